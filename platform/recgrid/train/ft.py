"""Fault tolerance with torchft (`train.fault_tolerance=torchft`): the surviving replicas keep
running; only a failed one is replaced, and it heals from a live peer.

Where it applies: grids with L = 1 (M = T, every worker a whole model copy). Ray 2.60's
`TorchftConfig` makes every worker its own torchft replica group (its worker group hard-codes
`replica_group_size=1`) and replaces only the replica groups that failed; a sharding group of
L > 1 workers cannot be one of them, so larger L keeps the holder path (`train.recovery`).

The grid in torchft's terms: a torchft replica group is a recgrid sharding group (here one
worker: TorchRec's DMP over a world of one, the whole model on this worker); torchft's
fault-tolerant process group across replica groups is the recgrid replica group. One step is
one quorum round:
  1. `Manager.start_quorum()`, synchronous: the live replicas agree on a quorum. A replica
     behind the others (a replacement) receives a live peer's whole state over `PGTransport`
     before it computes (`ReplicaState`: embedding weights and row-wise AdaGrad moments, the
     dense part, the progress with the data cursor). c follows the live replica count unless
     `optim.moment_scale` fixes it.
  2. forward and backward on this replica's batch; FBGEMM's fused kernels update the embedding
     rows inside backward, as in every recgrid step, so these updates cannot wait for the
     commit (an uncommitted round's batch reaches its own replica's tables, not the dense part).
  3. the dense gradients are averaged over the live replicas through the manager; every K steps
     the embedding weights and moments are averaged too, into a buffer (torchft's LocalSGD idea);
     at logging steps the metric sums are reduced over the live replicas the same way.
  4. `Manager.should_commit()`: only then does the dense optimizer step, the averaged tables
     land and the step count advance. A round that does not commit (a peer died inside it) is
     not a step: the next round takes the next batch under the same step number.
Nothing is rolled back: survivors never go back, a newcomer starts where they are. A graceful
stop (`RecoveryCoordinator.request_stop`) is read at logging steps and agreed through the manager
(a maximum over the live replicas, before the commit), so every replica ends at the same step.
If every replica fails at once, Ray Train restarts them all and, with no storage checkpoints on
this path yet, training starts again from step 0; a replacement that arrives after the others
have finished the job ends at once.

Data: each epoch is split into T parts by replica id (as torchft's DistributedSampler splits by
replica group), and the data cursor is shared by the live replicas (a newcomer receives it with
the state). The rows of a dead replica's part for the rounds it is away are not trained in that
epoch; every other row is read once.

Metrics: the live replica of quorum rank 0 logs into the job's one MLflow run (each step once,
through `train.worker`'s reporter), evaluates (every eval row, on its own: no collective a peer's
death could break), logs `grid/num_groups` whenever the live replica count changes, and logs the
replacement events the newcomers record in the recovery coordinator (`recovery/count`,
`recovery/source` = peer, `recovery/seconds`: the controller seeing the failure → the newcomer's
first committed step). In Ray Train's terms, an *attempt* here is one replica group's start.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import defaultdict
from datetime import timedelta
from typing import Any

TIMEOUT_S = 30  # collectives and the heal transfer; a dead peer's sockets close, so its collectives fail sooner
QUORUM_TIMEOUT_S = 120  # longer than the lighthouse's join timeout (60 s): a peer evaluating is waited for
START_WAIT_S = 120  # the first start: how long replicas wait for each other, so the first quorum has all of them


def train_replica(cfg: dict) -> None:
    """Ray Train's per-worker function with train.fault_tolerance=torchft (`cfg["job"]` is the
    `train.worker.WorkerJob`): one replica, its manager, its loop."""
    import ray
    import ray.train
    import torch

    from recgrid.engine.device import worker_device
    from recgrid.engine.grid import Grid
    from recgrid.logs import quiet_libraries
    from recgrid.train.trainer import Trainer

    quiet_libraries()
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's quorum servers log every round at INFO
    # torchft logs a peer's death as a traceback; the loop says it in one line (`ReplicaLoop._not_committed`)
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    job = cfg["job"]
    ctx = ray.train.get_context()
    replica, replicas = ctx.get_world_rank(), ctx.get_world_size()  # replica id, T (= M: L = 1)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    device = worker_device(ctx.get_local_rank(), job.use_gpu)
    coordinator = job.coordinator
    attempt = ray.get(coordinator.begin_attempt.remote(1))
    ray.get(coordinator.register.remote(attempt, replica, os.getpid(), ray.get_runtime_context().get_node_id()))
    status = ray.get(coordinator.status.remote())
    replacement = any(replica in a["workers"] for a in status["attempts"][:attempt])

    # the whole model on this worker: TorchRec's DMP over the world of one Ray made for this replica group
    trainer = Trainer.build(Grid(1, 1), job.engine, device, job.plan, ne_window_steps=job.loop.ne_window_steps,
                            pipeline=False)
    state = ReplicaState(trainer, replica)
    manager = make_manager(state, replica, device)
    coordinator.note.remote(attempt, replica, {"ready": True})
    if not replacement:
        _wait_for_peers(coordinator, replicas)
    loop = ReplicaLoop(trainer, manager, state, job, replica, replicas, attempt, replacement, status["attempts"][attempt])
    try:
        loop.run()
    finally:
        manager.shutdown(wait=False)


def make_manager(state: "ReplicaState", replica: int, device: Any) -> Any:
    """This replica's torchft manager: gloo (NCCL on a GPU) across replicas, heals over the same
    process group (`PGTransport`), a quorum of at least one live replica, every round synchronous
    (a heal lands before the forward pass, and a peer's state is read while it waits)."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    from torchft.checkpointing.pg_transport import PGTransport

    timeout = timedelta(seconds=TIMEOUT_S)
    pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    return Manager(pg=pg, load_state_dict=state.load, state_dict=state.state_dict, min_replica_size=1,
                   use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
                   world_size=1, rank=0, replica_id=f"recgrid_{replica}",
                   checkpoint_transport=PGTransport(pg, timeout=timeout, device=device))


def _wait_for_peers(coordinator: Any, replicas: int) -> None:
    """At the job's first start, wait until every replica's manager is up: the first quorum then
    holds all of them (torchft forms a quorum of whoever asks first otherwise)."""
    import ray

    deadline = time.time() + START_WAIT_S
    while time.time() < deadline:
        attempts = ray.get(coordinator.status.remote())["attempts"]
        if len({r for a in attempts for r, w in a["workers"].items() if w.get("ready")}) >= replicas:
            return
        time.sleep(0.1)


def kernel_digest(trainer: Any) -> str:
    """Checksum of this replica's embedding weights and moments (equal iff bit for bit equal)."""
    from recgrid.train.recovery import digest

    return digest([t.detach().cpu().numpy() for t in trainer.shard_tensors()])


def dense_digest(trainer: Any) -> str:
    from recgrid.train.recovery import digest

    dense = trainer.dense_state()
    return digest([dense[k].numpy() for k in sorted(dense)])


class ReplicaState:
    """What torchft sends a recovering replica, and how the replica loads it (the manager's
    `state_dict` / `load_state_dict`): the trainer's embedding weights and moments, its dense
    part and its progress (step, examples, data cursor), plus who sent it and the weights'
    checksum, so the heal can be shown bit for bit."""

    def __init__(self, trainer: Any, replica: int) -> None:
        self.trainer, self.replica = trainer, replica
        self.heals: list[dict[str, Any]] = []  # heals of this replica, newest last
        self.unseen_heal = False  # set by `load`, cleared by the loop (the data cursor moved)

    def state_dict(self) -> dict[str, Any]:
        # contiguous copies: PGTransport sends a tensor's whole storage, and the kernels' views share one
        shard = [t.detach().clone() for t in self.trainer.shard_tensors()]
        from recgrid.train.recovery import digest

        return {"shard": shard, "dense": self.trainer.dense_state(), "progress": json.dumps(self.trainer.state.progress()),
                "from": self.replica, "digest": digest([t.cpu().numpy() for t in shard])}

    def load(self, sd: dict[str, Any]) -> None:
        t0 = time.time()
        self.trainer.restore(list(sd["shard"]), dict(sd["dense"]), json.loads(sd["progress"]), None)
        self.heals.append({"from": int(sd["from"]), "step": self.trainer.state.step, "source_digest": sd["digest"],
                           "digest": kernel_digest(self.trainer), "load_s": time.time() - t0, "at": time.time()})
        self.unseen_heal = True


class ReplicaLoop:
    """One replica's training loop under torchft (the module docstring's four steps per round)."""

    def __init__(self, trainer: Any, manager: Any, state: ReplicaState, job: Any, replica: int, replicas: int,
                 attempt: int, replacement: bool, attempt_info: dict[str, Any]) -> None:
        from recgrid.data.units import EpochPlan
        from recgrid.train.trainer import EvalData, TrainData
        from recgrid.train.worker import RowLog

        self.trainer, self.manager, self.state, self.job = trainer, manager, state, job
        self.replica, self.replicas, self.attempt, self.replacement = replica, replicas, attempt, replacement
        self.attempt_info = attempt_info
        self.coordinator = job.coordinator
        loop = job.loop
        # every replica id owns a part of each epoch, live or not: a dead replica's rows wait for no one
        self.data = TrainData(EpochPlan(job.train_inputs, job.engine.seed, loop.batch_size, job.rows_per_unit),
                              job.engine.spec, replica, replicas)
        self.eval_data = EvalData(job.eval_inputs, job.engine.spec, loop.batch_size, 0, 1) \
            if job.eval_inputs is not None else None
        self.rows = RowLog(job.row_log, attempt, replica) if job.row_log else None
        self.moment_scale: float | None = None
        self.live: int | None = None  # live replicas in the current quorum
        self.synced_live: int | None = None  # live replicas at this replica's last sync
        self.report: Any = None  # the reporter, while this replica is the quorum's rank 0
        self.events_logged: set[int] = set()
        self.first_step_done = False
        from recgrid.train.worker import metrics_exporter

        self.exporter = metrics_exporter(job, replica)

    # ---- the loop -------------------------------------------------------------------------------------
    def run(self) -> None:
        st, loop, timer = self.trainer.state, self.job.loop, self.trainer.metrics.timer
        batches, left = None, 0
        self.trainer.metrics.reset_interval()
        while st.step < loop.max_steps:
            t0 = time.perf_counter()
            self.manager.start_quorum()  # heals this replica here when it is behind
            quorum_s = time.perf_counter() - t0
            self._new_quorum()
            if self.replacement and not self.first_step_done and self._finished_elsewhere():
                return
            if self.state.unseen_heal:  # the cursor came with the peer's state
                self.state.unseen_heal = False
                if batches is not None:
                    batches.close()
                batches = None
            if batches is None:
                left, batches = self.data.segment_batches(st.cursor)
            t1 = time.perf_counter()
            batch = next(batches)
            timer.add("data_wait", time.perf_counter() - t1)
            step = st.step + 1
            committed, comm_s, values, stop = self._round(batch, step)
            timer.add("sync", quorum_s + comm_s)
            st.cursor.steps += 1  # the batch is consumed, committed or not
            left -= 1
            if left == 0:
                batches.close()
                batches = None
                self.data.plan.next_epoch(st.cursor)
            if self.rows is not None:
                self.rows.write(step, getattr(batch, "row_ids", None))
            if committed:
                self._committed(step, values, last=stop or step == loop.max_steps)
                if stop:
                    break
            else:
                self._not_committed(step)
        if batches is not None:
            batches.close()
        self._finish()

    def _new_quorum(self) -> None:
        """After each quorum: c for the live replica count, and who logs."""
        from recgrid.engine.optimizer import moment_scale_for
        from recgrid.engine.sync import embedding_kernels

        live = self.manager.num_participants()
        c = moment_scale_for(live, self.job.engine.moment_scale)
        if c != self.moment_scale:  # the fused kernels' lr and eps carry c (engine.optimizer)
            self.trainer.embedding_optimizer = opt = self.job.engine.embedding_optimizer(live)
            fused = opt.fused_params()
            for kernel in embedding_kernels(self.trainer.model):
                kernel.update_hyper_parameters({"lr": fused["learning_rate"], "eps": fused["eps"]})
            self.moment_scale = c
        if self.manager.participating_rank() == 0 and self.report is None:
            from recgrid.train.worker import Reporter

            self.report = Reporter(self.job, self.trainer, self.coordinator, self.attempt, self.exporter)
        elif self.manager.participating_rank() != 0:
            self.report = None
        if live != self.live and self.report is not None:
            import ray

            values = {"grid/num_groups": live, "grid/world_size": live}
            if self.report.tracker is not None and ray.get(self.coordinator.claim_step.remote("grid", self.trainer.state.step)):
                self.report.tracker.log_metrics(values, self.trainer.state.step)
            self.exporter(values, self.trainer.state.step)
        self.live = live

    def _round(self, batch: Any, step: int) -> tuple[bool, float, dict[str, float] | None, bool]:
        """Forward, backward, the averages over the live replicas, the commit: (committed, seconds
        spent in collectives and the commit, the reduced metrics on a logging step, whether a
        graceful stop ends training after this step: asked of any live replica, agreed by all)."""
        import torch
        from torch.distributed import ReduceOp

        t, loop = self.trainer, self.job.loop
        start, lookup_before = time.perf_counter(), t.metrics.timer.seconds["lookup"]
        batch = batch.to(t.device, non_blocking=True)
        t.dense_optimizer.zero_grad(set_to_none=True)
        loss, (_, logits, labels) = t._forward(batch)
        loss.backward()
        t.metrics.update(torch.sigmoid(logits.detach().float()), labels, loss.detach())
        t0 = time.perf_counter()
        live = self.live or 1
        params = t._dense_params()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = self._average([p.grad for p in params]) if live > 1 else None
        syncing = live > 1 and step % self.job.engine.sync_every == 0
        tables = self._average([x.detach().clone() for x in t.shard_tensors()]) if syncing else None
        values, stop = None, None
        if step % loop.log_every == 0 or step == loop.max_steps:
            import ray

            from recgrid.train.metrics import reduce_metrics

            values = reduce_metrics(train=t.metrics, reducer=self._reduce_sums if live > 1 else None)
            stop = torch.tensor([float(ray.get(self.coordinator.stop_requested.remote()))], dtype=torch.float64)
            stop_work = self.manager.allreduce(stop, reduce_op=ReduceOp.MAX) if live > 1 else None
        for job in (grads, tables):
            if job is not None:
                job()
        if stop is not None and stop_work is not None:
            stop_work.wait()
        committed = self.manager.should_commit()
        if committed:
            t.dense_optimizer.step()
            if tables is not None:
                with torch.no_grad():
                    for dst, src in zip(t.shard_tensors(), tables.tensors):
                        dst.copy_(src)
        end = time.perf_counter()
        comm_s = end - t0
        # the lookup hooks fired inside this round's forward; the rest of its compute is the dense part
        t.metrics.timer.add("dense", max(0.0, end - start - comm_s - t.metrics.timer.seconds["lookup"] + lookup_before))
        if committed and syncing:
            from recgrid.engine.sync import SyncRecord

            t.state.sync.add(SyncRecord(step=step, seconds=comm_s, bytes=sum(x.numel() * x.element_size()
                                                                              for x in tables.tensors)))
        return committed, comm_s, values, bool(stop is not None and float(stop[0]) > 0)

    def _average(self, tensors: list[Any]) -> "_Average":
        """Launch the average of `tensors` over the live replicas (one flat buffer per dtype);
        calling the result waits and writes the averages back into `tensors`."""
        from torch._utils import _flatten_dense_tensors

        by_dtype: dict[Any, list[Any]] = defaultdict(list)
        for x in tensors:
            by_dtype[x.dtype].append(x)
        launched = []
        for group in by_dtype.values():
            flat = _flatten_dense_tensors(group)
            launched.append((self.manager.allreduce(flat), flat, group))
        return _Average(tensors, launched)

    def _reduce_sums(self, sums: Any, maxes: Any) -> None:
        """`reduce_metrics`' reducer: the metric sums and maxima over the live replicas."""
        from torch.distributed import ReduceOp

        works = [self.manager.allreduce(sums, reduce_op=ReduceOp.SUM),
                 self.manager.allreduce(maxes, reduce_op=ReduceOp.MAX)]
        for w in works:
            w.wait()

    # ---- after a committed step ---------------------------------------------------------------------------
    def _committed(self, step: int, values: dict[str, float] | None, last: bool) -> None:
        from recgrid.engine.device import peak_memory_mb

        t, st, loop = self.trainer, self.trainer.state, self.job.loop
        st.step = step
        st.examples += int(loop.batch_size) * (self.live or 1)
        if not self.first_step_done:
            self.first_step_done = True
            self._record_start()
        if step % self.job.engine.sync_every == 0 and self.live != self.synced_live:
            # the first sync after the live count changed (a newcomer's first): every replica notes its
            # tables, which must then be the same on all of them (no collective: notes go to the coordinator)
            self.coordinator.note.remote(self.attempt, self.replica, {f"digest@{step}": kernel_digest(t),
                                                                    f"live@{step}": self.live})
            self.synced_live = self.live
        if self.report is not None:
            self.report.step(step)
        if values is not None:
            values.update(t.sync_metrics())
            values["train/examples_total"] = float(st.examples)  # the job's, not a sum of replicas' counters
            t.metrics.reset_interval()
            self.exporter({**values, "memory/peak_mb": peak_memory_mb(t.device)}, step)
            if self.report is not None:
                self.report.log(values, step)
                self._log_events(step)
        if self.eval_data is not None and self.report is not None and (
                (loop.eval_every and step % loop.eval_every == 0) or last):
            evaluation = t.evaluate(self.eval_data)
            st.evaluated_at = step
            self.report.log(evaluation, step)

    def _not_committed(self, step: int) -> None:
        err = self.manager.errored()
        why = str(getattr(err, "original_exception", err) or "the quorum did not agree").splitlines()[0][:200]
        print(f"[recgrid] replica {self.replica}: the round for step {step} did not commit ({why}); "
              f"the next round takes the next batch", file=sys.__stdout__, flush=True)

    def _finished_elsewhere(self) -> bool:
        """A replacement that found no live replica ahead while the others have already ended
        the job (they noted their final step): nothing is left to train."""
        import ray

        if self.state.heals and self.state.heals[-1]["step"] > 0:
            return False
        attempts = ray.get(self.coordinator.status.remote())["attempts"]
        if not any("final_step" in w for a in attempts for w in a["workers"].values()):
            return False
        print(f"[recgrid] replica {self.replica}: the other replicas have finished the job; nothing to train",
              file=sys.__stdout__, flush=True)
        return True

    def _record_start(self) -> None:
        """At this replica's first committed step: a replacement records how it came back."""
        import ray

        if not self.replacement:
            return
        now = time.time()
        detected = self.attempt_info.get("failure_time") or self.attempt_info["start"]
        heal = self.state.heals[-1] if self.state.heals else None
        if heal is None or heal["step"] == 0:
            event = {"source": "fresh", "step": 0, "why": "no live replica ahead of this one: training starts again "
                                                          "from step 0 (no storage checkpoints with torchft)"}
        else:
            event = {"source": "peer", "step": heal["step"], "from_replica": heal["from"],
                     "digest": heal["digest"], "source_digest": heal["source_digest"],
                     "bit_identical": heal["digest"] == heal["source_digest"], "restore_s": heal["load_s"],
                     "why": f"replica {self.replica} replaced; healed from live replica {heal['from']} over "
                            f"torchft's PGTransport (no storage read; the other replicas kept running)",
                     "detail": f"replica {self.replica} from replica {heal['from']}"}
        event.update(attempt=self.attempt, replica=self.replica, pid=os.getpid(), failure_step=None, steps_lost=0,
                     t_failure_detected=detected, t_attempt_start=self.attempt_info["start"],
                     t_heal=heal["at"] if heal else None, t_first_step=now, seconds=now - detected,
                     num_groups=self.live, world_size=self.live)
        ray.get(self.coordinator.record.remote(event))

    def _log_events(self, step: int) -> None:
        """The logger's part: replacement events recorded by newcomers, each logged once."""
        import ray

        events = ray.get(self.coordinator.status.remote())["events"]
        for i, event in enumerate(events):
            if i in self.events_logged or "seconds" not in event:
                continue
            self.events_logged.add(i)
            if not ray.get(self.coordinator.claim_step.remote("event", i)):
                continue
            count = i + 1
            values = {"recovery/count": count, "recovery/seconds": event["seconds"], "recovery/steps_lost": 0}
            tracker = self.report.tracker
            if tracker is not None:
                tracker.log_metrics(values, step)
                tracker.set_tags({f"recovery/source/{count}": event["source"],
                                  f"recovery/detail/{count}": event.get("detail", ""),
                                  f"recovery/why/{count}": event.get("why", "")})
            self.report.say(f"recovery {count}: {event.get('why', '')}; first step {event['seconds']:.1f} s after "
                            f"the failure was seen")
            self.exporter(values, step)

    def _finish(self) -> None:
        """Every replica notes where it ended (its tables and dense part): the same on every live replica."""
        import ray

        t = self.trainer
        if self.report is not None:
            self._log_events(t.state.step)
        ray.get(self.coordinator.note.remote(self.attempt, self.replica, {
            "final_step": t.state.step, "final_digest": kernel_digest(t), "final_dense_digest": dense_digest(t),
            "heals": [{k: v for k, v in h.items()} for h in self.state.heals]}))


class _Average:
    """An average in flight over the live replicas: call it to wait and write the result back."""

    def __init__(self, tensors: list[Any], launched: list[tuple[Any, Any, list[Any]]]) -> None:
        self.tensors, self.launched = tensors, launched

    def __call__(self) -> None:
        from torch._utils import _unflatten_dense_tensors

        for work, flat, group in self.launched:
            work.wait()
            for x, avg in zip(group, _unflatten_dense_tensors(flat, group)):
                x.copy_(avg)
