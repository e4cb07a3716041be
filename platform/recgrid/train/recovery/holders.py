"""In-memory snapshots on the hosts' holders: copies of every shard position kept outside the
sharding groups' runs, for when no live peer group can heal a rebuilt group (every group lost a
worker at once: a host loss under host-local, any failure at M = 1). One design at any M; the
protocol is docs/design-notes.md's "Failures, restarts and elastic jobs".

- `SnapshotHolder`, one per host (made there by the job's recovery coordinator, which the driver
  owns, so no worker's death takes it along): the newest generations handed to it (at most two:
  the newest complete one and the one being written), of its own host's shard positions, in
  shared-memory slot files (`train.recovery.slots`), and of one other host's, whose holder
  forwards every copy it receives (`keep`), so a lost host's positions survive on the next.
- `Snapshotter`, on every worker: at a committed replica sync the live group of quorum rank 0
  hands each host's holder its share of the trainer's state (`Trainer.snapshot()`: the shards,
  the dense part, the progress, the NE windows), as often as its cadence says (`SnapshotCadence`).
- `HolderRestore`, on every worker of a group that found nobody ahead of step 0: its shard
  position from the newest complete generation, this host's holder first, checked bit for bit.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from recgrid.config import SnapshotCadence
from recgrid.engine.device import HostCopy, pin_host_memory
from recgrid.train.control import LazyActor
from recgrid.train.recovery.slots import (SnapshotDirRefused, allocate_slot_files, array_view, digest,
                                          make_node_dir, map_slot, read_slot, remove_node_dir, shard_layout,
                                          slot_files, snapshot_dir, tensor_view, write_into)

if TYPE_CHECKING:
    import torch

    from recgrid.engine.grid import Grid, GridGroups
    from recgrid.train.job import WorkerJob
    from recgrid.train.trainer import Trainer

KEEP_GENERATIONS = 2  # the newest complete generation and the one being written
KEEP_TIMEOUT_S = 120  # how long a holder waits for the other host's holder to keep its copy


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
            return {"step": step, "where": where, "windows": windows, "lost_nodes": list(lost), "generations": steps}
    return {"step": None, "missing": missing_newest, "lost_nodes": list(lost), "generations": steps}


def ring_keeper(nodes: Sequence[str], node: str) -> str | None:
    """The host whose holder keeps a copy of `node`'s: the next of `nodes` (the hosts the
    snapshots come from) in sorted order, around the ring; None on one host (no other to keep it)."""
    ring = sorted(set(nodes))
    if len(ring) < 2:
        return None
    return ring[(ring.index(node) + 1) % len(ring)]


class SnapshotHolderImpl:
    """One host's in-memory snapshots: generation (step) -> key -> what holds the payload.

    Keys: "shard/<j>" (shard position j: a list of arrays), "dense" (name -> array), "progress"
    (the job's progress), "window/<rank>" (a worker's NE window). A shard of this host is
    normally in one of the key's two slot files, which this holder owns and the sender wrote in
    place (`commit`; held as {"path", "slot", "layout"}). Every other payload, a shard when there
    is no room in shared memory, and the copies another host's holder forwards (`keep`) are
    copied, once, into objects of this holder's (`ray.put` here; held as [ref]): they outlive the
    sender and stay in this host's object store. What arrives from a worker of this host is
    forwarded to `keeper` (the holder of the host that keeps this one's copies), if one is named.
    """

    def __init__(self, node_id: str, run_id: str = "local") -> None:
        self.node_id, self.run_id = node_id, run_id
        self.generations: dict[int, dict[str, Any]] = {}
        # (step, key) -> the payload's checksum as it arrived (`digest`): a restore checks the copy against it
        self.digests: dict[tuple[int, str], str] = {}
        self.origins: dict[tuple[int, str], str] = {}  # (step, key) -> the host a kept copy came from
        self.sizes: dict[tuple[int, str], int] = {}  # (step, key) -> bytes held
        self._lock = threading.Lock()  # the workers of a host put at once
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

    def _hold(self, step: int, key: str, held: Any, checksum: str, nbytes: int, origin: str | None = None) -> bool:
        with self._lock:
            if not self._admit(step):
                return False
            self.generations[step][key] = held
            self.digests[(step, key)], self.sizes[(step, key)] = checksum, nbytes
            if origin is not None:
                self.origins[(step, key)] = origin
            return True

    def put(self, step: int, key: str, payload: Any, keeper: Any = None) -> None:
        import ray

        arrays = _arrays(payload)
        checksum = digest(arrays)  # of the bits as they arrived, before the copy
        held = [ray.put(payload)]  # the copy, owned here, outside the lock (a list: kept a reference)
        if self._hold(step, key, held, checksum, sum(int(a.nbytes) for a in arrays)):
            self._forward(keeper, step, key, held, checksum)

    def _forward(self, keeper: Any, step: int, key: str, held: list, checksum: str) -> None:
        """Have `keeper` keep a copy, and wait until it has (so a writer that waits for this call
        knows its snapshot is on two hosts: the next one starts only then). A keeper that cannot
        (its host is gone) is said, not raised: this host's copy stands."""
        import ray

        if keeper is None:
            return
        try:
            ray.get(keeper.keep.remote(step, key, held, checksum, self.node_id), timeout=KEEP_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the other host failed; the restore then finds what is left
            print(f"[recgrid] the copy of {key}@{step} for another host was not kept there: {type(e).__name__}",
                  file=sys.stderr, flush=True)

    def put_many(self, step: int, payload: dict[str, Any], keeper: Any = None) -> float:
        """Hold each of `payload`'s keys (`put`). Returns this holder process's CPU seconds so far,
        Ray's threads in it included (the writers' measure of what a snapshot costs the host:
        `Snapshotter.holder_s`)."""
        for key, value in payload.items():
            self.put(step, key, value, keeper)
        return time.process_time()

    def keep(self, step: int, key: str, held: list, checksum: str, origin: str) -> None:
        """Keep a copy of host `origin`'s payload `key` (its holder forwards everything its workers
        hand it): fetched here, checked against the checksum it had there, and held as this
        holder's own object (a copy that arrived changed is not kept: the restore then goes on
        without it, older generations or storage)."""
        import ray

        payload = ray.get(held[0])
        arrays = _arrays(payload)
        if digest(arrays) != checksum:
            print(f"[recgrid] the copy of {key}@{step} from node {origin[:12]} arrived changed; not kept",
                  file=sys.stderr, flush=True)
            return
        self._hold(step, key, [ray.put(payload)], checksum, sum(int(a.nbytes) for a in arrays), origin)

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

    def commit(self, step: int, key: str, slot: dict[str, Any], layout: list, keeper: Any = None) -> float:
        """The writer finished writing generation `step`'s `key` into one of the key's slot files:
        held, with its checksum as written (off the writer's clock: the writer waits for it only at
        its next snapshot), and a copy goes to `keeper`, if named. A kept generation whose copy of
        `key` was in that slot file lost it (overwritten). Returns the process's CPU seconds, as
        `put_many` does."""
        import ray

        arrays = read_slot(slot["path"], layout)
        checksum = digest(arrays)
        with self._lock:
            for s, g in self.generations.items():
                if s != step and isinstance(g.get(key), dict) and g[key]["slot"] == slot["slot"]:
                    del g[key]
            if not self._admit(step):
                return time.process_time()
            self.generations[step][key] = {**slot, "layout": layout}
            self.digests[(step, key)] = checksum
            self.sizes[(step, key)] = sum(int(a.nbytes) for a in arrays)
        if keeper is not None:  # the copy for another host only (a host alone keeps none)
            self._forward(keeper, step, key, [ray.put(arrays)], checksum)
        return time.process_time()

    def inventory(self) -> dict[int, list[str]]:
        return {step: sorted(keys) for step, keys in self.generations.items()}

    def get(self, step: int, key: str) -> Any:
        """[the payload's object ref] (in a list, so the caller fetches it straight from the store),
        or for a shard in a slot file {"path", "slot", "layout"} (a worker on this host maps it)."""
        return self.generations[step][key]

    def origin_of(self, step: int, key: str) -> str:
        """The host a held payload came from: this one, or the host whose copy this holder keeps."""
        return self.origins.get((step, key), self.node_id)

    def fetch(self, step: int, key: str) -> list:
        """[an object ref to a payload's arrays] (a worker on another host: the store moves it there)."""
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
        """Bytes held: the kept generations' payloads, this host's and the copies kept for another."""
        with self._lock:
            return sum(self.sizes.get((s, k), 0) for s, g in self.generations.items() for k in g)

    def files(self) -> list[str]:
        """The slot files on disk (at most two per shard position of this host)."""
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
        for table in (self.digests, self.origins, self.sizes):
            for k in [k for k in table if k[0] == step]:
                del table[k]


def _arrays(payload: Any) -> list[np.ndarray]:
    if isinstance(payload, np.ndarray):
        return [payload]
    if isinstance(payload, dict):
        return [a for k in sorted(payload) for a in _arrays(payload[k])]
    if isinstance(payload, (list, tuple)):
        return [a for v in payload for a in _arrays(v)]
    return []


# every worker of a host may wait in a call of its holder while that holder's copy is kept on the next
# host, whose own workers' calls must still be served: threads for all of them
SnapshotHolder = LazyActor(SnapshotHolderImpl, max_concurrency=64)


# ---- on every worker ------------------------------------------------------------------------------------
class _WorkerSide:
    """What a worker's snapshotter and its recovery share: the job's actors and where it sits.

    Args:
        coordinator: the job's RecoveryCoordinator.
        grid, groups: the trainer's grid (its sharding group) and this worker's process groups.
        nodes: node id of every rank of the grid.
    """

    def __init__(self, coordinator: Any, grid: "Grid", groups: "GridGroups", nodes: Sequence[str]) -> None:
        self.coordinator, self.grid, self.groups, self.nodes = coordinator, grid, groups, list(nodes)
        self.rank = groups.coords.rank
        self.node = self.nodes[self.rank]
        self._holders: dict[str, Any] = {}

    def holder_on(self, node: str) -> Any:
        """The holder on `node` (asked of the coordinator once)."""
        import ray

        if node not in self._holders:
            self._holders[node] = ray.get(self.coordinator.holder_for.remote(node))
        return self._holders[node]

    @property
    def holder(self) -> Any:
        """This host's holder."""
        return self.holder_on(self.node)


class Snapshotter(_WorkerSide):
    """A worker's in-memory snapshots: at committed replica syncs where `cadence` says so, while its
    sharding group is the one that writes (`writes()`: the live group of quorum rank 0), it hands
    its share of the trainer's state (`Trainer.snapshot`) to its host's holder, which forwards a
    copy to the holder that keeps this host's (`ring_keeper`). The group's workers decide alike:
    `wants(step)` is this worker's vote at a sync step (the replica component agrees the votes over
    the group, `Replicas.agree`), and `maybe_snapshot(step)` (after every committed step) acts on
    the agreed one. A measured cadence takes the next snapshot when the syncs since the last are at
    least cost / (step_fraction x the sync interval's seconds), never fewer than 1 nor more than
    `max_syncs`. A snapshot's cost is this worker's time in it on the step's path plus its host's
    holder process's CPU seconds per snapshot (`holder_s`; its idle CPU included, an over-count),
    counted in full: on a host whose cores all train, the holder's CPU comes out of training.
    `say(line)`, if given, tells the job's log why a host's holder keeps no slot files, from one
    worker per host; `pin(step)`, if given, names each snapshot's step a restore point
    (`JobControl.pin`), from the group's shard rank 0."""

    def __init__(self, trainer: "Trainer", coordinator: Any, grid: "Grid", groups: "GridGroups",
                 nodes: Sequence[str], cadence: SnapshotCadence, writes: Any = None, agreed: Any = None,
                 say: Any = None, pin: Any = None) -> None:
        super().__init__(coordinator, grid, groups, nodes)
        self.trainer, self.cadence, self.say, self.pin = trainer, cadence, say, pin
        self.writes = writes or (lambda: True)
        self.agreed = agreed or (lambda name: True)  # the group's agreed vote at this step's commit
        self.keeper_node = ring_keeper(self.nodes, self.node)
        self._inflight: list[Any] = []
        self._copies: list[tuple[HostCopy, Any]] = []  # device copies issued, and what to commit when they land
        self._maps: dict[str, Any] = {}  # slot file path -> (mmap, uint8 tensor over it, undo of its pinning)
        self._slots: dict[str, list[str]] = {}  # key -> its two slot files (`prepare`)
        self._next_slot: dict[str, int] = {}  # key -> the slot its next snapshot writes (asked once, then alternating)
        self.snapshots, self.last_step = 0, None
        self.seconds: list[float] = []  # each snapshot's time on this worker's step path
        self.holder_s = 0.0  # the host's holder process's CPU seconds per snapshot, newest measure (`_settle`)
        self._holder_cpu: tuple[float, int] | None = None  # (the holder's CPU seconds, snapshots settled) then
        self._asked: tuple[Any, Any] = (None, None)  # `prepare`'s calls to the holder, answered at the first snapshot
        self._sync_at: float | None = None
        self._sync_s: float | None = None  # the newest sync interval's seconds (the cadence's measure)
        if self.enabled:
            self.prepare()  # shared-memory slots for this worker's snapshots, before any step

    @property
    def enabled(self) -> bool:
        return self.coordinator is not None and self.cadence.on

    # ---- the cadence ------------------------------------------------------------------------------
    def wants(self, step: int) -> bool:
        """This worker's vote, at sync step `step`, for a snapshot there."""
        now = time.perf_counter()
        if self._sync_at is not None:
            self._sync_s = now - self._sync_at
        self._sync_at = now
        if not self.enabled or not self.writes():
            return False
        schedule = self.trainer.schedule
        if not self.cadence.measured:
            return schedule.snapshot_sync(step)
        if self.last_step is None or not self.seconds or not self._sync_s:
            return self._sync_s is not None  # the first, once a sync interval is measured
        return schedule.syncs_between(self.last_step, step) >= self.syncs_apart()

    def syncs_apart(self) -> int:
        """Syncs between two snapshots of a measured cadence: the newest snapshot's cost (its time
        on the step's path and the holder's CPU for one) over `step_fraction` of the newest sync
        interval, in 1 .. `max_syncs`."""
        c = self.cadence
        cost = self.seconds[-1] + self.holder_s
        need = math.ceil(cost / (c.step_fraction * max(self._sync_s or 0.0, 1e-9)))
        return max(1, min(c.max_syncs, need))

    def maybe_snapshot(self, step: int) -> None:
        self._land()
        if self.enabled and self.trainer.schedule.syncs(step) and self.agreed("snapshot"):
            t0 = time.perf_counter()
            with self.trainer.metrics.timer.phase("snapshot"):
                self.snapshot()
            self.seconds.append(time.perf_counter() - t0)
            del self.seconds[:-8]
            self.last_step = step
            if self.pin is not None and self.groups.coords.shard_rank == 0:
                self.pin(step)

    # ---- what this worker sends ---------------------------------------------------------------------
    def sends_shard(self) -> bool:
        """Whether this worker hands its host's holder the copy of its shard position: the first
        sharding group of the grid with that position on this host does."""
        g, c = self.grid, self.groups.coords
        here = [i for i in range(g.num_groups) if self.nodes[g.global_rank(i, c.shard_rank)] == self.node]
        return c.sharding_group == min(here)

    def sends_job_state(self) -> bool:
        """Whether this worker hands its host's holder the dense part and the progress: the lowest rank on the host."""
        return self.rank == min(r for r in range(self.grid.world_size) if self.nodes[r] == self.node)

    def keeper(self) -> Any:
        """The holder that keeps a copy of this host's (None: one host, nowhere else to keep it)."""
        return None if self.keeper_node is None else self.holder_on(self.keeper_node)

    def snapshot(self) -> None:
        """Hand this worker's share of the state to its host's holder (every worker of the writing
        group calls it at the same step). Returns once the copies are issued: the shard's into its
        slot file (on CUDA without waiting for the device), the rest into the object store; the
        holders check and forward them while training goes on."""
        import ray

        self._prepared()
        snap = self.trainer.snapshot(copy=False)  # views: copied below, before the next step changes them
        step = snap.progress["step"]
        self._settle()
        keeper = self.keeper()
        # every worker's own NE window (a few KiB; the restore sums them)
        payload: dict[str, Any] = {f"window/{self.rank}": snap.window.cpu().numpy()}
        c = self.groups.coords
        if self.sends_shard():
            key = f"shard/{c.shard_rank}"
            if not self._write_slot(step, key, snap.shard, keeper):
                payload[key] = [array_view(t) for t in snap.shard]
        if self.sends_job_state():
            payload["dense"] = {k: v.numpy() for k, v in snap.dense.items()}
            payload["progress"] = {"progress": snap.progress}
        # one copy into the object store, now (the step may change the tensors next), and one call
        self._inflight.append(self.holder.put_many.remote(step, ray.put(payload), keeper))
        self.snapshots += 1

    def prepare(self) -> None:
        """Before training, without waiting: have the host's holder (made now if this host has none:
        a process start, off a rebuilt group's first step) create this worker's two slot files when
        it sends its shard position's copy; the first snapshot maps them (`_prepared`)."""
        self._asked = (self.holder.why_no_shared_memory.remote() if self.say is not None and self.sends_job_state()
                       else None,
                       self.holder.allocate.remote(f"shard/{self.groups.coords.shard_rank}",
                                                   shard_layout(self.trainer.shard_tensors())[1])
                       if self.sends_shard() else None)

    def _prepared(self) -> None:
        """The holder's answers to `prepare`: why it keeps no slot files (said once per host), and this
        worker's slot files, mapped here, so snapshots only copy."""
        import ray

        problem_ref, paths_ref = self._asked
        self._asked = (None, None)
        if problem_ref is not None:
            problem = ray.get(problem_ref)
            if problem:
                self.say(problem)
        if paths_ref is not None:
            paths = ray.get(paths_ref)
            if paths:
                key = f"shard/{self.groups.coords.shard_rank}"
                _, nbytes = shard_layout(self.trainer.shard_tensors())
                self._slots[key] = paths
                for path in paths:
                    self._map(path, nbytes)

    def _map(self, path: str, nbytes: int) -> "torch.Tensor":
        """The slot file at `path` as a writable uint8 tensor (mapped once per attempt, page-locked
        on CUDA so the copy into it does not wait for the device)."""
        if path not in self._maps or self._maps[path][1].numel() != nbytes:
            mm, buf = map_slot(path, nbytes)
            self._maps[path] = (mm, buf, pin_host_memory(buf) if self.trainer.device.type == "cuda" else None)
        return self._maps[path][1]

    def _write_slot(self, step: int, key: str, tensors: Sequence["torch.Tensor"], keeper: Any) -> bool:
        """Copy `tensors` into the slot file the host's holder gives them (asked once; then the two
        slots alternate), and commit it once the copy has landed. False: the holder has no room in
        shared memory (the caller uses the object store)."""
        import ray

        layout, nbytes = shard_layout(tensors)
        if key not in self._slots:
            return False
        if key not in self._next_slot:  # the one slot no kept generation uses
            held = ray.get(self.holder.reserve.remote(step, key, nbytes))
            if held is None:
                return False
            self._next_slot[key] = held["slot"]
        slot = self._next_slot[key]
        path = self._slots[key][slot]
        copier = HostCopy(self.trainer.device)
        write_into(self._map(path, nbytes), tensors, layout, copier)
        self._copies.append((copier.issued(), (step, key, {"path": path, "slot": slot}, layout, keeper)))
        self._next_slot[key] = 1 - slot
        self._land()
        return True

    def _land(self, wait: bool = False) -> None:
        """Commit the slot files whose copies have landed (all of them, waiting, with `wait`)."""
        while self._copies and (wait or self._copies[0][0].done()):
            copier, (step, key, slot, layout, keeper) = self._copies.pop(0)
            copier.wait()
            self._inflight.append(self.holder.commit.remote(step, key, slot, layout, keeper))

    def _settle(self) -> None:
        """Wait for the previous snapshot's copies (memory stays bounded by two generations)."""
        import ray

        self._land(wait=True)
        if self._inflight:
            cpu = max(ray.get(self._inflight))  # each call answers the holder's CPU seconds so far
            self._inflight = []
            if self._holder_cpu is not None and self.snapshots > self._holder_cpu[1]:  # per snapshot since
                self.holder_s = max(0.0, cpu - self._holder_cpu[0]) / (self.snapshots - self._holder_cpu[1])
            self._holder_cpu = (cpu, self.snapshots)

    def close(self) -> None:
        self._settle()
        for _, _, undo in self._maps.values():
            if undo is not None:
                undo()


class HolderRestore(_WorkerSide):
    """A worker's side of a restore from the holders: a sharding group that found no live peer
    group ahead of step 0 loads the newest complete generation they hold (`load`, its plan from
    `RecoveryCoordinatorImpl.restore_plan`) and checks it bit for bit (`verify`);
    `train.recovery.storage.StorageFallback` decides when."""

    def load(self, trainer: "Trainer", plan: dict[str, Any]) -> dict[str, Any]:
        """Fetch this worker's shard position, the dense part and the progress from the holders
        (this host's first) and load them. Returns where the shard came from: the host that held
        it, the host it was written on, and how it travelled."""
        import ray
        import torch

        step, where = plan["step"], plan["where"]
        chosen: dict[str, str] = {}
        via: dict[str, str] = {}  # how each payload came: "shared memory" (a slot file) or "object store"

        def fetch(key: str) -> Any:
            nodes = where[key]
            chosen[key] = self.node if self.node in nodes else nodes[0]
            holder = self.holder_on(chosen[key])
            held = ray.get(holder.get.remote(step, key))
            if isinstance(held, dict):  # a slot file: mapped here on its host, else sent through the store
                if chosen[key] == self.node:
                    via[key] = "shared memory"
                    return read_slot(held["path"], held["layout"])
                held = ray.get(holder.fetch.remote(step, key))
            via[key] = "object store"
            return ray.get(held[0])  # mapped from this host's object store (moved here if it lives elsewhere)

        key = f"shard/{self.groups.coords.shard_rank}"
        shard, dense, progress = fetch(key), fetch("dense"), fetch("progress")
        origin = ray.get(self.holder_on(chosen[key]).origin_of.remote(step, key))
        window = None
        if self.rank == 0:  # the NE window: the sum of every writing worker's (a metric, not the model)
            where.update(plan.get("windows", {}))
            windows = [fetch(k) for k in plan.get("windows", {})]
            window = torch.from_numpy(np.sum(windows, axis=0)) if windows else None
        # cold start: a host's holder is an actor process of this module that never needs torch
        # (train.state imports it: 1.3 core-s of the holder's start, off a rebuilt group's first step)
        from recgrid.train.state import Snapshot

        trainer.load_snapshot(Snapshot(shard=[tensor_view(a) for a in shard],
                                       dense={k: tensor_view(v) for k, v in dense.items()},
                                       progress=progress["progress"], window=None), window)
        return {"key": key, "node": chosen[key], "origin": origin, "via": via[key]}

    def verify(self, trainer: "Trainer", step: int, fetched: dict[str, Any]) -> dict[str, Any]:
        """This worker's restored shard checksum beside the one the holder's copy was written with:
        bit for bit or an error."""
        import ray

        held = ray.get(self.holder_on(fetched["node"]).digest_of.remote(step, fetched["key"]))
        got = digest([array_view(t) for t in trainer.shard_tensors()])
        if got != held:
            raise RuntimeError(f"{fetched['key']} restored from node {fetched['node']} differs from the copy held "
                               f"there ({got} != {held})")
        return {"rank": self.rank, "shard": self.groups.coords.shard_rank, "digest": got, "source_digest": held,
                "from_node": fetched["node"], "written_on": fetched["origin"],
                "same_node": fetched["node"] == self.node, "via": fetched["via"]}


def group_snapshots(job: "WorkerJob", trainer: "Trainer") -> tuple[Any, Any]:
    """When the job takes in-memory snapshots (`JobConfig.snapshots`): this worker's snapshotter
    (its shard position to its host's holder at the snapshot steps, while its group is the one
    that writes) and the holders' side of a restore (`HolderRestore` over
    the group's grid), else (None, None). Collective over the sharding group (its workers' hosts)."""
    import ray
    import torch.distributed as dist

    if not job.schedule.snapshots.on:
        return None, None
    grid, groups = trainer.grid, trainer.groups
    nodes: list[Any] = [None] * grid.world_size
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    control = job.control
    snapshotter = Snapshotter(trainer, job.recovery, grid, groups, nodes, job.schedule.snapshots,
                              writes=lambda: trainer.replicas.evaluates(),
                              agreed=lambda name: trainer.replicas.agreed(name),
                              say=lambda msg: control.say.remote(f"[recgrid] {msg}"),
                              pin=lambda step: control.pin.remote(step, "snapshot"))
    return snapshotter, HolderRestore(job.recovery, grid, groups, nodes)
