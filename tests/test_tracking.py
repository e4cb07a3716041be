"""Tracking against a real SQLite MLflow store in tmp_path: params, metric series, FAILED runs."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from recgrid.tracking import (
    MAX_PARAM_VAL_LENGTH,
    Tracker,
    default_tracking_uri,
    flatten_params,
    resolve_tracking_uri,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    # one database for the module: creating a SQLite store runs MLflow's migrations (seconds)
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'sub' / 'mlflow.db'}"


def test_flatten_params() -> None:
    flat = flatten_params({"grid": {"world_size": 4, "layout": "host-local"}, "model": {"dense_arch": [64, 16]},
                           "x": None, "long": "a" * 10_000})
    assert flat["grid.world_size"] == "4" and flat["grid.layout"] == "host-local"
    assert flat["model.dense_arch"] == "[64, 16]" and flat["x"] == "None"
    assert len(flat["long"]) == MAX_PARAM_VAL_LENGTH and flat["long"].endswith("[truncated]")


def test_run_params_metrics_and_finish(store: str) -> None:
    tracker = Tracker(experiment="t-finish", tracking_uri=store)
    params = {"grid": {"world_size": 4, "num_groups": 2}, "optim": {"lr": 0.01}, "sharding": {"t_C1": "table_wise"}}
    with tracker.start("T4-M2-K1", params=params, tags={"layout": "host-local"}):
        versions = tracker.log_stack_versions()
        for step in (1, 2, 3):
            tracker.log_metrics({"train/loss": 1.0 / step, "train/qps": 100.0 * step, "eval/auc": math.nan}, step=step)
        tracker.log_params({"grid": {"world_size": 4}})  # same value again: fine
        with pytest.raises(ValueError, match="grid.world_size"):
            tracker.log_params({"grid.world_size": 8})

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "T4-M2-K1"
    assert run.data.params["grid.world_size"] == "4" and run.data.params["grid.num_groups"] == "2"
    assert run.data.params["optim.lr"] == "0.01" and run.data.params["sharding.t_C1"] == "table_wise"
    assert run.data.params["versions.torch"] == versions["torch"] != "not installed"
    assert run.data.tags["layout"] == "host-local"
    loss = client.get_metric_history(tracker.run_id, "train/loss")
    assert [(m.step, m.value) for m in sorted(loss, key=lambda m: m.step)] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert len(client.get_metric_history(tracker.run_id, "train/qps")) == 3
    assert math.isnan(client.get_metric_history(tracker.run_id, "eval/auc")[0].value)
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "t-finish" and exp.artifact_location.endswith("/sub/mlartifacts")


def test_a_recovery_event_written_again_by_the_next_logger_reaches_the_run_once(store: str) -> None:
    """A logging worker killed between writing a recovery event and saying so: the next logger gets
    the same step and time from job control (`event_slot`) and repeats the write, which MLflow
    stores once; a later event goes at a later step; a logged event is nobody's to write again."""
    from recgrid.train.control import JobControlImpl

    control = JobControlImpl()
    tracker = Tracker(experiment="t-event", tracking_uri=store)
    with tracker.start("events"):
        first = control.event_slot(0, 40)
        tracker.log_metrics({"recovery/count": 1, "recovery/seconds": 7.5}, *first)  # ... and killed here
        assert control.event_slot(0, 60) == first  # the next logger, at its own step 60
        tracker.log_metrics({"recovery/count": 1, "recovery/seconds": 7.5}, *first)
        control.event_logged(0)
        assert control.event_slot(0, 70) is None
        second = control.event_slot(1, 40)  # logged at the same call as the first, say
        assert second[0] == 41
        tracker.log_metrics({"recovery/count": 2, "recovery/seconds": 3.0}, *second)
    client = MlflowClient(tracking_uri=store)
    history = client.get_metric_history(tracker.run_id, "recovery/count")
    assert sorted((m.step, m.value) for m in history) == [(40, 1.0), (41, 2.0)]
    assert client.get_run(tracker.run_id).data.metrics["recovery/count"] == 2


