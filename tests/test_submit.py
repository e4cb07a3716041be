"""`recgrid submit` as a user runs it, against a real `ray start --head` cluster with token
authentication (issue 8, acceptance 1 and 4).

One cluster for the module (its own temp dir and ports, a metrics endpoint on a known port);
`recgrid submit` runs as a subprocess with the submitter's `MLFLOW_TRACKING_URI` naming a SQLite
file outside the working directory. A T=4, M=2 job must SUCCEED, its FINISHED run must be in that
store (not under the cluster's copy of the working directory), its experiment must carry MLflow's
training kind, and every metric name the Grafana dashboard queries must appear on the cluster's
metrics endpoint while the job runs. An invalid config is refused before anything is uploaded,
a missing or wrong token gets the sentence that says what to do, and `--no-wait` returns at once
with a job whose data paths the cluster checks (and refuses, as `recgrid train` would).

What a submission ships (issue 18, acceptance 2): the real job is submitted from a project directory
made here (a git work tree tracking the job's config) that also holds `.env`, `secrets/key.pem` and a
50 MB untracked file; none of them may reach the cluster (its unpacked working directory is read), the
job must finish and the command must have printed what it shipped. From a home directory, to plain
http:// on a non-loopback address, or with credentials in an override, it refuses before contacting
anything.

Teardown stops this cluster only: SIGTERM to its `ray start --block` process (which shuts its node
down), then SIGKILL to whatever of its process group is left. Never `ray stop`: that kills every
Ray process on the machine, other people's clusters included.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DASHBOARD = REPO / "dashboards" / "recgrid.json"
T, M, K, STEPS = 4, 2, 5, 30


@dataclass
class Cluster:
    address: str  # the Job API (dashboard)
    metrics_port: int
    token_file: Path
    tmp: Path

    def api(self, path: str, token: str | None = None) -> object:
        """GET the Job API with the token, as JSON."""
        token = self.token_file.read_text().strip() if token is None else token
        req = urllib.request.Request(self.address + path, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _user_env(**extra: str) -> dict[str, str]:
    """This shell's environment without any Ray cluster or token of its own, the venv first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "MLFLOW_TRACKING_URI")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def cluster():
    # short: Ray's socket paths under the temp dir must fit in 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix="rgsub", dir="/tmp"))
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    gcs, dash, metrics, client, agent, agent_grpc, rtenv = _free_ports(7)
    log = open(tmp / "ray-start.log", "w")
    cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--temp-dir={tmp / 'ray'}", f"--port={gcs}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--metrics-export-port={metrics}",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={rtenv}",
           "--num-cpus=4", "--num-gpus=0", "--disable-usage-stats",
           "--system-config=" + json.dumps({"metrics_report_interval_ms": 1000})]
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=_user_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
                                          RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0"))  # teardown without a drain
    c = Cluster(f"http://127.0.0.1:{dash}", metrics, token, tmp)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                c.api("/api/version")
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"ray start did not come up:\n{(tmp / 'ray-start.log').read_text()[-3000:]}")
                time.sleep(1)
        yield c
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # this cluster's process group only
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _submit(*args: str, env: dict[str, str], timeout: float = 60, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "recgrid"), "submit", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


UNTRACKED = (".env", "secrets/key.pem", "big.bin")  # in the project directory, never to be shipped
BIG_BYTES = 50 * 1000 * 1000
PROJECT_README = "a recgrid project, submitted by tests/test_submit.py\n"


