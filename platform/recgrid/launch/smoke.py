"""`recgrid smoke`: train the tiny model on T local gloo processes and report whether the 2-D
sync holds — the check a user runs on a new install or a new cluster."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Iterator

import torch
import torch.distributed as dist

from recgrid.config import defaults
from recgrid.data.specs import NUM_DENSE, SPARSE_NAMES, DatasetSpec, get_spec
from recgrid.engine.grid import Grid, GridError
from recgrid.engine.model import ModelSpec
from recgrid.engine.sharding import sharding_summary
from recgrid.engine.sync import embedding_weights, optimizer_states
from recgrid.launch.local import run_local
from recgrid.train.trainer import Trainer, dense_parameters
from recgrid.trainer_config import EngineConfig


def random_batches(spec: DatasetSpec, batch_size: int, seed: int) -> Iterator:
    """Endless random Criteo-shaped batches (one id per feature, skewed towards low ids)."""
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    g = torch.Generator().manual_seed(seed)
    rows = torch.tensor(spec.table_rows, dtype=torch.float64)
    while True:
        u = torch.rand(len(rows), batch_size, generator=g, dtype=torch.float64)
        ids = (rows.unsqueeze(1) * u.pow(3)).long().clamp_max((rows - 1).long().unsqueeze(1))
        yield Batch(
            dense_features=torch.rand(batch_size, NUM_DENSE, generator=g),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=list(SPARSE_NAMES), values=ids.flatten(),
                lengths=torch.ones(len(rows) * batch_size, dtype=torch.int32)),
            labels=(torch.rand(batch_size, generator=g) < 0.25).float(),
        )


def peer_max_diff(tensors: list[torch.Tensor], pg: dist.ProcessGroup) -> float:
    """Largest |difference| of `tensors` between the members of `pg`, the same on every rank of
    the global group (max over all groups)."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]) if tensors else torch.zeros(1)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(gathered, flat, group=pg)
    diff = torch.stack([(g - gathered[0]).abs().max() for g in gathered]).max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def smoke_worker(grid: Grid, steps: int, sync_every: int, sharding: str, batch_size: int,
                 moment_scale: float | None, delayed: bool, arch: str, seed: int) -> dict:
    config = EngineConfig.from_job(defaults(), 
        spec=get_spec("tiny"),
        model=ModelSpec(arch=arch),
        lr=0.05, moment_scale=moment_scale,
        sync_every=sync_every, delayed_moment_sync=delayed, sharding=sharding, seed=seed,
    )
    state = Trainer.build(grid, config, torch.device("cpu"))
    rpg = state.groups.replica_pg
    diffs: dict[str, float] = {}

    def before(sync) -> None:
        diffs["peer_weight_diff_before_sync"] = peer_max_diff(embedding_weights(state.model), rpg)
        diffs["peer_optim_diff_before_sync"] = peer_max_diff(optimizer_states(state.model), rpg)

    def after(sync) -> None:
        diffs["peer_weight_diff_after_sync"] = peer_max_diff(embedding_weights(state.model), rpg)
        diffs["peer_optim_diff_after_sync"] = peer_max_diff(optimizer_states(state.model), rpg)

    state.replica_sync.before_sync.append(before)
    state.replica_sync.after_sync.append(after)
    rank = dist.get_rank()
    result = state.run(random_batches(config.spec, batch_size, seed=seed * 1000 + rank), steps)
    state.replica_sync.close()
    dense = dense_parameters(state.model)
    out = {
        **diffs,
        "dense_diff": peer_max_diff(dense, dist.group.WORLD),
        "step_time_median_s": statistics.median(result.step_seconds),
        "sync_seconds": state.replica_sync.stats.seconds,
        "sync_bytes": state.replica_sync.stats.bytes,
        "syncs": state.replica_sync.stats.count,
        "final_loss": result.losses[-1],
        "sharding_plan": sharding_summary(state.plan),
    }
    return out


def run_smoke(world_size: int, groups: int, steps: int, sync_every: int, sharding: str = "table_wise",
              inter_host: bool = False, batch_size: int = 64, moment_scale: float | None = None,
              delayed: bool = False, arch: str = "dlrm", seed: int = 0) -> dict:
    grid = Grid(world_size, groups, "inter-host" if inter_host else "host-local")
    per_rank = run_local(smoke_worker, world_size, grid, steps, sync_every, sharding, batch_size,
                         moment_scale, delayed, arch, seed)
    r0 = per_rank[0]
    return {
        "world_size": grid.world_size, "num_groups": grid.num_groups, "group_size": grid.group_size,
        "sync_every": sync_every, "layout": grid.layout, "sharding": sharding, "steps": steps,
        "sharding_groups": grid.sharding_groups, "replica_groups": grid.replica_groups,
        **{k: r0.get(k) for k in ("peer_weight_diff_before_sync", "peer_weight_diff_after_sync",
                                  "peer_optim_diff_before_sync", "peer_optim_diff_after_sync", "dense_diff")},
        # step time and sync cost: the slowest worker's, which is what the job waits for
        "step_time_median_s": max(r["step_time_median_s"] for r in per_rank),
        "sync_seconds": max(r["sync_seconds"] for r in per_rank),
        "sync_bytes": r0["sync_bytes"],
        "syncs": r0["syncs"],
        "final_loss": r0["final_loss"],
        "sharding_plan": r0["sharding_plan"],
    }


def run_cli(args: argparse.Namespace) -> int:
    try:
        Grid(args.world_size, args.groups, "inter-host" if args.inter_host else "host-local")
    except GridError as e:
        print(f"recgrid smoke: {e}", file=sys.stderr)
        return 2
    if args.steps < 1 or args.sync_every < 1:
        print("recgrid smoke: --steps and --sync-every must be >= 1", file=sys.stderr)
        return 2
    if not args.json:
        print(f"[smoke] spawning {args.world_size} gloo workers, M={args.groups}, K={args.sync_every}, "
              f"{args.steps} steps, sharding={args.sharding} ...", file=sys.stderr)
    out = run_smoke(args.world_size, args.groups, args.steps, args.sync_every, args.sharding, args.inter_host,
                    args.batch_size, args.moment_scale, args.delayed_moment_sync, args.model, args.seed)
    print(json.dumps(out, indent=None if args.json else 2))
    if args.groups > 1 and not args.delayed_moment_sync and out["syncs"]:
        ok = out["peer_weight_diff_after_sync"] == 0 and out["peer_optim_diff_after_sync"] == 0
        if not args.json:
            print(f"[smoke] replicas {'identical after sync: OK' if ok else 'DIFFER after sync: FAIL'}", file=sys.stderr)
        return 0 if ok else 1
    return 0
