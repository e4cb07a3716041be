"""Disaggregated Multi-Tower on real gloo process groups, T = 4 as 2 hosts x 2 workers.

SPTT changes no number: with pass-through towers it equals the flat exchange of the same shards
and TorchRec's own DMP (the flat engine) given the same initial tables, for M = 1 and M = 2,
losses, embeddings and dense weights within 1e-6; multi-hot tables (row-wise, reduce-scatter)
too. The run's metrics show the cross-host all-to-all shrink from T workers to N towers and
its bytes by the tower modules' compression ratio. Tower modules stay identical on the workers
that run them, the replica sync and in-memory snapshots cover tower models. Each test spawns one
set of workers; what they return is checked here, in the parent."""

import pytest
import torch
import torch.distributed as dist

from recgrid.data.specs import SPARSE_NAMES, get_spec
from recgrid.engine.grid import Grid
from recgrid.engine.towers import TowerConfig, TowerError, TowerLayout, strided_partition
from recgrid.launch.local import run_local
from recgrid.launch.smoke import random_batches
from helpers import engine_config

SPEC = get_spec("tiny")
W = 2  # workers per emulated host
STEPS = 20


JOB = ("train.seed=7", "grid.sync_every=5")  # the towers' engine: `engine_config(*JOB, ...)`


def _dense(model) -> dict:
    from recgrid.train.trainer import dense_named_parameters

    return {n.split("model.", 1)[1]: p.detach().clone() for n, p in dense_named_parameters(model)}


def _torchrec_shards(model) -> dict:
    """The flat (TorchRec DMP) trainer's local table shards by (table, row offset, column offset):
    views of its kernels' storage, read through the DMP's state dict (DTensors of local shards)."""
    out = {}
    for key, v in model.state_dict().items():
        if ".embedding_bags." not in key:
            continue
        table = key.split(".embedding_bags.")[1].split(".")[0]
        local = v.to_local()
        for shard, offset in zip(local.local_shards(), local.local_offsets()):
            out[(table, int(offset[0]), int(offset[1]))] = shard
    return out


def _multi_hot_batches(spec, batch_size, seed):
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    g = torch.Generator().manual_seed(seed)
    while True:
        lengths, values = [], []
        for rows, size in zip(spec.table_rows, spec.bag_sizes):
            ln = torch.randint(0, size + 1, (batch_size,), generator=g)
            values.append((rows * torch.rand(int(ln.sum()), generator=g).pow(3)).long().clamp_max(rows - 1))
            lengths.append(ln)
        yield Batch(dense_features=torch.rand(batch_size, 13, generator=g),
                    sparse_features=KeyedJaggedTensor.from_lengths_sync(
                        keys=list(SPARSE_NAMES), values=torch.cat(values), lengths=torch.cat(lengths).int()),
                    labels=(torch.rand(batch_size, generator=g) < 0.25).float())


def _run(trainer, batches) -> dict:
    from recgrid.engine.sptt import tower_shards

    losses = trainer.run(iter(batches), len(batches)).losses
    trainer.close()
    shards = tower_shards(trainer.model) if trainer.config.towers else _torchrec_shards(trainer.model)
    return {"losses": losses, "dense": _dense(trainer.model),
            "emb": {k: (v[0] if isinstance(v, tuple) else v).detach().clone() for k, v in shards.items()},
            "moment": {k: v[1].detach().clone() for k, v in shards.items() if isinstance(v, tuple)}}


