"""Storage checkpoints: the trainer's whole state written with `torch.distributed.checkpoint`.

The only code that knows where checkpoints live. A checkpoint is a directory
`checkpoint_step_<step>` under the writing sharding group's run directory in Ray Train's storage
(`RunConfig.storage_path`: a local path, or any pyarrow/fsspec URI on a cluster), written in
place and not reported to Ray Train (one sharding group writes while the others train, and Ray
Train's report is a barrier over every worker of a run): the job's recovery coordinator lists
them (`train.recovery.storage.StorageFallback`). Outside Ray Train (the local launcher, tests) the same code
writes under a plain directory.

`Checkpointer.maybe_save(step)` writes every `train.checkpoint_every` steps (by default a tenth of
the job: `JobConfig.checkpoint_every`); `Checkpointer.keep_newest` keeps the job's `CHECKPOINTS_KEPT`
newest and deletes the older ones. What is written is
the trainer's `state_dict()`: the same parts as an in-memory snapshot, the shards in the DMP's
sharded form. Written at sync steps only, when the replicas are identical: the embedding tables are the DMP's
DTensors, replicated over the replica axis, and DCP's planner writes each replicated shard
once, so a job with M sharding groups writes one copy of the model, not M, split over the
workers. Loading is resharding: a checkpoint written at T=4, M=2 loads into T=4, M=1 or
T=2, M=1 (another L, another plan) because DCP reads whatever overlaps each new shard.

Reading is restricted to data. A checkpoint directory on a shared volume holds whatever anyone
who can write there put in it, and DCP unpickles two things from it: the `.metadata` file
(`pickle.load`, which calls any callable the file names) and the non-tensor entries
(`torch.load(weights_only=False)`). `load` reads `.metadata` with an unpickler that admits only
an exact list of DCP's metadata classes and the torch types they carry (`METADATA_GLOBALS`: no
module, no namespace, nothing that hands out one), refuses a BUILD onto a class, module or function,
and refuses metadata whose storage entries point outside the checkpoint's directory; the
non-tensor entries are read with `torch.load(weights_only=True)` (recgrid writes them as JSON
strings and plain tensors). A file that names anything else is refused with its path and the name.
(torch's weights-only unpickler cannot read `.metadata`: it stops at protocol 4's FRAME opcode.)
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

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

# bound at import: the checks below call nothing a pickle being read could have rebound
_isinstance, _id, _type = isinstance, id, type
_NOT_BUILDABLE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


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
    """Admits `METADATA_GLOBALS` only, and refuses a BUILD onto a class, module or function (it
    would set attributes on an object the whole process shares)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, stream: Any, path: str) -> None:
        super().__init__(stream)
        self._path = path
        self._admitted = _admitted()
        self._handed_out = frozenset(_id(v) for v in self._admitted.values())

    def find_class(self, module: str, name: str) -> Any:
        value = self._admitted.get((module, name), _MetadataUnpickler)
        if value is _MetadataUnpickler:
            raise CheckpointRefused(f"{self._path}: the checkpoint's metadata names {module}.{name}, which is not "
                                    f"checkpoint data (a planted or foreign file?); refusing to load it")
        return value

    def _load_build(self) -> None:
        target = self.stack[-2]
        if _id(target) in self._handed_out or _isinstance(target, _NOT_BUILDABLE):
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
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    local = type("SafeFileSystemReader", (dcp.FileSystemReader,), {"read_metadata": read_metadata})
    remote = type("SafeFsspecReader", (FsspecReader,), {"read_metadata": read_metadata})
    return local, remote


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

    It owns the cadence of a job's checkpoints: given the `trainer` and `every` (steps, a
    multiple of K; 0: none), the loop calls `maybe_save(step)` after every step;
    `after_save(step, path)` runs once one is written.
    """

    root: str | None = None
    ray_storage: bool = False
    every: int = 0
    trainer: "Trainer | None" = None
    after_save: Callable[[int, str], None] | None = None

    def maybe_save(self, step: int, force: bool = False) -> str | None:
        """Write a checkpoint if `step` is one of the job's checkpoint steps (`force`: any sync
        step of a job with checkpoints, e.g. where an interrupt stopped it)."""
        if not self.every or (step % self.every and not force) or self.trainer is None:
            return None
        return self._write(step)

    def save_at(self, step: int) -> str:
        """A checkpoint of step `step` (an interrupt's, the last group's at a drain, the job's final
        one): the one the cadence wrote there at a checkpoint step, else one written now
        (collective), whatever the cadence (`every` 0 included)."""
        if self.every and step % self.every == 0:
            return self.path_for(step)
        return self._write(step)

    def _write(self, step: int) -> str:
        with self.trainer.metrics.timer.phase("checkpoint"):  # type: ignore[union-attr]
            path = self.save(self.trainer)  # type: ignore[arg-type]
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
