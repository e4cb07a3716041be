"""Fault tolerance with torchft (`train.fault_tolerance=torchft`): the trainer's replica component
for live replicas. The surviving replicas keep running; only a failed one is replaced, and it
heals from a live peer.

Where it applies: grids with L = 1 (M = T, every worker a whole model copy). Ray 2.60's
`TorchftConfig` makes every worker its own torchft replica group (its worker group hard-codes
`replica_group_size=1`) and replaces only the replica groups that failed; a sharding group of
L > 1 workers cannot be one of them, so larger L keeps the holder path (`train.recovery`).

The grid in torchft's terms: a torchft replica group is a recgrid sharding group (here one
worker: TorchRec's DMP over a world of one, the whole model on this worker); torchft's
fault-tolerant process group across replica groups is the recgrid replica group.

This module is only the component the trainer's one loop calls (`Trainer.fit`, with
`trainer.replicas = TorchftReplicas(...)`); what the loop does per round is the same as every
path's, the component decides what differs:
  1. `start_round`: `Manager.start_quorum()`, synchronous: the live replicas agree on a quorum.
     A replica behind the others (a replacement) receives a live peer's state over `PGTransport`
     before it computes: the trainer's own state inventory (`Trainer.snapshot()`, sent as
     `Snapshot.to_dict()`: embedding weights and row-wise AdaGrad moments, the dense part, the
     progress with the data cursor), and the loop reads on from the healed cursor. c follows the
     live replica count unless `optim.moment_scale` fixes it.
  2. the loop's forward and backward on this replica's batch; FBGEMM's fused kernels update the
     embedding rows inside backward, as in every recgrid step, so these updates cannot wait for
     the commit (an uncommitted round's batch reaches its own replica's tables, not the dense part).
  3. `commit`: the dense gradients are averaged over the live replicas through the manager;
     every K steps the embedding weights and moments are averaged too, into a buffer (torchft's
     LocalSGD idea); then `Manager.should_commit()`. Only a committed round's dense optimizer
     steps, its averaged tables land (`sync`) and the step count advances. A round that does not
     commit (a peer died inside it) is not a step: the next round takes the next batch under the
     same step number.
  4. at logging steps the metric sums are reduced over the live replicas (`reduce`), and a
     graceful stop is agreed as a maximum over them (`agree_stop`), so every replica ends at the
     same step.
Nothing is rolled back: survivors never go back, a newcomer starts where they are. If every
replica fails at once, Ray Train restarts them all and, with no storage checkpoints on this path
yet, training starts again from step 0.

Data: each epoch is split into T parts by replica id (as torchft's DistributedSampler splits by
replica group), and the data cursor is shared by the live replicas (a newcomer receives it with
the state). The rows of a dead replica's part for the rounds it is away are not trained in that
epoch; every other row is read once.

Who logs, evaluates and records the replacements is the worker's business
(`train.worker.ReplicaReport`, told of each quorum and commit through `ReplicaListener`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import timedelta
from typing import Any, Callable, Protocol

from recgrid.engine.device import process_group_backend
from recgrid.engine.optimizer import moment_scale_for
from recgrid.engine.sync import LOW_PRECISION, SyncRecord, average_low_precision_, embedding_kernels
from recgrid.train.metrics import reduce_metrics
from recgrid.train.recovery import digest
from recgrid.train.trainer import Replicas, Snapshot, Trainer

TIMEOUT_S = 30  # collectives and the heal transfer; a dead peer's sockets close, so its collectives fail sooner
QUORUM_TIMEOUT_S = 120  # longer than the lighthouse's join timeout (60 s): a peer evaluating is waited for


def make_manager(heal: "HealTransport", replica: int, device: Any) -> Any:
    """This replica's torchft manager: gloo (NCCL on a GPU: `engine.device.process_group_backend`)
    across replicas, heals over the same process group (`PGTransport`), a quorum of at least one
    live replica, every round synchronous (a heal lands before the forward pass, and a peer's
    state is read while it waits)."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    from torchft.checkpointing.pg_transport import PGTransport

    timeout = timedelta(seconds=TIMEOUT_S)
    kind = {"nccl": ProcessGroupNCCL, "gloo": ProcessGroupGloo}[process_group_backend(device.type)]
    pg = kind(timeout=timeout)
    return Manager(pg=pg, load_state_dict=heal.load, state_dict=heal.state_dict, min_replica_size=1,
                   use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
                   world_size=1, rank=0, replica_id=f"recgrid_{replica}",
                   checkpoint_transport=PGTransport(pg, timeout=timeout, device=device))


