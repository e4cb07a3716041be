"""Fault tolerance with torchft (every job: each sharding group a Ray Train run): the trainer's
replica component for live sharding groups (`TorchftReplicas`), the job's lighthouse, each
worker's manager, the heal transport and the replica sync's transport over the manager.

The grid in torchft's terms: a torchft replica group is a recgrid sharding group (L workers, one
whole model copy; TorchRec's DMP over the group's process group), and torchft's fault-tolerant
process group of shard rank s across the live groups is recgrid's replica group s: torchft
averages and heals shard s from shard s of a live peer group. The groups meet across runs
through torchft, torchft's own deployment model (one job per replica group): the driver owns the
lighthouse (`Lighthouse`), and each worker's manager meets its group in the run's rendezvous
store (`GroupWorld`). (Ray 2.60's own torchft integration, `TorchftConfig`, makes replica groups
of one worker and fails the run when two dead workers must be replaced at once, as in a node loss.)

What the component does per round, as the trainer's loop calls it: `start_round` (a quorum only
at a group's first round, after a round that did not commit, or at a block start the last sync
step asked for; a group behind the others heals there from a live peer), `commit` (one average
over the live groups of the dense gradients and, every K steps, the tables through the one
replica sync, `engine.sync.ReplicaSync` over `ManagerSum`; then the group's L workers agree in
one small all-reduce that no collective of the round failed, and on the next block's start and
votes), `sync` (a committed round's tables land), `reduce` and `agree_stop` at log steps. A round
that does not commit is not a step: its workers abort their process groups across the groups and
vote it down (`_abandon_round`). Nothing is rolled back: survivors never go back, a rebuilt group
starts where they are, and reads on from its own data cursor. With no live group ahead of step 0
a group's first quorum restores from the hosts' holders or storage (`train.recovery.storage`).
A group whose node is drained leaves after its sync (`TorchftReplicas.left`).

The protocol, what each part costs and why: docs/design-notes.md, "Failures, restarts and
elastic jobs".
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Protocol

from recgrid.engine.device import process_group_backend
from recgrid.engine.optimizer import moment_scale_for
from recgrid.engine.sync import InFlight, ReplicaSync, embedding_kernels
from recgrid.train.metrics import reduce_metrics
from recgrid.train.recovery.slots import digest
from recgrid.train.state import Snapshot
from recgrid.train.trainer import Replicas, Trainer

if TYPE_CHECKING:
    from recgrid.train.recovery.storage import StorageFallback

TIMEOUT_S = 30  # collectives and the heal transfer; a dead peer's sockets close, so its collectives fail sooner
QUORUM_TIMEOUT_S = 120  # longer than the lighthouse's join timeout: a peer evaluating is waited for


GROUP_START_S = 120  # how long a sharding group's manager waits to reach its group's store and the lighthouse
# torchft's lighthouse leaves out a sharding group whose manager server has not beaten for this long
# (torchft's default is 5 s: the groups that kept training would wait that long after every failure);
# managers beat every 100 ms
LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS = 2000
# how long torchft's lighthouse waits, once more than half of the beating groups ask for a quorum, for
# the other beating ones (torchft's Python default is 100 ms: a live group that reached a quorum the
# live groups agreed on 100 ms after the first was left out of it, and then waited alone, short of
# more than half, until its quorum timeout); a dead group stops beating and is left out after
# LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS whatever this says
LIGHTHOUSE_JOIN_TIMEOUT_MS = 60_000
LOCAL_LIGHTHOUSE_HOST = "127.0.0.1"  # a local job's lighthouse address when the hostname does not resolve
# how often a sharding group asks Ray Train whether a node of its run is being drained (at a sync step
# its workers agreed on at the one before): Ray Train's own watcher polls Ray every 5 s, and a
# drain gives minutes (a spot reclaim: 30 s or more)
DRAIN_CHECK_S = 2.0


@dataclass(frozen=True)
class GroupWorld:
    """Where this worker stands under torchft: shard rank `shard` of sharding group `group` (one
    Ray Train run of `size` workers, whose torch world is the group: the default process group),
    the group's store (the run's rendezvous store, where the group's torchft manager meets too)
    and the job's lighthouse."""

    group: int
    shard: int
    size: int
    store_host: str
    store_port: int
    lighthouse: str

    @classmethod
    def of_run(cls, ctx: Any, group: int, lighthouse: str) -> "GroupWorld":
        """This worker's place in its sharding group's Ray Train run (`ctx`: Ray Train's context;
        the store its torch backend rendezvoused in: MASTER_ADDR and MASTER_PORT)."""
        return cls(group=group, shard=ctx.get_world_rank(), size=ctx.get_world_size(),
                   store_host=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
                   lighthouse=lighthouse)


