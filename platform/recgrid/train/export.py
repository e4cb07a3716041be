"""The job's metrics as Ray metrics, for Prometheus and Grafana: one table declares them all.

This module owns what recgrid exports through Ray's metrics system: `METRICS` declares every
exported metric once (its Ray name, description, tag keys, and the MLflow key whose value it
carries), and `RayMetricsExporter` is what a training worker calls at each logging interval
with the same flat dict it logs to MLflow (`train/qps`, `time/lookup_s`, `sync/bytes_total`, ...,
see `recgrid.train.metrics`). There is no second metrics server: Ray serves these on every
node's metrics endpoint, next to its own Train metrics, with a `ray_` prefix
(`recgrid_train_qps` is scraped as `ray_recgrid_train_qps`). `dashboards/recgrid.json` queries
only names that `exported_names()` returns; tests/test_dashboard.py checks both ends.

Every metric is a gauge: each value arrives already reduced over the workers, or already
cumulative (`sync/seconds_total`) and restored with the trainer's state after a restart, so the
exported value is the trainer's value rather than a per-process tally that would start again at
zero with every new worker group.

Two scopes. Job metrics are the same on every worker after the reduce, so one worker (rank 0)
exports them, tagged `run_id` and `run_name`. Worker metrics differ per worker (its own peak
memory, its own replica-sync seconds and bytes) and every worker exports them, tagged also
`rank` and `node` (the host name; a pod's name on Kubernetes). Ray adds `NodeAddress`,
`WorkerId`, `SessionName` and a few more to every series.

Units follow Prometheus: seconds and bytes (`memory/peak_mb_*` MiB become bytes).
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import socket
from dataclasses import dataclass
from typing import Any, Literal, Mapping

logger = logging.getLogger(__name__)

RAY_PREFIX = "ray_"
"""What Ray puts before a user metric's name on the metrics endpoint."""
JOB_TAGS: tuple[str, ...] = ("run_id", "run_name")
WORKER_TAGS: tuple[str, ...] = JOB_TAGS + ("rank", "node")
MIB = float(2**20)


@dataclass(frozen=True)
class MetricDef:
    """One exported metric.

    `key` is the MLflow key whose value the metric carries. A `{phase}` in it matches any phase
    name and becomes the metric's `phase` tag (`time/{phase}_s` takes `time/lookup_s` to
    `recgrid_phase_seconds{phase="lookup"}`); a key declared without a placeholder wins over a
    pattern (`time/interval_s` is not a phase).
    """

    key: str
    name: str
    description: str
    scope: Literal["job", "worker"] = "job"
    scale: float = 1.0

    @property
    def exported_name(self) -> str:
        """The name on a node's metrics endpoint, what PromQL queries."""
        return RAY_PREFIX + self.name

    @property
    def tag_keys(self) -> tuple[str, ...]:
        base = WORKER_TAGS if self.scope == "worker" else JOB_TAGS
        return base + tuple(re.findall(r"\{(\w+)\}", self.key))


def _d(key: str, name: str, description: str, scope: Literal["job", "worker"] = "job", scale: float = 1.0) -> MetricDef:
    return MetricDef(key, "recgrid_" + name, description, scope, scale)


METRICS: tuple[MetricDef, ...] = (
    # progress and throughput
    _d("step", "train_step", "Training steps taken (the step of the last logging interval)."),
    _d("train/qps", "train_qps", "Training examples per second, all workers together, over the last logging interval."),
    _d("train/step_time_s", "train_step_seconds", "Wall seconds per training step in the last logging interval (slowest worker)."),
    _d("train/examples_total", "train_examples", "Training examples processed so far by all workers."),
    _d("time/interval_s", "interval_seconds", "Wall seconds of the last logging interval (slowest worker)."),
    _d("time/{phase}_s", "phase_seconds",
       "Seconds a worker spent in a phase (recgrid.train.metrics.PHASES: lookup, lookup_kernel, dense, sync, data_wait, snapshot, "
       "checkpoint) during the last logging interval, mean over workers."),
    _d("time/{phase}_s_max", "phase_seconds_max", "Seconds in a phase during the last logging interval, max over workers."),
    _d("imbalance/lookup_max_over_mean", "lookup_imbalance",
       "Lookup imbalance: max / mean over workers of embedding-lookup kernel seconds in the last logging interval (1 = balanced)."),
    # model quality
    _d("train/loss", "train_loss", "Mean training loss per example over the last logging interval."),
    _d("train/ne", "train_ne", "Normalized entropy over the recent training window (< 1 beats predicting the base rate)."),
    _d("eval/ne", "eval_ne", "Normalized entropy over the last evaluation's rows."),
    _d("eval/auc", "eval_auc", "ROC AUC over the last evaluation's rows."),
    # memory
    _d("memory/peak_mb_max", "memory_peak_bytes_max", "Peak memory of a worker in bytes, max over workers (CUDA allocated on GPU, RSS on CPU).", scale=MIB),
    _d("memory/peak_mb_mean", "memory_peak_bytes_mean", "Peak memory of a worker in bytes, mean over workers.", scale=MIB),
    _d("memory/peak_mb", "worker_memory_peak_bytes", "This worker's peak memory in bytes (CUDA allocated on GPU, RSS on CPU).", "worker", MIB),
    # replica-group sync, as this worker saw it
    _d("sync/count", "sync_count", "Replica-group syncs so far (0 when M = 1).", "worker"),
    _d("sync/seconds_total", "sync_seconds", "Seconds this worker spent in replica-group syncs so far.", "worker"),
    _d("sync/bytes_total", "sync_bytes", "Bytes this worker put into replica-group all-reduces so far (embedding weights + optimizer states).", "worker"),
    _d("sync/seconds_last", "sync_last_seconds", "Seconds of this worker's last replica-group sync.", "worker"),
    _d("sync/bytes_last", "sync_last_bytes", "Bytes of this worker's last replica-group sync.", "worker"),
    # the grid and recovery
    _d("grid/num_groups", "grid_num_groups", "M: sharding groups training now (changes when the job shrinks or grows)."),
    _d("grid/world_size", "grid_world_size", "T: workers training now."),
    _d("recovery/count", "recovery_count", "Recoveries (restarts with restored state) so far in this job."),
    _d("recovery/seconds", "recovery_seconds", "Seconds the last recovery took, from the failure detected to the first step after it."),
    _d("recovery/steps_lost", "recovery_steps_lost", "Training steps the last recovery lost (redone after the restore)."),
)


