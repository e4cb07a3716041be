# recgrid: `make demo` runs the local job, `make test` runs the tests. Both install on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# cpu or cuda: a machine whose nvidia-smi lists a GPU gets the CUDA builds of the same versions.
ACCEL  ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# PyTorch's wheel index for this ACCEL: the torch step reads it alone (no second index)
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/$(if $(filter cuda,$(ACCEL)),cu128,cpu)
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q --no-compile
# uv (requirements/tools.txt, installed by pip) for the PyPI steps: parallel downloads and unpacking
UV     := $(BIN)/uv pip install -q --python $(BIN)/python
# every file whose pins carry hashes installs in hash-checking mode: a file that changed on an index
# (or a dependency nobody pinned) fails the install. torch-cuda.txt has none yet (requirements/README.md).
HASHES  = $(if $(shell grep -l -- '--hash=sha256:' $(1) 2>/dev/null),--require-hashes)
PYTEST_ARGS ?=

.PHONY: install tools lint test demo bench smoke clean lock python
install: $(STAMP)

# the pinned wheels are Python 3.11's (pyproject.toml's requires-python), for Linux x86-64: refuse another
# before anything is installed. Checked every time (order-only below): the venv's python when there is
# one, and PYTHON too when there is none or it was given.
PYTHON_GIVEN = $(filter-out file,$(origin PYTHON))
python:
	@[ "$$(uname -sm)" = "Linux x86_64" ] || { echo "recgrid installs on Linux x86-64 only (its pinned wheels are built for it); this is $$(uname -sm)"; exit 1; }
	@for py in $(if $(wildcard $(BIN)/python),$(BIN)/python) $(if $(or $(PYTHON_GIVEN),$(if $(wildcard $(BIN)/python),,x)),$(PYTHON)); do \
		v=$$($$py -c 'import sys; print("Python %d.%d" % sys.version_info[:2])' 2>/dev/null || echo "no Python that runs"); \
		[ "$$v" = "Python 3.11" ] && continue; \
		if [ "$$py" = $(BIN)/python ]; then echo "$(VENV) was made with $$v, and recgrid needs Python 3.11: remove it (make clean) and run make PYTHON=<your python3.11> install"; \
		else echo "recgrid needs Python 3.11, and $$py is $$v: run make PYTHON=<your python3.11> $(or $(MAKECMDGOALS),install)"; fi; exit 1; \
	done

$(STAMP): requirements/tools.txt requirements/torch-$(ACCEL).txt requirements/nodeps.txt requirements/lock.txt requirements/fbgemm-cpu.txt requirements/gpu-tools.txt pyproject.toml | python
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --require-hashes --no-deps -r requirements/tools.txt
	@echo "[install] torch ($(ACCEL), from $(TORCH_INDEX_URL)) ..."
	$(PIP) $(call HASHES,requirements/torch-$(ACCEL).txt) $(if $(filter cpu,$(ACCEL)),--no-deps) --index-url $(TORCH_INDEX_URL) -r requirements/torch-$(ACCEL).txt
	@echo "[install] fbgemm, torchrec (--no-deps) ..."
	$(UV) --require-hashes --no-deps -r requirements/nodeps.txt $(if $(filter cpu,$(ACCEL)),-r requirements/fbgemm-cpu.txt,-r requirements/gpu-tools.txt)
	@echo "[install] ray, mlflow and the rest (the whole closure pinned, hash-checked; pip check below proves it complete) ..."
	$(UV) --require-hashes --no-deps -r requirements/lock.txt
	$(PIP) --no-deps --no-build-isolation -e .
	@echo "[install] bytecode (every core) ..."
	@# but files named for a newer Python than 3.11, which it cannot compile (torch/testing/_internal/py312_intrinsics.py)
	$(BIN)/python -m compileall -q -j 0 -x '/py31[2-9]_[^/]*\.py$$' $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null
	@# every installed distribution's requirements are met (but torchrec's fbgemm-gpu: fbgemm-gpu-cpu on CPU)
	! $(BIN)/python -m pip check | grep -v -e '^torchrec [^ ]* requires fbgemm-gpu, which is not installed' -e '^No broken requirements'
	$(BIN)/python -c "import torch, fbgemm_gpu, torchrec, ray, mlflow; print('[install] ok: torch', torch.__version__, '| ray', ray.__version__, '| mlflow', mlflow.__version__)"
	@touch $@

# rewrite the hashes of requirements/*.txt from the indexes (after editing a version there)
lock: install
	$(BIN)/python requirements/lock.py

# recgrid's own bytecode, brought up to date first (incremental): every Ray worker, actor and spawned
# process imports the package, and with PYTHONDONTWRITEBYTECODE set no process writes it
BYTECODE = $(BIN)/python -m compileall -q -j 0 platform tests >/dev/null

# the suite's tools besides Python: Prometheus and promtool (tests/test_dashboard.py), Debian's
# `prometheus` package, installed where missing when apt-get can (as root, or through sudo without a
# password). Without them those tests skip, but under CI=true they fail (tests/conftest.py).
SUDO = $(if $(filter 0,$(shell id -u)),,sudo -n)
tools:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then :; \
	elif command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then \
		echo "[install] prometheus and promtool (Debian's prometheus package, for tests/test_dashboard.py) ..."; \
		$(SUDO) apt-get update -qq >/dev/null && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	else echo "[install] no prometheus here and no apt-get to install it with: the Prometheus tests skip (they fail under CI=true)"; fi

# ruff (requirements/tools.txt; its rules in pyproject.toml), in a fraction of a second: no cache written
lint: install
	$(BIN)/ruff check --no-cache --quiet --output-format concise platform tests bench requirements

# two pytest-xdist workers: the modules that start Ray on one, the rest beside them (tests/conftest.py)
test: install tools lint
	$(BYTECODE)
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

demo: install
	$(BYTECODE)
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
	$(BIN)/python bench/node_loss.py
	$(BIN)/python bench/quality.py
	$(BIN)/python bench/towers.py
	$(BIN)/python bench/compression.py
	$(BIN)/python bench/simulate.py
	$(BIN)/python bench/plan_quality.py
	$(BIN)/python bench/peer.py
	$(BIN)/python bench/checkpoint_cost.py
	$(BIN)/python bench/srp.py

clean:
	rm -rf $(VENV) runs
