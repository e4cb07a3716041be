"""The sharding group as the unit of failure, on a real local Ray cluster (survivors keep training).

T=4, M=2 (L=2), K=5, failures allowed: every sharding group one Ray Train run and one torchft
replica group. One worker is SIGKILLed
after the first sync, then, once the job has healed and synced twice, the worker that logs to
MLflow. Each time the other sharding group keeps its processes and keeps taking steps; Ray
Train restarts the dead worker's group alone (its run's L workers), and the group heals from the
live peer group (bit for bit what the peer sent) and rejoins at the current step. The job ends FINISHED in its one MLflow run with both recoveries recorded, every
metric once per step. The row audit: each global rank's part of the epoch plan is trained as a
prefix with no row skipped (a rebuilt group reads on from its own cursor), and only the batches
a group had consumed but not committed when it broke are read again.
When no live group is left (T=4, M=1: one sharding group of four), the rebuilt group restores the
hosts' in-memory snapshot bit for bit, and every row after it is read again, none skipped.
"""

import os
import random
import signal
import socket
import time
from pathlib import Path

import pytest

from faults import BackgroundJob, mlflow_client, part_positions, read_again_from, workers_of
from recgrid.config import load_config
from recgrid.train.job import TABLE_DIGESTS_ENV

REPO = Path(__file__).resolve().parents[1]
T, M, K, B = 4, 2, 5, 64
L = T // M


def _config(tmp: Path, *extra: str):
    return load_config(REPO / "jobs/local_demo.yaml", [
        f"data.train={tmp}/data/train/*.parquet", f"data.eval={tmp}/data/eval/*.parquet",
        "data.synth_rows=40000", "data.synth_eval_rows=8000", f"data.row_log={tmp}/rows",
        f"grid.world_size={T}", f"grid.num_groups={M}", f"grid.sync_every={K}",
        # ended by a graceful stop once the second rebuilt group has healed and synced twice
        "train.max_steps=100000", f"train.batch_size={B}", "train.log_every=10", "train.eval_every=0",
        "train.max_failures=2",
        f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db", "tracking.experiment=test-torchft",
        "tracking.log_model=false", *extra,  # the model's end: test_launcher's M=2 job
    ])


def _group(rank: int) -> int:
    return rank % M  # host-local layout: sharding group i = [i, M+i, ...] (engine/grid.py)


def _events(st: dict) -> list[dict]:
    return [e for e in st["events"] if "seconds" in e]


def _tcp_sockets() -> dict[str, tuple[str, int, int, str]]:
    """(local address, local port, remote port, state) by socket inode, from /proc/net/tcp and tcp6."""
    out = {}
    for family, table in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            (addr, port), (_, rport) = (c.split(":") for c in cols[1:3])
            raw = bytes.fromhex(addr)  # the kernel's 32-bit words, each in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out[cols[9]] = (socket.inet_ntop(family, raw), int(port, 16), int(rport, 16), cols[3])
    return out


def _inodes(pid: int) -> set[str]:
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            pass
    return {link[8:-1] for link in links if link.startswith("socket:[")}


def listening() -> set[str]:
    """This process's listening sockets' inodes."""
    sockets = _tcp_sockets()
    return {i for i in _inodes(os.getpid()) if i in sockets and sockets[i][3] == "0A"}


def lighthouse_listens(worker_pids, before: set[str]) -> list[str]:
    """Where torchft's lighthouse listens (address:port, from the kernel's socket tables): the
    listening sockets the job's driver (this process: it owns the lighthouse) opened since
    `before` (`listening()`) that the job's workers are connected to."""
    sockets = _tcp_sockets()
    dialled = {sockets[i][2] for pid in worker_pids for i in _inodes(pid) if i in sockets and sockets[i][3] == "01"}
    return sorted(f"{sockets[i][0]}:{sockets[i][1]}" for i in listening() - before if sockets[i][1] in dialled)


