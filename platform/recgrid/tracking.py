"""MLflow tracking: one training job is one MLflow run, written from one place.

This module owns where runs are stored (the tracking URI and the artifact location), how a
job's config becomes MLflow params (nested dicts flattened to dotted keys, values
stringified and cut to MLflow's limits), batched metric logging, and the run's end state:
FINISHED, or FAILED with the error text. `Tracker` is small enough to live on the driver or
on rank 0; `Tracker.attach(run_id)` lets a second process log into a run the first created.
It also owns the run's views in MLflow's UI (`Tracker.ui_url`, `Tracker.ui_hint`, the shared
runs-list view `RUNS_VIEW_COLUMNS`), a sweep's parent run, the run's Datasets
(`Tracker.log_inputs`) and the per-node system metrics (`start_system_metrics`).

Where runs go, first match wins:
  1. `tracking_uri` passed to `Tracker` (the job config's `tracking.tracking_uri`);
  2. the `MLFLOW_TRACKING_URI` environment variable (e.g. a cluster's tracking server);
  3. `sqlite:///<repo>/runs/mlflow.db`, artifacts in `<repo>/runs/mlartifacts`
     (MLflow 3 refuses the plain file store, so the local default is a SQLite file).

A URI's credentials (`user:pass@`, and a query string's tokens and signatures) never leave this
module in what it prints or logs: `redact_uri` masks them and `strip_credentials` drops them;
only the MLflow client itself is given the full URI. The artifacts it writes to a local store
are this user's only (`private_tree`: 0600 files in 0700 directories), as checkpoints are.

mlflow is imported inside the class, so importing this module is free.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform as _platform
import re
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from recgrid.data.units import Inputs

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNS_DIR = REPO_ROOT / "runs"
DEFAULT_EXPERIMENT = "recgrid"
ARTIFACTS_DIRNAME = "mlartifacts"
# MLflow 3's UI opens an experiment without this tag (or with "genai_development") as a GenAI
# overview of traces; "custom_model_development" is the kind for training runs
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
PARENT_RUN_TAG = "mlflow.parentRunId"
# ... but MLflow 3.17's UI itself picks its GenAI or model-training view from a browser-wide toggle
# (default GenAI, remembered in the browser), or from this in the page's URL
UI_TRAINING_VIEW = "workflowType=machine_learning"
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
# The runs list's columns: MLflow 3.17's UI keeps a view (columns, order) it was asked to share in
# the experiment tag `mlflow.sharedViewState.<key>` (JSON) and opens it from `viewStateShareKey=<key>`
# in the page's URL. Column names are `<params|metrics>.`<key>``, as the UI writes them.
RUNS_VIEW_KEY = "recgrid"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"
RUNS_VIEW_COLUMNS = ("metrics.`eval/ne`", "metrics.`eval/auc`", "metrics.`train/qps_median`",
                     "params.`grid.num_groups`", "params.`grid.sync_every`", "params.`grid.world_size`",
                     "attributes.`Duration`")

# MLflow's limits (mlflow/utils/validation.py), restated so we cut values before it refuses them.
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_KEY_LENGTH = 250
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_DATASET_NAME_LENGTH = 500
DATASET_DIGEST_LENGTH = 16  # hex digits; MLflow allows 36

# distribution names to try for each component of the stack, first installed one wins
STACK: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "torchrec": ("torchrec", "torchrec-nightly", "torchrec-nightly-cpu"),
    "fbgemm_gpu": ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu"),
    "ray": ("ray",),
    "mlflow": ("mlflow", "mlflow-skinny"),
}


def default_tracking_uri() -> str:
    """The local default store: a SQLite file under the repository's run directory."""
    return f"sqlite:///{RUNS_DIR / 'mlflow.db'}"


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """The explicit URI, else `MLFLOW_TRACKING_URI`, else `default_tracking_uri()`."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


# the userinfo of any URL in a text: `scheme://user:pass@` or `scheme://token@`, up to the authority's
# LAST `@` (a password may hold a raw `@`)
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s]+)@")


# a query-string parameter named for a secret (`token`, `access_token`, `X-Amz-Signature`, `X-Amz-Credential`,
# `X-Amz-Security-Token`, a SAS `sig`, `password`, `api_key`, ...) and its value
_SECRET_PARAM = re.compile(r"(?P<name>[?&;][A-Za-z0-9_.-]*(?:token|secret|passw|pwd|signature|credential|key|\bsig)"
                           r"[A-Za-z0-9_.-]*=)(?P<value>[^&#\s'\"]+)", re.IGNORECASE)


def redact_uri(text: str, keep: str = "***@") -> str:
    """`text` with the credentials of every URL in it replaced by `keep` (`***@`; "" drops them) and the
    value of every query parameter named for a secret by `***`."""
    return _SECRET_PARAM.sub(lambda m: m.group("name") + "***", _USERINFO.sub(lambda m: m.group("scheme") + keep, text))


def strip_credentials(uri: str) -> str:
    """`uri` without its user and password and without its query parameters named for a secret (what is
    passed on to another machine, which must hold credentials of its own)."""
    uri = _USERINFO.sub(lambda m: m.group("scheme"), uri)
    base, mark, query = uri.partition("?")
    query, hash_mark, fragment = query.partition("#")
    kept = [p for p in query.split("&") if p and not _SECRET_PARAM.fullmatch(f"?{p}")]
    return base + (mark if kept else "") + "&".join(kept) + hash_mark + fragment


def has_credentials(text: str) -> bool:
    """Whether a URL in `text` carries a user or password, or a query parameter named for a secret."""
    return _USERINFO.search(text) is not None or _SECRET_PARAM.search(text) is not None


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI; None for other stores and in-memory SQLite."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def _open_client(tracking_uri: str) -> Any:
    """An `MlflowClient` on `tracking_uri`, its store opened. The first open of a new SQLite file creates
    MLflow's schema, and processes creating it at once fail all but one (SQLAlchemy's `table ... already
    exists`), so recgrid's processes open a SQLite store in turn, through a lock file beside it."""
    from mlflow.tracking import MlflowClient

    db = _sqlite_path(tracking_uri)
    if db is None:
        return MlflowClient(tracking_uri=tracking_uri)
    import fcntl

    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return MlflowClient(tracking_uri=tracking_uri)


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts → `{"a.b.c": "value"}` with every value stringified and cut to MLflow's limit."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, prefix=f"{name}."))
            continue
        if len(name) > MAX_KEY_LENGTH:
            raise ValueError(f"param key {name[:60]!r}... is {len(name)} characters; MLflow allows {MAX_KEY_LENGTH}")
        flat[name] = _cut(redact_uri(str(value)), MAX_PARAM_VAL_LENGTH)
    return flat


