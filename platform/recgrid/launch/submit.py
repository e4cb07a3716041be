"""`recgrid submit CONFIG [--address URL] [--set key=value ...] [--no-wait]`: a training job on a
running Ray cluster, through the Ray Job API. What it does, step by step, and what it refuses:
README.md, "From a laptop with `recgrid submit`".

This module owns what a submission carries and how it talks to the cluster:
- the config, validated here first with `recgrid train`'s errors (exit 2, nothing contacted);
  data globs are left to the cluster, which checks them before any worker starts;
- what ships (`shipped_files`, `stage`): the files `git ls-files` lists under the project
  directory plus the config file, in a private staging directory that becomes the job's working
  directory, never `EXCLUDES`, with this recgrid package; it runs `python -m recgrid.cli train`
  there, so the code that validated the config is the code that runs;
- the job's environment (`job_env`): `MLFLOW_TRACKING_URI` and `FORWARDED_ENV`, with credentials
  stripped (a runtime env and the entrypoint are shown on the Ray dashboard), and a config or
  `--set` carrying one refused;
- the connection (`cluster_address`, `enable_token_auth`): `https://`, or `http://` to a loopback
  address only (the token travels in every request's header), token found where Ray looks;
- following the job (`follow_logs`, `wait_until_done`) and its exit status (0 when it
  SUCCEEDED, the driver's exit code when it FAILED, 1 otherwise).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tempfile
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import recgrid
from recgrid.config import ConfigError, JobConfig, load_config
from recgrid.launch.report import say
from recgrid.tracking import has_credentials, redact_uri, strip_credentials

# never shipped, tracked by git or not (gitignore patterns, relative to the project directory)
EXCLUDES = [".git", ".venv", "venv", "/runs/", "mlruns", "__pycache__", ".pytest_cache", "*.egg-info", "*.pyc"]
# settings of the submitting shell the job needs (besides MLFLOW_TRACKING_URI, handled on its own)
FORWARDED_ENV = ("MLFLOW_S3_ENDPOINT_URL", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL",
                 "MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING")
# what every job gets (the same quiet logs as a local `recgrid train`)
JOB_ENV = {"PYTHONWARNINGS": "ignore", "TORCHREC_LOG_LEVEL": "ERROR"}
# set here, deliberately not forwarded: the cluster must hold its own
CREDENTIALS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY")
TOKEN_HELP = ("copy the head node's token (`ray get-auth-token` there; a Secret on KubeRay) to ~/.ray/auth_token "
              "here, or set RAY_AUTH_TOKEN to it or RAY_AUTH_TOKEN_PATH to a file holding it")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
LARGEST_SHOWN = 3  # the largest shipped files named in the shipping line


class SubmitError(Exception):
    """A submission that cannot go ahead; the message is the sentence to print."""


def run_cli(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.set, check_paths=False)
    except (ConfigError, FileNotFoundError) as e:
        print(f"recgrid submit: invalid job config: {e}", file=sys.stderr)
        return 2
    try:
        address = cluster_address(args.address)
        project = project_dir()
        entry = entrypoint(args.config, args.set)
        refuse_shipped_credentials(args.config, config)
        files = shipped_files(project, args.config)
    except SubmitError as e:
        print(f"recgrid submit: {e}", file=sys.stderr)
        return 2
    try:
        return submit(config, address, entry, files, project, wait=not args.no_wait)
    except SubmitError as e:
        print(f"recgrid submit: {e}", file=sys.stderr)
        return 1


# ---- what is submitted ------------------------------------------------------------------------------
def cluster_address(address: str | None) -> str:
    """`--address`, else $RAY_ADDRESS: the cluster's dashboard (Job API), https://HEAD:8265, or
    http:// to a loopback address (a port-forward). Plain http to anything else is refused: the
    token would cross the network in clear. Nothing is contacted here."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise SubmitError("no cluster to submit to: pass --address https://HEAD:8265 (the Ray dashboard's address), "
                          "or http://127.0.0.1:8265 through a port-forward, or set RAY_ADDRESS")
    address = address.rstrip("/")
    shown = redact_uri(address)
    if has_credentials(address):
        raise SubmitError(f"{shown}: the address carries credentials; give the cluster's token through "
                          f"RAY_AUTH_TOKEN or a token file instead ({TOKEN_HELP})")
    parts = urlsplit(address if "://" in address else "http://" + address)
    if parts.scheme == "https":
        return address
    if parts.scheme == "http" and _loopback(parts.hostname or ""):
        return address
    if parts.scheme == "http":
        raise SubmitError(f"{shown}: plain http:// to a non-loopback address would send the cluster's token in "
                          f"clear; use https:// (a TLS proxy in front of the dashboard), or reach the dashboard "
                          f"through `kubectl port-forward` / an SSH tunnel and pass http://127.0.0.1:PORT")
    raise SubmitError(f"{shown}: not a Job API address; pass https://HEAD:8265, or http://127.0.0.1:PORT through a "
                      f"port-forward")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def project_dir() -> Path:
    """The current directory, the project shipped with the job: never a home directory (nor a
    directory holding one), which would ship ~/.ssh, ~/.aws, ~/.kube if anything went wrong."""
    cwd = Path.cwd().resolve()
    home = Path.home().resolve()
    if cwd == home or cwd in home.parents:
        raise SubmitError(f"{cwd} is {'your home directory' if cwd == home else 'a directory holding your home'}: "
                          f"recgrid submit ships the project directory it runs in; cd into the project "
                          f"(a git work tree holding the job's config) and run it there")
    return cwd


