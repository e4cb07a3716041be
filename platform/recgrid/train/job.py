"""What the driver hands every worker of a job (`WorkerJob`): the job's configs, grid, inputs,
actors and schedule, filled by `launch.ray.fit_on_ray` from the JobConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recgrid.data.units import Inputs
from recgrid.engine.grid import Grid
from recgrid.train.schedule import Schedule
from recgrid.trainer_config import EngineConfig, LoopConfig

# set (to 1) in the driver's environment, every worker notes a checksum of its tables after the
# first two syncs past each change of the live group count and at its end, for the tests that
# compare them across groups (a copy of every table to the CPU: off in users' jobs)
TABLE_DIGESTS_ENV = "RECGRID_TABLE_DIGESTS"


@dataclass(frozen=True)
class WorkerJob:
    """What the driver hands every worker (it pickles; it holds no live process handle but the
    job's actor handles). No defaults: the driver fills every field from the JobConfig."""

    engine: EngineConfig
    loop: LoopConfig
    grid: Grid  # T asked for, M, L and the layout
    use_gpu: bool
    plan: Any  # the job's ShardingPlan, in shard ranks
    train_inputs: Inputs
    eval_inputs: Inputs | None
    run_id: str | None
    tracking_uri: str | None
    control: Any  # the job's JobControl actor (train.control)
    recovery: Any  # the job's RecoveryCoordinator actor (train.recovery.coordinator)
    run_name: str
    resume_from: str | None
    row_log: str | None
    rows_per_unit: int
    schedule: Schedule  # K, the checkpoint and snapshot cadences, the stop check (`Schedule.of_job`)
    lighthouse: str  # the job's torchft lighthouse (`train.recovery.peers.Lighthouse`, owned by the driver)
    min_groups: int  # the fewest live sharding groups that train (`JobConfig.min_groups`)
    start_groups: int  # the sharding groups the cluster holds at the job's start (the first quorum waits for them)
    log_model: bool  # the writing group ends the job with a checkpoint of its final step (the driver logs the model)
    table_digests: bool = False  # every worker notes checksums of its tables (tests only: TABLE_DIGESTS_ENV)
    call_audit: bool = False  # every worker counts its actor and MLflow calls by step (tests only: train.audit)
