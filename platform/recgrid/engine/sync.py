"""The replica sync: every K steps, average embedding weights and optimizer states over the
replica group (the M workers that hold the same shard). Nothing to do when M = 1.

The tensors are the fused FBGEMM kernels' own storage (`split_embedding_weights()` and
`get_optimizer_state()` return views), so an in-place all-reduce updates the model. They are
all-reduced coalesced: one collective per dtype, not one per table.

Delayed moment sync (optional): at sync n the optimizer states are snapshotted and the
snapshot's average is launched asynchronously; at sync n+1 each worker applies
`avg(snapshot_n) + (v_now - snapshot_n)`, so the state communication overlaps K steps of compute.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from recgrid.engine.device import Stopwatch, stopwatch

SyncHook = Callable[["ReplicaSync"], None]


def embedding_kernels(model: nn.Module) -> list[nn.Module]:
    """Every fused FBGEMM lookup kernel under `model`, in a deterministic order.

    Sharded modules keep their lookups in `_lookups`, which are not registered children, so
    `model.modules()` alone never reaches them.
    """
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    found: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen):
            found.append(m)
        for lookup in getattr(m, "_lookups", []) or []:
            visit(lookup)
        for child in m.children():
            visit(child)

    visit(model)
    return found


def embedding_weights(model: nn.Module) -> list[torch.Tensor]:
    """Per-table weight views of this worker's shards (share storage with the kernels)."""
    return [w for k in embedding_kernels(model) for w in k.split_embedding_weights()]


def optimizer_states(model: nn.Module) -> list[torch.Tensor]:
    """Per-table optimizer-state views (row-wise AdaGrad: one moment per row)."""
    return [s for k in embedding_kernels(model) for table in k.get_optimizer_state() for s in table.values()]


@dataclass
class SyncRecord:
    """One replica sync: when, how long, how many bytes this worker sent into the all-reduce."""

    step: int
    seconds: float
    bytes: int


