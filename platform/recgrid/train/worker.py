"""The Ray Train worker body: what every worker of every sharding group's run runs. Thin: it
wires the trainer (`train.trainer`: the one step loop) to the job's actors and components.

`train_group_worker`: every sharding group is a Ray Train run of its own, of L workers whose
torch world is the group; Ray Train restarts that run alone when one of them dies. The groups
meet across runs through torchft (`train.recovery.peers.TorchftReplicas`, the trainer's replica component):
a rebuilt group heals from a live peer group, else restores from its node holders (M = 1), the
newest storage checkpoint, `train.resume_from`, or starts at step 0. Shard rank 0 of the live
group of quorum rank 0 logs into the job's one MLflow run (never twice for a step), that group
writes the storage checkpoints (`train.recovery.storage.StorageFallback`), and `GroupReport` records each
rebuilt group's heal or restore. A group whose node is drained leaves after its last sync
(`_leave_at_drain`).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from recgrid.config import CheckpointCadence, SnapshotCadence
from recgrid.data.stream import EvalData, TrainData, stats_text
from recgrid.data.units import EpochPlan, Inputs
from recgrid.engine.grid import Grid
from recgrid.engine.sync import sync_step
from recgrid.train.control import Heartbeat, StopPoll
from recgrid.train.recovery.events import RecoveryEvents
from recgrid.train.rows import RowLog
from recgrid.train.trainer import FitHooks, Trainer
from recgrid.trainer_config import EngineConfig, LoopConfig

START_WAIT_S = 120  # torchft's first start: how long the sharding groups wait for each other, so the first quorum has all of them


@dataclass(frozen=True)
class WorkerJob:
    """What the driver hands every worker (it pickles; it holds no live process handle but the
    job's actor handles). No defaults: the driver fills every field from the JobConfig."""

    engine: EngineConfig
    loop: LoopConfig
    group_size: int  # L
    max_world_size: int  # T asked for
    layout: str
    use_gpu: bool
    plan: Any  # the job's ShardingPlan, in shard ranks
    train_inputs: Inputs
    eval_inputs: Inputs | None
    run_id: str | None
    tracking_uri: str | None
    control: Any  # the job's JobControl actor (train.control)
    recovery: Any  # the job's RecoveryCoordinator actor (train.recovery.coordinator)
    run_name: str
    resume_from: str | None
    row_log: str | None
    rows_per_unit: int
    checkpoints: CheckpointCadence  # when the storage checkpoints are written (`JobConfig.checkpoints`)
    snapshots: SnapshotCadence  # when the in-memory snapshots are taken (`JobConfig.snapshots`)
    lighthouse: str  # the job's torchft lighthouse (`train.recovery.peers.Lighthouse`, owned by the driver)
    min_groups: int  # the fewest live sharding groups that train (`JobConfig.min_groups`)
    start_groups: int  # the sharding groups the cluster holds at the job's start (the first quorum waits for them)
    log_model: bool  # the writing group ends the job with a checkpoint of its final step (the driver logs the model)


def _start_worker(job: WorkerJob) -> tuple[Any, Any]:
    """What every worker does first: quiet libraries, threads, its device. Returns (Ray Train's
    context, the device)."""
    import ray.train
    import torch

    from recgrid.logs import quiet_libraries

    quiet_libraries()
    ctx = ray.train.get_context()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    return ctx, ray_worker_device(job.use_gpu)


def ray_worker_device(use_gpu: bool) -> Any:
    """The device of this Ray Train worker, made current: the GPU Ray assigned it
    (`ray.train.torch.get_device()`, from the GPU ids Ray reserved for it) on GPU jobs, cpu
    otherwise. Never computed from `get_local_rank()`: under torchft every sharding group is a
    run of its own, so two runs' workers on one node have the same local ranks."""
    from recgrid.engine.device import worker_device

    if not use_gpu:
        return worker_device(use_gpu=False)
    import ray.train.torch

    return worker_device(use_gpu=True, assigned=ray.train.torch.get_device())


def _data(job: WorkerJob, rank: int, workers: int, eval_rank: int, eval_workers: int,
          device: Any) -> tuple[TrainData, EvalData | None]:
    """This worker's part of each epoch (of `workers` parts) and of the evaluation rows, in pinned
    memory on a GPU worker (`engine.device.pin_batches`)."""
    from recgrid.engine.device import pin_batches

    loop, pin = job.loop, pin_batches(device)
    data = TrainData(EpochPlan(job.train_inputs, job.engine.seed, loop.batch_size, job.rows_per_unit),
                     job.engine.spec, rank, workers, pin=pin, compression=job.engine.model.compression)
    eval_data = EvalData(job.eval_inputs, job.engine.spec, loop.batch_size, eval_rank, eval_workers, pin=pin,
                         compression=job.engine.model.compression) \
        if job.eval_inputs is not None else None
    return data, eval_data


def train_group_worker(cfg: dict) -> None:
    """Ray Train's per-worker function (`cfg["job"]` is the WorkerJob, `cfg["group"]` this run's
    sharding group g): every sharding group is a Ray Train
    run of its own, of L workers whose torch world is the group (TorchRec's DMP over it), and
    this worker is shard rank s of it. The groups meet across runs through torchft (the job's
    lighthouse, `train.recovery.peers`). When a worker dies, Ray Train restarts its group's run alone (all L
    workers: a group-mate's step fails on the dead worker's collective, and it ends too); the
    other groups keep their processes and train on, and the restarted group heals from a live
    peer group at its first round."""
    import logging

    import ray

    from recgrid.tracking import stop_system_metrics
    from recgrid.train.checkpoint import Checkpointer
    from recgrid.train.recovery.peers import GroupWorld, HealTransport, TorchftReplicas, make_manager
    from recgrid.train.recovery.storage import StorageFallback

    job: WorkerJob = cfg["job"]
    ctx, device = _start_worker(job)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's quorum servers log every round at INFO
    # torchft logs a peer's death as a traceback; the component says it in one line
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    world = GroupWorld.of_run(ctx, cfg["group"], job.lighthouse)
    L, T = world.size, job.max_world_size
    grid = Grid(T, T // L, job.layout)  # type: ignore[arg-type]
    rank = grid.global_rank(world.group, world.shard)
    coords = grid.coords(rank)
    g, s = coords.sharding_group, coords.shard_rank
    control = job.control
    attempt = ray.get(control.begin_attempt.remote(1))
    node = ray.get_runtime_context().get_node_id()
    ray.get(control.register.remote(attempt, rank, os.getpid(), node))
    system = None
    if job.run_id and ray.get(control.claim_step.remote(f"system:{node}", 0)):
        import socket

        from recgrid.tracking import start_system_metrics

        # one monitor per node (the job's first worker there), named by host and Ray node
        system = start_system_metrics(job.run_id, f"{socket.gethostname()}-{node[:8]}", job.tracking_uri)
    status = ray.get(control.status.remote())
    replacement = any(rank in a["workers"] for a in status["attempts"][:attempt])
    attempt_info = status["attempts"][attempt]
    # this worker takes over the MLflow logging if the logging group fails: its tracker is attached
    # ahead (MLflow's import and store: a second or more), so the takeover does not hold up the group
    # while it trains on alone (a replacement skips it: its start is the recovery's critical path)
    tracker = WarmTracker(job.run_id, job.tracking_uri, s == 0 and not replacement)
    before = ray.get(control.group_status.remote(g)) if replacement else {}  # the group's last commit before it failed
    # the whole model over the sharding group: TorchRec's DMP over its L workers (the default process group),
    # in the device's loop (TorchRec's pipeline on CUDA, whose optimizer step is the round's commit)
    trainer = Trainer.build(Grid(L, 1), job.engine, device, job.plan)
    heal = HealTransport(trainer, g, own_cursor=lambda: ray.get(control.group_status.remote(g)).get("cursor"))
    report = GroupReport(job, trainer, heal, coords, attempt, replacement, attempt_info,
                         metrics_exporter(job, rank), before, tracker)
    # every global rank owns a part of each epoch, live or not, with its sharding group's cursor;
    # the evaluating group reads every eval row over its L workers
    data, eval_data = _data(job, rank, T, s, L, device)
    rows = RowLog(job.row_log, attempt, rank) if job.row_log else None
    # the manager last: its server beats to the lighthouse from here, and while a group beats without
    # asking for a quorum, a lone live group of M = 2 cannot form one (torchft's split-brain rule)
    manager, replica_pg = make_manager(heal, world, device, job.min_groups)
    control.note.remote(attempt, rank, {"ready": True, "sharding_group": g, "shard_rank": s})
    if not replacement:
        _wait_for_peers(control, job.start_groups * L)
    # in-memory snapshots on the hosts' holders, taken by the live group of quorum rank 0 and read when
    # no live group is ahead (a host loss under host-local, any failure at M = 1)
    snapshotter, holders = _group_snapshots(job, trainer)
    # storage checkpoints: written by the live group of quorum rank 0, read when no live group or snapshot is left
    checkpointer = Checkpointer(ray_storage=True, cadence=job.checkpoints, trainer=trainer)
    fallback = StorageFallback(checkpointer, control, job.recovery, g, s, job.resume_from, holders,
                               agreed=lambda name: trainer.replicas.agreed(name))
    progress = GroupProgress(control, g, s, trainer)
    replicas = trainer.replicas = TorchftReplicas(trainer, manager, heal, report, group_size=L, fallback=fallback,
                                                  drain_notice=ray.train.get_preemption_info, joins=progress,
                                                  peers=T > L, replica_pg=replica_pg)
    replicas.agree("checkpoint", checkpointer.wants)
    if snapshotter is not None:
        replicas.agree("snapshot", snapshotter.wants)

    def checkpoint(step: int) -> None:
        fallback.maybe_save(step, writes=replicas.evaluates())

    after_step = [progress.note, checkpoint, report.step] + ([snapshotter.maybe_snapshot] if snapshotter else [])
    def log(values: dict[str, float], step: int) -> None:
        if snapshotter is not None:  # this worker's snapshots so far (its group's while it writes them)
            values = {**values, "snapshot/count": float(snapshotter.snapshots)}
        report.log(values, step)

    hooks = FitHooks(on_log=log, on_batch=rows.on_batch if rows else None,
                     after_step=after_step, stop_requested=StopPoll(control))
    try:
        trainer.fit(data, job.loop, eval_data, hooks)
    except BaseException as e:
        # the other groups' collectives with this worker fail now, not at their timeout, and its manager
        # server stops beating to the lighthouse: with M = 2 the live group's quorum waits while a second
        # group beats (torchft's split-brain rule: more than half must join)
        replica_pg.abort()
        manager.shutdown(wait=False)
        seen = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        control.say.remote(f"[recgrid] sharding group {g}: shard rank {s} stopped ({seen}); Ray Train restarts the "
                           + ("group, which heals from a live peer group" if T > L else
                              "group, which restores from the hosts' holders" if snapshotter is not None else
                              "group, which restores the newest storage checkpoint"))
        raise
    step, ck = trainer.state.step, fallback.checkpointer
    if trainer.interrupted and ck.cadence.on and replicas.evaluates():
        # interrupted at a sync step (`Trainer.fit`): the live groups agree, so the writing group makes a checkpoint
        path = ck.save_at(step)
        if s == 0:
            report.say(f"interrupted: checkpoint at step {step} written to {path}")
    elif job.log_model and not trainer.interrupted and replicas.left is None and replicas.evaluates():
        # the job's final model, which the driver logs (`launch.unshard`): the cadence's own at a checkpoint step
        ck.save_at(step)
    if snapshotter is not None:
        snapshotter.close()
    if system is not None:
        stop_system_metrics(system)
    if replicas.left is not None:
        _leave_at_drain(job, trainer, replicas, fallback, manager, g, s, L)
        return
    manager.shutdown(wait=False)
    logger = report.report
    if logger is not None and logger.tracker is not None:  # Ray Data's execution stats of the logging worker's streams
        logger.tracker.log_text(stats_text(data, eval_data), "data/ray_data_stats.txt")
    report.finish()
    ray.get(control.finished.remote(trainer.state.step, trainer.interrupted))  # every live worker: the same


class GroupProgress:
    """Shard rank 0's notes of its sharding group's progress to job control (`note`, after every
    committed sync step: the step and the data cursor, `JobControl.group_progress`; a rebuilt group
    reads on from its own newest note), and the component's `train.recovery.peers.JoinSignal` on top of them:
    each note's answer, read at the next sync step without waiting for it, is the asks still open
    (`JobControl.joining`: the groups that asked for their first quorum and have not committed
    since), so the live groups learn of a waiting group without a call of their own. Every open ask
    this worker has not met for yet is heard once, whenever it was made: a group that asked before
    this one's first quorum and is not in it is heard too (counting asks, a group's own ask hid the
    asks made before it, and a group the first quorum left out waited until the others ended). An
    ask of a group that was in that quorum may be heard once more: one quorum in which nothing
    changes. The other shard ranks note nothing and hear nothing (their group-mate's word reaches
    them through the group's agreement, `TorchftReplicas.commit`)."""

    def __init__(self, control: Any, group: int, shard: int, trainer: Trainer) -> None:
        self.control, self.group, self.shard, self.trainer = control, group, shard, trainer
        self.met: set[tuple[int, int]] = set()  # the asks (group, number) this worker has heard
        self.heard = False  # an ask not in `met` arrived and nobody has been told yet
        self._answer: Any = None  # the newest note's reply, not read yet

    def note(self, step: int) -> None:
        if self.shard != 0 or not sync_step(step, self.trainer.config.sync_every):
            return
        self._read()
        self._answer = self.control.group_progress.remote(self.group, step, self.trainer.state.cursor.state_dict(),
                                                          time.time())

    def announce(self) -> None:
        import ray

        if self.shard == 0:
            ray.get(self.control.joining.remote(self.group))

    def pending(self) -> bool:
        self._read()
        heard, self.heard = self.heard, False
        return heard

    def _read(self) -> None:
        import ray

        if self._answer is None or not ray.wait([self._answer], timeout=0)[0]:
            return
        asks, self._answer = ray.get(self._answer), None
        new = set(asks.items()) - self.met
        if new:
            self.met |= new
            self.heard = True


def _group_snapshots(job: WorkerJob, trainer: Trainer) -> tuple[Any, Any]:
    """When the job takes in-memory snapshots (`JobConfig.snapshots`): this worker's snapshotter
    (its shard position to its host's holder at the snapshot steps, while its group is the one
    that writes) and the holders' side of a restore (`train.recovery.holders.HolderRestore` over
    the group's grid), else (None, None). Collective over the sharding group (its workers' hosts)."""
    import ray
    import torch.distributed as dist

    from recgrid.train.recovery.holders import HolderRestore, Snapshotter

    if not job.snapshots.on:
        return None, None
    grid, groups = trainer.grid, trainer.groups
    nodes: list[Any] = [None] * grid.world_size
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    control = job.control
    snapshotter = Snapshotter(trainer, job.recovery, grid, groups, nodes, job.snapshots,
                              writes=lambda: trainer.replicas.evaluates(),
                              agreed=lambda name: trainer.replicas.agreed(name),
                              say=lambda msg: control.say.remote(f"[recgrid] {msg}"),
                              pin=lambda step: control.pin.remote(step, "snapshot"))
    return snapshotter, HolderRestore(job.recovery, grid, groups, nodes)


def _leave_at_drain(job: WorkerJob, trainer: Trainer, replicas: Any, fallback: Any, manager: Any, g: int, s: int,
                    L: int) -> None:
    """A node of this sharding group's run is being drained (Ray Train's notice, `train.recovery.peers`): the
    group leaves after its committed step. Its updates were averaged into the live groups at the
    block's sync and its data cursor is noted, so nothing it trained is lost; the last group to
    leave writes a storage checkpoint first. Then its workers wait: Ray Train ends the run at the
    drain's deadline and starts it again where there is room (the group comes back healed from
    a live peer), unless the job ends first (the run then ends with it)."""
    import ray
    import torch.distributed as dist

    notice, step, control = replicas.left, trainer.state.step, job.control
    manager.shutdown(wait=False)  # the live groups' next quorum goes on without this group
    box = [ray.get(control.group_leaves.remote(g, step, notice.preempted_node_ids, notice.deadline_ms))
           if s == 0 else None]
    if L > 1:
        dist.broadcast_object_list(box, src=0)
    stays, ckpt, kept = box[0], fallback.checkpointer, None
    if not stays and ckpt.cadence.on:  # no group trains on: the model goes to storage (collective over the group)
        kept = ckpt.save_at(step)
    if s == 0:
        left = max(0.0, notice.deadline_ms / 1000 - time.time()) if notice.deadline_ms else None
        control.say.remote(
            f"[recgrid] sharding group {g}: its node is being drained"
            + (f" ({left:.0f} s to the deadline)" if left is not None else "") + f"; it left after step {step}, "
            + (f"groups {stays} train on and it comes back, healed from one of them, where there is room" if stays
               else f"no group trains on: storage checkpoint {kept}" if kept
               else "no group trains on and train.checkpoint_every=0: nothing is kept past this job"))
    while not ray.get(control.over.remote()):
        time.sleep(1.0)


def _wait_for_peers(control: Any, workers: int) -> None:
    """At the job's first start, wait until the managers of `workers` workers are up (those of
    the sharding groups the cluster holds): the first quorum then holds every group that can
    start (torchft forms a quorum of whoever asks first otherwise); the others join later."""
    import ray

    deadline = time.time() + START_WAIT_S
    while time.time() < deadline:
        attempts = ray.get(control.status.remote())["attempts"]
        if len({r for a in attempts for r, w in a["workers"].items() if w.get("ready")}) >= workers:
            return
        time.sleep(0.1)


class Reporter:
    """The logging worker's voice: MLflow logging into the job's run (each step once, whichever
    worker logs it), progress lines, recovery events, the Ray-native metrics and the throttled
    heartbeat to job control."""

    def __init__(self, job: WorkerJob, trainer: Trainer, control: Any, coordinator: Any, attempt: int,
                 exporter: Any, tracker: Any = None) -> None:
        import ray

        from recgrid.tracking import Tracker

        self.job, self.trainer, self.control, self.coordinator, self.attempt = job, trainer, control, coordinator, attempt
        self.tracker = tracker or (Tracker.attach(job.run_id, job.tracking_uri) if job.run_id else None)
        status = ray.get(control.status.remote())
        self.logged_upto = status["logged_upto"]
        self.attempt_info = status["attempts"][attempt]
        self.started_at = time.perf_counter()
        self.exporter = exporter
        self.heartbeat = Heartbeat(control)

    def say(self, msg: str) -> None:
        """A line for the user: the driver prints it (job control's console)."""
        self.control.say.remote(f"[recgrid] {msg}")

    def log_grid(self, num_groups: int, world_size: int, step: int) -> None:
        """`grid/num_groups` and `grid/world_size` at `step` (once per step, restarts included)."""
        import ray

        values = {"grid/num_groups": num_groups, "grid/world_size": world_size}
        if self.tracker is not None and ray.get(self.control.claim_step.remote("grid", step)):
            self.tracker.log_metrics(values, step)
        self.exporter(values, step)

    def open_run(self, workers_per_node: int | None, step: int) -> None:
        """What a worker that starts logging puts in the run first: `derived.workers_per_node`
        (once a job; the plan itself is the run's artifact sharding_plan.json, written by the
        driver), and the recovery gauges, which exist from the start (0 until a recovery), as
        dashboards expect."""
        import ray

        if self.tracker is not None and ray.get(self.control.claim_step.remote("params", 0)):
            self.tracker.log_params({"derived.workers_per_node": workers_per_node})
        events = [e for e in ray.get(self.coordinator.status.remote())["events"] if "seconds" in e]
        last = events[-1] if events else {}
        self.exporter({"recovery/count": len(events), "recovery/seconds": last.get("seconds", 0.0),
                       "recovery/steps_lost": last.get("steps_lost", 0)}, step)

    def step(self, step: int) -> None:
        """`FitHooks.after_step`: the throttled heartbeat."""
        self.heartbeat.maybe_beat(step)

    def log_event(self, count: int, event: dict[str, Any], step: int, timestamp_ms: int | None = None) -> None:
        """Recovery number `count` into the run: its metrics (at `step`, and `timestamp_ms` when given:
        then writing it again changes nothing) and its source, detail and why as tags."""
        values = {"recovery/count": count, "recovery/seconds": event["seconds"],
                  "recovery/steps_lost": event.get("steps_lost", 0)}
        if "survivors_qps" in event:  # what the groups that kept training did meanwhile
            values.update({"recovery/survivors_qps": event["survivors_qps"],
                           "recovery/survivors_qps_before": event["survivors_qps_before"],
                           "recovery/survivors_steps": event["survivors_steps"]})
        tags = {f"recovery/source/{count}": event["source"], f"recovery/detail/{count}": event.get("detail", ""),
                f"recovery/why/{count}": event.get("why", "")}
        if "kept_training" in event:
            tags[f"recovery/kept_training/{count}"] = ",".join(map(str, event["kept_training"])) or "none"
        if self.tracker is not None:
            self.tracker.log_metrics(values, step, timestamp_ms)
            self.tracker.set_tags(tags)
        self.exporter(values, step)

    def log(self, values: dict[str, float], step: int) -> None:
        from recgrid.logs import progress_line

        import ray

        self.heartbeat.beat(step)
        # each step's training metrics and its evaluation reach the run once: a step trained again
        # after a restart, an evaluation repeated after a rollback, or a new logging worker are not logged twice
        series = "eval" if "eval/ne" in values else "train"
        if (series == "train" and step <= self.logged_upto) or not ray.get(self.control.claim_step.remote(series, step)):
            return
        if series == "eval" and not ray.get(self.control.claim_step.remote("train", step)):
            # the step's training metrics came first (memory, ...): the evaluation adds its own only
            values = {k: v for k, v in values.items() if k.startswith("eval/")}
        if self.tracker is not None:
            self.tracker.log_metrics(values, step)
        self.control.mark_logged.remote(step)
        self.control.say.remote(progress_line(values, step, self.job.loop.max_steps,
                                              time.perf_counter() - self.started_at))


class WarmTracker:
    """The job's MLflow run, attached in a background thread when `warm`, for a worker that may take
    over the logging mid-job; `get()` gives it (attached then if it was not warmed or that failed)."""

    def __init__(self, run_id: str | None, tracking_uri: str | None, warm: bool) -> None:
        import threading

        self.run_id, self.tracking_uri = run_id, tracking_uri
        self.tracker: Any = None
        self._thread = threading.Thread(target=self._warm, name="recgrid-tracker", daemon=True) \
            if warm and run_id else None
        if self._thread is not None:
            self._thread.start()

    def _attach(self) -> Any:
        from recgrid.tracking import Tracker

        return Tracker.attach(self.run_id, self.tracking_uri)  # type: ignore[arg-type]

    def _warm(self) -> None:
        try:
            self.tracker = self._attach()
        except Exception:  # noqa: BLE001 - warming only: `get` attaches again, and raises there
            pass

    def get(self) -> Any:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.tracker is None and self.run_id:
            self.tracker = self._attach()
        return self.tracker


class GroupReport:
    """A worker's side of logging (`train.recovery.peers.GroupListener`): shard rank 0 of the live
    sharding group of quorum rank 0 logs through a `Reporter` (it changes when that group fails),
    logs `grid/num_groups` whenever the live group count changes, and logs the recovery events that
    rebuilt groups record (`train.recovery.events`). An attempt here is one worker's start."""

    def __init__(self, job: WorkerJob, trainer: Trainer, heal: Any, coords: Any, attempt: int, replacement: bool,
                 attempt_info: dict[str, Any], exporter: Any, before: dict[str, Any], tracker: "WarmTracker") -> None:
        self.job, self.trainer, self.heal, self.attempt, self.tracker = job, trainer, heal, attempt, tracker
        self.rank, self.group, self.shard = coords.rank, coords.sharding_group, coords.shard_rank
        self.replacement, self.exporter = replacement, exporter
        self.control, self.coordinator = job.control, job.recovery
        self.report: Reporter | None = None  # while this sharding group is the quorum's rank 0
        self.live: int | None = None
        self.synced_live: int | None = None  # live sharding groups at this group's last sync
        self.digests_left = 0  # syncs whose table digest this worker still notes (`committed`)
        self.heals_sent = 0  # `heal.sent` at this group's last digest decision
        self.events = RecoveryEvents(job, heal, self.group, self.shard, attempt, attempt_info, replacement, before)
        self.first_step_done = False

    # ---- GroupListener ------------------------------------------------------------------------------
    def quorum(self, live: int, rank: int) -> None:
        if rank == 0 and self.shard == 0 and self.report is None:
            self.report = Reporter(self.job, self.trainer, self.control, self.coordinator, self.attempt, self.exporter,
                                   tracker=self.tracker.get())
            self.control.note.remote(self.attempt, self.rank, {"logging_since": time.time()})
            self.report.open_run(self._workers_per_node(), self.trainer.state.step)
        elif rank != 0:
            self.report = None
        if live != self.live and self.report is not None:
            self.report.log_grid(live, live * self.job.group_size, self.trainer.state.step)
        self.live = live

    def _workers_per_node(self) -> int | None:
        """The job's workers on each node, as job control has them registered (each global rank's
        newest start), when every node holds as many; else None."""
        import ray

        newest: dict[int, str] = {}
        for a in ray.get(self.control.status.remote())["attempts"]:
            for rank, w in a["workers"].items():
                newest[int(rank)] = w["node"]
        counts = set(Counter(newest.values()).values())
        return counts.pop() if len(counts) == 1 else None

    def finished_elsewhere(self) -> bool:
        """A replacement that found no live sharding group ahead while the others have already ended
        the job (they noted their final step): nothing is left to train."""
        import ray

        if (not self.replacement or self.first_step_done or self.heal.restored
                or (self.heal.heals and self.heal.heals[-1]["step"] > 0)):
            return False
        attempts = ray.get(self.control.status.remote())["attempts"]
        if not any("final_step" in w for a in attempts for w in a["workers"].values()):
            return False
        self.control.say.remote(f"[recgrid] sharding group {self.group}: the other groups have finished the job; "
                                f"nothing to train")
        return True

    def committed(self, step: int, live: int, synced: bool) -> None:
        from recgrid.train.recovery.peers import kernel_digest

        if not self.first_step_done:
            self.first_step_done = True
            self.events.record_start(self.live, logging=self.report is not None)
        if sync_step(step, self.job.engine.sync_every):
            if live != self.synced_live or self.heal.sent != self.heals_sent:
                # the live count changed, or this group healed a newcomer (which may rejoin before
                # this group's quorum ever counted it gone)
                self.synced_live, self.heals_sent, self.digests_left = live, self.heal.sent, 2
            if self.digests_left:
                # the first two syncs after the live count changed (a newcomer's first): every worker
                # notes its tables, which must then be the same on all of them (no collective: notes go
                # to job control). Two, because a newcomer that heals in the round of a sync step may
                # commit its first sync a round later than the groups that were live.
                digest = kernel_digest(self.trainer, replicated=True)
                self.control.note.remote(self.attempt, self.rank, {f"digest@{step}": digest, f"live@{step}": live})
                self.digests_left -= 1

    def say(self, msg: str) -> None:
        self.control.say.remote(f"[recgrid] {msg}")

    # ---- FitHooks -------------------------------------------------------------------------------------
    def step(self, step: int) -> None:
        if self.report is not None:
            self.report.step(step)

    def log(self, values: dict[str, float], step: int) -> None:
        from recgrid.engine.device import peak_memory_mb

        self.exporter({**values, "memory/peak_mb": peak_memory_mb(self.trainer.device)}, step)
        if self.report is not None:
            self.report.log(values, step)
            self.events.log_new(self.report, step)

    def finish(self) -> None:
        """Every worker notes where it ended (its tables and dense part): the same on every live sharding group."""
        import ray

        from recgrid.train.recovery.peers import dense_digest, kernel_digest

        t = self.trainer
        if self.report is not None:
            self.events.log_new(self.report, t.state.step)
        ray.get(self.control.note.remote(self.attempt, self.rank, {
            "final_step": t.state.step, "final_digest": kernel_digest(t, replicated=True),
            "final_dense_digest": dense_digest(t),
            "heals": [dict(h) for h in self.heal.heals]}))

def metrics_exporter(job: WorkerJob, rank: int):
    """This worker's Ray-native metric exporter (`train.export`): job metrics from rank 0,
    its own memory and sync figures from every worker."""
    from recgrid.train.export import RayMetricsExporter

    return RayMetricsExporter(run_id=job.run_id or "", rank=rank, run_name=job.run_name or None).export
