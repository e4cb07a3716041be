"""Dataset specs: the Criteo columns and the embedding table each categorical feature feeds.

Every spec reads the same Criteo columns (label, I1..I13, C1..C26), so one data path serves
Criteo Kaggle, Criteo 1TB and the `tiny` spec used by tests and the demo. A spec gives each
categorical feature its row count (the modulus of the categorical transform) and the default
embedding dimension. `max_rows_per_table` caps rows so the big specs run small on a laptop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES: tuple[str, ...] = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
LABEL_NAME = "label"

# MLPerf DLRM-DCNv2 synthetic multi-hot bag sizes, one per categorical feature C1..C26.
MLPERF_MULTI_HOT_SIZES: tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)

# Criteo Kaggle (Display Advertising Challenge) cardinalities, as used by the DLRM reference.
CRITEO_KAGGLE_ROWS: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
# Criteo 1TB with MLPerf's 40M cap per feature.
CRITEO_1TB_ROWS: tuple[int, ...] = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
# tiny: the Kaggle shape shrunk to at most a few thousand rows, so it trains in seconds.
TINY_ROWS: tuple[int, ...] = (
    1460, 583, 4000, 3000, 305, 24, 2500, 633, 3, 2048, 1500, 3500, 1024,
    27, 1800, 3200, 10, 1200, 900, 4, 2800, 18, 15, 2200, 105, 1600,
)


class SpecError(ValueError):
    pass


@dataclass(frozen=True)
class DatasetSpec:
    """Rows per categorical feature and the default embedding dimension.

    Attributes:
        name: spec name ("criteo_kaggle", "criteo_1tb", "tiny" or a YAML file's name).
        rows: row count of the table behind each of C1..C26 (the categorical modulus).
        embedding_dim: default embedding dimension of every table.
        multi_hot_sizes: per-feature bag sizes for the synthetic multi-hot variant, or None
            for one id per feature (one-hot).
        max_rows_per_table: if set, every table has min(rows, max_rows_per_table) rows.
    """

    name: str
    rows: tuple[int, ...]
    embedding_dim: int
    multi_hot_sizes: tuple[int, ...] | None = None
    max_rows_per_table: int | None = None

    def __post_init__(self) -> None:
        if len(self.rows) != NUM_SPARSE:
            raise SpecError(f"spec {self.name!r}: rows has {len(self.rows)} entries, need {NUM_SPARSE}")
        if any((not isinstance(r, int)) or r < 1 for r in self.rows):
            raise SpecError(f"spec {self.name!r}: every row count must be a positive integer: {self.rows}")
        if self.embedding_dim < 1:
            raise SpecError(f"spec {self.name!r}: embedding_dim must be positive, got {self.embedding_dim}")
        if self.multi_hot_sizes is not None and (
            len(self.multi_hot_sizes) != NUM_SPARSE or min(self.multi_hot_sizes) < 1
        ):
            raise SpecError(f"spec {self.name!r}: multi_hot_sizes needs {NUM_SPARSE} positive sizes")
        if self.max_rows_per_table is not None and self.max_rows_per_table < 1:
            raise SpecError(
                f"spec {self.name!r}: max_rows_per_table must be positive, got {self.max_rows_per_table}"
            )

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Rows of each table after the cap: the modulus of the categorical transform."""
        cap = self.max_rows_per_table
        return tuple(min(r, cap) for r in self.rows) if cap else self.rows

    @property
    def multi_hot(self) -> bool:
        return self.multi_hot_sizes is not None

    @property
    def bag_sizes(self) -> tuple[int, ...]:
        return self.multi_hot_sizes or (1,) * NUM_SPARSE

    def capped(self, max_rows_per_table: int | None) -> "DatasetSpec":
        return dataclasses.replace(self, max_rows_per_table=max_rows_per_table)

    def with_multi_hot(self, sizes: tuple[int, ...] = MLPERF_MULTI_HOT_SIZES) -> "DatasetSpec":
        return dataclasses.replace(self, multi_hot_sizes=tuple(sizes))

    def table_name(self, feature: str) -> str:
        return f"t_{feature}"


BUILTIN_SPECS: dict[str, DatasetSpec] = {
    "criteo_kaggle": DatasetSpec("criteo_kaggle", CRITEO_KAGGLE_ROWS, embedding_dim=16),
    "criteo_1tb": DatasetSpec("criteo_1tb", CRITEO_1TB_ROWS, embedding_dim=128),
    "tiny": DatasetSpec("tiny", TINY_ROWS, embedding_dim=16),
}


def get_spec(name: str, max_rows_per_table: int | None = None, multi_hot: bool | None = None) -> DatasetSpec:
    """A builtin spec by name, `NAME+multihot` for the MLPerf multi-hot variant, or a YAML file.

    A YAML spec has keys `rows` (26 ints), `embedding_dim`, and optionally `multi_hot_sizes`.
    """
    base, _, suffix = name.partition("+")
    if suffix not in ("", "multihot"):
        raise SpecError(f"unknown spec suffix {suffix!r} in {name!r}; the only suffix is '+multihot'")
    if base in BUILTIN_SPECS:
        spec = BUILTIN_SPECS[base]
    elif base.endswith((".yaml", ".yml")):
        spec = _load_yaml_spec(Path(base))
    else:
        raise SpecError(f"unknown dataset spec {name!r}; builtin specs: {sorted(BUILTIN_SPECS)} or a .yaml path")
    if suffix == "multihot" or multi_hot:
        spec = spec.with_multi_hot(spec.multi_hot_sizes or MLPERF_MULTI_HOT_SIZES)
    elif multi_hot is False:
        spec = dataclasses.replace(spec, multi_hot_sizes=None)
    if max_rows_per_table is not None:
        spec = spec.capped(max_rows_per_table)
    return spec


def _load_yaml_spec(path: Path) -> DatasetSpec:
    import yaml

    if not path.is_file():
        raise SpecError(f"dataset spec file {path} does not exist")
    with path.open() as f:
        raw = yaml.safe_load(f) or {}
    unknown = set(raw) - {"rows", "embedding_dim", "multi_hot_sizes", "name"}
    if unknown:
        raise SpecError(f"{path}: unknown keys {sorted(unknown)}")
    try:
        return DatasetSpec(
            name=str(raw.get("name", path.stem)),
            rows=tuple(int(r) for r in raw["rows"]),
            embedding_dim=int(raw.get("embedding_dim", 16)),
            multi_hot_sizes=tuple(int(s) for s in raw["multi_hot_sizes"]) if raw.get("multi_hot_sizes") else None,
        )
    except KeyError as e:
        raise SpecError(f"{path}: missing key {e.args[0]!r}") from None
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None
