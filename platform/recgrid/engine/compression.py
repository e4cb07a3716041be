"""QR-compressed embedding tables in the model: their TorchRec table configs, their
initialisation, and the sparse arch that combines a compressed feature's pooled parts.

The naming and sizing of the tables is one fact, kept in `data.specs` (the data pipeline's id
transform needs it too, and `data/` may not import `engine/`); this module builds on it.

Combination. A compressed feature f has the pooled outputs q (`<f>_q`), r (`<f>_r`) and, with a
head cache, h (`<f>_h`); the sparse arch returns h + op(q, r) with op = q * r, q + r or
cat(q, r) in f's place of C1..C26, so the interaction sees [B, 26, D] as without compression.
With sum pooling this equals pooling the per-id combinations for add and concat whatever the bag
(both are linear), and for mult when every bag holds one id (a head id leaves q and r empty:
their pooled zeros multiply to 0; any other id leaves h empty). mult over bags of several ids
would pool q and r separately and multiply the sums, not sum the products: config.py refuses
mult with multi-hot data.

Initialisation (TorchRec's table init is uniform(-s, s) with s = sqrt(1 / rows); the fused
kernel draws it per shard from the table config's weight_init_min/max, and the replica sync's
align makes every sharding group start from one copy). For a compressed table of n rows, with
s = sqrt(1 / n), the rows an id gets start with the variance of an uncompressed row (s^2 / 3):
- head rows: uniform(-s, s), as the uncompressed table's;
- concat: q and r halves each uniform(-s, s) (each coordinate as an uncompressed row's);
- add: q and r uniform(-s / sqrt(2), s / sqrt(2)) (the variances add);
- mult: q and r uniform(-a, a) with a = (3 s^2)^(1/4), so Var(q r) = (a^2 / 3)^2 = s^2 / 3,
  mean 0. (The reference implementation's `uniform_(w, sqrt(1/n))` draws from U(sqrt(1/n), 1),
  all positive; that is not used.)
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Sequence

from recgrid.data.specs import HEAD, QUOTIENT, REMAINDER, SPARSE_NAMES, Compression, DatasetSpec, table_layout

if TYPE_CHECKING:
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig


def compressed_tables(spec: DatasetSpec, dim: int, compression: Compression | None,
                      head_sizes: dict[int, int] | None = None) -> list[tuple[str, str, int, int]]:
    """(table name, feature name, rows, dim) of every table of one model copy: pure, for the planner.
    `head_sizes` (feature index -> H) sizes head tables before their ids are counted; by default the
    compression's counted heads (none if not counted yet)."""
    if compression is not None and head_sizes is None and compression.head_ids is not None:
        head_sizes = compression.head_sizes()
    return table_layout(spec, dim, compression, head_sizes)


def init_range(compression: Compression, original_rows: int, part: str) -> float:
    """The half-width a of the uniform(-a, a) that a compressed table's `part` (HEAD, QUOTIENT or
    REMAINDER) starts from, for a table of `original_rows` rows before compression (module docstring)."""
    s = math.sqrt(1.0 / original_rows)
    if part == HEAD or compression.operation == "concat":
        return s
    if compression.operation == "add":
        return s / math.sqrt(2.0)
    return (3.0 * s * s) ** 0.25  # mult


def qr_table_configs(spec: DatasetSpec, dim: int, dtype: Any, compression: Compression) -> list["EmbeddingBagConfig"]:
    """The TorchRec tables of a compressed model copy: sum-pooled, named and sized by
    `table_layout`, compressed parts with `init_range`'s uniform init."""
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.embedding_configs import PoolingType

    original = {name: rows for name, rows in zip(SPARSE_NAMES, spec.table_rows)}
    out = []
    for table, feature, rows, d in table_layout(spec, dim, compression, compression.head_sizes()):
        extra = {}
        if feature not in original:
            base, part = feature[:-2], feature[-2:]
            a = init_range(compression, original[base], part)
            extra = {"weight_init_min": -a, "weight_init_max": a}
        out.append(EmbeddingBagConfig(name=table, embedding_dim=d, num_embeddings=rows, feature_names=[feature],
                                      pooling=PoolingType.SUM, data_type=dtype, **extra))
    return out


def combine_parts(pooled: dict[str, torch.Tensor], parts: Sequence[tuple[str | None, ...]], operation: str,
                  num_features: int, dim: int) -> torch.Tensor:
    """The sparse arch's output, [B, F, D], from the tables' pooled embeddings by name: per feature
    its table's, or for a QR-compressed one h + op(q, r) (h: its head table's, where it has one;
    op: "mult", "add" or "concat"). `parts[f]`: (table feature name,) or (head or None, q, r)."""
    import torch

    out = []
    for part in parts:
        if len(part) == 1:
            out.append(pooled[part[0]])  # type: ignore[index]
            continue
        head, q_name, r_name = part
        q, r = pooled[q_name], pooled[r_name]  # type: ignore[index]
        e = q * r if operation == "mult" else q + r if operation == "add" else torch.cat([q, r], dim=1)
        out.append(e if head is None else pooled[head] + e)
    return torch.cat(out, dim=1).reshape(-1, num_features, dim)


@functools.lru_cache(maxsize=1)
def _qr_sparse_arch_class() -> type:
    """`QRSparseArch`, defined on first use (torchrec is a heavy import)."""
    from torchrec.models.dlrm import SparseArch

    class QRSparseArch(SparseArch):
        """DLRM's sparse arch over an EBC of expanded tables: per feature of C1..C26, its table's
        pooled output, or h + op(q, r) for a compressed one; [B, 26, D] out."""

        def __init__(self, ebc: "EmbeddingBagCollection", spec: DatasetSpec, dim: int,
                     compression: Compression) -> None:
            super().__init__(ebc)
            compressed, heads = set(compression.features(spec)), compression.heads()
            # per feature: (plain name) or (head name or None, quotient name, remainder name)
            self.parts: list[tuple[str | None, ...]] = [
                (name + HEAD if f in heads else None, name + QUOTIENT, name + REMAINDER) if f in compressed
                else (name,) for f, name in enumerate(SPARSE_NAMES)]
            self.operation = compression.operation
            self.D, self._sparse_feature_names, self.F = dim, list(SPARSE_NAMES), len(SPARSE_NAMES)

        def forward(self, features: Any) -> torch.Tensor:  # type: ignore[override]
            return combine_parts(self.embedding_bag_collection(features).to_dict(), self.parts, self.operation,
                                 self.F, self.D)

    return QRSparseArch


def qr_sparse_arch(ebc: "EmbeddingBagCollection", spec: DatasetSpec, dim: int, compression: Compression) -> Any:
    """The sparse arch of a compressed model (a TorchRec `SparseArch`: DMP shards its EBC as any other)."""
    return _qr_sparse_arch_class()(ebc, spec, dim, compression)
