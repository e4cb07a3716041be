"""`recgrid towers`: partition the features into towers for Disaggregated Multi-Tower.

A short run of the flat engine (one local gloo worker, the job's model and optimizers) on the
data, or a storage checkpoint loaded into it, gives the pooled embeddings of a few thousand
samples; `plan.feature_clusters` turns them into N balanced towers; the partition file it writes is
what a job's `model.towers` reads.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from recgrid.config import defaults
from recgrid.data.specs import SPARSE_NAMES, SpecError, get_spec
from recgrid.data.stream import local_batches, scan_inputs
from recgrid.engine.grid import Grid
from recgrid.engine.model import ModelSpec
from recgrid.engine.towers import strided_partition, write_partition
from recgrid.launch.local import run_local
from recgrid.plan.feature_clusters import partition_features, size_bounds
from recgrid.train.checkpoint import Checkpointer
from recgrid.train.trainer import Trainer
from recgrid.trainer_config import EngineConfig


def pooled_embeddings(data: str, spec_name: str, steps: int, batch_size: int, samples: int, seed: int,
                      checkpoint: str | None = None, embedding_dim: int | None = None) -> Any:
    """Train `steps` steps on `data` (or load `checkpoint`) and return pooled embeddings
    [samples, F, D] of the data's first rows (one worker of the real engine, in a subprocess)."""
    return run_local(_short_run, 1, data, spec_name, steps, batch_size, samples, seed, checkpoint, embedding_dim,
                     threads_per_worker=1)[0]


def _short_run(data: str, spec_name: str, steps: int, batch_size: int, samples: int, seed: int,
               checkpoint: str | None, embedding_dim: int | None) -> Any:
    import numpy as np
    import torch
    from torchrec.models.dlrm import SparseArch

    spec = get_spec(spec_name)
    inputs = scan_inputs(data, spec)
    config = EngineConfig.from_job(defaults(), spec=spec, model=ModelSpec(embedding_dim=embedding_dim), sharding="table_wise", seed=seed)
    trainer = Trainer.build(Grid(1, 1), config, torch.device("cpu"))
    if checkpoint:
        Checkpointer().load(trainer, checkpoint)
    else:
        def epochs():
            while True:
                yield from local_batches(inputs, inputs.units(), spec, batch_size)

        trainer.run(epochs(), steps)
    sparse = next(m for m in trainer.model.modules() if isinstance(m, SparseArch))
    out, have = [], 0
    with torch.no_grad():
        for batch in local_batches(inputs, inputs.units(), spec, 1024, drop_last=False):
            out.append(sparse(batch.sparse_features).numpy())
            have += len(out[-1])
            if have >= samples:
                break
    trainer.close()
    return np.concatenate(out)[:samples]


def run_cli(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        size_bounds(len(SPARSE_NAMES), args.towers, args.balance)
        say = (lambda m: None) if args.quiet else (lambda m: print(f"[towers] {m}", file=sys.stderr, flush=True))
        say(f"{'loading ' + args.checkpoint if args.checkpoint else f'training {args.steps} steps'} "
            f"on {args.data} (spec {args.spec}) ...")
        pooled = pooled_embeddings(args.data, args.spec, args.steps, args.batch_size, args.samples, args.seed,
                                   args.checkpoint, args.embedding_dim)
        part = partition_features(pooled, args.towers, args.strategy, dims=args.dims, balance=args.balance,
                                  seed=args.seed)
    except (ValueError, SpecError, OSError) as e:
        print(f"recgrid towers: {e}", file=sys.stderr)
        return 2
    towers = part.towers(SPARSE_NAMES)
    write_partition(args.out, towers, strategy=args.strategy, balance=args.balance, sizes=part.sizes(),
                    data=args.data, spec=args.spec, steps=0 if args.checkpoint else args.steps,
                    checkpoint=args.checkpoint, samples=int(len(pooled)), seed=args.seed,
                    strided=[list(t) for t in strided_partition(args.towers)],
                    interaction=[[round(float(v), 5) for v in row] for row in part.interaction])
    print(f"towers: {args.towers} ({args.strategy}, sizes {part.sizes()}) from {len(pooled):,} samples "
          f"in {time.perf_counter() - t0:.1f} s -> {args.out}")
    for t, names in enumerate(towers):
        print(f"  tower {t}: {' '.join(names)}")
    return 0
