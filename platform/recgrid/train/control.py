"""Job control: one actor per job, owned by the driver, that every attempt's workers report to.

`JobControl` keeps what the job's attempts share and what the driver, tests and benchmarks
watch, apart from recovery (`train.recovery.coordinator`: snapshot holders, the restore plan,
recovery events):
- the attempts: every worker's rank, pid and node per attempt (the driver records them in the
  run as `grid/ranks.json`; this actor never imports MLflow), and when the controller first saw
  the failure that led to it (`FailureClock`, a Ray Train callback in the controller);
- the stop flag: `request_stop()` ends the job at its next logging interval, as if at
  max_steps; `request_stop(interrupt=True)` (Ctrl-C, SIGTERM) at its next stop check, without
  the final evaluation; rank 0 reads it without waiting (`StopPoll`);
- the console: the lines the workers have for the user, which the driver prints (`say`,
  `console`);
- heartbeats: the newest step any attempt finished, throttled to one call per `HEARTBEAT_S`;
- MLflow de-duplication, restarts included: `mark_logged`, `claim_step` (yes once per series
  and step) and each recovery event's place in the run (`event_slot`, `event_logged`);
- with torchft, each sharding group's progress (`group_progress`: step and data cursor of its
  newest committed round), its cursors at the job's restore points (`pin`, `cursors_at`,
  `rewind_groups`) and the groups that left at a node drain (`group_leaves`).
Design: docs/design-notes.md, "Failures, restarts and elastic jobs".

Actors are created on first use (`LazyActor`), so importing this module needs no Ray.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

HEARTBEAT_S = 1.0  # the most often a worker tells the job its step
GROUP_HISTORY = 2000  # commits kept per sharding group (torchft): enough to cover a recovery's seconds
PINS_KEPT = 2  # restore points of each kind whose group cursors are kept: a job keeps 2 checkpoints, 2 snapshots
CURSORS_KEPT = 64  # each group's newest noted cursors: a restore point pinned up to this many sync steps late
# the stop codes the workers agree on (`Trainer.fit`, `FitHooks.stop_requested`): 0 trains on
STOP_FINISH = 1  # end at the next logging interval, as if max_steps were reached (final evaluation included)
STOP_NOW = 2  # an interrupt: end at the next stop check, no evaluation


class JobControlImpl:
    """The job's attempts, stop flag, heartbeats and logged-up-to mark (one actor)."""

    def __init__(self) -> None:
        self.attempts: list[dict[str, Any]] = []  # per attempt: start time, workers (rank -> pid, node, notes)
        self.failure_time: float | None = None  # when the controller first saw the current failure
        self.last_step = 0  # newest step any attempt finished (the logging worker's heartbeat)
        self.logged_upto = -1  # newest step whose metrics reached the run
        self.stop = 0  # a stop was asked for: STOP_FINISH (graceful) or STOP_NOW (an interrupt)
        self.final: dict[str, Any] | None = None  # where the job's workers ended: step, interrupted
        self.lines: list[str] = []  # the console: what the workers said, for the driver to print
        self.claimed: dict[str, set[int]] = {}  # series logged at restarts -> steps they have
        self.event_slots: dict[int, tuple[int, int]] = {}  # recovery event -> (step, time in ms) it is logged at
        self.events_logged: set[int] = set()  # recovery events whose metrics and tags reached the run
        self.groups: dict[int, dict[str, Any]] = {}  # torchft: sharding group -> its newest commit, and a history
        self.pins: dict[int, dict[int, dict[str, Any] | None]] = {}  # restore point step -> group -> cursor
        self.pin_kinds: dict[str, list[int]] = {}  # "snapshot" / "checkpoint" -> its restore points kept
        self.leaves: list[dict[str, Any]] = []  # torchft: each sharding group's leaving at a drain (group, step, at)
        self.joins = 0  # torchft: how many times a sharding group asked for its first quorum (`joining`)
        # torchft: the groups that asked for their first quorum and have not committed since -> their ask's number
        self.asking: dict[int, int] = {}
        # the actor serves 4 calls at once, and Ray serialises a return value after the method returned: the
        # attempts' and groups' records are changed, and handed out as copies, under this lock (a reply
        # serialised while a commit appended to a group's history reached a worker as msgpack it could not
        # read, and failed the job)
        self._lock = threading.RLock()

    def begin_attempt(self, world_size: int) -> int:
        with self._lock:
            self.attempts.append({"start": time.time(), "world_size": world_size, "workers": {},
                                  "failure_time": self.failure_time, "last_step_before": self.last_step})
            self.failure_time = None
            return len(self.attempts) - 1

    def register(self, attempt: int, rank: int, pid: int, node_id: str) -> None:
        """A worker of `attempt` started; once all have, `console` hands the attempts to the driver."""
        with self._lock:
            self.attempts[attempt]["workers"][rank] = {"pid": pid, "node": node_id}

    def note(self, attempt: int, rank: int, fields: dict[str, Any]) -> None:
        """Add `fields` to a registered worker's record (torchft replicas: ready, table checksums)."""
        with self._lock:
            self.attempts[attempt]["workers"][rank].update(fields)

    def failure_detected(self, when: float) -> None:
        if self.failure_time is None:
            self.failure_time = when

    def heartbeat(self, step: int) -> None:
        self.last_step = step

    def request_stop(self, interrupt: bool = False) -> None:
        """Ask the job to end at its next logging interval, as if it had reached max_steps; with
        `interrupt`, at its next stop check, without the final evaluation."""
        self.stop = max(self.stop, STOP_NOW if interrupt else STOP_FINISH)

    def stop_requested(self) -> int:
        """0, STOP_FINISH or STOP_NOW (`train.trainer`'s stop codes)."""
        return self.stop

    def finished(self, step: int, interrupted: bool) -> None:
        """The logging worker's last word: the step its attempt ended at."""
        self.final = {"step": step, "interrupted": interrupted}
        self.last_step = max(self.last_step, step)

    def say(self, line: str) -> None:
        """A line for the user's console (the driver prints it: `console`)."""
        self.lines.append(line)

    def console(self, since: int, complete: int = 0) -> tuple[list[str], int, int, list[dict[str, Any]] | None]:
        """The console lines from number `since` on, the newest step any attempt finished, how many
        attempts have all their workers registered, and, when that is more than `complete` (what
        the caller last saw), every attempt's record (for the run's grid/ranks.json)."""
        with self._lock:
            now = sum(len(a["workers"]) == a["world_size"] for a in self.attempts)
            return self.lines[since:], self.last_step, now, copy.deepcopy(self.attempts) if now > complete else None

    def claim_step(self, name: str, step: int) -> bool:
        """True the first time series `name` asks for `step`: a value logged once per step, restarts included."""
        claimed = self.claimed.setdefault(name, set())
        if step in claimed:
            return False
        claimed.add(step)
        return True

    def event_slot(self, index: int, step: int) -> tuple[int, int] | None:
        """Where recovery event `index` goes in the run: (step, time in ms), the same for every logger
        that asks until one says it is logged (`event_logged`), then None. The first asker's `step`,
        past every earlier event's (one event per step, so no metric has two values at a step)."""
        with self._lock:
            if index in self.events_logged:
                return None
            if index not in self.event_slots:
                after = max((s for s, _ in self.event_slots.values()), default=-1) + 1
                self.event_slots[index] = (max(step, after), int(time.time() * 1000))
            return self.event_slots[index]

    def event_logged(self, index: int) -> None:
        with self._lock:
            self.events_logged.add(index)

    def joining(self, group: int) -> int:
        """Sharding group `group` asks for its first quorum (it starts, is rebuilt or comes back):
        the live groups meet when they hear of it (`group_progress`'s answer). Returns the ask's
        number (how many asks so far)."""
        with self._lock:
            self.joins += 1
            self.asking[group] = self.joins
            return self.joins

    def group_progress(self, group: int, step: int, cursor: dict[str, Any], when: float) -> dict[int, int]:
        """Sharding group `group` committed the sync step `step`; its data cursor is `cursor`. The
        last GROUP_HISTORY notes' (time, step) are kept for the recovery's rates, the last
        CURSORS_KEPT (step, cursor) for a restore point named after its step was noted (`pin`), and
        every restore point's cursor is brought up to this note when the note is not past it.
        Returns the asks still open (`joining`): group -> its ask's number, for the groups that asked
        for their first quorum and have not committed since (a committed sync step means a group is
        in a quorum: its own ask closes here)."""
        with self._lock:
            g = self.groups.setdefault(group, {"history": [], "cursors": []})
            g.update(step=step, cursor=cursor, at=when)
            g["history"].append((when, step))
            del g["history"][:-GROUP_HISTORY]
            g["cursors"].append((step, cursor))
            del g["cursors"][:-CURSORS_KEPT]
            for at, cursors in self.pins.items():
                if step <= at:
                    cursors[group] = cursor
            self.asking.pop(group, None)
            return dict(self.asking)

    def pin(self, step: int, kind: str) -> None:
        """Step `step` is a restore point (`kind` "snapshot" or "checkpoint": an in-memory snapshot
        or a storage checkpoint of it was written): every sharding group's data cursor there is kept
        (its note at that step, or the last one before it: a group away then), the newest
        PINS_KEPT of each kind."""
        with self._lock:
            self.pins[step] = {g: next((c for s, c in reversed(p["cursors"]) if s <= step), None)
                               for g, p in self.groups.items()}
            self.pin_kinds.setdefault(kind, [])
            if step not in self.pin_kinds[kind]:
                self.pin_kinds[kind].append(step)
            del self.pin_kinds[kind][:-PINS_KEPT]
            kept = {s for steps in self.pin_kinds.values() for s in steps}
            for s in [s for s in self.pins if s not in kept]:
                del self.pins[s]

    def cursors_at(self, step: int) -> dict[int, dict[str, Any] | None]:
        """Every sharding group's data cursor at restore point `step` (None: the start of its parts,
        for a group that had not committed by then)."""
        with self._lock:
            pinned = self.pins.get(step, {})
            return {g: pinned.get(g) for g in self.groups}

    def rewind_groups(self, step: int) -> dict[int, dict[str, Any] | None]:
        """A sharding group restored restore point `step` (a snapshot or a storage checkpoint):
        every group goes back to its cursor there (`cursors_at`; a group rebuilt later reads on from
        it). Returns the cursors (the same to every group restoring it)."""
        with self._lock:
            cursors = self.cursors_at(step)
            for g, p in self.groups.items():
                if p.get("step", 0) > step:
                    p.update(step=step, cursor=cursors[g])
                p["cursors"] = [(s, c) for s, c in p["cursors"] if s <= step]
            for s in [s for s in self.pins if s > step]:
                del self.pins[s]
            for steps in self.pin_kinds.values():
                steps[:] = [s for s in steps if s <= step]
            return cursors

    def group_leaves(self, group: int, step: int, nodes: list[str], deadline_ms: int | None) -> list[int]:
        """Sharding group `group` leaves the job after its committed step `step`: its node is drained
        (`train.recovery.peers`, preemption). Returns the groups that have committed and not left, which train on
        (none: this group writes a storage checkpoint before it goes)."""
        with self._lock:
            now = time.time()
            self.leaves.append({"group": group, "step": step, "at": now, "nodes": nodes, "deadline_ms": deadline_ms})
            away = {x["group"] for x in self.leaves if x["at"] >= self.groups.get(x["group"], {}).get("at", 0.0)}
            return sorted(g for g in self.groups if g not in away)

    def over(self) -> bool:
        """Whether the job's training ended (`finished`): a sharding group's run that has not
        started (waiting for capacity) or has left has nothing more to do."""
        return self.final is not None

    def group_status(self, group: int | None = None) -> dict[Any, Any]:
        """Every sharding group's newest commit (or `group`'s: {} before its first)."""
        with self._lock:
            return copy.deepcopy(self.groups.get(group, {}) if group is not None else self.groups)

    def mark_logged(self, step: int) -> None:
        self.logged_upto = max(self.logged_upto, step)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"attempts": copy.deepcopy(self.attempts), "last_step": self.last_step,
                    "logged_upto": self.logged_upto, "failure_time": self.failure_time, "stop": self.stop,
                    "final": self.final, "leaves": copy.deepcopy(self.leaves)}


