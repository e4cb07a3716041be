"""Moment-scaled row-wise AdaGrad: FBGEMM's fused kernel, driven by our fused parameters,
against the update written out explicitly, and c = 1 against plain row-wise AdaGrad."""

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recgrid.engine.optimizer import MomentScaledRowWiseAdagrad, dense_optimizer, reference_step

ROWS, DIM, LR, EPS = 12, 4, 0.1, 1e-3
# (ids, offsets) per step: repeated ids inside and across bags, some rows never touched
STEPS = [
    (torch.tensor([1, 3, 3, 7]), torch.tensor([0, 2, 4])),
    (torch.tensor([0, 1, 11, 3, 5]), torch.tensor([0, 3, 5])),
    (torch.tensor([7, 7, 7, 2]), torch.tensor([0, 1, 4])),
]


def _fused_kernel(c: float) -> SplitTableBatchedEmbeddingBagsCodegen:
    fp = MomentScaledRowWiseAdagrad(lr=LR, eps=EPS, moment_scale=c).fused_params()
    torch.manual_seed(0)
    k = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=fp["optimizer"], learning_rate=fp["learning_rate"], eps=fp["eps"], pooling_mode=PoolingMode.SUM,
    )
    with torch.no_grad():
        k.split_embedding_weights()[0].copy_(torch.linspace(-1, 1, ROWS * DIM).reshape(ROWS, DIM))
    return k


def _known_grads(step: int, bags: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(bags, DIM, generator=g)


def _run_fused(c: float) -> tuple[torch.Tensor, torch.Tensor]:
    k = _fused_kernel(c)
    for s, (ids, offsets) in enumerate(STEPS):
        out = k(ids, offsets)
        out.backward(_known_grads(s, len(offsets) - 1))
    return k.split_embedding_weights()[0].detach().clone(), k.get_optimizer_state()[0]["sum"].clone()


def _run_reference(c: float) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.linspace(-1, 1, ROWS * DIM).reshape(ROWS, DIM)
    v = torch.zeros(ROWS)
    for s, (ids, offsets) in enumerate(STEPS):
        bag_grads = _known_grads(s, len(offsets) - 1)
        bag_of_id = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets.diff())
        reference_step(w, v, ids, bag_grads[bag_of_id], LR, EPS, c)
    return w, v


@pytest.mark.parametrize("c", [1.0, 2.0, 4.0])
def test_fused_kernel_matches_explicit_reference(c):
    w, v = _run_fused(c)
    w_ref, v_ref = _run_reference(c)
    assert torch.allclose(v, v_ref, atol=1e-6, rtol=0)
    assert torch.allclose(w, w_ref, atol=1e-6, rtol=0)
    assert (w - torch.linspace(-1, 1, ROWS * DIM).reshape(ROWS, DIM)).abs().max() > 1e-2  # it did move


def test_moment_scale_changes_the_step():
    w1, _ = _run_fused(1.0)
    w4, _ = _run_fused(4.0)
    # larger c divides the moment: bigger effective steps on the touched rows
    assert (w4 - w1).abs().max() > 1e-3


def test_c1_equals_plain_rowwise_adagrad():
    w_fused, v_fused = _run_fused(1.0)
    bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum")
    with torch.no_grad():
        bag.weight.copy_(torch.linspace(-1, 1, ROWS * DIM).reshape(ROWS, DIM))
    opt = RowWiseAdagrad([bag.weight], lr=LR, eps=EPS)
    for s, (ids, offsets) in enumerate(STEPS):
        opt.zero_grad()
        out = bag(ids, offsets[:-1])
        out.backward(_known_grads(s, len(offsets) - 1))
        opt.step()
    state_sum = opt.state[bag.weight]["sum"].reshape(-1)
    assert torch.allclose(v_fused, state_sum, atol=1e-6, rtol=0)
    assert torch.allclose(w_fused, bag.weight.detach(), atol=1e-6, rtol=0)


def test_fused_params_scale_lr_and_eps_by_root_c():
    fp = MomentScaledRowWiseAdagrad(lr=0.1, eps=1e-4, moment_scale=4.0).fused_params()
    assert fp["learning_rate"] == pytest.approx(0.2) and fp["eps"] == pytest.approx(2e-4)


@pytest.mark.parametrize("field,value", [("lr", -0.1), ("eps", 0.0), ("moment_scale", 0)])
def test_invalid_values_are_named(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a positive number, got {value}"):
        MomentScaledRowWiseAdagrad(**{"lr": 0.05, "eps": 1e-8, "moment_scale": 1.0, field: value})


@pytest.mark.parametrize("name,cls", [("adagrad", torch.optim.Adagrad), ("adam", torch.optim.Adam), ("sgd", torch.optim.SGD)])
def test_dense_optimizers(name, cls):
    assert isinstance(dense_optimizer(name, [torch.nn.Parameter(torch.zeros(2))], 0.1), cls)
    with pytest.raises(ValueError, match="'rmsprop'"):
        dense_optimizer("rmsprop", [torch.nn.Parameter(torch.zeros(2))], 0.1)
