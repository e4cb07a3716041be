"""The Ray Train worker body: what every worker of every sharding group's run runs. Thin: it
wires the trainer (`train.trainer`: the one step loop) to the job's actors and components.

`train_group_worker`: every sharding group is a Ray Train run of its own, of L workers whose
torch world is the group; Ray Train restarts that run alone when one of them dies. The groups
meet across runs through torchft (`train.recovery.peers.TorchftReplicas`, the trainer's replica component):
a rebuilt group heals from a live peer group, else restores from the hosts' holders, the
newest storage checkpoint, `train.resume_from`, or starts at step 0. Shard rank 0 of the live
group of quorum rank 0 logs into the job's one MLflow run (never twice for a step), that group
writes the storage checkpoints (`train.recovery.storage.StorageFallback`), and `GroupReport` records each
rebuilt group's heal or restore (`train.report`). A group whose node is drained leaves after its
last sync (`train.recovery.membership.leave_at_drain`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from recgrid.data.stream import EvalData, TrainData, stats_text
from recgrid.data.units import EpochPlan
from recgrid.engine.device import pin_batches, worker_device
from recgrid.engine.grid import Grid
from recgrid.logs import quiet_libraries
from recgrid.tracking import start_system_metrics, stop_system_metrics
from recgrid.train.audit import CallAudit
from recgrid.train.checkpoint import Checkpointer
from recgrid.train.control import StopPoll
from recgrid.train.job import WorkerJob
from recgrid.train.recovery.holders import group_snapshots
from recgrid.train.recovery.membership import GroupProgress, leave_at_drain, wait_for_peers
from recgrid.train.recovery.peers import GroupWorld, HealTransport, TorchftReplicas, make_manager
from recgrid.train.recovery.storage import StorageFallback
from recgrid.train.report import GroupReport, WarmTracker, metrics_exporter
from recgrid.train.rows import RowLog
from recgrid.train.trainer import FitHooks, Trainer


def _start_worker(job: WorkerJob) -> tuple[Any, Any]:
    """What every worker does first: quiet libraries, threads, its device. Returns (Ray Train's
    context, the device)."""
    import ray.train
    import torch

    quiet_libraries()
    ctx = ray.train.get_context()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    return ctx, ray_worker_device(job.use_gpu)


def ray_worker_device(use_gpu: bool) -> Any:
    """The device of this Ray Train worker, made current: the GPU Ray assigned it
    (`ray.train.torch.get_device()`, from the GPU ids Ray reserved for it) on GPU jobs, cpu
    otherwise. Never computed from `get_local_rank()`: under torchft every sharding group is a
    run of its own, so two runs' workers on one node have the same local ranks."""
    if not use_gpu:
        return worker_device(use_gpu=False)
    import ray.train.torch

    return worker_device(use_gpu=True, assigned=ray.train.torch.get_device())


def _data(job: WorkerJob, rank: int, workers: int, eval_rank: int, eval_workers: int,
          device: Any) -> tuple[TrainData, EvalData | None]:
    """This worker's part of each epoch (of `workers` parts) and of the evaluation rows, in pinned
    memory on a GPU worker (`engine.device.pin_batches`)."""
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
    import ray

    job: WorkerJob = cfg["job"]
    audit = CallAudit() if job.call_audit else None
    if audit is not None:  # the test of the step's path (train.audit): every actor call counted by step
        job = dataclasses.replace(job, control=audit.actor(job.control), recovery=audit.actor(job.recovery))
    ctx, device = _start_worker(job)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's quorum servers log every round at INFO
    # torchft logs a peer's death as a traceback; the component says it in one line
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    world = GroupWorld.of_run(ctx, cfg["group"], job.lighthouse)
    grid = job.grid
    L, T = grid.group_size, grid.world_size
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

        # one monitor per node (the job's first worker there), named by host and Ray node
        system = start_system_metrics(job.run_id, f"{socket.gethostname()}-{node[:8]}", job.tracking_uri)
    status = ray.get(control.status.remote())
    replacement = any(rank in a["workers"] for a in status["attempts"][:attempt])
    attempt_info = status["attempts"][attempt]
    # this worker takes over the MLflow logging if the logging group fails: its tracker is attached
    # ahead (MLflow's import and store: a second or more), so the takeover does not hold up the group
    # while it trains on alone (a replacement skips it: its start is the recovery's critical path)
    tracker = WarmTracker(job.run_id, job.tracking_uri, s == 0 and not replacement,
                          wrap=audit.tracker if audit is not None else None)
    before = ray.get(control.group_status.remote(g)) if replacement else {}  # the group's last commit before it failed
    # the whole model over the sharding group: TorchRec's DMP over its L workers (the default process group),
    # in the device's loop (TorchRec's pipeline on CUDA, whose optimizer step is the round's commit)
    trainer = Trainer.build(Grid(L, 1), job.engine, device, job.plan, schedule=job.schedule)
    if audit is not None:
        audit.step_of = lambda: trainer.state.step
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
        wait_for_peers(control, job.start_groups * L)
    # in-memory snapshots on the hosts' holders, taken by the live group of quorum rank 0 and read when
    # no live group is ahead (a host loss under host-local, any failure at M = 1)
    snapshotter, holders = group_snapshots(job, trainer)
    # storage checkpoints: written by the live group of quorum rank 0, read when no live group or snapshot is left
    checkpointer = Checkpointer(ray_storage=True, cadence=job.schedule.checkpoints, trainer=trainer)
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
    final = replicas.evaluates() and replicas.left is None and (
        ck.cadence.on if trainer.interrupted else job.log_model)
    if final:  # the driver waits for this group's last checkpoint before it ends the job's runs
        control.note.remote(attempt, rank, {"final_checkpoint": step})
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
        leave_at_drain(job, trainer, replicas, fallback, manager, g, s, L)
        return
    manager.shutdown(wait=False)
    logger = report.report
    if logger is not None and logger.tracker is not None:  # Ray Data's execution stats of the logging worker's streams
        logger.tracker.log_text(stats_text(data, eval_data), "data/ray_data_stats.txt")
    if audit is not None:
        control.note.remote(attempt, rank, {"final_calls": audit.record()})
    report.finish()
    ray.get(control.finished.remote(trainer.state.step, trainer.interrupted))  # every live worker: the same
