"""Rewrite the `--hash=sha256:...` lines of requirements/*.txt from the package indexes.

    python requirements/lock.py            # every file below
    python requirements/lock.py lock.txt   # one file

Each file's `name==version` lines are its input (edit a version there, then run this); every
other line (comments, options) is kept. For each pin the hashes of EVERY file the index serves
for that version (all platforms, wheels and sdist) are written, the way
`pip-compile --generate-hashes` does, so `pip install --require-hashes` accepts whichever
file pip picks on any machine. `mlflow-server.txt` is derived: the dependency closure of
SERVER_ROOTS at lock.txt's versions (read from this venv's installed metadata), so the server
image installs it alone with `--require-hashes`.

Where the hashes come from, per file (INDEXES): PyPI's simple API (PEP 691 JSON), or PyTorch's
wheel index (HTML, `#sha256=` fragments) for the torch builds; for those, wheel files of the pinned
version found in pip's `--find-links` directories (PIP_FIND_LINKS: a machine's wheel cache) are
hashed and added as well, so a cached copy installs too. A pin with no file anywhere is an error.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import sys
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

HERE = Path(__file__).resolve().parent
PYPI = "https://pypi.org/simple"
TORCH_CPU = "https://download.pytorch.org/whl/cpu"
TORCH_CUDA = "https://download.pytorch.org/whl/cu128"
# file -> the index its pins come from (the Makefile and k8s/Dockerfile install each from that index only)
INDEXES = {"lock.txt": PYPI, "nodeps.txt": PYPI, "fbgemm-cpu.txt": PYPI, "gpu-tools.txt": PYPI,
           "mlflow-server.txt": PYPI, "tools.txt": PYPI, "torch-cpu.txt": TORCH_CPU, "torch-cuda.txt": TORCH_CUDA}
SERVER_ROOTS = ("mlflow", "psycopg2-binary", "Flask-WTF")  # mlflow server --app-name basic-auth needs Flask-WTF
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (filename, sha256)

    def handle_starttag(self, tag, attrs):
        href = dict(attrs).get("href") or ""
        if tag == "a" and "#sha256=" in href:
            url, digest = href.split("#sha256=", 1)
            self.links.append((urllib.request.unquote(url.rsplit("/", 1)[-1]), digest))


def _fetch(url: str, accept: str) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "recgrid-lock"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def _version_of(filename: str) -> tuple[str, Version] | None:
    try:
        if filename.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(filename)
        elif filename.endswith((".tar.gz", ".zip")):
            name, version = parse_sdist_filename(filename)
        else:
            return None
    except Exception:  # noqa: BLE001 - a file name the index serves that packaging does not parse
        return None
    return name, version


def index_files(index: str, name: str) -> list[tuple[str, str]]:
    """(filename, sha256) of every file the index lists for `name`."""
    url = f"{index}/{canonicalize_name(name)}/"
    if index == PYPI:
        data = json.loads(_fetch(url, "application/vnd.pypi.simple.v1+json"))
        return [(f["filename"], f["hashes"]["sha256"]) for f in data["files"] if "sha256" in f.get("hashes", {})]
    parser = _Links()
    parser.feed(_fetch(url, "text/html").decode())
    return parser.links


def find_links_files(name: str, version: Version) -> list[tuple[str, str]]:
    dirs = [d for d in re.split(r"[\s]+", os.environ.get("PIP_FIND_LINKS", "")) if d and Path(d).is_dir()]
    out = []
    for d in dirs:
        for path in sorted(Path(d).iterdir()):
            parsed = _version_of(path.name)
            if parsed and parsed[0] == canonicalize_name(name) and parsed[1] == version:
                out.append((path.name, hashlib.sha256(path.read_bytes()).hexdigest()))
    return out


def hashes(index: str, name: str, version: str) -> list[str]:
    want = Version(version)
    found: list[tuple[str, str]] = []
    try:
        found += [(f, h) for f, h in index_files(index, name)
                  if (p := _version_of(f)) and p[0] == canonicalize_name(name) and p[1] == want]
    except (urllib.error.URLError, OSError) as e:
        if index == PYPI:
            raise
        print(f"  {index} is unreachable ({e}); {name}=={version}: only the --find-links copies are hashed",
              file=sys.stderr)
    if index != PYPI:
        found += find_links_files(name, want)
    if not found:
        raise SystemExit(f"{name}=={version}: no file of this version at {index} (or in PIP_FIND_LINKS)")
    return sorted({h for _, h in found})


def _logical_lines(text: str) -> list[str]:
    out, cur = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def pins(path: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for line in _logical_lines(path.read_text()) if (m := PIN.match(line.strip()))]


def server_closure() -> list[str]:
    """SERVER_ROOTS and everything they need, as `name==version` at lock.txt's versions (this venv's
    metadata gives the dependencies; markers evaluated for Linux, CPython 3.11)."""
    locked = {canonicalize_name(n): v for n, v in pins(HERE / "lock.txt")}
    locked.update({canonicalize_name(n): v for n, v in pins(HERE / "mlflow-server.txt")
                   if canonicalize_name(n) not in locked})
    env = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux",
           "python_version": "3.11", "python_full_version": "3.11.9", "implementation_name": "cpython",
           "platform_python_implementation": "CPython"}
    todo, seen = [(r, frozenset()) for r in SERVER_ROOTS], {}
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and extras <= seen[key]:
            continue
        seen[key] = seen.get(key, frozenset()) | extras
        if key not in locked:
            raise SystemExit(f"{name}: needed by the MLflow server but pinned in neither lock.txt nor mlflow-server.txt")
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            requires = []  # not in this venv (psycopg2-binary): it has no dependencies
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})):
                todo.append((req.name, frozenset(req.extras)))
    return sorted(f"{n}=={locked[n]}" for n in seen)


def _hashed(index: str, item: str) -> str:
    name, version = item.split("==")
    return " \\\n".join([item] + [f"    --hash=sha256:{d}" for d in hashes(index, name, version)])


def server_closure_names() -> list[str]:
    return [canonicalize_name(item.split("==")[0]) for item in server_closure()]


def rewrite(path: Path) -> None:
    """Each pin of the file with its hashes, in place; comments and options kept where they are."""
    index = INDEXES[path.name]
    lines = [line for line in _logical_lines(path.read_text()) if line.strip()]
    if path.name == "mlflow-server.txt":
        out = [line for line in lines if not PIN.match(line.strip())] + [_hashed(index, i) for i in server_closure()]
    else:
        out = [_hashed(index, m.group(0)) if (m := PIN.match(line.strip())) else line for line in lines]
    path.write_text("\n".join(out) + "\n")
    print(f"{path.name}: {sum(bool(PIN.match(x)) for x in out)} pins hashed from {index}")


def main(argv: list[str]) -> int:
    failed = []
    for name in argv or list(INDEXES):
        try:
            rewrite(HERE / Path(name).name)
        except (SystemExit, urllib.error.URLError, OSError) as e:
            print(f"{name}: NOT rewritten: {e}", file=sys.stderr)
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
