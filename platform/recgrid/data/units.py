"""Epochs as ordered lists of row ranges, and the data cursor that makes them resumable.

Ray Data's `streaming_split` hands blocks to whichever worker asks first, so where a worker was
in it cannot be written down or sought back to (ray-project/ray#37633). recgrid's training input
is instead a deterministic sequence, which each worker reads through a Ray Dataset of its own
(`data.stream.ray_batches`: read tasks of whole batches cut from its units, in order): the job's files are cut into *units* (a file's row range, at most
`rows_per_unit` rows), an epoch is the units in an order drawn from (seed, epoch), and a
*segment* of an epoch is split over the workers that train it into equal contiguous parts of
whole batches. Every worker takes one batch per step, so a step consumes the same number of
rows in every part and the whole data position is a `DataCursor`: the epoch, the units the
segment started with, how many workers and rows per batch it was split for, and the steps it
has taken. Restoring a cursor resumes each part exactly where the step count says; restoring
it on a different number of workers (elastic jobs) re-splits what no part has consumed yet into
a new segment, so no row of the epoch is skipped and none is trained twice beyond the steps
rolled back.

A segment's rows beyond the last whole step of every part (fewer than workers x batch rows)
are not trained in that epoch; the next epoch starts from the full list again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

DEFAULT_ROWS_PER_UNIT = 65_536


@dataclass(frozen=True)
class Unit:
    """Rows [start, end) of file number `file` of the job's inputs."""

    file: int
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Inputs:
    """The job's data files, in order, and how many rows each holds."""

    files: tuple[str, ...]
    rows: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.files) != len(self.rows):
            raise ValueError(f"{len(self.files)} files but {len(self.rows)} row counts")

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    def units(self, rows_per_unit: int = DEFAULT_ROWS_PER_UNIT) -> list[Unit]:
        """Every file cut into ranges of at most `rows_per_unit` rows, in file order."""
        if rows_per_unit < 1:
            raise ValueError(f"rows_per_unit must be positive, got {rows_per_unit}")
        return [Unit(f, s, min(s + rows_per_unit, n)) for f, n in enumerate(self.rows)
                for s in range(0, n, rows_per_unit)]


def epoch_units(inputs: Inputs, epoch: int, seed: int, rows_per_unit: int = DEFAULT_ROWS_PER_UNIT) -> list[Unit]:
    """The units of `epoch` in the order drawn from (seed, epoch): the same in every process."""
    units = inputs.units(rows_per_unit)
    random.Random(f"recgrid-epoch-{seed}-{epoch}").shuffle(units)
    return units


def take_rows(units: Sequence[Unit], skip: int, count: int | None = None) -> list[Unit]:
    """The ranges of rows [skip, skip + count) of the concatenation of `units` (all after `skip`
    when count is None)."""
    out: list[Unit] = []
    left = None if count is None else count
    for u in units:
        if left == 0:
            break
        if skip >= u.rows:
            skip -= u.rows
            continue
        start = u.start + skip
        skip = 0
        end = u.end if left is None else min(u.end, start + left)
        out.append(Unit(u.file, start, end))
        if left is not None:
            left -= end - start
    return out


def split_rows(units: Sequence[Unit], sizes: Sequence[int]) -> list[list[Unit]]:
    """Consecutive parts of the concatenated `units` with `sizes[i]` rows each."""
    parts, offset = [], 0
    for size in sizes:
        parts.append(take_rows(units, offset, size))
        offset += size
    return parts


def even_sizes(total: int, parts: int) -> list[int]:
    """`total` rows over `parts` parts, sizes differing by at most one (evaluation)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


@dataclass
class DataCursor:
    """Where training is in its data: the epoch, the segment being trained and its steps.

    `segment` is None at the start of an epoch (the segment is then the whole epoch, in its
    drawn order); after an elastic re-split it is the explicit list of units left.
    """

    epoch: int = 0
    segment: list[Unit] | None = None
    workers: int = 0  # how many parts the segment is split into (0: not started)
    batch_size: int = 0
    steps: int = 0  # steps taken in this segment

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "workers": self.workers, "batch_size": self.batch_size, "steps": self.steps,
                "segment": None if self.segment is None else [[u.file, u.start, u.end] for u in self.segment]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.workers = int(sd["epoch"]), int(sd["workers"])
        self.batch_size, self.steps = int(sd["batch_size"]), int(sd["steps"])
        self.segment = None if sd["segment"] is None else [Unit(*map(int, u)) for u in sd["segment"]]


@dataclass
class Segment:
    """One segment split over `workers` parts of `steps_total` batches each."""

    epoch: int
    units: list[Unit]
    workers: int
    batch_size: int
    parts: list[list[Unit]] = field(default_factory=list)

    @property
    def steps_total(self) -> int:
        return sum(u.rows for u in self.units) // (self.workers * self.batch_size)

    def part(self, rank: int, from_step: int = 0) -> list[Unit]:
        """Worker `rank`'s rows from step `from_step` on."""
        return take_rows(self.parts[rank], from_step * self.batch_size)


class EpochPlan:
    """The job's training sequence: which rows each worker trains at each step.

    Args:
        inputs: the training files and their row counts.
        seed: draws each epoch's unit order.
        batch_size: rows per worker per step.
        rows_per_unit: the largest range a file is cut into.
    """

    def __init__(self, inputs: Inputs, seed: int, batch_size: int, rows_per_unit: int = DEFAULT_ROWS_PER_UNIT):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.inputs, self.seed, self.batch_size, self.rows_per_unit = inputs, seed, batch_size, rows_per_unit

    def segment(self, cursor: DataCursor, workers: int) -> Segment:
        """The segment `cursor` is in, split over `workers`; moves `cursor` to it.

        Same workers and batch size as when the segment started: the same split (resume at
        `cursor.steps`). Otherwise what no part has consumed is re-split, and the cursor starts a
        new segment at step 0.
        """
        if cursor.segment is None and cursor.workers == 0:
            units = epoch_units(self.inputs, cursor.epoch, self.seed, self.rows_per_unit)
        elif cursor.workers == workers and cursor.batch_size == self.batch_size:
            units = self._units_of(cursor)
        else:
            units = self.remaining(cursor)
            cursor.segment, cursor.steps = units, 0
        cursor.workers, cursor.batch_size = workers, self.batch_size
        return self._split(cursor.epoch, units, workers)

    def next_epoch(self, cursor: DataCursor) -> None:
        cursor.epoch, cursor.segment, cursor.workers, cursor.batch_size, cursor.steps = cursor.epoch + 1, None, 0, 0, 0

    def remaining(self, cursor: DataCursor) -> list[Unit]:
        """Every row of the cursor's segment that no part has trained yet, parts in order, then
        the segment's tail."""
        units = self._units_of(cursor)
        if cursor.workers == 0:
            return list(units)
        seg = self._split(cursor.epoch, units, cursor.workers, cursor.batch_size)
        left = [u for part in seg.parts for u in take_rows(part, cursor.steps * cursor.batch_size)]
        used = cursor.workers * seg.steps_total * cursor.batch_size
        return left + take_rows(units, used)

    def _units_of(self, cursor: DataCursor) -> list[Unit]:
        if cursor.segment is not None:
            return cursor.segment
        return epoch_units(self.inputs, cursor.epoch, self.seed, self.rows_per_unit)

    def _split(self, epoch: int, units: list[Unit], workers: int, batch_size: int | None = None) -> Segment:
        b = batch_size or self.batch_size
        seg = Segment(epoch, units, workers, b)
        per_part = seg.steps_total * b
        seg.parts = split_rows(units, [per_part] * workers)
        return seg
