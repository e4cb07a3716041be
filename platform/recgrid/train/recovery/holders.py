"""In-memory snapshots on the nodes' holders: copies of every shard kept outside the sharding
group's run, for the one case where no live peer group can heal a rebuilt group: a job of one
sharding group (M = 1), whose run Ray Train restarts on a failure (with M >= 2 a rebuilt group
heals from a live peer, `train.recovery.peers`, and no snapshot is taken).

- `SnapshotHolder`, one per node (created on the node it serves by the job's recovery coordinator,
  which the driver owns, so no worker's death takes it along; mind Ray's ownership rule: an object
  a worker puts dies with that worker): it keeps the snapshot generations handed to it by the
  workers of its node, at most two (the newest complete one and the one being written). A shard
  copy lives in one of two shared-memory slot files per shard position that the holder owns
  (`train.recovery.slots`). The small parts (dense part, progress, NE windows), and the shards
  too where /dev/shm is missing or too small, go through the object store and are copied out by
  the holder.
- `Snapshotter`, on every worker: owns the cadence. The loop calls `maybe_snapshot(step)` after
  every step, and at every snapshot point (a sync step, every `train.snapshot_every_syncs` blocks
  of K steps) each node's holder receives the copy of every shard position held on that node,
  plus the dense part and the progress. What a snapshot carries is the trainer's one state
  inventory (`Trainer.snapshot()`: the shard, the dense part, the progress with the data cursor,
  the NE window); nothing here assembles state of its own. A generation is complete when the live
  holders together have every shard position 0..L-1, the dense part and the progress
  (`plan_restore`).
- `HolderRestore`, on every worker of a rebuilt group: each worker takes its shard position from
  its own node's holder if it has one, else from a holder on another node; no storage read. A
  holder records each copy's checksum (`slots.digest`) as it arrives, and before a restore uses a
  generation its copies are checked against it: a copy whose bits changed since (a corrupted slot
  file) is dropped, the restore's detail and the run's event say which, and the plan is made
  without it (another node's copy, an older generation, else the storage checkpoint). After the
  load each worker's restored shard is checked against the same checksum, bit for bit.

Work lost is at most the steps since the last snapshot (K steps with snapshots at every sync).
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from recgrid.train.control import LazyActor
from recgrid.train.recovery.slots import (SnapshotDirRefused, allocate_slot_files, array_view, digest,
                                          make_node_dir, map_slot, read_slot, remove_node_dir, shard_layout,
                                          slot_files, snapshot_dir, tensor_view, write_into)

if TYPE_CHECKING:
    import torch

    from recgrid.engine.grid import Grid, GridGroups
    from recgrid.train.trainer import Trainer

KEEP_GENERATIONS = 2  # the newest complete generation and the one being written


def plan_restore(inventories: dict[str, dict[int, list[str]]], group_size: int,
                 lost: Sequence[str] = ()) -> dict[str, Any]:
    """The newest generation that `inventories` (node -> step -> keys held) hold completely for a
    sharding group of L = `group_size` shard positions: every "shard/<j>" (j < L), "dense" and
    "progress"; where each key is (a node's own copy first for its workers), and otherwise what the
    newest generation misses (for the log)."""
    needed = [f"shard/{j}" for j in range(group_size)] + ["dense", "progress"]
    steps = sorted({s for inv in inventories.values() for s in inv}, reverse=True)
    missing_newest: list[str] = needed
    for step in steps:
        where = {k: sorted(n for n, inv in inventories.items() if k in inv.get(step, [])) for k in needed}
        missing = [k for k, nodes in where.items() if not nodes]
        if step == steps[0]:
            missing_newest = missing
        if not missing:
            held = {k for inv in inventories.values() for k in inv.get(step, [])}
            windows = {k: sorted(n for n, inv in inventories.items() if k in inv.get(step, []))
                       for k in sorted(k for k in held if k.startswith("window/"))}
            return {"step": step, "where": where, "windows": windows, "lost_nodes": list(lost)}
    return {"step": None, "missing": missing_newest, "lost_nodes": list(lost), "generations": steps}


class SnapshotHolderImpl:
    """One node's in-memory snapshots: generation (step) -> key -> what holds the payload.

    Keys: "shard/<j>" (shard position j: a list of arrays), "dense" (name -> array), "progress"
    (the job's progress), "window/<rank>" (a worker's NE window). A shard is
    normally in one of the key's two slot files, which this holder owns and the sender wrote in place
    (`reserve` / `commit`; held as {"path", "slot", "layout"}). Every other payload, and a shard
    when there is no room in shared memory, arrives as a view of an object the sending worker
    owns and is copied, once, into an object of this holder's (`ray.put` here; held as [ref]):
    it outlives the sender, stays in the node's shared-memory object store, and a restoring
    worker on this node maps it without another copy through this process.
    """

    def __init__(self, node_id: str, run_id: str = "local") -> None:
        self.node_id, self.run_id = node_id, run_id
        self.generations: dict[int, dict[str, Any]] = {}
        # (step, key) -> the payload's checksum as it arrived (`digest`): a restore checks the copy against it
        self.digests: dict[tuple[int, str], str] = {}
        self._lock = threading.Lock()  # the workers of a node put at once
        self.problem: str | None = None  # why this holder keeps no slot files (for the job's log)
        self.swept: list[str] = []
        self.root = self._make_root()

    def _make_root(self) -> str | None:
        """This holder's directory for slot files (`slots.make_node_dir`). None (snapshots through
        the object store): no usable shared memory, or a path that is not this job's own (a link,
        another user's or another job's directory: refused, left untouched; `problem` says which)."""
        try:
            root, self.swept = make_node_dir(self.run_id, self.node_id)
        except SnapshotDirRefused as e:
            self.problem = str(e)
            print(f"[recgrid] {e}", file=sys.stderr, flush=True)
            return None
        except OSError as e:
            self.problem = (f"{snapshot_dir(self.run_id, self.node_id)}: cannot make this node's snapshot directory "
                            f"({e}); snapshots go through the object store")
            return None
        return root

    def why_no_shared_memory(self) -> str | None:
        """Why this holder keeps no slot files, when it was refused a directory (None: it has one, or no /dev/shm)."""
        return self.problem

    def _admit(self, step: int) -> bool:
        """Make room for generation `step` (keeping at most KEEP_GENERATIONS, itself included);
        False for a step older than everything kept (a stale writer: nothing to keep). Under the lock."""
        if step not in self.generations:
            if self.generations and step < min(self.generations) and len(self.generations) >= KEEP_GENERATIONS:
                return False
            self.generations[step] = {}
            for old in sorted(self.generations)[:-KEEP_GENERATIONS]:
                self._drop(old)
        return True

    def put(self, step: int, key: str, payload: Any) -> None:
        import ray

        checksum = digest(_arrays(payload))  # of the bits as they arrived, before the copy
        payload = [ray.put(payload)]  # the copy, owned here, outside the lock (a list: kept a reference)
        with self._lock:
            if self._admit(step):
                self.generations[step][key] = payload
                self.digests[(step, key)] = checksum

    def reserve(self, step: int, key: str, nbytes: int) -> dict[str, Any] | None:
        """A shared-memory slot file of `nbytes` for `key` at generation `step`: the one of the
        key's two slots that no other kept generation uses. None: write through the object store
        (no usable /dev/shm, not enough room in it, or a stale step)."""
        with self._lock:
            if self.root is None or not self._admit(step):
                return None
            used = {p["slot"] for s, g in self.generations.items() if s != step
                    for k, p in g.items() if k == key and isinstance(p, dict)}
            free = sorted({0, 1} - used)
            if not free:  # cannot happen with two generations kept; the object store then
                return None
            paths = self._allocate(key, nbytes)
            return None if paths is None else {"path": paths[free[0]], "slot": free[0]}

    def allocate(self, key: str, nbytes: int) -> list[str] | None:
        """Both slot files of `key`, of `nbytes` each, created now where missing (a writer maps
        them before training, so no snapshot pays for the pages). None: no room in shared memory."""
        with self._lock:
            return self._allocate(key, nbytes)

    def _allocate(self, key: str, nbytes: int) -> list[str] | None:
        return None if self.root is None else allocate_slot_files(self.root, key, nbytes)

    def commit(self, step: int, key: str, slot: dict[str, Any], layout: list) -> None:
        """The writer finished the slot file it reserved: generation `step` now has `key`, and its
        checksum as written (off the writer's clock: the writer waits for it only at its next snapshot)."""
        checksum = digest(read_slot(slot["path"], layout))
        with self._lock:
            if step in self.generations:  # else dropped meanwhile (a restore went back before it)
                self.generations[step][key] = {**slot, "layout": layout}
                self.digests[(step, key)] = checksum

    def put_many(self, step: int, payload: dict[str, Any]) -> None:
        for key, value in payload.items():
            self.put(step, key, value)

    def inventory(self) -> dict[int, list[str]]:
        return {step: sorted(keys) for step, keys in self.generations.items()}

    def get(self, step: int, key: str) -> Any:
        """[the payload's object ref] (in a list, so the caller fetches it straight from the store),
        or for a shard in a slot file {"path", "slot", "layout"} (a worker on this node maps it)."""
        return self.generations[step][key]

    def fetch(self, step: int, key: str) -> list:
        """[an object ref to a payload's arrays] (a worker on another node: the store moves it there)."""
        import ray

        return [ray.put(self._payload(step, key))]

    def _payload(self, step: int, key: str) -> Any:
        import ray

        held = self.generations[step][key]
        return read_slot(held["path"], held["layout"]) if isinstance(held, dict) else ray.get(held[0])

    def digest_of(self, step: int, key: str) -> str:
        """The checksum a held payload had when it arrived (the restore's bit-for-bit check of what it loaded)."""
        return self.digests[(step, key)]

    def verify(self, step: int, keys: Sequence[str]) -> dict[str, str]:
        """Check the held copies of `keys` at generation `step` against the checksums they arrived
        with; a copy whose bits changed since (a corrupted slot file) is dropped from the generation,
        so no restore uses it. Returns {key: why} for the copies dropped."""
        bad = {}
        for key in keys:
            if key not in self.generations.get(step, {}):
                continue
            got, want = digest(_arrays(self._payload(step, key))), self.digests.get((step, key))
            if got != want:
                bad[key] = f"{key}@{step} on node {self.node_id[:12]}: checksum {got}, {want} when it was written"
        with self._lock:
            for key in bad:
                self.generations.get(step, {}).pop(key, None)
                self.digests.pop((step, key), None)
        return bad

    def drop_after(self, step: int) -> None:
        """Forget generations newer than `step` (the restore point): a restarted job writes them anew."""
        with self._lock:
            for s in [s for s in self.generations if s > step]:
                self._drop(s)

    def nbytes(self) -> int:
        """Bytes held: the kept generations' payloads (a slot file counts while a generation uses it)."""
        return sum(int(a.nbytes) for s, g in self.generations.items() for k in g for a in _arrays(self._payload(s, k)))

    def files(self) -> list[str]:
        """The slot files on disk (at most two per shard position of this node)."""
        return slot_files(self.root)

    def close(self) -> None:
        """Forget everything and delete the slot files (the job is over)."""
        with self._lock:
            self.generations.clear()
            self.digests.clear()
            if self.root is not None:
                remove_node_dir(self.root, self.run_id)

    def _drop(self, step: int) -> None:
        self.generations.pop(step, None)  # its slot files stay, for the next generation to reuse
        for k in [k for k in self.digests if k[0] == step]:
            del self.digests[k]


def _arrays(payload: Any) -> list[np.ndarray]:
    if isinstance(payload, np.ndarray):
        return [payload]
    if isinstance(payload, dict):
        return [a for k in sorted(payload) for a in _arrays(payload[k])]
    if isinstance(payload, (list, tuple)):
        return [a for v in payload for a in _arrays(v)]
    return []


SnapshotHolder = LazyActor(SnapshotHolderImpl)


# ---- on every worker ------------------------------------------------------------------------------------
class _WorkerSide:
    """What a worker's snapshotter and its recovery share: the job's actors and where it sits.

    Args:
        coordinator: the job's RecoveryCoordinator (None: no in-memory copies, e.g. local runs).
        grid, groups: this attempt's grid and this worker's process groups.
        nodes: node id of every rank of the grid.
        attempt: this attempt's number.
    """

    def __init__(self, coordinator: Any, grid: "Grid", groups: "GridGroups", nodes: Sequence[str], attempt: int) -> None:
        self.coordinator, self.grid, self.groups, self.nodes, self.attempt = coordinator, grid, groups, list(nodes), attempt
        self.rank = groups.coords.rank
        self.node = self.nodes[self.rank]
        self._holder: Any = None

    @property
    def holder(self) -> Any:
        """This node's holder."""
        import ray

        if self._holder is None:
            self._holder = ray.get(self.coordinator.holder_for.remote(self.node))
        return self._holder


class Snapshotter(_WorkerSide):
    """A worker's in-memory snapshots: every `every_syncs` replica syncs (every K steps when
    M = 1; 0: none) it hands its share of the trainer's state (`Trainer.snapshot`) to its node's
    holder. It owns that cadence: the loop calls `maybe_snapshot(step)` after every step.
    `say(line)`, if given, tells the job's log why a node's holder keeps no slot files (it was
    refused its directory: `SnapshotHolderImpl`), from one worker per node."""

    def __init__(self, trainer: "Trainer", coordinator: Any, grid: "Grid", groups: "GridGroups",
                 nodes: Sequence[str], attempt: int, every_syncs: int, say: Any = None) -> None:
        super().__init__(coordinator, grid, groups, nodes, attempt)
        self.trainer, self.every_syncs, self.say = trainer, every_syncs, say
        self._inflight: list[Any] = []
        self._maps: dict[str, Any] = {}  # slot file path -> (mmap, uint8 tensor over it), kept mapped
        self.snapshots = 0
        if self.enabled:
            self.prepare()  # shared-memory slots for this worker's snapshots, before any step

    @property
    def enabled(self) -> bool:
        return self.coordinator is not None and self.every_syncs > 0

    def due(self, step: int) -> bool:
        from recgrid.engine.sync import sync_step

        K = self.trainer.config.sync_every
        return self.enabled and sync_step(step, K) and (step // K) % self.every_syncs == 0

    def maybe_snapshot(self, step: int) -> None:
        if self.due(step):
            with self.trainer.metrics.timer.phase("snapshot"):
                self.snapshot()

    # ---- what this worker sends ---------------------------------------------------------------------
    def sends_shard(self) -> bool:
        """Whether this worker hands its node's holder the copy of its shard position: the first
        sharding group with that position on this node does."""
        g, c = self.grid, self.groups.coords
        here = [i for i in range(g.num_groups) if self.nodes[g.global_rank(i, c.shard_rank)] == self.node]
        return c.sharding_group == min(here)

    def sends_job_state(self) -> bool:
        """Whether this worker hands its node's holder the dense part and the progress: the lowest rank on the node."""
        return self.rank == min(r for r in range(self.grid.world_size) if self.nodes[r] == self.node)

    def snapshot(self) -> None:
        """Hand this worker's share of the state to its node's holder (collective: every worker of
        the grid calls it at the same step). Returns once the copies are in the object store;
        the holder copies them out while training goes on."""
        import ray

        snap = self.trainer.snapshot(copy=False)  # views: copied below, before the next step
        step = snap.progress["step"]
        self._settle()
        # every worker's own NE window (a few KiB; the restore sums them)
        payload: dict[str, Any] = {f"window/{self.rank}": snap.window.numpy()}
        c = self.groups.coords
        position = snap.shard
        if self.sends_shard():
            key = f"shard/{c.shard_rank}"
            if not self._write_slot(step, key, position):
                payload[key] = [array_view(t) for t in position]
        if self.sends_job_state():
            payload["dense"] = {k: v.numpy() for k, v in snap.dense.items()}
            payload["progress"] = {"progress": snap.progress}
        # one copy into the object store, now (the step may change the tensors next), and one call
        self._inflight.append(self.holder.put_many.remote(step, ray.put(payload)))
        self.snapshots += 1

    def prepare(self) -> None:
        """Before training: have the node's holder create this worker's two slot files (when it
        sends its shard position's copy) and map them here, so snapshots only copy."""
        import ray

        if self.say is not None and self.sends_job_state():  # one worker per node says why its holder has no files
            problem = ray.get(self.holder.why_no_shared_memory.remote())
            if problem:
                self.say(problem)
        if not self.sends_shard():
            return
        _, nbytes = shard_layout(self.trainer.shard_tensors())
        for path in ray.get(self.holder.allocate.remote(f"shard/{self.groups.coords.shard_rank}", nbytes)) or []:
            self._map(path, nbytes)

    def _map(self, path: str, nbytes: int) -> "torch.Tensor":
        """The slot file at `path` as a writable uint8 tensor (mapped once per attempt)."""
        if path not in self._maps or self._maps[path][1].numel() != nbytes:
            self._maps[path] = map_slot(path, nbytes)
        return self._maps[path][1]

    def _write_slot(self, step: int, key: str, tensors: Sequence["torch.Tensor"]) -> bool:
        """Copy `tensors` into a slot file the node's holder reserves for them, and commit it.
        False: the holder has no room in shared memory (the caller uses the object store)."""
        import ray

        layout, nbytes = shard_layout(tensors)
        slot = ray.get(self.holder.reserve.remote(step, key, nbytes))
        if slot is None:
            return False
        write_into(self._map(slot["path"], nbytes), tensors, layout)
        self._inflight.append(self.holder.commit.remote(step, key, slot, layout))
        return True

    def _settle(self) -> None:
        """Wait for the previous snapshot's copies (memory stays bounded by two generations)."""
        import ray

        if self._inflight:
            ray.get(self._inflight)
            self._inflight = []

    def close(self) -> None:
        self._settle()


class HolderRestore(_WorkerSide):
    """A worker's side of a restore from the holders: a sharding group rebuilt with no live peer
    group to heal from (M = 1) loads the newest complete generation they hold (`load`, its plan
    from `RecoveryCoordinatorImpl.restore_plan`) and checks it bit for bit (`verify`);
    `train.recovery.storage.StorageFallback` decides when."""

    def load(self, trainer: "Trainer", plan: dict[str, Any]) -> dict[str, Any]:
        """Fetch this worker's shard position, the dense part and the progress from the holders
        (this node's first) and load them. Returns where the shard came from."""
        import ray
        import torch

        step, where = plan["step"], plan["where"]
        chosen: dict[str, str] = {}
        via: dict[str, str] = {}  # how each payload came: "shared memory" (a slot file) or "object store"

        def fetch(key: str) -> Any:
            nodes = where[key]
            chosen[key] = self.node if self.node in nodes else nodes[0]
            holder = ray.get(self.coordinator.holder_for.remote(chosen[key]))
            held = ray.get(holder.get.remote(step, key))
            if isinstance(held, dict):  # a slot file: mapped here on its node, else sent through the store
                if chosen[key] == self.node:
                    via[key] = "shared memory"
                    return read_slot(held["path"], held["layout"])
                held = ray.get(holder.fetch.remote(step, key))
            via[key] = "object store"
            return ray.get(held[0])  # mapped from this node's object store (moved here if it lives elsewhere)

        key = f"shard/{self.groups.coords.shard_rank}"
        shard, dense, progress = fetch(key), fetch("dense"), fetch("progress")
        window = None
        if self.rank == 0:  # the NE window: the sum of every surviving worker's (a metric, not the model)
            where.update(plan.get("windows", {}))
            windows = [fetch(k) for k in plan.get("windows", {})]
            window = torch.from_numpy(np.sum(windows, axis=0)) if windows else None
        from recgrid.train.trainer import Snapshot

        trainer.load_snapshot(Snapshot(shard=[tensor_view(a) for a in shard],
                                       dense={k: tensor_view(v) for k, v in dense.items()},
                                       progress=progress["progress"], window=None), window)
        return {"key": key, "node": chosen[key], "via": via[key]}

    def verify(self, trainer: "Trainer", step: int, fetched: dict[str, Any]) -> dict[str, Any]:
        """This worker's restored shard checksum beside the one the holder's copy was written with:
        bit for bit or an error."""
        import ray

        holder = ray.get(self.coordinator.holder_for.remote(fetched["node"]))
        held = ray.get(holder.digest_of.remote(step, fetched["key"]))
        got = digest([array_view(t) for t in trainer.shard_tensors()])
        if got != held:
            raise RuntimeError(f"{fetched['key']} restored from node {fetched['node']} differs from the copy held "
                               f"there ({got} != {held})")
        return {"rank": self.rank, "shard": self.groups.coords.shard_rank, "digest": got, "source_digest": held,
                "from_node": fetched["node"], "same_node": fetched["node"] == self.node, "via": fetched["via"]}

