"""What the default storage checkpoint cadence costs a job: the demo job (jobs/local_demo.yaml)
run with train.checkpoint_every left null (the derived cadence: a tenth of the job, a multiple
of K) and with train.checkpoint_every=0 (none), each on recgrid's own local Ray cluster.

For each run: the job's wall seconds, the workers' seconds in the `checkpoint` phase (the sum of
the run's `time/checkpoint_s` over its logging intervals: mean over workers; and of
`time/checkpoint_s_max`: the slowest worker's), their share of the summed interval wall time, the
checkpoints written and the bytes of the newest one. Timings on a shared machine are noisy.

Writes bench/results/checkpoint_cost.json and prints it.

    .venv/bin/python bench/checkpoint_cost.py [--set key=value ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(tmp: Path, name: str, overrides: list[str]) -> dict:
    from mlflow.tracking import MlflowClient

    from recgrid.config import load_config
    from recgrid.launch.ray import run_job
    from recgrid.launch.report import say

    uri = f"sqlite:///{tmp}/mlflow.db"
    cfg = load_config(REPO / "jobs/local_demo.yaml", [
        f"train.storage_path={tmp}/storage-{name}", f"tracking.tracking_uri={uri}",
        "tracking.experiment=bench-checkpoint-cost", f"tracking.run_name={name}", *overrides])
    t0 = time.perf_counter()
    result = run_job(cfg, summary=False)
    wall = time.perf_counter() - t0
    if result.status != "FINISHED":
        raise SystemExit(f"{name}: {result.status}: {result.error}")
    client = MlflowClient(uri)

    def total(metric: str) -> float:
        return sum(m.value for m in client.get_metric_history(result.run_id, metric))

    checkpoints = sorted(p for p in (tmp / f"storage-{name}").rglob("checkpoint_step_*") if p.is_dir())
    newest = checkpoints[-1] if checkpoints else None
    out = {
        "checkpoint_every": cfg.checkpoint_every,
        "checkpoints_written": cfg.train.max_steps // cfg.checkpoint_every if cfg.checkpoint_every else 0,
        "checkpoints_kept": [p.name for p in checkpoints],
        "newest_checkpoint_bytes": sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) if newest else 0,
        "job_wall_s": round(wall, 2),
        "checkpoint_s_mean_over_workers": round(total("time/checkpoint_s"), 3),
        "checkpoint_s_slowest_worker": round(total("time/checkpoint_s_max"), 3),
        "interval_wall_s": round(total("time/interval_s"), 2),
        "train_qps_median": result.metrics.get("train/qps_median"),
    }
    out["checkpoint_share_of_training"] = round(out["checkpoint_s_slowest_worker"] / out["interval_wall_s"], 4)
    say(f"{name}: {json.dumps(out)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], help="a job config override, as recgrid train's")
    parser.add_argument("--out", default=str(REPO / "bench/results/checkpoint_cost.json"))
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="recgrid-ckpt-cost-"))
    try:
        os.environ["RECGRID_RUNS_DIR"] = str(tmp / "runs")
        # the first job pays the local cluster's start: the run without checkpoints goes first
        runs = {"none": run(tmp, "none", [*args.set, "train.checkpoint_every=0"]), "derived": run(tmp, "derived", args.set)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"config": "jobs/local_demo.yaml", "overrides": args.set, "machine": platform.node(),
              "cpus": os.cpu_count(), "note": "shared machine: timings are noisy", "runs": runs,
              "order": list(runs),
              "job_wall_s_difference": round(runs["derived"]["job_wall_s"] - runs["none"]["job_wall_s"], 2),
              "interval_wall_s_difference": round(runs["derived"]["interval_wall_s"] - runs["none"]["interval_wall_s"], 2)}
    from recgrid.launch.report import write_result

    path = write_result(args.out, result)
    print(json.dumps(result, indent=1))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
