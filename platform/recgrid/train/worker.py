"""The Ray Train worker body: what every worker of every attempt runs.

1. Place the grid on the workers Ray gave this attempt: L (the sharding group size) is fixed
   for the job's life, so n workers train as M' = n // L whole sharding groups (an elastic job
   after losing or regaining capacity; no resharding, a shard's identity is its position inside
   a sharding group); ranks past M' * L sit the attempt out. The layout is checked against the
   nodes.
2. Build the trainer with the job's recorded sharding plan.
3. Restore: in-memory copies from the holders, else the storage checkpoint, else
   `train.resume_from`, else fresh (`train.recovery`).
4. Train, snapshotting at sync points and checkpointing every `train.checkpoint_every` steps;
   global rank 0 logs into the job's one MLflow run (never twice for a step), prints progress,
   and records the recovery events.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from recgrid.data.units import DEFAULT_ROWS_PER_UNIT, EpochPlan, Inputs
from recgrid.engine.grid import Grid, GridError
from recgrid.train.trainer import EngineConfig, EvalData, FitHooks, LoopConfig, TrainData, Trainer


@dataclass(frozen=True)
class WorkerJob:
    """What the driver hands every worker (it pickles; it holds no live process handle but the
    coordinator's actor handle)."""

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
    coordinator: Any
    run_name: str = ""
    resume_from: str | None = None
    row_log: str | None = None
    rows_per_unit: int = DEFAULT_ROWS_PER_UNIT


def train_worker(cfg: dict) -> None:
    """Ray Train's per-worker function (`cfg["job"]` is the WorkerJob)."""
    import ray
    import ray.train
    import torch
    import torch.distributed as dist

    from recgrid.engine.device import peak_memory_mb, worker_device
    from recgrid.logs import quiet_libraries
    from recgrid.train.checkpoint import Checkpointer
    from recgrid.train.recovery import Recovery

    quiet_libraries()
    job: WorkerJob = cfg["job"]
    ctx = ray.train.get_context()
    world_rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    device = worker_device(ctx.get_local_rank(), job.use_gpu)
    coordinator = job.coordinator

    attempt = [ray.get(coordinator.begin_attempt.remote(world)) if world_rank == 0 else None]
    dist.broadcast_object_list(attempt, src=0)
    attempt_no = attempt[0]
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    coordinator.register.remote(attempt_no, world_rank, os.getpid(), nodes[world_rank])

    grid = place_grid(job, nodes)
    groups = grid.build_process_groups(device.type)  # collective over all `world` ranks
    sidelined = list(range(grid.world_size, world))
    side_pg = dist.new_group([0, *sidelined]) if sidelined else None
    if groups is None:
        _sit_out(side_pg)
        return

    trainer = Trainer(grid, groups, job.engine, device, job.plan, ne_window_steps=job.loop.ne_window_steps)
    exporter = metrics_exporter(job, groups.coords.rank)
    report = Reporter(job, trainer, coordinator, attempt_no, exporter) if world_rank == 0 else None
    system = None
    if job.run_id and world_rank == min(r for r in range(world) if nodes[r] == nodes[world_rank]):
        import socket

        from recgrid.tracking import start_system_metrics

        # one monitor per node (its first worker), named by host and Ray node (hosts may hold several)
        system = start_system_metrics(job.run_id, f"{socket.gethostname()}-{nodes[world_rank][:8]}", job.tracking_uri)
    recovery = Recovery(coordinator, grid, groups, nodes[:grid.world_size], attempt_no)
    if job.loop.snapshot_every_syncs:
        recovery.prepare(trainer)  # shared-memory slots for this worker's snapshots, before any step
    checkpointer = Checkpointer(ray_storage=True)
    stored = ray.train.get_checkpoint()
    restored = recovery.restore(trainer, checkpointer, stored.path if stored else None, job.resume_from,
                                say=report.say if report else print)
    if report:
        report.started(restored, grid)

    rank, loop = groups.coords.rank, job.loop
    data = TrainData(EpochPlan(job.train_inputs, job.engine.seed, loop.batch_size, job.rows_per_unit),
                     job.engine.spec, rank, grid.world_size)
    eval_data = EvalData(job.eval_inputs, job.engine.spec, loop.batch_size, rank, grid.world_size) \
        if job.eval_inputs is not None else None
    rows = RowLog(job.row_log, attempt_no, world_rank) if job.row_log else None
    pending_check = [restored.source == "peer" and grid.num_groups > 1]

    def at_sync_point(t: Trainer) -> None:
        step = t.state.step
        if pending_check[0] and t.replica_sync.due(step):  # the first sync after a peer restore
            digests = recovery.replica_digests(t)
            pending_check[0] = False
            if report:
                report.replicas_checked(digests)
        if loop.snapshot_every_syncs and (step // job.engine.sync_every) % loop.snapshot_every_syncs == 0:
            with t.metrics.timer.phase("snapshot"):
                recovery.snapshot(t)
        if loop.checkpoint_every and step % loop.checkpoint_every == 0:
            with t.metrics.timer.phase("checkpoint"):
                if side_pg is not None:  # the sitting-out workers join Ray Train's report
                    dist.broadcast_object_list([("report", step)], group=side_pg, group_src=0) if rank == 0 else None
                path = checkpointer.save(t)
                if rank == 0:
                    coordinator.checkpoint_written.remote(step, path)

    def on_step(t: Trainer, out: Any, batch: Any) -> None:
        if rows is not None:
            rows.write(t.state.step, getattr(batch, "row_ids", None))
        if report:
            report.step(t.state.step)

    def stop_requested(t: Trainer) -> bool:
        box = [ray.get(coordinator.stop_requested.remote()) if rank == 0 else None]
        dist.broadcast_object_list(box, group=groups.global_pg, group_src=0)
        return bool(box[0])

    def on_log(values: dict[str, float], step: int) -> None:
        # every worker exports its own memory and sync figures; rank 0 also the job's, and logs
        exporter({**values, "memory/peak_mb": peak_memory_mb(device)}, step)
        if report:
            report.log(values, step)

    hooks = FitHooks(on_log=on_log, at_sync_point=at_sync_point, on_step=on_step, stop_requested=stop_requested)
    trainer.fit(data, loop, eval_data, hooks)
    trainer.close()
    recovery.close()
    if system is not None:
        system.finish()
    if side_pg is not None and rank == 0:
        dist.broadcast_object_list([("done", trainer.state.step)], group=side_pg, group_src=0)
    dist.barrier(group=groups.global_pg)


def place_grid(job: WorkerJob, nodes: list[str]) -> Grid:
    """This attempt's grid: as many whole sharding groups of L as the workers allow (at most the
    job's T), checked against the nodes the workers run on."""
    L = job.group_size
    n = min(job.max_world_size, len(nodes) // L * L)
    if n == 0:
        raise GridError(f"this attempt got {len(nodes)} workers, fewer than one sharding group of L={L}; "
                        f"grid.min_world_size must be at least L")
    counts = Counter(nodes[:n])
    per_node = next(iter(counts.values())) if len(set(counts.values())) == 1 else None
    grid = Grid(n, n // L, job.layout, workers_per_node=per_node)  # type: ignore[arg-type]
    grid.check_placement(nodes[:n])
    return grid


def _sit_out(side_pg: Any) -> None:
    """A worker past the last whole sharding group: join Ray Train's reports until the job ends."""
    import torch.distributed as dist

    from recgrid.train.checkpoint import report_checkpoint

    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, group=side_pg, group_src=0)
        kind, step = box[0]
        if kind == "done":
            return
        report_checkpoint(None, step, {})


class RowLog:
    """Appends (step, row id) pairs of every trained row to `<dir>/rows-a<attempt>-r<rank>.bin`
    (int64 pairs, written per step, so a killed worker's file holds every step it finished)."""

    def __init__(self, directory: str, attempt: int, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.fd = os.open(os.path.join(directory, f"rows-a{attempt:03d}-r{rank:03d}.bin"),
                          os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, step: int, row_ids: Any) -> None:
        import numpy as np

        if row_ids is None:
            return
        ids = np.asarray(row_ids, dtype=np.int64)
        os.write(self.fd, np.stack([np.full_like(ids, step), ids], axis=1).tobytes())


def read_row_logs(directory: str) -> dict[tuple[int, int], Any]:
    """(attempt, rank) -> int64 array [n, 2] of (step, row id), from a RowLog directory."""
    import numpy as np

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rows-a") and name.endswith(".bin"):
            attempt, rank = int(name[6:9]), int(name[11:14])
            out[(attempt, rank)] = np.fromfile(os.path.join(directory, name), dtype=np.int64).reshape(-1, 2)
    return out


class Reporter:
    """Global rank 0's voice: MLflow logging into the job's run (each step once, restarts
    included), progress lines, recovery events and the Ray-native metrics."""

    def __init__(self, job: WorkerJob, trainer: Trainer, coordinator: Any, attempt: int, exporter: Any) -> None:
        import ray

        from recgrid.tracking import Tracker

        self.job, self.trainer, self.coordinator, self.attempt = job, trainer, coordinator, attempt
        self.tracker = Tracker.attach(job.run_id, job.tracking_uri) if job.run_id else None
        status = ray.get(coordinator.status.remote())
        self.logged_upto = status["logged_upto"]
        self.attempt_info = status["attempts"][attempt]
        self.started_at = time.perf_counter()
        self.recovery: dict[str, Any] | None = None
        self.first_step_done = False
        self.exporter = exporter

    def say(self, msg: str) -> None:
        # to the process's own stdout: Ray Train's print patch would log the line a second time
        print(f"[recgrid] {msg}", file=sys.__stdout__, flush=True)

    def started(self, restored: Any, grid: Grid) -> None:
        from recgrid.engine.sharding import sharding_summary

        step = restored.step
        if self.tracker is not None and self.attempt == 0:
            self.tracker.log_params({"sharding": sharding_summary(self.trainer.plan),
                                     "grid.workers_per_node": grid.workers_per_node})
        import ray

        grid_values = {"grid/num_groups": grid.num_groups, "grid/world_size": grid.world_size}
        if self.tracker is not None and ray.get(self.coordinator.claim_step.remote("grid", step)):
            self.tracker.log_metrics(grid_values, step)
        self.exporter(grid_values, step)
        # the recovery gauges exist from the start (0 until a recovery), as dashboards expect
        events = [e for e in ray.get(self.coordinator.status.remote())["events"] if "seconds" in e]
        last = events[-1] if events else {}
        self.exporter({"recovery/count": len(events), "recovery/seconds": last.get("seconds", 0.0),
                       "recovery/steps_lost": last.get("steps_lost", 0)}, step)
        if restored.event is not None:
            self.recovery = {"event": restored.event, "source": restored.source, "step": step}
        if self.attempt > 0 or restored.source != "fresh":
            self.say(f"attempt {self.attempt}: T={grid.world_size} M={grid.num_groups} L={grid.group_size}; "
                     f"resuming at step {step} ({restored.source}{': ' + restored.detail if restored.detail else ''})")

    def replicas_checked(self, digests: list[str]) -> None:
        if self.recovery is not None:
            self.coordinator.update_event.remote(self.recovery["event"], {"replicas_identical_after_sync": len(set(digests)) == 1})

    def step(self, step: int) -> None:
        self.coordinator.heartbeat.remote(step)
        if not self.first_step_done:
            self.first_step_done = True
            if self.recovery is not None:
                self._log_recovery(step)

    def _log_recovery(self, step: int) -> None:
        import ray

        now = time.time()
        status = ray.get(self.coordinator.status.remote())
        event = status["events"][self.recovery["event"]]
        detected = self.attempt_info.get("failure_time") or self.attempt_info["start"]
        fields = {"t_first_step": now, "t_attempt_start": self.attempt_info["start"], "t_failure_detected": detected,
                  "seconds": now - detected,
                  "steps_lost": max(0, (event.get("failure_step") or 0) - event["step"])}
        self.coordinator.update_event.remote(self.recovery["event"], fields)
        count = self.recovery["event"] + 1  # events are numbered from 0, recoveries from 1
        values = {"recovery/count": count, "recovery/seconds": fields["seconds"],
                  "recovery/steps_lost": fields["steps_lost"]}
        if self.tracker is not None:
            self.tracker.log_metrics(values, step)
            self.tracker.set_tags({f"recovery/source/{count}": self.recovery["source"],
                                   f"recovery/detail/{count}": event.get("detail", ""),
                                   f"recovery/why/{count}": event.get("why", "")})
        self.say(f"recovered from {self.recovery['source']} in {fields['seconds']:.1f} s "
                 f"({fields['steps_lost']} steps lost)")
        self.exporter(values, step)

    def log(self, values: dict[str, float], step: int) -> None:
        from recgrid.logs import progress_line

        if step <= self.logged_upto and "eval/ne" not in values:
            return  # this step reached the run before the restart
        if self.tracker is not None:
            self.tracker.log_metrics(values, step)
        self.coordinator.mark_logged.remote(step)
        print(progress_line(values, step, self.job.loop.max_steps, time.perf_counter() - self.started_at),
              file=sys.__stdout__, flush=True)


def metrics_exporter(job: WorkerJob, rank: int):
    """This worker's Ray-native metric exporter (`train.export`): job metrics from rank 0,
    its own memory and sync figures from every worker."""
    from recgrid.train.export import RayMetricsExporter

    return RayMetricsExporter(run_id=job.run_id or "", rank=rank, run_name=job.run_name or None).export
