"""A trained model as one ordinary PyTorch module, for use outside recgrid's training.

`UnshardedDLRM` is TorchRec's DLRM (or DLRM-DCN) over a plain, unsharded `EmbeddingBagCollection`
on the CPU: no process group, no Ray, no sharding plan. Its input is what the training data
gives before any compression: the 13 dense features (`[B, 13]` float32, already transformed as
`data.criteo.transform_dense` does) and the 26 categorical id lists (a `KeyedJaggedTensor` of keys
C1..C26, ids in each table's rows, as `data.criteo.transform_categorical` gives them). A
QR-compressed model carries its id mapping (`QRIds`: per compressed feature, its head cache's
ids and the collision count) and applies it itself, as the training pipeline did
(`data.specs.Compression.apply`), so callers never see the expanded features. Its output is
one logit per sample (`[B]`; `torch.sigmoid` gives the click probability).

This module imports torch and TorchRec only (never the rest of recgrid): loading a pickled
`UnshardedDLRM` (an MLflow model of a job, `train.unshard`) needs those two and this file.
`predict_rows` is the one-tensor form MLflow's pyfunc hands a model: `[B, 39]` float32, the 13
dense values then one id per categorical feature (ids above 2**24 are not exact in float32: use
the KeyedJaggedTensor form for those).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def combine_parts(pooled: dict[str, torch.Tensor], parts: Sequence[tuple[str | None, ...]], operation: str,
                  num_features: int, dim: int) -> torch.Tensor:
    """The sparse arch's output, [B, F, D], from the tables' pooled embeddings by name: per feature
    its table's, or for a QR-compressed one h + op(q, r) (h: its head table's, where it has one;
    op: "mult", "add" or "concat"). `parts[f]`: (table feature name,) or (head or None, q, r)."""
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


class QRIds(nn.Module):
    """The id mapping of a QR-compressed model: each compressed feature's ids become a head row
    (an id in its head cache: its index there) or a quotient and a remainder row (id // c, id % c),
    each bag keeping its order; the other features pass as they are. The expanded keys are in
    `keys` order (C1..C26, each compressed f replaced by f_h (with a head), f_q, f_r)."""

    def __init__(self, features: Sequence[str], compressed: dict[str, tuple[str | None, str, str]],
                 heads: dict[str, torch.Tensor], collisions: int) -> None:
        super().__init__()
        self.features, self.compressed, self.collisions = list(features), dict(compressed), int(collisions)
        for name, ids in heads.items():
            self.register_buffer(f"head_{name}", torch.as_tensor(ids, dtype=torch.int64).sort().values)

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        by_key = kjt.to_dict()
        keys: list[str] = []
        values: list[torch.Tensor] = []
        lengths: list[torch.Tensor] = []
        for f in self.features:
            jt = by_key[f]
            v, n = jt.values().long(), jt.lengths().long()
            if f not in self.compressed:
                keys.append(f)
                values.append(v)
                lengths.append(n)
                continue
            head_key, q_key, r_key = self.compressed[f]
            rest, rest_n = v, n
            if head_key is not None:
                head = getattr(self, f"head_{f}")
                pos = torch.searchsorted(head, v)
                hit = (pos < head.numel()) & (head[pos.clamp(max=max(head.numel() - 1, 0))] == v)
                sample = torch.repeat_interleave(torch.arange(n.numel()), n)
                hits = torch.bincount(sample[hit], minlength=n.numel())
                keys.append(head_key)
                values.append(pos[hit])
                lengths.append(hits)
                rest, rest_n = v[~hit], n - hits
            keys += [q_key, r_key]
            values += [torch.div(rest, self.collisions, rounding_mode="floor"), rest % self.collisions]
            lengths += [rest_n, rest_n]
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values),
                                                   lengths=torch.cat(lengths).int())


class UnshardedSparseArch(nn.Module):
    """TorchRec's sparse arch for an unsharded model: [B, F, D] from the raw C1..C26 ids (through
    `ids`, a `QRIds`, for a compressed model). Its table module keeps TorchRec's name
    (`embedding_bag_collection`), so a storage checkpoint's tables load into it by name."""

    def __init__(self, ebc: nn.Module, parts: Sequence[tuple[str | None, ...]], operation: str, dim: int,
                 ids: QRIds | None = None) -> None:
        super().__init__()
        self.embedding_bag_collection, self.ids = ebc, ids
        self.parts, self.operation, self.D, self.F = [tuple(p) for p in parts], operation, dim, len(parts)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        if self.ids is not None:
            features = self.ids(features)
        pooled = self.embedding_bag_collection(features).to_dict()
        return combine_parts(pooled, self.parts, self.operation, self.F, self.D)


class UnshardedDLRM(nn.Module):
    """A trained DLRM as one module (the module docstring): `forward(dense, sparse)` gives `[B]`
    logits; `predict_rows(rows)` the same from one `[B, 13 + 26]` tensor. `model` is TorchRec's
    DLRM or DLRM_DCN whose sparse arch is an `UnshardedSparseArch`; `info` records what it was
    trained as (dataset spec, architecture, compression settings, the job's run and step)."""

    def __init__(self, model: nn.Module, features: Sequence[str], num_dense: int, info: dict) -> None:
        super().__init__()
        self.model, self.features, self.num_dense, self.info = model, list(features), int(num_dense), dict(info)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor | None = None) -> torch.Tensor:
        if sparse is None:  # MLflow's pyfunc: one [B, 13 + 26] float32 tensor
            return self.predict_rows(dense)
        return self.model(dense.float(), sparse).reshape(-1)

    def predict_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Logits `[B]` of rows `[B, 13 + 26]`: the dense values, then one id per categorical feature."""
        d = self.num_dense
        if rows.dim() != 2 or rows.shape[1] != d + len(self.features):
            raise ValueError(f"rows of shape {tuple(rows.shape)}: expected [B, {d + len(self.features)}] "
                             f"({d} dense values, then one id for each of {self.features[0]}..{self.features[-1]})")
        ids = rows[:, d:].round().long()
        B = rows.shape[0]
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=self.features, values=ids.t().reshape(-1),
                                                  lengths=torch.ones(B * len(self.features), dtype=torch.int32))
        return self.forward(rows[:, :d].float(), kjt)
