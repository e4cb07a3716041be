"""`train.fault_tolerance=torchft` on a real local Ray cluster (issue 7, part 4's first path).

T=2 replicas of the whole model (M = T, L = 1), K=5; one replica is SIGKILLed after the first
sync. The job finishes in its one MLflow run. The surviving replica keeps its process (the same
pid trains on alone and ends the job); the killed one is replaced by Ray Train alone and healed
from the live peer over torchft's PGTransport: its tables bit for bit what the peer sent, the same
as the peer's after the next sync and at the end. The data cursor is exact: each replica reads its
own part of the epoch plan in order, the newcomer resumes at the survivor's position, no row is
read twice, and the dead replica's rows for the rounds it was away are the only ones skipped.
Invalid torchft configs fail before any worker starts, with a sentence naming the field.
"""

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from faults import BackgroundJob, mlflow_client
from recgrid.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
T, K, B = 2, 5, 128
VICTIM, SURVIVOR = 0, 1  # the victim logs to MLflow until it dies: the survivor takes over, then hands back


def _config(tmp: Path, *extra: str):
    return load_config(REPO / "jobs/local_demo.yaml", [
        f"data.train={tmp}/data/train/*.parquet", f"data.eval={tmp}/data/eval/*.parquet",
        "data.synth_rows=40000", "data.synth_eval_rows=8000", f"data.row_log={tmp}/rows",
        f"grid.world_size={T}", f"grid.num_groups={T}", f"grid.sync_every={K}",
        # ended by a graceful stop once the replacement has healed and synced twice
        "train.max_steps=100000", f"train.batch_size={B}", "train.log_every=10", "train.eval_every=0",
        "train.fault_tolerance=torchft", "train.max_failures=1",
        f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db", "tracking.experiment=test-torchft", *extra,
    ])


def _ready(st: dict) -> bool:
    return len({r for a in st["attempts"] for r, w in a["workers"].items() if w.get("ready")}) == T


@pytest.fixture(scope="module")
def job(tmp_path_factory, shared_ray):
    tmp = tmp_path_factory.mktemp("torchft")
    os.environ["RECGRID_RUNS_DIR"] = str(tmp / "runs")
    config = _config(tmp)
    t0 = time.time()
    bg = BackgroundJob(config)
    st = bg.wait_for(lambda s: _ready(s) and s["last_step"] > K)  # after the first sync
    pids = {r: w["pid"] for a in st["attempts"] for r, w in a["workers"].items()}
    killed_at = st["last_step"]
    os.kill(pids[VICTIM], signal.SIGKILL)
    st = bg.wait_for(lambda s: any("seconds" in e for e in s["events"]))
    healed_at = st["events"][0]["step"]
    bg.wait_for(lambda s: s["last_step"] >= healed_at + 2 * K)  # two syncs of the two replicas
    bg.request_stop()
    result = bg.join()
    out = {"config": config, "result": result, "pids": pids, "killed_at": killed_at, "tmp": tmp,
           "seconds": time.time() - t0}
    assert result.status == "FINISHED", result.error
    workers = [(a, r, w) for a in result.attempts for r, w in a["workers"].items()]
    out["survivor"] = [w for _, r, w in workers if r == SURVIVOR]
    out["victim"] = [w for _, r, w in workers if r == VICTIM]
    out["event"] = result.events[0]
    print(f"\ntorchft job: {out['seconds']:.0f} s; pids before the kill {pids}; killed replica {VICTIM} at step "
          f"{killed_at}; replacement pid {out['victim'][-1]['pid']} healed from replica {out['event']['from_replica']} "
          f"at step {out['event']['step']}, first step {out['event']['seconds']:.1f} s after the failure was seen; "
          f"survivor pid {out['survivor'][0]['pid']} ended at step {out['survivor'][0]['final_step']}; "
          f"eval NE {result.metrics.get('eval/ne')}")
    return out


