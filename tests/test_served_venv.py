"""Issue 47, acceptance 1, as a user serves a job's model: a registered model, served by `mlflow models
serve -m models:/NAME/VERSION --env-manager local` from a virtualenv that holds only the model's
requirements.txt (MLflow, torch, numpy and pandas: recgrid, Ray and TorchRec are checked absent),
answers a raw Criteo file's 200 rows POSTed as `dataframe_split` with `recgrid eval`'s click
probabilities (1e-6), and a malformed value with HTTP 400 naming its row and column; the same
rows through `mlflow.pyfunc.load_model(...).predict(df)` in that virtualenv.

The virtualenv is made with uv (`.venv/bin/uv`, requirements/tools.txt): the model's requirements
held to requirements/lock.txt's versions (the ones installed here, so uv's cache serves them), torch's
CPU build from PIP_FIND_LINKS where a machine has a wheel cache (as the Makefile's pip reads it),
else from PyTorch's CPU index (`--torch-backend cpu`); everything else from PyPI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from recgrid.launch.local import free_port
from test_served_model import QR, client_frame, eval_probabilities, random_model, raw_rows

ROOT = Path(__file__).resolve().parents[1]
UV = Path(sys.executable).parent / "uv"
SERVE_TIMEOUT_S = 600  # a fresh virtualenv's first imports compile MLflow's and torch's bytecode
IN_VENV = """
import importlib.util, json, sys
import mlflow.pyfunc, pandas as pd
absent = [m for m in ("recgrid", "ray", "torchrec", "fbgemm_gpu") if importlib.util.find_spec(m) is not None]
df = pd.read_csv(sys.argv[2], sep="\\t", header=None, dtype={i: str for i in range(14, 40)}).drop(columns=[0])
df.columns = [*(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
got = mlflow.pyfunc.load_model(sys.argv[1]).predict(df)
print(json.dumps({"importable": absent, "columns": list(got.columns), "p": got["probability"].tolist()}))
"""


def install_args() -> list[str]:
    """Where torch's CPU build comes from: a wheel cache (PIP_FIND_LINKS) or PyTorch's CPU index."""
    links = [p for p in os.environ.get("PIP_FIND_LINKS", "").split() if p]
    if any(n.startswith("torch-") for p in links if os.path.isdir(p) for n in os.listdir(p)):
        return [a for p in links for a in ("--find-links", p)]
    return ["--torch-backend", "cpu"]


def post(port: int, body: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def up(server: subprocess.Popen, port: int, log: Path, t0: float) -> bool:
    """Wait for `mlflow models serve` to answer /ping: True once it does, False if it exited because
    its port was taken meanwhile (the caller tries another); any other exit or a timeout fails."""
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5):
                return True
        except (urllib.error.URLError, ConnectionError, OSError):
            if server.poll() is not None:
                text = log.read_text()
                assert "address already in use" in text, text[-3000:]
                return False
            assert time.perf_counter() - t0 < SERVE_TIMEOUT_S, "the server did not come up"
            time.sleep(0.5)


def test_a_registered_model_served_without_recgrid_answers_raw_rows_as_recgrid_eval(tmp_path, monkeypatch):
    import mlflow

    from recgrid.launch.model import model_files
    from recgrid.tracking import Tracker
    from recgrid.launch.unshard import model_spec

    t0 = time.perf_counter()
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    model = random_model(["model.arch=dcn", *QR, "model.qr_operation=mult"])
    tracker = Tracker(experiment="served", tracking_uri=store).start("served")
    with tempfile.TemporaryDirectory() as staging:
        info = tracker.log_model(model_files(model, staging), step=1, register_as="ctr")
    tracker.finish()
    artifacts = [tmp_path / "mlartifacts", *(tmp_path / "mlartifacts").rglob("*")]  # the model, this user's only
    assert any(p.name == "weights.pt" for p in artifacts)
    assert all(p.stat().st_mode & 0o777 == (0o700 if p.is_dir() else 0o600) for p in artifacts)
    uri = f"models:/ctr/{info.registered_model_version}"
    data = raw_rows(tmp_path / "raw", model_spec(model))
    want = eval_probabilities(uri, data, tmp_path / "p.txt")  # `recgrid eval models:/ctr/1 --predictions`
    mlflow.set_tracking_uri(store)
    requirements = Path(mlflow.artifacts.download_artifacts(f"{uri}/requirements.txt", dst_path=str(tmp_path)))
    assert sorted(line.split("==")[0] for line in requirements.read_text().split()) == \
        ["mlflow", "numpy", "pandas", "torch"]

    venv, t1 = tmp_path / "venv", time.perf_counter()
    subprocess.run([str(UV), "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    subprocess.run([str(UV), "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "-r", str(requirements),
                    "-c", str(ROOT / "requirements" / "lock.txt"), *install_args()], check=True)
    built = time.perf_counter() - t1
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path)),
           "MLFLOW_TRACKING_URI": store, "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
    alone = subprocess.run([str(venv / "bin" / "python"), "-c", IN_VENV, uri, data], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=SERVE_TIMEOUT_S)
    assert alone.returncode == 0, alone.stderr[-3000:]
    got = json.loads(alone.stdout.strip().splitlines()[-1])
    assert got["importable"] == [] and got["columns"] == ["probability"], got
    assert np.abs(np.array(got["p"]) - want).max() <= 1e-6

    t2 = time.perf_counter()
    for _ in range(3):  # a free port can be taken by another test's process before the server binds it
        port = free_port()
        server = subprocess.Popen([str(venv / "bin" / "mlflow"), "models", "serve", "-m", uri, "--env-manager",
                                   "local", "--host", "127.0.0.1", "-p", str(port)], env=env, cwd=tmp_path,
                                  start_new_session=True, stdout=open(tmp_path / "serve.log", "w"),
                                  stderr=subprocess.STDOUT)
        if up(server, port, tmp_path / "serve.log", t2):
            break
        server.wait(timeout=60)
    else:
        log = (tmp_path / "serve.log").read_text()
        raise AssertionError(f"the server found no free port in three tries: {log[-3000:]}")
    try:
        started = time.perf_counter() - t2
        df = client_frame(data)
        status, body = post(port, '{"dataframe_split": ' + df.to_json(orient="split", index=False) + "}")
        assert status == 200, body
        served = np.array([row["probability"] for row in body["predictions"]])
        assert len(served) == 200 and np.abs(served - want).max() <= 1e-6
        bad = df.astype({"C9": object})
        bad.loc[37, "C9"] = "not-hex"
        status, body = post(port, '{"dataframe_split": ' + bad.to_json(orient="split", index=False) + "}")
        assert status == 400 and body["error_code"] == "INVALID_PARAMETER_VALUE", (status, body)
        assert "row 37, column C9: 'not-hex' is not a hexadecimal id of 1 to 16 digits" in body["message"], body
        assert "stack_trace" not in body
    finally:
        try:
            os.killpg(server.pid, 15)
        except ProcessLookupError:  # it exited already: its log says why, in the error above
            pass
        server.wait(timeout=60)
    print(f"served-model acceptance: virtualenv {built:.1f} s, server up in {started:.1f} s, "
          f"all {time.perf_counter() - t0:.1f} s")
