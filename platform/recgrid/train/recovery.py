"""Recovery from in-memory snapshots: copies of every shard kept outside the sharding group's
run, for a group rebuilt with no live peer group to heal from (M = 1: `train.ft.StorageFallback`
reads them before the storage checkpoint).

2-D sparse parallelism keeps M copies of every shard, one per sharding group, and with M >= 2 a
rebuilt group heals from a live peer (`train.ft`). With M = 1 Ray Train restarts the job's only
group's run on a failure, so copies that must outlive it live in actors the driver owns:

- `SnapshotHolder`, one per node (created on the node it serves, owned by the coordinator, which
  the driver owns, so no worker's death takes it along): it keeps the snapshot generations
  handed to it by the workers of its node, at most two (the newest complete one and the one
  being written). A shard copy lives in one of two shared-memory files per shard position that
  the holder owns (under /dev/shm; they outlive the worker that wrote them, and each worker
  keeps both mapped, so a snapshot is one memory copy straight out of the kernels' storage:
  no serialization, no object-store copy, no second copy by the holder). The small parts (dense
  part, progress, NE windows), and the shards too where /dev/shm is missing or too small, go
  through the object store and are copied out by the holder (an object put by a worker dies
  with that worker).
  The slot files are the model's bits on a machine other users may share, so the holder makes
  its job's directory (`/dev/shm/recgrid-snapshots-<run id>`) and its node's directory inside
  exclusively with mode 0700, each with an owner marker (job, node, pid and start time of the
  holder), and accepts an existing one only if it is a real directory of this user, mode 0700,
  whose marker names this job (a previous holder's); anything else at the path (a link, another
  user's or another job's directory) is refused, left untouched, and the job's snapshots go
  through the object store, the log saying why. Slot files are created with O_CREAT | O_EXCL |
  O_NOFOLLOW, mode 0600, and mapped through O_NOFOLLOW after checking their owner. A starting
  holder sweeps this user's snapshot directories whose owners are all gone (a driver killed with
  SIGKILL takes its holders along, and nothing else would delete them).
- `RecoveryCoordinator`, one per job: the holders by node, which generation is complete on the
  holders still alive, the storage checkpoints written and the recovery events the run logs.
  The attempts, heartbeats and the stop flag are job control's (`train.control.JobControl`).

What a snapshot carries is the trainer's one state inventory (`Trainer.snapshot()`: the shard,
the dense part, the progress with the data cursor, the NE window); nothing here assembles state
of its own. `Snapshotter` owns the cadence: the loop calls `maybe_snapshot(step)` after every
step, and at every snapshot point (a sync step, every `train.snapshot_every_syncs` syncs) each
node's holder receives one copy of every shard position held on that node (the first sharding
group there sends it, into its slot file; the others hold the same bits after the sync), plus
the dense part and the progress. A generation is complete when the live holders together have
every shard position 0..L-1, the dense part and the progress.

With delayed moment sync (M > 1) the replicas' optimizer states differ between syncs by design
(each replica's own updates since the last average), and the average launched at the snapshot's
sync is still in flight. So there the position copy holds the weights only (the same on every
replica after the sync), and every worker also hands its node's holder its own optimizer states
("moments/<j>/<g>": shard position j, sharding group g; 1/dim of the weights for row-wise
AdaGrad, through the object store), which right after the sync are also the in-flight average's
input. A restore gives each worker its position's weights and its own group's states, and every
worker relaunches the average with its own input: the failure-free run's state, bit for bit. A
generation holding moments is complete only with "moments/<j>/<g>" for every j < L and every g
< M of the restoring grid; with another M (an elastic attempt) or a group's moments lost with
its node, no in-memory restore is exact, so the plan skips that generation (an older complete one,
else the storage checkpoint, whose docstring says what it drops; the log says which moments were
missing). Without delayed moment sync the replicas are identical at a sync, and one copy per
position is exact.

What a rebuilt group of M = 1 restores (`train.ft.StorageFallback`, shard rank 0 decides and tells
its group):
  1. the newest complete in-memory generation, when it is at least as new as the newest storage
     checkpoint: each worker takes its shard position from its own node's holder if it has one,
     else from a holder on another node (`Recovery`). No storage read. A holder records each
     copy's checksum (`digest`) as it arrives, and before a restore uses a generation its copies
     are checked against it: a copy whose bits changed since (a corrupted slot file) is dropped,
     the restore's detail and the run's event say which, and the plan is made without it (another
     node's copy, an older generation, else the next source below). After the load each worker's
     restored shard is checked against the same checksum, bit for bit.
  2. else the job's newest storage checkpoint, else `train.resume_from`, else step 0 (said).
Work lost is at most the steps since the last snapshot (K steps with snapshots at every sync).
"""

