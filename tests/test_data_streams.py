"""Streams into training: 4 workers (Ray actors) read disjoint streams, every row once per epoch,
from parquet and from raw files; the collate step's Batch layout, multi-hot bags and guards."""

from __future__ import annotations

import gzip

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import ray
import torch
from torchrec.datasets.utils import Batch

from recgrid.data.criteo import CriteoDataError, PREPARED_SCHEMA, prepared_metadata
from recgrid.data.stream import collate, iter_batches, memory_batches, read_dataset, synthetic_batches, worker_streams
from recgrid.data.specs import DENSE_NAMES, MLPERF_MULTI_HOT_SIZES, SPARSE_NAMES, get_spec
from recgrid.data.synth import HiddenModel, raw_table, synth_table

# C3 has 10M rows in Kaggle: its id carries each row's global number through every step
SPEC = get_spec("criteo_kaggle")
T = 4


@pytest.fixture(scope="module")
def consumers():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0.25)
    class Worker:
        """Stands in for one training worker: pulls its stream as Batches, returns row numbers."""

        def consume(self, stream, spec, batch_size):
            from recgrid.data.stream import iter_batches

            seen, batches = [], 0
            for b in iter_batches(stream, batch_size, spec, drop_last=False):
                assert b.dense_features.shape == (len(b.labels), 13)
                seen.append(b.sparse_features["C3"].values().numpy().copy())
                batches += 1
            return np.concatenate(seen) if seen else np.zeros(0, np.int64), batches

    workers = [Worker.remote() for _ in range(T)]
    yield workers
    ray.shutdown()


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


def run_epoch(workers, streams, batch_size=256):
    results = ray.get([w.consume.remote(s, SPEC, batch_size) for w, s in zip(workers, streams)])
    return [r[0] for r in results], [r[1] for r in results]


def assert_exactly_once(per_worker, total):
    everything = np.concatenate(per_worker)
    assert len(everything) == total, [len(x) for x in per_worker]
    assert (np.sort(everything) == np.arange(total)).all()  # disjoint, and nothing missing


def test_parquet_every_row_once_per_epoch_across_4_workers(tmp_path, consumers):
    for i in range(6):
        write_parquet(str(tmp_path / f"shard-{i}.parquet"), i * 1500, 1500)
    streams = worker_streams(read_dataset(str(tmp_path / "*.parquet"), SPEC), T)
    for _epoch in range(2):  # the same split streams, a second pass: again every row once
        per_worker, _ = run_epoch(consumers, streams)
        assert_exactly_once(per_worker, 9000)
    assert sum(len(x) > 0 for x in per_worker) >= 2  # the rows really were spread


def test_raw_files_every_row_once_across_4_workers(tmp_path, consumers):
    write_raw(str(tmp_path / "day_0"), 0, 2000, gz=False)  # no extension, like the 1TB files
    write_raw(str(tmp_path / "day_1.gz"), 2000, 1500, gz=True)
    write_raw(str(tmp_path / "day_2"), 3500, 1700, gz=True)  # gzip without the .gz name
    streams = worker_streams(read_dataset([str(tmp_path / "day_*")], SPEC), T)
    per_worker, _ = run_epoch(consumers, streams)
    assert_exactly_once(per_worker, 5200)


def test_equal_split_gives_every_worker_the_same_rows(tmp_path, consumers):
    for i in range(3):
        write_parquet(str(tmp_path / f"s{i}.parquet"), i * 1001, 1001)
    streams = worker_streams(read_dataset(str(tmp_path), SPEC), T, equal=True)
    per_worker, _ = run_epoch(consumers, streams)
    counts = [len(x) for x in per_worker]
    assert len(set(counts)) == 1 and 3003 - T < sum(counts) <= 3003
    everything = np.concatenate(per_worker)
    assert len(np.unique(everything)) == len(everything)


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


def test_memory_and_synthetic_batches_match_the_stream(tmp_path, consumers):
    write_parquet(str(tmp_path / "one.parquet"), 0, 1000)
    from_stream = list(iter_batches(read_dataset(str(tmp_path), SPEC), 128, SPEC))
    in_memory = memory_batches(numbered_table(0, 1000), 128, SPEC)
    assert len(from_stream) == len(in_memory) == 7  # drop_last: 1000 // 128
    for s, m in zip(from_stream, in_memory):  # one file, one reader: same order
        assert torch.equal(s.dense_features, m.dense_features) and torch.equal(s.labels, m.labels)
        assert torch.equal(s.sparse_features.values(), m.sparse_features.values())
    syn = synthetic_batches(get_spec("tiny"), 32, 3, seed=0)
    assert len(syn) == 3 and all(b.labels.shape == (32,) for b in syn)
    assert torch.equal(syn[0].labels, synthetic_batches(get_spec("tiny"), 32, 3, seed=0)[0].labels)
