"""Storage checkpoints: the trainer's whole state written with `torch.distributed.checkpoint`.
Design: docs/design-notes.md, "Failures, restarts and elastic jobs" (the restore order, and
how a checkpoint is read as data).

The only code that knows where checkpoints live. A checkpoint is a directory
`checkpoint_step_<step>` under the writing sharding group's run directory in Ray Train's storage
(`RunConfig.storage_path`: a local path, or any pyarrow/fsspec URI on a cluster), written in
place and not reported to Ray Train (one sharding group writes while the others train, and Ray
Train's report is a barrier over every worker of a run): the job's recovery coordinator lists
them (`train.recovery.storage.StorageFallback`). Outside Ray Train (the local launcher, tests)
the same code writes under a plain directory.

`Checkpointer.maybe_save` writes the trainer's `state_dict()` at the job's cadence
(`JobConfig.checkpoints`), at sync steps only, when the replicas are identical: DCP writes each
replicated shard once, so a job with M sharding groups writes one copy of the model, split over
the workers; `Checkpointer.keep_newest` keeps the `CHECKPOINTS_KEPT` newest. Loading reshards:
DCP reads whatever overlaps each new shard, so another M, L or plan loads it.

Reading is restricted to data (`read_checkpoint`): `.metadata` through an unpickler that admits
only `METADATA_GLOBALS` and builds only onto `BUILDABLE` instances, storage entries only inside
the checkpoint's directory, the data files through recgrid's own loop over DCP's plan
(`read_items`: no link out, no entry past its file's end, every tensor of its declared dtype and
shape, the rest with `torch.load(weights_only=True)`). Anything else is refused with its path.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from recgrid.config import CheckpointCadence

if TYPE_CHECKING:
    from recgrid.train.trainer import Trainer

CHECKPOINT_PREFIX = "checkpoint_step_"
CHECKPOINTS_KEPT = 2  # a job's newest storage checkpoints kept (`Checkpointer.keep_newest`)
_STEP = re.compile(rf"{CHECKPOINT_PREFIX}(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_step(path: str) -> int | None:
    """The step a checkpoint directory was written at, from its name."""
    m = _STEP.search(path.rstrip("/"))
    return int(m.group(1)) if m else None


def _is_uri(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _writer(path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    if _is_uri(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(path)
    return dcp.FileSystemWriter(path.removeprefix("file://"))


# What a checkpoint's `.metadata` may name when it is unpickled: exact (module, name) pairs, read off the
# `.metadata` files torch 2.13's DCP writes (DCP's metadata classes, the path and storage info its
# filesystem writer records, the torch types they carry). None is a module, a namespace or a callable
# that builds anything but its own plain value.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
TORCH_DTYPES = frozenset({
    "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128", "complex32", "complex64",
    "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu", "int1", "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int64",
    "int7", "int8", "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "uint1", "uint16", "uint2", "uint3",
    "uint32", "uint4", "uint5", "uint6", "uint64", "uint7", "uint8"})  # as a dtype pickles: torch.<canonical name>
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {(_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                        "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
       ("collections", "OrderedDict")}
    | {("torch", name) for name in TORCH_DTYPES})

# the only objects a `.metadata` may set attributes on (BUILD): DCP's metadata dataclasses, which
# are only ever made fresh while it is read (an enum member, a class or a module is shared)
BUILDABLE: frozenset[tuple[str, str]] = frozenset(
    {(_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")})

# bound at import: the checks below call nothing a pickle being read could have rebound
_isinstance, _id, _type = isinstance, id, type


class CheckpointRefused(pickle.UnpicklingError):
    """A checkpoint whose metadata names something that is not checkpoint data."""


@functools.cache
def _admitted() -> dict[tuple[str, str], Any]:
    """`METADATA_GLOBALS` resolved, once, before any byte of a checkpoint is read."""
    import importlib

    out = {}
    for module, name in METADATA_GLOBALS:
        value = getattr(importlib.import_module(module), name, _admitted)
        if value is not _admitted:  # a dtype this torch build lacks is simply not admitted
            out[(module, name)] = value
    return out


class _MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be checked
    """Admits `METADATA_GLOBALS` only, and a BUILD only onto an instance of a `BUILDABLE` class (a
    BUILD onto anything else could set attributes on an object the whole process shares: the
    admitted enum's members, `_MEM_FORMAT_ENCODING(0)`, are every later checkpoint's)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, stream: Any, path: str) -> None:
        super().__init__(stream)
        self._path = path
        self._admitted = _admitted()
        self._buildable = frozenset(_id(self._admitted[k]) for k in BUILDABLE)

    def find_class(self, module: str, name: str) -> Any:
        value = self._admitted.get((module, name), _MetadataUnpickler)
        if value is _MetadataUnpickler:
            raise CheckpointRefused(f"{self._path}: the checkpoint's metadata names {module}.{name}, which is not "
                                    f"checkpoint data (a planted or foreign file?); refusing to load it")
        return value

    def _load_build(self) -> None:
        target = self.stack[-2]
        if _id(_type(target)) not in self._buildable:  # the exact class: no subclass, no metaclass
            raise CheckpointRefused(f"{self._path}: the checkpoint's metadata sets attributes on "
                                    f"{_type(target).__name__} {getattr(target, '__name__', '')} (a planted "
                                    f"or foreign file?); refusing to load it")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


