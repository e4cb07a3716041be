"""`recgrid simulate`: what happens at 1024 or 4096 GPUs. For each GPU count T, full model
parallelism (one sharding group of all T workers, TorchRec's ordinary DMP) against 2-D
sparse parallelism with sharding groups of a fixed size L (M = T / L copies): QPS, the
scaling factor, peak memory per GPU, out-of-memory.

Both strategies are priced by the planner's cost model (`planner.evaluate`), so the
simulation is exactly `recgrid plan` at each T, restricted to M = 1 and M = T / L. The
scaling factor is the paper's Table 2 metric: the QPS speed-up over the first (smallest) GPU
count, divided by the GPU-count multiplier; 1.0 is linear scaling.

A strategy is one entry of STRATEGIES: a name and a function that prices it at one GPU count
(`price(model, cluster, group_size, sync_every) -> Candidate`). Another way of training (DMT's
towers, say) is one more entry there; the rows, the scaling factor, the table and the JSON follow.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from recgrid.plan.constants import GB
from recgrid.plan.planner import (
    DEFAULT_SYNC_EVERY, QPS_TOLERANCE, Candidate, Cluster, PlanError, evaluate, gpu_cost, parse_int_list,
)
from recgrid.plan.tables import ModelTables, TablesError, resolve_model



@dataclass(frozen=True)
class SimRow:
    gpus: int
    strategy: str
    candidate: Candidate
    scaling_factor: float | None

    @property
    def oom(self) -> bool:
        return not self.candidate.feasible

    def to_json(self) -> dict:
        c = self.candidate
        gb = lambda b: round(b / GB, 3)  # noqa: E731
        return {
            "gpus": self.gpus, "strategy": self.strategy, "num_groups": c.num_groups,
            "qps": None if self.oom else round(c.qps, 1),
            "scaling_factor": None if self.scaling_factor is None else round(self.scaling_factor, 4),
            "peak_memory_gb": gb(c.peak_bytes), "oom": self.oom,
            "sync_every": c.sync_every, "layout": c.layout,
            "memory_gb": {"tables": gb(c.tables_bytes), "optimizer": gb(c.optimizer_bytes),
                          "lookup_activations": gb(c.activation_bytes), "dense": gb(c.dense_bytes)},
        }


def _best_k(model: ModelTables, cluster: Cluster, M: int, sync_every: Sequence[int]) -> Candidate:
    """The planner's K rule for a fixed M: the smallest K within QPS_TOLERANCE of the best."""
    options = [evaluate(model, cluster, M, K) for K in ((1,) if M == 1 else sync_every)]
    top = max(c.qps for c in options)
    return min((c for c in options if c.qps >= (1 - QPS_TOLERANCE) * top), key=lambda c: c.sync_every)


Price = Callable[[ModelTables, Cluster, int, Sequence[int]], Candidate]


def model_parallel(model: ModelTables, cluster: Cluster, group_size: int, sync_every: Sequence[int]) -> Candidate:
    """TorchRec's ordinary full model parallelism: one sharding group of all T workers."""
    return _best_k(model, cluster, 1, sync_every)


