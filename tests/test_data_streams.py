"""Every training and evaluation batch out of Ray Data (real Ray, real files): each worker's stream
is its own part of the epoch plan, in order, from parquet and from raw gzip logs; a restored
data cursor resumes each worker exactly (also re-split over fewer workers); evaluation reads every
row once; a bad raw row fails naming file, line and field; the collate step's Batch layout,
multi-hot bags equal to a reference computed row by row here, and its guards."""

from __future__ import annotations

import gzip

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.datasets.utils import Batch

from recgrid.data.criteo import CriteoDataError, PREPARED_SCHEMA, prepared_metadata
from recgrid.data.stream import (
    EvalData, TrainData, collate, memory_batches, ray_batches, read_tasks, scan_inputs, stats_text, synthetic_batches,
)
from recgrid.data.specs import DENSE_NAMES, MLPERF_MULTI_HOT_SIZES, SPARSE_NAMES, get_spec
from recgrid.data.synth import HiddenModel, raw_table, synth_table
from recgrid.data.units import DataCursor, EpochPlan, Unit, take_rows

# C3 has 10M rows in Kaggle: its id carries each row's global number through every step
SPEC = get_spec("criteo_kaggle")
T = 4


@pytest.fixture(scope="module")
def ray_session(shared_ray):
    """The suite's shared local cluster."""


def numbered_table(start: int, n: int) -> pa.Table:
    t = synth_table(SPEC, n, seed=start)
    return t.set_column(t.schema.get_field_index("C3"), "C3", pa.array(np.arange(start, start + n, dtype=np.int64)))


def write_parquet(path: str, start: int, n: int) -> None:
    pq.write_table(numbered_table(start, n).replace_schema_metadata(prepared_metadata(SPEC)), path)