def load_metadata(stream: Any, path: str) -> Any:
    """Unpickle a checkpoint's `.metadata` from `stream`, admitting only `METADATA_GLOBALS`: a DCP
    `Metadata` whose storage entries name files inside the checkpoint directory, or `CheckpointRefused`."""
    metadata = _MetadataUnpickler(stream, path).load()
    admitted = _admitted()
    if _type(metadata) is not admitted[(_DCP_METADATA, "Metadata")]:
        raise CheckpointRefused(f"{path}: not a checkpoint's metadata (it holds a {_type(metadata).__name__}); "
                                f"refusing to load it")
    info, entries = admitted[("torch.distributed.checkpoint.filesystem", "_StorageInfo")], metadata.storage_data
    for item in entries.values() if _type(entries) is dict else [None]:
        rel = item.relative_path if _type(item) is info else None
        if _type(rel) is not str or not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            raise CheckpointRefused(f"{path}: the checkpoint's metadata points outside its directory "
                                    f"({rel!r}); refusing to load it")
    return metadata


@functools.cache
def _reader_classes() -> tuple[type, type]:
    """DCP's file-system and fsspec readers, reading `.metadata` through `load_metadata`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        if self.local:
            inside_directory(str(self.path), str(path))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self: Any, metadata: Any, *args: Any, **kwargs: Any) -> None:
        dcp.FileSystemReader.set_up_storage_reader(self, metadata, *args, **kwargs)
        self.declared = metadata.state_dict_metadata

    methods = {"read_metadata": read_metadata, "set_up_storage_reader": set_up_storage_reader,
               "read_data": read_items}
    local = type("SafeFileSystemReader", (dcp.FileSystemReader,), {**methods, "local": True})
    remote = type("SafeFsspecReader", (FsspecReader,), {**methods, "local": False})
    return local, remote


def inside_directory(directory: str, path: str) -> None:
    """Refuse `path` (a checkpoint's file) unless it resolves inside `directory`: a link out of it
    would read a file the checkpoint's writer never wrote."""
    root = os.path.realpath(directory)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise CheckpointRefused(f"{path}: a link to {os.path.realpath(path)}, outside the checkpoint's directory "
                                f"(a planted or foreign file?); refusing to load it")


class _Slice(io.RawIOBase):
    """Bytes [offset, offset + length) of an open stream, as a stream that never reads past them."""

    def __init__(self, stream: Any, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._start, self._length, self._at = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._at, os.SEEK_END: self._length}[whence]
        self._at = min(max(base + offset, 0), self._length)
        return self._at

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._length - self._at)
        if n <= 0:
            return 0
        self._stream.seek(self._start + self._at)
        got = self._stream.readinto(memoryview(buffer)[:n])
        self._at += got or 0
        return got or 0


