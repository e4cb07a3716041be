"""Training and evaluation metrics: per-worker states that are sums, reduced over all T workers.

This module owns what a worker measures (prediction sums, the AUC histogram, phase timers,
example counts, peak memory) and the one collective that turns every worker's measurements
into the job's numbers (`reduce_metrics`). Every state is a plain sum (or a maximum), as in
`torchrec.metrics.ne`, so the reduced value is the same for any group count M and any
uneven split of rows between workers: NE and AUC are computed from summed states, never
averaged from per-worker NE or AUC. NE follows `torchrec.metrics.ne` exactly (`ne_from_sums`:
predictions and the base rate clamped to `[eta, 1-eta]`, `eta = 1e-12`, cross-entropy in bits);
AUC is binned (its precision: `AUCHistogram`).

Metric names, units, meanings and who logs them: the one table, `recgrid.train.export.TABLE`
(docs/reference.md's metrics section is generated from it).

All workers must call `reduce_metrics` together with states of the same shape (same
phases, same `num_bins`, same choice of train/eval); a worker with no rows passes empty
states, which is fine.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from recgrid.engine.device import Stopwatch, collective_device, peak_memory_mb, pipelined, stopwatch, synchronizer

ETA = 1e-12  # torchrec.metrics.ne's clamp for predictions and the base rate
DEFAULT_NUM_BINS = 1 << 18
# The phases a training step's time is split into: the one list, which every worker times.
# "lookup_kernel" lies inside "lookup"; "snapshot" (in-memory recovery copies) and "checkpoint"
# (storage checkpoints) happen between steps, at sync steps.
PHASES: tuple[str, ...] = ("data_wait", "lookup", "lookup_kernel", "dense", "sync", "snapshot", "checkpoint")

# Layout of one block of prediction sums (float64): everything NE, log loss, accuracy,
# positive rate and calibration need, all additive.
_CE, _W, _POS, _NEG, _CORRECT, _PRED = range(6)
NUM_SUMS = 6


# ---- prediction sums --------------------------------------------------------------------------
def prediction_sums(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The additive sums of one batch: [cross-entropy (bits), weight, pos, neg, correct, pred].

    `predictions` are probabilities (apply `torch.sigmoid` to logits), `labels` in {0, 1}.
    Cross-entropy is `torchrec.metrics.ne.compute_cross_entropy`'s formula (in bits, predictions
    clamped to [ETA, 1-ETA]), written out: importing `torchrec.metrics` costs every worker about
    1 s of start-up (torchmetrics, matplotlib). `tests/test_metrics.py` checks it against TorchRec's.
    """
    p = predictions.detach().reshape(-1).double().clamp(ETA, 1.0 - ETA)
    y = labels.detach().reshape(-1).double()
    w = torch.ones_like(p) if weights is None else weights.detach().reshape(-1).double()
    ce = -w * y * torch.log2(p) - w * (1.0 - y) * torch.log2(1.0 - p)
    hit = (p >= 0.5).double()
    correct = w * (y * hit + (1.0 - y) * (1.0 - hit))
    return torch.stack([ce.sum(), w.sum(), (w * y).sum(), (w * (1.0 - y)).sum(), correct.sum(), (w * p).sum()])


def ne_from_sums(ce_sum: float, weight: float, pos: float, neg: float, eta: float = ETA) -> float:
    """Normalized entropy from summed states, the formula of `torchrec.metrics.ne.compute_ne`: the
    cross-entropy over that of always predicting the (clamped) base rate, in float64."""
    if weight <= 0:
        return math.nan
    base = min(max(pos / max(weight, eta), eta), 1.0 - eta)
    norm = -pos * math.log2(base) - neg * math.log2(1.0 - base)
    ne = ce_sum / norm if norm else math.inf
    return ne if math.isfinite(ne) else math.nan


