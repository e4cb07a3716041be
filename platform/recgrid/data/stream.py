"""Criteo rows into training: every training and evaluation batch comes out of Ray Data.

Owns what the training loop consumes (`TrainData`, `EvalData`) and how it is made. A worker's
input is the row ranges (`data.units.Unit`) the epoch plan gives it, in order. `ray_batches`
turns them into a Ray Dataset of the worker's own (`UnitsDatasource`): its read tasks are
consecutive runs of whole batches of those rows, cut from the units in order, and the dataset
runs with `preserve_order`, so the k-th batch out is the k-th batch of the worker's rows, and
the data position stays a step count that a restore seeks back to (`data.units` says why Ray
Data's `streaming_split` cannot be used for that). A read task reads its rows (parquet: only the
row groups it needs; raw TSV or gzip logs: parsed and transformed by `criteo.read_raw`, so no
`prepare` step is needed), and a `map_batches` stage fused with it collates them
(`collate_block`): dense [B, 13] float32, KeyedJaggedTensor values int64 and lengths int32
key-major (multi-hot bags expanded), labels float32, row ids where the files carry them. Both
run as Ray tasks reserving `DEFAULT_NUM_CPUS_PER_TASK` CPU each, which Ray may place on any node
with CPUs, including nodes with no training worker. The training process only iterates the
prefetched blocks and wraps each batch's arrays with `torch.from_numpy` into a torchrec
`Batch` (`batches_of_block`; on a CUDA worker, in pinned memory, one copy per block): no per-row or
per-feature work is left in it.

`scan_inputs` counts the rows of the job's files once (parquet footers; raw logs are counted
line by line). `read_dataset` (whole-file checks) reads globs of raw logs or prepared
parquet into one Dataset of prepared rows. `local_batches` runs the same read tasks in the
calling process, without Ray (offline tools: `recgrid towers`). `memory_batches` and
`synthetic_batches` build the same `Batch`es up front, in memory: the baseline that streaming
is measured against, and a file-free source for engine tests.

Multi-hot (spec.multi_hot): each id x of feature f becomes a bag of spec.bag_sizes[f] ids,
x first, then (x + offset) % rows with offsets from a seeded per-feature table indexed by
x % 2048, so the same id always gets the same bag (`data.transforms.expand_bags`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from recgrid.data.specs import Compression
from recgrid.data.criteo import (
    PARQUET, PREPARED_SCHEMA, ROW_ID, CriteoDataError, check_prepared_rows, check_prepared_schema, expand_inputs,
    iter_line_chunks, parquet_file, read_raw, read_row_group, sniff_format,
)
from recgrid.data.specs import DENSE_NAMES, LABEL_NAME, SPARSE_NAMES, DatasetSpec, head_from_counts, merge_counts
from recgrid.data.synth import synth_table
from recgrid.data.transforms import bag_offsets, expand_bags
from recgrid.data.units import DataCursor, EpochPlan, Inputs, Unit, even_sizes, split_rows, take_rows

if TYPE_CHECKING:  # torch, torchrec and ray are heavy; import them where they are used
    import ray.data
    from torchrec.datasets.utils import Batch

DEFAULT_NUM_CPUS_PER_TASK = 0.25  # read tasks must fit next to the training workers on a small box
DEFAULT_BLOCK_BYTES = 4 << 20
DEFAULT_ROWS_PER_TASK = 32_768  # rows a read task reads and collates: per-task and per-block costs amortised
_EXPAND_ROWS = 2048  # rows whose multi-hot bags are expanded at once (see collate_block)
_BAGS_VALUES = 1 << 20  # a feature's table of every id's bag is kept up to this many values (8 MiB)
DEFAULT_PREFETCH_BLOCKS = 2  # collated blocks the training process holds ready ahead of the loop


# ---------------------------------------------------------------- prepared rows as one Dataset (prepare, checks)


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
    training workers, or reading waits forever. `block_bytes` bounds a block: ~4 MiB is ~16k
    prepared rows. Training does not read through this Dataset (`ray_batches` does); it checks
    files whole (tests of `prepare`'s output, of bad inputs).
    """
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
            check_prepared_schema(p, parquet_file(p).schema_arrow, spec)
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
            f, row = parquet_file(path), 0
            for g in range(f.metadata.num_row_groups):
                table = read_row_group(f, path, g, PREPARED_SCHEMA.names).select(PREPARED_SCHEMA.names)
                check_prepared_rows(table, path, row, spec)
                row += table.num_rows
                yield table
        else:
            for chunk in read_raw(path, spec, fmt=fmt):
                yield chunk.table


