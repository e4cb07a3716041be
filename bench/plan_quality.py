"""Plan quality: the job's `model.sharding: auto` (recgrid's planner, priced for the device the job
runs on) against every fixed sharding type, measured (issue 31, acceptance 1).

The demo's shape (jobs/local_demo.yaml: T = 4, K = 5, 400 steps of 256 rows per worker) with
failures off (train.max_failures=0, train.snapshot_every_syncs=0,
train.checkpoint_every=0), at each M of --groups, for `auto` and each fixed type of --types. Jobs
run one after another and alternate: round r runs every type once, in an order rotated by r, so a
shared machine's slow drifts spread over all types. Each job's figure is its median QPS over the
logging intervals (`train/qps_median`, the job summary's); the load average at its start is kept
beside it. Per M: each type's median over its jobs, the best fixed type, and `auto` over it (the
acceptance: >= 0.97 at every M). Also what each job ran (its recorded plan's types by count).

Writes JSON (default bench/results/plan_quality.json) with the configuration, the machine and the
figures. On a shared machine timings move with the neighbours' load: read `loadavg_at_start`.

    .venv/bin/python bench/plan_quality.py                              # the acceptance run
    .venv/bin/python bench/plan_quality.py --steps 60 --jobs 1 --types table_wise --out /tmp/pq.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXED_TYPES = ("table_wise", "column_wise", "row_wise", "table_column_wise")
FAILURES_OFF = ("train.max_failures=0", "train.snapshot_every_syncs=0",
                "train.checkpoint_every=0")
BAR = 0.97  # auto's median QPS over the best fixed type's, at every M


def rounds(types: list[str], jobs: int) -> list[list[str]]:
    """`jobs` rounds of every type once, round r rotated by r (alternating, not one type's jobs in a row)."""
    return [types[r % len(types):] + types[:r % len(types)] for r in range(jobs)]


def summarize(runs: list[dict], groups: list[int], types: list[str]) -> dict:
    """Per M: each type's median QPS over its finished jobs, the best fixed type, auto's ratio to it."""
    out = {}
    for m in groups:
        medians = {}
        for t in types:
            qps = [r["qps"] for r in runs if r["M"] == m and r["sharding"] == t and r["qps"] is not None]
            medians[t] = statistics.median(qps) if qps else None
        fixed = {t: q for t, q in medians.items() if t != "auto" and q is not None}
        best = max(fixed, key=fixed.get) if fixed else None
        ratio = medians.get("auto") / fixed[best] if best and medians.get("auto") else None
        out[str(m)] = {"median_qps": medians, "best_fixed": best, "auto_over_best_fixed": ratio,
                       "meets_bar": None if ratio is None else ratio >= BAR}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "jobs/local_demo.yaml"))
    ap.add_argument("--groups", default="1,2", help="group counts M (default 1,2)")
    ap.add_argument("--types", default=",".join(FIXED_TYPES), help="fixed sharding types to compare auto with")
    ap.add_argument("--jobs", type=int, default=2, help="jobs per (M, type) (default 2)")
    ap.add_argument("--steps", type=int, default=400, help="train.max_steps (default 400, the demo's)")
    ap.add_argument("--set", action="append", default=[], help="another job config override")
    ap.add_argument("--out", default=str(REPO / "bench/results/plan_quality.json"))
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "platform"))
    from recgrid.config import load_config
    from recgrid.launch.compare import ran_sharding
    from recgrid.launch.ray import run_job
    from recgrid.launch.report import machine_info, say, write_result
    from mlflow.tracking import MlflowClient

    groups = [int(x) for x in a.groups.split(",")]
    types = ["auto", *[t for t in a.types.split(",") if t]]
    if a.jobs < 1 or a.steps < 1:
        raise SystemExit(f"--jobs and --steps must be >= 1, got {a.jobs} and {a.steps}")
    tmp = Path(tempfile.mkdtemp(prefix="recgrid-plan-quality-"))
    uri = f"sqlite:///{tmp}/mlflow.db"
    base = [*FAILURES_OFF, f"train.max_steps={a.steps}", f"train.storage_path={tmp}/ray",
            f"tracking.tracking_uri={uri}", "tracking.experiment=bench-plan-quality", *a.set]
    configuration = {"config": str(Path(a.config).relative_to(REPO) if Path(a.config).is_absolute() else a.config),
                     "overrides": base[:len(FAILURES_OFF) + 1] + a.set, "groups": groups, "types": types,
                     "jobs_per_type": a.jobs, "order": "alternating: round r runs every type once, rotated by r",
                     "figure": "median QPS over logging intervals (train/qps_median)", "bar": BAR}
    result = {"benchmark": "plan_quality", "machine": machine_info(), "configuration": configuration, "runs": []}
    client = MlflowClient(uri)
    for m in groups:
        for r, order in enumerate(rounds(types, a.jobs)):
            for t in order:
                cfg = load_config(a.config, [*base, f"grid.num_groups={m}", f"model.sharding={t}",
                                             f"tracking.run_name=M{m}-{t}-{r}"])
                load = os.getloadavg()
                t0 = time.perf_counter()
                job = run_job(cfg, summary=False)
                run = {"M": m, "sharding": t, "round": r, "status": job.status, "error": job.error or "",
                       "qps": job.metrics.get("train/qps_median"), "ran": ran_sharding(client, job.run_id),
                       "loadavg_at_start": [round(x, 2) for x in load], "wall_s": round(time.perf_counter() - t0, 1)}
                result["runs"].append(run)
                say(f"plan_quality: M={m} {t} round {r}: {job.status}, QPS {run['qps']}, ran {run['ran']}, "
                    f"load {run['loadavg_at_start'][0]}")
                result["summary"] = summarize(result["runs"], groups, types)
                write_result(a.out, result)  # after every job: a stopped bench keeps what it measured
    for m, s in result["summary"].items():
        say(f"plan_quality: M={m}: auto {s['median_qps'].get('auto')}, best fixed {s['best_fixed']} "
            f"{s['median_qps'].get(s['best_fixed'])}, auto / best = {s['auto_over_best_fixed']}")
    return 0 if all(s["meets_bar"] for s in result["summary"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