def entrypoint(config_path: str, overrides: list[str]) -> str:
    """The job's command, run in the shipped working directory: the config must be shipped too.
    The entrypoint is shown on the Ray dashboard: an override carrying credentials is refused."""
    for o in overrides:
        if has_credentials(o):
            raise SubmitError(f"--set {redact_uri(o)}: a URI with credentials would be shown on the Ray dashboard "
                              f"(the job's command); give the tracking server's user and password to the cluster "
                              f"as MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD instead")
    cwd = Path.cwd().resolve()
    path = Path(config_path).resolve()
    try:
        rel = path.relative_to(cwd).as_posix()
    except ValueError:
        raise SubmitError(f"{config_path}: the config must lie inside the working directory that is shipped "
                          f"({cwd}); copy it there (e.g. into jobs/) or run recgrid submit from a directory "
                          f"that holds it") from None
    if _ignored(rel):
        raise SubmitError(f"{rel}: the config lies in a path that is never shipped ({EXCLUDES}); "
                          f"move it, e.g. into jobs/")
    args = ["python", "-m", "recgrid.cli", "train", rel] + [a for o in overrides for a in ("--set", o)]
    return shlex.join(args)


def refuse_shipped_credentials(config_path: str, config: JobConfig) -> None:
    """A config file is shipped in the job's working directory, which anyone who can reach the Ray
    dashboard can read: one with a credential (a URI's user and password, a query-string token) in
    any field is refused, as `--set` is."""
    for key, value in config.to_flat_dict(resolved=False).items():
        text = str(value)
        if has_credentials(text):
            what = "a user and password" if has_credentials(strip_query(text)) else "a token in its query string"
            raise SubmitError(f"{config_path}: {key} {redact_uri(text)} carries {what}, and the config is shipped "
                              f"to the cluster (its working directory); take them out and give the cluster its own "
                              f"(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD for the tracking server, the "
                              f"object store's credentials in the cluster's environment)")


def strip_query(text: str) -> str:
    """`text` with every URL's query string left out (what is left can still carry a user and password)."""
    return re.sub(r"\?[^\s'\"]*", "", text)


def _ignored(rel: str) -> bool:
    parts = Path(rel).parts
    for pattern in EXCLUDES:
        name = pattern.strip("/")
        if (pattern.startswith("/") and parts[0] == name) or (not pattern.startswith("/") and any(
                Path(p).match(name) for p in parts)):
            return True
    return False


