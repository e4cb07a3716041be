"""The job config: typed sections, a docstring per field, validated in one place.

This module owns what a training job can be told (`JobConfig`; its six sections and their field
docs live in `config_sections`, importable from here), how it is read (`load_config`: a YAML file
plus `--set section.field=value` overrides, values parsed as YAML scalars) and the one validation
pass (`JobConfig.validate`, run on construction), so a wrong value fails at start-up with a
sentence that begins with the field's path, e.g. `optim.lr: must be > 0, got -0.1`.

The config keeps what the user wrote; values left null are resolved by `JobConfig`'s properties
(`embedding_dim`, `dense_arch`, `moment_scale`, `precision`, `checkpoints`, `snapshots`,
`run_name`) from the dataset spec, the grid and the device, so changing `grid.num_groups` later
never leaves a stale `c` behind. `to_flat_dict()` gives the resolved values as dotted keys for
MLflow params.

Relative paths and globs in `data` are relative to the current directory (where `recgrid
train` runs); globs with a URI scheme (`s3://...`) are left to Ray Data and not checked.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

from recgrid.config_sections import SECTIONS, DataConfig, GridConfig, ModelConfig, OptimConfig, TrackingConfig
from recgrid.config_sections import TrainConfig
from recgrid.data.specs import Compression, DatasetSpec, SpecError, get_spec
from recgrid.engine.device import GPU_PRECISIONS, default_precision
from recgrid.engine.grid import Grid, GridError
from recgrid.engine.model import GPU_EMBEDDING_DTYPES, default_dense_arch
from recgrid.engine.optimizer import moment_scale_for
from recgrid.engine.srp import SPARSE_SHARDINGS
from recgrid.engine.towers import TowerConfig, TowerError, TowerLayout

class ConfigError(ValueError):
    """A config value that cannot work; the message starts with the field's path."""


# the derived cadences (`JobConfig.checkpoints`, `JobConfig.snapshots`), decided here
CHECKPOINT_EVERY_S = 1800.0  # a storage checkpoint every 30 minutes of training
SNAPSHOT_STEP_FRACTION = 0.02  # in-memory snapshots cost at most this share of the step time (path + holder CPU)
SNAPSHOT_MAX_SYNCS = 20  # ... and are never more than this many replica syncs apart


@dataclass(frozen=True)
class CheckpointCadence:
    """When the storage checkpoints are written, at sync steps: every `every_steps` steps (a
    multiple of K), or at the first sync step `every_s` seconds of training after the last one;
    neither: none."""

    every_steps: int = 0
    every_s: float = 0.0

    @property
    def on(self) -> bool:
        return bool(self.every_steps or self.every_s)

    def param(self) -> int | str:
        """The run's `train.checkpoint_every` param: the steps, or the time budget ("1800s")."""
        return f"{self.every_s:g}s" if self.every_s else self.every_steps


@dataclass(frozen=True)
class SnapshotCadence:
    """When the in-memory snapshots are taken, at committed replica syncs: every `every_syncs`
    syncs, or with `measured` as often as keeps their cost (the writer's time on the step's path
    and its host holder's CPU: `Snapshotter.syncs_apart`) at or under `step_fraction` of the step
    time, at most `max_syncs` syncs apart; neither: none."""

    every_syncs: int = 0
    measured: bool = False
    step_fraction: float = SNAPSHOT_STEP_FRACTION
    max_syncs: int = SNAPSHOT_MAX_SYNCS

    @property
    def on(self) -> bool:
        return self.measured or self.every_syncs > 0

    def param(self) -> int | str:
        """The run's `train.snapshot_every_syncs` param: the syncs, or "measured" (derived)."""
        return f"measured (<= {self.step_fraction:.0%} of the step time, <= {self.max_syncs} syncs apart)" \
            if self.measured else self.every_syncs




