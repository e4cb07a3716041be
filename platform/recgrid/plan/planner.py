"""`recgrid plan`: for every group count M dividing T, predict the step time split, the peak
memory per GPU and the QPS of 2-D sparse parallelism, then recommend M and K and say why.

How a candidate (M, K) is priced:

1. One sharding group of L = T / M workers is planned with TorchRec's own pieces: its
   `EmbeddingEnumerator` (with TorchRec's perf and storage estimators) lists every table's sharding
   options with per-shard lookup time, communication time and memory (options that cut a table into
   the same shards kept once; row-wise offered only where it is needed, see ROW_WISE; column-wise
   also in narrower shards for the tables above one worker's share, see `_narrow_column_widths`);
   TorchRec's proposers (greedy by critical path, greedy by total work, uniform) propose plans; its
   `GreedyPerfPartitioner` places them on L devices under the memory left after the dense part. A
   short descent then moves the heaviest tables of the slowest (or fullest) worker to another
   sharding type while that helps. Plans are rated by the slowest worker's lookup + the slowest
   worker's all-to-all + the replica sync they imply (the largest shard's bytes / K), so a 2-D plan
   keeps its shards small. Every sharding group replays the same plan, so one is enough. On the CTR
   model, with TorchRec's default options (before the narrower column shards were offered), this
   search matched TorchRec's full `EmbeddingShardingPlanner` on its own rating (max per-worker
   perf) at L = 32 and L = 256, in about 1/15 to 1/60 of its time.
2. recgrid adds what 2-D adds: the all-to-all bandwidth and per-peer latency for a group of L
   spread over nodes as the grid layout puts it (cost.py), the replica sync (paper Eq. 1, a ring
   all-reduce of each worker's shard bytes over its M-worker replica group, every K steps, over
   NVLink when the replica group sits in one node and over all the NICs of its nodes when it is
   whole nodes of its own), and the replica memory overhead S(M-1)/T.
3. The dense part is data-parallel over all T workers: its compute and its gradient all-reduce
   are the same for every M.

Enumerations and placements are cached per sharding-group shape (L, workers per node), so the K
candidates of one M re-rate placements instead of repeating them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator, Sequence

from recgrid.plan.constants import GB, MIN_COLUMN_SHARD_BYTES, PROFILES
from recgrid.plan.cost import CpuCost, GpuCost
from recgrid.plan.recscale import (
    MemorySummary, OptionsError, apply_args, describe, exchange_label, memory_summary, price_sparse_exchange,
    row_wise_exchange_bytes,
)
from recgrid.plan.tables import BYTES_PER_WEIGHT, ModelTables, TableSpec, TablesError, resolve_model

# Sharding types the planner considers for every table: table-wise, column-wise and
# table-row-wise (TorchRec's choice for large tables on multi-node groups).
PLAN_SHARDING_TYPES: tuple[str, ...] = ("table_wise", "column_wise", "table_row_wise")
# Row-wise is offered too where TorchRec's planner would need it (`_row_wise_tables`): to a table
# larger than one GPU (weights and optimizer state above what the dense part leaves), and, in a
# sharding group with one member per node (a replica group spanning whole nodes), where
# table-row-wise splits nothing, to a table above one worker's share of the bytes or of the lookup
# work. Not to every table: its L shards per table make TorchRec's enumeration slow (15 s of CPU
# for 788 tables at L = 256, 0.5 s without it, and growing with L), and its reduce-scatter of
# B x L pooled rows per table and worker makes TorchRec's estimators prefer table-row-wise wherever
# that splits.
ROW_WISE = "row_wise"
# K candidates: the sync intervals this project measures (bench/step_time.py, bench/quality.py).
DEFAULT_SYNC_EVERY: tuple[int, ...] = (1, 5, 25)
# Policy, not physics: among plans within this fraction of the best QPS, prefer the smallest K
# (less local-SGD drift), then the smallest M (fewer copies, closer to the M = 1 baseline).
QPS_TOLERANCE = 0.02
# All-to-alls a step runs per sharding type present (TorchRec's KJTAllToAll sends the splits,
# then lengths and values; PooledEmbeddingsAllToAll sends the pooled embeddings forward and
# their gradients backward).
A2A_PER_SHARDING_TYPE = 5
# A greedy proposer walk stops after this many proposals that do not fit (TorchRec's own walk
# can take one per table option; beyond a few dozen it only trades speed for memory).
MAX_GREEDY_STEPS = 40
# Critical-path descent after the proposers: at most this many trial placements (a round
# without improvement ends it sooner). Bounds planning time for L in the hundreds.
DESCENT_TRIALS = 8


class PlanError(ValueError):
    """An impossible cluster or argument; the message names it."""


# ---- the cluster --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cluster:
    """T workers, G to a node, B samples per worker per step, and the hardware's cost form."""

    gpus: int
    gpus_per_node: int
    batch_per_gpu: int
    cost: GpuCost | CpuCost

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "batch_per_gpu"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PlanError(f"--gpus T={self.gpus} is not a whole number of nodes of --gpus-per-node "
                            f"{self.gpus_per_node}")

    @property
    def workers_per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)

    def group_counts(self) -> list[int]:
        return [m for m in range(1, self.gpus + 1) if self.gpus % m == 0]