class LazyActor:
    """`ray.remote` applied to `cls` on first use, so importing a module that defines actors needs
    no Ray. Bookkeeping and memory copies: no CPU reserved, so they never wait behind training."""

    def __init__(self, cls: type, max_concurrency: int = 4) -> None:
        self.cls, self.actor, self.max_concurrency = cls, None, max_concurrency

    def options(self, **kw: Any) -> Any:
        return self._get().options(**kw)

    def remote(self, *a: Any, **kw: Any) -> Any:
        return self._get().remote(*a, **kw)

    def _get(self) -> Any:
        if self.actor is None:
            import ray

            self.actor = ray.remote(num_cpus=0, max_concurrency=self.max_concurrency)(self.cls)
        return self.actor


JobControl = LazyActor(JobControlImpl)


class FailureClock:
    """A Ray Train callback (runs in the controller) that tells job control when a worker failure
    was first seen (the start of `recovery/seconds`) and what failed, for the user's console (the
    whole traceback is in the worker's log and, when the job fails, printed by the driver)."""

    def __new__(cls, control: Any) -> Any:
        from ray.train import UserCallback

        class _Clock(UserCallback):
            def __init__(self, control: Any) -> None:
                self.control = control

            def after_exception(self, run_context: Any, worker_exceptions: dict) -> None:
                self.control.failure_detected.remote(time.time())
                for rank, error in sorted(worker_exceptions.items())[:3]:
                    self.control.say.remote(f"[recgrid] worker rank {rank} failed: {error_line(error)}")

        return _Clock(control)