def stack_versions() -> dict[str, str]:
    """Installed versions of python, torch, torchrec, fbgemm_gpu, ray and mlflow, without importing them."""
    out = {"python": _platform.python_version()}
    for name in STACK:
        found = _installed(name)
        out[name] = found[1] if found else "not installed"
    return out


def _installed(name: str) -> tuple[str, str] | None:
    """(distribution, version) of STACK entry `name` as installed here, or None."""
    for d in STACK[name]:
        try:
            return d, importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def private_directory(path: Path) -> None:
    """`path` made (or kept) a directory only this user may enter (0700): MLflow writes the files under
    it with the umask's modes."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def private_tree(path: str | Path) -> None:
    """`path` and every directory under it 0700, every file 0600, as checkpoints are (model weights and
    run artifacts on a shared host); links are left alone, never followed."""
    os.chmod(path, 0o700)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = os.path.join(root, name)
            if not os.path.islink(entry):
                os.chmod(entry, 0o700 if name in dirs else 0o600)


def private_artifacts(artifact_uri: str | None, root_uri: str | None = None) -> None:
    """The local artifact directory `artifact_uri` (a run's, a logged model's) `private_tree`d, and the
    directories between it and the store's artifact root `root_uri` made 0700; an artifact store
    elsewhere (a tracking server's) keeps its own modes."""
    from urllib.parse import unquote, urlsplit

    if not artifact_uri or not artifact_uri.startswith("file://"):
        return
    path = Path(unquote(urlsplit(artifact_uri).path))
    if not path.is_dir():
        return
    private_tree(path)
    root = Path(unquote(urlsplit(root_uri).path)) if root_uri and root_uri.startswith("file://") else None
    while root is not None and root in path.parents:
        path = path.parent
        os.chmod(path, 0o700)


def _cut(text: str, limit: int) -> str:
    marker = "...[truncated]"
    return text if len(text) <= limit else text[: limit - len(marker)] + marker


class Tracker:
    """One job's MLflow run.

    Typical use (the driver, or rank 0 only):

        tracker = Tracker(experiment="recgrid")
        with tracker.start("T4-M2-K1", params=config.to_flat_dict(), tags={"layout": "host-local"}):
            tracker.log_stack_versions()
            tracker.log_metrics({"train/loss": 0.5}, step=10)
        # FINISHED on normal exit; FAILED with the error on an exception, which propagates.
        print(tracker.ui_command())
    """

    def __init__(self, experiment: str = DEFAULT_EXPERIMENT, tracking_uri: str | None = None) -> None:
        self.experiment = experiment
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        db = _sqlite_path(self.tracking_uri)
        # new experiments in a local SQLite store keep their artifacts beside the database;
        # a tracking server decides for itself
        self.artifact_location: str | None = (db.parent / ARTIFACTS_DIRNAME).resolve().as_uri() if db else None
        if db:
            db.parent.mkdir(parents=True, exist_ok=True)
            private_directory(db.parent / ARTIFACTS_DIRNAME)  # what runs store: only this user may enter
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._params: dict[str, str] = {}
        self._ended = False
        self._client: Any = None

    # ---- the store ------------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        """The `MlflowClient` on this tracker's URI (created on first use)."""
        if self._client is None:
            # the first open of a new SQLite store runs dozens of schema migrations, each logged
            for name in ("alembic", "mlflow.store.db.utils"):
                logging.getLogger(name).setLevel(logging.WARNING)
            self._client = _open_client(self.tracking_uri)
        return self._client

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                return self.client.create_experiment(self.experiment, artifact_location=self.artifact_location,
                                                     tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND,
                                                           RUNS_VIEW_TAG: runs_view()})
            except MlflowException:  # another job created it a moment ago
                exp = self.client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:  # made before the tag, by hand, or by the UI's guess
            self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        if exp.tags.get(RUNS_VIEW_TAG) != runs_view():
            self.client.set_experiment_tag(exp.experiment_id, RUNS_VIEW_TAG, runs_view())
        return exp.experiment_id

    # ---- the run --------------------------------------------------------------------------------
    def start(
        self,
        run_name: str | None = None,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
    ) -> "Tracker":
        """Create the run (status RUNNING) and log `params` (flattened) and `tags`; with
        `parent_run_id`, the run is that run's child (a sweep's configuration). Returns self."""
        if self.run_id is not None:
            raise RuntimeError(f"this tracker already has run {self.run_id}; one Tracker is one run")
        if parent_run_id:
            tags = {**(tags or {}), PARENT_RUN_TAG: parent_run_id}
        self.experiment_id = self._experiment_id()
        run = self.client.create_run(
            self.experiment_id,
            run_name=run_name,
            tags={k: _cut(redact_uri(str(v)), MAX_TAG_VAL_LENGTH) for k, v in (tags or {}).items()},
        )
        self.run_id = run.info.run_id
        if params:
            self.log_params(params)
        return self

    @classmethod
    def attach(cls, run_id: str, tracking_uri: str | None = None) -> "Tracker":
        """A tracker that logs into an existing run (e.g. rank 0 logging into the driver's run)."""
        tracker = cls(tracking_uri=tracking_uri)
        run = tracker.client.get_run(run_id)
        tracker.run_id, tracker.experiment_id = run_id, run.info.experiment_id
        tracker._params = dict(run.data.params)
        return tracker

    def _require_run(self) -> str:
        if self.run_id is None:
            raise RuntimeError("no run: call Tracker.start() first")
        return self.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params, nested dicts flattened to dotted keys. Re-logging an equal value is a no-op;
        a different value for a logged key is an error (MLflow params are immutable)."""
        from mlflow.entities import Param

        run_id = self._require_run()
        new: list[Param] = []
        for key, value in flatten_params(params).items():
            if key in self._params:
                if self._params[key] != value:
                    raise ValueError(f"param {key!r} is already {self._params[key]!r}; cannot change it to {value!r}")
                continue
            self._params[key] = value
            new.append(Param(key, value))
        for i in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=new[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_stack_versions(self) -> dict[str, str]:
        """Log `stack_versions()` as params `versions.<name>`; returns them."""
        versions = stack_versions()
        self.log_params({"versions": versions})
        return versions

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        run_id = self._require_run()
        items = [RunTag(k, _cut(redact_uri(str(v)), MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, tags=items[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Log one point of each metric series at `step`, in as few requests as MLflow allows.
        None values are skipped; NaN is stored as NaN. With `timestamp_ms` the points carry that
        time: the same write repeated is stored once (MLflow keys a point by key, time, step, value)."""
        from mlflow.entities import Metric

        run_id = self._require_run()
        now = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        items = [Metric(k, float(v), now, int(step)) for k, v in metrics.items() if v is not None]
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=items[i:i + MAX_METRICS_PER_BATCH])

    def log_interval_medians(self, step: int) -> dict[str, float]:
        """Log the median over the run's logging intervals of QPS, step time and lookup imbalance
        (`<name>_median` at `step`): the run's typical figures, which an interval holding an
        epoch's start-up, an evaluation or a restart does not skew. The summary and `compare`
        show these, so both quote the same statistic."""
        import statistics

        out = {}
        for name in ("train/qps", "train/step_time_s", "imbalance/lookup_max_over_mean"):
            values = [m.value for m in self.client.get_metric_history(self._require_run(), name)]
            if values:
                out[f"{name}_median"] = statistics.median(values)
        self.log_metrics(out, step)
        return out

    def log_inputs(self, data: Mapping[str, tuple[Sequence[str], "Inputs"]]) -> dict[str, Any]:
        """Log the data the job reads as the run's Datasets (MLflow run inputs), one per context
        ("training", "eval"): `data` maps a context to the globs as the config names them and the
        files they expanded to with their row counts (`data.units.Inputs`). A Dataset is named by
        its globs, its source is their absolute form, its profile holds the rows, files and bytes,
        and its digest is a hash of the file list: each file's absolute path, size and modification
        time, in order (not the bytes: the 1TB dataset's would take an hour to read), so a run that
        read other or changed files shows another digest. Returns each context's
        `mlflow.entities.Dataset`."""
        import hashlib
        import json

        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        run_id = self._require_run()
        out: dict[str, Any] = {}
        for context, (globs, inputs) in data.items():
            if not globs:
                raise ValueError(f"the {context} data names no glob")
            uris = [redact_uri(g) if "://" in g else os.path.abspath(os.path.expanduser(g)) for g in globs]
            stats = [(os.path.abspath(f), (st := os.stat(f)).st_size, st.st_mtime_ns) for f in inputs.files]
            out[context] = Dataset(
                name=_cut(redact_uri(", ".join(globs)), MAX_DATASET_NAME_LENGTH),
                digest=hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:DATASET_DIGEST_LENGTH],
                source_type=uris[0].partition("://")[0] if "://" in uris[0] else "local",
                # MLflow's form of a file system source for one glob; a list for several
                source=json.dumps({"uri": uris[0]} if len(uris) == 1 else {"uris": uris}),
                profile=json.dumps({"num_rows": inputs.total_rows, "num_files": len(stats),
                                    "num_bytes": sum(size for _, size, _ in stats)}),
            )
        self.client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])
                                                 for context, dataset in out.items()])
        return out

    def log_model(self, pyfunc: Mapping[str, Any], *, step: int, register_as: str | None = None,
                  params: Mapping[str, Any] | None = None) -> Any:
        """Log an MLflow pyfunc model (`pyfunc`: `mlflow.pyfunc.log_model`'s arguments that make it: a
        model from code, its artifacts, code paths, signature, input example and requirements) as an
        MLflow 3 logged model of the run, named "model", at `step` (MLflow links the run's metrics of
        that step to it: the final evaluation's), and, with `register_as`, as a new version of that
        registered model. Written 0600 in 0700 directories where the artifacts are local. Returns
        MLflow's `ModelInfo` (`model_id`, `model_uri`, `registered_model_version`)."""
        import mlflow
        import mlflow.pyfunc
        from mlflow.entities import LoggedModelStatus
        from mlflow.models import Model

        run_id = self._require_run()
        mlflow.set_tracking_uri(self.tracking_uri)
        # made here, in the run's experiment (MLflow's own call would put it in the process's current one)
        logged = self.client.create_logged_model(self.experiment_id or self.client.get_run(run_id).info.experiment_id,
                                                 name="model", source_run_id=run_id,
                                                 params={k: redact_uri(str(v)) for k, v in (params or {}).items()} or None)
        # Model.log, which mlflow.pyfunc.log_model calls, takes the run (log_model only the active one)
        info = Model.log(artifact_path=None, name="model", flavor=mlflow.pyfunc, registered_model_name=register_as, step=int(step),
                         run_id=run_id, model_id=logged.model_id, **pyfunc)
        if self.client.get_logged_model(logged.model_id).status != LoggedModelStatus.READY:
            self.client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
        private_artifacts(self.client.get_logged_model(logged.model_id).artifact_location, self.artifact_location)
        return info

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store `text` as an artifact of the run (e.g. the summary table, the resolved config)."""
        self.client.log_text(self._require_run(), text, artifact_file)
        private_artifacts(self.client.get_run(self._require_run()).info.artifact_uri, self.artifact_location)

    def finish(self) -> None:
        """Mark the run FINISHED (once; later calls do nothing)."""
        self._end("FINISHED")

    def fail(self, error: BaseException | str) -> None:
        """Mark the run FAILED with the error: tag `error` (one line) and artifact `error.txt`
        (the full traceback). Without a started run, does nothing."""
        if self.run_id is None or self._ended:
            return
        if isinstance(error, BaseException):
            summary = f"{type(error).__name__}: {error}"
            full = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        else:
            summary = full = str(error)
        summary, full = redact_uri(summary), redact_uri(full)
        # each step on its own: a store that refuses the artifact must not keep the run RUNNING
        for record in (lambda: self.set_tags({"error": summary}), lambda: self.log_text(full, "error.txt")):
            try:
                record()
            except Exception as e:  # noqa: BLE001 - the original error matters more than this one
                print(f"recgrid.tracking: could not record the error in MLflow: {redact_uri(str(e))}",
                      file=sys.stderr)
        self._end("FAILED")

    def kill(self, message: str) -> None:
        """Mark the run KILLED (interrupted), the tag `interrupted` saying where ("interrupted at step N ...")."""
        if self.run_id is None or self._ended:
            return
        try:
            self.set_tags({"interrupted": message})
        finally:
            self._end("KILLED")

    def _end(self, status: str) -> None:
        if self.run_id is None or self._ended:
            return
        self.client.set_terminated(self.run_id, status=status)
        self._ended = True

    def __enter__(self) -> "Tracker":
        self._require_run()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self.finish()
        elif isinstance(exc, KeyboardInterrupt):
            self.set_tags({"error": "KeyboardInterrupt"})
            self._end("KILLED")
        else:
            self.fail(exc)
        return False  # never swallow the exception

    # ---- looking at the runs ----------------------------------------------------------------------
    @property
    def display_uri(self) -> str:
        """The tracking URI to print: its credentials, if any, masked."""
        return redact_uri(self.tracking_uri)

    def ui_command(self) -> str:
        """The shell command that opens the MLflow UI on this tracker's runs."""
        uri = redact_uri(self.tracking_uri, keep="")
        if uri.startswith(("http://", "https://")):
            return f"{shlex.quote(sys.executable)} -m webbrowser {shlex.quote(uri)}"  # the server is the UI
        mlflow_bin = Path(sys.executable).parent / "mlflow"
        exe = str(mlflow_bin) if mlflow_bin.exists() else "mlflow"
        return f"{shlex.quote(exe)} ui --backend-store-uri {shlex.quote(uri)}"

    @property
    def served(self) -> bool:
        """Whether the runs are on a tracking server (which serves the UI) rather than a local store."""
        return self.tracking_uri.startswith(("http://", "https://"))

    def _ui_base(self) -> str:
        return redact_uri(self.tracking_uri, keep="").rstrip("/") if self.served else LOCAL_UI

    def ui_url(self, page: str = "") -> str:
        """The run's page in the MLflow UI's model-training view (`page`: a tab, e.g.
        "artifacts/compare/chart.png"): on the tracking server, or on `mlflow ui`'s default
        address for a local store. The URL names the view: MLflow 3.17's UI opens every
        experiment in its GenAI view until the browser is switched to "Model training"."""
        path = f"/#/experiments/{self.experiment_id}/runs/{self._require_run()}" + (f"/{page}" if page else "")
        return f"{self._ui_base()}{path}?{UI_TRAINING_VIEW}"

    def experiment_url(self) -> str:
        """The experiment's runs list in the model-training view, with `RUNS_VIEW_COLUMNS` shown."""
        self._require_run()
        return (f"{self._ui_base()}/#/experiments/{self.experiment_id}/runs"
                f"?{UI_TRAINING_VIEW}&viewStateShareKey={RUNS_VIEW_KEY}")

    def compare_url(self, run_ids: list[str]) -> str:
        """MLflow's page that compares `run_ids` (runs of this tracker's experiment) side by side:
        every param and metric in one table, and the metric curves per run."""
        import json
        from urllib.parse import quote

        self._require_run()
        query = f"runs={quote(json.dumps(list(run_ids)))}&experiments={quote(json.dumps([self.experiment_id]))}"
        return f"{self._ui_base()}/#/compare-runs?{query}&{UI_TRAINING_VIEW}"

    def ui_hint(self) -> str:
        """One line saying where to watch the run: its page, after `mlflow ui` for a local store."""
        if self.served:
            return f"MLflow: {self.ui_url()}"
        return f"MLflow: run `{self.ui_command()}`, then open {self.ui_url()}"


