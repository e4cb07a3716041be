"""The cluster a plan is made for: T workers, G to a node, B samples per worker per step, and the
device's cost form (`estimators.GpuCost` or `estimators.CpuCost`); the rank layouts recgrid's grid
allows on it. The grid itself (`engine.grid.Grid`) is the one place rank lists come from."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from recgrid.engine.grid import Grid
from recgrid.plan.estimators import CpuCost, GpuCost


class PlanError(ValueError):
    """An impossible cluster or argument; the message names it."""


@dataclass(frozen=True)
class Cluster:
    """T workers (`gpus`; CPU processes with a `CpuCost`), `gpus_per_node` to a node,
    `batch_per_gpu` samples per worker per step, and the hardware's cost form."""

    gpus: int
    gpus_per_node: int
    batch_per_gpu: int
    cost: GpuCost | CpuCost

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "batch_per_gpu"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PlanError(f"--gpus T={self.gpus} is not a whole number of nodes of --gpus-per-node "
                            f"{self.gpus_per_node}")

    @property
    def workers_per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)

    @property
    def device(self) -> str:
        """"cuda" or "cpu": which cost form prices this cluster."""
        return self.cost.compute_device

    def group_counts(self) -> list[int]:
        return [m for m in range(1, self.gpus + 1) if self.gpus % m == 0]


def layouts_for(cluster: Cluster, num_groups: int) -> list[str]:
    """The rank layouts recgrid's grid allows for (T, M): host-local when M divides the workers
    per node W (each replica group inside one node: sync over NVLink) or is a multiple of W (each
    replica group on M/W whole nodes of its own: sync over all their NICs), and inter-host (each
    sharding group on whole nodes: NVLink inside the sharding group, sync over one NIC per GPU)
    when M > 1."""
    W = cluster.workers_per_node
    out = ["host-local"] if W % num_groups == 0 or num_groups % W == 0 else []
    if num_groups > 1:
        out.append("inter-host")
    return out


def grid_for(cluster: Cluster, num_groups: int, layout: str):
    """recgrid's grid for (T, M, layout): the one place rank lists come from."""
    return Grid(cluster.gpus, num_groups, layout, workers_per_node=cluster.workers_per_node)


def ranks_per_node(ranks: Sequence[int], workers_per_node: int) -> int:
    """Most members of one rank list that share a node (ranks are numbered contiguously per node)."""
    return max(Counter(r // workers_per_node for r in ranks).values())
