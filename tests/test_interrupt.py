"""Ctrl-C (issue 17, acceptance 3) and SIGTERM (issue 50: what `kill`, a pod's deletion or a job
scheduler sends) on `recgrid train`, on a machine whose Ray temp directory names a local cluster
that died.

One subprocess: `recgrid train` with a stale `ray_current_cluster` file in its Ray temp
directory (a dead address) still starts its own local cluster and trains; SIGTERM mid-job stops
the workers at their next sync step, they write a checkpoint there (the job has checkpoints), the
final evaluation is skipped, the MLflow run ends KILLED saying the step and the signal, no process
of the job is left, and the command exits 128 + the signal's number (143) within 30 s. Its
console has neither ANSI codes nor Ray's bookkeeping. Ctrl-C (SIGINT) reaches the same handler: a
job interrupted by it before training ends KILLED, tagged with SIGINT, and exits 130.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
K = 5
PROGRESS = re.compile(r"^\[recgrid\] step +(\d+)/")


def _job_processes(marker: str) -> list[int]:
    """Pids of the processes whose environment holds `marker` (the job's own RAY_TMPDIR): the
    driver, Ray's local cluster and every worker it started inherit it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def _train(tmp_path: Path, ray_tmp: str, overrides: list[str]) -> subprocess.Popen:
    """`recgrid train` of the demo config with `overrides`, in a session of its own, with Ray's temp
    directory `ray_tmp` (the job's processes carry it: `_job_processes`) and no RAY_ADDRESS."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, RECGRID_RUNS_DIR=str(tmp_path / "runs"))
    return subprocess.Popen([sys.executable, "-m", "recgrid.cli", "train", str(REPO / "jobs/local_demo.yaml"),
                             *sum((["--set", o] for o in overrides), [])],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


# SIGTERM here; SIGINT takes the same handler (launch.ray.Interrupts), and its own exit code and tag are
# checked below on a job interrupted before training, without training a job for it
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_stops_at_a_sync_step_with_a_stale_ray_cluster_file(tmp_path, sig):
    from mlflow.tracking import MlflowClient

    # Ray's temp directory, short (its sockets live there) and the job's own: the stale file
    # must not reach other Ray sessions on the machine
    ray_tmp = tempfile.mkdtemp(prefix="rgint", dir="/tmp")
    (Path(ray_tmp) / "ray").mkdir()
    (Path(ray_tmp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")  # nothing listens there
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    overrides = [
        f"data.train={tmp_path}/data/train/*.parquet", f"data.eval={tmp_path}/data/eval/*.parquet",
        "data.synth_rows=8000", "data.synth_eval_rows=1000",
        "grid.world_size=2", "grid.num_groups=2", f"grid.sync_every={K}",
        "train.max_steps=5000", "train.batch_size=64", "train.log_every=3", "train.eval_every=0",
        "train.cpus_per_worker=0.25", "train.checkpoint_every=100", f"train.storage_path={tmp_path}/ray_storage",
        f"tracking.tracking_uri={uri}", "tracking.experiment=test-interrupt",
    ]
    proc = _train(tmp_path, ray_tmp, overrides)
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = PROGRESS.match(lines[-1])
            if m and int(m.group(1)) >= 2 * K:
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not started.wait(1) and proc.poll() is None and time.monotonic() < deadline:
            pass
        assert started.is_set(), f"training never showed progress (exit {proc.poll()}):\n" + "\n".join(lines)
        seen = max(int(m.group(1)) for m in map(PROGRESS.match, lines) if m)
        t0 = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
        reader.join(5)
        out = "\n".join(lines)
        assert code == 128 + sig, out  # the shell's code for a command the signal ended: 130, 143
        assert took < 30
        # the job's processes: driver, raylet, GCS, workers, all gone within a few seconds of its exit
        deadline = time.monotonic() + 10
        while _job_processes(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _job_processes(ray_tmp) == [], out

        run = MlflowClient(tracking_uri=uri).search_runs(
            [MlflowClient(tracking_uri=uri).get_experiment_by_name("test-interrupt").experiment_id])[0]
        assert run.info.status == "KILLED"
        m = re.match(rf"interrupted at step (\d+) \({sig.name}\)", run.data.tags["interrupted"])
        assert m, run.data.tags
        step = int(m.group(1))
        assert step >= seen and step % K == 0  # at the next sync step
        assert f"checkpoint at step {step} written" in out
        assert any((tmp_path / "ray_storage").rglob(f"checkpoint_step_{step:08d}/.metadata"))
        assert "eval at step" not in out  # the final evaluation was skipped
        # the console: recgrid's lines, unprefixed, nothing of Ray's own, no colour codes
        assert "\x1b" not in out
        for noise in ("TrainController", "PreemptionWatcher", "RayTrainWorker", "pid=", "Token authentication",
                      "PYTHON worker processes have been started"):
            assert noise not in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _job_processes(ray_tmp):  # what this test started and left, if it failed
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_ctrl_c_before_training_ends_the_run_killed_and_exits_130(tmp_path):
    """SIGINT once the job's local Ray cluster is up, before any worker trains: the run ends KILLED,
    tagged "interrupted before training (SIGINT)", the command exits 130 and leaves no process."""
    from mlflow.tracking import MlflowClient

    ray_tmp = tempfile.mkdtemp(prefix="rgint", dir="/tmp")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    overrides = [f"data.train={tmp_path}/data/train/*.parquet", "data.eval=[]", "data.synth_rows=2000",
                 "grid.world_size=2", "grid.num_groups=2", "train.max_steps=5000", "train.batch_size=64",
                 "train.cpus_per_worker=0.25", f"tracking.tracking_uri={uri}", "tracking.experiment=test-ctrl-c"]
    proc = _train(tmp_path, ray_tmp, overrides)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "started a local Ray cluster" in line:
                proc.send_signal(signal.SIGINT)
                break
        lines += proc.stdout.read().splitlines()
        code = proc.wait(timeout=60)
        out = "\n".join(lines)
        assert code == 130, out
        run = MlflowClient(tracking_uri=uri).search_runs(
            [MlflowClient(tracking_uri=uri).get_experiment_by_name("test-ctrl-c").experiment_id])[0]
        assert run.info.status == "KILLED"
        assert run.data.tags["interrupted"].startswith("interrupted before training (SIGINT)"), run.data.tags
        deadline = time.monotonic() + 10
        while _job_processes(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _job_processes(ray_tmp) == [], out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _job_processes(ray_tmp):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
