"""A trainer's configuration, the one translation of a `JobConfig`: `EngineConfig` (what a
worker builds its part of the 2-D engine from) and `LoopConfig` (how long it trains, how often it
logs and evaluates). Below `train/`, so that the planner's CLI and the launchers read them without
importing the trainer; light to import (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from recgrid.config import JobConfig
from recgrid.data.specs import Compression, DatasetSpec
from recgrid.engine.model import ModelSpec
from recgrid.engine.optimizer import MomentScaledRowWiseAdagrad, moment_scale_for
from recgrid.engine.towers import TowerConfig


@dataclass(frozen=True)
class EngineConfig:
    """Everything a worker needs to build its part of the 2-D engine. No field has a default of
    its own: `from_job` fills them from a `JobConfig` (the job's, or `recgrid.config.defaults()`
    for code that builds trainers without a job file), so they never disagree with the config.

    Attributes:
        spec: the dataset spec (tables and their rows).
        model: the dense architecture.
        lr, eps: the embedding tables' moment-scaled row-wise AdaGrad.
        moment_scale: c; None = M of the grid the trainer is built on (`moment_scale_for`).
        dense_optimizer: "adagrad", "adam" or "sgd"; dense_lr its learning rate.
        sync_every: K, steps between replica syncs.
        delayed_moment_sync: average optimizer states one sync late, overlapped with compute.
        sharding: a TorchRec sharding type for every table, or "auto" for the planner's choice.
        row_wise_exchange: "dense" (TorchRec's reduce-scatter) or "sparse" (SRP, `engine.srp`):
            how row-wise shards return their partial sums.
        seed: seeds the dense initialisation (identical on every worker) and the data order.
        towers: Disaggregated Multi-Tower (`engine.towers`): the towers, their modules and the
            exchange; None = TorchRec's flat exchange (and `sharding` applies).
        precision: dense compute: "fp32", "tf32" (TensorFloat-32 matmuls) or "bf16" (bfloat16
            autocast of the training forward; evaluation stays float32); None = the device's
            default (`engine.device.default_precision`: tf32 on CUDA, fp32 on CPU). tf32 and bf16
            need CUDA.
        ne_window_steps: the training NE's window, in steps.
    """

    spec: DatasetSpec
    model: ModelSpec
    lr: float
    eps: float
    moment_scale: float | None
    dense_optimizer: str
    dense_lr: float
    sync_every: int
    delayed_moment_sync: bool
    sharding: str
    row_wise_exchange: str
    seed: int
    towers: TowerConfig | None
    precision: str | None
    ne_window_steps: int

    @classmethod
    def from_job(cls, config: JobConfig, **overrides: Any) -> "EngineConfig":
        """The engine of job `config` (the one translation of a JobConfig), with `overrides` of
        these fields (tests and benchmarks: a dataset spec of their own, another K...)."""
        m, o = config.model, config.optim
        engine = cls(
            spec=config.dataset_spec(),
            # null sizes stay null: the engine resolves them against `spec` (an override may change it)
            model=ModelSpec(arch=m.arch, embedding_dim=m.embedding_dim,
                            dense_arch=tuple(m.dense_arch) if m.dense_arch is not None else None,
                            over_arch=tuple(m.over_arch), dcn_num_layers=m.dcn_num_layers,
                            dcn_low_rank_dim=m.dcn_low_rank_dim, embedding_dtype=m.embedding_dtype,
                            compression=config.compression()),  # a head cache's ids: `with_compression`
            lr=o.lr, eps=o.eps, moment_scale=o.moment_scale,  # c = M of each attempt's grid unless fixed
            dense_optimizer=o.dense_optimizer, dense_lr=o.dense_lr,
            sync_every=config.grid.sync_every, delayed_moment_sync=config.grid.delayed_moment_sync,
            sharding=m.sharding, row_wise_exchange=m.row_wise_exchange, seed=config.train.seed, towers=config.tower_config(),
            precision=config.train.precision, ne_window_steps=config.train.ne_window_steps,
        )
        return replace(engine, **overrides)

    def with_compression(self, compression: Compression | None) -> "EngineConfig":
        """This engine with `compression` (the job's, once the driver has counted its head ids)."""
        return replace(self, model=replace(self.model, compression=compression))

    def embedding_optimizer(self, num_groups: int) -> MomentScaledRowWiseAdagrad:
        return MomentScaledRowWiseAdagrad(lr=self.lr, eps=self.eps,
                                          moment_scale=moment_scale_for(num_groups, self.moment_scale))


@dataclass(frozen=True)
class LoopConfig:
    """How long to train, and how often to log and evaluate (in steps). Snapshots and storage
    checkpoints own their cadence (`train.recovery.holders.Snapshotter`, `train.checkpoint.Checkpointer`).
    No defaults of its own: `from_job` fills it from a JobConfig."""

    max_steps: int
    batch_size: int
    log_every: int
    eval_every: int  # 0: evaluate only at the end

    @classmethod
    def from_job(cls, config: JobConfig, **overrides: Any) -> "LoopConfig":
        t = config.train
        return replace(cls(max_steps=t.max_steps, batch_size=t.batch_size, log_every=t.log_every,
                           eval_every=t.eval_every), **overrides)
