"""Raw Criteo lines through `recgrid prepare` and through raw streaming, value by value; bad input;
resume. Real Ray (one local cluster for the module), real files."""

from __future__ import annotations

import glob
import gzip
import math
import os
import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from recgrid import cli
from recgrid.data.criteo import ROW_ID, CriteoDataError, expand_inputs, sniff_format
from recgrid.data.stream import read_dataset
from recgrid.data.prepare import prepare
from recgrid.data.specs import DENSE_NAMES, SPARSE_NAMES, get_spec
from recgrid.data.synth import write_synth


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(shared_ray):
    """The suite's shared local cluster (the README recipe's train runs on it, as `recgrid train` would)."""


def line(label: str, dense: list[str], cats: list[str]) -> str:
    return "\t".join([label, *dense, *cats])


# Hand-written rows: negatives, missing values, upper/lower/mixed-case hex, short and 16-digit hex,
# a dense value past int32, an all-missing row.
ROWS = [
    ("1", ["-1", "0", "5", "", "3", "-3", "100", "", "7", "2", "0", "1", "2147483648"],
     ["68fd1e64", "80E26C9B", "fb936136", "", "7b4723c4", "25c83c98", "7e0ccccf", "de7995b8", "1f89b562",
      "a73ee510", "a8cd5504", "b2cb9c98", "37c9c164", "2824a5f6", "1adce6ef", "8ba8b39a", "891b62e7",
      "e5ba7672", "f54016b9", "21ddcdc9", "b1252a9d", "07b5194c", "", "3a171ecb", "c5c50484", "e8b83407"]),
    ("0", [""] * 13, [""] * 26),
    ("0", ["12", "-2", "", "0", "999999", "", "", "4", "", "", "1", "", "-7"],
     ["AbCdEf01", "1", "ffffffffffffffff", "DEADBEEF", "0", "00000000", "FFFFFFFF", "a", "7", "0a",
      "", "", "12345678", "9abcdef0", "cafebabe", "", "8badf00d", "", "", "", "", "", "", "", "", "1F"]),
    ("1", ["0"] * 13, ["0badcafe"] * 26),
]
LINES = [line(*r) for r in ROWS]


def expected(spec):
    """The transforms, written out independently of criteo.py: Python ints and math.log1p."""
    out = []
    for label, dense, cats in ROWS:
        row = {"label": int(label)}
        for name, v in zip(DENSE_NAMES, dense):
            row[name] = np.float32(math.log1p(max(int(v), 0))) if v else np.float32(0.0)
        for name, v, rows in zip(SPARSE_NAMES, cats, spec.table_rows):
            row[name] = int(v, 16) % rows if v else 0
        out.append(row)
    return out


def check_rows(got: list[dict], spec) -> None:
    want = expected(spec)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        for k, v in w.items():
            if k.startswith("I"):
                assert np.float32(g[k]) == v, (i, k, g[k], v)
            else:
                assert int(g[k]) == v, (i, k, g[k], v)


def write(path: str, lines: list[str], gz: bool = False) -> str:
    data = ("\n".join(lines) + "\n").encode()
    with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
        f.write(data)
    return path


def shards(out: str) -> list[str]:
    return sorted(glob.glob(os.path.join(out, "*.parquet")))


def leftovers(out: str) -> list[str]:
    return [n for n in os.listdir(out) if n.startswith(".")] if os.path.isdir(out) else []


def read_shards(out: str) -> list[dict]:
    rows = []
    for p in shards(out):
        rows += pq.read_table(p).to_pylist()
    return rows


def test_hand_written_lines_through_prepare_plain_and_gzip(tmp_path):
    spec = get_spec("tiny")
    # the 1TB day files have no extension; gzip is told by its magic bytes, not a name
    day0 = write(str(tmp_path / "day_0"), LINES)
    day1 = write(str(tmp_path / "day_1"), LINES, gz=True)
    assert sniff_format(day0) == "tsv" and sniff_format(day1) == "tsv.gz"
    out = str(tmp_path / "out")
    r = prepare([day0], out, spec, log=lambda *_: None)
    assert (r.rows, r.bad_rows, r.shards_written) == (4, 0, 1)
    check_rows(read_shards(out), spec)
    schema = pq.read_schema(shards(out)[0])
    assert str(schema.field("label").type) == "int32"
    assert all(str(schema.field(n).type) == "float" for n in DENSE_NAMES)
    assert all(str(schema.field(n).type) == "int64" for n in SPARSE_NAMES)
    out_gz = str(tmp_path / "out_gz")
    prepare([day1], out_gz, spec, log=lambda *_: None)
    check_rows(read_shards(out_gz), spec)


