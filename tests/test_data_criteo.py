"""criteo.py without Ray: line chunking and numbering across chunks and parts, cutting a plain file
into parts, format sniffing and input expansion; bad rows and corrupt shards stop the job's read
tasks (run here, in this process: `data.stream.local_batches`) with a sentence naming the file."""

from __future__ import annotations

import glob
import gzip
import os
import re

import pyarrow as pa
import pytest

from recgrid.data.criteo import (
    CriteoDataError, expand_inputs, iter_line_chunks, line_part_offsets, parse_lines, read_raw, sniff_format,
)
from recgrid.data.specs import get_spec

GOOD = "\t".join(["1"] + ["3"] * 13 + ["0a1b2c3d"] * 26)


def numbered_lines(n: int) -> list[str]:
    """Good lines whose I1 is the line number, so a row can be traced back to its line."""
    return ["\t".join(["0", str(i)] + ["1"] * 12 + ["ffffffff"] * 26) for i in range(1, n + 1)]


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("trailing_newline", [True, False])
def test_chunks_and_parts_keep_every_line_and_its_number(tmp_path, gz, trailing_newline):
    lines = numbered_lines(203)
    data = ("\n".join(lines) + ("\n" if trailing_newline else "")).encode()
    path = str(tmp_path / "f")
    with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
        f.write(data)
    # tiny chunks: many chunks per part, and parts of 50 lines cut inside chunks
    chunks = list(iter_line_chunks(path, chunk_bytes=1000, lines_per_part=50))
    assert b"".join(c.data for c in chunks) == data + (b"" if trailing_newline else b"\n")
    expect = 1
    for c in chunks:
        assert c.first_line == expect and c.data.count(b"\n") == c.lines
        assert (c.first_line - 1) // 50 == (c.first_line + c.lines - 2) // 50  # never crosses a part
        first_i1 = int(c.data.split(b"\t", 2)[1])
        assert first_i1 == c.first_line
        expect += c.lines
    assert expect == 204


def test_plain_file_cut_into_parts_by_line(tmp_path):
    lines = numbered_lines(100)
    path = str(tmp_path / "p.tsv")
    with open(path, "w") as f:
        f.write("\n".join(lines))  # no final newline
    parts = line_part_offsets(path, 30, block_bytes=777)  # boundaries fall inside scan blocks
    assert [(first, n) for _, _, first, n in parts] == [(1, 30), (31, 30), (61, 30), (91, 10)]
    for start, end, first, n in parts:
        got = list(iter_line_chunks(path, "tsv", start=start, end=end, first_line=first, chunk_bytes=500))
        assert sum(c.lines for c in got) == n and got[0].first_line == first
        assert int(got[0].data.split(b"\t", 2)[1]) == first
    with open(path, "a") as f:
        f.write("\n" + "\n".join(numbered_lines(20)) + "\n")  # now exactly 120 lines, 4 full parts
    assert [n for *_, n in line_part_offsets(path, 30)] == [30, 30, 30, 30]


def test_error_line_numbers_hold_across_chunks(tmp_path):
    lines = numbered_lines(500)
    lines[436] = lines[436].replace("ffffffff", "fffffffz", 1)
    path = str(tmp_path / "day_1")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with pytest.raises(CriteoDataError, match=r"day_1:437: field C1: 'fffffffz'"):
        for _ in read_raw(path, get_spec("tiny"), chunk_bytes=2000):
            pass
    kept = sum(c.table.num_rows for c in _skip_bad(path))
    assert kept == 499


def _skip_bad(path):
    for c in iter_line_chunks(path, chunk_bytes=2000):
        yield parse_lines(c.data, get_spec("tiny"), file=path, first_line=c.first_line, skip_bad=True)


