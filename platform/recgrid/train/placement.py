"""Where the workers go: what the job asks Ray for, what the cluster's nodes can hold, and the
record of where every rank ran.

Ray Train (2.60) asks for one placement group of T equal bundles (one per worker) under one
placement strategy, and numbers ranks contiguously per node in the order the nodes first appear
among the bundles. Its public API has no bundle shape per layout that would survive a restart:
a per-worker `label_selector` naming node ids is fixed for the job's life, so after a node
loss the restarted workers would wait for the dead node. So the job asks for the strategy whose
placement the layout needs (`PLACEMENT_STRATEGY`), which Ray applies afresh to every attempt on
the nodes then alive:

- host-local: PACK fills a node before the next, so with room for a multiple of M workers on
  each node every replica group sits on one node;
- inter-host: SPREAD puts the bundles on distinct nodes round-robin, however few CPUs each
  asks for; with M nodes that can hold workers (or a multiple of M, with room for L workers per
  sharding group) every sharding group sits on nodes of its own.

Before any worker starts the driver refuses a cluster that cannot give the layout
(`Grid.check_cluster` on `cluster_slots`); every attempt's workers check where they really
landed (`Grid.check_placement`, with `usable_nodes` of the cluster) and fail with a sentence
instead of training on a layout that does not hold.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from recgrid.engine.grid import GridError

PLACEMENT_STRATEGY = {"host-local": "PACK", "inter-host": "SPREAD"}
"""Ray placement strategy that gives each layout (see the module docstring)."""

GROUP_RUN_PLACEMENT = {"host-local": "SPREAD", "inter-host": "PACK"}
"""The same for one sharding group's run (train.fault_tolerance=torchft: a Ray Train run per
sharding group): inter-host packs the group's L workers onto as few nodes as hold them,
host-local spreads them one per node. Ray places each run on its own, so which nodes the M
runs share is not fixed by this."""

RANKS_ARTIFACT = "grid/ranks.json"


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


def usable_nodes() -> int:
    """How many alive nodes of the cluster could hold a worker like the calling one (asking
    what Ray assigned it). Call on a Ray Train worker."""
    import ray

    mine = ray.get_runtime_context().get_assigned_resources()
    return sum(1 for s in cluster_slots(mine).values() if s > 0)


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


def free_cpus() -> float:
    """CPUs no task or actor holds now, over the alive nodes of the connected cluster."""
    import ray

    return float(ray.available_resources().get("CPU", 0.0))
