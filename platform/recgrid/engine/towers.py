"""Disaggregated Multi-Tower (DMT, Luo et al.): what a tower job is and where its tables live.

This module owns the light half of DMT (no torch at import; config validation reads it):
- `TowerConfig`: the towers of a job: which features each tower holds (a partition), the tower
  module kind, its compression ratio CR, and the exchange (SPTT, or the flat one for reference);
- `TowerLayout`: where the towers sit in the 2-D grid. Towers live inside each sharding group:
  the sharding group's L workers are cut into N towers of L_t = L / N consecutive shard ranks,
  which the grid places on one host (or on whole hosts), so replica groups, replica sync and
  recovery are those of the flat engine. Peers of shard rank s are the shard ranks with the same
  index inside their tower, s % L_t; the cross-tower exchange runs among peers (world size N);
- `tower_plan`: the job's sharding plan for towers, as a TorchRec `ShardingPlan` in shard ranks:
  each tower's tables are sharded over the tower's workers only, single-hot tables column-wise,
  multi-hot tables row-wise (as the paper does). It is a plain TorchRec plan, so `plan_record`,
  `sharding_summary` and the flat engine (the reference in tests) read it unchanged;
- partition files (`recgrid towers` writes them, `model.towers` reads them).

The heavy half (the sharded embedding module, the SPTT exchange, tower modules) is
`engine.sptt`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from recgrid.data.specs import SPARSE_NAMES, DatasetSpec
from recgrid.engine.grid import Grid

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

    from recgrid.engine.model import ModelSpec

# Tower module kinds (config.py's model.tower_module takes its choices from here): "none" passes
# the tower's embeddings through; "dlrm" is the paper's Listing 1; "dcn" a small CrossNet + linear.
TOWER_MODULES: tuple[str, ...] = ("none", "dlrm", "dcn")
# How looked-up embeddings go back to the workers that own the samples: "sptt" (the tower
# transform) or "flat" (one all-to-all over the sharding group; the same shards, for reference).
EXCHANGES: tuple[str, ...] = ("sptt", "flat")
PARTITION_FORMAT = "recgrid-tower-partition/1"
# The module path of the embedding tables in recgrid's DLRMTrain (plans name it).
EBC_PATH = "model.sparse_arch.embedding_bag_collection"


class TowerError(ValueError):
    """A tower configuration that cannot work with the model or the grid."""


@dataclass(frozen=True)
class TowerConfig:
    """The towers of a DMT job.

    Attributes:
        partition: the features of each tower (names C1..C26), N = len(partition) towers per
            sharding group; every feature in exactly one tower.
        module: "none" (pass-through), "dlrm" or "dcn": the dense module each tower runs on its
            embeddings before the cross-tower exchange.
        compression: CR: a tower of F_t features sends `outputs()[t]` = max(1, round(F_t / CR))
            embeddings instead of F_t (ignored with module "none").
        exchange: "sptt" or "flat" (see EXCHANGES).
        source: where the partition came from ("strided" or a partition file), for records.
    """

    partition: tuple[tuple[str, ...], ...]
    module: str = "none"
    compression: float = 1.0
    exchange: str = "sptt"
    source: str = "strided"

    def __post_init__(self) -> None:
        seen = [f for tower in self.partition for f in tower]
        if not self.partition or any(not tower for tower in self.partition):
            raise TowerError(f"every tower needs at least one feature, got {[list(t) for t in self.partition]}")
        if sorted(seen) != sorted(SPARSE_NAMES):
            missing, extra = set(SPARSE_NAMES) - set(seen), [f for f in seen if f not in SPARSE_NAMES]
            dup = sorted({f for f in seen if seen.count(f) > 1})
            raise TowerError(f"a tower partition must hold each of {SPARSE_NAMES[0]}..{SPARSE_NAMES[-1]} once; "
                             f"missing {sorted(missing)}, unknown {extra}, repeated {dup}")
        if self.module not in TOWER_MODULES:
            raise TowerError(f"tower module must be one of {TOWER_MODULES}, got {self.module!r}")
        if self.exchange not in EXCHANGES:
            raise TowerError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if not self.compression > 0:
            raise TowerError(f"compression ratio must be > 0, got {self.compression}")

    @classmethod
    def strided(cls, towers: int, **kw: Any) -> "TowerConfig":
        """The paper's naive assignment: feature f goes to tower f % N."""
        return cls(strided_partition(towers), source="strided", **kw)

    @classmethod
    def from_option(cls, value: str | int, **kw: Any) -> "TowerConfig":
        """`model.towers` as written: a tower count, or the path of a partition file."""
        text = str(value).strip()
        if text.isdigit():
            return cls.strided(int(text), **kw)
        return cls(load_partition(text), source=text, **kw)

    @property
    def num_towers(self) -> int:
        return len(self.partition)

    def outputs(self) -> tuple[int, ...]:
        """Embeddings each tower sends across: F_t with pass-through, else max(1, round(F_t / CR))."""
        if self.module == "none":
            return tuple(len(t) for t in self.partition)
        return tuple(max(1, round(len(t) / self.compression)) for t in self.partition)

    def effective_compression(self) -> float:
        """Σ F_t / Σ outputs: the factor by which the cross-tower bytes shrink."""
        return sum(len(t) for t in self.partition) / sum(self.outputs())


