"""Ray Data feeds training from the cluster's CPUs (issue 14, acceptance 1): T=4, M=2 trains from
raw gzip day files (no prepare step) on a two-node `ray.cluster_utils.Cluster` whose head holds
the training workers (a custom resource only it offers, asked for through
`train.resources_per_worker`, and all of its CPUs) while the other node offers only CPUs. Ray's
state API shows every Ray Data read task of the run ran on the CPU-only node; the run has Ray
Data's execution stats (`data/ray_data_stats.txt`) and the input wait (`data/wait_s`)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from faults import mlflow_client, ray_env
from recgrid.config import load_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    from recgrid.cluster import LOCAL_SYSTEM_CONFIG  # as `recgrid train`'s own local clusters

    # the head: 2 CPUs, all of them taken by the 4 training workers (0.5 each), and the only
    # "trainer" resource; the second node: 2 CPUs and nothing else
    # its own dashboard port: the state API is served by the dashboard, and another Ray instance on
    # the machine may hold the default one
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"trainer": 4},
                                                      "include_dashboard": True, "dashboard_port": port,
                                                      "_system_config": LOCAL_SYSTEM_CONFIG})
    cpu_node = c.add_node(num_cpus=2)
    ray.init(address=c.address, runtime_env={"env_vars": ray_env()}, logging_level="WARNING")
    c.wait_for_nodes()
    yield {"head": c.head_node.node_id, "cpu_node": cpu_node.node_id, "address": c.address}
    ray.shutdown()
    c.shutdown()


def test_read_tasks_run_on_the_cpu_only_node_from_raw_gzip_files(cluster, tmp_path):
    from ray.util.state import list_tasks

    from recgrid.data.synth import write_synth
    from recgrid.launch.ray import run_job

    write_synth(str(tmp_path / "train"), 6000, files=3, fmt="tsv.gz", spec="tiny", seed=0)
    write_synth(str(tmp_path / "eval"), 1000, files=1, fmt="tsv.gz", spec="tiny", seed=0, stream=1)
    cfg = load_config(REPO / "jobs/local_demo.yaml", [
        f"data.train={tmp_path}/train/*", f"data.eval={tmp_path}/eval/*", "data.synth_if_missing=false",
        "data.rows_per_unit=1000", "grid.world_size=4", "grid.num_groups=2",
        "train.max_steps=6", "train.batch_size=64", "train.log_every=3", "train.eval_every=0",
        "train.cpus_per_worker=0.5", "train.resources_per_worker={trainer: 1}", "train.snapshot_every_syncs=0",
        f"train.storage_path={tmp_path}/storage", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        "tracking.experiment=test-data-cluster",
    ])
    r = run_job(cfg)
    assert r.status == "FINISHED", r.error
    assert {w["node"] for w in r.attempts[0]["workers"].values()} == {cluster["head"]}  # confined

    reads = [t for t in list_tasks(cluster["address"], filters=[("type", "=", "NORMAL_TASK")], limit=10_000,
                                     detail=True, timeout=30)
             # a read task the stream submitted but cancelled when training ended was never placed (node None)
             if "ReadUnits" in t.name and t.node_id is not None]
    # 4 training streams and 4 evaluation streams, each at least one read task
    assert len(reads) >= 8, [t.name for t in reads]
    assert {t.node_id for t in reads} == {cluster["cpu_node"]}  # the head had no CPU left for them
    assert {t.required_resources.get("CPU") for t in reads} == {0.25}  # a fraction: they fit beside workers

    client = mlflow_client(cfg)
    stats = Path(client.download_artifacts(r.run_id, "data/ray_data_stats.txt", str(tmp_path))).read_text()
    assert "training stream 0" in stats and "evaluation stream 0" in stats and "ReadUnits" in stats
    waits = client.get_metric_history(r.run_id, "data/wait_s")
    assert sorted(m.step for m in waits) == [3, 6] and all(m.value >= 0 for m in waits)
