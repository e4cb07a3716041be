"""`recgrid prepare`: raw Criteo TSV / gzip -> prepared parquet shards, on Ray Data.

Owns: cutting inputs into units of work (a plain file into parts of --rows-per-file lines,
planned in parallel so one big file such as Kaggle's train.txt still spreads over the
cluster; a gzip file whole, its parts cut as it streams), shard naming and resume, the
bad-row budget, and the progress and final lines. Parsing and transforms are criteo.py's.

Resume: a shard exists under its final name only once complete (it is written under a
temporary name and renamed), and its footer records the input (path, size, mtime), the
line range and the table rows it was made with. A rerun skips shards that match and stops
on shards that do not, rather than mixing two versions of the data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from recgrid.cluster import ClusterError, connect
from recgrid.data.criteo import (
    PREPARED_ROW_GROUP_ROWS, PREPARED_SCHEMA, TSV, TSV_GZ, CriteoDataError, expand_inputs, iter_line_chunks,
    line_part_offsets, parse_lines, prepared_metadata, prepared_writer, sniff_format,
)
from recgrid.data.stream import data_context
from recgrid.data.specs import DatasetSpec, SpecError, get_spec

DEFAULT_ROWS_PER_FILE = 1_000_000
SOURCE_KEY = b"recgrid.source"  # parquet footer: where a shard's rows came from
TMP_PREFIX = ".tmp-"
LOCAL_SCAN_BYTES = 1 << 30  # below this, plain inputs are cut into parts by the driver itself


@dataclass
class PrepareResult:
    """What a prepare run did. rows and bad_rows count every shard, also ones a previous run wrote."""

    rows: int = 0
    bad_rows: int = 0
    shards_written: int = 0
    shards_skipped: int = 0
    seconds: float = 0.0
    rows_this_run: int = 0
    cpu_seconds: float = 0.0  # the units' CPU time in their tasks (this run's)
    examples: list[str] = field(default_factory=list)

    @property
    def rows_per_second(self) -> float:
        return self.rows_this_run / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (f"prepared {self.rows:,} rows, {self.bad_rows:,} bad rows, {self.seconds:.1f} s, "
                f"{self.rows_per_second:,.0f} rows/s ({self.shards_written} shards written, "
                f"{self.shards_skipped} already done)")


def shard_name(path: str, part: int) -> str:
    """`<input stem>-<hash of its absolute path>-<part>.parquet`: two inputs named day_0 in
    different directories do not collide."""
    stem = re.sub(r"(\.tsv|\.txt|\.csv)?(\.gz)?$", "", os.path.basename(path)) or "input"
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:8]
    return f"{stem}-{digest}-{part:05d}.parquet"


def _source(path: str, part: int, rows_per_file: int) -> dict:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "part": part, "rows_per_file": rows_per_file}


def _existing_shard(out: str, name: str, source: dict, spec: DatasetSpec) -> dict | None:
    """The recorded stats of a finished shard matching `source`, None if there is none.

    A finished shard made from something else (another version of the input, another
    --rows-per-file, another spec) is an error: resuming over it would mix two datasets.
    """
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    meta = pq.read_metadata(path).metadata or {}
    recorded = json.loads(meta.get(SOURCE_KEY, b"{}"))
    same_source = {k: recorded.get(k) for k in source} == source
    if not same_source or meta.get(b"recgrid.table_rows") != prepared_metadata(spec)[b"recgrid.table_rows"]:
        raise CriteoDataError(
            path, f"was prepared from other inputs or settings (recorded {recorded}); "
                  f"now {source} with spec {spec.name!r}. Remove it or prepare into a new --out directory",
        )
    return recorded


class _ShardWriter:
    """Writes one shard under a temporary name; `commit` renames it into place."""

    def __init__(self, out: str, name: str, spec: DatasetSpec):
        self.final = os.path.join(out, name)
        self.tmp = os.path.join(out, f"{TMP_PREFIX}{name}.{os.getpid()}")
        self.schema = PREPARED_SCHEMA.with_metadata(prepared_metadata(spec))
        self.writer = prepared_writer(self.tmp, self.schema)
        self.pending: list[pa.Table] = []  # rows short of a whole row group
        self.rows = self.bad = self.lines = 0
        self.examples: list[str] = []

    def write(self, chunk) -> None:
        self.pending.append(chunk.table.replace_schema_metadata(self.schema.metadata))
        self.rows += chunk.table.num_rows
        self.bad += chunk.bad_rows
        self.lines += chunk.lines
        self.examples += chunk.bad_examples[: max(0, 5 - len(self.examples))]
        self._flush(last=False)

    def _flush(self, last: bool) -> None:
        """Write the pending rows in row groups of PREPARED_ROW_GROUP_ROWS, from the shard's first
        row on (all of them if `last`; else the rest waits for more)."""
        rows = sum(t.num_rows for t in self.pending)
        whole = rows if last else rows - rows % PREPARED_ROW_GROUP_ROWS
        if not whole:
            return
        table = pa.concat_tables(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.writer.write_table(table.slice(0, whole), row_group_size=PREPARED_ROW_GROUP_ROWS)
        self.pending = [table.slice(whole)] if whole < rows else []

    def commit(self, source: dict) -> dict:
        self._flush(last=True)
        stats = {**source, "rows": self.rows, "bad_rows": self.bad, "lines": self.lines}
        self.writer.add_key_value_metadata({SOURCE_KEY.decode(): json.dumps(stats)})
        self.writer.close()
        os.replace(self.tmp, self.final)  # atomic: the final name never holds a partial shard
        return stats

    def abort(self) -> None:
        try:
            self.writer.close()
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)


def _process_unit(unit: dict, **kwargs) -> dict:
    """Runs in a Ray Data task: parse one unit, write its shard(s). Returns counts for the driver.

    A data error comes back as a field of the result, not as an exception: Ray Data would wrap
    it and keep only its text, and the driver wants the file, line and field.
    """
    stats = {"path": unit["path"], "rows": 0, "bad_rows": 0, "written": 0, "skipped": 0, "rows_new": 0,
             "examples": "[]", "error": "", "cpu_seconds": 0.0}
    cpu = time.process_time()
    try:
        _process_unit_into(unit, stats, **kwargs)
    except CriteoDataError as e:
        stats["error"] = json.dumps([e.file, e.detail, e.line, e.field])
    stats["cpu_seconds"] = time.process_time() - cpu
    return stats


def _process_unit_into(
    unit: dict, stats: dict, *, spec: DatasetSpec, out: str, skip_bad: bool, rows_per_file: int
) -> None:
    path, fmt = unit["path"], unit["fmt"]
    examples: list[str] = []
    if fmt == TSV:
        chunks = iter_line_chunks(path, TSV, start=unit["start"], end=unit["end"], first_line=unit["first_line"])
        parts = {unit["part"]: chunks}.items()
    else:
        parts = _gzip_parts(path, rows_per_file)
    for part, chunks in parts:
        name = shard_name(path, part)
        source = _source(path, part, rows_per_file)
        done = _existing_shard(out, name, source, spec)
        if done is not None:  # only gzip parts get here: plain ones were skipped when planned
            for _ in chunks:
                pass  # still read through: the next part starts after these lines
            stats["rows"] += done["rows"]
            stats["bad_rows"] += done["bad_rows"]
            stats["skipped"] += 1
            continue
        w = _ShardWriter(out, name, spec)
        try:
            for chunk in chunks:
                w.write(parse_lines(chunk.data, spec, file=path, first_line=chunk.first_line, skip_bad=skip_bad))
            w.commit(source)
        except BaseException:
            w.abort()
            raise
        stats["rows"] += w.rows
        stats["rows_new"] += w.rows
        stats["bad_rows"] += w.bad
        stats["written"] += 1
        examples += w.examples
    stats["examples"] = json.dumps(examples[:5])


def _gzip_parts(path: str, rows_per_file: int):
    """(part, chunks of that part's lines) in order, cut from one pass over the gzip stream."""
    stream = iter_line_chunks(path, TSV_GZ, lines_per_part=rows_per_file)
    pending = next(stream, None)
    while pending is not None:
        part = (pending.first_line - 1) // rows_per_file

        def this_part(first=pending):
            nonlocal pending
            yield first
            for c in stream:
                if (c.first_line - 1) // rows_per_file != part:
                    pending = c
                    return
                yield c
            pending = None

        gen = this_part()
        yield part, gen
        for _ in gen:  # drain what the consumer left, so `pending` moves on
            pass


def prepare(
    inputs: str | Sequence[str],
    out: str,
    spec: DatasetSpec | str = "tiny",
    *,
    rows_per_file: int | None = None,
    allow_bad_rows: float = 0.0,
    num_cpus_per_task: float = 1.0,
    log=print,
) -> PrepareResult:
    """Prepare raw Criteo files (paths, globs or directories) into parquet shards under `out`.

    Bad rows stop the run with a CriteoDataError (file, line, field) unless allow_bad_rows > 0:
    then they are skipped, counted, and the run fails only if their fraction of all lines
    exceeds allow_bad_rows. Shards finished before a failure stay finished: a rerun resumes.
    """
    import ray
    import ray.data

    spec = get_spec(spec) if isinstance(spec, str) else spec
    rows_per_file = rows_per_file or DEFAULT_ROWS_PER_FILE
    if rows_per_file < 1:
        raise ValueError(f"--rows-per-file must be positive, got {rows_per_file}")
    if not 0.0 <= allow_bad_rows < 1.0:
        raise ValueError(f"--allow-bad-rows is a fraction in [0, 1), got {allow_bad_rows}")
    files = expand_inputs(inputs)
    fmts = {p: sniff_format(p) for p in files}
    for p, fmt in fmts.items():
        if fmt not in (TSV, TSV_GZ):
            raise CriteoDataError(p, f"is {fmt}, already prepared; prepare reads raw TSV (plain or gzip)")
    for n in os.listdir(out) if os.path.isdir(out) else ():  # leftovers of a killed run; one prepare per --out at a time
        if n.startswith(TMP_PREFIX):
            os.remove(os.path.join(out, n))

    started = connect(include_dashboard=False, say=lambda m: log(f"[prepare] {m}"))
    t0 = time.perf_counter()  # the work, not the cluster's start-up
    result = PrepareResult()
    try:
        plain = [p for p in files if fmts[p] == TSV]
        if sum(os.path.getsize(p) for p in plain) < LOCAL_SCAN_BYTES:  # a task's round trip costs more
            offsets = {p: line_part_offsets(p, rows_per_file) for p in plain}
        else:  # big inputs are scanned by tasks, in parallel, where Ray places them
            scan = ray.remote(num_cpus=min(0.5, num_cpus_per_task))(line_part_offsets)
            offsets = dict(zip(plain, ray.get([scan.remote(p, rows_per_file) for p in plain])))
        units = []
        for p in files:
            if fmts[p] == TSV_GZ:
                units.append({"path": p, "fmt": TSV_GZ, "part": -1, "start": 0, "end": 0, "first_line": 1})
                continue
            for part, (start, end, first_line, _lines) in enumerate(offsets[p]):
                done = _existing_shard(out, shard_name(p, part), _source(p, part, rows_per_file), spec)
                if done is not None:
                    result.rows += done["rows"]
                    result.bad_rows += done["bad_rows"]
                    result.shards_skipped += 1
                    continue
                units.append({"path": p, "fmt": TSV, "part": part, "start": start, "end": end,
                              "first_line": first_line})
        log(f"[prepare] {len(files)} input file(s), {len(units)} unit(s) to do, "
            f"{result.shards_skipped} shard(s) already done -> {out}")
        if units:
            os.makedirs(out, exist_ok=True)  # only now: a run that writes nothing leaves no directory
            with data_context():
                ds = ray.data.from_items(units, override_num_blocks=len(units)).map(
                    _process_unit,
                    fn_kwargs={"spec": spec, "out": out, "skip_bad": allow_bad_rows > 0,
                               "rows_per_file": rows_per_file},
                    num_cpus=num_cpus_per_task,
                )
            for i, s in enumerate(ds.iter_rows(), 1):
                if s["error"]:
                    raise CriteoDataError(*json.loads(s["error"]))
                result.rows += s["rows"]
                result.bad_rows += s["bad_rows"]
                result.rows_this_run += s["rows_new"]
                result.cpu_seconds += s["cpu_seconds"]
                result.shards_written += s["written"]
                result.shards_skipped += s["skipped"]
                result.examples += json.loads(s["examples"])[: max(0, 5 - len(result.examples))]
                dt = time.perf_counter() - t0
                log(f"[prepare] {i}/{len(units)} units · {result.rows:,} rows · {result.bad_rows:,} bad · "
                    f"{dt:.1f} s · {result.rows_this_run / dt:,.0f} rows/s")
        result.seconds = time.perf_counter() - t0
    finally:
        if started:
            ray.shutdown()
    lines = result.rows + result.bad_rows
    if result.bad_rows and result.bad_rows > allow_bad_rows * lines:
        raise CriteoDataError(
            out, f"{result.bad_rows:,} bad rows of {lines:,} lines ({result.bad_rows / lines:.4%}) exceed "
                 f"--allow-bad-rows {allow_bad_rows}; first: " + " | ".join(result.examples[:3]),
        )
    return result


def run_cli(args: argparse.Namespace) -> int:
    try:
        spec = get_spec(args.spec, max_rows_per_table=args.max_rows_per_table)
        result = prepare(args.inputs, args.out, spec, rows_per_file=args.rows_per_file,
                         allow_bad_rows=args.allow_bad_rows)
    except CriteoDataError as e:
        print(f"recgrid prepare: {e}", file=sys.stderr)
        return 1
    except (SpecError, ValueError, ClusterError) as e:
        print(f"recgrid prepare: {e}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0
