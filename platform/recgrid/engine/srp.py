"""Sparse Row-wise Parallelism (SRP): row-wise shards send only the pooled partial sums that are
not empty.

With `model.row_wise_exchange: sparse`, shard s sends peer r only the partial sums of r's bags
that have at least one id on s, in one variable-size `all_to_all_single`, instead of TorchRec's
dense reduce-scatter of `[W·B, D]` (W = L workers). Both sides know the split sizes without
exchanging them: the owner from the lengths it received in the ids' all-to-all, the receiver
from the bucketized lengths it sent. The receiver scatter-adds in a ring reduce-scatter's order
(gloo's), and the backward divides the gradient by W as TorchRec's does, so the fused kernel and
its row-wise AdaGrad see the dense path's numbers. Design: docs/design-notes.md, "Sparse Row-wise
Parallelism".

This module owns the exchange (`SparseRowWiseDist`, a subclass of TorchRec's
`RwPooledEmbeddingDist`), its hook into TorchRec's `ShardedEmbeddingBagCollection`
(`install_srp`: the row-wise output dists replaced, the receiver's mask read off the ids'
all-to-all and carried on each batch's sharding context, the owner's mask read by a pre-hook on
the sharding's lookup), the sharding types it covers (`SPARSE_SHARDINGS`: row-wise only;
table-row-wise and grid shards send their reduce-scatter to a host-local relay, which never sees
the owners' bucketized ids) and the planner's price of it (`expected_occupancy`,
`expected_exchange_bytes`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # torch is heavy; config validation imports ROW_WISE_EXCHANGES from here
    import torch
    import torch.distributed as dist

# model.row_wise_exchange: "dense" = TorchRec's reduce-scatter, "sparse" = SRP. config.py reads
# its choices from here.
ROW_WISE_EXCHANGES: tuple[str, ...] = ("dense", "sparse")
# The model.sharding values whose tables SRP exchanges sparsely (all of them row-wise).
SPARSE_SHARDINGS: tuple[str, ...] = ("row_wise",)


class SrpError(RuntimeError):
    """SRP cannot exchange this batch (a TorchRec path it does not cover)."""


# ---- pricing -------------------------------------------------------------------------------------
def expected_occupancy(ids_per_bag: float, shards: int) -> float:
    """The expected fraction of a bag's W row-wise shards that hold at least one of its ids, for
    a bag of P ids drawn uniformly over the table's rows (rows split evenly over the shards):
    1 − (1 − 1/W)^P. One-hot (P = 1): 1/W; W = 1: 1. Skewed ids (a few hot rows, which sit in
    the first shard of a row-wise table) occupy fewer shards than this."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    if ids_per_bag <= 0:
        return 0.0
    return 1.0 - (1.0 - 1.0 / shards) ** ids_per_bag


def expected_exchange_bytes(batch_size: int, dims: Sequence[int], ids_per_bag: Sequence[float], shards: int,
                            sparse: bool, bytes_per_value: int = 4) -> float:
    """Expected bytes one worker sends its peers per training step in the forward output
    exchange of its row-wise shards (backward sends as many back): a sharding group of W =
    `shards` workers, each training `batch_size` samples; row-wise tables of embedding dims
    `dims` whose bags hold `ids_per_bag` ids each, drawn uniformly.

    Dense (TorchRec's reduce-scatter): the worker's shard sends each of its W − 1 peers a
    partial sum for every one of the peer's B bags of every table: B·(W − 1)·ΣD values. Sparse
    (SRP): only the bags with an id on the shard, which for a given (shard, bag) happens with
    probability `expected_occupancy(P, W)`: B·(W − 1)·Σ D_t·occupancy(P_t, W) values. So SRP's
    share of the dense bytes is the dims-weighted occupancy (1/W for one-hot tables).
    """
    if len(dims) != len(ids_per_bag):
        raise ValueError("dims and ids_per_bag need one entry per table")
    if shards <= 1:
        return 0.0
    per_bag = sum(d * (expected_occupancy(p, shards) if sparse else 1.0) for d, p in zip(dims, ids_per_bag))
    return float(batch_size * (shards - 1) * per_bag * bytes_per_value)


# ---- the exchange --------------------------------------------------------------------------------
# the attribute of TorchRec's per-sharding context that carries a batch's receiver mask
_SENT = "srp_sent"


