"""What RecScale's two options change in the model `recgrid plan` and `recgrid simulate` price
(issue 16): QR-compressed tables with a head cache, and SRP's sparse row-wise exchange.
Design and figures: docs/performance.md, "Compressed tables and SRP in the planner".

- `compress_model` rewrites a model's tables as a job with `model.compression: qr` builds them
  (quotient, remainder and head tables, sized by `data.specs.compressed_parts`, one table at a
  time), which TorchRec's planner then prices as ordinary tables. Lookups are counted per part: a
  table of pooling P whose head catches a share h of its ids gives the head table P·h ids per
  sample, the quotient and the remainder table P·(1 − h) each.
- The head's size and share need the ids' frequencies, which the planner has not: `head_rows` is
  exact; `head_coverage` needs `id_zipf_exponent` (a bounded power law, `power_law_head`) and is
  refused without it; with `head_rows` and no exponent h = 0 (an upper bound on lookup work).
- SRP: the output exchange of a row-wise option is scaled by the occupancy of a bag of P ids on
  its W shards (`engine.srp.expected_occupancy`, or `measured_occupancy` from a pair of runs),
  for the sharding types the engine's SRP covers (`engine.srp.SPARSE_SHARDINGS`) only.
- `MemorySummary`: one model copy's table bytes, uncompressed and compressed, and the largest M
  whose copies (tables + row-wise AdaGrad state) fit after the dense part (`max_groups`: a memory
  bound, before lookup activations and shard imbalance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from recgrid.config import ConfigError, DataConfig, JobConfig, ModelConfig
from recgrid.data.specs import HEAD, Compression, compressed_parts
from recgrid.engine.srp import SPARSE_SHARDINGS, expected_exchange_bytes, expected_occupancy
from recgrid.plan.tables import BYTES_PER_WEIGHT, ModelTables, TableSpec
from recgrid.tracking import resolve_tracking_uri

ROW_WISE = "row_wise"


class OptionsError(ValueError):
    """A compression or exchange setting the planner cannot price; the message names the flag."""


# ---- the ids' law (what `recgrid synth` draws) ---------------------------------------------------------
def power_law_share(top: int, rows: int, exponent: float) -> float:
    """The share of lookups that go to the `top` most frequent of `rows` ids when ranks follow a
    bounded power law with `exponent` a (density ∝ x^-a on [1, rows + 1), rank = floor(x) − 1, as
    `data.synth` draws them): F(top + 1) = ((top + 1)^(1−a) − 1) / ((rows + 1)^(1−a) − 1)."""
    if top <= 0:
        return 0.0
    if top >= rows:
        return 1.0
    if abs(exponent - 1.0) < 1e-12:
        return math.log(top + 1) / math.log(rows + 1)
    b = 1.0 - exponent
    return ((top + 1) ** b - 1.0) / ((rows + 1) ** b - 1.0)


def power_law_head(coverage: float, rows: int, exponent: float) -> int:
    """The fewest most-frequent ids that cover `coverage` of the lookups under that law (>= 1)."""
    if abs(exponent - 1.0) < 1e-12:
        x = (rows + 1) ** coverage
    else:
        b = 1.0 - exponent
        x = (1.0 + coverage * ((rows + 1) ** b - 1.0)) ** (1.0 / b)
    head = max(1, min(rows, math.ceil(x - 1.0 - 1e-9)))
    while head < rows and power_law_share(head, rows, exponent) < coverage:  # rounding: cover at least p
        head += 1
    return head


# ---- compressed tables ------------------------------------------------------------------------------
def table_parts(rows: int, dim: int, compression: Compression, head: int) -> list[tuple[str, int, int]]:
    """One table's tables after compression as (name suffix: "" uncompressed, else HEAD, QUOTIENT,
    REMAINDER; rows; dim): `data.specs.compressed_parts`, the engine's sizing."""
    try:
        return compressed_parts(int(rows), int(dim), compression, head)
    except ValueError as e:
        raise OptionsError(f"--qr-operation (model.qr_operation): {e}") from None