def _describe(sums: Sequence[float], prefix: str) -> dict[str, float]:
    ce, w, pos, neg, correct, pred = (float(x) for x in sums)
    if w <= 0:  # no rows anywhere: report nothing rather than NaNs
        return {}
    return {
        f"{prefix}/ne": ne_from_sums(ce, w, pos, neg),
        f"{prefix}/logloss": ce * math.log(2.0) / w,
        f"{prefix}/accuracy": correct / w,
        f"{prefix}/positive_rate": pos / w,
        f"{prefix}/calibration": pred / pos if pos > 0 else math.nan,
    }


# ---- AUC --------------------------------------------------------------------------------------
def auc_from_histograms(pos: torch.Tensor, neg: torch.Tensor) -> tuple[float, float]:
    """(AUC, max binning error) from per-bin positive and negative counts, bins ascending.

    A negative in bin b is outranked by every positive in a higher bin and half-outranked by
    each positive in its own bin (torchmetrics' treatment of tied predictions).
    """
    pos, neg = pos.double().cpu(), neg.double().cpu()
    P, N = float(pos.sum()), float(neg.sum())
    if P <= 0 or N <= 0:
        return math.nan, math.nan
    pos_above = P - torch.cumsum(pos, 0)  # positives in strictly higher bins
    pairs = float((neg * (pos_above + 0.5 * pos)).sum())
    same_bin = float((pos * neg).sum())
    return pairs / (P * N), 0.5 * same_bin / (P * N)


class AUCHistogram:
    """Per-bin (weighted) positive and negative counts of predicted probabilities in [0, 1].

    Precision: `num_bins` equal bins (default 2^18, width 3.8e-6); AUC is the trapezoid over bins,
    which gives a positive/negative pair in one bin half credit, as torchmetrics' exact
    `binary_auroc` counts exact ties: predictions whose distinct values fall in distinct bins get
    torchmetrics' AUC to float64 rounding. Distinct predictions sharing a bin differ by at most
    `sum_b pos_b * neg_b / (2 P N)` (`eval/auc_max_error`; ~3e-6 for predictions over [0.02, 0.5],
    ~6e-5 when all sit in [0.01, 0.07]). Against torchmetrics on 100k-500k CTR-like rows the
    difference measured 1e-8 to 3e-7, mostly torchmetrics' own float32 arithmetic; tests assert
    1e-5. Costs 2 * num_bins float64 (4 MiB) per worker, all-reduced once per evaluation.
    """

    def __init__(self, num_bins: int = DEFAULT_NUM_BINS, device: torch.device | str = "cpu") -> None:
        self.num_bins = int(num_bins)
        self.counts = torch.zeros(2, self.num_bins, dtype=torch.float64, device=device)  # [neg, pos]

    def update(self, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        p = predictions.detach().reshape(-1).to(self.counts.device, torch.float64)
        y = labels.detach().reshape(-1).to(self.counts.device, torch.float64)
        w = torch.ones_like(p) if weights is None else weights.detach().reshape(-1).to(p.device, torch.float64)
        # float64 before scaling, so the bin edge is exact for every float32 prediction
        idx = (p * self.num_bins).floor().clamp_(0, self.num_bins - 1).long()
        self.counts[0].index_add_(0, idx, w * (1.0 - y))
        self.counts[1].index_add_(0, idx, w * y)

    def compute(self) -> tuple[float, float]:
        """(AUC, max binning error) of the rows seen by this histogram alone."""
        return auc_from_histograms(self.counts[1], self.counts[0])

    def reset(self) -> None:
        self.counts.zero_()


# ---- timing and memory ------------------------------------------------------------------------
class PhaseTimer:
    """Seconds spent in named phases since the last reset.

    `synchronize` (e.g. `torch.cuda.synchronize`) runs at each phase boundary so GPU work is
    charged to the phase that launched it rather than to whichever phase waits on it.
    """

    def __init__(self, phases: Sequence[str] = PHASES, synchronize: Callable[[], None] | None = None) -> None:
        self.phases = tuple(phases)
        self.synchronize = synchronize
        self.seconds: dict[str, float] = dict.fromkeys(self.phases, 0.0)
        self._open: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._check(name)
        if self.synchronize:
            self.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize:
                self.synchronize()
            self.seconds[name] += time.perf_counter() - start

    def start(self, name: str) -> None:
        """Open `name` (for forward hooks, where a `with` block cannot span pre-hook and hook)."""
        self._check(name)
        if self.synchronize:
            self.synchronize()
        self._open[name] = time.perf_counter()

    def stop(self, name: str) -> float:
        """Close `name`, charge it its seconds and return them."""
        if self.synchronize:
            self.synchronize()
        elapsed = time.perf_counter() - self._open.pop(name)
        self.seconds[name] += elapsed
        return elapsed

    def add(self, name: str, seconds: float) -> None:
        self._check(name)
        self.seconds[name] += float(seconds)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.phases, 0.0)

    def take(self) -> dict[str, float]:
        """The seconds so far, and reset."""
        out = self.seconds
        self.reset()
        return out

    def lap(self) -> "Lap":
        """The seconds since the last lap (or reset) as a `Lap`, and reset: per-step splits."""
        return Lap(self.take())

    def _check(self, name: str) -> None:
        if name not in self.phases:
            # every worker must time the same phases, or the reduce vectors would not line up
            raise ValueError(f"unknown phase {name!r}; phases of this timer: {list(self.phases)}")


