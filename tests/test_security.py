"""What recgrid reads from disk runs nothing: planted checkpoint metadata is refused, naming the
file, before anything it names is called. Hand-written pickles, a real DCP checkpoint, no cluster."""

import builtins
import os
import pickle
import struct

import pytest
import torch

from recgrid.train import checkpoint

METADATA_MODULE = "torch.distributed.checkpoint.metadata"


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _str(text: str) -> bytes:
    data = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _plant(directory, body: bytes) -> str:
    """A checkpoint directory holding only a `.metadata` of `body` (opcodes, STOP added)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, ".metadata")
    with open(path, "wb") as f:
        f.write(pickle.PROTO + b"\x02" + body + pickle.NONE + pickle.STOP)
    return path


def test_metadata_that_rewrites_the_builtins_is_refused_and_runs_nothing(tmp_path):
    """The reviewed attack: fetch the metadata module's `__builtins__` (the live builtins dict), set
    `isinstance` in it to a class any two arguments build (so a dtype check admits any torch name),
    then import `os.system` through torch's dotted-name import and call it."""
    mark = tmp_path / "ran"
    directory = tmp_path / "checkpoint_step_00000004"
    path = _plant(directory, _global(METADATA_MODULE, "__builtins__") + _str("isinstance")
                  + _global(METADATA_MODULE, "Metadata") + pickle.SETITEM + pickle.POP
                  + _global("torch", "_import_dotted_name") + _str("os.system") + pickle.TUPLE1 + pickle.REDUCE
                  + _str(f"touch {mark}") + pickle.TUPLE1 + pickle.REDUCE + pickle.POP)
    original = builtins.isinstance
    try:
        with pytest.raises(Exception) as refused:
            checkpoint.read_checkpoint(str(directory), {})
        rewritten = builtins.isinstance is not original
    finally:
        builtins.isinstance = original
    assert not mark.exists(), "the pickle ran os.system"
    assert not rewritten, "the pickle rewrote builtins.isinstance"
    assert refused.type is checkpoint.CheckpointRefused, refused.value
    assert str(refused.value).startswith(f"{path}: the checkpoint's metadata names {METADATA_MODULE}.__builtins__")


@pytest.mark.parametrize("what,module,name", [
    ("module", METADATA_MODULE, "os"),                      # a module a namespace import would hand out
    ("type", METADATA_MODULE, "Metadata"),                  # an admitted class, shared by the process
    ("function", "torch.serialization", "_get_layout"),     # an admitted function (its __dict__ is its cache)
])
def test_metadata_that_builds_onto_a_module_type_or_function_is_refused(tmp_path, what, module, name):
    """BUILD with slot state sets attributes on whatever is below it on the stack: a planted file
    would rewire an object every later load (and everything else in the process) uses."""
    import importlib

    target = getattr(importlib.import_module(module), name)
    directory = tmp_path / "checkpoint_step_00000004"
    state = pickle.EMPTY_DICT + _str("recgrid_planted") + pickle.NEWTRUE + pickle.SETITEM
    path = _plant(directory, _global(module, name) + pickle.NONE + state + pickle.TUPLE2 + pickle.BUILD + pickle.POP)
    try:
        with pytest.raises(Exception) as refused:
            checkpoint.read_checkpoint(str(directory), {})
        planted = hasattr(target, "recgrid_planted")
    finally:
        if hasattr(target, "recgrid_planted"):
            delattr(target, "recgrid_planted")
    assert not planted, f"the pickle set an attribute on the {what} {module}.{name}"
    assert refused.type is checkpoint.CheckpointRefused and str(refused.value).startswith(f"{path}: "), refused.value


def test_metadata_pointing_outside_its_directory_is_refused(tmp_path):
    """A real checkpoint's metadata, its storage entry pointed at a file outside the directory."""
    import torch.distributed.checkpoint as dcp

    directory = str(tmp_path / "checkpoint_step_00000002")
    dcp.save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    meta = os.path.join(directory, ".metadata")
    with open(meta, "rb") as f:
        md = checkpoint.load_metadata(f, meta)
    next(iter(md.storage_data.values())).relative_path = "../../secret"
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(checkpoint.CheckpointRefused, match=r"\.metadata: .*points outside its directory \('\.\./\.\./secret'\)"):
        checkpoint.read_checkpoint(directory, {"w": torch.zeros(4)})


