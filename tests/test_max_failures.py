"""A job whose sharding group fails more often than `train.max_failures` allows: it fails, its
MLflow run is FAILED, and it says why in a sentence (issue 50). On the suite's shared Ray cluster."""

from __future__ import annotations

import os
import signal

import pytest

from faults import BackgroundJob, mlflow_client, small_job, workers_of

K = 5


def _training(st: dict, not_pid: int | None = None, past_step: int = 0) -> bool:
    """The one worker is ready, is not process `not_pid`, and the job trained past `past_step`."""
    w = workers_of(st).get(0)
    return bool(w and w.get("ready") and w["pid"] != not_pid and st["last_step"] > past_step)


@pytest.fixture(scope="module")
def spent(tmp_path_factory, shared_ray):
    """T = M = 1 with train.max_failures=1: its worker killed once (Ray Train restarts the group,
    which restores its snapshot), then again."""
    tmp = tmp_path_factory.mktemp("max_failures")
    config = small_job(tmp, "test-max-failures", "grid.world_size=1", "grid.num_groups=1",
                       f"grid.sync_every={K}", "train.max_steps=100000", "train.max_failures=1",
                       "train.checkpoint_every=0", "data.eval=[]")
    job = BackgroundJob(config)
    st = job.wait_for(lambda s: _training(s, past_step=K), timeout=240)
    first = workers_of(st)[0]["pid"]
    os.kill(first, signal.SIGKILL)  # the failure the job survives
    # the first failure survived: a new worker trains on (wait_for raises if the job ended instead)
    st = job.wait_for(lambda s: _training(s, not_pid=first, past_step=st["last_step"]), timeout=240)
    os.kill(workers_of(st)[0]["pid"], signal.SIGKILL)  # one more than train.max_failures
    result = job.join(timeout=240)
    return result, mlflow_client(config).get_run(result.run_id)


def test_a_job_past_its_max_failures_fails_and_its_run_is_failed(spent):
    result, run = spent
    assert result.status == "FAILED", result
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].split(":", 1)[0] == result.error.split(":", 1)[0], run.data.tags["error"]


def test_a_job_past_its_max_failures_says_so_in_a_sentence(spent):
    result, run = spent
    for said in (result.error, run.data.tags["error"]):
        assert said.startswith("sharding group 0 failed 2 times, more than train.max_failures=1 allows; its last "
                               "failure: "), said