# ---------------------------------------------------------------- collate (in Ray Data tasks)


@functools.lru_cache(maxsize=8)
def _bag_tables(table_rows: tuple[int, ...], bag_sizes: tuple[int, ...],
                seed: int) -> tuple[tuple[np.ndarray | None, np.ndarray | None], ...]:
    """Per feature (bags, offsets): `bags` [rows, bag] int64, every id's whole bag, where rows x bag
    is at most _BAGS_VALUES (a bag is then one gathered row); else `offsets`, the [2048, bag]
    uint32 offsets of `transforms.bag_offsets`, expanded per id (`expand_bags`); both None for
    bags of one. `bags` is `expand_bags` of every id, so both ways give the same bag."""
    out = []
    for f, (rows, bag) in enumerate(zip(table_rows, bag_sizes)):
        offsets = bag_offsets(rows, bag, seed, f)
        if offsets is not None and rows * bag <= _BAGS_VALUES:
            out.append((expand_bags(np.arange(rows, dtype=np.uint32), offsets, rows).astype(np.int64), None))
        else:
            out.append((None, offsets))
    return tuple(out)


def collate_block(cols: Mapping[str, np.ndarray], spec: DatasetSpec, batch_size: int,
                  multi_hot_seed: int = 0, compression: Compression | None = None) -> dict[str, np.ndarray]:
    """Prepared rows (column name -> array of n values) as n / batch_size ready batches.

    n is a multiple of batch_size, or smaller than it (a last, short batch: one batch of n).
    Every output column holds one entry per batch: "dense" [nb, B, 13] float32, "labels" [nb, B]
    float32, "values" [nb, V] int64 and "lengths" [nb, 26 * B] int32 of the KeyedJaggedTensor of
    C1..C26, key-major (V = B * sum of the bag sizes), and "row_ids" [nb, B] int64 when the rows
    carry them. Array operations over the whole block: no loop over rows or batches (multi-hot
    loops over the 26 features, each expanded for every row of the block at once: one gathered
    row of offsets per bag is faster than one array operation that gathers every value).

    With `compression` (QR, `data.specs`) the compressed features' ids are split into their
    quotient, remainder and head features (`Compression.apply`): "values" is then [nb, V] padded,
    "lengths" [nb, len(keys) * B] of the expanded keys, and "value_counts" [nb] says how many of
    a batch's values are real.
    """
    labels = np.asarray(cols[LABEL_NAME])
    n = len(labels)
    b = batch_size if n >= batch_size else n
    if n == 0 or n % b:
        raise ValueError(f"a block of {n} rows is not whole batches of {batch_size}")
    nb = n // b
    ids = np.stack([np.asarray(cols[name], dtype=np.int64) for name in SPARSE_NAMES])  # [26, n]
    rows = np.asarray(spec.table_rows, dtype=np.int64)
    # one pass: as uint64 a negative id is above every table's rows
    if (ids.view(np.uint64).max(axis=1, initial=0) >= rows.astype(np.uint64)).any():
        # an id past its table would be a silent wrong lookup (or a crash) later
        bad = (ids < 0) | (ids >= rows[:, None])
        f = int(np.flatnonzero(bad.any(axis=1))[0])
        raise CriteoDataError(
            "<batch>", f"id {int(ids[f][bad[f]][0])} outside table rows [0, {rows[f]}) of spec "
                       f"{spec.name!r}; data prepared for another spec?", field=SPARSE_NAMES[f],
        )
    bags = spec.bag_sizes
    if spec.multi_hot:
        # per feature, over the whole block: a bag is one gathered row of the feature's offset
        # table plus the id, reduced mod rows (`transforms.expand_bags`, in uint32)
        if max(spec.table_rows) >= 1 << 31:
            raise ValueError(f"spec {spec.name!r}: multi-hot expansion needs table rows < 2^31")
        values = np.empty((nb, b * sum(bags)), np.int64)
        tables = _bag_tables(spec.table_rows, bags, multi_hot_seed)
        ids32 = ids.astype(np.uint32) if any(o is not None for _, o in tables) else None
        step = max(1, _EXPAND_ROWS // b)  # batches expanded at once: their values stay in cache
        for j in range(0, nb, step):
            k = min(step, nb - j)
            start = 0
            for f, (whole, offsets) in enumerate(tables):
                out = values[j:j + k, start:start + b * bags[f]]
                if whole is not None:  # ids were checked against the table's rows above: no bounds check
                    out[...] = whole.take(ids[f, j * b:(j + k) * b], axis=0, mode="clip").reshape(k, -1)
                elif offsets is not None:
                    out[...] = expand_bags(ids32[f, j * b:(j + k) * b], offsets, int(rows[f])).reshape(k, -1)
                else:
                    out[...] = ids[f, j * b:(j + k) * b].reshape(k, b)
                start += b * bags[f]
    else:  # key-major: all of C1's ids of a batch, then C2's, ... as the KJT lays them out
        values = ids.reshape(len(SPARSE_NAMES), nb, b).transpose(1, 0, 2).reshape(nb, -1)
    lengths = np.broadcast_to(np.repeat(np.asarray(bags, np.int32), b), (nb, b * len(SPARSE_NAMES)))
    counts = None
    if compression is not None:
        values, lengths, counts = compression.apply(values, spec, b)
    out = {
        "dense": np.stack([np.asarray(cols[name], dtype=np.float32) for name in DENSE_NAMES], axis=1).reshape(nb, b, -1),
        "labels": labels.astype(np.float32).reshape(nb, b),
        "values": values,
        "lengths": np.ascontiguousarray(lengths),
    }
    if counts is not None:
        out["value_counts"] = counts
    if ROW_ID in cols:
        out["row_ids"] = np.asarray(cols[ROW_ID], dtype=np.int64).reshape(nb, b)
    return out


def batches_of_block(block: Mapping[str, np.ndarray], pin: bool = False,
                     keys: Sequence[str] = SPARSE_NAMES) -> Iterator["Batch"]:
    """The torchrec Batches of one collated block: views of its arrays, wrapped, nothing computed.
    `keys`: the KeyedJaggedTensor's keys (a compressed job's: `Compression.keys`).
    With `pin` (a CUDA worker: `engine.device.pin_batches`) the block's arrays are first copied
    once into pinned memory, so each batch's `non_blocking` copy to the GPU is asynchronous."""
    import torch
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = list(keys)
    counts = block["value_counts"].tolist() if "value_counts" in block else None  # QR: padded values
    # the block's arrays are read-only views of Ray's object store (a training batch is never written)
    dense, labels, values, lengths = (torch.from_numpy(_writable(block[k])) for k in ("dense", "labels", "values", "lengths"))
    row_ids = torch.from_numpy(_writable(block["row_ids"])) if "row_ids" in block else None
    if pin:  # one copy per block (not per batch); row ids stay on the host, where audits read them
        dense, labels, values, lengths = (t.pin_memory() for t in (dense, labels, values, lengths))
    for j in range(len(labels)):
        out = Batch(dense_features=dense[j], labels=labels[j],
                    sparse_features=KeyedJaggedTensor(keys=keys, values=values[j] if counts is None
                                                      else values[j, :counts[j]], lengths=lengths[j]))
        if row_ids is not None:  # carried beside the batch (Batch.to drops it): read it before moving
            out.row_ids = row_ids[j]
        yield out


def _writable(a: np.ndarray) -> np.ndarray:
    """`a` marked writable without a copy (torch.from_numpy warns on read-only arrays)."""
    if not a.flags.writeable:
        a = a.view()
        try:
            a.flags.writeable = True
        except ValueError:  # a buffer that cannot be made writable: copy
            a = a.copy()
    return a


def collate(batch: Mapping[str, np.ndarray], spec: DatasetSpec, *, multi_hot_seed: int = 0,
            compression: Compression | None = None) -> "Batch":
    """One numpy batch (column name -> array of B values) as a torchrec Batch."""
    return next(batches_of_block(collate_block(batch, spec, len(batch[LABEL_NAME]), multi_hot_seed, compression),
                                 keys=_keys(spec, compression)))


def _keys(spec: DatasetSpec, compression: Compression | None) -> list[str]:
    return list(SPARSE_NAMES) if compression is None else compression.keys(spec)


# ---------------------------------------------------------------- a worker's stream (Ray Data)


def memory_batches(source: "pa.Table | str | Sequence[str]", batch_size: int, spec: DatasetSpec, *,
                   drop_last: bool = True, multi_hot_seed: int = 0,
                   compression: Compression | None = None) -> list["Batch"]:
    """Every batch of one pass of `source`, collated up front and held in memory (no Ray).

    `source` is an arrow table of prepared rows, or paths/globs of raw logs or prepared parquet
    (read in order). Iterate the list (or itertools.cycle it) as a stream-free baseline.
    """
    if not isinstance(source, pa.Table):
        inputs = scan_inputs(source, spec)
        tables = [t for f, n in enumerate(inputs.rows) for t in read_unit(inputs.files[f], Unit(f, 0, n), spec)]
        source = _concat(tables)
    cols = {n: source.column(n).to_numpy() for n in source.column_names}
    whole = len(source) - len(source) % batch_size
    out = list(batches_of_block(collate_block({k: v[:whole] for k, v in cols.items()}, spec, batch_size,
                                              multi_hot_seed, compression), keys=_keys(spec, compression))) \
        if whole else []
    if whole < len(source) and not drop_last:
        out.append(collate({k: v[whole:] for k, v in cols.items()}, spec, multi_hot_seed=multi_hot_seed,
                           compression=compression))
    return out


def synthetic_batches(
    spec: DatasetSpec, batch_size: int, num_batches: int, *, seed: int = 0, stream: int = 0,
    compression: Compression | None = None,
) -> list["Batch"]:
    """`num_batches` in-memory batches of synth's planted-signal rows, no files and no Ray.

    Same (spec, seed) gives the same hidden model; `stream` picks an independent draw from it
    (e.g. 0 for training, 1 for evaluation).
    """
    return memory_batches(synth_table(spec, batch_size * num_batches, seed, stream=stream), batch_size, spec,
                          compression=compression)


def _concat(tables: Sequence[pa.Table]) -> pa.Table:
    """Prepared tables as one; a row id column survives only if every table has it."""
    present = [set(t.column_names) for t in tables]
    names = [n for n in (*PREPARED_SCHEMA.names, ROW_ID) if all(n in p for p in present)]
    return pa.concat_tables([t.select(names) for t in tables]) if tables else PREPARED_SCHEMA.empty_table()


# ---------------------------------------------------------------- a worker's stream (Ray Data)


def read_tasks(units: Sequence[Unit], batch_size: int, *, drop_last: bool = True,
               rows_per_task: int = DEFAULT_ROWS_PER_TASK) -> list[list[Unit]]:
    """The rows of `units` cut into consecutive read tasks of whole batches, in order.

    A task holds `rows_per_task` rows rounded down to whole batches (at least one). Without
    `drop_last` a final short batch is a task of its own (a block holds batches of one size).
    """
    total = sum(u.rows for u in units)
    per_task = max(1, rows_per_task // batch_size) * batch_size
    whole = total - total % batch_size
    bounds = [(s, min(per_task, whole - s)) for s in range(0, whole, per_task)]
    if whole < total and not drop_last:
        bounds.append((whole, total - whole))
    out, rest, at = [], list(units), 0
    for start, count in bounds:  # walk the units once: each task starts where the last one ended
        rest = take_rows(rest, start - at)
        out.append(take_rows(rest, 0, count))
        at = start
    return out


@functools.lru_cache(maxsize=1)
def _datasource_class() -> type:
    """`UnitsDatasource`, defined on first use (ray.data is a heavy import)."""
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata

    class UnitsDatasource(Datasource):
        """One worker's rows as read tasks of whole batches (`read_tasks`), in order."""

        def __init__(self, inputs: Inputs, units: Sequence[Unit], spec: DatasetSpec, batch_size: int, *,
                     drop_last: bool, rows_per_task: int) -> None:
            super().__init__()
            self.inputs, self.spec = inputs, spec
            self.tasks = read_tasks(units, batch_size, drop_last=drop_last, rows_per_task=rows_per_task)

        def get_name(self) -> str:
            return "ReadUnits"

        def estimate_inmemory_data_size(self) -> int | None:
            return None  # no estimate: Ray Data then keeps one block per read task

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                           data_context: Any = None) -> list[Any]:
            # every task, whatever the parallelism asked: a task is whole batches, in order
            return [ReadTask(functools.partial(read_task_table, self.inputs, task, self.spec),
                             BlockMetadata(num_rows=sum(u.rows for u in task), size_bytes=None, exec_stats=None,
                                           input_files=tuple(sorted({self.inputs.files[u.file] for u in task}))))
                    for task in self.tasks]

    return UnitsDatasource


def UnitsDatasource(inputs: Inputs, units: Sequence[Unit], spec: DatasetSpec, batch_size: int, *,  # noqa: N802
                    drop_last: bool = True, rows_per_task: int = DEFAULT_ROWS_PER_TASK) -> Any:
    """A `ray.data.Datasource` of one worker's rows: its read tasks are consecutive runs of whole
    batches of `units` (`read_tasks`), in order; each reads its ranges with `read_unit`."""
    return _datasource_class()(inputs, units, spec, batch_size, drop_last=drop_last, rows_per_task=rows_per_task)


def read_task_table(inputs: Inputs, units: Sequence[Unit], spec: DatasetSpec) -> list[pa.Table]:
    """One read task: its ranges' prepared rows, as one table (one block)."""
    formats: dict[int, str] = {}
    tables = []
    for unit in units:
        fmt = formats.setdefault(unit.file, sniff_format(inputs.files[unit.file]))
        tables += read_unit(inputs.files[unit.file], unit, spec, fmt)
    return [_concat(tables).combine_chunks()]


def ray_batches(inputs: Inputs, units: Sequence[Unit], spec: DatasetSpec, batch_size: int, *,
                drop_last: bool = True, multi_hot_seed: int = 0, rows_per_task: int = DEFAULT_ROWS_PER_TASK,
                prefetch_blocks: int = DEFAULT_PREFETCH_BLOCKS,
                num_cpus_per_task: float = DEFAULT_NUM_CPUS_PER_TASK, stats: list | None = None,
                pin: bool = False, compression: Compression | None = None) -> Iterator["Batch"]:
    """The rows of `units`, in order, as torchrec Batches of `batch_size` rows, out of Ray Data.

    Read tasks (each `rows_per_task` rows, rounded to whole batches) read, parse and collate in
    Ray tasks reserving `num_cpus_per_task` CPU; up to `prefetch_blocks` collated blocks wait
    ready in this process. A read error (a bad raw row, a missing file) is raised here, naming
    file, line and field. With `drop_last` a final short batch is dropped (training parts are
    whole batches, so none is); evaluation keeps it. `stats`, if given, gets the Dataset's
    execution stats appended when the stream ends or is closed. With `pin` the batches come in
    pinned host memory (`batches_of_block`). With `compression` the read tasks also apply QR's id
    transform (`collate_block`).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    ds = units_dataset(inputs, units, spec, batch_size, drop_last=drop_last, multi_hot_seed=multi_hot_seed,
                       rows_per_task=rows_per_task, num_cpus_per_task=num_cpus_per_task, compression=compression)
    if ds is None:  # no whole batch: an empty generator (the loop closes what it is given)
        return (b for b in ())
    return _iterate(ds, prefetch_blocks, stats, pin, _keys(spec, compression))


def local_batches(inputs: Inputs, units: Sequence[Unit], spec: DatasetSpec, batch_size: int, *,
                  drop_last: bool = True, multi_hot_seed: int = 0,
                  rows_per_task: int = DEFAULT_ROWS_PER_TASK,
                  compression: Compression | None = None) -> Iterator["Batch"]:
    """`ray_batches`' read tasks run here, one after another, without Ray: for offline tools in
    one process (`recgrid towers`). Training and evaluation read through `ray_batches`."""
    for task in read_tasks(units, batch_size, drop_last=drop_last, rows_per_task=rows_per_task):
        (table,) = read_task_table(inputs, task, spec)
        cols = {n: table.column(n).to_numpy() for n in table.column_names}
        yield from batches_of_block(collate_block(cols, spec, batch_size, multi_hot_seed, compression),
                                    keys=_keys(spec, compression))


def _iterate(ds: "ray.data.Dataset", prefetch_blocks: int, stats: list | None, pin: bool = False,
             keys: Sequence[str] = SPARSE_NAMES) -> Iterator["Batch"]:
    blocks = ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=prefetch_blocks)
    try:
        for block in blocks:
            yield from batches_of_block(block, pin, keys)
    except Exception as e:  # a bad row's error as the read task raised it, not Ray's wrapping of it
        data_error = _data_error(e)
        if data_error is None:
            raise
        raise data_error from None
    finally:
        close = getattr(blocks, "close", None)
        if close is not None:
            close()  # stops the stream's executor when the loop leaves early
        if stats is not None:
            text = ds.stats()
            if text:
                stats.append(text)


def _data_error(e: BaseException) -> CriteoDataError | None:
    """The CriteoDataError a Ray task raised, found inside Ray's exceptions (None if there is none)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, CriteoDataError):
            return e
        e = getattr(e, "cause", None) or e.__cause__
    return None


def units_dataset(inputs: Inputs, units: Sequence[Unit], spec: DatasetSpec, batch_size: int, *,
                  drop_last: bool = True, multi_hot_seed: int = 0, rows_per_task: int = DEFAULT_ROWS_PER_TASK,
                  num_cpus_per_task: float = DEFAULT_NUM_CPUS_PER_TASK,
                  compression: Compression | None = None) -> "ray.data.Dataset | None":
    """The Ray Dataset of collated batches of `units`' rows, in order (None: no batch at all)."""
    import ray.data

    source = UnitsDatasource(inputs, units, spec, batch_size, drop_last=drop_last, rows_per_task=rows_per_task)
    if not source.tasks:
        return None
    with ordered_context():
        ds = ray.data.read_datasource(source, override_num_blocks=len(source.tasks), num_cpus=num_cpus_per_task)
        return ds.map_batches(collate_block, batch_size=None, batch_format="numpy", zero_copy_batch=True,
                              num_cpus=num_cpus_per_task,
                              fn_kwargs={"spec": spec, "batch_size": batch_size, "multi_hot_seed": multi_hot_seed,
                                         "compression": compression})


@contextlib.contextmanager
def ordered_context():
    """The Ray Data settings of a worker's stream, for the Datasets created inside (a Dataset
    keeps the context it was created under): blocks come out in read-task order
    (`preserve_order`), a read task's output stays one block (a block holds whole batches, so no
    size limit may cut one), no progress bars."""
    import logging

    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)  # no line per stream started and finished
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # nor "progress bars disabled"
    ctx = ray.data.DataContext.get_current()
    options = copy.deepcopy(ctx.execution_options)
    options.preserve_order = True
    with data_context(execution_options=options, target_max_block_size=1 << 34, enable_progress_bars=False,
                      print_on_execution_start=False):
        yield