@pytest.fixture(scope="module")
def job(tmp_path_factory, shared_ray):
    tmp = tmp_path_factory.mktemp("torchft")
    os.environ["RECGRID_RUNS_DIR"] = str(tmp / "runs")
    # a DMT tower model (two towers of one worker per sharding group, DLRM tower modules): the
    # heal carries the tower modules with the dense part, and the live groups average them; with
    # delayed moment sync (each group's moments its own between averages: the heal carries the peer's)
    config = _config(tmp, "model.towers=2", "model.tower_module=dlrm", "grid.delayed_moment_sync=true")
    seed = int(os.environ.get("RECGRID_CHAOS_SEED", random.randrange(1 << 30)))
    print(f"\nchaos seed {seed} (replay: RECGRID_CHAOS_SEED={seed})")
    rng = random.Random(seed)
    t0 = time.time()
    before = listening()
    os.environ[TABLE_DIGESTS_ENV] = "1"  # the workers note their tables' checksums (read below)
    bg = BackgroundJob(config)
    kills = []
    for n in range(2):
        st = bg.wait_for(lambda s: len({r for r, w in workers_of(s).items() if w.get("ready")}) == T and (
            s["last_step"] > K if n == 0 else s["last_step"] >= _events(s)[-1]["step"] + 2 * K))
        workers = workers_of(st)
        if n == 0:  # any worker, after the first sync
            victim = rng.randrange(T)
            lighthouse = lighthouse_listens([w["pid"] for w in workers.values()], before)
        else:  # the worker that logs to MLflow now
            victim = max((w.get("logging_since", 0), r) for r, w in workers.items())[1]
        pids = {r: w["pid"] for r, w in workers.items()}
        kill = {"victim": victim, "pids": pids, "step": st["last_step"], "at": time.time()}
        os.kill(pids[victim], signal.SIGKILL)
        st = bg.wait_for(lambda s: len(_events(s)) > n, timeout=240)
        kill["event"] = _events(st)[n]
        kill["first_step_s"] = kill["event"]["t_first_step"] - kill["at"]
        kills.append(kill)
    bg.wait_for(lambda s: s["last_step"] >= kills[-1]["event"]["step"] + 2 * K)
    bg.request_stop()
    result = bg.join()
    os.environ.pop(TABLE_DIGESTS_ENV)
    assert result.status == "FINISHED", result.error
    out = {"config": config, "result": result, "kills": kills, "tmp": tmp, "seconds": time.time() - t0,
           "lighthouse": lighthouse,
           "final": {r: w for r, w in workers_of({"attempts": result.attempts}).items()},
           "all": [(r, w) for a in result.attempts for r, w in a["workers"].items()]}
    for k in kills:
        e = k["event"]
        print({x: round(e[x] - k["at"], 2) for x in ("t_failure_detected", "t_attempt_start", "t_heal", "t_first_step")
               if e.get(x)})
        print(f"kill of rank {k['victim']} (group {_group(k['victim'])}) at step {k['step']}: group rebuilt and "
              f"healed from group {e.get('from_replica')} at step {e['step']}, first committed step "
              f"{k['first_step_s']:.1f} s after the kill ({e['seconds']:.1f} s after the failure was seen); the "
              f"groups {e['kept_training']} kept training: {e['survivors_steps']} steps, "
              f"{e['survivors_qps']:,.0f} QPS (before: {e['survivors_qps_before']:,.0f})")
    print(f"torchft job: {out['seconds']:.0f} s, eval NE {result.metrics.get('eval/ne')}")
    return out