def layouts_for(cluster: Cluster, num_groups: int) -> list[str]:
    """The rank layouts recgrid's grid allows for (T, M): host-local when M divides the workers
    per node W (each replica group inside one node: sync over NVLink) or is a multiple of W (each
    replica group on M/W whole nodes of its own: sync over all their NICs), and inter-host (each
    sharding group on whole nodes: NVLink inside the sharding group, sync over one NIC per GPU)
    when M > 1."""
    W = cluster.workers_per_node
    out = ["host-local"] if W % num_groups == 0 or num_groups % W == 0 else []
    if num_groups > 1:
        out.append("inter-host")
    return out


def grid_for(cluster: Cluster, num_groups: int, layout: str):
    """recgrid's grid for (T, M, layout): the one place rank lists come from."""
    from recgrid.engine.grid import Grid

    return Grid(cluster.gpus, num_groups, layout, workers_per_node=cluster.workers_per_node)


def _ranks_per_node(ranks: Sequence[int], workers_per_node: int) -> int:
    """Most members of one rank list that share a node (ranks are numbered contiguously per node)."""
    return max(Counter(r // workers_per_node for r in ranks).values())


# ---- one sharding group, planned with TorchRec --------------------------------------------------
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


@contextlib.contextmanager
def quiet_torchrec() -> Iterator[None]:
    """TorchRec's planner logs tables and warnings at INFO/WARNING; recgrid prints its own."""
    names = ("torchrec", "torch", "fbgemm_gpu")
    saved = {n: logging.getLogger(n).level for n in names}
    root = logging.getLogger().level
    try:
        for n in names:
            logging.getLogger(n).setLevel(logging.ERROR)
        logging.getLogger().setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for n, lvl in saved.items():
            logging.getLogger(n).setLevel(lvl)
        logging.getLogger().setLevel(root)


@contextlib.contextmanager
def memoized_estimator_lookups() -> Iterator[None]:
    """TorchRec 1.8's perf estimator finds its hardware config's annotated methods by scanning
    `dir(config)` on every call (about half of enumeration time; 2.5x faster without it).
    While planning, remember which method each scan found, per config class, annotation and
    sharding type, and return that same bound method; a scan whose result cannot be recalled by
    name is repeated every time. Restored on exit; a TorchRec without these functions is left alone."""
    try:
        from torchrec.distributed.planner.estimator import annotations
    except ImportError:
        yield
        return
    names = [n for n in ("_get_annotated_method", "_get_coefficient_method") if callable(getattr(annotations, n, None))]
    saved = {n: getattr(annotations, n) for n in names}

    def remembering(scan):
        found: dict[tuple, str | None] = {}

        def lookup(config, marker, sharding_type=None):
            key = (type(config), marker, sharding_type)
            if key in found:
                name = found[key]
                return None if name is None else getattr(config, name)
            method = scan(config, marker, sharding_type)
            name = getattr(getattr(method, "__func__", None), "__name__", None)
            if method is None or (name is not None and getattr(config, name, None) == method):
                found[key] = None if method is None else name
            return method
        return lookup

    try:
        for n in names:
            setattr(annotations, n, remembering(saved[n]))
        yield
    finally:
        for n, f in saved.items():
            setattr(annotations, n, f)


@functools.lru_cache(maxsize=8)
def _meta_module(model: ModelTables):
    """The model's tables as an unsharded EmbeddingBagCollection on the meta device (no memory),
    each weight tagged with row-wise AdaGrad so TorchRec's storage estimator counts its state."""
    import torch
    import torchrec.optim as trec_optim
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=[t.name])
                for t in model.tables],
        device=torch.device("meta"),
    )
    for p in ebc.parameters():
        p._optimizer_classes = [trec_optim.RowWiseAdagrad]  # noqa: SLF001 - TorchRec's own convention
    return ebc


@functools.lru_cache(maxsize=1)
def _sharder():
    from recgrid.config import OptimConfig
    from recgrid.engine.optimizer import MomentScaledRowWiseAdagrad
    from recgrid.engine.sharding import grid_sharder

    o = OptimConfig()  # the planner's sharder only needs a fused optimizer's kind, not its values
    return grid_sharder(MomentScaledRowWiseAdagrad(lr=o.lr, eps=o.eps, moment_scale=1.0).fused_params())


@dataclass
class _SearchSpace:
    """TorchRec's enumeration of one sharding group: every table's options with per-shard perf
    and storage, and the topology left after the dense part's reservation. Cached per L."""

    options: dict[str, list]  # table name -> its sharding options, leanest critical path first
    reserved: object  # Topology
    hopeless: bool  # even the leanest option of every table, spread perfectly, does not fit
    seconds: float
    # placements already made, by proposal (its options' ids) and memory cap: K candidates of one
    # M rate the same placements differently, so each proposal is partitioned once
    placements: dict = field(default_factory=dict)


_SPACE_CACHE: dict[tuple, _SearchSpace] = {}
_GROUP_CACHE: dict[tuple, GroupPlan] = {}
MAX_CACHED_SHAPES = 32


