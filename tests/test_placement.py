"""Placement follows the layout (issue 14, acceptance 4) on a real two-node Ray cluster in one
process (`ray.cluster_utils.Cluster`: a head and one node of 2 CPUs each), shared by the tests
below in file order (the last one removes the second node):

1. a layout the cluster cannot give is refused before any worker starts;
2. host-local on packed nodes (1 CPU per worker: each node full with one replica group);
3. the issue's inter-host scenario (0.5 CPU per worker, so one node could hold all four): each
   sharding group sits on a node of its own, the run records `derived.nodes=2` and
   `grid/ranks.json`, and the job survives losing the second node by restoring its shards from
   the copies of the other sharding group."""

import json

import pytest

from faults import BackgroundJob, mlflow_client, ray_env, small_job, training


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    node = c.add_node(num_cpus=2)
    ray.init(address=c.address, runtime_env={"env_vars": ray_env()}, logging_level="WARNING")
    c.wait_for_nodes()
    yield {"cluster": c, "node": node, "head_id": ray.get_runtime_context().get_node_id()}
    ray.shutdown()
    c.shutdown()


def test_node_slots_count_the_workers_each_alive_node_can_hold():
    from recgrid.train.placement import node_slots, rank_records

    nodes = [
        {"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.1",
         "Resources": {"CPU": 2.0, "memory": 1e9, "node:10.0.0.1": 1.0, "trainer_node": 1.0}},
        {"NodeID": "b" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0}},
        {"NodeID": "c" * 56, "Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 8.0}},
    ]
    assert node_slots(nodes, {"CPU": 0.5}) == {"aaaaaaaaaaaa at 10.0.0.1 (CPU 2, trainer_node 1)": 4,
                                               "bbbbbbbbbbbb at 10.0.0.2 (CPU 8)": 16}
    # a custom resource only one node offers confines the workers there
    assert list(node_slots(nodes, {"CPU": 0.5, "trainer_node": 0.25}).values()) == [4, 0]
    assert list(node_slots(nodes, {"CPU": 0.3}).values()) == [6, 26]
    attempts = [{"world_size": 2, "workers": {1: {"pid": 11, "node": "n1"}, 0: {"pid": 10, "node": "n0"}}},
                {"world_size": 2, "workers": {0: {"pid": 20, "node": "n0"}}}]
    assert rank_records(attempts) == [{"attempt": 0, "rank": 0, "node": "n0", "pid": 10},
                                      {"attempt": 0, "rank": 1, "node": "n1", "pid": 11},
                                      {"attempt": 1, "rank": 0, "node": "n0", "pid": 20}]


def _ranks(cfg, run_id: str) -> list[dict]:
    path = mlflow_client(cfg).download_artifacts(run_id, "grid/ranks.json")
    with open(path) as f:
        return json.load(f)


def test_a_layout_the_cluster_cannot_give_is_refused_before_any_worker_starts(cluster, tmp_path):
    import ray

    from recgrid.launch.ray import run_job

    started = []
    # four sharding groups that each need a node of their own, on two nodes
    cfg = small_job(tmp_path, "test-placement-refused", "grid.layout=inter-host", "grid.num_groups=4",
                    "train.cpus_per_worker=0.5")
    r = run_job(cfg, on_start=started.append)
    assert r.status == "FAILED" and not started and not r.attempts  # no coordinator, no worker group
    assert r.error.startswith("GridError: inter-host layout: the M=4 sharding groups need nodes of their own, "
                              "but this cluster has 2 nodes that can hold workers")
    assert cluster["head_id"][:12] in r.error and "(CPU 2): 4 worker(s)" in r.error
    assert "lower grid.num_groups to 2 or fewer" in r.error
    assert ray.available_resources().get("CPU") == 4  # nothing holds a CPU: no worker group was asked for
    run = mlflow_client(cfg).get_run(r.run_id)
    assert run.info.status == "FAILED" and "sharding groups need nodes of their own" in run.data.tags["error"]
    # host-local: a replica group of M=2 needs a node with room for two workers (1.5 CPUs each: one per node)
    r = run_job(small_job(tmp_path, "test-placement-refused", "train.cpus_per_worker=1.5"))
    assert r.status == "FAILED" and r.error.startswith(
        "GridError: host-local layout: the cluster's nodes hold 2 of the 4 workers the job needs")
    # workers that would take every CPU leave none for Ray Data's read tasks: refused, not a hang
    r = run_job(small_job(tmp_path, "test-placement-refused", "train.cpus_per_worker=1"))
    assert r.status == "FAILED" and r.error.startswith(
        "GridError: the T=4 workers would reserve 4 of the cluster's 4 CPUs (train.cpus_per_worker=1), leaving 0 "
        "CPU free, less than the 0.25 CPU a Ray Data read task reserves")
    assert ray.is_initialized()


