"""Enumerate: one sharding group's search space, TorchRec's `EmbeddingEnumerator` over the model's
tables with TorchRec's perf and storage estimators on the cost form's `Topology`, every table's
sharding options with per-shard lookup time, communication time and memory.

What recgrid adds to TorchRec's enumeration: options that cut a table into the same shards are
kept once (`distinct`); row-wise is offered only where TorchRec's planner would need it
(ROW_WISE, `row_wise_tables`); column-wise is also offered in narrower shards to the tables above
one worker's share (`narrow_column_widths`); SRP's sparse row-wise exchange is priced by occupancy
(`recscale.price_sparse_exchange`). Cached per sharding-group shape.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field, replace

from recgrid.config import OptimConfig
from recgrid.engine.optimizer import MomentScaledRowWiseAdagrad
from recgrid.engine.quiet import libraries_quiet
from recgrid.engine.sharding import grid_sharder
from recgrid.plan.constants import MIN_COLUMN_SHARD_BYTES
from recgrid.plan.recscale import price_sparse_exchange
from recgrid.plan.tables import BYTES_PER_WEIGHT, ModelTables, TableSpec

# Sharding types the planner considers for every table: table-wise, column-wise and
# table-row-wise (TorchRec's choice for large tables on multi-node groups).
PLAN_SHARDING_TYPES: tuple[str, ...] = ("table_wise", "column_wise", "table_row_wise")
# Row-wise is offered too where TorchRec's planner would need it (`row_wise_tables`): to a table
# larger than one GPU (weights and optimizer state above what the dense part leaves), and, in a
# sharding group with one member per node (a replica group spanning whole nodes), where
# table-row-wise splits nothing, to a table above one worker's share of the bytes or of the lookup
# work. Not to every table: its L shards per table make TorchRec's enumeration slow (15 s of CPU
# for 788 tables at L = 256, 0.5 s without it, and growing with L), and its reduce-scatter of
# B x L pooled rows per table and worker makes TorchRec's estimators prefer table-row-wise wherever
# that splits.
ROW_WISE = "row_wise"


def quiet_torchrec() -> contextlib.AbstractContextManager[None]:
    """TorchRec's planner logs tables and warnings at INFO/WARNING; recgrid prints its own."""
    return libraries_quiet(root=logging.ERROR)


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
    o = OptimConfig()  # the planner's sharder only needs a fused optimizer's kind, not its values
    return grid_sharder(MomentScaledRowWiseAdagrad(lr=o.lr, eps=o.eps, moment_scale=1.0).fused_params())


@dataclass
class SearchSpace:
    """TorchRec's enumeration of one sharding group: every table's options with per-shard perf
    and storage, and the topology left after the dense part's reservation. Cached per L."""

    options: dict[str, list]  # table name -> its sharding options, leanest critical path first
    reserved: object  # Topology
    hopeless: bool  # even the leanest option of every table, spread perfectly, does not fit
    seconds: float
    # placements already made, by proposal (its options' ids) and memory cap: K candidates of one
    # M rate the same placements differently, so each proposal is partitioned once
    placements: dict = field(default_factory=dict)


_SPACE_CACHE: dict[tuple, SearchSpace] = {}
MAX_CACHED_SHAPES = 32


def clear_cache() -> None:
    _SPACE_CACHE.clear()


def search_space(model: ModelTables, L: int, per_node: int, batch: int, cost, reserve_bytes: float,
                 sharding_types: tuple[str, ...]) -> SearchSpace:
    key = (model, L, per_node, batch, cost.key, int(reserve_bytes), sharding_types)
    if key in _SPACE_CACHE:
        return _SPACE_CACHE[key]
    if len(_SPACE_CACHE) >= MAX_CACHED_SHAPES:  # each holds every table's options: bound the memory
        _SPACE_CACHE.clear()
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.storage_reservations import FixedAbsoluteStorageReservation
    from torchrec.distributed.planner.types import ParameterConstraints

    t0 = time.perf_counter()
    ebc, sharder = _meta_module(model), _sharder()
    row_wise = set() if ROW_WISE in sharding_types else row_wise_tables(model, L, per_node,
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
        for width, names in narrow_column_widths(model, L).items():
            _add_options(options, model, names, width, topology, batch, sharder)
    price_sparse_exchange(model, options)  # SRP: a row-wise option's output exchange by its occupancy
    for name, opts in options.items():
        options[name] = distinct(opts)
    reserved = FixedAbsoluteStorageReservation(int(min(reserve_bytes, cost.capacity))).reserve(
        topology, batch, ebc, [sharder], constraints)
    budget = capacity(reserved.devices[0].storage, cost)
    leanest = sum(min(sum(capacity(sh.storage, cost) for sh in so.shards) for so in opts)
                  for opts in options.values())
    space = SearchSpace(options, reserved, leanest / L > budget, time.perf_counter() - t0)
    _SPACE_CACHE[key] = space
    return space



def row_wise_tables(model: ModelTables, L: int, per_node: int, one_gpu: float) -> set[str]:
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


def narrow_column_widths(model: ModelTables, L: int) -> dict[int, list[str]]:
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


def capacity(storage, cost) -> float:
    return storage.hbm if cost.compute_device == "cuda" else storage.ddr


def distinct(opts: list) -> list:
    """A table's options, leanest critical path first, without options that cut the table into the
    same shards as a leaner one (column-wise into one column shard and table-row-wise over one
    worker per node are table-wise): the proposers and the descent then never spend a trial on them."""
    seen: set = set()
    out = []
    # ties broken by name, not by TorchRec's enumeration order, which follows the string hash seed
    for so in sorted(opts, key=lambda so: (depth(so), so.sharding_type, so.compute_kernel, len(so.shards))):
        cut = tuple((tuple(sh.size), tuple(sh.offset)) for sh in so.shards)
        if cut not in seen:
            seen.add(cut)
            out.append(so)
    return out


def depth(so) -> float:
    """TorchRec's GreedyProposer score with use_depth: the slowest shard's estimated time."""
    return max(sh.perf.total for sh in so.shards)


