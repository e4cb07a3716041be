"""A job's schedule (`Schedule`): K and every cadence counted from it, built once from the
JobConfig (`Schedule.of_job`) and handed to the components that act on it: the trainer's stop
check, the storage checkpoints (`train.checkpoint.Checkpointer`), the in-memory snapshots
(`train.recovery.holders.Snapshotter`), the group's progress notes and heartbeats (sync steps
only), and the row audit's window. The one sync-step predicate is the engine's
(`engine.sync.sync_step`, which the replica sync itself keeps)."""

from __future__ import annotations

from dataclasses import dataclass, field

from recgrid.config import CheckpointCadence, JobConfig, SnapshotCadence
from recgrid.engine.sync import sync_step

STOP_CHECK_MIN_STEPS = 5  # the fewest steps between two stop checks (`Schedule.stop_check_every`)


@dataclass(frozen=True)
class Schedule:
    """When things happen, in steps: the replica sync every `sync_every` (K) steps; at sync steps
    only, the storage checkpoints (`checkpoints`) and the in-memory snapshots (`snapshots`); a
    stop check every `stop_check_every` steps (and at every logging step). A schedule without
    cadences (`Schedule(K)`) is the local launcher's and the benches'."""

    sync_every: int
    checkpoints: CheckpointCadence = field(default_factory=CheckpointCadence)
    snapshots: SnapshotCadence = field(default_factory=SnapshotCadence)

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every (K) must be >= 1, got {self.sync_every}")

    @classmethod
    def of_job(cls, config: JobConfig) -> "Schedule":
        return cls(config.grid.sync_every, config.checkpoints, config.snapshots)

    def syncs(self, step: int) -> bool:
        """Whether step `step` (1-based count of finished steps) ends a block of K steps."""
        return sync_step(step, self.sync_every)

    def syncs_between(self, earlier: int, step: int) -> int:
        """Replica syncs from step `earlier` to step `step` (sync steps both)."""
        return (step - earlier) // self.sync_every

    def snapshot_sync(self, step: int) -> bool:
        """Whether a fixed snapshot cadence (`snapshots.every_syncs`) takes one at sync step `step`."""
        return self.snapshots.every_syncs > 0 and (step // self.sync_every) % self.snapshots.every_syncs == 0

    @property
    def stop_check_every(self) -> int:
        """Steps between two stop checks: the first multiple of K from STOP_CHECK_MIN_STEPS on, so an
        interrupted job stops where the replicas were just synced, and a check (one small
        collective) is never paid every step."""
        return self.sync_every * max(1, -(-STOP_CHECK_MIN_STEPS // self.sync_every))

    def checks_stop(self, step: int) -> bool:
        return step % self.stop_check_every == 0

    @property
    def reread_window(self) -> int:
        """How far back in its part a batch read again may lie: a rebuilt sharding group reads on
        from its group's last noted sync step (`train.recovery.membership.GroupProgress`), so the
        batches of up to K - 1 committed steps after it, and those of the rounds that did not
        commit when it broke (one or two), are read again (`train.rows.rank_positions`)."""
        return self.sync_every + 2
