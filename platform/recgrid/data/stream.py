"""Criteo rows into training: each worker's row ranges read into batches, Ray Datasets, and the
collate step.

Owns what the training loop consumes. The trainer's input is `unit_batches`: the row ranges
(`data.units.Unit`) the epoch plan gives a worker, read in order by pyarrow in a prefetch
thread of the worker and collated there, so the data position is a step count that a restore
can seek back to (`data.units` says why Ray Data's streaming split cannot). `scan_inputs` counts
the rows of the job's files once (parquet footers; raw logs are counted line by line, so
prepare them for big jobs). Rows of shards that carry a `row_id` column (synthetic data) come
with `batch.row_ids`, for audits.

`read_dataset` turns globs of raw logs (plain or gzip,
parsed and transformed on the fly by criteo.py) or of prepared parquet shards, told apart by
content, into one Ray Dataset of prepared rows. Each of the T workers reads its own disjoint
stream of it: inside Ray Train, the launcher passes the dataset as
`TorchTrainer(datasets={"train": ds})` and a worker calls `ray.train.get_dataset_shard("train")`;
outside, `worker_streams` gives the same `streaming_split` iterators. `iter_batches` turns a
stream into an iterator of torchrec `Batch` (dense [B, 13] float32, a KeyedJaggedTensor of
C1..C26, labels [B] float32), collating in Ray's prefetch thread so it overlaps training.
`memory_batches` and `synthetic_batches` build the same `Batch`es up front, in memory: the
baseline that streaming is measured against, and a file-free source for engine tests.

Multi-hot (spec.multi_hot): each id x of feature f becomes a bag of spec.bag_sizes[f] ids,
x first, then (x + offset) % rows with offsets from a seeded per-feature table indexed by
x % 2048, so the same id always gets the same bag.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recgrid.data.criteo import (
    PARQUET, PREPARED_SCHEMA, ROW_ID, CriteoDataError, check_prepared_schema, expand_inputs, iter_line_chunks,
    read_raw, sniff_format,
)
from recgrid.data.specs import DENSE_NAMES, LABEL_NAME, SPARSE_NAMES, DatasetSpec
from recgrid.data.units import Inputs, Unit

if TYPE_CHECKING:  # torch, torchrec and ray are heavy; import them where they are used
    import ray.data
    from torchrec.datasets.utils import Batch

_MULTI_HOT_TABLE = 2048  # offset rows per feature: small, yet bags of nearby ids differ
DEFAULT_NUM_CPUS_PER_TASK = 0.25  # read tasks must fit next to the training workers on a small box
DEFAULT_BLOCK_BYTES = 4 << 20


# ---------------------------------------------------------------- datasets and streams


def read_dataset(
    paths: str | Sequence[str],
    spec: DatasetSpec,
    *,
    num_cpus_per_task: float = DEFAULT_NUM_CPUS_PER_TASK,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> "ray.data.Dataset":
    """A Ray Dataset of prepared rows (PREPARED_SCHEMA) from paths, globs or directories.

    Raw Criteo logs (plain or gzip) are parsed and transformed on the fly (a bad row raises
    CriteoDataError naming file, line and field); prepared parquet is read as it is, after its
    schema and table rows are checked against `spec`. Formats are told by content and may mix.
    `num_cpus_per_task` is what each read task reserves: leave that much CPU unreserved by the
    training workers, or reading waits forever. `block_bytes` bounds a block (the unit a worker
    takes from the stream): ~4 MiB is ~16k prepared rows.
    """
    # Ray Data coalesces output into blocks of up to 128 MiB (~500k rows); streaming_split hands
    # out whole blocks, so small blocks are what lets T workers share a modest dataset evenly.
    with data_context(target_max_block_size=block_bytes):
        return _read_dataset(paths, spec, num_cpus_per_task)


@contextlib.contextmanager
def data_context(**settings):
    """Ray Data settings for the Datasets created inside; a Dataset keeps the context it was
    created under, so the settings follow it to execution and nothing else sees them.

    Operator resource reservation is off by default: it splits the CPU budget between
    operators, and recgrid's pipelines have one operator that would otherwise leave CPUs idle.
    """
    import ray.data

    settings = {"op_resource_reservation_enabled": False, **settings}
    ctx = ray.data.DataContext.get_current()
    saved = {k: getattr(ctx, k) for k in settings}
    for k, v in settings.items():
        setattr(ctx, k, v)
    try:
        yield ctx
    finally:
        for k, v in saved.items():
            setattr(ctx, k, v)


def _read_dataset(paths: str | Sequence[str], spec: DatasetSpec, num_cpus_per_task: float) -> "ray.data.Dataset":
    import ray.data

    files = expand_inputs(paths)
    items = []
    for p in files:
        fmt = sniff_format(p)
        if fmt == PARQUET:  # a footer read each: cheap, and a wrong shard fails here, not mid-epoch
            check_prepared_schema(p, pq.read_schema(p), spec)
        items.append({"path": p, "fmt": fmt})
    # One read task per file, ours rather than read_parquet's: read_parquet batches small files
    # into one task (one block, one worker's worth) and lists files in a task that takes a
    # whole CPU, which can wait forever beside training workers that hold the rest.
    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _read_files, batch_size=1, fn_kwargs={"spec": spec}, num_cpus=num_cpus_per_task,
    )


def _read_files(batch: Mapping[str, np.ndarray], spec: DatasetSpec) -> Iterator[pa.Table]:
    for path, fmt in zip(batch["path"], batch["fmt"]):
        path, fmt = str(path), str(fmt)
        if fmt == PARQUET:
            for b in pq.ParquetFile(path).iter_batches(batch_size=8192, columns=list(PREPARED_SCHEMA.names)):
                yield pa.Table.from_batches([b]).select(PREPARED_SCHEMA.names)
        else:
            for chunk in read_raw(path, spec, fmt=fmt):
                yield chunk.table


def worker_streams(ds: "ray.data.Dataset", num_workers: int, *, equal: bool = False) -> list["ray.data.DataIterator"]:
    """`num_workers` disjoint streams over one pass of `ds` (Ray Data `streaming_split`).

    equal=False: every row reaches exactly one stream, streams may differ in length.
    equal=True: streams get the same number of rows, up to num_workers - 1 rows are dropped;
    this is what Ray Train's `get_dataset_shard` does by default. All streams must be consumed
    together: one that stops pulling stalls the others.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be positive, got {num_workers}")
    return ds.streaming_split(num_workers, equal=equal)


