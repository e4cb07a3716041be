"""The trainer's plain records: `TrainerState` (what must survive a restart), `Snapshot` (one
worker's share of the state inventory, as plain tensors), `StepOutput` and `LoopResult` (what
a step and a loop give back) and `FitHooks` (what a caller plugs into `Trainer.fit`; a hook is
called with the trainer first). The inventory's story: docs/design-notes.md, "Failures, restarts
and elastic jobs"."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from recgrid.data.units import DataCursor
from recgrid.engine.sync import SyncState


@dataclass
class TrainerState:
    """The scalar state that must survive a restart (the tensors live in the model and
    optimizers; `Trainer.state_dict()` gathers everything)."""

    step: int = 0  # finished steps
    examples: int = 0  # examples trained by all workers
    cursor: DataCursor = field(default_factory=DataCursor)
    sync: SyncState = field(default_factory=SyncState)
    evaluated_at: int = -1

    def progress(self) -> dict[str, Any]:
        return {"step": self.step, "examples": self.examples, "cursor": self.cursor.state_dict(),
                "sync": self.sync.counters(), "evaluated_at": self.evaluated_at}

    def load_progress(self, p: dict[str, Any]) -> None:
        self.step, self.examples, self.evaluated_at = int(p["step"]), int(p["examples"]), int(p["evaluated_at"])
        self.cursor.load_state_dict(p["cursor"])
        self.sync.load_counters(p["sync"])


@dataclass
class StepOutput:
    loss: torch.Tensor  # detached scalar
    logits: torch.Tensor  # detached [B]
    labels: torch.Tensor  # [B]
    seconds: float  # compute seconds of this step (forward, backward, optimizers; no replica agreement)
    step: int = 0  # the step this batch counts for
    committed: bool = True  # False: a torchft round that did not commit (the batch is consumed, no step taken)


@dataclass
class Snapshot:
    """This worker's share of the trainer's one state inventory, as plain tensors: its shards
    (embedding weights, optimizer states), the dense part (parameters and optimizer state by
    name), the scalar progress (step, examples, data cursor, sync counters) and this worker's own
    NE window. The shards are the same for
    every member of a replica group right after a sync; the dense part and progress are the
    same on every worker. `Trainer.state_dict()` holds the same parts, the shards in the DMP's
    sharded form (for DCP's resharding)."""

    shard: list[torch.Tensor]
    dense: dict[str, torch.Tensor]
    progress: dict[str, Any]
    window: torch.Tensor

    def to_dict(self) -> dict[str, Any]:
        """A transport's form (torchft's heal): tensors in lists and dicts, the progress as JSON."""
        return {"shard": self.shard, "dense": self.dense, "progress": json.dumps(self.progress), "window": self.window}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Snapshot":
        return cls(list(d["shard"]), dict(d["dense"]), json.loads(d["progress"]), d["window"])


@dataclass
class FitHooks:
    """What the caller plugs into `Trainer.fit` (all run on every worker).

    on_log(metrics, step): the metrics reduced over the workers, every log_every steps, at the
        end and after each evaluation.
    on_batch(trainer, step, batch): every batch the loop consumes, with the step it is trained
        for, before its round commits (the pipelined loop, whose steps all commit, as each comes
        out): row audits, which then hold every committed batch even when the worker dies
        right after the commit.
    on_step(trainer, out, batch): after every batch the loop consumed (`out.committed` False for
        a torchft round that did not commit).
    after_step: called with the step after every committed step, in order; each owns its
        cadence (`Snapshotter.maybe_snapshot`, `Checkpointer.maybe_save`, heartbeats).
    stop_requested(trainer): this worker's view of a stop request (`train.control`'s codes: 0
        none, STOP_FINISH or True, STOP_NOW), read at every stop check (every logging interval,
        and every `Schedule.stop_check_every` steps); the trainer's replica component agrees on it
        (`Replicas.agree_stop`, the largest code wins). STOP_FINISH ends training at a logging
        interval, as if max_steps were reached; STOP_NOW (an interrupt) at the first check at a
        sync step (a multiple of K), with no evaluation, and sets `Trainer.interrupted`.
    """

    on_log: Callable[[dict[str, float], int], None] | None = None
    on_batch: Callable[[Any, int, Any], None] | None = None
    on_step: Callable[[Any, StepOutput, Any], None] | None = None
    after_step: list[Callable[[int], Any]] = field(default_factory=list)
    stop_requested: Callable[[Any], bool] | None = None


@dataclass
class LoopResult:
    steps: int
    step_seconds: list[float] = field(default_factory=list)  # per step: compute + sync
    losses: list[float] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    examples: int = 0
    wall_seconds: float = 0.0
