"""A Criteo value into a model input: the one definition of the transforms, and of what a value may be.

    dense        an integer of int64's range; missing -> 0, then ln(1 + max(x, 0)), float32
    categorical  a hash: 1 to 16 hex digits (the raw files' form) or an integer in [0, 2**64);
                 missing -> 0, else hash % rows (the feature's table rows), int64
    label        0 or 1
    multi-hot    an id x of feature f becomes a bag of the spec's bag size: x first, then
                 (x + offset) % rows, offsets from a table seeded by f and indexed by x % 2048

Training (`data.criteo`'s TSV parser, `data.synth`) and every served model apply these functions:
a logged model ships this file beside its own code (MLflow `code_paths`, as `recgrid_transforms`),
so this module imports numpy and the standard library only, never the rest of recgrid.
`dense_values` and `categorical_hashes` read one column of values as a client holds them (numbers,
strings, None or NaN for missing) and refuse a value that is none of the above with `BadValue`,
naming its row and column.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import numpy as np

MAX_HEX_DIGITS = 16  # ids are reduced in uint64
DENSE_DIGITS = 19  # an int64 has at most 19 decimal digits
DENSE_MIN, DENSE_MAX = -(1 << 63), (1 << 63) - 1
HASH_MAX = (1 << 64) - 1
EXACT_FLOAT = 1 << 53  # the largest integer below which float64 holds every integer
MULTI_HOT_TABLE = 2048  # offset rows per feature (a power of two: x % 2048 is x & 2047)
MULTI_HOT_SEED = 0  # the seed of every multi-hot expansion (`bag_offsets`)
_INT_RE = re.compile(r"[+-]?[0-9]+")
_HEX_RE = re.compile(r"[0-9a-fA-F]{1,%d}" % MAX_HEX_DIGITS)


class BadValue(ValueError):
    """A value that is not one of its column's kind: `row` (position in the column, from 0), `column`, `detail`."""

    def __init__(self, row: int, column: str, detail: str) -> None:
        self.row, self.column, self.detail = int(row), str(column), detail
        super().__init__(f"row {self.row}, column {self.column}: {detail}")

    def __reduce__(self):
        return (type(self), (self.row, self.column, self.detail))


def transform_dense(values: np.ndarray, missing: np.ndarray | None = None) -> np.ndarray:
    """Dense transform: missing -> 0, then ln(1 + max(x, 0)), computed in float64, stored float32."""
    x = np.maximum(np.asarray(values, dtype=np.float64), 0.0)
    if missing is not None:
        x[missing] = 0.0
    return np.log1p(x).astype(np.float32)


def transform_categorical(hashes: np.ndarray, rows: int, missing: np.ndarray | None = None) -> np.ndarray:
    """Categorical transform: missing -> 0, else hash % rows (hash = int(hex, 16)), int64."""
    hashes = np.asarray(hashes)
    if hashes.dtype == np.uint32 and rows < 1 << 32:  # the same remainders in 32 bits, several times faster
        ids = (hashes % np.uint32(rows)).astype(np.int64)
    else:
        ids = (np.asarray(hashes, dtype=np.uint64) % np.uint64(rows)).astype(np.int64)
    if missing is not None:
        ids[missing] = 0
    return ids


def bag_offsets(rows: int, bag: int, seed: int, feature: int) -> np.ndarray | None:
    """Multi-hot (a spec's `multi_hot_sizes`): the [2048, bag] uint32 offsets of feature `feature`'s
    bags, seeded by (seed, feature); column 0 is 0 (a bag's first id is the id itself); None for
    bags of one. An id x's bag is (x + offsets[x % 2048]) % rows (`expand_bags`)."""
    if bag == 1:
        return None
    rng = np.random.default_rng([seed, feature])
    # offsets in [1, rows): the other ids of a bag differ from the id itself (if rows > 1)
    other = rng.integers(1, rows, (MULTI_HOT_TABLE, bag - 1)) if rows > 1 else np.zeros((MULTI_HOT_TABLE, bag - 1))
    return np.concatenate([np.zeros((MULTI_HOT_TABLE, 1), np.uint32), other.astype(np.uint32)], axis=1)


def expand_bags(ids: np.ndarray, offsets: np.ndarray, rows: int) -> np.ndarray:
    """The multi-hot bags ([..., bag] uint32) of `ids` (uint32, each < rows < 2**31) from their
    feature's `bag_offsets`: one gathered row of offsets per id, plus the id, mod rows (x + offset <
    2 * rows < 2**32, and min(v, v - rows) is v mod rows, as v - rows wraps around when v < rows)."""
    v = offsets[ids & (MULTI_HOT_TABLE - 1)]
    v += ids[..., None]
    np.minimum(v, v - np.uint32(rows), out=v)
    return v


