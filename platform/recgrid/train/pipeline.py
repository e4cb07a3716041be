"""What the trainer's pipelined loop (TorchRec's `TrainPipelineSparseDist`, on CUDA) needs
around the pipeline: `RoundCommit`, the dense optimizer as the pipeline calls it, whose step is
the round's commit, and `BatchFeeder`, the batches it reads, kept until trained so that a dropped
pipeline's prefetched batches are fed again. `trainer` is the `train.trainer.Trainer` (its loop:
docs/design-notes.md, "GPUs")."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Iterator


class RoundCommit:
    """The dense optimizer as TorchRec's pipeline calls it (`zero_grad`, `step`): the pipeline's
    optimizer step ends the round. It hands the round's batch to `on_batch` (before the commit, as
    the plain loop does), asks the replicas to commit (`Replicas.commit`; the grid's own always
    do), and steps the dense optimizer only if the round committed. Where the commit talks to
    peers (torchft), its seconds are taken out of the "dense" phase (`seconds`, charged to "sync")."""

    def __init__(self, trainer: Any, feeder: "BatchFeeder",
                 on_batch: Callable[[Any, int, Any], None] | None) -> None:
        self.trainer, self.feeder, self.on_batch = trainer, feeder, on_batch
        self.committed, self.seconds = True, 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.trainer.dense_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        t = self.trainer
        step = t.state.step + 1
        if self.on_batch is not None:
            self.on_batch(t, step, self.feeder.training)
        talks = t.replicas.rounds_talk
        if talks:
            t.metrics.timer.stop("dense")
        t0 = time.perf_counter()
        self.committed = t.replicas.commit(step)
        self.seconds = time.perf_counter() - t0 if talks else 0.0
        if talks:
            t.metrics.timer.start("dense")
        if self.committed:
            t.dense_optimizer.step()


class BatchFeeder:
    """What the training pipeline reads from: a worker's batches, pulled from `source` with the
    wait charged to the "data_wait" phase, and every batch handed to the pipeline kept until its
    step is trained (in order: the pipeline trains first in, first out).

    `prefetch(n)` pulls ahead before a step opens, so the step's span holds no wait for data;
    `trained()` gives the batch of the output that just came out; `refeed()` puts the batches a
    dropped pipeline held back in front (they are read again, by the next pipeline); `drop()`
    forgets them (a restore, or training ends: the cursor counts only trained batches).
    """

    def __init__(self, source: Iterator[Any], timer: Any) -> None:
        self._source, self._timer = source, timer
        self._ready: deque = deque()  # pulled, not yet handed to the pipeline
        self._in_flight: deque = deque()  # handed to the pipeline, not yet trained
        self._exhausted = False

    @property
    def drained(self) -> bool:
        """No batch left to hand out."""
        return self._exhausted and not self._ready

    def prefetch(self, n: int) -> None:
        t0 = time.perf_counter()
        while len(self._ready) < n and not self._exhausted:
            batch = next(self._source, None)
            if batch is None:
                self._exhausted = True
            else:
                self._ready.append(batch)
        self._timer.add("data_wait", time.perf_counter() - t0)

    def __iter__(self) -> "BatchFeeder":
        return self

    def __next__(self) -> Any:
        if not self._ready:
            self.prefetch(1)
        if not self._ready:
            raise StopIteration
        batch = self._ready.popleft()
        self._in_flight.append(batch)
        return batch

    @property
    def training(self) -> Any:
        """The batch the pipeline is training now (the oldest handed to it)."""
        return self._in_flight[0]

    def trained(self) -> Any:
        return self._in_flight.popleft()

    def refeed(self) -> None:
        self._ready.extendleft(reversed(self._in_flight))
        self._in_flight.clear()

    def drop(self) -> None:
        self._ready.clear()
        self._in_flight.clear()
