"""The job's metric names, and the metrics as Ray metrics, for Prometheus and Grafana.

This module owns the one table of metrics (`TABLE`: every MLflow key recgrid logs, its unit, its
meaning, who logs it and, for the exported ones, its Ray gauge), from which docs/reference.md's
metrics section (`reference_table`) and the Prometheus definitions (`METRICS`: Ray name,
description, tag keys, and the MLflow key whose value each carries) are generated.
`RayMetricsExporter` is what a training worker calls at each logging interval
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


@dataclass(frozen=True)
class Metric:
    """One row of the metrics table: an MLflow key (`<phase>`, `<kind>`, `<n>`: any phase, exchange
    kind or recovery number), its unit, what it means, who logs it, and, for a metric Ray exports,
    its Prometheus gauge (`exported`, after `recgrid_`), description, scope and scale."""

    key: str
    unit: str
    meaning: str
    logged_by: str
    tag: bool = False  # an MLflow tag of the run, not a metric
    exported: str | None = None
    description: str = ""
    scope: Literal["job", "worker"] = "job"
    scale: float = 1.0


INTERVAL = "trainer, every logging interval"
EVAL = "trainer, every evaluation"
RECOVERY = "logging worker, at a recovery's first committed step"

TABLE: tuple[Metric, ...] = (
    Metric("step", "steps", "training steps taken (the step of the last logging interval)", "Ray metrics only",
           exported="train_step", description="Training steps taken (the step of the last logging interval)."),
    Metric("train/loss", "nats", "mean training loss per example over the logging interval (the loss the workers passed "
           "to `TrainMetrics.update`, row-weighted; log loss in nats of the predictions if none was passed)", INTERVAL,
           exported="train_loss", description="Mean training loss per example over the last logging interval."),
    Metric("train/ne", "1", "normalized entropy over the last `window_steps` training steps of all workers: "
           "cross-entropy / entropy of the base rate (TorchRec's NE; < 1 means better than predicting the base rate)",
           INTERVAL, exported="train_ne",
           description="Normalized entropy over the recent training window (< 1 beats predicting the base rate)."),
    Metric("train/accuracy", "1", "fraction of rows in the NE window where `prediction >= 0.5` matches the label", INTERVAL),
    Metric("train/positive_rate", "1", "fraction of positive labels in the NE window", INTERVAL),
    Metric("train/calibration", "1", "mean prediction / mean label in the NE window (1 = calibrated)", INTERVAL),
    Metric("train/qps", "examples/s", "training examples per second, globally: examples of all workers in the interval / "
           "the interval's wall seconds (slowest worker)", INTERVAL, exported="train_qps",
           description="Training examples per second, all workers together, over the last logging interval."),
    Metric("train/step_time_s", "s", "wall seconds per training step in the interval (slowest worker)", INTERVAL,
           exported="train_step_seconds",
           description="Wall seconds per training step in the last logging interval (slowest worker)."),
    Metric("train/qps_median", "examples/s", "the median of `train/qps` over the run's logging intervals (an interval "
           "holding an epoch's start-up or an evaluation does not skew it)", "driver, once at the end"),
    Metric("train/step_time_s_median", "s", "the median of `train/step_time_s` over the run's logging intervals",
           "driver, once at the end"),
    Metric("imbalance/lookup_max_over_mean_median", "1", "the median of `imbalance/lookup_max_over_mean` over the run's "
           "logging intervals", "driver, once at the end"),
    Metric("train/examples_total", "examples", "training examples processed so far by all workers", INTERVAL,
           exported="train_examples", description="Training examples processed so far by all workers."),
    Metric("time/interval_s", "s", "wall seconds of the logging interval (slowest worker)", INTERVAL,
           exported="interval_seconds", description="Wall seconds of the last logging interval (slowest worker)."),
    Metric("time/<phase>_s", "s", "seconds a worker spent in `<phase>` during the interval, mean over workers. Phases: "
           "`lookup` (the sparse arch's forward: id all-to-all, embedding lookup, pooled all-to-all inside the sharding "
           "group), `lookup_kernel` (this worker's fused-kernel lookups alone, inside `lookup`), `dense` (the rest of the "
           "step: interaction, MLPs, backward with the fused embedding update, dense optimizer), `sync` (replica-group "
           "sync of weights and optimizer states), `data_wait` (waiting for the next batch), `snapshot` (handing "
           "in-memory copies of the shards to the node's holder, at snapshot steps), `checkpoint` (writing a storage "
           "checkpoint). On GPU workers the phases are timed with CUDA events on the compute stream and read once per "
           "interval: `lookup`, `dense` and `sync` are device time (`dense` is the step's device time minus its "
           "`lookup`), `data_wait` is the host's wait for the next batch, which the training pipeline overlaps with "
           "device work", INTERVAL, exported="phase_seconds",
           description="Seconds a worker spent in a phase (recgrid.train.metrics.PHASES: lookup, lookup_kernel, dense, "
           "sync, data_wait, snapshot, checkpoint) during the last logging interval, mean over workers."),
    Metric("time/<phase>_s_max", "s", "the same, max over workers", INTERVAL, exported="phase_seconds_max",
           description="Seconds in a phase during the last logging interval, max over workers."),
    Metric("data/wait_s", "s", "seconds the trainer waited for its next batch from Ray Data during the interval (the "
           "`data_wait` phase), max over workers: every step waits for the slowest worker's input", INTERVAL),
    Metric("imbalance/lookup_max_over_mean", "1", "lookup imbalance ratio, as in the 2D paper: max / mean over workers "
           "of per-worker embedding-lookup seconds in the interval (the training loop feeds it `lookup_kernel`, the "
           "kernels' own time, free of all-to-all waits; 1 = balanced)", INTERVAL, exported="lookup_imbalance",
           description="Lookup imbalance: max / mean over workers of embedding-lookup kernel seconds in the last "
           "logging interval (1 = balanced)."),
    Metric("sync/count", "syncs", "replica syncs so far (0 when M = 1)", INTERVAL, exported="sync_count",
           description="Replica-group syncs so far (0 when M = 1).", scope="worker"),
    Metric("sync/seconds_total", "s", "seconds this worker spent in replica syncs so far", INTERVAL,
           exported="sync_seconds", description="Seconds this worker spent in replica-group syncs so far.",
           scope="worker"),
    Metric("sync/seconds_last", "s", "seconds this worker spent in the last replica sync", INTERVAL,
           exported="sync_last_seconds", description="Seconds of this worker's last replica-group sync.", scope="worker"),
    Metric("sync/bytes_total", "bytes", "bytes this worker put into the replica-group all-reduce (embedding weights + "
           "optimizer states of its shards) so far", INTERVAL, exported="sync_bytes",
           description="Bytes this worker put into replica-group all-reduces so far (embedding weights + optimizer "
           "states).", scope="worker"),
    Metric("sync/bytes_last", "bytes", "the same, in the last sync", INTERVAL, exported="sync_last_bytes",
           description="Bytes of this worker's last replica-group sync.", scope="worker"),
    Metric("exchange/world_size/<kind>", "workers", "world size of each all-to-all of the embedding exchange (the "
           "forward one that returns looked-up embeddings to the workers owning the samples; the id distribution before "
           "the lookup is not counted). Kinds: `flat` (TorchRec's pooled all-to-all over the sharding group, L workers; "
           "table-, column- and row-wise tables), `intra_tower` and `cross_tower` (DMT's SPTT: inside a tower, L / N "
           "workers; among the N towers' peers)", INTERVAL),
    Metric("exchange/bytes/<kind>", "bytes", "bytes a worker sends to other workers per training step in that "
           "all-to-all (forward; backward sends as many back), mean over workers and steps of the interval", INTERVAL),
    Metric("exchange/bytes/row_wise", "bytes", "the part of the `flat` exchange that row-wise shards send: with "
           "`model.row_wise_exchange: dense` TorchRec's reduce-scatter (a partial sum for every bag of every peer, zeros "
           "included), with `sparse` SRP's all-to-all (only the partial sums of bags that have ids on the shard: "
           "`engine.srp`); absent when no table is row-wise (table-row-wise shards are not counted)", INTERVAL),
    Metric("exchange/world_size/row_wise", "workers", "the world size of that part", INTERVAL),
    Metric("exchange/bytes/cross_host", "bytes", "the same summed over the exchange's all-to-alls, sent to a receiver "
           "on another host (hosts as the grid's `workers_per_node` places them)", INTERVAL),
    Metric("exchange/bytes/intra_host", "bytes", "the same, sent to a receiver on this worker's host", INTERVAL),
    Metric("exchange/world_size/cross_host", "workers", "the largest world size of an all-to-all that sends bytes "
           "across hosts: L (T when M = 1) for the flat exchange, N (the towers) for SPTT", INTERVAL),
    Metric("memory/peak_mb_max", "MiB", "peak memory of a worker in MiB, max over workers: "
           "`torch.cuda.max_memory_allocated` on GPU workers, peak resident set size of the worker process on CPU "
           "workers", INTERVAL, exported="memory_peak_bytes_max",
           description="Peak memory of a worker in bytes, max over workers (CUDA allocated on GPU, RSS on CPU).",
           scale=MIB),
    Metric("memory/peak_mb_mean", "MiB", "the same, mean over workers", INTERVAL, exported="memory_peak_bytes_mean",
           description="Peak memory of a worker in bytes, mean over workers.", scale=MIB),
    Metric("memory/peak_mb", "MiB", "this worker's own peak memory", "every worker, Ray metrics only",
           exported="worker_memory_peak_bytes",
           description="This worker's peak memory in bytes (CUDA allocated on GPU, RSS on CPU).", scope="worker",
           scale=MIB),
    Metric("memory/embedding_bytes", "bytes", "bytes of the embedding tables' weights of ONE model copy (every table, "
           "at the table data type; the job holds M copies): with `model.compression: qr` the compressed tables "
           "(quotient, remainder and head tables), so the uncompressed figure over this one is the memory reduction",
           "driver, once at step 0"),
    Metric("eval/ne", "1", "normalized entropy over all eval rows of all workers", EVAL, exported="eval_ne",
           description="Normalized entropy over the last evaluation's rows."),
    Metric("eval/auc", "1", "ROC AUC over all eval rows of all workers, from a 2^18-bin histogram of predicted "
           "probabilities (`train.metrics`)", EVAL, exported="eval_auc",
           description="ROC AUC over the last evaluation's rows."),
    Metric("eval/auc_max_error", "1", "upper bound on `|eval/auc - exact AUC|` due to binning (half the share of "
           "positive/negative pairs that fall in one bin)", EVAL),
    Metric("eval/logloss", "nats", "mean log loss per eval row, in nats (TorchRec's `compute_logloss` is in bits: "
           "divide by ln 2)", EVAL),
    Metric("eval/accuracy", "1", "fraction of eval rows where `prediction >= 0.5` matches the label", EVAL),
    Metric("eval/positive_rate", "1", "fraction of positive eval labels", EVAL),
    Metric("eval/calibration", "1", "mean prediction / mean label over the eval rows", EVAL),
    Metric("eval/examples", "rows", "eval rows of all workers (sum of weights when weights are given)", EVAL),
    Metric("grid/num_groups", "groups", "M: the live sharding groups from this step on (M over time)",
           "logging worker, whenever the live count changes", exported="grid_num_groups",
           description="M: sharding groups training now (changes when the job shrinks or grows)."),
    Metric("grid/world_size", "workers", "T: the live groups' workers from this step on",
           "logging worker, whenever the live count changes", exported="grid_world_size",
           description="T: workers training now."),
    Metric("recovery/count", "recoveries", "recoveries so far (a rebuilt sharding group's heal or restore)", RECOVERY,
           exported="recovery_count", description="Recoveries (restarts with restored state) so far in this job."),
    Metric("recovery/seconds", "s", "seconds from the failure being detected to the rebuilt group's first committed "
           "step", RECOVERY, exported="recovery_seconds",
           description="Seconds the last recovery took, from the failure detected to the first step after it."),
    Metric("recovery/steps_lost", "steps", "the rebuilt group's committed steps that it trains again (0 after a heal "
           "from a live peer)", RECOVERY, exported="recovery_steps_lost",
           description="Training steps the last recovery lost (redone after the restore)."),
    Metric("recovery/source/<n>", "", "recovery n's source: `peer` (a live peer group's copy), `holder` (the hosts' "
           "in-memory snapshot), `storage`, `resume` (`train.resume_from`) or `fresh` (step 0)", RECOVERY, tag=True),
    Metric("recovery/why/<n>", "", "the sentence the log printed for recovery n", RECOVERY, tag=True),
    Metric("recovery/detail/<n>", "", "where recovery n's shards or checkpoint came from", RECOVERY, tag=True),
    Metric("recovery/survivors_qps", "examples/s", "the QPS of the sharding groups that kept training while the failed "
           "group was rebuilt", RECOVERY),
    Metric("recovery/survivors_qps_before", "examples/s", "their QPS over as long a span before the failure", RECOVERY),
    Metric("recovery/survivors_steps", "steps", "the steps they took meanwhile", RECOVERY),
    Metric("recovery/kept_training/<n>", "", "the sharding groups that kept training through recovery n", RECOVERY,
           tag=True),
)


def reference_table() -> str:
    """docs/reference.md's metrics table, as Markdown (the doc holds exactly this between its
    metrics-table markers; a test checks it)."""
    lines = ["| name | unit | meaning | logged by |", "|---|---|---|---|"]
    for m in TABLE:
        name = f"tag `{m.key}`" if m.tag else f"`{m.key}`"
        lines.append(f"| {name} | {m.unit} | {m.meaning} | {m.logged_by} |")
    return "\n".join(lines)


def _def(m: Metric) -> MetricDef:
    key = re.sub(r"<(\w+)>", r"{\1}", m.key)
    return MetricDef(key, "recgrid_" + str(m.exported), m.description, m.scope, m.scale)


# the Prometheus definitions: the table's exported rows
METRICS: tuple[MetricDef, ...] = tuple(_def(m) for m in TABLE if m.exported)


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
