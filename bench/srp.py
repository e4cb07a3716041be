"""Sparse Row-wise Parallelism against TorchRec's dense row-wise exchange: bytes and step time.

For each sharding group size L (one sharding group of L local gloo workers, M = 1) and each
spec (one-hot "tiny", multi-hot "tiny+multihot"), the same batches train with
`model.row_wise_exchange` dense (TorchRec's reduce-scatter) and sparse (SRP, engine.srp), every
table row-wise. Recorded per configuration: `exchange/bytes/row_wise` (bytes a worker sends its
peers per step in the forward output exchange, as the job logs it), its ratio to dense, the
expected ratio for uniform ids (`engine.srp.expected_exchange_bytes`; synth's ids are power-law,
so the measured occupancy is lower for multi-hot bags), the median step time and the largest
loss difference between the two exchanges (they must agree).

`measure(...)` returns the figures (bench/compression.py calls it); the CLI writes them as JSON:

    .venv/bin/python bench/srp.py [--steps 30] [--batch-size 256] [--worlds 2,4] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECS = ("tiny", "tiny+multihot")


def _run_pair(spec_name: str, steps: int, batch: int, seed: int) -> dict:
    """On every worker of one sharding group: dense, then sparse, on the same batches; rank 0's
    figures (the exchange figures are means over the workers, the step time the slowest's)."""
    import torch
    import torch.distributed as dist

    from recgrid.config import defaults
    from recgrid.data.specs import get_spec
    from recgrid.data.stream import synthetic_batches
    from recgrid.engine.grid import Grid
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    spec = get_spec(spec_name)
    T, rank = dist.get_world_size(), dist.get_rank()
    batches = synthetic_batches(spec, batch, steps, seed=seed, stream=rank)
    out = {}
    for exchange in ("dense", "sparse"):
        config = EngineConfig.from_job(defaults(), spec=spec, sharding="row_wise", row_wise_exchange=exchange,
                                       lr=0.05, seed=seed)
        trainer = Trainer.build(Grid(T, 1), config, torch.device("cpu"))
        result = trainer.run(iter(batches), steps)
        metrics = trainer.exchange.metrics(trainer.groups.global_pg)
        times = torch.tensor(result.step_seconds[2:] or result.step_seconds, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest worker
        trainer.replica_sync.close()
        out[exchange] = {"bytes_per_step": metrics.get("exchange/bytes/row_wise", 0.0),
                         "step_time_median_s": statistics.median(times.tolist()),
                         "losses": list(result.losses)}
    return out


def measure(worlds: tuple[int, ...] = (2, 4), specs: tuple[str, ...] = SPECS, steps: int = 30,
            batch_size: int = 256, seed: int = 0, timeout_s: float = 1800) -> list[dict]:
    """SRP against dense row-wise for every (L, spec): one row per pair with bytes per step of
    each, SRP's share of dense measured and expected for uniform ids, median step times, and the
    largest loss difference."""
    from recgrid.data.specs import get_spec
    from recgrid.engine.srp import expected_exchange_bytes
    from recgrid.launch.local import run_local

    rows = []
    for L in worlds:
        for name in specs:
            spec = get_spec(name)
            r = run_local(_run_pair, L, name, steps, batch_size, seed, timeout_s=timeout_s)[0]
            d, s = r["dense"], r["sparse"]
            dims = [spec.embedding_dim] * len(spec.table_rows)
            sizes = list(spec.multi_hot_sizes or (1,) * len(dims))
            expected = (expected_exchange_bytes(batch_size, dims, sizes, L, sparse=True)
                        / expected_exchange_bytes(batch_size, dims, sizes, L, sparse=False))
            rows.append({
                "L": L, "spec": name, "multi_hot": spec.multi_hot,
                "dense_bytes_per_step": d["bytes_per_step"], "sparse_bytes_per_step": s["bytes_per_step"],
                "sparse_over_dense": s["bytes_per_step"] / d["bytes_per_step"] if d["bytes_per_step"] else None,
                "expected_sparse_over_dense_uniform_ids": expected,
                "dense_step_time_median_s": d["step_time_median_s"],
                "sparse_step_time_median_s": s["step_time_median_s"],
                "max_loss_diff": max(abs(a - b) for a, b in zip(d["losses"], s["losses"])),
            })
            print(f"[srp] L={L} {name}: bytes {rows[-1]['sparse_over_dense']:.3f}x of dense "
                  f"(uniform ids: {expected:.3f}), step {s['step_time_median_s'] * 1e3:.1f} ms sparse vs "
                  f"{d['step_time_median_s'] * 1e3:.1f} ms dense", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    from recgrid.launch.report import machine_info, write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="training steps per run")
    ap.add_argument("--batch-size", type=int, default=256, help="rows per worker per step")
    ap.add_argument("--worlds", default="2,4", help="sharding group sizes L")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "srp.json"))
    a = ap.parse_args()
    worlds = tuple(int(w) for w in a.worlds.split(","))
    t0 = time.perf_counter()
    result = {
        "benchmark": "srp",
        "configuration": {"worlds": list(worlds), "num_groups": 1, "specs": list(SPECS), "sharding": "row_wise",
                          "steps": a.steps, "batch_per_worker": a.batch_size, "seed": a.seed,
                          "data": "synthetic_batches (synth's power-law ids)", "backend": "gloo", "device": "cpu",
                          "note": "bytes: exchange/bytes/row_wise, per worker per step (forward; backward sends as "
                                  "many back); step time: median over steps of the slowest worker's, on a shared "
                                  "2-core machine (noisy: compare the two exchanges, not absolute values)"},
        "machine": machine_info(),
    }
    result["rows"] = measure(worlds, SPECS, a.steps, a.batch_size, a.seed)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    write_result(a.out, result)
    print(f"{'L':>2} {'spec':<14} {'dense B/step':>13} {'sparse B/step':>13} {'ratio':>6} {'uniform':>7} "
          f"{'dense ms':>9} {'sparse ms':>9}")
    for r in result["rows"]:
        print(f"{r['L']:>2} {r['spec']:<14} {r['dense_bytes_per_step']:13.0f} {r['sparse_bytes_per_step']:13.0f} "
              f"{r['sparse_over_dense']:6.3f} {r['expected_sparse_over_dense_uniform_ids']:7.3f} "
              f"{r['dense_step_time_median_s'] * 1e3:9.1f} {r['sparse_step_time_median_s'] * 1e3:9.1f}")


if __name__ == "__main__":
    main()
