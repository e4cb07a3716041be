"""The embedding tables (and dense part) a plan is made for: read from a tables YAML, derived
from a dataset spec, or generated with a documented skewed distribution.

A tables file describes an industrial model, which is not Criteo-shaped:

    tables:
      - {name: user_history, rows: 120000000, dim: 128, pooling: 40}   # pooling = mean ids per sample
      - ...
    dense:                    # optional; defaults below
      dense_features: 13
      bottom_mlp: [512, 256, 128]
      top_mlp: [1024, 1024, 512, 256, 1]
      interaction: concat     # or dot (DLRM: pairwise dot products; needs one dim)

Errors name the file, the table (by index and name) and the field. The generator behind
datasets/ctr_like_0.5tb.yaml and datasets/ctr_like_1.7tb.yaml is `ctr_like_tables` (run this
module to write one; see datasets/README.md).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recgrid.data.specs import SPARSE_NAMES, SpecError, get_spec

# fp32 weights: the unit a model's size is quoted in ("0.5 TB of tables").
BYTES_PER_WEIGHT = 4
# MLPerf DLRM (Criteo 1TB reference) MLP sizes: the dense part when a tables file gives none.
DEFAULT_BOTTOM_MLP: tuple[int, ...] = (512, 256, 128)
DEFAULT_TOP_MLP: tuple[int, ...] = (1024, 1024, 512, 256, 1)
DEFAULT_DENSE_FEATURES = 13


class TablesError(ValueError):
    """A tables file or value that cannot describe a model; the message names file and field."""


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: `rows` x `dim` fp32 weights, `pooling` ids looked up per sample."""

    name: str
    rows: int
    dim: int
    pooling: float

    @property
    def bytes(self) -> int:
        return self.rows * self.dim * BYTES_PER_WEIGHT


INTERACTIONS = ("concat", "dot")


@dataclass(frozen=True)
class DenseSpec:
    """The data-parallel part: a bottom MLP over the dense features, an interaction of its output
    with the pooled embeddings, a top MLP over that. Interaction "concat" feeds the top MLP the
    bottom output and every pooled embedding side by side; "dot" (DLRM) feeds it the bottom output
    and the pairwise dot products of the n + 1 vectors (all of one dim)."""

    dense_features: int = DEFAULT_DENSE_FEATURES
    bottom_mlp: tuple[int, ...] = DEFAULT_BOTTOM_MLP
    top_mlp: tuple[int, ...] = DEFAULT_TOP_MLP
    interaction: str = "concat"

    def top_in(self, num_tables: int, embedding_width: int) -> int:
        if self.interaction == "dot":
            return self.bottom_mlp[-1] + (num_tables + 1) * num_tables // 2
        return self.bottom_mlp[-1] + embedding_width

    def layers(self, num_tables: int, embedding_width: int) -> list[tuple[int, int]]:
        """(in, out) of every linear layer."""
        sizes = [(self.dense_features, self.bottom_mlp[0])]
        sizes += list(zip(self.bottom_mlp, self.bottom_mlp[1:]))
        sizes.append((self.top_in(num_tables, embedding_width), self.top_mlp[0]))
        sizes += list(zip(self.top_mlp, self.top_mlp[1:]))
        return sizes


@dataclass(frozen=True)
class ModelTables:
    """What the planner needs of a model: its tables, its dense part, and how the job shards them
    (model.sharding) and exchanges row-wise shards' output (model.row_wise_exchange)."""

    name: str
    tables: tuple[TableSpec, ...]
    dense: DenseSpec = field(default_factory=DenseSpec)
    source: "ModelTables | None" = None
    """For tables rewritten by QR compression (plan.recscale.compress_model): the model as described,
    whose features the dense part's interaction sees (the compressed parts combine before it)."""
    sharding: str = "auto"
    """model.sharding: "auto" lets the planner choose per table; any other value is every table's type."""
    row_wise_exchange: str = "dense"
    """How row-wise shards return pooled partial sums: "dense" (TorchRec's reduce-scatter) or
    "sparse" (SRP, priced by plan.recscale)."""
    measured_occupancy: tuple[tuple[int, float], ...] = ()
    """SRP's measured share of the dense row-wise exchange bytes, by sharding group size L."""

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.tables)

    @property
    def embedding_width(self) -> int:
        """Summed dim of every table: the width of one sample's pooled embeddings."""
        return sum(t.dim for t in self.tables)

    @property
    def features(self) -> int:
        """Features the interaction sees: the tables as described (before compression)."""
        return len((self.source or self).tables)

    @property
    def dense_layers(self) -> list[tuple[int, int]]:
        m = self.source or self
        return self.dense.layers(len(m.tables), m.embedding_width)

    @property
    def dense_params(self) -> int:
        return sum(i * o + o for i, o in self.dense_layers)


