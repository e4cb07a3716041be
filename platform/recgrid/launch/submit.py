"""`recgrid submit CONFIG [--address URL] [--set key=value ...] [--no-wait]`: a training job on a
running Ray cluster, through the Ray Job API.

This module owns what a submission carries and how it talks to the cluster:
- the config is validated here first, with the same errors as `recgrid train` (exit 2, nothing
  contacted, nothing uploaded). Data globs are not checked against this machine's files: the job
  reads the cluster's (absolute paths, object-store URIs, or relative paths in the shipped working
  directory, where git-ignored data such as `runs/` never goes); `recgrid train` checks them on the
  cluster before any worker starts, with the same sentence;
- the job is the current directory (the working directory, respecting `.gitignore`; never
  `.venv`, `runs/`, `.git` or caches) plus this recgrid package, running `python -m recgrid.cli
  train CONFIG --set ...` there, so the code that validated the config is the code that runs;
- settings the job needs go in the runtime env's `env_vars` (the submitting shell's environment
  never reaches a job): `MLFLOW_TRACKING_URI` (a relative SQLite path made absolute) and the
  MLflow settings in `FORWARDED_ENV`. Credentials are not forwarded (a runtime env is shown on the
  Ray dashboard): the cluster has its own;
- Ray 2.60 clusters require token authentication: the token is found where Ray looks
  (`RAY_AUTH_TOKEN`, the file at `RAY_AUTH_TOKEN_PATH`, `~/.ray/auth_token`) and token mode is
  switched on for this client when one is there; a cluster that asks for a token and gets none,
  or refuses it, gets one sentence that says what to do.
Then it follows the job's logs and exits with the job's status (0 when it SUCCEEDED, the driver's
exit code when it FAILED, 1 otherwise), or with `--no-wait` prints how to follow and stop it.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from recgrid.config import ConfigError, JobConfig, load_config
from recgrid.launch.report import say

# never shipped, .gitignore or not (gitignore patterns, relative to the working directory)
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
        entry = entrypoint(args.config, args.set)
    except SubmitError as e:
        print(f"recgrid submit: {e}", file=sys.stderr)
        return 2
    try:
        return submit(config, address, entry, wait=not args.no_wait)
    except SubmitError as e:
        print(f"recgrid submit: {e}", file=sys.stderr)
        return 1


# ---- what is submitted ------------------------------------------------------------------------------
def cluster_address(address: str | None) -> str:
    """`--address`, else $RAY_ADDRESS: the cluster's dashboard (Job API), e.g. http://head:8265."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise SubmitError("no cluster to submit to: pass --address http://HEAD:8265 (the Ray dashboard's address) "
                          "or set RAY_ADDRESS")
    return address.rstrip("/")


def entrypoint(config_path: str, overrides: list[str]) -> str:
    """The job's command, run in the shipped working directory: the config must be shipped too."""
    cwd = Path.cwd().resolve()
    path = Path(config_path).resolve()
    try:
        rel = path.relative_to(cwd).as_posix()
    except ValueError:
        raise SubmitError(f"{config_path}: the config must lie inside the working directory that is shipped "
                          f"({cwd}); copy it there (e.g. into jobs/) or run recgrid submit from a directory "
                          f"that holds it") from None
    if _ignored(rel):
        raise SubmitError(f"{rel}: the config lies in a path that is not shipped (.gitignore or {EXCLUDES}); "
                          f"move it, e.g. into jobs/")
    args = ["python", "-m", "recgrid.cli", "train", rel] + [a for o in overrides for a in ("--set", o)]
    return shlex.join(args)


def _ignored(rel: str) -> bool:
    parts = Path(rel).parts
    for pattern in EXCLUDES:
        name = pattern.strip("/")
        if (pattern.startswith("/") and parts[0] == name) or (not pattern.startswith("/") and any(
                Path(p).match(name) for p in parts)):
            return True
    if shutil.which("git") is None:
        return False
    # exit 0: ignored; 1: not ignored; 128: not a git work tree
    return subprocess.run(["git", "check-ignore", "-q", rel], capture_output=True).returncode == 0


def job_env(config: JobConfig) -> tuple[dict[str, str], list[str]]:
    """The runtime env's env_vars, and lines telling the user what was and was not forwarded."""
    env = dict(JOB_ENV)
    notes = []
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):  # relative: make it this directory's
            uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).absolute())
        env["MLFLOW_TRACKING_URI"] = uri
    for name in FORWARDED_ENV:
        if os.environ.get(name):
            env[name] = os.environ[name]
    if config.tracking.tracking_uri:
        notes.append(f"MLflow: the run goes to {config.tracking.tracking_uri} (tracking.tracking_uri in the config)")
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


def runtime_env(env_vars: dict[str, str]) -> dict[str, Any]:
    import recgrid

    return {
        "working_dir": str(Path.cwd()),
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
    client sends no token otherwise). Returns where the token comes from."""
    source = token_source()
    if source and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        if "ray._raylet" in sys.modules:  # Ray read its config already: make it read the mode again
            from ray._raylet import Config

            Config.initialize("")
    return source


def _auth_sentence(error: BaseException, address: str, source: str | None) -> str:
    if "Authentication failed" in str(error) or "invalid" in str(error).lower():
        return f"the Ray cluster at {address} refused the token from {source or 'this machine'}: {TOKEN_HELP}."
    return f"the Ray cluster at {address} requires token authentication and no token was found: {TOKEN_HELP}."


# ---- the job ----------------------------------------------------------------------------------------
def submit(config: JobConfig, address: str, entry: str, wait: bool = True) -> int:
    source = enable_token_auth()
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    # the client's INFO lines (packaging, websocket closed) say nothing the job's own log does not
    for name in ("ray", "ray.dashboard.modules.job.sdk", "ray.dashboard.modules.dashboard_sdk"):
        logging.getLogger(name).setLevel(logging.WARNING)

    env_vars, notes = job_env(config)
    try:
        client = JobSubmissionClient(address)
    except AuthenticationError as e:
        raise SubmitError(_auth_sentence(e, address, source)) from None
    except ConnectionError as e:
        raise SubmitError(f"cannot reach the Ray cluster's Job API at {address} ({e}); is the address the head's "
                          f"dashboard (port 8265) and is the cluster up?") from None
    job_id = re.sub(r"[^a-z0-9_-]+", "-", f"recgrid-{config.run_name}-{uuid.uuid4().hex[:8]}".lower())
    say(f"submitting {entry!r} to {address} as job {job_id}; shipping {Path.cwd()} (.gitignore respected; "
        f"no .venv, runs/, caches)")
    for note in notes:
        say(note)
    try:
        client.submit_job(entrypoint=entry, submission_id=job_id, runtime_env=runtime_env(env_vars),
                          metadata={"recgrid.run_name": config.run_name, "recgrid.experiment": config.tracking.experiment})
    except AuthenticationError as e:
        raise SubmitError(_auth_sentence(e, address, source)) from None
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
