"""The replica sync: every K steps, average embedding weights and optimizer states over the
replica group (the M workers that hold the same shard). Nothing to do when M = 1.

The tensors are the fused FBGEMM kernels' own storage (`split_embedding_weights()` and
`get_optimizer_state()` return views), so an in-place all-reduce updates the model. fp32 tensors
are summed coalesced in place (one collective per dtype, not one per table) and divided by M.
Low-precision tensors (fp16, bf16 tables) are summed in fp32 buckets of at most `BUCKET_BYTES`,
divided by M there and rounded back once: averaged in their own dtype, identical rows would
drift (fp16(1/3) * 3 != 1, and the sum itself rounds), and a whole-shard fp32 copy would double
the tables' memory. `align` broadcasts through buckets of the same bound, never a copy of the shard.

Delayed moment sync (optional): at sync n the optimizer states are snapshotted and the
snapshot's average is launched asynchronously; at sync n+1 each worker applies
`avg(snapshot_n) + (v_now - snapshot_n)`, so the state communication overlaps K steps of compute.

One sync for every job: the sum over the replica group is a transport (`ReplicaSum`), a process
group in the local launcher's grid, torchft's manager over the live sharding groups in a Ray job.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from recgrid.engine.device import Stopwatch, stopwatch

SyncHook = Callable[["ReplicaSync"], None]

# The most bytes of staging buffer a replica sync or an `align` allocates at once (per collective
# in flight): the bucket size of the fp32 averages of low-precision tables and of the broadcasts.
BUCKET_BYTES = 64 * 2**20
# Tables whose dtype cannot carry a sum of M copies without rounding: averaged in fp32.
LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})


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
    that launched it (`snapshot`: the average's input, never written again), and the buffers the
    average lands in (`averaged`). It lives in the trainer's state (`SyncState.pending`); it is
    dropped where the states it corrects are replaced (a restore, a heal) and, on torchft, where a
    round fails or the live groups change before it lands (`ReplicaSync.drop_pending`): those K
    steps' moments then stay each member's own."""

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


def sync_step(step: int, sync_every: int) -> bool:
    """Whether step `step` (1-based count of finished steps) ends a block of K = `sync_every`
    steps: where the replicas are averaged, a snapshot or checkpoint may be taken, a torchft round
    is voted on and an interrupt may stop. The one place K's cadence is decided."""
    return step % sync_every == 0


class ReplicaSum(Protocol):
    """The replica sync's one transport: a sum over the replica group, in place, started now. A
    process group (`ProcessGroupSum`: the local launcher's grid) or torchft's manager over the
    live sharding groups (`train.recovery.peers.ManagerSum`: a Ray job)."""

    def members(self) -> int: ...  # how many copies the sum adds up (M, or the live groups)
    def sum_(self, tensors: list[torch.Tensor]) -> "Waitable": ...  # same-dtype tensors, summed in place on wait()
    def broadcast_(self, tensors: list[torch.Tensor], src: int, bucket_bytes: int) -> None: ...  # `align`


class Waitable(Protocol):
    def wait(self) -> Any: ...


class ProcessGroupSum:
    """`ReplicaSum` over a process group of `members` workers: one coalesced all-reduce."""

    def __init__(self, pg: dist.ProcessGroup, members: int) -> None:
        self.pg, self._members = pg, members

    def members(self) -> int:
        return self._members

    def sum_(self, tensors: list[torch.Tensor]) -> Waitable:
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self.pg.allreduce_coalesced(tensors, opts)

    def broadcast_(self, tensors: list[torch.Tensor], src: int, bucket_bytes: int) -> None:
        broadcast_bucketed(tensors, self.pg, src, bucket_bytes)


