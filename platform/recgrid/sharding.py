"""Sharding inside each sharding group: plan for L workers, remap the plan onto this worker's
sharding group, and wrap the model in TorchRec's `DistributedModelParallel` with a
`ShardingEnv2D`, which also makes the dense part data-parallel (DDP) over all T workers.

This is what TorchRec's CUDA-only `DMPCollection` does, built from its public pieces so the
same path runs on CPU (gloo) and GPU (NCCL).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.remote_device import _remote_device
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import EnumerableShardingSpec, ShardingEnv2D, ShardingPlan, ShardingType

from recgrid.config import SHARDINGS
from recgrid.device import placement
from recgrid.grid import Grid, GridGroups

# The sharding types a user may ask for (config.SHARDINGS); "auto" lets TorchRec's planner choose.
SHARDING_CHOICES: tuple[str, ...] = SHARDINGS
# ShardingType(...) fails at import if a name is not one of TorchRec's sharding types
MODEL_PARALLEL_TYPES: tuple[str, ...] = tuple(ShardingType(t).value for t in SHARDINGS if t != "auto")
# What "auto" lets the planner pick from: table-column-wise only when asked for (see
# _check_table_column_wise); column-wise and table-wise cover what it would do here.
AUTO_TYPES: tuple[str, ...] = tuple(t for t in MODEL_PARALLEL_TYPES if t != ShardingType.TABLE_COLUMN_WISE.value)


class GridSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder, declaring every model-parallel sharding type on every device.

    The stock sharder offers row-wise, table-row-wise and grid only on CUDA; their CPU
    implementations work. Only the fused kernel is offered: embeddings are never data-parallel
    here (the replica axis is ours), and the fused kernel is where the optimizer lives.
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(MODEL_PARALLEL_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.FUSED.value]


def plan_sharding(model: torch.nn.Module, grid: Grid, groups: GridGroups, sharder: GridSharder,
                  device: torch.device, sharding: str = "auto") -> ShardingPlan:
    """A plan for ONE sharding group (world size L), computed on rank 0 and broadcast to all T.

    Ranks in the returned plan are shard ranks 0..L-1; `remap_plan` turns them into this
    worker's global ranks.
    """
    if sharding not in SHARDING_CHOICES:
        raise ValueError(f"sharding must be one of {list(SHARDING_CHOICES)}, got {sharding!r}")
    choices = [sharding] if sharding != "auto" else list(AUTO_TYPES)
    constraints = {
        name: ParameterConstraints(
            sharding_types=choices,
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
            min_partition=_column_shard_dim(dim, grid.group_size) if "column" in sharding else None,
        )
        for name, dim in _tables(model)
    }
    topology = Topology(
        world_size=grid.group_size,
        compute_device=device.type,
        local_world_size=grid.sharding_group_per_node,
    )
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    # Every worker must shard with the same plan, so one plans and the global group hears it.
    plan = planner.collective_plan(model, [sharder], groups.global_pg)
    _check_table_column_wise(plan, grid.group_size)
    return plan


def _check_table_column_wise(plan: ShardingPlan, group_size: int) -> None:
    """TorchRec 1.8 cannot build the 2-D (DTensor) view of a table-column-wise table on a worker
    that holds none of its shards (its global-shape helper has no table-column-wise case), and
    fails deep inside sharding. Say so up front, naming the table."""
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            if ps.sharding_type == ShardingType.TABLE_COLUMN_WISE.value and len(set(ps.ranks or [])) < group_size:
                raise ValueError(
                    f"table_column_wise put table {table} on shard ranks {sorted(set(ps.ranks))} of a sharding group "
                    f"of L={group_size}; TorchRec 1.8 needs every worker of the group to hold a shard of such a "
                    f"table. Use column_wise, or a larger embedding dim, or a smaller L (more groups)."
                )


def remap_plan(plan: ShardingPlan, grid: Grid, groups: GridGroups, device: torch.device) -> ShardingPlan:
    """A copy of `plan` with shard rank r replaced by the global rank of shard r in this worker's
    sharding group. Placements are written `rank:R/cpu` on CPU (CPU shards reject `cpu:N`)."""
    plan = copy.deepcopy(plan)
    group = groups.coords.sharding_group
    for module_plan in plan.plan.values():
        for param_sharding in module_plan.values():  # type: ignore[union-attr]
            param_sharding.ranks = [grid.global_rank(group, r) for r in param_sharding.ranks]
            spec = param_sharding.sharding_spec
            if isinstance(spec, EnumerableShardingSpec):
                for shard in spec.shards:
                    rank = grid.global_rank(group, shard.placement.rank())
                    shard.placement = _remote_device(placement(device, rank, grid.local_rank(rank)))
    return plan


def shard_model(model: torch.nn.Module, grid: Grid, groups: GridGroups, device: torch.device,
                fused_params: dict[str, Any], sharding: str = "auto") -> tuple[DistributedModelParallel, ShardingPlan]:
    """Shard `model`'s embedding tables inside this worker's sharding group.

    Returns the DMP-wrapped model and the plan in shard ranks (same on every worker).
    """
    sharder = GridSharder(fused_params=fused_params)
    group_plan = plan_sharding(model, grid, groups, sharder, device, sharding)
    env = ShardingEnv2D(
        sharding_pg=groups.sharding_pg,
        replica_pg=groups.replica_pg,
        global_pg=groups.global_pg,
        device_mesh=groups.mesh,
        node_group_size=grid.sharding_group_per_node,
        use_inter_host_allreduce=grid.layout == "inter-host",
    )
    dmp = DistributedModelParallel(
        model, env=env, device=device, plan=remap_plan(group_plan, grid, groups, device), sharders=[sharder]
    )
    return dmp, group_plan


def sharding_summary(plan: ShardingPlan) -> dict[str, str]:
    """table name -> "sharding_type@shard ranks" (shard ranks inside a sharding group)."""
    out: dict[str, str] = {}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            out[table] = f"{ps.sharding_type}@{','.join(map(str, ps.ranks or []))}"
    return out


def _tables(model: torch.nn.Module) -> list[tuple[str, int]]:
    """(table name, embedding dim) of every table in the unsharded model."""
    from torchrec import EmbeddingBagCollection

    return [(t.name, t.embedding_dim) for m in model.modules() if isinstance(m, EmbeddingBagCollection)
            for t in m.embedding_bag_configs()]


def _column_shard_dim(dim: int, group_size: int) -> int | None:
    """Column width that splits a table over the whole sharding group when asked for column-wise.

    TorchRec's default minimum (128 columns) keeps small tables whole; a user who asks for
    column-wise on L workers means L column shards. None (TorchRec's default) if it can't split.
    """
    width = dim // group_size
    return width if dim % group_size == 0 and width >= 4 else None