# ---- acceptance 1: SPTT == flat ---------------------------------------------------------------------
def sptt_equals_flat(steps: int) -> dict:
    from recgrid.engine.sptt import init_shard
    from recgrid.engine.towers import LocalShard, tower_plan
    from recgrid.train.trainer import Trainer

    rank = dist.get_rank()
    single = [b for b, _ in zip(random_batches(SPEC, 32, seed=rank), range(steps))]
    multi_spec = get_spec("tiny+multihot")
    multi = [b for b, _ in zip(_multi_hot_batches(multi_spec, 16, seed=rank), range(steps // 2))]
    out = {}
    for M in (1, 2):
        grid = Grid(4, M, workers_per_node=W)
        towers = TowerConfig.strided(2)
        # the flat engine (TorchRec's DMP, ShardingEnv2D when M = 2) on the towers' plan, with the
        # towers' initial tables copied in
        plan = tower_plan(SPEC, engine_config(*JOB).model, towers, grid, "cpu")
        flat = Trainer.build(grid, engine_config(*JOB), torch.device("cpu"), plan=plan)
        with torch.no_grad():
            for (table, r0, c0), shard in _torchrec_shards(flat.model).items():
                f = SPARSE_NAMES.index(table[2:])
                shard.copy_(init_shard(7, f, SPEC.table_rows[f], 16, LocalShard(f, False, r0, shard.shape[0], c0,
                                                                                   shard.shape[1])))
        out[M] = {"torchrec": _run(flat, single)}
        for exchange in ("flat", "sptt"):
            t = Trainer.build(grid, engine_config(*JOB, towers=TowerConfig.strided(2, exchange=exchange)),
                              torch.device("cpu"))
            out[M][exchange] = _run(t, single)
        for exchange in ("flat", "sptt"):  # multi-hot: row-wise shards, the intra-tower reduce-scatter
            t = Trainer.build(grid, engine_config(*JOB, towers=TowerConfig.strided(2, exchange=exchange), spec=multi_spec),
                              torch.device("cpu"))
            out[M][f"multi_{exchange}"] = _run(t, multi)
        out[M]["plan"] = {k: v.sharding_type for k, v in flat.plan.plan["model.sparse_arch.embedding_bag_collection"].items()}
        out[M]["multi_types"] = sorted({v.sharding_type for v in t.plan.plan[
            "model.sparse_arch.embedding_bag_collection"].values()})
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def equality():
    return run_local(sptt_equals_flat, 4, STEPS)


@pytest.mark.parametrize("M", [1, 2])
def test_sptt_equals_flat_exchange_and_torchrec(equality, M):
    for r in equality:
        res = r[M]
        ref, flat, sptt = res["torchrec"], res["flat"], res["sptt"]
        assert len(ref["losses"]) == len(sptt["losses"]) == STEPS and ref["losses"][0] != ref["losses"][-1]
        for other in (flat, sptt):
            assert max(abs(x - y) for x, y in zip(ref["losses"], other["losses"])) <= 1e-6
            assert _max_diff(ref["emb"], other["emb"]) <= 1e-6
            assert _max_diff(ref["dense"], other["dense"]) <= 1e-6
        assert _max_diff(flat["moment"], sptt["moment"]) <= 1e-6
        assert set(res["plan"].values()) == {"column_wise"}


@pytest.mark.parametrize("M", [1, 2])
def test_sptt_equals_flat_with_multi_hot_row_wise_tables(equality, M):
    for r in equality:
        flat, sptt = r[M]["multi_flat"], r[M]["multi_sptt"]
        assert r[M]["multi_types"] == ["column_wise", "row_wise"]
        assert max(abs(x - y) for x, y in zip(flat["losses"], sptt["losses"])) <= 1e-6
        assert _max_diff(flat["emb"], sptt["emb"]) <= 1e-6
        assert _max_diff(flat["dense"], sptt["dense"]) <= 1e-6


def test_replicas_of_a_tower_model_are_synced(equality):
    # M = 2, K = 5, 20 steps: the run ended on a sync, so replica peers hold the same shards
    grid = Grid(4, 2, workers_per_node=W)
    for a, b in grid.replica_groups:
        ea, eb = equality[a][2]["sptt"]["emb"], equality[b][2]["sptt"]["emb"]
        assert ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)


# ---- acceptance 2: world sizes and bytes, from the run's metrics ---------------------------------------
def exchange_figures(steps: int) -> dict:
    from recgrid.train.trainer import Trainer

    rank = dist.get_rank()
    batches = [b for b, _ in zip(random_batches(SPEC, 32, seed=rank), range(steps))]
    grid = Grid(4, 1, workers_per_node=W)
    uneven = (SPARSE_NAMES[:12], SPARSE_NAMES[12:])  # 12 and 14 features: CR 2 is exact
    runs = {"flat": None, "pass": TowerConfig(uneven), "dlrm": TowerConfig(uneven, module="dlrm", compression=2),
            "dcn": TowerConfig(uneven, module="dcn", compression=2)}
    out = {}
    for name, towers in runs.items():
        # the flat run: table-wise, whose pooled all-to-all spans the sharding group (TorchRec's
        # table-row-wise, which "auto" picks across hosts, exchanges in two levels; not metered)
        t = Trainer.build(grid, engine_config(*JOB, "grid.sync_every=1", f"model.arch={'dcn' if name == 'dcn' else 'dlrm'}",
                                              "model.sharding=table_wise", towers=towers), torch.device("cpu"))
        modules = [m for m in t.model.modules() if type(m).__name__.endswith("TowerModule")]
        before = [p.detach().clone() for m in modules for p in m.parameters()]
        losses = t.run(iter(batches), steps).losses
        out[name] = {"metrics": t.exchange.metrics(t.groups.global_pg), "losses": losses,
                     "tm": [p.detach().clone() for m in modules for p in m.parameters()], "tm_before": before,
                     "snapshot": None}
        if name == "dlrm":  # snapshots of a tower model: restore into a fresh trainer, bit for bit
            snap = t.snapshot()
            b = Trainer.build(grid, engine_config(*JOB, "grid.sync_every=1", towers=towers), torch.device("cpu"))
            b.load_snapshot(snap, None)
            out[name]["snapshot"] = (all(torch.equal(x, y) for x, y in zip(b.shard_tensors(), snap.shard))
                                     and all(torch.equal(v, b.dense_state()[k]) for k, v in snap.dense.items()))
    return out


@pytest.fixture(scope="module")
def figures():
    return run_local(exchange_figures, 4, 4)


def test_cross_host_all_to_all_shrinks_to_the_towers(figures):
    m = figures[0]
    flat, sptt = m["flat"]["metrics"], m["pass"]["metrics"]
    assert flat["exchange/world_size/flat"] == flat["exchange/world_size/cross_host"] == 4  # T
    assert sptt["exchange/world_size/cross_tower"] == sptt["exchange/world_size/cross_host"] == 2  # towers
    assert sptt["exchange/world_size/intra_tower"] == 2 and "exchange/bytes/flat" not in sptt
    # a tower is one host: the intra-tower step never leaves it, every cross-tower byte does
    assert sptt["exchange/bytes/cross_host"] == sptt["exchange/bytes/cross_tower"] > 0
    assert sptt["exchange/bytes/intra_host"] == sptt["exchange/bytes/intra_tower"] > 0
    # pass-through moves what the flat exchange moves across hosts (same samples, same columns)
    assert sptt["exchange/bytes/cross_host"] == flat["exchange/bytes/cross_host"]


@pytest.mark.parametrize("kind", ["dlrm", "dcn"])
def test_tower_modules_cut_cross_host_bytes_by_cr(figures, kind):
    passthrough, compressed = figures[0]["pass"]["metrics"], figures[0][kind]["metrics"]
    assert passthrough["exchange/bytes/cross_host"] / compressed["exchange/bytes/cross_host"] == 2.0
    assert compressed["exchange/world_size/cross_host"] == 2
    assert compressed["exchange/bytes/intra_tower"] == passthrough["exchange/bytes/intra_tower"]
    # each tower's module trained, and stayed identical on the workers that run it
    layout = TowerLayout(Grid(4, 1, workers_per_node=W), 2)
    for group in layout.module_groups():
        first = figures[group[0]][kind]
        assert any(not torch.equal(a, b) for a, b in zip(first["tm"], first["tm_before"]))
        for r in group[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first["tm"], figures[r][kind]["tm"]))


def test_snapshot_of_a_tower_model_restores_exactly(figures):
    assert all(r["dlrm"]["snapshot"] for r in figures)


# ---- layout and config, no processes ---------------------------------------------------------------------
def test_tower_layout_peers_and_groups():
    grid = Grid(8, 2, workers_per_node=4)  # 2 hosts; each sharding group has 2 workers per host
    layout = TowerLayout(grid, 2)
    assert grid.sharding_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.tower_size == 2 and layout.peer_order() == [0, 2, 1, 3]
    assert layout.intra_tower_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]  # each on one host
    assert layout.peer_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]  # across the hosts
    assert layout.module_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a tower's host, all sharding groups
    with pytest.raises(TowerError, match="divide"):
        TowerLayout(grid, 3)
    with pytest.raises(TowerError, match="straddle"):
        TowerLayout(Grid(12, 1, workers_per_node=4), 4)  # towers of 3 on hosts of 4


def test_tower_config_partitions_and_outputs(tmp_path):
    from recgrid.engine.towers import load_partition, write_partition

    assert strided_partition(4)[1] == ("C2", "C6", "C10", "C14", "C18", "C22", "C26")
    tc = TowerConfig.strided(2, module="dlrm", compression=4)
    assert tc.outputs() == (3, 3) and tc.effective_compression() == pytest.approx(26 / 6)
    write_partition(tmp_path / "p.json", strided_partition(3), strategy="coherent")
    assert TowerConfig.from_option(str(tmp_path / "p.json")).partition == load_partition(tmp_path / "p.json")
    with pytest.raises(TowerError, match="once"):
        TowerConfig((SPARSE_NAMES[:10], SPARSE_NAMES[9:]))