from __future__ import annotations

import mmap
import os
import shutil
import stat
import sys
import time
import zlib
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from recgrid.train.control import LazyActor

if TYPE_CHECKING:
    import torch

    from recgrid.engine.grid import Grid, GridGroups
    from recgrid.train.trainer import Trainer

KEEP_GENERATIONS = 2  # the newest complete generation and the one being written
SHM_BASE = "/dev/shm"  # tmpfs: shared memory the node's processes map (Ray's object store lives there too)
SHM_MARGIN = 256 << 20  # what a new slot file leaves free in it, for the object store and others
ALIGN = 64  # byte alignment of each tensor in a slot file


SNAPSHOT_PREFIX = "recgrid-snapshots-"  # a job's directory under SHM_BASE: SNAPSHOT_PREFIX + run id
MARKER = ".recgrid-owner"  # in a job's and a node's directory: {"run_id", "node", "pid", "start"} of its maker


class SnapshotDirRefused(OSError):
    """A snapshot directory path that is not this job's own (a link, another user's, another job's)."""


def _job_dir(run_id: str) -> str:
    """The directory of job `run_id`'s shard files on a machine (one subdirectory per node's holder)."""
    return os.path.join(SHM_BASE, f"{SNAPSHOT_PREFIX}{run_id}")


def snapshot_dir(run_id: str, node_id: str) -> str | None:
    """Where a node's holder keeps its shard files (None: no usable shared memory here)."""
    if not (os.path.isdir(SHM_BASE) and os.access(SHM_BASE, os.W_OK)):
        return None
    return os.path.join(_job_dir(run_id), node_id[:16])


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from /proc; None: no such process, or no
    /proc), so a recorded owner is not mistaken for a later process that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _alive(owner: dict[str, Any]) -> bool:
    """Whether the process an owner marker names still runs (the same process, not a reused pid)."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds the pid: not the owner
        return False
    start = _process_start(pid)
    return start is None or owner.get("start") in (None, start)


def _read_marker(directory: str) -> dict[str, Any] | None:
    """The owner marker of `directory` (never through a link; None: none, or not ours)."""
    import json

    try:
        fd = os.open(os.path.join(directory, MARKER), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            return None
        data = json.loads(os.read(fd, 4096) or b"null")
        return data if isinstance(data, dict) else None
    except ValueError:
        return None
    finally:
        os.close(fd)


def _write_marker(directory: str, run_id: str, node: str | None) -> None:
    """Record this process as the maker of `directory` (a fresh file: exclusive, no link, 0600)."""
    import json

    path = os.path.join(directory, MARKER)
    try:
        os.unlink(path)  # a previous holder's of this job and node (checked by the caller)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps({"run_id": run_id, "node": node, "pid": os.getpid(),
                                 "start": _process_start(os.getpid())}).encode())
    finally:
        os.close(fd)


_NO_MARKER = "not made by this job's snapshot holder (no owner marker naming it)"


def _not_own_dir(path: str, run_id: str, node: str | None) -> str | None:
    """Why `path` is not job `run_id`'s own snapshot directory for `node` (None: it is: a real
    directory, not a link, of this user, mode 0700, whose owner marker names this job and node)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link (to {os.readlink(path)!r})"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not this job's user (uid {os.getuid()})"
    if stat.S_IMODE(st.st_mode) != 0o700:
        return f"mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    marker = _read_marker(path)
    if marker is not None and marker.get("run_id") == run_id and marker.get("node") == node:
        return None
    return "made by another job" if marker is not None and marker.get("run_id") != run_id else _NO_MARKER