# ---- the job ----------------------------------------------------------------------------------
@dataclass
class JobConfig:
    """One training job. Constructing it validates it (raises `ConfigError`)."""

    grid: GridConfig = field(default_factory=GridConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    _: dataclasses.KW_ONLY
    check_paths: dataclasses.InitVar[bool] = True
    """Construction only: false skips checking that local data globs match files here (a config
    validated for another machine, e.g. a cluster job's, whose data lives on the cluster)."""

    def __post_init__(self, check_paths: bool = True) -> None:
        self.validate(check_paths=check_paths)

    # ---- validation: the one place ----------------------------------------------------------------
    def validate(self, *, check_paths: bool = True) -> None:
        """Check types and values of every field; raise `ConfigError` naming the first bad field.
        With `check_paths` false, local data globs need not match any file on this machine."""
        for name, cls in SECTIONS.items():
            section = getattr(self, name)
            if not isinstance(section, cls):
                raise ConfigError(f"{name}: must be a {cls.__name__}, got {type(section).__name__}")
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                setattr(section, f.name, _coerce(f"{name}.{f.name}", getattr(section, f.name), hints[f.name]))

        g, m, d, t, o = self.grid, self.model, self.data, self.train, self.optim
        _at_least("grid.world_size", g.world_size, 1)
        _at_least("grid.num_groups", g.num_groups, 1)
        if g.world_size % g.num_groups:
            valid = [x for x in range(1, g.world_size + 1) if g.world_size % x == 0]
            raise ConfigError(
                f"grid.num_groups: M={g.num_groups} must divide grid.world_size T={g.world_size}; "
                f"valid values for T={g.world_size}: {valid}"
            )
        _at_least("grid.sync_every", g.sync_every, 1)
        if g.min_world_size is not None:
            L = g.world_size // g.num_groups
            if not 1 <= g.min_world_size <= g.world_size or g.min_world_size % L:
                raise ConfigError(
                    f"grid.min_world_size: must be a multiple of L = T / M = {L} between {L} and T={g.world_size} "
                    f"(whole sharding groups), got {g.min_world_size}")
        try:
            self.build_grid()
        except GridError as e:
            raise ConfigError(f"grid: {e}") from None

        if d.max_rows_per_table is not None:
            _at_least("data.max_rows_per_table", d.max_rows_per_table, 1)
        spec = self.dataset_spec()
        if m.embedding_dim is not None:
            _at_least("model.embedding_dim", m.embedding_dim, 1)
        for path, arch in (("model.dense_arch", m.dense_arch or []), ("model.over_arch", m.over_arch)):
            for i, size in enumerate(arch):
                _at_least(f"{path}[{i}]", size, 1)
        if m.dense_arch is not None:
            if not m.dense_arch or m.dense_arch[-1] != self.embedding_dim:
                raise ConfigError(
                    f"model.dense_arch: must end in the embedding dimension {self.embedding_dim} "
                    f"(model.embedding_dim, or spec {spec.name!r}'s default), got {m.dense_arch}"
                )
        if not m.over_arch or m.over_arch[-1] != 1:
            raise ConfigError(f"model.over_arch: must end in 1 (one logit per row), got {m.over_arch}")
        _at_least("model.dcn_num_layers", m.dcn_num_layers, 1)
        _at_least("model.dcn_low_rank_dim", m.dcn_low_rank_dim, 1)
        if m.row_wise_exchange == "sparse":
            if m.sharding not in SPARSE_SHARDINGS:
                raise ConfigError(
                    f"model.row_wise_exchange: sparse (SRP) exchanges row-wise shards only; model.sharding is "
                    f"{m.sharding}, use {' or '.join(SPARSE_SHARDINGS)} (auto may choose types without a row-wise "
                    f"exchange; table_row_wise and grid_shard are not covered yet)")
            if m.towers is not None:
                raise ConfigError("model.row_wise_exchange: sparse (SRP) does not apply to model.towers (DMT has its "
                                  "own exchange); leave it dense")
        if m.towers is None and (m.tower_module != "none" or m.tower_compression != 1.0):
            raise ConfigError("model.tower_module: tower modules and their compression need model.towers "
                              "(a tower count or a partition file)")
        if m.towers is not None:
            if m.tower_module == "none" and m.tower_compression != 1.0:
                raise ConfigError(f"model.tower_compression: {m.tower_compression} needs a tower module "
                                  f"(model.tower_module: dlrm or dcn); pass-through towers compress nothing")
            if check_paths or str(m.towers).strip().isdigit():
                try:
                    TowerLayout(self.build_grid(), self.tower_config().num_towers)  # type: ignore[union-attr]
                except TowerError as e:
                    raise ConfigError(f"model.towers: {e}") from None
            if self.train.checkpoint_every or self.train.resume_from:
                raise ConfigError("model.towers: storage checkpoints of tower models are not supported yet; "
                                  "leave train.checkpoint_every at 0 and train.resume_from unset (in-memory "
                                  "snapshots and peer recovery work)")
        self._check_compression(spec)
        if m.embedding_dtype in GPU_EMBEDDING_DTYPES and not self.train.use_gpu:
            raise ConfigError(
                f"model.embedding_dtype: {m.embedding_dtype} tables need GPU workers (train.use_gpu: true); "
                f"CPU workers keep fp32 tables, set fp32")

        if not d.train:
            raise ConfigError("data.train: required: one or more globs of Criteo TSV, .gz or parquet files")
        for path, patterns in (("data.train", d.train), ("data.eval", d.eval)):
            for pattern in patterns:
                if not pattern.strip():
                    raise ConfigError(f"{path}: empty glob in {patterns}")
                if check_paths and not d.synth_if_missing and not _matches(pattern):
                    raise ConfigError(
                        f"{path}: no file matches {pattern!r} (relative to {os.getcwd()}); "
                        f"fix the glob, or set data.synth_if_missing: true to generate synthetic data there"
                    )
        _at_least("data.synth_rows", d.synth_rows, 1)
        _at_least("data.synth_eval_rows", d.synth_eval_rows, 1)

        _at_least("train.max_steps", t.max_steps, 1)
        _at_least("train.batch_size", t.batch_size, 1)
        _at_least("train.eval_every", t.eval_every, 0)
        _at_least("train.log_every", t.log_every, 1)
        _at_least("train.ne_window_steps", t.ne_window_steps, 1)
        _positive("train.cpus_per_worker", t.cpus_per_worker)
        for name, amount in t.resources_per_worker.items():
            if not name.strip():
                raise ConfigError("train.resources_per_worker: a resource name must not be empty")
            if name in ("CPU", "GPU"):
                raise ConfigError(
                    f"train.resources_per_worker.{name}: CPUs and GPUs are not set here; use "
                    f"{'train.cpus_per_worker' if name == 'CPU' else 'train.use_gpu'}")
            _positive(f"train.resources_per_worker.{name}", amount)
        if t.precision in GPU_PRECISIONS and not t.use_gpu:
            raise ConfigError(
                f"train.precision: {t.precision} needs GPU workers (train.use_gpu: true); CPU workers compute in "
                f"fp32, leave it null or set fp32")
        _at_least("train.max_failures", t.max_failures, 0)
        if t.snapshot_every_syncs is not None:
            _at_least("train.snapshot_every_syncs", t.snapshot_every_syncs, 0)
        self._check_checkpoints()
        if t.resume_from is not None and "://" not in t.resume_from:
            if not (Path(t.resume_from) / ".metadata").is_file():
                raise ConfigError(f"train.resume_from: {t.resume_from} is not a storage checkpoint directory "
                                  f"(no .metadata in it)")
        _at_least("data.rows_per_unit", d.rows_per_unit, 1)

        _positive("optim.lr", o.lr)
        _positive("optim.eps", o.eps)
        if o.moment_scale is not None:
            _positive("optim.moment_scale", o.moment_scale)
        _positive("optim.dense_lr", o.dense_lr)
        if not self.tracking.experiment.strip():
            raise ConfigError("tracking.experiment: must not be empty")

    def _check_checkpoints(self) -> None:
        """train.checkpoint_every as written: null (derived: `checkpoints`) or a multiple of K."""
        t, K = self.train, self.grid.sync_every
        if t.checkpoint_every is None:
            return
        _at_least("train.checkpoint_every", t.checkpoint_every, 0)
        if t.checkpoint_every % K:
            raise ConfigError(
                f"train.checkpoint_every: must be a multiple of grid.sync_every K={K} (checkpoints are "
                f"written at sync steps, when the replicas are identical), got {t.checkpoint_every}; "
                f"leave it null for the derived cadence (every {CHECKPOINT_EVERY_S:g} s of training)")

    def _check_compression(self, spec: DatasetSpec) -> None:
        """model.compression and its fields (data/specs.py, engine/compression.py)."""
        m = self.model
        if m.compression == "none":
            return  # the qr_ and head_ fields wait unused (a sweep may switch compression alone)
        if m.qr_collisions < 2:
            raise ConfigError(f"model.qr_collisions: c must be >= 2 (c = 1 compresses nothing), got {m.qr_collisions}")
        _at_least("model.qr_threshold_rows", m.qr_threshold_rows, 1)
        rows = spec.table_rows
        if max(rows) <= m.qr_threshold_rows:
            raise ConfigError(
                f"model.qr_threshold_rows: {m.qr_threshold_rows} compresses no table: the largest table of spec "
                f"{spec.name!r} has {max(rows):,} rows" + (f" (data.max_rows_per_table={self.data.max_rows_per_table})"
                                                         if self.data.max_rows_per_table else "")
                + "; lower it or set model.compression: none")
        _at_least("model.head_rows", m.head_rows, 0)
        if m.head_coverage is not None:
            if not 0 < m.head_coverage < 1:
                raise ConfigError(f"model.head_coverage: must be in (0, 1) (a fraction of the lookups), "
                                  f"got {m.head_coverage}")
            if m.head_rows > 0:
                raise ConfigError(f"model.head_coverage: set either model.head_rows ({m.head_rows}) or "
                                  f"model.head_coverage, not both")
        if m.qr_operation == "mult" and spec.multi_hot:
            raise ConfigError(
                "model.qr_operation: mult needs one id per bag: the tables pool each part's rows before they "
                "combine, and the product of pooled sums is not the pooled sum of per-id products for bags of "
                "more than one id; use add or concat with multi-hot data")
        if m.qr_operation == "concat" and self.embedding_dim % 2:
            raise ConfigError(f"model.qr_operation: concat splits the embedding dimension into two halves; "
                              f"{self.embedding_dim} is odd (model.embedding_dim)")
        if m.towers is not None:
            raise ConfigError("model.compression: QR compression does not work with model.towers (DMT builds "
                              "its own tables); set model.compression: none or leave model.towers unset")

    def compression(self) -> Compression | None:
        """The job's QR compression (without its head ids: the driver counts them), or None."""
        m = self.model
        if m.compression == "none":
            return None
        return Compression(threshold_rows=m.qr_threshold_rows, collisions=m.qr_collisions, operation=m.qr_operation,
                           head_rows=m.head_rows, head_coverage=m.head_coverage)

    # ---- derived values -------------------------------------------------------------------------
    @property
    def min_groups(self) -> int:
        """The fewest live sharding groups that train (`grid.min_world_size` / L; one when null)."""
        g = self.grid
        return (g.min_world_size or g.world_size // g.num_groups) // (g.world_size // g.num_groups)

    def build_grid(self) -> Grid:
        """The `recgrid.grid.Grid` of this job (also reachable as `cfg.grid()`)."""
        return self.grid()

    def dataset_spec(self) -> DatasetSpec:
        """The dataset spec named by `data.spec`, with `data.max_rows_per_table` and `data.multi_hot` applied."""
        try:
            return get_spec(self.data.spec, self.data.max_rows_per_table, self.data.multi_hot or None)
        except SpecError as e:
            raise ConfigError(f"data.spec: {e}") from None

    @property
    def embedding_dim(self) -> int:
        """`model.embedding_dim`, or the dataset spec's default."""
        return self.model.embedding_dim or self.dataset_spec().embedding_dim

    @property
    def dense_arch(self) -> list[int]:
        """`model.dense_arch`, or `engine.model.default_dense_arch(embedding_dim)`."""
        if self.model.dense_arch is not None:
            return list(self.model.dense_arch)
        return list(default_dense_arch(self.embedding_dim))

    @property
    def precision(self) -> str:
        """`train.precision`, or the device's default (tf32 on GPU workers, fp32 on CPU)."""
        return self.train.precision or default_precision(self.train.use_gpu)

    def tower_config(self) -> TowerConfig | None:
        """The DMT towers of `model.towers` (reads the partition file), or None: the flat exchange."""
        m = self.model
        if m.towers is None:
            return None
        return TowerConfig.from_option(m.towers, module=m.tower_module, compression=m.tower_compression)

    @property
    def can_restore(self) -> bool:
        """Whether a failure can be survived at all (`train.max_failures` > 0): only then are the
        derived snapshot and checkpoint cadences on."""
        return self.train.max_failures > 0

    @property
    def checkpoints(self) -> CheckpointCadence:
        """When the storage checkpoints are written: `train.checkpoint_every` steps, or when null
        every `CHECKPOINT_EVERY_S` of training for a job that can restore (none else, and none for
        tower models, which write none)."""
        t = self.train
        if t.checkpoint_every is not None:
            return CheckpointCadence(every_steps=t.checkpoint_every)
        if self.model.towers is not None or not self.can_restore:
            return CheckpointCadence()
        return CheckpointCadence(every_s=CHECKPOINT_EVERY_S)

    @property
    def snapshots(self) -> SnapshotCadence:
        """When the in-memory snapshots are taken: `train.snapshot_every_syncs`, or when null
        measured (`SnapshotCadence`) for a job that can restore and whose host loss can take every
        live copy of a shard (host-local at any M, M = 1 under either layout), else none."""
        t, g = self.train, self.grid
        if t.snapshot_every_syncs is not None:
            return SnapshotCadence(every_syncs=t.snapshot_every_syncs)
        exposed = g.layout == "host-local" or g.num_groups == 1
        return SnapshotCadence(measured=self.can_restore and exposed)

    @property
    def moment_scale(self) -> float:
        """c: `optim.moment_scale`, or M."""
        return moment_scale_for(self.grid.num_groups, self.optim.moment_scale)

    def run_params(self) -> dict[str, Any]:
        """The MLflow params of a job: every config key once (nulls resolved, as `to_flat_dict`),
        plus `derived.group_size` (L). What else a run logs is in `DERIVED_PARAMS`."""
        return {**self.to_flat_dict(), "derived.group_size": self.build_grid().group_size}

    @property
    def run_name(self) -> str:
        """`tracking.run_name`, or "T<T>-M<M>-K<K>" ("T<T>-M1" when M = 1: no replica groups, K does not apply)."""
        g = self.grid
        k = f"-K{g.sync_every}" if g.num_groups > 1 else ""
        return self.tracking.run_name or f"T{g.world_size}-M{g.num_groups}{k}"

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The config as written (nulls kept), nested: `{"grid": {"world_size": 4, ...}, ...}`."""
        return dataclasses.asdict(self)

    def to_flat_dict(self, resolved: bool = True) -> dict[str, Any]:
        """`{"grid.world_size": 4, ...}` for MLflow params; with `resolved`, nulls that have a
        derived value (embedding_dim, dense_arch, moment_scale, precision, checkpoints,
        snapshots, run_name) carry it."""
        flat = {f"{s}.{k}": v for s, fields_ in self.to_dict().items() for k, v in fields_.items()}
        if resolved:
            flat.update({
                "model.embedding_dim": self.embedding_dim,
                "model.dense_arch": self.dense_arch,
                "optim.moment_scale": self.moment_scale,
                "train.precision": self.precision,
                "train.checkpoint_every": self.checkpoints.param(),
                "train.snapshot_every_syncs": self.snapshots.param(),
                "tracking.run_name": self.run_name,
            })
        return flat

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str | None = None, *, check_paths: bool = True) -> "JobConfig":
        """Build and validate from `{"section": {"field": value}}`; unknown keys are errors
        (naming `source`, e.g. the YAML file, when given). `check_paths`: see `JobConfig.check_paths`."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source or 'config'}: must be a mapping of sections {list(SECTIONS)}, got {type(raw).__name__}")
        _check_keys(raw, source)
        sections = {name: SECTIONS[name](**(values or {})) for name, values in raw.items()}
        return cls(**sections, check_paths=check_paths)


# Params a run carries that are not config keys (every config key is a param, once, under its
# `section.field` name): values derived from the config or from where the job ran, each under one
# name that no config key has.
DERIVED_PARAMS: dict[str, str] = {
    "derived.group_size": "L = T / M: workers in one sharding group",
    "derived.workers_per_node": "workers per node as the grid placed them (attempt 0)",
    "derived.nodes": "distinct nodes the job's first placement ran on (each global rank's first process)",
    "derived.global_batch": "`recgrid compare`'s parent run: T x train.batch_size",
}
# prefixes of params that are not config keys either: the stack's versions (`Tracker.log_stack_versions`)
# and `recgrid compare`'s own options on its parent run
DERIVED_PARAM_PREFIXES = ("versions.", "compare.")


def defaults(*overrides: str) -> JobConfig:
    """The job config's defaults with `section.field=value` overrides, for code that builds a
    trainer without a job file (tests, benchmarks, `recgrid smoke`), so its engine and loop take
    their values from this module as a job's do (`EngineConfig.from_job`). It names no data:
    data.train is a placeholder such code never reads."""
    return load_config(None, ["data.train=[unused]", *overrides], check_paths=False)


# ---- loading ----------------------------------------------------------------------------------
def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = (), *,
                check_paths: bool = True) -> JobConfig:
    """Read a job YAML (or start from defaults when `path` is None), apply `section.field=value`
    overrides in order, validate, and return the `JobConfig`. With `check_paths` false, local data
    globs need not match files here (validating a cluster job's config on a laptop)."""
    import yaml

    raw: dict[str, Any] = {}
    source = None
    if path is not None:
        source = str(path)
        if not Path(path).is_file():
            raise ConfigError(f"{source}: config file does not exist")
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{source}: must be a mapping of sections {list(SECTIONS)}, got {type(loaded).__name__}")
        raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in (loaded or {}).items()}
        _check_keys(raw, source)  # before overrides, so the error names the file

    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item}: expected SECTION.FIELD=VALUE, e.g. grid.num_groups=2")
        section, dot, name = key.partition(".")
        if section not in SECTIONS:
            raise ConfigError(f"{key}: unknown section in --set{_did_you_mean(section, SECTIONS)}; "
                              f"valid sections: {', '.join(SECTIONS)}")
        valid = _field_names(SECTIONS[section])
        if key in RETIRED_KEYS:
            raise _retired(key, " in --set")
        if not dot or name not in valid:
            raise ConfigError(f"{key}: unknown key in --set{_did_you_mean(name, valid, section + '.')}; "
                              f"valid keys in {section}: {', '.join(valid)}")
        raw.setdefault(section, None)
        raw[section] = {**(raw[section] or {}), name: _parse_scalar(text)}
    return JobConfig.from_dict(raw, source=source, check_paths=check_paths)


