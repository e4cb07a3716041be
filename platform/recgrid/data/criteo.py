"""Criteo click-log formats and the one definition of their transforms.

Owns: the raw layout (one sample per line, tab-separated: label, I1..I13, C1..C26; an empty
field is a missing value), the prepared parquet schema and writer, vectorised parsing and
validation of raw lines and of prepared rows (errors name file, line or row, and field; lines in
Criteo's plain form are parsed straight from their bytes, others through pyarrow's CSV reader),
format sniffing by content (plain TSV, gzip TSV, parquet: the 1TB day files have no extension),
and expansion of input globs.
The transforms themselves (and what a value may be) are `data.transforms`', which every served
model applies too:

    dense        an int64; missing -> 0, then ln(1 + max(x, 0)), float32
    categorical  1 to 16 hex digits; missing -> 0, else int(hex, 16) % spec.table_rows[feature], int64
    label        0 or 1, int32

prepare.py, stream.py and synth.py all go through this module, so a value can only be computed one way.
"""

from __future__ import annotations

import glob
import os
import zlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recgrid.data.plain_lines import parse_plain
from recgrid.data.specs import DENSE_NAMES, LABEL_NAME, SPARSE_NAMES, DatasetSpec
from recgrid.data.transforms import (  # noqa: F401 - transform_*: the data modules' name for them
    MAX_HEX_DIGITS, dense_value, transform_categorical, transform_dense,
)

RAW_COLUMNS: tuple[str, ...] = (LABEL_NAME, *DENSE_NAMES, *SPARSE_NAMES)
PREPARED_SCHEMA = pa.schema(
    [pa.field(LABEL_NAME, pa.int32())]
    + [pa.field(n, pa.float32()) for n in DENSE_NAMES]
    + [pa.field(n, pa.int64()) for n in SPARSE_NAMES]
)
# An optional int64 column of prepared shards: a row's identity, which synthetic data carries so
# exactly-once delivery can be audited row by row. Readers pass it through; training ignores it.
ROW_ID = "row_id"
# Parquet key-value metadata: the moduli the ids were reduced by, so a reader can refuse
# shards prepared for another spec or row cap instead of looking up wrong rows.
TABLE_ROWS_KEY = b"recgrid.table_rows"

TSV, TSV_GZ, PARQUET = "tsv", "tsv.gz", "parquet"
CHUNK_BYTES = 16 << 20  # raw bytes parsed at once: bounded memory, ~60k Criteo lines
MAX_LINE_BYTES = 1 << 20  # a Criteo line is a few hundred bytes
_READ_BYTES = 1 << 20  # gzip read size: a truncation is located to within this much data
_MAX_EXAMPLES = 5

# byte -> hex digit value, 255 where the byte is not a hex digit
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
# bytes a decimal integer's text may be built from (arrow's cast rejects misplaced '-')
_DEC_OK = np.zeros(256, dtype=bool)
_DEC_OK[list(b"0123456789-")] = True


class CriteoDataError(ValueError):
    """Bad input. The message names the file and, where they apply, the line (raw files, from 1) or
    the row (parquet files, from 0), and the field."""

    def __init__(self, file: str, detail: str, line: int | None = None, field: str | None = None,
                 row: int | None = None):
        self.file, self.detail, self.line, self.field, self.row = str(file), detail, line, field, row
        where = self.file + (f":{line}" if line is not None else "") + (f": row {row}" if row is not None else "")
        super().__init__(f"{where}: " + (f"field {field}: " if field else "") + detail)

    def __reduce__(self):  # keep the structured fields when Ray pickles it back to the driver
        return (type(self), (self.file, self.detail, self.line, self.field, self.row))


# ---------------------------------------------------------------- prepared shards

# Rows per row group of a prepared shard: a reader decodes whole row groups, and a read task of
# `stream.DEFAULT_ROWS_PER_TASK` rows that starts anywhere then decodes about 1.5 times its rows.
PREPARED_ROW_GROUP_ROWS = 16_384


