"""bench/quality.py's arithmetic, without training: every M trains the same rows in the same
steps, gaps are paired by seed and relative to M = 1, and the trend verdicts follow their rules."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "quality.py"
_spec = importlib.util.spec_from_file_location("bench_quality", _PATH)
quality = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = quality  # dataclasses look their module up while the file runs
_spec.loader.exec_module(quality)


def test_every_step_trains_one_contiguous_block_split_over_the_workers():
    steps, T, B = 7, 8, 4
    per_rank = [quality.train_rows(steps, T, B, r).reshape(steps, B) for r in range(T)]
    for i in range(steps):
        step_rows = np.concatenate([rows[i] for rows in per_rank])
        assert sorted(step_rows) == list(range(i * T * B, (i + 1) * T * B))


def _run(M, kind, c, K, delayed, seed, ne):
    return {"num_groups": M, "kind": kind, "c": c, "sync_every": K, "delayed": delayed, "seed": seed, "eval_ne": ne}


def _runs(gaps_c1, gaps_cm, base=(0.60, 0.62)):
    """M = 1 at NE `base` per seed; M > 1 at base * (1 + gap%/100) (the same relative gap every seed)."""
    runs = [_run(1, "model_parallel", "-", 1, False, s, ne) for s, ne in enumerate(base)]
    for M, g1, gm in zip((2, 4, 8), gaps_c1, gaps_cm):
        for s, ne in enumerate(base):
            runs.append(_run(M, "2d", "1", 1, False, s, ne * (1 + g1 / 100)))
            runs.append(_run(M, "2d", "M", 1, False, s, ne * (1 + gm / 100)))
    return runs


def test_gaps_are_paired_by_seed_and_relative_to_m1():
    runs = [_run(1, "model_parallel", "-", 1, False, 0, 0.50), _run(1, "model_parallel", "-", 1, False, 1, 0.60),
            _run(2, "2d", "1", 5, True, 0, 0.51), _run(2, "2d", "1", 5, True, 1, 0.63)]
    table = quality.aggregate(runs)
    base = next(r for r in table if r["kind"] == "model_parallel")
    assert base["ne_mean"] == pytest.approx(0.55) and base["gap_mean"] == pytest.approx(0.0)
    row = quality.lookup(table, 2, "1", 5, True)
    assert row["ne_mean"] == pytest.approx(0.57)
    assert row["ne_std"] == pytest.approx(np.std([0.51, 0.63], ddof=1))
    assert row["gap_mean"] == pytest.approx((0.01 + 0.03) / 2)
    assert row["gap_pct_mean"] == pytest.approx((2.0 + 5.0) / 2)  # 0.01/0.50 and 0.03/0.60
    assert row["gap_pct_std"] == pytest.approx(np.std([2.0, 5.0], ddof=1))


def test_trend_verdicts():
    holds = quality.trends(quality.aggregate(_runs([0.2, 0.5, 1.0], [0.01, 0.02, 0.0])), [1, 2, 4, 8], [1])
    assert holds["headline"]["gap_grows_with_M_at_c1"] and holds["headline"]["c_eq_M_closes_gap"]
    assert "does NOT" not in quality.verdict(holds)
    flat = quality.trends(quality.aggregate(_runs([0.5, 0.4, 0.6], [0.4, 0.5, 0.5])), [1, 2, 4, 8], [1])
    assert not flat["headline"]["gap_grows_with_M_at_c1"]  # not monotone in M
    assert not flat["headline"]["c_eq_M_closes_gap"]  # c = M no better than c = 1 at M = 4
    assert quality.verdict(flat).count("does NOT hold") == 2
