"""Metrics: NE against torchrec.metrics, AUC against torchmetrics, and the cross-rank reduction
on real gloo process groups with rows split unevenly over the ranks."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recgrid.engine.device import peak_memory_mb
from recgrid.launch.local import free_port
from recgrid.train.metrics import (
    EvalMetrics,
    PhaseTimer,
    TrainMetrics,
    prediction_sums,
    ne_from_sums,
    reduce_metrics,
)

# torchrec and torchmetrics are imported inside the tests that use them, so the spawned gloo
# workers (which import this module) start quickly.

AUC_TOL = 1e-5  # histogram AUC vs torchmetrics' exact AUC on realistic predictions (measured ~3e-7)
TIE_TOL = 1e-6  # exact ties on bin edges: only torchmetrics' own float32 rounding remains
NE_TOL = 1e-12  # same formula in float64


def _ctr_data(n: int, seed: int, scale: float = 1.0, bias: float = -2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions of a model with some signal on a CTR-like base rate, and labels."""
    g = torch.Generator().manual_seed(seed)
    logit = torch.randn(n, generator=g) * scale + bias
    labels = (torch.rand(n, generator=g) < torch.sigmoid(1.3 * logit + 0.2)).float()
    return torch.sigmoid(logit), labels


def test_ne_matches_torchrec_compute_ne() -> None:
    from torchrec.metrics.ne import compute_ne, get_ne_states

    preds, labels = _ctr_data(50_000, seed=1)
    preds[:10] = 0.0  # exercise the eta clamp at both ends
    preds[10:20] = 1.0
    weights = torch.rand(50_000, generator=torch.Generator().manual_seed(2)) + 0.5
    for w in (None, weights):
        ww = torch.ones_like(preds) if w is None else w
        st = get_ne_states(labels.double(), preds.double(), ww.double(), 1e-12)
        ref = compute_ne(st["cross_entropy_sum"], st["weighted_num_samples"], st["pos_labels"], st["neg_labels"], 1e-12)
        ce, wsum, pos, neg, _, _ = prediction_sums(preds, labels, w).tolist()
        assert ce == pytest.approx(float(st["cross_entropy_sum"]), rel=NE_TOL)
        assert ne_from_sums(ce, wsum, pos, neg) == pytest.approx(float(ref), rel=NE_TOL, abs=0)


def test_lifetime_and_windowed_ne_match_torchrec_ne_metric() -> None:
    from torchrec.metrics.metrics_config import RecComputeMode, RecTaskInfo
    from torchrec.metrics.ne import NEMetric

    B, window_steps = 128, 3
    ref = NEMetric(world_size=1, my_rank=0, batch_size=B, tasks=[RecTaskInfo(name="t")],
                   compute_mode=RecComputeMode.UNFUSED_TASKS_COMPUTATION, window_size=window_steps * B)
    train, lifetime = TrainMetrics(window_steps=window_steps), EvalMetrics(num_bins=16)
    for step in range(8):
        preds, labels = _ctr_data(B, seed=100 + step, bias=-1.0 + 0.2 * step)  # drifting, so windows differ
        ref.update(predictions={"t": preds}, labels={"t": labels}, weights={"t": torch.ones(B)})
        train.update(preds, labels)
        lifetime.update(preds, labels)
    want = ref.compute()
    got = reduce_metrics(train=train, evaluation=lifetime)
    assert got["train/ne"] == pytest.approx(float(want["ne-t|window_ne"]), rel=NE_TOL)
    assert got["eval/ne"] == pytest.approx(float(want["ne-t|lifetime_ne"]), rel=NE_TOL)
    assert got["train/ne"] != pytest.approx(got["eval/ne"], rel=1e-3)  # the window really is a window


@pytest.mark.parametrize("scale,bias", [(1.0, -2.0), (0.3, -3.5), (3.0, 0.0)])
def test_auc_matches_torchmetrics(scale: float, bias: float) -> None:
    from torchmetrics.functional.classification import binary_auroc

    preds, labels = _ctr_data(100_000, seed=3, scale=scale, bias=bias)
    m = EvalMetrics()
    for chunk in range(4):  # several updates accumulate
        sl = slice(chunk * 25_000, (chunk + 1) * 25_000)
        m.update(preds[sl], labels[sl])
    out = reduce_metrics(evaluation=m)
    ref = float(binary_auroc(preds, labels.long()))
    assert abs(out["eval/auc"] - ref) < AUC_TOL
    assert abs(out["eval/auc"] - ref) <= out["eval/auc_max_error"] + TIE_TOL
    assert out["eval/examples"] == 100_000


def test_auc_exact_ties_count_half_like_torchmetrics() -> None:
    from torchmetrics.functional.classification import binary_auroc

    g = torch.Generator().manual_seed(4)
    preds = torch.randint(0, 9, (20_000,), generator=g).float() / 8  # 9 values, each on a bin edge
    labels = (torch.rand(20_000, generator=g) < 0.2 + 0.5 * preds).float()
    m = EvalMetrics(num_bins=64)
    m.update(preds, labels)
    out = reduce_metrics(evaluation=m)
    assert out["eval/auc_max_error"] > 0.01  # many tied pairs: a wrong tie rule would show
    assert out["eval/auc"] == pytest.approx(float(binary_auroc(preds, labels.long())), abs=TIE_TOL)


def test_single_class_and_empty_states_report_no_auc() -> None:
    m = EvalMetrics(num_bins=32)
    assert "eval/auc" not in reduce_metrics(evaluation=m)
    m.update(torch.rand(100), torch.ones(100))
    out = reduce_metrics(evaluation=m)
    assert "eval/auc" not in out and out["eval/positive_rate"] == 1.0