def test_exception_marks_run_failed_with_error(store: str) -> None:
    tracker = Tracker(experiment="t-fail", tracking_uri=store)
    with pytest.raises(RuntimeError, match="worker 3 died"):
        with tracker.start("boom", params={"a": 1}):
            tracker.log_metrics({"train/loss": 0.7}, step=1)
            raise RuntimeError("worker 3 died")
    client = MlflowClient(tracking_uri=store)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == "RuntimeError: worker 3 died"
    text = client.download_artifacts(tracker.run_id, "error.txt")
    with open(text) as f:
        assert "Traceback" in f.read()


def test_fail_with_message_and_no_run(store: str) -> None:
    Tracker(tracking_uri=store).fail("never started")  # no run: nothing to mark, no error
    tracker = Tracker(experiment="t-fail", tracking_uri=store).start("bad-config")
    tracker.fail("optim.lr: must be > 0, got -0.1")
    tracker.finish()  # already ended: stays FAILED
    run = MlflowClient(tracking_uri=store).get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.data.tags["error"].startswith("optim.lr:")


def test_attach_logs_into_the_same_run(store: str) -> None:
    driver = Tracker(experiment="t-attach", tracking_uri=store).start("x", params={"grid": {"num_groups": 2}})
    rank0 = Tracker.attach(driver.run_id, tracking_uri=store)
    rank0.log_metrics({"eval/ne": 0.8}, step=5)
    rank0.log_params({"grid.num_groups": 2})  # known already: no conflict
    driver.finish()
    client = MlflowClient(tracking_uri=store)
    assert client.get_metric_history(driver.run_id, "eval/ne")[0].value == 0.8
    assert client.get_run(driver.run_id).info.status == "FINISHED"


def _start_a_run(uri: str, barrier, results) -> None:
    try:
        tracker = Tracker(experiment="t-race", tracking_uri=uri)
        barrier.wait()  # every process opens the new store at the same moment
        with tracker.start("race"):
            pass
        results.put("ok")
    except BaseException as e:
        results.put(f"{type(e).__name__}: {e}"[:300])


def test_processes_that_open_one_new_sqlite_store_at_once_all_start_their_runs(tmp_path) -> None:
    # forked, so each process opens the store at once instead of after seconds of importing MLflow
    import importlib
    import multiprocessing

    importlib.import_module("mlflow.store.tracking.sqlalchemy_store")  # before the fork, not in each child
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_start_a_run, args=(uri, barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert outcomes == ["ok"] * 4
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("t-race").experiment_id])
    assert len(runs) == 4 and {r.info.status for r in runs} == {"FINISHED"}