def test_job_finishes_in_one_mlflow_run_with_both_recoveries(job):
    client = mlflow_client(job["config"])
    exp = client.get_experiment_by_name("test-torchft")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_id == job["result"].run_id and run.info.status == "FINISHED"
    m, tags, rid = run.data.metrics, run.data.tags, run.info.run_id
    assert "train.fault_tolerance" not in run.data.params  # one design: no switch
    # a local job's lighthouse (quorums, a kill route) listens on loopback only, as the kernel says
    assert job["lighthouse"] and all(a.startswith(("127.", "::1:")) for a in job["lighthouse"]), job["lighthouse"]
    assert m["recovery/count"] == 2 and m["recovery/steps_lost"] == 0
    for n, kill in enumerate(job["kills"], 1):
        assert tags[f"recovery/source/{n}"] == "peer"
        assert tags[f"recovery/kept_training/{n}"] == str(1 - _group(kill["victim"]))
    for key in ("recovery/seconds", "recovery/survivors_qps", "recovery/survivors_qps_before"):
        values = [x.value for x in client.get_metric_history(rid, key)]
        assert len(values) == 2 and all(v > 0 for v in values), (key, values)
    groups = [x.value for x in client.get_metric_history(rid, "grid/num_groups")]
    assert groups[0] == M and 1.0 in groups and groups[-1] == M  # one group trained alone meanwhile
    assert 0 < m["eval/ne"] < 1.0 and m["eval/examples"] == 8000 and m["sync/count"] > 0
    # no metric, the evaluation included, reached the run twice for one step, whoever logged it
    for key in m:
        steps = [x.step for x in client.get_metric_history(rid, key)]
        assert len(steps) == len(set(steps)), (key, steps)


def test_the_other_group_kept_its_processes(job):
    """Per kill: the other sharding group's workers are the same processes at the end; the other
    group's step count advanced while the broken group was restarted; only the victim's group
    (its run's L workers) was replaced."""
    final = job["final"]
    end = {w["final_step"] for w in final.values()}
    assert len(end) == 1  # every worker ended at the same step
    kills = job["kills"]
    for kill, after in zip(kills, [k["pids"] for k in kills[1:]] + [{r: w["pid"] for r, w in final.items()}]):
        victim, pids = kill["victim"], kill["pids"]
        for r in range(T):
            if _group(r) != _group(victim):  # the other group (survivors) kept its processes
                assert after[r] == pids[r], (kill, r)
            else:  # the victim's group was restarted, every worker of it
                assert after[r] != pids[r], (kill, r)
        e = kill["event"]
        assert e["kept_training"] == [1 - _group(victim)] and e["survivors_steps"] > 0
        assert e["step"] > kill["step"] and e["steps_lost"] == 0
    # Ray started T workers and one group of L per kill: nobody else was restarted
    assert len(job["all"]) == T + L * len(job["kills"])


def test_the_rebuilt_group_healed_from_the_live_peer_group_bit_for_bit(job):
    final = job["final"]
    for kill in job["kills"]:
        e = kill["event"]
        g = _group(kill["victim"])
        assert e["source"] == "peer" and e["sharding_group"] == g and e["from_replica"] == 1 - g
        assert e["digest"] == e["source_digest"] and e["bit_identical"]
    # at the end (a sync step) the groups hold the same tables, moments, dense part and its optimizer
    # (the dense part per shard rank: it holds its tower's module, the same in every group)
    for r in range(L):  # each replica group: shard rank r of every sharding group (global ranks rM .. rM+M-1)
        assert len({final[r * M + g]["final_digest"] for g in range(M)}) == 1, r
        assert len({final[r * M + g]["final_dense_digest"] for g in range(M)}) == 1, r
    assert next(iter(final.values()))["final_step"] % K == 0


def test_no_row_is_skipped_and_only_a_broken_groups_last_batches_are_read_again(job):
    """Each global rank's logged batches, in the order trained, are batches of its part of the
    epoch plan: together a prefix of it (no row skipped), and every batch read twice belongs to
    a failure of its group (consumed after the group's last noted sync step when it broke)."""
    from recgrid.data.stream import scan_inputs
    from recgrid.train.rows import rank_positions, read_row_logs
    from recgrid.train.schedule import Schedule

    config = job["config"]
    inputs = scan_inputs(config.data.train, config.dataset_spec())
    logs = read_row_logs(str(job["tmp"] / "rows"))
    failures = {r: sum(_group(k["victim"]) == _group(r) for k in job["kills"]) for r in range(T)}
    for rank in range(T):
        # matched in order: a batch may recur in a later epoch at another position
        positions = rank_positions(inputs, config.train.seed, B, config.data.rows_per_unit, T, rank, logs,
                                   Schedule(K).reread_window)
        assert sorted(set(positions)) == list(range(max(positions) + 1)), rank  # a prefix: nothing skipped
        again = len(positions) - len(set(positions))
        assert again <= (Schedule(K).reread_window - 1) * failures[rank], (rank, again, failures[rank])
        if not failures[rank]:
            assert positions == list(range(len(positions)))  # in order, once each


