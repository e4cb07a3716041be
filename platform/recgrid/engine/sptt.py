"""The tower engine of Disaggregated Multi-Tower: recgrid's own sharded embedding module with the
semantic-preserving tower transform (SPTT) and tower modules.

One training step's sparse side, on shard rank s = (tower t, index k) of a sharding group of L
workers in N towers of L_t (engine.towers):
1. input distribution: the ids of every sample of the sharding group go, in one all-to-all, to
   the workers that hold their tables (all tower workers for column-wise shards, the row block's
   owner for row-wise ones); the fused FBGEMM kernel looks them up for all L workers' samples;
2. peer permute: the looked-up rows, grouped by the worker that owns the samples, are put in
   peer order (by (index in tower, tower)), so the rows destined for each peer group are
   contiguous;
3. intra-tower all-to-all (world size L_t): column shards go to the tower worker of the peer
   group that owns the samples (row-wise partial sums: a reduce-scatter); afterwards worker k
   holds its tower's full embeddings for the samples of its peers (the k-th workers of all towers);
4. local shuffle: the pieces, received as (tower worker, column shard), are laid out per sample
   as (features, dim), samples peer by peer;
5. the tower module (optional) compresses each sample's tower embeddings;
6. cross-tower peer all-to-all (world size N): each peer gets its samples' tower embeddings.
The result is every sample's embeddings on the worker that owns it, in the flat model's feature
order (pass-through), so outputs, losses and gradients are the flat exchange's; autograd runs
the same collectives backwards and the fused kernel applies the optimizer in backward. As in
TorchRec, the embedding gradients are divided by the sharding group's size L on the way back.

The flat exchange of the same shards (one all-to-all over the sharding group) is kept as the
reference. The model built here (`shard_tower_model`) is TorchRec's DLRM/DLRM-DCN with this
module as its sparse arch, its dense part data-parallel over all T workers (DDP); each tower
module's gradients are summed over the workers that run it (the tower, in every sharding group)
and divided by T, the gradient DDP would give a dense parameter.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torchrec.models.dlrm import SparseArch

from recgrid.data.specs import NUM_DENSE, SPARSE_NAMES, DatasetSpec
from recgrid.engine.exchange import ExchangeMeter
from recgrid.engine.grid import Grid, GridGroups
from recgrid.engine.model import build_model
from recgrid.engine.towers import LocalShard, TowerConfig, TowerError, TowerLayout, shards_by_rank

# ---- collectives with autograd -----------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, in_splits: list[int], out_splits: list[int],
                pg: "dist.ProcessGroup | None") -> torch.Tensor:
    """All-to-all of the flattened `x` (splits in elements), differentiable; world size 1: x."""
    flat = x.reshape(-1)
    if pg is None:
        return flat
    out = flat.new_empty(sum(out_splits))
    return dist_nn.all_to_all_single(out, flat.contiguous(), out_splits, in_splits, group=pg)


class _ReduceScatter(torch.autograd.Function):
    """Sum equal chunks over the group, each worker keeping its own; backward: all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pg: "dist.ProcessGroup", world: int) -> torch.Tensor:  # type: ignore[override]
        ctx.pg, ctx.world = pg, world
        out = x.new_empty(x.numel() // world)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=pg)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        full = grad.new_empty(grad.numel() * ctx.world)
        dist.all_gather_into_tensor(full, grad.contiguous(), group=ctx.pg)
        return full, None, None


def _reduce_scatter(x: torch.Tensor, rows: list[int], width: int, me: int,
                    pg: "dist.ProcessGroup | None") -> torch.Tensor:
    """x: [Σ rows, width], row blocks for each group member in order; returns the sum over the
    members of block `me`, [rows[me], width]. Unequal blocks: an all-to-all and a local sum."""
    if pg is None:
        return x
    world = len(rows)
    if len(set(rows)) == 1:
        return _ReduceScatter.apply(x.reshape(-1), pg, world).view(rows[me], width)
    recv = _all_to_all(x, [r * width for r in rows], [rows[me] * width] * world, pg)
    return recv.view(world, rows[me], width).sum(0)


# ---- tower modules -------------------------------------------------------------------------------------
class DLRMTowerModule(nn.Module):
    """The paper's Listing 1 for DLRM: from a tower's F_t embeddings of dim D, p new embeddings from
    a linear over the flattened tower embeddings, and c from a projection along the feature axis
    (each a linear combination of the tower's embeddings). Output [rows, p + c, D]."""

    def __init__(self, num_features: int, dim: int, outputs: int) -> None:
        super().__init__()
        self.dim = dim
        self.c = outputs // 2
        self.p = outputs - self.c
        self.linear = nn.Linear(num_features * dim, self.p * dim)
        self.project = nn.Linear(num_features, self.c, bias=False) if self.c else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = [self.linear(x.flatten(1)).view(x.size(0), self.p, self.dim)]
        if self.project is not None:
            out.append(self.project(x.transpose(1, 2)).transpose(1, 2))
        return torch.cat(out, dim=1)


class DCNTowerModule(nn.Module):
    """For DLRM-DCN: a smaller low-rank CrossNet over the flattened tower embeddings (one layer,
    half the model's rank), then a linear to `outputs` embeddings of dim D."""

    def __init__(self, num_features: int, dim: int, outputs: int, low_rank: int) -> None:
        super().__init__()
        from torchrec.modules.crossnet import LowRankCrossNet

        self.dim, self.outputs = dim, outputs
        self.cross = LowRankCrossNet(in_features=num_features * dim, num_layers=1, low_rank=max(1, low_rank))
        self.linear = nn.Linear(num_features * dim, outputs * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.cross(x.flatten(1))).view(x.size(0), self.outputs, self.dim)


def tower_module(towers: TowerConfig, tower: int, dim: int, dcn_low_rank_dim: int, seed: int) -> nn.Module | None:
    """Tower `tower`'s module, initialised from (seed, tower): the same on every worker running it."""
    if towers.module == "none":
        return None
    n_in, n_out = len(towers.partition[tower]), towers.outputs()[tower]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + 7919 * (tower + 1))
        if towers.module == "dlrm":
            return DLRMTowerModule(n_in, dim, n_out)
        return DCNTowerModule(n_in, dim, n_out, dcn_low_rank_dim // 2)


class _TowerGradSync:
    """Sums a tower module's gradients over the workers that run it and divides by T, once per
    backward (queued when the module's output gets its gradient, run when backward ends)."""

    def __init__(self, module: nn.Module, pg: "dist.ProcessGroup | None", world_size: int) -> None:
        self.module, self.pg, self.world_size = module, pg, world_size
        self.queued = False

    def arm(self, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)
        return grad

    def _reduce(self) -> None:
        self.queued = False
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        if self.pg is not None:
            dist.all_reduce(flat, group=self.pg)
        flat.div_(self.world_size)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


# ---- process groups ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TowerGroups:
    """One worker's tower process groups (None where the group is this worker alone) and the
    global ranks of each, in group-rank order."""

    intra: "dist.ProcessGroup | None"
    intra_ranks: list[int]
    peers: "dist.ProcessGroup | None"
    peer_ranks: list[int]
    module: "dist.ProcessGroup | None"
    module_ranks: list[int]


def build_tower_groups(layout: TowerLayout, groups: GridGroups) -> TowerGroups:
    """Create this worker's tower groups. Only members take part in creating a group
    (`use_local_synchronization`), so workers an elastic attempt sidelines need not join; every
    worker walks the groups in the same order."""
    rank = groups.coords.rank
    sharding_ranks = dist.get_process_group_ranks(groups.sharding_pg)
    made: dict[tuple[int, ...], "dist.ProcessGroup | None"] = {tuple(sharding_ranks): groups.sharding_pg}
    for ranks in layout.intra_tower_groups() + layout.peer_groups() + layout.module_groups():
        key = tuple(sorted(ranks))
        if key in made or rank not in key:
            continue
        made[key] = dist.new_group(list(key), use_local_synchronization=True) if len(key) > 1 else None

    def mine(lists: list[list[int]]) -> tuple["dist.ProcessGroup | None", list[int]]:
        (ranks,) = [r for r in lists if rank in r]
        if ranks != sorted(ranks):  # collectives index members by ascending global rank
            raise TowerError(f"tower group {ranks} is not in ascending rank order")
        return (None if len(ranks) == 1 else made[tuple(ranks)]), ranks

    intra, intra_ranks = mine(layout.intra_tower_groups())
    peers, peer_ranks = mine(layout.peer_groups())
    module, module_ranks = mine(layout.module_groups())
    return TowerGroups(intra, intra_ranks, peers, peer_ranks, module, module_ranks)


# ---- the kernel --------------------------------------------------------------------------------------
def init_shard(seed: int, feature: int, table_rows: int, dim: int, shard: LocalShard,
               block_rows: int = 1 << 16) -> torch.Tensor:
    """The initial values of one shard: TorchRec's default init (uniform ±sqrt(1/rows)) drawn per
    block of rows from a generator seeded by (seed, feature, block), so any shard of a table gets
    its slice of the same full table without materialising it."""
    bound = math.sqrt(1.0 / table_rows)
    out = torch.empty(shard.rows, shard.cols)
    lo, hi = shard.row_offset, shard.row_offset + shard.rows
    for b0 in range(lo - lo % block_rows, hi, block_rows):
        n = min(block_rows, table_rows - b0)
        g = torch.Generator().manual_seed((seed * 1_000_003 + (feature + 1) * 65_537 + b0 // block_rows) % (1 << 62))
        block = torch.rand(n, dim, generator=g) * (2 * bound) - bound
        a, b = max(lo, b0), min(hi, b0 + n)
        out[a - lo:b - lo] = block[a - b0:b - b0, shard.col_offset:shard.col_offset + shard.cols]
    return out


def _kernel(shards: list[LocalShard], spec: DatasetSpec, dim: int, fused_params: dict, device: torch.device,
            seed: int) -> nn.Module:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen,
    )

    location, compute = ((EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if device.type == "cuda"
                         else (EmbeddingLocation.HOST, ComputeDevice.CPU))
    kernel = SplitTableBatchedEmbeddingBagsCodegen(
        [(s.rows, s.cols, location, compute) for s in shards], pooling_mode=PoolingMode.SUM, device=device,
        table_names=[f"{spec.table_name(SPARSE_NAMES[s.feature])}@{s.row_offset},{s.col_offset}" for s in shards],
        **fused_params)
    with torch.no_grad():
        for w, s in zip(kernel.split_embedding_weights(), shards):
            w.copy_(init_shard(seed, s.feature, spec.table_rows[s.feature], dim, s))
    return kernel


# ---- the sharded module ---------------------------------------------------------------------------------
class TowerSparseArch(SparseArch):
    """DLRM's sparse arch for towers: ids in, every local sample's embeddings out, [B, F', D]
    (F' = F with pass-through towers, in the flat model's feature order; else Σ tower outputs,
    tower by tower). The fused kernel sits in `_lookups`, not a registered child, as in TorchRec's
    sharded modules (it never reaches DDP or the dense optimizer; the replica sync finds it there)."""

    def __init__(self, spec: DatasetSpec, dim: int, towers: TowerConfig, layout: TowerLayout, grid: Grid,
                 groups: GridGroups, tower_groups: TowerGroups, shards: list[list[LocalShard]], kernel: nn.Module,
                 module: nn.Module | None, meter: ExchangeMeter, device: torch.device) -> None:
        nn.Module.__init__(self)  # SparseArch's own init wants an EmbeddingBagCollection
        self._lookups = [kernel]
        self.tower_module = module
        self.towers, self.layout, self.meter = towers, layout, meter
        self.sharding_pg, self.tg = groups.sharding_pg, tower_groups
        self.sharding_ranks = dist.get_process_group_ranks(groups.sharding_pg)
        self.me = groups.coords.shard_rank
        self.tower, self.index = layout.tower_of(self.me), layout.index_in_tower(self.me)
        self.shards, self.D = shards, dim
        L, N = grid.group_size, towers.num_towers
        self.cw_width = [sum(s.cols for s in shards[r] if not s.row_wise) for r in range(L)]
        self.rw_width = [sum(s.cols for s in shards[r] if s.row_wise) for r in range(L)]
        # per tower: its features as the local shuffle lays them out (column-wise, then row-wise)
        firsts = [shards[layout.tower_shard_ranks(t)[0]] for t in range(N)]
        self.n_cw = [sum(not s.row_wise for s in f) for f in firsts]
        self.n_rw = [sum(s.row_wise for s in f) for f in firsts]
        tower_order = [s.feature for f in firsts for s in f]
        self.outputs = list(towers.outputs())
        self.grad_sync = (_TowerGradSync(module, tower_groups.module, grid.world_size)
                          if module is not None else None)
        if towers.module == "none":
            # a plain tensor, not a buffer: nothing for DDP to broadcast
            self.to_flat_order = torch.tensor([tower_order.index(f) for f in range(len(SPARSE_NAMES))], device=device)
            self._sparse_feature_names = list(SPARSE_NAMES)
        else:
            self.to_flat_order = None
            self._sparse_feature_names = [f"tower{t}_{j}" for t in range(N) for j in range(self.outputs[t])]
        self.F = len(self._sparse_feature_names)
        self.peer_order = layout.peer_order()
        from torchrec.distributed.comm_ops import get_gradient_division

        self.grad_division = grid.group_size if get_gradient_division() else 1

    def _divide_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / self.grad_division

    @property
    def kernel(self) -> nn.Module:
        return self._lookups[0]

    def forward(self, features) -> torch.Tensor:  # type: ignore[override]
        self.meter.begin_step(self.training and torch.is_grad_enabled())
        indices, offsets, batch = self._distribute_ids(features)
        emb = self.kernel(indices, offsets)  # [Σ batch, this worker's columns]
        if emb.requires_grad and self.grad_division > 1:
            # TorchRec's convention (comm_ops' gradient division): the pooled-embedding
            # all-to-all's backward divides by the sharding group's size
            emb.register_hook(self._divide_grad)
        if self.towers.exchange == "flat":
            out = self._flat_exchange(emb, batch)
        else:
            out = self._tower_exchange(emb, batch)
        return out if self.to_flat_order is None else out.index_select(1, self.to_flat_order)

    # -- 1. input distribution ------------------------------------------------------------------------
    def _distribute_ids(self, kjt) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """All-to-all of ids to the shards' owners; returns the kernel's indices and offsets
        (table-major, samples in shard-rank order) and the batch size of every shard rank."""
        F, B = len(SPARSE_NAMES), kjt.stride()
        if list(kjt.keys()) != list(SPARSE_NAMES):
            kjt = kjt.permute([kjt.keys().index(f) for f in SPARSE_NAMES])
        lengths = kjt.lengths().long().view(F, B)
        values = kjt.values().long()
        offs = [0, *torch.cumsum(lengths.sum(1), 0).tolist()]
        bags: dict[int, torch.Tensor] = {}
        payloads, header = [], []
        for shards in self.shards:
            lens, vals = [], []
            for s in shards:
                seg, ln = values[offs[s.feature]:offs[s.feature + 1]], lengths[s.feature]
                if s.row_wise:
                    if s.feature not in bags:
                        bags[s.feature] = torch.repeat_interleave(torch.arange(B, device=seg.device), ln)
                    keep = (seg >= s.row_offset) & (seg < s.row_offset + s.rows)
                    seg, ln = seg[keep] - s.row_offset, torch.bincount(bags[s.feature][keep], minlength=B)
                lens.append(ln)
                vals.append(seg)
            payload = torch.cat(lens + vals) if lens else values.new_empty(0)
            payloads.append(payload)
            header.append([B, payload.numel()])
        L = len(self.shards)
        head = torch.tensor(header, dtype=torch.long, device=values.device)
        recv_head = torch.empty_like(head)
        dist.all_to_all_single(recv_head, head, group=self.sharding_pg)
        batch = recv_head[:, 0].tolist()
        in_splits, out_splits = [p.numel() for p in payloads], recv_head[:, 1].tolist()
        recv = values.new_empty(sum(out_splits))
        dist.all_to_all_single(recv, torch.cat(payloads), out_splits, in_splits, group=self.sharding_pg)

        # from [source][table][sample] (lengths, then values) to the kernel's [table][source][sample]
        n_tab = len(self.shards[self.me])
        starts = [0, *torch.cumsum(torch.tensor(out_splits), 0).tolist()]
        len_blocks, seg_start, seg_len = [], [], []
        for src in range(L):
            ln = recv[starts[src]:starts[src] + n_tab * batch[src]].view(n_tab, batch[src])
            len_blocks.append(ln)
            per_table = ln.sum(1)
            first_value = starts[src] + n_tab * batch[src]
            seg_start.append(first_value + torch.cumsum(per_table, 0) - per_table)
            seg_len.append(per_table)
        lengths_all = torch.cat(len_blocks, dim=1)  # [n_tab, Σ batch]
        seg_start_t = torch.stack(seg_start, 1).reshape(-1)  # (table, source) order
        seg_len_t = torch.stack(seg_len, 1).reshape(-1)
        total = int(seg_len_t.sum())
        base = seg_start_t - (torch.cumsum(seg_len_t, 0) - seg_len_t)
        index = torch.repeat_interleave(base, seg_len_t, output_size=total) + torch.arange(total, device=recv.device)
        indices = recv[index]
        offsets = torch.cat([lengths_all.new_zeros(1), torch.cumsum(lengths_all.reshape(-1), 0)])
        return indices, offsets, batch

    # -- the flat exchange (reference) ---------------------------------------------------------------------
    def _flat_exchange(self, emb: torch.Tensor, batch: list[int]) -> torch.Tensor:
        L, W, B = len(batch), emb.size(1), batch[self.me]
        width = [self.cw_width[r] + self.rw_width[r] for r in range(L)]
        self.meter.record("flat", self.sharding_ranks, [b * W * emb.element_size() for b in batch])
        in_splits, out_splits = [b * W for b in batch], [B * w for w in width]
        pieces = _all_to_all(emb, in_splits, out_splits, self.sharding_pg).split(out_splits)
        blocks = []
        for t in range(self.towers.num_towers):
            members = self.layout.tower_shard_ranks(t)
            parts = []
            if self.n_cw[t]:
                parts.append(torch.cat([pieces[r].view(B, -1)[:, :self.cw_width[r]].reshape(B, self.n_cw[t], -1)
                                        for r in members], dim=2))
            if self.n_rw[t]:
                rw = [pieces[r].view(B, -1)[:, self.cw_width[r]:].reshape(B, self.n_rw[t], self.D) for r in members]
                parts.append(functools.reduce(torch.add, rw))
            blocks.append(torch.cat(parts, dim=1))
        return torch.cat(blocks, dim=1)

    # -- SPTT ------------------------------------------------------------------------------------------
    def _tower_exchange(self, emb: torch.Tensor, batch: list[int]) -> torch.Tensor:
        layout, t, k, D = self.layout, self.tower, self.index, self.D
        Lt, B, elsize = layout.tower_size, batch[self.me], emb.element_size()
        group_rows = [sum(batch[s] for s in layout.peer_shard_ranks(j)) for j in range(Lt)]
        members = layout.tower_shard_ranks(t)

        # 2. peer permute: source blocks in peer order, so each peer group's rows are contiguous
        if self.peer_order != sorted(self.peer_order):
            start = [0, *torch.cumsum(torch.tensor(batch), 0).tolist()]
            emb = torch.cat([emb[start[s]:start[s] + batch[s]] for s in self.peer_order])

        # 3. intra-tower all-to-all (column shards) and reduce-scatter (row-wise partial sums)
        parts = []
        cw, rw = self.cw_width[self.me], self.rw_width[self.me]
        if self.n_cw[t]:
            self.meter.record("intra_tower", self.tg.intra_ranks, [r * cw * elsize for r in group_rows])
            out_splits = [group_rows[k] * self.cw_width[r] for r in members]
            recv = _all_to_all(emb[:, :cw], [r * cw for r in group_rows], out_splits, self.tg.intra)
            # 4. local shuffle: (tower worker, rows, features, columns) -> (rows, features, dim)
            parts.append(torch.cat([p.view(group_rows[k], self.n_cw[t], -1) for p in recv.split(out_splits)], dim=2))
        if self.n_rw[t]:
            self.meter.record("intra_tower", self.tg.intra_ranks, [r * rw * elsize for r in group_rows])
            summed = _reduce_scatter(emb[:, cw:], group_rows, rw, k, self.tg.intra)
            parts.append(summed.view(group_rows[k], self.n_rw[t], D))
        x = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [rows of my peers, F_t, D], peer by peer

        # 5. the tower module
        if self.tower_module is not None:
            x = self.tower_module(x)
            if self.training and self.grad_sync is not None:
                self.grad_sync.arm(x)

        # 6. cross-tower peer all-to-all: each peer gets its own samples' tower embeddings
        peer_batch = [batch[s] for s in layout.peer_shard_ranks(k)]
        row = self.outputs[t] * D
        self.meter.record("cross_tower", self.tg.peer_ranks, [b * row * elsize for b in peer_batch])
        out_splits = [B * o * D for o in self.outputs]
        recv = _all_to_all(x, [b * row for b in peer_batch], out_splits, self.tg.peers)
        return torch.cat([p.view(B, o, D) for p, o in zip(recv.split(out_splits), self.outputs)], dim=1)


def tower_shards(model: nn.Module) -> dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]]:
    """This worker's shards of a tower model, by (table, row offset, column offset): the kernel's
    weight and row-wise AdaGrad momentum views."""
    arch = next(m for m in model.modules() if isinstance(m, TowerSparseArch))
    kernel = arch.kernel
    states = kernel.get_optimizer_state()
    out = {}
    for s, w, st in zip(arch.shards[arch.me], kernel.split_embedding_weights(), states):
        out[(f"t_{SPARSE_NAMES[s.feature]}", s.row_offset, s.col_offset)] = (w, st["sum"])
    return out


# ---- the model -----------------------------------------------------------------------------------------
def _dense_model(spec: DatasetSpec, model, feature_names: Sequence[str], seed: int, device: torch.device):
    """A DLRMTrain whose sparse arch is a placeholder of len(feature_names) features of the model's
    dim (on the meta device): the dense part initialised exactly as `build_model` does it."""
    if list(feature_names) == list(SPARSE_NAMES):
        return build_model(spec, model, seed=seed, dense_device=device)
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain

    dim = model.resolved_dim(spec)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=1,
                                                            feature_names=[n]) for n in feature_names],
                                 device=torch.device("meta"))
    torch.manual_seed(seed)
    common = dict(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                  dense_arch_layer_sizes=list(model.resolved_dense_arch(spec)),
                  over_arch_layer_sizes=list(model.over_arch), dense_device=device)
    if model.arch == "dlrm":
        return DLRMTrain(DLRM(**common))
    return DLRMTrain(DLRM_DCN(**common, dcn_num_layers=model.dcn_num_layers, dcn_low_rank_dim=model.dcn_low_rank_dim))