def test_parse_skip_bad_reports_lines_and_keeps_order():
    data = "\n".join([GOOD, "1\t2", GOOD, GOOD.replace("\t3\t", "\t3.0\t", 1), GOOD]) + "\n"
    r = parse_lines(data.encode(), get_spec("tiny"), file="x", first_line=100, skip_bad=True)
    assert (r.lines, r.bad_rows, r.table.num_rows) == (5, 2, 3)
    assert r.bad_examples[0].startswith("x:101: line has 2 tab-separated fields")
    assert r.bad_examples[1] == "x:103: field I1: '3.0' is not an integer"


def test_sniff_and_expand_inputs(tmp_path):
    import pyarrow.parquet as pq

    (tmp_path / "d").mkdir()
    raw = tmp_path / "d" / "day_0"
    raw.write_text(GOOD + "\n")
    gz = tmp_path / "d" / "data.txt"  # gzip under a misleading name
    gz.write_bytes(gzip.compress(GOOD.encode()))
    pqf = tmp_path / "d" / "x.bin"
    pq.write_table(pa.table({"a": [1]}), pqf)
    (tmp_path / "d" / ".tmp-partial").write_text("x")
    (tmp_path / "d" / "_SUCCESS").write_text("")
    zst = tmp_path / "z"
    zst.write_bytes(b"\x28\xb5\x2f\xfd rest")
    assert [sniff_format(str(p)) for p in (raw, gz, pqf)] == ["tsv", "tsv.gz", "parquet"]
    with pytest.raises(CriteoDataError, match="zstd-compressed"):
        sniff_format(str(zst))
    # a directory stands for its data files: temp files and markers are not data
    assert expand_inputs(str(tmp_path / "d")) == sorted(str(p) for p in (raw, gz, pqf))
    assert expand_inputs([str(raw), str(tmp_path / "d" / "day_*"), str(gz)]) == [str(raw), str(gz)]
    with pytest.raises(CriteoDataError, match="no such file"):
        expand_inputs(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CriteoDataError, match="directory holds no data file"):
        expand_inputs(str(tmp_path / "empty"))
    assert os.path.exists(tmp_path / "d" / ".tmp-partial")


def test_double_star_is_zero_or_more_directories_in_every_module(tmp_path, monkeypatch):
    """`DIR/**/*.gz` as Ray Data and fsspec read it: DIR's own files and those below, for the
    data reader and the config's validation alike (non-recursive, it had matched DIR/day0's alone)."""
    from recgrid.config import ConfigError, load_config

    nested, flat = tmp_path / "nested", tmp_path / "flat"
    (nested / "day0").mkdir(parents=True)
    flat.mkdir()
    files = [nested / "a.tsv.gz", nested / "b.tsv.gz", nested / "day0" / "c.tsv.gz", nested / "day0" / "d.tsv.gz",
             flat / "a.tsv.gz", flat / "b.tsv.gz"]
    for f in files:
        f.write_bytes(gzip.compress(GOOD.encode()))
    assert expand_inputs(f"{nested}/**/*.gz") == sorted(map(str, files[:4]))
    assert expand_inputs(f"{flat}/**/*.gz") == sorted(map(str, files[4:]))
    assert expand_inputs(f"{nested}/**") == sorted(map(str, files[:4]))  # directories stand for their files
    monkeypatch.chdir(tmp_path)
    assert load_config(None, ["data.train=flat/**/*.gz", "data.eval=nested/**/*.gz"]).data.eval == ["nested/**/*.gz"]
    with pytest.raises(ConfigError, match=r"^data\.train: no file matches 'flat/\*\*/\*\.parquet'"):
        load_config(None, ["data.train=flat/**/*.parquet"])


def test_binary_junk_fails_fast_with_a_clear_error(tmp_path):
    path = tmp_path / "junk"
    path.write_bytes(b"\x00\x01" * (1 << 20))  # 2 MiB, no newline: not text
    with pytest.raises(CriteoDataError, match=r"junk:1: line longer than 1 MiB"):
        list(iter_line_chunks(str(path), chunk_bytes=1 << 20))