# ---------------------------------------------------------------- collate


@functools.lru_cache(maxsize=8)
def _multi_hot_offsets(
    table_rows: tuple[int, ...], bag_sizes: tuple[int, ...], seed: int
) -> tuple[np.ndarray | None, ...]:
    out = []
    for f, (rows, bag) in enumerate(zip(table_rows, bag_sizes)):
        if bag == 1:
            out.append(None)
            continue
        rng = np.random.default_rng([seed, f])
        # offsets in [1, rows): the other ids of a bag differ from the id itself (if rows > 1)
        out.append(rng.integers(1, rows, (_MULTI_HOT_TABLE, bag - 1)) if rows > 1
                   else np.zeros((_MULTI_HOT_TABLE, bag - 1), np.int64))
    return tuple(out)


class Collator:
    """numpy batch (column name -> array) -> torchrec Batch, for one spec. Thread-safe."""

    def __init__(self, spec: DatasetSpec, multi_hot_seed: int = 0):
        self.spec = spec
        self.rows = np.array(spec.table_rows, dtype=np.int64)
        self.bags = spec.bag_sizes
        self.offsets = _multi_hot_offsets(spec.table_rows, spec.bag_sizes, multi_hot_seed)

    def __call__(self, batch: Mapping[str, np.ndarray]) -> "Batch":
        import torch
        from torchrec.datasets.utils import Batch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        labels = np.asarray(batch[LABEL_NAME])
        b = len(labels)
        dense = np.empty((b, len(DENSE_NAMES)), dtype=np.float32)
        for j, name in enumerate(DENSE_NAMES):
            dense[:, j] = batch[name]
        ids = np.empty((len(SPARSE_NAMES), b), dtype=np.int64)
        for f, name in enumerate(SPARSE_NAMES):
            ids[f] = batch[name]
        bad = (ids < 0) | (ids >= self.rows[:, None])
        if bad.any():  # an id past its table would be a silent wrong lookup (or a crash) later
            f = int(np.flatnonzero(bad.any(axis=1))[0])
            raise CriteoDataError(
                "<batch>", f"id {int(ids[f][bad[f]][0])} outside table rows [0, {self.rows[f]}) of spec "
                           f"{self.spec.name!r}; data prepared for another spec?", field=SPARSE_NAMES[f],
            )
        if self.spec.multi_hot:
            values = np.concatenate([
                ids[f] if off is None else
                ((ids[f][:, None] + np.concatenate([np.zeros((b, 1), np.int64), off[ids[f] % _MULTI_HOT_TABLE]], 1))
                 % self.rows[f]).ravel()
                for f, off in enumerate(self.offsets)
            ])
            lengths = np.repeat(np.array(self.bags, dtype=np.int32), b)
        else:
            values = ids.ravel()  # key-major: all of C1's ids, then C2's, ... as KJT lays them out
            lengths = np.ones(len(SPARSE_NAMES) * b, dtype=np.int32)
        kjt = KeyedJaggedTensor(keys=list(SPARSE_NAMES), values=torch.from_numpy(values),
                                lengths=torch.from_numpy(lengths))
        out = Batch(dense_features=torch.from_numpy(dense), sparse_features=kjt,
                    labels=torch.from_numpy(labels.astype(np.float32)))
        if ROW_ID in batch:  # carried beside the batch (Batch.to drops it): read it before moving
            out.row_ids = torch.from_numpy(np.asarray(batch[ROW_ID], dtype=np.int64))
        return out


