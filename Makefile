# recgrid: `make demo` runs the local job, `make test` runs the tests. Both install on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# cpu or cuda: a machine whose nvidia-smi lists a GPU gets the CUDA builds of the same versions.
ACCEL  ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
TORCH_INDEX_URL ?=
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q
PYTEST_ARGS ?=

.PHONY: install test demo bench smoke clean
install: $(STAMP)

$(STAMP): requirements/torch-$(ACCEL).txt requirements/nodeps.txt requirements/lock.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "[install] torch + fbgemm ($(ACCEL)) ..."
	$(PIP) $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL)) -r requirements/torch-$(ACCEL).txt
	@echo "[install] torchrec (--no-deps) ..."
	$(PIP) --no-deps -r requirements/nodeps.txt
	@echo "[install] ray, mlflow and the rest (pinned) ..."
	$(PIP) -r requirements/lock.txt
	$(PIP) --no-deps -e .
	$(BIN)/python -c "import torch, fbgemm_gpu, torchrec, ray, mlflow; print('[install] ok: torch', torch.__version__, '| ray', ray.__version__, '| mlflow', mlflow.__version__)"
	@touch $@

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: install
	$(BIN)/recgrid train jobs/local_demo.yaml

smoke: install
	$(BIN)/recgrid smoke --world-size 4 --groups 2 --steps 20 --sync-every 5

# every committed bench/results/ file, in the order the calibration needs (both step_time runs first)
bench: install
	$(BIN)/python bench/step_time.py
	$(BIN)/python bench/step_time.py --global-batch 512 --m-sweep-only --out bench/results/step_time_b512.json
	$(BIN)/python bench/calibrate_cpu.py
	$(BIN)/python bench/data_pipeline.py
	$(BIN)/python bench/recovery.py
	$(BIN)/python bench/quality.py
	$(BIN)/python bench/towers.py

clean:
	rm -rf $(VENV) runs
