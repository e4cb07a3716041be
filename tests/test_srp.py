"""Sparse Row-wise Parallelism (engine.srp) on real gloo process groups: the same steps on the
same batches with TorchRec's dense row-wise reduce-scatter and with SRP's sparse all-to-all give
the same losses, shards, AdaGrad moments and dense weights, at M = 1 (L = 4) and M = 2 (L = 2,
with replica syncs), one-hot and multi-hot; SRP sends fewer bytes. One spawn of four processes
runs all eight trainings; the parent checks what they return."""

import pytest
import torch
import torch.distributed as dist

from recgrid.config import ConfigError, load_config
from recgrid.data.specs import get_spec
from recgrid.engine.grid import Grid
from recgrid.launch.local import run_local

STEPS = 20
SPECS = ("tiny", "tiny+multihot")


def srp_vs_dense(steps: int, sync_every: int) -> dict:
    from recgrid.config import defaults
    from recgrid.data.stream import synthetic_batches
    from recgrid.engine.sync import embedding_weights, optimizer_states
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    T, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for M in (1, 2):
        grid = Grid(T, M)
        for name in SPECS:
            spec = get_spec(name)
            batches = synthetic_batches(spec, 32, steps, seed=3, stream=rank)
            runs = [("dense", None), ("sparse", None)]
            if M == 1 and name == "tiny":  # TorchRec's train pipeline runs the input dist a step ahead
                runs.append(("sparse", True))
            for exchange, pipeline in runs:
                config = EngineConfig.from_job(defaults(), spec=spec, sharding="row_wise", row_wise_exchange=exchange,
                                               lr=0.05, sync_every=sync_every, seed=7)
                state = Trainer.build(grid, config, torch.device("cpu"), pipeline=pipeline)
                result = state.run(iter(batches), steps)
                metrics = state.exchange.metrics(state.groups.global_pg)
                state.replica_sync.close()
                out[(M, name, exchange + ("+pipeline" if pipeline else ""))] = {
                    "losses": list(result.losses),
                    "emb": [w.detach().clone() for w in embedding_weights(state.model)],
                    "moments": [s.clone() for s in optimizer_states(state.model)],
                    "dense": torch.cat([p.detach().reshape(-1) for n, p in state.model.named_parameters()
                                        if "embedding_bag" not in n]),
                    "bytes": metrics.get("exchange/bytes/row_wise"),
                    "flat": metrics.get("exchange/bytes/flat"),
                    "syncs": state.replica_sync.stats.count if M > 1 else 0,
                }
    return out


@pytest.fixture(scope="module")
def results():
    return run_local(srp_vs_dense, 4, STEPS, 5)


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("name", SPECS)
def test_sparse_exchange_equals_torchrec_dense_row_wise(results, M, name):
    for r in results:
        dense, sparse = r[(M, name, "dense")], r[(M, name, "sparse")]
        assert len(dense["losses"]) == len(sparse["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(dense["losses"], sparse["losses"])) <= 1e-6
        assert dense["losses"][0] != dense["losses"][-1]  # it trained
        for kind in ("emb", "moments"):
            assert len(dense[kind]) == len(sparse[kind]) == 26  # every table has a row-wise shard here
            for a, b in zip(dense[kind], sparse[kind]):
                assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-6)
        assert sum(float(m.abs().sum()) for m in sparse["moments"]) > 0  # AdaGrad moments moved
        assert (dense["dense"] - sparse["dense"]).abs().max() <= 1e-6
        if M == 2:
            assert dense["syncs"] == sparse["syncs"] == STEPS // 5  # the replica sync ran


def test_sparse_exchange_under_torchrec_train_pipeline(results):
    for r in results:
        dense, piped = r[(1, "tiny", "dense")], r[(1, "tiny", "sparse+pipeline")]
        assert len(piped["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(dense["losses"], piped["losses"])) <= 1e-6
        for a, b in zip(dense["emb"] + dense["moments"], piped["emb"] + piped["moments"]):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)
        assert (dense["dense"] - piped["dense"]).abs().max() <= 1e-6


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("name", SPECS)
def test_sparse_exchange_sends_fewer_bytes(results, M, name):
    r = results[0]  # the meter's figures are means over all workers: the same on every rank
    dense, sparse = r[(M, name, "dense")]["bytes"], r[(M, name, "sparse")]["bytes"]
    assert dense > 0 and sparse > 0
    assert sparse <= dense
    assert r[(M, name, "sparse")]["flat"] == sparse  # all tables row-wise: the whole flat exchange
    # dense: each worker sends each of its L - 1 peers 32 bags x 26 tables x 16 floats
    L = 4 // M
    assert dense == 32 * 26 * 16 * 4 * (L - 1)
    if (M, name) == (1, "tiny"):  # L = 4, one-hot: a bag has ids on one shard of four
        assert sparse <= 0.6 * dense


@pytest.mark.parametrize("overrides, message", [
    (["model.row_wise_exchange=sparse"], r"^model\.row_wise_exchange: sparse .* model\.sharding is auto"),
    (["model.row_wise_exchange=sparse", "model.sharding=table_wise"], r"^model\.row_wise_exchange: .* table_wise"),
    (["model.row_wise_exchange=sparse", "model.sharding=column_wise"], r"^model\.row_wise_exchange: "),
    (["model.row_wise_exchange=sparse", "model.sharding=table_column_wise"], r"^model\.row_wise_exchange: "),
    (["model.row_wise_exchange=sparse", "model.sharding=table_row_wise"], r"^model\.row_wise_exchange: "),
    (["model.row_wise_exchange=sparse", "model.sharding=grid_shard"], r"^model\.row_wise_exchange: "),
    (["model.row_wise_exchange=sparse", "model.sharding=row_wise", "model.towers=2"],
     r"^model\.row_wise_exchange: sparse \(SRP\) does not apply to model\.towers"),
    (["model.row_wise_exchange=thin"], r"^model\.row_wise_exchange: must be one of \['dense', 'sparse'\]"),
])
def test_sparse_exchange_refused_without_row_wise_shards(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.train=s3://bucket/x/*.parquet", *overrides])
    assert load_config(None, ["data.train=s3://bucket/x/*.parquet", "model.row_wise_exchange=sparse",
                              "model.sharding=row_wise"]).model.row_wise_exchange == "sparse"


def test_expected_occupancy_and_bytes():
    from recgrid.engine.srp import expected_exchange_bytes, expected_occupancy

    assert expected_occupancy(1, 4) == pytest.approx(0.25)
    assert expected_occupancy(3, 2) == pytest.approx(1 - 0.5 ** 3)
    assert expected_occupancy(5, 1) == 1.0 and expected_occupancy(0, 4) == 0.0
    dense = expected_exchange_bytes(32, [16] * 26, [1] * 26, 4, sparse=False)
    assert dense == 32 * 3 * 26 * 16 * 4
    assert expected_exchange_bytes(32, [16] * 26, [1] * 26, 4, sparse=True) == pytest.approx(dense / 4)
    assert expected_exchange_bytes(32, [16], [1], 1, sparse=False) == 0.0
