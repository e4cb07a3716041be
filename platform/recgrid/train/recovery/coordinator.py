"""The job's recovery record: one actor (`RecoveryCoordinator`), owned by the driver on its node,
that outlives every sharding group's run. It keeps the hosts' snapshot holders (one per host,
created there on first use), makes the restore plan from what the live ones hold and says how
much each keeps (`train.recovery.holders`), lists the storage checkpoints written (`train.recovery.storage`), and
keeps the recovery events in order, as the rebuilt groups record them and the logging worker logs
them into the run (`train.recovery.events`). Attempts, heartbeats and the stop flag are job
control's (`train.control`).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from recgrid.train.checkpoint import checkpoint_step, is_complete
from recgrid.train.control import LazyActor
from recgrid.train.recovery.holders import SnapshotHolder, plan_restore


class RecoveryCoordinatorImpl:
    """The job's recovery bookkeeping (one actor, owned by the driver): the holders, the restore
    plan, the storage checkpoints written and the recovery events. Attempts, heartbeats and the
    stop flag are job control's (`train.control`)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._lock = threading.Lock()
        self._planning = threading.Lock()  # one restore plan at a time (`restore_plan`)
        self.holders: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []  # restores, in order
        self.checkpoints: list[tuple[int, str]] = []  # storage checkpoints written, (step, path)

    # ---- holders ------------------------------------------------------------------------------
    def holder_for(self, node_id: str) -> Any:
        """The holder on `node_id`, created there on first use."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self._lock:  # the workers of a node ask at once: one holder per node
            if node_id not in self.holders or not self._alive(node_id):
                self.holders[node_id] = SnapshotHolder.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
                ).remote(node_id, self.run_id)
            return self.holders[node_id]

    def release(self) -> None:
        """The job is over: every live holder deletes its slot files."""
        import ray

        for holder in list(self.holders.values()):
            try:
                ray.get(holder.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead node's holder: its files went with it (or the driver removes them)
                pass

    def _alive(self, node_id: str) -> bool:
        import ray

        try:
            ray.get(self.holders[node_id].inventory.remote(), timeout=10)
            return True
        except Exception:  # noqa: BLE001 - a dead node's holder answers with an error or not at all
            return False

    def restore_plan(self, group_size: int) -> dict[str, Any]:
        """The newest generation the live holders together hold completely for a sharding group of
        L = `group_size` (`plan_restore`), where each key is, and which keys no
        live holder has (for the log when there is none). Every copy the plan names is first
        checked against the checksum it arrived with (`SnapshotHolderImpl.verify`); a corrupted
        one is dropped and the plan made again without it (another node's copy of the key, an
        older generation, else none: the storage checkpoint). `corrupt` says what was dropped."""
        with self._planning:  # the groups restoring at once plan one after another, over the same holders
            return self._restore_plan(group_size)

    def _restore_plan(self, group_size: int) -> dict[str, Any]:
        import ray

        lost: list[str] = []
        corrupt: list[str] = []
        while True:
            inventories: dict[str, dict[int, list[str]]] = {}
            for node, holder in list(self.holders.items()):
                try:
                    inventories[node] = ray.get(holder.inventory.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - the node is gone, and its copies with it
                    lost.append(node)
                    self.holders.pop(node, None)
            plan = plan_restore(inventories, group_size, lost)
            if plan["step"] is None:
                break
            keys: dict[str, list[str]] = {}
            for key, nodes in [*plan["where"].items(), *plan["windows"].items()]:
                for node in nodes:
                    keys.setdefault(node, []).append(key)
            found = ray.get([self.holders[n].verify.remote(plan["step"], ks) for n, ks in keys.items()], timeout=300)
            bad = [why for f in found for why in f.values()]
            if not bad:
                break
            corrupt += bad
        plan["corrupt"] = corrupt
        return plan

    def drop_after(self, step: int) -> None:
        import ray

        ray.get([h.drop_after.remote(step) for h in self.holders.values()], timeout=60)

    def holder_bytes(self) -> dict[str, int]:
        """Bytes each live host's holder keeps now (its own shard positions' copies and the ones
        it keeps for another host, over the generations it keeps)."""
        import ray

        out = {}
        for node, holder in list(self.holders.items()):
            try:
                out[node] = ray.get(holder.nbytes.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a lost host's holder: nothing kept there any more
                continue
        return out

    # ---- storage checkpoints and events ----------------------------------------------------------------
    def checkpoint_written(self, step: int, path: str) -> None:
        self.checkpoints.append((step, path))

    def latest_checkpoint(self, candidates: Sequence[str | None] = ()) -> str | None:
        """The newest storage checkpoint: recorded here, or among `candidates` (Ray Train's own)."""
        found = list(self.checkpoints) + [(checkpoint_step(c) or -1, c) for c in candidates if c]
        done = sorted((s, p) for s, p in found if is_complete(p))
        return done[-1][1] if done else None

    def record(self, event: dict[str, Any]) -> int:
        self.events.append(event)
        return len(self.events) - 1

    def update_event(self, index: int, fields: dict[str, Any]) -> None:
        self.events[index].update(fields)

    def status(self) -> dict[str, Any]:
        return {"events": self.events, "holders": sorted(self.holders),
                "checkpoints": [p for _, p in self.checkpoints]}


RecoveryCoordinator = LazyActor(RecoveryCoordinatorImpl)
