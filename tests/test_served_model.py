"""A job's model as MLflow serves it (launch/served.py, launch/model.py): raw rows in, click
probabilities out, equal to `recgrid eval`'s; bad values refused naming their row and column.

Models here are built unsharded with random tables (`launch.unshard.build_unsharded`, no job, no Ray)
and saved as `recgrid export` saves them; `recgrid eval` runs on a raw TSV file of synthetic rows and
the served model on the DataFrame `pandas.read_csv` gives of the same file. The same model served
from a virtualenv without recgrid, over HTTP, is tests/test_served_venv.py.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pandas as pd
import pytest
import torch

from recgrid.data.specs import DENSE_NAMES, SPARSE_NAMES

TINY = ["data.spec=tiny", "data.train=none/*.parquet"]
QR = ["model.compression=qr", "model.qr_threshold_rows=2000", "model.qr_collisions=8", "model.head_rows=4"]


def random_model(overrides: list[str], seed: int = 0):
    """An unsharded model of `overrides` (a job's config keys), its tables drawn N(0, 0.5) so every id's
    row tells; a head cache gets 4 ids of each compressed feature, the first one the rows below use."""
    from recgrid.config import load_config
    from recgrid.launch.unshard import build_unsharded

    config = load_config(None, TINY + overrides, check_paths=False)
    compression = config.compression()
    if compression is not None and compression.wants_head:
        compression = compression.with_heads({f: [0, 17, 2939, 3999 - f] for f in compression.features(config.dataset_spec())})
    model = build_unsharded(config, compression, {"step": 1})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if "embedding_bags" in name:
                t.copy_(torch.randn(t.shape, generator=generator) * 0.5)
    return model


def raw_rows(directory, spec, rows: int = 200) -> str:
    from recgrid.data.synth import write_synth

    write_synth(str(directory), rows, files=1, fmt="tsv", spec=spec, seed=3)
    (path,) = glob.glob(str(directory / "*"))
    return path


def client_frame(path: str) -> pd.DataFrame:
    """A raw Criteo file as a client reads it: tab-separated, no header, the categorical columns as
    strings (missing values NaN), the label dropped, the spec's column names set."""
    df = pd.read_csv(path, sep="\t", header=None, dtype={i: str for i in range(14, 40)})
    df = df.drop(columns=[0])
    df.columns = [*DENSE_NAMES, *SPARSE_NAMES]
    return df


def eval_probabilities(model_dir: str, data: str, out) -> np.ndarray:
    """`recgrid eval MODEL --data FILE --predictions OUT`'s probabilities."""
    from recgrid.cli import main

    assert main(["eval", model_dir, "--data", data, "--predictions", str(out)]) == 0
    return np.loadtxt(out, ndmin=1)


@pytest.mark.parametrize("overrides", [
    [],                                                                   # DLRM, one table per feature
    ["model.arch=dcn", *QR, "model.qr_operation=add"],                    # DCN over QR + head tables
    [*QR, "model.qr_operation=concat", "data.multi_hot=true"],            # multi-hot bags through QR halves
], ids=["dlrm", "dcn-qr-head", "multihot-qr-concat"])
def test_the_served_model_scores_raw_rows_as_recgrid_eval_does(tmp_path, overrides):
    """Issue 47, acceptance 1 (in this process): the model saved as recgrid saves it, loaded by MLflow
    (`mlflow.pyfunc.load_model`, its code from the model directory), scores a raw file's rows
    read by pandas, hex strings and missing values as they are, with `recgrid eval`'s probabilities
    (1e-6), in a column named `probability`."""
    import mlflow.pyfunc

    from recgrid.launch.model import save_model_dir
    from recgrid.launch.unshard import model_spec

    model = random_model(overrides)
    save_model_dir(model, str(tmp_path / "model"))
    data = raw_rows(tmp_path / "raw", model_spec(model))
    want = eval_probabilities(str(tmp_path / "model"), data, tmp_path / "p.txt")
    df = client_frame(data)
    assert df.isna().any().any() and pd.api.types.is_string_dtype(df["C1"])  # missing values, hex strings
    got = mlflow.pyfunc.load_model(str(tmp_path / "model")).predict(df)
    assert list(got.columns) == ["probability"] and len(got) == len(want) == 200
    assert np.abs(got["probability"].to_numpy() - want).max() <= 1e-6
    assert want.std() > 0.005  # the rows' probabilities differ: a wrong row would show


def test_ids_above_2_24_reach_their_own_row(tmp_path):
    """Ids past float32's exact integers (2**24), as integers or as hex strings, are scored as
    `recgrid eval` scores the raw file that holds them: 123456789 is not read as 123456792."""
    import mlflow.pyfunc

    from recgrid.data.transforms import categorical_hashes, transform_categorical
    from recgrid.launch.model import save_model_dir

    hashes = np.array([2**24 + 1, 123456789, 123456792, 2**53 + 1, 2**64 - 1], dtype=np.uint64)
    got, missing = categorical_hashes(hashes, "C1")
    assert got.tolist() == hashes.tolist() and not missing.any()
    assert transform_categorical(got[1:3], 40_000_000).tolist() == [3456789, 3456792]  # Criteo 1TB's cap
    assert categorical_hashes(np.array([123456789.0, np.nan]), "C1")[0][0] == 123456789  # float64: exact here
    model = random_model([])
    save_model_dir(model, str(tmp_path / "model"))
    ids = [123456789, 123456792, 2**40 + 3, 2**62 + 11]
    lines = ["\t".join(["1"] + ["2"] * 13 + [format(i + f, "x") for f in range(26)]) for i in ids]
    (tmp_path / "big.tsv").write_text("\n".join(lines) + "\n")
    want = eval_probabilities(str(tmp_path / "model"), str(tmp_path / "big.tsv"), tmp_path / "p.txt")
    served = mlflow.pyfunc.load_model(str(tmp_path / "model"))
    as_ints = pd.DataFrame({**{n: [2] * len(ids) for n in DENSE_NAMES},
                            **{n: [i + f for i in ids] for f, n in enumerate(SPARSE_NAMES)}})
    as_hex = client_frame(str(tmp_path / "big.tsv"))
    for df in (as_ints, as_hex):
        assert np.abs(served.predict(df)["probability"].to_numpy() - want).max() <= 1e-6
    assert abs(want[0] - want[1]) > 1e-4  # neighbours in float32, different rows here


def test_a_40m_row_tables_ids_above_2_24_and_its_head_ids_reach_their_own_rows(tmp_path):
    """Criteo 1TB's 40M-row tables, QR-compressed (so the test's tables stay small) with a head cache
    whose ids pass 2**24: an id in the head, 2**24 + 1, and its float32 neighbour 2**24 each reach
    their own row (head and quotient/remainder), as `recgrid eval` reads them."""
    import mlflow.pyfunc

    from recgrid.config import load_config
    from recgrid.launch.model import save_model_dir
    from recgrid.launch.unshard import build_unsharded

    config = load_config(None, ["data.spec=criteo_1tb", "data.train=none/*.parquet", "model.embedding_dim=16",
                                "model.compression=qr", "model.qr_threshold_rows=2000", "model.qr_collisions=8192",
                                "model.head_rows=2", "model.qr_operation=add"], check_paths=False)
    spec = config.dataset_spec()
    assert spec.table_rows[0] == 40_000_000
    compression = config.compression().with_heads({f: [2**24 + 1, 33_554_433] if f == 0 else [1, 2]
                                                   for f in config.compression().features(spec)})
    model = build_unsharded(config, compression, {"step": 1})
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if "embedding_bags" in name:
                t.copy_(torch.randn(t.shape, generator=generator) * 0.5)
    save_model_dir(model, str(tmp_path / "model"))
    ids = [2**24 + 1, 2**24, 123456789, 33_554_433]
    lines = ["\t".join(["1"] + ["2"] * 13 + [format(i, "x")] + ["0a1b2c3d"] * 25) for i in ids]
    (tmp_path / "big.tsv").write_text("\n".join(lines) + "\n")
    want = eval_probabilities(str(tmp_path / "model"), str(tmp_path / "big.tsv"), tmp_path / "p.txt")
    got = mlflow.pyfunc.load_model(str(tmp_path / "model")).predict(client_frame(str(tmp_path / "big.tsv")))
    assert np.abs(got["probability"].to_numpy() - want).max() <= 1e-6
    assert abs(want[0] - want[1]) > 1e-4 and abs(want[0] - want[3]) > 1e-4  # three rows, not one


@pytest.mark.parametrize("column,value,needle", [
    ("C3", "zz12", "'zz12' is not a hexadecimal id of 1 to 16 digits"),
    ("C3", -5, "-5 is not an id in [0, 2**64)"),
    ("I2", 1.5, "1.5 is not an integer: the model takes the raw files' integers"),
    ("I2", "9" * 5000, "'9999999999999999999...9999999' (5000 characters) is an integer of 5,000 digits, outside "
                       "int64's range"),
    ("I2", float("inf"), "inf is not a finite number"),
    ("C7", 2.0**60, "e+18 is a float above 2**53, which cannot say which id it is"),
])
def test_a_bad_value_is_refused_naming_its_row_and_column(served, column, value, needle):
    """MLflow's INVALID_PARAMETER_VALUE (its scoring server's HTTP 400, checked here through the
    server's own request handler too), not a stack trace or a silent score."""
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc import scoring_server

    model, df = served
    bad = df.copy().astype({column: object})
    bad.loc[4, column] = value
    with pytest.raises(MlflowException) as refused:
        model.predict(bad)
    message = refused.value.message
    assert f"row 4, column {column}: " in message and needle in message, message
    assert refused.value.get_http_status_code() == 400
    if value != float("inf"):  # JSON has no inf
        body = '{"dataframe_split": ' + bad.to_json(orient="split", index=False) + "}"
        with pytest.raises(MlflowException) as served_refusal:
            scoring_server.invocations(body, "application/json", model, model.metadata.get_input_schema())
        message = served_refusal.value.message
        assert f"row 4, column {column}: " in message and needle in message, message
        assert served_refusal.value.get_http_status_code() == 400


def test_the_served_model_names_a_missing_column(served):
    from mlflow.exceptions import MlflowException

    model, df = served
    with pytest.raises(MlflowException, match=r"Model is missing inputs \['C26'\]|no column C26"):
        model.predict(df.drop(columns=["C26"]))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A saved model loaded by MLflow, and a client's DataFrame of 8 raw rows."""
    import mlflow.pyfunc

    from recgrid.launch.model import save_model_dir
    from recgrid.launch.unshard import model_spec

    tmp = tmp_path_factory.mktemp("served")
    model = random_model([])
    save_model_dir(model, str(tmp / "model"))
    return mlflow.pyfunc.load_model(str(tmp / "model")), client_frame(raw_rows(tmp / "raw", model_spec(model), 8))


def test_export_writes_a_fresh_private_model_that_reads_back_tensor_for_tensor(tmp_path):
    """`recgrid export MODEL_DIR --out DIR` rebuilds the model from its weights and architecture and
    writes it again with this recgrid's code: 0700 directories, 0600 files, the same tensors."""
    from recgrid.cli import main
    from recgrid.launch.model import read_model_dir, save_model_dir

    model = random_model(QR)
    save_model_dir(model, str(tmp_path / "model"))
    assert main(["export", str(tmp_path / "model"), "--out", str(tmp_path / "again")]) == 0
    modes = {os.path.relpath(os.path.join(r, n), tmp_path / "again"): os.stat(os.path.join(r, n)).st_mode & 0o777
             for r, ds, fs in os.walk(tmp_path / "again") for n in ds + fs}
    assert os.stat(tmp_path / "again").st_mode & 0o777 == 0o700 and "artifacts/weights.pt" in modes
    assert {m for m in modes.values()} == {0o700, 0o600}
    assert all(m == (0o700 if os.path.isdir(tmp_path / "again" / rel) else 0o600) for rel, m in modes.items())
    again = read_model_dir(str(tmp_path / "again")).state_dict()
    assert again.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.items())
