"""Calibrate the CPU form of the planner's cost model on this machine, then check it against
bench/step_time.py's measured step times.

The constants come from microbenchmarks only, never from the step-time runs they predict:

  collectives   gloo all-to-all and reduce-scatter inside sharding groups of n and all-reduce inside
                groups of n,
                on T local processes with every group of the grid busy at once (as in training).
                Bandwidth: the slope over message sizes. Latency: measured "under load", each
                rank doing a chunk of single-core compute before every collective (the chunk is
                the measured per-step compute below divided by the collectives a step runs), because
                with T processes on fewer cores a collective also waits for descheduled peers
  lookup        FBGEMM's fused CPU kernel (forward + backward with its row-wise AdaGrad), the
                tiny spec's 26 tables, one process, one thread; fitted over batch sizes, and
                expressed as the bandwidth that makes TorchRec's estimator give that time
  dense         the tiny DLRM's dense part (bottom MLP, dot interaction, top MLP, Adagrad step),
                one process, one thread; fitted over batch sizes
  overhead      a one-worker (T = 1) sharded training step minus its measured kernel and dense
                time: TorchRec's per-step bookkeeping, which no collective or kernel explains
  contention    the one-worker step run in T independent processes at once, over it alone:
                how much slower each worker computes when T share this machine's cores

The collective latencies under training load: the microbenchmark's chunks of compute between
collectives are far shorter than a real step's, and on an oversubscribed machine a collective
waits for peers that are descheduled mid-step, so the microbenchmark latencies leave ~10 ms of a
T = 4 step unexplained. When step-time runs at ANOTHER batch size are given
(`--calibration-runs`, default bench/results/step_time_b512.json: bench/step_time.py at a global
batch of 512, 128 per worker), the latencies are taken from them instead: each run's measured
step minus the model's compute and bandwidth terms is what its collectives cost, solved for the
three unknowns the three runs pin down (at T = 4: the dense all-reduce over 4 from M = 4, where
L = 1 has no all-to-all; then the all-to-all over L = 2 from M = 2 and over L = 4 from M = 1).
Both predictions are written: with the microbenchmark latencies, and with the run latencies.

Then the planner's CPU form (`recgrid.plan.estimators.CpuCost`) predicts the step time for M in
{1, 2, 4} at T = 4 and compares it
with bench/results/step_time.json (run bench/step_time.py first, on the same machine: the
default global batch of 1024, which the calibration runs never saw). Writes
bench/results/calibrate_cpu.json: the profile the cost model loads, the raw microbenchmarks, the
predictions and their errors.

    .venv/bin/python bench/step_time.py
    .venv/bin/python bench/step_time.py --global-batch 512 --m-sweep-only --out bench/results/step_time_b512.json
    .venv/bin/python bench/calibrate_cpu.py [--world-size 4] [--step-time bench/results/step_time.json]

Timings on a shared 2-core machine are noisy; re-run on a quiet one for figures worth quoting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from recgrid.data.specs import NUM_DENSE, get_spec
from recgrid.launch.local import run_local
from recgrid.launch.report import machine_info, write_result

A2A_BYTES = (1 << 8, 1 << 12, 1 << 16, 1 << 18, 1 << 20)  # per rank, all peers together
ALLREDUCE_BYTES = (1 << 8, 1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
LOOKUP_BATCHES = (256, 512, 1024)
DENSE_BATCHES = (128, 256, 512)
REPS = 25
STEP_SECONDS = 3.0  # how long a one-worker trainer steps for


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def _median_time(fn, reps: int = REPS, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ---- collectives: T processes, every group of the grid at once -----------------------------------
def busy(iters: int) -> None:
    """Single-core compute that holds the GIL-free CPU like a kernel does."""
    a = torch.rand(64, 64)
    for _ in range(iters):
        a = a @ a
        a = a / (a.norm() + 1)


def busy_iters_for(seconds: float) -> int:
    """How many `busy` iterations take `seconds` on one core, alone."""
    busy(20)
    t0 = time.perf_counter()
    busy(200)
    per = (time.perf_counter() - t0) / 200
    return max(1, round(seconds / per))


def _loop_time(fn, reps: int = 40, warmup: int = 3) -> float:
    """Wall seconds per call over a loop: unlike a per-call median, it counts the time this
    process waits for a core while other processes run."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def collectives_worker(world_size: int, chunk_iters: int) -> dict:
    from recgrid.engine.grid import Grid

    rank = dist.get_rank()
    out: dict = {"all_to_all": {}, "all_reduce": {}, "reduce_scatter": {}, "chunk_iters": chunk_iters}
    # the compute chunk alone (the other ranks wait in a barrier), then all ranks at once
    if rank == 0:
        out["chunk_alone_s"] = min(_loop_time(lambda: busy(chunk_iters)) for _ in range(2))
    dist.barrier()
    for n in [d for d in range(2, world_size + 1) if world_size % d == 0]:
        # a2a inside sharding groups of L = n (M = T / n groups), all-reduce inside replica groups of n
        shard_groups = Grid(world_size, world_size // n).sharding_groups
        replica_groups = Grid(world_size, n).replica_groups
        # reduce-scatter inside sharding groups too: a row-wise shard's pooled output goes that way
        for kind, groups, sizes in (("all_to_all", shard_groups, A2A_BYTES),
                                    ("all_reduce", replica_groups, ALLREDUCE_BYTES),
                                    ("reduce_scatter", shard_groups, A2A_BYTES)):
            pgs = [dist.new_group(g, backend="gloo") for g in groups]  # every rank creates every group
            pg = next(p for p, g in zip(pgs, groups) if rank in g)

            def collective(x: torch.Tensor, y: torch.Tensor) -> None:
                if kind == "all_to_all":
                    dist.all_to_all_single(y, x, group=pg)
                elif kind == "reduce_scatter":
                    dist.reduce_scatter_tensor(y[:len(x) // n], x, group=pg)
                else:
                    dist.all_reduce(x, group=pg)

            times = []
            for nbytes in sizes:
                x = torch.rand(max(n, nbytes // 4 // n * n))
                y = torch.empty_like(x)
                dist.barrier()
                times.append(_median_time(lambda: collective(x, y)))
            # under load: compute chunk, then a small collective; minus the chunk alone (same load)
            x = torch.rand(max(n, A2A_BYTES[0] // 4 // n * n))
            y = torch.empty_like(x)
            loaded = {}
            for with_comm in (False, True, False, True):
                dist.barrier()
                t = _loop_time(lambda: (busy(chunk_iters), collective(x, y) if with_comm else None))
                loaded[with_comm] = min(loaded.get(with_comm, t), t)
            out[kind][n] = {"bytes": [max(n, b // 4 // n * n) * 4 for b in sizes], "seconds": times,
                            "loaded_step_s": loaded[True], "loaded_compute_s": loaded[False],
                            "loaded_latency_s": max(0.0, loaded[True] - loaded[False])}
    return out


# ---- the fused lookup kernel, one thread ----------------------------------------------------------
def lookup_kernel_times(spec_name: str, dim: int) -> dict:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen,
    )

    spec = get_spec(spec_name)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(r, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in spec.table_rows],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05, eps=1e-8,
        pooling_mode=PoolingMode.SUM, device=torch.device("cpu"),
    )
    rows = torch.tensor(spec.table_rows, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    out = {"batches": list(LOOKUP_BATCHES), "seconds": []}
    for b in LOOKUP_BATCHES:
        # the ids bench/step_time.py feeds (recgrid.launch.smoke.random_batches): skewed to low ids
        u = torch.rand(len(rows), b, generator=g, dtype=torch.float64)
        ids = (rows.unsqueeze(1) * u.pow(3)).long().clamp_max((rows - 1).long().unsqueeze(1)).flatten()
        offsets = torch.arange(0, len(rows) * b + 1, dtype=torch.long)

        def step() -> None:
            pooled = tbe(ids, offsets)
            pooled.backward(torch.ones_like(pooled))

        out["seconds"].append(_median_time(step))
    return out


# ---- the dense part, one thread ----------------------------------------------------------------------
def dense_times(spec_name: str) -> dict:
    from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

    from recgrid.engine.model import ModelSpec

    spec = get_spec(spec_name)
    ms = ModelSpec()
    dim = ms.resolved_dim(spec)
    n = len(spec.table_rows)
    dense = DenseArch(NUM_DENSE, list(ms.resolved_dense_arch(spec)))
    inter = InteractionArch(num_sparse_features=n)
    over = OverArch(dim + n * (n + 1) // 2, list(ms.over_arch))
    params = [*dense.parameters(), *over.parameters()]
    opt = torch.optim.Adagrad(params, lr=0.01)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    out = {"batches": list(DENSE_BATCHES), "seconds": [],
           "params": sum(p.numel() for p in params)}
    for b in DENSE_BATCHES:
        x = torch.rand(b, NUM_DENSE)
        pooled = torch.rand(b, n, dim, requires_grad=True)
        labels = (torch.rand(b) < 0.25).float()

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            logits = over(inter(dense(x), pooled)).squeeze(-1)
            loss_fn(logits, labels).backward()
            opt.step()

        out["seconds"].append(_median_time(step))
    return out


# ---- one worker's sharded step: the framework's own cost ----------------------------------------------
def one_worker_step(spec_name: str, batch: int, sharding: str, start_at: float, duration: float) -> float:
    """Seconds per training step of a one-worker (T = 1) trainer: steps run from wall-clock
    `start_at` for `duration` seconds (so that runs in several processes overlap exactly)."""
    from recgrid.engine.grid import Grid
    from recgrid.engine.model import ModelSpec
    from recgrid.launch.smoke import random_batches
    from recgrid.config import defaults
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    spec = get_spec(spec_name)
    config = EngineConfig.from_job(defaults(), spec=spec, model=ModelSpec(), sharding=sharding, lr=0.05)
    trainer = Trainer.build(Grid(1, 1), config, torch.device("cpu"))
    batches = [b for b, _ in zip(random_batches(spec, batch, seed=0), range(16))]
    for i in range(5):
        trainer.train_step(batches[i % len(batches)])
    time.sleep(max(0.0, start_at - time.time()))
    t0, steps = time.perf_counter(), 0
    while time.perf_counter() - t0 < duration:
        trainer.train_step(batches[steps % len(batches)])
        steps += 1
    seconds = (time.perf_counter() - t0) / steps
    trainer.close()
    return seconds


def in_process(fn, *args):
    """Run `fn` in one fresh gloo process with one thread (as each training worker has)."""
    return run_local(fn, 1, *args)[0]


def concurrently(n: int, fn, *args) -> list:
    """`fn` in n independent one-process runs at the same time (no collective between them)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: in_process(fn, *args), range(n)))


# ---- the profile and the check ---------------------------------------------------------------------------
def build_profile(world_size: int, batch: int, spec_name: str, sharding: str) -> dict:
    from recgrid.engine.model import ModelSpec
    from recgrid.plan.estimators import A2A_PER_SHARDING_TYPE

    dim = ModelSpec().resolved_dim(get_spec(spec_name))
    print("[calibrate] fused lookup kernel, dense part, one-worker step (one process, one thread) ...",
          file=sys.stderr, flush=True)
    lookup = in_process(lookup_kernel_times, spec_name, dim)
    dense = in_process(dense_times, spec_name)
    step1 = in_process(one_worker_step, spec_name, batch, sharding, time.time(), STEP_SECONDS)
    # the same one-worker step in T independent processes at once: how much slower a worker's
    # compute runs when T workers share this machine's cores (no collective involved)
    print(f"[calibrate] {world_size} one-worker trainers at once ...", file=sys.stderr, flush=True)
    start_at = time.time() + 20.0 + 5.0 * world_size  # after every process has started and built
    step1_shared = statistics.median(
        concurrently(world_size, one_worker_step, spec_name, batch, sharding, start_at, STEP_SECONDS))

    profile: dict = {"cores": os.cpu_count() or 1}
    # The kernel: measured t(b) = c0 + c1 b; TorchRec's estimator says F(b) / bandwidth with F
    # linear in b, so bandwidth = dF/db / c1.
    c0, c1 = _fit(lookup["batches"], lookup["seconds"])
    f_slope = _torchrec_lookup_bytes_slope(spec_name, dim)
    profile["lookup_bandwidth"] = f_slope / c1
    profile["lookup_call_overhead"] = max(c0, 0.0)
    d0, d1 = _fit(dense["batches"], dense["seconds"])
    profile["dense_seconds_per_sample"] = d1
    profile["dense_call_overhead"] = max(d0, 0.0)
    kernel_b = c0 + c1 * batch
    dense_b = d0 + d1 * batch
    profile["sharded_step_overhead"] = max(0.0, step1 - kernel_b - dense_b)

    # A step's single-core compute, shared out over the collectives it runs (the all-to-alls of one
    # sharding type and the dense all-reduce): the compute a rank does before each collective.
    collectives = A2A_PER_SHARDING_TYPE + 1
    chunk_s = (kernel_b + dense_b + profile["sharded_step_overhead"]) / collectives
    chunk_iters = in_process(busy_iters_for, chunk_s)
    print(f"[calibrate] collectives on {world_size} gloo processes (load chunk {chunk_s * 1e3:.2f} ms) ...",
          file=sys.stderr, flush=True)
    coll = run_local(collectives_worker, world_size, world_size, chunk_iters)[0]
    # How much slower a worker computes when all T compute at once (its share of the cores, and
    # whatever else the machine runs): T one-worker steps at once over one alone.
    profile["world_size"] = world_size
    profile["compute_slowdown"] = step1_shared / step1
    for kind, lat, bw in (("all_to_all", "a2a_latency", "a2a_bandwidth"),
                          ("all_reduce", "allreduce_latency", "allreduce_bandwidth"),
                          ("reduce_scatter", "reduce_scatter_latency", "reduce_scatter_bandwidth")):
        profile[lat], profile[bw] = {}, {}
        for n, m in coll[kind].items():
            _, slope = _fit(m["bytes"], m["seconds"])
            profile[lat][str(n)] = m["loaded_latency_s"]
            profile[bw][str(n)] = 1.0 / slope if slope > 0 else float("inf")
    measured = {"collectives": coll, "load_chunk_s": chunk_s, "lookup_kernel": lookup, "dense": dense,
                "one_worker_step_s": step1, "one_worker_step_shared_s": step1_shared, "one_worker_batch": batch}
    return {"profile": profile, "microbenchmarks": measured}


def _torchrec_lookup_bytes_slope(spec_name: str, dim: int) -> float:
    """d(bytes)/d(batch) of TorchRec's lookup estimate for the tiny tables on one table-wise
    worker: plan with a 1 byte/s device so the estimate in seconds is the byte count."""
    from recgrid.plan.constants import CpuProfile
    from recgrid.plan.estimators import CpuCost
    from recgrid.plan.proposers import plan_group
    from recgrid.plan.tables import tables_from_spec

    unit = CpuProfile(cores=1, world_size=1, compute_slowdown=1.0, a2a_latency={2: 0.0}, a2a_bandwidth={2: 1e12},
                      allreduce_latency={2: 0.0}, allreduce_bandwidth={2: 1e12}, lookup_bandwidth=1.0, lookup_call_overhead=0.0,
                      dense_seconds_per_sample=0.0, dense_call_overhead=0.0, sharded_step_overhead=0.0)
    model = tables_from_spec(spec_name)
    lo, hi = LOOKUP_BATCHES[0], LOOKUP_BATCHES[-1]
    f = [max(plan_group(model, 1, 1, b, CpuCost(unit, 1), 0, ("table_wise",)).lookup_s) for b in (lo, hi)]
    return (f[1] - f[0]) / (hi - lo)


def _model_of(spec_name: str):
    from recgrid.data.specs import get_spec as spec_of
    from recgrid.engine.model import ModelSpec
    from recgrid.plan.tables import DenseSpec, ModelTables, tables_from_spec

    ms = ModelSpec()
    base = tables_from_spec(spec_name)
    return ModelTables(base.name, base.tables, DenseSpec(
        dense_features=NUM_DENSE, bottom_mlp=ms.resolved_dense_arch(spec_of(spec_name)),
        top_mlp=tuple(ms.over_arch), interaction="dot"))


def _candidates(profile, step_time: dict) -> list:
    """The cost model's candidate for every run of a step_time.py sweep, under `profile`."""
    from recgrid.plan.estimators import CpuCost
    from recgrid.plan.cluster import Cluster
    from recgrid.plan.rating import evaluate

    cfg = step_time["configuration"]
    T, sharding = cfg["world_size"], cfg["sharding"]
    cluster = Cluster(gpus=T, gpus_per_node=T, batch_per_gpu=cfg["global_batch"] // T, cost=CpuCost(profile, T))
    model = _model_of(cfg["spec"])
    return [evaluate(model, cluster, m["M"], m["K"], layout="host-local", sharding_types=(sharding,))
            for m in step_time["m_sweep"]]


def run_latencies(profile: dict, runs: dict) -> dict:
    """Collective latencies under training load from step-time runs (see the module docstring):
    each run's measured median step (a step without a replica sync) minus what the model
    predicts for it with zero latencies is what its collectives' latencies add."""
    from dataclasses import replace

    from recgrid.plan.constants import CpuProfile
    from recgrid.plan.estimators import A2A_PER_SHARDING_TYPE

    T = runs["configuration"]["world_size"]
    if runs["configuration"]["world_size"] != profile["world_size"]:
        raise SystemExit(f"calibration runs at T={T}, microbenchmarks at T={profile['world_size']}: use the same T")
    base = CpuProfile.from_dict(profile)
    zero = replace(base, a2a_latency={n: 0.0 for n in base.a2a_latency},
                   allreduce_latency={n: 0.0 for n in base.allreduce_latency})
    residual, types = {}, {}
    for m, c in zip(runs["m_sweep"], _candidates(zero, runs)):
        predicted = c.step_s - c.sync_s if m["K"] > 1 else c.step_s
        residual[m["M"]] = m["step_time_median_s"] - predicted
        types[m["M"]] = len(c.sharding)
    if not {1, T} <= set(residual):
        raise SystemExit(f"calibration runs need M=1 and M={T} (got M in {sorted(residual)})")
    allreduce = max(0.0, residual[T])  # M = T: L = 1, no all-to-all; the dense all-reduce over T alone
    a2a = {str(T // M): max(0.0, (residual[M] - allreduce) / (A2A_PER_SHARDING_TYPE * types[M]))
           for M in residual if M < T}
    return {"a2a_latency": a2a, "allreduce_latency": {**{str(n): v for n, v in base.allreduce_latency.items()},
                                                      str(T): allreduce},
            "residual_s": {str(M): round(r, 6) for M, r in residual.items()}}


def predict(raw_profile: dict, step_time: dict) -> dict:
    """The cost model's step time under `raw_profile` (its JSON form) against each measured run."""
    from recgrid.plan.constants import CpuProfile

    cfg = step_time["configuration"]
    T = cfg["world_size"]
    profile = CpuProfile.from_dict(raw_profile)
    rows = []
    for m, c in zip(step_time["m_sweep"], _candidates(profile, step_time)):
        # the measured median step is a step without a sync when K > 1 (K - 1 of K steps have none)
        predicted = c.step_s - c.sync_s if m["K"] > 1 else c.step_s
        measured = m["step_time_median_s"]
        rows.append({
            "M": m["M"], "L": c.group_size, "K": m["K"],
            "predicted_step_s": round(predicted, 6), "measured_step_median_s": measured,
            "error": round(predicted / measured - 1, 4),
            "predicted_split_s": {k: round(v / 1e3, 6) for k, v in c.to_json()["time_ms"].items()},
            "measured_phases_s": m["phase_seconds_per_step_mean_over_workers"],
            "predicted_sync_per_sync_s": round(c.sync_per_sync_s, 6),
            "measured_sync_per_sync_s": m["sync_seconds_per_sync"],
        })
    return {"world_size": T, "rows": rows, "max_abs_error": max(abs(r["error"]) for r in rows),
            "within_30_percent": all(abs(r["error"]) <= 0.30 for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=256, help="per-worker batch (step_time.py: 1024 / T)")
    ap.add_argument("--spec", default="tiny")
    ap.add_argument("--sharding", default="table_wise")
    ap.add_argument("--step-time", default="bench/results/step_time.json")
    ap.add_argument("--out", default="bench/results/calibrate_cpu.json")
    ap.add_argument("--calibration-runs", default="bench/results/step_time_b512.json",
                    help="step_time.py runs at another batch, for the collective latencies under training load "
                         "(missing: the microbenchmark latencies are used)")
    ap.add_argument("--skip-measure", action="store_true", help="reuse the microbenchmarks in --out; only calibrate and predict")
    a = ap.parse_args()
    out = Path(a.out)
    if a.skip_measure:
        result = json.loads(out.read_text())
        result["profile"] = result.get("microbenchmark_profile", result["profile"])
    else:
        result = build_profile(a.world_size, a.batch_size, a.spec, a.sharding)
        result.update(benchmark="calibrate_cpu", machine=machine_info(),
                      configuration={"world_size": a.world_size, "batch_size": a.batch_size, "spec": a.spec,
                                     "sharding": a.sharding, "threads_per_worker": 1, "reps": REPS})
    result["microbenchmark_profile"] = dict(result["profile"])
    runs_path = Path(a.calibration_runs)
    if runs_path.is_file():
        runs = json.loads(runs_path.read_text())
        lat = run_latencies(result["profile"], runs)
        result["profile"] = {**result["profile"], "a2a_latency": lat["a2a_latency"],
                             "allreduce_latency": lat["allreduce_latency"]}
        result["latencies"] = {"source": f"{runs_path} (global batch {runs['configuration']['global_batch']})",
                               "residual_s": lat["residual_s"]}
    else:
        result["latencies"] = {"source": f"microbenchmarks ({runs_path} not found)"}
    write_result(out, result)  # the profile is kept even if the check below fails
    step_path = Path(a.step_time)
    if step_path.is_file():
        step_time = json.loads(step_path.read_text())
        if runs_path.is_file() and step_time["configuration"]["global_batch"] == runs["configuration"]["global_batch"]:
            raise SystemExit(f"{step_path} and {runs_path} ran the same batch: the check must use runs the "
                             f"calibration never saw")
        result["check"] = predict(result["profile"], step_time)
        result["check"]["step_time_file"] = str(step_path)
        result["check_microbenchmark_latencies"] = predict(result["microbenchmark_profile"], step_time)
    else:
        result["check"] = {"skipped": f"{step_path} not found; run bench/step_time.py first"}
    write_result(out, result)
    print(json.dumps({"profile": result["profile"], "latencies": result["latencies"], "check": result["check"],
                      "check_microbenchmark_latencies": result.get("check_microbenchmark_latencies")}, indent=2))


if __name__ == "__main__":
    main()
