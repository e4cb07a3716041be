"""The planner: ONE search, priced by the cost form of the device the job runs on, used both by
`recgrid plan` (every M dividing T, every K, and a recommendation) and by a job's
`model.sharding: auto` (the job's own M, K and layout; the launcher calls `job_sharding_plan` and
hands the plan to the engine, which replays it).

The search is TorchRec's planner split the same way (enumerators, estimators, proposers,
partitioners) with recgrid's 2-D rating (`rating.evaluate`). The cost form: `estimators.GpuCost`
with the published GPU figures on GPUs, `estimators.CpuCost` with the measured CPU figures on CPU
workers with gloo (`constants.CPU_MEASURED`, or $RECGRID_CPU_PROFILE: a calibration file).
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from recgrid.data.specs import SPARSE_NAMES
from recgrid.engine.device import placement
from recgrid.engine.sharding import AUTO_TYPES
from recgrid.plan.cluster import Cluster, PlanError
from recgrid.plan.constants import CPU_MEASURED, GB, H100_SXM, CpuProfile
from recgrid.plan.enumerators import PLAN_SHARDING_TYPES
from recgrid.plan.estimators import CpuCost, GpuCost, dense_memory_bytes
from recgrid.plan.partitioners import TablePlacement
from recgrid.plan.rating import DEFAULT_SYNC_EVERY, Candidate, evaluate
from recgrid.plan.recscale import memory_summary
from recgrid.plan.report import Plan, recommend
from recgrid.plan.tables import DenseSpec, ModelTables, TableSpec

CPU_PROFILE_ENV = "RECGRID_CPU_PROFILE"


def make_plan(model: ModelTables, cluster: Cluster, sync_every: Sequence[int] = DEFAULT_SYNC_EVERY,
              progress=None, job: Candidate | None = None) -> Plan:
    """Every M dividing T (infeasible ones included) x every K, and the recommendation; `job`: the
    job's own candidate, reported beside them (`recgrid plan --config`)."""
    t0 = time.perf_counter()
    candidates: list[Candidate] = []
    for M in cluster.group_counts():
        t1 = time.perf_counter()
        for K in ((1,) if M == 1 else tuple(sync_every)):
            candidates.append(evaluate(model, cluster, M, K))
        if progress:
            progress(f"M={M:<4} L={cluster.gpus // M:<5} planned in {time.perf_counter() - t1:.1f}s")
    rec, reason = recommend(candidates)
    memory = None if cluster.device == "cpu" else memory_summary(  # CPU memory is not priced
        model, cluster.gpus, cluster.cost.capacity, dense_memory_bytes(model, cluster.batch_per_gpu))
    return Plan(model=model, cluster=cluster, candidates=candidates, recommended=rec, reason=reason,
                seconds=time.perf_counter() - t0, memory=memory, job=job)


# ---- a job's plan -------------------------------------------------------------------------------------
def cpu_profile(path: str | None = None) -> CpuProfile:
    """The CPU figures a CPU job is priced with: `path`, else $RECGRID_CPU_PROFILE, else this
    project's machine as measured (`constants.CPU_MEASURED`)."""
    path = path or os.environ.get(CPU_PROFILE_ENV)
    return CpuProfile.load(path) if path else CPU_MEASURED


def job_cluster(config: Any, hbm_cap: int | None = None, profile: CpuProfile | None = None) -> Cluster:
    """The cluster a job runs on: its T workers, as many to a node as its grid says (all on one
    node when unknown), its per-worker batch, priced on GPUs with the published figures (memory
    `hbm_cap` bytes per GPU when given) and on CPU workers with the measured ones."""
    grid = config.build_grid()
    T = grid.world_size
    per_node = grid.workers_per_node or T
    if config.train.use_gpu:
        gpu = H100_SXM if hbm_cap is None else H100_SXM.with_overrides(hbm_gb=hbm_cap / GB)
        cost: GpuCost | CpuCost = GpuCost(gpu, per_node)
    else:
        cost = CpuCost(profile or cpu_profile(), T)
    return Cluster(gpus=T, gpus_per_node=per_node, batch_per_gpu=config.train.batch_size, cost=cost)