def kernel_digest(trainer: Trainer) -> str:
    """Checksum of this replica's embedding weights and moments (equal iff bit for bit equal)."""
    return digest([t.detach().cpu().numpy() for t in trainer.shard_tensors()])


def dense_digest(trainer: Trainer) -> str:
    dense = trainer.dense_state()
    return digest([dense[k].numpy() for k in sorted(dense)])


class HealTransport:
    """What torchft sends a recovering replica, and how the replica loads it (the manager's
    `state_dict` / `load_state_dict`): the trainer's snapshot (its one state inventory), plus
    who sent it and the weights' checksum, so the heal can be shown bit for bit."""

    def __init__(self, trainer: Trainer, replica: int) -> None:
        self.trainer, self.replica = trainer, replica
        self.heals: list[dict[str, Any]] = []  # heals of this replica, newest last
        self.unseen_heal = False  # set by `load`, cleared by the component (the data cursor moved)
        self.sent = 0  # heals this replica sent to a peer (`state_dict`)

    def state_dict(self) -> dict[str, Any]:
        # contiguous copies: PGTransport sends a tensor's whole storage, and the kernels' views share one
        snap = self.trainer.snapshot(copy=False)
        snap.shard = [t.detach().clone() for t in snap.shard]
        self.sent += 1
        return {"snapshot": snap.to_dict(), "from": self.replica,
                "digest": digest([t.cpu().numpy() for t in snap.shard])}

    def load(self, sd: dict[str, Any]) -> None:
        t0 = time.time()
        self.trainer.load_snapshot(Snapshot.from_dict(sd["snapshot"]), window=None)
        self.heals.append({"from": int(sd["from"]), "step": self.trainer.state.step, "source_digest": sd["digest"],
                           "digest": kernel_digest(self.trainer), "load_s": time.time() - t0, "at": time.time()})
        self.unseen_heal = True


class ReplicaListener(Protocol):
    """What the worker hears from the component."""

    def quorum(self, live: int, rank: int) -> None: ...  # after every quorum: live replicas, this one's rank
    def finished_elsewhere(self) -> bool: ...  # a newcomer with nothing left to train
    def committed(self, step: int, live: int, synced: bool) -> None: ...  # after a committed round
    def say(self, msg: str) -> None: ...  # a line for the user's console