def test_hand_written_lines_through_raw_streaming_with_row_cap(tmp_path):
    # the cap makes the modulus min(rows, 1000): C3 (10M rows in Kaggle) now wraps at 1000
    spec = get_spec("criteo_kaggle", max_rows_per_table=1000)
    assert spec.table_rows[2] == 1000 and spec.table_rows[8] == 3
    path = write(str(tmp_path / "day_0"), LINES)
    gz = write(str(tmp_path / "day_0.gz"), LINES, gz=True)
    for p in (path, gz):
        check_rows(read_dataset(p, spec).take_all(), spec)


def test_cli_prepare_final_line_and_multi_part_split(tmp_path, capsys):
    # 10 lines of each hand row -> 40 lines, 3 parts of 16 lines: part boundaries inside a file
    path = write(str(tmp_path / "train.txt"), LINES * 10)
    out = str(tmp_path / "out")
    assert cli.main(["prepare", path, "--out", out, "--spec", "tiny", "--rows-per-file", "16"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("prepared 40 rows, 0 bad rows,") and "rows/s" in last
    assert [pq.read_metadata(p).num_rows for p in shards(out)] == [16, 16, 8]
    got = read_shards(out)
    for k in range(10):
        check_rows(got[4 * k:4 * k + 4], get_spec("tiny"))


BAD_CASES = [
    # (line to put at line 3, substrings the error must name besides the file and line)
    (line("1", ["1"] * 13, ["0"] * 25), ["39 tab-separated fields"]),
    (line("1", ["1"] * 13, ["0"] * 27), ["41 tab-separated fields"]),
    (line("1", ["1"] * 13, ["0"] * 6 + ["12G45678"] + ["0"] * 19), ["field C7", "12G45678", "not a hexadecimal"]),
    (line("1", ["1"] * 13, ["0"] * 6 + ["0x1f"] + ["0"] * 19), ["field C7", "0x1f"]),
    (line("1", ["1", "2", "3", "1.5"] + ["1"] * 9, ["0"] * 26), ["field I4", "1.5", "not an integer"]),
    (line("1", ["1", "0x10"] + ["1"] * 11, ["0"] * 26), ["field I2", "0x10", "not an integer"]),
    (line("1", ["1", "9" * 5000] + ["1"] * 11, ["0"] * 26), ["field I2", "5,000 digits, outside int64's range"]),
    (line("2", ["1"] * 13, ["0"] * 26), ["field label", "'2'"]),
    (line("", ["1"] * 13, ["0"] * 26), ["field label", "missing label"]),
    ("", ["empty line"]),
]


@pytest.mark.parametrize("bad_line,needles", BAD_CASES)
def test_bad_line_stops_prepare_naming_file_line_field(tmp_path, bad_line, needles):
    path = write(str(tmp_path / "day_3"), LINES[:2] + [bad_line] + LINES[2:])
    out = str(tmp_path / "out")
    with pytest.raises(CriteoDataError) as e:
        prepare([path], out, get_spec("tiny"), log=lambda *_: None)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: "), msg
    for needle in needles:
        assert needle in msg, msg
    assert shards(out) == [] and leftovers(out) == []  # nothing that looks complete, no temp file


def test_bad_line_in_raw_streaming_names_file_line_field(tmp_path):
    path = write(str(tmp_path / "day_5"), LINES + [line("1", ["1"] * 13, ["0"] * 11 + ["xyz"] + ["0"] * 14)])
    with pytest.raises(Exception) as e:
        read_dataset(path, get_spec("tiny")).take_all()
    assert f"{path}:5: field C12: 'xyz'" in str(e.value)


def test_empty_and_truncated_gzip_and_missing_glob(tmp_path):
    spec = get_spec("tiny")
    empty = write(str(tmp_path / "empty"), [])
    open(empty, "wb").close()
    with pytest.raises(CriteoDataError, match=r"empty:1: empty file"):
        prepare([empty], str(tmp_path / "o1"), spec, log=lambda *_: None)
    empty_gz = str(tmp_path / "empty.gz")
    with gzip.open(empty_gz, "wb"):
        pass
    with pytest.raises(CriteoDataError, match=r"empty.gz:1: empty file"):
        prepare([empty_gz], str(tmp_path / "o2"), spec, log=lambda *_: None)

    full = str(tmp_path / "full.gz")
    write(full, LINES * 500, gz=True)
    data = open(full, "rb").read()
    trunc = str(tmp_path / "day_7")
    with open(trunc, "wb") as f:
        f.write(data[: len(data) // 2])
    out = str(tmp_path / "o3")
    with pytest.raises(CriteoDataError, match=r"day_7:\d+: truncated or corrupt gzip stream after line \d+"):
        prepare([trunc], out, spec, log=lambda *_: None)
    assert shards(out) == [] and leftovers(out) == []
    with pytest.raises(Exception, match=r"truncated or corrupt gzip"):
        read_dataset(trunc, spec).take_all()
    # with parts, the parts before the damage are complete and stay; the damaged one is not written
    out4 = str(tmp_path / "o4")
    with pytest.raises(CriteoDataError, match="truncated"):
        prepare([trunc], out4, spec, rows_per_file=100, allow_bad_rows=0.5, log=lambda *_: None)
    done = shards(out4)
    assert done and all(pq.read_metadata(p).num_rows == 100 for p in done) and leftovers(out4) == []

    with pytest.raises(CriteoDataError, match=r"nothing-\*.tsv: glob matches no file"):
        expand_inputs([str(tmp_path / "nothing-*.tsv")])
    assert cli.main(["prepare", str(tmp_path / "nothing-*.tsv"), "--out", str(tmp_path / "o5"), "--spec", "tiny"]) == 1


def test_allow_bad_rows_counts_and_enforces_bound(tmp_path, capsys):
    bad = [line("1", ["x"] + ["1"] * 12, ["0"] * 26), line("1", ["1"] * 13, ["0"] * 20)]
    path = write(str(tmp_path / "day_9"), LINES * 4 + bad)  # 18 lines, 2 bad: 11.1%
    out = str(tmp_path / "out")
    assert cli.main(["prepare", path, "--out", out, "--spec", "tiny", "--allow-bad-rows", "0.05"]) == 1
    err = capsys.readouterr().err
    assert "2 bad rows of 18 lines" in err and "exceed --allow-bad-rows 0.05" in err
    assert f"{path}:17: field I1: 'x' is not an integer" in err
    # the shard holds only good rows, so a rerun with a looser bound reuses it
    assert cli.main(["prepare", path, "--out", out, "--spec", "tiny", "--allow-bad-rows", "0.2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("prepared 16 rows, 2 bad rows,") and "0 shards written, 1 already done" in last
    check_rows(read_shards(out)[:4], get_spec("tiny"))


def test_resume_skips_finished_shards_and_refuses_changed_inputs(tmp_path):
    spec = get_spec("tiny")
    src = str(tmp_path / "raw")
    write_synth(src, rows=3000, files=2, fmt="tsv", spec=spec, seed=3)
    gz = write_synth(str(tmp_path / "rawgz"), rows=1000, files=1, fmt="tsv.gz", spec=spec, seed=4)
    out = str(tmp_path / "out")
    first = prepare([src, gz[0]], out, spec, rows_per_file=400, log=lambda *_: None)
    names = shards(out)
    assert first.rows == 4000 and first.shards_written == len(names) == 4 + 4 + 3
    before = {p: open(p, "rb").read() for p in names}
    # a killed run: one plain shard and one gzip part gone, a temp file left behind
    os.remove([p for p in names if "part-00001-of-00002" in p][2])
    os.remove([p for p in names if "part-00000-of-00001" in p][1])
    open(os.path.join(out, ".tmp-x.parquet.123"), "wb").close()
    again = prepare([src, gz[0]], out, spec, rows_per_file=400, log=lambda *_: None)
    assert again.rows == 4000 and again.shards_written == 2 and again.shards_skipped == 9
    assert {p: open(p, "rb").read() for p in shards(out)} == before and leftovers(out) == []
    # another --rows-per-file over the same output would mix two cuts of the data: refused
    with pytest.raises(CriteoDataError, match="prepared from other inputs or settings"):
        prepare([src], out, spec, rows_per_file=500, log=lambda *_: None)
    # and prepared shards refuse a spec with other table rows when streamed
    with pytest.raises(CriteoDataError, match="prepared for table rows"):
        read_dataset(out, get_spec("tiny", max_rows_per_table=100))


def test_synth_raw_through_prepare_equals_synth_parquet(tmp_path):
    spec = get_spec("tiny")
    raw = write_synth(str(tmp_path / "raw"), rows=5000, files=2, fmt="tsv.gz", spec=spec, seed=11)
    pqt = write_synth(str(tmp_path / "pq"), rows=5000, files=2, fmt="parquet", spec=spec, seed=11)
    out = str(tmp_path / "out")
    prepare(raw, out, spec, log=lambda *_: None)
    for i in range(2):
        got = pq.read_table(shards(out)[i]).replace_schema_metadata(None)
        want = pq.read_table(pqt[i]).replace_schema_metadata(None)
        # synthetic parquet also numbers its rows (for audits); raw text has no such column
        assert want.column(ROW_ID).to_pylist() == list(range(i * 2500, (i + 1) * 2500))
        assert got.equals(want.drop_columns([ROW_ID]))


# ---- the README's real-Criteo recipe (issue 17, acceptance 6) ------------------------------------
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def readme_recipe(marker: str) -> tuple[list[str], list[str]]:
    """The variable lines and the commands (continuations joined) of the ```sh block after `marker`."""
    text = open(README).read()
    block = text[text.index(marker):].split("```sh\n", 1)[1].split("\n```", 1)[0]
    logical = block.replace("\\\n", " ").splitlines()
    variables = [ln for ln in logical if re.match(r"^[A-Z_]+=", ln)]
    commands = [ln.strip() for ln in logical if ln.strip().startswith("recgrid ")]
    assert variables and commands, block
    return variables, commands


def test_readme_criteo_recipe_prepares_then_trains_on_days_0_22_and_evaluates_on_day_23(tmp_path):
    """The README's recipe as written, on 24 small raw day files named as Criteo names them
    (`day_0.gz` … `day_23.gz`): the shell expands its commands (with its own CRITEO and CAP), then
    `prepare` runs as written and `train` with a short run's settings appended (steps, batch, CPUs
    for this machine, a store in tmp). No evaluation shard matches a training glob."""
    import fnmatch
    import shlex
    import subprocess

    from mlflow.tracking import MlflowClient

    from recgrid.config import load_config
    from recgrid.data.criteo import CriteoDataError
    from recgrid.data.stream import scan_inputs

    rows_per_day = 40
    raw = tmp_path / "synth"
    for day, path in enumerate(write_synth(str(raw), 24 * rows_per_day, files=24, fmt="tsv.gz", spec="tiny", seed=3)):
        os.replace(path, tmp_path / f"day_{day}.gz")
    variables, commands = readme_recipe("<!-- recipe:criteo-1tb")
    assert [v.split("=")[0] for v in variables] == ["CRITEO", "CAP"]
    assert [c.split()[1] for c in commands] == ["prepare", "train"]
    mine = f"CRITEO={shlex.quote(str(tmp_path))}; CAP=1000; "
    argvs = [subprocess.run(["bash", "-c", mine + "printf '%s\\0' " + c[len("recgrid "):]], check=True,
                            capture_output=True, text=True).stdout.split("\0")[:-1] for c in commands]

    assert cli.main(argvs[0]) == 0
    out = tmp_path / "parquet"
    assert sorted({os.path.basename(p).split("-")[0] for p in glob.glob(str(out / "*.parquet"))}) == \
        sorted(f"day_{d}" for d in range(24))
    short = ["train.max_steps=4", "train.batch_size=32", "train.log_every=2", "train.cpus_per_worker=0.25",
             f"train.storage_path={tmp_path}/ray", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
             "tracking.experiment=test-readme-recipe"]
    train_argv = argvs[1] + sum((["--set", s] for s in short), [])
    cfg = load_config(train_argv[1], [a for i, a in enumerate(train_argv) if i and train_argv[i - 1] == "--set"])
    train_files = sorted({f for g in cfg.data.train for f in glob.glob(g)})
    eval_files = sorted({f for g in cfg.data.eval for f in glob.glob(g)})
    days = lambda files: sorted({int(os.path.basename(f).split("-")[0][4:]) for f in files})  # noqa: E731
    assert days(train_files) == list(range(23)) and days(eval_files) == [23]
    assert not [(f, g) for f in eval_files for g in cfg.data.train if fnmatch.fnmatch(f, g)]
    assert fnmatch.fnmatch(eval_files[0], str(out / "day_[0-22]*"))  # the old recipe's glob took day 23 too
    with pytest.raises(CriteoDataError, match="prepared for table rows"):
        scan_inputs(train_files[:1], get_spec("criteo_1tb"))  # shards prepared with CAP refuse a train without it

    assert cli.main(train_argv) == 0
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("test-readme-recipe").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["data.max_rows_per_table"] == "1000"
    assert run.data.metrics["eval/examples"] == rows_per_day  # day 23, every row once
