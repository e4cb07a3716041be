"""Dataset specs: the Criteo columns and the embedding table each categorical feature feeds.

Every spec reads the same Criteo columns (label, I1..I13, C1..C26), so one data path serves
Criteo Kaggle, Criteo 1TB and the `tiny` spec used by tests and the demo. A spec gives each
categorical feature its row count (the modulus of the categorical transform) and the default
embedding dimension. `max_rows_per_table` caps rows so the big specs run small on a laptop.

QR compression's tables are part of the same fact (the engine builds every table from here).
A feature f whose table has more than `threshold_rows` rows n (after `data.max_rows_per_table`)
is compressed (RecScale, after Shi et al.): it becomes the features `<f>_q` (a quotient table of
ceil(n / c) rows, index `id // c`) and `<f>_r` (a remainder table of c rows, index `id % c`),
c = `collisions`, and with a head cache `<f>_h` (H rows, one per head id, index = the id's rank
among the head's sorted ids). An id in the head goes to `<f>_h` only; any other id to `<f>_q`
and `<f>_r`. The quotient is integer floor division on int64 (float division picks the wrong row
once ids pass 2^24 * c). Features that are not compressed keep their table and name, so an
uncompressed job's tables, plans and checkpoints are what they were.

`Compression` is the job's setting plus its head ids (small and picklable: it travels to Ray
Data's read tasks); `apply` turns a block's key-major ids of C1..C26 into the expanded key-major
KeyedJaggedTensor arrays, vectorised over the block. `table_layout` sizes the tables (the
engine builds them from it, the planner prices them, `embedding_bytes` adds them up).
`head_from_counts` picks the head of one feature from its id counts (`data.stream.id_counts`
counts them over the training files).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES: tuple[str, ...] = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
LABEL_NAME = "label"

# MLPerf DLRM-DCNv2 synthetic multi-hot bag sizes, one per categorical feature C1..C26.
MLPERF_MULTI_HOT_SIZES: tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)

# Criteo Kaggle (Display Advertising Challenge) cardinalities, as used by the DLRM reference.
CRITEO_KAGGLE_ROWS: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
# Criteo 1TB with MLPerf's 40M cap per feature.
CRITEO_1TB_ROWS: tuple[int, ...] = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
# tiny: the Kaggle shape shrunk to at most a few thousand rows, so it trains in seconds.
TINY_ROWS: tuple[int, ...] = (
    1460, 583, 4000, 3000, 305, 24, 2500, 633, 3, 2048, 1500, 3500, 1024,
    27, 1800, 3200, 10, 1200, 900, 4, 2800, 18, 15, 2200, 105, 1600,
)


class SpecError(ValueError):
    pass


@dataclass(frozen=True)
class DatasetSpec:
    """Rows per categorical feature and the default embedding dimension.

    Attributes:
        name: spec name ("criteo_kaggle", "criteo_1tb", "tiny" or a YAML file's name).
        rows: row count of the table behind each of C1..C26 (the categorical modulus).
        embedding_dim: default embedding dimension of every table.
        multi_hot_sizes: per-feature bag sizes for the synthetic multi-hot variant, or None
            for one id per feature (one-hot).
        max_rows_per_table: if set, every table has min(rows, max_rows_per_table) rows.
    """

    name: str
    rows: tuple[int, ...]
    embedding_dim: int
    multi_hot_sizes: tuple[int, ...] | None = None
    max_rows_per_table: int | None = None

    def __post_init__(self) -> None:
        if len(self.rows) != NUM_SPARSE:
            raise SpecError(f"spec {self.name!r}: rows has {len(self.rows)} entries, need {NUM_SPARSE}")
        if any((not isinstance(r, int)) or r < 1 for r in self.rows):
            raise SpecError(f"spec {self.name!r}: every row count must be a positive integer: {self.rows}")
        if self.embedding_dim < 1:
            raise SpecError(f"spec {self.name!r}: embedding_dim must be positive, got {self.embedding_dim}")
        if self.multi_hot_sizes is not None and (
            len(self.multi_hot_sizes) != NUM_SPARSE or min(self.multi_hot_sizes) < 1
        ):
            raise SpecError(f"spec {self.name!r}: multi_hot_sizes needs {NUM_SPARSE} positive sizes")
        if self.max_rows_per_table is not None and self.max_rows_per_table < 1:
            raise SpecError(
                f"spec {self.name!r}: max_rows_per_table must be positive, got {self.max_rows_per_table}"
            )

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Rows of each table after the cap: the modulus of the categorical transform."""
        cap = self.max_rows_per_table
        return tuple(min(r, cap) for r in self.rows) if cap else self.rows

    @property
    def multi_hot(self) -> bool:
        return self.multi_hot_sizes is not None

    @property
    def bag_sizes(self) -> tuple[int, ...]:
        return self.multi_hot_sizes or (1,) * NUM_SPARSE

    def capped(self, max_rows_per_table: int | None) -> "DatasetSpec":
        return dataclasses.replace(self, max_rows_per_table=max_rows_per_table)

    def with_multi_hot(self, sizes: tuple[int, ...] = MLPERF_MULTI_HOT_SIZES) -> "DatasetSpec":
        return dataclasses.replace(self, multi_hot_sizes=tuple(sizes))

    def table_name(self, feature: str) -> str:
        return f"t_{feature}"


BUILTIN_SPECS: dict[str, DatasetSpec] = {
    "criteo_kaggle": DatasetSpec("criteo_kaggle", CRITEO_KAGGLE_ROWS, embedding_dim=16),
    "criteo_1tb": DatasetSpec("criteo_1tb", CRITEO_1TB_ROWS, embedding_dim=128),
    "tiny": DatasetSpec("tiny", TINY_ROWS, embedding_dim=16),
}


def get_spec(name: str, max_rows_per_table: int | None = None, multi_hot: bool | None = None) -> DatasetSpec:
    """A builtin spec by name, `NAME+multihot` for the MLPerf multi-hot variant, or a YAML file.

    A YAML spec has keys `rows` (26 ints), `embedding_dim`, and optionally `multi_hot_sizes`.
    """
    base, _, suffix = name.partition("+")
    if suffix not in ("", "multihot"):
        raise SpecError(f"unknown spec suffix {suffix!r} in {name!r}; the only suffix is '+multihot'")
    if base in BUILTIN_SPECS:
        spec = BUILTIN_SPECS[base]
    elif base.endswith((".yaml", ".yml")):
        spec = _load_yaml_spec(Path(base))
    else:
        raise SpecError(f"unknown dataset spec {name!r}; builtin specs: {sorted(BUILTIN_SPECS)} or a .yaml path")
    if suffix == "multihot" or multi_hot:
        spec = spec.with_multi_hot(spec.multi_hot_sizes or MLPERF_MULTI_HOT_SIZES)
    elif multi_hot is False:
        spec = dataclasses.replace(spec, multi_hot_sizes=None)
    if max_rows_per_table is not None:
        spec = spec.capped(max_rows_per_table)
    return spec


def _load_yaml_spec(path: Path) -> DatasetSpec:
    import yaml

    if not path.is_file():
        raise SpecError(f"dataset spec file {path} does not exist")
    with path.open() as f:
        raw = yaml.safe_load(f) or {}
    unknown = set(raw) - {"rows", "embedding_dim", "multi_hot_sizes", "name"}
    if unknown:
        raise SpecError(f"{path}: unknown keys {sorted(unknown)}")
    try:
        return DatasetSpec(
            name=str(raw.get("name", path.stem)),
            rows=tuple(int(r) for r in raw["rows"]),
            embedding_dim=int(raw.get("embedding_dim", 16)),
            multi_hot_sizes=tuple(int(s) for s in raw["multi_hot_sizes"]) if raw.get("multi_hot_sizes") else None,
        )
    except KeyError as e:
        raise SpecError(f"{path}: missing key {e.args[0]!r}") from None
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None


# ---------------------------------------------------------------- QR compression's tables

# The job's choices (config.py's model.compression and model.qr_operation take them from here).
COMPRESSIONS: tuple[str, ...] = ("none", "qr")
QR_OPERATIONS: tuple[str, ...] = ("mult", "add", "concat")
# Bytes per weight of each table data type (engine.model.EMBEDDING_DTYPES names them).
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2}

