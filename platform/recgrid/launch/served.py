"""The served form of a job's model: the MLflow pyfunc "model from code" every logged model carries.

MLflow runs this file where it loads or serves the model (`mlflow.pyfunc.load_model`, `mlflow models
serve`): it needs MLflow, torch, numpy and pandas, never recgrid, Ray or TorchRec. Its artifacts are
the model's weights (`weights.pt`: a dict of plain tensors, read with `torch.load(weights_only=True)`)
and its recorded architecture (`architecture.json`, whose "served" part lays the model out as plain
tables and matrices by their weights' names: `engine.unsharded.served_layout`); beside it, in the
model's `code/` folder, `recgrid_transforms.py` is recgrid's `data/transforms.py`, the transforms
training applied, shipped as they are.

`predict` takes a pandas DataFrame of the columns I1..I13 and C1..C26 holding the values as the data
files hold them (the raw files' integers and hex strings, or prepared integer ids; None or NaN for a
missing value), applies training's transforms, and returns a DataFrame with one column,
`probability`: the click probability of each row. A value that is not one the data files can hold
raises MLflow's INVALID_PARAMETER_VALUE (HTTP 400 from MLflow's scoring server) naming its row (the
DataFrame's index) and column.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

TRANSFORMS = "recgrid_transforms"  # the shipped `data/transforms.py`, by the name it has in the model's code/
OUTPUT = "probability"


class PlainDLRM:
    """The model's forward in plain torch, from its served layout and its weights."""

    def __init__(self, layout: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
        self.layout = layout
        # fp16 tables pool in fp32, as TorchRec's do; the head caches' ids stay int64 (exact past 2**24)
        self.w = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
        self.heads = {f: self.w[c["head"]].long() for f, c in layout["compressed"].items() if c["head"]}

    def forward(self, dense: torch.Tensor, ids: list[np.ndarray]) -> torch.Tensor:
        """Logits [B] of transformed dense values [B, 13] and each feature's ids ([B] or [B, bag])."""
        lay = self.layout
        B = dense.shape[0]
        pooled: dict[str, torch.Tensor] = {}
        for name, x in zip(lay["sparse"], ids):
            v = torch.from_numpy(np.ascontiguousarray(x)).long().reshape(B, -1)
            sample = torch.arange(B).repeat_interleave(v.shape[1])
            v = v.reshape(-1)
            c = lay["compressed"].get(name)
            if c is None:
                pooled[name] = self.pool(lay["tables"][name], v, sample, B)
                continue
            head_key, q_key, r_key = c["keys"]
            if head_key is not None:
                head = self.heads[name]
                pos = torch.searchsorted(head, v).clamp(max=head.numel() - 1)
                hit = head[pos] == v
                pooled[head_key] = self.pool(lay["tables"][head_key], pos[hit], sample[hit], B)
                v, sample = v[~hit], sample[~hit]
            collisions = lay["collisions"]
            pooled[q_key] = self.pool(lay["tables"][q_key], torch.div(v, collisions, rounding_mode="floor"), sample, B)
            pooled[r_key] = self.pool(lay["tables"][r_key], v % collisions, sample, B)
        parts = []
        for part in lay["parts"]:
            if len(part) == 1:
                parts.append(pooled[part[0]])
                continue
            head_key, q_key, r_key = part
            q, r = pooled[q_key], pooled[r_key]
            op = lay["operation"]
            e = q * r if op == "mult" else q + r if op == "add" else torch.cat([q, r], dim=1)
            parts.append(e if head_key is None else pooled[head_key] + e)
        sparse = torch.cat(parts, dim=1).reshape(B, len(parts), lay["embedding_dim"])
        x = dense
        for w, b in lay["bottom"]:
            x = torch.relu(F.linear(x, self.w[w], self.w[b]))
        combined = torch.cat([x.unsqueeze(1), sparse], dim=1)
        if lay["interaction"] == "dot":
            n = combined.shape[1]
            i, j = torch.triu_indices(n, n, offset=1)
            z = torch.cat([x, torch.bmm(combined, combined.transpose(1, 2))[:, i, j]], dim=1)
        else:  # "dcn": a low-rank cross net over the flattened embeddings
            x0 = xl = combined.reshape(B, -1)
            for w, v, b in lay["cross"]:
                xl = x0 * (F.linear(F.linear(xl, self.w[v]), self.w[w]) + self.w[b]) + xl
            z = xl
        for k, (w, b) in enumerate(lay["top"]):
            z = F.linear(z, self.w[w], self.w[b])
            if k < len(lay["top"]) - 1:
                z = torch.relu(z)
        return z.reshape(-1)

    def pool(self, weight: str, values: torch.Tensor, sample: torch.Tensor, batch: int) -> torch.Tensor:
        """Sum-pooled rows of table `weight` per sample ([batch, D]; a sample with no id gets zeros)."""
        counts = torch.bincount(sample, minlength=batch)
        offsets = torch.cumsum(counts, 0) - counts
        return F.embedding_bag(values, self.w[weight], offsets, mode="sum")


class ServedDLRM(mlflow.pyfunc.PythonModel):
    """A job's model as MLflow serves it (the module docstring)."""

    def load_context(self, context: Any) -> None:
        self.transforms = importlib.import_module(TRANSFORMS)
        with open(context.artifacts["architecture"]) as f:
            self.layout = json.load(f)["served"]
        weights = torch.load(context.artifacts["weights"], map_location="cpu", weights_only=True)
        self.net = PlainDLRM(self.layout, weights)
        lay = self.layout  # multi-hot: each feature's bag offsets (None: one id per feature)
        self.bags = [self.transforms.bag_offsets(rows, bag, lay["multi_hot_seed"], f)
                     for f, (rows, bag) in enumerate(zip(lay["table_rows"], lay["bag_sizes"]))]

    # `pd.DataFrame`: a hint MLflow infers no schema from (the model's signature is the logged one) and
    # wraps nothing for; without a hint MLflow warns at every load that data validation is off
    def predict(self, context, model_input: pd.DataFrame, params=None):
        df = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        lay, t = self.layout, self.transforms
        columns = [*lay["dense"], *lay["sparse"]]
        missing = [c for c in columns if c not in df.columns]
        if missing:
            refuse(f"the rows have no column {', '.join(map(str, missing))}: the model takes one column per "
                   f"feature, {columns[0]}..{lay['dense'][-1]} and {lay['sparse'][0]}..{columns[-1]}")
        try:
            dense = [t.transform_dense(*t.dense_values(df[c].to_numpy(), c)) for c in lay["dense"]]
            ids = []
            for f, c in enumerate(lay["sparse"]):
                hashes, absent = t.categorical_hashes(df[c].to_numpy(), c)
                x = t.transform_categorical(hashes, lay["table_rows"][f], absent)
                ids.append(x if self.bags[f] is None else t.expand_bags(x.astype(np.uint32), self.bags[f],
                                                                        lay["table_rows"][f]))
        except t.BadValue as e:
            refuse(f"row {df.index[e.row]!r}, column {e.column}: {e.detail}")
        with torch.no_grad():
            logits = self.net.forward(torch.from_numpy(np.stack(dense, axis=1)), ids)
        return pd.DataFrame({OUTPUT: torch.sigmoid(logits).double().numpy()}, index=df.index)


def refuse(message: str) -> None:
    raise MlflowException(message, error_code=INVALID_PARAMETER_VALUE)


mlflow.models.set_model(ServedDLRM())