# ---------------------------------------------------------------- id counts (QR's head cache)


def id_counts(inputs: Inputs, spec: DatasetSpec, features: Sequence[int], *, multi_hot_seed: int = 0,
              num_cpus_per_task: float = DEFAULT_NUM_CPUS_PER_TASK,
              rows_per_task: int = DEFAULT_ROWS_PER_TASK) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """How often each id of `features` (indices into C1..C26) is looked up over every row of
    `inputs`: feature -> (distinct ids, counts), multi-hot bags expanded as training expands them.
    One Ray Data pass: the read tasks `ray_batches` uses, each followed by a count of its block's
    ids (numpy, per feature); this process adds the blocks' counts up."""
    import ray.data

    source = UnitsDatasource(inputs, inputs.units(), spec, 1, drop_last=False, rows_per_task=rows_per_task)
    found: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {f: [] for f in features}
    if not source.tasks:
        return {f: merge_counts([]) for f in features}
    with ordered_context():
        ds = ray.data.read_datasource(source, override_num_blocks=len(source.tasks), num_cpus=num_cpus_per_task)
        ds = ds.map_batches(_count_block, batch_size=None, batch_format="numpy", zero_copy_batch=True,
                            num_cpus=num_cpus_per_task,
                            fn_kwargs={"spec": spec, "features": tuple(features), "multi_hot_seed": multi_hot_seed})
    for block in ds.iter_batches(batch_size=None, batch_format="numpy"):
        feature = block["feature"]
        for f in features:
            mine = feature == f
            found[f].append((block["id"][mine], block["count"][mine]))
    return {f: merge_counts(pairs) for f, pairs in found.items()}