def job_tables(config: Any, module: Any) -> ModelTables:
    """The job's model as the planner prices it: the tables of the EmbeddingBagCollection the
    engine built (`module`, unsharded; QR parts included), each looking up its feature's mean ids
    per sample (a QR or head part: its feature's, an upper bound), and the dense part's layers
    as the module has them."""
    import torch
    from torchrec import EmbeddingBagCollection

    spec = config.dataset_spec()
    bags = dict(zip(SPARSE_NAMES, spec.bag_sizes))
    _, ebc = embedding_module(module)
    tables = []
    for t in ebc.embedding_bag_configs():
        pooling = sum(bags.get(f, bags.get(f[:-2], 1.0)) for f in t.feature_names)
        tables.append(TableSpec(name=t.name, rows=t.num_embeddings, dim=t.embedding_dim, pooling=float(pooling)))

    def widths(part: str) -> list[tuple[int, int]]:
        sub = getattr(getattr(module, "model", module), part, None)
        return [] if sub is None else [(m.in_features, m.out_features) for m in sub.modules()
                                       if isinstance(m, torch.nn.Linear) and not isinstance(m, EmbeddingBagCollection)]

    bottom, top = widths("dense_arch"), widths("over_arch")
    dense = DenseSpec(dense_features=bottom[0][0], bottom_mlp=tuple(o for _, o in bottom),
                      top_mlp=tuple(o for _, o in top), interaction="dot" if config.model.arch == "dlrm" else "concat")
    return ModelTables(name=f"{spec.name} ({config.model.arch})", tables=tuple(tables), dense=dense,
                       row_wise_exchange=config.model.row_wise_exchange)


def embedding_module(module: Any) -> tuple[str, Any]:
    """The path and module of the one EmbeddingBagCollection in `module`."""
    from torchrec import EmbeddingBagCollection

    found = [(p, m) for p, m in module.named_modules() if isinstance(m, EmbeddingBagCollection)]
    if len(found) != 1:
        raise PlanError(f"the planner plans a model with one EmbeddingBagCollection; this one has {len(found)} "
                        f"({', '.join(p for p, _ in found) or 'none'})")
    return found[0]


def auto_sharding_types() -> tuple[str, ...]:
    """The sharding types `auto` searches: the planner's, less those the engine leaves out of
    "auto" (`engine.sharding.AUTO_TYPES`)."""
    return tuple(t for t in PLAN_SHARDING_TYPES if t in AUTO_TYPES)


def job_candidate(config: Any, module: Any, hbm_cap: int | None = None, profile: CpuProfile | None = None) -> Candidate:
    """The job's own (M, K, layout) priced and planned: what `auto` runs."""
    grid = config.build_grid()
    model = job_tables(config, module)
    return evaluate(model, job_cluster(config, hbm_cap, profile), grid.num_groups, config.grid.sync_every,
                    layout=grid.layout, sharding_types=auto_sharding_types())


def job_sharding_plan(config: Any, module: Any, hbm_cap: int | None = None, profile: CpuProfile | None = None) -> Any:
    """The TorchRec `ShardingPlan` of one sharding group (shard ranks 0..L-1) that a job with
    `model.sharding: auto` runs: `job_candidate`'s placements, for the engine to replay."""
    candidate = job_candidate(config, module, hbm_cap, profile)
    path, _ = embedding_module(module)
    grid = config.build_grid()
    device = "cuda" if config.train.use_gpu else "cpu"
    return sharding_plan(candidate.placements, path, device, grid.sharding_group_per_node)


def sharding_plan(placements: Sequence[TablePlacement], path: str, device_type: str, per_node: int) -> Any:
    """A TorchRec `ShardingPlan` for the module at `path` from the planner's table placements."""
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan, EnumerableShardingSpec, ParameterSharding, ShardingPlan, ShardMetadata,
    )

    module_plan = EmbeddingModuleShardingPlan()
    for p in placements:
        module_plan[p.name] = ParameterSharding(
            sharding_spec=EnumerableShardingSpec([
                ShardMetadata(shard_sizes=list(size), shard_offsets=list(offset),
                              placement=placement(device_type, rank, rank % per_node if device_type != "cpu" else None))
                for size, offset, rank in p.shards]),
            sharding_type=p.sharding_type, compute_kernel=p.compute_kernel, ranks=p.ranks)
    return ShardingPlan({path: module_plan})