def shipped_files(project: Path, config_path: str) -> list[str]:
    """What the job ships, relative to `project`: the files git tracks under it (`git ls-files`;
    untracked files never go, ignored or not) and the config, minus EXCLUDES."""
    if shutil.which("git") is None:
        raise SubmitError("git is not installed: recgrid submit ships the files git tracks in the project directory")
    p = subprocess.run(["git", "ls-files", "-z", "--cached", "--full-name", "--", "."], cwd=project,
                       capture_output=True)
    if p.returncode != 0:
        raise SubmitError(f"{project} is not in a git work tree: recgrid submit ships only the files git tracks "
                          f"(`git ls-files`) plus the config; run `git init` and `git add` the job's files, "
                          f"or run it from the project's repository")
    top = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=project, capture_output=True,
                              text=True).stdout.strip()).resolve()
    files = set()
    for name in p.stdout.decode().split("\0"):
        if not name:
            continue
        rel = (top / name).relative_to(project).as_posix()
        if (project / rel).is_file() and not (project / rel).is_symlink() and not _ignored(rel):
            files.add(rel)
    files.add(Path(config_path).resolve().relative_to(project).as_posix())
    return sorted(files)


def describe(project: Path, files: list[str]) -> str:
    """One line: how many files, their size, the largest few."""
    sizes = sorted(((project / f).stat().st_size, f) for f in files)
    largest = ", ".join(f"{f} ({_size(s)})" for s, f in reversed(sizes[-LARGEST_SHOWN:]))
    return (f"shipping {len(files)} file(s), {_size(sum(s for s, _ in sizes))}, from {project} (the files git "
            f"tracks there plus the config; untracked files stay here); largest: {largest}")


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def stage(project: Path, files: list[str]) -> Path:
    """A private copy (mode 0700) of exactly `files`: the directory Ray packs as the working_dir."""
    root = Path(tempfile.mkdtemp(prefix="recgrid-submit-"))
    for rel in files:
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(project / rel, dest)
    return root


def job_env(config: JobConfig) -> tuple[dict[str, str], list[str]]:
    """The runtime env's env_vars, and lines telling the user what was and was not forwarded."""
    env = dict(JOB_ENV)
    notes = []
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):  # relative: make it this directory's
            uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).absolute())
        if has_credentials(uri):
            uri = strip_credentials(uri)
            notes.append("not forwarded: the credentials in MLFLOW_TRACKING_URI (a runtime env is visible "
                         "on the Ray dashboard); the cluster needs MLFLOW_TRACKING_USERNAME / "
                         "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) of its own")
        env["MLFLOW_TRACKING_URI"] = uri
    for name in FORWARDED_ENV:
        if os.environ.get(name):
            env[name] = strip_credentials(os.environ[name])
            if env[name] != os.environ[name]:
                notes.append(f"not forwarded: the credentials in {name} (a runtime env is visible on the Ray "
                             f"dashboard); forwarded as {env[name]}, the cluster needs its own")
    if config.tracking.tracking_uri:
        notes.append(f"MLflow: the run goes to {redact_uri(config.tracking.tracking_uri)} (tracking.tracking_uri in "
                     f"the config)")
    elif uri:
        notes.append(f"MLflow: the run goes to {uri} (MLFLOW_TRACKING_URI, forwarded to the job)"
                     + ("; a SQLite file: the cluster's nodes must see this path" if uri.startswith("sqlite:") else ""))
    else:
        notes.append("MLflow: MLFLOW_TRACKING_URI is not set here, so the run goes where the cluster's own "
                     "MLFLOW_TRACKING_URI points, else into a SQLite file in the job's working directory on the "
                     "cluster, which Ray deletes; set MLFLOW_TRACKING_URI to your tracking server")
    held = [name for name in CREDENTIALS if os.environ.get(name)]
    if held:
        notes.append(f"not forwarded: {', '.join(held)} (a runtime env is visible on the Ray dashboard); "
                     f"the cluster needs its own")
    return env, notes


def runtime_env(env_vars: dict[str, str], working_dir: Path) -> dict[str, Any]:
    return {
        "working_dir": str(working_dir),
        # this package, whatever the cluster's image holds: PYTHONPATH puts it first
        "py_modules": [str(Path(recgrid.__file__).resolve().parent)],
        "excludes": EXCLUDES,
        "env_vars": env_vars,
    }


