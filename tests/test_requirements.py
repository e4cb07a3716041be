"""requirements/: every pin is hash-locked (issue 18), from one index per file, and the MLflow
server's file is the closure the server needs at lock.txt's versions. Reads files only; `make
install` in a fresh venv is what proves the hashes (requirements/README.md says how it was run)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"
spec = importlib.util.spec_from_file_location("recgrid_lock", REQ / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)

# not hash-locked yet: its index (download.pytorch.org) was unreachable where the lock was made
UNLOCKED = {"torch-cuda.txt"}
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


def _requirement_lines(path: Path) -> list[str]:
    return [line.strip() for line in lock._logical_lines(path.read_text())
            if line.strip() and not line.strip().startswith(("#", "-"))]


@pytest.mark.parametrize("name", sorted(p.name for p in REQ.glob("*.txt")))
def test_every_pin_is_exact_and_hash_locked(name):
    assert name in lock.INDEXES, f"{name}: lock.py does not know which index it comes from"
    lines = _requirement_lines(REQ / name)
    assert lines, name
    for line in lines:
        assert lock.PIN.match(line), f"{name}: {line.split()[0]} is not pinned with =="
        if name not in UNLOCKED:
            assert HASH.search(line), f"{name}: {line.split()[0]} carries no --hash"


def test_no_second_index_is_mixed_in():
    for path in [*REQ.glob("*.txt"), ROOT / "Makefile", ROOT / "k8s" / "Dockerfile"]:
        assert "--extra-index-url" not in path.read_text(), f"{path.name} mixes indexes"
    make = (ROOT / "Makefile").read_text()
    for name in ("tools.txt", "nodeps.txt", "lock.txt"):  # every PyPI step hash-checked
        assert f"--require-hashes --no-deps -r requirements/{name}" in make, name
    assert "pip check" in make  # lock.txt installs --no-deps: the check proves its closure complete


def test_the_mlflow_server_file_is_its_closure_at_the_locks_versions():
    locked = {lock.canonicalize_name(n): v for n, v in lock.pins(REQ / "lock.txt")}
    server = {lock.canonicalize_name(n): v for n, v in lock.pins(REQ / "mlflow-server.txt")}
    assert {"mlflow", "psycopg2-binary", "flask-wtf", "wtforms"} <= set(server)
    assert all(locked[n] == v for n, v in server.items() if n in locked)
    assert set(lock.server_closure_names()) == set(server)