def strided_partition(towers: int, features: Sequence[str] = SPARSE_NAMES) -> tuple[tuple[str, ...], ...]:
    if not isinstance(towers, int) or not 1 <= towers <= len(features):
        raise TowerError(f"towers must be an integer between 1 and {len(features)}, got {towers!r}")
    return tuple(tuple(features[f] for f in range(t, len(features), towers)) for t in range(towers))


# ---- partition files ---------------------------------------------------------------------------
def write_partition(path: str | Path, partition: Sequence[Sequence[str]], **record: Any) -> None:
    """A partition file: JSON with the towers (lists of feature names) and how they were found."""
    body = {"format": PARTITION_FORMAT, "towers": [list(t) for t in partition], **record}
    Path(path).write_text(json.dumps(body, indent=1) + "\n")


def load_partition(path: str | Path) -> tuple[tuple[str, ...], ...]:
    p = Path(path)
    if not p.is_file():
        raise TowerError(f"{path}: no such tower partition file (write one with `recgrid towers`), "
                         f"or give a tower count")
    try:
        body = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise TowerError(f"{path}: not a tower partition file (not JSON: {e})") from None
    if not isinstance(body, dict) or body.get("format") != PARTITION_FORMAT or not isinstance(body.get("towers"), list):
        raise TowerError(f"{path}: not a tower partition file (expected format {PARTITION_FORMAT!r} "
                         f"and a list 'towers')")
    partition = tuple(tuple(str(f) for f in t) for t in body["towers"])
    TowerConfig(partition)  # validates
    return partition


