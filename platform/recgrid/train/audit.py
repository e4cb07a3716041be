"""What a worker's step path calls outside the step itself, counted by step (`CallAudit`): the
calls of job control's and the recovery coordinator's Ray actors and of the MLflow tracker, for
the test that there are none between logging and sync steps. On only where the driver's
environment sets CALL_AUDIT_ENV (`WorkerJob.call_audit`); users' jobs never wrap anything."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

# set (to 1) in the driver's environment, every worker counts its actor and MLflow calls by step and
# notes the counts at its end (`final_calls`)
CALL_AUDIT_ENV = "RECGRID_CALL_AUDIT"


class CallAudit:
    """Counts of calls by kind ("ray", "mlflow") and by the trainer's step when each was made
    (`step_of`; -1 before the trainer exists)."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = {"ray": Counter(), "mlflow": Counter()}
        self.step_of: Callable[[], int] = lambda: -1

    def actor(self, handle: Any) -> Any:
        return _AuditedActor(handle, self)

    def tracker(self, tracker: Any) -> Any:
        return None if tracker is None else _AuditedTracker(tracker, self)

    def note(self, kind: str) -> None:
        self.counts[kind][self.step_of()] += 1

    def record(self) -> dict[str, dict[str, int]]:
        return {kind: {str(step): n for step, n in sorted(c.items())} for kind, c in self.counts.items()}


class _AuditedActor:
    """An actor handle whose `method.remote(...)` calls are counted, then made."""

    def __init__(self, handle: Any, audit: CallAudit) -> None:
        self._handle, self._audit = handle, audit

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)
        audit = self._audit

        class _Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                audit.note("ray")
                return method.remote(*args, **kwargs)

        return _Method()


class _AuditedTracker:
    """The MLflow tracker, each of its methods counted when called."""

    def __init__(self, tracker: Any, audit: CallAudit) -> None:
        self._tracker, self._audit = tracker, audit

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._tracker, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self._audit.note("mlflow")
            return value(*args, **kwargs)

        return call
