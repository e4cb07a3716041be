"""Propose: plan ONE sharding group of L workers. TorchRec's proposers (greedy by critical path,
greedy by total work, uniform) propose, its partitioner places (`partitioners.place`), and a short
critical-path descent moves the heaviest tables of the slowest (or fullest) worker to another
sharding type while that helps.

A placed plan is rated by the cost form of the device it will run on: the slowest worker's lookup
plus the slowest worker's all-to-all, plus what each sharding type present costs whatever its
bytes (`estimators.kernel_fixed_seconds`: its all-to-alls' latency and kernel call), plus the
replica sync a 2-D plan pays on its largest shard (`sync_s_per_byte`, 0 for M = 1). Where the cost
model cannot tell two plans apart (ratings within TIE_TOLERANCE), the one with less communication
wins (`pick`). A column-wise table of one shard is then run table-wise
(`partitioners.one_shard_columns_as_tables`: the same cut at the same estimated cost). Every
sharding group replays the same plan, so one is enough; cached per shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

from recgrid.plan.cluster import PlanError
from recgrid.plan.constants import TIE_TOLERANCE
from recgrid.plan.enumerators import PLAN_SHARDING_TYPES, SearchSpace, quiet_torchrec, search_space
from recgrid.plan.estimator_lookups import memoized_estimator_lookups
from recgrid.plan.estimators import CpuCost, GpuCost, kernel_fixed_seconds
from recgrid.plan.partitioners import GroupPlan, one_shard_columns_as_tables, place
from recgrid.plan.tables import ModelTables

# A greedy proposer walk stops after this many proposals that do not fit (TorchRec's own walk
# can take one per table option; beyond a few dozen it only trades speed for memory).
MAX_GREEDY_STEPS = 40
# Critical-path descent after the proposers: at most this many trial placements (a round
# without improvement ends it sooner). Bounds planning time for L in the hundreds.
DESCENT_TRIALS = 8

_GROUP_CACHE: dict[tuple, GroupPlan] = {}
MAX_CACHED_GROUPS = 256


def clear_cache() -> None:
    _GROUP_CACHE.clear()


def plan_group(model: ModelTables, group_size: int, per_node: int, batch: int, cost: GpuCost | CpuCost,
               reserve_bytes: float, sharding_types: Sequence[str] = PLAN_SHARDING_TYPES,
               sync_s_per_byte: float = 0.0) -> GroupPlan:
    """Plan ONE sharding group of `group_size` workers (`per_node` of them share a node) with
    TorchRec's enumerator, estimators, proposers and partitioner, rated as the module docstring
    says; cached."""
    key = (model, group_size, per_node, batch, cost.key, int(reserve_bytes), tuple(sharding_types),
           round(sync_s_per_byte, 18))
    if key not in _GROUP_CACHE:
        if len(_GROUP_CACHE) >= MAX_CACHED_GROUPS:
            _GROUP_CACHE.clear()
        with quiet_torchrec(), memoized_estimator_lookups():
            space = search_space(model, group_size, per_node, batch, cost, reserve_bytes, tuple(sharding_types))
            plan = _plan_group(space, group_size, per_node, cost, sync_s_per_byte)
            _GROUP_CACHE[key] = one_shard_columns_as_tables(plan) if "table_wise" in sharding_types else plan
    return _GROUP_CACHE[key]


@dataclass
class Placed:
    plan: GroupPlan
    rating: float
    hot: list[str]  # tables on the slowest worker, heaviest first
    big: list[str]  # tables on the worker holding the most shard bytes, largest first (if the sync is rated)

    def beats(self, other: "Placed | None") -> bool:
        """A lower rating (beyond float noise)."""
        return other is None or self.rating < other.rating * (1 - 1e-9)


def pick(placed: Sequence[Placed]) -> Placed:
    """Of the placements a search rated: among those within TIE_TOLERANCE of the best rating (the
    cost model cannot tell them apart), the one with the least communication; then the lower
    rating. Only this search's own placements, so a plan never depends on what was planned before."""
    best = min(p.rating for p in placed)
    tied = [p for p in placed if p.rating <= best * (1 + TIE_TOLERANCE)]
    return min(tied, key=lambda p: (p.plan.comms_total_s, p.rating))


