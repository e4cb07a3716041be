"""The exchange meter: the bytes each worker sends in the embedding exchange, per kind of
all-to-all and by host, and each all-to-all's world size, for the flat exchange of TorchRec's
sharded modules (hooks on their output dists), SRP's (engine.srp) and the tower engine's
(engine.sptt)."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist
from torchrec.models.dlrm import SparseArch

from recgrid.engine.device import collective_device
from recgrid.engine.grid import Grid
from recgrid.engine.srp import is_sparse_dist

# The all-to-alls of the embedding exchange, as the metrics name them, and the parts of them
# metered on their own as well ("row_wise": the row-wise shards' output exchange inside "flat",
# TorchRec's reduce-scatter or SRP's sparse all-to-all; engine.srp).
EXCHANGE_KINDS: tuple[str, ...] = ("flat", "intra_tower", "cross_tower")
EXCHANGE_PARTS: tuple[str, ...] = ("row_wise",)


class ExchangeMeter:
    """Bytes this worker sends to other workers in the embedding exchange (the forward all-to-alls
    that return looked-up embeddings; the id distribution before the lookup is not counted), per
    kind of all-to-all and by whether the receiver is on another host, and each all-to-all's
    world size. Training steps only; `metrics` reduces over the workers and starts a new interval."""

    def __init__(self, rank: int, node_of: Callable[[int], int]) -> None:
        self.rank, self.node_of = rank, node_of
        self.counting = False
        self._reset()
        self.world: dict[str, int] = {}
        self.cross_host_world = 0

    def _reset(self) -> None:
        self.steps = 0
        self.bytes: dict[str, float] = dict.fromkeys(EXCHANGE_KINDS + EXCHANGE_PARTS, 0.0)
        self.cross_host = 0.0
        self.intra_host = 0.0

    def begin_step(self, training: bool) -> None:
        self.counting = training
        if training:
            self.steps += 1

    def record(self, kind: str, ranks: Sequence[int], bytes_to: Sequence[int], part: str | None = None) -> None:
        """One all-to-all over the workers `ranks` (global), sending `bytes_to[i]` to `ranks[i]`;
        `part` (one of `EXCHANGE_PARTS`): the bytes also count there (not twice in the host totals)."""
        if not self.counting:
            return
        for k in (kind, part) if part is not None else (kind,):
            self.world[k] = max(self.world.get(k, 0), len(ranks))
            self.bytes[k] += sum(b for r, b in zip(ranks, bytes_to) if r != self.rank)
        me = self.node_of(self.rank)
        for r, b in zip(ranks, bytes_to):
            if r == self.rank or not b:
                continue
            if self.node_of(r) != me:
                self.cross_host += b
                self.cross_host_world = max(self.cross_host_world, len(ranks))
            else:
                self.intra_host += b

    def metrics(self, group: "dist.ProcessGroup | None", device: torch.device | None = None) -> dict[str, float]:
        """The interval's figures over all workers of `group` (a collective; every worker calls
        it): bytes per step per worker (mean over workers) and world sizes (max)."""
        kinds = EXCHANGE_KINDS + EXCHANGE_PARTS
        n = len(kinds)
        per_step = 1.0 / self.steps if self.steps else 0.0
        sums = torch.tensor([self.bytes[k] * per_step for k in kinds]
                            + [self.cross_host * per_step, self.intra_host * per_step, 1.0], dtype=torch.float64)
        maxes = torch.tensor([float(self.world.get(k, 0)) for k in kinds] + [float(self.cross_host_world)],
                             dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dev = collective_device(group, device or torch.device("cpu"))
            sums, maxes = sums.to(dev), maxes.to(dev)
            works = [dist.all_reduce(sums, group=group, async_op=True),
                     dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group, async_op=True)]
            for w in works:
                w.wait()
            sums, maxes = sums.cpu(), maxes.cpu()
        self._reset()
        workers = float(sums[-1])
        out: dict[str, float] = {}
        for i, k in enumerate(kinds):
            if maxes[i] > 0:
                out[f"exchange/world_size/{k}"] = float(maxes[i])
                out[f"exchange/bytes/{k}"] = float(sums[i]) / workers
        if out:
            out["exchange/bytes/cross_host"] = float(sums[n]) / workers
            out["exchange/bytes/intra_host"] = float(sums[n + 1]) / workers
            out["exchange/world_size/cross_host"] = float(maxes[n])
        return out


def exchange_meter(model: nn.Module, grid: Grid, rank: int) -> ExchangeMeter:
    """The meter of `model`'s embedding exchange: a tower model's own (engine.sptt: its sparse
    arch holds it as `meter`), or one fed by hooks on the pooled-embedding all-to-alls of
    TorchRec's sharded modules (table-, column- and row-wise shards, row-wise ones also as the
    part "row_wise"; SRP's dists record what they send themselves; table-row-wise and grid
    shards exchange in two levels and are not counted)."""
    for m in model.modules():
        if isinstance(m, SparseArch) and isinstance(getattr(m, "meter", None), ExchangeMeter):
            return m.meter
    meter = ExchangeMeter(rank, grid.node_of)
    for m in model.modules():
        dists = getattr(m, "_output_dists", None)
        if not dists:
            continue
        m.register_forward_pre_hook(lambda mod, args: meter.begin_step(mod.training and torch.is_grad_enabled()))
        for d in dists:
            if is_sparse_dist(d):
                d.meter = meter
            elif isinstance(d, (TwPooledEmbeddingDist, RwPooledEmbeddingDist)) and getattr(d, "_pg", None) is not None:
                ranks = dist.get_process_group_ranks(d._pg)
                part = "row_wise" if isinstance(d, RwPooledEmbeddingDist) else None
                d.register_forward_pre_hook(functools.partial(_meter_torchrec, meter, ranks, part))
    return meter


def _meter_torchrec(meter: ExchangeMeter, ranks: list[int], part: str | None, module: nn.Module, args: tuple) -> None:
    embs = args[0]
    if not torch.is_tensor(embs):
        return
    ctx = args[1] if len(args) > 1 else None
    per_rank = list(getattr(ctx, "batch_size_per_rank", None) or []) or [embs.size(0) // len(ranks)] * len(ranks)
    row = embs.size(1) * embs.element_size()
    meter.record("flat", ranks, [b * row for b in per_rank], part=part)
