"""Where the workers go: what the job asks Ray for, what the cluster's nodes can hold, and the
record of where every rank ran.

Every sharding group is a Ray Train run of its own (2.60: one placement group of L equal bundles
under one placement strategy), and Ray places each run on its own, on the nodes alive when it
starts or restarts. So the job asks each run for the strategy its layout wants of one group
(`GROUP_RUN_PLACEMENT`): inter-host packs the group's L workers onto as few nodes as hold them,
host-local spreads them one per node. Which nodes the M runs share is not fixed by this: a
per-worker `label_selector` naming node ids would be, but it is fixed for the run's life, so a
run restarted after a node loss would wait for the dead node.

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
