"""QR compression and the head cache without processes: the id transform (exact integer quotients,
every id in exactly one of head or quotient/remainder, key-major lengths), the pooled combination
against the per-id one on a real unsharded TorchRec EBC, the initialisation's statistics, the
sizing, and the config refusals. The sharded engine is tested in test_engine.py (sync_results)."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from recgrid.config import ConfigError, defaults
from recgrid.data.specs import Compression, embedding_bytes, head_from_counts, merge_counts, table_layout
from recgrid.data.specs import SPARSE_NAMES, DatasetSpec, get_spec
from recgrid.data.stream import collate_block, memory_batches
from recgrid.data.synth import synth_table

SPEC = get_spec("tiny")


def _key_major(ids: np.ndarray, bags: tuple[int, ...]) -> np.ndarray:
    """[26, B, max bag] ids -> one batch's key-major values [1, B * sum(bags)] (bag f: its first bags[f] ids)."""
    return np.concatenate([ids[f, :, :bag].reshape(-1) for f, bag in enumerate(bags)])[None]


def _segments(values: np.ndarray, lengths: np.ndarray, keys: list[str], b: int) -> dict[str, list[np.ndarray]]:
    """key -> per sample its bag of values, from one batch's key-major values and lengths."""
    out, at = {}, 0
    for k, key in enumerate(keys):
        bags = []
        for n in lengths[k * b:(k + 1) * b]:
            bags.append(values[at:at + n])
            at += n
        out[key] = bags
    assert at == len(values)
    return out


def test_quotients_are_exact_integer_division_past_2_pow_24_times_c():
    rows = (1 << 41,) + (10,) * 25
    spec = DatasetSpec("huge", rows, embedding_dim=4)
    comp = Compression(threshold_rows=100, collisions=4)
    big = np.array([(1 << 40) + 3, (1 << 24) * 4 + 7, 5], np.int64)
    ids = np.zeros((26, 3, 1), np.int64)
    ids[0, :, 0] = big
    values, lengths, counts = comp.apply(_key_major(ids, spec.bag_sizes), spec, 3)
    seg = _segments(values[0, :counts[0]], lengths[0], comp.keys(spec), 3)
    q = np.concatenate(seg["C1_q"])
    r = np.concatenate(seg["C1_r"])
    assert q.tolist() == [1 << 38, (1 << 24) + 1, 1] and r.tolist() == [3, 3, 1]
    assert (q * 4 + r).tolist() == big.tolist()
    # what float32 division would have given: the wrong row (the bug integer division avoids)
    assert int(np.float32(big[1]) / np.float32(4)) != big[1] // 4


@pytest.mark.parametrize("multi_hot", [False, True])
def test_every_id_lands_in_exactly_one_of_head_or_quotient_and_remainder(multi_hot):
    spec = SPEC.with_multi_hot() if multi_hot else SPEC
    comp = Compression(threshold_rows=2000, collisions=5, operation="add", head_rows=40)
    compressed = comp.features(spec)
    assert [SPARSE_NAMES[f] for f in compressed] == ["C3", "C4", "C7", "C10", "C12", "C16", "C21", "C24"]
    rng = np.random.default_rng(0)
    comp = comp.with_heads({f: rng.choice(spec.table_rows[f], 40, replace=False) for f in compressed})
    b = 16
    table = synth_table(spec, 3 * b, seed=1)
    cols = {n: table.column(n).to_numpy() for n in table.column_names}
    plain = collate_block(cols, spec, b)
    block = collate_block(cols, spec, b, compression=comp)
    keys = comp.keys(spec)
    assert keys[:5] == ["C1", "C2", "C3_h", "C3_q", "C3_r"] and len(keys) == 26 + 2 * len(compressed)
    heads = comp.heads()
    for j in range(3):  # each batch of the block
        n = block["value_counts"][j]
        assert n == block["lengths"][j].sum()
        assert not block["values"][j, n:].any()  # padding only past the real values
        got = _segments(block["values"][j, :n], block["lengths"][j], keys, b)
        want = _segments(plain["values"][j], plain["lengths"][j], list(SPARSE_NAMES), b)
        for f, name in enumerate(SPARSE_NAMES):
            if f not in compressed:
                assert all(np.array_equal(x, y) for x, y in zip(got[name], want[name]))
                continue
            for i in range(b):
                h, q, r = got[name + "_h"][i], got[name + "_q"][i], got[name + "_r"][i]
                assert len(q) == len(r) and len(h) + len(q) == spec.bag_sizes[f]
                assert q.max(initial=0) < math.ceil(spec.table_rows[f] / 5) and r.max(initial=0) < 5
                restored = sorted(heads[f][h].tolist() + (q * 5 + r).tolist())
                assert restored == sorted(want[name][i].tolist())
                assert not np.isin(q * 5 + r, heads[f]).any()  # a head id never goes through QR
    assert sum(len(v) for v in heads.values()) > 0 and block["lengths"].dtype == np.int32