RETIRED_KEYS: dict[str, str] = {
    "train.fault_tolerance": "recgrid has one fault-tolerance design: every sharding group is a Ray Train run of "
                             "its own, restarted alone and healed from a live peer group (README, \"Failures and "
                             "restarts\"); delete the key",
    "train.resize_check_s": "every sharding group's run waits for room on its own and joins the live groups when "
                            "it starts, so there is no resize to check for; delete the key",
}
"""Keys that configs once had, and why each is refused now (an old config fails with the sentence)."""


def _retired(key: str, where: str) -> ConfigError:
    return ConfigError(f"{key}{where}: no longer a setting: {RETIRED_KEYS[key]}")


def _check_keys(raw: Mapping[str, Any], source: str | None) -> None:
    """Fail on an unknown section or key, or a section that is not a mapping."""
    where = f" in {source}" if source else ""
    for name, values in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"{name}: unknown section{where}{_did_you_mean(name, SECTIONS)}; "
                              f"valid sections: {', '.join(SECTIONS)}")
        if values is not None and not isinstance(values, Mapping):
            raise ConfigError(f"{name}: must be a mapping of fields{where}, got {values!r}")
        valid = _field_names(SECTIONS[name])
        for key in values or {}:
            if f"{name}.{key}" in RETIRED_KEYS:
                raise _retired(f"{name}.{key}", where)
            if key not in valid:
                raise ConfigError(f"{name}.{key}: unknown key{where}{_did_you_mean(str(key), valid, name + '.')}; "
                                  f"valid keys in {name}: {', '.join(valid)}")