class Heartbeat:
    """A worker's throttled heartbeat: `maybe_beat(step)` tells job control the step at most once
    per `every_s` seconds (`beat` always: a logging step, the end)."""

    def __init__(self, control: Any, every_s: float = HEARTBEAT_S) -> None:
        self.control, self.every_s = control, every_s
        self._last = 0.0

    def maybe_beat(self, step: int) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self.beat(step)

    def beat(self, step: int) -> None:
        self._last = time.monotonic()
        self.control.heartbeat.remote(step)


class StopPoll:
    """Rank 0's view of the job's stop flag without waiting on job control: each call returns the
    newest answer that has arrived and, once it has, asks again (`FitHooks.stop_requested`)."""

    def __init__(self, control: Any) -> None:
        self.control, self.value = control, 0
        self.pending = control.stop_requested.remote()

    def __call__(self, trainer: Any = None) -> int:
        import ray

        ready, _ = ray.wait([self.pending], timeout=0)
        if ready:
            self.value = ray.get(ready[0])
            self.pending = self.control.stop_requested.remote()
        return self.value


def error_line(error: BaseException) -> str:
    """An error's last line that names it ("ValueError: ..."), out of Ray's wrappers and tracebacks."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    named = [line for line in lines if ": " in line and line.split(":", 1)[0].replace(".", "").isidentifier()]
    return (named[-1] if named else lines[-1] if lines else type(error).__name__)[:300]
