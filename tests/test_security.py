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
