"""Sharding inside each sharding group: plan for L workers, remap the plan onto this worker's
sharding group, and wrap the model in TorchRec's `DistributedModelParallel` with a
`ShardingEnv2D`, which also makes the dense part data-parallel (DDP) over all T workers.

This is what TorchRec's CUDA-only `DMPCollection` does, built from its public pieces so the
same path runs on CPU (gloo) and GPU (NCCL).
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING, Any

from recgrid.data.specs import DTYPE_BYTES
from recgrid.engine.device import device_indices, device_memory_bytes, placement
from recgrid.engine.grid import Grid, GridGroups
from recgrid.engine.quiet import libraries_quiet
from recgrid.engine.srp import ROW_WISE_EXCHANGES, install_srp

if TYPE_CHECKING:  # torchrec is heavy; config validation imports SHARDINGS from here
    import torch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

# The model-parallel sharding types a job can name (TorchRec's names), and "auto": TorchRec's
# planner chooses per table. config.py's model.sharding takes its choices from here.
MODEL_PARALLEL_TYPES: tuple[str, ...] = (
    "table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise", "grid_shard",
)
SHARDINGS: tuple[str, ...] = ("auto", *MODEL_PARALLEL_TYPES)
# What "auto" lets the planner pick from: table-column-wise only when asked for (see
# _check_table_column_wise); column-wise and table-wise cover what it would do here.
AUTO_TYPES: tuple[str, ...] = tuple(t for t in MODEL_PARALLEL_TYPES if t != "table_column_wise")
@functools.cache
def _sharder_class() -> type:
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    for t in MODEL_PARALLEL_TYPES:
        ShardingType(t)  # fails loudly if TorchRec renamed a sharding type

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

    return GridSharder


def grid_sharder(fused_params: dict[str, Any]):
    """The sharder recgrid shards with: every sharding type on every device, fused kernels only."""
    return _sharder_class()(fused_params=fused_params)


def make_plan(model: "torch.nn.Module", grid: Grid, device_type: str, fused_params: dict[str, Any],
              sharding: str = "auto", hbm_cap: int | None = None) -> "ShardingPlan":
    """The sharding plan of ONE sharding group (world size L), in shard ranks 0..L-1.

    Needs no process group: the driver makes it once per job, records it, and every worker of
    every restart replays it (`shard_model`), so a shard's identity (its position inside a
    sharding group) never changes while the job lives. Deterministic: the same model, grid shape
    and sharding give the same plan in every process, whatever its hash seed.

    `hbm_cap`: bytes of memory per GPU the planner may fill (CUDA only; TorchRec's own default is
    32 GiB whatever the GPU); None = this process's CUDA device's memory.
    """
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {list(SHARDINGS)}, got {sharding!r}")
    choices = [sharding] if sharding != "auto" else list(AUTO_TYPES)
    if device_type == "cuda" and hbm_cap is None:
        hbm_cap = device_memory_bytes()
    constraints = {
        name: ParameterConstraints(
            sharding_types=choices,
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
            min_partition=_column_shard_dim(dim, grid.group_size) if "column" in sharding else None,
        )
        for name, dim in _tables(model)
    }
    # TorchRec's planner prints its whole proposal table at INFO and warns about its own storage
    # heuristics on every plan (and TorchRec 1.8 about a Topology built without its factory): a
    # plan is reported by recgrid (sharding_summary) instead
    with libraries_quiet(("torchrec.distributed.planner",)):
        memory = {"hbm_cap": int(hbm_cap)} if device_type == "cuda" and hbm_cap is not None else {}
        topology = Topology(world_size=grid.group_size, compute_device=device_type,
                            local_world_size=grid.sharding_group_per_node, **memory)
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints,
                                           enumerator=_ordered_enumerator(topology, constraints))
        plan = planner.plan(model, [grid_sharder(fused_params)])
    _check_table_column_wise(plan, grid.group_size)
    return plan


def _ordered_enumerator(topology: Any, constraints: dict) -> Any:
    """TorchRec's enumerator with its options in a fixed order.

    TorchRec intersects the allowed sharding types as Python sets, so the options' order (and with
    it which of two equal-cost options wins, e.g. row-wise or table-row-wise inside one host)
    follows the process's string hash seed. Sorting by table, then by our order of sharding types,
    makes the choice the same in every process.
    """
    from torchrec.distributed.planner.constants import BATCH_SIZE
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    class OrderedEnumerator(EmbeddingEnumerator):
        def enumerate(self, module, sharders):  # type: ignore[override]
            options = super().enumerate(module, sharders)
            tables = {fqn: i for i, fqn in enumerate(dict.fromkeys(o.fqn for o in options))}
            return sorted(options, key=lambda o: (tables[o.fqn], MODEL_PARALLEL_TYPES.index(o.sharding_type),
                                                  o.compute_kernel))

    return OrderedEnumerator(topology=topology, batch_size=BATCH_SIZE, constraints=constraints)


def agree_on_plan(plan: "ShardingPlan | None", model: "torch.nn.Module", grid: Grid, groups: GridGroups,
                  device_type: str, fused_params: dict[str, Any], sharding: str,
                  hbm_cap: int | None = None) -> "ShardingPlan":
    """`plan` if the job recorded one, else one made by global rank 0 and sent to every worker
    (for launches without a driver: the local launcher, tests, benchmarks). On CUDA the plan
    fills rank 0's device memory unless `hbm_cap` says otherwise."""
    import torch.distributed as dist

    if plan is not None:
        return plan
    box = [make_plan(model, grid, device_type, fused_params, sharding, hbm_cap)
           if groups.coords.rank == 0 else None]
    dist.broadcast_object_list(box, group=groups.global_pg, group_src=0)
    return box[0]