# ---- bad rows and corrupt shards (issue 47, issue 50) --------------------------------------------------------
def long_int_line(digits: int) -> str:
    return "\t".join(["1", "1" * digits] + ["3"] * 12 + ["0a1b2c3d"] * 26)


@pytest.mark.parametrize("digits", [20, 400, 5000])
def test_a_dense_integer_too_long_for_int64_names_file_line_and_field(tmp_path, digits):
    """5,000 digits gave Python's bare `ValueError: Exceeds the limit (4300 digits)`, 400 digits an
    `OverflowError`, 20 digits a float past int64; now each is a sentence, or a counted bad row."""
    path = tmp_path / "day_1"
    path.write_text("\n".join([GOOD, long_int_line(digits), GOOD]) + "\n")
    with pytest.raises(CriteoDataError) as e:
        list(read_raw(str(path), get_spec("tiny")))
    assert str(e.value).startswith(f"{path}:2: field I1: '1111111111"), e.value
    assert f"is an integer of {digits:,} digits, outside int64's range" in str(e.value)
    assert len(str(e.value)) < 300  # the value is named, not printed
    skipped = parse_lines(path.read_bytes(), get_spec("tiny"), file=str(path), skip_bad=True)
    assert (skipped.lines, skipped.bad_rows, skipped.table.num_rows) == (3, 1, 2)


@pytest.fixture(scope="module")
def good_shard(tmp_path_factory) -> str:
    """A prepared shard of 300 synthetic rows."""
    from recgrid.data.synth import write_synth

    directory = tmp_path_factory.mktemp("good")
    write_synth(str(directory), 300, files=1, fmt="parquet", spec=get_spec("tiny"), seed=0)
    (path,) = glob.glob(str(directory / "*.parquet"))
    return path


def job_reads(path: str) -> list:
    """What a job's read tasks give for `path` (the driver's row count, then every read task in order)."""
    from recgrid.data.stream import local_batches, scan_inputs

    inputs = scan_inputs(path, get_spec("tiny"))
    return list(local_batches(inputs, inputs.units(), get_spec("tiny"), 64, drop_last=False))


