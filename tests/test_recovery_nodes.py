"""Host loss, placement and elastic group count on a real multi-node Ray cluster in one process
(`ray.cluster_utils.Cluster`: a head that holds no worker (it lacks the `worker_slot` resource
the workers ask for) and whose CPU runs Ray Data's read tasks, two worker nodes that hold two
workers each and are full with them).

A host loss under host-local (every worker node holds a shard position of every sharding group)
restores the hosts' in-memory snapshot, from the copy another host kept; losing every copy
restores the newest storage checkpoint, saying so. Inter-host groups get hosts of their own even
where one node has room for all, and a host loss leaves a group training. (The inter-host node
loss and the group's return: bench/node_loss.py.)

A job started with room for one sharding group trains at M=1 and grows to M=2 when a node is
added, the new group healed from the live one (bit for bit) while the first keeps its processes;
`ray drain-node` with a deadline on that node makes its group leave right after a replica sync,
the other trains on, and the job ends FINISHED.

A layout the cluster cannot give is refused before any worker starts (first: every node is still
there), and `grid/ranks.json` records every process of the job, rebuilt ones included.

Ray Data feeds training from the cluster's CPUs, on the same cluster before any node is lost:
T=4, M=2 trains from raw gzip day files (no prepare step) while the workers fill the worker
nodes' CPUs, so the head's CPU is the only one left; Ray's state API shows that every Ray Data
read task it lists from while they did ran there; the run has Ray Data's execution stats
(`data/ray_data_stats.txt`) and the input wait (`data/wait_s`)."""

import json
import re
import sys
import time
from pathlib import Path

import pytest

from faults import BackgroundJob, mlflow_client, part_positions, ray_env, small_job, workers_of

from recgrid.train.job import TABLE_DIGESTS_ENV