def _did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """' (did you mean grid.num_groups?)' for the closest valid name, or '' when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _parse_scalar(text: str) -> Any:
    """A `--set` value as YAML reads it (`2` → 2, `true` → True, `null` → None, `[a, b]` → list);
    text YAML cannot parse (e.g. a glob starting with `*`) stays a string."""
    import yaml

    text = text.strip()
    try:
        return yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return text


def field_docs() -> dict[str, str]:
    """`{"grid.world_size": "T: number of training workers ...", ...}`: each field's docstring, on
    one line, read from `config_sections`' source (for docs/reference.md and `recgrid keys`)."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(GridConfig)))  # type: ignore[arg-type]
    classes = {c.__name__: s for s, c in SECTIONS.items()}
    docs: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            body = node.body
            for a, b in zip(body, body[1:]):
                if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                        and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)):
                    text = " ".join(line.strip() for line in str(b.value.value).splitlines())
                    docs[f"{classes[node.name]}.{a.target.id}"] = text.strip()
    return docs


def reference_table() -> str:
    """docs/reference.md's job config reference, as Markdown: every field's key, default and docstring
    (docs/reference.md holds exactly this between its config-table markers; a test checks it)."""
    docs, defaults = field_docs(), field_defaults()
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, default in defaults.items():
        if docs[key].startswith("Required."):
            default = "(required)"
        lines.append(f"| `{key}` | `{default}` | {docs[key]} |")
    return "\n".join(lines)


