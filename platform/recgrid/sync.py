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

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

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
class SyncStats:
    count: int = 0
    seconds: float = 0.0
    bytes: int = 0
    last: SyncRecord | None = None

    def add(self, record: SyncRecord) -> None:
        self.count += 1
        self.seconds += record.seconds
        self.bytes += record.bytes
        self.last = record


class ReplicaSync:
    """Keeps the M copies of every shard in step by averaging them every `sync_every` steps.

    Args:
        model: the sharded model (its fused kernels are found once, here).
        replica_pg: this worker's replica-group process group.
        num_groups: M; with M = 1 nothing is ever sent.
        sync_every: K, steps between two syncs.
        delayed_moment_sync: average optimizer states one sync late, asynchronously.
    """

    def __init__(self, model: nn.Module, replica_pg: dist.ProcessGroup, num_groups: int, sync_every: int,
                 delayed_moment_sync: bool = False) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every (K) must be >= 1, got {sync_every}")
        self.replica_pg = replica_pg
        self.num_groups = num_groups
        self.sync_every = sync_every
        self.delayed_moment_sync = delayed_moment_sync
        self.weights = embedding_weights(model)
        self.states = optimizer_states(model)
        self.stats = SyncStats()
        self.before_sync: list[SyncHook] = []
        self.after_sync: list[SyncHook] = []
        # (work, snapshot as it was locally, snapshot being averaged) of the last delayed state sync
        self._pending: tuple[dist.Work, list[torch.Tensor], list[torch.Tensor]] | None = None

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
        t0 = time.perf_counter()
        sent = 0
        if self.delayed_moment_sync:
            sent += self._all_reduce_avg(self.weights)
            sent += self._delayed_state_sync()
        else:
            sent += self._all_reduce_avg(self.weights + self.states)
        _wait_device(self.weights)
        record = SyncRecord(step=step, seconds=time.perf_counter() - t0, bytes=sent)
        self.stats.add(record)
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
        """Finish a delayed state sync still in flight (before the process groups go away)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def _delayed_state_sync(self) -> int:
        if self._pending is not None:
            work, snapshot, averaged = self._pending
            work.wait()
            for v, s, a in zip(self.states, snapshot, averaged):
                v.add_(a - s)  # v = avg(snapshot_n) + (v_now - snapshot_n)
        snapshot = [v.detach().clone() for v in self.states]
        averaged = [v.clone() for v in snapshot]
        self._pending = (self._launch_avg(averaged), snapshot, averaged)
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


def _wait_device(tensors: list[torch.Tensor]) -> None:
    if tensors and tensors[0].is_cuda:
        torch.cuda.synchronize(tensors[0].device)