def _search_space(model: ModelTables, L: int, per_node: int, batch: int, cost, reserve_bytes: float,
                  sharding_types: tuple[str, ...]) -> _SearchSpace:
    key = (model, L, per_node, batch, cost.key, int(reserve_bytes), sharding_types)
    if key in _SPACE_CACHE:
        return _SPACE_CACHE[key]
    if len(_SPACE_CACHE) >= MAX_CACHED_SHAPES:  # each holds every table's options: bound the memory
        _SPACE_CACHE.clear()
        _GROUP_CACHE.clear()
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.storage_reservations import FixedAbsoluteStorageReservation
    from torchrec.distributed.planner.types import ParameterConstraints

    t0 = time.perf_counter()
    ebc, sharder = _meta_module(model), _sharder()
    row_wise = set() if ROW_WISE in sharding_types else _row_wise_tables(model, L, per_node,
                                                                         cost.capacity - reserve_bytes)
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=list(sharding_types) + ([ROW_WISE] if t.name in row_wise else []),
            compute_kernels=[EmbeddingComputeKernel.FUSED.value], pooling_factors=[t.pooling])
        for t in model.tables
    }
    topology = cost.topology(L, per_node)
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=batch, constraints=constraints)
    options: dict[str, list] = {}
    for so in enumerator.enumerate(ebc, [sharder]):
        options.setdefault(so.name, []).append(so)
    if "column_wise" in sharding_types:
        for width, names in _narrow_column_widths(model, L).items():
            _add_options(options, model, names, width, topology, batch, sharder)
    price_sparse_exchange(model, options)  # SRP: a row-wise option's output exchange by its occupancy
    for name, opts in options.items():
        options[name] = _distinct(opts)
    reserved = FixedAbsoluteStorageReservation(int(min(reserve_bytes, cost.capacity))).reserve(
        topology, batch, ebc, [sharder], constraints)
    budget = _capacity(reserved.devices[0].storage, cost)
    leanest = sum(min(sum(_capacity(sh.storage, cost) for sh in so.shards) for so in opts)
                  for opts in options.values())
    space = _SearchSpace(options, reserved, leanest / L > budget, time.perf_counter() - t0)
    _SPACE_CACHE[key] = space
    return space


def _row_wise_tables(model: ModelTables, L: int, per_node: int, one_gpu: float) -> set[str]:
    """The tables row-wise is offered to (see ROW_WISE): larger than one GPU, or, with one member
    of the sharding group per node, above a worker's share of the bytes or the lookup work."""
    out = {t.name for t in model.tables if _state_bytes(t) > one_gpu}
    if per_node == 1:
        out |= _above_share(model, L)
    return out


def _state_bytes(t: TableSpec) -> float:
    return t.bytes * (1 + 1 / t.dim)  # weights and row-wise AdaGrad state


def _above_share(model: ModelTables, L: int) -> set[str]:
    """The tables above one worker's share (1/L) of the model's bytes (weights and row-wise AdaGrad
    state) or of its lookup work (ids x dim per sample): whole on one worker, they make it the
    fullest or the slowest of its sharding group. None when L = 1."""
    if L <= 1:
        return set()
    state = {t.name: _state_bytes(t) for t in model.tables}
    work = {t.name: t.pooling * t.dim for t in model.tables}
    total_state, total_work = sum(state.values()), sum(work.values())
    return {t.name for t in model.tables if state[t.name] > total_state / L or work[t.name] > total_work / L}


