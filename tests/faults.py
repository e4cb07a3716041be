"""Helpers for the fault-tolerance tests: a small job config, a job run in the background
with its actors (job control, recovery coordinator) in reach, and the row-id audit of what a job trained."""

from __future__ import annotations

import collections
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from recgrid.config import load_config

REPO = Path(__file__).resolve().parents[1]


def small_job(tmp: Path, name: str, *overrides: str):
    """T=4, M=2, K=5 on synthetic parquet data (40k rows: one epoch is 156 steps), row ids logged."""
    data = tmp.parent / "data"  # every job of a test module reads the same generated rows
    return load_config(REPO / "jobs/local_demo.yaml", [
        f"data.train={data}/train/*.parquet", f"data.eval={data}/eval/*.parquet",
        "data.synth_rows=40000", "data.synth_eval_rows=8000", f"data.row_log={tmp}/rows",
        "grid.world_size=4", "grid.num_groups=2", "grid.sync_every=5",
        "train.max_steps=80", "train.batch_size=64", "train.log_every=10", "train.eval_every=0",
        f"train.storage_path={tmp}/storage", f"tracking.tracking_uri=sqlite:///{tmp.parent}/mlflow.db",
        f"tracking.experiment={name}", "tracking.log_model=false", *overrides,  # a model: test_launcher's M=2 job
    ])