@dataclass
class InFlight:
    """A replica sync launched and not landed yet: the tables it averages (`targets`, views of
    the kernels), the copies the average runs on when it must land only later (`copies`: a
    torchft round lands only once it commits; None: in place), the collectives, and the seconds
    from the launch until the average was in."""

    step: int
    targets: list[torch.Tensor]
    copies: list[torch.Tensor] | None
    works: "_Works"
    low: list[torch.Tensor]  # fp16/bf16 tensors of `copies or targets`: averaged in fp32 at `wait`
    started: float
    seconds: float | None = None
    sent: int = 0  # bytes this worker put into the all-reduces (low-precision tensors: their fp32 buckets)

    def wait(self, transport: ReplicaSum, bucket_bytes: int) -> None:
        """The average is in (`copies or targets` hold it)."""
        if self.seconds is not None:
            return
        self.sent = _nbytes(self.works.after)
        self.works.wait()
        if self.low:
            self.sent += average_low_precision_(self.low, lambda t: transport.sum_([t]), self.works.divisor,
                                                bucket_bytes)
        self.seconds = time.perf_counter() - self.started


class ReplicaSync:
    """Keeps the M copies of every shard in step by averaging them every `sync_every` steps, over
    one `ReplicaSum` transport: the embedding weights and moments, or with delayed moment sync the
    weights now and the moments one sync late (`_delayed_moments`), whose average in flight is
    `state.pending`, inside the trainer's state.

    Args:
        weights, states: this worker's embedding weights and optimizer states (views of the
            fused kernels' storage: `of_model`).
        transport: the sum over the replica group; with one member nothing is ever sent.
        sync_every: K, steps between two syncs.
        delayed_moment_sync: average optimizer states one sync late, asynchronously.
        state: the counters and in-flight average, owned by the caller (the trainer's state).
        bucket_bytes: the most staging memory one fp32 average of low-precision tables, or one
            broadcast of `align`, allocates.
    """

    def __init__(self, weights: list[torch.Tensor], states: list[torch.Tensor], transport: ReplicaSum,
                 sync_every: int, delayed_moment_sync: bool = False, state: SyncState | None = None,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every (K) must be >= 1, got {sync_every}")
        self.weights, self.states, self.transport = weights, states, transport
        self.sync_every = sync_every
        self.delayed_moment_sync = delayed_moment_sync
        self.bucket_bytes = bucket_bytes
        self.state = state if state is not None else SyncState()
        self.before_sync: list[SyncHook] = []
        self.after_sync: list[SyncHook] = []

    @classmethod
    def of_model(cls, model: nn.Module, transport: ReplicaSum, sync_every: int, **kw: Any) -> "ReplicaSync":
        """The replica sync of `model`'s fused kernels (found once, here)."""
        return cls(embedding_weights(model), optimizer_states(model), transport, sync_every, **kw)

    @property
    def stats(self) -> SyncState:
        self.state.settle()
        return self.state

    @property
    def enabled(self) -> bool:
        return self.transport.members() > 1

    def due(self, step: int) -> bool:
        """Whether a sync follows step `step` (1-based count of finished steps)."""
        return self.enabled and sync_step(step, self.sync_every)

    def replicated(self) -> list[torch.Tensor]:
        """What every member holds alike right after a sync, and a sync averages: the weights and
        moments, or with delayed moment sync the weights only (the moments are each member's own
        between their averages)."""
        return self.weights if self.delayed_moment_sync else self.weights + self.states

    def maybe_sync(self, step: int) -> SyncRecord | None:
        return self.sync(step) if self.due(step) else None

    def sync(self, step: int) -> SyncRecord:
        """Average now, in place, and land (the grid's own sync: every step commits)."""
        for hook in self.before_sync:
            hook(self)
        # the host clock on CPU (gloo's waits return when the data is there); CUDA events on a GPU,
        # read when the counters are (no wait for the device here, once per K steps)
        watch = stopwatch(self.weights[0].device if self.weights else torch.device("cpu")).start()
        sent = self._land(self.launch(step, copy=False))
        watch.stop()
        record = SyncRecord(step=step, seconds=0.0 if watch.deferred else watch.seconds, bytes=sent)
        self.state.add(record, watch)
        for hook in self.after_sync:
            hook(self)
        return record

    def launch(self, step: int, copy: bool) -> InFlight:
        """Start the average of `replicated()`: in place, or on copies (`copy`) that `land` writes
        back only when the caller says (a torchft round, once it commits)."""
        targets = self.replicated()
        on = [x.detach().clone() for x in targets] if copy else targets
        return InFlight(step, targets, on if copy else None, launch_average_(on, self.transport),
                        [x for x in on if x.dtype in LOW_PRECISION], time.perf_counter())

    def land(self, inflight: InFlight) -> SyncRecord:
        """Land a launched sync (its average written into the tables, the delayed moments' rule
        applied) and count it; its seconds: from the launch until the average was in, plus the landing."""
        t0 = time.perf_counter()
        sent = self._land(inflight)
        record = SyncRecord(step=inflight.step, seconds=time.perf_counter() - t0 + (inflight.seconds or 0.0),
                            bytes=sent)
        self.state.add(record)
        return record

    def _land(self, inflight: InFlight) -> int:
        inflight.wait(self.transport, self.bucket_bytes)
        if inflight.copies is not None:
            with torch.no_grad():
                for dst, src in zip(inflight.targets, inflight.copies):
                    dst.copy_(src)
        sent = inflight.sent
        if self.delayed_moment_sync:
            sent += self._delayed_moments()
        return sent

    def drop_pending(self, settle: bool = False) -> None:
        """Forget a delayed moment average in flight (a round failed, the live groups changed, or the
        state it corrects was replaced); `settle`: let it land first (its collective must finish)."""
        if settle and self.state.pending is not None:
            self.state.pending.settle()
        self.state.pending = None

    def align(self, src_replica_rank: int = 0) -> None:
        """Copy weights and states from one member of each replica group to the others.

        Used at start (every sharding group initialises its shards independently) and to
        rebuild a worker from its replica-group peers. In place, through staging buckets of at
        most `BUCKET_BYTES`: the extra memory does not grow with the shard.
        """
        if self.enabled:
            self.transport.broadcast_(self.weights + self.states, src_replica_rank, self.bucket_bytes)

    def close(self) -> None:
        """Let a delayed state average still in flight land (before the process groups go away)."""
        if self.state.pending is not None:
            self.state.pending.settle()

    def _delayed_moments(self) -> int:
        """The delayed-moment rule, at a sync that landed: the average launched at the sync before
        lands as a correction, v = avg(v_then) + (v_now - v_then) (each member keeps what it added
        since), and the moments as they are now go into the next average, which overlaps the next
        K steps. Returns the bytes sent."""
        pending = self.state.pending
        if pending is not None:
            pending.settle()
            with torch.no_grad():
                for v, then, avg in zip(self.states, pending.snapshot, pending.averaged):
                    v.add_(avg - then)
        now = [v.detach().clone() for v in self.states]
        averaged = [v.clone() for v in now]
        self.state.pending = PendingAverage(now, averaged, launch_average_(averaged, self.transport))
        return _nbytes(averaged)


def average_(tensors: list[torch.Tensor], transport: ReplicaSum, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Replace each tensor by its mean over the replica group (`transport`), in place, and wait.

    fp32 (and wider) tensors: summed in place, one coalesced collective per dtype, then divided.
    fp16/bf16 tensors: copied into fp32 buckets of at most `bucket_bytes`, summed, divided by
    the members and rounded back once, so M identical copies stay bit-identical.
    Returns the bytes this worker put into the all-reduce.
    """
    inflight = InFlight(0, tensors, None, launch_average_(tensors, transport),
                        [t for t in tensors if t.dtype in LOW_PRECISION], time.perf_counter())
    inflight.wait(transport, bucket_bytes)
    return inflight.sent


def average_low_precision_(tensors: list[torch.Tensor], sum_: Callable[[torch.Tensor], Any], group_size: int,
                           bucket_bytes: int = BUCKET_BYTES) -> int:
    """Replace each fp16/bf16 tensor by its mean over `group_size` members, in place: copied into
    fp32 buckets of at most `bucket_bytes`, summed by `sum_(bucket)` (an all-reduce SUM over the
    members, in place, returning something to `wait()` on), divided by `group_size` and rounded
    back once, so M identical copies stay bit-identical. Returns the bytes put into the all-reduces."""
    sent = 0
    for dtype, group in _by_dtype(tensors).items():
        if dtype not in LOW_PRECISION:
            raise ValueError(f"average_low_precision_ averages fp16/bf16 tensors, got {dtype}")
        for bucket in _buckets(group, bucket_bytes // 4):
            staging = torch.empty(sum(n for _, _, n in bucket), dtype=torch.float32, device=group[0].device)
            _gather_into(staging, bucket)
            sum_(staging).wait()
            staging.div_(group_size)
            _scatter_from(staging, bucket)  # rounds to fp16/bf16 once
            sent += staging.numel() * staging.element_size()
    return sent


def launch_average_(tensors: list[torch.Tensor], transport: ReplicaSum) -> "_Works":
    """Start averaging the fp32 (or wider) of `tensors` over `transport` in place: a coalesced SUM
    per dtype, whose `wait()` also divides by the members. Low-precision tensors are left to
    `average_low_precision_` (summed in fp32)."""
    groups = [g for dtype, g in _by_dtype(tensors).items() if dtype not in LOW_PRECISION]
    return _Works([transport.sum_(group) for group in groups], after=[t for group in groups for t in group],
                  divisor=transport.members())


def broadcast_bucketed(tensors: list[torch.Tensor], pg: dist.ProcessGroup, group_src: int,
                       bucket_bytes: int = BUCKET_BYTES) -> None:
    """Broadcast `tensors` from member `group_src` of `pg` to the others, in place. A tensor of at
    least `bucket_bytes` is broadcast as it is; smaller ones are packed into staging buffers of at
    most `bucket_bytes` (per dtype), so the extra memory is one bucket, whatever the shard's size."""
    for dtype, group in _by_dtype(tensors).items():
        item = torch.empty((), dtype=dtype).element_size()
        small = []
        for t in group:
            if t.numel() * item >= bucket_bytes:
                dist.broadcast(_flat(t), group=pg, group_src=group_src)  # in place, no copy
            else:
                small.append(t)
        for bucket in _buckets(small, max(1, bucket_bytes // item)):
            staging = torch.empty(sum(n for _, _, n in bucket), dtype=dtype, device=group[0].device)
            _gather_into(staging, bucket)
            dist.broadcast(staging, group=pg, group_src=group_src)
            _scatter_from(staging, bucket)


# A piece of a tensor: (tensor, first element, element count) in its flattened order.
_Piece = tuple[torch.Tensor, int, int]


def _buckets(tensors: list[torch.Tensor], elements: int) -> list[list[_Piece]]:
    """Cut the tensors (flattened, in order) into buckets of at most `elements` elements; a tensor
    larger than a bucket is split over several."""
    out: list[list[_Piece]] = []
    bucket: list[_Piece] = []
    room = elements
    for t in tensors:
        start, n = 0, t.numel()
        while n > 0:
            take = min(n, room)
            bucket.append((t, start, take))
            start, n, room = start + take, n - take, room - take
            if room == 0:
                out.append(bucket)
                bucket, room = [], elements
    if bucket:
        out.append(bucket)
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    # kernel weights and states are contiguous views of the kernel's storage; a non-contiguous
    # tensor would make reshape copy, and the copy-back below would be lost
    if not t.is_contiguous():
        raise ValueError(f"replica sync needs contiguous tensors, got one of shape {tuple(t.shape)} "
                         f"and strides {t.stride()}")
    return t.view(-1)


def _gather_into(staging: torch.Tensor, bucket: list[_Piece]) -> None:
    at = 0
    for t, start, n in bucket:
        staging[at:at + n].copy_(_flat(t)[start:start + n])
        at += n


def _scatter_from(staging: torch.Tensor, bucket: list[_Piece]) -> None:
    at = 0
    for t, start, n in bucket:
        _flat(t)[start:start + n].copy_(staging[at:at + n])
        at += n


@dataclass
class _Works:
    """Collectives in flight; `wait()` waits for them, then divides `after` by `divisor` (a SUM
    that is an average once every member's part is in)."""

    works: list = field(default_factory=list)
    after: list[torch.Tensor] = field(default_factory=list)
    divisor: int = 1

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []
        if self.divisor != 1:
            for t in self.after:
                t.div_(self.divisor)
        self.after = []


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.dtype].append(t)
    return dict(groups)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
