"""The 2-D engine on real gloo process groups: M = 1 equals TorchRec's plain model parallelism,
replica syncs make peers identical and equal to their mean, delayed moment sync follows its
formula, and every sharding type runs on CPU. Each test spawns one set of worker processes and
checks everything it returns here, in the parent, independently of the code under test."""

import pytest
import torch
import torch.distributed as dist

from recgrid.engine.grid import Grid
from recgrid.launch.local import run_local
from recgrid.launch.smoke import random_batches
from recgrid.data.specs import get_spec
from helpers import engine_config

SPEC = get_spec("tiny")
QR_HEAD = "qr_head"  # sync_probe's name for a QR-compressed model with a head cache (row-wise shards)
SEED = "train.seed=7"


def _snapshot(model):
    from recgrid.engine.sync import embedding_weights, optimizer_states

    return ([w.detach().clone() for w in embedding_weights(model)], [s.clone() for s in optimizer_states(model)])


def _dense(model):
    return torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters() if "embedding_bag" not in n])


# ---- acceptance 2: M = 1 is TorchRec's ordinary model parallelism ---------------------------------
def m1_vs_plain_dmp(steps: int) -> dict:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from recgrid.engine.model import build_model
    from recgrid.engine.sync import embedding_weights
    from recgrid.train.trainer import Trainer

    T, rank = dist.get_world_size(), dist.get_rank()
    batches = [b for b, _ in zip(random_batches(SPEC, 32, seed=rank), range(steps))]
    grid = Grid(T, 1)
    config = engine_config(SEED, "model.sharding=table_wise")

    state = Trainer.build(grid, config, torch.device("cpu"))
    ours = state.run(iter(batches), steps)

    # The baseline, written as a TorchRec user would, sharing nothing with recgrid but the model.
    model = build_model(SPEC, config.model, seed=config.seed)
    opt = config.embedding_optimizer(grid.num_groups)
    sharder = EmbeddingBagCollectionSharder(fused_params=opt.fused_params())  # c = M = 1: plain lr, eps
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=["table_wise"]) for f in SPEC_FEATURES}
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=T, compute_device="cpu"),
                                    constraints=constraints).collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense_opt = torch.optim.Adagrad([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())],
                                    lr=config.dense_lr)
    plain_losses = []
    for b in batches:
        dense_opt.zero_grad()
        loss, _ = dmp(b)
        loss.backward()
        dense_opt.step()
        plain_losses.append(float(loss))
    return {
        "losses": (ours.losses, plain_losses),
        "emb": ([w.clone() for w in embedding_weights(state.model)], [w.clone() for w in embedding_weights(dmp)]),
        "dense": (_dense(state.model), _dense(dmp)),
    }


SPEC_FEATURES = [f"C{i}" for i in range(1, 27)]


def test_m1_equals_plain_distributed_model_parallel():
    for rank_result in run_local(m1_vs_plain_dmp, 2, 20):
        ours, plain = rank_result["losses"]
        assert len(ours) == len(plain) == 20
        assert max(abs(a - b) for a, b in zip(ours, plain)) <= 1e-6
        emb_ours, emb_plain = rank_result["emb"]
        assert len(emb_ours) == len(emb_plain) > 0
        for a, b in zip(emb_ours, emb_plain):
            assert a.shape == b.shape and (a - b).abs().max() <= 1e-6
        d_ours, d_plain = rank_result["dense"]
        assert (d_ours - d_plain).abs().max() <= 1e-6
        assert ours[0] != ours[-1]  # it trained


# ---- acceptance 3, 4 (and every sharding type on CPU) --------------------------------------------
def _qr_compression():
    """QR (mult, c = 4) of tiny's tables over 2000 rows, with a head cache of each one's 64 most
    frequent ids in synthetic data (acceptance 2 of the RecScale issue, engine side)."""
    import numpy as np

    from recgrid.data.specs import Compression, head_from_counts
    from recgrid.data.synth import synth_table

    comp = Compression(threshold_rows=2000, collisions=4, operation="mult", head_rows=64)
    table = synth_table(SPEC, 4096, seed=7)
    return comp.with_heads({f: head_from_counts(*np.unique(table.column(f"C{f + 1}").to_numpy(), return_counts=True),
                                                head_rows=64) for f in comp.features(SPEC)})