@dataclass(frozen=True)
class TableCompression:
    """What compression did to one table: its parts' rows and the head's share of its lookups."""

    name: str
    rows: int
    head_rows: int
    head_share: float
    parts: tuple[TableSpec, ...]


def compress_model(model: ModelTables, compression: Compression,
                   id_zipf_exponent: float | None = None) -> tuple[ModelTables, tuple[TableCompression, ...]]:
    """The model with every table above the threshold replaced by its compressed tables (module
    docstring), and what happened to each compressed table. Refuses a setting that compresses no
    table, or head_coverage without the ids' exponent, naming the flag."""
    if compression.head_coverage is not None and id_zipf_exponent is None:
        raise OptionsError("--head-coverage (model.head_coverage): the planner has no id counts to size a head by "
                           "coverage; give --id-zipf-exponent A (the ids' power law, as recgrid synth draws them) "
                           "or size the head with --head-rows")
    if max(t.rows for t in model.tables) <= compression.threshold_rows:
        biggest = max(model.tables, key=lambda t: t.rows)
        raise OptionsError(f"--qr-threshold-rows (model.qr_threshold_rows): {compression.threshold_rows} compresses "
                           f"no table: the largest, {biggest.name}, has {biggest.rows:,} rows; lower it or leave "
                           f"--compression none")
    tables: list[TableSpec] = []
    done: list[TableCompression] = []
    for t in model.tables:
        if t.rows <= compression.threshold_rows:
            tables.append(t)
            continue
        if compression.head_coverage is not None:
            head = power_law_head(compression.head_coverage, t.rows, id_zipf_exponent)
            share = compression.head_coverage
        else:
            head = min(compression.head_rows, t.rows)
            share = power_law_share(head, t.rows, id_zipf_exponent) if id_zipf_exponent is not None else 0.0
        parts = []
        for suffix, rows, dim in table_parts(t.rows, t.dim, compression, head):
            pooling = t.pooling * (share if suffix == HEAD else 1.0 - share)
            parts.append(TableSpec(name=t.name + suffix, rows=rows, dim=dim, pooling=pooling))
        tables += parts
        done.append(TableCompression(t.name, t.rows, head, share, tuple(parts)))
    return replace(model, tables=tuple(tables), source=model.source or model), tuple(done)


# ---- SRP --------------------------------------------------------------------------------------------------
def row_wise_occupancy(model: ModelTables, pooling: float, shards: int) -> float:
    """The share of a row-wise table's dense output exchange that SRP sends: the occupancy measured
    at this group size when a pair of runs gave one (`model.measured_occupancy`), else 1 − (1 −
    1/W)^P for uniform ids; 1 with the dense exchange."""
    if model.row_wise_exchange != "sparse":
        return 1.0
    measured = dict(model.measured_occupancy)
    if shards in measured:
        return measured[shards]
    return expected_occupancy(pooling, shards)


def price_sparse_exchange(model: ModelTables, options: Mapping[str, list]) -> None:
    """Scale, in place, the output exchange (forward reduce-scatter, backward all-gather: TorchRec's
    fwd_comms and bwd_comms) of every row-wise option of `options` (table name -> TorchRec sharding
    options) by its occupancy; the ids' all-to-all (input_dist_comms) stays. No-op when dense."""
    if model.row_wise_exchange != "sparse" or ROW_WISE not in SPARSE_SHARDINGS:
        return
    pooling = {t.name: t.pooling for t in model.tables}
    for name, opts in options.items():
        for so in opts:
            if so.sharding_type != ROW_WISE:
                continue
            occ = row_wise_occupancy(model, pooling[name], len(so.shards))
            for sh in so.shards:
                sh.perf = replace(sh.perf, fwd_comms=sh.perf.fwd_comms * occ, bwd_comms=sh.perf.bwd_comms * occ)