def _own_dir(path: str, run_id: str, node: str | None) -> str:
    """Create `path` (mode 0700, exclusively), or accept an existing one only when it is this
    job's own (`_not_own_dir`): a previous holder's of this job. Returns "created" or "accepted";
    raises `SnapshotDirRefused` naming the path otherwise, without touching what is there."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(path, 0o700, follow_symlinks=False)  # whatever the umask
        _write_marker(path, run_id, node)
        return "created"
    deadline = time.monotonic() + 2.0  # another holder of this job on this machine may be writing its marker
    while True:
        why = _not_own_dir(path, run_id, node)
        if why is None:
            return "accepted"
        if why == _NO_MARKER and node is None and time.monotonic() < deadline:
            time.sleep(0.05)
            continue
        raise SnapshotDirRefused(f"{path}: refusing this snapshot directory: it is {why}; this job's in-memory "
                                 f"snapshots go through the object store instead (remove the path if it is stale)")


def _owned_by_job(path: str, run_id: str) -> bool:
    """Whether `path` is job `run_id`'s own snapshot directory (`_not_own_dir`, the job's level)."""
    try:
        return _not_own_dir(path, run_id, None) is None
    except OSError:
        return False


def _remove_owned(path: str, run_id: str) -> None:
    """Delete job `run_id`'s snapshot directory `path` if it is its own (`_owned_by_job`)."""
    if _owned_by_job(path, run_id):
        shutil.rmtree(path, ignore_errors=True)


def remove_snapshot_files(run_id: str) -> None:
    """Delete this machine's shard files of job `run_id` (those of holders that died with their
    node included, where several Ray nodes share one machine): only a directory that is the job's own."""
    _remove_owned(_job_dir(run_id), run_id)


def sweep_stale_snapshots(keep: str | None = None) -> list[str]:
    """Delete the snapshot directories under SHM_BASE that this user's jobs left behind and whose
    owners are all gone (a driver killed with SIGKILL takes its holders with it, and nobody else
    deletes their files): a job's directory goes when neither its maker nor any node directory's
    holder in it still runs. Never another user's, a link, a directory without an owner marker, a
    live job's, or `keep` (the caller's own job). Returns what was deleted."""
    try:
        names = os.listdir(SHM_BASE)
    except OSError:
        return []
    swept = []
    for name in names:
        path = os.path.join(SHM_BASE, name)
        if not name.startswith(SNAPSHOT_PREFIX) or path == keep:
            continue
        run_id = name[len(SNAPSHOT_PREFIX):]
        if not _owned_by_job(path, run_id):
            continue
        owners = [_read_marker(path)]
        try:
            owners += [_read_marker(os.path.join(path, n)) for n in os.listdir(path) if n != MARKER]
        except OSError:
            continue
        if not any(o is not None and _alive(o) for o in owners):
            shutil.rmtree(path, ignore_errors=True)
            swept.append(path)
    return swept


def open_slot(path: str, writable: bool) -> int:
    """A slot file's descriptor, opened without following links and checked: a regular file of
    this user (a planted link or another user's file is refused, naming the path)."""
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise SnapshotDirRefused(f"{path}: not a snapshot slot file of this user (uid {st.st_uid}); refusing to map it")
    return fd