def two_d(model: ModelTables, cluster: Cluster, group_size: int, sync_every: Sequence[int]) -> Candidate:
    """2-D sparse parallelism: M = T / L sharding groups of `group_size`, the planner's K and layout."""
    return _best_k(model, cluster, cluster.gpus // group_size, sync_every)


# The strategies a simulation compares, in row order: name -> how to price it at one GPU count.
STRATEGIES: dict[str, Price] = {"model_parallel": model_parallel, "2d": two_d}


def simulate(model: ModelTables, gpus: Sequence[int], group_size: int, batch_per_gpu: int, gpus_per_node: int,
             cost_for, sync_every: Sequence[int] = DEFAULT_SYNC_EVERY, progress=None) -> list[SimRow]:
    """Rows for every T in `gpus` and both strategies. `cost_for(T)` gives the hardware cost form."""
    if not gpus:
        raise PlanError("--gpus needs at least one GPU count")
    for T in gpus:
        if T < group_size or T % group_size:
            raise PlanError(f"--gpus {T} is not a multiple of --sharding-group-size L={group_size}: 2-D needs "
                            f"T = M x L")
    rows: list[SimRow] = []
    base: dict[str, tuple[int, float] | None] = {}
    for T in sorted(gpus):
        t0 = time.perf_counter()
        cluster = Cluster(gpus=T, gpus_per_node=gpus_per_node, batch_per_gpu=batch_per_gpu, cost=cost_for(T))
        for strategy, price in STRATEGIES.items():
            c = price(model, cluster, group_size, sync_every)
            if strategy not in base:
                base[strategy] = (T, c.qps) if c.feasible else None
            ref = base[strategy]
            factor = None
            if ref is not None and c.feasible:
                factor = (c.qps / ref[1]) / (T / ref[0])
            rows.append(SimRow(T, strategy, c, factor))
        if progress:
            progress(f"T={T:<5} priced in {time.perf_counter() - t0:.1f}s")
    return rows


def format_rows(rows: Sequence[SimRow], model: ModelTables, group_size: int, batch: int) -> str:
    lines = [
        f"{model.name}: {len(model.tables)} tables, {model.total_bytes / 1e12:.3g} TB fp32 | batch {batch} per GPU | "
        f"2-D sharding groups of L={group_size}",
        "",
        f"{'GPUs':>6}  {'strategy':<15} {'M':>4} {'K':>3} {'layout':<10} {'step ms':>8} {'QPS M/s':>9} {'scaling':>8} "
        f"{'tables':>7} {'optim':>6} {'activ':>6} {'dense':>6} {'peak GB':>8}  {'OOM':<3}",
    ]
    for r in rows:
        c = r.candidate
        qps = "-" if r.oom else f"{c.qps / 1e6:.3f}"
        sf = "-" if r.scaling_factor is None else f"{r.scaling_factor:.3f}"
        lines.append(f"{r.gpus:>6}  {r.strategy:<15} {c.num_groups:>4} {c.sync_every:>3} {c.layout:<10} "
                     f"{c.step_s * 1e3:>8.2f} {qps:>9} {sf:>8} {c.tables_bytes / GB:>7.2f} {c.optimizer_bytes / GB:>6.2f} "
                     f"{c.activation_bytes / GB:>6.2f} {c.dense_bytes / GB:>6.2f} {c.peak_bytes / GB:>8.2f}  "
                     f"{'OOM' if r.oom else 'no'}")
    lines += ["", "scaling: QPS speed-up over the smallest GPU count / the GPU-count multiplier (1.0 = linear); "
                  "K: the planner's sync interval for that M; memory (GB): the fullest GPU's tables, optimizer state, "
                  "lookup activations (TorchRec's input and output estimates) and dense part."]
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    try:
        model = resolve_model(args.spec, args.tables)
        gpus = parse_int_list(args.gpus, "--gpus")
        ks = parse_int_list(args.sync_every, "--sync-every")
        L = args.sharding_group_size
        if isinstance(L, bool) or not isinstance(L, int) or L < 1:
            raise PlanError(f"--sharding-group-size must be a positive integer, got {L!r}")
        cost = gpu_cost(args)
        if not args.json:
            print(f"[simulate] pricing {len(gpus)} GPU counts x 2 strategies with TorchRec's planner ...",
                  file=sys.stderr, flush=True)
        progress = None if args.json else (lambda m: print(f"[simulate] {m}", file=sys.stderr, flush=True))
        rows = simulate(model, gpus, L, args.batch_per_gpu, args.gpus_per_node, lambda T: cost, ks, progress)
    except (PlanError, TablesError) as e:
        print(f"recgrid simulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps([r.to_json() for r in rows]) if args.json else format_rows(rows, model, L, args.batch_per_gpu))
    return 0