class Lighthouse:
    """torchft's lighthouse for one job, owned by its driver (it lives as long as the job, whatever
    happens to the sharding groups' runs): a quorum needs `min_groups` live sharding groups (the
    job's `min_groups`: one unless `grid.min_world_size` asks for more) and waits for every group
    that beats (up to LIGHTHOUSE_JOIN_TIMEOUT_MS), and a group whose manager stopped beating for
    LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS is left out. It listens on
    `host` (the node's own address, not every interface: `bind_host`)."""

    def __init__(self, host: str, min_groups: int = 1) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse logs every quorum at INFO (read at import)
        from torchft.coordination import LighthouseServer

        at = f"[{host}]" if ":" in host else host  # an IPv6 address in brackets
        self.server = LighthouseServer(bind=f"{at}:0", min_replicas=min_groups,
                                       join_timeout_ms=LIGHTHOUSE_JOIN_TIMEOUT_MS,
                                       heartbeat_timeout_ms=LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS)
        port = self.server.address().rsplit(":", 1)[1]  # it advertises the hostname: the workers dial `host`
        self.address = f"http://{at}:{port}"

    def shutdown(self) -> None:
        self.server.shutdown()


def bind_host(on_cluster: bool) -> str:
    """The address the job's lighthouse binds: the node's IP on a cluster; on a local cluster the
    address the hostname resolves to (loopback on the usual host), else LOCAL_LIGHTHOUSE_HOST."""
    import socket

    import ray

    if on_cluster:
        return ray.util.get_node_ip_address()
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return LOCAL_LIGHTHOUSE_HOST