def describe(model: ModelTables) -> str:
    """"N tables, X TB fp32", with what compression made of them."""
    if model.source is None:
        return f"{len(model.tables)} tables, {model.total_bytes / 1e12:.3g} TB fp32"
    src = model.source
    return (f"{len(src.tables)} tables, {src.total_bytes / 1e12:.3g} TB fp32 -> {len(model.tables)} tables, "
            f"{model.total_bytes / 1e12:.3g} TB after QR compression")


def exchange_label(model: ModelTables) -> str:
    return ("SRP (sparse: only non-empty partial sums)" if model.row_wise_exchange == "sparse"
            else "dense (TorchRec's reduce-scatter)")


def row_wise_exchange_bytes(model: ModelTables, row_wise_tables: Sequence[str], batch: int,
                            group_size: int) -> tuple[float, float]:
    """(dense, as priced) bytes one worker sends per step in the forward output exchange of the
    row-wise tables of its sharding group of `group_size` (backward sends as many back), from
    `engine.srp.expected_exchange_bytes`."""
    by_name = {t.name: t for t in model.tables}
    tables = [by_name[n] for n in row_wise_tables]
    dims, pools = [t.dim for t in tables], [t.pooling for t in tables]
    dense = expected_exchange_bytes(batch, dims, pools, group_size, sparse=False)
    if model.row_wise_exchange != "sparse" or not tables or group_size <= 1:
        return dense, dense
    if group_size in dict(model.measured_occupancy):
        return dense, dense * dict(model.measured_occupancy)[group_size]
    return dense, expected_exchange_bytes(batch, dims, pools, group_size, sparse=True)