def shard_layout(tensors: Sequence["torch.Tensor"]) -> tuple[list[tuple[str, list[int], int]], int]:
    """Where each tensor goes in a slot file: [(dtype name, shape, byte offset)], total bytes."""
    layout, offset = [], 0
    for t in tensors:
        layout.append((str(t.dtype).removeprefix("torch."), list(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return layout, max(offset, ALIGN)


def read_slot(path: str, layout: Sequence[tuple[str, list[int], int]]) -> list[np.ndarray]:
    """The arrays of a slot file, as read-only views of its (shared) memory."""
    fd = open_slot(path, writable=False)
    with os.fdopen(fd, "rb") as f:
        whole = np.memmap(f, dtype=np.uint8, mode="r")
    out = []
    for dtype, shape, offset in layout:
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        out.append(whole[offset:offset + n].view(dt).reshape(shape))
    return out


def digest(arrays: Sequence[np.ndarray]) -> str:
    """A checksum of the arrays' bytes (CRC-32 chained over them): equal iff bit-for-bit equal,
    for any practical purpose."""
    crc = 0
    for a in arrays:  # as bytes (an empty shard's (0, D) tensors included: a memoryview cast refuses those)
        crc = zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8), crc)
    return f"{crc:08x}-{sum(int(a.nbytes) for a in arrays)}"


def shard_parts(shard: Sequence[Any], weights: int, kernel: int) -> tuple[list[Any], list[Any] | None]:
    """A snapshot's shard (`Trainer.shard_tensors()`: `weights` embedding weights, then optimizer
    states up to `kernel`, then a delayed average's input if one is in flight) split into what the
    holders keep: (the shard position's copy, this sharding group's own moments). Without an
    average in flight: (the whole shard, None). With one: (the weights, the average's input),
    which right after the sync that launched it (a snapshot point) are also the live states."""
    if len(shard) == kernel:
        return list(shard), None
    if len(shard) != 2 * kernel - weights:
        raise ValueError(f"a shard of {len(shard)} tensors is neither {kernel} kernel tensors nor those plus "
                         f"{kernel - weights} moments in flight")
    return list(shard[:weights]), list(shard[kernel:])


def compose_shard(position: Sequence[Any], moments: Sequence[Any] | None) -> list[Any]:
    """The shard a worker loads (`Trainer.load_snapshot`): its position's copy, and with delayed
    moment sync its own group's moments as both its optimizer states and the input of the average
    it relaunches (the inverse of `shard_parts`)."""
    return list(position) if moments is None else [*position, *moments, *moments]


def plan_restore(inventories: dict[str, dict[int, list[str]]], group_size: int, num_groups: int,
                 lost: Sequence[str] = ()) -> dict[str, Any]:
    """The newest generation that `inventories` (node -> step -> keys held) hold completely for a
    grid of L = `group_size` shard positions and M = `num_groups` sharding groups, where each key
    is, and otherwise what the newest generation misses (for the log).

    Complete: every "shard/<j>" (j < L), "dense" and "progress"; and for a generation holding
    moments (delayed moment sync) "moments/<j>/<g>" for every j < L and g < M, and none for a
    group g >= M. A generation of another M (an elastic attempt: the average in flight was over
    the old M's states) or one that lost some group's moments cannot be restored exactly, so it
    is skipped like any incomplete generation: an older complete one is used, else none (the
    caller then falls back to the storage checkpoint and says why)."""
    base = [f"shard/{j}" for j in range(group_size)] + ["dense", "progress"]
    steps = sorted({s for inv in inventories.values() for s in inv}, reverse=True)
    missing_newest: list[str] = base
    for step in steps:
        held = {k for inv in inventories.values() for k in inv.get(step, [])}
        moments = sorted(k for k in held if k.startswith("moments/"))
        needed = list(base)
        missing: list[str] = []
        if moments:
            needed += [f"moments/{j}/{g}" for j in range(group_size) for g in range(num_groups)]
            groups = {int(k.rsplit("/", 1)[1]) for k in moments}
            if max(groups) >= num_groups:
                missing.append(f"moments of sharding groups {sorted(groups)} for a grid of M={num_groups} "
                               f"(delayed moment sync: the average in flight was over another M)")
        where = {k: sorted(n for n, inv in inventories.items() if k in inv.get(step, [])) for k in needed}
        missing = [k for k, nodes in where.items() if not nodes] + missing
        if step == steps[0]:
            missing_newest = missing
        if not missing:
            windows = {k: sorted(n for n, inv in inventories.items() if k in inv.get(step, []))
                       for k in sorted(k for k in held if k.startswith("window/"))}
            return {"step": step, "where": where, "windows": windows, "lost_nodes": list(lost)}
    return {"step": None, "missing": missing_newest, "lost_nodes": list(lost), "generations": steps}


class SnapshotHolderImpl:
    """One node's in-memory snapshots: generation (step) -> key -> what holds the payload.

    Keys: "shard/<j>" (shard position j: a list of arrays), "moments/<j>/<g>" (with delayed
    moment sync: sharding group g's own optimizer states for position j), "dense" (name ->
    array), "progress" (the job's progress), "window/<rank>" (a worker's NE window). A shard is
    normally in one of the key's two slot files, which this holder owns and the sender wrote in place
    (`reserve` / `commit`; held as {"path", "slot", "layout"}). Every other payload, and a shard
    when there is no room in shared memory, arrives as a view of an object the sending worker
    owns and is copied, once, into an object of this holder's (`ray.put` here; held as [ref]):
    it outlives the sender, stays in the node's shared-memory object store, and a restoring
    worker on this node maps it without another copy through this process.
    """

    def __init__(self, node_id: str, run_id: str = "local") -> None:
        import threading

        self.node_id, self.run_id = node_id, run_id
        self.generations: dict[int, dict[str, Any]] = {}
        # (step, key) -> the payload's checksum as it arrived (`digest`): a restore checks the copy against it
        self.digests: dict[tuple[int, str], str] = {}
        self._lock = threading.Lock()  # the workers of a node put at once
        self.problem: str | None = None  # why this holder keeps no slot files (for the job's log)
        self.swept: list[str] = []
        self.root = self._make_root(snapshot_dir(run_id, node_id))

    def _make_root(self, root: str | None) -> str | None:
        """This holder's directory for slot files, its job's directory above it: both created
        exclusively with mode 0700 (or a previous holder's of this job and node, taken over);
        first, this user's snapshot directories of jobs that are gone are swept. None (snapshots
        through the object store): no usable shared memory, or a path that is not this job's
        own (a link, another user's or another job's directory: refused, left untouched;
        `problem` says which)."""
        if root is None:
            return None
        job_dir = os.path.dirname(root)
        self.swept = sweep_stale_snapshots(keep=job_dir)
        try:
            _own_dir(job_dir, self.run_id, None)
            if _own_dir(root, self.run_id, self.node_id[:16]) == "accepted":
                # a previous holder of this job and node died: this one owns its slot files now
                _write_marker(root, self.run_id, self.node_id[:16])
        except SnapshotDirRefused as e:
            self.problem = str(e)
            print(f"[recgrid] {e}", file=sys.stderr, flush=True)
            return None
        except OSError as e:
            self.problem = f"{root}: cannot make this node's snapshot directory ({e}); snapshots go through the object store"
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
        if self.root is None:
            return None
        paths = [os.path.join(self.root, f"{key.replace('/', '-')}.{slot}") for slot in (0, 1)]
        try:
            for path in paths:
                try:
                    st = os.lstat(path)
                    have = st.st_size if stat.S_ISREG(st.st_mode) else 0
                except FileNotFoundError:
                    st, have = None, 0
                if st is not None and have == nbytes:
                    continue
                if shutil.disk_usage(self.root).free + have < nbytes + SHM_MARGIN:
                    return None
                if st is not None:  # another size: a new file (a writer's mapping keeps the old one)
                    os.unlink(path)
                # the pages are allocated (and zeroed) here, once; never through a planted link
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR, 0o600)
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
        except OSError:
            return None
        return paths

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
        if self.root is None or not os.path.isdir(self.root):
            return []
        return sorted(os.path.join(self.root, f) for f in os.listdir(self.root) if f != MARKER)

    def close(self) -> None:
        """Forget everything and delete the slot files (the job is over)."""
        with self._lock:
            self.generations.clear()
            self.digests.clear()
            if self.root is not None:
                shutil.rmtree(self.root, ignore_errors=True)
                job_dir = os.path.dirname(self.root)
                try:
                    if os.listdir(job_dir) == [MARKER]:  # the job's directory, once no node's is left
                        _remove_owned(job_dir, self.run_id)
                except OSError:
                    pass

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