def make_manager(heal: "HealTransport", world: GroupWorld, device: Any, min_groups: int = 1) -> tuple[Any, Any]:
    """This worker's torchft manager and its process group across the live groups (the replica
    group of its shard rank: abort it the moment this worker stops training, so the peers' collectives
    with it fail at once instead of at their timeout): shard rank s of its sharding group's L (the group's manager
    server on shard rank 0, found through the group's store), gloo (NCCL on a GPU:
    `engine.device.process_group_backend`) across groups, heals over the same process group
    (`PGTransport`) only a group behind the others (no step-0 sync: the groups start alike), a
    quorum of at least `min_groups` live groups, every round synchronous (a heal lands before the forward
    pass, and a peer's state is read while it waits)."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    from torchft.checkpointing.pg_transport import PGTransport

    timeout = timedelta(seconds=TIMEOUT_S)
    kind = {"nccl": ProcessGroupNCCL, "gloo": ProcessGroupGloo}[process_group_backend(device.type)]
    pg = kind(timeout=timeout)
    # init_sync off: every group builds the same model from the job's seed, and torchft's step-0 sync heals
    # shard ranks from different groups (its sources are spread by shard rank), so one worker of a group
    # would load a peer's state while its group-mate does not
    return Manager(pg=pg, load_state_dict=heal.load, state_dict=heal.state_dict, min_replica_size=min_groups,
                   use_async_quorum=False, init_sync=False, timeout=timeout,
                   quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
                   connect_timeout=timedelta(seconds=GROUP_START_S),
                   world_size=world.size, rank=world.shard, store_addr=world.store_host, store_port=world.store_port,
                   lighthouse_addr=world.lighthouse, replica_id=f"recgrid_g{world.group}",
                   checkpoint_transport=PGTransport(pg, timeout=timeout, device=device)), pg


def kernel_digest(trainer: Trainer, replicated: bool = False) -> str:
    """Checksum of this worker's embedding weights and moments (equal iff bit for bit equal);
    `replicated`: of what the replica sync averages only (`ReplicaSync.replicated`)."""
    shard = trainer.replica_sync.replicated() if replicated else trainer.shard_tensors()
    return digest([t.detach().cpu().numpy() for t in shard])


def dense_digest(trainer: Trainer) -> str:
    dense = trainer.dense_state()
    return digest([dense[k].numpy() for k in sorted(dense)])


class ManagerSum:
    """The replica sync's transport in a Ray job (`engine.sync.ReplicaSum`): a sum over the live
    sharding groups through torchft's manager (shard s with shard s), whose members are the live
    groups of the current quorum. The tensors of one call are flattened into one buffer, summed,
    and written back on `wait()`."""

    def __init__(self, manager: Any, members: Callable[[], int], device: Any) -> None:
        self.manager, self._members, self.device = manager, members, device

    def members(self) -> int:
        return self._members()

    def sum_(self, tensors: list[Any]) -> "_Unflatten":
        from torch._utils import _flatten_dense_tensors
        from torch.distributed import ReduceOp

        for x in tensors:  # the manager's process group is NCCL on CUDA (`make_manager`): it refuses CPU tensors
            if x.device.type != self.device.type:
                raise RuntimeError(f"a {x.device} tensor was handed to the replicas' {self.device.type} "
                                   f"collective; it must live on {self.device}")
        flat = tensors[0].view(-1) if len(tensors) == 1 and tensors[0].is_contiguous() else _flatten_dense_tensors(tensors)
        return _Unflatten(self.manager.allreduce(flat, reduce_op=ReduceOp.SUM), flat, tensors)

    def broadcast_(self, tensors: list[Any], src: int, bucket_bytes: int) -> None:
        raise NotImplementedError("sharding groups under torchft start alike; a rebuilt one heals from a live peer")


class _Unflatten:
    """A manager sum in flight over a flat buffer: `wait()` writes it back into its tensors."""

    def __init__(self, work: Any, flat: Any, tensors: list[Any]) -> None:
        self.work, self.flat, self.tensors = work, flat, tensors

    def wait(self) -> None:
        from torch._utils import _unflatten_dense_tensors

        self.work.wait()
        if len(self.tensors) == 1 and self.flat.data_ptr() == self.tensors[0].data_ptr():
            return
        for x, total in zip(self.tensors, _unflatten_dense_tensors(self.flat, self.tensors)):
            x.copy_(total)


class HealTransport:
    """What torchft sends a recovering group, and how its workers load it (the manager's
    `state_dict` / `load_state_dict`): the trainer's snapshot (its one state inventory), plus
    which group sent it and the weights' checksum, so the heal can be shown bit for bit. The
    data cursor is the one thing not taken from the peer: `own_cursor()` gives this group's own
    newest one (None: it never committed, and reads its parts from the start of the epoch plan)."""

    def __init__(self, trainer: Trainer, group: int,
                 own_cursor: Callable[[], dict[str, Any] | None] = lambda: None) -> None:
        self.trainer, self.group, self.own_cursor = trainer, group, own_cursor
        self.heals: list[dict[str, Any]] = []  # heals of this sharding group, newest last
        self.restored: dict[str, Any] | None = None  # a restore from a storage checkpoint (`StorageFallback`)
        self.unseen_heal = False  # set by `load`, cleared by the component (the data cursor moved)
        self.sent = 0  # heals this sharding group sent to a peer (`state_dict`)

    def state_dict(self) -> dict[str, Any]:
        # contiguous copies: PGTransport sends a tensor's whole storage, and the kernels' views share one
        snap = self.trainer.snapshot(copy=False)
        snap.shard = [t.detach().clone() for t in snap.shard]
        self.sent += 1
        return {"snapshot": snap.to_dict(), "from": self.group,
                "digest": digest([t.cpu().numpy() for t in snap.shard])}

    def load(self, sd: dict[str, Any]) -> None:
        t0 = time.time()
        snap = Snapshot.from_dict(sd["snapshot"])
        own = self.own_cursor()
        snap.progress["cursor"] = own if own is not None else type(self.trainer.state.cursor)().state_dict()
        self.trainer.load_snapshot(snap, window=None)
        self.heals.append({"from": int(sd["from"]), "step": self.trainer.state.step, "source_digest": sd["digest"],
                           "digest": kernel_digest(self.trainer), "load_s": time.time() - t0, "at": time.time()})
        self.unseen_heal = True


class GroupListener(Protocol):
    """What the worker hears from the component."""

    def quorum(self, live: int, rank: int) -> None: ...  # after every quorum: live groups, this group's rank
    def finished_elsewhere(self) -> bool: ...  # a newcomer with nothing left to train
    def committed(self, step: int, live: int, synced: bool) -> None: ...  # after a committed round
    def say(self, msg: str) -> None: ...  # a line for the user's console


def keep_local_gradients(model: Any) -> None:
    """Turn DDP's own all-reduce of the dense gradients off in `model`: a communication hook that
    hands each bucket back as it is, on each of its DistributedDataParallel modules (DDP's public
    `register_comm_hook`), so the gradients after backward are this worker's own. Under torchft
    the component averages them itself, over the live groups and then over the sharding group,
    with the round's agreement in the same all-reduce (`TorchftReplicas.commit`)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    def local(_, bucket):  # type: ignore[no-untyped-def]  # DDP refuses a hook annotated other than its own types
        done = torch.futures.Future()  # type: ignore[var-annotated]
        done.set_result(bucket.buffer())
        return done

    for m in model.modules():
        if isinstance(m, DistributedDataParallel):
            m.register_comm_hook(None, local)