def runs_view() -> str:
    """The value of the experiment tag `RUNS_VIEW_TAG`: the runs list's columns, newest run first."""
    import json

    return json.dumps({"selectedColumns": list(RUNS_VIEW_COLUMNS), "orderByKey": "attributes.start_time",
                       "orderByAsc": False})


# ---- system metrics ---------------------------------------------------------------------------------
def start_system_metrics(run_id: str, node_id: str | None = None, tracking_uri: str | None = None,
                         sampling_interval_s: float = 5.0) -> Any:
    """Log MLflow's system metrics of THIS node into `run_id` until the run ends: CPU and memory
    use, disk, network, and GPU utilisation and memory where NVML sees a GPU, as
    `system/<node_id>/<name>` every `sampling_interval_s` (MLflow's own
    `MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` wins), from a daemon thread. MLflow's monitor logs
    a sample only once its interval has passed and drops the one in progress when stopped; stop
    it with `stop_system_metrics`, which logs that one too, so a node that trains for less than
    one interval still records a point. 5 s (MLflow's default is 10) gives a 60-step demo a few
    points at one small request per node per interval.

    The monitor samples the machine it runs on, so call it once per node, in a process that
    lives as long as the training there (e.g. each node's local rank 0 worker); `node_id` names
    the node (default: the host name; a pod's name on Kubernetes). Returns the monitor (stop it
    with `stop_system_metrics`; it also stops by itself once the run is no longer RUNNING),
    or None when it cannot start (e.g. psutil missing): system metrics never stop training.
    A restarted worker group resumes the run's system-metric steps instead of starting at 0.
    """
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # INFO at every start and stop
        monitor = SystemMetricsMonitor(run_id, sampling_interval=sampling_interval_s, resume_logging=True,
                                       node_id=node_id or _platform.node(),
                                       tracking_uri=resolve_tracking_uri(tracking_uri))
        monitor.start()
        return monitor
    except Exception as e:  # noqa: BLE001 - metrics must never stop training
        print(f"recgrid.tracking: MLflow system metrics are off on this node: {type(e).__name__}: "
              f"{redact_uri(str(e))}",
              file=sys.stderr)
        return None


def stop_system_metrics(monitor: Any) -> None:
    """Stop a `start_system_metrics` monitor, logging the sample its interval had not yet logged
    (MLflow's `finish` drops it), with the monitor's public calls. Never raises: system metrics
    never stop training."""
    try:
        monitor.finish()
        metrics = monitor.aggregate_metrics()
        if metrics:
            monitor.publish_metrics(metrics)
            monitor.mlflow_logger.flush()
    except Exception as e:  # noqa: BLE001 - metrics must never stop training
        print(f"recgrid.tracking: the last MLflow system metrics sample was not logged: {type(e).__name__}: "
              f"{redact_uri(str(e))}", file=sys.stderr)
