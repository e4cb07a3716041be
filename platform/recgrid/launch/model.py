"""A job's model outside the platform: the MLflow model a job logs, `recgrid export` and `recgrid eval`.

The model is an MLflow pyfunc "model from code" (`launch/served.py`, which MLflow runs where it loads
or serves the model: MLflow, torch, numpy and pandas, not recgrid, Ray or TorchRec) over two artifacts:
`weights.pt`, the unsharded model's `state_dict()` as plain tensors, and `architecture.json`, what
recgrid builds the model from (`launch.unshard.model_record`) and the served form's plain layout of
it (`engine.unsharded.served_layout`); `code/recgrid_transforms.py` is `data/transforms.py`, so a
served model applies training's own transforms to raw rows. Why not pickle the module (MLflow's
pytorch flavor) or a `torch.export` program: a pickle runs code where it is read and needs recgrid
and TorchRec importable, and TorchRec's KeyedJaggedTensor and fused ops do not export to a program
that torch alone loads; a few plain matrix products over named weights do.

`log_job_model` logs a finished job's model (its final storage checkpoint, unsharded) into its
run. `recgrid export CHECKPOINT --config JOB.yaml --out DIR` writes the model of a storage
checkpoint (`launch.unshard.from_checkpoint`: any T, M and L), `recgrid export MODEL --out DIR` that
of a logged model, as a fresh model directory (0700, its files 0600) with this recgrid's served code.
`recgrid eval MODEL --data GLOB` gives NE, AUC and rows (`--json`), on the CPU, without Ray.

What they trust: a model (a run id, `models:/...`, `runs:/...` or a directory) is read as data
(`read_model_dir`): its weights with `torch.load(weights_only=True)`, its architecture as JSON
from which recgrid builds the model with its own code. Nothing in it is imported or unpickled, and a
model directory holding any other file (a pickle such as MLflow's `data/model.pth`, a
`pickle_module_info.txt`, a code module) is refused, naming the file; served code other than this
recgrid's is named in a note (recgrid runs none of it; `recgrid export` writes this recgrid's). A
storage checkpoint is read through `train.checkpoint`'s data-only reader.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.metadata
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from recgrid.config import load_config
from recgrid.data.specs import DENSE_NAMES, SPARSE_NAMES
from recgrid.data.transforms import MULTI_HOT_SEED
from recgrid.engine.unsharded import served_layout
from recgrid.launch.report import say
from recgrid.launch.unshard import evaluate_files, from_checkpoint, from_record, model_spec, table_shapes
from recgrid.logs import libraries_quiet
from recgrid.tracking import private_tree, resolve_tracking_uri
from recgrid.train.checkpoint import checkpoint_step, is_complete

SERVED_CODE = Path(__file__).with_name("served.py")
TRANSFORMS_CODE = Path(__file__).resolve().parents[1] / "data" / "transforms.py"
TRANSFORMS_NAME = "recgrid_transforms.py"  # its name in a model's code/ (`launch.served.TRANSFORMS`)
WEIGHTS, ARCHITECTURE = "weights.pt", "architecture.json"
LAYOUT_FORMAT = 1  # the layout of architecture.json
# what serving needs besides MLflow (which MLflow names itself): `launch/served.py`'s imports
SERVED_STACK = ("torch", "numpy", "pandas")
# the files of a model directory recgrid writes (MLflow's, and ours); anything else is refused
MODEL_FILES = frozenset({
    "MLmodel", "conda.yaml", "python_env.yaml", "requirements.txt", "input_example.json",
    "serving_input_example.json", "registered_model_meta", SERVED_CODE.name, f"code/{TRANSFORMS_NAME}",
    f"artifacts/{WEIGHTS}", f"artifacts/{ARCHITECTURE}"})
OWN_CODE = {SERVED_CODE.name: SERVED_CODE, f"code/{TRANSFORMS_NAME}": TRANSFORMS_CODE}
# the bytecode Python writes beside that code where MLflow loads a model directory (never read by recgrid)
BYTECODE = re.compile(r"(__pycache__/served|code/__pycache__/recgrid_transforms)\.cpython-\d+(\.opt-\d)?\.pyc")


class ModelRefused(ValueError):
    """A model that is not one recgrid wrote, refused before anything in it is used; names the file."""


# ---- writing --------------------------------------------------------------------------------------------------
def served_requirements() -> list[str]:
    """`dist==version` of SERVED_STACK as installed here, without a local version label (`+cpu`: any
    build of that release serves the model; the machine that serves it picks its own)."""
    return [f"{d}=={importlib.metadata.version(d).split('+')[0]}" for d in SERVED_STACK]


def example_rows() -> Any:
    """Two rows as a client holds them (the raw files' form): integer dense values, hex categorical
    values, a missing value of each kind (NaN, None). The model's input example."""
    import numpy as np
    import pandas as pd

    return pd.DataFrame({**{n: [1, np.nan if i == 0 else 3] for i, n in enumerate(DENSE_NAMES)},
                         **{n: ["68fd1e64", None if i == 0 else "80e26c9b"] for i, n in enumerate(SPARSE_NAMES)}})


def signature() -> Any:
    """The model's MLflow signature: one column per feature of any type (integers, hex strings, NaN),
    one `probability` column out."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, ColSpec, Schema

    # lazy: launch.served defines an MLflow PythonModel, and MLflow warns on stderr when one is defined;
    # importing it here, where the callers quiet the libraries, keeps that warning off every command's start
    from recgrid.launch.served import OUTPUT

    return ModelSignature(Schema([ColSpec(AnyType(), n) for n in (*DENSE_NAMES, *SPARSE_NAMES)]),
                          Schema([ColSpec("double", OUTPUT)]))


def model_files(model: Any, directory: str) -> dict[str, Any]:
    """Write the model's artifacts and code into `directory`; returns the arguments of MLflow's
    pyfunc `save_model` / `log_model` that make the model of them."""
    import torch

    spec = model_spec(model)
    if spec.multi_hot and max(spec.table_rows) >= 1 << 31:
        raise ValueError(f"spec {spec.name!r}: multi-hot expansion needs table rows < 2^31")
    weights, architecture = os.path.join(directory, WEIGHTS), os.path.join(directory, ARCHITECTURE)
    torch.save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, weights)
    layout = served_layout(model, spec.table_rows, spec.bag_sizes, MULTI_HOT_SEED)
    with open(architecture, "w") as f:
        json.dump({"format": LAYOUT_FORMAT, "recgrid": model.info, "served": layout}, f)
    code = os.path.join(directory, "code")
    os.makedirs(code, exist_ok=True)
    shutil.copyfile(TRANSFORMS_CODE, os.path.join(code, TRANSFORMS_NAME))
    return {"python_model": str(SERVED_CODE), "artifacts": {"weights": weights, "architecture": architecture},
            "code_paths": [os.path.join(code, TRANSFORMS_NAME)], "signature": signature(),
            "input_example": example_rows(), "pip_requirements": served_requirements()}


def save_model_dir(model: Any, out: str) -> None:
    """Save `model` (an `UnshardedDLRM`) as an MLflow model directory at `out` (which must not exist):
    0700, its files 0600."""
    import mlflow.pyfunc

    with tempfile.TemporaryDirectory(prefix="recgrid-model-") as staging:
        mlflow.pyfunc.save_model(out, **model_files(model, staging))
    private_tree(out)


def log_job_model(config: Any, tracker: Any, status: dict[str, Any]) -> Any:
    """The job's model out of the platform: its final storage checkpoint unsharded in this process
    (`launch.unshard.from_checkpoint`) and logged as the run's MLflow model "model" at the final
    step (the final evaluation's metrics linked to it) and, with `tracking.register_as`, a
    registered model version. Returns MLflow's `ModelInfo`, or None when the job ended without
    a checkpoint of its final step (interrupted, or every group left at a drain)."""
    if config.model.towers is not None:
        say("model: not logged: a Disaggregated Multi-Tower model (model.towers) has no unsharded form yet")
        return None
    final = (status.get("final") or {}).get("step")
    written = status.get("checkpoints") or []
    path = next((p for p in reversed(written) if checkpoint_step(p) == final), None)
    if final is None or path is None:
        say(f"model: no checkpoint of the final step {final}: no model logged")
        return None
    model = from_checkpoint(path, config, info={"run_id": tracker.run_id}, say=say)
    # MLflow warns, while it logs a pyfunc whose predict has no type hints, that its data validation is
    # off: recgrid's predict validates the raw columns itself (launch.served); the warning is not the user's
    with tempfile.TemporaryDirectory(prefix="recgrid-model-") as staging, libraries_quiet():
        info = tracker.log_model(model_files(model, staging), step=final, register_as=config.tracking.register_as,
                                 params={"checkpoint": path, "spec": config.dataset_spec().name})
    ne = tracker.client.get_run(tracker.run_id).data.metrics.get("eval/ne")
    say(f"model: logged as {info.model_uri} (step {final}"
        + (f", eval NE {ne:.4f}" if ne is not None else "")
        + (f"; registered as {config.tracking.register_as!r} version {info.registered_model_version}"
           if config.tracking.register_as else "") + ")")
    return info


# ---- reading ---------------------------------------------------------------------------------------------------
def read_model_dir(path: str) -> Any:
    """The `UnshardedDLRM` of the MLflow model directory at `path`, read as data (the module
    docstring): `ModelRefused`, naming the file, for a directory that holds anything but what recgrid
    writes, weights that are not plain tensors or do not fit the recorded architecture."""
    import torch
    import yaml

    root = Path(path)
    for dirpath, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            file = Path(dirpath) / name
            rel = file.relative_to(root).as_posix()
            if file.is_symlink() or (name in files and rel not in MODEL_FILES and not BYTECODE.fullmatch(rel)):
                raise ModelRefused(f"{file}: not a file of a recgrid model (a planted or foreign model?); refusing "
                                   f"to read the model. recgrid reads only models it wrote: "
                                   f"{', '.join(sorted(MODEL_FILES))}")
    for rel in ("MLmodel", f"artifacts/{WEIGHTS}", f"artifacts/{ARCHITECTURE}", *OWN_CODE):
        if not (root / rel).is_file():
            raise ModelRefused(f"{root / rel}: missing: {path} is not a model recgrid wrote")
    for rel, own in OWN_CODE.items():  # never run here: what recgrid evaluates is built by its own code
        if not filecmp.cmp(root / rel, own, shallow=False):
            print(f"[recgrid] note: {root / rel} is not this recgrid's served code (another recgrid version's, or "
                  f"changed): recgrid reads only the weights and the architecture and runs none of it, but "
                  f"`mlflow models serve` of that directory would run it; `recgrid export` writes the model "
                  f"again with this recgrid's", file=sys.stderr)
    try:
        mlmodel = yaml.safe_load((root / "MLmodel").read_text())
        flavor = mlmodel["flavors"]
        ok = set(flavor) == {"python_function"} and flavor["python_function"].get("model_code_path") \
            and Path(flavor["python_function"]["model_code_path"]).name == SERVED_CODE.name
    except (yaml.YAMLError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ModelRefused(f"{root / 'MLmodel'}: not the MLmodel of a recgrid model (its only flavor is "
                           f"python_function from {SERVED_CODE.name}); refusing to read the model")
    weights_file, architecture_file = root / "artifacts" / WEIGHTS, root / "artifacts" / ARCHITECTURE
    try:
        weights = torch.load(weights_file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the weights-only unpickler's refusal, or a file that is no archive
        raise ModelRefused(f"{weights_file}: not plain tensors (a planted or foreign file?); refusing to read "
                           f"it: {str(e).splitlines()[0]}") from None
    if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in weights.items()):
        raise ModelRefused(f"{weights_file}: not a dict of named tensors; refusing to read it")
    try:
        architecture = json.loads(architecture_file.read_text())
        if architecture.get("format") != LAYOUT_FORMAT:
            raise ValueError(f"format {architecture.get('format')!r}, not {LAYOUT_FORMAT}")
        record = architecture["recgrid"]
        shapes = table_shapes(record)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelRefused(f"{architecture_file}: not the architecture of a recgrid model ({type(e).__name__}: "
                           f"{e}); refusing to read the model") from None
    prefix = "model.sparse_arch.embedding_bag_collection.embedding_bags."
    for table, shape in shapes.items():  # before any table is allocated: a recorded size is only a claim
        got = weights.get(f"{prefix}{table}.weight")
        if got is None or tuple(got.shape) != shape:
            raise ModelRefused(f"{weights_file}: table {table} is {None if got is None else list(got.shape)} "
                               f"where {architecture_file.name} records {list(shape)}; refusing to read the model")
    model = from_record(record)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ModelRefused(f"{weights_file}: does not fit the recorded architecture: {str(e).splitlines()[0]} "
                           f"...; refusing to read the model") from None
    spec = model_spec(model)
    if architecture.get("served") != json.loads(json.dumps(served_layout(model, spec.table_rows, spec.bag_sizes,
                                                                         MULTI_HOT_SEED))):
        raise ModelRefused(f"{architecture_file}: its served layout is not the recorded model's (what MLflow "
                           f"serves would not be what recgrid evaluates); refusing to read the model")
    return model


def _checkpoint_model(path: str, config_path: str | None, overrides: list[str]) -> Any:
    if not config_path:
        raise SystemExit(f"recgrid: {path} is a storage checkpoint: give the config of the job that wrote it "
                         f"(--config JOB.yaml): its dataset spec, model and compression")
    config = load_config(config_path, overrides, check_paths=False)
    return from_checkpoint(path, config, say=lambda m: print(f"[recgrid] {m}", file=sys.stderr, flush=True))


def load_model(ref: str, config_path: str | None = None, overrides: list[str] | None = None,
               tracking_uri: str | None = None) -> Any:
    """The `UnshardedDLRM` of `ref`: a storage checkpoint directory (with the job's config), an MLflow
    model directory, an MLflow model URI, or a run id (its logged model "model"), read as data."""
    import mlflow

    if os.path.isdir(ref) and is_complete(ref):
        return _checkpoint_model(ref, config_path, overrides or [])
    if os.path.isdir(ref):
        return read_model_dir(ref)
    if ":/" not in ref and (os.sep in ref or ref.startswith(".")):
        raise SystemExit(f"recgrid: {ref}: no such checkpoint or model directory")
    mlflow.set_tracking_uri(resolve_tracking_uri(tracking_uri))
    uri = ref if ":/" in ref else f"runs:/{ref}/model"
    with tempfile.TemporaryDirectory(prefix="recgrid-model-") as tmp:  # 0700: the weights stay this user's
        return read_model_dir(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp))


def run_export(args: argparse.Namespace) -> int:
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        print(f"recgrid export: {args.out} exists and is not an empty directory: nothing written", file=sys.stderr)
        return 2
    try:
        with libraries_quiet():
            model = load_model(args.source, args.config, args.set, args.tracking_uri)
            if os.path.isdir(args.out):
                os.rmdir(args.out)  # MLflow makes it
            save_model_dir(model, args.out)
    except ModelRefused as e:
        print(f"recgrid export: {e}", file=sys.stderr)
        return 2
    print(f"[recgrid] model of {args.source} saved to {args.out} (mlflow.pyfunc.load_model({args.out!r}), "
          f"or `mlflow models serve -m {args.out} --env-manager local`)")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    probabilities: list | None = [] if args.predictions else None
    try:
        with libraries_quiet():
            model = load_model(args.model, args.config, args.set, args.tracking_uri)
            out = evaluate_files(model, args.data, model_spec(model), probabilities=probabilities)
    except ModelRefused as e:
        print(f"recgrid eval: {e}", file=sys.stderr)
        return 2
    if probabilities is not None:
        import numpy as np

        np.savetxt(args.predictions, np.concatenate(probabilities) if probabilities else np.zeros(0), fmt="%.9g")
    if args.json:
        print(json.dumps(out))
    else:
        print(f"NE {out['ne']:.6f} | AUC {out['auc']:.6f} | rows {out['rows']:,}")
    return 0
