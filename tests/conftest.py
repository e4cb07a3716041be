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

# Modules whose in-process jobs share one local Ray cluster: the one `recgrid train` starts for the
# demo job (`shared_ray`). They run one after another, so that cluster starts once (each start, with
# its first Ray Data stream, cost a module 15-20 s). Modules that start a cluster of their own (other
# shapes, nodes, `ray start`) run before them, but LATE_MODULES after them, and shut theirs down.
SHARED_CLUSTER_MODULES = ("test_compare.py", "test_data_prepare.py", "test_data_streams.py",
                          "test_launcher.py", "test_max_failures.py", "test_torchft.py")
# Every module that starts Ray (the shared cluster, clusters of nodes of its own, `ray start`, a metrics
# session). `make test` runs the suite on two pytest-xdist workers: these modules all on one, one after
# another in the order above (the Ray jobs: the suite's long critical path, two clusters at once would
# starve both), and every other module, whole, on the other one beside them (the planner, the
# simulator, the engine over gloo, the manifests: mostly one core's work, which left the second core
# idle while they ran alone). `pytest_xdist_make_scheduler` below makes those work units.
RAY_MODULES = SHARED_CLUSTER_MODULES + ("test_dashboard.py", "test_interrupt.py", "test_recovery_nodes.py",
                                        "test_submit.py")
# Ray modules that run last, after the shared cluster's: their jobs lose nodes and wait on Ray's and
# torchft's failure detection, which stretched under the Ray-free modules' load when they ran first
# (test_recovery_nodes.py: 508 s there, 290 s alone), and the Ray-free modules are done by then. As a
# work unit of their own, beside the shared cluster's jobs, they were worse: two Ray clusters at once
# (test_recovery_nodes.py 1010 s with 2 failures and an error, test_launcher.py's jobs 519 s against 241 s).
LATE_MODULES = ("test_recovery_nodes.py",)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    # stable: the order within each part stays
    items.sort(key=lambda item: (item.path.name in LATE_MODULES, item.path.name in SHARED_CLUSTER_MODULES))


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's scope scheduling with the scopes above: "ray" for every RAY_MODULES test, the
    module otherwise (its fixtures built once). pytest-xdist queues the units with most tests first
    and hands each worker two at the start: "ray" (96 tests) is second to test_k8s.py (109), so it
    starts at once on the other worker, with test_config.py (38, quick) queued behind it; the rest
    go to whichever worker has fewer than two units waiting, in practice the first.
    (`--dist loadgroup` would need the group in each test's node id, which pytest-xdist 3.8 can no
    longer write under pytest 9.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RayApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return "ray" if module in RAY_MODULES else module

    return RayApart(config, log)


@pytest.fixture(scope="session")
def shared_ray(mlflow_server):
    """The local cluster `recgrid train jobs/local_demo.yaml` starts (`launch.ray.connect_ray`: its
    CPUs, system config and workers' env vars), for the SHARED_CLUSTER_MODULES; jobs run on it
    one after another, as on any cluster. Its workers get the suite's MLflow server credentials
    in their environment, as the Ray pods get them from their Secret."""
    import ray

    from recgrid.config import load_config
    from recgrid.launch.ray import connect_ray

    if ray.is_initialized():  # a module that runs before the group left its cluster up
        ray.shutdown()
    old = {k: os.environ.get(k) for k in mlflow_server.client_env()}
    os.environ.update(mlflow_server.client_env())  # the raylet's environment, which its workers inherit
    os.environ.pop("RAY_ADDRESS", None)
    try:
        connect_ray(load_config(os.path.join(os.path.dirname(__file__), "..", "jobs", "local_demo.yaml")))
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    yield
    ray.shutdown()


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