# ---- authentication ---------------------------------------------------------------------------------
def token_source() -> str | None:
    """Where Ray will read this client's token from, in Ray's order, or None."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return f"RAY_AUTH_TOKEN_PATH ({path})" if Path(path).expanduser().is_file() else None
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def enable_token_auth() -> str | None:
    """Switch this client to token mode when a token is at hand and RAY_AUTH_MODE is unset (Ray's
    client sends no token otherwise). Ray reads the mode once, as it is imported: `recgrid submit`
    calls this before anything imports Ray. Returns where the token comes from."""
    source = token_source()
    if source and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
    return source


def _auth_sentence(error: BaseException, address: str, source: str | None) -> str:
    if "Authentication failed" in str(error) or "invalid" in str(error).lower():
        return f"the Ray cluster at {address} refused the token from {source or 'this machine'}: {TOKEN_HELP}."
    return f"the Ray cluster at {address} requires token authentication and no token was found: {TOKEN_HELP}."


# ---- the job ----------------------------------------------------------------------------------------
def submit(config: JobConfig, address: str, entry: str, files: list[str], project: Path, wait: bool = True) -> int:
    source = enable_token_auth()
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    # the client's INFO lines (packaging, websocket closed) say nothing the job's own log does not
    for name in ("ray", "ray.dashboard.modules.job.sdk", "ray.dashboard.modules.dashboard_sdk"):
        logging.getLogger(name).setLevel(logging.WARNING)

    env_vars, notes = job_env(config)
    try:
        client = JobSubmissionClient(address, verify=True)
    except AuthenticationError as e:
        raise SubmitError(_auth_sentence(e, address, source)) from None
    except ConnectionError as e:
        raise SubmitError(f"cannot reach the Ray cluster's Job API at {address} ({e}); is the address the head's "
                          f"dashboard (port 8265) and is the cluster up?") from None
    job_id = re.sub(r"[^a-z0-9_-]+", "-", f"recgrid-{config.run_name}-{uuid.uuid4().hex[:8]}".lower())
    say(f"submitting {entry!r} to {address} as job {job_id}; {describe(project, files)}")
    for note in notes:
        say(note)
    staged = stage(project, files)
    try:
        client.submit_job(entrypoint=entry, submission_id=job_id, runtime_env=runtime_env(env_vars, staged),
                          metadata={"recgrid.run_name": config.run_name, "recgrid.experiment": config.tracking.experiment})
    except AuthenticationError as e:
        raise SubmitError(_auth_sentence(e, address, source)) from None
    finally:  # uploaded (or refused): the copy is no longer needed
        shutil.rmtree(staged, ignore_errors=True)
    mode = "RAY_AUTH_MODE=token " if os.environ.get("RAY_AUTH_MODE") == "token" else ""
    stop = f"{mode}ray job stop --address {shlex.quote(address)} {job_id}"
    say(f"job {job_id} submitted; stop it with:  {stop}")
    if not wait:
        say(f"follow it with:  {mode}ray job logs --follow --address {shlex.quote(address)} {job_id}")
        return 0
    try:
        follow_logs(client, job_id)
        info = wait_until_done(client, job_id)
    except KeyboardInterrupt:
        say(f"stopped following; job {job_id} goes on. Stop it with:  {stop}")
        return 130
    status = str(info.status.value if hasattr(info.status, "value") else info.status)
    say(f"job {job_id} {status}" + (f": {info.message}" if status != "SUCCEEDED" and info.message else ""))
    if status == "SUCCEEDED":
        return 0
    code = getattr(info, "driver_exit_code", None)
    return code if isinstance(code, int) and code > 0 else 1


def follow_logs(client: Any, job_id: str) -> None:
    """Print the job's logs as they come, until the job ends."""
    import asyncio

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            sys.stdout.write(lines)
            sys.stdout.flush()

    asyncio.run(tail())


def wait_until_done(client: Any, job_id: str, timeout_s: float = 60.0) -> Any:
    """The job's info once it is SUCCEEDED, FAILED or STOPPED (the log stream may end a moment before)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.get_job_info(job_id)
        if str(getattr(info.status, "value", info.status)) in TERMINAL or time.monotonic() > deadline:
            return info
        time.sleep(0.5)
