"""criteo.py without Ray: line chunking and numbering across chunks and parts, cutting a plain file
into parts, format sniffing and input expansion."""

from __future__ import annotations

import gzip
import os

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
