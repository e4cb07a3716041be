"""Every name a doc gives a reader exists (issue 50): the config keys (`section.field`, checked
against recgrid.config's SECTIONS), the flags of `recgrid <verb> ...` commands (against the CLI's
argparse parser) and the repository paths named in the READMEs, docs/, the job configs' and
dataset specs' comments. A doc that names a retired key as retired is listed in RETIRED_MENTIONS
with the reason. Pure Python, no Ray, no runs (test_docs_figures checks the figures)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from pathlib import Path

import pytest

from recgrid.cli import build_parser
from recgrid.config import RETIRED_KEYS, SECTIONS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "platform" / "recgrid"
DOC_GLOBS = ("*.md", "docs/*.md", "k8s/**/*.md", "requirements/*.md", "dashboards/*.md", "datasets/*.md",
             "jobs/*.yaml", "datasets/*.yaml")
# what a checkout holds that is no part of the repository (made by make, git, tools or a job)
NOT_TRACKED = {".git", ".venv", "runs", "data", "mlruns", ".pytest_cache", ".ruff_cache", "__pycache__"}
# (doc, retired key) -> why the doc names it: each one must be in config.RETIRED_KEYS, which refuses it
RETIRED_MENTIONS = {
    ("docs/design-notes.md", "train.fault_tolerance"): "the design's history: says the switch is gone and why",
}


def _docs() -> dict[str, str]:
    """Doc path -> its text (a YAML file's comments only)."""
    out = {}
    for pattern in DOC_GLOBS:
        for path in sorted(ROOT.glob(pattern)):
            if NOT_TRACKED & set(path.relative_to(ROOT).parts):
                continue
            text = path.read_text()
            if path.suffix == ".yaml":
                text = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
            out[path.relative_to(ROOT).as_posix()] = text
    return out


DOCS = _docs()


# ---- config keys ----------------------------------------------------------------------------------------------
FIELDS = {section: {f.name for f in dataclasses.fields(cls)} for section, cls in SECTIONS.items()}
KEY = re.compile(rf"(?<![\w./-])({'|'.join(SECTIONS)})\.([A-Za-z_]\w*)")
FILE_SUFFIXES = {"txt", "py", "md", "yaml", "json", "gz", "parquet"}  # `train.txt`: Criteo's file, not a key


def _config_keys(text: str) -> set[str]:
    """The `section.field` names in `text`, but module paths (`train.worker.GroupReport`, `data.specs`:
    a module of the sub-package of that name) and file names."""
    keys = set()
    for m in KEY.finditer(text):
        section, name = m.groups()
        if name in FILE_SUFFIXES or (PACKAGE / section / f"{name}.py").exists() or (PACKAGE / section / name).is_dir():
            continue
        keys.add(m.group(0))
    return keys


def unknown_keys(doc: str, text: str) -> list[str]:
    bad = []
    for key in sorted(_config_keys(text)):
        section, name = key.split(".", 1)
        if name in FIELDS[section]:
            continue
        if (doc, key) in RETIRED_MENTIONS and key in RETIRED_KEYS:
            continue
        bad.append(key)
    return bad


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_config_key_a_doc_names_exists(doc):
    bad = unknown_keys(doc, DOCS[doc])
    assert not bad, f"{doc} names config keys that recgrid.config does not have: {bad}"


def test_each_retired_mention_is_still_made_and_still_retired():
    for (doc, key), why in RETIRED_MENTIONS.items():
        assert key in RETIRED_KEYS and key.split(".", 1)[1] not in FIELDS[key.split(".", 1)[0]], (key, why)
        assert key in _config_keys(DOCS[doc]), f"{doc} no longer names {key}: drop it from RETIRED_MENTIONS"


# ---- CLI flags --------------------------------------------------------------------------------------------------
@functools.cache
def _options() -> tuple[set[str], dict[str, set[str]]]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    top = {o for a in parser._actions for o in a.option_strings}
    return top, {verb: {o for a in p._actions for o in a.option_strings} for verb, p in sub.choices.items()}


FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
# a command line: `recgrid VERB ...` where a shell starts a command (after a prompt, env settings, a path
# such as .venv/bin/, or `python -m recgrid.cli`), up to the line's end (a `\` continues it)
COMMAND = re.compile(r"^[ \t]*(?:\$[ \t]+)?(?:[A-Z_]+=\S*[ \t]+)*(?:\S*/)?(?:python[\d.]* -m )?recgrid(?:\.cli)?"
                     r"[ \t]+(--[\w-]+|[a-z][\w-]*)((?:[^\n\\]|\\\n)*)", re.M)
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def _code(doc: str, text: str) -> list[str]:
    """The code a doc shows: fenced blocks and inline spans; a YAML file's indented comment lines too."""
    pieces = FENCE.findall(text) + SPAN.findall(FENCE.sub("", text))
    if doc.endswith(".yaml"):
        pieces += [line for line in text.splitlines() if line.startswith("  ")]
    return pieces


def commands(doc: str, text: str) -> list[tuple[str, list[str]]]:
    """(verb, the flags given it) of every `recgrid` command a doc shows."""
    out = []
    for piece in _code(doc, text):
        for m in COMMAND.finditer(piece):
            verb, rest = m.groups()
            rest = re.split(r"\s(?:\||;|&&|#)\s|\)", rest)[0]  # the command ends where the shell's next begins
            out.append((verb, FLAG.findall(rest)))
    return out


def unknown_flags(doc: str, text: str) -> list[str]:
    top, verbs = _options()
    bad = []
    for verb, flags in commands(doc, text):
        if verb.startswith("--"):
            flags, verb = [verb, *flags], None
        elif verb not in verbs:
            bad.append(f"recgrid {verb}")
            continue
        bad += [f"recgrid {verb or ''} {f}".replace("  ", " ") for f in flags if f not in top | verbs.get(verb, set())]
    return bad


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_recgrid_command_a_doc_shows_has_its_verb_and_flags(doc):
    bad = unknown_flags(doc, DOCS[doc])
    assert not bad, f"{doc} shows commands the CLI does not have: {bad}"


def test_the_command_reader_finds_the_readmes_commands():
    """The check above reads what it should: the README's commands and their flags."""
    found = commands("README.md", DOCS["README.md"])
    assert any(v == "submit" and "--no-wait" in f for v, f in found), found
    assert sum(len(f) for _, f in found) >= 20 and {v for v, _ in found} >= {"train", "submit", "compare", "plan"}


# ---- repository paths -------------------------------------------------------------------------------------------
PATH = re.compile(r"(?<![\w./:@$-])((?:\.{0,2}[\w-][\w.-]*/)+[\w.-]*|[\w-]+\.py)(?![\w/*<>{}…])")
ROOTS = {p.name for p in ROOT.iterdir()} - NOT_TRACKED
PY_NAMES = {p.name for d in ("platform", "tests", "bench", "requirements") for p in (ROOT / d).rglob("*.py")}


def unknown_paths(doc: str, text: str) -> list[str]:
    """Paths in `text` that name the repository (their first part is a top-level entry, or an entry of the
    doc's folder) and are not there; a path under platform/recgrid/ may be written from there
    (`launch/ray.py`, `train/recovery/`), a module by its file name (`peers.py`)."""
    here = (ROOT / doc).parent
    bad = []
    for m in PATH.finditer(text):
        name = m.group(1).rstrip(".")
        path = name.rstrip("/")
        if "/" not in name:  # a module's file name
            if name not in PY_NAMES:
                bad.append(name)
            continue
        first = path.split("/", 1)[0]
        if first in ROOTS or (here != ROOT and (here / first).exists()):
            if not ((ROOT / path).exists() or (here / path).exists()):
                bad.append(name)
        elif (PACKAGE / first).is_dir() and name.endswith((".py", "/")):  # `train/qps`: a metric, not a path
            if not (PACKAGE / path).exists():
                bad.append(name)
    return sorted(set(bad))


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_repository_path_a_doc_names_exists(doc):
    bad = unknown_paths(doc, DOCS[doc])
    assert not bad, f"{doc} names paths the repository does not have: {bad}"


def test_the_checks_catch_a_stale_name():
    """Each check fails on a name that does not exist (and passes its real neighbour)."""
    assert unknown_keys("x.md", "set `train.no_such_key` or `train.max_failures`") == ["train.no_such_key"]
    assert unknown_keys("x.md", "`train.fault_tolerance` is gone") == ["train.fault_tolerance"]  # not listed there
    assert unknown_flags("x.md", "`recgrid submit jobs/local_demo.yaml --no-wait --no-such-flag`") == \
        ["recgrid submit --no-such-flag"]
    assert unknown_flags("x.md", "```\n$ .venv/bin/recgrid trian jobs/local_demo.yaml\n```") == ["recgrid trian"]
    assert unknown_paths("README.md", "see `platform/recgrid/launch/ray.py`, `launch/nope.py` and tests/nope.py") \
        == ["launch/nope.py", "tests/nope.py"]
    assert unknown_paths("k8s/README.md", "`examples/secrets.example.yaml` and `examples/gone.yaml`") == \
        ["examples/gone.yaml"]