# ---- reading ------------------------------------------------------------------------------------
def load_tables(path: str | Path) -> ModelTables:
    """Read a tables YAML; every error names the file and the offending field."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise TablesError(f"{path}: tables file does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise TablesError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict) or "tables" not in raw:
        raise TablesError(f"{path}: expected a mapping with a 'tables' list at the top")
    unknown = set(raw) - {"tables", "dense", "name", "description"}
    if unknown:
        raise TablesError(f"{path}: unknown top-level keys {sorted(unknown)}; "
                          f"allowed: tables, dense, name, description")
    entries = raw["tables"]
    if not isinstance(entries, list) or not entries:
        raise TablesError(f"{path}: 'tables' must be a non-empty list of {{name, rows, dim, pooling}}")
    tables = tuple(_table(path, i, e) for i, e in enumerate(entries))
    seen: set[str] = set()
    for i, t in enumerate(tables):
        if t.name in seen:
            raise TablesError(f"{path}: tables[{i}].name: duplicate table name {t.name!r}")
        seen.add(t.name)
    dense = _dense(path, raw.get("dense"))
    dims = {t.dim for t in tables}
    if dense.interaction == "dot" and (len(dims) > 1 or dims != {dense.bottom_mlp[-1]}):
        raise TablesError(f"{path}: dense.interaction: dot needs every table's dim and bottom_mlp's last size "
                          f"to be equal, got dims {sorted(dims)} and bottom_mlp {list(dense.bottom_mlp)}")
    return ModelTables(name=str(raw.get("name", path.stem)), tables=tables, dense=dense)


def _table(path: Path, i: int, e: Any) -> TableSpec:
    where = f"{path}: tables[{i}]"
    if not isinstance(e, dict):
        raise TablesError(f"{where}: expected a mapping {{name, rows, dim, pooling}}, got {e!r}")
    missing = [k for k in ("name", "rows", "dim", "pooling") if k not in e]
    if missing:
        raise TablesError(f"{where}: missing field(s) {missing}")
    unknown = set(e) - {"name", "rows", "dim", "pooling"}
    if unknown:
        raise TablesError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: name, rows, dim, pooling")
    name = e["name"]
    if not isinstance(name, str) or not name:
        raise TablesError(f"{where}.name: must be a non-empty string, got {name!r}")
    where = f"{path}: tables[{i}] ({name})"
    rows, dim, pooling = e["rows"], e["dim"], e["pooling"]
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise TablesError(f"{where}.rows: must be a positive integer, got {rows!r}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise TablesError(f"{where}.dim: must be a positive integer, got {dim!r}")
    if isinstance(pooling, bool) or not isinstance(pooling, (int, float)) or not pooling > 0 or math.isinf(pooling):
        raise TablesError(f"{where}.pooling: must be a positive number (mean ids per sample), got {pooling!r}")
    return TableSpec(name=name, rows=rows, dim=dim, pooling=float(pooling))


def _dense(path: Path, raw: Any) -> DenseSpec:
    if raw is None:
        return DenseSpec()
    if not isinstance(raw, dict):
        raise TablesError(f"{path}: dense: expected a mapping {{dense_features, bottom_mlp, top_mlp, interaction}}")
    unknown = set(raw) - {"dense_features", "bottom_mlp", "top_mlp", "interaction"}
    if unknown:
        raise TablesError(f"{path}: dense: unknown field(s) {sorted(unknown)}")
    d = DenseSpec()
    feats = raw.get("dense_features", d.dense_features)
    if isinstance(feats, bool) or not isinstance(feats, int) or feats < 1:
        raise TablesError(f"{path}: dense.dense_features: must be a positive integer, got {feats!r}")
    mlps = {}
    for key in ("bottom_mlp", "top_mlp"):
        v = raw.get(key, getattr(d, key))
        if not isinstance(v, (list, tuple)) or not v or any(
                isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
            raise TablesError(f"{path}: dense.{key}: must be a non-empty list of positive layer sizes, got {v!r}")
        mlps[key] = tuple(v)
    if mlps["top_mlp"][-1] != 1:
        raise TablesError(f"{path}: dense.top_mlp: must end in 1 (one logit), got {list(mlps['top_mlp'])}")
    interaction = raw.get("interaction", d.interaction)
    if interaction not in INTERACTIONS:
        raise TablesError(f"{path}: dense.interaction: must be one of {list(INTERACTIONS)}, got {interaction!r}")
    return DenseSpec(dense_features=feats, interaction=interaction, **mlps)


def tables_from_spec(spec_name: str) -> ModelTables:
    """The 26 Criteo tables of a dataset spec (one id per feature, or the MLPerf multi-hot bag
    sizes for `NAME+multihot`), with the MLPerf DLRM dense part sized to the spec's dim."""
    try:
        spec = get_spec(spec_name)
    except SpecError as e:
        raise TablesError(str(e)) from None
    dim = spec.embedding_dim
    tables = tuple(TableSpec(name=spec.table_name(f), rows=r, dim=dim, pooling=float(p))
                   for f, r, p in zip(SPARSE_NAMES, spec.table_rows, spec.bag_sizes))
    return ModelTables(name=spec.name, tables=tables,
                       dense=DenseSpec(bottom_mlp=DEFAULT_BOTTOM_MLP[:-1] + (dim,), interaction="dot"))