def _count_block(cols: Mapping[str, np.ndarray], spec: DatasetSpec, features: tuple[int, ...],
                 multi_hot_seed: int) -> dict[str, np.ndarray]:
    """One block's (feature, id, count) rows for `features`: its ids collated as training collates them."""
    n = len(cols[LABEL_NAME])
    values = collate_block(cols, spec, n, multi_hot_seed)["values"][0]  # key-major, one batch of n rows
    bounds = np.cumsum([0, *(n * bag for bag in spec.bag_sizes)])
    out = {"feature": [], "id": [], "count": []}
    for f in features:
        ids, counts = np.unique(values[bounds[f]:bounds[f + 1]], return_counts=True)
        out["feature"].append(np.full(len(ids), f, np.int16))
        out["id"].append(ids)
        out["count"].append(counts.astype(np.int64))
    return {k: np.concatenate(v) for k, v in out.items()}


def head_ids(inputs: Inputs, spec: DatasetSpec, compression: Compression, *,
             multi_hot_seed: int = 0) -> dict[int, np.ndarray]:
    """The head cache of every compressed feature (`Compression.features`): its `head_rows` most
    frequent ids over `inputs`, or the fewest covering `head_coverage` of its lookups (sorted)."""
    counts = id_counts(inputs, spec, compression.features(spec), multi_hot_seed=multi_hot_seed)
    return {f: head_from_counts(ids, n, compression.head_rows, compression.head_coverage)
            for f, (ids, n) in counts.items()}