class Lap:
    """One lap's phase seconds; `seconds()` reads them (a deferred timer's lap waits then)."""

    def __init__(self, seconds: dict[str, float] | None = None, spans: list | None = None,
                 timer: "DeferredPhaseTimer | None" = None) -> None:
        self._seconds, self._spans, self._timer = seconds, spans or [], timer

    def seconds(self) -> dict[str, float]:
        if self._timer is not None:
            self._seconds = self._timer._settle(self._seconds, self._spans)
            self._timer, self._spans = None, []
        return dict(self._seconds)


class DeferredPhaseTimer(PhaseTimer):
    """A phase timer whose spans are device stopwatches (`engine.device.stopwatch`: CUDA events
    on a GPU) read late: recording a phase never waits for the device; reading `seconds` (once
    per logging interval, in `reduce_metrics`) waits once, for the last span.

    `exclusive` names phases whose spans are charged net of inner phases recorded while they
    are open: with the default, "dense" spans the whole step (the training loop opens it before
    the step and closes it after the optimizer) and is charged the step minus its "lookup"
    spans, so lookup + dense is the step's device time. Host-measured seconds (`add`, e.g. the
    wait for data) are charged as they are.
    """

    def __init__(self, phases: Sequence[str] = PHASES, device: torch.device | str = "cpu",
                 exclusive: dict[str, Sequence[str]] | None = None) -> None:
        self.device = torch.device(device)
        exclusive = {"dense": ("lookup",)} if exclusive is None else exclusive
        self.exclusive = {outer: tuple(inner) for outer, inner in exclusive.items()}
        self._spans: list[tuple[str, Stopwatch, int]] = []  # (phase, watch, first span recorded inside it)
        self._opened: dict[str, tuple[Stopwatch, int]] = {}
        super().__init__(phases, synchronize=None)
        for outer, inner in self.exclusive.items():
            for name in (outer, *inner):
                self._check(name)

    @property
    def seconds(self) -> dict[str, float]:  # type: ignore[override]
        self._settled = self._settle(self._settled, self._spans)
        self._spans = []
        return self._settled

    @seconds.setter
    def seconds(self, value: dict[str, float]) -> None:
        self._settled = value

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def start(self, name: str) -> None:
        self._check(name)
        self._opened[name] = (stopwatch(self.device).start(), len(self._spans))

    def stop(self, name: str) -> float:
        """Close `name`; its seconds are read later (returns 0.0)."""
        watch, first = self._opened.pop(name)
        self._spans.append((name, watch.stop(), first))
        return 0.0

    def add(self, name: str, seconds: float) -> None:
        self._check(name)
        self._settled[name] += float(seconds)

    def reset(self) -> None:
        """Zero the seconds and forget the recorded spans (phases still open stay open)."""
        self._settled = dict.fromkeys(self.phases, 0.0)
        self._spans = []
        self._opened = {name: (watch, 0) for name, (watch, _) in self._opened.items()}

    def lap(self) -> Lap:
        """The spans and seconds since the last lap (or reset), to read later, and reset."""
        lap = Lap(self._settled, self._spans, self)
        self.reset()
        return lap

    def _settle(self, seconds: dict[str, float], spans: list[tuple[str, Stopwatch, int]]) -> dict[str, float]:
        """`seconds` plus what `spans` measured (waits for the device's last span)."""
        out = dict(seconds)
        measured = [watch.seconds for _, watch, _ in reversed(spans)][::-1]  # the last one waits, the rest are done
        for i, (name, _, first) in enumerate(spans):
            inner = self.exclusive.get(name, ())
            nested = sum(measured[j] for j in range(first, i) if spans[j][0] in inner)
            out[name] += max(0.0, measured[i] - nested)
        return out