# ---- where the towers sit -------------------------------------------------------------------------
@dataclass(frozen=True)
class TowerLayout:
    """N towers in every sharding group of `grid`: tower t holds shard ranks
    [t * L_t, (t + 1) * L_t). Shard ranks are numbered host by host in both layouts, so a tower
    is a host's share of the sharding group (or several whole hosts) when the grid's
    `sharding_group_per_node` allows it; `__post_init__` refuses towers that straddle hosts."""

    grid: Grid
    num_towers: int
    _host_sizes: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        L, N = self.grid.group_size, self.num_towers
        if not isinstance(N, int) or N < 1 or L % N:
            raise TowerError(f"N={N} towers must divide the sharding group size L={L} "
                             f"(valid: {[n for n in range(1, L + 1) if L % n == 0]})")
        per_host = self.grid.sharding_group_per_node
        Lt = L // N
        if Lt % per_host and per_host % Lt:
            raise TowerError(f"a tower of L/N={Lt} workers would straddle hosts that hold "
                             f"{per_host} workers of each sharding group; use N = {L // per_host} "
                             f"(one tower per host) or a count whose towers are whole hosts or split a host evenly")

    @property
    def tower_size(self) -> int:
        """L_t: workers per tower."""
        return self.grid.group_size // self.num_towers

    def tower_of(self, shard_rank: int) -> int:
        return shard_rank // self.tower_size

    def index_in_tower(self, shard_rank: int) -> int:
        return shard_rank % self.tower_size

    def tower_shard_ranks(self, tower: int) -> list[int]:
        Lt = self.tower_size
        return list(range(tower * Lt, (tower + 1) * Lt))

    def peer_shard_ranks(self, index: int) -> list[int]:
        """The peers with index `index` inside their tower, in tower order (world size N)."""
        return [t * self.tower_size + index for t in range(self.num_towers)]

    def peer_order(self) -> list[int]:
        """Shard ranks in peer order: sorted by (index in tower, tower)."""
        return sorted(range(self.grid.group_size), key=lambda s: (s % self.tower_size, s // self.tower_size))

    # global ranks of the process groups, in a fixed order every worker agrees on
    def intra_tower_groups(self) -> list[list[int]]:
        return [[g[s] for s in self.tower_shard_ranks(t)] for g in self.grid.sharding_groups
                for t in range(self.num_towers)]

    def peer_groups(self) -> list[list[int]]:
        return [[g[s] for s in self.peer_shard_ranks(k)] for g in self.grid.sharding_groups
                for k in range(self.tower_size)]

    def module_groups(self) -> list[list[int]]:
        """Per tower, every worker that runs its tower module: the tower's workers in all M
        sharding groups (their gradients are summed there, so all copies stay identical)."""
        return [sorted(g[s] for g in self.grid.sharding_groups for s in self.tower_shard_ranks(t))
                for t in range(self.num_towers)]


# ---- the plan ------------------------------------------------------------------------------------
def row_wise_features(spec: DatasetSpec, tower_size: int) -> set[str]:
    """Multi-hot features whose tables are sharded row-wise inside their tower (the rest,
    single-hot or with fewer rows than the tower has workers, column-wise)."""
    return {f for f, bag, rows in zip(SPARSE_NAMES, spec.bag_sizes, spec.table_rows)
            if bag > 1 and rows >= tower_size}


def tower_plan(spec: DatasetSpec, model: "ModelSpec", towers: TowerConfig, grid: Grid,
               device_type: str) -> "ShardingPlan":
    """The sharding plan of one sharding group (shard ranks 0..L-1) for `towers`: each table on
    its tower's workers only, column-wise (equal column shards, one per worker) or row-wise
    (near-equal row blocks). Deterministic, so the driver and every worker make the same one."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan, EnumerableShardingSpec, ParameterSharding, ShardingPlan, ShardMetadata,
    )

    layout = TowerLayout(grid, towers.num_towers)
    Lt, dim = layout.tower_size, model.resolved_dim(spec)
    rw = row_wise_features(spec, Lt)
    rows_of = dict(zip(SPARSE_NAMES, spec.table_rows))
    module_plan: dict[str, ParameterSharding] = {}
    for t, features in enumerate(towers.partition):
        ranks = layout.tower_shard_ranks(t)
        for f in features:
            rows = rows_of[f]
            if f in rw:
                sizes = [rows // Lt + (k < rows % Lt) for k in range(Lt)]
                shards = [ShardMetadata(shard_offsets=[sum(sizes[:k]), 0], shard_sizes=[sizes[k], dim],
                                        placement=f"rank:{r}/{device_type}") for k, r in enumerate(ranks)]
                kind = "row_wise"
            else:
                if dim % Lt:
                    raise TowerError(f"embedding dim {dim} must be divisible by the {Lt} workers of a tower "
                                     f"(single-hot tables are split column-wise over them)")
                w = dim // Lt
                shards = [ShardMetadata(shard_offsets=[0, k * w], shard_sizes=[rows, w],
                                        placement=f"rank:{r}/{device_type}") for k, r in enumerate(ranks)]
                kind = "column_wise"
            module_plan[spec.table_name(f)] = ParameterSharding(
                sharding_type=kind, compute_kernel=EmbeddingComputeKernel.FUSED.value, ranks=list(ranks),
                sharding_spec=EnumerableShardingSpec(shards))
    ordered = {spec.table_name(f): module_plan[spec.table_name(f)] for f in SPARSE_NAMES}
    return ShardingPlan({EBC_PATH: EmbeddingModuleShardingPlan(ordered)})


@dataclass(frozen=True)
class LocalShard:
    """One table shard as a tower worker's kernel holds it."""

    feature: int  # index into SPARSE_NAMES
    row_wise: bool
    row_offset: int
    rows: int
    col_offset: int
    cols: int


def shards_by_rank(plan: "ShardingPlan", spec: DatasetSpec, group_size: int) -> list[list[LocalShard]]:
    """Per shard rank, the shards it holds, in its kernel's order: its column-wise shards, then
    its row-wise shards, each in feature order."""
    module_plan = plan.plan[EBC_PATH]
    out: list[list[LocalShard]] = [[] for _ in range(group_size)]
    for fi, f in enumerate(SPARSE_NAMES):
        ps = module_plan[spec.table_name(f)]  # type: ignore[index]
        for shard in ps.sharding_spec.shards:  # type: ignore[union-attr]
            (r0, c0), (nr, nc) = shard.shard_offsets, shard.shard_sizes
            out[shard.placement.rank()].append(
                LocalShard(fi, ps.sharding_type == "row_wise", r0, nr, c0, nc))
    return [sorted(s, key=lambda x: (x.row_wise, x.feature)) for s in out]