# ---------------------------------------------------------------- files and row ranges


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
            meta = parquet_file(path).metadata
            check_prepared_schema(path, meta.schema.to_arrow_schema(), spec)
            rows.append(meta.num_rows)
        else:
            rows.append(sum(chunk.lines for chunk in iter_line_chunks(path, fmt)))
    return Inputs(tuple(files), tuple(rows))


def read_unit(path: str, unit: Unit, spec: DatasetSpec, fmt: str | None = None) -> Iterator[pa.Table]:
    """Rows [unit.start, unit.end) of `path` as prepared tables, in file order (with ROW_ID
    where the file has it). Parquet skips whole row groups before the range; raw logs are
    parsed from the top, so a range deep inside a raw file costs a read of what precedes it.
    A parquet row that training's transforms cannot have made, or a corrupt row group, stops the
    read with a CriteoDataError naming the file, the row and the field (`check_prepared_rows`)."""
    fmt = fmt or sniff_format(path)
    offset = 0  # file row of the next table's first row
    parquet = fmt == PARQUET
    if parquet:
        f = parquet_file(path)
        present = set(f.schema_arrow.names)
        names = [n for n in (*PREPARED_SCHEMA.names, ROW_ID) if n in present]
        groups, start = [], 0  # the row groups overlapping the range; `offset`: the first one's first row
        for g in range(f.metadata.num_row_groups):
            n = f.metadata.row_group(g).num_rows
            if start + n > unit.start and start < unit.end:
                if not groups:
                    offset = start
                groups.append(g)
            start += n
        tables = (read_row_group(f, path, g, names) for g in groups)
    else:
        tables = (chunk.table for chunk in read_raw(path, spec, fmt=fmt))
    for table in tables:
        n = table.num_rows
        lo, hi = max(unit.start - offset, 0), min(unit.end - offset, n)
        if hi > lo:
            rows = table.slice(lo, hi - lo)
            if parquet:  # raw rows were checked as they were parsed
                check_prepared_rows(rows, path, offset + lo, spec)
            yield rows
        offset += n
        if offset >= unit.end:
            return




