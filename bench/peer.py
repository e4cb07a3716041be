"""The peer bench: a `recgrid train` job against the fastest plain loop of the same shape.

The same model (recgrid's tiny DLRM of jobs/local_demo.yaml), plan (the job's, table-wise), optimizers
(fused row-wise AdaGrad for the tables, the job's dense optimizer) and rows (each global rank's part of
the job's first epoch, read from the demo's parquet files into memory before timing), at T = 4 on gloo:

- `bare_dmp` (M = 1): TorchRec's `DistributedModelParallel` over all T processes, a plain loop
  (forward, backward, dense optimizer step);
- `bare_dmp_warm`: the same loop in processes where a recgrid `Trainer` of the same shape was built
  (and dropped) first: the issue's "a bare loop ran 12-15% faster after recgrid's trainer" check.
  What made it faster was the ranks meeting before they build: a `dist.barrier()` alone (or any
  `dist.new_group`, which holds one) gave the same 1.11-1.13x (2026-12-04, 3 alternating runs each;
  glibc's mmap threshold fixed by `mallopt` 1.05x, importing the trainer without building it 1.04x:
  within the runs' spread). Every bare loop here meets first, as recgrid's workers do when they build
  their process groups, so this variant now checks that the reference is the fast one (about 1.0x);
- `bare_2d` (M = 2, L = 2): a DMP per sharding group over TorchRec's 2-D env (`ShardingEnv2D`: the dense
  part data-parallel over all T by DDP, as TorchRec's `DMPCollection` builds it, which runs on CUDA only),
  and a plain process-group average of the tables and moments every K steps;
- `recgrid_m1`: `recgrid train` (a Ray job: every sharding group a Ray Train run), M = 1,
  `model.sharding=table_wise`, every mechanism off (`train.max_failures=0`, `train.checkpoint_every=0`,
  `train.eval_every=0`, no eval files);
- `recgrid_m2`: the demo's M = 2 with `train.max_failures=2` (snapshots and checkpoints at their
  derived cadence), also without evaluation.

Each loop's figure is the median over its logging intervals of 50 steps (the job's `train/qps_median`,
the same statistic), after a first interval of warm-up that is not counted. Variants alternate, `--reps`
rounds; the JSON has every run, the medians and the ratios recgrid / bare (`bench/results/peer.json`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
T, K, STEPS, LOG_EVERY, BATCH = 4, 5, 400, 50, 256
DEMO = REPO / "jobs" / "local_demo.yaml"


def _config(tmp: Path, extra: list[str]):
    from recgrid.config import load_config

    return load_config(DEMO, [f"grid.world_size={T}", f"grid.sync_every={K}", f"train.max_steps={STEPS}",
                              f"train.batch_size={BATCH}", f"train.log_every={LOG_EVERY}", "train.eval_every=0",
                              "data.eval=[]", f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db",
                              "tracking.experiment=bench-peer", "tracking.log_model=false", *extra])


def _interval_qps(step_ends: list[float], rows_per_step: int) -> float:
    """The median QPS over logging intervals of LOG_EVERY steps, the first one left out (warm-up)."""
    qps = [rows_per_step * LOG_EVERY / (step_ends[i + LOG_EVERY] - step_ends[i])
           for i in range(LOG_EVERY, len(step_ends) - LOG_EVERY, LOG_EVERY)]
    return statistics.median(qps)


def bare_probe(cfg, M: int, warm: bool) -> float:
    """One rank of a bare loop (module docstring); returns its median interval QPS (the job's rows)."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from recgrid.data.stream import local_batches, scan_inputs
    from recgrid.data.units import DataCursor, EpochPlan
    from recgrid.engine.grid import Grid
    from recgrid.engine.model import build_model
    from recgrid.engine.optimizer import dense_optimizer
    from recgrid.engine.sharding import shard_model
    from recgrid.engine.sync import embedding_kernels
    from recgrid.launch.ray import job_plan
    from recgrid.trainer_config import EngineConfig

    # the ranks meet before they build: without it the same loop ran 11-13% slower (module docstring)
    dist.barrier()
    rank = dist.get_rank()
    grid = Grid(T, M)
    engine = EngineConfig.from_job(cfg)
    if warm:  # what the issue saw: a recgrid Trainer built first in the same process
        from recgrid.train.trainer import Trainer

        Trainer.build(grid, engine, torch.device("cpu"), job_plan(cfg)).close()
    plan = EpochPlan(scan_inputs([str(Path(p).absolute()) for p in cfg.data.train], engine.spec), engine.seed,
                     BATCH, cfg.data.rows_per_unit)
    part = plan.segment(DataCursor(), T).part(rank)
    batches = list(itertools.islice(local_batches(plan.inputs, part, engine.spec, BATCH), STEPS))
    model = build_model(engine.spec, engine.model, seed=engine.seed)
    fused = engine.embedding_optimizer(M).fused_params()
    if M == 1:  # TorchRec's own: one DMP over the T processes
        dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                       device=torch.device("cpu"), plan=job_plan(cfg),
                                       sharders=[EmbeddingBagCollectionSharder(fused_params=fused)])
        replica_pg = None
    else:  # a DMP per sharding group over TorchRec's 2-D env, the dense part DDP over all T (as TorchRec's
        # DMPCollection builds it, which runs on CUDA only; here the process groups and the env as recgrid's
        # engine makes them); the loop below adds only the tables' average every K steps
        groups = grid.build_process_groups("cpu")
        dmp = shard_model(model, grid, groups, torch.device("cpu"), fused, job_plan(cfg))
        replica_pg = groups.replica_pg
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    opt = dense_optimizer(engine.dense_optimizer, dense, engine.dense_lr)
    tables = [t for k in embedding_kernels(dmp) for t in k.split_embedding_weights()] + \
             [s for k in embedding_kernels(dmp) for tb in k.get_optimizer_state() for s in tb.values()]
    ends = [time.perf_counter()]
    for step, batch in enumerate(batches, 1):
        opt.zero_grad(set_to_none=True)
        loss, _ = dmp(batch)
        loss.backward()
        opt.step()
        if M > 1 and step % K == 0:  # the replica sync: tables and moments averaged over the replica group
            for work in [dist.all_reduce(t, group=replica_pg, async_op=True) for t in tables]:
                work.wait()
            for t in tables:
                t.div_(M)
        ends.append(time.perf_counter())
    return _interval_qps(ends, BATCH * T)