def test_host_local_on_packed_nodes_puts_each_replica_group_on_one_node(cluster, tmp_path):
    # 0.875 CPU per worker: two workers fill a node (a third does not fit), leaving each node only the
    # quarter CPU of a Ray Data read task; PACK has no room for a worker to spare anywhere
    cfg = small_job(tmp_path, "test-placement-host-local", "grid.layout=host-local", "train.cpus_per_worker=0.875",
                    "train.max_steps=5", "train.log_every=5")
    job = BackgroundJob(cfg)
    r = job.join()
    assert r.status == "FINISHED", r.error
    (attempt,) = r.attempts
    node = {int(rank): w["node"] for rank, w in attempt["workers"].items()}
    # host-local replica groups are [0, 1] and [2, 3]: one node each, the two nodes distinct
    assert node[0] == node[1] and node[2] == node[3] and node[0] != node[2]
    assert mlflow_client(cfg).get_run(r.run_id).data.params["derived.nodes"] == "2"
    assert sorted((e["rank"], e["node"]) for e in _ranks(cfg, r.run_id)) == sorted(node.items())


def test_inter_host_places_sharding_groups_apart_and_survives_losing_a_node(cluster, tmp_path):
    # the scenario, with workers small enough that one node could hold all four: at 0.4375 CPU
    # (the 0.5 less the quarter CPU of a Ray Data read task) the node left after the loss
    # still has a read task's CPU free; at 0.5 its workers would hold every CPU and the restart is
    # refused as it starts (the inter-host restart after a node loss is a 2-node cluster's worst case)
    cfg = small_job(tmp_path, "test-placement-inter-host", "grid.layout=inter-host", "train.cpus_per_worker=0.4375",
                    "train.max_steps=40", "train.max_failures=3")
    job = BackgroundJob(cfg)
    st = job.wait_for(lambda s: training(s, 0, 7), timeout=600)
    first = {int(rank): w for rank, w in st["attempts"][0]["workers"].items()}
    # sharding groups [0, 1] and [2, 3], each on a node of its own
    assert first[0]["node"] == first[1]["node"] != first[2]["node"] == first[3]["node"]
    client = mlflow_client(cfg)
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    # recorded as the attempt started, while it trains
    assert run.data.params["derived.nodes"] == "2"
    assert {(x["rank"], x["node"], x["pid"]) for x in _ranks(cfg, run.info.run_id)} == \
        {(k, w["node"], w["pid"]) for k, w in first.items()}
    lost = cluster["node"].node_id
    assert lost in {w["node"] for w in first.values()}
    cluster["cluster"].remove_node(cluster["node"])
    r = job.join()
    assert r.status == "FINISHED", r.error
    # (a loaded machine may fail a later attempt's worker health check too: each such restart
    # restores from memory as well, so only the node loss's restore is asserted)
    assert len(r.attempts) >= 2 and all(a["world_size"] == 4 for a in r.attempts)
    for a in r.attempts[1:]:  # one node left: nothing to spread
        assert {w["node"] for w in a["workers"].values()} == {cluster["head_id"]}
    e = r.events[0]
    assert e["source"] == "peer" and lost in e["lost_nodes"]  # the other sharding group's copies
    assert all(s["digest"] == s["source_digest"] for s in e["shards"])
    ranks = _ranks(cfg, r.run_id)  # every attempt so far, rewritten as each started
    assert sorted((x["attempt"], x["rank"]) for x in ranks) == [(a, k) for a in range(len(r.attempts)) for k in range(4)]
    assert {x["pid"] for x in ranks if x["attempt"] == 0} == {w["pid"] for w in first.values()}
    assert {(x["rank"], x["node"]) for x in ranks if x["attempt"] == 0} == {(k, w["node"]) for k, w in first.items()}
    assert client.get_run(r.run_id).data.params["derived.nodes"] == "2"  # the first attempt's

