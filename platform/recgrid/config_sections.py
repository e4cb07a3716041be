"""The job config's six sections: every field a job can set, with its type, default and docstring.

The docstring under each field is that field's documentation: `recgrid.config.field_docs()` reads
them from this module's source for docs/reference.md's config table and `recgrid keys`. Choices
come from the modules that implement them (`LAYOUTS`, `SHARDINGS`, ...). `recgrid.config` joins the
sections into `JobConfig`, validates them and resolves their nulls; import them from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from recgrid.data.specs import COMPRESSIONS, QR_OPERATIONS
from recgrid.engine.device import PRECISIONS
from recgrid.engine.grid import LAYOUTS, Grid
from recgrid.engine.model import ARCHS, EMBEDDING_DTYPES
from recgrid.engine.optimizer import DENSE_OPTIMIZERS
from recgrid.engine.sharding import SHARDINGS
from recgrid.engine.srp import ROW_WISE_EXCHANGES
from recgrid.engine.towers import TOWER_MODULES


@dataclass
class GridConfig:
    """How the T workers form the 2-D grid (DESIGN.md's vocabulary)."""

    world_size: int = 4
    """T: number of training workers (one per GPU, or per CPU slot in CPU mode)."""
    num_groups: int = 1
    """M: number of sharding groups, i.e. full model copies; must divide T. M = 1 is TorchRec's ordinary full
    model parallelism."""
    sync_every: int = 1
    """K: steps between two replica-group syncs of embedding weights and optimizer states (1 = every step)."""
    layout: Literal[LAYOUTS] = "host-local"
    """Rank layout: "host-local" puts each replica group on one host (fast sync); "inter-host" spreads it over
    hosts (survives losing a host)."""
    delayed_moment_sync: bool = False
    """Sync optimizer states one sync interval behind the weights, as the TorchRec team reports works best."""
    min_world_size: int | None = None
    """The fewest workers that train, a multiple of L = T / M: every job is elastic by whole sharding groups
    (each one a Ray Train run: it leaves when its workers fail or its node is drained, and comes back, healed
    from a live peer group, when there is room for it; no resharding, a shard's identity is its position
    inside a sharding group), and the live groups' quorum waits for min_world_size / L of them; null = L, one
    group."""

    def __call__(self) -> Grid:
        """`cfg.grid()`: the `recgrid.grid.Grid` of this section (same as `JobConfig.build_grid()`)."""
        return Grid(world_size=self.world_size, num_groups=self.num_groups, layout=self.layout)


@dataclass
class ModelConfig:
    """The DLRM-family model and how its embedding tables are sharded inside a sharding group."""

    arch: Literal[ARCHS] = "dlrm"
    """Model: "dlrm" (dot interaction) or "dcn" (DLRM with a low-rank DCN-v2 cross interaction)."""
    embedding_dim: int | None = None
    """Embedding dimension of every table; null = the dataset spec's default."""
    dense_arch: list[int] | None = None
    """Layer sizes of the bottom (dense) MLP; must end in the embedding dimension (a config that does not is
    refused). null = [64, embedding_dim]."""
    over_arch: list[int] = field(default_factory=lambda: [64, 32, 1])
    """Layer sizes of the top (over) MLP; must end in 1 (one logit)."""
    dcn_num_layers: int = 3
    """Cross layers of the DCN interaction (arch "dcn" only)."""
    dcn_low_rank_dim: int = 16
    """Rank of the low-rank cross layers (arch "dcn" only)."""
    sharding: Literal[SHARDINGS] = "auto"
    """How tables are sharded over the L workers of a sharding group; "auto" lets recgrid's planner choose per
    table: the search `recgrid plan` runs, priced for the device the job runs on (published GPU figures on
    GPUs, measured CPU figures on CPU workers; `recgrid plan --config JOB.yaml` prints the plan a job gets); a
    named type is TorchRec's planner restricted to it."""
    row_wise_exchange: Literal[ROW_WISE_EXCHANGES] = "dense"
    """How row-wise shards return their pooled partial sums to the workers that own the samples: "dense"
    (TorchRec's reduce-scatter, a partial sum for every bag, zeros included) or "sparse" (SRP: each shard
    sends only the partial sums of bags that have ids on it, in a variable-size all-to-all; same results,
    fewer bytes). "sparse" needs model.sharding: row_wise (not auto, table_row_wise or grid_shard yet) and no
    model.towers."""
    embedding_dtype: Literal[EMBEDDING_DTYPES] = "fp32"
    """Data type of the embedding tables' weights (TorchRec's table data type; optimizer states and pooled
    embeddings stay fp32): "fp16" halves table memory (the replica sync averages them in fp32, so its bytes
    stay fp32's). GPU workers only."""
    towers: str | None = None
    """Disaggregated Multi-Tower: N towers per sharding group, as a count (feature f in tower f % N) or a
    partition file written by `recgrid towers`. A tower is L / N workers of a sharding group on one host (or
    whole hosts) holding its features' tables (single-hot column-wise, multi-hot row-wise); embeddings return
    by SPTT: an intra-tower all-to-all, then one among the N peers across hosts. null = TorchRec's flat
    exchange (model.sharding applies). Storage checkpoints are not supported yet."""
    tower_module: Literal[TOWER_MODULES] = "none"
    """DMT only: the dense module each tower runs on its embeddings before the cross-host exchange: "none"
    (pass-through, the flat exchange's numbers), "dlrm" (the paper's Listing 1: a linear to p·D plus a
    projection to c·D) or "dcn" (a one-layer low-rank CrossNet and a linear)."""
    tower_compression: float = 1.0
    """DMT only: CR of the tower modules: a tower of F_t features sends max(1, round(F_t / CR)) embeddings
    across hosts instead of F_t, so cross-host bytes shrink by about CR."""
    compression: Literal[COMPRESSIONS] = "none"
    """Embedding compression: "qr" replaces every table of more than qr_threshold_rows rows by a quotient
    table (ceil(rows / c) rows, index id // c) and a remainder table (c rows, index id % c), combined per id
    by qr_operation (RecScale); "none" = full tables."""
    qr_threshold_rows: int = 1_000_000
    """QR: tables with more rows than this (after data.max_rows_per_table) are compressed; the default leaves
    tables small enough that a collision costs more quality than their memory is worth (on Criteo Kaggle it
    compresses the five tables that hold 98% of the rows)."""
    qr_collisions: int = 4
    """QR: c, the remainder table's rows: c ids share each quotient row (embedding memory of a compressed
    table shrinks about c-fold); at least 2."""
    qr_operation: Literal[QR_OPERATIONS] = "mult"
    """QR: how an id's quotient row q and remainder row r combine: "mult" (q * r; one-hot data only), "add" (q
    + r) or "concat" (q and r of half the embedding dimension each, concatenated; needs an even dimension)."""
    head_rows: int = 0
    """QR head cache: the H most frequent ids of each compressed table (counted over the training files before
    training, fixed for the job's life, recorded as the run artifact compression/head_ids.npz) get full rows
    of their own; only the other ids go through QR. 0 = none (unless head_coverage)."""
    head_coverage: float | None = None
    """QR head cache sized by coverage instead of head_rows: the fewest ids that cover this fraction of each
    compressed table's lookups, in (0, 1); null = head_rows decides."""


@dataclass
class DataConfig:
    """Where the Criteo-format rows come from and which dataset spec they follow."""

    train: list[str] = field(default_factory=list)
    """Required. Glob(s) of training files: raw Criteo TSV, .gz, or parquet. One string or a list; `**`
    matches zero or more directories (`DIR/**/*.gz`: every .gz file in DIR and below)."""
    eval: list[str] = field(default_factory=list)
    """Glob(s) of evaluation files; empty = no evaluation."""
    spec: str = "tiny"
    """Dataset spec: "tiny", "criteo_kaggle", "criteo_1tb" (suffix "+multihot" for MLPerf bag sizes) or a spec
    YAML path."""
    max_rows_per_table: int | None = None
    """Cap every embedding table at this many rows (the categorical modulus); null = the spec's rows."""
    multi_hot: bool = False
    """Use the MLPerf synthetic multi-hot bag sizes instead of one id per feature."""
    synth_if_missing: bool = False
    """If a glob matches no file, generate synthetic Criteo-format data with a planted signal in its directory
    (the launcher does it); only into a missing or empty directory: a glob that matches nothing beside other
    files is an error."""
    synth_rows: int = 100_000
    """Training rows to generate when synth_if_missing applies."""
    synth_eval_rows: int = 20_000
    """Evaluation rows to generate when synth_if_missing applies."""
    rows_per_unit: int = 65_536
    """An epoch is the training files cut into ranges of at most this many rows, in an order drawn from the
    seed; the data cursor counts steps through them, so a restore resumes exactly."""
    row_log: str | None = None
    """Audits: a directory where every worker appends the (step, row id) of each row it trains (synthetic
    parquet data carries row ids); null = off."""


@dataclass
class TrainConfig:
    """The training loop and the Ray workers that run it."""

    max_steps: int = 200
    """Training steps (every worker takes one step per global step)."""
    batch_size: int = 256
    """Rows per worker per step; the global batch is batch_size * T."""
    eval_every: int = 0
    """Evaluate every this many steps; 0 = only at the end."""
    log_every: int = 10
    """Reduce metrics over all workers and log them to MLflow every this many steps."""
    ne_window_steps: int = 100
    """The training NE (`train/ne`) is computed over the last this many steps of all workers."""
    seed: int = 0
    """Seed for model initialisation and data order."""
    use_gpu: bool = False
    """One GPU per worker and NCCL; false = CPU workers and gloo. GPU workers train through TorchRec's
    TrainPipelineSparseDist (host-to-device copy and input all-to-all overlapped with compute) and time phases
    with CUDA events."""
    precision: Literal[PRECISIONS] | None = None
    """Dense compute precision: "fp32", "tf32" (fp32 tensors, TensorFloat-32 matmuls) or "bf16" (bfloat16
    autocast of the forward, TF32 for the rest); null = "tf32" on GPU workers, "fp32" on CPU. tf32 and bf16
    need GPU workers."""
    cpus_per_worker: float = 0.5
    """CPUs Ray reserves per worker; fractional so T=4 workers fit a 2-core machine."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources each worker asks for besides its CPUs (and GPU), e.g. {trainer_node: 0.25} to keep
    the workers on the nodes that offer that custom resource (Ray Data's read tasks ask for none of them, so
    they may run on any node with CPUs); names are Ray resource names, amounts > 0; CPUs and GPUs are set by
    train.cpus_per_worker and train.use_gpu."""
    max_failures: int = 0
    """Worker failures each sharding group survives (every group is a Ray Train run of its own, whose
    FailureConfig this is: Ray Train restarts the group's L workers, which heal from a live peer group, else
    restore from the node holders, the storage checkpoint or train.resume_from); 0 = fail on the first (the
    group's run fails, and the job with it)."""
    snapshot_every_syncs: int | None = None
    """In-memory snapshots of every shard position, taken at a committed replica sync by the live sharding
    group of quorum rank 0 and kept by a holder actor per host: each host's holder keeps the host's own shard
    positions and a copy of another host's (a ring over the hosts), so a lost host is restored from memory, at
    most one snapshot interval back: every this many blocks of K steps; 0 = none. null = derived: on for a job
    that can restore (train.max_failures > 0) and whose host loss can take every live copy of a shard
    (host-local at any M, M = 1 under either layout), every as many syncs as keep the snapshots' cost (the
    writing workers' time in them on the step's path and the host holder's CPU) at or under 2% of the step
    time (measured as the job runs), at most 20 syncs apart; else 0 (an inter-host job of M >= 2 heals a lost
    host's group from a live peer)."""
    checkpoint_every: int | None = None
    """Steps between storage checkpoints (torch.distributed.checkpoint, under train.storage_path), the
    fallback when no live sharding group and no in-memory copy is left (a host and the host that keeps its
    copy lost at once, or every host); a multiple of grid.sync_every, so replicas are identical when written;
    0 = none. null = derived: for a job that can restore (train.max_failures > 0), one every 30 minutes of
    training (at the first sync step past it), else 0; 0 for tower models, which write no storage checkpoints.
    The live sharding group of quorum rank 0 writes them; a job keeps its two newest."""
    storage_path: str | None = None
    """Where Ray Train keeps the job's run directory and storage checkpoints: a local path or a pyarrow/fsspec
    URI (s3://...); null = runs/ray under the current directory (or $RECGRID_RUNS_DIR/ray)."""
    resume_from: str | None = None
    """A storage checkpoint directory to start from, written by a job with the same model at any M or L (it is
    resharded); null = start fresh."""


@dataclass
class OptimConfig:
    """The embedding optimizer (moment-scaled row-wise AdaGrad) and the dense optimizer."""

    lr: float = 0.05
    """Learning rate of the embedding tables (fused row-wise AdaGrad)."""
    eps: float = 1e-8
    """AdaGrad epsilon: w -= lr * g / (sqrt(v / c) + eps)."""
    moment_scale: float | None = None
    """c, the moment scale of row-wise AdaGrad; null = M (the group count)."""
    dense_optimizer: Literal[DENSE_OPTIMIZERS] = "adagrad"
    """Optimizer of the dense (data-parallel) part."""
    dense_lr: float = 0.01
    """Learning rate of the dense part."""


@dataclass
class TrackingConfig:
    """Where the job's MLflow run goes."""

    experiment: str = "recgrid"
    """MLflow experiment name."""
    run_name: str | None = None
    """MLflow run name; null = "T<T>-M<M>-K<K>" ("T<T>-M1" when M = 1, which has no replica groups to
    sync)."""
    tracking_uri: str | None = None
    """MLflow tracking URI; null = $MLFLOW_TRACKING_URI if set, else sqlite:///<repo>/runs/mlflow.db."""
    log_model: bool = True
    """At the end of a job, log its model, unsharded, as the run's MLflow model "model" (MLflow serves it with
    torch alone, raw rows in, click probabilities out; the final eval metrics linked to it), read from the
    final storage checkpoint, which the job then always writes. Not for tower models (model.towers), which
    write no storage checkpoint."""
    register_as: str | None = None
    """With log_model: also register the logged model as a new version of this registered model name; null =
    not registered."""


SECTIONS: dict[str, type] = {
    "grid": GridConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "tracking": TrackingConfig,
}
