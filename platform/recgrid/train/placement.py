"""Where the workers go: what the job asks Ray for, what the cluster's nodes can hold, and the
record of where every rank ran.

Every sharding group is a Ray Train run of its own (2.60: one placement group of L equal bundles
under one placement strategy), and Ray places each run on its own, on the nodes alive when it
starts or restarts. So the job asks each run for the strategy its layout wants of one group
(`GROUP_RUN_PLACEMENT`): inter-host packs the group's L workers onto as few nodes as hold them,
host-local spreads them one per node.

Host-local also needs the M runs to agree: shard position s of every group on one node (replica
group s together, where its sync is fast). The driver fixes that with a per-worker label
selector on Ray's node id label (`ScalingConfig.label_selector`: bundle s, hence shard rank s, on
`host_local_nodes(...)[s][g]`). A selector is fixed for the run's life, so when a node named in
it is gone (which, host-local, took every copy of its shards: every group restores from storage
anyway), the driver ends the runs and starts them again with selectors over the live nodes
(`launch.ray`). Where the cluster cannot hold every replica group whole (an elastic job started
on less room) the runs are not pinned: Ray spreads each group, and replica groups may straddle
nodes.

Before any worker starts the driver refuses a cluster that cannot give the layout
(`Grid.check_cluster` on `cluster_slots`) or would leave Ray Data's read tasks no CPU
(`check_room_for_data`). `grid/ranks.json` records where every process of the job ran.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from recgrid.engine.grid import GridError

GROUP_RUN_PLACEMENT = {"host-local": "SPREAD", "inter-host": "PACK"}
"""Ray placement strategy of one sharding group's run, per layout (the module docstring)."""

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


def label_selectors(nodes_of: list[list[str]], group: int) -> list[dict[str, str]]:
    """Sharding group `group`'s run's per-worker label selectors for `host_local_nodes`' answer."""
    return [{NODE_ID_LABEL: position[group]} for position in nodes_of]


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


def cluster_slots(per_worker: Mapping[str, float]) -> dict[str, int]:
    """`node_slots` of the connected Ray cluster."""
    import ray

    return node_slots(ray.nodes(), per_worker)


def rank_records(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`[{"attempt", "rank", "node", "pid"}, ...]` of every registered worker of every attempt
    (`attempts`: the job-control record, per attempt `{"world_size", "workers": {rank: {"pid", "node"}}}`)."""
    return [{"attempt": a, "rank": int(rank), "node": w["node"], "pid": w["pid"]}
            for a, attempt in enumerate(attempts) for rank, w in sorted(attempt["workers"].items())]


def record_ranks(run_id: str | None, tracking_uri: str | None, attempts: list[dict[str, Any]]) -> None:
    """Write the run's `grid/ranks.json` (every attempt so far: which process on which node is
    which rank) and its param `derived.nodes`: the distinct nodes the first attempt whose workers
    all registered ran on. Called once an attempt's workers are all in; rewrites the file."""
    if not run_id:
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    client.log_text(run_id, json.dumps(rank_records(attempts), indent=1), RANKS_ARTIFACT)
    first = next(a for a in attempts if len(a["workers"]) == a["world_size"])
    client.log_param(run_id, "derived.nodes", len({w["node"] for w in first["workers"].values()}))


def check_room_for_data(free_cpus: float, what: str) -> None:
    """Refuse a cluster whose free CPUs cannot run one Ray Data read task: every batch comes out of
    those tasks, so training would wait for its data forever. `what` says who holds the CPUs."""
    from recgrid.data.stream import DEFAULT_NUM_CPUS_PER_TASK

    if free_cpus + 1e-9 < DEFAULT_NUM_CPUS_PER_TASK:
        raise GridError(
            f"{what}, leaving {free_cpus:g} CPU free, less than the {DEFAULT_NUM_CPUS_PER_TASK:g} CPU a Ray Data "
            f"read task reserves, so training would wait for its data forever; lower train.cpus_per_worker "
            f"or add a node with CPUs")
