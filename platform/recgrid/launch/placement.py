"""Where the workers go: what the job asks Ray for, which nodes each sharding group's run is
pinned to, what the cluster's nodes can hold, and the record of where every rank ran.

Every sharding group is a Ray Train run of its own, and Ray places each run on its own; the
driver makes the M runs keep the layout's promise by pinning them, through a per-worker label
selector on Ray's node id label (`ScalingConfig.label_selector`: bundle s, hence shard rank s, on
the node chosen for it). Host-local: shard position s of every group on one node
(`host_local_nodes`: replica group s together, where its sync is fast). Inter-host: each group on
nodes no other group of the job uses (`inter_host_nodes`), whatever room the nodes have. Where
the cluster cannot yet hold every replica group whole (an elastic host-local job started on less
room) or has one node that holds workers, the runs are not pinned. Before any worker starts the
driver refuses a cluster that cannot give the layout (`Grid.check_cluster` on `cluster_slots`) or
would leave Ray Data's read tasks no CPU (`check_room_for_data`). `grid/ranks.json` records where
every process of the job ran.
"""

from __future__ import annotations

import json
import math
from typing import Any, Collection, Mapping, Sequence

from recgrid.data.stream import DEFAULT_NUM_CPUS_PER_TASK
from recgrid.engine.grid import GridError
from recgrid.train.recovery.holders import ring_keeper

GROUP_RUN_PLACEMENT = {"host-local": "SPREAD", "inter-host": "PACK"}
"""Ray placement strategy of one sharding group's run, per layout, for runs that are not pinned."""

RANKS_ARTIFACT = "grid/ranks.json"
NODE_ID_LABEL = "ray.io/node-id"  # the label every Ray node carries: its node id