def sync_probe(sharding_types: list[str], steps: int, sync_every: int, delayed: bool = False) -> dict:
    from recgrid.data.stream import synthetic_batches
    from recgrid.engine.sharding import sharding_summary
    from recgrid.train.trainer import Trainer

    T, rank = dist.get_world_size(), dist.get_rank()
    grid = Grid(T, 2)
    out = {}
    for st in sharding_types:
        if st == QR_HEAD:  # row-wise shards of QR-compressed tables with a head cache, fed by the id transform
            comp = _qr_compression()
            config = engine_config(SEED, "model.sharding=row_wise", sync_every=sync_every,
                                   delayed_moment_sync=delayed).with_compression(comp)
            batches = iter(synthetic_batches(SPEC, 32, steps, seed=7, stream=rank + 1, compression=comp))
        else:
            config = engine_config(SEED, f"model.sharding={st}", sync_every=sync_every, delayed_moment_sync=delayed)
            batches = random_batches(SPEC, 32, seed=rank)
        state = Trainer.build(grid, config, torch.device("cpu"))
        pre, post = [], []
        state.replica_sync.before_sync.append(lambda s: pre.append(_snapshot(state.model)))
        state.replica_sync.after_sync.append(lambda s: post.append(_snapshot(state.model)))
        aligned = _snapshot(state.model)  # right after build: replicas aligned
        result = state.run(batches, steps)
        state.replica_sync.close()
        kernel_lrs = sorted({k.get_learning_rate() for k in _kernels(state.model)})
        out[st] = {"pre": pre, "post": post, "aligned": aligned, "dense": _dense(state.model),
                   "plan": sharding_summary(state.plan), "lr": kernel_lrs, "bytes": state.replica_sync.stats.bytes,
                   "losses": result.losses}
    return out


def _kernels(model):
    from recgrid.engine.sync import embedding_kernels

    return embedding_kernels(model)


def _peers(grid):
    return grid.replica_groups


def _check_synced(results, grid, st, n_syncs):
    for group in _peers(grid):
        a, b = (results[r][st] for r in group)
        assert len(a["pre"]) == len(a["post"]) == n_syncs
        # at start the two copies are the same (aligned from one sharding group)
        for x, y in zip(a["aligned"][0], b["aligned"][0]):
            assert torch.equal(x, y)
        for i in range(n_syncs):
            for kind in (0, 1):  # 0: embedding weights, 1: optimizer states
                pre_a, pre_b, post_a, post_b = a["pre"][i][kind], b["pre"][i][kind], a["post"][i][kind], b["post"][i][kind]
                assert len(pre_a) == len(pre_b) > 0
                # before a sync the copies have drifted apart (each saw its own data) ...
                assert max((x - y).abs().max() for x, y in zip(pre_a, pre_b)) > 0
                for x, y, p, q in zip(post_a, post_b, pre_a, pre_b):
                    assert torch.equal(x, y)  # ... after it they are bit-identical
                    assert (x - (p + q) / 2).abs().max() <= 1e-6  # and equal to the mean of the peers


@pytest.fixture(scope="module")
def sync_results():
    types = ["table_wise", "column_wise", "row_wise", "table_row_wise", "grid_shard", "table_column_wise", "auto",
             QR_HEAD]
    return types, run_local(sync_probe, 4, types, 10, 5)


@pytest.mark.parametrize("st", ["table_wise", "column_wise", "row_wise"])
def test_sync_makes_replicas_identical_and_equal_to_mean(sync_results, st):
    types, results = sync_results
    _check_synced(results, Grid(4, 2), st, n_syncs=2)
    # dense parameters are identical on all four workers (DDP over the global group)
    for r in results[1:]:
        assert torch.equal(r[st]["dense"], results[0][st]["dense"])


def test_sharding_types_really_shard(sync_results):
    _, results = sync_results
    plan = {st: results[0][st]["plan"] for st in results[0]}
    assert all(v.startswith("table_wise@") and "," not in v for v in plan["table_wise"].values())
    assert all(v == "row_wise@0,1" for v in plan["row_wise"].values())
    assert all(v == "column_wise@0,1" for v in plan["column_wise"].values())
    # the shards a worker holds differ with the type: row-wise halves every table
    rw_rows = sum(w.shape[0] for w in results[0]["row_wise"]["post"][0][0])
    assert abs(rw_rows - sum(SPEC.table_rows) / 2) <= 26


