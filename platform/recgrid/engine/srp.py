"""Sparse Row-wise Parallelism (SRP): row-wise shards send only the pooled partial sums that are
not empty.

TorchRec's row-wise output path reduce-scatters a dense `[W·B, D]` block per shard over the
sharding group of W = L workers: every shard sends every peer a partial sum for each of the
peer's B bags, zeros included, so the bytes grow with W whatever the ids touch. With SRP
(`model.row_wise_exchange: sparse`), shard s sends peer r only the partial sums of r's bags that
have at least one id on s (a bag whose ids all live on other shards sends nothing), in one
variable-size `all_to_all_single`. Both sides know the sizes without exchanging them:

- the owner (shard s) knows which of peer r's bags are non-empty on s from the lengths it
  received in the ids' all-to-all (the KJT its lookup kernel reads);
- the receiver (peer r) knows which of its bags are non-empty on s from its own bucketized
  lengths, the KJT it sent in that all-to-all.

The receiver scatter-adds what it receives into its `[B, D]` pooled output, in the order a
ring reduce-scatter adds (gloo's; the sums are then bit for bit the dense path's there; other
backends may differ from it in the last bits, as any two reduction orders do). Backward mirrors it:
autograd's all-to-all sends each shard the gradient rows of exactly the bags it received from
it, and the gather's backward scatters them into the shard's `[W·B, D]` gradient with zeros
elsewhere (a bag with no id on the shard touches no row, so those zeros are never read). The
gradient is divided by W as TorchRec's reduce-scatter divides it (`comm_ops`' gradient
division), so the fused kernel and its row-wise AdaGrad see the dense path's gradients.

How it is hooked into TorchRec's `ShardedEmbeddingBagCollection` (`install_srp`), for each of
its row-wise shardings:
1. the output dist becomes a `SparseRowWiseDist` (a subclass of TorchRec's
   `RwPooledEmbeddingDist` whose forward is the exchange above);
2. the ids' all-to-all of the sharding's input dist (created lazily by TorchRec on the first
   batch) gets a forward hook that reads the bucketized lengths it sends and tags the KJT it
   will deliver with them (a callback on TorchRec's awaitables), so a batch's masks travel with
   the batch, also when the train pipeline runs the input dist a step ahead;
3. the sharding's lookup gets a forward pre-hook that reads the delivered KJT's lengths (the
   owner's mask) and its tag (the receiver's mask) just before the lookup, which TorchRec runs
   immediately before the output dist of the same sharding.

Table-row-wise shards (a two-level exchange: an intra-host reduce-scatter, then a cross-host
all-to-all, over TorchRec's staggered input layout) are not covered yet: config refuses
`sparse` with any sharding but row_wise (`SPARSE_SHARDINGS`).

`expected_occupancy` and `expected_exchange_bytes` price the exchange for the planner.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # torch is heavy; config validation imports ROW_WISE_EXCHANGES from here
    import torch
    import torch.distributed as dist

    from recgrid.engine.sptt import ExchangeMeter

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
class _Masks:
    """One row-wise sharding's masks between the hooks: the receiver's masks by the KJT its input
    dist delivers (weakly: a batch the loop drops takes its tag with it), and the current
    batch's pair, set by the lookup's pre-hook and taken by the output dist right after."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.by_kjt: "weakref.WeakKeyDictionary[Any, torch.Tensor]" = weakref.WeakKeyDictionary()
        self.current: tuple[torch.Tensor, torch.Tensor] | None = None

    def tag(self, kjt: Any, sent: torch.Tensor) -> Any:
        self.by_kjt[kjt] = sent
        return kjt

    def before_lookup(self, module: torch.nn.Module, args: tuple) -> None:
        kjt = args[0]
        sent = self.by_kjt.pop(kjt, None)
        if sent is None:
            raise SrpError("row_wise_exchange sparse: a row-wise lookup got ids that did not come through its "
                           "input dist's all-to-all (no bucketized lengths to size the exchange)")
        held = kjt.lengths().view(len(kjt.keys()), -1) > 0  # [F, Σ_r B_r]: the owner's mask
        self.current = (held, sent)

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        masks, self.current = self.current, None
        if masks is None:
            raise SrpError("row_wise_exchange sparse: the output dist ran without its lookup's masks")
        return masks