def resolve_model(spec: str | None, tables: str | None) -> ModelTables:
    """Exactly one of `--spec` / `--tables`."""
    if (spec is None) == (tables is None):
        raise TablesError("give exactly one of --spec SPEC or --tables FILE")
    return tables_from_spec(spec) if spec is not None else load_tables(tables)


# ---- a documented skewed model ------------------------------------------------------------------
def ctr_like_tables(num_tables: int = 300, total_bytes: float = 0.5e12, alpha: float = 0.7, seed: int = 0,
                    name: str = "ctr_like", dims: tuple[int, ...] = (256, 128, 64, 32),
                    pooling_median: float = 4.0) -> ModelTables:
    """An industrial-CTR-like set of tables, deterministic in its arguments.

    Sizes follow a Zipf law over the tables ranked by size, as production embedding tables do
    (a few tables hold much of the bytes): table i (0 = largest) holds a share of `total_bytes`
    proportional to (i + 1)^-alpha. Dims are `dims` by size quantile, largest tables first (the
    default: 256 / 128 / 64 / 32 by quartile; one value: every table). Rows follow as share /
    (dim x 4 bytes), at least 1,000; the largest table absorbs the rounding so the total is
    `total_bytes` (fp32) to within one row. Pooling (mean ids per sample) is lognormal with median
    `pooling_median` and sigma 1 (mean = median x e^0.5), drawn with `random.Random(seed)`, rounded
    to 0.1 and clipped to [1, 200]: most features are near one-hot, a few are long id lists
    (histories). Tables are named t000 (largest) to t{n-1}.
    """
    if num_tables < 1:
        raise TablesError(f"num_tables must be >= 1, got {num_tables}")
    if not alpha >= 0:
        raise TablesError(f"alpha must be >= 0, got {alpha}")
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
        raise TablesError(f"dims must be positive integers, got {dims!r}")
    if not pooling_median > 0:
        raise TablesError(f"pooling_median must be > 0, got {pooling_median}")
    rng = random.Random(seed)
    weights = [(i + 1) ** -alpha for i in range(num_tables)]
    q = len(dims)
    dims = [dims[min(q - 1, q * i // num_tables)] for i in range(num_tables)]
    poolings = [min(200.0, max(1.0, round(pooling_median * math.exp(rng.gauss(0.0, 1.0)), 1)))
                for _ in range(num_tables)]
    total_w = sum(weights)
    rows = [max(1000, int(total_bytes * w / total_w / (d * BYTES_PER_WEIGHT))) for w, d in zip(weights, dims)]
    rest = sum(r * d for r, d in zip(rows[1:], dims[1:])) * BYTES_PER_WEIGHT
    rows[0] = int(round((total_bytes - rest) / (dims[0] * BYTES_PER_WEIGHT)))
    width = len(str(num_tables - 1))
    tables = tuple(TableSpec(name=f"t{i:0{width}d}", rows=r, dim=d, pooling=p)
                   for i, (r, d, p) in enumerate(zip(rows, dims, poolings)))
    return ModelTables(name=name, tables=tables)


def dump_tables(model: ModelTables, header: str = "") -> str:
    """YAML text of `model` (one flow mapping per table), with `header` as leading comments."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines.append(f"name: {model.name}")
    lines.append("tables:")
    for t in model.tables:
        lines.append(f"  - {{name: {t.name}, rows: {t.rows}, dim: {t.dim}, pooling: {t.pooling:g}}}")
    d = model.dense
    lines.append("dense:")
    lines.append(f"  dense_features: {d.dense_features}")
    lines.append(f"  bottom_mlp: {list(d.bottom_mlp)}")
    lines.append(f"  top_mlp: {list(d.top_mlp)}")
    lines.append(f"  interaction: {d.interaction}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write a ctr-like tables YAML (see ctr_like_tables)")
    ap.add_argument("--tables", type=int, default=300, help="number of tables")
    ap.add_argument("--total-tb", type=float, default=0.5, help="total fp32 bytes of all tables, in TB (1e12)")
    ap.add_argument("--alpha", type=float, default=0.7, help="Zipf exponent of the table sizes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None)
    ap.add_argument("--dims", default="256,128,64,32",
                    help="embedding dims by size quantile, largest tables first (one value: every table)")
    ap.add_argument("--pooling-median", type=float, default=4.0,
                    help="median of the lognormal (sigma 1) mean-ids-per-sample; its mean is median x e^0.5")
    ap.add_argument("--note", default="", help="more header comment lines (the sources of the shape), '|' for a new line")
    a = ap.parse_args(argv)
    name = a.name or f"ctr_like_{a.total_tb:g}tb"
    dims = tuple(int(d) for d in a.dims.split(","))
    model = ctr_like_tables(a.tables, a.total_tb * 1e12, a.alpha, a.seed, name, dims, a.pooling_median)
    default_shape = dims == (256, 128, 64, 32) and a.pooling_median == 4.0
    flags = "" if default_shape else f" --dims {a.dims} --pooling-median {a.pooling_median:g}"
    flags += " --note <the source lines at the end>" if a.note else ""
    dim_text = ("dims 256/128/64/32 by size quartile" if dims == (256, 128, 64, 32)
                else f"dim {dims[0]} for every table" if len(dims) == 1
                else f"dims {'/'.join(map(str, dims))} by size quantile")
    header = (
        f"{name}: {len(model.tables)} embedding tables, {model.total_bytes / 1e12:g} TB in fp32, a skewed\n"
        f"industrial-CTR-like model for `recgrid plan` / `recgrid simulate`. Generated, deterministically, by\n"
        f"  python -m recgrid.plan.tables --tables {a.tables} --total-tb {a.total_tb:g} --alpha {a.alpha:g} "
        f"--seed {a.seed}{' --name ' + a.name if a.name else ''}{flags}\n"
        f"Distribution (recgrid.plan.tables.ctr_like_tables): table i of n (0 = largest) holds a share of the bytes\n"
        f"proportional to (i+1)^-{a.alpha:g} (Zipf); {dim_text}; pooling (mean ids per "
        f"sample)\n"
        f"lognormal, median {a.pooling_median:g}, sigma 1, clipped to [1, 200]. See datasets/README.md."
        + "".join(f"\n{line.strip()}" for line in a.note.split("|") if a.note)
    )
    sys.stdout.write(dump_tables(model, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