def test_phase_timer_and_memory() -> None:
    t = PhaseTimer()
    with t.phase("dense"):
        sum(range(100_000))
    t.add("lookup", 0.25)
    assert t.seconds["dense"] > 0 and t.seconds["lookup"] == 0.25 and t.seconds["sync"] == 0.0
    with pytest.raises(ValueError, match="unknown phase 'lookups'"):
        t.add("lookups", 1.0)
    assert 10 < peak_memory_mb("cpu") < 1_000_000  # torch alone needs > 10 MiB; units are MiB not KiB


def test_train_interval_loss_qps_and_reset() -> None:
    m = TrainMetrics(window_steps=4)
    for _ in range(5):
        preds, labels = _ctr_data(64, seed=5)
        m.update(preds, labels, loss=torch.tensor(0.5))
    out = reduce_metrics(train=m)
    assert out["train/loss"] == pytest.approx(0.5)
    assert out["train/examples_total"] == 320 and out["train/qps"] > 0
    assert out["train/step_time_s"] == pytest.approx(out["time/interval_s"] / 5)
    assert "imbalance/lookup_max_over_mean" not in out  # no lookup time recorded
    k = TrainMetrics(phases=("lookup", "lookup_kernel"), imbalance_phase="lookup_kernel")
    k.timer.add("lookup", 2.0)
    k.timer.add("lookup_kernel", 1.0)  # one worker: max == mean
    assert reduce_metrics(train=k)["imbalance/lookup_max_over_mean"] == 1.0
    m.reset_interval()
    preds, labels = _ctr_data(64, seed=6)
    m.update(preds, labels)  # no loss passed: log loss of the predictions, in nats
    ll = torch.nn.functional.binary_cross_entropy(preds.double(), labels.double()).item()
    out = reduce_metrics(train=m)
    assert out["train/loss"] == pytest.approx(ll, rel=1e-9)
    assert out["train/examples_total"] == 384


# ---- real gloo process groups ------------------------------------------------------------------
WORLD = 3
ROWS = [7_000, 0, 23_017]  # uneven, one rank with no eval rows at all
TRAIN_STEPS, WINDOW, BATCH = [5, 2, 7], 3, [32, 17, 64]  # rank 1 has fewer steps than the window


def _eval_rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    preds, labels = _ctr_data(sum(ROWS), seed=7)
    start = sum(ROWS[:rank])
    return preds[start:start + ROWS[rank]], labels[start:start + ROWS[rank]]


def _train_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _ctr_data(BATCH[rank], seed=1000 * rank + step, bias=-1.5)


def _gloo_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        ev, tr = EvalMetrics(), TrainMetrics(window_steps=WINDOW)
        preds, labels = _eval_rows(rank)
        for part in torch.arange(len(preds)).split(4096):  # several eval batches
            ev.update(preds[part], labels[part])
        for step in range(TRAIN_STEPS[rank]):
            tr.update(*_train_batch(rank, step), loss=float(rank))
        tr.timer.add("lookup", rank + 1.0)  # 1, 2, 3 s: imbalance = 3 / 2
        tr.timer.add("sync", 0.5)
        out = reduce_metrics(dist.group.WORLD, train=tr, evaluation=ev)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_gloo_reduction_equals_single_process_over_all_rows(tmp_path) -> None:
    mp.spawn(_gloo_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert all(r == results[0] for r in results[1:]), "every rank must get the same numbers"
    got = results[0]

    # the same rows in one process
    ev = EvalMetrics()
    ev.update(*_ctr_data(sum(ROWS), seed=7))
    want = reduce_metrics(evaluation=ev)
    for k in ("eval/ne", "eval/auc", "eval/logloss", "eval/accuracy", "eval/positive_rate", "eval/examples"):
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-12), k

    # windowed train NE = NE over every rank's last WINDOW steps, concatenated
    last = [_train_batch(r, s) for r in range(WORLD) for s in range(max(0, TRAIN_STEPS[r] - WINDOW), TRAIN_STEPS[r])]
    ce, w, pos, neg, _, _ = prediction_sums(torch.cat([p for p, _ in last]), torch.cat([y for _, y in last])).tolist()
    assert got["train/ne"] == pytest.approx(ne_from_sums(ce, w, pos, neg), rel=1e-12)

    rows = [TRAIN_STEPS[r] * BATCH[r] for r in range(WORLD)]
    assert got["train/loss"] == pytest.approx(sum(r * n for r, n in enumerate(rows)) / sum(rows))
    assert got["train/examples_total"] == sum(rows)
    assert got["time/lookup_s"] == pytest.approx(2.0) and got["time/lookup_s_max"] == pytest.approx(3.0)
    assert got["imbalance/lookup_max_over_mean"] == pytest.approx(1.5)
    assert got["time/sync_s"] == pytest.approx(0.5) and got["time/dense_s"] == 0.0
    assert got["memory/peak_mb_max"] >= got["memory/peak_mb_mean"] > 10
    assert math.isfinite(got["train/qps"]) and got["train/qps"] > 0


def test_readme_metrics_table_is_the_modules() -> None:
    from pathlib import Path

    import recgrid.train.metrics as metrics
    from recgrid.train.export import reference_table

    table = reference_table()
    readme = (Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text()
    begin, end = "<!-- metrics-table:begin -->\n", "\n<!-- metrics-table:end -->"
    assert readme[readme.index(begin) + len(begin):readme.index(end)] == table
    for phase in metrics.PHASES:  # every phase the trainer times is explained
        assert f"`{phase}`" in table, phase
