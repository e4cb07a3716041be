"""Optimizers: the moment-scaled row-wise AdaGrad of the embeddings (fused into FBGEMM's kernel)
and the dense optimizer.

Moment-scaled row-wise AdaGrad, per embedding row touched in a step with summed gradient g:
    v += mean(g²)                       (one float per row)
    w -= lr · g / (sqrt(v / c) + eps)   (c: the moment scale, default M)
FBGEMM's EXACT_ROWWISE_ADAGRAD computes w -= lr' · g / (sqrt(v) + eps'). Since
sqrt(v / c) = sqrt(v) / sqrt(c), the scaled update is exactly FBGEMM's with
lr' = lr · sqrt(c) and eps' = eps · sqrt(c); c = 1 is plain row-wise AdaGrad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # config validation imports DENSE_OPTIMIZERS from here without torch
    import torch

# The dense optimizers a job can name (config.py's optim.dense_optimizer takes them from here).
DENSE_OPTIMIZERS: tuple[str, ...] = ("adagrad", "adam", "sgd")


def moment_scale_for(num_groups: int, moment_scale: float | None = None) -> float:
    """c: `moment_scale` when given, else M (the group count). The one place that default is
    decided; an elastic job whose M changes asks again with the new M."""
    return float(num_groups) if moment_scale is None else float(moment_scale)


@dataclass(frozen=True)
class MomentScaledRowWiseAdagrad:
    """The embedding optimizer. `moment_scale` is c (`moment_scale_for` decides its default).
    No defaults of its own: lr and eps are the job's (`optim.lr`, `optim.eps`, config.py)."""

    lr: float
    eps: float
    moment_scale: float

    def __post_init__(self) -> None:
        for name in ("lr", "eps", "moment_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    def fused_params(self) -> dict:
        """Fused-kernel parameters for TorchRec's sharder (see the module docstring)."""
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        root_c = math.sqrt(self.moment_scale)
        return {
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": self.lr * root_c,
            "eps": self.eps * root_c,
        }


def reference_step(weight: "torch.Tensor", moment: "torch.Tensor", rows: "torch.Tensor", grads: "torch.Tensor",
                   lr: float, eps: float, moment_scale: float) -> None:
    """The update written out plainly, in place; the proof the fused kernel is what we claim.

    `rows[i]` is the table row of gradient `grads[i]`; repeated rows are summed first (as the
    exact kernel does), then each touched row is updated once.
    """
    import torch

    touched, inverse = torch.unique(rows, return_inverse=True)
    g = torch.zeros(len(touched), weight.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)
    moment[touched] += (g * g).mean(dim=1)
    weight[touched] -= lr * g / (torch.sqrt(moment[touched] / moment_scale) + eps).unsqueeze(1)


def dense_optimizer(name: str, params: Iterable["torch.nn.Parameter"], lr: float) -> "torch.optim.Optimizer":
    import torch

    params = list(params)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"dense optimizer must be one of {DENSE_OPTIMIZERS}, got {name!r}")
