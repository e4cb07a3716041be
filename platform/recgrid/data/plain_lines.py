"""Criteo lines in their plain form, parsed straight from their bytes (`parse_plain`): 40 fields,
a label of 0 or 1, dense values of at most 8 characters, categoricals empty or exactly 8 hex
digits. Any other chunk is `data.criteo.parse_lines`' to parse the general way, which says what
is wrong; both give the same rows (the transforms of `data.transforms`)."""

from __future__ import annotations

import numpy as np

from recgrid.data.specs import DENSE_NAMES, SPARSE_NAMES, DatasetSpec
from recgrid.data.transforms import transform_categorical, transform_dense

_FIELDS = 1 + len(DENSE_NAMES) + len(SPARSE_NAMES)  # a line's fields: label, I1..I13, C1..C26
_U64 = np.uint64
_LANES = _U64(0x0101010101010101)  # one in each byte of a word
_ZEROS = _U64(0x30) * _LANES  # eight '0' characters
_PLAIN_ROWS = 4096  # lines `parse_plain` works on at once
_TOP = np.array([0] + [((1 << 64) - 1) ^ ((1 << (8 * (8 - k))) - 1) for k in range(1, 9)], dtype=np.uint64)  # top k bytes


def parse_plain(data: bytes, spec: DatasetSpec) -> list[np.ndarray] | None:
    """The columns of `data`'s rows (label, dense, categorical: `data.criteo.PREPARED_SCHEMA`'s
    order, transformed) if every line has Criteo's plain form, else None.

    Plain form, a narrower one than `parse_lines` accepts: newline-terminated lines of 40 fields
    (39 tabs), a label of 0 or 1, dense values empty or an optional '-' and digits in at most 8
    characters, categoricals empty or exactly 8 hex digits. Such lines are parsed here with array
    operations over the raw bytes, without making strings: each field is read as the 8 bytes that
    end where it ends (a little-endian uint64, the field in its top bytes). Anything else (a bad
    row, a long or short value) gets None, and `parse_lines` parses the chunk the general way,
    which says what is wrong. Both ways give the same rows (the same transforms of the same values).
    """
    buf = np.frombuffer(data, np.uint8)
    if not len(buf) or buf[-1] != 10:
        return None
    sep = np.flatnonzero(buf <= 10)  # tabs and newlines; any other byte below 11 fails the next check
    n = len(sep) // _FIELDS
    if len(sep) != n * _FIELDS:
        return None
    sep = sep.reshape(n, _FIELDS)
    kinds = buf[sep]
    if not ((kinds[:, :-1] == 9).all() and (kinds[:, -1] == 10).all()):  # 39 tabs, then the newline
        return None
    padded = np.empty(len(buf) + 8, np.uint8)
    padded[:8] = 48
    padded[8:] = buf
    at = np.ndarray((len(buf) + 1,), dtype="<u8", buffer=padded, strides=(1,))  # at[i]: the 8 bytes before byte i
    d, c = 1 + len(DENSE_NAMES), len(SPARSE_NAMES)
    label = np.empty(n, np.int32)
    dense = np.empty((len(DENSE_NAMES), n), np.float32)
    hashes = np.empty((c, n), np.uint32)
    missing = np.empty((c, n), bool)
    for r in range(0, n, _PLAIN_ROWS):  # a few thousand lines at a time: the arrays stay in cache
        s = sep[r:r + _PLAIN_ROWS]
        lens = np.empty(s.shape, np.int64)  # field lengths: from the separator before to this one
        lens[:, 1:] = np.diff(s, axis=1) - 1
        lens[0, 0] = s[0, 0] - (sep[r - 1, -1] + 1 if r else 0)
        lens[1:, 0] = s[1:, 0] - s[:-1, -1] - 1
        lens = np.ascontiguousarray(lens.T)  # [40, rows]
        words = at[s.T]
        top = words[0] >> _U64(56)
        if not ((lens[0] == 1).all() and ((top == 48) | (top == 49)).all()):
            return None
        label[r:r + _PLAIN_ROWS] = top.astype(np.int32) - 48
        values = _plain_dense(words[1:d], lens[1:d])
        h = _plain_hex(words[d:], lens[d:])
        if values is None or h is None:
            return None
        dense[:, r:r + _PLAIN_ROWS] = transform_dense(values)
        hashes[:, r:r + _PLAIN_ROWS] = h
        missing[:, r:r + _PLAIN_ROWS] = lens[d:] == 0
    return [label, *dense, *(transform_categorical(hashes[f], rows, missing[f]) for f, rows in enumerate(spec.table_rows))]