class RecoveryCoordinatorImpl:
    """The job's recovery bookkeeping (one actor, owned by the driver): the holders, the restore
    plan, the storage checkpoints written and the recovery events. Attempts, heartbeats and the
    stop flag are job control's (`train.control`)."""

    def __init__(self, run_id: str) -> None:
        import threading

        self.run_id = run_id
        self._lock = threading.Lock()
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

    def restore_plan(self, group_size: int, num_groups: int) -> dict[str, Any]:
        """The newest generation the live holders together hold completely for a grid of L =
        `group_size` and M = `num_groups` (`plan_restore`), where each key is, and which keys no
        live holder has (for the log when there is none). Every copy the plan names is first
        checked against the checksum it arrived with (`SnapshotHolderImpl.verify`); a corrupted
        one is dropped and the plan made again without it (another node's copy of the key, an
        older generation, else none: the storage checkpoint). `corrupt` says what was dropped."""
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
                    del self.holders[node]
            plan = plan_restore(inventories, group_size, num_groups, lost)
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

    # ---- storage checkpoints and events ----------------------------------------------------------------
    def checkpoint_written(self, step: int, path: str) -> None:
        self.checkpoints.append((step, path))

    def latest_checkpoint(self, candidates: Sequence[str | None] = ()) -> str | None:
        """The newest storage checkpoint: recorded here, or among `candidates` (Ray Train's own)."""
        from recgrid.train.checkpoint import checkpoint_step, is_complete

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