def _narrow_column_widths(model: ModelTables, L: int) -> dict[int, list[str]]:
    """Column-shard widths offered beyond TorchRec's default (one 128-column shard, i.e. the whole
    table at dim <= 128): for each table above one worker's share, every halving of its dim down to
    MIN_COLUMN_SHARD_BYTES of fp32 per row (dim 128: 64 and 32 columns, two or four shards), so
    TorchRec's partitioner can spread a hot or large table over several workers without row-wise's
    B x L reduce-scatter; TorchRec's estimators price each width (every column shard reads all the
    table's ids). By width: the tables it is offered to."""
    floor = max(4, MIN_COLUMN_SHARD_BYTES // BYTES_PER_WEIGHT)  # TBE needs dims that are multiples of 4
    out: dict[int, list[str]] = {}
    above = _above_share(model, L)
    for t in model.tables:
        if t.name not in above:
            continue
        width = t.dim // 2
        while width >= floor and t.dim % width == 0 and width % 4 == 0:
            out.setdefault(width, []).append(t.name)
            width //= 2
    return out


def _add_options(options: dict[str, list], model: ModelTables, names: list[str], width: int, topology, batch: int,
                 sharder) -> None:
    """TorchRec's column-wise options for `names` at shard width `width` (its `min_partition`):
    one more enumeration, of those tables alone."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.types import ParameterConstraints

    wanted = set(names)
    sub = replace(model, tables=tuple(t for t in model.tables if t.name in wanted))
    constraints = {t.name: ParameterConstraints(sharding_types=["column_wise"],
                                                compute_kernels=[EmbeddingComputeKernel.FUSED.value],
                                                pooling_factors=[t.pooling], min_partition=width)
                   for t in sub.tables}
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=batch, constraints=constraints)
    for so in enumerator.enumerate(_meta_module(sub), [sharder]):
        options[so.name].append(so)


def _capacity(storage, cost) -> float:
    return storage.hbm if cost.compute_device == "cuda" else storage.ddr


def _distinct(opts: list) -> list:
    """A table's options, leanest critical path first, without options that cut the table into the
    same shards as a leaner one (column-wise into one column shard and table-row-wise over one
    worker per node are table-wise): the proposers and the descent then never spend a trial on them."""
    seen: set = set()
    out = []
    # ties broken by name, not by TorchRec's enumeration order, which follows the string hash seed
    for so in sorted(opts, key=lambda so: (_depth(so), so.sharding_type, so.compute_kernel, len(so.shards))):
        cut = tuple((tuple(sh.size), tuple(sh.offset)) for sh in so.shards)
        if cut not in seen:
            seen.add(cut)
            out.append(so)
    return out


def _depth(so) -> float:
    """TorchRec's GreedyProposer score with use_depth: the slowest shard's estimated time."""
    return max(sh.perf.total for sh in so.shards)


def plan_group(model: ModelTables, group_size: int, per_node: int, batch: int, cost: GpuCost | CpuCost,
               reserve_bytes: float, sharding_types: Sequence[str] = PLAN_SHARDING_TYPES,
               sync_s_per_byte: float = 0.0) -> GroupPlan:
    """Plan ONE sharding group of `group_size` workers (`per_node` of them share a node) with
    TorchRec's enumerator, estimators, proposers and partitioner; cached.

    A placed plan is rated by the slowest worker's lookup plus the slowest worker's all-to-all,
    plus `sync_s_per_byte` x the largest shard's bytes: the replica sync, which a 2-D plan pays
    on the largest shard (0 for M = 1)."""
    key = (model, group_size, per_node, batch, cost.key, int(reserve_bytes), tuple(sharding_types),
           round(sync_s_per_byte, 18))
    if key not in _GROUP_CACHE:
        with quiet_torchrec(), memoized_estimator_lookups():
            space = _search_space(model, group_size, per_node, batch, cost, reserve_bytes, tuple(sharding_types))
            _GROUP_CACHE[key] = _plan_group(space, group_size, per_node, cost, sync_s_per_byte)
    return _GROUP_CACHE[key]


@dataclass
class _Placed:
    plan: GroupPlan
    rating: float
    hot: list[str]  # tables on the slowest worker, heaviest first
    big: list[str]  # tables on the worker holding the most shard bytes, largest first (if the sync is rated)


def _plan_group(space: _SearchSpace, L: int, per_node: int, cost, sync_s_per_byte: float) -> GroupPlan:
    """TorchRec's proposers (greedy by depth, greedy by total work, uniform) and its partitioner,
    then a short critical-path descent: move the heaviest tables of the slowest worker to their
    next sharding type while that shortens the rated step."""
    from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
    from torchrec.distributed.planner.proposers import GreedyProposer, UniformProposer
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.distributed.planner.utils import reset_shard_rank

    t0 = time.perf_counter()
    partitioner = GreedyPerfPartitioner()
    search_space = [so for opts in space.options.values() for so in opts]
    tried = 0

    def place(proposal, unbounded: bool = False) -> _Placed | None:
        nonlocal tried
        key = (tuple(sorted(id(so) for so in proposal)), unbounded)
        if key not in space.placements:
            tried += 1
            try:
                partitioner.partition(proposal, space.reserved, hbm_per_device=(1 << 62) if unbounded else None)
                space.placements[key] = _summarize(proposal, L, per_node, fits=not unbounded)
            except PlannerError:
                space.placements[key] = None
            reset_shard_rank(proposal)
        if space.placements[key] is None:
            return None
        plan, hot, big = space.placements[key]
        shard = max(w + o for w, o in zip(plan.weight_bytes, plan.optimizer_bytes))
        return _Placed(plan, plan.critical_s + sync_s_per_byte * shard, hot, big if sync_s_per_byte else [])

    best: tuple[_Placed, list] | None = None
    unplaced = []  # proposals that did not fit (first of each greedy walk, every uniform one)
    for proposer in (GreedyProposer(use_depth=True), GreedyProposer(use_depth=False), UniformProposer()):
        proposer.load(search_space=search_space)
        greedy = isinstance(proposer, GreedyProposer)
        proposal, misses = proposer.propose(), 0
        while proposal:
            placed = None if space.hopeless else place(proposal)
            if placed is None:
                if misses == 0 or not greedy:
                    unplaced.append(list(proposal))
                misses += 1
                if greedy and (space.hopeless or misses >= MAX_GREEDY_STEPS):
                    break
                proposer.feedback(partitionable=False, plan=proposal, storage_constraint=space.reserved)
            else:
                if best is None or placed.rating < best[0].rating:
                    best = (placed, list(proposal))
                if greedy:
                    break  # a greedy walk's first fit is its best; later steps trade speed for memory
                proposer.feedback(partitionable=True, plan=proposal, perf_rating=placed.rating,
                                  storage_constraint=space.reserved)
            proposal = proposer.propose()

    if best is not None:
        best = _descend(best, space, place)
        result = best[0].plan
    else:
        # Nothing fits: show the leanest of the proposals, placed without a memory cap.
        lean = None
        for proposal in unplaced:
            placed = place(proposal, unbounded=True)
            if placed is not None and (lean is None or max(placed.plan.sparse_bytes) < max(lean.sparse_bytes)):
                lean = placed.plan
        if lean is None:
            raise PlanError(f"TorchRec's partitioner could not place the tables on a sharding group of L={L}")
        result = lean
    return GroupPlan(**{**asdict(result), "proposals": tried, "seconds": space.seconds + time.perf_counter() - t0})


def _descend(best, space: _SearchSpace, place, trials: int = DESCENT_TRIALS, per_round: int = 3):
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
                got = place(trial)
                if got is not None and got.rating < placed.rating * (1 - 1e-6):
                    placed, proposal, improved = got, trial, True
                    break
            if improved:
                break
        if not improved:
            break
    return placed, proposal


def _summarize(plan, L: int, per_node: int, fits: bool) -> tuple[GroupPlan, list[str], list[str]]:
    """Per-rank sums of TorchRec's per-shard estimates (Perf in ms; storage in bytes), the tables
    on the slowest worker (heaviest first) and on the worker with the most bytes (largest first)."""
    lookup, comms, ids = [0.0] * L, [0.0] * L, [0.0] * L
    weights, optim, activ = [0] * L, [0] * L, [0] * L
    sharding: Counter = Counter()
    on_rank: dict[int, list[tuple[float, str]]] = {}
    row_wise = []
    for so in plan:
        sharding[so.sharding_type] += 1
        if so.sharding_type == ROW_WISE:
            row_wise.append(so.name)
        dim = so.tensor.shape[1]
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
                         input_comms_s=tuple(ids), row_wise_tables=tuple(sorted(row_wise)))
    return plan_out, hot, big


# ---- the dense part ------------------------------------------------------------------------------
def dense_flops_per_sample(model: ModelTables) -> float:
    """Training FLOP per sample: forward 2 and backward 4 per dense weight (and per
    multiply-add of a dot interaction)."""
    flops = 6.0 * sum(i * o for i, o in model.dense_layers)
    if model.dense.interaction == "dot":
        n = model.features + 1
        flops += 6.0 * n * n * model.dense.bottom_mlp[-1]
    return flops


def dense_memory_bytes(model: ModelTables, batch: int) -> int:
    """Per worker: weights, gradients and Adagrad state of the dense part, its activations and
    their gradients, and the pooled embeddings it receives (and their gradients)."""
    params = model.dense_params
    layer_out = sum(o for _, o in model.dense_layers)
    activations = batch * (layer_out + model.embedding_width + model.dense.dense_features) * 4 * 2
    return 3 * params * 4 + activations


# ---- a candidate ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """The prediction for one (M, K). Times per step in seconds, memory per worker in bytes."""

    num_groups: int
    group_size: int
    sync_every: int
    layout: str
    lookup_s: float
    lookup_a2a_s: float
    dense_s: float
    dense_allreduce_s: float
    sync_s: float  # per step: one sync's time / K
    sync_per_sync_s: float
    overhead_s: float
    tables_bytes: int
    replica_overhead_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    dense_bytes: int
    capacity_bytes: float
    lookup_imbalance: float
    sharding: dict[str, int]
    planner_fits: bool
    samples_per_step: int
    row_wise_dense_bytes: float = 0.0
    """Bytes a worker sends per step in its row-wise tables' forward output exchange, dense
    (TorchRec's reduce-scatter); backward sends as many back."""
    row_wise_bytes: float = 0.0
    """The same as priced: x occupancy with SRP (`row_wise_exchange: sparse`), else the dense bytes."""

    @property
    def step_s(self) -> float:
        return (self.lookup_s + self.lookup_a2a_s + self.dense_s + self.dense_allreduce_s + self.sync_s
                + self.overhead_s)

    @property
    def qps(self) -> float:
        return self.samples_per_step / self.step_s

    @property
    def peak_bytes(self) -> int:
        return self.tables_bytes + self.optimizer_bytes + self.activation_bytes + self.dense_bytes

    @property
    def feasible(self) -> bool:
        return self.planner_fits and self.peak_bytes <= self.capacity_bytes

    def to_json(self) -> dict:
        ms = lambda s: round(s * 1e3, 3)  # noqa: E731
        gb = lambda b: round(b / GB, 3)  # noqa: E731
        return {
            "num_groups": self.num_groups, "group_size": self.group_size, "sync_every": self.sync_every,
            "layout": self.layout, "qps": round(self.qps, 1), "step_ms": ms(self.step_s),
            "peak_memory_gb": gb(self.peak_bytes), "feasible": self.feasible,
            "time_ms": {"lookup": ms(self.lookup_s), "lookup_all_to_all": ms(self.lookup_a2a_s),
                        "dense": ms(self.dense_s), "dense_all_reduce": ms(self.dense_allreduce_s),
                        "replica_sync": ms(self.sync_s), "replica_sync_per_sync": ms(self.sync_per_sync_s),
                        "overhead": ms(self.overhead_s)},
            "memory_gb": {"tables": gb(self.tables_bytes), "replica_overhead": gb(self.replica_overhead_bytes),
                          "optimizer": gb(self.optimizer_bytes), "lookup_activations": gb(self.activation_bytes),
                          "dense": gb(self.dense_bytes), "capacity": gb(self.capacity_bytes)},
            "lookup_imbalance": round(self.lookup_imbalance, 3),
            "sharding": self.sharding,
            "row_wise_exchange_bytes": {"dense": round(self.row_wise_dense_bytes),
                                        "priced": round(self.row_wise_bytes)},
        }


def evaluate(model: ModelTables, cluster: Cluster, num_groups: int, sync_every: int = 1,
             layout: str | None = None, sharding_types: Sequence[str] = PLAN_SHARDING_TYPES) -> Candidate:
    """Price (M, K) on `cluster`: TorchRec's plan for one sharding group plus what 2-D adds.
    With no `layout`, every layout the grid allows is priced and the better one kept (one that
    fits memory first, then the higher QPS)."""
    if cluster.gpus % num_groups:
        raise PlanError(f"M={num_groups} does not divide T={cluster.gpus}")
    if sync_every < 1:
        raise PlanError(f"sync_every (K) must be >= 1, got {sync_every}")
    layouts = [layout] if layout else layouts_for(cluster, num_groups)
    if model.sharding != "auto" and sharding_types == PLAN_SHARDING_TYPES:
        sharding_types = (model.sharding,)  # the job's model.sharding, not the planner's choice
    priced = [_evaluate(model, cluster, num_groups, sync_every, lay, sharding_types) for lay in layouts]
    return max(priced, key=lambda c: (c.feasible, c.qps))


def _evaluate(model: ModelTables, cluster: Cluster, num_groups: int, sync_every: int, layout: str,
              sharding_types: Sequence[str]) -> Candidate:
    from recgrid.engine.grid import GridError

    try:
        grid = grid_for(cluster, num_groups, layout)
    except GridError as e:
        raise PlanError(str(e)) from None
    T, M, L, B, W = cluster.gpus, num_groups, grid.group_size, cluster.batch_per_gpu, cluster.workers_per_node
    cost = cluster.cost
    dense_bytes = dense_memory_bytes(model, B)
    replica = grid.replica_groups[0]
    replica_per_node = _ranks_per_node(replica, W)
    sync_per_byte = 1.0 / (cost.allreduce_rate(M, replica_per_node) * sync_every) if M > 1 else 0.0
    group = plan_group(model, L, grid.sharding_group_per_node, B, cost, dense_bytes, sharding_types, sync_per_byte)
    peak = group.peak_rank

    a2a_latency = A2A_PER_SHARDING_TYPE * len(group.sharding) * cost.a2a_latency(L, grid.sharding_group_per_node)
    dense_s = cost.dense_seconds(dense_flops_per_sample(model) * B, B)
    dense_ar = cost.allreduce_seconds(model.dense_params * 4, T, W)
    # Replica sync (Eq. 1): each worker's shard bytes (weights + optimizer state), all-reduced over
    # its replica group; the slowest (largest) shard sets the pace.
    shard_bytes = max(w + o for w, o in zip(group.weight_bytes, group.optimizer_bytes))
    sync_one = cost.allreduce_seconds(shard_bytes, M, replica_per_node) if M > 1 else 0.0
    state_bytes = sum(group.weight_bytes) + sum(group.optimizer_bytes)  # S: one full copy
    rw_dense, rw_priced = row_wise_exchange_bytes(model, group.row_wise_tables, B, L)
    return Candidate(
        num_groups=M, group_size=L, sync_every=sync_every if M > 1 else 1, layout=grid.layout,
        lookup_s=max(group.lookup_s) + cost.lookup_overhead(group.kernels),
        lookup_a2a_s=max(group.comms_s) + a2a_latency,
        dense_s=dense_s, dense_allreduce_s=dense_ar,
        sync_s=sync_one / sync_every, sync_per_sync_s=sync_one, overhead_s=cost.step_overhead(),
        tables_bytes=group.weight_bytes[peak], replica_overhead_bytes=state_bytes * (M - 1) // T,
        optimizer_bytes=group.optimizer_bytes[peak], activation_bytes=group.activation_bytes[peak],
        dense_bytes=dense_bytes, capacity_bytes=cost.capacity, lookup_imbalance=group.lookup_imbalance,
        sharding=group.sharding, planner_fits=group.fits, samples_per_step=T * B,
        row_wise_dense_bytes=rw_dense, row_wise_bytes=rw_priced,
    )


# ---- the plan ---------------------------------------------------------------------------------------
@dataclass
class Plan:
    model: ModelTables
    cluster: Cluster
    candidates: list[Candidate]
    recommended: Candidate | None
    reason: str
    seconds: float
    memory: MemorySummary | None = None

    @property
    def max_feasible_groups(self) -> int:
        """The largest M among the candidates that fit (0: none)."""
        return max((c.num_groups for c in self.candidates if c.feasible), default=0)

    def to_json(self) -> dict:
        c = self.cluster
        return {
            "model": {"name": self.model.name, "tables": len(self.model.tables),
                      "table_bytes": self.model.total_bytes, "dense_params": self.model.dense_params,
                      "features": self.model.features},
            "cluster": {"gpus": c.gpus, "gpus_per_node": c.gpus_per_node, "batch_per_gpu": c.batch_per_gpu,
                        "hbm_gb": round(c.cost.capacity / GB, 3)},
            "candidates": [x.to_json() for x in self.candidates],
            "recommended": ({"num_groups": self.recommended.num_groups, "sync_every": self.recommended.sync_every}
                            if self.recommended else None),
            "reason": self.reason,
            "planner_seconds": round(self.seconds, 2),
            "exchange": {"row_wise": self.model.row_wise_exchange, "sharding": self.model.sharding},
            "memory": {**(self.memory.to_json() if self.memory else {}),
                       "max_feasible_groups": self.max_feasible_groups},
        }


def recommend(candidates: Sequence[Candidate]) -> tuple[Candidate | None, str]:
    """Among feasible candidates within QPS_TOLERANCE of the best QPS: the smallest K, then the
    smallest M. Returns it and a sentence saying why."""
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        leanest = min(candidates, key=lambda c: c.peak_bytes)
        return None, (f"no group count fits: the leanest, M={leanest.num_groups}, needs "
                      f"{leanest.peak_bytes / GB:.1f} GB per GPU of {leanest.capacity_bytes / GB:.0f} GB; "
                      f"use more GPUs, a smaller batch or smaller tables")
    top = max(c.qps for c in feasible)
    chosen = min((c for c in feasible if c.qps >= (1 - QPS_TOLERANCE) * top),
                 key=lambda c: (c.sync_every, c.num_groups))
    return chosen, _reason(chosen, candidates, top)


def _reason(rec: Candidate, candidates: Sequence[Candidate], top: float) -> str:
    M, K = rec.num_groups, rec.sync_every
    parts = [f"M={M}, K={K}: {rec.qps / 1e6:.2f} M samples/s at {rec.peak_bytes / GB:.1f} GB per GPU"]
    base = next((c for c in candidates if c.num_groups == 1), None)
    if base is not None and M > 1:
        gain = [f"{rec.qps / base.qps:.2f}x the QPS of full model parallelism (M=1)"]
        if base.lookup_imbalance > rec.lookup_imbalance * 1.05:
            gain.append(f"lookup imbalance {base.lookup_imbalance:.2f} -> {rec.lookup_imbalance:.2f}")
        d_a2a = (base.lookup_a2a_s + base.lookup_s) - (rec.lookup_a2a_s + rec.lookup_s)
        if d_a2a > 0:
            gain.append(f"{d_a2a * 1e3:.1f} ms less lookup + all-to-all per step with sharding groups of "
                        f"L={rec.group_size}")
        parts.append("; ".join(gain))
    elif M == 1:
        parts.append("full model parallelism: no 2-D candidate beats it by more than "
                     f"{QPS_TOLERANCE:.0%}")
    larger = sorted({c.num_groups for c in candidates if c.num_groups > M})
    if larger:
        nxt = [c for c in candidates if c.num_groups == larger[0]]
        best_next = max(nxt, key=lambda c: (c.feasible, c.qps))
        if not best_next.feasible:
            parts.append(f"M={larger[0]} needs {best_next.peak_bytes / GB:.1f} GB per GPU "
                         f"(> {best_next.capacity_bytes / GB:.0f} GB)")
        elif best_next.qps <= rec.qps:
            parts.append(f"M={larger[0]} is slower ({best_next.qps / 1e6:.2f} M/s at best, replica sync "
                         f"{best_next.sync_per_sync_s * 1e3:.0f} ms per sync) and needs "
                         f"{best_next.peak_bytes / GB:.1f} GB per GPU")
        else:
            parts.append(f"M={larger[0]} is at most {best_next.qps / rec.qps - 1:.1%} faster "
                         f"({best_next.qps / 1e6:.2f} M/s), within the {QPS_TOLERANCE:.0%} tie band, for "
                         f"{larger[0] // M}x the copies and {best_next.peak_bytes / GB:.1f} GB per GPU")
    if M > 1:
        same_m = [c for c in candidates if c.num_groups == M and c.feasible]
        if K > min(c.sync_every for c in same_m):
            parts.append(f"K={K} is the smallest sync interval within {QPS_TOLERANCE:.0%} of the best QPS "
                         f"(a sync costs {rec.sync_per_sync_s * 1e3:.0f} ms); smaller K keeps replicas closer")
        else:
            parts.append(f"syncing every {K} step(s) costs {rec.sync_s * 1e3:.1f} ms per step")
    return "Recommend " + "; ".join(parts) + "."


def make_plan(model: ModelTables, cluster: Cluster, sync_every: Sequence[int] = DEFAULT_SYNC_EVERY,
              progress=None) -> Plan:
    """Every M dividing T (infeasible ones included) x every K, and the recommendation."""
    t0 = time.perf_counter()
    candidates: list[Candidate] = []
    for M in cluster.group_counts():
        t1 = time.perf_counter()
        for K in ((1,) if M == 1 else tuple(sync_every)):
            candidates.append(evaluate(model, cluster, M, K))
        if progress:
            progress(f"M={M:<4} L={cluster.gpus // M:<5} planned in {time.perf_counter() - t1:.1f}s")
    rec, reason = recommend(candidates)
    memory = memory_summary(model, cluster.gpus, cluster.cost.capacity,
                            dense_memory_bytes(model, cluster.batch_per_gpu))
    return Plan(model=model, cluster=cluster, candidates=candidates, recommended=rec, reason=reason,
                seconds=time.perf_counter() - t0, memory=memory)


# ---- presentation -------------------------------------------------------------------------------
def format_plan(plan: Plan) -> str:
    c = plan.cluster
    m = plan.model
    lines = [
        f"{m.name}: {describe(m)}, dense {m.dense_params / 1e6:.1f} M "
        f"params | T={c.gpus} GPUs, {c.gpus_per_node} per node, {c.cost.capacity / GB:.0f} GB each, "
        f"batch {c.batch_per_gpu} per GPU",
        "",
        f"{'M':>4} {'L':>5} {'K':>3} {'layout':<10} {'lookup':>7} {'a2a':>7} {'dense':>7} {'d-AR':>6} {'sync':>7} "
        f"{'step':>7} {'QPS':>9} {'imbal':>5} {'tables':>7} {'+repl':>6} {'optim':>6} {'activ':>6} {'dense':>6} "
        f"{'peak GB':>8}  fits",
        f"{'':>4} {'':>5} {'':>3} {'':<10} {'ms':>7} {'ms':>7} {'ms':>7} {'ms':>6} {'ms/step':>7} {'ms':>7} "
        f"{'M/s':>9} {'':>5} {'GB':>7} {'GB':>6} {'GB':>6} {'GB':>6} {'GB':>6}",
    ]
    for x in plan.candidates:
        mark = "*" if plan.recommended is x else " "
        fits = "yes" if x.feasible else "OOM"
        lines.append(
            f"{x.num_groups:>4} {x.group_size:>5} {x.sync_every:>3} {x.layout:<10} {x.lookup_s * 1e3:>7.2f} "
            f"{x.lookup_a2a_s * 1e3:>7.2f} {x.dense_s * 1e3:>7.2f} {x.dense_allreduce_s * 1e3:>6.2f} "
            f"{x.sync_s * 1e3:>7.2f} {x.step_s * 1e3:>7.2f} {x.qps / 1e6:>9.3f} {x.lookup_imbalance:>5.2f} "
            f"{x.tables_bytes / GB:>7.2f} {x.replica_overhead_bytes / GB:>6.2f} {x.optimizer_bytes / GB:>6.2f} "
            f"{x.activation_bytes / GB:>6.2f} {x.dense_bytes / GB:>6.2f} {x.peak_bytes / GB:>8.2f}  {fits}{mark}")
    lines += [
        "",
        "lookup, a2a: the slowest worker's embedding lookup and all-to-all inside its sharding group (TorchRec's "
        "estimators); d-AR: dense all-reduce over all T; sync: replica sync / K; memory: the fullest worker "
        "(+repl: S(M-1)/T of it is the replica overhead).",
    ]
    lines += exchange_lines(plan.candidates, m)
    if plan.memory is not None:
        lines += [""] + plan.memory.lines(c.gpus, c.cost.capacity)
        lines.append(f"largest group count among the priced candidates that fits: "
                     f"{'none' if not plan.max_feasible_groups else f'M={plan.max_feasible_groups}'}")
    lines += ["", plan.reason]
    return "\n".join(lines)


def exchange_lines(candidates: Sequence[Candidate], model: ModelTables) -> list[str]:
    """The row-wise output exchange per M (the first K of each), when some plan shards row-wise."""
    seen: dict[int, Candidate] = {}
    for x in candidates:
        if x.row_wise_dense_bytes > 0:
            seen.setdefault(x.num_groups, x)
    if not seen:
        return []
    how = exchange_label(model)
    cells = [f"M={m} (L={x.group_size}, {x.sharding.get('row_wise', 0)} tables): "
             f"{x.row_wise_dense_bytes / 1e6:.2f} MB dense -> {x.row_wise_bytes / 1e6:.2f} MB priced"
             for m, x in sorted(seen.items())]
    return ["", f"row-wise output exchange, {how}, MB a worker sends per step forward (as many back):"] + \
        [f"  {c}" for c in cells]


# ---- command line ------------------------------------------------------------------------------------
def parse_int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"{flag} must be a comma-separated list of positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise PlanError(f"{flag} must be a comma-separated list of positive integers, got {text!r}")
    return values


def gpu_cost(args: argparse.Namespace) -> GpuCost:
    if args.gpu not in PROFILES:
        raise PlanError(f"--gpu must be one of {sorted(PROFILES)}, got {args.gpu!r}")
    for flag in ("hbm_gb", "intra_node_gbps", "inter_node_gbps"):
        v = getattr(args, flag)
        if v is not None and not v > 0:
            raise PlanError(f"--{flag.replace('_', '-')} must be positive, got {v}")
    profile = PROFILES[args.gpu].with_overrides(args.hbm_gb, args.intra_node_gbps, args.inter_node_gbps)
    return GpuCost(profile, args.gpus_per_node)


def progress_printer(enabled: bool):
    if not enabled:
        return None
    return lambda msg: print(f"[plan] {msg}", file=sys.stderr, flush=True)


def run_cli(args: argparse.Namespace) -> int:
    try:
        model, _ = apply_args(resolve_model(args.spec, args.tables), args)
        ks = parse_int_list(args.sync_every, "--sync-every")
        cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node, batch_per_gpu=args.batch_per_gpu,
                          cost=gpu_cost(args))
        if not args.json:
            print(f"[plan] planning {len(model.tables)} tables for every M dividing T={cluster.gpus} "
                  f"with TorchRec's planner ...", file=sys.stderr, flush=True)
        plan = make_plan(model, cluster, ks, progress=progress_printer(not args.json))
    except (PlanError, TablesError, OptionsError) as e:
        print(f"recgrid plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json()) if args.json else format_plan(plan))
    return 0
