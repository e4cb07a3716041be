"""The platform end to end: `recgrid train` on a real local Ray cluster with synthetic data,
read back through the MLflow client; invalid configs fail before any worker starts. (Failures,
recoveries and elastic groups are tests/test_torchft.py's and tests/test_recovery_nodes.py's.)"""

import collections
import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from faults import BackgroundJob
from recgrid.train.recovery import coordinator as recovery_actors, holders, slots
from recgrid.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _job(tmp: Path, uri: str, groups: int, extra: list[str] = ()):
    return load_config(REPO / "jobs/local_demo.yaml", [
        f"data.train={tmp}/data/train/*.parquet", f"data.eval={tmp}/data/eval/*.parquet",
        "data.synth_rows=40000", "data.synth_eval_rows=8000",
        "grid.world_size=4", f"grid.num_groups={groups}", "grid.sync_every=5",
        "train.max_steps=60", "train.batch_size=128", "train.log_every=20", "train.eval_every=30",
        f"tracking.tracking_uri={uri}", "tracking.experiment=test-launcher", f"data.row_log={tmp}/rows-M{groups}",
        *extra,
    ])


QR_HEAD = ["model.compression=qr", "model.qr_threshold_rows=2000", "model.qr_operation=mult", "model.head_rows=64"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, mlflow_server, shared_ray):
    """One job with M=2 (QR-compressed with a head cache) and a job that fails on a bad row, side by
    side on the suite's shared local Ray cluster, as jobs share a cluster (the M=1 baseline of the
    same job is in tests/test_compare.py). The M=2 job logs to the suite's real `mlflow server`
    (basic auth, as on k8s), its workers authenticating with the env vars the Ray pods get
    (`shared_ray`); the other to a SQLite store."""
    tmp = tmp_path_factory.mktemp("launcher")
    uri = f"sqlite:///{tmp}/mlflow.db"
    os.environ["RECGRID_RUNS_DIR"] = str(tmp / "runs")
    old_env = {k: os.environ.get(k) for k in mlflow_server.client_env()}
    os.environ.update(mlflow_server.client_env())  # this process's client (the workers have them: shared_ray)
    bad = tmp / "bad"
    bad.mkdir()
    good = "\t".join(["1"] + ["3"] * 13 + ["0a1b2c3d"] * 26)
    lines = [good] * 16
    lines[1] = good.replace("0a1b2c3d", "NOT-HEX!", 1)  # line 2: in the first worker's first batches
    (bad / "day_0").write_text("\n".join(lines) + "\n")
    # the M=2 job's model is QR-compressed with a head cache; the head ids are counted once, by the driver
    m2_cfg = _job(tmp, mlflow_server.url, 2, [*QR_HEAD, "train.checkpoint_every=0", *SIDE_BY_SIDE])
    m2_path = tmp / "m2.yaml"  # the job's config as a file (`recgrid export --config`)
    m2_path.write_text(yaml.safe_dump(m2_cfg.to_dict()))
    failed_cfg = load_config(REPO / "jobs/local_demo.yaml", [
        f"data.train={bad}/day_*", "data.eval=[]", "data.synth_if_missing=false", "train.max_steps=5",
        "grid.world_size=1", "grid.num_groups=1",  # one worker starts faster; it reads the bad line first
        "train.batch_size=1", f"tracking.tracking_uri={uri}", "tracking.experiment=test-launcher-failed",
        *SIDE_BY_SIDE])
    printed = _ThreadOutput(sys.stdout)
    sys.stdout = printed
    try:
        m2_job = BackgroundJob(m2_cfg)
        failed_job = BackgroundJob(failed_cfg)
        m2, failed = m2_job.join(), failed_job.join()
    finally:
        sys.stdout = printed.out
        for k, v in old_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    M2.update(printed=printed.of(m2_job.thread), server=mlflow_server, config=m2_cfg, config_path=m2_path)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return client, m2, failed


M2: dict = {}  # what the M=2 job printed, the server it logged to, and its config


