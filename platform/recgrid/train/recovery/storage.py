"""The restore order past a live peer, and the storage checkpoints it ends in.

A worker that starts without state takes, in this order: a live peer group's copy (the heal at
its group's first quorum, `train.recovery.peers`); else the hosts' newest complete in-memory
snapshot (`train.recovery.holders`, source `holder`) when it is at least as new as the newest
storage checkpoint; else that checkpoint (`storage`); else `train.resume_from` (`resume`); else
step 0 (`fresh`), said in the log and the run (`train.recovery.events`). `StorageFallback` is
everything after the peer, and writes the storage checkpoints (the live group of quorum rank 0,
at the job's cadence). A restore sets every group's data cursor back to the restored step
(`JobControl.rewind_groups`). The protocol is docs/design-notes.md's "Failures, restarts and
elastic jobs".
"""

from __future__ import annotations

import time
from typing import Any

from recgrid.train.checkpoint import checkpoint_step
from recgrid.train.trainer import Trainer


class StorageFallback:
    """Storage checkpoints and the restore order past a live peer (the module docstring): `maybe_save` after every committed
    step (the live group of quorum rank 0 writes at the job's checkpoint steps), `restore` at a
    group's first quorum when nobody is ahead of step 0: the hosts' in-memory snapshot when at
    least as new as the job's newest storage checkpoint, else that checkpoint, else `resume_from`
    (`train.resume_from`: another job's checkpoint, at any M and L), else nothing. `agreed(name)`
    is the writing group's agreed vote at the step's commit (`Replicas.agreed`)."""

    def __init__(self, checkpointer: Any, control: Any, coordinator: Any, group: int, shard: int,
                 resume_from: str | None = None, holders: Any = None, agreed: Any = None) -> None:
        self.checkpointer, self.control, self.coordinator = checkpointer, control, coordinator
        self.group, self.shard, self.resume_from = group, shard, resume_from
        # the in-memory snapshots on the hosts' holders (`holders.HolderRestore` over the group's grid), read
        # before the storage checkpoint when they are at least as new; None: the job takes none
        self.holders = holders
        self.agreed = agreed or (lambda name: False)
        checkpointer.after_save = self.written

    def maybe_save(self, step: int, writes: bool) -> None:
        """At a checkpoint step the group agreed on, the live group of quorum rank 0 (`writes`)
        writes one (collective over its workers; the checkpointer keeps the cadence)."""
        if writes:
            self.checkpointer.maybe_save(step, self.agreed("checkpoint"))

    def written(self, step: int, path: str) -> None:
        """The checkpointer's `after_save`: shard rank 0 lists the checkpoint with the coordinator,
        names its step a restore point (job control keeps every group's cursor there), and the
        checkpointer keeps the job's newest (`Checkpointer.keep_newest`)."""
        import ray

        if self.shard != 0:
            return
        self.control.pin.remote(step, "checkpoint")
        ray.get(self.coordinator.checkpoint_written.remote(step, path))
        self.checkpointer.keep_newest(ray.get(self.coordinator.status.remote())["checkpoints"])

    def restore(self, trainer: Trainer) -> dict[str, Any] | None:
        """Load the hosts' newest complete in-memory snapshot or the job's newest storage
        checkpoint, whichever is newer (the snapshot on a tie; collective over the sharding group:
        shard rank 0 picks), and set this group's data cursor to where it stood at that step (job
        control's, `JobControl.rewind_groups`: the same for every group restoring it); else
        `resume_from`, with the data cursor it holds (where the job that wrote it stood, its parts
        re-split for this job's when T differs). Returns what was loaded (`source` "holder",
        "storage" or "resume", path, step, seconds), or None."""
        import ray
        import torch.distributed as dist

        box = [self._choose() if self.shard == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        path, plan = box[0]
        t0 = time.time()
        if plan is not None:
            restored = self._from_holders(trainer, plan)
        elif path is not None:
            step = self.checkpointer.load(trainer, path)
            restored = {"source": "storage", "path": path, "step": step}
        elif self.resume_from:
            step = self.checkpointer.load(trainer, self.resume_from)
            return {"source": "resume", "path": self.resume_from, "step": step, "load_s": time.time() - t0,
                    "at": time.time()}
        else:
            return None
        cursor = ray.get(self.control.rewind_groups.remote(restored["step"])).get(self.group)
        trainer.state.cursor.load_state_dict(cursor if cursor is not None else type(trainer.state.cursor)().state_dict())
        return {**restored, "load_s": time.time() - t0, "at": time.time()}

    def _choose(self) -> tuple[str | None, dict[str, Any] | None]:
        """Shard rank 0's pick: (the newest storage checkpoint, the holders' plan when their newest
        complete snapshot is at least as new, else None)."""
        import ray

        path = ray.get(self.coordinator.latest_checkpoint.remote())
        if self.holders is None:
            return path, None
        plan = ray.get(self.coordinator.restore_plan.remote(self.holders.grid.group_size))
        if plan["step"] is None or (path is not None and plan["step"] < (checkpoint_step(path) or 0)):
            return path, None
        return path, plan

    def _from_holders(self, trainer: Trainer, plan: dict[str, Any]) -> dict[str, Any]:
        """Load the holders' snapshot of `plan` (every worker its own shard position, this host's
        holder first), check it bit for bit against the checksums the copies arrived with, and
        forget newer, incomplete generations (collective over the sharding group). Its detail says
        where each shard position came from."""
        import ray
        import torch.distributed as dist

        fetched = self.holders.load(trainer, plan)
        mine = self.holders.verify(trainer, plan["step"], fetched)  # raises unless bit for bit
        shards: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            shards = [None] * dist.get_world_size()
            dist.all_gather_object(shards, mine)
        if self.shard == 0:
            ray.get(self.coordinator.drop_after.remote(plan["step"]))
        corrupt = plan.get("corrupt") or []
        # the interval: to the nearest other generation the holders list, older or newer (a newer one
        # being written when the host went may have evicted the older: two generations are kept)
        others = [abs(plan["step"] - s) for s in plan.get("generations", []) if s != plan["step"]]
        return {"source": "holder", "path": "", "step": trainer.state.step, "shards": shards, "corrupt": corrupt,
                "snapshot_interval_steps": min(others) if others else None,
                "lost_nodes": plan.get("lost_nodes", []), "detail": shards_detail(shards)
                + (f"; corrupted copies dropped (their checksums changed since they were written): "
                   f"{'; '.join(corrupt)}" if corrupt else "")}


def shards_detail(shards: list[dict[str, Any]]) -> str:
    """Where each restored shard position came from, for the log and the run: the host whose
    holder served it, and, for a copy kept for another host, the host it was written on."""
    parts = []
    for x in sorted(shards, key=lambda x: (x["shard"], x["rank"])):
        if any(p.startswith(f"shard position {x['shard']} ") for p in parts):
            continue
        kept = x["written_on"] != x["from_node"]
        parts.append(f"shard position {x['shard']} from host {x['from_node'][:12]}"
                     + (f" (the copy it kept of host {x['written_on'][:12]})" if kept else " (its own copy)"))
    return "; ".join(parts)