def _project(root: Path) -> Path:
    """A project directory: a git work tree tracking the job's config and a README, beside an
    untracked `.env`, `secrets/key.pem` and a 50 MB file (none of them git-ignored)."""
    root.mkdir(parents=True)
    (root / "jobs").mkdir()
    shutil.copy(REPO / "jobs" / "local_demo.yaml", root / "jobs" / "local_demo.yaml")
    (root / "README.md").write_text(PROJECT_README)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "add", "jobs/local_demo.yaml", "README.md"], cwd=root, check=True)
    (root / ".env").write_text("AWS_SECRET_ACCESS_KEY=do-not-ship\n")
    (root / "secrets").mkdir()
    (root / "secrets" / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\ndo-not-ship\n")
    with open(root / "big.bin", "wb") as f:
        f.truncate(BIG_BYTES)
    return root


def _jobs(cluster: Cluster) -> list[dict]:
    return cluster.api("/api/jobs/")  # type: ignore[return-value]


# ---- refused before anything is uploaded --------------------------------------------------------------
def test_a_home_directory_is_refused_as_the_project(cluster, tmp_path):
    home = _project(tmp_path / "home")
    before = len(_jobs(cluster))
    p = _submit("jobs/local_demo.yaml", "--address", cluster.address, cwd=home,
                env=_user_env(HOME=str(home), RAY_AUTH_TOKEN_PATH=str(cluster.token_file)))
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"recgrid submit: {home} is your home directory" in p.stderr and "shipping" not in p.stdout
    assert len(_jobs(cluster)) == before


@pytest.mark.parametrize("address,args,said,file_uri", [
    ("http://10.0.0.1:8265", [], "plain http:// to a non-loopback address would send the cluster's token in clear", None),
    ("head.example.com:8265", [], "plain http:// to a non-loopback address", None),  # no scheme: Ray would use http
    ("https://ray:pw@head.example.com:8265", [], "https://***@head.example.com:8265: the address carries credentials", None),
    ("https://head.example.com:8265", ["--set", "tracking.tracking_uri=https://u:pw@mlflow.example.com"],
     "--set tracking.tracking_uri=https://***@mlflow.example.com: a URI with credentials", None),
    ("https://head.example.com:8265", [], "jobs/local_demo.yaml: tracking.tracking_uri https://***@mlflow.example.com "
     "carries a user and password", "https://u:pw@mlflow.example.com"),  # in the shipped config file
])
def test_plain_http_and_credentials_are_refused_before_connecting(address, args, said, file_uri, tmp_path):
    """Nothing is sent anywhere: the refusal comes before any connection (the addresses are strings only)."""
    project = _project(tmp_path / "p")
    if file_uri:
        config = project / "jobs" / "local_demo.yaml"
        config.write_text(config.read_text().replace("\ntracking:\n", f"\ntracking:\n  tracking_uri: {file_uri}\n"))
    p = _submit("jobs/local_demo.yaml", "--address", address, *args, cwd=project,
                env=_user_env(RAY_AUTH_TOKEN="not-a-real-token"), timeout=30)
    assert p.returncode == 2, p.stdout + p.stderr
    assert said in p.stderr and "shipping" not in p.stdout
    assert "pw@" not in p.stdout + p.stderr and "not-a-real-token" not in p.stdout + p.stderr


def test_invalid_config_is_refused_before_anything_is_uploaded(cluster):
    before = len(_jobs(cluster))
    p = _submit("jobs/local_demo.yaml", "--address", cluster.address, "--set", "grid.num_groups=3",
                env=_user_env(RAY_AUTH_TOKEN_PATH=str(cluster.token_file)))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "invalid job config: grid.num_groups: M=3 must divide grid.world_size T=4" in p.stderr
    assert "submitting" not in p.stdout
    assert len(_jobs(cluster)) == before  # no job reached the cluster


@pytest.mark.parametrize("token,said", [
    (None, "requires token authentication and no token was found"),
    ("not-the-clusters-token", "refused the token"),
])
def test_a_missing_or_wrong_token_gets_one_sentence_saying_what_to_do(cluster, tmp_path, token, said):
    env = _user_env(HOME=str(tmp_path))  # no ~/.ray/auth_token either
    if token:
        env["RAY_AUTH_TOKEN"] = token
    p = _submit("jobs/local_demo.yaml", "--address", cluster.address, env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("recgrid submit: ") and said in lines[0], p.stderr
    assert "ray get-auth-token" in lines[0] and "RAY_AUTH_TOKEN" in lines[0]
    assert "Traceback" not in p.stderr


def test_no_wait_returns_at_once_and_the_cluster_checks_the_data_paths(cluster):
    """Data globs name the cluster's files, so the cluster's `recgrid train` checks them: a job with
    none fails there, before any worker starts, with the sentence and exit code `recgrid train` has."""
    p = _submit("jobs/local_demo.yaml", "--address", cluster.address, "--no-wait",
                "--set", "data.train=/nonexistent/recgrid/*.parquet", "--set", "data.synth_if_missing=false",
                env=_user_env(RAY_AUTH_TOKEN_PATH=str(cluster.token_file)))
    assert p.returncode == 0, p.stdout + p.stderr
    (job_id,) = re.findall(r"as job (\S+);", p.stdout)
    assert f"RAY_AUTH_MODE=token ray job logs --follow --address {cluster.address} {job_id}" in p.stdout
    assert "MLFLOW_TRACKING_URI is not set here" in p.stdout  # and says where the run would go instead
    deadline = time.monotonic() + 120
    while (job := cluster.api(f"/api/jobs/{job_id}"))["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, job
        time.sleep(1)
    assert job["status"] == "FAILED" and job["driver_exit_code"] == 2, job
    logs = cluster.api(f"/api/jobs/{job_id}/logs")["logs"]
    assert "recgrid train: invalid job config: data.train: no file matches '/nonexistent/recgrid/*.parquet'" in logs


# ---- a real job -----------------------------------------------------------------------------------------
def dashboard_metric_names() -> set[str]:
    """Every metric name the Grafana dashboard's queries (panels and variables) name."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
              for v in dash["templating"]["list"] if v["type"] == "query"]
    names: set[str] = set()
    for expr in exprs:
        bare = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers name no metric
        names |= {m for m in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare) if m.startswith("ray_")}
    return names


def _scrape(port: int) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return set()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def submitted(cluster):
    """`recgrid submit` of a T=4, M=2 job, followed to its end, scraping the metrics endpoint meanwhile."""
    store = cluster.tmp / "mlflow"  # outside the working directory and outside the cluster's
    store.mkdir()
    uri = f"sqlite:///{store}/mlflow.db"
    data = cluster.tmp / "data"
    args = ["jobs/local_demo.yaml", "--address", cluster.address,
            "--set", f"grid.world_size={T}", "--set", f"grid.num_groups={M}", "--set", f"grid.sync_every={K}",
            "--set", f"train.max_steps={STEPS}", "--set", "train.batch_size=64", "--set", "train.log_every=5",
            "--set", "train.eval_every=15", "--set", "train.checkpoint_every=0",  # no restore is tested here
            "--set", f"train.storage_path={cluster.tmp / 'ray-runs'}",
            "--set", f"data.train={data}/train/*.parquet", "--set", f"data.eval={data}/eval/*.parquet",
            "--set", "data.synth_rows=10000", "--set", "data.synth_eval_rows=2000",
            "--set", "tracking.experiment=test-submit"]
    env = _user_env(RAY_AUTH_TOKEN_PATH=str(cluster.token_file), MLFLOW_TRACKING_URI=uri)
    project = _project(cluster.tmp / "project")
    t0 = time.monotonic()
    proc = subprocess.Popen([str(BIN / "recgrid"), "submit", *args], cwd=project, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []  # each with the seconds since submitting, for a failure's report
    reader = threading.Thread(
        target=lambda: lines.extend(f"{time.monotonic() - t0:6.1f}s {line}" for line in proc.stdout))
    reader.start()
    seen: set[str] = set()
    while proc.poll() is None and time.monotonic() - t0 < 400:
        seen |= _scrape(cluster.metrics_port)
        time.sleep(1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(timeout=10)
    seen |= _scrape(cluster.metrics_port)
    return {"rc": proc.returncode, "out": "".join(lines), "uri": uri, "seen": seen, "seconds": time.monotonic() - t0}


def test_job_succeeds_and_its_run_is_in_the_submitters_tracking_store(cluster, submitted):
    from mlflow.tracking import MlflowClient

    out = submitted["out"]
    assert submitted["rc"] == 0, out[-4000:]
    (job_id,) = re.findall(r"as job (\S+);", out)
    assert f"stop it with:  RAY_AUTH_MODE=token ray job stop --address {cluster.address} {job_id}" in out
    job = cluster.api(f"/api/jobs/{job_id}")
    assert job["status"] == "SUCCEEDED", job
    env_vars = job["runtime_env"]["env_vars"]
    assert env_vars["MLFLOW_TRACKING_URI"] == submitted["uri"]  # forwarded, since a shell's env never reaches a job
    assert not any("TOKEN" in k for k in env_vars)  # credentials stay out of the runtime env
    assert "[recgrid] step     30/30" in out  # the job's logs were followed to the end

    client = MlflowClient(tracking_uri=submitted["uri"])
    exp = client.get_experiment_by_name("test-submit")
    assert exp is not None, "no experiment in the submitter's store"
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert (p["grid.world_size"], p["grid.num_groups"], p["derived.group_size"], p["grid.sync_every"]) == \
        (str(T), str(M), "2", str(K))
    assert run.data.metrics["sync/count"] == STEPS // K and 0 < run.data.metrics["eval/auc"] <= 1
    # nothing went to a store under the cluster's copy of the working directory
    assert not list((cluster.tmp / "ray").rglob("mlflow.db"))


def test_only_the_tracked_files_reach_the_cluster_and_the_command_said_so(cluster, submitted):
    assert submitted["rc"] == 0, submitted["out"][-3000:]
    shipped = [d for d in (cluster.tmp / "ray").glob("session_*/runtime_resources/working_dir_files/*") if d.is_dir()]
    copies = [d for d in shipped if (d / "README.md").is_file() and (d / "README.md").read_text() == PROJECT_README]
    assert copies, f"the project is not among the shipped working directories {shipped}"
    for wd in copies:  # the job ran in it (it wrote its data under runs/): only that came on top
        files = {p.relative_to(wd).as_posix() for p in wd.rglob("*") if p.is_file() and p.parts[len(wd.parts)] != "runs"}
        assert files == {"README.md", "jobs/local_demo.yaml"}, files
        for name in UNTRACKED:
            assert not (wd / name).exists(), name
    assert not [p for p in (cluster.tmp / "ray").rglob("*") if p.name in ("key.pem", "big.bin", ".env")]
    # what it shipped, said before sending: 2 files, the largest named; nothing near 50 MB went
    (line,) = [x for x in submitted["out"].splitlines() if "shipping 2 file(s)" in x]
    assert "jobs/local_demo.yaml (" in line and "untracked files stay here" in line and " MB" not in line


def test_every_dashboard_metric_was_exported_during_the_job(submitted):
    assert submitted["rc"] == 0, submitted["out"][-3000:]
    queried = dashboard_metric_names()
    assert len(queried) >= 20
    missing = queried - submitted["seen"]
    assert not missing, (f"the dashboard queries names the cluster never exported during the job: {sorted(missing)}\n"
                         + submitted["out"][-6000:])


def test_forwarded_uris_lose_their_credentials_and_a_shipped_config_with_one_is_refused(tmp_path, monkeypatch):
    """Issue 47: every URI the runtime env forwards (shown on the Ray dashboard) loses its user and
    password and its query-string tokens; a config file with a credential in any field is refused
    as `--set` is (the working directory it ships can be read there), and so is such an override.
    Functions of the submission only: no cluster, nothing sent."""
    import json

    from recgrid.config import load_config
    from recgrid.launch.submit import SubmitError, entrypoint, job_env, refuse_shipped_credentials

    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", "https://minio:S3CR3T@minio.example.com:9000/?X-Amz-Security-Token=T0K")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.com/?token=T0K2")
    env, notes = job_env(load_config(None, ["data.train=none/*.parquet"], check_paths=False))
    assert env["MLFLOW_S3_ENDPOINT_URL"] == "https://minio.example.com:9000/"
    assert env["MLFLOW_TRACKING_URI"] == "https://mlflow.example.com/"
    assert not any(s in json.dumps([env, notes]) for s in ("S3CR3T", "T0K")), (env, notes)
    assert any("not forwarded: the credentials in MLFLOW_S3_ENDPOINT_URL" in n for n in notes), notes
    for key, value, what in (("data.train", "s3://KEY:SECRET@bucket/train/*.parquet", "a user and password"),
                             ("data.eval", "https://h.example.com/eval.tsv?sig=SECRET", "a token in its query string"),
                             ("tracking.tracking_uri", "https://h.example.com/?token=SECRET", "a token")):
        config = load_config(None, ["data.train=none/*.parquet", f"{key}={value}"], check_paths=False)
        with pytest.raises(SubmitError) as refused:
            refuse_shipped_credentials("jobs/job.yaml", config)
        assert str(refused.value).startswith(f"jobs/job.yaml: {key} ") and f"carries {what}" in str(refused.value)
        assert "SECRET" not in str(refused.value)
        with pytest.raises(SubmitError, match=f"--set {key}=.*a URI with credentials") as refused:
            entrypoint("jobs/job.yaml", [f"{key}={value}"])
        assert "SECRET" not in str(refused.value)