@pytest.mark.parametrize("st", ["table_row_wise", "grid_shard", "table_column_wise", "auto"])
def test_other_sharding_types_run_and_sync_on_cpu(sync_results, st):
    _, results = sync_results
    _check_synced(results, Grid(4, 2), st, n_syncs=2)
    assert results[0][st]["plan"]


def test_qr_compressed_model_with_head_cache_trains_and_syncs(sync_results):
    """T=4, M=2: a QR + head-cache model's q, r and h shards (row-wise) train, and a sync makes the
    replica peers' shards identical (the mean of theirs)."""
    _, results = sync_results
    plan = results[0][QR_HEAD]["plan"]
    assert {"t_C3_h", "t_C3_q", "t_C3_r", "t_C1"} <= set(plan) and "t_C3" not in plan
    assert all(v == "row_wise@0,1" for v in plan.values())
    _check_synced(results, Grid(4, 2), QR_HEAD, n_syncs=2)
    for r in results[1:]:
        assert torch.equal(r[QR_HEAD]["dense"], results[0][QR_HEAD]["dense"])
    # a worker's shards: half of each compressed table's ceil(n / 4) + 4 + 64 rows, not half its n
    rows = sum(w.shape[0] for w in results[0][QR_HEAD]["post"][0][0])
    want = sum(r if r <= 2000 else -(-r // 4) + 4 + 64 for r in SPEC.table_rows)
    assert abs(rows - want / 2) <= 3 * 26
    losses = results[0][QR_HEAD]["losses"]
    assert len(losses) == 10 and all(0 < x < 2 for x in losses)


def test_fused_kernels_carry_the_moment_scaled_lr(sync_results):
    _, results = sync_results
    # c = M = 2: the kernel's lr is lr * sqrt(2)
    assert results[0]["table_wise"]["lr"] == [pytest.approx(0.05 * 2 ** 0.5)]


# ---- acceptance 6: delayed moment sync ------------------------------------------------------------
def test_delayed_moment_sync_follows_its_formula():
    grid = Grid(4, 2)
    results = run_local(sync_probe, 4, ["table_wise"], 8, 2, True)  # syncs after steps 2, 4, 6, 8
    for group in grid.replica_groups:
        a, b = (results[r]["table_wise"] for r in group)
        assert len(a["pre"]) == 4
        for n in range(1, 4):  # syncs 2, 3, 4 each apply the average launched at the sync before
            for me in (a, b):
                for v_after, v_now, snap, snap_a, snap_b in zip(
                        me["post"][n][1], me["pre"][n][1], me["post"][n - 1][1], a["post"][n - 1][1], b["post"][n - 1][1]):
                    expected = (snap_a + snap_b) / 2 + (v_now - snap)
                    assert (v_after - expected).abs().max() <= 1e-6
            # weights are still averaged synchronously at every sync
            for x, y, p, q in zip(a["post"][n][0], b["post"][n][0], a["pre"][n][0], b["pre"][n][0]):
                assert torch.equal(x, y) and (x - (p + q) / 2).abs().max() <= 1e-6
        # the first sync only launches the state average: states are left as they were
        for x, y in zip(a["post"][0][1], a["pre"][0][1]):
            assert torch.equal(x, y)
        # and the correction really is one sync late: states differ between peers after a sync
        assert max((x - y).abs().max() for x, y in zip(a["post"][3][1], b["post"][3][1])) > 0


def test_libraries_quiet_silences_for_a_while_and_restores() -> None:
    """engine.quiet, the one helper: loggers below ERROR and warnings silent inside, levels and
    warning filters as they were afterwards."""
    import logging
    import warnings

    from recgrid.engine.quiet import libraries_quiet

    torchrec, root = logging.getLogger("torchrec"), logging.getLogger()
    torchrec.setLevel(logging.INFO)
    levels_before, filters_before = (torchrec.level, root.level), list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with libraries_quiet(root=logging.CRITICAL):
            assert not torchrec.isEnabledFor(logging.WARNING) and root.level == logging.CRITICAL
            warnings.warn("a library's note")
        warnings.warn("recgrid's own")
    assert [str(w.message) for w in caught] == ["recgrid's own"]
    assert (torchrec.level, root.level) == levels_before and warnings.filters == filters_before
    torchrec.setLevel(logging.NOTSET)
