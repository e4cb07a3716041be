"""Storage checkpoints: the trainer's whole state written with `torch.distributed.checkpoint`.

The only code that knows where checkpoints live. A checkpoint is a directory
`checkpoint_step_<step>` under the job's run directory in Ray Train's storage
(`RunConfig.storage_path`: a local path, or any pyarrow/fsspec URI on a cluster), reported to
Ray Train with `ray.train.report(..., checkpoint_upload_mode=NO_UPLOAD)` so Ray's own
`get_checkpoint()` knows the newest one. Outside Ray Train (the local launcher, tests) the
same code writes under a plain directory.

`Checkpointer.maybe_save(step)` writes every `train.checkpoint_every` steps. What is written is
the trainer's `state_dict()`: the same parts as an in-memory snapshot, the shards in the DMP's
sharded form. Written at sync steps only, when the replicas are identical: the embedding tables are the DMP's
DTensors, replicated over the replica axis, and DCP's planner writes each replicated shard
once, so a job with M sharding groups writes one copy of the model, not M, split over the
workers. Loading is resharding: a checkpoint written at T=4, M=2 loads into T=4, M=1 or
T=2, M=1 (another L, another plan) because DCP reads whatever overlaps each new shard.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from recgrid.train.trainer import Trainer

CHECKPOINT_PREFIX = "checkpoint_step_"
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


def _reader(path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    if _is_uri(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path)
    return dcp.FileSystemReader(path.removeprefix("file://"))


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
    multiple of K; 0: none), the loop calls `maybe_save(step)` after every step.
    `before_save(step)` runs first on every worker (the workers sitting out an elastic grid join
    Ray Train's report), `after_save(step, path)` once it is written.
    """

    root: str | None = None
    ray_storage: bool = False
    every: int = 0
    trainer: "Trainer | None" = None
    before_save: Callable[[int], None] | None = None
    after_save: Callable[[int, str], None] | None = None

    def maybe_save(self, step: int, force: bool = False) -> str | None:
        """Write a checkpoint if `step` is one of the job's checkpoint steps (`force`: any sync
        step of a job with checkpoints, e.g. where an interrupt stopped it)."""
        if not self.every or (step % self.every and not force) or self.trainer is None:
            return None
        with self.trainer.metrics.timer.phase("checkpoint"):
            if self.before_save is not None:
                self.before_save(step)
            path = self.save(self.trainer)
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

    def save(self, trainer: "Trainer", metrics: dict[str, float] | None = None) -> str:
        """Write the trainer's state at its current step (collective over the trainer's workers).
        Inside Ray Train, also report it so Ray's `get_checkpoint()` returns it after a restart."""
        import torch.distributed.checkpoint as dcp

        step = trainer.state.step
        path = self.path_for(step)
        dcp.save(trainer.state_dict(), storage_writer=_writer(path), process_group=trainer.groups.global_pg)
        if self.ray_storage:
            report_checkpoint(path, step, metrics or {})
        return path

    def load(self, trainer: "Trainer", path: str) -> int:
        """Load the checkpoint at `path` into `trainer` (collective; resharding to the trainer's
        grid as needed). Returns the step it was written at."""
        import torch.distributed.checkpoint as dcp

        if not is_complete(path):
            raise FileNotFoundError(f"{path}: not a complete recgrid checkpoint (no .metadata)")
        sd = trainer.state_dict()
        if "compression" in sd:  # a compressed model: the checkpoint's head ids first, before tables that may not fit
            record: dict[str, Any] = {"compression": ""}
            try:
                dcp.load(record, storage_reader=_reader(path), process_group=trainer.groups.global_pg)
            except Exception:  # noqa: BLE001 - written by an uncompressed model: no record
                record["compression"] = None
            trainer.check_compression(record["compression"])
        dcp.load(sd, storage_reader=_reader(path), process_group=trainer.groups.global_pg)
        trainer.load_state_dict(sd)
        return trainer.state.step


def report_checkpoint(path: str | None, step: int, metrics: dict[str, float]) -> None:
    """`ray.train.report` a checkpoint already written in place (every worker of the Ray Train
    group must call it, a worker sitting out an elastic grid too, with path None)."""
    import ray.train
    from ray.train import Checkpoint
    from ray.train.v2.api.report_config import CheckpointUploadMode

    checkpoint = Checkpoint(path) if path is not None else None
    ray.train.report({"step": step, **metrics}, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_name(step),
                     checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