def test_the_allowlist_holds_no_module_namespace_or_wildcard():
    assert all("*" not in name and not name.startswith("__") for _, name in checkpoint.METADATA_GLOBALS)
    resolved = checkpoint._admitted()
    assert not any(isinstance(v, (type(os), dict)) for v in resolved.values())
    assert ("torch", "float32") in resolved and ("torch", "_import_dotted_name") not in resolved


# ---- the checkpoint's data files and its enum (issue 47) ----------------------------------------------
def _checkpoint(directory, state) -> str:
    """A real DCP checkpoint of `state`, written without a process group."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    return str(directory)


def _rewrite_metadata(directory, change) -> None:
    """The checkpoint's `.metadata` read (as data), changed in place by `change(metadata)`, written back."""
    meta = os.path.join(directory, ".metadata")
    with open(meta, "rb") as f:
        md = checkpoint.load_metadata(f, meta)
    change(md)
    with open(meta, "wb") as f:
        pickle.dump(md, f)


def _reads_back(tmp_path) -> None:
    """A checkpoint written now, in this process, reads back whole: what a refused file left behind broke nothing."""
    directory = _checkpoint(tmp_path / "checkpoint_step_00000009", {"w": torch.arange(6.0).reshape(2, 3),
                                                                    "note": "written afterwards"})
    state = {"w": torch.zeros(2, 3), "note": ""}
    checkpoint.read_checkpoint(directory, state)
    assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3)) and state["note"] == "written afterwards"