class _Masks:
    """One row-wise sharding's masks between the hooks: the receiver's mask of the batch whose
    input dist is running (moved onto that batch's sharding context as soon as the input dist
    returns, so it travels with the batch, also when the train pipeline runs the input dist a
    step ahead), and the owner's mask of the batch being looked up (set by the lookup's pre-hook,
    taken by the output dist that TorchRec runs right after the lookup)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.sent: "torch.Tensor | None" = None
        self.held: "torch.Tensor | None" = None

    def on_ids_sent(self, module: "torch.nn.Module", args: tuple, result: Any) -> None:
        """Forward hook of the ids' all-to-all: what this worker sends, [W shards, F, B bags] > 0."""
        bucketized = args[0]
        self.sent = bucketized.lengths().view(self.world, len(bucketized.keys()) // self.world, -1) > 0

    def before_lookup(self, module: "torch.nn.Module", args: tuple) -> None:
        kjt = args[0]
        self.held = kjt.lengths().view(len(kjt.keys()), -1) > 0  # [F, Σ_r B_r]: what this shard holds

    def take(self, sharding_ctx: Any) -> "tuple[torch.Tensor, torch.Tensor]":
        held, self.held = self.held, None
        sent = getattr(sharding_ctx, _SENT, None)
        if held is None or sent is None:
            raise SrpError("row_wise_exchange sparse: a row-wise output dist ran without the masks of its batch "
                           "(its input dist or lookup did not run through SRP's hooks)")
        return held, sent


def _element_index(starts: torch.Tensor, lengths: torch.Tensor, uniform: int | None, total: int) -> torch.Tensor:
    """Flat indices of the runs [start, start + length) one after another (`total` elements);
    `uniform`: every length, when they are all equal."""
    import torch

    if uniform is not None:
        return (starts.unsqueeze(1) + torch.arange(uniform, device=starts.device)).reshape(-1)
    first = torch.cumsum(lengths, 0) - lengths
    return (torch.repeat_interleave(starts - first, lengths, output_size=total)
            + torch.arange(total, device=starts.device))


def _sparse_exchange(local_embs: torch.Tensor, held: torch.Tensor, sent: torch.Tensor, batch_per_rank: list[int],
                     dims: list[int], pg: "dist.ProcessGroup", divide_grad: bool
                     ) -> tuple[torch.Tensor, list[int]]:
    """SRP's forward: `local_embs` [Σ_r B_r, ΣD] (this shard's partial sums of every worker's bags,
    rows by worker) → this worker's pooled sums [B, ΣD]; also the elements sent to each peer."""
    import torch
    import torch.distributed.nn.functional as dist_nn

    W = pg.size()
    dev = local_embs.device
    C = sum(dims)
    dims_t = torch.tensor(dims, device=dev, dtype=torch.long)
    col = torch.cumsum(dims_t, 0) - dims_t
    uniform = dims[0] if len(set(dims)) == 1 else None

    # owner: the bags of every peer that have ids here, peer by peer, then feature, then bag
    f_own, b_own = held.nonzero(as_tuple=True)
    peer_of_row = torch.repeat_interleave(torch.arange(W, device=dev),
                                          torch.tensor(batch_per_rank, device=dev), output_size=held.size(1))
    peer = peer_of_row[b_own]
    order = torch.sort(peer, stable=True).indices
    f_own, b_own, peer = f_own[order], b_own[order], peer[order]
    send_counts = (torch.bincount(peer * len(dims) + f_own, minlength=W * len(dims)).view(W, -1) * dims_t).sum(1)
    # receiver: its bags that have ids on each shard, shard by shard, then feature, then bag: the
    # owner's order for this worker's block
    s_got, f_got, b_got = sent.nonzero(as_tuple=True)
    recv_counts = (torch.bincount(s_got * len(dims) + f_got, minlength=W * len(dims)).view(W, -1) * dims_t).sum(1)
    splits = torch.cat([send_counts, recv_counts]).tolist()  # the one host sync, as TorchRec's splits
    in_splits, out_splits = splits[:W], splits[W:]

    send_index = _element_index(b_own * C + col[f_own], dims_t[f_own], uniform, sum(in_splits))
    send = local_embs.reshape(-1).index_select(0, send_index)
    if divide_grad and send.requires_grad:
        send.register_hook(lambda g: g / W)  # TorchRec's reduce-scatter divides its gradient by W
    recv = send.new_empty(sum(out_splits))
    recv = dist_nn.all_to_all_single(recv, send, out_splits, in_splits, group=pg)
    # add the partial sums in a ring reduce-scatter's order (gloo's): from the previous worker
    # backwards, this worker's own last, so that on gloo the sums are bit for bit the dense path's
    # (a bag with ids on three or more shards is where the order shows); index_add adds duplicate
    # indices in order on CPU
    B, total = sent.size(2), sum(out_splits)
    bag_len = dims_t[f_got]
    bag_start = torch.cumsum(bag_len, 0) - bag_len
    order = torch.sort(torch.remainder(pg.rank() - 1 - s_got, W), stable=True).indices
    take = _element_index(bag_start[order], bag_len[order], uniform, total)
    put = _element_index((b_got * C + col[f_got])[order], bag_len[order], uniform, total)
    out = local_embs.new_zeros(B * C).index_add(0, put, recv.index_select(0, take))
    return out.view(B, C), in_splits


@functools.cache
def _dist_class() -> type:
    import torch.distributed as dist
    from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
    from torchrec.distributed.types import NoWait

    class SparseRowWiseDist(RwPooledEmbeddingDist):
        """TorchRec's row-wise output dist with SRP's exchange in place of its reduce-scatter
        (same process group, embedding dims and gradient division)."""

        def __init__(self, pg: "dist.ProcessGroup", embedding_dims: list[int], masks: _Masks) -> None:
            super().__init__(pg, embedding_dims=embedding_dims)
            self.masks = masks
            self.meter: Any = None  # an engine.exchange.ExchangeMeter, set by exchange.exchange_meter
            self.ranks = dist.get_process_group_ranks(pg)

        def forward(self, local_embs: "torch.Tensor", sharding_ctx: Any = None) -> Any:  # type: ignore[override]
            from torchrec.distributed.comm_ops import get_gradient_division

            held, sent = self.masks.take(sharding_ctx)
            W = self._pg.size()
            if sharding_ctx.variable_batch_per_feature:
                raise SrpError("row_wise_exchange sparse: variable batch sizes per feature are not supported")
            per_rank = list(sharding_ctx.batch_size_per_rank or []) or [local_embs.size(0) // W] * W
            out, elements = _sparse_exchange(local_embs, held, sent, per_rank, list(self._embedding_dims), self._pg,
                                             get_gradient_division())
            if self.meter is not None:
                self.meter.record("flat", self.ranks, [e * local_embs.element_size() for e in elements],
                                  part="row_wise")
            return NoWait(out)

    return SparseRowWiseDist


@functools.cache
def _module_class() -> type:
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    class SrpShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
        """TorchRec's sharded EBC whose row-wise shardings exchange by SRP: its input dist also
        leaves each batch's receiver mask on the batch's sharding context (`_SENT`), and the ids'
        all-to-all of every such sharding is watched from the moment TorchRec builds it."""

        _srp_masks: dict[int, _Masks]

        def _create_input_dist(self, input_feature_names: list[str]) -> None:
            super()._create_input_dist(input_feature_names)
            for i, masks in self._srp_masks.items():
                _watch_ids_all_to_all(self._input_dists[i], masks)

        def input_dist(self, ctx: Any, features: Any) -> Any:  # type: ignore[override]
            awaitable = super().input_dist(ctx, features)
            for i, masks in self._srp_masks.items():
                sent, masks.sent = masks.sent, None
                setattr(ctx.sharding_contexts[i], _SENT, sent)
            return awaitable

    return SrpShardedEmbeddingBagCollection


def _watch_ids_all_to_all(input_dist: "torch.nn.Module", masks: _Masks) -> None:
    """Record what the ids' all-to-all of `input_dist` (TorchRec's `RwSparseFeaturesDist`) sends."""
    from torchrec.distributed.dist_data import KJTAllToAll

    a2a = getattr(input_dist, "_dist", None)
    if not isinstance(a2a, KJTAllToAll):
        raise SrpError(f"row_wise_exchange sparse: unexpected row-wise input dist {type(input_dist).__name__}")
    a2a.register_forward_hook(masks.on_ids_sent)


def is_sparse_dist(module: "torch.nn.Module") -> bool:
    """Whether `module` is an output dist SRP installed."""
    return isinstance(module, _dist_class())


def install_srp(model: "torch.nn.Module") -> int:
    """Switch the row-wise shardings of every sharded EmbeddingBagCollection in `model` (a DMP
    model built by `sharding.shard_model`) to SRP's exchange; returns how many it switched. Runs
    before the first batch (TorchRec builds the input dists on it), on every worker."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist

    switched = 0
    for m in list(model.modules()):
        if type(m) is not ShardedEmbeddingBagCollection:
            continue
        if m._input_dists:
            raise SrpError("install_srp must run before the model's first batch")
        masks: dict[int, _Masks] = {}
        for i, st in enumerate(m._sharding_types):
            out_dist = m._output_dists[i]
            if st not in SPARSE_SHARDINGS or type(out_dist) is not RwPooledEmbeddingDist:
                continue
            masks[i] = _Masks(out_dist._pg.size())
            m._output_dists[i] = _dist_class()(out_dist._pg, list(out_dist._embedding_dims), masks[i])
            m._lookups[i].register_forward_pre_hook(masks[i].before_lookup)
        if masks:
            m.__class__ = _module_class()  # the same object, with SRP's input_dist (see the class)
            m._srp_masks = masks
            switched += len(masks)
    return switched