def shard_tower_model(spec: DatasetSpec, model, towers: TowerConfig, grid: Grid, groups: GridGroups,
                      device: torch.device, fused_params: dict, plan, seed: int) -> nn.Module:
    """The DMT model of this worker: DLRMTrain with a `TowerSparseArch` (this worker's shards of
    `plan`, its tower module), wrapped in DDP over all T workers for the dense part (the tower
    module is left out of DDP: `_TowerGradSync` syncs it inside its tower)."""
    from torch.nn.parallel import DistributedDataParallel

    layout = TowerLayout(grid, towers.num_towers)
    if towers.exchange == "flat" and towers.module != "none":
        raise TowerError("the flat exchange is the pass-through reference; tower modules need exchange 'sptt'")
    dim = model.resolved_dim(spec)
    tower_groups = build_tower_groups(layout, groups)
    shards = shards_by_rank(plan, spec, grid.group_size)
    me = groups.coords.shard_rank
    kernel = _kernel(shards[me], spec, dim, fused_params, device, seed)
    module = tower_module(towers, layout.tower_of(me), dim, model.dcn_low_rank_dim, seed)
    if module is not None:
        module = module.to(device)
    names = (list(SPARSE_NAMES) if towers.module == "none" else
             [f"tower{t}_{j}" for t, n in enumerate(towers.outputs()) for j in range(n)])
    net = _dense_model(spec, model, names, seed, device)
    meter = ExchangeMeter(groups.coords.rank, grid.node_of)
    net.model.sparse_arch = TowerSparseArch(spec, dim, towers, layout, grid, groups, tower_groups, shards, kernel,
                                            module, meter, device)
    ignore = [f"model.sparse_arch.tower_module.{n}" for n, _ in (module.named_parameters() if module else [])]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ignore)
    return DistributedDataParallel(net, process_group=groups.global_pg, device_ids=None, broadcast_buffers=False,
                                   gradient_as_bucket_view=True, static_graph=True)