def _plan_group(space: SearchSpace, L: int, per_node: int, cost, sync_s_per_byte: float) -> GroupPlan:
    """TorchRec's proposers and its partitioner, then the critical-path descent."""
    from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
    from torchrec.distributed.planner.proposers import GreedyProposer, UniformProposer

    t0 = time.perf_counter()
    partitioner = GreedyPerfPartitioner()
    options = [so for opts in space.options.values() for so in opts]
    tried = 0
    seen: dict[tuple, Placed] = {}  # this search's placements that fit, by proposal

    def rated(proposal, unbounded: bool = False) -> Placed | None:
        nonlocal tried
        key = (tuple(sorted(id(so) for so in proposal)), unbounded)
        if key not in space.placements:
            tried += 1
            space.placements[key] = place(partitioner, proposal, space.reserved, L, per_node, unbounded)
        if space.placements[key] is None:
            return None
        plan, hot, big = space.placements[key]
        shard = max(w + o for w, o in zip(plan.weight_bytes, plan.optimizer_bytes))
        rating = plan.critical_s + kernel_fixed_seconds(cost, plan.kernels, L, per_node) + sync_s_per_byte * shard
        out = Placed(plan, rating, hot, big if sync_s_per_byte else [])
        if not unbounded:
            seen[key] = out
        return out

    best: tuple[Placed, list] | None = None
    unplaced = []  # proposals that did not fit (first of each greedy walk, every uniform one)
    for proposer in (GreedyProposer(use_depth=True), GreedyProposer(use_depth=False), UniformProposer()):
        proposer.load(search_space=options)
        greedy = isinstance(proposer, GreedyProposer)
        proposal, misses = proposer.propose(), 0
        while proposal:
            placed = None if space.hopeless else rated(proposal)
            if placed is None:
                if misses == 0 or not greedy:
                    unplaced.append(list(proposal))
                misses += 1
                if greedy and (space.hopeless or misses >= MAX_GREEDY_STEPS):
                    break
                proposer.feedback(partitionable=False, plan=proposal, storage_constraint=space.reserved)
            else:
                if placed.beats(best[0] if best else None):
                    best = (placed, list(proposal))
                if greedy:
                    break  # a greedy walk's first fit is its best; later steps trade speed for memory
                proposer.feedback(partitionable=True, plan=proposal, perf_rating=placed.rating,
                                  storage_constraint=space.reserved)
            proposal = proposer.propose()

    if best is not None:
        descend(best, space, rated)
        result = pick(list(seen.values())).plan
    else:
        # Nothing fits: show the leanest of the proposals, placed without a memory cap.
        lean = None
        for proposal in unplaced:
            placed = rated(proposal, unbounded=True)
            if placed is not None and (lean is None or max(placed.plan.sparse_bytes) < max(lean.sparse_bytes)):
                lean = placed.plan
        if lean is None:
            raise PlanError(f"TorchRec's partitioner could not place the tables on a sharding group of L={L}")
        result = lean
    return replace(result, proposals=tried, seconds=space.seconds + time.perf_counter() - t0)


def descend(best: tuple[Placed, list], space: SearchSpace, rated, trials: int = DESCENT_TRIALS,
            per_round: int = 3) -> tuple[Placed, list]:
    """Critical-path descent: for the heaviest tables on the slowest worker (and, when the sync
    is rated, the largest tables on the worker holding the most bytes), try each of the table's
    other sharding types, leanest critical path first; keep the first change that rates better."""
    placed, proposal = best
    while trials > 0:
        current = {so.name: i for i, so in enumerate(proposal)}
        names = list(dict.fromkeys(placed.hot[:per_round] + placed.big[:per_round]))
        improved = False
        for name in names:
            cur = proposal[current[name]]
            for alt in space.options[name]:
                if alt.sharding_type == cur.sharding_type:
                    continue
                if trials <= 0:
                    break
                trials -= 1
                trial = list(proposal)
                trial[current[name]] = alt
                got = rated(trial)
                if got is not None and got.beats(placed):
                    placed, proposal, improved = got, trial, True
                    break
            if improved:
                break
        if not improved:
            break
    return placed, proposal
