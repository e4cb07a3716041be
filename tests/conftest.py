"""Session hooks for the whole suite."""

from __future__ import annotations

import os
import sys

import pytest

from faults import TRAIN_SUITE_ENV

# every Ray cluster the suite starts inherits this process's environment: Ray Train's controllers
# of local jobs (recgrid's own clusters, `ray start`) run as the test clusters' runtime env says
for _name, _value in TRAIN_SUITE_ENV.items():
    os.environ.setdefault(_name, _value)

_EXIT = {"status": 0}


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real `mlflow server` with k8s/'s basic-auth settings for the whole session (tests/mlflow_server.py)."""
    import mlflow_server as ms

    server = ms.start(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without the interpreter's own teardown, with pytest's exit status.

    The suite starts and shuts down a dozen Ray sessions (and Ray Train, gloo and MLflow threads
    with them) in this one process. Native threads left by an earlier session can crash the
    interpreter's teardown (ray-project/ray#31145): seen once in CI as a SIGSEGV after every test
    had passed and the summary was printed, which turned a green run into a failed `make test`.
    Every result is reported by the time this runs, so nothing is lost by skipping that teardown."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT["status"])