def write_raw(path: str, start: int, n: int, gz: bool) -> None:
    t = raw_table(HiddenModel(SPEC, seed=1).sample(n, np.random.default_rng(start)))
    t = t.set_column(t.schema.get_field_index("C3"), "C3", pa.array([f"{i:08X}" for i in range(start, start + n)]))
    sink = pa.BufferOutputStream()
    pacsv.write_csv(t, sink, pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none"))
    with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
        f.write(sink.getvalue().to_pybytes())


def row_numbers(inputs, units) -> np.ndarray:
    """The global numbers of `units`' rows (files numbered one after the other)."""
    first = np.concatenate([[0], np.cumsum(inputs.rows)[:-1]])
    return np.concatenate([np.arange(first[u.file] + u.start, first[u.file] + u.end) for u in units] or [np.zeros(0, int)])


def c3(batches) -> np.ndarray:
    return np.concatenate([b.sparse_features["C3"].values().numpy() for b in batches] or [np.zeros(0, np.int64)])


def test_read_tasks_cut_whole_batches_in_order():
    units = [Unit(0, 0, 100), Unit(2, 50, 60), Unit(1, 7, 97)]
    tasks = read_tasks(units, 16, rows_per_task=40)  # 32 rows a task
    assert [sum(u.rows for u in t) for t in tasks] == [32, 32, 32, 32, 32, 32]  # 200 rows -> 192 whole
    assert row_numbers_of(tasks) == row_numbers_of([take_rows(units, 0, 192)])  # the units' rows, in order
    tail = read_tasks(units, 16, drop_last=False, rows_per_task=40)
    assert [sum(u.rows for u in t) for t in tail][-2:] == [32, 8]  # the short batch alone


def row_numbers_of(tasks):
    return [(u.file, r) for t in tasks for u in t for r in range(u.start, u.end)]


@pytest.mark.parametrize("fmt", ["parquet", "gzip"])
def test_each_worker_streams_its_part_of_the_plan_in_order(tmp_path, ray_session, fmt):
    if fmt == "parquet":
        for i, n in enumerate((1500, 1100, 1400)):
            write_parquet(str(tmp_path / f"shard-{i}.parquet"), sum((1500, 1100, 1400)[:i]), n)
    else:  # raw day files, gzip, parsed and transformed in Ray Data's tasks: no prepare step
        for i, n in enumerate((1500, 1100, 1400)):
            write_raw(str(tmp_path / f"day_{i}.gz"), sum((1500, 1100, 1400)[:i]), n, gz=True)
    inputs = scan_inputs(str(tmp_path / "*"), SPEC)
    plan = EpochPlan(inputs, seed=3, batch_size=64, rows_per_unit=300)
    seg = plan.segment(DataCursor(), T)
    seen = []
    for rank in range(T):
        steps, batches = TrainData(plan, SPEC, rank, T).segment_batches(DataCursor())
        got = list(batches)
        assert steps == seg.steps_total == len(got) and all(len(b.labels) == 64 for b in got)
        assert np.array_equal(c3(got), row_numbers(inputs, seg.parts[rank]))  # the plan's rows, in its order
        seen.append(c3(got))
    every = np.concatenate(seen)
    assert len(np.unique(every)) == len(every) == T * seg.steps_total * 64  # disjoint parts


def test_a_restored_cursor_resumes_every_worker_exactly(tmp_path, ray_session):
    for i in range(3):
        write_parquet(str(tmp_path / f"s{i}.parquet"), i * 1000, 1000)
    inputs = scan_inputs(str(tmp_path), SPEC)
    plan = EpochPlan(inputs, seed=1, batch_size=32, rows_per_unit=256)
    full = [list(TrainData(plan, SPEC, r, T).segment_batches(DataCursor())[1]) for r in range(T)]
    trained = [c3(f[:5]) for f in full]  # every worker trained 5 steps, then the job was restored
    cursor = DataCursor()
    plan.segment(cursor, T)
    cursor.steps = 5
    saved = cursor.state_dict()
    for r in range(T):  # same workers: each resumes at its sixth batch
        back = DataCursor()
        back.load_state_dict(saved)
        steps, batches = TrainData(plan, SPEC, r, T).segment_batches(back)
        rest = list(batches)
        assert steps == len(full[r]) - 5 and np.array_equal(c3(rest), c3(full[r][5:]))
    # on 2 workers (an elastic restore): what no part trained is re-split, none skipped, none twice
    rest = []
    for r in range(2):
        back = DataCursor()
        back.load_state_dict(saved)
        rest.append(c3(TrainData(plan, SPEC, r, 2).segment_batches(back)[1]))
    epoch = np.concatenate(trained + rest)
    assert len(np.unique(epoch)) == len(epoch)
    assert len(epoch) > 3000 - 2 * 32 * 2 - 4 * 32  # at most a step's rows of each split are left over


def test_evaluation_reads_every_row_once_in_order(tmp_path, ray_session):
    write_raw(str(tmp_path / "day_0"), 0, 700, gz=False)  # no extension, like the 1TB files
    write_parquet(str(tmp_path / "day_1.parquet"), 700, 555)
    inputs = scan_inputs([str(tmp_path / "day_0"), str(tmp_path / "day_1.parquet")], SPEC)
    parts = [EvalData(inputs, SPEC, 100, r, T) for r in range(T)]
    got = [list(p.batches()) for p in parts]
    assert [len(b.labels) for b in got[0]] == [100, 100, 100, 14]  # 314 rows: the short batch kept
    assert np.array_equal(np.concatenate([c3(g) for g in got]), np.arange(1255))
    text = stats_text(parts[0])
    assert "evaluation stream 0" in text and "ReadUnits" in text  # Ray Data's execution stats


def test_a_bad_raw_row_fails_naming_file_line_and_field(tmp_path, ray_session):
    good = "\t".join(["1"] + ["3"] * 13 + ["0a1b2c3d"] * 26)
    lines = [good] * 40
    lines[33] = good.replace("0a1b2c3d", "NOT-HEX!", 1)
    (tmp_path / "day_0").write_text("\n".join(lines) + "\n")
    inputs = scan_inputs(str(tmp_path / "day_0"), SPEC)
    with pytest.raises(CriteoDataError, match="day_0:34: field C1"):
        list(ray_batches(inputs, [Unit(0, 0, 40)], SPEC, 8))


def test_multi_hot_batches_equal_a_row_by_row_reference(tmp_path, ray_session):
    spec = SPEC.with_multi_hot()
    write_parquet(str(tmp_path / "one.parquet"), 0, 600)
    inputs = scan_inputs(str(tmp_path), spec)
    got = list(ray_batches(inputs, [Unit(0, 0, 600)], spec, 128, drop_last=False))
    table = pq.read_table(str(tmp_path / "one.parquet"))
    # the reference: each row's bag built alone, from the seeded per-feature offset tables
    offsets = [np.random.default_rng([0, f]).integers(1, rows, (2048, bag - 1)) if bag > 1 else None
               for f, (rows, bag) in enumerate(zip(spec.table_rows, MLPERF_MULTI_HOT_SIZES))]
    ids = {n: table.column(n).to_numpy() for n in SPARSE_NAMES}
    for k, batch in enumerate(got):
        lo, hi = k * 128, min(600, (k + 1) * 128)
        want_values, want_lengths = [], []
        for f, n in enumerate(SPARSE_NAMES):
            rows = spec.table_rows[f]
            for x in ids[n][lo:hi]:
                bag = [int(x)] + ([] if offsets[f] is None else [int((x + o) % rows) for o in offsets[f][x % 2048]])
                want_values += bag
                want_lengths.append(len(bag))
        assert batch.sparse_features.values().tolist() == want_values
        assert batch.sparse_features.lengths().tolist() == want_lengths
        assert batch.sparse_features.values().dtype == torch.int64 and batch.sparse_features.lengths().dtype == torch.int32
    assert [len(b.labels) for b in got] == [128] * 4 + [88]


def test_collate_layout_one_hot():
    t = numbered_table(100, 8)
    cols = {n: t.column(n).to_numpy() for n in PREPARED_SCHEMA.names}
    b = collate(cols, SPEC)
    assert isinstance(b, Batch)
    assert b.dense_features.dtype == torch.float32 and b.dense_features.shape == (8, 13)
    assert b.labels.dtype == torch.float32 and b.labels.shape == (8,)
    assert (b.labels.numpy() == cols["label"]).all()
    for j, n in enumerate(DENSE_NAMES):
        assert (b.dense_features[:, j].numpy() == cols[n]).all()
    kjt = b.sparse_features
    assert kjt.keys() == list(SPARSE_NAMES) and kjt.stride() == 8
    for n in SPARSE_NAMES:
        assert (kjt[n].values().numpy() == cols[n]).all() and (kjt[n].lengths() == 1).all()
    assert (kjt["C3"].values().numpy() == np.arange(100, 108)).all()


def test_collate_multi_hot_bags_are_fixed_seeded_and_in_range():
    spec = get_spec("tiny+multihot")
    cols = {n: c.to_numpy() for n, c in zip(PREPARED_SCHEMA.names, synth_table(spec, 64, seed=3).columns)}
    a, b = collate(cols, spec), collate(cols, spec)
    for f, (n, bag, rows) in enumerate(zip(SPARSE_NAMES, MLPERF_MULTI_HOT_SIZES, spec.table_rows)):
        jt = a.sparse_features[n]
        assert (jt.lengths() == bag).all()
        vals = jt.values().numpy().reshape(64, bag)
        assert (vals[:, 0] == cols[n]).all() and (vals >= 0).all() and (vals < rows).all()
        assert (vals == b.sparse_features[n].values().numpy().reshape(64, bag)).all()
        if bag > 1 and rows > 1:
            assert (vals[:, 1:] != vals[:, :1]).all()  # the other ids of a bag differ from the id
    # the same id gets the same bag wherever it appears; another seed gives other bags
    c21 = a.sparse_features["C21"].values().numpy().reshape(64, 100)
    for id_ in np.unique(cols["C21"]):
        assert (c21[cols["C21"] == id_] == c21[cols["C21"] == id_][0]).all()
    other = collate(cols, spec, multi_hot_seed=1).sparse_features["C21"].values().numpy().reshape(64, 100)
    assert (other[:, 0] == c21[:, 0]).all() and (other[:, 1:] != c21[:, 1:]).any()


def test_collate_refuses_ids_outside_the_table():
    cols = {n: c.to_numpy().copy() for n, c in zip(PREPARED_SCHEMA.names, numbered_table(0, 4).columns)}
    cols["C3"][2] = 10**9
    with pytest.raises(CriteoDataError, match=r"field C3: id 1000000000 outside table rows \[0, 10131227\)"):
        collate(cols, SPEC)


def test_memory_and_synthetic_batches_match_the_stream(tmp_path, ray_session):
    write_parquet(str(tmp_path / "one.parquet"), 0, 1000)
    inputs = scan_inputs(str(tmp_path), SPEC)
    from_stream = list(ray_batches(inputs, inputs.units(), SPEC, 128))
    in_memory = memory_batches(numbered_table(0, 1000), 128, SPEC)
    assert len(from_stream) == len(in_memory) == 7  # drop_last: 1000 // 128
    for s, m in zip(from_stream, in_memory):  # one file, one reader: same order
        assert torch.equal(s.dense_features, m.dense_features) and torch.equal(s.labels, m.labels)
        assert torch.equal(s.sparse_features.values(), m.sparse_features.values())
    syn = synthetic_batches(get_spec("tiny"), 32, 3, seed=0)
    assert len(syn) == 3 and all(b.labels.shape == (32,) for b in syn)
    assert torch.equal(syn[0].labels, synthetic_batches(get_spec("tiny"), 32, 3, seed=0)[0].labels)