def read_items(reader: Any, plan: Any, planner: Any) -> Any:
    """DCP's read of a load plan's items (a `StorageReader.read_data`), checking each against what
    the checkpoint declares: its file inside the checkpoint's directory, its bytes inside its file
    (no read past the file's end, whatever length is declared), no storage transform (recgrid
    writes none), and a tensor entry of exactly its declared dtype and shape. Anything else is
    `CheckpointRefused`, naming the file and the entry."""
    import torch
    from torch.futures import Future
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType

    per_file: dict[str, list[Any]] = {}
    for item in plan.items:
        per_file.setdefault(reader.storage_data[item.storage_index].relative_path, []).append(item)
    for relative_path, items in per_file.items():
        path = reader.fs.concat_path(reader.path, relative_path)
        if reader.local:
            inside_directory(str(reader.path), str(path))
        with reader.fs.create_stream(path, "rb") as stream:
            size = stream.seek(0, os.SEEK_END)
            for item in items:
                info, fqn = reader.storage_data[item.storage_index], item.storage_index.fqn
                if info.transform_descriptors:
                    raise CheckpointRefused(f"{path}: entry {fqn!r} is stored through transforms "
                                            f"{list(info.transform_descriptors)}, which recgrid never writes; "
                                            f"refusing to load it")
                if not (0 <= info.offset and 0 <= info.length and info.offset + info.length <= size):
                    raise CheckpointRefused(f"{path}: entry {fqn!r} is declared at bytes {info.offset:,} to "
                                            f"{info.offset + info.length:,} of a file of {size:,} bytes; "
                                            f"refusing to load it")
                data = _Slice(stream, info.offset, info.length)
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(data.read()))
                    continue
                declared = reader.declared.get(fqn)
                chunk = next((c for c in getattr(declared, "chunks", ()) if c.offsets == item.storage_index.offset),
                             None)
                try:
                    tensor = torch.load(data, map_location="cpu", weights_only=True)
                except pickle.UnpicklingError as e:
                    raise CheckpointRefused(f"{path}: entry {fqn!r} is not a tensor (a planted or foreign "
                                            f"file?); refusing to load it: {str(e).splitlines()[0]}") from None
                if not isinstance(declared, TensorStorageMetadata) or chunk is None or not isinstance(
                        tensor, torch.Tensor) or tensor.dtype != declared.properties.dtype or tuple(
                        tensor.shape) != tuple(chunk.sizes):
                    what = (f"a {str(tensor.dtype).removeprefix('torch.')} tensor of shape {list(tensor.shape)}"
                            if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}")
                    want = (f"a {str(declared.properties.dtype).removeprefix('torch.')} tensor of shape "
                            f"{list(chunk.sizes)}" if chunk is not None else "no such tensor chunk")
                    raise CheckpointRefused(f"{path}: entry {fqn!r} holds {what}, but the checkpoint's metadata "
                                            f"declares {want}; refusing to load it")
                for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    tensor = tensor.narrow(dim, start, length)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise CheckpointRefused(f"{path}: entry {fqn!r} has shape {list(tensor.shape)} where the model "
                                            f"has {list(target.shape)}; refusing to load it")
                target.copy_(tensor)
                planner.commit_tensor(item, target)
    done: Future = Future()
    done.set_result(None)
    return done


@functools.cache
def _load_planner_class() -> type:
    """DCP's default load planner, refusing a non-tensor entry that `torch.load(weights_only=True)`
    refuses before DCP loads it (DCP itself loads them with `weights_only=False`)."""
    import io

    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        path = "<checkpoint>"

        def load_bytes(self, read_item: Any, value: Any) -> None:
            data = value.read()
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except pickle.UnpicklingError as e:
                why = next((line.split("Unsupported global:")[1].split(" was not")[0].strip()
                            for line in str(e).splitlines() if "Unsupported global:" in line), "")
                why = f" It names {why.removeprefix('GLOBAL ')}." if why else ""
                raise CheckpointRefused(f"{self.path}: entry {read_item.dest_index.fqn!r} is not checkpoint data "
                                        f"(a planted or foreign file?); refusing to load it.{why}") from None
            super().load_bytes(read_item, io.BytesIO(data))

    return SafeLoadPlanner


def _reader(path: str) -> Any:
    local, remote = _reader_classes()
    if _is_uri(path):
        return remote(path)
    return local(path.removeprefix("file://"))


def _owner_only(directory: str) -> None:
    """The checkpoint directory 0700 and its files 0600 (DCP creates them with the umask's modes)."""
    os.chmod(directory, 0o700)
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                os.chmod(entry.path, 0o600)


def is_complete(path: str) -> bool:
    """Whether `path` holds a finished checkpoint (DCP writes `.metadata` last, on one rank)."""
    if _is_uri(path):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        return fs.exists(f"{p}/.metadata")
    return os.path.isfile(os.path.join(path.removeprefix("file://"), ".metadata"))


