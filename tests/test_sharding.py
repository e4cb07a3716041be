"""Sharding-plan decisions that a GPU job depends on, checked on CPU without process groups:
shard placements name the device each worker reads (not one computed from ranks), the planner
fills the job's GPU memory (not TorchRec's 32 GiB default), and elastic jobs keep away from the
sharding types whose process groups span the whole world."""

import pytest
import torch
from torch import nn

from recgrid.data.specs import get_spec
from recgrid.engine.grid import Grid
from recgrid.engine.model import ModelSpec, build_model
from recgrid.engine.optimizer import MomentScaledRowWiseAdagrad
from recgrid.engine.sharding import make_plan, remap_plan, sharding_summary

FUSED = MomentScaledRowWiseAdagrad(lr=0.05, eps=1e-8, moment_scale=1).fused_params()
GiB = 2**30


def _placements(plan) -> dict[int, set[str]]:
    """global rank -> the placement devices of the shards on it"""
    out: dict[int, set[str]] = {}
    for module_plan in plan.plan.values():
        for ps in module_plan.values():
            for shard in ps.sharding_spec.shards:
                out.setdefault(shard.placement.rank(), set()).add(str(shard.placement.device()))
    return out


@pytest.fixture(scope="module")
def tiny_plan_l3():
    # T=6 on nodes of 4 + 2 workers: an elastic attempt's grid knows no workers_per_node
    return make_plan(build_model(get_spec("tiny"), ModelSpec()), Grid(6, 2), "cpu", FUSED, "table_wise")


def test_cuda_placements_name_each_workers_own_device(tiny_plan_l3):
    grid = Grid(6, 2)  # host-local: sharding group 0 = ranks [0, 2, 4], group 1 = [1, 3, 5]
    assert grid.workers_per_node is None and grid.sharding_groups == [[0, 2, 4], [1, 3, 5]]
    # what each worker read from torch.cuda.current_device(): ranks 0-3 on node 0, 4-5 on node 1
    read = {0: 0, 1: 1, 2: 2, 3: 3, 4: 0, 5: 1}
    got = _placements(remap_plan(tiny_plan_l3, grid, 0, "cuda", read))
    assert got == {0: {"cuda:0"}, 2: {"cuda:2"}, 4: {"cuda:0"}}  # rank 4 is the second node's first GPU, not cuda:4
    got = _placements(remap_plan(tiny_plan_l3, grid, 1, "cuda", read))
    assert got == {1: {"cuda:1"}, 3: {"cuda:3"}, 5: {"cuda:1"}}
    # the brief's shape: a gathered [0, 1, 0] over one sharding group's three workers
    got = _placements(remap_plan(tiny_plan_l3, grid, 0, "cuda", dict(zip([0, 2, 4], [0, 1, 0]))))
    assert [got[r] for r in (0, 2, 4)] == [{"cuda:0"}, {"cuda:1"}, {"cuda:0"}]


def test_cpu_placements_carry_no_index(tiny_plan_l3):
    got = _placements(remap_plan(tiny_plan_l3, Grid(6, 2), 1, "cpu", None))
    assert got == {1: {"cpu"}, 3: {"cpu"}, 5: {"cpu"}}


def test_cuda_placement_without_the_workers_device_is_refused(tiny_plan_l3):
    with pytest.raises(ValueError, match="device index of rank 4"):
        remap_plan(tiny_plan_l3, Grid(6, 2), 0, "cuda", {0: 0, 2: 1})


# ---- the planner's GPU memory ---------------------------------------------------------------------
def _big_tables() -> nn.Module:
    """Two 40 GiB fp32 tables (dim 128) on the meta device: 80 GiB over L = 2 GPUs, 40 GiB each."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    rows = 40 * GiB // (128 * 4)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=128, num_embeddings=rows, feature_names=[f"f{i}"])
              for i in range(2)]
    return nn.ModuleDict({"ebc": EmbeddingBagCollection(tables=tables, device=torch.device("meta"))})


def test_planner_fills_the_gpus_memory_not_torchrecs_default():
    from torchrec.distributed.planner.constants import HBM_CAP
    from torchrec.distributed.planner.types import PlannerError

    assert HBM_CAP == 32 * GiB  # TorchRec's default, which the plan used to get on every GPU
    plan = make_plan(_big_tables(), Grid(2, 1), "cuda", FUSED, "auto", hbm_cap=80 * GiB)
    assert len(sharding_summary(plan)) == 2
    with pytest.raises(PlannerError):
        make_plan(_big_tables(), Grid(2, 1), "cuda", FUSED, "auto", hbm_cap=HBM_CAP)


@pytest.mark.skipif(torch.cuda.is_available(), reason="reads this machine's GPU memory instead")
def test_cuda_plan_without_device_memory_says_so():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        make_plan(_big_tables(), Grid(2, 1), "cuda", FUSED, "auto")


