"""QR compression's facts that the data pipeline needs: which features are compressed, what
their expanded features and tables are called and sized, and the id transform (numpy, no torch).

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

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from recgrid.data.specs import SPARSE_NAMES, DatasetSpec

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


def table_layout(spec: DatasetSpec, dim: int, compression: Compression | None = None,
                 head_sizes: Mapping[int, int] | None = None) -> list[tuple[str, str, int, int]]:
    """The tables of one model copy as (table name, feature name, rows, dim), in key order: the
    pure sizing the engine builds tables from and the planner prices. `head_sizes` (feature index
    -> H) sizes the head tables without their ids (a planner's estimate); by default none."""
    if compression is None:
        return [(spec.table_name(n), n, rows, dim) for n, rows in zip(SPARSE_NAMES, spec.table_rows)]
    if compression.operation == "concat" and dim % 2:
        raise ValueError(f"qr_operation concat splits the embedding dimension in two halves; {dim} is odd")
    heads = dict(head_sizes or {})
    compressed = set(compression.features(spec))
    half = dim // 2 if compression.operation == "concat" else dim
    out = []
    for f, (name, rows) in enumerate(zip(SPARSE_NAMES, spec.table_rows)):
        if f not in compressed:
            out.append((spec.table_name(name), name, rows, dim))
            continue
        if heads.get(f):
            out.append((spec.table_name(name + HEAD), name + HEAD, int(heads[f]), dim))
        c = compression.collisions
        out.append((spec.table_name(name + QUOTIENT), name + QUOTIENT, math.ceil(rows / c), half))
        out.append((spec.table_name(name + REMAINDER), name + REMAINDER, c, half))
    return out


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
