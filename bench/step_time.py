"""Step time, QPS and replica-sync cost of the 2-D engine on T local gloo workers.

Sweeps M in {1, 2, 4} at T = 4 with the same global batch, and K in {1, 5, 25} at M = 2.
Writes bench/results/step_time.json (configuration, machine, figures) and prints it.

    .venv/bin/python bench/step_time.py [--steps 200] [--global-batch 1024] [--m-sweep-only] [--out PATH]

bench/calibrate_cpu.py takes its collective latencies from a run of this at another batch
(`--global-batch 512 --m-sweep-only --out bench/results/step_time_b512.json`) and checks the
cost model against the default one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from recgrid.engine.grid import Grid
from recgrid.launch.local import run_local
from recgrid.launch.report import machine_info, write_result
from recgrid.engine.model import ModelSpec
from recgrid.launch.smoke import random_batches
from recgrid.data.specs import get_spec


def bench_worker(grid: Grid, sync_every: int, steps: int, warmup: int, batch_size: int, spec_name: str,
                 sharding: str) -> dict:
    from recgrid.config import defaults
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    spec = get_spec(spec_name)
    config = EngineConfig.from_job(defaults(), spec=spec, model=ModelSpec(), sync_every=sync_every, sharding=sharding, lr=0.05)  # c = M
    state = Trainer.build(grid, config, torch.device("cpu"))
    # batches made up front so data generation is not in the step time
    pool = [b for b, _ in zip(random_batches(spec, batch_size, seed=dist.get_rank()), range(32))]
    state.run(itertools.cycle(pool), warmup)
    syncs_before = (state.replica_sync.stats.count, state.replica_sync.stats.seconds, state.replica_sync.stats.bytes)
    result = state.run(itertools.cycle(pool), warmup + steps)
    s = state.replica_sync.stats
    state.replica_sync.close()
    return {
        "step_seconds": result.step_seconds,
        "phase_seconds": result.phase_seconds,
        "syncs": s.count - syncs_before[0],
        "sync_seconds": s.seconds - syncs_before[1],
        "sync_bytes": s.bytes - syncs_before[2],
    }


def measure(T: int, M: int, K: int, steps: int, warmup: int, global_batch: int, spec: str, sharding: str) -> dict:
    grid = Grid(T, M)
    t0 = time.perf_counter()
    per_rank = run_local(bench_worker, T, grid, K, steps, warmup, global_batch // T, spec, sharding)
    # the job moves at the pace of its slowest worker, step by step
    step_s = [max(r["step_seconds"][i] for r in per_rank) for i in range(steps)]
    median = statistics.median(step_s)
    syncs = per_rank[0]["syncs"]
    sync_s = max(r["sync_seconds"] for r in per_rank)
    phases = {p: round(statistics.mean(r["phase_seconds"][p] for r in per_rank) / steps, 6)
              for p in per_rank[0]["phase_seconds"]}
    out = {
        "T": T, "M": M, "L": T // M, "K": K, "global_batch": global_batch, "steps": steps,
        "step_time_median_s": round(median, 6),
        "step_time_p90_s": round(sorted(step_s)[int(0.9 * (len(step_s) - 1))], 6),
        "qps": round(global_batch / median, 1),
        "syncs": syncs,
        "sync_seconds_total": round(sync_s, 6),
        "sync_seconds_per_sync": round(sync_s / syncs, 6) if syncs else 0.0,
        "sync_bytes_per_sync_per_worker": per_rank[0]["sync_bytes"] // syncs if syncs else 0,
        "sync_seconds_per_step": round(sync_s / steps, 6),
        "phase_seconds_per_step_mean_over_workers": phases,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200, help="measured steps per configuration (K sweep: 2x)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--spec", default="tiny")
    ap.add_argument("--sharding", default="table_wise")
    ap.add_argument("--sync-every", type=int, default=5, help="K used in the M sweep")
    ap.add_argument("--out", default="bench/results/step_time.json")
    ap.add_argument("--m-sweep-only", action="store_true", help="skip the K sweep (calibration runs)")
    a = ap.parse_args()
    T = a.world_size
    m_sweep = [measure(T, M, a.sync_every, a.steps, a.warmup, a.global_batch, a.spec, a.sharding)
               for M in (1, 2, 4) if T % M == 0]
    k_sweep = [] if a.m_sweep_only else \
        [measure(T, 2, K, 2 * a.steps, a.warmup, a.global_batch, a.spec, a.sharding) for K in (1, 5, 25)]
    result = {
        "benchmark": "step_time",
        "configuration": {"world_size": T, "global_batch": a.global_batch, "spec": a.spec, "sharding": a.sharding,
                          "model": "dlrm", "m_sweep_sync_every": a.sync_every, "steps": a.steps, "warmup": a.warmup,
                          "backend": "gloo", "device": "cpu", "threads_per_worker": 1,
                          "note": "step time = the slowest worker's compute + sync per step; QPS = global batch / median"},
        "machine": machine_info(),
        "m_sweep": m_sweep,
        "k_sweep": k_sweep,
    }
    write_result(a.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