class BackgroundJob:
    """`run_job(config)` in a thread; `status()` reads the job's actors (`launch.ray.JobActors`)."""

    def __init__(self, config: Any) -> None:
        from recgrid.launch.ray import run_job

        self.actors = None
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(run_job, config), daemon=True)
        self.thread.start()

    def _run(self, run_job: Callable, config: Any) -> None:
        self.result = run_job(config, on_start=lambda actors: setattr(self, "actors", actors))

    def status(self) -> dict | None:
        if self.actors is None:
            return None
        try:
            return self.actors.status(timeout=10)
        except Exception:  # noqa: BLE001 - the job may be between states
            return None

    def request_stop(self) -> None:
        import ray

        ray.get(self.actors.control.request_stop.remote())

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float = 300) -> dict:
        """Poll until `predicate(status)` holds (the job must still be running)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            st = self.status()
            if st is not None and predicate(st):
                return st
            if not self.thread.is_alive():
                raise AssertionError(f"the job ended while waiting: {self.result}")
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting; last status: {self.status()}")

    def join(self, timeout: float = 600) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the job did not finish"
        return self.result


CHAOS_SEED_ENV = "RECGRID_CHAOS_SEED"


def chaos_seed() -> int:
    """The seed a chaos test draws whom and when to kill from: `RECGRID_CHAOS_SEED` when set (to
    replay a failing run), else a new one. Printed either way (pytest shows it with a failure's
    captured output), and the chaos tests name it in their failure messages."""
    value = os.environ.get(CHAOS_SEED_ENV)
    seed = int(value) if value else random.randrange(1 << 30)
    print(f"chaos kill seed {seed} (replay: {CHAOS_SEED_ENV}={seed})", file=sys.stderr, flush=True)
    return seed


def training(st: dict, attempt: int, past_step: int = 0) -> bool:
    """Attempt `attempt` has all its workers registered and has trained past `past_step`."""
    return (len(st["attempts"]) > attempt and len(st["attempts"][attempt]["workers"]) == st["attempts"][attempt]["world_size"]
            and st["last_step"] > past_step)


def row_log_step(directory: Path, attempt: int, rank: int) -> int:
    """The newest step rank `rank` of attempt `attempt` finished, from its row log (0: none yet):
    read as the worker writes it, so a test can act at an exact step (the job's heartbeat lags by
    up to a second)."""
    from recgrid.train.rows import row_log_file

    try:
        with open(row_log_file(str(directory), attempt, rank), "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < 16:
                return 0
            f.seek(f.tell() - 16)
            return int(np.frombuffer(f.read(16), dtype=np.int64)[0])
    except FileNotFoundError:
        return 0


def row_audit(directory: Path) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """What a job trained, from its row log: step -> row ids that the newest attempt of each rank
    trained at the step (the timeline that survived; a rank's attempts are in order, whether Ray
    restarted every worker or one sharding group's), and attempt -> rows it trained that a later
    attempt trained again (the work a restore rolled back)."""
    from recgrid.train.rows import read_row_logs

    logs = read_row_logs(str(directory))
    final: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
    for (attempt, rank), arr in sorted(logs.items()):
        for step in np.unique(arr[:, 0]):
            final[(int(step), rank)] = (attempt, arr[arr[:, 0] == step, 1])
    by_step: dict[int, list[np.ndarray]] = collections.defaultdict(list)
    for (step, _), (_, ids) in final.items():
        by_step[step].append(ids)
    redone: dict[int, int] = collections.defaultdict(int)
    for (attempt, rank), arr in logs.items():
        redone[attempt] += int(sum(final[(int(s), rank)][0] != attempt for s in arr[:, 0]))
    return {s: np.sort(np.concatenate(parts)) for s, parts in by_step.items()}, dict(redone)


def workers_of(st: dict) -> dict[int, dict]:
    """Global rank -> the record of its newest process, over every attempt of a job's status."""
    return {r: w for a in st["attempts"] for r, w in a["workers"].items()}


def part_positions(config: Any, workers: int, rank: int, logs: dict) -> tuple[list[int], np.ndarray]:
    """Where each batch rank `rank` logged (`read_row_logs`, its attempts in order) sits in its part
    of the first epoch of the job's plan for `workers` workers, and the step each was logged under."""
    from recgrid.data.stream import scan_inputs
    from recgrid.data.units import DataCursor, EpochPlan, take_rows

    inputs = scan_inputs(config.data.train, config.dataset_spec())
    B = config.train.batch_size
    seg = EpochPlan(inputs, config.train.seed, B, config.data.rows_per_unit).segment(DataCursor(), workers)
    first_row = np.cumsum([0, *inputs.rows])
    expected = [np.sort(np.concatenate([first_row[u.file] + np.arange(u.start, u.end)
                                        for u in take_rows(seg.parts[rank], k * B, B)])).tobytes()
                for k in range(seg.steps_total)]
    rows = np.concatenate([logs[k] for k in sorted(logs) if k[1] == rank])
    return [expected.index(np.sort(b).tobytes()) for b in rows[:, 1].reshape(-1, B)], rows[::B, 0]


def read_again_from(positions: list[int], step: int, rank: int) -> int | None:
    """Check a rank's `part_positions` around a storage restore of `step`: in order up to the
    loss, then again from `step` on, in order. Returns the index of the first batch read again
    (None: lost right after committing the checkpoint's step, nothing read again)."""
    again = next((i for i in range(1, len(positions)) if positions[i] <= positions[i - 1]), None)
    if again is None:
        assert positions == list(range(len(positions))), rank
        return None
    assert positions[:again] == list(range(again)), rank  # in order up to the loss
    assert positions[again:] == list(range(step, step + len(positions) - again)), rank  # from the checkpoint on
    return again


def planned_rows(config: Any, workers: int, steps: int) -> dict[int, np.ndarray]:
    """Step -> the sorted row ids the job's epoch plan gives `workers` workers at steps 1..`steps`
    of its first epoch, from the start (what a job that never failed, or lost nothing, trains)."""
    from recgrid.data.stream import scan_inputs
    from recgrid.data.units import DataCursor, EpochPlan, take_rows

    inputs = scan_inputs([str(Path(p).absolute()) for p in config.data.train], config.dataset_spec())
    plan = EpochPlan(inputs, config.train.seed, config.train.batch_size, config.data.rows_per_unit)
    segment = plan.segment(DataCursor(), workers)
    assert segment.steps_total >= steps, "the steps asked for run past the first epoch"
    offsets = np.cumsum((0,) + inputs.rows)
    B = config.train.batch_size
    return {s: np.sort(np.concatenate([np.arange(offsets[u.file] + u.start, offsets[u.file] + u.end)
                                       for part in segment.parts for u in take_rows(part, (s - 1) * B, B)]))
            for s in range(1, steps + 1)}


def mlflow_client(config: Any):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=config.tracking.tracking_uri)


def ray_env() -> dict[str, str]:
    """Environment for the jobs' Ray workers: quiet, and quick to give up on a worker group that
    cannot start (an elastic job retries with fewer workers)."""
    return {"PYTHONWARNINGS": "ignore", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **TRAIN_SUITE_ENV}


# Ray Train's preemption watcher (an actor per worker group start, for nodes Ray drains: none here)
# costs every start a process and about 1 s; the suite tests no preemption where this is set. (The
# controller's poll interval is the platform's own: `launch.runs.RUN_ENV`.)
TRAIN_SUITE_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}

