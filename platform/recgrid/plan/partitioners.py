"""Partition: a proposal (one sharding option per table) placed on the L workers of one sharding
group by TorchRec's `GreedyPerfPartitioner`, and the placement summed per worker (`GroupPlan`:
lookup time, all-to-all time and memory per shard rank, and every table's shards), which is what
the proposers rate and what a job's sharding plan is built from."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

from recgrid.plan.enumerators import ROW_WISE
from recgrid.plan.tables import BYTES_PER_WEIGHT


@dataclass(frozen=True)
class TablePlacement:
    """Where one table's shards went: its sharding type and kernel, and per shard its sizes,
    offsets and shard rank (0..L-1 inside the sharding group)."""

    name: str
    sharding_type: str
    compute_kernel: str
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]

    @property
    def ranks(self) -> list[int]:
        return [rank for _, _, rank in self.shards]

    def label(self) -> str:
        """"sharding_type@shard ranks", as `engine.sharding.sharding_summary` writes a table."""
        return f"{self.sharding_type}@{','.join(map(str, self.ranks))}"


@dataclass(frozen=True)
class GroupPlan:
    """TorchRec's plan for one sharding group of L workers: per shard rank, the lookup time,
    the all-to-all (bandwidth) time and the memory of the shards placed there."""

    group_size: int
    per_node: int
    sharding: dict[str, int]
    lookup_s: tuple[float, ...]
    comms_s: tuple[float, ...]
    weight_bytes: tuple[int, ...]
    optimizer_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    fits: bool
    proposals: int
    seconds: float
    input_comms_s: tuple[float, ...] = ()
    """Per shard rank, the part of `comms_s` that distributes the ids (TorchRec's input_dist_comms);
    the rest returns pooled embeddings and their gradients (what a DMT tower module compresses)."""
    row_wise_tables: tuple[str, ...] = ()
    """The tables the plan shards row-wise (whose output exchange SRP makes sparse)."""
    placements: tuple[TablePlacement, ...] = ()
    """Every table's shards, in the model's table order."""

    @property
    def sparse_bytes(self) -> list[int]:
        return [w + o + a for w, o, a in zip(self.weight_bytes, self.optimizer_bytes, self.activation_bytes)]

    @property
    def peak_rank(self) -> int:
        s = self.sparse_bytes
        return max(range(len(s)), key=s.__getitem__)

    @property
    def lookup_imbalance(self) -> float:
        mean = sum(self.lookup_s) / len(self.lookup_s)
        return max(self.lookup_s) / mean if mean > 0 else 1.0

    @property
    def kernels(self) -> int:
        """Fused lookup kernels a worker runs per step (one per sharding type present)."""
        return len(self.sharding)

    @property
    def critical_s(self) -> float:
        return max(self.lookup_s) + max(self.comms_s)

    @property
    def comms_total_s(self) -> float:
        """All-to-all time summed over the workers: the plan's communication, which breaks ties."""
        return sum(self.comms_s)

    def labels(self) -> dict[str, str]:
        """table name -> "sharding_type@shard ranks"."""
        return {p.name: p.label() for p in self.placements}


def one_shard_columns_as_tables(plan: GroupPlan) -> GroupPlan:
    """`plan` with every column-wise table of one shard run table-wise: the same cut, which
    TorchRec's estimators price the same (tests/test_job_plan.py), without column-wise's output
    permute, and one sharding type (a set of all-to-alls and a kernel) fewer where table-wise is
    present too; never where that would add table-wise as a type. The per-rank sums do not change."""
    def whole(p: TablePlacement) -> bool:
        return p.sharding_type == "column_wise" and len(p.shards) == 1

    columns = [p for p in plan.placements if p.sharding_type == "column_wise"]
    if not any(whole(p) for p in columns):
        return plan
    if "table_wise" not in plan.sharding and not all(whole(p) for p in columns):
        return plan  # it would add table-wise as a type of its own (its all-to-alls and kernel)
    placements = tuple(replace(p, sharding_type="table_wise") if whole(p) else p for p in plan.placements)
    return replace(plan, placements=placements, sharding=dict(Counter(p.sharding_type for p in placements)))


def place(partitioner, proposal: list, reserved, L: int, per_node: int, unbounded: bool = False):
    """`proposal` placed by TorchRec's `partitioner` on the `reserved` topology (without a memory
    cap when `unbounded`) and summarised (`summarize`), or None when it does not fit. The options'
    shard ranks are reset afterwards, so a proposal can be placed again."""
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.distributed.planner.utils import reset_shard_rank

    try:
        partitioner.partition(proposal, reserved, hbm_per_device=(1 << 62) if unbounded else None)
        return summarize(proposal, L, per_node, fits=not unbounded)
    except PlannerError:
        return None
    finally:
        reset_shard_rank(proposal)


def summarize(plan, L: int, per_node: int, fits: bool) -> tuple[GroupPlan, list[str], list[str]]:
    """Per-rank sums of TorchRec's per-shard estimates (Perf in ms; storage in bytes), the tables
    on the slowest worker (heaviest first) and on the worker with the most bytes (largest first)."""
    lookup, comms, ids = [0.0] * L, [0.0] * L, [0.0] * L
    weights, optim, activ = [0] * L, [0] * L, [0] * L
    sharding: Counter = Counter()
    placements = []
    on_rank: dict[int, list[tuple[float, str]]] = {}
    row_wise = []
    for so in plan:
        sharding[so.sharding_type] += 1
        if so.sharding_type == ROW_WISE:
            row_wise.append(so.name)
        dim = so.tensor.shape[1]
        placements.append(TablePlacement(so.name, so.sharding_type, so.compute_kernel, tuple(
            (tuple(sh.size), tuple(sh.offset), int(sh.rank)) for sh in so.shards)))
        for sh in so.shards:
            r, perf = sh.rank, sh.perf
            lookup[r] += (perf.fwd_compute + perf.bwd_compute + perf.prefetch_compute) * 1e-3
            comms[r] += (perf.fwd_comms + perf.bwd_comms + perf.input_dist_comms) * 1e-3
            ids[r] += perf.input_dist_comms * 1e-3
            w = sh.size[0] * sh.size[1] * BYTES_PER_WEIGHT
            on_rank.setdefault(r, []).append((perf.total, w, so.name))
            o = math.ceil(w / dim)  # TorchRec's row-wise AdaGrad estimate: one float per row
            total = max(sh.storage.hbm, sh.storage.ddr)
            weights[r] += w
            optim[r] += o
            activ[r] += max(0, total - w - o)
    worst = max(range(L), key=lambda r: lookup[r] + comms[r])
    hot = [name for _, _, name in sorted(on_rank.get(worst, []), reverse=True)]
    fullest = max(range(L), key=weights.__getitem__)
    big = [name for _, _, name in sorted(on_rank.get(fullest, []), key=lambda x: -x[1])]
    plan_out = GroupPlan(group_size=L, per_node=per_node, sharding=dict(sharding), lookup_s=tuple(lookup),
                         comms_s=tuple(comms), weight_bytes=tuple(weights), optimizer_bytes=tuple(optim),
                         activation_bytes=tuple(activ), fits=fits, proposals=0, seconds=0.0,
                         input_comms_s=tuple(ids), row_wise_tables=tuple(sorted(row_wise)),
                         placements=tuple(placements))
    return plan_out, hot, big