def _check_table_column_wise(plan: "ShardingPlan", group_size: int) -> None:
    """TorchRec 1.8 cannot build the 2-D (DTensor) view of a table-column-wise table on a worker
    that holds none of its shards (its global-shape helper has no table-column-wise case), and
    fails deep inside sharding. Say so up front, naming the table."""
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            if ps.sharding_type == "table_column_wise" and len(set(ps.ranks or [])) < group_size:
                raise ValueError(
                    f"table_column_wise put table {table} on shard ranks {sorted(set(ps.ranks))} of a sharding group "
                    f"of L={group_size}; TorchRec 1.8 needs every worker of the group to hold a shard of such a "
                    f"table. Use column_wise, or a larger embedding dim, or a smaller L (more groups)."
                )


def remap_plan(plan: "ShardingPlan", grid: Grid, sharding_group: int, device_type: str,
               device_index: "dict[int, int] | None" = None) -> "ShardingPlan":
    """A copy of `plan` with shard rank r replaced by the global rank of shard r in sharding group
    `sharding_group`, and each shard placed on the device its worker really computes on
    (`device_index`: global rank -> CUDA device index, as `device.device_indices` gathers it).
    Placements are written `rank:R/cpu` on CPU (CPU shards reject `cpu:N`)."""
    from torch.distributed.remote_device import _remote_device
    from torchrec.distributed.types import EnumerableShardingSpec

    plan = copy.deepcopy(plan)
    for module_plan in plan.plan.values():
        for param_sharding in module_plan.values():  # type: ignore[union-attr]
            param_sharding.ranks = [grid.global_rank(sharding_group, r) for r in param_sharding.ranks]
            spec = param_sharding.sharding_spec
            if isinstance(spec, EnumerableShardingSpec):
                for shard in spec.shards:
                    rank = grid.global_rank(sharding_group, shard.placement.rank())
                    index = None if device_index is None else device_index.get(rank)
                    shard.placement = _remote_device(placement(device_type, rank, index))
    return plan