def exported_names() -> set[str]:
    """Every metric name this module exports, as it appears on a node's metrics endpoint."""
    return {m.exported_name for m in METRICS}


def metric_by_exported_name() -> dict[str, MetricDef]:
    return {m.exported_name: m for m in METRICS}


def _pattern(key: str) -> re.Pattern[str]:
    parts = re.split(r"\{(\w+)\}", key)
    regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>[A-Za-z0-9_]+?)" for i, p in enumerate(parts))
    return re.compile(f"^{regex}$")


_EXACT: dict[str, MetricDef] = {m.key: m for m in METRICS if "{" not in m.key}
_PATTERNS: tuple[tuple[re.Pattern[str], MetricDef], ...] = tuple((_pattern(m.key), m) for m in METRICS if "{" in m.key)


def resolve(key: str) -> tuple[MetricDef, dict[str, str]] | None:
    """The metric a flat-dict key feeds and the tags its key fills in, or None if not exported."""
    if key in _EXACT:
        return _EXACT[key], {}
    for pattern, metric in _PATTERNS:
        match = pattern.match(key)
        if match:
            return metric, match.groupdict()
    return None


# one Ray gauge per name per process: Ray metrics are process-wide, and exporters come and go
_GAUGES: dict[str, Any] = {}


def _gauge(metric: MetricDef) -> Any:
    gauge = _GAUGES.get(metric.name)
    if gauge is None:
        from ray.util.metrics import Gauge

        gauge = _GAUGES[metric.name] = Gauge(metric.name, metric.description, tag_keys=metric.tag_keys)
    return gauge


class RayMetricsExporter:
    """Sets the Ray metrics of one worker from the flat metric dicts the trainer logs.

    `export(values, step)` is cheap (a dict look-up and a gauge set per known key; unknown keys,
    None and non-finite values are skipped), does nothing while Ray is not initialised in this
    process, and never raises: the first failure is logged with its traceback, later ones are
    counted silently (`failures`), and training carries on.

    `run_id` names the job's series (the MLflow run id); `run_name` is what dashboards show
    (e.g. "T16-M2-K5"). Job metrics go out from the worker with `job_metrics` true (default:
    rank 0); worker metrics from every worker.
    """

    def __init__(self, run_id: str, rank: int, *, run_name: str | None = None, node: str | None = None,
                 job_metrics: bool | None = None) -> None:
        self.rank = int(rank)
        self.job_metrics = self.rank == 0 if job_metrics is None else bool(job_metrics)
        self._tags = {"run_id": str(run_id), "run_name": str(run_name or run_id)}
        self._worker_tags = {**self._tags, "rank": str(self.rank), "node": node or socket.gethostname()}
        self._resolved: dict[str, tuple[MetricDef, dict[str, str]] | None] = {}
        self.failures = 0

    def export(self, values: Mapping[str, float], step: int) -> None:
        """Set every exported metric found in `values` (and the step). Never raises."""
        try:
            if not _ray_initialized():
                return
            self._set("step", step)
            for key, value in values.items():
                self._set(key, value)
        except Exception:  # metrics must never stop training
            self.failures += 1
            if self.failures == 1:
                logger.warning("recgrid: exporting metrics to Ray failed; training goes on, metrics may be missing",
                               exc_info=True)

    def _set(self, key: str, value: Any) -> None:
        if key not in self._resolved:
            self._resolved[key] = resolve(key)
        found = self._resolved[key]
        if found is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
            return
        metric, key_tags = found
        if metric.scope == "job" and not self.job_metrics:
            return
        value = float(value) * metric.scale
        if not math.isfinite(value):
            return
        tags = self._worker_tags if metric.scope == "worker" else self._tags
        _gauge(metric).set(value, tags={**tags, **key_tags} if key_tags else tags)


def _ray_initialized() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()