def is_missing(value: Any) -> bool:
    """None, NaN (pandas' missing value) and the empty string (the raw files' empty field)."""
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def dense_value(value: Any) -> int:
    """One present dense value as an int; ValueError with the reason if it is not an int64."""
    if isinstance(value, str):
        if not _INT_RE.fullmatch(value):
            raise ValueError(f"{_show(value)} is not an integer")
        digits = len(value.lstrip("+-"))
        if digits > DENSE_DIGITS:  # before int(): Python refuses 4,300 digits, float() overflows at 309
            raise ValueError(f"{_show(value)} is an integer of {digits:,} digits, outside int64's range "
                             f"(dense values are int64s)")
        x = int(value)
    elif isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{value!r} is not an integer")
    elif isinstance(value, (int, np.integer)):
        x = int(value)
    elif isinstance(value, (float, np.floating)):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite number")
        if value != math.floor(value):
            raise ValueError(f"{value!r} is not an integer: the model takes the raw files' integers "
                             f"(it applies ln(1 + x) itself)")
        x = int(value)
    else:
        raise ValueError(f"{_show(value)} ({type(value).__name__}) is not an integer")
    if not DENSE_MIN <= x <= DENSE_MAX:
        raise ValueError(f"{_show(value)} is outside int64's range")
    return x


def hash_value(value: Any) -> int:
    """One present categorical value as its hash; ValueError with the reason if it is not one."""
    if isinstance(value, str):
        if not _HEX_RE.fullmatch(value):
            raise ValueError(f"{_show(value)} is not a hexadecimal id of 1 to {MAX_HEX_DIGITS} digits")
        return int(value, 16)
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{value!r} is not an id")
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or value != math.floor(value):
            raise ValueError(f"{value!r} is not an integer id")
        if abs(value) > EXACT_FLOAT:  # a float this large stands for many ids: send integers or hex strings
            raise ValueError(f"{value!r} is a float above 2**53, which cannot say which id it is; send ids as "
                             f"integers or hexadecimal strings")
        value = int(value)
    if not isinstance(value, (int, np.integer)):
        raise ValueError(f"{_show(value)} ({type(value).__name__}) is not an id")
    x = int(value)
    if not 0 <= x <= HASH_MAX:
        raise ValueError(f"{x} is not an id in [0, 2**64)")
    return x


def dense_values(column: Sequence[Any] | np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """One dense column as (float64 values, missing mask), or `BadValue` naming the first bad row."""
    a = np.asarray(column)
    if a.dtype.kind in "iu":
        return a.astype(np.float64), np.zeros(len(a), bool)
    if a.dtype.kind == "f":
        missing = np.isnan(a)
        with np.errstate(invalid="ignore"):
            bad = ~missing & (~np.isfinite(a) | (a != np.floor(a)) | (a >= 2.0 ** 63) | (a < -2.0 ** 63))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            _raise(i, name, dense_value, a[i])
        return np.where(missing, 0.0, a).astype(np.float64), missing
    values, missing = np.zeros(len(a), np.float64), np.zeros(len(a), bool)
    for i, v in enumerate(a.tolist()):
        if is_missing(v):
            missing[i] = True
        else:
            values[i] = float(_call(i, name, dense_value, v))
    return values, missing


def categorical_hashes(column: Sequence[Any] | np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """One categorical column as (uint64 hashes, missing mask), or `BadValue` naming the first bad row.
    Integers are read as int64 or uint64, never through a float (an id above 2**24 keeps its row)."""
    a = np.asarray(column)
    if a.dtype.kind == "u":
        return a.astype(np.uint64), np.zeros(len(a), bool)
    if a.dtype.kind == "i":
        if (a < 0).any():
            i = int(np.flatnonzero(a < 0)[0])
            _raise(i, name, hash_value, a[i])
        return a.astype(np.uint64), np.zeros(len(a), bool)
    hashes, missing = np.zeros(len(a), np.uint64), np.zeros(len(a), bool)
    for i, v in enumerate(a.tolist()):
        if is_missing(v):
            missing[i] = True
        else:
            hashes[i] = _call(i, name, hash_value, v)
    return hashes, missing


def _call(row: int, name: str, parse: Any, value: Any) -> int:
    try:
        return parse(value)
    except ValueError as e:
        raise BadValue(row, name, str(e)) from None


def _raise(row: int, name: str, parse: Any, value: Any) -> None:
    _call(row, name, parse, value.item() if isinstance(value, np.generic) else value)
    raise AssertionError(f"row {row}, column {name}: {value!r} was flagged but parses")  # the masks mirror the parsers


def _show(value: Any) -> str:
    """A value for a message: long ones cut (a 5,000-digit integer is named, not printed)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(str(value))} characters)"