@pytest.mark.parametrize("column,value,needle", [
    ("label", 7, "field label: 7 is not a label (0 or 1)"),
    ("label", -3, "field label: -3 is not a label (0 or 1)"),
    ("I5", float("nan"), "field I5: nan is not a finite dense value"),
    ("I5", float("inf"), "field I5: inf is not a finite dense value"),
    ("C3", 4000, "field C3: 4000 is outside table rows [0, 4000) of spec 'tiny'"),
    ("C3", -1, "field C3: -1 is outside table rows [0, 4000) of spec 'tiny'"),
])
def test_a_prepared_row_training_could_not_have_made_stops_the_read_naming_file_row_and_field(
        tmp_path, good_shard, column, value, needle):
    """Labels 7 and -3 and NaN or inf dense values were trained on from parquet; an id past its table
    was named `<batch>`. The shard's row 211 is planted; rows before it read as they were."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recgrid.data.stream import memory_batches

    table = pq.read_table(good_shard)
    assert len(job_reads(good_shard)) == 5
    values = table.column(column).to_pylist()
    values[211] = value
    bad = str(tmp_path / "bad.parquet")
    pq.write_table(table.set_column(table.schema.get_field_index(column), column,
                                    pa.array(values, table.schema.field(column).type)), bad, row_group_size=100)
    for read in (job_reads, lambda p: memory_batches(p, 64, get_spec("tiny"))):  # a job; `recgrid eval`
        with pytest.raises(CriteoDataError) as e:
            read(bad)
        assert str(e.value) == f"{bad}: row 211: {needle}" + ("; data prepared for another spec?" if column == "C3" else ""), e.value


def test_a_corrupt_parquet_shard_stops_the_job_and_prepare_naming_the_file(tmp_path, good_shard):
    """Issue 50: a shard whose footer is gone stops the driver's row count (before any worker
    starts); one whose footer is whole but whose page is damaged stops the read task that reads it;
    `recgrid prepare` refuses both, naming the file. Neither gives pyarrow's bare error."""
    from recgrid.data.prepare import prepare

    data = open(good_shard, "rb").read()
    truncated, damaged = str(tmp_path / "truncated.parquet"), str(tmp_path / "damaged.parquet")
    open(truncated, "wb").write(data[:len(data) // 2])
    open(damaged, "wb").write(data[:4] + b"\xff" * 36 + data[40:])  # the first page's header
    with pytest.raises(CriteoDataError) as e:
        job_reads(truncated)
    assert str(e.value).startswith(f"{truncated}: is not a readable parquet file (truncated or corrupt?): "), e.value
    with pytest.raises(CriteoDataError) as e:
        job_reads(damaged)
    assert str(e.value).startswith(f"{damaged}: row group 0 cannot be read (truncated or corrupt?): "), e.value
    assert "\n" not in str(e.value)
    for path in (truncated, damaged):
        with pytest.raises(CriteoDataError, match=f"^{re.escape(path)}: is parquet"):
            prepare([path], str(tmp_path / "out"), get_spec("tiny"), log=lambda *_: None)


def test_plain_lines_parse_the_fast_way_to_the_rows_the_general_way_gives(monkeypatch):
    """`parse_plain` (array operations over raw bytes) takes only lines the general parser accepts,
    and gives the same rows bit for bit; anything else it leaves to the general parser."""
    import random

    from recgrid.data import criteo

    spec = get_spec("tiny")
    rng = random.Random(0)
    odd = [chr(c) for c in range(1, 128) if chr(c) not in "\t\n0123456789abcdefABCDEF"] + ["\x80", "\xff"]
    dense_ok = ["", "0", "7", "-1", "-0", "007", "12345678", "-1234567", "99999999"]
    dense_other = ["-", "123456789", "+5", " 5", "1-2", "0x10", "1e3", "5\r"]
    hex_ok = ["", "68fd1e64", "ABCDEF01", "a1B2c3D4"]
    hex_other = ["1234567", "123456789", "0", "68fd1e6\r"]

    def field(ok, other, p):
        if rng.random() < p:
            return rng.choice(ok)
        return rng.choice(other + [rng.choice(ok[1:]) + rng.choice(odd), rng.choice(odd) + rng.choice(ok[1:])])

    def general(data):
        with monkeypatch.context() as m:
            m.setattr(criteo, "parse_plain", lambda *_: None)
            return parse_lines(data, spec, file="f", skip_bad=True)

    fast_taken = 0
    for _ in range(400):
        p = rng.choice([1.0, 1.0, 0.999, 0.99])
        lines = []
        for _ in range(rng.randrange(1, 40)):
            f = [rng.choice(["0", "1"]) if rng.random() < p else rng.choice(["", "2", "01", " 1"])]
            f += [field(dense_ok, dense_other, p) for _ in range(13)] + [field(hex_ok, hex_other, p) for _ in range(26)]
            if rng.random() > p:
                f = f[:rng.randrange(40)] + (["x"] if rng.random() < 0.5 else [])
            lines.append("\t".join(f))
        data = ("\n".join(lines) + "\n").encode("latin-1")
        fast = criteo.parse_plain(data, spec)
        if fast is None:
            continue
        fast_taken += 1
        slow = general(data)
        assert slow.bad_rows == 0 and len(fast) == slow.table.num_columns
        for a, b in zip(fast, slow.table.columns):
            assert pa.array(a).type == b.type and a.tobytes() == b.to_numpy().tobytes()
    assert fast_taken > 100
    # the whole chunk goes the general way when one line is not plain, and keeps its line numbers
    with pytest.raises(CriteoDataError, match=r"f:3: field C1: '1234567g' is not a hexadecimal id"):
        parse_lines(((GOOD + "\n") * 2 + GOOD.replace("0a1b2c3d", "1234567g", 5) + "\n").encode(), spec, file="f")
