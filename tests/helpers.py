"""The config helper every test module shares: a trainer's engine, made as a job makes its own.

A free port: `recgrid.launch.local.free_port`. Fault-tolerance jobs in the background: `faults`.
"""

from __future__ import annotations

from typing import Any

from recgrid.config import defaults
from recgrid.trainer_config import EngineConfig


def engine_config(*overrides: str, **fields: Any) -> EngineConfig:
    """The engine of a job of the config's defaults with `section.field=value` `overrides` (applied
    in order, so a later one wins), through `EngineConfig.from_job`, the one translation a job's
    workers use; `fields` replace what no config key carries (a dataset spec, a `ModelSpec`, towers)."""
    return EngineConfig.from_job(defaults(*overrides), **fields)