SnapshotHolder = LazyActor(SnapshotHolderImpl)
RecoveryCoordinator = LazyActor(RecoveryCoordinatorImpl)


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
        position, moments = shard_parts(snap.shard, self.trainer.weight_tensor_count(),
                                        self.trainer.kernel_tensor_count())
        if moments is not None:  # delayed moment sync: this group's own states (replicas differ in them)
            last = self.trainer.state.sync.last
            if last is None or last.step != step:
                raise RuntimeError(f"snapshot at step {step} is not right after a replica sync (last: "
                                   f"{None if last is None else last.step}): its optimizer states are not "
                                   f"the delayed average's input")
            # before "dense" and "progress" (the holder puts keys in order): a generation with the
            # job's state but no moments is never mistaken for one taken without delayed moment sync
            payload[f"moments/{c.shard_rank}/{c.sharding_group}"] = [_numpy(t) for t in moments]
        if self.sends_shard():
            key = f"shard/{c.shard_rank}"
            if not self._write_slot(step, key, position):
                payload[key] = [_numpy(t) for t in position]
        if self.sends_job_state():
            payload["dense"] = {k: v.numpy() for k, v in snap.dense.items()}
            payload["progress"] = {"progress": snap.progress}
        # one copy into the object store, now (the step may change the tensors next), and one call
        self._inflight.append(self.holder.put_many.remote(step, ray.put(payload)))
        self.snapshots += 1

    def prepare(self) -> None:
        """Before training: have the node's holder create this worker's two slot files (when it
        sends its shard position's copy: the weights only with delayed moment sync) and map them
        here, so snapshots only copy."""
        import ray

        if self.say is not None and self.sends_job_state():  # one worker per node says why its holder has no files
            problem = ray.get(self.holder.why_no_shared_memory.remote())
            if problem:
                self.say(problem)
        if not self.sends_shard():
            return
        t = self.trainer
        _, nbytes = shard_layout(t.shard_tensors()[:t.replica_tensor_count()])
        for path in ray.get(self.holder.allocate.remote(f"shard/{self.groups.coords.shard_rank}", nbytes)) or []:
            self._map(path, nbytes)

    def _map(self, path: str, nbytes: int) -> "torch.Tensor":
        """The slot file at `path` as a writable uint8 tensor (mapped once per attempt, page tables filled now)."""
        import torch

        if path not in self._maps or self._maps[path][1].numel() != nbytes:
            fd = open_slot(path, writable=True)  # no link followed, this user's file (the holder made it 0600)
            try:
                mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
            self._maps[path] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        return self._maps[path][1]

    def _write_slot(self, step: int, key: str, tensors: Sequence["torch.Tensor"]) -> bool:
        """Copy `tensors` into a slot file the node's holder reserves for them, and commit it.
        False: the holder has no room in shared memory (the caller uses the object store)."""
        import ray
        import torch

        layout, nbytes = shard_layout(tensors)
        slot = ray.get(self.holder.reserve.remote(step, key, nbytes))
        if slot is None:
            return False
        buf = self._map(slot["path"], nbytes)
        with torch.no_grad():
            for t, (_, _, offset) in zip(tensors, layout):
                n = t.numel() * t.element_size()
                buf[offset:offset + n].view(t.dtype).copy_(t.detach().reshape(-1))
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


