"""Shared-memory slot files: where an in-memory snapshot's shard copies live on a node.

A node's snapshot holder (`train.recovery.holders`) owns two slot files per shard position of its
node, under /dev/shm: they outlive the worker that wrote them, and each writing worker keeps both
mapped, so a snapshot is one memory copy straight out of the kernels' storage (no serialization,
no object-store copy, no second copy by the holder). Everything that touches the file system for
them is here.

The slot files are the model's bits on a machine other users may share, so the holder makes its
job's directory (`/dev/shm/recgrid-snapshots-<run id>`) and its node's directory inside
exclusively with mode 0700, each with an owner marker (job, node, pid and start time of the
holder), and accepts an existing one only if it is a real directory of this user, mode 0700,
whose marker names this job (a previous holder's); anything else at the path (a link, another
user's or another job's directory) is refused (`SnapshotDirRefused`), left untouched, and the
job's snapshots go through the object store, the log saying why. Slot files are created with
O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600, and mapped through O_NOFOLLOW after checking their
owner. A starting holder sweeps this user's snapshot directories whose owners are all gone (a
driver killed with SIGKILL takes its holders along, and nothing else would delete them).

A slot file holds a list of tensors at 64-byte aligned offsets (`shard_layout`); `digest` is the
checksum a holder records as a copy arrives and a restore checks, bit for bit.
"""

from __future__ import annotations

import mmap
import os
import shutil
import stat
import time
import zlib
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

SHM_BASE = "/dev/shm"  # tmpfs: shared memory the node's processes map (Ray's object store lives there too)
SHM_MARGIN = 256 << 20  # what a new slot file leaves free in it, for the object store and others
ALIGN = 64  # byte alignment of each tensor in a slot file
SNAPSHOT_PREFIX = "recgrid-snapshots-"  # a job's directory under SHM_BASE: SNAPSHOT_PREFIX + run id
MARKER = ".recgrid-owner"  # in a job's and a node's directory: {"run_id", "node", "pid", "start"} of its maker


class SnapshotDirRefused(OSError):
    """A snapshot directory path that is not this job's own (a link, another user's, another job's)."""


def shm_free() -> int | None:
    """Free bytes of this machine's shared memory (SHM_BASE), None without one."""
    if not os.path.isdir(SHM_BASE):
        return None
    return shutil.disk_usage(SHM_BASE).free


def job_dir(run_id: str) -> str:
    """The directory of job `run_id`'s shard files on a machine (one subdirectory per node's holder)."""
    return os.path.join(SHM_BASE, f"{SNAPSHOT_PREFIX}{run_id}")


def snapshot_dir(run_id: str, node_id: str) -> str | None:
    """Where a node's holder keeps its shard files (None: no usable shared memory here)."""
    if not (os.path.isdir(SHM_BASE) and os.access(SHM_BASE, os.W_OK)):
        return None
    return os.path.join(job_dir(run_id), node_id[:16])


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
    _remove_owned(job_dir(run_id), run_id)


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



def make_node_dir(run_id: str, node_id: str) -> tuple[str | None, list[str]]:
    """A node's holder's directory for slot files (`snapshot_dir`), its job's directory above it:
    both created exclusively with mode 0700 (or a previous holder's of this job and node, taken
    over); first, this user's snapshot directories of jobs that are gone are swept. Returns (the
    directory, None without usable shared memory; what was swept). Raises `SnapshotDirRefused`
    for a path that is not this job's own (left untouched), `OSError` when it cannot be made."""
    root = snapshot_dir(run_id, node_id)
    if root is None:
        return None, []
    parent = os.path.dirname(root)
    swept = sweep_stale_snapshots(keep=parent)
    _own_dir(parent, run_id, None)
    if _own_dir(root, run_id, node_id[:16]) == "accepted":
        # a previous holder of this job and node died: this one owns its slot files now
        _write_marker(root, run_id, node_id[:16])
    return root, swept


def remove_node_dir(root: str, run_id: str) -> None:
    """Delete a node's directory of slot files, and its job's directory once no node's is left."""
    shutil.rmtree(root, ignore_errors=True)
    parent = os.path.dirname(root)
    try:
        if os.listdir(parent) == [MARKER]:
            _remove_owned(parent, run_id)
    except OSError:
        pass


def allocate_slot_files(root: str, key: str, nbytes: int) -> list[str] | None:
    """Both slot files of `key` (slot 0 and 1) in `root`, of `nbytes` each, created now where missing
    or of another size (the pages allocated and zeroed once; never through a planted link). None:
    no room in shared memory (SHM_MARGIN left free) or the files cannot be made."""
    paths = [os.path.join(root, f"{key.replace('/', '-')}.{slot}") for slot in (0, 1)]
    try:
        for path in paths:
            try:
                st = os.lstat(path)
                have = st.st_size if stat.S_ISREG(st.st_mode) else 0
            except FileNotFoundError:
                st, have = None, 0
            if st is not None and have == nbytes:
                continue
            if shutil.disk_usage(root).free + have < nbytes + SHM_MARGIN:
                return None
            if st is not None:  # another size: a new file (a writer's mapping keeps the old one)
                os.unlink(path)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
    except OSError:
        return None
    return paths


def slot_files(root: str | None) -> list[str]:
    """The slot files in a node's directory (at most two per shard position of the node)."""
    if root is None or not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f != MARKER)


def map_slot(path: str, nbytes: int) -> tuple[mmap.mmap, "torch.Tensor"]:
    """The slot file at `path` mapped writable, as (the mapping, a uint8 tensor over it), its page
    tables filled now (no link followed, this user's file: `open_slot`)."""
    import torch

    fd = open_slot(path, writable=True)
    try:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def write_into(buf: "torch.Tensor", tensors: Sequence["torch.Tensor"], layout: Sequence[tuple[str, list[int], int]],
               copier: Any = None) -> None:
    """Copy `tensors` into a mapped slot file `buf` at the offsets of `layout` (`shard_layout`),
    through `copier` (`engine.device.HostCopy`: device tensors without waiting) or in place."""
    import torch

    with torch.no_grad():
        for t, (_, _, offset) in zip(tensors, layout):
            n = t.numel() * t.element_size()
            dst, src = buf[offset:offset + n].view(t.dtype), t.detach().reshape(-1)
            copier.copy(dst, src) if copier is not None else dst.copy_(src)


def tensor_view(a: np.ndarray) -> "torch.Tensor":
    """A tensor viewing `a` (read-only memory of the object store: it is only copied from)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable
        return torch.from_numpy(a)


def array_view(t: "torch.Tensor") -> np.ndarray:
    """A CPU numpy view of `t` (a copy only for device tensors)."""
    t = t.detach()
    return (t if t.device.type == "cpu" else t.cpu()).numpy()

