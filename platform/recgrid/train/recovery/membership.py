"""A sharding group's membership in the job between failures: the join signal (`GroupProgress`:
shard rank 0's progress notes to job control, whose answers tell the live groups that a group
waits to join), the first start's wait for the other groups (`wait_for_peers`) and the leave
at a drain (`leave_at_drain`). The protocol: docs/design-notes.md, "Failures, restarts and
elastic jobs"."""

from __future__ import annotations

import time
from typing import Any

from recgrid.train.job import WorkerJob
from recgrid.train.trainer import Trainer

START_WAIT_S = 120  # torchft's first start: how long the sharding groups wait for each other, so the first quorum has all of them


class GroupProgress:
    """Shard rank 0's notes of its sharding group's progress to job control (`note`, after every
    committed sync step: the step and the data cursor, `JobControl.group_progress`; a rebuilt group
    reads on from its own newest note), and the component's `train.recovery.peers.JoinSignal` on top of them:
    each note's answer, read at the next sync step without waiting for it, is the asks still open
    (`JobControl.joining`: the groups that asked for their first quorum and have not committed
    since), so the live groups learn of a waiting group without a call of their own. Every open ask
    this worker has not met for yet is heard once, whenever it was made: a group that asked before
    this one's first quorum and is not in it is heard too (counting asks, a group's own ask hid the
    asks made before it, and a group the first quorum left out waited until the others ended). An
    ask of a group that was in that quorum may be heard once more: one quorum in which nothing
    changes. The other shard ranks note nothing and hear nothing (their group-mate's word reaches
    them through the group's agreement, `TorchftReplicas.commit`)."""

    def __init__(self, control: Any, group: int, shard: int, trainer: Trainer) -> None:
        self.control, self.group, self.shard, self.trainer = control, group, shard, trainer
        self.met: set[tuple[int, int]] = set()  # the asks (group, number) this worker has heard
        self.heard = False  # an ask not in `met` arrived and nobody has been told yet
        self._answer: Any = None  # the newest note's reply, not read yet

    def note(self, step: int) -> None:
        if self.shard != 0 or not self.trainer.schedule.syncs(step):
            return
        self._read()
        self._answer = self.control.group_progress.remote(self.group, step, self.trainer.state.cursor.state_dict(),
                                                          time.time())

    def announce(self) -> None:
        import ray

        if self.shard == 0:
            ray.get(self.control.joining.remote(self.group))

    def pending(self) -> bool:
        self._read()
        heard, self.heard = self.heard, False
        return heard

    def _read(self) -> None:
        import ray

        if self._answer is None or not ray.wait([self._answer], timeout=0)[0]:
            return
        asks, self._answer = ray.get(self._answer), None
        new = set(asks.items()) - self.met
        if new:
            self.met |= new
            self.heard = True


def wait_for_peers(control: Any, workers: int) -> None:
    """At the job's first start, wait until the managers of `workers` workers are up (those of
    the sharding groups the cluster holds): the first quorum then holds every group that can
    start (torchft forms a quorum of whoever asks first otherwise); the others join later."""
    import ray

    deadline = time.time() + START_WAIT_S
    while time.time() < deadline:
        attempts = ray.get(control.status.remote())["attempts"]
        if len({r for a in attempts for r, w in a["workers"].items() if w.get("ready")}) >= workers:
            return
        time.sleep(0.1)


def leave_at_drain(job: WorkerJob, trainer: Trainer, replicas: Any, fallback: Any, manager: Any, g: int, s: int,
                    L: int) -> None:
    """A node of this sharding group's run is being drained (Ray Train's notice, `train.recovery.peers`): the
    group leaves after its committed step. Its updates were averaged into the live groups at the
    block's sync and its data cursor is noted, so nothing it trained is lost; the last group to
    leave writes a storage checkpoint first. Then its workers wait: Ray Train ends the run at the
    drain's deadline and starts it again where there is room (the group comes back healed from
    a live peer), unless the job ends first (the run then ends with it)."""
    import ray
    import torch.distributed as dist

    notice, step, control = replicas.left, trainer.state.step, job.control
    manager.shutdown(wait=False)  # the live groups' next quorum goes on without this group
    box = [ray.get(control.group_leaves.remote(g, step, notice.preempted_node_ids, notice.deadline_ms))
           if s == 0 else None]
    if L > 1:
        dist.broadcast_object_list(box, src=0)
    stays, ckpt, kept = box[0], fallback.checkpointer, None
    if not stays and ckpt.cadence.on:  # no group trains on: the model goes to storage (collective over the group)
        kept = ckpt.save_at(step)
    if s == 0:
        left = max(0.0, notice.deadline_ms / 1000 - time.time()) if notice.deadline_ms else None
        control.say.remote(
            f"[recgrid] sharding group {g}: its node is being drained"
            + (f" ({left:.0f} s to the deadline)" if left is not None else "") + f"; it left after step {step}, "
            + (f"groups {stays} train on and it comes back, healed from one of them, where there is room" if stays
               else f"no group trains on: storage checkpoint {kept}" if kept
               else "no group trains on and train.checkpoint_every=0: nothing is kept past this job"))
    while not ray.get(control.over.remote()):
        time.sleep(1.0)