def test_the_runs_datasets_are_its_training_and_eval_data(store: str, tmp_path, monkeypatch) -> None:
    """The run's Datasets: one per context, named by the globs, the rows in the profile, and a
    digest of the file list that changes when a file changes (size or mtime), not otherwise."""
    import json
    import os

    from recgrid.data.units import Inputs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train" / "day0").mkdir(parents=True)
    (tmp_path / "eval").mkdir()
    for name, text in (("train/a.tsv", "x\n" * 3), ("train/day0/b.tsv", "x\n" * 5), ("eval/c.tsv", "x\n" * 2)):
        (tmp_path / name).write_text(text)
    train = Inputs((str(tmp_path / "train/a.tsv"), str(tmp_path / "train/day0/b.tsv")), (3, 5))
    evals = Inputs((str(tmp_path / "eval/c.tsv"),), (2,))

    def logged(data) -> dict:
        tracker = Tracker(experiment="t-inputs", tracking_uri=store).start("x")
        returned = tracker.log_inputs(data)
        run = MlflowClient(tracking_uri=store).get_run(tracker.run_id)
        out = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs
               if [t.key for t in i.tags] == ["mlflow.data.context"]}
        assert {c: (d.name, d.digest) for c, d in returned.items()} == {c: (d.name, d.digest) for c, d in out.items()}
        return out

    first = logged({"training": (["train/**/*.tsv"], train), "eval": (["eval/*.tsv", "eval/none-*.tsv"], evals)})
    assert set(first) == {"training", "eval"}
    assert first["training"].name == "train/**/*.tsv" and first["eval"].name == "eval/*.tsv, eval/none-*.tsv"
    assert json.loads(first["training"].profile) == {"num_rows": 8, "num_files": 2, "num_bytes": 16}
    assert json.loads(first["eval"].profile)["num_rows"] == 2
    assert json.loads(first["training"].source) == {"uri": f"{tmp_path}/train/**/*.tsv"}
    assert first["training"].source_type == "local" and first["training"].digest != first["eval"].digest
    assert logged({"training": (["train/**/*.tsv"], train)})["training"].digest == first["training"].digest
    os.utime(tmp_path / "train/day0/b.tsv", ns=(0, 0))  # same bytes, another mtime: another digest
    second = logged({"training": (["train/**/*.tsv"], train), "eval": (["eval/*.tsv"], evals)})
    assert second["training"].digest != first["training"].digest and second["eval"].digest == first["eval"].digest


