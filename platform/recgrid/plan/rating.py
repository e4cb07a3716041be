"""The 2-D rating: what one (M, K) costs on a cluster. One sharding group of L = T / M workers is
planned by the proposers (`proposers.plan_group`, TorchRec's pieces priced by the device's cost
form); recgrid adds what 2-D adds: the all-to-all latency of a group of L spread over nodes as the
grid layout puts it, the replica sync (paper Eq. 1: a ring all-reduce of each worker's shard bytes
over its M-worker replica group, every K steps), the replica memory overhead S(M-1)/T, and the
data-parallel dense part over all T (the same for every M). `recommend` picks among candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from recgrid.engine.grid import GridError
from recgrid.plan.cluster import Cluster, PlanError, grid_for, layouts_for, ranks_per_node
from recgrid.plan.constants import GB
from recgrid.plan.enumerators import PLAN_SHARDING_TYPES
from recgrid.plan.estimators import A2A_PER_SHARDING_TYPE, dense_flops_per_sample, dense_memory_bytes
from recgrid.plan.partitioners import TablePlacement
from recgrid.plan.proposers import plan_group
from recgrid.plan.recscale import row_wise_exchange_bytes
from recgrid.plan.tables import ModelTables

# K candidates: the sync intervals this project measures (bench/step_time.py, bench/quality.py).
DEFAULT_SYNC_EVERY: tuple[int, ...] = (1, 5, 25)
# Policy, not physics: among plans within this fraction of the best QPS, prefer the smallest K
# (less local-SGD drift), then the smallest M (fewer copies, closer to the M = 1 baseline).
QPS_TOLERANCE = 0.02


@dataclass(frozen=True)
class Candidate:
    """The prediction for one (M, K). Times per step in seconds, memory per worker in bytes."""

    num_groups: int
    group_size: int
    sync_every: int
    layout: str
    lookup_s: float
    lookup_a2a_s: float
    dense_s: float
    dense_allreduce_s: float
    sync_s: float  # per step: one sync's time / K
    sync_per_sync_s: float
    overhead_s: float
    tables_bytes: int
    replica_overhead_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    dense_bytes: int
    capacity_bytes: float
    lookup_imbalance: float
    sharding: dict[str, int]
    planner_fits: bool
    samples_per_step: int
    row_wise_dense_bytes: float = 0.0
    """Bytes a worker sends per step in its row-wise tables' forward output exchange, dense
    (TorchRec's reduce-scatter); backward sends as many back."""
    row_wise_bytes: float = 0.0
    """The same as priced: x occupancy with SRP (`row_wise_exchange: sparse`), else the dense bytes."""
    placements: tuple[TablePlacement, ...] = ()
    """The sharding group's plan: every table's shards (what a job with this M, K and layout runs)."""

    @property
    def step_s(self) -> float:
        return (self.lookup_s + self.lookup_a2a_s + self.dense_s + self.dense_allreduce_s + self.sync_s
                + self.overhead_s)

    @property
    def qps(self) -> float:
        return self.samples_per_step / self.step_s

    @property
    def peak_bytes(self) -> int:
        return self.tables_bytes + self.optimizer_bytes + self.activation_bytes + self.dense_bytes

    @property
    def feasible(self) -> bool:
        return self.planner_fits and self.peak_bytes <= self.capacity_bytes

    def to_json(self) -> dict:
        ms = lambda s: round(s * 1e3, 3)  # noqa: E731
        gb = lambda b: round(b / GB, 3)  # noqa: E731
        return {
            "num_groups": self.num_groups, "group_size": self.group_size, "sync_every": self.sync_every,
            "layout": self.layout, "qps": round(self.qps, 1), "step_ms": ms(self.step_s),
            "peak_memory_gb": gb(self.peak_bytes), "feasible": self.feasible,
            "time_ms": {"lookup": ms(self.lookup_s), "lookup_all_to_all": ms(self.lookup_a2a_s),
                        "dense": ms(self.dense_s), "dense_all_reduce": ms(self.dense_allreduce_s),
                        "replica_sync": ms(self.sync_s), "replica_sync_per_sync": ms(self.sync_per_sync_s),
                        "overhead": ms(self.overhead_s)},
            "memory_gb": {"tables": gb(self.tables_bytes), "replica_overhead": gb(self.replica_overhead_bytes),
                          "optimizer": gb(self.optimizer_bytes), "lookup_activations": gb(self.activation_bytes),
                          "dense": gb(self.dense_bytes), "capacity": gb(self.capacity_bytes)},
            "lookup_imbalance": round(self.lookup_imbalance, 3),
            "sharding": self.sharding,
            "row_wise_exchange_bytes": {"dense": round(self.row_wise_dense_bytes),
                                        "priced": round(self.row_wise_bytes)},
        }


def evaluate(model: ModelTables, cluster: Cluster, num_groups: int, sync_every: int = 1,
             layout: str | None = None, sharding_types: Sequence[str] = PLAN_SHARDING_TYPES) -> Candidate:
    """Price (M, K) on `cluster`: TorchRec's plan for one sharding group plus what 2-D adds.
    With no `layout`, every layout the grid allows is priced and the better one kept (one that
    fits memory first, then the higher QPS)."""
    if cluster.gpus % num_groups:
        raise PlanError(f"M={num_groups} does not divide T={cluster.gpus}")
    if sync_every < 1:
        raise PlanError(f"sync_every (K) must be >= 1, got {sync_every}")
    layouts = [layout] if layout else layouts_for(cluster, num_groups)
    if model.sharding != "auto" and sharding_types == PLAN_SHARDING_TYPES:
        sharding_types = (model.sharding,)  # the job's model.sharding, not the planner's choice
    priced = [_evaluate(model, cluster, num_groups, sync_every, lay, sharding_types) for lay in layouts]
    return max(priced, key=lambda c: (c.feasible, c.qps))


def _evaluate(model: ModelTables, cluster: Cluster, num_groups: int, sync_every: int, layout: str,
              sharding_types: Sequence[str]) -> Candidate:
    try:
        grid = grid_for(cluster, num_groups, layout)
    except GridError as e:
        raise PlanError(str(e)) from None
    T, M, L, B, W = cluster.gpus, num_groups, grid.group_size, cluster.batch_per_gpu, cluster.workers_per_node
    cost = cluster.cost
    dense_bytes = dense_memory_bytes(model, B)
    replica = grid.replica_groups[0]
    replica_per_node = ranks_per_node(replica, W)
    sync_per_byte = 1.0 / (cost.allreduce_rate(M, replica_per_node) * sync_every) if M > 1 else 0.0
    group = plan_group(model, L, grid.sharding_group_per_node, B, cost, dense_bytes, sharding_types, sync_per_byte)
    peak = group.peak_rank

    a2a_latency = A2A_PER_SHARDING_TYPE * len(group.sharding) * cost.a2a_latency(L, grid.sharding_group_per_node)
    dense_s = cost.dense_seconds(dense_flops_per_sample(model) * B, B)
    dense_ar = cost.allreduce_seconds(model.dense_params * 4, T, W)
    # Replica sync (Eq. 1): each worker's shard bytes (weights + optimizer state), all-reduced over
    # its replica group; the slowest (largest) shard sets the pace.
    shard_bytes = max(w + o for w, o in zip(group.weight_bytes, group.optimizer_bytes))
    sync_one = cost.allreduce_seconds(shard_bytes, M, replica_per_node) if M > 1 else 0.0
    state_bytes = sum(group.weight_bytes) + sum(group.optimizer_bytes)  # S: one full copy
    rw_dense, rw_priced = row_wise_exchange_bytes(model, group.row_wise_tables, B, L)
    return Candidate(
        num_groups=M, group_size=L, sync_every=sync_every if M > 1 else 1, layout=grid.layout,
        lookup_s=max(group.lookup_s) + cost.lookup_overhead(group.kernels),
        lookup_a2a_s=max(group.comms_s) + a2a_latency,
        dense_s=dense_s, dense_allreduce_s=dense_ar,
        sync_s=sync_one / sync_every, sync_per_sync_s=sync_one, overhead_s=cost.step_overhead(),
        tables_bytes=group.weight_bytes[peak], replica_overhead_bytes=state_bytes * (M - 1) // T,
        optimizer_bytes=group.optimizer_bytes[peak], activation_bytes=group.activation_bytes[peak],
        dense_bytes=dense_bytes, capacity_bytes=cost.capacity, lookup_imbalance=group.lookup_imbalance,
        sharding=group.sharding, planner_fits=group.fits, samples_per_step=T * B,
        row_wise_dense_bytes=rw_dense, row_wise_bytes=rw_priced, placements=group.placements,
    )


def choose(candidates: Sequence[Candidate]) -> Candidate | None:
    """Among feasible candidates within QPS_TOLERANCE of the best QPS: the smallest K, then the
    smallest M; None when none fits."""
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        return None
    top = max(c.qps for c in feasible)
    return min((c for c in feasible if c.qps >= (1 - QPS_TOLERANCE) * top), key=lambda c: (c.sync_every, c.num_groups))