def measured_occupancy(dense_run: str, sparse_run: str, tracking_uri: str | None = None) -> tuple[int, float]:
    """(L, occupancy) from two finished runs of one job at one L, dense and sparse: the ratio of
    their median `exchange/bytes/row_wise`. Raises OptionsError when a run did not record it or
    the runs differ in L or exchange. The MLflow store: `tracking_uri`, else $MLFLOW_TRACKING_URI,
    else the project's (recgrid.tracking)."""
    import mlflow

    client = mlflow.tracking.MlflowClient(resolve_tracking_uri(tracking_uri))
    found = {}
    for want, run_id in (("dense", dense_run), ("sparse", sparse_run)):
        try:
            run = client.get_run(run_id)
        except Exception as e:  # noqa: BLE001 - MLflow raises its own types for a missing run
            raise OptionsError(f"--srp-runs: run {run_id!r}: {e}") from None
        params = run.data.params
        got = params.get("model.row_wise_exchange", "dense")
        if got != want:
            raise OptionsError(f"--srp-runs: run {run_id} has model.row_wise_exchange={got}, expected {want} "
                               f"(give the dense run first, then the sparse one)")
        history = sorted(m.value for m in client.get_metric_history(run_id, "exchange/bytes/row_wise"))
        if not history:
            raise OptionsError(f"--srp-runs: run {run_id} recorded no exchange/bytes/row_wise")
        try:
            L = int(params.get("derived.group_size")
                    or int(params["grid.world_size"]) // int(params["grid.num_groups"]))
        except (KeyError, ValueError):
            raise OptionsError(f"--srp-runs: run {run_id} has no grid.world_size / grid.num_groups params") from None
        found[want] = (L, history[len(history) // 2])
    if found["dense"][0] != found["sparse"][0]:
        raise OptionsError(f"--srp-runs: the runs have different sharding group sizes (L={found['dense'][0]} and "
                           f"L={found['sparse'][0]})")
    if found["dense"][1] <= 0:
        raise OptionsError(f"--srp-runs: run {dense_run} sent no row-wise bytes")
    return found["dense"][0], found["sparse"][1] / found["dense"][1]


# ---- memory and the group count -------------------------------------------------------------------------
def state_bytes(model: ModelTables) -> int:
    """One model copy's tables with their row-wise AdaGrad state (one fp32 per row)."""
    return sum(t.bytes + t.rows * BYTES_PER_WEIGHT for t in model.tables)


def max_groups(copy_bytes: float, gpus: int, budget_per_gpu: float) -> int:
    """The largest M dividing T whose M copies of `copy_bytes` fit T GPUs of `budget_per_gpu`
    (0: not even one)."""
    fitting = [m for m in range(1, gpus + 1) if gpus % m == 0 and m * copy_bytes <= gpus * budget_per_gpu]
    return max(fitting, default=0)


@dataclass(frozen=True)
class MemorySummary:
    """One model copy's embedding memory uncompressed and as priced, and the group counts they allow."""

    embedding_bytes_uncompressed: int
    embedding_bytes: int
    state_bytes_uncompressed: int
    state_bytes: int
    budget_per_gpu: float
    max_groups_uncompressed: int
    max_groups: int
    compressed_tables: int

    @property
    def freed_bytes(self) -> int:
        return self.embedding_bytes_uncompressed - self.embedding_bytes

    def to_json(self) -> dict:
        return {"embedding_bytes_uncompressed": self.embedding_bytes_uncompressed,
                "embedding_bytes": self.embedding_bytes, "freed_bytes": self.freed_bytes,
                "state_bytes_uncompressed": self.state_bytes_uncompressed, "state_bytes": self.state_bytes,
                "compressed_tables": self.compressed_tables, "budget_per_gpu": None if math.isinf(self.budget_per_gpu) else round(self.budget_per_gpu),
                "max_groups_uncompressed": self.max_groups_uncompressed, "max_groups": self.max_groups}

    def lines(self, gpus: int, capacity: float) -> list[str]:
        gb = lambda b: f"{b / 1e9:,.2f} GB" if b >= 1e9 else f"{b / 1e6:,.2f} MB"  # noqa: E731
        cap = "unbounded" if math.isinf(capacity) else f"{capacity / 1e9:.0f} GB"
        fit = lambda m: "none" if m == 0 else f"M <= {m}"  # noqa: E731
        if self.compressed_tables:
            return [
                f"embedding tables, one model copy: {gb(self.embedding_bytes_uncompressed)} uncompressed -> "
                f"{gb(self.embedding_bytes)} compressed ({self.compressed_tables} tables; "
                f"{gb(self.freed_bytes)} freed, "
                f"{self.embedding_bytes_uncompressed / self.embedding_bytes:.2f}x less)",
                f"group counts whose M copies (tables + row-wise AdaGrad state) fit T={gpus} x {cap} after the dense "
                f"part: uncompressed {fit(self.max_groups_uncompressed)}, compressed {fit(self.max_groups)} "
                f"(a memory bound before lookup activations and shard imbalance)"]
        return [f"embedding tables, one model copy: {gb(self.embedding_bytes)}; M copies (with row-wise AdaGrad state) "
                f"fit T={gpus} x {cap} after the dense part for {fit(self.max_groups)} (a memory bound)"]


def memory_summary(model: ModelTables, gpus: int, capacity: float, dense_bytes: float) -> MemorySummary:
    """`model` as priced (compressed or not; `model.source` is the uncompressed one)."""
    original = model.source or model
    compressed = {t.name for t in original.tables} - {t.name for t in model.tables}
    budget = capacity - dense_bytes
    return MemorySummary(
        embedding_bytes_uncompressed=original.total_bytes, embedding_bytes=model.total_bytes,
        state_bytes_uncompressed=state_bytes(original), state_bytes=state_bytes(model), budget_per_gpu=budget,
        max_groups_uncompressed=max_groups(state_bytes(original), gpus, budget),
        max_groups=max_groups(state_bytes(model), gpus, budget), compressed_tables=len(compressed))


# ---- the job's settings, as flags that mirror model.* ---------------------------------------------------
# The model.* fields `recgrid plan` / `simulate` take as flags (--qr-collisions for model.qr_collisions).
MODEL_FIELDS: tuple[str, ...] = ("sharding", "row_wise_exchange", "compression", "qr_threshold_rows", "qr_collisions",
                                 "qr_operation", "head_rows", "head_coverage")


def _flag(message: str) -> str:
    """A config error's message led by the flag of the model.* field it names."""
    field = message.split(":", 1)[0]
    if field.startswith("model.") and field[len("model."):] in MODEL_FIELDS:
        return f"--{field[len('model.'):].replace('_', '-')}: {message}"
    return message


def apply_options(model: ModelTables, spec: str | None, settings: Mapping[str, object],
                  id_zipf_exponent: float | None = None,
                  measured: tuple[int, float] | None = None) -> tuple[ModelTables, tuple[TableCompression, ...]]:
    """The model as a job with these model.* `settings` (MODEL_FIELDS; missing ones take the job
    config's defaults) trains it: validated by the job config's own rules (`JobConfig`, on the
    dataset spec when the model is one; for a tables file, the rules that do not depend on the
    spec, then the tables' own: a threshold that compresses no table, mult with bags of several
    ids), then compressed and given its exchange. Errors name the flag and the field."""
    unknown = set(settings) - set(MODEL_FIELDS)
    if unknown:
        raise OptionsError(f"unknown model settings {sorted(unknown)}; known: {list(MODEL_FIELDS)}")
    if id_zipf_exponent is not None and not (isinstance(id_zipf_exponent, (int, float)) and id_zipf_exponent > 0):
        raise OptionsError(f"--id-zipf-exponent: must be a positive number, got {id_zipf_exponent!r}")
    try:
        m = ModelConfig(**{k: v for k, v in settings.items() if v is not None})
        check = m if spec is not None else replace(m, qr_threshold_rows=1)  # the tables' rows are checked below
        JobConfig(model=check, data=DataConfig(spec=spec or "tiny", train=["(planned)"]), check_paths=False)
    except (ConfigError, TypeError) as e:
        raise OptionsError(_flag(str(e))) from None
    if m.row_wise_exchange == "sparse" and ROW_WISE not in SPARSE_SHARDINGS:
        raise OptionsError("--row-wise-exchange: sparse has no sharding type to price")
    if measured is not None and m.row_wise_exchange != "sparse":
        raise OptionsError("--srp-runs: a measured occupancy prices SRP; it needs --row-wise-exchange sparse")
    priced = replace(model, sharding=m.sharding, row_wise_exchange=m.row_wise_exchange,
                     measured_occupancy=(measured,) if measured else ())
    if m.compression == "none":
        return priced, ()
    compression = Compression(threshold_rows=m.qr_threshold_rows, collisions=m.qr_collisions, operation=m.qr_operation,
                              head_rows=m.head_rows, head_coverage=m.head_coverage)
    if spec is None and m.qr_operation == "mult":
        bags = [t.name for t in model.tables if t.rows > m.qr_threshold_rows and t.pooling > 1]
        if bags:
            raise OptionsError(f"--qr-operation (model.qr_operation): mult needs one id per bag, and compressed "
                               f"table(s) {bags[:3]}{' ...' if len(bags) > 3 else ''} pool more than one id per "
                               f"sample (the product of pooled sums is not the pooled sum of products); use add or "
                               f"concat")
    return compress_model(priced, compression, id_zipf_exponent)


def apply_args(model: ModelTables, args) -> tuple[ModelTables, tuple[TableCompression, ...]]:
    """`apply_options` from the command line's flags (cli._add_cluster_args)."""
    measured = None
    runs = getattr(args, "srp_runs", None)
    if runs:
        ids = [r.strip() for r in runs.split(",")]
        if len(ids) != 2 or not all(ids):
            raise OptionsError(f"--srp-runs: give two run ids, DENSE,SPARSE; got {runs!r}")
        measured = measured_occupancy(*ids)
    settings = {k: getattr(args, k, None) for k in MODEL_FIELDS}
    return apply_options(model, getattr(args, "spec", None), settings, getattr(args, "id_zipf_exponent", None),
                         measured)
