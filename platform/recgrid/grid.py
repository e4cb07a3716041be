"""The grid: the one object that owns T, M, L, the rank layout and the process groups.

Every other module asks a `Grid` for rank lists and coordinates; nothing else does rank
arithmetic. Vocabulary (DESIGN.md): a *sharding group* is the L workers that together hold
one full copy of every embedding table; a *replica group* is the M workers (one per
sharding group) that hold the same shard and average it every K steps.

Layouts:
  host-local (default): sharding group i = [i, M+i, 2M+i, ...]; replica group j = [jM, ..., jM+M-1].
      Ray Train numbers ranks contiguously per node, so when M divides the workers per node every
      replica group sits on one host and the weight all-reduce never leaves it.
  inter-host: sharding group i = [iL, ..., iL+L-1]; replica group j = [j, L+j, ...].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

if TYPE_CHECKING:  # torch is heavy; the layout command and config validation do not need it
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

Layout = Literal["host-local", "inter-host"]
LAYOUTS: tuple[str, ...] = ("host-local", "inter-host")


class GridError(ValueError):
    """An impossible grid shape or a grid that does not fit the workers it was given."""


@dataclass(frozen=True)
class WorkerCoords:
    """Where one worker sits in the grid."""

    rank: int
    sharding_group: int  # which sharding group (0..M-1): which full model copy
    shard_rank: int  # rank inside its sharding group (0..L-1): which shard it holds
    replica_group: int  # which replica group (0..L-1); equal to shard_rank
    replica_rank: int  # position inside its replica group (0..M-1); equal to sharding_group


@dataclass(frozen=True)
class Grid:
    """T workers arranged as M sharding groups of L workers each.

    Attributes:
        world_size: T, the number of training workers.
        num_groups: M, the number of sharding groups (full model copies). M = 1 is TorchRec's
            ordinary full model parallelism.
        layout: "host-local" (replica groups on one host, the default) or "inter-host".
        workers_per_node: workers on each node, when known; checked against the layout.
    """

    world_size: int
    num_groups: int = 1
    layout: Layout = "host-local"
    workers_per_node: int | None = None

    def __post_init__(self) -> None:
        T, M = self.world_size, self.num_groups
        if not isinstance(T, int) or T < 1:
            raise GridError(f"world_size (T) must be a positive integer, got {T!r}")
        if not isinstance(M, int) or M < 1:
            raise GridError(
                f"num_groups (M) must be a positive integer, got {M!r}; "
                f"valid values for T={T}: {_divisors(T)}"
            )
        if self.layout not in LAYOUTS:
            raise GridError(f"layout must be one of {list(LAYOUTS)}, got {self.layout!r}")
        if T % M:
            raise GridError(
                f"world_size T={T} is not divisible by num_groups M={M}; "
                f"M must divide T, valid values: {_divisors(T)}"
            )
        W = self.workers_per_node
        if W is None:
            return
        if not isinstance(W, int) or W < 1:
            raise GridError(f"workers_per_node must be a positive integer, got {W!r}")
        if T % W:
            raise GridError(
                f"world_size T={T} is not a whole number of nodes of workers_per_node={W}; "
                f"use T in {[W * k for k in range(1, 5)]}..."
            )
        if self.layout == "host-local" and W % M:
            ok = [m for m in _divisors(T) if W % m == 0]
            raise GridError(
                f"host-local layout needs num_groups M={M} to divide workers_per_node={W} "
                f"(else a replica group spans hosts); with T={T}, W={W} use M in {ok}, "
                f"or layout='inter-host'"
            )

    # ---- shape -------------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """L = T / M, the workers per sharding group."""
        return self.world_size // self.num_groups

    @property
    def sharding_groups(self) -> list[list[int]]:
        """M lists of L global ranks; list i holds one full copy of the model."""
        T, M, L = self.world_size, self.num_groups, self.group_size
        if self.layout == "host-local":
            return [[i + M * r for r in range(L)] for i in range(M)]
        return [list(range(i * L, (i + 1) * L)) for i in range(M)]

    @property
    def replica_groups(self) -> list[list[int]]:
        """L lists of M global ranks; list j holds the M copies of shard j."""
        groups = self.sharding_groups
        return [[groups[i][j] for i in range(self.num_groups)] for j in range(self.group_size)]

    @property
    def sharding_group_per_node(self) -> int:
        """How many members of one sharding group share a node (TorchRec's `node_group_size`
        and the planner's `local_world_size`). Unknown workers_per_node means one node."""
        W, M, L = self.workers_per_node, self.num_groups, self.group_size
        if W is None or W >= self.world_size:
            return L
        return max(1, W // M) if self.layout == "host-local" else min(L, W)

    def local_rank(self, rank: int) -> int:
        """The rank of global `rank` on its node (Ray Train numbers ranks contiguously per node)."""
        return rank % (self.workers_per_node or self.world_size)

    def global_rank(self, sharding_group: int, shard_rank: int) -> int:
        """The global rank of shard `shard_rank` in sharding group `sharding_group`."""
        return self.sharding_groups[sharding_group][shard_rank]

    def coords(self, rank: int) -> WorkerCoords:
        if not 0 <= rank < self.world_size:
            raise GridError(f"rank {rank} is outside the grid of T={self.world_size} workers")
        M, L = self.num_groups, self.group_size
        if self.layout == "host-local":
            i, r = rank % M, rank // M
        else:
            i, r = rank // L, rank % L
        return WorkerCoords(rank=rank, sharding_group=i, shard_rank=r, replica_group=r, replica_rank=i)

    def with_world_size(self, world_size: int, num_groups: int) -> "Grid":
        return dataclasses.replace(self, world_size=world_size, num_groups=num_groups)

    def as_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "num_groups": self.num_groups,
            "group_size": self.group_size,
            "layout": self.layout,
            "sharding_groups": self.sharding_groups,
            "replica_groups": self.replica_groups,
        }

    # ---- the real nodes ------------------------------------------------------------------------
    def check_placement(self, node_of_rank: Sequence[str]) -> None:
        """Check the layout against where workers really run (`node_of_rank[r]` = node id of rank r).

        host-local: every replica group must sit on one node.
        inter-host: with more than one node, no replica group may sit wholly on one node
        (so losing a host never loses every copy of a shard).
        """
        if len(node_of_rank) != self.world_size:
            raise GridError(
                f"got node ids for {len(node_of_rank)} workers but the grid has T={self.world_size}"
            )
        nodes = sorted(set(node_of_rank))
        for j, group in enumerate(self.replica_groups):
            where = sorted({node_of_rank[r] for r in group})
            if self.layout == "host-local" and len(where) > 1:
                raise GridError(
                    f"host-local layout: replica group {j} (ranks {group}) spans nodes {where}; "
                    f"M={self.num_groups} must divide the workers on every node "
                    f"(workers per node: {_count(node_of_rank)}), or use layout='inter-host'"
                )
            if self.layout == "inter-host" and len(nodes) > 1 and len(where) == 1 and self.num_groups > 1:
                raise GridError(
                    f"inter-host layout: replica group {j} (ranks {group}) sits wholly on node "
                    f"{where[0]}, so losing that host loses every copy of shard {j}; "
                    f"use layout='host-local' or spread the workers over more nodes"
                )

    # ---- process groups --------------------------------------------------------------------------
    def build_process_groups(self, device_type: str) -> "GridGroups":
        """Build the 2-D DeviceMesh (rows = sharding groups) and its two process groups.

        Must be called on every rank of an initialised default process group of size T.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            raise GridError("torch.distributed is not initialised; init the global group first")
        if dist.get_world_size() != self.world_size:
            raise GridError(
                f"the global process group has {dist.get_world_size()} ranks but the grid has "
                f"T={self.world_size}"
            )
        mesh = DeviceMesh(device_type, mesh=self.sharding_groups, mesh_dim_names=("replicate", "shard"))
        return GridGroups(
            mesh=mesh,
            sharding_pg=mesh.get_group("shard"),
            replica_pg=mesh.get_group("replicate"),
            global_pg=dist.group.WORLD,
            coords=self.coords(dist.get_rank()),
        )


@dataclass(frozen=True)
class GridGroups:
    """The process groups of one worker: built once per worker from its `Grid`."""

    mesh: "DeviceMesh"
    sharding_pg: "dist.ProcessGroup"
    replica_pg: "dist.ProcessGroup"
    global_pg: "dist.ProcessGroup"
    coords: WorkerCoords


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if isinstance(n, int) and n > 0 else []


def _count(node_of_rank: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in node_of_rank:
        out[n] = out.get(n, 0) + 1
    return out
