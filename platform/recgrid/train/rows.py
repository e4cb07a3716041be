"""The rows a job trained: every worker's row log (`RowLog`: the row ids of each batch it
consumed, under the step it counts for) and the audit that reads them back against the job's
epoch plan (`rank_positions`): no batch skipped, and which batches were read twice. Tests and
`bench/node_loss.py` audit jobs with it; `data.row_log` turns the logs on."""

from __future__ import annotations

import os
from typing import Any

from recgrid.data.units import DataCursor, EpochPlan, take_rows


class RowLog:
    """Appends (step, row id) pairs of every trained row to `<dir>/rows-a<attempt>-r<rank>.bin`
    (int64 pairs, written per batch before its round commits, so a killed worker's file holds
    every step its group committed, and at most its last uncommitted batch besides)."""

    def __init__(self, directory: str, attempt: int, rank: int) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        # the rows a job trained are its data: this user's only, and never through a planted link
        self.fd = os.open(row_log_file(directory, attempt, rank),
                          os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)

    def on_batch(self, trainer: Any, step: int, batch: Any) -> None:
        """`FitHooks.on_batch`: the rows of every consumed batch, under the step it counts for,
        written before its round commits (a worker killed right after a commit has them)."""
        self.write(step, getattr(batch, "row_ids", None))

    def write(self, step: int, row_ids: Any) -> None:
        import numpy as np

        if row_ids is None:
            return
        ids = np.asarray(row_ids, dtype=np.int64)
        os.write(self.fd, np.stack([np.full_like(ids, step), ids], axis=1).tobytes())


def row_log_file(directory: str, attempt: int, rank: int) -> str:
    """The file `RowLog` writes for rank `rank` of attempt `attempt` under `directory`."""
    return os.path.join(directory, f"rows-a{attempt:03d}-r{rank:03d}.bin")


def read_row_logs(directory: str) -> dict[tuple[int, int], Any]:
    """(attempt, rank) -> int64 array [n, 2] of (step, row id), from a RowLog directory."""
    import numpy as np

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rows-a") and name.endswith(".bin"):
            attempt, rank = int(name[6:9]), int(name[11:14])
            out[(attempt, rank)] = np.fromfile(os.path.join(directory, name), dtype=np.int64).reshape(-1, 2)
    return out


def rank_positions(inputs: Any, seed: int, batch_size: int, rows_per_unit: int, workers: int, rank: int,
                   logs: dict[tuple[int, int], Any], window: int) -> list[int]:
    """Where each batch global rank `rank` logged (`read_row_logs`' arrays, its attempts in order)
    sits in its part of the job's epoch plan for `workers` workers, epoch after epoch (position k:
    the part's k-th batch over the epochs). Each is matched in order: the part's next batch, or
    one of the `window` - 1 before it read again (`Schedule.reread_window`); one that is neither is placed at its next
    occurrence further on (a gap: the batches between were skipped). Synthetic row ids count
    rows over all files, as `scan_inputs` lists them."""
    import numpy as np

    B = batch_size
    plan = EpochPlan(inputs, seed, B, rows_per_unit)
    first_row = np.cumsum([0, *inputs.rows])
    batches = [np.sort(b).tobytes() for (a, r) in sorted(logs) if r == rank for b in logs[(a, r)][:, 1].reshape(-1, B)]
    expected: list[bytes] = []
    cursor = DataCursor()
    while len(expected) < len(batches) + window:
        seg = plan.segment(cursor, workers)
        expected += [np.sort(np.concatenate([first_row[u.file] + np.arange(u.start, u.end)
                                             for u in take_rows(seg.parts[rank], k * B, B)])).tobytes()
                     for k in range(seg.steps_total)]
        plan.next_epoch(cursor)
    positions, nxt = [], 0
    for b in batches:
        back = [j for j in range(nxt, max(-1, nxt - window), -1) if expected[j] == b]
        at = back[0] if back else expected.index(b, nxt)
        positions.append(at)
        nxt = at + 1
    return positions