def collate(batch: Mapping[str, np.ndarray], spec: DatasetSpec, *, multi_hot_seed: int = 0) -> "Batch":
    """One numpy batch (column name -> array of B values) as a torchrec Batch."""
    return Collator(spec, multi_hot_seed)(batch)


# ---------------------------------------------------------------- batch sources


def iter_batches(
    source: "ray.data.Dataset | ray.data.DataIterator",
    batch_size: int,
    spec: DatasetSpec,
    *,
    drop_last: bool = True,
    prefetch_batches: int = 1,
    local_shuffle_buffer_size: int | None = None,
    local_shuffle_seed: int | None = None,
    multi_hot_seed: int = 0,
    rows_per_fetch: int = 32768,
) -> Iterator["Batch"]:
    """A stream (a worker's DataIterator, or a whole Dataset) as an iterator of torchrec Batch.

    Rows come from Ray in groups of about `rows_per_fetch` (a multiple of batch_size) and are cut
    into batches here: Ray's per-batch cost (slicing and converting 40 columns) is paid per group,
    not per training batch. Measured on 2 cores with T=4 training workers (bench/data_pipeline.py):
    8192-row groups slowed the training processes' own compute by ~30%, 32768-row groups by none. Collation runs in Ray's prefetch thread, `prefetch_batches` groups
    ahead of the consumer (with more than one thread Ray may reorder groups, hence one). One call
    is one pass (one epoch) of the stream. Batches stay on CPU: call `batch.to(device)`.
    """
    from ray.data.collate_fn import NumpyBatchCollateFn

    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    collator = Collator(spec, multi_hot_seed)
    group = batch_size * max(1, rows_per_fetch // batch_size)

    class _CollateGroup(NumpyBatchCollateFn):
        def __call__(self, cols):
            n = len(cols[LABEL_NAME])
            stop = n - n % batch_size if drop_last else n  # only the stream's last group is short
            return [collator({k: v[i:i + batch_size] for k, v in cols.items()}) for i in range(0, stop, batch_size)]

    it = source.iterator() if hasattr(source, "streaming_split") else source
    groups = it.iter_torch_batches(
        batch_size=group, collate_fn=_CollateGroup(), drop_last=False, prefetch_batches=prefetch_batches,
        local_shuffle_buffer_size=local_shuffle_buffer_size, local_shuffle_seed=local_shuffle_seed, device="cpu",
    )
    return (b for g in groups for b in g)


def memory_batches(
    source: "pa.Table | ray.data.Dataset | ray.data.DataIterator | str | Sequence[str]",
    batch_size: int,
    spec: DatasetSpec,
    *,
    drop_last: bool = True,
    multi_hot_seed: int = 0,
) -> list["Batch"]:
    """Every batch of one pass of `source`, collated up front and held in memory.

    `source` is an arrow table of prepared rows, a Dataset or DataIterator, or paths/globs (read
    with read_dataset). Iterate the list (or itertools.cycle it) as a stream-free baseline.
    """
    collator = Collator(spec, multi_hot_seed)
    if isinstance(source, pa.Table):
        cols = {n: source.column(n).to_numpy() for n in PREPARED_SCHEMA.names}
        stop = len(source) - (len(source) % batch_size if drop_last else 0)
        return [collator({n: c[i:i + batch_size] for n, c in cols.items()}) for i in range(0, stop, batch_size)]
    if isinstance(source, (str, list, tuple)):
        source = read_dataset(source, spec)
    return list(iter_batches(source, batch_size, spec, drop_last=drop_last, multi_hot_seed=multi_hot_seed))


def synthetic_batches(
    spec: DatasetSpec, batch_size: int, num_batches: int, *, seed: int = 0, stream: int = 0
) -> list["Batch"]:
    """`num_batches` in-memory batches of synth's planted-signal rows, no files and no Ray.

    Same (spec, seed) gives the same hidden model; `stream` picks an independent draw from it
    (e.g. 0 for training, 1 for evaluation).
    """
    from recgrid.data.synth import synth_table

    return memory_batches(synth_table(spec, batch_size * num_batches, seed, stream=stream), batch_size, spec)


# ---------------------------------------------------------------- row ranges (the trainer's input)


def scan_inputs(patterns: str | Sequence[str], spec: DatasetSpec | None = None) -> Inputs:
    """The files named by `patterns`, in order, with their row counts.

    Parquet shards are checked against `spec` and counted from their footers; raw logs (plain or
    gzip) are counted line by line, which reads them once.
    """
    files = expand_inputs(patterns)
    rows = []
    for path in files:
        fmt = sniff_format(path)
        if fmt == PARQUET:
            meta = pq.read_metadata(path)
            check_prepared_schema(path, meta.schema.to_arrow_schema(), spec)
            rows.append(meta.num_rows)
        else:
            rows.append(sum(chunk.lines for chunk in iter_line_chunks(path, fmt)))
    return Inputs(tuple(files), tuple(rows))


def read_unit(path: str, unit: Unit, spec: DatasetSpec, fmt: str | None = None) -> Iterator[pa.Table]:
    """Rows [unit.start, unit.end) of `path` as prepared tables, in file order (with ROW_ID
    where the file has it). Parquet skips whole row groups before the range; raw logs are
    parsed from the top, so a range deep inside a raw file costs a read of what precedes it."""
    fmt = fmt or sniff_format(path)
    offset = 0  # file row of the next table's first row
    if fmt == PARQUET:
        f = pq.ParquetFile(path)
        names = [n for n in (*PREPARED_SCHEMA.names, ROW_ID) if n in f.schema_arrow.names]
        groups, start = [], 0  # the row groups overlapping the range; `offset`: the first one's first row
        for g in range(f.metadata.num_row_groups):
            n = f.metadata.row_group(g).num_rows
            if start + n > unit.start and start < unit.end:
                if not groups:
                    offset = start
                groups.append(g)
            start += n
        tables = (f.read_row_group(g, columns=names) for g in groups)
    else:
        tables = (chunk.table for chunk in read_raw(path, spec, fmt=fmt))
    for table in tables:
        n = table.num_rows
        lo, hi = max(unit.start - offset, 0), min(unit.end - offset, n)
        offset += n
        if hi > lo:
            yield table.slice(lo, hi - lo)
        if offset >= unit.end:
            return


def unit_batches(inputs: Inputs, units: Sequence[Unit], spec: DatasetSpec, batch_size: int, *,
                 drop_last: bool = True, prefetch: int = 4, multi_hot_seed: int = 0) -> Iterator["Batch"]:
    """The rows of `units`, in order, as torchrec Batches of `batch_size` rows.

    Reading and collating run in a prefetch thread up to `prefetch` batches ahead. A read error
    (a bad raw row, a missing file) is raised in the consumer, naming file, line and field.
    With `drop_last`, a final short batch is dropped (the epoch plan gives training parts of
    whole batches, so none is); evaluation keeps it.
    """
    import queue
    import threading

    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    collator = Collator(spec, multi_hot_seed)
    formats: dict[int, str] = {}
    out: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            carry: dict[str, np.ndarray] | None = None  # fewer than batch_size rows left over
            for unit in units:
                path = inputs.files[unit.file]
                fmt = formats.setdefault(unit.file, sniff_format(path))
                for table in read_unit(path, unit, spec, fmt):
                    cols = _columns(table)  # one conversion per table, then numpy slices
                    if carry is not None:
                        cols = {k: np.concatenate([carry[k], v]) for k, v in cols.items()}
                    n, i = len(cols[LABEL_NAME]), 0
                    while n - i >= batch_size:
                        if not put(collator({k: v[i:i + batch_size] for k, v in cols.items()})):
                            return
                        i += batch_size
                    carry = {k: v[i:] for k, v in cols.items()} if i < n else None
            if carry is not None and not drop_last:
                put(collator(carry))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, who raises it
            put(e)
        finally:
            put(done)

    threading.Thread(target=produce, name="recgrid-reader", daemon=True).start()
    try:
        while True:
            item = out.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def _columns(table: pa.Table) -> dict[str, np.ndarray]:
    return {name: table.column(name).to_numpy() for name in table.column_names}