def field_defaults() -> dict[str, Any]:
    """`{"grid.world_size": 4, ...}`: every field's default, in section and field order."""
    out: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f"{section}.{f.name}"] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                out[f"{section}.{f.name}"] = f.default_factory()  # type: ignore[misc]
    return out


# ---- field checks -------------------------------------------------------------------------------
def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """`value` as type `tp` (the field's annotation), or a ConfigError naming `path`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(path, value, inner)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: must be one of {list(args)}, got {value!r}")
        return value
    if origin is dict:
        key_type, value_type = args
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: must be a mapping, got {value!r}")
        return {_coerce(f"{path} key", k, key_type): _coerce(f"{path}.{k}", v, value_type) for k, v in value.items()}
    if origin is list:
        (elem,) = args
        if isinstance(value, str) and elem is str:
            value = [value]  # one glob may be given as a plain string
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: must be a list, got {value!r}")
        return [_coerce(f"{path}[{i}]", v, elem) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # PyYAML reads `1e-3` (no dot) as a string; accept numeric text for float fields
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{path}: must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. `--set tracking.run_name=2024`
        if not isinstance(value, str):
            raise ConfigError(f"{path}: must be a string, got {value!r}")
        return value
    raise TypeError(f"{path}: unsupported field type {tp!r}")  # a bug in this module, not in the config


def _at_least(path: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{path}: must be >= {low}, got {value}")


def _positive(path: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{path}: must be > 0, got {value}")


def _matches(pattern: str) -> bool:
    if "://" in pattern:
        return True  # remote storage: Ray Data reads and checks it
    # the data reader's own expansion, imported here: it brings pyarrow, which reading a config needs not
    from recgrid.data.criteo import names_data

    return names_data(pattern)


if __name__ == "__main__":  # python -m recgrid.config: print docs/reference.md's config reference
    print(reference_table())
