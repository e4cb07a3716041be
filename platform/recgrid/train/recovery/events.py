"""Recovery events: how a rebuilt sharding group came back, recorded once by the group and logged
once into the job's MLflow run.

At its first committed step, shard rank 0 of a rebuilt group records (with the job's recovery
coordinator, `train.recovery.coordinator`) where its state came from (`source`: `peer`, `holder`,
`storage`, `resume` or `fresh`, the restore order of `train.recovery.storage`), the sentence the
log prints (`why`), where the shards or the checkpoint came from (`detail`), the steps trained
again, and `seconds`: the failure first seen (by a group-mate, or by Ray Train's controller as it
started the replacement) -> the group's first committed step; and what the groups that kept
training did meanwhile (which, their QPS during the recovery and in as long a span before).
The logging worker logs each recorded event into the run (`recovery/count`, `recovery/seconds`,
`recovery/steps_lost`, the survivors' figures, and tags `recovery/source/<n>`, `recovery/why/<n>`,
`recovery/detail/<n>`, `recovery/kept_training/<n>`) at the step and time job control fixed for
it, so a logger that dies between the write and its mark leaves it to the next, whose write
MLflow stores once.
"""

from __future__ import annotations

import os
import time
from typing import Any


class RecoveryEvents:
    """One worker's side of the recovery events (the module docstring): `record_start` at its
    group's first committed step, `log_new` at the logging worker's logging steps.

    Args:
        job: the job (`train.job.WorkerJob`: its control and recovery actors, grid shape, loop).
        heal: the group's `train.recovery.peers.HealTransport` (its heals and storage restore).
        group, shard: this worker's sharding group and shard rank.
        attempt, attempt_info: this worker's start, as job control has it.
        replacement: whether this worker rebuilds a rank that ran before.
        before: the group's last commit before it failed (`JobControl.group_status`; {} at the start).
    """

    def __init__(self, job: Any, heal: Any, group: int, shard: int, attempt: int, attempt_info: dict[str, Any],
                 replacement: bool, before: dict[str, Any]) -> None:
        self.job, self.heal, self.group, self.shard = job, heal, group, shard
        self.attempt, self.attempt_info, self.replacement, self.before = attempt, attempt_info, replacement, before
        self.control, self.coordinator = job.control, job.recovery
        self.logged: set[int] = set()

    def record_start(self, live: int | None, logging: bool) -> None:
        """At its first committed step, shard rank 0 of a rebuilt group records how the group came
        back, and what the groups that kept training did meanwhile; at the job's start, shard rank 0
        of the logging group (`logging`) records a resume from `train.resume_from` (every group
        resumed). `live`: the live sharding groups of the group's first quorum."""
        import ray

        heal, restored = self.heal.heals[-1] if self.heal.heals else None, self.heal.restored
        at_start = not self.replacement
        # at the job's start only a resume is an event, recorded once (by the group that logs)
        resumed_here = restored is not None and restored["source"] == "resume" and logging
        if self.shard != 0 or (at_start and not resumed_here):
            return
        now = time.time()
        detected = self.attempt_info["start"] if at_start else self._failure_seen()
        before = self.before.get("step") or 0  # the group's last commit before it failed (none at the start)
        if restored is not None:  # nobody ahead of step 0: the holders' snapshot, a storage checkpoint or resume_from
            event = self.restored_event(restored, before, at_start)
        elif heal is None or heal["step"] == 0:
            event = {"source": "fresh", "step": 0, "steps_lost": before,
                     "why": "no live sharding group ahead of this one and no storage checkpoint written yet: "
                            "training starts again from step 0"}
        else:
            event = {"source": "peer", "step": heal["step"], "from_replica": heal["from"], "steps_lost": 0,
                     "digest": heal["digest"], "source_digest": heal["source_digest"],
                     "bit_identical": heal["digest"] == heal["source_digest"], "restore_s": heal["load_s"],
                     "why": f"sharding group {self.group} rebuilt; healed from live group {heal['from']} over "
                            f"torchft's PGTransport (no storage read; the other groups kept training)",
                     "detail": f"group {self.group} from group {heal['from']}"}
        if at_start:
            event["at_start"] = True
        else:
            event.update(self._survivors(detected, now))
        event.update(attempt=self.attempt, sharding_group=self.group, pid=os.getpid(),
                     failure_step=self.before.get("step"), t_failure_detected=detected,
                     t_attempt_start=self.attempt_info["start"],
                     t_heal=restored["at"] if restored is not None else heal["at"] if heal else None,
                     t_first_step=now, seconds=now - detected,
                     num_groups=live, world_size=(live or 1) * self.job.grid.group_size)
        ray.get(self.coordinator.record.remote(event))

    @staticmethod
    def restored_event(restored: dict[str, Any], before: int, at_start: bool) -> dict[str, Any]:
        """The event of a group that found nobody ahead of step 0 and loaded `restored`
        (`StorageFallback.restore`); `before`: its last committed step before it failed."""
        source, step = restored["source"], restored["step"]
        lost = before if source == "resume" else max(0, before - step)  # the group's commits trained again
        why = {"holder": f": the in-memory snapshot of step {step} restored from the hosts' holders, bit for bit, "
                         f"every group's data cursor set back there ({lost} steps trained again)",
               "storage": f": the storage checkpoint of step {step} restored, every group's data cursor set back "
                          f"there ({lost} steps trained again)",
               "resume": f" and no storage checkpoint of this job: resumed from train.resume_from, the checkpoint "
                         f"of step {step}"}[source]
        event = {"source": source, "step": step, "restore_s": restored["load_s"], "steps_lost": lost,
                 "detail": restored["path"] or restored["detail"],
                 "why": (f"resuming from the checkpoint {restored['path']} (step {step}; train.resume_from)"
                         if at_start else f"no live sharding group ahead of step 0{why}")}
        if source == "holder":
            event.update(shards=restored["shards"], snapshot_interval_steps=restored.get("snapshot_interval_steps"),
                         bit_identical=all(x["digest"] == x["source_digest"] for x in restored["shards"]))
        return event

    def _failure_seen(self) -> float:
        """When this group's failure was first seen: by this worker (a group-mate rebuilt in place: when
        its step failed) or by Ray Train's controller, as it started a replacement for one of the
        group's workers (that attempt's `failure_time`), whichever came first after the group's last
        commit."""
        import ray

        seen = [self.attempt_info.get("failure_time") or self.attempt_info["start"]]
        last_commit = self.before.get("at", 0.0)
        grid = self.job.grid
        ranks = set(grid.sharding_groups[self.group])
        for a in ray.get(self.control.status.remote())["attempts"]:
            if (a.get("failure_time") or 0.0) > last_commit and ranks & {int(r) for r in a["workers"]}:
                seen.append(a["failure_time"])
        return min(seen)

    def _survivors(self, since: float, now: float) -> dict[str, Any]:
        """The groups that kept training while this one was rebuilt (`since` the failure was seen,
        to `now`), their QPS meanwhile and in as long a span before (from the commits their shard
        rank 0 noted, `JobControl.group_progress`)."""
        import ray

        groups = ray.get(self.control.group_status.remote())
        others = {g: p for g, p in groups.items() if g != self.group}
        kept = sorted(g for g, p in others.items() if p.get("at", 0) > since)
        out: dict[str, Any] = {"kept_training": kept}
        if not kept:
            return out
        history = others[kept[0]]["history"]  # every live group commits the same rounds
        rows_per_step = self.job.loop.batch_size * self.job.grid.group_size * len(kept)

        def commits(t0: float, t1: float) -> list[tuple[float, int]]:
            return [(t, step) for t, step in history if t0 <= t <= t1]

        span = max(now - since, 1e-9)
        during = commits(since, now)
        steps = during[-1][1] - during[0][1] if len(during) > 1 else 0
        # before: over the commits of as long a span before the failure (not the start-up before the first one)
        before = commits(since - span, since)
        qps_before = ((before[-1][1] - before[0][1]) * rows_per_step / (before[-1][0] - before[0][0])
                      if len(before) > 1 and before[-1][0] > before[0][0] else 0.0)
        out.update(survivors_steps=steps, survivors_qps=steps * rows_per_step / span, survivors_qps_before=qps_before)
        return out

    def log_new(self, report: Any, step: int) -> None:
        """The logger's part (`report`: its `train.report.Reporter`): the events rebuilt groups recorded, each logged once. Each at the
        step and time job control fixed for it (`JobControl.event_slot`), and marked logged only after
        the write: a logger killed in between (a kill aimed at the logging worker lands at a logging
        step) leaves the event to the next logger, whose identical write MLflow stores once."""
        import ray

        events = ray.get(self.coordinator.status.remote())["events"]
        for i, event in enumerate(events):
            if i in self.logged or "seconds" not in event:
                continue
            self.logged.add(i)
            slot = ray.get(self.control.event_slot.remote(i, step))
            if slot is None:  # another logger wrote it
                continue
            report.log_event(i + 1, event, *slot)
            ray.get(self.control.event_logged.remote(i))
            since = "the group started" if event.get("at_start") else "the failure was seen"
            report.say(f"recovery {i + 1}: {event.get('why', '')}; first step {event['seconds']:.1f} s after "
                            f"{since}")