class JoinSignal(Protocol):
    """How the live sharding groups learn that a group waits at the lighthouse to join (they ask for
    a quorum only then, or after a round that did not commit: never while nothing changes)."""

    def announce(self) -> None: ...  # this group asks for its first quorum now
    def pending(self) -> bool: ...  # this worker has heard of a group asking since it last said so


class TorchftReplicas(Replicas):
    """The trainer's replica component under torchft (the module docstring's rounds), for a
    worker of a sharding group of `group_size` workers (the default process group)."""

    def __init__(self, trainer: Trainer, manager: Any, heal: HealTransport, listener: GroupListener,
                 group_size: int = 1, fallback: "StorageFallback | None" = None,
                 drain_notice: Callable[[], Any] | None = None, joins: "JoinSignal | None" = None,
                 peers: bool = True, replica_pg: Any = None) -> None:
        super().__init__(trainer)
        # a round's quorum and its commit talk to the other sharding groups: charged to "sync"; a job of
        # one sharding group (M = 1) has none to talk to, and charges no sync
        self.rounds_talk = peers
        keep_local_gradients(trainer.model)  # `commit` averages the dense gradients
        self.joins = joins  # a sharding group waiting to join: the live groups then meet (`JoinSignal`)
        self.manager, self.heal, self.listener, self.group_size = manager, heal, listener, group_size
        self.replica_pg = replica_pg  # the manager's process group across the live groups (`make_manager`)
        self.fallback = fallback
        # Ray Train's notice that a node of this group's run is being drained (`ray.train.get_preemption_info`:
        # a collective over the run's workers, asked by all of them at the same round), or None
        self.drain_notice = drain_notice
        self.left: Any = None  # the drain notice this group leaves at (the loop ends at the next round's start)
        self._drain_checked = time.monotonic()
        self.live: int | None = None  # live sharding groups in the current quorum (None before the first)
        self.moment_scale: float | None = None
        # the replica sync over the live groups (the trainer's own: its grid is one sharding group)
        trainer.replica_sync = ReplicaSync(trainer.replica_sync.weights, trainer.replica_sync.states,
                                           ManagerSum(manager, lambda: self.live or 1, trainer.device),
                                           trainer.schedule.sync_every, trainer.config.delayed_moment_sync,
                                           state=trainer.state.sync)
        self._landing: InFlight | None = None  # a committed round's table average, to land in `sync`
        self._meet_next = False  # a round did not commit: the next one meets the live groups, whatever its step
        # agreed at the last committed sync step: the next block's start asks for a quorum; the next sync
        # step asks Ray Train for a drain notice
        self._quorum_next = self._drain_next = False

    def start_round(self) -> str:
        t = self.trainer
        block_start = t.schedule.syncs(t.state.step)
        if self.left is not None:  # a node is being drained: the group leaves after its sync step (`commit`)
            return "end"
        meet = self.live is None or self._meet_next or (block_start and self._quorum_next)
        self._quorum_next = False
        if not meet:
            return "train"  # no quorum: the live groups are those of the last one (the module docstring, 1.)
        # torchft's manager server waits for every worker of the group at a quorum, and a dead group-mate
        # never comes (its wait ends at the quorum timeout): the group meets first, over its own process
        # group, where a dead mate fails the round at once (and Ray Train restarts the group)
        self._group_meets()
        if self.live is None and self.joins is not None:
            # the live groups meet at their next block start, with this group: asked only once the whole group
            # is here, right before its quorum (asked before, while a group-mate was still starting, the live
            # groups could meet first and alone, torchft's fast quorum, and this group then waited out its
            # quorum timeout)
            self.joins.announce()
        self.manager.start_quorum()  # heals this sharding group here when it is behind
        if self.live is None:  # this group's first quorum
            self._maybe_restore()
        live = self.manager.num_participants()
        if live != self.live:  # the moment average in flight was launched over other groups: dropped
            t.replica_sync.drop_pending()
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

    def _maybe_restore(self) -> None:
        """At this group's first quorum: nobody ahead of step 0 (no heal) means every group was lost
        (or M = 1), or the job starts: the newest storage checkpoint, else `train.resume_from`, if
        any (`StorageFallback.restore`), and the manager's step with it."""
        if self.fallback is None or self.heal.unseen_heal or self.manager.current_step() != 0:
            return
        restored = self.fallback.restore(self.trainer)
        if restored is None:
            return
        self.manager.load_state_dict({"step": restored["step"], "batches_committed": self.manager.batches_committed()})
        self.heal.restored = restored
        self.heal.unseen_heal = True  # the state and the data cursor changed: the loop reloads
        if self.fallback.shard == 0:
            what = {"holder": "restored, bit for bit, the in-memory snapshot on the node holders",
                    "storage": "restored the storage checkpoint",
                    "resume": "no storage checkpoint of this job; resumed from train.resume_from, the checkpoint"}
            self.listener.say(f"sharding group {self.heal.group}: no live group ahead; {what[restored['source']]} "
                              f"of step {restored['step']} ({restored['path'] or restored['detail']})")

    def commit(self, step: int) -> bool:
        import torch
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        t, live = self.trainer, self.live or 1
        params = t.dense_params()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ends_block = t.schedule.syncs(step)
        # a sync step: a drain check when the group agreed on one at its last sync (every DRAIN_CHECK_S;
        # Ray Train's notice is a collective over the run's workers); the next block's start asks for a
        # quorum when a group waits to join or this one leaves; the next sync checks a drain when due
        notice = None
        if ends_block and self._drain_next:
            self._drain_checked = time.monotonic()
            notice = self.drain_notice()
        wants = ends_block and (notice is not None or (self.joins is not None and self.joins.pending()))
        due = (ends_block and self.drain_notice is not None
               and time.monotonic() - self._drain_checked >= DRAIN_CHECK_S)
        # the tables' average over the live groups, launched first, on copies (they land in `sync` if the
        # round commits)
        rs = t.replica_sync
        average = rs.launch(step, copy=True) if rs.due(step) else None
        # the dense gradients (each worker's own: DDP's all-reduce is off, `keep_local_gradients`) and the
        # round's flags in one buffer: averaged over the live groups (shard s with shard s), then summed
        # over the sharding group, which also agrees the flags (so its workers commit alike): whether a
        # collective of the round failed on any of them, whether a group waits to join or leaves (any
        # group: the first average carried it), whether the next sync checks a drain
        # and the group's votes at a sync step (`Replicas.agree`: a snapshot, a checkpoint), summed over the group
        grads = [p.grad for p in params]
        votes = self._local_votes(step)
        flags = 3 + len(votes)
        buf = torch.cat([_flatten_dense_tensors(grads).float(),
                         torch.tensor([float(wants), 0.0, 0.0] + [0.0] * len(votes), device=t.device)])
        if live > 1:
            self.manager.allreduce(buf).wait()
        if average is not None:
            average.wait(rs.transport, rs.bucket_bytes)
        buf[-flags + 1] = 0.0 if self.manager.errored() is None else 1.0
        buf[-flags + 2] = float(due)
        for i, mine in enumerate(votes.values()):
            buf[-flags + 3 + i] = float(mine)
        if self.group_size > 1:
            dist.all_reduce(buf)
        wants, failed, due, *agreed = buf[-flags:].tolist()
        self._agreed = {name: v > 0 for name, v in zip(votes, agreed)}
        for g, total in zip(grads, _unflatten_dense_tensors(buf[:-flags], grads)):
            g.copy_(total).div_(self.group_size)
        committed = not failed
        if committed:  # the manager's step is the trainer's: a group that missed a step is behind, and heals
            self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        self._meet_next = not committed
        if ends_block:  # what the next block's start and the next sync step do
            self._quorum_next, self._drain_next = committed and wants > 0, committed and due > 0
        if notice is not None:  # leave at the next round's start: what the group committed is synced
            self.left = notice
        self._landing = average if committed else None
        if not committed:  # a moment average in flight may have failed with the round: dropped on every group
            rs.drop_pending()
            err = self.manager.errored()
            why = str(getattr(err, "original_exception", err) or "a group-mate's collective failed").splitlines()[0][:200]
            self.listener.say(f"sharding group {self.heal.group}: the round for step {step} did not commit ({why}); "
                              f"the next round takes the next batch")
            self._abandon_round()
        return committed

    def _abandon_round(self) -> None:
        """After a round that did not commit, on every worker of the group (they agreed on it): this
        worker's process group across the live groups is aborted at once, and the group votes the
        round down in torchft's own commit (`Manager.should_commit`), so the next quorum is a new
        one (the lighthouse moves to a new quorum id after a failed commit) and configures a new
        process group. The abort is for the other live groups: torchft skips a round's collectives
        after its first error, so a peer group can still be inside one with this worker, waiting for
        data it will never send; with three groups or more the two would wait for each other until
        the collective timeout, one in the collective and the other at the quorum, which waits for
        every beating group (`Lighthouse`)."""
        if self.replica_pg is not None:
            self.replica_pg.abort()
        self.manager.should_commit()

    def sync(self, step: int) -> float:
        """Land the committed round's table average (the replica sync, `ReplicaSync.land`)."""
        t0 = time.perf_counter()
        landing, self._landing = self._landing, None
        if landing is not None:
            self.trainer.replica_sync.land(landing)
        seconds = time.perf_counter() - t0 if landing is not None else 0.0  # nothing landed: no replica sync
        self.listener.committed(step, self.live or 1, landing is not None)
        return seconds

    @property
    def workers(self) -> int:
        return (self.live or 1) * self.group_size

    def _group_meets(self) -> None:
        """Every worker of the sharding group is here (a barrier over its process group, on the
        trainer's device: NCCL takes no CPU tensors); raises if a group-mate died."""
        import torch
        import torch.distributed as dist

        if self.group_size > 1:
            dist.all_reduce(torch.zeros(1, device=self.trainer.device))

    def reduce(self, **states: Any) -> dict[str, float]:
        live = self.live or 1
        reducer = self._reduce_sums if live > 1 or self.group_size > 1 else None
        values = reduce_metrics(reducer=reducer, **states)
        if "train" in states:
            values["train/examples_total"] = float(self.trainer.state.examples)  # the job's, not a sum of workers'
        return values

    def agree_stop(self, mine: int) -> int:
        import torch
        import torch.distributed as dist
        from torch.distributed import ReduceOp

        # on the trainer's device: the manager's process group is NCCL on CUDA, which refuses CPU tensors
        stop = torch.tensor([float(mine)], dtype=torch.float64, device=self.trainer.device)
        if self.group_size > 1:  # the sharding group's largest, then the live groups'
            dist.all_reduce(stop, op=ReduceOp.MAX)
        if (self.live or 1) > 1:
            self.manager.allreduce(stop, reduce_op=ReduceOp.MAX).wait()
        return int(stop[0])

    def evaluates(self) -> bool:
        """The live sharding group of quorum rank 0 evaluates (every eval row, over its L workers);
        not a group that left."""
        return self.left is None and self.manager.participating_rank() == 0

    def _reduce_sums(self, sums: Any, maxes: Any) -> None:
        """`reduce_metrics`' reducer: the metric sums and maxima over the sharding group (the
        default process group), then over the live groups."""
        import torch.distributed as dist
        from torch.distributed import ReduceOp

        device = self.trainer.device  # the manager's process group's (NCCL on CUDA refuses CPU tensors)
        on = [x if x.device.type == device.type else x.to(device) for x in (sums, maxes)]
        if self.group_size > 1:
            dist.all_reduce(on[0], op=ReduceOp.SUM)
            dist.all_reduce(on[1], op=ReduceOp.MAX)
        if (self.live or 1) > 1:
            works = [self.manager.allreduce(on[0], reduce_op=ReduceOp.SUM),
                     self.manager.allreduce(on[1], reduce_op=ReduceOp.MAX)]
            for w in works:
                w.wait()
        for x, y in zip((sums, maxes), on):
            if y is not x:
                x.copy_(y)