@pytest.fixture(scope="module")
def lone_group_job(tmp_path_factory, shared_ray):
    """T=4, M=1 (one sharding group of L=4), a QR-compressed model with a head cache, in-memory snapshots every K steps
    and storage checkpoints every 10: a worker is killed past the first, so no live group is left
    to heal from (issue 28, acceptance 7)."""
    tmp = tmp_path_factory.mktemp("torchft_storage")
    os.environ["RECGRID_RUNS_DIR"] = str(tmp / "runs")
    config = load_config(REPO / "jobs/local_demo.yaml", [
        f"data.train={tmp}/data/train/*.parquet", "data.eval=[]", "data.synth_rows=40000",
        f"data.row_log={tmp}/rows", "grid.world_size=4", "grid.num_groups=1", f"grid.sync_every={K}",
        "train.max_steps=100000", f"train.batch_size={B}", "train.log_every=5", "train.eval_every=0",
        "train.checkpoint_every=10", "train.max_failures=1", "train.snapshot_every_syncs=1",
        # QR-compressed with a head cache: its q, r and h shards are snapshotted and restored as any
        "model.compression=qr", "model.qr_threshold_rows=2000", "model.qr_operation=mult", "model.head_rows=64",
        f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db", "tracking.experiment=test-torchft-storage",
        "tracking.log_model=false"])  # no final checkpoint beside the cadence's (the retention below counts them)
    seed = int(os.environ.get("RECGRID_CHAOS_SEED", random.randrange(1 << 30)))
    print(f"\nchaos seed {seed} (replay: RECGRID_CHAOS_SEED={seed})")
    bg = BackgroundJob(config)
    # killed just past a snapshot-only sync (35, 45, ...): a kill at a checkpoint step can land
    # between that step's storage checkpoint and its in-memory snapshot, and then storage is newer
    st = bg.wait_for(lambda s: len({r for r, w in workers_of(s).items() if w.get("ready")}) == 4
                     and s["last_step"] >= 33 and s["last_step"] % 10 in (5, 6, 7))
    victim = random.Random(seed).randrange(4)
    pids = {r: w["pid"] for r, w in workers_of(st).items()}
    os.kill(pids[victim], signal.SIGKILL)
    before = list(st["checkpoints"])  # the storage checkpoints written before the kill (at least)
    st = bg.wait_for(lambda s: len(_events(s)) == 1, timeout=240)
    event = _events(st)[0]
    bg.wait_for(lambda s: s["last_step"] >= event["failure_step"] + 10)
    written = bg.status()["checkpoints"]
    bg.request_stop()
    result = bg.join()
    assert result.status == "FINISHED", result.error
    print(f"M = 1: {event.get('why')}; first step {event['seconds']:.1f} s after the failure was seen")
    return {"config": config, "result": result, "event": event, "pids": pids, "victim": victim, "tmp": tmp,
            "written": written, "before": before, "final": workers_of({"attempts": result.attempts})}