WORKER_SLOT = "train.resources_per_worker={worker_slot: 1}"  # workers on the worker nodes only


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    from recgrid.cluster import LOCAL_SYSTEM_CONFIG  # as `recgrid train`'s own local clusters

    if ray.is_initialized():  # the shared cluster (conftest.LATE_MODULES: this module runs after its modules)
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": LOCAL_SYSTEM_CONFIG})
    nodes = [_worker_node(c) for _ in range(2)]
    # Ray Train's preemption watcher on (the suite's other clusters turn it off), polling every second
    env = {**ray_env(), "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}
    ray.init(address=c.address, runtime_env={"env_vars": env}, logging_level="WARNING")
    c.wait_for_nodes()
    box = {"cluster": c, "nodes": nodes}
    yield box
    ray.shutdown()
    c.shutdown()


def _worker_node(c):
    return c.add_node(num_cpus=1, resources={"worker_slot": 2})


def _ranks(cfg, run_id: str) -> list[dict]:
    path = mlflow_client(cfg).download_artifacts(run_id, "grid/ranks.json")
    with open(path) as f:
        return json.load(f)


def test_a_layout_the_cluster_cannot_give_is_refused_before_any_worker_starts(cluster, tmp_path):
    import ray

    from recgrid.launch.ray import run_job

    started = []
    # four sharding groups that each need a node of their own, on two nodes that can hold workers
    cfg = small_job(tmp_path, "test-placement-refused", "grid.layout=inter-host", "grid.num_groups=4", WORKER_SLOT)
    r = run_job(cfg, on_start=started.append)
    assert r.status == "FAILED" and not started and not r.attempts  # no coordinator, no worker group
    assert r.error.startswith("GridError: inter-host layout: the M=4 sharding groups need nodes of their own, "
                              "but this cluster has 2 nodes that can hold workers"), r.error
    assert all(n.node_id[:12] in r.error for n in cluster["nodes"]) and "worker_slot 2): 2 worker(s)" in r.error
    assert "lower grid.num_groups to 2 or fewer" in r.error
    assert ray.available_resources().get("CPU") == 3  # nothing holds a CPU: no worker group was asked for
    run = mlflow_client(cfg).get_run(r.run_id)
    assert run.info.status == "FAILED" and "sharding groups need nodes of their own" in run.data.tags["error"]
    # host-local: a replica group of M=2 needs a node with room for two workers (one fits on each)
    r = run_job(small_job(tmp_path, "test-placement-refused", "train.resources_per_worker={worker_slot: 1.5}"))
    assert r.status == "FAILED" and r.error.startswith(
        "GridError: host-local layout: the cluster's nodes hold 2 of the 4 workers the job needs"), r.error
    # workers that would take every CPU leave none for Ray Data's read tasks: refused, not a hang
    # (three sharding groups of one worker, a whole CPU each, one on each of the three nodes)
    r = run_job(small_job(tmp_path, "test-placement-refused", "grid.world_size=3", "grid.num_groups=3",
                          "grid.layout=inter-host", "train.cpus_per_worker=1"))
    assert r.status == "FAILED" and r.error.startswith(
        "GridError: the T=3 workers would reserve 3 of the cluster's 3 CPUs (train.cpus_per_worker=1), leaving 0 "
        "CPU free, less than the 0.25 CPU a Ray Data read task reserves"), r.error
    assert ray.is_initialized()


def test_read_tasks_run_on_the_cpu_only_node_from_raw_gzip_files(cluster, tmp_path):
    from ray.util.state import list_tasks

    from recgrid.config import load_config
    from recgrid.data.synth import write_synth
    from recgrid.launch.ray import run_job

    write_synth(str(tmp_path / "train"), 6000, files=3, fmt="tsv.gz", spec="tiny", seed=0)
    write_synth(str(tmp_path / "eval"), 1000, files=1, fmt="tsv.gz", spec="tiny", seed=0, stream=1)
    cfg = load_config(Path(__file__).resolve().parents[1] / "jobs/local_demo.yaml", [
        f"data.train={tmp_path}/train/*", f"data.eval={tmp_path}/eval/*", "data.synth_if_missing=false",
        "data.rows_per_unit=1000", "grid.world_size=4", "grid.num_groups=2",
        "train.max_steps=6", "train.batch_size=64", "train.log_every=3", "train.eval_every=0",
        "train.cpus_per_worker=0.5", WORKER_SLOT, "train.snapshot_every_syncs=0", "train.checkpoint_every=0",
        f"train.storage_path={tmp_path}/storage", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        "tracking.experiment=test-data-cluster",
    ])
    r = run_job(cfg)
    assert r.status == "FINISHED", r.error
    head = cluster["cluster"].head_node.node_id
    workers = {n.node_id for n in cluster["nodes"]}
    # two on each worker node, none on the head (each sharding group's run records its own attempt)
    assert {w["node"] for a in r.attempts for w in a["workers"].values()} == workers

    def placed_reads() -> list:
        return [t for t in list_tasks(cluster["cluster"].address, filters=[("type", "=", "NORMAL_TASK")], limit=10_000,
                                      detail=True, timeout=30)
                # a read task the stream submitted but cancelled when training ended was never placed (node None)
                if "ReadUnits" in t.name and t.node_id is not None]

    # 4 training streams and 4 evaluation streams ran at least one read task each (Ray Data's own count,
    # the run's stats below); Ray's state API lists the tasks whose events have reached the GCS, which for
    # this job was anywhere from 4 to 10 of them. Those created while every worker held its CPU (before
    # the last training step was logged: the evaluation comes after it, and a group that does not
    # evaluate ends meanwhile, freeing its CPUs) must have run on the head
    client = mlflow_client(cfg)
    trained = max(m.timestamp for m in client.get_metric_history(r.run_id, "train/loss"))
    deadline = time.time() + 5
    while len(reads := placed_reads()) < 4 and time.time() < deadline:
        time.sleep(0.5)
    assert len(reads) >= 4, [t.name for t in reads]
    training = [t for t in reads if t.creation_time_ms is not None and t.creation_time_ms < trained]
    assert training and {t.node_id for t in training} == {head}  # the worker nodes had no CPU left for them
    assert {t.required_resources.get("CPU") for t in reads} == {0.25}  # a fraction: they fit beside workers

    stats = Path(client.download_artifacts(r.run_id, "data/ray_data_stats.txt", str(tmp_path))).read_text()
    assert "training stream 0" in stats and "evaluation stream 0" in stats and "ReadUnits" in stats
    executed = [int(n) for n in re.findall(r"ReadReadUnits\S*: (\d+) tasks executed", stats)]
    assert len(executed) >= 2 and min(executed) >= 1, stats  # the logging worker's training and evaluation streams
    waits = client.get_metric_history(r.run_id, "data/wait_s")
    assert sorted(m.step for m in waits) == [3, 6] and all(m.value >= 0 for m in waits)


def _runs_from(positions: list[int], restored: list[int], rank: int, sync_every: int = 5) -> None:
    """A rank's `part_positions` over restores that set its cursor back: its part in order from 0,
    and wherever it went back, back to the next of the steps restored (`restored`, in order), never
    past where it was (no row skipped; a restore of the very step a rank had reached reads nothing
    again, and shows no going back), or back to a sync step of its own where its group healed from a
    live peer after a restore (restores start the groups at different moments)."""
    assert positions[0] == 0, rank
    later = list(restored)
    for before, now in zip(positions, positions[1:]):
        if now == before + 1:
            continue
        assert now <= before, (rank, before, now, restored)  # none skipped
        if now in later:
            while later[0] != now:
                later.pop(0)  # a restore this rank read nothing again at
            later.pop(0)
        else:  # a group healed from a live peer reads on from its own newest sync step (its uncommitted rounds again)
            assert now % sync_every == 0, (rank, before, now, restored)


def test_a_host_loss_restores_the_holders_snapshot_and_losing_both_copies_restores_storage(cluster, tmp_path, capsys):
    """Issue 46, acceptance 1 and 3 (host-local, the default): the driver pins shard position s of
    every sharding group to one node, so each worker node holds one shard position of both groups,
    and its snapshot holder keeps its own position and a copy of the other node's. The node of
    position 1 goes: every group restarts and restores, bit for bit, the hosts' newest in-memory
    snapshot (position 1 from the copy the other host kept), no storage read, and says which host
    each position came from; at most a snapshot interval and a block are trained again. Then both
    worker nodes go at once (every copy of every position): the groups restore the newest storage
    checkpoint and say so. One FINISHED run; the row audit: every rank's part read in order, again
    from each restored step, nothing skipped."""
    from recgrid.train.checkpoint import checkpoint_step
    from recgrid.train.rows import read_row_logs

    K = 5
    # a snapshot at every sync (the derived cadence, measured, is the benchmark's: bench/node_loss.py), so the
    # newest restore point is always a snapshot while a host keeps its copy; a storage checkpoint every 10 steps
    cfg = small_job(tmp_path, "test-host-loss", "grid.layout=host-local", "train.max_steps=10000", WORKER_SLOT,
                    "train.max_failures=2", "train.snapshot_every_syncs=1", "train.checkpoint_every=10",
                    "data.eval=[]")
    job = BackgroundJob(cfg)
    try:
        st = job.wait_for(lambda s: len(workers_of(s)) == 4 and s["last_step"] > 30)
        first = workers_of(st)
        # host-local: sharding group g = ranks g and M+g, replica group s = ranks sM..sM+M-1 (engine/grid.py)
        assert first[0]["node"] == first[1]["node"] != first[2]["node"] == first[3]["node"], first
        victim = next(n for n in cluster["nodes"] if n.node_id == first[2]["node"])
        keeper = first[0]["node"]
        cluster["nodes"].remove(victim)
        cluster["cluster"].remove_node(victim)
        cluster["nodes"].append(_worker_node(cluster["cluster"]))
        st = job.wait_for(lambda s: len([e for e in s["events"] if "seconds" in e]) >= 1, timeout=240)
        e = [e for e in st["events"] if "seconds" in e][0]
        assert e["source"] == "holder" and e["bit_identical"], e
        assert e["snapshot_interval_steps"] == K and e["steps_lost"] <= K + K, e
        assert {x["shard"]: (x["from_node"], x["written_on"]) for x in e["shards"]} == \
            {0: (keeper, keeper), 1: (keeper, victim.node_id)}
        assert f"shard position 1 from host {keeper[:12]} (the copy it kept of host {victim.node_id[:12]})" \
            in e["detail"]
        # both worker nodes at once: every copy of every shard position is gone
        job.wait_for(lambda s: s["last_step"] >= e["step"] + 4 * K)
        for node in list(cluster["nodes"]):
            cluster["nodes"].remove(node)
            cluster["cluster"].remove_node(node)
        cluster["nodes"] += [_worker_node(cluster["cluster"]) for _ in range(2)]
        st = job.wait_for(lambda s: any(x.get("source") == "storage" for x in s["events"] if "seconds" in x),
                          timeout=300)
        job.wait_for(lambda s: s["last_step"] >= max(x["step"] for x in s["events"] if "seconds" in x) + 2 * K)
        job.request_stop()
        r = job.join()
    finally:
        if job.thread.is_alive() and job.actors is not None:
            job.request_stop()
            job.thread.join(180)
    assert r.status == "FINISHED", r.error
    events = [x for x in r.events if "seconds" in x]
    stored = next(x for x in events if x["source"] == "storage")
    assert checkpoint_step(stored["detail"]) == stored["step"] and stored["step"] % 10 == 0
    assert all(x["source"] in ("holder", "storage", "peer") for x in events)  # a later group may heal from a peer
    run = mlflow_client(cfg).get_run(r.run_id)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["recovery/source/1"] == "holder" and "hosts' holders" in tags["recovery/why/1"]
    assert "storage" in tags.values() and any("storage checkpoint of step" in v for v in tags.values())
    assert run.data.metrics["holders/bytes_max"] > 0
    out = capsys.readouterr().out
    assert "holding shard position(s) [1] of every sharding group are gone" in out, out[-3000:]
    assert "snapshot holders (most per host)" in out
    # grid/ranks.json records every process of the job, where it ran: the first four and the rebuilt ones
    recorded = {(x["rank"], x["node"], x["pid"]) for x in _ranks(cfg, r.run_id)}
    every = [(k, w) for a in r.attempts for k, w in a["workers"].items()]
    assert {(int(k), w["node"], w["pid"]) for k, w in every} <= recorded and len(every) >= 12
    # the row audit, per rank: in order, then again from each restored step on
    logs = read_row_logs(str(tmp_path / "rows"))
    restored = [next(x["step"] for x in events if x["source"] == source) for source in ("holder", "storage")]
    for rank in range(4):
        positions, _ = part_positions(cfg, 4, rank, logs)
        _runs_from(positions, restored, rank, K)


def test_inter_host_groups_get_hosts_of_their_own_and_a_host_loss_leaves_one_training(cluster, tmp_path):
    """Issue 46, acceptance 2: inter-host on two worker nodes that each have room for every worker
    of the job (four of a quarter CPU each): the driver pins each sharding group's run to a node no
    other group uses (Ray alone packed both onto one node, or not, by chance), `grid/ranks.json`
    and `derived.nodes` say so; the node of one group goes, and the other keeps its processes and
    keeps training (the lost group's run waits for a node of its own: the job ends at M = 1)."""
    K = 5
    cfg = small_job(tmp_path, "test-inter-host-room", "grid.layout=inter-host", "train.max_steps=100000",
                    "train.resources_per_worker={worker_slot: 0.5}", "train.cpus_per_worker=0.25",
                    "train.max_failures=2", "data.eval=[]")
    job = BackgroundJob(cfg)
    try:
        st = job.wait_for(lambda s: len(workers_of(s)) == 4 and s["last_step"] > 2 * K)
        first = workers_of(st)
        # inter-host: sharding group 0 = ranks 0, 1; group 1 = ranks 2, 3 (engine/grid.py)
        assert first[0]["node"] == first[1]["node"] != first[2]["node"] == first[3]["node"], first
        victim = next(n for n in cluster["nodes"] if n.node_id == first[2]["node"])
        cluster["nodes"].remove(victim)
        cluster["cluster"].remove_node(victim)
        at = st["last_step"]
        st = job.wait_for(lambda s: s["last_step"] > at + 6 * K, timeout=120)  # group 0 trains on alone
        assert {r: w["pid"] for r, w in workers_of(st).items() if r < 2} == {r: first[r]["pid"] for r in (0, 1)}
        job.request_stop()
        r = job.join()
    finally:
        if job.thread.is_alive() and job.actors is not None:
            job.request_stop()
            job.thread.join(180)
        # the lost group's run waited for a node of its own; once the job ended, its placement group may
        # still be pending a moment: a node added before it is gone would be taken by it
        _wait_no_pending_placement_groups(cluster["cluster"].address)
        cluster["nodes"].append(_worker_node(cluster["cluster"]))  # the module's shape back
    assert r.status == "FINISHED", r.error
    run = mlflow_client(cfg).get_run(r.run_id)
    assert run.data.params["derived.nodes"] == "2"
    first_node: dict[int, str] = {}
    for x in _ranks(cfg, r.run_id):  # each rank's first process: the job's first placement
        first_node.setdefault(x["rank"], x["node"])
    by_group = {g: {first_node[r] for r in (2 * g, 2 * g + 1)} for g in (0, 1)}
    assert len(by_group[0]) == len(by_group[1]) == 1 and not by_group[0] & by_group[1], by_group


def test_a_sharding_group_joins_when_room_comes_and_leaves_when_its_node_is_drained(cluster, tmp_path, monkeypatch):
    """An elastic job (every job runs under torchft): started with room for one sharding group,
    the job trains at M=1 and grows to M=2 when a node is added, the new group healed from the live
    one; then `ray drain-node` with a deadline on the new node: that group leaves right after a
    replica sync (what it trained is in the other group's tables; its data cursor is noted), the
    other group keeps its processes throughout, and the job ends FINISHED: the drained group's run,
    which Ray Train restarts and which waits for room, is ended by the driver."""
    K = 5
    monkeypatch.setenv(TABLE_DIGESTS_ENV, "1")  # the workers note their tables' checksums (read below)
    c = cluster["cluster"]
    gone = cluster["nodes"].pop(1)  # room for one sharding group of L=2 at the start
    c.remove_node(gone)
    cfg = small_job(tmp_path, "test-join-drain", "grid.layout=inter-host", "grid.min_world_size=2", WORKER_SLOT,
                    "train.max_steps=100000", "train.max_failures=2", f"grid.sync_every={K}", "data.eval=[]")
    assert cfg.min_groups == 1
    job = BackgroundJob(cfg)
    try:
        _join_then_drain(c, cluster, job, cfg, K)
    finally:  # a failed check leaves no job running into the next module's cluster
        if job.thread.is_alive() and job.actors is not None:
            job.request_stop()
            job.thread.join(180)


def _join_then_drain(c, cluster, job, cfg, K: int) -> None:
    import subprocess

    # inter-host: sharding group 0 = ranks 0, 1; group 1 = ranks 2, 3 (engine/grid.py); either may get the room
    st = job.wait_for(lambda s: s["last_step"] > 3 * K)
    first = workers_of(st)
    assert sorted(first) in ([0, 1], [2, 3])  # the group with no room has no process
    starter, joiner = ((0, 1), (2, 3)) if 0 in first else ((2, 3), (0, 1))
    joiner_group = joiner[0] // 2
    pids = {r: first[r]["pid"] for r in starter}
    room = _worker_node(c)
    cluster["nodes"].append(room)

    def synced_at_two(s: dict) -> int | None:  # a sync step every worker noted its tables at, with 2 groups live
        w = workers_of(s)
        if sorted(w) != [0, 1, 2, 3]:
            return None
        steps = set.intersection(*({int(k[7:]) for k in w[r] if k.startswith("digest@") and w[r].get(f"live@{k[7:]}") == 2}
                                   for r in range(4)))
        return min(steps) if steps else None

    # the joining group trains: its workers note their tables at its first syncs at M=2, equal to the other group's
    st = job.wait_for(lambda s: synced_at_two(s) is not None, timeout=240)
    joined, synced = workers_of(st), synced_at_two(st)
    assert {joined[r]["node"] for r in joiner} == {room.node_id}  # inter-host: a node per sharding group
    assert joined[starter[0]]["node"] == joined[starter[1]]["node"] != room.node_id
    assert joined[0]["digest@%d" % synced] == joined[2]["digest@%d" % synced]  # shard 0 of both groups: bit for bit
    assert joined[1]["digest@%d" % synced] == joined[3]["digest@%d" % synced]
    drained_at = time.time()
    subprocess.run([str(Path(sys.executable).with_name("ray")), "drain-node",
                    f"--address={c.address}", f"--node-id={room.node_id}", "--reason=DRAIN_NODE_REASON_PREEMPTION",
                    "--reason-message=test preemption", "--deadline-remaining-seconds=8"], check=True,
                   capture_output=True, timeout=60)
    st = job.wait_for(lambda s: s["leaves"], timeout=60)
    (leave,) = st["leaves"]
    assert leave["group"] == joiner_group and room.node_id in leave["nodes"] and leave["at"] - drained_at < 15
    assert leave["step"] % K == 0  # right after a replica sync: everything it trained is in the other group's tables
    st = job.wait_for(lambda s: s["last_step"] >= leave["step"] + 3 * K)  # the first group trains on alone
    time.sleep(max(0.0, drained_at + 10 - time.time()))  # past the deadline: Ray Train restarted the run, which waits
    job.request_stop()
    r = job.join()
    assert r.status == "FINISHED", r.error
    final = workers_of({"attempts": r.attempts})
    assert {k: final[k]["pid"] for k in starter} == pids  # the first group kept its processes throughout
    client = mlflow_client(cfg)
    groups = [m.value for m in sorted(client.get_metric_history(r.run_id, "grid/num_groups"), key=lambda m: m.step)]
    assert groups == [1, 2, 1]


def _wait_no_pending_placement_groups(address: str, timeout_s: float = 60.0) -> None:
    """Until no placement group of the cluster at `address` waits for resources (or `timeout_s`): a
    run that waited for a node when its job ended may leave one pending for a moment, and a node
    added then would go to it. Connects for the look if the job's end disconnected this process."""
    import ray

    joined = not ray.is_initialized()
    try:
        if joined:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if not any(pg.get("state") == "PENDING" for pg in ray.util.placement_group_table().values()):
                return
            time.sleep(0.5)
    except Exception:  # noqa: BLE001 - the look is a courtesy to the next test: wait a little instead
        time.sleep(10)
    finally:
        if joined and ray.is_initialized():
            ray.shutdown()
