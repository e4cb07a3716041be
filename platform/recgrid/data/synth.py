"""Synthetic Criteo-format data with a planted, learnable signal (`recgrid synth`).

Owns the hidden model that labels the synthetic rows and the writers of its three formats.
Per categorical feature, ids follow a bounded power law (a few ids are frequent, most are
rare) mapped through a seeded bijection onto the table's rows; dense features are
heavy-tailed counts; both have Criteo-like missing rates. The label is drawn from a
logistic model: a linear function of the *transformed* dense features plus a hidden weight
per (feature, id), so a model that sees what training sees can learn it. Most of the signal
sits on low-cardinality features, frequent ids and dense features, so a small model learns
a good part of it from a few hundred thousand rows; the long tail adds unlearnable noise,
as in real logs. The bias is calibrated to a Criteo-like positive rate of 25%.

The hex written for an id maps back to it under int(hex, 16) % rows, and each id always gets
the same hex, so a smaller row cap still sees a consistent (collided) id. Same arguments,
same bytes: every random draw comes from a generator seeded by (seed, stream, file, chunk);
the hidden model depends on the seed alone, so held-out data is another stream, same seed.

Planted feature interactions (`interaction_groups` N > 0, off by default, and then nothing
above changes): the features are split into N known groups (`planted_groups`), each (feature,
id) gets a hidden vector of INTERACTION_RANK numbers, and the logit gains, per group, the sum
of dot products of its features' vectors over every pair in the group, scaled to variance
`interaction_strength`². Only features of one group interact, so a tower partitioner can be
scored against the known groups.
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from recgrid.data.criteo import (
    PARQUET, PREPARED_ROW_GROUP_ROWS, PREPARED_SCHEMA, ROW_ID, TSV, TSV_GZ, names_data, prepared_metadata,
    prepared_writer, transform_categorical, transform_dense,
)
from recgrid.data.specs import DENSE_NAMES, LABEL_NAME, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES, DatasetSpec, get_spec

FORMATS = (TSV, TSV_GZ, PARQUET)
POSITIVE_RATE = 0.25
_CHUNK_ROWS = 100_000  # rows generated at once: bounds memory, and fixes where random streams restart
_PILOT_ROWS = 50_000  # rows used to calibrate the bias (fixed, so the model does not depend on --rows)

# Approximate missing rates of Criteo Kaggle, per feature.
DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.77, 0.22)
SPARSE_MISSING = (
    0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.03, 0.0, 0.03, 0.0,
    0.0, 0.0, 0.03, 0.0, 0.0, 0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44,
)

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
INTERACTION_RANK = 2  # numbers per (feature, id) in the planted pairwise interactions


def planted_groups(groups: int, seed: int = 0) -> tuple[tuple[int, ...], ...]:
    """The known feature groups of the planted interactions: the 26 features (indices) in a
    seeded random order, cut into `groups` groups of near-equal size, each sorted."""
    if not 1 <= groups <= NUM_SPARSE:
        raise ValueError(f"interaction groups must be between 1 and {NUM_SPARSE}, got {groups}")
    order = np.random.default_rng([int(seed), 0x6E0]).permutation(NUM_SPARSE)
    return tuple(tuple(sorted(int(f) for f in part)) for part in np.array_split(order, groups))


def _mix(*keys) -> np.ndarray:
    """splitmix64 of the combined keys, elementwise: a stateless hash, so a table with 40M rows
    needs no 40M-entry array of hidden weights."""
    with np.errstate(over="ignore"):
        z = np.zeros((), dtype=np.uint64)
        for k in keys:
            z = (z ^ np.asarray(k, dtype=np.uint64)) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
    return z


def _unit(h: np.ndarray) -> np.ndarray:
    """uint64 hash -> float64 uniform in [0, 1)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass
class Sample:
    """Raw synthetic rows, before formatting: what a Criteo log line holds."""

    label: np.ndarray  # [n] int32
    dense: np.ndarray  # [n, 13] int64 counts
    dense_missing: np.ndarray  # [n, 13] bool
    ids: np.ndarray  # [n, 26] int64, the intended id (< table rows)
    hashes: np.ndarray  # [n, 26] uint64, 32-bit hash with hash % rows == id
    sparse_missing: np.ndarray  # [n, 26] bool
    prob: np.ndarray  # [n] the hidden model's click probability (for measuring the Bayes limit)


class HiddenModel:
    """The generator of synthetic rows and of their labels, fixed by (spec table rows, seed)."""

    def __init__(self, spec: DatasetSpec, seed: int = 0, interaction_groups: int = 0,
                 interaction_strength: float = 1.0):
        self.spec, self.seed = spec, int(seed)
        # drawn from their own generator, so every draw below is what it is without them
        self.groups = planted_groups(interaction_groups, seed) if interaction_groups else ()
        self.interaction_strength = float(interaction_strength)
        self.rows = np.array(spec.table_rows, dtype=np.int64)
        rng = np.random.default_rng([self.seed, 0x51D])
        self.zipf_exp = rng.uniform(1.05, 1.35, NUM_SPARSE)
        # a bijection rank -> id per feature: id = (mult * rank + add) % rows with gcd(mult, rows) = 1
        self.mult = np.array([self._coprime(rng, int(r)) for r in self.rows], dtype=np.int64)
        self.add = np.array([rng.integers(0, r) for r in self.rows], dtype=np.int64)
        # per-feature signal strength: the fewer rows, the faster a model learns them
        self.sparse_scale = np.where(self.rows <= 30, 0.9, np.where(self.rows <= 1000, 0.45, 0.25))
        self.dense_mu = rng.uniform(0.5, 4.0, NUM_DENSE)
        self.dense_sigma = rng.uniform(0.8, 1.8, NUM_DENSE)
        self.dense_coef = rng.choice([-1.0, 1.0], NUM_DENSE) * rng.uniform(0.15, 0.45, NUM_DENSE)
        self.bias = 0.0
        pilot = self.sample(_PILOT_ROWS, np.random.default_rng([self.seed, 0xB1A5]), label=False)
        self.bias = self._calibrate(pilot.prob)

    @staticmethod
    def _coprime(rng: np.random.Generator, rows: int) -> int:
        if rows == 1:
            return 1
        while True:
            m = int(rng.integers(1, rows))
            if np.gcd(m, rows) == 1:
                return m

    @staticmethod
    def _calibrate(prob_at_zero_bias: np.ndarray) -> float:
        """Bias that moves the mean click probability to POSITIVE_RATE (bisection on the logit)."""
        logit = np.log(prob_at_zero_bias) - np.log1p(-prob_at_zero_bias)
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if np.mean(1.0 / (1.0 + np.exp(-(logit + mid)))) > POSITIVE_RATE:
                hi = mid
            else:
                lo = mid
        return (lo + hi) / 2

    def id_weight(self, feature: int, ids: np.ndarray) -> np.ndarray:
        """Hidden weight of each id of one feature: uniform with unit variance, from a hash."""
        return (_unit(_mix(self.seed, 0xA11CE, feature, ids)) - 0.5) * np.sqrt(12.0)

    def interaction_vectors(self, feature: int, ids: np.ndarray) -> np.ndarray:
        """Hidden vectors of one feature's ids, [n, INTERACTION_RANK], unit variance each."""
        return np.stack([(_unit(_mix(self.seed, 0x1D7E, feature, ids, c)) - 0.5) * np.sqrt(12.0)
                         for c in range(INTERACTION_RANK)], axis=1)

    def interactions(self, ids: np.ndarray) -> np.ndarray:
        """The planted interaction term of each row: per group, Σ over pairs i < j of
        <v_i(id_i), v_j(id_j)>, scaled to variance interaction_strength² per group."""
        out = np.zeros(len(ids))
        for group in self.groups:
            pairs = len(group) * (len(group) - 1) // 2
            if not pairs:
                continue
            v = [self.interaction_vectors(f, ids[:, f]) for f in group]
            total = np.sum(v, axis=0)
            pair_sum = 0.5 * ((total * total).sum(1) - sum((x * x).sum(1) for x in v))
            out += self.interaction_strength * pair_sum / np.sqrt(pairs * INTERACTION_RANK)
        return out

    def hex_hash(self, feature: int, ids: np.ndarray) -> np.ndarray:
        """A 32-bit hash per id with hash % rows == id; the same id always gets the same hash."""
        rows = np.uint64(self.rows[feature])
        ids = ids.astype(np.uint64)
        kmax = (np.uint64(0xFFFFFFFF) - ids) // rows
        k = _mix(self.seed, 0x4E7, feature, ids) % (kmax + np.uint64(1))
        return ids + rows * k

    def sample(self, n: int, rng: np.random.Generator, label: bool = True) -> Sample:
        dense_missing = rng.random((n, NUM_DENSE)) < np.array(DENSE_MISSING)
        z = rng.standard_normal((n, NUM_DENSE))
        dense = np.floor(np.expm1(self.dense_mu + self.dense_sigma * z)).astype(np.int64)
        dense = np.maximum(dense, 0)
        neg = rng.random(n) < 0.08  # I2 has small negative values in Criteo
        dense[neg, 1] = -rng.integers(1, 4, int(neg.sum()))
        dense[dense_missing] = 0
        # the model sees the transformed values; the signal is linear in them
        t = transform_dense(dense, dense_missing).astype(np.float64)
        logit = self.bias + ((t - self.dense_mu) / self.dense_sigma) @ self.dense_coef

        sparse_missing = rng.random((n, NUM_SPARSE)) < np.array(SPARSE_MISSING)
        u = rng.random((n, NUM_SPARSE))
        ids = np.empty((n, NUM_SPARSE), dtype=np.int64)
        hashes = np.empty((n, NUM_SPARSE), dtype=np.uint64)
        for f in range(NUM_SPARSE):
            v = float(self.rows[f])
            a = self.zipf_exp[f]
            # inverse CDF of a power law on [1, v + 1): rank 0 most frequent
            x = ((np.power(v + 1.0, 1.0 - a) - 1.0) * u[:, f] + 1.0) ** (1.0 / (1.0 - a))
            rank = np.minimum(np.floor(x).astype(np.int64) - 1, self.rows[f] - 1)
            col = (self.mult[f] * rank + self.add[f]) % self.rows[f]
            col[sparse_missing[:, f]] = 0  # what the model sees for a missing value
            ids[:, f] = col
            hashes[:, f] = self.hex_hash(f, col)
            logit += self.sparse_scale[f] * self.id_weight(f, col)
        if self.groups:
            logit += self.interactions(ids)
        prob = 1.0 / (1.0 + np.exp(-logit))
        y = (rng.random(n) < prob).astype(np.int32) if label else np.zeros(n, np.int32)
        return Sample(y, dense, dense_missing, ids, hashes, sparse_missing, prob)