# the jobs of `two_runs` run at once on the 3-CPU cluster (5 workers): a tenth of a CPU per worker
# leaves Ray Data's read tasks of all of them room, and every attempt's start finds a read task's share free
SIDE_BY_SIDE = ["train.cpus_per_worker=0.1"]


class _ThreadOutput(io.TextIOBase):
    """sys.stdout while jobs run side by side in threads: passed on, and kept per thread (what one
    job printed, whole lines: each thread's writes in order)."""

    def __init__(self, out) -> None:
        self.out = out
        self.by_thread: dict[int, list[str]] = collections.defaultdict(list)

    def write(self, text: str) -> int:
        self.by_thread[threading.get_ident()].append(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def of(self, thread: threading.Thread) -> str:
        return "".join(self.by_thread[thread.ident])


def test_m2_job_lands_in_mlflow(two_runs):
    import json

    from mlflow.tracking import MlflowClient

    from recgrid.config import DERIVED_PARAM_PREFIXES, DERIVED_PARAMS, defaults

    _, m2, _ = two_runs
    assert m2.status == "FINISHED", m2.error
    old = {k: os.environ.get(k) for k in M2["server"].client_env()}
    os.environ.update(M2["server"].client_env())
    try:
        client = MlflowClient(M2["server"].url)
        run = client.get_run(m2.run_id)
        sharding_plan = json.loads(Path(client.download_artifacts(m2.run_id, "sharding_plan.json")).read_text())
        check_m2_run(client, m2, run, sharding_plan, DERIVED_PARAMS, DERIVED_PARAM_PREFIXES, defaults)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def check_m2_run(client, m2, run, sharding_plan, derived, derived_prefixes, defaults):
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["grid.num_groups"] == "2" and p["grid.world_size"] == "4" and p["derived.group_size"] == "2"
    assert p["grid.sync_every"] == "5" and p["optim.moment_scale"] == "2.0" and p["grid.layout"] == "host-local"
    assert p["derived.workers_per_node"] == "4" and p["derived.nodes"] == "1"
    assert p["versions.torch"].startswith("2.13") and "versions.ray" in p and "versions.torchrec" in p
    # each param once: a config key, or a documented derived one; the per-table plan is an artifact
    config_keys = set(defaults().to_flat_dict())
    strays = {k for k in p if k not in config_keys and k not in derived and not k.startswith(derived_prefixes)}
    assert not strays, f"params that are neither config keys nor in config.DERIVED_PARAMS: {sorted(strays)}"
    leaves = [k.rsplit(".", 1)[-1] for k in p if not k.startswith("versions.")]
    assert len(leaves) == len(set(leaves)), sorted(k for k in leaves if leaves.count(k) > 1)
    # QR_HEAD: 18 tables as they are, 8 compressed ones as a quotient, a remainder and a head table each
    assert len(sharding_plan) == 18 + 3 * 8 and not any(k.startswith("sharding.") for k in p)
    # the system metrics of the one node: a 60-step job records some
    assert any(k.startswith("system/") and k.endswith("/cpu_utilization_percentage") for k in run.data.metrics), \
        sorted(run.data.metrics)
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
    # the run's Datasets: the training and eval data, named by their globs, with rows and a digest
    import json

    datasets = {next(t.value for t in i.tags if t.key == "mlflow.data.context"): i.dataset
                for i in run.inputs.dataset_inputs}
    assert set(datasets) == {"training", "eval"}, datasets
    assert datasets["training"].name.endswith("/data/train/*.parquet")
    assert datasets["eval"].name.endswith("/data/eval/*.parquet")
    assert [json.loads(datasets[c].profile)["num_rows"] for c in ("training", "eval")] == [40000, 8000]
    assert len({datasets["training"].digest, datasets["eval"].digest}) == 2


def test_the_printed_mlflow_url_opens_the_run_on_the_server(two_runs):
    """The line `recgrid train` prints names the run's page in MLflow 3.17's training view on the
    tracking server; the server serves that page, and the experiment and run its path names are
    the job's; the experiment's runs list shows NE, QPS and M as columns (its shared view)."""
    import json
    import re

    from recgrid.tracking import RUNS_VIEW_TAG

    _, m2, _ = two_runs
    server = M2["server"]
    (url,) = re.findall(r"^\[recgrid\] MLflow: (\S+)$", M2["printed"], flags=re.M)
    page, _, route = url.partition("#")
    assert page == server.url + "/" and route.endswith("?workflowType=machine_learning"), url
    status, body = server.get(page)
    assert status == 200 and b'<div id="root"' in body  # MLflow's single-page app
    exp_id, run_id = re.fullmatch(r"/experiments/(\d+)/runs/([0-9a-f]{32})\?.*", route).groups()
    assert run_id == m2.run_id
    status, body = server.get(f"/ajax-api/2.0/mlflow/runs/get?run_id={run_id}")  # what the page asks
    run = json.loads(body)["run"]
    assert status == 200 and run["info"]["experiment_id"] == exp_id and run["info"]["status"] == "FINISHED"
    status, body = server.get(f"/ajax-api/2.0/mlflow/experiments/get?experiment_id={exp_id}")
    tags = {t["key"]: t["value"] for t in json.loads(body)["experiment"]["tags"]}
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    columns = json.loads(tags[RUNS_VIEW_TAG])["selectedColumns"]
    metrics = {m["key"] for m in run["data"]["metrics"]}
    params = {p["key"] for p in run["data"]["params"]}
    shown = {c.split(".", 1)[1].strip("`") for c in columns if c.startswith(("metrics.", "params."))}
    assert {"eval/ne", "train/qps_median", "grid.num_groups"} <= shown <= metrics | params


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
    client, _, failed = two_runs
    assert failed.status == "FAILED"
    run = client.get_run(failed.run_id)
    assert run.info.status == "FAILED"
    # file, line and field of the bad value, in the run and in what the driver printed
    assert "bad/day_0:2: field C1" in run.data.tags["error"], run.data.tags["error"]
    assert "bad/day_0:2: field C1" in failed.error


def test_a_job_whose_host_cannot_hold_its_snapshots_is_refused_before_any_worker_starts(shared_ray, tmp_path):
    """Issue 46, acceptance 6: Criteo Kaggle's tables at dimension 128 (16 GiB of weights and moments
    a copy) on the suite's one-node cluster, whose holder would keep two generations of every shard
    position: more than the host's free /dev/shm. Refused with a sentence naming the host and the
    bytes, before job control or any worker exists; the run is FAILED."""
    from recgrid.launch.ray import run_job
    from recgrid.train.recovery.slots import shm_free

    started = []
    cfg = _job(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 2, [
        "data.spec=criteo_kaggle", "model.embedding_dim=128", "model.dense_arch=[64,128]",
        "model.sharding=table_wise", "train.max_failures=2"])
    assert cfg.snapshots.measured
    r = run_job(cfg, on_start=started.append, summary=False)
    assert r.status == "FAILED" and not started and not r.attempts, r
    free = shm_free()
    assert r.error.startswith("GridError: in-memory snapshots: host "), r.error
    assert "GiB of free shared memory (/dev/shm)" in r.error, r.error
    need = int(r.error.split("GiB (")[1].split(" bytes")[0].replace(",", ""))
    assert need > free and "train.snapshot_every_syncs=0" in r.error


# ---- the M=2 job's QR head cache --------------------------------------------------------------------
def test_m2_jobs_head_cache_is_counted_once_and_recorded(two_runs, tmp_path):
    """The QR job's head ids: one count over the training files by the driver, recorded as an
    artifact (every sharding group's workers get them from the driver), and its embedding bytes
    those of the compressed tables."""
    from recgrid.data.specs import embedding_bytes, get_spec

    from mlflow.tracking import MlflowClient

    r, cfg = two_runs[1], M2["config"]
    old = {k: os.environ.get(k) for k in M2["server"].client_env()}
    os.environ.update(M2["server"].client_env())
    try:
        client = MlflowClient(M2["server"].url)
        heads = np.load(client.download_artifacts(r.run_id, "compression/head_ids.npz", str(tmp_path)))
        got = client.get_run(r.run_id).data.metrics["memory/embedding_bytes"]
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    compressed = [f"C{f + 1}" for f, rows in enumerate(get_spec("tiny").table_rows) if rows > 2000]
    assert sorted(heads.files) == sorted(compressed) and all(len(heads[f]) == 64 for f in compressed)
    comp = cfg.compression().with_heads({int(f[1:]) - 1: heads[f] for f in heads.files})
    spec = cfg.dataset_spec()
    assert got == embedding_bytes(spec, 16, compression=comp) < 0.6 * embedding_bytes(spec, 16)  # 8 of 26 tables
    assert embedding_bytes(spec, 16) == sum(spec.table_rows) * 16 * 4  # uncompressed: every row, fp32


FRESH_PROCESS_EVAL = """
import contextlib, io, json, sys
import mlflow.pyfunc
import torch.distributed as dist
served = mlflow.pyfunc.load_model(sys.argv[1])
served_alone = sorted(m for m in sys.modules if m.split(".")[0] in ("recgrid", "ray", "torchrec"))
from recgrid.launch.model import load_model
model = load_model(sys.argv[1])
alone = sorted(m for m in sys.modules if m == "ray" or m.startswith(("ray.", "recgrid.train.trainer", "recgrid.train.worker")))
from recgrid.launch.unshard import evaluate_files, model_spec
mine = evaluate_files(model, sys.argv[2:], model_spec(model))
from recgrid.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["eval", sys.argv[1], *[a for g in sys.argv[2:] for a in ("--data", g)], "--json"])
print(json.dumps({"served_alone": served_alone, "alone": alone, "dist": dist.is_initialized(), "mine": mine,
                  "cli": json.loads(out.getvalue())}))
"""


def test_m2_jobs_model_leaves_the_platform_and_gives_its_eval_ne_alone(two_runs, tmp_path):
    """Issue 30, acceptance 1, 2 and 3, on the M=2 job (T=4, QR with a head cache, logging to the real
    `mlflow server`): its model is an MLflow model of the run, logged at the final step with
    `eval/ne` linked. A fresh Python process loads its served form by its URI with MLflow alone
    (no recgrid, Ray or TorchRec imported: issue 47), then reads it as data with recgrid (no Ray,
    torch distributed or trainer) and reproduces the job's final eval NE on the eval rows (1e-5);
    `recgrid eval` on the same rows prints the same. `recgrid export` of the job's final storage
    checkpoint gives the same model, tensor for tensor. The run's Datasets
    hold the training and eval inputs with their rows and digests."""
    import json
    import re

    from mlflow.tracking import MlflowClient

    from recgrid.cli import main
    from recgrid.launch.model import load_model, read_model_dir

    r, cfg = two_runs[1], M2["config"]
    found = re.search(r"model: logged as (models:/\S+) \(step (\d+), eval NE", M2["printed"])
    assert found, M2["printed"][-2000:]
    uri, step = found.group(1), int(found.group(2))
    checkpoint = re.search(r"unsharded the checkpoint (\S+):", M2["printed"]).group(1)
    old = {k: os.environ.get(k) for k in [*M2["server"].client_env(), "MLFLOW_TRACKING_URI"]}
    os.environ.update({**M2["server"].client_env(), "MLFLOW_TRACKING_URI": M2["server"].url})
    try:
        client = MlflowClient(M2["server"].url)
        run = client.get_run(r.run_id)
        logged = client.get_logged_model(uri.removeprefix("models:/"))
        fresh = subprocess.run([sys.executable, "-c", FRESH_PROCESS_EVAL, uri, *cfg.data.eval], capture_output=True,
                               text=True, timeout=300, env=os.environ.copy())
        assert fresh.returncode == 0, fresh.stderr[-3000:]
        got = json.loads(fresh.stdout.strip().splitlines()[-1])
        model = load_model(uri)
        out = tmp_path / "exported"
        assert main(["export", checkpoint, "--config", str(M2["config_path"]), "--out", str(out)]) == 0
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    ne = run.data.metrics["eval/ne"]
    assert logged.source_run_id == r.run_id and step == cfg.train.max_steps
    assert {m.key: m.value for m in logged.metrics if m.step == step}["eval/ne"] == ne  # linked to the model
    assert got["served_alone"] == [], got  # served: MLflow and torch only
    assert got["alone"] == [] and not got["dist"], got  # read by recgrid: no Ray, no process group, no trainer
    assert abs(got["mine"]["ne"] - ne) <= 1e-5 and got["cli"] == got["mine"], (got, ne)
    assert got["mine"]["rows"] == run.data.metrics["eval/examples"] == cfg.data.synth_eval_rows
    # acceptance 3: the run's Datasets, by context, with their rows and a digest of the file list
    inputs = {next(t.value for t in d.tags if t.key == "mlflow.data.context"): d.dataset
              for d in run.inputs.dataset_inputs}
    rows = {c: json.loads(d.profile)["num_rows"] for c, d in inputs.items()}
    assert rows == {"training": cfg.data.synth_rows, "eval": cfg.data.synth_eval_rows}, rows
    assert all(re.fullmatch(r"[0-9a-f]{16}", d.digest) for d in inputs.values())
    exported = read_model_dir(str(out)).state_dict()
    assert exported.keys() == model.state_dict().keys()
    assert all(torch_equal(v, model.state_dict()[k]) for k, v in exported.items())


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


# ---- on the shared cluster, without a training job ----------------------------------------------------------
KILLED_DRIVER = """
import sys, time
import ray
from recgrid.train.recovery.coordinator import RecoveryCoordinator
ray.init(address=sys.argv[1], logging_level="WARNING")
node = ray.get_runtime_context().get_node_id()
coordinator = RecoveryCoordinator.remote(sys.argv[2])  # owned by this driver, as a job's is
holder = ray.get(coordinator.holder_for.remote(node))
print(ray.get(holder.reserve.remote(5, "shard/0", 4096))["path"], flush=True)
time.sleep(600)
"""


def test_a_driver_killed_with_sigkill_leaves_no_snapshot_files_once_the_next_job_starts(shared_ray):
    """Issue 18, acceptance 3: a driver SIGKILLed takes its actors, the snapshot holders, along,
    and no `finally` of its deletes their slot files; the next job's holder on the node sweeps them."""
    import json
    import uuid

    import ray

    dead_run = uuid.uuid4().hex
    driver = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, ray.get_runtime_context().gcs_address, dead_run],
                              stdout=subprocess.PIPE, text=True)
    try:
        slot = driver.stdout.readline().strip()
    finally:
        driver.kill()  # SIGKILL
        driver.wait()
    job_dir = Path(slots.job_dir(dead_run))
    assert slot.startswith(str(job_dir)) and os.path.isfile(slot)
    # Ray ends a dead driver's actors; the holder's pid is in its directory's owner marker
    holder_pid = json.loads((Path(slot).parent / slots.MARKER).read_text())["pid"]
    deadline = time.time() + 60
    while os.path.exists(f"/proc/{holder_pid}") and time.time() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{holder_pid}"), "the killed driver's holder still runs"
    assert job_dir.exists()  # nobody deleted them: the driver's cleanup never ran
    coordinator = recovery_actors.RecoveryCoordinator.remote(uuid.uuid4().hex)  # the next job on the node
    try:
        holder = ray.get(coordinator.holder_for.remote(ray.get_runtime_context().get_node_id()))
        assert ray.get(holder.inventory.remote()) == {}  # started
        assert not job_dir.exists()
    finally:
        ray.get(coordinator.release.remote())
        ray.kill(coordinator)


