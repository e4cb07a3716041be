"""Quiet libraries: torch, TorchRec and FBGEMM warn and log at INFO on every sharding, plan and
kernel, and recgrid prints its own lines instead. The one helper every layer uses (it is in the
engine, the lowest layer that needs it): `quiet` from now on (a worker's process), `libraries_quiet`
for a while (a process that goes on)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator, Mapping

LIBRARIES: tuple[str, ...] = ("torch", "torchrec", "fbgemm_gpu")


def quiet(levels: Mapping[str, int]) -> dict[str, int]:
    """Ignore warnings and set each named logger ("" the root logger) to its level, from now on;
    returns the loggers' levels before."""
    warnings.simplefilter("ignore")
    before = {}
    for name, level in levels.items():
        logger = logging.getLogger(name or None)
        before[name] = logger.level
        logger.setLevel(level)
    return before


@contextlib.contextmanager
def libraries_quiet(names: tuple[str, ...] = LIBRARIES, root: int | None = None) -> Iterator[None]:
    """For a while: warnings ignored, loggers `names` below ERROR silent (the root logger at `root`
    too, when given); warning filters and levels restored afterwards."""
    levels = dict.fromkeys(names, logging.ERROR) | ({"": root} if root is not None else {})
    with warnings.catch_warnings():
        before = quiet(levels)
        try:
            yield
        finally:
            for name, level in before.items():
                logging.getLogger(name or None).setLevel(level)