def _chunks(rows: int, seed: int, stream: int, file_index: int):
    """(n, rng) per chunk of a file: the random stream restarts per (seed, stream, file, chunk)."""
    for c, start in enumerate(range(0, rows, _CHUNK_ROWS)):
        yield min(_CHUNK_ROWS, rows - start), np.random.default_rng([seed, 1 + stream, 1 + file_index, c])


def prepared_table(model: HiddenModel, s: Sample) -> pa.Table:
    """The rows as `recgrid prepare` would write them, through the one set of transforms."""
    cols = [pa.array(s.label.astype(np.int32))]
    cols += [pa.array(transform_dense(s.dense[:, j], s.dense_missing[:, j])) for j in range(NUM_DENSE)]
    cols += [
        pa.array(transform_categorical(s.hashes[:, f], int(model.rows[f]), s.sparse_missing[:, f]))
        for f in range(NUM_SPARSE)
    ]
    return pa.Table.from_arrays(cols, schema=PREPARED_SCHEMA)


def _hex_column(hashes: np.ndarray, missing: np.ndarray) -> pa.Array:
    """8-digit lowercase hex strings (nulls where missing), built from bytes, not per-row formatting."""
    present = ~missing
    h = hashes[present].astype(np.uint32)
    nibbles = (h[:, None] >> np.arange(28, -1, -4, dtype=np.uint32)[None, :]) & np.uint32(15)
    data = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)[nibbles]
    offsets = np.zeros(len(hashes) + 1, dtype=np.int32)
    np.cumsum(present * 8, out=offsets[1:])
    validity = np.packbits(present, bitorder="little")
    return pa.StringArray.from_buffers(
        len(hashes), pa.py_buffer(offsets), pa.py_buffer(data.tobytes()), pa.py_buffer(validity), int(missing.sum())
    )