def test_m1_group_restores_its_node_holders_snapshot_bit_for_bit(lone_group_job):
    """After the kill the rebuilt group (its run restarted whole) restored the newest complete
    in-memory snapshot from the node holders, every shard position bit for bit, no older than the
    storage checkpoints; logged as the run's one recovery (source holder, the steps trained again),
    and trained on to a FINISHED run. The group's checkpoints (every 10 steps, two kept) were
    written by it alone, without Ray Train's report."""
    from recgrid.train.checkpoint import checkpoint_step, is_complete

    job = lone_group_job
    e = job["event"]
    assert e["source"] == "holder" and e["step"] % K == 0 and e["step"] > 0 and e["bit_identical"]
    assert sorted(x["shard"] for x in e["shards"]) == [0, 1, 2, 3]
    assert all(x["digest"] == x["source_digest"] for x in e["shards"])
    assert e["steps_lost"] == e["failure_step"] - e["step"] and 0 <= e["steps_lost"] <= 2 * K
    assert e["failure_step"] >= 30 and e["step"] >= max(checkpoint_step(p) for p in job["before"])
    assert all(job["final"][r]["pid"] != job["pids"][r] for r in range(4))  # the group's run restarted whole
    left = sorted(Path(job["tmp"], "runs").rglob("checkpoint_step_*"))
    assert len(left) == 2 and all(is_complete(str(p)) for p in left), left  # the two newest kept
    steps = [checkpoint_step(str(p)) for p in left]
    assert steps[1] == steps[0] + 10 and steps[1] > e["step"] and len(job["written"]) > 2
    client = mlflow_client(job["config"])
    (run,) = client.search_runs([client.get_experiment_by_name("test-torchft-storage").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["recovery/count"] == 1 and run.data.tags["recovery/source/1"] == "holder"
    assert run.data.metrics["recovery/steps_lost"] == e["steps_lost"]
    for key in run.data.metrics:  # steps trained again are not logged again
        steps_logged = [x.step for x in client.get_metric_history(run.info.run_id, key)]
        assert len(steps_logged) == len(set(steps_logged)), key


def test_a_restore_reads_the_rows_after_the_restored_step_again_and_skips_none(lone_group_job):
    """Each rank's batches, in the order trained: its part of the epoch plan up to the kill, then
    again from where its cursor stood at the restored snapshot's step."""
    from recgrid.train.rows import read_row_logs

    job, n = lone_group_job, 4
    config, e = job["config"], job["event"]
    logs = read_row_logs(str(job["tmp"] / "rows"))
    for rank in range(n):
        positions, steps = part_positions(config, n, rank, logs)
        again = read_again_from(positions, e["step"], rank)
        if again is None:  # killed right after committing the checkpoint's step: nothing to read again
            assert e["steps_lost"] == 0, rank
            continue
        assert positions[again] == e["step"] and steps[again] == e["step"] + 1, rank  # read on from step 10k


# ---- the replica average itself: three real torchft managers (gloo) in threads, no Ray ---------------
def _managers(n: int, body, min_replicas: int | None = None, heartbeat_timeout_ms: int = 5000,
              job_lighthouse: bool = False) -> list:
    """`n` torchft managers joined in one quorum by a real lighthouse (each replica a thread with its
    own TCPStore and gloo process group); each runs `body(i, component)` with the component over
    its manager. Later quorums need `min_replicas` (default: all `n`); `job_lighthouse`: recgrid's
    own (`train.recovery.peers.Lighthouse`, as a job's driver starts it). Returns each replica's result."""
    import threading
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    from recgrid.engine.sync import SyncState
    from recgrid.train.recovery.peers import Lighthouse, TorchftReplicas
    from recgrid.train.schedule import Schedule

    least = n if min_replicas is None else min_replicas
    if job_lighthouse:
        job = Lighthouse("127.0.0.1", min_groups=least)
        lighthouse, address = job.server, job.address
    else:
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=least, join_timeout_ms=10_000,
                                      heartbeat_timeout_ms=heartbeat_timeout_ms)
        address = lighthouse.address()
    beating = threading.Barrier(n)  # every manager beats before the first quorum is asked for
    out: list = [None] * n
    errors: list = []

    def replica(i: int) -> None:
        manager = None
        try:
            store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
            manager = Manager(pg=pg, load_state_dict=lambda sd: None,
                              state_dict=lambda: {}, min_replica_size=least, use_async_quorum=False, init_sync=False,
                              timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=30), rank=0,
                              world_size=1, replica_id=f"avg_{i}", store_addr="localhost", store_port=store.port,
                              lighthouse_addr=address)
            beating.wait(timeout=60)
            manager.start_quorum()
            # the component needs only the trainer's device, a model (no DDP in it), its schedule (K),
            # moment rule, its replica sync's tensors (none here: a body hands its own) and its state
            trainer = SimpleNamespace(device=torch.device("cpu"), model=torch.nn.Module(),
                                      schedule=Schedule(1),
                                      config=SimpleNamespace(delayed_moment_sync=True),
                                      replica_sync=SimpleNamespace(weights=[], states=[]),
                                      state=SimpleNamespace(sync=SyncState()))
            reps = TorchftReplicas(trainer, manager, heal=None, listener=None, replica_pg=pg)
            reps.live = manager.num_participants()
            out[i] = body(i, reps)
        except BaseException as e:  # noqa: BLE001 - raised below, with the replica named
            errors.append((i, e))
        finally:
            if manager is not None:
                manager.shutdown(wait=False)

    threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    lighthouse.shutdown()
    assert not errors, errors
    return out