@dataclass
class PendingAverage:
    """A delayed moment sync's state average in flight: the states as they were at the sync
    that launched it (`snapshot`), and the buffers the average lands in (`averaged`)."""

    snapshot: list[torch.Tensor]
    averaged: list[torch.Tensor]
    work: "_Works | None" = None  # the collective; None once it has landed

    def settle(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


@dataclass
class SyncState:
    """What the replica sync carries from one sync to the next, and across a restore: its
    counters and, with delayed moment sync, the state average in flight. The trainer owns it."""

    count: int = 0
    seconds: float = 0.0
    bytes: int = 0
    last: SyncRecord | None = None
    pending: PendingAverage | None = None
    unsettled: list[tuple[SyncRecord, Stopwatch]] = field(default_factory=list)  # timed on the device, not read yet

    def add(self, record: SyncRecord, watch: Stopwatch | None = None) -> None:
        """Count a sync; with a deferred `watch` (CUDA events) its seconds are read by `settle`."""
        self.count += 1
        self.bytes += record.bytes
        self.last = record
        if watch is not None and watch.deferred:
            self.unsettled.append((record, watch))
        else:
            self.seconds += record.seconds

    def settle(self) -> None:
        """Read the device time of the syncs timed with CUDA events into their records and the
        total (waits for the last one's end: call it when the numbers are wanted, not per step)."""
        for record, watch in self.unsettled:
            record.seconds = watch.seconds
            self.seconds += record.seconds
        self.unsettled.clear()

    def counters(self) -> dict:
        self.settle()
        last = self.last
        return {"count": self.count, "seconds": self.seconds, "bytes": self.bytes,
                "last": None if last is None else [last.step, last.seconds, last.bytes]}

    def load_counters(self, d: dict) -> None:
        self.unsettled.clear()
        self.count, self.seconds, self.bytes = int(d["count"]), float(d["seconds"]), int(d["bytes"])
        self.last = None if d["last"] is None else SyncRecord(int(d["last"][0]), float(d["last"][1]), int(d["last"][2]))


class ReplicaSync:
    """Keeps the M copies of every shard in step by averaging them every `sync_every` steps.

    Args:
        model: the sharded model (its fused kernels are found once, here).
        replica_pg: this worker's replica-group process group.
        num_groups: M; with M = 1 nothing is ever sent.
        sync_every: K, steps between two syncs.
        delayed_moment_sync: average optimizer states one sync late, asynchronously.
        state: the counters and in-flight average, owned by the caller (the trainer's state).
    """

    def __init__(self, model: nn.Module, replica_pg: dist.ProcessGroup, num_groups: int, sync_every: int,
                 delayed_moment_sync: bool = False, state: SyncState | None = None) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every (K) must be >= 1, got {sync_every}")
        self.replica_pg = replica_pg
        self.num_groups = num_groups
        self.sync_every = sync_every
        self.delayed_moment_sync = delayed_moment_sync
        self.weights = embedding_weights(model)
        self.states = optimizer_states(model)
        self.state = state if state is not None else SyncState()
        self.before_sync: list[SyncHook] = []
        self.after_sync: list[SyncHook] = []

    @property
    def stats(self) -> SyncState:
        self.state.settle()
        return self.state

    @property
    def enabled(self) -> bool:
        return self.num_groups > 1

    def due(self, step: int) -> bool:
        """Whether a sync follows step `step` (1-based count of finished steps)."""
        return self.enabled and step % self.sync_every == 0

    def maybe_sync(self, step: int) -> SyncRecord | None:
        return self.sync(step) if self.due(step) else None

    def sync(self, step: int) -> SyncRecord:
        for hook in self.before_sync:
            hook(self)
        # the host clock on CPU (gloo's waits return when the data is there); CUDA events on a GPU,
        # read when the counters are (no wait for the device here, once per K steps)
        watch = stopwatch(self.weights[0].device if self.weights else torch.device("cpu")).start()
        sent = 0
        if self.delayed_moment_sync:
            sent += self._all_reduce_avg(self.weights)
            sent += self._delayed_state_sync()
        else:
            sent += self._all_reduce_avg(self.weights + self.states)
        watch.stop()
        record = SyncRecord(step=step, seconds=0.0 if watch.deferred else watch.seconds, bytes=sent)
        self.state.add(record, watch)
        for hook in self.after_sync:
            hook(self)
        return record

    def align(self, src_replica_rank: int = 0) -> None:
        """Copy weights and states from one member of each replica group to the others.

        Used at start (every sharding group initialises its shards independently) and to
        rebuild a worker from its replica-group peers.
        """
        if not self.enabled:
            return
        for tensors in _by_dtype(self.weights + self.states).values():
            flat = torch._utils._flatten_dense_tensors(tensors)
            dist.broadcast(flat, group=self.replica_pg, group_src=src_replica_rank)
            for t, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
                t.copy_(synced)

    def close(self) -> None:
        """Let a delayed state average still in flight land (before the process groups go away)."""
        if self.state.pending is not None:
            self.state.pending.settle()

    def _delayed_state_sync(self) -> int:
        pending = self.state.pending
        if pending is not None:
            pending.settle()
            for v, s, a in zip(self.states, pending.snapshot, pending.averaged):
                v.add_(a - s)  # v = avg(snapshot_n) + (v_now - snapshot_n)
        snapshot = [v.detach().clone() for v in self.states]
        averaged = [v.clone() for v in snapshot]
        self.state.pending = PendingAverage(snapshot, averaged, self._launch_avg(averaged))
        return _nbytes(averaged)

    def _all_reduce_avg(self, tensors: list[torch.Tensor]) -> int:
        self._launch_avg(tensors).wait()
        return _nbytes(tensors)

    def _launch_avg(self, tensors: list[torch.Tensor]) -> "_Works":
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = dist.ReduceOp.AVG
        return _Works([self.replica_pg.allreduce_coalesced(group, opts) for group in _by_dtype(tensors).values()])


@dataclass
class _Works:
    works: list = field(default_factory=list)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.dtype].append(t)
    return dict(groups)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