def raw_table(s: Sample) -> pa.Table:
    """The rows as Criteo log columns: integers and hex strings, null where missing."""
    cols = {LABEL_NAME: pa.array(s.label)}
    for j, name in enumerate(DENSE_NAMES):
        cols[name] = pa.array(s.dense[:, j], mask=s.dense_missing[:, j])
    for f, name in enumerate(SPARSE_NAMES):
        cols[name] = _hex_column(s.hashes[:, f], s.sparse_missing[:, f])
    return pa.table(cols)


def synth_table(spec: DatasetSpec, rows: int, seed: int = 0, *, stream: int = 0, interaction_groups: int = 0,
                interaction_strength: float = 1.0) -> pa.Table:
    """`rows` prepared rows in memory (PREPARED_SCHEMA), for tests and in-memory batch sources.

    `stream` picks an independent draw from the same hidden model (e.g. 0 train, 1 eval). The
    rows are those of write_synth(..., files=1, seed=seed, stream=stream).
    """
    model = HiddenModel(spec, seed, interaction_groups, interaction_strength)
    parts = [prepared_table(model, model.sample(n, rng)) for n, rng in _chunks(rows, seed, stream, 0)]
    return pa.concat_tables(parts) if parts else PREPARED_SCHEMA.empty_table()


def file_name(index: int, files: int, fmt: str) -> str:
    return f"part-{index:05d}-of-{files:05d}.{fmt}"


