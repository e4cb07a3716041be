"""`recgrid synth`: same seed same bytes, hex that maps back to the intended ids, Criteo-like
statistics, and a planted signal that logistic regression learns (shuffled labels: nothing);
`data.synth_if_missing` writes only into a missing or empty directory."""

from __future__ import annotations

import filecmp
import os
import re

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from recgrid import cli
from recgrid.data.criteo import ROW_ID, read_raw
from recgrid.data.specs import DENSE_NAMES, SPARSE_NAMES, get_spec
from recgrid.data.synth import POSITIVE_RATE, HiddenModel, ensure_synth, synth_table, write_synth


@pytest.mark.parametrize("fmt", ["tsv", "tsv.gz", "parquet"])
def test_same_seed_same_bytes(tmp_path, fmt):
    a, b, c = (str(tmp_path / n) for n in "abc")
    for out, seed in ((a, 5), (b, 5), (c, 6)):
        assert cli.main(["synth", "--out", out, "--rows", "3000", "--files", "2", "--format", fmt,
                         "--spec", "tiny", "--seed", str(seed)]) == 0
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)) == [f"part-0000{i}-of-00002.{fmt}" for i in range(2)]
    for n in names:
        assert filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)
        assert not filecmp.cmp(os.path.join(a, n), os.path.join(c, n), shallow=False)


def test_hex_maps_back_to_intended_ids_and_raw_parses_to_parquet(tmp_path):
    spec = get_spec("criteo_kaggle", max_rows_per_table=5000)
    model = HiddenModel(spec, seed=2)
    s = model.sample(20000, np.random.default_rng(0))
    rows = np.array(spec.table_rows, dtype=np.uint64)
    assert (s.hashes < 2**32).all()  # 8 hex digits, as in Criteo
    assert ((s.hashes % rows).astype(np.int64) == s.ids).all()
    # the same id always gets the same hex, so a smaller cap still sees one (collided) id
    again = model.hex_hash(3, s.ids[:, 3])
    assert (again == s.hashes[:, 3]).all()
    raw = write_synth(str(tmp_path / "raw"), 4000, 1, "tsv", spec, seed=2)
    prepared = write_synth(str(tmp_path / "pq"), 4000, 1, "parquet", spec, seed=2)
    parsed = next(read_raw(raw[0], spec)).table
    assert parsed.equals(pq.read_table(prepared[0]).replace_schema_metadata(None).drop_columns([ROW_ID]))
    # the in-memory source draws the same rows; another stream draws others from the same model
    assert synth_table(spec, 4000, seed=2).equals(parsed)
    other = synth_table(spec, 4000, seed=2, stream=1)
    assert not other.equals(parsed) and abs(pc.mean(other["label"]).as_py() - POSITIVE_RATE) < 0.03


def test_criteo_like_statistics():
    spec = get_spec("tiny")
    s = HiddenModel(spec, seed=0).sample(50000, np.random.default_rng(1))
    assert abs(s.label.mean() - POSITIVE_RATE) < 0.015
    assert abs(s.dense_missing[:, 11].mean() - 0.77) < 0.02 and s.dense_missing[:, 1].mean() == 0
    assert abs(s.sparse_missing[:, 21].mean() - 0.76) < 0.02 and (s.dense < 0).any()
    # power law: the most frequent id of a 4000-row table takes a large share, most ids are rare
    counts = np.sort(np.bincount(s.ids[~s.sparse_missing[:, 2], 2], minlength=4000))[::-1]
    assert counts[0] > 0.03 * counts.sum() and (counts <= 2).sum() > 1000


def _arrays(path):
    t = pq.read_table(path)
    dense = torch.from_numpy(np.stack([t.column(n).to_numpy() for n in DENSE_NAMES], 1))
    ids = torch.from_numpy(np.stack([t.column(n).to_numpy() for n in SPARSE_NAMES], 1))
    return dense, ids, torch.from_numpy(t.column("label").to_numpy().astype(np.float32))


def normalized_entropy(p: torch.Tensor, y: torch.Tensor) -> float:
    p = p.clamp(1e-7, 1 - 1e-7)
    logloss = -(y * p.log() + (1 - y) * (1 - p).log()).mean()
    r = y.mean()
    return float(logloss / -(r * r.log() + (1 - r) * (1 - r).log()))


