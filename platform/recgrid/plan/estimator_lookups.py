"""A speed-up of TorchRec's perf estimator, used while the planner enumerates: remembered
annotated-method lookups.

TorchRec 1.8's perf estimator finds its hardware config's annotated methods by scanning
`dir(config)` on every call (`estimator.annotations._get_annotated_method` and
`_get_coefficient_method`), which is about half of an enumeration's time. While planning,
`memoized_estimator_lookups` remembers which method each scan found, per config class, annotation
and sharding type, and returns that same bound method. It patches TorchRec's private functions, so
it is guarded: only on the TorchRec versions in TESTED_TORCHREC (whose scans it was checked
against: tests/test_plan.py compares every estimate with and without it), and only where those
functions exist; anywhere else it does nothing. The gain, measured by `measure_gain` (docs/
performance.md quotes it), is the reason it stays.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

# TorchRec versions (major.minor) whose private annotated-method scans this was checked against
TESTED_TORCHREC: tuple[str, ...] = ("1.8",)
SCANS: tuple[str, ...] = ("_get_annotated_method", "_get_coefficient_method")


def torchrec_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchrec")
    except PackageNotFoundError:
        return ""


def applies(version: str | None = None) -> bool:
    """Whether the patch is used with this TorchRec (`version`: the installed one when None)."""
    v = torchrec_version() if version is None else version
    return ".".join(v.split(".")[:2]) in TESTED_TORCHREC


@contextlib.contextmanager
def memoized_estimator_lookups() -> Iterator[None]:
    """Remember TorchRec's annotated-method scans while inside; restored on exit. Does nothing on
    an untested TorchRec or one without these functions."""
    if not applies():
        yield
        return
    try:
        from torchrec.distributed.planner.estimator import annotations
    except ImportError:
        yield
        return
    names = [n for n in SCANS if callable(getattr(annotations, n, None))]
    saved = {n: getattr(annotations, n) for n in names}
    try:
        for n in names:
            setattr(annotations, n, _remembering(saved[n]))
        yield
    finally:
        for n, f in saved.items():
            setattr(annotations, n, f)


def _remembering(scan: Callable) -> Callable:
    """`scan` with its answers remembered by name; a scan whose result cannot be recalled by name
    is repeated every time."""
    found: dict[tuple, str | None] = {}

    def lookup(config, marker, sharding_type=None):
        key = (type(config), marker, sharding_type)
        if key in found:
            name = found[key]
            return None if name is None else getattr(config, name)
        method = scan(config, marker, sharding_type)
        name = getattr(getattr(method, "__func__", None), "__name__", None)
        if method is None or (name is not None and getattr(config, name, None) == method):
            found[key] = None if method is None else name
        return method
    return lookup


def measure_gain(enumerate_once: Callable[[], object], repeats: int = 3) -> dict:
    """Seconds of `enumerate_once()` (an uncached enumeration) without and with the patch, best
    of `repeats` each, and their ratio."""
    def best(memo: bool) -> float:
        times = []
        for _ in range(repeats):
            with memoized_estimator_lookups() if memo else contextlib.nullcontext():
                t0 = time.perf_counter()
                enumerate_once()
                times.append(time.perf_counter() - t0)
        return min(times)

    plain, memo = best(False), best(True)
    return {"torchrec": torchrec_version(), "plain_s": round(plain, 3), "memoized_s": round(memo, 3),
            "speedup": round(plain / memo, 2) if memo > 0 else None}