@dataclass
class Checkpointer:
    """Writes and reads the trainer's state. `root` is where checkpoints go outside Ray Train;
    inside it, Ray Train's storage context decides (`ray_storage=True`).

    It acts on the job's checkpoint cadence (`cadence`, the `Schedule`'s: every so many steps, or every so many
    seconds of training; at sync steps): `wants(step)` is this worker's vote at a sync step, and
    `maybe_save(step, agreed)` writes when the writing group agreed on one (the replica
    component agrees the votes, `Replicas.agree`); `after_save(step, path)` runs once one is written.
    """

    root: str | None = None
    ray_storage: bool = False
    cadence: CheckpointCadence = field(default_factory=CheckpointCadence)
    trainer: "Trainer | None" = None
    after_save: Callable[[int, str], None] | None = None
    written_at: int | None = field(default=None, init=False)  # the step of the newest checkpoint this one wrote
    _since: float = field(default_factory=time.monotonic, init=False, repr=False)  # the time budget's clock

    def wants(self, step: int) -> bool:
        """This worker's vote, at sync step `step`, for a checkpoint there: a multiple of the
        cadence's steps, or its seconds of training gone since the last one (or the start)."""
        c = self.cadence
        if c.every_steps:
            return step % c.every_steps == 0
        return bool(c.every_s) and time.monotonic() - self._since >= c.every_s

    def maybe_save(self, step: int, agreed: bool) -> str | None:
        """Write a checkpoint of `step` if the writing group agreed on one there."""
        if not agreed or not self.cadence.on or self.trainer is None:
            return None
        return self._write(step)

    def save_at(self, step: int) -> str:
        """A checkpoint of step `step` (an interrupt's, the last group's at a drain, the job's final
        one): the one the cadence wrote there, else one written now (collective), whatever the
        cadence (none included)."""
        if self.written_at == step:
            return self.path_for(step)
        return self._write(step)

    def _write(self, step: int) -> str:
        with self.trainer.metrics.timer.phase("checkpoint"):  # type: ignore[union-attr]
            path = self.save(self.trainer)  # type: ignore[arg-type]
        self.written_at, self._since = step, time.monotonic()
        if self.after_save is not None:
            self.after_save(step, path)
        return path

    def path_for(self, step: int) -> str:
        name = checkpoint_name(step)
        if self.ray_storage:
            import ray.train

            storage = ray.train.get_context().get_storage()
            path = storage.build_checkpoint_path_from_name(name)
            fs = storage.storage_filesystem
            kind = getattr(fs, "type_name", "local")
            return path if kind == "local" else f"{kind}://{path}"
        if self.root is None:
            raise ValueError("no checkpoint root: give Checkpointer(root=...) outside Ray Train")
        return os.path.join(self.root, name) if not _is_uri(self.root) else f"{self.root.rstrip('/')}/{name}"

    def save(self, trainer: "Trainer") -> str:
        """Write the trainer's state at its current step (collective over the trainer's workers)."""
        import torch.distributed.checkpoint as dcp

        step = trainer.state.step
        path = self.path_for(step)
        local = None if _is_uri(path) else path.removeprefix("file://")
        if local is not None:  # model weights on a shared host: a directory only this user can enter
            os.makedirs(local, mode=0o700, exist_ok=True)
        dcp.save(trainer.state_dict(), storage_writer=_writer(path), process_group=trainer.groups.global_pg)
        if local is not None:
            _owner_only(local)
        return path

    def keep_newest(self, written: Sequence[str]) -> list[str]:
        """The job's retention: of its checkpoints `written` (oldest first), delete all but the
        `CHECKPOINTS_KEPT` newest. Returns the deleted paths."""
        old = list(written)[:-CHECKPOINTS_KEPT]
        for path in old:
            self.delete(path)
        return old

    @staticmethod
    def delete(path: str) -> None:
        """Remove the checkpoint directory at `path` (a local path or a URI); gone already is fine."""
        if _is_uri(path):
            import fsspec

            fs, p = fsspec.core.url_to_fs(path)
            if fs.exists(p):
                fs.rm(p, recursive=True)
            return
        import shutil

        shutil.rmtree(path.removeprefix("file://"), ignore_errors=True)

    def load(self, trainer: "Trainer", path: str) -> int:
        """Load the checkpoint at `path` into `trainer` (collective; resharding to the trainer's
        grid as needed). Returns the step it was written at."""
        if not is_complete(path):
            raise FileNotFoundError(f"{path}: not a complete recgrid checkpoint (no .metadata)")
        sd = trainer.state_dict()
        if "compression" in sd:  # a compressed model: the checkpoint's head ids first, before tables that may not fit
            trainer.check_compression(compression_record(path, trainer.groups.global_pg))
        read_checkpoint(path, sd, trainer.groups.global_pg)
        trainer.load_state_dict(sd)
        return trainer.state.step


def compression_record(path: str, process_group: Any = None) -> str | None:
    """The QR compression record (`Trainer.state_dict()["compression"]`, JSON) the checkpoint at
    `path` holds; None: written by an uncompressed model. A refused checkpoint raises."""
    record: dict[str, Any] = {"compression": ""}
    try:
        read_checkpoint(path, record, process_group)
    except CheckpointRefused:
        raise
    except Exception:  # noqa: BLE001 - written by an uncompressed model: no record
        return None
    return record["compression"]


def read_checkpoint(path: str, state: dict[str, Any], process_group: Any = None) -> None:
    """Load `state` in place from the checkpoint at `path` (collective over `process_group`; None
    outside torch.distributed), reading its metadata and non-tensor entries as data only (see the
    module docstring): `CheckpointRefused` names the file or entry that is not."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    reader = _reader(path)
    reader.read_metadata()  # refused here, where the refusal is raised (DCP's load would catch it)
    planner = _load_planner_class()()
    planner.path = path
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader, planner=planner, process_group=process_group,
                 no_dist=not dist.is_initialized())
    except CheckpointException as e:  # DCP gathers every rank's failure: the refusal is the one to say
        failures = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]  # (exception, traceback)
        refused = [f for f in failures if isinstance(f, CheckpointRefused)]
        if refused:
            raise refused[0] from None
        raise