def prepared_writer(path: str, schema: pa.Schema) -> pq.ParquetWriter:
    """The parquet writer of prepared shards (`schema`: PREPARED_SCHEMA, with metadata, maybe a
    ROW_ID column). Ids and row ids are delta-encoded, uncompressed: a dictionary of 26 int64
    columns costs as much time to build as the raw lines take to parse, for a few % of size."""
    ints = [n for n in (*SPARSE_NAMES, ROW_ID) if n in schema.names]
    return pq.ParquetWriter(path, schema, use_dictionary=[n for n in schema.names if n not in ints],
                            column_encoding={n: "DELTA_BINARY_PACKED" for n in ints},
                            compression={n: "NONE" if n in ints else "SNAPPY" for n in schema.names})


def prepared_metadata(spec: DatasetSpec) -> dict[bytes, bytes]:
    """Parquet key-value metadata every prepared shard carries."""
    return {TABLE_ROWS_KEY: ",".join(map(str, spec.table_rows)).encode()}


def check_prepared_schema(path: str, schema: pa.Schema, spec: DatasetSpec | None) -> None:
    """Refuse a parquet file that is not a prepared shard, or one prepared for other table rows."""
    for f in PREPARED_SCHEMA:
        if f.name not in schema.names:
            raise CriteoDataError(path, f"parquet file has no column {f.name!r}; not a prepared Criteo shard")
        if schema.field(f.name).type != f.type:
            raise CriteoDataError(
                path, f"column has type {schema.field(f.name).type}, prepared shards have {f.type}", field=f.name
            )
    rows = (schema.metadata or {}).get(TABLE_ROWS_KEY)
    if spec is not None and rows is not None and rows != prepared_metadata(spec)[TABLE_ROWS_KEY]:
        raise CriteoDataError(
            path,
            f"prepared for table rows {rows.decode()}, but spec {spec.name!r} (cap "
            f"{spec.max_rows_per_table}) has {','.join(map(str, spec.table_rows))}; prepare it again for this spec",
        )


def check_prepared_rows(table: pa.Table, path: str, first_row: int, spec: DatasetSpec | None) -> None:
    """Refuse prepared rows (a parquet file's rows first_row.. of `table`) that training's transforms
    cannot have made: a label other than 0 or 1, a dense value that is not finite, an id outside
    its table's rows (`spec`'s; data prepared for another spec). The error names the file, the
    first bad row and its field."""
    if _rows_plainly_good(table, spec):
        return
    checks: list[tuple[str, np.ndarray, str]] = []
    labels = table.column(LABEL_NAME).to_numpy(zero_copy_only=False)
    checks.append((LABEL_NAME, (labels != 0) & (labels != 1), "is not a label (0 or 1)"))
    for name in DENSE_NAMES:
        x = table.column(name).to_numpy(zero_copy_only=False)
        checks.append((name, ~np.isfinite(x), "is not a finite dense value"))
    if spec is not None:
        for name, rows in zip(SPARSE_NAMES, spec.table_rows):
            ids = table.column(name).to_numpy(zero_copy_only=False)
            checks.append((name, (ids < 0) | (ids >= rows),
                           f"is outside table rows [0, {rows}) of spec {spec.name!r}; data prepared for another spec?"))
    first = None  # (row, field, detail) of the first bad row
    for name, bad, why in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            if first is None or i < first[0]:
                first = (i, name, f"{table.column(name)[i].as_py()!r} {why}")
    if first is not None:
        raise CriteoDataError(path, first[2], field=first[1], row=first_row + first[0])


def _rows_plainly_good(table: pa.Table, spec: DatasetSpec | None) -> bool:
    """True if no row can fail `check_prepared_rows`, found with one reduction per column; False
    sends the rows through the row-by-row checks (which then decide). A float sum is finite only
    if every term is; as uint64 a negative id is above every table's rows."""
    if any(table.schema.field(f.name).type != f.type or table.column(f.name).null_count for f in PREPARED_SCHEMA):
        return False
    if table.column(LABEL_NAME).to_numpy().view(np.uint32).max(initial=0) > 1:
        return False
    if not all(np.isfinite(table.column(name).to_numpy().sum()) for name in DENSE_NAMES):
        return False
    if spec is not None:
        for name, rows in zip(SPARSE_NAMES, spec.table_rows):
            if table.column(name).to_numpy().view(np.uint64).max(initial=0) >= rows:
                return False
    return True


