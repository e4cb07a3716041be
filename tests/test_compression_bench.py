"""bench/compression.py's arithmetic, without training: gaps paired by seed, the equal-memory
verdict's rule (each QR + head configuration against the QR-alone one of its operation with the
fewest bytes >= its own), and the wide over-arch's width against the bytes it may spend."""

import importlib.util
import math
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "bench" / "compression.py"
_spec = importlib.util.spec_from_file_location("bench_compression", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up while the file runs
_spec.loader.exec_module(bench)


def _run(kind, c, op, seed, ne, nbytes, auc=0.8):
    cfg = bench.RunConfig(kind, c, op)
    return {"kind": kind, "c": c, "op": op, "label": cfg.label, "seed": seed, "eval_ne": ne, "eval_auc": auc,
            "embedding_bytes": nbytes, "over_arch": [64, 32, 1]}


def _runs(gap_qr4, gap_qr16, gap_head16, base=(0.60, 0.62, 0.61), noise=(0.0, 0.0, 0.0)):
    """Uncompressed at `base` per seed; QR c=4 (1000 B), QR c=16 (300 B), QR + head c=16 (600 B),
    QR + head c=4 (1300 B): each at base + its gap (+ a per-seed noise)."""
    runs = []
    for s, (ne, e) in enumerate(zip(base, noise)):
        runs += [_run("none", 0, "-", s, ne, 4000),
                 _run("qr", 4, "mult", s, ne + gap_qr4 + e, 1000),
                 _run("qr", 16, "mult", s, ne + gap_qr16 + e, 300),
                 _run("qr+head", 16, "mult", s, ne + gap_head16 - e, 600),
                 _run("qr+head", 4, "mult", s, ne - e, 1300)]
    return runs


def test_gaps_are_paired_by_seed_and_ratios_are_against_uncompressed_bytes():
    table = bench.aggregate(_runs(0.01, 0.03, 0.002))
    row = {r["label"]: r for r in table}
    assert [r["kind"] for r in table] == ["none", "qr", "qr", "qr+head", "qr+head"]
    assert math.isclose(row["qr c=4 mult"]["gap_mean"], 0.01) and row["qr c=4 mult"]["gap_std"] < 1e-12
    assert row["qr c=16 mult"]["compression_ratio"] == round(4000 / 300, 3)
    assert math.isclose(row["qr c=16 mult"]["gap_pct_mean"], 100 * sum(0.03 / b for b in (0.60, 0.62, 0.61)) / 3)


def test_head_cache_is_judged_against_the_qr_run_with_at_least_its_bytes():
    v = bench.verdict(bench.aggregate(_runs(0.01, 0.03, 0.002)))
    # head c=16 (600 B) against QR c=4 (1000 B), not c=16 (300 B); head c=4 (1300 B) has no comparator
    assert [(p["head"], p["qr"]) for p in v["pairs"]] == [("qr+head c=16 mult", "qr c=4 mult")]
    assert v["answer"] == "yes" and v["pairs"][0]["recovers"]
    # a head cache that keeps half of QR's loss does not recover it
    assert bench.verdict(bench.aggregate(_runs(0.01, 0.03, 0.005)))["answer"] == "no"


def test_a_qr_loss_within_noise_leaves_nothing_to_recover():
    noisy = bench.aggregate(_runs(0.001, 0.03, 0.0, noise=(-0.01, 0.0, 0.01)))
    v = bench.verdict(noisy)
    assert not v["pairs"][0]["qr_loses"] and v["answer"] == "nothing to recover"


def test_the_wide_over_arch_spends_no_more_than_the_freed_bytes():
    dim = 16
    base = bench.over_arch_params(bench.over_arch_in_dim(dim), bench.BASE_OVER_ARCH)
    assert bench.over_arch_in_dim(dim) == 16 + 27 * 26 // 2
    assert bench.wide_over_arch(0, dim) == bench.BASE_OVER_ARCH
    freed = 1_000_000
    wide = bench.wide_over_arch(freed, dim)
    extra = bench.over_arch_params(bench.over_arch_in_dim(dim), wide) - base
    one_more = bench.over_arch_params(bench.over_arch_in_dim(dim), (wide[0] + 1,) + wide[1:]) - base
    assert wide[1:] == bench.BASE_OVER_ARCH[1:] and 4 * extra <= freed < 4 * one_more