def test_uri_resolution_env_var_wins_over_default(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri() == default_tracking_uri()
    assert default_tracking_uri().startswith("sqlite:////") and default_tracking_uri().endswith("/runs/mlflow.db")

    env_uri = f"sqlite:///{tmp_path / 'env' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env_uri)
    tracker = Tracker(experiment="t-env")
    assert tracker.tracking_uri == env_uri
    tracker.start("from-env").finish()
    assert (tmp_path / "env" / "mlflow.db").is_file()
    assert MlflowClient(tracking_uri=env_uri).get_run(tracker.run_id).info.status == "FINISHED"
    assert Tracker(tracking_uri="sqlite:///elsewhere.db").tracking_uri == "sqlite:///elsewhere.db"  # explicit wins

    cmd = shlex.split(tracker.ui_command())
    assert cmd[0].endswith("mlflow") and cmd[1:] == ["ui", "--backend-store-uri", env_uri]


def test_experiments_open_on_their_runs_and_runs_can_have_a_parent(store: str) -> None:
    """MLflow 3's UI shows an experiment without `mlflow.experimentKind = custom_model_development`
    as a GenAI overview of traces: new experiments carry it, existing ones get it."""
    import json

    from recgrid.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, RUNS_VIEW_KEY

    client = MlflowClient(tracking_uri=store)
    parent = Tracker(experiment="t-kind", tracking_uri=store).start("sweep")
    assert client.get_experiment(parent.experiment_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    child = Tracker(experiment="t-kind", tracking_uri=store).start("T4-M2-K1", parent_run_id=parent.run_id)
    assert client.get_run(child.run_id).data.tags["mlflow.parentRunId"] == parent.run_id
    assert "mlflow.parentRunId" not in client.get_run(parent.run_id).data.tags
    # MLflow 3.17's UI shows GenAI views unless the page's URL asks for the training view
    assert parent.ui_url("artifacts") == (f"http://127.0.0.1:5000/#/experiments/{parent.experiment_id}/runs/"
                                          f"{parent.run_id}/artifacts?workflowType=machine_learning")
    # the runs list opens on a view (shared through an experiment tag) with the columns that matter
    assert parent.experiment_url() == (f"http://127.0.0.1:5000/#/experiments/{parent.experiment_id}/runs"
                                       f"?workflowType=machine_learning&viewStateShareKey={RUNS_VIEW_KEY}")
    view = json.loads(client.get_experiment(parent.experiment_id).tags[f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"])
    assert {"metrics.`eval/ne`", "metrics.`train/qps_median`", "params.`grid.num_groups`"} <= set(view["selectedColumns"])
    compare = parent.compare_url([child.run_id, parent.run_id])  # MLflow's compare-runs page, runs as JSON
    route, query = compare.split("#", 1)[1].split("?", 1)
    from urllib.parse import parse_qs

    assert route == "/compare-runs" and json.loads(parse_qs(query)["runs"][0]) == [child.run_id, parent.run_id]
    assert json.loads(parse_qs(query)["experiments"][0]) == [parent.experiment_id]
    hint = parent.ui_hint()  # a local store: start the UI first
    assert hint.startswith("MLflow: run `") and "ui --backend-store-uri" in hint and hint.endswith(parent.ui_url())
    old = client.create_experiment("t-kind-old")  # made by hand, or before recgrid tagged experiments
    client.set_experiment_tag(old, EXPERIMENT_KIND_TAG, "genai_development")
    Tracker(experiment="t-kind-old", tracking_uri=store).start("x")
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert f"mlflow.sharedViewState.{RUNS_VIEW_KEY}" in client.get_experiment(old).tags


def test_system_metrics_of_the_node_go_into_the_run(store: str) -> None:
    import time

    from recgrid.tracking import start_system_metrics, stop_system_metrics

    tracker = Tracker(experiment="t-system", tracking_uri=store).start("x")
    monitor = start_system_metrics(tracker.run_id, "node-a", store, sampling_interval_s=0.2)
    assert monitor is not None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = MlflowClient(tracking_uri=store).get_run(tracker.run_id).data.metrics
        if "system/node-a/cpu_utilization_percentage" in metrics:
            break
        time.sleep(0.2)
    # a node that stops before its first interval ends still logs the sample it took (MLflow drops it)
    short = start_system_metrics(tracker.run_id, "node-b", store, sampling_interval_s=60)
    time.sleep(0.5)
    stop_system_metrics(short)
    stop_system_metrics(monitor)
    tracker.finish()
    names = MlflowClient(tracking_uri=store).get_run(tracker.run_id).data.metrics
    assert {"system/node-a/cpu_utilization_percentage", "system/node-a/system_memory_usage_megabytes"} <= names.keys()
    assert "system/node-b/cpu_utilization_percentage" in names


def test_credentials_in_a_tracking_uri_are_never_logged_or_printed(store: str, monkeypatch, capsys) -> None:
    """A `user:pass@` URI (issue 18): masked in params, tags, error texts, UI links and what submit
    forwards or prints; only the MLflow client gets it whole."""
    from recgrid.config import load_config
    from recgrid.launch.submit import job_env
    from recgrid.tracking import has_credentials, redact_uri

    secret_uri = "https://alice:s3cret-pw@mlflow.example.com:5000/"
    assert redact_uri(f"at {secret_uri} and postgresql://u:pw@db/x") == \
        "at https://***@mlflow.example.com:5000/ and postgresql://***@db/x"
    assert redact_uri("http://tok3n@h:1", keep="") == "http://h:1"
    assert redact_uri("http://jobs:s3cr@tP4ss@mlflow and http://h/a@b") == "http://***@mlflow and http://h/a@b"
    assert has_credentials(secret_uri) and not has_credentials("https://mlflow.example.com/?a=b@c")

    tracker = Tracker(experiment="t-creds", tracking_uri=store)
    with tracker.start("creds", params={"tracking": {"tracking_uri": secret_uri}}, tags={"uri": secret_uri}):
        tracker.fail(RuntimeError(f"cannot reach {secret_uri}"))
    run = MlflowClient(tracking_uri=store).get_run(tracker.run_id)
    logged = " ".join([*run.data.params.values(), *run.data.tags.values()])
    assert "s3cret-pw" not in logged and "alice" not in logged
    assert run.data.params["tracking.tracking_uri"] == "https://***@mlflow.example.com:5000/"

    remote = Tracker(experiment="t", tracking_uri=secret_uri)  # no request is made until the client is used
    remote.run_id, remote.experiment_id = "r1", "1"
    assert remote.tracking_uri == secret_uri  # the client still authenticates with it
    shown = " ".join([remote.display_uri, remote.ui_command(), remote.ui_url()])
    assert "s3cret-pw" not in shown and "alice" not in shown and "mlflow.example.com:5000" in shown

    monkeypatch.setenv("MLFLOW_TRACKING_URI", secret_uri)
    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "jobs" / "local_demo.yaml", [f"tracking.tracking_uri={secret_uri}"], check_paths=False)
    env, notes = job_env(cfg)
    assert env["MLFLOW_TRACKING_URI"] == "https://mlflow.example.com:5000/"  # forwarded without its credentials
    assert "s3cret-pw" not in " ".join([*env.values(), *notes]) and "alice" not in " ".join(notes)
    assert any("MLFLOW_TRACKING_USERNAME" in n for n in notes)


def test_query_string_tokens_are_redacted_in_params_tags_errors_and_what_is_said(store: str, capsys) -> None:
    """Issue 47: a presigned URL's X-Amz-Credential and X-Amz-Signature, a SAS `sig`, a `?token=` are
    masked wherever recgrid logs or prints a URI (params, tags, the FAILED run's error, the driver's
    lines); the rest of the query string stays; `strip_credentials` drops them from a URI passed on."""
    import json

    from recgrid.launch.report import say
    from recgrid.tracking import has_credentials, strip_credentials

    presigned = "https://b.s3.amazonaws.com/day_0?X-Amz-Credential=AKIAX%2F2026&X-Amz-Signature=f00d&versionId=7"
    sas = "https://a.blob.core.windows.net/c/day_1?sv=2020-08-04&sig=s3cr3t"
    tracker = Tracker(experiment="t-tokens", tracking_uri=store).start(
        "x", params={"data": {"train": [presigned, sas]}}, tags={"source": "https://h.example.com/x?token=t0k"})
    tracker.fail(RuntimeError(f"cannot read {presigned}"))
    client = MlflowClient(tracking_uri=store)
    run = client.get_run(tracker.run_id)
    logged = json.dumps([run.data.params, run.data.tags]) + Path(
        client.download_artifacts(tracker.run_id, "error.txt", str(Path(store[len("sqlite:///"):]).parent))).read_text()
    say(f"data: reading {presigned} and {sas}")
    printed = capsys.readouterr().out
    for secret in ("AKIAX", "f00d", "s3cr3t", "t0k"):
        assert secret not in logged and secret not in printed, secret
    assert "X-Amz-Signature=***&versionId=7" in run.data.params["data.train"] and "sv=2020-08-04&sig=***" in printed
    assert has_credentials(presigned) and not has_credentials("sqlite:///runs/mlflow.db?timeout=20")
    assert strip_credentials(presigned) == "https://b.s3.amazonaws.com/day_0?versionId=7"
    assert strip_credentials("https://u:pw@h.example.com/x?token=t0k#top") == "https://h.example.com/x#top"


def test_a_local_stores_artifacts_are_this_users_only(tmp_path) -> None:
    """Issue 47: what a run stores beside a local SQLite database (its artifacts: the summary, the
    error, the model) is 0600 in 0700 directories, as checkpoints are, whatever the umask."""
    import os

    store = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    tracker = Tracker(experiment="t-private", tracking_uri=store).start("x")
    tracker.log_text("NE 0.6", "summary/table.md")
    tracker.fail("it stopped")
    root = tmp_path / "runs" / "mlartifacts"
    modes = {p: os.stat(p).st_mode & 0o777 for p in [root, *root.rglob("*")]}
    assert any(p.name == "table.md" for p in modes) and any(p.name == "error.txt" for p in modes)
    wrong = {str(p): oct(m) for p, m in modes.items() if m != (0o700 if p.is_dir() else 0o600)}
    assert not wrong, wrong