def _watch_ids_all_to_all(input_dist: torch.nn.Module, masks: _Masks) -> None:
    """Tag the KJT that `input_dist` (TorchRec's `RwSparseFeaturesDist`) delivers with the mask of
    what this worker sent: its bucketized lengths, [W shards, F features, B bags] > 0."""
    from torchrec.distributed.dist_data import KJTAllToAll

    a2a = getattr(input_dist, "_dist", None)
    if not isinstance(a2a, KJTAllToAll):
        raise SrpError(f"row_wise_exchange sparse: unexpected row-wise input dist {type(input_dist).__name__}")

    def after(module: torch.nn.Module, args: tuple, awaitable: Any) -> Any:
        bucketized = args[0]
        F = len(bucketized.keys()) // masks.world
        sent = bucketized.lengths().view(masks.world, F, -1) > 0

        def on_tensors(tensors_awaitable: Any) -> Any:
            tensors_awaitable.callbacks.append(functools.partial(masks.tag, sent=sent))
            return tensors_awaitable

        awaitable.callbacks.append(on_tensors)
        return awaitable

    a2a.register_forward_hook(after)


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
    import torch
    import torch.distributed as dist
    from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
    from torchrec.distributed.types import NoWait

    class SparseRowWiseDist(RwPooledEmbeddingDist):
        """TorchRec's row-wise output dist with SRP's exchange in place of its reduce-scatter
        (same process group, embedding dims and gradient division)."""

        def __init__(self, pg: "dist.ProcessGroup", embedding_dims: list[int], masks: _Masks) -> None:
            super().__init__(pg, embedding_dims=embedding_dims)
            self.masks = masks
            self.meter: "ExchangeMeter | None" = None  # set by sptt.exchange_meter
            self.ranks = dist.get_process_group_ranks(pg)

        def forward(self, local_embs: torch.Tensor, sharding_ctx: Any = None) -> Any:  # type: ignore[override]
            from torchrec.distributed.comm_ops import get_gradient_division

            held, sent = self.masks.take()
            W = self._pg.size()
            if sharding_ctx is not None and sharding_ctx.variable_batch_per_feature:
                raise SrpError("row_wise_exchange sparse: variable batch sizes per feature are not supported")
            per_rank = list(getattr(sharding_ctx, "batch_size_per_rank", None) or []) or [local_embs.size(0) // W] * W
            out, elements = _sparse_exchange(local_embs, held, sent, per_rank, list(self._embedding_dims), self._pg,
                                             get_gradient_division())
            if self.meter is not None:
                self.meter.record("flat", self.ranks, [e * local_embs.element_size() for e in elements],
                                  part="row_wise")
            return NoWait(out)

    return SparseRowWiseDist


def is_sparse_dist(module: "torch.nn.Module") -> bool:
    """Whether `module` is an output dist SRP installed."""
    return isinstance(module, _dist_class())


def install_srp(model: torch.nn.Module) -> int:
    """Switch the row-wise shardings of every sharded EmbeddingBagCollection in `model` (a DMP
    model built by `sharding.shard_model`) to SRP's exchange; returns how many it switched.
    Must run before the first batch (TorchRec builds the input dists on it) or after it (the
    existing input dists are watched); either way every worker of a sharding group runs it."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist

    switched = 0
    for m in model.modules():
        if not isinstance(m, ShardedEmbeddingBagCollection):
            continue
        for i, (st, sharding) in enumerate(zip(m._sharding_types, m._embedding_shardings)):
            dist_i = m._output_dists[i]
            if st not in SPARSE_SHARDINGS or type(dist_i) is not RwPooledEmbeddingDist:
                continue
            masks = _Masks(dist_i._pg.size())
            m._output_dists[i] = _dist_class()(dist_i._pg, list(dist_i._embedding_dims), masks)
            m._lookups[i].register_forward_pre_hook(masks.before_lookup)
            if len(m._input_dists) > i:
                _watch_ids_all_to_all(m._input_dists[i], masks)
            else:  # TorchRec builds the input dists on the first batch
                sharding.create_input_dist = _watching(sharding.create_input_dist, masks)
            switched += 1
    return switched


def _watching(create: Any, masks: _Masks) -> Any:
    @functools.wraps(create)
    def create_input_dist(*args: Any, **kwargs: Any) -> Any:
        input_dist = create(*args, **kwargs)
        _watch_ids_all_to_all(input_dist, masks)
        return input_dist

    return create_input_dist