def parquet_file(path: str) -> pq.ParquetFile:
    """`path` opened as parquet; a file whose footer cannot be read is a CriteoDataError naming it."""
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise CriteoDataError(path, f"is not a readable parquet file (truncated or corrupt?): {_one_line(e)}") from None


def read_row_group(f: pq.ParquetFile, path: str, group: int, columns: Sequence[str]) -> pa.Table:
    """Row group `group` of the open parquet file `f`; a corrupt one is a CriteoDataError naming the file."""
    try:
        return f.read_row_group(group, columns=list(columns), use_threads=False)  # a read task is one core's work
    except (pa.ArrowException, OSError) as e:
        raise CriteoDataError(path, f"row group {group} cannot be read (truncated or corrupt?): {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


# ---------------------------------------------------------------- inputs


def sniff_format(path: str) -> str:
    """TSV, TSV_GZ or PARQUET, told by the first bytes of the file, not by its name."""
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        raise CriteoDataError(path, "empty file", line=1)
    if head == b"PAR1":
        return PARQUET
    if head[:2] == b"\x1f\x8b":
        return TSV_GZ
    for magic, name in ((b"\x28\xb5\x2f\xfd", "zstd"), (b"BZh", "bzip2"), (b"\xfd7zX", "xz"), (b"PK\x03\x04", "zip")):
        if head.startswith(magic):
            raise CriteoDataError(path, f"{name}-compressed; recgrid reads plain or gzip TSV and parquet")
    return TSV


def glob_files(pattern: str) -> list[str]:
    """What the glob `pattern` matches here, sorted: the one reading of a data glob, for
    validation, synthetic data and training alike. `**` stands for zero or more directories, as
    Ray Data and fsspec read it (`DIR/**/*.gz` is every .gz file in DIR and below), `~` for the
    home directory; names starting with '.' are not matched."""
    return sorted(glob.glob(os.path.expanduser(pattern), recursive=True))


def names_data(pattern: str) -> bool:
    """Whether the path, glob or directory `pattern` names a data file (`expand_inputs` finds one)."""
    try:
        return bool(expand_inputs(pattern))
    except CriteoDataError:  # no file matches, or an empty directory
        return False


def expand_inputs(patterns: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Files named by paths, globs (`glob_files`) and directories, in order, each once.

    A directory stands for the files directly in it, except names starting with '.' or '_'
    (temporary files and markers). A glob or directory that names no file is an error: a
    typo must not train on nothing. A directory a glob matches may hold no file (`DIR/**`
    matches DIR and its sub-directories): the glob's other matches count.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    if not patterns:
        raise CriteoDataError("<inputs>", "no input given")
    out: dict[str, None] = {}
    for pattern in map(os.fspath, patterns):
        pattern = os.path.expanduser(pattern)
        if glob.has_magic(pattern):
            matches = glob_files(pattern)
        elif os.path.exists(pattern):
            matches = [pattern]
        else:
            raise CriteoDataError(pattern, "no such file or directory")
        files: list[str] = []
        for m in matches:
            if os.path.isdir(m):
                files += sorted(
                    os.path.join(m, n) for n in os.listdir(m)
                    if not n.startswith((".", "_")) and os.path.isfile(os.path.join(m, n))
                )
            else:
                files.append(m)
        if not files:
            raise CriteoDataError(pattern, "glob matches no file" if glob.has_magic(pattern)
                                  else "directory holds no data file")
        out.update(dict.fromkeys(files))
    return list(out)


# ---------------------------------------------------------------- reading raw lines


@dataclass
class LineChunk:
    """Whole lines of one raw file: `data` holds lines first_line .. first_line + lines - 1."""

    data: bytes
    first_line: int
    lines: int


class _Damaged(Exception):
    """A gzip stream that ends early or does not decompress."""


def _gunzip_blocks(f, read_bytes: int = _READ_BYTES) -> Iterator[bytes]:
    """Decompressed blocks of a gzip file (all members), everything readable before any damage.

    zlib directly rather than the gzip module: gzip.read() raises on a truncated stream
    without handing over the data it decompressed in that call.
    """
    d = zlib.decompressobj(wbits=31)
    started = False
    while True:
        comp = f.read(read_bytes)
        if not comp:
            if started and not d.eof:
                raise _Damaged("stream ends before its end-of-stream marker")
            return
        while comp:
            if d.eof:  # another gzip member follows
                if not comp.startswith(b"\x1f\x8b"):
                    raise _Damaged("data after the end of the gzip stream is not gzip")
                d = zlib.decompressobj(wbits=31)
            started = True
            try:
                out = d.decompress(comp)
            except zlib.error as e:
                raise _Damaged(f"corrupt data: {e}") from None
            if out:
                yield out
            comp = d.unused_data if d.eof else b""


def _plain_blocks(f, start: int, end: int | None, read_bytes: int) -> Iterator[bytes]:
    if start:
        f.seek(start)
    remaining = None if end is None else end - start
    while remaining is None or remaining > 0:
        block = f.read(read_bytes if remaining is None else min(read_bytes, remaining))
        if not block:
            return
        if remaining is not None:
            remaining -= len(block)
        yield block


def iter_line_chunks(
    path: str,
    fmt: str | None = None,
    *,
    start: int = 0,
    end: int | None = None,
    first_line: int = 1,
    chunk_bytes: int = CHUNK_BYTES,
    lines_per_part: int | None = None,
) -> Iterator[LineChunk]:
    """Chunks of whole lines of a raw file (plain or gzip), about chunk_bytes each.

    `start`/`end` pick a byte range of a plain file that begins at line `first_line`.
    With `lines_per_part`, no chunk crosses a multiple of that many lines (counted from
    first_line), so a caller can cut the file into parts of exactly that many lines.
    A damaged gzip stream yields every whole line before the damage, then raises
    CriteoDataError naming the first line it could not read.
    """
    fmt = fmt or sniff_format(path)
    if fmt not in (TSV, TSV_GZ):
        raise CriteoDataError(path, f"is {fmt}, not a raw Criteo TSV file")
    line = first_line  # number of the next line to yield
    with open(path, "rb") as f:
        blocks = _gunzip_blocks(f) if fmt == TSV_GZ else _plain_blocks(f, start, end, chunk_bytes)
        pending: list[bytes] = []
        size = 0
        damage = None
        done = False
        while not done:
            try:
                block = next(blocks)
            except StopIteration:
                block, done = b"", True
            except _Damaged as e:
                block, done, damage = b"", True, e
            if block:
                pending.append(block)
                size += len(block)
                if size < chunk_bytes:
                    continue
            buf = b"".join(pending)
            if done and damage is None:
                if buf and not buf.endswith(b"\n"):
                    buf += b"\n"  # the last line without its newline is still a line
                pending, size = [], 0
            else:
                cut = buf.rfind(b"\n") + 1  # a damaged stream's partial last line is dropped
                buf, rest = buf[:cut], buf[cut:]
                pending, size = ([rest], len(rest)) if rest else ([], 0)
                if size > MAX_LINE_BYTES:  # binary junk or a wrong file: fail now, not after reading it all
                    raise CriteoDataError(path, f"line longer than {MAX_LINE_BYTES >> 20} MiB; not Criteo "
                                                f"tab-separated text", line=line + buf.count(b"\n"))
            while buf:
                n = buf.count(b"\n")
                if lines_per_part:
                    room = lines_per_part - (line - first_line) % lines_per_part
                    if n > room:  # split at the part boundary
                        nl = np.flatnonzero(np.frombuffer(buf, dtype=np.uint8) == 10)
                        k = int(nl[room - 1]) + 1
                        yield LineChunk(buf[:k], line, room)
                        line += room
                        buf = buf[k:]
                        continue
                yield LineChunk(buf, line, n)
                line += n
                buf = b""
    if damage is not None:
        raise CriteoDataError(path, f"truncated or corrupt gzip stream after line {line - 1}: {damage}", line=line)
    if line == first_line and start == 0:
        where = " after decompression" if fmt == TSV_GZ else ""
        raise CriteoDataError(path, f"empty file (no lines{where})", line=1)


def line_part_offsets(path: str, lines_per_part: int, block_bytes: int = 64 << 20) -> list[tuple[int, int, int, int]]:
    """Split a plain raw file into parts of lines_per_part lines: [(start, end, first_line, lines)].

    One sequential pass that counts newlines (fast: bytes.count), so parts of one big file can be
    parsed in parallel and each part's errors still carry the true line number.
    """
    size = os.path.getsize(path)
    if size == 0:
        raise CriteoDataError(path, "empty file", line=1)
    bounds = [0]  # byte offsets where parts start
    lines_before = 0  # lines completed before `pos`
    pos = 0
    last_byte = b""
    with open(path, "rb") as f:
        while True:
            block = f.read(block_bytes)
            if not block:
                break
            n = block.count(b"\n")
            next_boundary = len(bounds) * lines_per_part
            if lines_before + n >= next_boundary:
                nl = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10)
                while lines_before + len(nl) >= next_boundary:
                    bounds.append(pos + int(nl[next_boundary - lines_before - 1]) + 1)
                    next_boundary += lines_per_part
            lines_before += n
            pos += len(block)
            last_byte = block[-1:]
    total_lines = lines_before + (last_byte != b"\n")
    if bounds[-1] >= size:
        bounds.pop()  # file ends exactly at a boundary
    parts = []
    for i, s in enumerate(bounds):
        e = bounds[i + 1] if i + 1 < len(bounds) else size
        first = i * lines_per_part + 1
        parts.append((s, e, first, min(lines_per_part, total_lines - first + 1)))
    return parts


# ---------------------------------------------------------------- parsing


@dataclass
class ParsedChunk:
    """Transformed good rows of one chunk of raw lines, and what was wrong with the others."""

    table: pa.Table  # PREPARED_SCHEMA
    lines: int
    bad_rows: int = 0
    bad_examples: list[str] = field(default_factory=list)


def _string_parts(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n+1], data bytes) of a string array, without copying the bytes."""
    _, off_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(off_buf, dtype=np.int32, count=arr.offset + len(arr) + 1)[arr.offset:]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None and data_buf.size else np.zeros(1, np.uint8)
    return offsets, data


def _parse_label(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    offsets, data = _string_parts(arr)
    first = data[np.minimum(offsets[:-1], len(data) - 1)]
    ok = (np.diff(offsets) == 1) & ((first == 48) | (first == 49))
    return np.where(ok, first.astype(np.int32) - 48, 0).astype(np.int32), ~ok


def _parse_dense(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Integer values as float64 (missing -> 0) and the mask of values that are not integers."""
    offsets, data = _string_parts(arr)
    present = np.diff(offsets) > 0
    if _DEC_OK[data[offsets[0]:offsets[-1]]].all():
        # fast path: arrow's cast, once the bytes are known to hold no hex prefix or sign tricks;
        # empty (missing) fields become nulls so the cast does not reject them
        bits = np.concatenate([np.ones(arr.offset, bool), present]) if arr.offset else present
        validity = pa.py_buffer(np.packbits(bits, bitorder="little"))
        with_nulls = pa.StringArray.from_buffers(
            len(arr), arr.buffers()[1], arr.buffers()[2], validity, int((~present).sum()), arr.offset
        )
        try:
            ints = pc.fill_null(pc.cast(with_nulls, pa.int64()), 0)
            return ints.to_numpy().astype(np.float64), np.zeros(len(arr), bool)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    values = np.zeros(len(arr), dtype=np.float64)
    bad = np.zeros(len(arr), dtype=bool)
    for i, s in enumerate(arr.to_pylist()):  # rare path: a chunk holding a non-integer or one past int64
        if not s:
            continue
        try:
            values[i] = float(dense_value(s))
        except ValueError:
            bad[i] = True
    return values, bad