def _first_quorum(trainer, control, coordinator, resume_from: str):
    """A sharding group of one worker at its first quorum under torchft (`train.recovery.peers`), alone with a
    real lighthouse: what it restored, what it said, and its manager's step after."""
    from datetime import timedelta
    from types import SimpleNamespace

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    from recgrid.train.checkpoint import Checkpointer
    from recgrid.train.recovery.peers import HealTransport, TorchftReplicas
    from recgrid.train.recovery.storage import StorageFallback

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    heal, said = HealTransport(trainer, 0), []
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=20)), load_state_dict=heal.load,
                      state_dict=heal.state_dict, min_replica_size=1, use_async_quorum=False, init_sync=False,
                      timeout=timedelta(seconds=20), rank=0, world_size=1, replica_id="resume",
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse.address())
    try:
        listener = SimpleNamespace(quorum=lambda live, rank: None, finished_elsewhere=lambda: False, say=said.append)
        fallback = StorageFallback(Checkpointer(), control, coordinator, 0, 0, resume_from=resume_from)
        replicas = TorchftReplicas(trainer, manager, heal, listener, fallback=fallback)
        assert replicas.start_round() == "reload"  # the state and its data cursor changed: the loop reloads
        return heal.restored, said, manager.current_step()
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


def test_object_store_snapshots_a_corrupted_copy_and_resume_from_restore_as_they_should(shared_ray, tmp_path):
    """Three recovery paths on real actors (job control, the recovery coordinator and its holder)
    and a one-rank gloo group in this process, the cheapest real form of each:
    1. a node's holder without usable shared memory (here: refused its directory, which something
       else made first; a missing or full /dev/shm takes the same path) keeps the shards in the
       object store, and a restore from them is the trainer's state, bit for bit;
    2. a slot file corrupted after it was written is caught by the checksum it was written with
       before the restore uses it: the copy is dropped and the older complete generation restored,
       and the restore's detail (the recovery event's) says so;
    3. `train.resume_from`, as a sharding group's first quorum reads it (`train.recovery.storage`: a real torchft
       manager and lighthouse): no storage checkpoint of its own job, so it loads another run's and
       continues at its step exactly as the run that wrote it continued."""
    import uuid

    import ray
    import torch
    import torch.distributed as dist

    from recgrid.config import SnapshotCadence, defaults
    from recgrid.data.specs import get_spec
    from recgrid.engine.grid import Grid
    from recgrid.launch.smoke import random_batches
    from recgrid.train.checkpoint import Checkpointer
    from recgrid.train.control import JobControl
    from recgrid.train.recovery.storage import StorageFallback
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    spec = get_spec("tiny")
    engine = EngineConfig.from_job(defaults(), spec=spec, sync_every=2, seed=5, dense_optimizer="adam")
    batches = [b for b, _ in zip(random_batches(spec, 32, seed=0), range(8))]
    node = ray.get_runtime_context().get_node_id()
    grid = Grid(1, 1)
    actors, coordinators, planted = [], [], []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)

    def run(snapshot_steps: list[int], run_id: str):
        """A run's actors and a trainer trained to each of `snapshot_steps`, snapshotting there."""
        control, coordinator = JobControl.remote(), recovery_actors.RecoveryCoordinator.remote(run_id)
        actors.extend([control, coordinator])
        coordinators.append(coordinator)
        trainer = Trainer.build(grid, engine, torch.device("cpu"))
        said: list[str] = []
        snapshotter = holders.Snapshotter(trainer, coordinator, grid, trainer.groups, [node],
                                          SnapshotCadence(every_syncs=1), say=said.append)
        states = {}
        for step in snapshot_steps:
            trainer.run(iter(batches[trainer.state.step:step]), step)
            snapshotter.snapshot()
            states[step] = (trainer.snapshot(), trainer.dense_state())
        snapshotter.close()
        return control, coordinator, trainer, states, said

    def restore(control, coordinator):
        """A rebuilt group of M = 1 at its first quorum: the holders' snapshot (`train.recovery.storage.StorageFallback`)."""
        fresh = Trainer.build(grid, engine, torch.device("cpu"))
        from_holders = holders.HolderRestore(coordinator, grid, fresh.groups, [node])
        return fresh, StorageFallback(Checkpointer(), control, coordinator, 0, 0,
                                      holders=from_holders).restore(fresh)

    def same(trainer, state) -> bool:
        shard, dense = state
        return all(torch.equal(x, y) for x, y in zip(trainer.shard_tensors(), shard.shard)) and \
            all(torch.equal(v, trainer.dense_state()[k]) for k, v in dense.items())

    trainers = []
    try:
        # 1. the object store
        run_id = uuid.uuid4().hex
        planted.append(slots.job_dir(run_id))
        os.mkdir(planted[0], 0o755)  # not the holder's own: refused, so no slot files
        control, coordinator, a, states, said = run([2, 4], run_id)
        trainers.append(a)
        assert any("refusing this snapshot directory" in line and "object store" in line for line in said), said
        holder = ray.get(coordinator.holder_for.remote(node))
        assert ray.get(holder.files.remote()) == [] and isinstance(ray.get(holder.get.remote(4, "shard/0")), list)
        fresh, restored = restore(control, coordinator)
        trainers.append(fresh)
        assert (restored["source"], restored["step"]) == ("holder", 4) and same(fresh, states[4])
        (shard,) = restored["shards"]
        assert shard["via"] == "object store" and shard["digest"] == shard["source_digest"]

        # 2. a corrupted slot file
        control, coordinator, b, states, _ = run([2, 4], uuid.uuid4().hex)
        trainers.append(b)
        holder = ray.get(coordinator.holder_for.remote(node))
        slot = ray.get(holder.get.remote(4, "shard/0"))
        assert isinstance(slot, dict)  # in shared memory this time
        with open(slot["path"], "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0x01]))
        fresh, restored = restore(control, coordinator)
        trainers.append(fresh)
        assert (restored["source"], restored["step"]) == ("holder", 2) and same(fresh, states[2])  # the older generation
        assert [c.split(":")[0] for c in restored["corrupt"]] == [f"shard/0@4 on node {node[:12]}"]
        assert "corrupted copies dropped" in restored["detail"] and "shard/0@4" in restored["detail"]
        assert restored["shards"][0]["digest"] == restored["shards"][0]["source_digest"]

        # 3. train.resume_from: another run's checkpoint (b's, at step 4), then the same 4 steps as b
        path = Checkpointer(root=str(tmp_path / "ckpt")).save(b)
        want = [float(x) for x in b.run(iter(batches[4:8]), 8).losses]
        control, coordinator = JobControl.remote(), recovery_actors.RecoveryCoordinator.remote(uuid.uuid4().hex)
        actors.extend([control, coordinator])
        coordinators.append(coordinator)
        resumed = Trainer.build(grid, engine, torch.device("cpu"))
        trainers.append(resumed)
        restored, said, step = _first_quorum(resumed, control, coordinator, path)
        assert (restored["source"], restored["step"], restored["path"], step) == ("resume", 4, path, 4)
        assert same(resumed, states[4]) and any(f"resumed from train.resume_from, the checkpoint of step 4 ({path})"
                                                in line for line in said), said
        got = [float(x) for x in resumed.run(iter(batches[4:8]), 8).losses]
        assert resumed.state.step == 8 and len(got) == 4 and max(abs(x - y) for x, y in zip(got, want)) <= 1e-6
    finally:
        for t in trainers:
            t.close()
        dist.destroy_process_group()
        for c in coordinators:
            ray.get(c.release.remote())
        for actor in actors:
            ray.kill(actor)
        for p in planted:
            os.rmdir(p)


# ---- one replica sync (issue 48): a Ray job and the local launcher train the same tables ----------------
def _local_tables(cfg) -> list[float]:
    """One rank of the local launcher's grid (one torch world, the replica sync over process groups)
    training `cfg`'s job: the job's plan, its epoch's part for this global rank, `max_steps` steps."""
    import torch
    import torch.distributed as dist

    from recgrid.data.stream import local_batches, scan_inputs
    from recgrid.data.units import DataCursor, EpochPlan
    from recgrid.launch.ray import job_plan
    from recgrid.train.report import table_sums
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    grid, engine = cfg.build_grid(), EngineConfig.from_job(cfg)
    trainer = Trainer.build(grid, engine, torch.device("cpu"), job_plan(cfg))
    plan = EpochPlan(scan_inputs([str(Path(p).absolute()) for p in cfg.data.train], engine.spec), engine.seed,
                     cfg.train.batch_size, cfg.data.rows_per_unit)
    part = plan.segment(DataCursor(), grid.world_size).part(dist.get_rank())
    trainer.run(local_batches(plan.inputs, part, engine.spec, plan.batch_size), cfg.train.max_steps)
    trainer.close()
    return table_sums(trainer)


def test_a_ray_job_and_the_local_launcher_train_the_same_tables(tmp_path, shared_ray, monkeypatch):
    """T=2, M=2 (L=1), K=5, 10 steps: the Ray job (each sharding group a Ray Train run, the replica sync
    over torchft's manager, the dense gradients averaged by the component) and the local launcher (one
    torch world, the replica sync over a process group, the dense gradients by DDP) end with the same
    tables and moments on every global rank. Compared as each tensor's sum to 1e-6, not bit for bit:
    the dense gradients are averaged in a different order (the live groups' mean, then the group's,
    against DDP's one all-reduce), so the dense part, and through it the rows' updates, differ in
    their last bits. The same job's workers count their calls of the job's actors and of MLflow by
    step (`train.audit`, issue 49): none on the steps that are neither sync (5, 10) nor log steps."""
    from faults import workers_of
    from recgrid.launch.local import run_local
    from recgrid.launch.ray import run_job
    from recgrid.train.job import TABLE_DIGESTS_ENV

    from recgrid.train.audit import CALL_AUDIT_ENV

    monkeypatch.setenv(TABLE_DIGESTS_ENV, "1")
    monkeypatch.setenv(CALL_AUDIT_ENV, "1")
    monkeypatch.setenv("RECGRID_RUNS_DIR", str(tmp_path / "runs"))
    cfg = load_config(REPO / "jobs/local_demo.yaml", [
        f"data.train={tmp_path}/data/train/*.parquet", "data.eval=[]", "data.synth_rows=4000",
        "grid.world_size=2", "grid.num_groups=2", "grid.sync_every=5", "train.max_steps=10",
        "train.batch_size=64", "train.log_every=10", "train.eval_every=0", "train.checkpoint_every=0",
        "tracking.log_model=false", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        "tracking.experiment=test-one-sync", *SIDE_BY_SIDE])
    result = run_job(cfg, summary=False)
    assert result.status == "FINISHED", result.error
    ray_sums = {r: w["final_sums"] for r, w in workers_of({"attempts": result.attempts}).items()}
    local_sums = dict(enumerate(run_local(_local_tables, 2, cfg)))
    assert sorted(ray_sums) == sorted(local_sums) == [0, 1]
    for r in (0, 1):
        assert ray_sums[r] == pytest.approx(local_sums[r], rel=1e-6, abs=1e-9), r
    assert ray_sums[0] == ray_sums[1]  # after the last sync the two sharding groups hold the same tables
    for r, w in workers_of({"attempts": result.attempts}).items():
        for kind, by_step in w["final_calls"].items():
            between = {int(step): n for step, n in by_step.items() if int(step) in (1, 2, 3, 4, 6, 7, 8, 9)}
            assert not between, (r, kind, by_step)
        assert sum(w["final_calls"]["ray"].values()) > 0  # the audit saw the worker's calls (its start, syncs, end)