def test_replica_average_keeps_identical_fp16_rows_bit_identical():
    """fp16 tables averaged over 3 live replicas come back bit for bit when every replica holds the
    same rows (averaged in fp16, sum and division round: 1/3 is not exact), and fp32 tensors beside
    them get their true mean."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows = (torch.rand(4096, generator=g) * 2 - 1).to(torch.float16)

    def make(i):
        return [rows.clone(), torch.full((8,), float(i), dtype=torch.float32), rows[:100].to(torch.bfloat16)]

    from recgrid.engine.sync import average_

    def average(i, reps):
        tensors = make(i)
        average_(tensors, reps.trainer.replica_sync.transport)  # the one replica sync's, over the manager
        return tensors

    got = _managers(3, average)
    for fp16, fp32, bf16 in got:
        changed = int((fp16 != rows).sum())
        assert changed == 0, f"{changed} of {rows.numel()} identical fp16 rows changed by the average"
        assert torch.equal(bf16, rows[:100].to(torch.bfloat16))
        assert torch.allclose(fp32, torch.full((8,), 1.0))  # (0 + 1 + 2) / 3


def test_a_round_one_live_group_gave_up_frees_the_others_collective_at_once():
    """Three groups. Group 1 stops beating to the lighthouse but its process keeps its sockets (a
    killed worker's group-mate before Ray Train ends it). Group 0's round failed (its collective
    with group 1 did) and torchft skips the round's other collectives; group 2 is still to enter
    one of them. Group 0 abandons the round (`TorchftReplicas._abandon_round`): group 2's
    collective fails on group 0's closed connections, not at the collective timeout, and the two
    meet in a new quorum and average again. (Without the abort group 2 waited for group 0, and
    group 0 at the quorum for group 2, which it needs: more than half of the beating groups.)"""
    import threading
    import time

    import torch

    done = threading.Event()
    started, finished = threading.Barrier(3), threading.Barrier(2, action=done.set)

    def body(i, reps):
        m = reps.manager
        started.wait()
        if i == 1:
            m.shutdown(wait=False)  # no beats; the process group stays open until the others are through
            done.wait(60)
            return None
        if i == 0:
            m.report_error(RuntimeError("a collective with group 1 failed"))
        else:
            time.sleep(0.5)  # group 0 gave the round up first
            m.allreduce(torch.ones(4)).wait()
        failed = m.errored()
        reps._abandon_round()
        m.start_quorum()
        live = m.num_participants()
        t = torch.full((4,), float(i))
        m.allreduce(t).wait()
        finished.wait(timeout=60)
        return str(getattr(failed, "original_exception", failed)), live, t.tolist(), m.errored()

    try:
        got = _managers(3, body, min_replicas=1, heartbeat_timeout_ms=1000)
    finally:
        done.set()
    (_, live0, avg0, err0), (failed2, live2, avg2, err2) = got[0], got[2]
    assert "timed out" not in failed2.lower() and "timeout" not in failed2.lower(), failed2
    assert "closed" in failed2.lower() or "reset" in failed2.lower(), failed2
    assert (live0, live2) == (2, 2)
    assert err0 is None and err2 is None
    assert avg0 == avg2 == [1.0] * 4  # (0 + 2) / 2


def test_the_job_lighthouse_waits_for_a_live_group_that_comes_late_to_a_quorum():
    """Three live groups agreed to meet (a group waits to join, a drain); one reaches the quorum half a
    second after the others (its steps were slower). The job's lighthouse waits for it: all three
    are in the new quorum. (torchft's default join timeout, 100 ms, left it out, and it then waited
    alone for a quorum of its own until its quorum timeout: more than half of the beating groups.)"""
    import time

    def body(i, reps):
        if i == 2:
            time.sleep(0.5)
        reps.manager.start_quorum()
        return reps.manager.num_participants()

    assert _managers(3, body, min_replicas=1, job_lighthouse=True) == [3, 3, 3]


def test_an_abandoned_round_with_every_group_alive_meets_in_a_new_process_group():
    """A round that failed everywhere with nobody gone (a collective timed out): the groups abandon it
    (`TorchftReplicas._abandon_round`: their process groups aborted, the round voted down), and the
    next quorum, of the same groups, builds them new process groups to average over."""
    import torch

    def body(i, reps):
        reps.manager.report_error(RuntimeError("a collective timed out"))
        reps._abandon_round()
        reps.manager.start_quorum()
        t = torch.full((4,), float(i))
        reps.manager.allreduce(t).wait()
        return t.tolist(), reps.manager.errored(), reps.manager.num_participants()

    for avg, err, live in _managers(2, body):
        assert err is None and live == 2 and avg == [0.5] * 4


def test_delayed_moment_sync_lands_each_average_one_sync_late():
    """Delayed moment sync over 2 live replicas (the one replica sync, `ReplicaSync`, over torchft's
    manager): the moments at a sync are averaged while the next block trains, and land at the next
    sync as a correction, v += avg(v_then) - v_then (each replica keeps what it added since); a
    round that does not commit drops the average in flight."""
    import torch

    from recgrid.engine.sync import ReplicaSync, SyncState

    def body(i, reps):
        v = [torch.full((4,), float(i)), torch.full((2,), 10.0 * i)]
        rs = ReplicaSync([], v, reps.trainer.replica_sync.transport, 1, delayed_moment_sync=True, state=SyncState())
        rs.land(rs.launch(1, copy=True))  # sync 1: launched, nothing lands yet
        first = [x.clone() for x in v]
        for x in v:
            x.add_(1.0 + i)  # this replica's steps in the block
        rs.land(rs.launch(2, copy=True))  # sync 2: sync 1's average lands
        second = [x.clone() for x in v]
        rs.drop_pending()  # what a round that does not commit does
        rs.land(rs.launch(3, copy=True))  # sync 3: nothing lands
        rs.close()  # the average launched at sync 3 lands before the manager goes
        return first, second, [x.clone() for x in v]

    (first0, second0, third0), (first1, second1, third1) = _managers(2, body)
    assert torch.equal(first0[0], torch.zeros(4)) and torch.equal(first1[0], torch.ones(4))  # no correction at sync 1
    assert torch.equal(second0[0], torch.full((4,), 0.5 + 1.0)) and torch.equal(second1[0], torch.full((4,), 0.5 + 2.0))
    assert torch.equal(second0[1], torch.full((2,), 5.0 + 1.0)) and torch.equal(second1[1], torch.full((2,), 5.0 + 2.0))
    assert torch.equal(third0[0], second0[0]) and torch.equal(third1[0], second1[0])


def test_job_control_pins_each_groups_cursor_at_restore_points_and_rewinds_to_them():
    """The cursors a restore sets the groups back to (a storage checkpoint's or an in-memory
    snapshot's step, named a restore point by its writer, `pin`, before or after the groups noted
    it): a group's own at that step, where its last commit left it for one it was away for, the
    start for one before its first; every group restoring it gets the same ones."""
    from recgrid.train.control import JobControlImpl

    c = JobControlImpl()

    def note(g: int, step: int) -> None:
        c.group_progress(g, step, {"steps": step * 100 + g}, float(step))

    c.pin(5, "snapshot")  # named before any group got there
    for step in range(1, 13):
        note(0, step)
        if step <= 7 or step >= 12:  # group 1 is away from 8 to 11, and heals at 12
            note(1, step)
    c.pin(10, "checkpoint")  # named after the groups passed it
    assert c.cursors_at(5) == {0: {"steps": 500}, 1: {"steps": 501}}
    assert c.cursors_at(10) == {0: {"steps": 1000}, 1: {"steps": 701}}
    c.group_progress(2, 12, {"steps": 1202}, 12.0)  # group 2 started late: before step 10, the start
    assert c.cursors_at(10)[2] is None
    cursors = c.rewind_groups(10)
    assert cursors == {0: {"steps": 1000}, 1: {"steps": 701}, 2: None}
    assert c.group_status(1)["cursor"] == {"steps": 701} and c.group_status(0)["step"] == 10
    assert c.rewind_groups(10) == cursors  # a group restoring it after the first: the same cursors
    for step in (15, 20, 25):  # the newest two restore points of each kind are kept
        c.pin(step, "snapshot")
    assert 5 not in c.pins and 10 in c.pins and {20, 25} <= set(c.pins)


def test_job_control_answers_every_progress_note_with_the_asks_still_open():
    """The join signal's source (`JobControl.joining`, `group_progress`): group 0 asks for its first
    quorum, then group 1 does and its first quorum forms without group 0 (group 0's manager had
    not beaten yet). Group 1's progress notes answer with group 0's ask until group 0 commits, so
    group 1 hears it, although it was made before group 1's own (a count of asks hid it, and group 0
    waited until group 1 ended); a group's own ask closes at its own note; a rebuilt group's new ask
    is a new one."""
    from recgrid.train.control import JobControlImpl

    c = JobControlImpl()
    first0, first1 = c.joining(0), c.joining(1)
    assert c.group_progress(1, 5, {}, time.time()) == {0: first0}
    assert c.group_progress(1, 10, {}, time.time()) == {0: first0}  # group 0 still waits
    assert c.group_progress(0, 10, {}, time.time()) == {}  # it joined: its ask closed, and group 1's
    again = c.joining(0)  # group 0 rebuilt
    assert again > first1 and c.group_progress(1, 15, {}, time.time()) == {0: again}


def test_job_control_says_which_groups_train_on_when_one_leaves_at_a_drain():
    """`group_leaves` answers a group leaving at a drain with the groups that stay (none: it is the
    last, and writes a storage checkpoint first); a group that commits again is back; `over` holds
    once the job's workers said where they ended (the driver then ends runs still waiting for room)."""
    from recgrid.train.control import JobControlImpl

    c = JobControlImpl()
    for g in (0, 1, 2):
        c.group_progress(g, 5, {}, time.time())
    assert c.group_leaves(2, 5, ["node-b"], None) == [0, 1]
    assert c.group_leaves(1, 10, ["node-b"], 1_000) == [0]
    time.sleep(0.01)
    c.group_progress(2, 15, {}, time.time())  # group 2 came back on another node
    assert c.group_leaves(0, 15, ["node-a"], None) == [2]
    assert c.group_leaves(2, 20, ["node-c"], None) == []  # the last to leave
    assert [x["group"] for x in c.status()["leaves"]] == [2, 1, 0, 2]
    assert not c.over()
    c.finished(20, False)
    assert c.over()