QUOTIENT, REMAINDER, HEAD = "_q", "_r", "_h"


@dataclass(frozen=True)
class Compression:
    """QR compression of a job's large tables, with an optional head cache.

    Attributes:
        threshold_rows: tables with MORE rows than this are compressed.
        collisions: c, the remainder table's rows (ids sharing a quotient row).
        operation: how a compressed id's quotient and remainder rows combine: "mult" (q * r),
            "add" (q + r) or "concat" (q and r of dim D/2 each, concatenated).
        head_rows: H, the head cache's size per compressed table (0: none, unless head_coverage).
        head_coverage: instead of H, the fewest ids that cover this fraction of the table's lookups.
        head_ids: per compressed feature (by index into C1..C26), its head's sorted ids; None
            until counted (`with_heads`). A head cache with no head ids cannot build tables.
    """

    threshold_rows: int
    collisions: int
    operation: str = "mult"
    head_rows: int = 0
    head_coverage: float | None = None
    head_ids: tuple[tuple[int, np.ndarray], ...] | None = field(default=None, compare=False)

    @property
    def wants_head(self) -> bool:
        return self.head_rows > 0 or self.head_coverage is not None

    def features(self, spec: DatasetSpec) -> tuple[int, ...]:
        """Indices (into C1..C26) of the compressed features: tables of more than threshold_rows rows."""
        return tuple(f for f, rows in enumerate(spec.table_rows) if rows > self.threshold_rows)

    def with_heads(self, head_ids: Mapping[int, np.ndarray]) -> "Compression":
        """This setting with its head ids (feature index -> ids, any order; stored sorted, unique)."""
        if not self.wants_head:
            raise ValueError("head ids for a compression without a head cache (head_rows 0, head_coverage None)")
        ids = tuple((int(f), np.unique(np.asarray(v, dtype=np.int64))) for f, v in sorted(head_ids.items()))
        return Compression(self.threshold_rows, self.collisions, self.operation, self.head_rows,
                           self.head_coverage, ids)

    def heads(self) -> dict[int, np.ndarray]:
        """Feature index -> its head's sorted ids ({} without a head cache); raises if a head
        cache was asked for and its ids were never counted."""
        if not self.wants_head:
            return {}
        if self.head_ids is None:
            raise ValueError("a head cache needs its head ids: count them over the training files first "
                             "(data.stream.id_counts, head_from_counts) and pass them with Compression.with_heads")
        return {f: ids for f, ids in self.head_ids if len(ids)}  # a feature with no lookups has no head

    def record(self) -> dict:
        """What fixes a compressed model's tables and id mapping, as JSON-able values (a storage
        checkpoint keeps it: its rows mean these ids)."""
        heads = self.heads() if self.head_ids is not None else {}
        return {"threshold_rows": self.threshold_rows, "collisions": self.collisions, "operation": self.operation,
                "head_ids": {SPARSE_NAMES[f]: ids.tolist() for f, ids in heads.items()}}

    def head_sizes(self) -> dict[int, int]:
        return {f: len(ids) for f, ids in self.heads().items()}

    # ---- the expanded features and their tables --------------------------------------------------
    def keys(self, spec: DatasetSpec) -> list[str]:
        """The KeyedJaggedTensor's keys, in order: C1..C26, each compressed one replaced by
        `<f>_h` (with a head cache), `<f>_q`, `<f>_r`."""
        compressed, heads = set(self.features(spec)), self.heads()
        out: list[str] = []
        for f, name in enumerate(SPARSE_NAMES):
            if f not in compressed:
                out.append(name)
                continue
            if f in heads:
                out.append(name + HEAD)
            out += [name + QUOTIENT, name + REMAINDER]
        return out

    def apply(self, values: np.ndarray, spec: DatasetSpec, batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Key-major ids of C1..C26 ([nb, b * sum(bag sizes)] int64, each feature's bags of
        spec.bag_sizes[f] ids) as the expanded features' (values [nb, V] int64 padded with 0,
        lengths [nb, len(keys) * b] int32 key-major, value counts [nb] int64: a batch's values
        are values[j, :counts[j]]). Array operations per feature over the whole block."""
        nb, b = values.shape[0], batch_size
        compressed, heads = set(self.features(spec)), self.heads()
        c = np.int64(self.collisions)
        parts: list[tuple[np.ndarray, np.ndarray]] = []  # per key: (its values, in batch order; lengths [nb, b])
        start = 0
        for f, bag in enumerate(spec.bag_sizes):
            x = values[:, start:start + b * bag]  # [nb, b * bag]: sample-major bags
            start += b * bag
            if f not in compressed:
                parts.append((x.reshape(-1), np.full((nb, b), bag, np.int32)))
                continue
            head = heads.get(f)
            if head is not None:
                pos = np.searchsorted(head, x)
                hit = pos < len(head)
                hit[hit] = head[pos[hit]] == x[hit]
                parts.append((pos[hit], hit.reshape(nb, b, bag).sum(axis=2, dtype=np.int32)))
                rest = x[~hit]
                miss_len = bag - parts[-1][1]
            else:
                rest = x.reshape(-1)
                miss_len = np.full((nb, b), bag, np.int32)
            parts.append((rest // c, miss_len))
            parts.append((rest % c, miss_len))
        counts = np.stack([p[1].sum(axis=1, dtype=np.int64) for p in parts], axis=1)  # [nb, keys]
        per_batch = counts.sum(axis=1)
        out = np.zeros((nb, int(per_batch.max()) if nb else 0), np.int64)
        offsets = np.cumsum(counts, axis=1) - counts  # where each key's values start in its batch
        batch_of = np.arange(nb)
        for k, (vals, _) in enumerate(parts):
            n_k = counts[:, k]
            rows = np.repeat(batch_of, n_k)
            within = np.arange(len(vals)) - np.repeat(np.cumsum(n_k) - n_k, n_k)
            out[rows, offsets[rows, k] + within] = vals
        lengths = np.concatenate([p[1] for p in parts], axis=1)
        return out, np.ascontiguousarray(lengths), per_batch

    def table_layout(self, spec: DatasetSpec, dim: int) -> list[tuple[str, str, int, int]]:
        """Every table of one model copy as (table name, feature name, rows, dim), in key order."""
        return table_layout(spec, dim, self, self.head_sizes())


def compressed_parts(rows: int, dim: int, compression: Compression | None, head: int = 0) -> list[tuple[str, int, int]]:
    """One table of `rows` rows under `compression`, as (feature name suffix, rows, dim): ("", rows,
    dim) when it is not compressed; else its head table (HEAD, `head`, dim) when `head` > 0, then
    (QUOTIENT, ceil(rows / c), d) and (REMAINDER, c, d), d = dim / 2 for concat, else dim."""
    if compression is None:
        return [("", rows, dim)]
    if compression.operation == "concat" and dim % 2:
        raise ValueError(f"qr_operation concat splits the embedding dimension in two halves; {dim} is odd")
    if rows <= compression.threshold_rows:
        return [("", rows, dim)]
    c = compression.collisions
    half = dim // 2 if compression.operation == "concat" else dim
    parts = [(HEAD, int(head), dim)] if head else []
    return parts + [(QUOTIENT, math.ceil(rows / c), half), (REMAINDER, c, half)]


def table_layout(spec: DatasetSpec, dim: int, compression: Compression | None = None,
                 head_sizes: Mapping[int, int] | None = None) -> list[tuple[str, str, int, int]]:
    """The tables of one model copy as (table name, feature name, rows, dim), in key order: the
    pure sizing the engine builds tables from and the planner prices (`compressed_parts` per
    table). `head_sizes` (feature index -> H) sizes the head tables without their ids (a planner's
    estimate); by default none."""
    heads = dict(head_sizes or {})
    return [(spec.table_name(name + suffix), name + suffix, r, d)
            for f, (name, rows) in enumerate(zip(SPARSE_NAMES, spec.table_rows))
            for suffix, r, d in compressed_parts(rows, dim, compression, heads.get(f, 0))]


def embedding_bytes(spec: DatasetSpec, dim: int, dtype: str = "fp32", compression: Compression | None = None,
                    head_sizes: Mapping[int, int] | None = None) -> int:
    """Bytes of every embedding table of ONE model copy at the table data type (weights only)."""
    per = DTYPE_BYTES[dtype]
    if compression is not None and head_sizes is None:
        head_sizes = compression.head_sizes() if compression.head_ids is not None else {}
    return sum(rows * d * per for _, _, rows, d in table_layout(spec, dim, compression, head_sizes))


def head_from_counts(ids: np.ndarray, counts: np.ndarray, head_rows: int = 0,
                     head_coverage: float | None = None) -> np.ndarray:
    """The head of one feature from its distinct ids and their lookup counts: the `head_rows`
    most frequent ids, or the fewest that cover `head_coverage` of the lookups (ties: smaller id
    first, so the choice is deterministic); sorted. At least one id when any was looked up."""
    ids, counts = np.asarray(ids, np.int64), np.asarray(counts, np.int64)
    order = np.lexsort((ids, -counts))  # most frequent first, then by id
    if head_coverage is not None:
        total = counts.sum()
        if total == 0:
            return np.zeros(0, np.int64)
        covered = np.cumsum(counts[order])
        k = int(np.searchsorted(covered, head_coverage * total, side="left")) + 1
    else:
        k = head_rows
    return np.sort(ids[order[:min(k, len(ids))]])


def merge_counts(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Sum (ids, counts) pairs into one (distinct ids, counts)."""
    if not pairs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ids = np.concatenate([p[0] for p in pairs])
    counts = np.concatenate([p[1] for p in pairs])
    uniq, inverse = np.unique(ids, return_inverse=True)
    return uniq, np.bincount(inverse, weights=counts, minlength=len(uniq)).astype(np.int64)