# ---- per-worker state ---------------------------------------------------------------------------
class TrainMetrics:
    """One worker's training measurements: windowed prediction sums, the interval's loss,
    examples, wall time and phase seconds.

    Use in the loop: `with m.timer.phase("lookup"): ...`, `m.update(probs, labels, loss)` every
    step, and at each logging interval `reduce_metrics(group, train=m)` on every worker then
    `m.reset_interval()`. State stays on `device`, so updating never forces a GPU sync.

    `deferred` picks the timer: a `DeferredPhaseTimer` of device stopwatches read once per
    logging interval (the default where the training loop is pipelined, i.e. on CUDA), or a
    `PhaseTimer` on the host clock (CPU).

    `imbalance_phase` is the phase whose max over mean is `imbalance/lookup_max_over_mean`. The
    `lookup` phase includes the all-to-all, so a fast worker's wait for the slowest one is charged
    to its lookup time and pulls the ratio toward 1; for the raw per-worker kernel imbalance, time
    the local lookup as a phase of its own (`lookup_kernel`) and name it here.
    """

    def __init__(
        self,
        window_steps: int = 100,
        device: torch.device | str = "cpu",
        phases: Sequence[str] = PHASES,
        imbalance_phase: str = "lookup",
        deferred: bool | None = None,
    ) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        self.device = torch.device(device)
        self.window_steps = int(window_steps)
        if deferred if deferred is not None else pipelined(self.device):
            nets = {"dense": ("lookup",)} if {"dense", "lookup"} <= set(phases) else {}
            self.timer: PhaseTimer = DeferredPhaseTimer(phases, self.device, exclusive=nets)
        else:
            self.timer = PhaseTimer(phases, synchronize=synchronizer(self.device))
        if imbalance_phase not in self.timer.phases:
            raise ValueError(f"imbalance_phase {imbalance_phase!r} is not one of {list(self.timer.phases)}")
        self.imbalance_phase = imbalance_phase
        self._window = torch.zeros(self.window_steps, NUM_SUMS, dtype=torch.float64, device=self.device)
        self.steps = 0
        self.examples_total = 0
        self.reset_interval()

    def reset_interval(self) -> None:
        """Start a new logging interval: loss, examples, wall clock and phase seconds restart."""
        self._interval = torch.zeros(NUM_SUMS + 2, dtype=torch.float64, device=self.device)  # + loss sum, loss rows
        self.interval_steps = 0
        self.interval_examples = 0
        self.interval_start = time.perf_counter()
        self.timer.reset()

    def update(
        self,
        predictions: torch.Tensor,
        labels: torch.Tensor,
        loss: torch.Tensor | float | None = None,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Record one step: `predictions` are probabilities, `loss` the batch's mean loss."""
        sums = prediction_sums(predictions.to(self.device), labels.to(self.device),
                               None if weights is None else weights.to(self.device))
        self._window[self.steps % self.window_steps] = sums  # ring buffer: the last N steps
        self._interval[:NUM_SUMS] += sums
        rows = labels.numel()
        if loss is not None:
            loss_t = loss.detach().to(self.device, torch.float64) if torch.is_tensor(loss) else float(loss)
            self._interval[NUM_SUMS] += loss_t * rows
            self._interval[NUM_SUMS + 1] += rows
        self.steps += 1
        self.interval_steps += 1
        self.interval_examples += rows
        self.examples_total += rows

    def window_sums(self) -> torch.Tensor:
        """Prediction sums of this worker's last `window_steps` steps."""
        return self._window.sum(0)

    def window_state(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The NE window summed over every worker of `group` (collective; what a restore needs:
        NE is computed from these sums, so whichever worker holds them after a restore, the
        reduced window is the same)."""
        window = self._window.clone()
        if dist.is_available() and dist.is_initialized():
            window = window.to(collective_device(group, self.device))
            dist.all_reduce(window, group=group)
        return window.cpu()

    def own_window(self) -> torch.Tensor:
        """A CPU copy of this worker's NE window (the sum of every worker's is `window_state`)."""
        return self._window.detach().to("cpu", copy=True)

    def load_window_state(self, window: torch.Tensor | None, steps: int, keep: bool) -> None:
        """Restore the window reduced by `window_state` onto this worker if `keep` (one worker
        of the group), zeros elsewhere; `steps` is the training step it was taken at."""
        if window is None or window.shape != self._window.shape:  # none, or another length: a fresh window
            window, keep = self._window, False
        self._window = window.to(self.device, torch.float64) if keep else torch.zeros_like(self._window)
        self.steps = steps


class EvalMetrics:
    """One worker's evaluation measurements: prediction sums and the AUC histogram."""

    def __init__(self, num_bins: int = DEFAULT_NUM_BINS, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.auc = AUCHistogram(num_bins, self.device)
        self.sums = torch.zeros(NUM_SUMS, dtype=torch.float64, device=self.device)

    def update(self, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        predictions, labels = predictions.to(self.device), labels.to(self.device)
        weights = None if weights is None else weights.to(self.device)
        self.sums += prediction_sums(predictions, labels, weights)
        self.auc.update(predictions, labels, weights)

    def reset(self) -> None:
        self.sums.zero_()
        self.auc.reset()


# ---- the reduction ------------------------------------------------------------------------------
def reduce_metrics(
    group: dist.ProcessGroup | None = None,
    *,
    train: TrainMetrics | None = None,
    evaluation: EvalMetrics | None = None,
    reducer: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> dict[str, float]:
    """Reduce every worker's states over `group` (the global group of all T workers) and return
    the metrics as a flat `{name: value}` dict, the same on every worker.

    A collective: every worker of `group` calls it with the same kinds of state. Two
    all_reduce calls (one SUM, one MAX), issued together. Without an initialised process
    group it reduces this process's states alone. `reducer(sums, maxes)`, if given, reduces the
    two flat float64 vectors in place instead of `group` (torchft's manager: `train.recovery.peers`). Does
    not reset anything.
    """
    if train is None and evaluation is None:
        raise ValueError("reduce_metrics needs train and/or evaluation states")
    device = (train or evaluation).device  # type: ignore[union-attr]
    now = time.perf_counter()
    f64 = dict(dtype=torch.float64, device=device)

    peak = peak_memory_mb(device)
    sums: dict[str, torch.Tensor] = {"workers": torch.ones(1, **f64), "peak_mb": torch.tensor([peak], **f64)}
    maxes: dict[str, torch.Tensor] = {"peak_mb": torch.tensor([peak], **f64)}
    if train is not None:
        phase_s = torch.tensor([train.timer.seconds[p] for p in train.timer.phases], **f64)
        sums.update(window=train.window_sums(), interval=train._interval, phases=phase_s,
                    examples=torch.tensor([train.interval_examples, train.examples_total], **f64))
        maxes.update(phases=phase_s, wall_steps=torch.tensor([now - train.interval_start, train.interval_steps], **f64))
    if evaluation is not None:
        sums.update(eval=evaluation.sums, auc=evaluation.auc.counts.reshape(-1))
    s, mx = _all_reduce_named(sums, maxes, group, reducer)

    out: dict[str, float] = {
        "memory/peak_mb_max": float(mx["peak_mb"][0]),
        "memory/peak_mb_mean": float(s["peak_mb"][0] / s["workers"][0]),
    }
    if train is not None:
        workers = float(s["workers"][0])
        interval, (examples, examples_total), (wall, steps) = s["interval"], s["examples"].tolist(), mx["wall_steps"].tolist()
        win = _describe(s["window"], "train")
        loss_sum, loss_rows = float(interval[NUM_SUMS]), float(interval[NUM_SUMS + 1])
        if loss_rows > 0:
            out["train/loss"] = loss_sum / loss_rows
        elif float(interval[_W]) > 0:
            out["train/loss"] = float(interval[_CE]) * math.log(2.0) / float(interval[_W])
        for k in ("ne", "accuracy", "positive_rate", "calibration"):
            if f"train/{k}" in win:
                out[f"train/{k}"] = win[f"train/{k}"]
        out["train/qps"] = examples / wall if wall > 0 else 0.0
        if steps > 0:
            out["train/step_time_s"] = wall / steps
        out["train/examples_total"] = examples_total
        out["time/interval_s"] = wall
        for k, name in enumerate(train.timer.phases):
            out[f"time/{name}_s"] = float(s["phases"][k]) / workers
            out[f"time/{name}_s_max"] = float(mx["phases"][k])
        if "data_wait" in train.timer.phases:  # the job steps in lockstep: the slowest input sets the pace
            out["data/wait_s"] = out["time/data_wait_s_max"]
        mean_lookup = out[f"time/{train.imbalance_phase}_s"]
        if mean_lookup > 0:  # one name whichever phase measures it, so runs stay comparable
            out["imbalance/lookup_max_over_mean"] = out[f"time/{train.imbalance_phase}_s_max"] / mean_lookup
    if evaluation is not None:
        nb = evaluation.auc.num_bins
        hist = s["auc"].reshape(2, nb)
        out.update(_describe(s["eval"], "eval"))
        out["eval/examples"] = float(s["eval"][_W])
        auc, err = auc_from_histograms(hist[1], hist[0])
        if not math.isnan(auc):
            out["eval/auc"] = auc
            out["eval/auc_max_error"] = err
    return out


def _all_reduce_named(sums: dict[str, torch.Tensor], maxes: dict[str, torch.Tensor], group: dist.ProcessGroup | None,
                      reducer: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """SUM-reduce `sums` and MAX-reduce `maxes` over `group`, each as one flat float64 vector
    (two collectives issued together), and hand the parts back by name, on CPU. Every worker
    passes the same names with the same sizes. Without a process group: this worker's values."""
    flat = {}
    for name, parts in (("sum", sums), ("max", maxes)):
        flat[name] = torch.cat([v.reshape(-1).double() for v in parts.values()])
    if reducer is not None:
        reducer(flat["sum"], flat["max"])
    elif dist.is_available() and dist.is_initialized():
        device = collective_device(group, flat["sum"].device)
        flat = {k: v.to(device) for k, v in flat.items()}
        works = [dist.all_reduce(flat["sum"], op=dist.ReduceOp.SUM, group=group, async_op=True),
                 dist.all_reduce(flat["max"], op=dist.ReduceOp.MAX, group=group, async_op=True)]
        for w in works:
            w.wait()
    out = []
    for name, parts in (("sum", sums), ("max", maxes)):
        pieces = flat[name].cpu().split([v.numel() for v in parts.values()])
        out.append(dict(zip(parts, pieces)))
    return out[0], out[1]