def test_job_finishes_in_one_mlflow_run(job):
    client = mlflow_client(job["config"])
    exp = client.get_experiment_by_name("test-torchft")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_id == job["result"].run_id and run.info.status == "FINISHED"
    m, tags = run.data.metrics, run.data.tags
    assert run.data.params["train.fault_tolerance"] == "torchft"
    assert m["recovery/count"] == 1 and m["recovery/seconds"] > 0 and m["recovery/steps_lost"] == 0
    assert tags["recovery/source/1"] == "peer" and "replica 0 from replica 1" in tags["recovery/detail/1"]
    groups = [x.value for x in client.get_metric_history(run.info.run_id, "grid/num_groups")]
    assert groups[0] == T and 1.0 in groups and groups[-1] == T  # alone while the victim was away
    assert 0 < m["eval/ne"] < 1.0 and m["eval/examples"] == 8000
    assert m["sync/count"] > 0
    # every logging step once, whoever logged it
    steps = [x.step for x in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == sorted(set(steps))


def test_the_survivor_kept_its_process(job):
    (survivor,) = job["survivor"]  # one process for the whole job: never restarted
    assert survivor["pid"] == job["pids"][SURVIVOR]
    first, replacement = job["victim"]
    assert first["pid"] == job["pids"][VICTIM] and replacement["pid"] != first["pid"]
    # the survivor trained on alone while the victim was away, and ended the job with the replacement
    assert job["event"]["step"] > job["killed_at"]
    assert survivor["final_step"] == replacement["final_step"] > job["event"]["step"]
    assert "final_step" not in first


def test_the_replacement_healed_from_the_live_peer(job):
    event, (survivor,), replacement = job["event"], job["survivor"], job["victim"][-1]
    assert event["source"] == "peer" and event["from_replica"] == SURVIVOR and event["replica"] == VICTIM
    # what the survivor sent is what the replacement holds, bit for bit (weights and AdaGrad moments)
    assert event["digest"] == event["source_digest"] and event["bit_identical"]
    assert [h["from"] for h in replacement["heals"]] == [SURVIVOR]
    # after the first sync they share, both replicas hold the same tables (each notes its first two
    # syncs after the live count changed: the newcomer's first may come a round after the survivor's)
    shared = [int(k.split("@")[1]) for k in replacement if k.startswith("digest@") and k in survivor]
    assert shared, (sorted(k for k in replacement if "@" in k), sorted(k for k in survivor if "@" in k))
    first_sync = min(shared)
    assert first_sync > event["step"] and first_sync % K == 0 and replacement[f"live@{first_sync}"] == T
    assert replacement[f"digest@{first_sync}"] == survivor[f"digest@{first_sync}"]
    # and at the end (a sync step): tables, moments, dense part and its optimizer, all the same
    assert replacement["final_step"] % K == 0
    assert replacement["final_digest"] == survivor["final_digest"]
    assert replacement["final_dense_digest"] == survivor["final_dense_digest"]


def test_the_data_cursor_is_exact(job):
    """Each log holds consecutive batches of its replica's part of the epoch plan; the replacement
    resumes at the survivor's position; nothing is read twice; the victim's rounds away are skipped."""
    from recgrid.data.stream import scan_inputs
    from recgrid.data.units import DataCursor, EpochPlan, take_rows
    from recgrid.train.worker import read_row_logs

    config = job["config"]
    inputs = scan_inputs(config.data.train, config.dataset_spec())
    plan = EpochPlan(inputs, config.train.seed, B, config.data.rows_per_unit)
    first_row = np.cumsum([0, *inputs.rows])  # synthetic row ids count rows over all files

    def part(replica: int, n: int) -> list[np.ndarray]:
        """The row ids of `replica`'s first `n` batches, epoch after epoch."""
        cursor, out = DataCursor(), []
        while len(out) < n:
            seg = plan.segment(cursor, T)
            for k in range(seg.steps_total):
                units = take_rows(seg.parts[replica], k * B, B)
                out.append(np.sort(np.concatenate([first_row[u.file] + np.arange(u.start, u.end) for u in units])))
            plan.next_epoch(cursor)
        return out[:n]

    logs = {key: np.sort(arr[:, 1].reshape(-1, B), axis=1) for key, arr in read_row_logs(str(job["tmp"] / "rows")).items()}
    by_replica = {r: [logs[(a, rr)] for (a, rr) in sorted(logs) if rr == r] for r in (VICTIM, SURVIVOR)}
    (survivor,), (first, replacement) = by_replica[SURVIVOR], by_replica[VICTIM]
    n = len(survivor)
    np.testing.assert_array_equal(survivor, part(SURVIVOR, n))  # every position, in order, none twice
    np.testing.assert_array_equal(first, part(VICTIM, len(first)))
    # the replacement read its own part from where the survivor was when it healed
    resumed = n - len(replacement)
    np.testing.assert_array_equal(replacement, part(VICTIM, n)[resumed:])
    skipped = (resumed - len(first)) * B
    assert skipped > 0  # the victim's part for the rounds it was away
    print(f"\nrows: survivor {n} batches, victim {len(first)} + replacement {len(replacement)}; "
          f"{skipped:,} rows of the victim's part skipped while it was away")


@pytest.mark.parametrize("overrides,field,words", [
    (["grid.world_size=4", "grid.num_groups=2"], "train.fault_tolerance", "L = T / M = 1"),
    (["grid.min_world_size=1"], "grid.min_world_size", "elastic"),
    (["train.checkpoint_every=10"], "train.checkpoint_every", "storage checkpoints"),
    (["grid.delayed_moment_sync=true"], "grid.delayed_moment_sync", "not supported"),
])
def test_torchft_configs_it_cannot_carry_fail_at_start(tmp_path, overrides, field, words):
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, *overrides)
    assert str(e.value).startswith(f"{field}:") and words in str(e.value)
    _config(tmp_path, "grid.min_world_size=2")  # a fixed size written out is fine


# ---- the replica average itself: three real torchft managers (gloo) in threads, no Ray ---------------
def _managers_average(n: int, make_tensors) -> list:
    """`n` torchft managers joined in one quorum by a real lighthouse (each replica a thread with its
    own TCPStore and gloo process group); each averages `make_tensors(i)` through the component's
    `_average`. Returns each replica's averaged tensors."""
    import threading
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    from recgrid.train.ft import TorchftReplicas

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=n, join_timeout_ms=10_000)
    out: list = [None] * n
    errors: list = []

    def replica(i: int) -> None:
        manager = None
        try:
            store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=20)), load_state_dict=lambda sd: None,
                              state_dict=lambda: {}, min_replica_size=n, use_async_quorum=False,
                              timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=30), rank=0,
                              world_size=1, replica_id=f"avg_{i}", store_addr="localhost", store_port=store.port,
                              lighthouse_addr=lighthouse.address())
            manager.start_quorum()
            # the component needs only the trainer's device and the live count from the quorum
            reps = TorchftReplicas(SimpleNamespace(device=torch.device("cpu")), manager, heal=None, listener=None)
            reps.live = manager.num_participants()
            tensors = make_tensors(i)
            reps._average(tensors)()
            out[i] = tensors
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

    got = _managers_average(3, make)
    for fp16, fp32, bf16 in got:
        changed = int((fp16 != rows).sum())
        assert changed == 0, f"{changed} of {rows.numel()} identical fp16 rows changed by the average"
        assert torch.equal(bf16, rows[:100].to(torch.bfloat16))
        assert torch.allclose(fp32, torch.full((8,), 1.0))  # (0 + 1 + 2) / 3