class Recovery(_WorkerSide):
    """A worker's side of a restore from the holders: a sharding group rebuilt with no live peer
    group to heal from (M = 1) loads the newest complete generation they hold
    (`restore_from_holders`, its plan from `RecoveryCoordinatorImpl.restore_plan`) and checks it
    bit for bit (`verify_restored`); `train.ft.StorageFallback` decides when."""

    def restore_from_holders(self, trainer: "Trainer", plan: dict[str, Any]) -> dict[str, Any]:
        """Fetch this worker's shard position (with delayed moment sync: its weights, and this
        sharding group's own moments: `compose_shard`), the dense part and the progress from the
        holders (this node's first) and load them. Returns where the shard came from."""
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

        c = self.groups.coords
        key, moments_key = f"shard/{c.shard_rank}", f"moments/{c.shard_rank}/{c.sharding_group}"
        shard, dense, progress = fetch(key), fetch("dense"), fetch("progress")
        moments = fetch(moments_key) if moments_key in where else None
        position = len(shard)
        shard = compose_shard(shard, moments)
        window = None
        if self.rank == 0:  # the NE window: the sum of every surviving worker's (a metric, not the model)
            where.update(plan.get("windows", {}))
            windows = [fetch(k) for k in plan.get("windows", {})]
            window = torch.from_numpy(np.sum(windows, axis=0)) if windows else None
        from recgrid.train.trainer import Snapshot

        trainer.load_snapshot(Snapshot(shard=[_tensor(a) for a in shard], dense={k: _tensor(v) for k, v in dense.items()},
                                       progress=progress["progress"], window=None), window)
        out = {"key": key, "node": chosen[key], "tensors": position, "via": via[key]}
        if moments is not None:
            out.update(moments_key=moments_key, moments_node=chosen[moments_key], moments_tensors=len(moments),
                       moments_via=via[moments_key])
        return out

    def verify_restored(self, trainer: "Trainer", step: int, fetched: dict[str, Any]) -> dict[str, Any]:
        """This worker's restored shard checksum beside the one the holder's copy was written with:
        bit for bit or an error.
        With delayed moment sync, two checks: the weights against the position copy, and both the
        optimizer states and the relaunched average's input against this group's moments copy
        (`digest` and `source_digest` then join the two checksums with "+")."""
        import ray

        tensors = trainer.shard_tensors()
        checks = [(fetched["key"], fetched["node"], [tensors[:fetched["tensors"]]])]
        if "moments_key" in fetched:
            k, n = trainer.kernel_tensor_count(), fetched["moments_tensors"]
            checks.append((fetched["moments_key"], fetched["moments_node"], [tensors[k - n:k], tensors[k:k + n]]))
        restored, source = [], []
        for key, node, parts in checks:
            holder = ray.get(self.coordinator.holder_for.remote(node))
            held = ray.get(holder.digest_of.remote(step, key))
            for part in parts:
                got = digest([_numpy(t) for t in part])
                if got != held:
                    raise RuntimeError(f"{key} restored from node {node} differs from the copy held there "
                                       f"({got} != {held})")
            restored.append(got)
            source.append(held)
        out = {"rank": self.rank, "shard": self.groups.coords.shard_rank, "digest": "+".join(restored),
               "source_digest": "+".join(source), "from_node": fetched["node"],
               "same_node": fetched["node"] == self.node, "via": fetched["via"]}
        if "moments_key" in fetched:
            out.update(moments_from_node=fetched["moments_node"], moments_via=fetched["moments_via"])
        return out


def _tensor(a: np.ndarray) -> "torch.Tensor":
    """A tensor viewing `a` (read-only memory of the object store: it is only copied from)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable
        return torch.from_numpy(a)


def _numpy(t: "torch.Tensor") -> np.ndarray:
    """A CPU numpy view of `t` (a copy only for device tensors)."""
    t = t.detach()
    return (t if t.device.type == "cpu" else t.cpu()).numpy()