# ---------------------------------------------------------------- what the training loop consumes


@dataclass
class TrainData:
    """A worker's training input: the job's epoch plan, read for this worker's part of it out of Ray
    Data. `stats` collects the execution stats of every stream it made."""

    plan: EpochPlan
    spec: DatasetSpec
    rank: int  # this worker's rank among the workers that train
    workers: int  # how many train
    stats: list[str] = field(default_factory=list, compare=False, repr=False)
    pin: bool = False  # batches in pinned memory (a CUDA worker: `engine.device.pin_batches`)
    compression: Compression | None = None  # QR's id transform, applied in the read tasks

    def segment_batches(self, cursor: DataCursor) -> tuple[int, Iterator[Any]]:
        """(steps left in the cursor's segment, the batches of this worker's rest of it)."""
        seg = self.plan.segment(cursor, self.workers)
        if seg.steps_total == 0:
            raise RuntimeError(
                f"epoch {cursor.epoch} holds {sum(u.rows for u in seg.units):,} rows, fewer than one step of "
                f"{self.workers} workers x {self.plan.batch_size} rows; use more data or a smaller train.batch_size")
        part = seg.part(self.rank, cursor.steps)
        return seg.steps_total - cursor.steps, ray_batches(self.plan.inputs, part, self.spec, self.plan.batch_size,
                                                           stats=self.stats, pin=self.pin,
                                                           compression=self.compression)


@dataclass
class EvalData:
    """The evaluation files, split over the workers by rows (every row once, parts may differ by one)."""

    inputs: Inputs
    spec: DatasetSpec
    batch_size: int
    rank: int
    workers: int
    stats: list[str] = field(default_factory=list, compare=False, repr=False)
    pin: bool = False  # batches in pinned memory (a CUDA worker: `engine.device.pin_batches`)
    compression: Compression | None = None  # QR's id transform, applied in the read tasks

    def batches(self) -> Iterator[Any]:
        units = self.inputs.units()
        part = split_rows(units, even_sizes(self.inputs.total_rows, self.workers))[self.rank]
        return ray_batches(self.inputs, part, self.spec, self.batch_size, drop_last=False, stats=self.stats,
                           pin=self.pin, compression=self.compression)


def stats_text(*sources: TrainData | EvalData | None) -> str:
    """Ray Data's execution stats of every stream of `sources`, one section each (run artifact)."""
    parts = []
    for src in sources:
        if src is None:
            continue
        kind = "training" if isinstance(src, TrainData) else "evaluation"
        parts += [f"=== {kind} stream {i} ===\n{text}" for i, text in enumerate(src.stats)]
    return "\n\n".join(parts) + "\n"