def _pooled_vs_per_id(operation: str, multi_hot: bool) -> None:
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.embedding_configs import DataType

    from recgrid.engine.compression import qr_sparse_arch, qr_table_configs

    spec = (SPEC.with_multi_hot() if multi_hot else SPEC)
    c, dim, b = 4, 8, 8
    comp = Compression(threshold_rows=2000, collisions=c, operation=operation, head_rows=30)
    table = synth_table(spec, b, seed=3)
    cols = {n: table.column(n).to_numpy() for n in table.column_names}
    counts = {f: np.unique(collate_block(cols, spec, b)["values"][0], return_counts=True) for f in comp.features(spec)}
    comp = comp.with_heads({f: head_from_counts(*counts[f], head_rows=30) for f in comp.features(spec)})
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=qr_table_configs(spec, dim, DataType.FP32, comp), device=torch.device("cpu"))
    arch = qr_sparse_arch(ebc, spec, dim, comp)
    (batch,) = memory_batches(table, b, spec, compression=comp)
    out = arch(batch.sparse_features)
    assert out.shape == (b, 26, dim)
    weights = {name[2:]: bag.weight for name, bag in ebc.embedding_bags.items()}  # t_C3_q -> C3_q
    plain = collate_block(cols, spec, b)
    want = _segments(plain["values"][0], plain["lengths"][0], list(SPARSE_NAMES), b)
    heads = comp.heads()
    for f, name in enumerate(SPARSE_NAMES):
        for i in range(b):
            rows = []
            for x in want[name][i].tolist():
                if f not in heads:
                    rows.append(weights[name][x])
                elif x in heads[f]:
                    rows.append(weights[name + "_h"][int(np.searchsorted(heads[f], x))])
                else:
                    q, r = weights[name + "_q"][x // c], weights[name + "_r"][x % c]
                    rows.append(q * r if operation == "mult" else q + r if operation == "add" else torch.cat([q, r]))
            torch.testing.assert_close(out[i, f], torch.stack(rows).sum(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("operation,multi_hot", [("add", True), ("concat", True), ("mult", False), ("add", False)])
def test_pooled_combination_is_the_pooled_per_id_combination(operation, multi_hot):
    _pooled_vs_per_id(operation, multi_hot)


@pytest.mark.parametrize("operation", ["mult", "add", "concat"])
def test_compressed_rows_start_with_an_uncompressed_rows_variance(operation):
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.embedding_configs import DataType

    from recgrid.engine.compression import qr_table_configs

    n, c, dim = 40_000, 4, 16
    spec = DatasetSpec("one", (n,) + (3,) * 25, embedding_dim=dim)
    comp = Compression(threshold_rows=1000, collisions=c, operation=operation)
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=qr_table_configs(spec, dim, DataType.FP32, comp), device=torch.device("cpu"))
    q, r = (ebc.embedding_bags[f"t_C1{p}"].weight.detach() for p in ("_q", "_r"))
    ids = torch.arange(n)
    qi, ri = q[ids // c], r[ids % c]
    rows = qi * ri if operation == "mult" else qi + ri if operation == "add" else torch.cat([qi, ri], 1)
    want = 1 / (3 * n)  # uniform(-sqrt(1/n), sqrt(1/n))'s variance
    assert rows.shape == (n, dim)
    # centred (the reference draws from U(sqrt(1/n), 1): mean ~0.5); the c remainder rows are few draws
    assert abs(rows.mean().item()) < 0.3 * math.sqrt(want)
    assert (q < 0).any() and (r < 0).any()
    # the c remainder rows are few draws: the variance matches within sampling noise
    assert 0.5 * want < rows.var().item() < 1.6 * want


def test_sizing_and_embedding_bytes():
    comp = Compression(threshold_rows=2000, collisions=4, operation="concat")
    layout = table_layout(SPEC, 16, comp, {2: 10})
    by_name = {t: (f, rows, d) for t, f, rows, d in layout}
    assert by_name["t_C3_h"] == ("C3_h", 10, 16) and by_name["t_C3_q"] == ("C3_q", 1000, 8)
    assert by_name["t_C3_r"] == ("C3_r", 4, 8) and by_name["t_C1"] == ("C1", 1460, 16) and "t_C4_h" not in by_name
    plain = embedding_bytes(SPEC, 16)
    assert plain == sum(SPEC.table_rows) * 16 * 4
    # without a head: each compressed table's rows shrink to ceil(n / c) + c (concat: at half width)
    mult = Compression(threshold_rows=2000, collisions=4)
    small = sum(r for r in SPEC.table_rows if r <= 2000)
    qr = sum(math.ceil(r / 4) + 4 for r in SPEC.table_rows if r > 2000)
    assert embedding_bytes(SPEC, 16, compression=mult) == (small + qr) * 16 * 4
    assert embedding_bytes(SPEC, 16, "fp16", mult) * 2 == embedding_bytes(SPEC, 16, compression=mult)
    # the uncompressed tables keep their names: an uncompressed job's tables are unchanged
    assert [t for t, *_ in table_layout(SPEC, 16)] == [f"t_{n}" for n in SPARSE_NAMES]


def test_head_from_counts_takes_the_most_frequent_ids_or_the_fewest_that_cover():
    ids = np.array([7, 3, 9, 1, 5])
    counts = np.array([50, 20, 20, 9, 1])
    assert head_from_counts(ids, counts, head_rows=2).tolist() == [3, 7]  # tie 3 vs 9: the smaller id
    assert head_from_counts(ids, counts, head_coverage=0.5).tolist() == [7]  # 50 of 100
    assert head_from_counts(ids, counts, head_coverage=0.51).tolist() == [3, 7]
    assert head_from_counts(ids, counts, head_coverage=0.95).tolist() == [1, 3, 7, 9]
    assert head_from_counts(ids, counts, head_rows=10).tolist() == [1, 3, 5, 7, 9]
    got = merge_counts([(np.array([1, 2]), np.array([3, 4])), (np.array([2, 5]), np.array([1, 1]))])
    assert got[0].tolist() == [1, 2, 5] and got[1].tolist() == [3, 5, 1]


def test_a_head_cache_without_counted_ids_cannot_build_tables():
    with pytest.raises(ValueError, match="head ids"):
        Compression(2000, 4, head_rows=5).keys(SPEC)


def test_compression_is_small_and_pickles():
    import pickle

    comp = Compression(2000, 4, head_rows=3).with_heads({2: np.array([5, 1, 9])})
    back = pickle.loads(pickle.dumps(comp))
    assert back.heads()[2].tolist() == [1, 5, 9] and back.keys(SPEC) == comp.keys(SPEC)


QR = ["model.compression=qr", "model.qr_threshold_rows=2000"]


@pytest.mark.parametrize("overrides,field", [
    (["model.compression=qr"], "model.qr_threshold_rows"),  # the default compresses none of tiny's tables
    ([*QR[:1], "model.qr_threshold_rows=5000", "data.max_rows_per_table=100000"], "model.qr_threshold_rows"),
    ([*QR[:1], "model.qr_threshold_rows=500", "data.max_rows_per_table=500"], "model.qr_threshold_rows"),
    ([*QR, "model.qr_collisions=1"], "model.qr_collisions"),
    ([*QR, "model.head_coverage=1.0"], "model.head_coverage"),
    ([*QR, "model.head_coverage=0"], "model.head_coverage"),
    ([*QR, "model.head_coverage=0.5", "model.head_rows=10"], "model.head_coverage"),
    ([*QR, "model.head_rows=-1"], "model.head_rows"),
    ([*QR, "data.multi_hot=true"], "model.qr_operation"),
    ([*QR, "model.qr_operation=concat", "model.embedding_dim=15", "model.dense_arch=[64, 15]"], "model.qr_operation"),
    ([*QR, "model.towers=2", "grid.world_size=4", "grid.num_groups=1"], "model.compression"),
    (["model.compression=zip"], "model.compression"),
])
def test_bad_compression_settings_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        defaults(*overrides)
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_good_compression_settings_give_the_jobs_compression():
    cfg = defaults(*QR, "model.qr_operation=add", "data.multi_hot=true", "model.head_coverage=0.3")
    assert cfg.compression() == Compression(2000, 4, "add", 0, 0.3)
    assert defaults().compression() is None
    assert dataclasses.replace(defaults().model).compression == "none"
