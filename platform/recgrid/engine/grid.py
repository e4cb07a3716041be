"""The grid: the one object that owns T, M, L, the rank layout and the process groups.

Every other module asks a `Grid` for rank lists and coordinates; nothing else does rank
arithmetic. Vocabulary (DESIGN.md): a *sharding group* is the L workers that together hold
one full copy of every embedding table; a *replica group* is the M workers (one per
sharding group) that hold the same shard and average it every K steps.

Layouts:
  host-local (default): sharding group i = [i, M+i, 2M+i, ...]; replica group j = [jM, ..., jM+M-1].
      Ray Train numbers ranks contiguously per node, so when M divides the workers per node W every
      replica group sits on one host and the weight all-reduce never leaves it; when M is a multiple
      of W every replica group is M/W whole nodes of its own and syncs over all their NICs (as
      TorchRec's DMPCollection lays it out for any M). Other M would split a node between replica groups.
  inter-host: sharding group i = [iL, ..., iL+L-1]; replica group j = [j, L+j, ...].
      On a cluster of more than one node each sharding group must sit on nodes of its own (no node
      shared by two sharding groups), so losing a host leaves every other sharding group whole.

`check_cluster` refuses, before any worker starts, a cluster whose nodes cannot give the layout;
`check_placement` checks where an attempt's workers really landed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Mapping, Sequence

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
        if self.layout == "host-local" and W % M and M % W:
            ok = [m for m in _divisors(T) if W % m == 0 or m % W == 0]
            raise GridError(
                f"host-local layout needs num_groups M={M} to divide workers_per_node={W} or be a "
                f"multiple of it (else a replica group shares a host with another); with T={T}, W={W} "
                f"use M in {ok}, or layout='inter-host'"
            )

    # ---- shape -------------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """L = T / M, the workers per sharding group."""
        return self.world_size // self.num_groups

    @property
    def sharding_groups(self) -> list[list[int]]:
        """M lists of L global ranks; list i holds one full copy of the model."""
        M, L = self.num_groups, self.group_size
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
        and the planner's `local_world_size`). Unknown workers_per_node means one node. Host-local
        with M a multiple of the workers per node: one (a node holds W members of one replica group)."""
        W, M, L = self.workers_per_node, self.num_groups, self.group_size
        if W is None or W >= self.world_size:
            return L
        return max(1, W // M) if self.layout == "host-local" else min(L, W)

    def local_rank(self, rank: int) -> int:
        """The rank of global `rank` on its node (Ray Train numbers ranks contiguously per node)."""
        return rank % (self.workers_per_node or self.world_size)

    def node_of(self, rank: int) -> int:
        """The node (0, 1, ...) of global `rank`: ranks are contiguous per node. Unknown
        workers_per_node means one node."""
        return rank // (self.workers_per_node or self.world_size)

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

    # ---- the real nodes ------------------------------------------------------------------------
    def check_cluster(self, slots: Mapping[str, int], min_world_size: int | None = None) -> None:
        """Refuse, before any worker starts, a cluster that cannot give this layout.

        `slots[node]` is how many workers `node` can hold (from what it offers; `node` is the text
        that names it in the error: id, address, resources). Nodes of no slot are ignored. Checked:
        the nodes hold at least `min_world_size` (default T) workers; inter-host on more than one
        node: at least as many nodes as the sharding groups the first attempt gets, each able to
        give one of them L workers; host-local with replica groups of at most one node: enough
        whole replica groups fit on single nodes. What Ray then really does is checked by
        `check_placement` on the workers.
        """
        T, L = self.world_size, self.group_size
        usable = {n: s for n, s in slots.items() if s > 0}
        listing = "; ".join(f"{n}: {s} worker(s)" for n, s in slots.items()) or "none"
        low = min_world_size or T
        total = sum(usable.values())
        if total < low:
            raise GridError(
                f"{self.layout} layout: the cluster's nodes hold {total} of the {low} workers the job needs "
                f"(nodes: {listing}); add nodes, or lower train.cpus_per_worker or grid.world_size")
        n = min(T, total // L * L)  # the workers the first attempt gets: whole sharding groups
        groups = n // L
        if self.layout == "inter-host" and len(usable) > 1 and groups > 1:
            if len(usable) < groups:
                raise GridError(
                    f"inter-host layout: the M={groups} sharding groups need nodes of their own, but this "
                    f"cluster has {len(usable)} nodes that can hold workers (nodes: {listing}); add nodes, "
                    f"lower grid.num_groups to {len(usable)} or fewer, or use grid.layout=host-local")
            if sum(min(s, L) for s in usable.values()) < groups * L:  # a node gives its sharding group at most L
                raise GridError(
                    f"inter-host layout: the M={groups} sharding groups of L={L} workers each need nodes of "
                    f"their own, and these nodes cannot give each its L workers (nodes: {listing}); add "
                    f"nodes or room on them (train.cpus_per_worker), or use grid.layout=host-local")
        if self.layout == "host-local" and groups > 1:  # replica groups of M = n / L workers
            M = groups
            whole = sum(s // M for s in usable.values())
            if M <= max(usable.values()) and whole * M < n:
                raise GridError(
                    f"host-local layout: each replica group of M={M} workers must sit on one node, but the "
                    f"cluster's nodes hold only {whole} whole replica group(s), {whole * M} of the {n} "
                    f"workers (nodes: {listing}); give each node room for a multiple of M workers "
                    f"(train.cpus_per_worker), lower grid.num_groups, or use grid.layout=inter-host")

    def check_placement(self, node_of_rank: Sequence[str], cluster_nodes: int = 1) -> None:
        """Check the layout against where workers really run (`node_of_rank[r]` = node id of rank r;
        `cluster_nodes`: how many nodes of the cluster could hold a worker).

        host-local: every replica group must sit on one node, or on whole nodes of its own (M a
        multiple of the workers per node: no node shared with another replica group).
        inter-host: on a cluster of more than one such node, no node may hold workers of two
        sharding groups (so losing a host never loses a copy of every shard).
        """
        if len(node_of_rank) != self.world_size:
            raise GridError(
                f"got node ids for {len(node_of_rank)} workers but the grid has T={self.world_size}"
            )
        per_node = _count(node_of_rank)
        if self.layout == "inter-host":
            self._check_sharding_groups_apart(node_of_rank, max(cluster_nodes, len(per_node)))
            return
        for j, group in enumerate(self.replica_groups):
            where = sorted({node_of_rank[r] for r in group})
            if len(where) == 1:
                continue
            mine = _count([node_of_rank[r] for r in group])
            shared = [n for n in where if mine[n] != per_node[n]]
            if shared:
                raise GridError(
                    f"host-local layout: replica group {j} (ranks {group}) spans nodes {where} and shares "
                    f"node(s) {shared} with other replica groups; M={self.num_groups} must divide the workers "
                    f"on every node or be a multiple of them (workers per node: {per_node}), "
                    f"or use layout='inter-host'"
                )

    def _check_sharding_groups_apart(self, node_of_rank: Sequence[str], cluster_nodes: int) -> None:
        """inter-host: each sharding group on nodes of its own, when the cluster has more than one node."""
        if self.num_groups == 1 or cluster_nodes < 2:
            return
        owner: dict[str, int] = {}
        for i, group in enumerate(self.sharding_groups):
            for r in group:
                other = owner.setdefault(node_of_rank[r], i)
                if other != i:
                    where = {g: sorted({node_of_rank[x] for x in ranks}) for g, ranks in enumerate(self.sharding_groups)}
                    raise GridError(
                        f"inter-host layout: node {node_of_rank[r]} holds workers of sharding groups {other} and "
                        f"{i} (nodes of each sharding group: {where}), so losing that host loses a copy of "
                        f"shards in both; on this cluster of {cluster_nodes} nodes that can hold workers each "
                        f"sharding group needs nodes of its own: confine the workers to M={self.num_groups} nodes "
                        f"(or a multiple of M) with room for L={self.group_size} workers per sharding group "
                        f"(train.resources_per_worker can name a resource only those nodes offer), "
                        f"or use grid.layout=host-local"
                    )

    # ---- process groups --------------------------------------------------------------------------
    def build_process_groups(self, device_type: str) -> "GridGroups | None":
        """Build this worker's process groups: its sharding group, its replica group, the group of
        all T workers, and the 2-D DeviceMesh over them (rows = sharding groups).

        Collective over the whole default process group, which may hold more than T ranks: an
        elastic job given a worker count that is not a multiple of L trains on the first T ranks
        and sidelines the rest, which get None.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            raise GridError("torch.distributed is not initialised; init the global group first")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world < self.world_size:
            raise GridError(f"the global process group has {world} ranks but the grid has T={self.world_size}")

        def member_of(groups: list[list[int]]) -> "dist.ProcessGroup | None":
            # every rank of the default group creates every group, in the same order
            mine = None
            for ranks in groups:
                pg = dist.new_group(ranks)
                if rank in ranks:
                    mine = pg
            return mine

        global_pg = dist.group.WORLD if world == self.world_size else member_of([list(range(self.world_size))])
        sharding_pg, replica_pg = member_of(self.sharding_groups), member_of(self.replica_groups)
        if rank >= self.world_size:
            return None
        mesh = DeviceMesh.from_group([replica_pg, sharding_pg], device_type, mesh=self.sharding_groups,
                                     mesh_dim_names=("replicate", "shard"))
        return GridGroups(mesh=mesh, sharding_pg=sharding_pg, replica_pg=replica_pg, global_pg=global_pg,
                          coords=self.coords(rank))


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