def run_bare(cfg, M: int, warm: bool = False) -> float:
    from recgrid.launch.local import run_local

    return run_local(bare_probe, T, cfg, M, warm)[0]


def run_recgrid(cfg) -> float:
    from recgrid.launch.ray import run_job

    result = run_job(cfg, summary=False)
    if result.status != "FINISHED":
        raise RuntimeError(f"the recgrid job did not finish: {result.error}")
    return float(result.metrics["train/qps_median"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="alternating rounds of every variant")
    ap.add_argument("--variants", default="bare_dmp,recgrid_m1,bare_2d,recgrid_m2,bare_dmp_warm")
    ap.add_argument("--out", default=str(REPO / "bench/results/peer.json"))
    a = ap.parse_args()
    import ray

    from recgrid.launch.report import machine_info, write_result

    tmp = Path(tempfile.mkdtemp(prefix="recgrid-bench-peer-"))
    data = [f"data.train={REPO}/runs/data/demo/train/*.parquet"]
    m1 = _config(tmp, [*data, "grid.num_groups=1", "model.sharding=table_wise", "train.max_failures=0",
                       "train.checkpoint_every=0"])
    m2 = _config(tmp, [*data, "grid.num_groups=2", "train.max_failures=2"])
    from recgrid.launch.ray import ensure_data

    ensure_data(m1)
    make = {"bare_dmp": lambda: run_bare(m1, 1), "bare_dmp_warm": lambda: run_bare(m1, 1, warm=True),
            "bare_2d": lambda: run_bare(m2, 2), "recgrid_m1": lambda: run_recgrid(m1),
            "recgrid_m2": lambda: run_recgrid(m2)}
    variants = a.variants.split(",")
    runs: dict[str, list[float]] = {v: [] for v in variants}

    def save() -> None:
        med = {v: statistics.median(q) for v, q in runs.items() if q}
        ratio = lambda x, y: round(med[x] / med[y], 4) if x in med and y in med else None  # noqa: E731
        write_result(a.out, {
            "benchmark": "peer",
            "configuration": {"world_size": T, "sync_every": K, "steps": STEPS, "batch_size_per_worker": BATCH,
                              "log_every": LOG_EVERY, "config": "jobs/local_demo.yaml", "reps": a.reps,
                              "m1": "grid.num_groups=1 model.sharding=table_wise train.max_failures=0 "
                                    "train.checkpoint_every=0 train.eval_every=0 data.eval=[]",
                              "m2": "grid.num_groups=2 train.max_failures=2 train.eval_every=0 data.eval=[]",
                              "statistic": "median over 50-step logging intervals, the first left out; "
                                           "then the median over the runs",
                              "command": " ".join(["bench/peer.py", *sys.argv[1:]])},
            "machine": machine_info(),
            "runs": runs, "median_qps": {v: round(q, 1) for v, q in med.items()},
            "ratios": {"recgrid_m1_over_bare_dmp": ratio("recgrid_m1", "bare_dmp"),
                       "recgrid_m2_over_bare_2d": ratio("recgrid_m2", "bare_2d"),
                       "bare_dmp_warm_over_bare_dmp": ratio("bare_dmp_warm", "bare_dmp")}})

    try:
        for rep in range(a.reps):
            for v in variants:
                print(f"[bench] peer round {rep + 1}/{a.reps}: {v} ...", file=sys.stderr, flush=True)
                runs[v].append(round(make[v](), 1))
                print(f"[bench] {v}: {runs[v][-1]:,.0f} QPS", file=sys.stderr, flush=True)
                save()
    finally:
        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    main()