def write_synth(
    out: str, rows: int, files: int = 1, fmt: str = TSV, spec: DatasetSpec | str = "tiny", seed: int = 0,
    stream: int = 0, interaction_groups: int = 0, interaction_strength: float = 1.0,
) -> list[str]:
    """Write `rows` synthetic rows split over `files` files in `out`; return their paths.

    `seed` fixes the hidden model (the planted signal); `stream` picks an independent draw of
    rows from it: held-out data is the same seed with another stream (another seed is another
    model, which nothing trained on this one can predict).
    tsv and tsv.gz are raw Criteo logs; parquet is already-prepared shards (prepare's schema).
    Each file is written under a temporary name and renamed, so none ever looks complete early.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if rows < 0 or files < 1:
        raise ValueError(f"need rows >= 0 and files >= 1, got rows={rows} files={files}")
    spec = get_spec(spec) if isinstance(spec, str) else spec
    model = HiddenModel(spec, seed, interaction_groups, interaction_strength)
    os.makedirs(out, exist_ok=True)
    paths = []
    for i in range(files):
        n_rows = rows // files + (i < rows % files)
        path = os.path.join(out, file_name(i, files, fmt))
        tmp = os.path.join(out, f".tmp-{os.path.basename(path)}")
        try:
            if fmt == PARQUET:
                # prepared shards carry a row id (stream in the top bits, then the row's index over
                # all files), so a test can account for every row a job trains
                schema = PREPARED_SCHEMA.append(pa.field(ROW_ID, pa.int64())).with_metadata(prepared_metadata(spec))
                first = (stream << 40) + (rows // files) * i + min(i, rows % files)
                with prepared_writer(tmp, schema) as w:
                    for n, rng in _chunks(n_rows, seed, stream, i):
                        table = prepared_table(model, model.sample(n, rng))
                        table = table.append_column(ROW_ID, pa.array(np.arange(first, first + n, dtype=np.int64)))
                        first += n
                        w.write_table(table.replace_schema_metadata(schema.metadata),
                                      row_group_size=PREPARED_ROW_GROUP_ROWS)
            else:
                with open(tmp, "wb") as raw:
                    # mtime=0 and no file name in the header: same seed, same bytes
                    sink = (gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6)
                            if fmt == TSV_GZ else raw)
                    for n, rng in _chunks(n_rows, seed, stream, i):
                        buf = io.BytesIO()
                        pacsv.write_csv(
                            raw_table(model.sample(n, rng)), buf,
                            pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none"),
                        )
                        sink.write(buf.getvalue())
                    if sink is not raw:
                        sink.close()
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        paths.append(path)
    return paths


def ensure_synth(pattern: str, rows: int, spec: DatasetSpec, seed: int, stream: int, say=print) -> list[str]:
    """Make sure the glob `pattern` matches data: if it matches nothing, write `rows` synthetic
    rows where it points (format told by its suffix: .parquet, .gz, else tsv), into the directory
    before its first wildcard. Returns the files written (none if the glob already matched).

    Synthetic data goes only where no file is: a missing or empty directory. A glob that matches
    nothing in a directory that holds something (the user's files, which the glob misses) is an
    error naming both, raised before anything is written; so is a glob that would not match the
    files written (they are removed again). Either way the directory is left as it was.
    """
    if names_data(pattern):
        return []
    parts = Path(os.path.expanduser(pattern)).parts
    wild = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts) - 1)
    out = Path(*parts[:wild]) if wild else Path(".")
    held = sorted(os.listdir(out)) if out.is_dir() else []
    if held or out.is_file():
        what = ("holds " + ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
                if held else "is a file")
        raise ValueError(f"{pattern!r} matches no file, but {out} {what}: synthetic data is written only "
                         f"into a missing or empty directory, never beside other files; fix the glob to match "
                         f"them, or point it at a new directory")
    created = next((p for p in [*reversed(out.parents), out] if not p.exists()), None)  # the top one made here
    fmt = PARQUET if pattern.endswith(".parquet") else TSV_GZ if pattern.endswith(".gz") else TSV
    say(f"{pattern!r} matches nothing; writing {rows:,} synthetic rows ({fmt}) to {out}/")
    written = write_synth(str(out), rows, files=max(1, min(8, rows // 25_000)), fmt=fmt, spec=spec, seed=seed,
                          stream=stream)
    if not names_data(pattern):
        for path in written:
            os.remove(path)
        if created is not None:  # and the directories made here, innermost first
            for d in [out, *out.parents]:
                d.rmdir()
                if d == created:
                    break
        raise ValueError(f"{pattern!r} does not match the synthetic files it would get ({Path(written[0]).name} "
                         f"and others in {out}/); use a glob such as {out}/*.{fmt}")
    return written


def run_cli(args: argparse.Namespace) -> int:
    try:
        spec = get_spec(args.spec, max_rows_per_table=args.max_rows_per_table)
        t0 = time.perf_counter()
        groups = getattr(args, "interaction_groups", 0) or 0
        paths = write_synth(args.out, args.rows, args.files, args.format, spec, args.seed, args.stream,
                            groups, getattr(args, "interaction_strength", 1.0))
    except (ValueError, OSError) as e:
        print(f"recgrid synth: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    print(f"synth: {args.rows:,} rows in {len(paths)} {args.format} file(s) under {args.out} "
          f"(spec {spec.name}, seed {args.seed}, stream {args.stream}) in {dt:.1f} s")
    if groups:
        names = [[SPARSE_NAMES[f] for f in g] for g in planted_groups(groups, args.seed)]
        print(f"synth: planted interactions within {groups} feature groups: {names}")
    return 0
