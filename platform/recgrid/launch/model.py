"""`recgrid export` and `recgrid eval`: a job's model outside the platform.

`recgrid export CHECKPOINT --config JOB.yaml --out DIR` unshards a storage checkpoint of a job of
that config (`train.unshard.from_checkpoint`: any T, M and L) and saves it as an MLflow model
directory (`mlflow.pytorch.load_model(DIR)` gives the `engine.unsharded.UnshardedDLRM`);
`recgrid export RUN_ID --out DIR` saves the run's logged model there (`tracking.log_model`).
`recgrid eval MODEL --data GLOB` evaluates a model (an MLflow model URI: `models:/<id>`,
`runs:/<run>/model`, a model directory; or a storage checkpoint with `--config`) on every row of
the files and prints NE, AUC and rows (`--json`: one object with keys `ne`, `auc`, `rows`). Both
run in this process, on the CPU, without Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _checkpoint_model(path: str, config_path: str | None, overrides: list[str]) -> Any:
    from recgrid.config import load_config
    from recgrid.train.unshard import from_checkpoint

    if not config_path:
        raise SystemExit(f"recgrid: {path} is a storage checkpoint: give the config of the job that wrote it "
                         f"(--config JOB.yaml): its dataset spec, model and compression")
    config = load_config(config_path, overrides, check_paths=False)
    return from_checkpoint(path, config, say=lambda m: print(f"[recgrid] {m}", file=sys.stderr, flush=True))


def load_model(ref: str, config_path: str | None = None, overrides: list[str] | None = None,
               tracking_uri: str | None = None) -> Any:
    """The `UnshardedDLRM` of `ref`: a storage checkpoint directory (with the job's config), an MLflow
    model directory, an MLflow model URI, or a run id (its logged model "model")."""
    import mlflow.pytorch

    from recgrid.tracking import resolve_tracking_uri
    from recgrid.train.checkpoint import is_complete

    if os.path.isdir(ref) and is_complete(ref):
        return _checkpoint_model(ref, config_path, overrides or [])
    if ":/" not in ref and (os.sep in ref or ref.startswith(".")) and not os.path.isdir(ref):
        raise SystemExit(f"recgrid: {ref}: no such checkpoint or model directory")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a line per file, redrawn, otherwise
    mlflow.set_tracking_uri(resolve_tracking_uri(tracking_uri))
    uri = ref if (":/" in ref or os.path.isdir(ref)) else f"runs:/{ref}/model"
    return mlflow.pytorch.load_model(uri)


def run_export(args: argparse.Namespace) -> int:
    import mlflow.pytorch

    from recgrid.logs import libraries_quiet
    from recgrid.tracking import MODEL_STACK, installed_requirements

    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        print(f"recgrid export: {args.out} exists and is not an empty directory: nothing written", file=sys.stderr)
        return 2
    with libraries_quiet():
        model = load_model(args.source, args.config, args.set, args.tracking_uri)
        if os.path.isdir(args.out):
            os.rmdir(args.out)  # MLflow makes it
        mlflow.pytorch.save_model(model, args.out, serialization_format="pickle",
                                  pip_requirements=installed_requirements(MODEL_STACK))
    print(f"[recgrid] model of {args.source} saved to {args.out} (mlflow.pytorch.load_model({args.out!r}))")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from recgrid.logs import libraries_quiet
    from recgrid.train.unshard import evaluate_files, model_spec

    with libraries_quiet():
        model = load_model(args.model, args.config, args.set, args.tracking_uri)
        out = evaluate_files(model, args.data, model_spec(model))
    if args.json:
        print(json.dumps(out))
    else:
        print(f"NE {out['ne']:.6f} | AUC {out['auc']:.6f} | rows {out['rows']:,}")
    return 0
