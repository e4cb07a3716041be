"""The platform end to end: `recgrid train` on a real local Ray cluster with synthetic data,
read back through the MLflow client; invalid configs fail before any worker starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recgrid.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _job(tmp: Path, uri: str, groups: int, extra: list[str] = ()):
    return load_config(REPO / "jobs/local_demo.yaml", [
        f"data.train={tmp}/data/train/*.parquet", f"data.eval={tmp}/data/eval/*.parquet",
        "data.synth_rows=40000", "data.synth_eval_rows=8000",
        "grid.world_size=4", f"grid.num_groups={groups}", "grid.sync_every=5",
        "train.max_steps=60", "train.batch_size=128", "train.log_every=20", "train.eval_every=30",
        f"tracking.tracking_uri={uri}", "tracking.experiment=test-launcher", *extra,
    ])


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """One job with M=2 and the same job with M=1 (the baseline), on one local Ray cluster."""
    import ray

    from recgrid.launcher import run_job

    tmp = tmp_path_factory.mktemp("launcher")
    uri = f"sqlite:///{tmp}/mlflow.db"
    os.environ["RECGRID_RUNS_DIR"] = str(tmp / "runs")
    bad = tmp / "bad"
    bad.mkdir()
    good = "\t".join(["1"] + ["3"] * 13 + ["0a1b2c3d"] * 26)
    (bad / "day_0").write_text(good + "\n" + good.replace("0a1b2c3d", "NOT-HEX!", 1) + "\n")
    try:
        m2 = run_job(_job(tmp, uri, 2))
        m1 = run_job(_job(tmp, uri, 1))
        failed = run_job(load_config(REPO / "jobs/local_demo.yaml", [
            f"data.train={bad}/day_*", "data.eval=[]", "data.synth_if_missing=false", "train.max_steps=5",
            "train.batch_size=1", f"tracking.tracking_uri={uri}", "tracking.experiment=test-launcher-failed"]))
    finally:
        ray.shutdown()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return client, m2, m1, failed


def test_m2_job_lands_in_mlflow(two_runs):
    client, m2, _, _ = two_runs
    assert m2.status == "FINISHED", m2.error
    run = client.get_run(m2.run_id)
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["num_groups"] == "2" and p["world_size"] == "4" and p["group_size"] == "2"
    assert p["sync_every"] == "5" and p["moment_scale"] == "2.0" and p["layout"] == "host-local"
    assert p["versions.torch"].startswith("2.13") and "versions.ray" in p and "versions.torchrec" in p
    assert all(f"sharding.t_C{i}" in p for i in range(1, 27))
    for name in ("train/qps", "memory/peak_mb_max", "memory/peak_mb_mean", "imbalance/lookup_max_over_mean",
                 "eval/ne", "eval/auc", "train/loss", "train/ne", "time/lookup_s", "time/dense_s", "time/sync_s",
                 "time/data_wait_s", "sync/seconds_total"):
        history = client.get_metric_history(m2.run_id, name)
        assert history, f"no {name} series"
    assert len(client.get_metric_history(m2.run_id, "train/qps")) == 3  # steps 20, 40, 60
    assert [m.step for m in client.get_metric_history(m2.run_id, "eval/ne")] == [30, 60]
    final = run.data.metrics
    assert final["eval/ne"] < 1.0
    assert 0.5 < final["eval/auc"] <= 1.0
    assert final["sync/count"] == 12  # 60 steps / K=5
    assert final["eval/examples"] == 8000  # every eval row, once
    assert final["train/qps_median"] > 0


def test_m1_baseline_differs_only_where_it_should(two_runs):
    client, m2, m1, _ = two_runs
    assert m1.status == "FINISHED", m1.error
    p1, p2 = client.get_run(m1.run_id).data.params, client.get_run(m2.run_id).data.params
    assert p1["num_groups"] == "1" and p1["group_size"] == "4"
    differing = {k for k in set(p1) | set(p2) if p1.get(k) != p2.get(k)}
    expected = {"num_groups", "grid.num_groups", "group_size", "moment_scale", "optim.moment_scale",
                "tracking.run_name", "grid.workers_per_node"}
    # the plan is made for L workers, so where tables sit may differ too; nothing else may
    assert {k for k in differing if not k.startswith("sharding.")} <= expected
    assert {"num_groups", "group_size"} <= differing
    f1, f2 = client.get_run(m1.run_id).data.metrics, client.get_run(m2.run_id).data.metrics
    assert f1["sync/count"] == 0 and f1["sync/bytes_total"] == 0
    assert f2["sync/count"] > 0 and f2["sync/bytes_total"] > 0
    assert f1["eval/ne"] < 1.0
    assert set(f1) == set(f2)  # the same metric series exist for both


def _train_cli(*overrides, env=None):
    return subprocess.run([sys.executable, "-m", "recgrid.cli", "train", str(REPO / "jobs/local_demo.yaml"),
                           *sum((["--set", o] for o in overrides), [])],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("overrides,field", [
    (["grid.world_size=6", "grid.num_groups=4"], "grid.num_groups"),
    (["data.train=/nonexistent/recgrid/*.parquet", "data.synth_if_missing=false"], "data.train"),
    (["optim.lr=-0.1"], "optim.lr"),
])
def test_invalid_config_fails_before_workers_start(tmp_path, overrides, field):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    p = _train_cli(*overrides, f"tracking.tracking_uri={uri}")
    assert p.returncode == 2
    assert field in p.stderr, p.stderr
    assert "started a local Ray cluster" not in p.stdout  # nothing started
    assert not (tmp_path / "mlflow.db").exists()  # and no run was created


def test_failed_job_marks_its_run_failed(two_runs):
    """A data error found once the job runs: the run is FAILED and says where the bad row is."""
    client, _, _, failed = two_runs
    assert failed.status == "FAILED"
    run = client.get_run(failed.run_id)
    assert run.info.status == "FAILED"
    # file, line and field of the bad value, in the run and in what the driver printed
    assert "bad/day_0:2: field C1" in run.data.tags["error"], run.data.tags["error"]
    assert "bad/day_0:2: field C1" in failed.error