def logistic_regression_ne(train, test, epochs: int = 1, seed: int = 0) -> float:
    """Held-out NE of a logistic regression over standardised dense features and one weight per id."""
    spec = get_spec("tiny")
    torch.manual_seed(seed)
    d, c, y = train
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(spec.table_rows)[:-1]]))
    weights = torch.nn.Embedding(sum(spec.table_rows), 1, sparse=True)
    torch.nn.init.zeros_(weights.weight)
    linear = torch.nn.Linear(13, 1)
    mu, sd = d.mean(0), d.std(0) + 1e-6
    opt = torch.optim.Adagrad([*weights.parameters(), *linear.parameters()], lr=0.05)

    def logit(d, c):
        return linear((d - mu) / sd).squeeze(1) + weights(c + offsets).sum((1, 2))

    for _ in range(epochs):
        for b in torch.randperm(len(y)).split(256):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logit(d[b], c[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        return normalized_entropy(torch.sigmoid(logit(test[0], test[1])), test[2])


def test_planted_signal_is_learnable_and_shuffled_labels_are_not(tmp_path):
    spec = get_spec("tiny")
    train = write_synth(str(tmp_path / "train"), 60000, 1, "parquet", spec, seed=0)
    # held-out rows: another draw (stream) of the same hidden model
    test = write_synth(str(tmp_path / "test"), 20000, 1, "parquet", spec, seed=0, stream=1)[0]
    tr, te = _arrays(train[0]), _arrays(test)
    ne = logistic_regression_ne(tr, te)
    g = torch.Generator().manual_seed(0)
    shuffled = (tr[0], tr[1], tr[2][torch.randperm(len(tr[2]), generator=g)])
    te_shuffled = (te[0], te[1], te[2][torch.randperm(len(te[2]), generator=g)])
    ne_shuffled = logistic_regression_ne(shuffled, te_shuffled)
    print(f"held-out NE: planted {ne:.3f}, shuffled labels {ne_shuffled:.3f}")
    assert ne < 0.8
    assert 0.98 < ne_shuffled < 1.06


def test_synthetic_data_is_written_only_where_no_file_is(tmp_path):
    """A glob that matches nothing beside the user's files is an error naming the glob and the
    directory, and the directory is unchanged; a missing directory gets the synthetic files."""
    from recgrid.config import ConfigError, load_config
    from recgrid.launch.ray import ensure_data

    user = tmp_path / "user"
    (user / "day0").mkdir(parents=True)
    for name in ("a.tsv.gz", "b.tsv.gz", "day0/c.tsv.gz"):
        (user / name).write_bytes(b"the user's rows")
    before = sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in user.rglob("*"))
    config = load_config(None, [f"data.train={user}/*.parquet", f"data.eval={tmp_path}/eval/*.parquet",
                                "data.synth_if_missing=true", "data.synth_rows=100", "data.synth_eval_rows=100"])
    with pytest.raises(ConfigError, match=rf"^data\.train: {re.escape(repr(f'{user}/*.parquet'))} matches no file, "
                                          rf"but {re.escape(str(user))} holds a\.tsv\.gz, b\.tsv\.gz, day0: .*never "
                                          r"beside other files"):
        ensure_data(config)
    assert sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in user.rglob("*")) == before
    assert not (tmp_path / "eval").exists()  # nothing written for the eval glob either: the job stopped first
    spec = get_spec("tiny")
    assert ensure_synth(f"{user}/**/*.gz", 100, spec, 0, 0) == []  # matches the user's 3 files: nothing written
    # a glob the synthetic files would not match: refused, and the directories made for them removed
    with pytest.raises(ValueError, match=r"'.*/new/deeper/day\*\.parquet' does not match the synthetic files"):
        ensure_synth(f"{tmp_path}/new/deeper/day*.parquet", 100, spec, 0, 0, say=lambda _: None)
    assert not (tmp_path / "new").exists()
    written = ensure_synth(f"{tmp_path}/new/**/*.parquet", 100, spec, 0, 0, say=lambda _: None)
    assert written == [str(tmp_path / "new" / "part-00000-of-00001.parquet")]