def _plain_dense(words: np.ndarray, lens: np.ndarray) -> np.ndarray | None:
    """Dense fields (each the top lens bytes of its word) as float64 integers (empty: 0), or None
    unless every one is empty or an optional '-' then digits, in at most 8 characters."""
    if lens.max(initial=0) > 8:
        return None
    top = _TOP[lens]
    w = (words & top) | (_ZEROS & ~top)  # the bytes before a field become '0's
    shift = (_U64(8) * (_U64(8) - lens.astype(np.uint64))) & _U64(63)  # its first byte's bit offset
    neg = (lens > 0) & (((w >> shift) & _U64(255)) == _U64(45))
    if neg.any():
        if (neg & (lens < 2)).any():  # "-" alone is not an integer
            return None
        w ^= np.where(neg, _U64(45 ^ 48) << shift, _U64(0))  # its '-' becomes a '0'
    if not _all_in(w, 0x30, 0x39):
        return None
    # eight digits, the most significant first (lowest byte), into their value (Lemire's SWAR)
    v = w - _ZEROS
    v = v * _U64(10) + (v >> _U64(8))
    v = (((v & _U64(0x000000FF000000FF)) * _U64(100 + (1000000 << 32)))
         + (((v >> _U64(16)) & _U64(0x000000FF000000FF)) * _U64(1 + (10000 << 32)))) >> _U64(32)
    v = v.view(np.int64)
    return np.where(neg, -v, v).astype(np.float64)  # negated as integers: "-0" is 0, not -0.0


def _plain_hex(words: np.ndarray, lens: np.ndarray) -> np.ndarray | None:
    """Categorical fields as uint32 hashes (empty: 0), or None unless every one is empty or
    exactly 8 hex digits."""
    empty = lens == 0
    if not (empty | (lens == 8)).all():
        return None
    w = np.where(empty, _ZEROS, words)
    # per byte c (below 0x80): its digit value if c is a hex digit ('0'-'9' -> 0-9, 'a'-'f' and
    # 'A'-'F' -> 10-15), and c is one exactly if writing that value back as a lowercase hex digit
    # gives c (lowercased where bit 6 is set) and the value is below 16
    nibbles = (w & _U64(0x0F) * _LANES) + ((w >> _U64(6)) & _LANES) * _U64(9)
    letter = ((nibbles + _U64(0x76) * _LANES) >> _U64(7)) & _LANES  # 1 where the value is 10 or more
    back = nibbles + _ZEROS + letter * _U64(0x27)
    if ((w & _U64(0x80) * _LANES) | (nibbles & _U64(0x10) * _LANES)).any() or (back != (w | ((w & _U64(0x40) * _LANES) >> _U64(1)))).any():
        return None
    lo = _U64(0x000F000F000F000F)
    y = ((nibbles & lo) << _U64(4)) | ((nibbles >> _U64(8)) & lo)  # 16-bit lanes: one byte of the hash each
    y = (y | (y >> _U64(8))) & _U64(0x0000FFFF0000FFFF)
    y = (y | (y >> _U64(16))) & _U64(0xFFFFFFFF)  # the hash's bytes, most significant lowest
    return y.astype(np.uint32).byteswap()


def _in(w: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """0x80 in each byte of w (every byte below 0x80) that lies in [lo, hi], else 0."""
    return (w + _U64(0x80 - lo) * _LANES) & ~(w + _U64(0x7F - hi) * _LANES) & (_U64(0x80) * _LANES)


def _all_in(w: np.ndarray, lo: int, hi: int) -> bool:
    """Whether every byte of every word lies in [lo, hi] (hi < 0x80)."""
    high = _U64(0x80) * _LANES
    return not ((w & high) != 0).any() and bool((_in(w, lo, hi) == high).all())