def _parse_hex(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint64 hash values, missing mask and the mask of values that are not 1..16 hex digits."""
    offsets, data = _string_parts(arr)
    n = len(arr)
    lens = np.diff(offsets)
    missing = lens == 0
    values = np.zeros(n, dtype=np.uint64)
    if n and ((lens == 8) | missing).all():
        # Criteo's case, every id 8 digits: the data buffer holds one 8-byte word per id. Map
        # bytes to digit values, then gather the 8 nibbles of each little-endian word into a
        # uint32 with shifts and masks (most significant digit is the lowest byte).
        digits = _HEX_LUT[data[offsets[0]:offsets[-1]]]
        bad = np.zeros(n, dtype=bool)
        if digits.max(initial=0) == 255:
            bad[~missing] = (digits.reshape(-1, 8) == 255).any(axis=1)
        x = digits.view("<u8")
        lo = np.uint64(0x000F000F000F000F)
        y = ((x & lo) << np.uint64(4)) | ((x >> np.uint64(8)) & lo)  # 16-bit lanes: one byte of the id each
        ff = np.uint64(0xFF)
        v = ((y & ff) << np.uint64(24)) | (((y >> np.uint64(16)) & ff) << np.uint64(16)) \
            | (((y >> np.uint64(32)) & ff) << np.uint64(8)) | ((y >> np.uint64(48)) & ff)
        if missing.any():
            values[~missing] = v
        else:
            values = v
        return values, missing, bad
    bad = lens > MAX_HEX_DIGITS
    width = int(min(lens.max(initial=0), MAX_HEX_DIGITS))
    if width:
        lens = np.minimum(lens, width)
        pad = (width - lens)[:, None]
        k = np.arange(width)[None, :]
        pos = np.maximum(offsets[:-1, None] + k - pad, 0)  # right-aligned digits; padding masked below
        digits = _HEX_LUT[data[pos]]
        digits[k < pad] = 0
        bad |= (digits == 255).any(axis=1)
        digits = digits.astype(np.uint64)
        for j in range(width):
            values = (values << np.uint64(4)) | digits[:, j]
    return values, missing, bad & ~missing


def _read_strings(data: bytes, file: str, first_line: int) -> tuple[pa.Table, list[tuple[int, int]]]:
    invalid: list[tuple[int, int]] = []  # (line within chunk, fields found)

    def on_invalid(row) -> str:
        invalid.append((row.number, row.actual_columns))
        return "skip"

    try:
        table = pacsv.read_csv(
            pa.py_buffer(data),
            read_options=pacsv.ReadOptions(
                column_names=list(RAW_COLUMNS), use_threads=False, block_size=4 << 20
            ),
            parse_options=pacsv.ParseOptions(
                delimiter="\t", quote_char=False, escape_char=False, double_quote=False,
                newlines_in_values=False, ignore_empty_lines=False, invalid_row_handler=on_invalid,
            ),
            convert_options=pacsv.ConvertOptions(
                column_types={c: pa.string() for c in RAW_COLUMNS}, strings_can_be_null=False
            ),
        )
    except pa.ArrowInvalid as e:
        raise CriteoDataError(file, f"cannot be read as tab-separated text: {e}", line=first_line) from None
    return table.combine_chunks(), invalid


def parse_lines(
    data: bytes, spec: DatasetSpec, *, file: str, first_line: int = 1, skip_bad: bool = False
) -> ParsedChunk:
    """Validate and transform whole raw lines into PREPARED_SCHEMA rows.

    A bad row (wrong field count, label not 0/1, dense not an integer, categorical not hex)
    raises CriteoDataError naming file, line and field, or with skip_bad is dropped and counted.
    Lines in Criteo's plain form take a faster way (`data.plain_lines.parse_plain`) to the same rows.
    """
    plain = parse_plain(data, spec)
    plain = None if plain is None else pa.Table.from_arrays([pa.array(col) for col in plain], schema=PREPARED_SCHEMA)
    if plain is not None:
        return ParsedChunk(plain, lines=plain.num_rows)
    table, invalid = _read_strings(data, file, first_line)
    n = table.num_rows
    total = n + len(invalid)
    if n:
        line_of_row = np.arange(first_line, first_line + total, dtype=np.int64)
        if invalid:
            line_of_row = np.delete(line_of_row, [num - 1 for num, _ in invalid])
    else:
        line_of_row = np.zeros(0, dtype=np.int64)
    label, bad_label = _parse_label(table.column(0).chunk(0) if n else pa.array([], pa.string()))
    bad_masks: list[tuple[str, np.ndarray]] = [(LABEL_NAME, bad_label)]
    cols: list[np.ndarray] = [label]
    for name in DENSE_NAMES:
        arr = table.column(name).chunk(0) if n else pa.array([], pa.string())
        values, bad = _parse_dense(arr)
        cols.append(transform_dense(values))
        bad_masks.append((name, bad))
    for name, rows in zip(SPARSE_NAMES, spec.table_rows):
        arr = table.column(name).chunk(0) if n else pa.array([], pa.string())
        hashes, missing, bad = _parse_hex(arr)
        cols.append(transform_categorical(hashes, rows, missing))
        bad_masks.append((name, bad))
    any_bad = np.zeros(n, dtype=bool)
    for _, m in bad_masks:
        any_bad |= m

    problems: list[tuple[int, str | None, str]] = [  # (line, field, detail), first few only
        (first_line + num - 1, None, f"line has {got} tab-separated fields, expected {len(RAW_COLUMNS)} "
                                     f"(label, I1..I13, C1..C26)")
        for num, got in invalid[:_MAX_EXAMPLES]
    ]
    for i in np.flatnonzero(any_bad)[:_MAX_EXAMPLES]:
        problems.append(_describe_bad_row(table, int(i), int(line_of_row[i]), bad_masks))
    problems.sort(key=lambda p: p[0])
    bad_count = len(invalid) + int(any_bad.sum())
    if bad_count and not skip_bad:
        line, fld, detail = problems[0]
        raise CriteoDataError(file, detail, line=line, field=fld)
    if any_bad.any():
        keep = ~any_bad
        cols = [c[keep] for c in cols]
    out = pa.Table.from_arrays([pa.array(c) for c in cols], schema=PREPARED_SCHEMA)
    examples = [str(CriteoDataError(file, d, line=ln, field=f)) for ln, f, d in problems[:_MAX_EXAMPLES]]
    return ParsedChunk(out, lines=total, bad_rows=bad_count, bad_examples=examples)


def _describe_bad_row(table: pa.Table, i: int, line: int, bad_masks) -> tuple[int, str | None, str]:
    row = {name: table.column(name)[i].as_py() or None for name in RAW_COLUMNS}  # "" is missing
    if all(v is None for v in row.values()):
        return line, None, "empty line"
    for name, mask in bad_masks:
        if mask[i]:
            v = row[name]
            if name == LABEL_NAME:
                return line, name, ("missing label" if v is None else f"{v!r} is not a label (0 or 1)")
            if name.startswith("I"):
                try:
                    dense_value(v)
                except ValueError as e:
                    return line, name, str(e)
            return line, name, f"{v!r} is not a hexadecimal id of 1 to {MAX_HEX_DIGITS} digits"
    raise AssertionError("row marked bad without a bad field")  # masks and any_bad come from one list


def read_raw(
    path: str,
    spec: DatasetSpec,
    *,
    fmt: str | None = None,
    skip_bad: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[ParsedChunk]:
    """A whole raw file (plain or gzip), parsed and transformed chunk by chunk."""
    for chunk in iter_line_chunks(path, fmt, chunk_bytes=chunk_bytes):
        yield parse_lines(chunk.data, spec, file=path, first_line=chunk.first_line, skip_bad=skip_bad)
