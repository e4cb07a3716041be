"""The restore order past a live peer, and the storage checkpoints it ends in.

A worker that starts without state takes, in this order: a live peer group's copy, in memory at
the current step (the heal at its group's first quorum, `train.recovery.peers`); else, with
M = 1, its group's newest complete in-memory snapshot on the nodes' holders
(`train.recovery.holders`, source `holder`), when it is at least as new as the newest storage
checkpoint; else the job's newest storage checkpoint (`storage`); else `train.resume_from`
(`resume`); else step 0 (`fresh`), said in the log and the run (`train.recovery.events`).
`StorageFallback.restore` is everything after the peer: shard rank 0 of the group decides, and
tells its group-mates.

Storage checkpoints, for when no live group is left to heal from (every group lost at once, or
M = 1): the live group of quorum rank 0 writes one at the job's cadence
(`train.checkpoint_every`, derived by default), over its own L workers, after the committed sync
step's tables landed: one whole model copy, the same form as any storage checkpoint (it loads at
any M or L). Nothing is reported to Ray Train (its report is a barrier over every worker, and the
other groups are training meanwhile); the job's recovery coordinator keeps the list, and the
writer's checkpointer keeps the newest (`Checkpointer.keep_newest`). A group whose first quorum
finds nobody ahead of step 0 reads the newest checkpoint, and every group's data cursor goes back
to where it stood at that step (job control pins them, `JobControl.cursors_at`): rows trained
after it are trained again, none is skipped. `train.resume_from` is another job's checkpoint,
with the data cursor it holds, read by every group at the job's start.
"""

from __future__ import annotations

import time
from typing import Any

from recgrid.train.trainer import Trainer


class StorageFallback:
    """Storage checkpoints and the restore order past a live peer (the module docstring): `maybe_save` after every committed
    step (the live group of quorum rank 0 writes at the job's checkpoint steps), `restore` at a
    group's first quorum when nobody is ahead of step 0: the job's newest storage checkpoint, else
    `resume_from` (`train.resume_from`: another job's checkpoint, at any M and L), else nothing."""

    def __init__(self, checkpointer: Any, control: Any, coordinator: Any, group: int, shard: int,
                 resume_from: str | None = None, holders: Any = None) -> None:
        self.checkpointer, self.control, self.coordinator = checkpointer, control, coordinator
        self.group, self.shard, self.resume_from = group, shard, resume_from
        # M = 1: the group's in-memory snapshots on its nodes' holders (`holders.HolderRestore` over the
        # group's grid), read before the storage checkpoint when they are at least as new; None: no snapshots
        self.holders = holders
        checkpointer.after_save = self.written

    def maybe_save(self, step: int, writes: bool) -> None:
        """At a checkpoint step, the live group of quorum rank 0 (`writes`) writes one (collective
        over its workers; the checkpointer owns the cadence)."""
        if writes:
            self.checkpointer.maybe_save(step)

    def written(self, step: int, path: str) -> None:
        """The checkpointer's `after_save`: shard rank 0 lists the checkpoint with the coordinator,
        and the checkpointer keeps the job's newest (`Checkpointer.keep_newest`)."""
        import ray

        if self.shard != 0:
            return
        ray.get(self.coordinator.checkpoint_written.remote(step, path))
        self.checkpointer.keep_newest(ray.get(self.coordinator.status.remote())["checkpoints"])

    def restore(self, trainer: Trainer) -> dict[str, Any] | None:
        """Load the job's newest storage checkpoint, if any (collective over the sharding group:
        shard rank 0 picks it), and set this group's data cursor to where it stood at that step;
        else `resume_from`, with the data cursor it holds (where the job that wrote it stood, its
        parts re-split for this job's when T differs). Returns what was loaded (`source` "storage"
        or "resume", path, step, seconds), or None."""
        import ray
        import torch.distributed as dist

        box = [self._choose() if self.shard == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        path, plan = box[0]
        if plan is not None:
            return self._from_holders(trainer, plan)
        source = "storage"
        if path is None:
            if not self.resume_from:
                return None
            path, source = self.resume_from, "resume"
        t0 = time.time()
        step = self.checkpointer.load(trainer, path)
        if source == "storage":
            cursor = ray.get(self.control.rewind_groups.remote(step)).get(self.group)
            trainer.state.cursor.load_state_dict(cursor if cursor is not None
                                                 else type(trainer.state.cursor)().state_dict())
        return {"source": source, "path": path, "step": step, "load_s": time.time() - t0, "at": time.time()}

    def _choose(self) -> tuple[str | None, dict[str, Any] | None]:
        """Shard rank 0's pick: (the newest storage checkpoint, the holders' plan when their newest
        complete snapshot is at least as new, else None)."""
        import ray

        from recgrid.train.checkpoint import checkpoint_step

        path = ray.get(self.coordinator.latest_checkpoint.remote())
        if self.holders is None:
            return path, None
        plan = ray.get(self.coordinator.restore_plan.remote(self.holders.grid.group_size))
        if plan["step"] is None or (path is not None and plan["step"] < (checkpoint_step(path) or 0)):
            return path, None
        return path, plan

    def _from_holders(self, trainer: Trainer, plan: dict[str, Any]) -> dict[str, Any]:
        """Load the holders' snapshot of `plan` (every worker its own shard position, this node's
        holder first), check it bit for bit against the checksums the copies arrived with, and
        forget newer, incomplete generations (collective over the sharding group)."""
        import ray
        import torch.distributed as dist

        t0 = time.time()
        fetched = self.holders.load(trainer, plan)
        mine = self.holders.verify(trainer, plan["step"], fetched)  # raises unless bit for bit
        shards: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            shards = [None] * dist.get_world_size()
            dist.all_gather_object(shards, mine)
        if self.shard == 0:
            ray.get(self.coordinator.drop_after.remote(plan["step"]))
        nodes = len({n for ns in plan["where"].values() for n in ns})
        corrupt = plan.get("corrupt") or []
        return {"source": "holder", "path": "", "step": trainer.state.step, "load_s": time.time() - t0,
                "at": time.time(), "shards": shards, "corrupt": corrupt,
                "detail": f"{len(shards)} shard position(s) from the holders of {nodes} node(s), "
                          f"{sum(s['same_node'] for s in shards)} from the worker's own node"
                          + (f"; corrupted copies dropped (their checksums changed since they were written): "
                             f"{'; '.join(corrupt)}" if corrupt else "")}