class TorchftReplicas(Replicas):
    """The trainer's replica component under torchft (the module docstring's rounds)."""

    rounds_talk = True  # every round asks the quorum, every commit too: charged to "sync"

    def __init__(self, trainer: Trainer, manager: Any, heal: HealTransport, listener: ReplicaListener) -> None:
        super().__init__(trainer)
        self.manager, self.heal, self.listener = manager, heal, listener
        self.live: int | None = None  # live replicas in the current quorum
        self.moment_scale: float | None = None
        self._tables: "_Average | None" = None  # a committed round's table average, to land in `sync`

    def start_round(self) -> str:
        self.manager.start_quorum()  # heals this replica here when it is behind
        live = self.manager.num_participants()
        t = self.trainer
        c = moment_scale_for(live, t.config.moment_scale)
        if c != self.moment_scale:  # the fused kernels' lr and eps carry c (engine.optimizer)
            t.embedding_optimizer = opt = t.config.embedding_optimizer(live)
            fused = opt.fused_params()
            for kernel in embedding_kernels(t.model):
                kernel.update_hyper_parameters({"lr": fused["learning_rate"], "eps": fused["eps"]})
            self.moment_scale = c
        self.live = live
        self.listener.quorum(live, self.manager.participating_rank())
        if self.listener.finished_elsewhere():
            return "end"
        if self.heal.unseen_heal:  # the state and its data cursor came from a peer
            self.heal.unseen_heal = False
            return "reload"
        return "train"

    def commit(self, step: int) -> bool:
        import torch

        t, live = self.trainer, self.live or 1
        params = t.dense_params()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = self._average([p.grad for p in params]) if live > 1 else None
        syncing = live > 1 and step % t.config.sync_every == 0
        tables = self._average([x.detach().clone() for x in t.shard_tensors()]) if syncing else None
        for job in (grads, tables):
            if job is not None:
                job()
        committed = self.manager.should_commit()
        self._tables = tables if committed else None
        if not committed:
            err = self.manager.errored()
            why = str(getattr(err, "original_exception", err) or "the quorum did not agree").splitlines()[0][:200]
            self.listener.say(f"replica {self.heal.replica}: the round for step {step} did not commit ({why}); "
                              f"the next round takes the next batch")
        return committed

    def sync(self, step: int) -> float:
        """Land the committed round's table average (the replica sync of this path)."""
        import torch

        t0 = time.perf_counter()
        tables, self._tables = self._tables, None
        if tables is not None:
            with torch.no_grad():
                for dst, src in zip(self.trainer.shard_tensors(), tables.tensors):
                    dst.copy_(src)
            self.trainer.state.sync.add(SyncRecord(step=step, seconds=time.perf_counter() - t0 + tables.seconds,
                                                   bytes=sum(x.numel() * x.element_size() for x in tables.tensors)))
        self.listener.committed(step, self.live or 1, tables is not None)
        return time.perf_counter() - t0

    @property
    def workers(self) -> int:
        return self.live or 1

    def reduce(self, **states: Any) -> dict[str, float]:
        live = self.live or 1
        values = reduce_metrics(reducer=self._reduce_sums if live > 1 else None, **states)
        if "train" in states:
            values["train/examples_total"] = float(self.trainer.state.examples)  # the job's, not a sum of replicas'
        return values

    def agree_stop(self, mine: int) -> int:
        import torch
        from torch.distributed import ReduceOp

        # on the trainer's device: the manager's process group is NCCL on CUDA, which refuses CPU tensors
        stop = torch.tensor([float(mine)], dtype=torch.float64, device=self.trainer.device)
        if (self.live or 1) > 1:
            self.manager.allreduce(stop, reduce_op=ReduceOp.MAX).wait()
        return int(stop[0])

    def evaluates(self) -> bool:
        """The live replica of quorum rank 0 evaluates (every eval row, on its own)."""
        return self.manager.participating_rank() == 0

    def _average(self, tensors: list[Any]) -> "_Average":
        """Launch the average of `tensors` over the live replicas: fp32 (and wider) tensors as one
        flat buffer per dtype, now; fp16/bf16 ones when the result is called, summed in fp32
        buckets and divided there (`engine.sync.average_low_precision_`: averaged in their own
        dtype, identical rows would drift). Calling the result waits and writes the averages
        back into `tensors`."""
        from torch._utils import _flatten_dense_tensors
        from torch.distributed import ReduceOp

        t0 = time.perf_counter()
        by_dtype: dict[Any, list[Any]] = defaultdict(list)
        low = []
        for x in tensors:
            self._check_device(x)
            (low if x.dtype in LOW_PRECISION else by_dtype[x.dtype]).append(x)
        launched = []
        for group in by_dtype.values():
            flat = _flatten_dense_tensors(group)
            launched.append((self.manager.allreduce(flat), flat, group))
        live = self.live or 1

        def average_low() -> None:
            average_low_precision_(low, lambda t: self.manager.allreduce(t, reduce_op=ReduceOp.SUM), live)

        return _Average(tensors, launched, t0, average_low if low else None)

    def _check_device(self, x: Any) -> None:
        """Every tensor of a collective over the replicas lives on the trainer's device: the
        manager's process group is NCCL there on CUDA (`make_manager`), and NCCL refuses CPU tensors."""
        if x.device.type != self.trainer.device.type:
            raise RuntimeError(f"a {x.device} tensor was handed to the replicas' {self.trainer.device.type} "
                               f"collective; it must live on {self.trainer.device}")

    def _reduce_sums(self, sums: Any, maxes: Any) -> None:
        """`reduce_metrics`' reducer: the metric sums and maxima over the live replicas."""
        from torch.distributed import ReduceOp

        device = self.trainer.device  # the manager's process group's (NCCL on CUDA refuses CPU tensors)
        on = [x if x.device.type == device.type else x.to(device) for x in (sums, maxes)]
        works = [self.manager.allreduce(on[0], reduce_op=ReduceOp.SUM),
                 self.manager.allreduce(on[1], reduce_op=ReduceOp.MAX)]
        for w in works:
            w.wait()
        for x, y in zip((sums, maxes), on):
            if y is not x:
                x.copy_(y)


class _Average:
    """An average in flight over the live replicas: call it to wait and write the result back
    (and to average the low-precision tensors, `low`, which are summed in fp32 then)."""

    def __init__(self, tensors: list[Any], launched: list[tuple[Any, Any, list[Any]]], started: float,
                 low: "Callable[[], None] | None" = None) -> None:
        self.tensors, self.launched, self.started, self.low = tensors, launched, started, low
        self.seconds = 0.0

    def __call__(self) -> None:
        from torch._utils import _unflatten_dense_tensors

        for work, flat, group in self.launched:
            work.wait()
            for x, avg in zip(group, _unflatten_dense_tensors(flat, group)):
                x.copy_(avg)
        if self.low is not None:
            self.low()
        self.seconds = time.perf_counter() - self.started
