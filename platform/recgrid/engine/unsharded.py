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

`served_layout` lays a model out as the plain computation MLflow serves (`launch.served`): its
tables by feature, its id mapping, its matrices layer by layer, each by its name in the model's
`state_dict()`, so the served form needs torch only, never TorchRec or this module.
This module imports torch, TorchRec, `data.specs` and `engine.compression` only.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recgrid.data.specs import DENSE_NAMES
from recgrid.engine.compression import combine_parts


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
    logits. `model` is TorchRec's DLRM or DLRM_DCN whose sparse arch is an `UnshardedSparseArch`;
    `info` records what it was trained as (dataset spec, architecture, compression settings, the
    job's run and step: `launch.unshard.model_record`, from which it is rebuilt)."""

    def __init__(self, model: nn.Module, features: Sequence[str], num_dense: int, info: dict) -> None:
        super().__init__()
        self.model, self.features, self.num_dense, self.info = model, list(features), int(num_dense), dict(info)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.model(dense.float(), sparse).reshape(-1)


def served_layout(model: UnshardedDLRM, table_rows: Sequence[int], bag_sizes: Sequence[int],
                  multi_hot_seed: int) -> dict[str, Any]:
    """`model` as the plain computation `launch.served.PlainDLRM` runs, every tensor by its name in
    `model.state_dict()`: per categorical feature its table (or, QR-compressed, its head ids and
    head, quotient and remainder tables: `QRIds`), how the parts combine, the bottom MLP's and the
    top MLP's (weight, bias) per layer, and the interaction (DLRM's dot products, or DCN's cross
    layers as (W, V, bias)). `table_rows` and `bag_sizes`: the spec's (the categorical modulus,
    the multi-hot bags). A module this does not know (another TorchRec layout) is an error, never
    a guess."""
    from torchrec.models.dlrm import DLRM, DLRM_DCN, InteractionArch, InteractionDCNArch
    from torchrec.modules.crossnet import LowRankCrossNet
    from torchrec.modules.mlp import Perceptron

    net = model.model
    if type(net) not in (DLRM, DLRM_DCN) or not isinstance(net.sparse_arch, UnshardedSparseArch):
        raise TypeError(f"no served layout for a {type(net).__name__} (DLRM or DLRM_DCN over an unsharded sparse arch)")
    arch = net.sparse_arch
    tables = {}
    for config in arch.embedding_bag_collection.embedding_bag_configs():
        for feature in config.feature_names:
            tables[feature] = f"model.sparse_arch.embedding_bag_collection.embedding_bags.{config.name}.weight"
    compressed = {}
    if arch.ids is not None:
        for f, keys in arch.ids.compressed.items():
            compressed[f] = {"keys": list(keys), "head": f"model.sparse_arch.ids.head_{f}" if keys[0] else None}

    def linears(module: nn.Module, prefix: str, relu_on_last: bool) -> list[list[str]]:
        found = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
        relu = [name for name, m in module.named_modules() if isinstance(m, Perceptron) and m._activation_fn is torch.relu]
        if len(relu) != len(found) - (not relu_on_last):  # every layer ReLU'd, but the over arch's last
            raise TypeError(f"{prefix}: not an MLP of ReLU layers")
        return [[f"{prefix}{name}.weight", f"{prefix}{name}.bias"] for name, _ in found]

    layout: dict[str, Any] = {
        "dense": list(DENSE_NAMES), "sparse": list(model.features), "table_rows": [int(r) for r in table_rows],
        "bag_sizes": [int(b) for b in bag_sizes], "multi_hot_seed": int(multi_hot_seed),
        "tables": tables, "compressed": compressed, "collisions": arch.ids.collisions if arch.ids else None,
        "parts": [list(p) for p in arch.parts], "operation": arch.operation, "embedding_dim": arch.D,
        "bottom": linears(net.dense_arch, "model.dense_arch.", True),
        "top": linears(net.over_arch, "model.over_arch.", False),
    }
    inter = net.inter_arch
    if type(inter) is InteractionArch:
        layout["interaction"] = "dot"
    elif type(inter) is InteractionDCNArch and type(inter.crossnet) is LowRankCrossNet:
        layout["interaction"] = "dcn"
        layout["cross"] = [[f"model.inter_arch.crossnet.{part}.{i}" for part in ("W_kernels", "V_kernels", "bias")]
                           for i in range(len(inter.crossnet.W_kernels))]
    else:
        raise TypeError(f"no served layout for the interaction {type(inter).__name__}")
    return layout