def test_metadata_that_builds_onto_the_admitted_enums_member_is_refused(tmp_path):
    """The reviewed attack: call the admitted enum `_MEM_FORMAT_ENCODING(0)` (it hands out its shared
    member) and BUILD `_value_ = 7` onto it: every checkpoint the process wrote afterwards would fail
    to read (`7 is not a valid _MEM_FORMAT_ENCODING`)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    member = _MEM_FORMAT_ENCODING(0)
    directory = tmp_path / "checkpoint_step_00000004"
    state = pickle.NONE + pickle.EMPTY_DICT + _str("_value_") + pickle.BININT1 + b"\x07" + pickle.SETITEM + pickle.TUPLE2
    path = _plant(directory, _global(METADATA_MODULE, "_MEM_FORMAT_ENCODING") + pickle.BININT1 + b"\x00"
                  + pickle.TUPLE1 + pickle.REDUCE + state + pickle.BUILD + pickle.POP)
    try:
        with pytest.raises(Exception) as refused:
            checkpoint.read_checkpoint(str(directory), {})
        changed = member._value_
    finally:
        member._value_ = 0
    assert changed == 0, "the pickle set _value_ on the shared enum member"
    assert refused.type is checkpoint.CheckpointRefused, refused.value
    assert str(refused.value).startswith(f"{path}: the checkpoint's metadata sets attributes on _MEM_FORMAT_ENCODING")
    _reads_back(tmp_path)


def test_a_data_file_linked_out_of_the_checkpoint_is_refused(tmp_path):
    directory = _checkpoint(tmp_path / "checkpoint_step_00000002", {"w": torch.arange(4.0)})
    (data,) = [n for n in os.listdir(directory) if n.endswith(".distcp")]
    elsewhere = tmp_path / "elsewhere.distcp"
    os.replace(os.path.join(directory, data), elsewhere)
    os.symlink(elsewhere, os.path.join(directory, data))
    with pytest.raises(checkpoint.CheckpointRefused) as refused:
        checkpoint.read_checkpoint(directory, {"w": torch.zeros(4)})
    assert str(refused.value).startswith(f"{os.path.join(directory, data)}: a link to {elsewhere}, outside the "
                                         f"checkpoint's directory"), refused.value
    _reads_back(tmp_path)


def test_an_entry_declared_past_its_files_end_is_refused_before_it_is_read(tmp_path):
    """A bytes entry declared 3 GiB long in a file of a few hundred bytes: refused at once, and no read
    asked for 3 GiB (Python's file read allocates what it is asked for before it reads)."""
    import tracemalloc

    directory = _checkpoint(tmp_path / "checkpoint_step_00000002", {"w": torch.arange(4.0), "note": "hello"})
    entry = {}

    def declare_3_gib(md):
        for index, info in md.storage_data.items():
            if index.fqn == "note":
                info.length = 3 << 30
                entry["file"] = os.path.join(directory, info.relative_path)

    _rewrite_metadata(directory, declare_3_gib)
    tracemalloc.start()
    try:
        with pytest.raises(Exception) as refused:
            checkpoint.read_checkpoint(directory, {"w": torch.zeros(4), "note": ""})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"reading the checkpoint allocated {peak / 2**30:.2f} GiB"
    assert refused.type is checkpoint.CheckpointRefused, refused.value
    assert str(refused.value).startswith(f"{entry['file']}: entry 'note' is declared at bytes "), refused.value
    assert f"{os.path.getsize(entry['file']):,} bytes; refusing" in str(refused.value), refused.value
    _reads_back(tmp_path)


def test_a_tensor_stored_in_another_dtype_than_declared_is_refused_not_cast(tmp_path):
    """A float64 tensor file declared float32: read into the float32 model it would be cast without a
    word (1e300 becomes inf)."""
    directory = _checkpoint(tmp_path / "checkpoint_step_00000002", {"w": torch.full((4,), 1e300, dtype=torch.float64)})

    def declare_float32(md):
        md.state_dict_metadata["w"].properties.dtype = torch.float32

    _rewrite_metadata(directory, declare_float32)
    target = torch.zeros(4)
    with pytest.raises(checkpoint.CheckpointRefused) as refused:
        checkpoint.read_checkpoint(directory, {"w": target})
    assert "entry 'w' holds a float64 tensor of shape [4], but the checkpoint's metadata declares a float32 tensor " \
           "of shape [4]" in str(refused.value), refused.value
    assert str(refused.value).startswith(directory) and not torch.isinf(target).any()
    _reads_back(tmp_path)


# ---- models `recgrid eval` and `recgrid export` read (issue 47) --------------------------------------
GOOD_LINE = "\t".join(["1"] + ["3"] * 13 + ["0a1b2c3d"] * 26)


@pytest.fixture(scope="module")
def recgrid_model(tmp_path_factory):
    """A model directory as recgrid writes it (a tiny spec, untrained) and a raw file to evaluate on."""
    from recgrid.config import load_config
    from recgrid.launch.model import save_model_dir
    from recgrid.launch.unshard import build_unsharded

    tmp = tmp_path_factory.mktemp("model")
    config = load_config(None, ["data.spec=tiny", "data.train=none/*.parquet"], check_paths=False)
    save_model_dir(build_unsharded(config, None, {"step": 1}), str(tmp / "model"))
    (tmp / "rows.tsv").write_text(GOOD_LINE + "\n")
    return tmp / "model", str(tmp / "rows.tsv")


def _copy(model, tmp_path):
    import shutil

    shutil.copytree(model, tmp_path / "planted")
    return tmp_path / "planted"


def _pytorch_model(directory, code_paths=None) -> str:
    """A model in MLflow's pytorch flavor (pickled), the form `recgrid eval` read before issue 47."""
    import mlflow.pytorch

    mlflow.pytorch.save_model(torch.nn.Linear(2, 1), str(directory), serialization_format="pickle",
                              code_paths=code_paths)
    return str(directory)


def _refused_by_eval_and_export(source, data, tmp_path, capsys, file, mark) -> None:
    """`recgrid eval SOURCE` and `recgrid export SOURCE` both stop (exit 2) with a sentence naming
    `file` (a path, or its tail), and nothing the model names ran (no `mark`)."""
    from recgrid.cli import main

    capsys.readouterr()
    for verb, args in (("eval", ["--data", data]), ("export", ["--out", str(tmp_path / "out")])):
        code = main([verb, str(source), *args])
        said = capsys.readouterr().err.strip().splitlines()[-1]  # after MLflow's own log lines, if any
        assert not os.path.exists(mark), f"recgrid {verb}: the planted model ran code"
        assert code == 2 and said.startswith(f"recgrid {verb}: ") and str(file) in said, (verb, code, said)
        assert "refusing to read" in said, said
    assert not (tmp_path / "out").exists()


class _Runs:
    """What a planted pickle unpickles into: a call that leaves a mark."""

    def __init__(self, mark: str) -> None:
        self.mark = mark

    def __reduce__(self):
        return (open, (self.mark, "w"))


def test_weights_with_a_reduce_are_refused_and_run_nothing(recgrid_model, tmp_path, capsys):
    model, data = recgrid_model
    planted, mark = _copy(model, tmp_path), str(tmp_path / "ran")
    torch.save({"model.over_arch.model.1.bias": _Runs(mark)}, planted / "artifacts" / "weights.pt")
    _refused_by_eval_and_export(planted, data, tmp_path, capsys, planted / "artifacts" / "weights.pt", mark)


def _rows(tmp_path) -> str:
    (tmp_path / "rows.tsv").write_text(GOOD_LINE + "\n")
    return str(tmp_path / "rows.tsv")


def test_a_pickled_pytorch_model_is_refused_and_runs_nothing(tmp_path, capsys):
    """MLflow's pytorch flavor, `data/model.pth` holding a `__reduce__`: `mlflow.pytorch.load_model`
    (what `recgrid eval` called) runs it; recgrid now refuses the file before anything reads it."""
    data = _rows(tmp_path)
    planted, mark = _pytorch_model(tmp_path / "planted"), str(tmp_path / "ran")
    torch.save(_Runs(mark), os.path.join(planted, "data", "model.pth"))
    _refused_by_eval_and_export(planted, data, tmp_path, capsys, "/data/", mark)


def test_a_logged_model_naming_a_code_module_as_its_pickle_module_is_refused_and_imports_nothing(
        tmp_path, capsys, monkeypatch):
    """The reviewed attack, through the tracking store as a job would plant it: a logged model whose
    `data/pickle_module_info.txt` names a module of its own `code` folder. MLflow imports that
    module before its pickle check, so MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false did not stop it."""
    import mlflow

    data, mark = _rows(tmp_path), str(tmp_path / "ran")
    (tmp_path / "planted_mod.py").write_text(f"open({mark!r}, 'w').close()\n")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false")
    mlflow.set_tracking_uri(store)
    with mlflow.start_run() as run:
        directory = _pytorch_model(tmp_path / "made", code_paths=[str(tmp_path / "planted_mod.py")])
        with open(os.path.join(directory, "data", "pickle_module_info.txt"), "w") as f:
            f.write("planted_mod")
        mlflow.log_artifacts(directory, "model")
    _refused_by_eval_and_export(f"runs:/{run.info.run_id}/model", data, tmp_path, capsys, "planted_mod", mark)


def test_a_recgrid_model_carrying_a_code_module_more_is_refused(recgrid_model, tmp_path, capsys):
    model, data = recgrid_model
    planted, mark = _copy(model, tmp_path), str(tmp_path / "ran")
    (planted / "code" / "helper.py").write_text(f"open({mark!r}, 'w').close()\n")
    _refused_by_eval_and_export(planted, data, tmp_path, capsys, planted / "code" / "helper.py", mark)


def test_served_code_other_than_recgrids_runs_nowhere_and_is_named(recgrid_model, tmp_path, capsys):
    """recgrid never runs a model's served code (it builds the model from the weights and architecture
    with its own): a changed served.py is named in a note, and `recgrid export` writes this recgrid's."""
    from recgrid.cli import main
    from recgrid.launch.model import SERVED_CODE

    model, data = recgrid_model
    planted, mark = _copy(model, tmp_path), str(tmp_path / "ran")
    served = planted / "served.py"
    served.write_text(served.read_text() + f"\nopen({mark!r}, 'w').close()\n")
    capsys.readouterr()
    assert main(["eval", str(planted), "--data", data]) == 0
    assert f"note: {served} is not this recgrid's served code" in capsys.readouterr().err
    assert main(["export", str(planted), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "served.py").read_bytes() == SERVED_CODE.read_bytes() and not os.path.exists(mark)