def host_local_nodes(nodes: list[dict[str, Any]], per_worker: Mapping[str, float], group_size: int,
                     num_groups: int) -> list[list[str]] | None:
    """Where host-local puts each worker: `out[s][g]` is the node id of shard position s of sharding
    group g, with replica group s (its M workers) on one node, or on whole nodes of its own when M is
    more than a node holds. Nodes are the alive ones of `nodes` (`ray.nodes()` entries), each
    holding the workers its total resources fit (`node_slots`), filled the largest first (ties by
    id, so every call on the same cluster gives the same answer). Positions on one node are
    consecutive, as Ray Train numbers a run's workers node by node in bundle order. None: the nodes
    cannot hold all L replica groups whole."""
    L, M = group_size, num_groups
    room = []
    for node in nodes:
        if node.get("Alive"):
            slots = next(iter(node_slots([node], per_worker).values()))
            if slots > 0:
                room.append((-slots, node["NodeID"]))
    out: list[list[str]] = []
    spill: list[str] = []  # M more than one node holds: a replica group over whole nodes
    for neg, node_id in sorted(room):
        slots = -neg
        if M <= slots:
            out += [[node_id] * M for _ in range(slots // M)]
        else:
            spill += [node_id] * slots
            while len(spill) >= M:
                out.append(spill[:M])
                spill = spill[M:]
    return out[:L] if len(out) >= L else None


def inter_host_nodes(nodes: list[dict[str, Any]], per_worker: Mapping[str, float], group_size: int,
                     groups: Sequence[int], taken: Collection[str] = ()) -> dict[int, list[str]]:
    """Where inter-host puts the sharding groups `groups`: group g -> the node id of each of its L
    shard positions, every group on nodes of its own, none of them in `taken` (the nodes of the
    job's groups already running). Each group takes the smallest alive node (`node_slots`) that
    holds its L workers, else the largest ones together (ties by id, so every call on the same
    cluster gives the same answer); positions on one node are consecutive. Only the groups that
    fit are in the answer."""
    L = group_size
    free = {}
    for node in nodes:
        if node.get("Alive") and node["NodeID"] not in taken:
            slots = next(iter(node_slots([node], per_worker).values()))
            if slots > 0:
                free[node["NodeID"]] = slots
    out: dict[int, list[str]] = {}
    for g in groups:
        whole = sorted((slots, n) for n, slots in free.items() if slots >= L)
        chosen = [whole[0][1]] if whole else [n for _, n in sorted((-s, n) for n, s in free.items())]
        positions: list[str] = []
        for n in chosen:
            if len(positions) >= L:
                break
            positions += [n] * min(free[n], L - len(positions))
        if len(positions) < L:
            break
        out[g] = positions
        for n in set(positions):
            del free[n]
    return out


def label_selectors(positions: list[str]) -> list[dict[str, str]]:
    """A sharding group's run's per-worker label selectors: shard position s on `positions[s]`."""
    return [{NODE_ID_LABEL: node} for node in positions]


def positions_by_node(pinned: Mapping[int, Sequence[str]]) -> dict[str, list[int]]:
    """node id -> the shard positions the job's groups hold there (each once, whichever group)."""
    out: dict[str, set[int]] = {}
    for positions in pinned.values():
        for s, node in enumerate(positions):
            out.setdefault(node, set()).add(s)
    return {n: sorted(p) for n, p in out.items()}


def holder_bytes(pinned: Mapping[int, Sequence[str]], position_bytes: Sequence[int],
                 generations: int) -> dict[str, int]:
    """What each host's snapshot holder keeps at most: `generations` copies of its own shard
    positions (`position_bytes[s]`, weights and optimizer states) and of the positions of the host
    whose copy it keeps (the ring of `train.recovery.holders.ring_keeper`)."""
    here = positions_by_node(pinned)
    own = {n: sum(position_bytes[s] for s in ps) for n, ps in here.items()}
    need = dict(own)
    for n in here:
        keeper = ring_keeper(list(here), n)
        if keeper is not None:
            need[keeper] += own[n]
    return {n: generations * b for n, b in need.items()}


def check_holder_room(need: Mapping[str, int], room: Mapping[str, dict[str, Any]]) -> None:
    """Refuse, before any worker starts, a job whose hosts cannot hold what their snapshot
    holders keep (`holder_bytes`): more than a host's free shared memory (/dev/shm, where the
    holders' slot files and Ray's object store live), or, without /dev/shm, its object store;
    `room[node]`: {"address", "shm_free", "object_store"}. The error names the host and the bytes."""
    for node, nbytes in sorted(need.items()):
        r = room.get(node, {})
        free, where = ((r["shm_free"], "free shared memory (/dev/shm)") if r.get("shm_free") is not None
                       else (r.get("object_store", 0), "object store"))
        if nbytes > free:
            raise GridError(
                f"in-memory snapshots: host {node[:12]} at {r.get('address', '?')} would keep {nbytes / 2**30:.2f} GiB "
                f"({nbytes:,} bytes: two generations of its shard positions and of the host whose copy it keeps), more "
                f"than its {free / 2**30:.2f} GiB of {where}; add hosts or memory, lower the tables' size, or set "
                f"train.snapshot_every_syncs=0 (a lost host then restores the newest storage checkpoint)")


def node_slots(nodes: list[dict[str, Any]], per_worker: Mapping[str, float]) -> dict[str, int]:
    """`{"<node id> at <address> (CPU 2, GPU 0, ...)": workers it can hold}` for the alive nodes
    in `nodes` (`ray.nodes()` entries), from their total resources: the workers of this job, each
    asking `per_worker`, that fit on the node when nothing else runs there."""
    out: dict[str, int] = {}
    for node in nodes:
        if not node.get("Alive"):
            continue
        total = node.get("Resources", {})
        fits = min((math.floor(total.get(name, 0.0) / amount + 1e-6) for name, amount in per_worker.items() if amount > 0),
                   default=0)
        shown = ", ".join(f"{k} {v:g}" for k, v in sorted(total.items())
                          if k in per_worker or not (k in ("memory", "object_store_memory") or ":" in k))
        out[f"{node['NodeID'][:12]} at {node.get('NodeManagerAddress', '?')} ({shown})"] = int(fits)
    return out


def worker_nodes(nodes: list[dict[str, Any]], per_worker: Mapping[str, float]) -> list[str]:
    """The ids of the alive nodes in `nodes` that can hold at least one of this job's workers."""
    return sorted(n["NodeID"] for n in nodes if n.get("Alive") and next(iter(node_slots([n], per_worker).values())) > 0)


def cluster_slots(per_worker: Mapping[str, float]) -> dict[str, int]:
    """`node_slots` of the connected Ray cluster."""
    import ray

    return node_slots(ray.nodes(), per_worker)


def rank_records(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`[{"attempt", "rank", "node", "pid"}, ...]` of every registered worker of every attempt
    (`attempts`: the job-control record, per attempt `{"world_size", "workers": {rank: {"pid", "node"}}}`)."""
    return [{"attempt": a, "rank": int(rank), "node": w["node"], "pid": w["pid"]}
            for a, attempt in enumerate(attempts) for rank, w in sorted(attempt["workers"].items())]


def record_ranks(run_id: str | None, tracking_uri: str | None, attempts: list[dict[str, Any]],
                 world_size: int) -> None:
    """Write the run's `grid/ranks.json` (every attempt so far: which process on which node is
    which rank) and, once all `world_size` global ranks have started, its param `derived.nodes`: the distinct
    nodes of each rank's first process (the job's first placement, every sharding group's run).
    Called once an attempt's workers are all in; rewrites the file."""
    if not run_id:
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    records = rank_records(attempts)
    client.log_text(run_id, json.dumps(records, indent=1), RANKS_ARTIFACT)
    first: dict[int, str] = {}
    for r in records:
        first.setdefault(r["rank"], r["node"])
    if len(first) >= world_size:
        client.log_param(run_id, "derived.nodes", len(set(first.values())))


def check_room_for_data(free_cpus: float, what: str) -> None:
    """Refuse a cluster whose free CPUs cannot run one Ray Data read task: every batch comes out of
    those tasks, so training would wait for its data forever. `what` says who holds the CPUs."""
    if free_cpus + 1e-9 < DEFAULT_NUM_CPUS_PER_TASK:
        raise GridError(
            f"{what}, leaving {free_cpus:g} CPU free, less than the {DEFAULT_NUM_CPUS_PER_TASK:g} CPU a Ray Data "
            f"read task reserves, so training would wait for its data forever; lower train.cpus_per_worker "
            f"or add a node with CPUs")