def shard_model(model: "torch.nn.Module", grid: Grid, groups: GridGroups, device: "torch.device",
                fused_params: dict[str, Any], plan: "ShardingPlan",
                row_wise_exchange: str = "dense") -> "DistributedModelParallel":
    """Shard `model`'s embedding tables inside this worker's sharding group with `plan` (the
    sharding group's plan in shard ranks, the same on every worker): a DMP-wrapped model whose
    dense part is data-parallel over all T workers. `row_wise_exchange` "sparse": the row-wise
    shards return their partial sums by SRP's sparse all-to-all (`engine.srp`) instead of
    TorchRec's reduce-scatter."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv2D

    env = ShardingEnv2D(
        sharding_pg=groups.sharding_pg,
        replica_pg=groups.replica_pg,
        global_pg=groups.global_pg,
        device_mesh=groups.mesh,
        node_group_size=grid.sharding_group_per_node,
        use_inter_host_allreduce=grid.layout == "inter-host",
    )
    # each shard on the device its worker computes on, as the worker reads it (collective)
    where = device_indices(groups.sharding_pg, device)
    local_plan = remap_plan(plan, grid, groups.coords.sharding_group, device.type, where)
    dmp = DistributedModelParallel(model, env=env, device=device, plan=local_plan,
                                   sharders=[grid_sharder(fused_params)])
    if row_wise_exchange not in ROW_WISE_EXCHANGES:
        raise ValueError(f"row_wise_exchange must be one of {list(ROW_WISE_EXCHANGES)}, got {row_wise_exchange!r}")
    if row_wise_exchange == "sparse":
        install_srp(dmp)
    return dmp


def sharding_summary(plan: "ShardingPlan") -> dict[str, str]:
    """table name -> "sharding_type@shard ranks" (shard ranks inside a sharding group)."""
    out: dict[str, str] = {}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            out[table] = f"{ps.sharding_type}@{','.join(map(str, ps.ranks or []))}"
    return out


def plan_record(plan: "ShardingPlan") -> dict[str, Any]:
    """The plan as JSON-able data, for the run's artifact and the checkpoints: per table its
    sharding type, compute kernel and shards (offsets, sizes, shard rank inside the group)."""
    from torchrec.distributed.types import EnumerableShardingSpec

    out: dict[str, Any] = {}
    for module, module_plan in sorted(plan.plan.items()):
        for table, ps in sorted(module_plan.items()):  # type: ignore[union-attr]
            spec = ps.sharding_spec
            shards = [{"offsets": list(s.shard_offsets), "sizes": list(s.shard_sizes), "shard_rank": s.placement.rank()}
                      for s in spec.shards] if isinstance(spec, EnumerableShardingSpec) else []
            out[f"{module}.{table}"] = {"sharding_type": ps.sharding_type, "compute_kernel": ps.compute_kernel,
                                        "ranks": list(ps.ranks or []), "shards": shards}
    return out


MOMENT_BYTES = 4  # row-wise AdaGrad keeps one fp32 moment per row of every shard


def shard_position_bytes(plan: "ShardingPlan", group_size: int, dtype: str = "fp32") -> list[int]:
    """Bytes each of the `group_size` shard ranks of a sharding group holds in its fused kernels:
    every shard of the plan placed there, its weights at the tables' data type `dtype` and one
    moment per row (what an in-memory snapshot copies of that shard position)."""
    record = plan_record(plan)
    out = [0] * group_size
    for table in record.values():
        for shard in table["shards"]:
            rows, cols = shard["sizes"]
            out[shard["shard_rank"]] += rows * cols * DTYPE_BYTES[dtype] + rows * MOMENT_BYTES
    return out


def _tables(model: "torch.nn.Module") -> list[tuple[str, int]]:
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


def watch_forwards(model: "torch.nn.Module") -> list[str]:
    """Record how each sharded embedding module of `model` runs, one entry per call: "pipelined"
    when TorchRec's train pipeline has swapped its forward for one of its pipelined forwards (the
    input all-to-all started a step ahead), "plain" otherwise. The pipeline falls back to plain
    forwards silently when it cannot rewrite a model; this is how a check sees that it did not."""
    from torchrec.distributed.types import ShardedModule

    calls: list[str] = []

    def record(module: "torch.nn.Module", args: Any) -> None:
        calls.append("pipelined" if type(module.forward).__name__.endswith("PipelinedForward") else "plain")

    for m in model.modules():
        if isinstance(m, ShardedModule):
            m.register_forward_pre_hook(record)
    return calls
