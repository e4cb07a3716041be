"""Ray Train's per-worker entry points, light to import.

Ray Train's controller unpickles the function it is handed and its `train_loop_config`. Handed
`train.worker.train_group_worker` and a `WorkerJob` (whose engine config and sharding plan are TorchRec
objects), the controller imported torch, TorchRec, FBGEMM and torchmetrics before it asked for a
single worker: about 4 s of CPU on every job's start path. Here the functions import nothing
heavy, and the job travels as bytes that only the workers unpickle.
"""

from __future__ import annotations

from typing import Any


def pack(job: Any) -> dict[str, bytes]:
    """The `train_loop_config` for `job` (a `train.worker.WorkerJob`): pickled once, by Ray's
    cloudpickle (it carries the job's actor handles)."""
    from ray import cloudpickle

    return {"job": cloudpickle.dumps(job)}


def _unpack(cfg: dict[str, bytes]) -> dict[str, Any]:
    from ray import cloudpickle

    return {**cfg, "job": cloudpickle.loads(cfg["job"])}


def group_worker(cfg: dict[str, bytes]) -> None:
    """`train.worker.train_group_worker` (one sharding group's run: `cfg["group"]`)."""
    # cold start: Ray Train's controller imports this module, and train.worker imports torch and TorchRec
    from recgrid.train.worker import train_group_worker

    train_group_worker(_unpack(cfg))
