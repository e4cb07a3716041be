"""A worker's side of the job's MLflow run and metrics: `GroupReport` (the trainer's
`GroupListener`: who logs, the live group count, the recovery events), `Reporter` (the logging
worker's MLflow logging, progress lines and heartbeat), `WarmTracker` (a takeover's tracker,
attached ahead) and the Ray-native metrics exporter. Who logs and why: docs/design-notes.md,
"Failures, restarts and elastic jobs"."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

from recgrid.engine.device import peak_memory_mb
from recgrid.logs import progress_line
from recgrid.tracking import Tracker
from recgrid.train.control import Heartbeat
from recgrid.train.export import RayMetricsExporter
from recgrid.train.job import WorkerJob
from recgrid.train.recovery.events import RecoveryEvents
from recgrid.train.recovery.peers import dense_digest, kernel_digest
from recgrid.train.trainer import Trainer


class Reporter:
    """The logging worker's voice: MLflow logging into the job's run (each step once, whichever
    worker logs it), progress lines, recovery events, the Ray-native metrics and the throttled
    heartbeat to job control."""

    def __init__(self, job: WorkerJob, trainer: Trainer, control: Any, coordinator: Any, attempt: int,
                 exporter: Any, tracker: Any = None) -> None:
        import ray

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
        """`FitHooks.after_step`: the throttled heartbeat, at sync steps only (no Ray call on the
        other steps' path; a logging step beats in `log`)."""
        if self.job.schedule.syncs(step):
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

    def __init__(self, run_id: str | None, tracking_uri: str | None, warm: bool,
                 wrap: Callable[[Any], Any] | None = None) -> None:
        import threading

        self.run_id, self.tracking_uri, self.wrap = run_id, tracking_uri, wrap
        self.tracker: Any = None
        self._thread = threading.Thread(target=self._warm, name="recgrid-tracker", daemon=True) \
            if warm and run_id else None
        if self._thread is not None:
            self._thread.start()

    def _attach(self) -> Any:
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
        return self.tracker if self.wrap is None else self.wrap(self.tracker)


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
            self.report.log_grid(live, live * self.job.grid.group_size, self.trainer.state.step)
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
        if not self.first_step_done:
            self.first_step_done = True
            self.events.record_start(self.live, logging=self.report is not None)
        if self.job.schedule.syncs(step):
            if live != self.synced_live or self.heal.sent != self.heals_sent:
                # the live count changed, or this group healed a newcomer (which may rejoin before
                # this group's quorum ever counted it gone)
                self.synced_live, self.heals_sent, self.digests_left = live, self.heal.sent, 2
            if self.digests_left and self.job.table_digests:
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
        self.exporter({**values, "memory/peak_mb": peak_memory_mb(self.trainer.device)}, step)
        if self.report is not None:
            self.report.log(values, step)
            self.events.log_new(self.report, step)

    def finish(self) -> None:
        """Every worker notes where it ended: its step, its heals and (`WorkerJob.table_digests`) its
        tables' and dense part's checksums, the same on every live sharding group."""
        import ray

        t = self.trainer
        if self.report is not None:
            self.events.log_new(self.report, t.state.step)
        digests = ({"final_digest": kernel_digest(t, replicated=True), "final_dense_digest": dense_digest(t),
                    "final_sums": table_sums(t)} if self.job.table_digests else {})
        ray.get(self.control.note.remote(self.attempt, self.rank, {
            "final_step": t.state.step, **digests, "heals": [dict(h) for h in self.heal.heals]}))


def metrics_exporter(job: WorkerJob, rank: int):
    """This worker's Ray-native metric exporter (`train.export`): job metrics from rank 0,
    its own memory and sync figures from every worker."""
    return RayMetricsExporter(run_id=job.run_id or "", rank=rank, run_name=job.run_name or None).export


def table_sums(trainer: Trainer) -> list[float]:
    """Each replicated table tensor's sum (float64): what a test compares between paths that train
    alike but need not add in the same order (`WorkerJob.table_digests`)."""
    return [float(x.double().sum()) for x in trainer.replica_sync.replicated()]
