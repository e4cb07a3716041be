"""Failure as a normal event, without a cluster: the deterministic plan, the data cursor's
exactly-once arithmetic, the row-range reader, in-memory snapshot/restore of the trainer, and
storage checkpoints that reshard to another M and L. Real gloo process groups, real DCP."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from recgrid.data.specs import get_spec
from recgrid.data.units import DataCursor, EpochPlan, Inputs, Unit, take_rows
from recgrid.engine.grid import Grid
from recgrid.launch.local import run_local
from recgrid.launch.smoke import random_batches
from helpers import engine_config

SPEC = get_spec("tiny")

PLAN_SCRIPT = """
import json
from recgrid.data.specs import get_spec
from recgrid.engine.grid import Grid
from recgrid.engine.model import ModelSpec, build_model
from recgrid.engine.optimizer import MomentScaledRowWiseAdagrad
from recgrid.engine.sharding import make_plan, plan_record
plan = make_plan(build_model(get_spec("tiny"), ModelSpec()), Grid(4, 2), "cpu",
                 MomentScaledRowWiseAdagrad(lr=0.05, eps=1e-8, moment_scale=2).fused_params(), "auto")
print(json.dumps(plan_record(plan), sort_keys=True))
"""


# ---- acceptance 1: the same config planned three times gives the same plan --------------------------
def test_auto_plan_is_the_same_in_every_process():
    plans = []
    for seed in ("1", "2", "3"):  # TorchRec's choice used to follow the string hash seed
        p = subprocess.run([sys.executable, "-c", PLAN_SCRIPT], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONWARNINGS": "ignore"})
        assert p.returncode == 0, p.stderr[-2000:]
        plans.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert plans[0] == plans[1] == plans[2]
    assert len(plans[0]) == 26 and all(v["shards"] for v in plans[0].values())


# ---- the data cursor ----------------------------------------------------------------------------------
def _rows(inputs: Inputs, units) -> np.ndarray:
    """Global row numbers (file offset + row) of `units`."""
    offsets = np.cumsum((0,) + inputs.rows)
    return np.concatenate([np.arange(offsets[u.file] + u.start, offsets[u.file] + u.end) for u in units]) \
        if units else np.zeros(0, np.int64)


def test_epoch_split_is_exact_and_resplits_without_loss():
    inputs = Inputs(("a", "b", "c"), (1000, 333, 2500))
    plan = EpochPlan(inputs, seed=3, batch_size=16, rows_per_unit=300)
    cursor = DataCursor()
    seg = plan.segment(cursor, workers=4)
    parts = [_rows(inputs, p) for p in seg.parts]
    assert all(len(p) == seg.steps_total * 16 for p in parts)
    every = np.concatenate(parts)
    assert len(np.unique(every)) == len(every)  # disjoint
    tail = inputs.total_rows - len(every)
    assert 0 <= tail < 4 * 16  # fewer than one step of rows is left for the next epoch

    # 7 steps on 4 workers, then the job continues on 3 (elastic) and finishes the epoch
    cursor.steps = 7
    trained = np.concatenate([_rows(inputs, take_rows(p, 0, 7 * 16)) for p in seg.parts])
    state = json.loads(json.dumps(cursor.state_dict()))  # it survives a trip through JSON
    resumed = DataCursor()
    resumed.load_state_dict(state)
    seg3 = plan.segment(resumed, workers=3)
    assert resumed.steps == 0 and resumed.workers == 3
    rest = np.concatenate([_rows(inputs, p) for p in seg3.parts])
    both = np.concatenate([trained, rest])
    assert len(np.unique(both)) == len(both)  # nothing trained twice
    assert inputs.total_rows - len(both) < 3 * 16  # nothing skipped but the last partial step

    # the same split resumes at the same rows: a restore on 4 workers at step 7
    again = DataCursor()
    again.load_state_dict(state)
    seg4 = plan.segment(again, workers=4)
    assert again.steps == 7
    assert np.array_equal(_rows(inputs, seg4.part(2, 7)), _rows(inputs, take_rows(seg.parts[2], 7 * 16)))

    # epochs differ in order, not in content
    plan.next_epoch(again)
    seg_next = plan.segment(again, workers=4)
    nxt = np.concatenate([_rows(inputs, p) for p in seg_next.parts])
    assert not np.array_equal(nxt[:200], every[:200])


def test_reader_gives_exactly_the_ranges_asked_for(tmp_path):
    from recgrid.data.stream import local_batches, scan_inputs
    from recgrid.data.synth import write_synth

    write_synth(str(tmp_path / "pq"), 5000, files=2, fmt="parquet", spec=SPEC)
    write_synth(str(tmp_path / "raw"), 900, files=1, fmt="tsv", spec=SPEC)
    inputs = scan_inputs(str(tmp_path / "pq" / "*.parquet"), SPEC)
    assert inputs.rows == (2500, 2500)
    units = [Unit(1, 100, 350), Unit(0, 2400, 2500), Unit(1, 0, 30)]
    batches = list(local_batches(inputs, units, SPEC, batch_size=32, drop_last=False))
    ids = torch.cat([b.row_ids for b in batches]).numpy()
    want = np.concatenate([np.arange(2500 + 100, 2500 + 350), np.arange(2400, 2500), np.arange(2500, 2530)])
    assert np.array_equal(ids, want)
    assert [len(b.labels) for b in batches][:-1] == [32] * (len(batches) - 1)
    # shards of many row groups (prepare writes its own sizes): ranges across group boundaries
    import pyarrow.parquet as pq

    for path in inputs.files:
        table = pq.read_table(path)
        pq.write_table(table.replace_schema_metadata(pq.read_schema(path).metadata), path, row_group_size=700)
    assert pq.ParquetFile(inputs.files[1]).metadata.num_row_groups == 4
    units = [Unit(1, 650, 2150), Unit(0, 1390, 1410), Unit(1, 2099, 2500)]
    ids = torch.cat([b.row_ids for b in local_batches(inputs, units, SPEC, batch_size=64, drop_last=False)]).numpy()
    want = np.concatenate([np.arange(2500 + 650, 2500 + 2150), np.arange(1390, 1410), np.arange(2500 + 2099, 5000)])
    assert np.array_equal(ids, want)
    raw = scan_inputs(str(tmp_path / "raw" / "*"), SPEC)
    assert raw.rows == (900,)
    got = list(local_batches(raw, [Unit(0, 850, 900)], SPEC, batch_size=25))
    assert len(got) == 2 and not hasattr(got[0], "row_ids")  # raw logs carry no row ids


# ---- snapshots and storage checkpoints on real gloo process groups -------------------------------------
JOB = ("grid.sync_every=2", "train.seed=5")  # the trainers' engine here: `engine_config(*JOB, ...)`


def _qr_heads(head_rows=32):
    """QR (add, c = 8) of tiny's tables over 2000 rows with a head cache of their most frequent ids."""
    from recgrid.data.specs import Compression, head_from_counts
    from recgrid.data.synth import synth_table

    comp = Compression(threshold_rows=2000, collisions=8, operation="add", head_rows=head_rows)
    table = synth_table(SPEC, 2048, seed=5)
    return comp.with_heads({f: head_from_counts(*np.unique(table.column(f"C{f + 1}").to_numpy(), return_counts=True),
                                                head_rows=head_rows) for f in comp.features(SPEC)})


def snapshot_roundtrip() -> dict:
    """Train 6 steps, snapshot, train 4 more; a second trainer restored from the snapshot of the
    same shard position (the replica peer's copy, as a heal or a holder hands it) takes the same 4 steps."""
    from recgrid.train.trainer import Trainer

    rank, T = dist.get_rank(), dist.get_world_size()
    grid = Grid(T, 2)
    batches = [b for b, _ in zip(random_batches(SPEC, 32, seed=rank), range(10))]
    a = Trainer.build(grid, engine_config(*JOB), torch.device("cpu"))
    a.run(iter(batches[:6]), 6)  # step 6 is a sync: the replicas are equal
    snap, window = a.snapshot(), a.metrics.window_state(a.groups.global_pg)
    # hand every worker the copy its replica peer took (the other sharding group, same shard)
    peers = grid.replica_groups[a.groups.coords.shard_rank]
    gathered: list = [None] * T
    dist.all_gather_object(gathered, snap)
    mine = gathered[next(r for r in peers if r != rank)]
    after_a = [float(x) for x in a.run(iter(batches[6:]), 10).losses]
    b = Trainer.build(grid, engine_config(*JOB), torch.device("cpu"))
    b.load_snapshot(mine, window)
    restored_exact = all(torch.equal(x, y) for x, y in zip(b.shard_tensors(), mine.shard))
    own_exact = len(b.shard_tensors()) == len(snap.shard) and all(
        torch.equal(x, y) for x, y in zip(b.shard_tensors(), snap.shard))  # = this worker's own state
    dense_exact = all(torch.equal(v, b.dense_state()[k]) for k, v in mine.dense.items())
    after_b = [float(x) for x in b.run(iter(batches[6:]), 10).losses]
    a.close()
    b.close()
    drift = max((x - y).abs().max().item() for x, y in zip(a.shard_tensors(), b.shard_tensors()))
    return {"a": after_a, "b": after_b, "step": b.state.step, "restored_exact": restored_exact,
            "dense_exact": dense_exact, "drift": drift, "own_exact": own_exact}


def test_restore_from_a_peer_snapshot_continues_identically():
    for r in run_local(snapshot_roundtrip, 4):
        assert r["step"] == 10
        assert len(r["a"]) == len(r["b"]) == 4
        assert r["restored_exact"] and r["dense_exact"]  # the peer's copy, bit for bit
        assert r["own_exact"]  # = the worker's own state
        # then the same training: the CPU kernels' float sums are not bit-reproducible run to run
        # (1 ulp), so the continuation is compared as test_engine compares M=1 with plain DMP
        assert max(abs(x - y) for x, y in zip(r["a"], r["b"])) <= 1e-6
        assert r["drift"] <= 1e-6


def test_restore_plan_takes_the_newest_generation_the_live_holders_hold_whole():
    from recgrid.train.recovery.holders import plan_restore

    job = ["dense", "progress", "window/0"]
    inv = {"a": {10: job + ["shard/0"], 12: job + ["shard/0"]}, "b": {10: ["shard/1", "window/1"]}}
    plan = plan_restore(inv, group_size=2, lost=["c"])
    assert plan["step"] == 10  # 12 lacks shard position 1 (node b's copy of it is of step 10 only)
    assert plan["where"]["shard/1"] == ["b"] and plan["windows"] == {"window/0": ["a"], "window/1": ["b"]}
    assert plan["lost_nodes"] == ["c"]
    none = plan_restore({"a": {12: inv["a"][12]}}, 2)
    assert none["step"] is None and none["missing"] == ["shard/1"] and none["generations"] == [12]
    assert plan_restore(inv, 3)["missing"] == ["shard/1", "shard/2"]  # of the newest


def save_or_load(src: str, phase: str, M: int, dst: str | None = None, head_rows: int = 32) -> dict:
    """phase "save": train T=4, M=2 for 6 steps and write a storage checkpoint at the sync step.
    phase "load": build a trainer at this process group's T and M, load it, and write what the
    loaded trainer holds to `dst` (to compare it whole). The model is QR-compressed with a head
    cache of `head_rows` ids per compressed table (a load with another head is refused)."""
    from recgrid.data.stream import synthetic_batches
    from recgrid.train.checkpoint import Checkpointer
    from recgrid.train.trainer import Trainer

    rank, T = dist.get_rank(), dist.get_world_size()
    grid = Grid(T, M)
    comp = _qr_heads(head_rows)
    trainer = Trainer.build(grid, engine_config(*JOB).with_compression(comp), torch.device("cpu"))
    if phase == "save":
        trainer.run(iter(synthetic_batches(SPEC, 32, 6, seed=5, stream=rank + 1, compression=comp)), 6)
        trainer.state.examples = 777  # any progress value: it must come back
        out = Checkpointer(root=src).save(trainer)
    else:
        try:
            out = Checkpointer().load(trainer, src)
        except ValueError as e:
            trainer.close()
            return {"refused": str(e)}
        Checkpointer(root=dst).save(trainer)
    trainer.close()
    return {"path": out, "step": trainer.state.step, "examples": trainer.state.examples, "lrs": _kernel_lrs(trainer)}


def _kernel_lrs(trainer) -> list[float]:
    """The learning rates the fused kernels apply: lr * sqrt(c) (`MomentScaledRowWiseAdagrad`)."""
    from recgrid.engine.sync import embedding_kernels

    return sorted({k.get_learning_rate() for k in embedding_kernels(trainer.model)})


def _full_tables(checkpoint: str, tmp) -> dict:
    """Every tensor of a checkpoint, whole (DCP's own single-process reader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / (os.path.basename(checkpoint) + ".pt")
    dcp_to_torch_save(checkpoint, out)
    sd = torch.load(out, weights_only=False)
    return {k: v for k, v in sd["model"].items()} | {f"opt/{k}": v for k, v in _flat(sd["embedding_optimizer"]).items()}


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        elif torch.is_tensor(v):
            out[f"{prefix}{k}"] = v
    return out


# ---- acceptance 5: written at T=4, M=2; resumed at T=4, M=1 and T=2, M=1 with the same weights ----------
# (of a QR-compressed model with a head cache: its q, r and h tables reshard as any table)
def test_storage_checkpoint_resumes_at_another_m_and_l(tmp_path):
    written_at = run_local(save_or_load, 4, str(tmp_path / "a"), "save", 2)
    saved = written_at[0]["path"]
    lr = engine_config(*JOB).lr
    assert [lr * 2 ** 0.5] * 4 == pytest.approx([x for r in written_at for x in r["lrs"]], rel=1e-6)  # c = M = 2
    written = sum(os.path.getsize(os.path.join(saved, f)) for f in os.listdir(saved))
    want = _full_tables(saved, tmp_path)
    table_bytes = sum(v.numel() * v.element_size() for k, v in want.items() if "embedding_bags" in k)
    # one copy of the model, split over the workers: not M = 2 copies (those would be twice the tables
    # and the rest: the compressed tables are small, so dense and optimizer states weigh more than the
    # uncompressed model's 1.5x)
    assert table_bytes <= written < 2 * table_bytes
    assert len({f for f in os.listdir(saved) if f.endswith(".distcp")}) == 4
    # model weights on a shared host: only the job's user reads them
    assert os.stat(saved).st_mode & 0o777 == 0o700
    assert {os.stat(os.path.join(saved, f)).st_mode & 0o777 for f in os.listdir(saved)} == {0o600}
    assert {"model.sparse_arch.embedding_bag_collection.embedding_bags.t_C3_h.weight",
            "model.sparse_arch.embedding_bag_collection.embedding_bags.t_C3_q.weight"} <= set(want)
    # the head ids are the checkpoint's: a job with another head cannot read its rows for other ids
    refused = run_local(save_or_load, 1, saved, "load", 1, str(tmp_path / "other"), 16)
    assert all("head-cache ids" in r["refused"] for r in refused)
    for T in (4, 2):
        loaded = run_local(save_or_load, T, saved, "load", 1, str(tmp_path / f"t{T}m1"))
        assert all(r["step"] == 6 and r["examples"] == 777 for r in loaded)
        # c re-derived for the new M: the checkpoint's optimizer state does not bring the old M's c back
        assert [lr] * T == pytest.approx([x for r in loaded for x in r["lrs"]], rel=1e-6)
        got = _full_tables(str(tmp_path / f"t{T}m1" / "checkpoint_step_00000006"), tmp_path)
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k  # every table and moment, bit for bit


def dense_roundtrip(root: str) -> dict:
    """For the dense optimizers with state of their own (Adam: step and both moments) and without
    (SGD): train 4 steps at T=2, M=2; a second trainer restored from this worker's snapshot and a
    third from a storage checkpoint hold the same dense parameters and optimizer state bit for
    bit, and the three take the same 2 more steps."""
    from recgrid.train.checkpoint import Checkpointer
    from recgrid.train.trainer import Trainer

    rank = dist.get_rank()
    grid = Grid(dist.get_world_size(), 2)
    batches = [b for b, _ in zip(random_batches(SPEC, 32, seed=rank), range(6))]
    out = {}
    for name in ("adam", "sgd"):
        engine = engine_config(*JOB, f"optim.dense_optimizer={name}")
        a = Trainer.build(grid, engine, torch.device("cpu"))
        a.run(iter(batches[:4]), 4)
        snap, want = a.snapshot(), a.dense_state()
        path = Checkpointer(root=f"{root}/{name}").save(a)
        b = Trainer.build(grid, engine, torch.device("cpu"))
        b.load_snapshot(snap, None)
        c = Trainer.build(grid, engine, torch.device("cpu"))
        Checkpointer().load(c, path)
        got = {"snapshot": b.dense_state(), "checkpoint": c.dense_state()}
        losses = [[float(x) for x in t.run(iter(batches[4:]), 6).losses] for t in (a, b, c)]
        exact = {k: sorted(g) == sorted(want) and all(torch.equal(want[n], g[n]) for n in want) for k, g in got.items()}
        out[name] = {"keys": sorted(want), "exact": exact,
                     "states": sorted({n.rsplit("/", 1)[1] for n in want if n.startswith("optim/")}),
                     "steps": [t.state.step for t in (a, b, c)], "losses": losses}
        for t in (a, b, c):
            t.close()
    return out


def train_and_checkpoint(root: str) -> dict:
    """T=4, M=2, QR with a head cache: 6 steps, a storage checkpoint at the sync step, and the
    trainer's own eval logits on a held-out batch of this rank's (its ids expanded by QR, as the
    data pipeline gives them), with that batch's raw ids."""
    from recgrid.data.stream import synthetic_batches
    from recgrid.train.checkpoint import Checkpointer
    from recgrid.train.trainer import Trainer

    rank, grid, comp = dist.get_rank(), Grid(4, 2), _qr_heads()
    trainer = Trainer.build(grid, engine_config(*JOB).with_compression(comp), torch.device("cpu"))
    trainer.run(iter(synthetic_batches(SPEC, 32, 6, seed=5, stream=rank + 1, compression=comp)), 6)
    path = Checkpointer(root=root).save(trainer)
    raw = synthetic_batches(SPEC, 64, 1, seed=9, stream=rank + 1)[0]
    expanded = synthetic_batches(SPEC, 64, 1, seed=9, stream=rank + 1, compression=comp)[0]
    trainer.model.eval()
    with torch.no_grad():
        _, (_, logits, _) = trainer._forward(expanded, training=False)
    trainer.close()
    return {"path": path, "logits": logits.numpy(), "dense": raw.dense_features.numpy(),
            "keys": raw.sparse_features.keys(), "values": raw.sparse_features.values().numpy(),
            "lengths": raw.sparse_features.lengths().numpy()}


def test_a_checkpoint_unshards_into_one_plain_module_that_predicts_as_the_trainer(tmp_path):
    """Issue 30: a storage checkpoint of a T=4, M=2 job with QR and a head cache, read whole in one
    process without a process group (`launch.unshard.from_checkpoint`), is an ordinary module over
    plain TorchRec tables that maps the raw ids itself: on every rank's held-out batch its logits
    are the sharded trainer's (1e-5), and pickled and loaded again it needs no recgrid trainer."""
    import pickle

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recgrid.config import load_config
    from recgrid.launch.unshard import from_checkpoint

    ranks = run_local(train_and_checkpoint, 4, str(tmp_path))
    config = load_config(None, ["data.spec=tiny", "data.train=none/*.parquet", "model.compression=qr",
                                "model.qr_threshold_rows=2000", "model.qr_collisions=8", "model.qr_operation=add",
                                "model.head_rows=32"], check_paths=False)
    model = pickle.loads(pickle.dumps(from_checkpoint(ranks[0]["path"], config)))
    assert type(model.model.sparse_arch.embedding_bag_collection).__name__ == "EmbeddingBagCollection"
    assert model.info["compression"]["head_ids"] and model.info["step"] == 6
    model.eval()
    for r in ranks:
        kjt = KeyedJaggedTensor.from_lengths_sync(r["keys"], torch.from_numpy(r["values"]),
                                                  torch.from_numpy(r["lengths"]))
        with torch.no_grad():
            got = model(torch.from_numpy(r["dense"]), kjt).numpy()
        assert np.abs(got - r["logits"]).max() <= 1e-5, np.abs(got - r["logits"]).max()


def test_adam_and_sgd_dense_state_survive_a_snapshot_and_a_checkpoint(tmp_path):
    for r in run_local(dense_roundtrip, 2, str(tmp_path)):
        assert r["adam"]["states"] == ["exp_avg", "exp_avg_sq", "step"]  # Adam's state is in both
        assert r["sgd"]["states"] == [] and r["sgd"]["keys"]  # SGD: its parameters only
        for name in ("adam", "sgd"):
            assert r[name]["exact"] == {"snapshot": True, "checkpoint": True}, name
            assert r[name]["steps"] == [6, 6, 6]
            a, b, c = r[name]["losses"]
            assert max(abs(x - y) for x, y in zip(a + a, b + c)) <= 1e-6, name


class _Planted:
    """What a planted checkpoint file unpickles into: a call that leaves a mark."""

    def __init__(self, mark: str) -> None:
        self.mark = mark

    def __reduce__(self):
        return (open, (self.mark, "w"))


def test_checkpoint_load_refuses_metadata_or_entries_that_are_not_data(tmp_path):
    """A checkpoint directory on a shared volume may hold files anyone planted: recgrid's reader
    loads a real checkpoint, and refuses (naming the file) a `.metadata` or a non-tensor entry that
    names a callable, without calling it."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from recgrid.train import checkpoint

    path = str(tmp_path / "checkpoint_step_00000004")
    state = {"w": torch.arange(6.0), "progress": '{"step": 4}'}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)

    def load() -> dict:
        got = {"w": torch.zeros(6), "progress": ""}
        checkpoint.read_checkpoint(path, got)
        return got

    got = load()
    assert torch.equal(got["w"], state["w"]) and got["progress"] == state["progress"]

    mark = tmp_path / "ran"
    meta = os.path.join(path, ".metadata")
    good = open(meta, "rb").read()
    with open(meta, "wb") as f:
        pickle.dump(_Planted(str(mark)), f)
    with pytest.raises(checkpoint.CheckpointRefused, match=r"\.metadata.*names io\.open"):
        load()
    assert not mark.exists()

    # genuine metadata again, but pointing the non-tensor entry at a planted pickle appended to its file
    md = checkpoint.load_metadata(io.BytesIO(good), meta)
    item = next(v for k, v in md.storage_data.items() if k.fqn == "progress")
    planted = io.BytesIO()
    torch.save(_Planted(str(mark)), planted)
    data = os.path.join(path, item.relative_path)
    item.offset, item.length = os.path.getsize(data), len(planted.getvalue())
    with open(data, "ab") as f:
        f.write(planted.getvalue())
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(checkpoint.CheckpointRefused, match="entry 'progress' is not checkpoint data.*It names io.open\\.$"):
        load()
    assert not mark.exists()


# ---- the holder's shared-memory slot files ----------------------------------------------------------------
def test_holder_slots_alternate_keep_two_generations_and_read_back(tmp_path, monkeypatch):
    """A shard copy goes into one of two slot files per shard position; a third generation reuses
    the slot of the one it evicts, never the newest kept; reads give back the written bits."""
    from recgrid.train.recovery import holders, slots

    monkeypatch.setattr(slots, "SHM_BASE", str(tmp_path))
    holder = holders.SnapshotHolderImpl("node-a", "run-1")
    written = {}
    used = []
    cpu_before = 0.0
    for step in (5, 10, 15):
        tensors = [torch.full((7, 3), float(step)), torch.arange(step, dtype=torch.int64)]
        layout, nbytes = slots.shard_layout(tensors)
        assert all(off % slots.ALIGN == 0 for _, _, off in layout)
        slot = holder.reserve(step, "shard/0", nbytes)
        assert slot is not None
        used.append(slot["slot"])
        buf = np.memmap(slot["path"], dtype=np.uint8, mode="r+")
        for t, (_, _, off) in zip(tensors, layout):
            raw = t.numpy().view(np.uint8).reshape(-1)
            buf[off:off + raw.size] = raw
        buf.flush()
        del buf
        cpu = holder.commit(step, "shard/0", slot, layout)
        assert cpu >= cpu_before  # the holder's CPU seconds so far: the writers' measure of a snapshot's cost
        cpu_before = cpu
        written[step] = [t.numpy().copy() for t in tensors]
    assert used == [0, 1, 0]
    assert sorted(holder.inventory()) == [10, 15]  # the oldest went; its slot was reused
    assert len(holder.files()) == 2
    for step in (10, 15):
        got = holder._payload(step, "shard/0")
        assert [g.tolist() for g in got] == [w.tolist() for w in written[step]]
        assert holder.digest_of(step, "shard/0") == slots.digest(written[step])
    assert holder.reserve(1, "shard/0", 64) is None  # older than everything kept: nothing to keep
    # a generation being written (reserved, not committed) is not complete, and evicts no kept slot
    slot = holder.reserve(20, "shard/0", 64 * 4)
    assert slot["slot"] == 1 and holder.inventory()[20] == []
    holder.close()
    assert holder.files() == [] and not (tmp_path / "recgrid-snapshots-run-1").exists()


def test_a_measured_snapshot_cadence_counts_the_holders_cpu_beside_the_writers_time():
    """The syncs between two snapshots cover their whole cost at 2% of the sync interval: the
    writer's time on the step's path and the CPU its host's holder spends per snapshot."""
    from types import SimpleNamespace

    from recgrid.config import SnapshotCadence
    from recgrid.train.recovery import holders

    cadence = SnapshotCadence(measured=True)
    s = holders.Snapshotter(None, None, None, SimpleNamespace(coords=SimpleNamespace(rank=0)), ["node-a"], cadence)
    s.seconds, s._sync_s = [0.004], 0.25  # 2% of the interval: 5 ms
    assert s.syncs_apart() == 1
    s.holder_s = 0.02  # 24 ms in all
    assert s.syncs_apart() == 5
    s.holder_s = 10.0
    assert s.syncs_apart() == cadence.max_syncs


def test_holder_without_shared_memory_says_so(tmp_path, monkeypatch):
    from recgrid.train.recovery import holders, slots

    monkeypatch.setattr(slots, "SHM_BASE", str(tmp_path / "missing"))
    assert holders.SnapshotHolderImpl("node-a", "run-1").reserve(5, "shard/0", 64) is None
    # shared memory too full for a slot file and the margin it leaves: no slot either (the object store)
    monkeypatch.setattr(slots, "SHM_BASE", str(tmp_path))
    holder = holders.SnapshotHolderImpl("node-a", "run-1")
    assert holder.root is not None and holder.reserve(5, "shard/0", 64) is not None  # room for a small one
    free = slots.shutil.disk_usage(holder.root).free
    assert holder.reserve(5, "shard/1", free) is None and holder.allocate("shard/1", free) is None
    assert [os.path.basename(f) for f in holder.files()] == ["shard-0.0", "shard-0.1"]
    holder.close()


def test_holder_checks_each_copy_against_the_checksum_it_was_written_with(tmp_path, monkeypatch):
    """A slot file's bits changed after its commit (a corrupted copy) are caught by the checksum the
    holder recorded at the commit: `verify` drops the copy, so the plan falls back to the older
    complete generation; an intact copy passes."""
    from recgrid.train.recovery import holders, slots

    monkeypatch.setattr(slots, "SHM_BASE", str(tmp_path))
    holder = holders.SnapshotHolderImpl("node-a", "run-1")
    for step in (5, 10):
        tensors = [torch.full((4, 3), float(step))]
        layout, nbytes = slots.shard_layout(tensors)
        slot = holder.reserve(step, "shard/0", nbytes)
        np.memmap(slot["path"], dtype=np.float32, mode="r+", shape=(12,))[:] = tensors[0].numpy().reshape(-1)
        holder.commit(step, "shard/0", slot, layout)
        holder.generations[step].update(dense=[None], progress=[None])  # the rest of a generation (not checked here)
        assert holder.digest_of(step, "shard/0") == slots.digest([t.numpy() for t in tensors])
    assert holder.verify(10, ["shard/0"]) == {}
    # a shard position that holds no row of some table (L=3 of tiny: (0, D) tensors) has a checksum too
    assert slots.digest([np.zeros((0, 16), np.float32), np.ones(2, np.float32)]) == \
        slots.digest([np.ones(2, np.float32)])
    path = holder.get(10, "shard/0")["path"]
    with open(path, "r+b") as f:  # one bit of the newest copy flips
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0x10]))
    bad = holder.verify(10, ["shard/0"])
    assert list(bad) == ["shard/0"] and "shard/0@10 on node node-a" in bad["shard/0"]
    assert holder.inventory() == {5: ["dense", "progress", "shard/0"], 10: ["dense", "progress"]}
    assert holders.plan_restore({"node-a": holder.inventory()}, 1)["step"] == 5
    holder.close()


# ---- the snapshot files on a shared machine (issue 18) ----------------------------------------------------
def test_holder_files_are_0600_in_0700_directories_and_links_are_never_followed(tmp_path, monkeypatch):
    import stat

    from recgrid.train.recovery import holders, slots

    monkeypatch.setattr(slots, "SHM_BASE", str(tmp_path))
    holder = holders.SnapshotHolderImpl("node-a", "run-1")
    slot = holder.reserve(5, "shard/0", 256)
    job_dir = tmp_path / "recgrid-snapshots-run-1"
    for d in (job_dir, job_dir / "node-a"):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700 and stat.S_ISDIR(os.lstat(d).st_mode)
    files = holder.files()
    assert len(files) == 2 and slot["path"] in files
    for f in [*files, str(job_dir / slots.MARKER), str(job_dir / "node-a" / slots.MARKER)]:
        assert stat.S_IMODE(os.lstat(f).st_mode) == 0o600 and stat.S_ISREG(os.lstat(f).st_mode)
    # a link planted where a slot file goes (by this user: nobody else can write in a 0700
    # directory) is replaced by a file of the holder's, its target left as it was
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 8)
    other = os.path.join(holder.root, "shard-1.0")
    os.symlink(victim, other)
    with pytest.raises(OSError):  # a worker maps no link
        slots.open_slot(other, writable=True)
    assert holder.allocate("shard/1", 128) is not None
    assert not os.path.islink(other) and os.path.getsize(other) == 128 and victim.read_bytes() == b"precious" * 8
    holder.close()
    assert not job_dir.exists()


def test_row_log_is_0600_in_a_0700_directory_and_never_follows_a_link(tmp_path):
    import errno

    from recgrid.train.rows import RowLog, row_log_file

    directory = str(tmp_path / "rows")
    log = RowLog(directory, 0, 0)
    log.write(3, [7, 8])
    os.close(log.fd)
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert os.stat(row_log_file(directory, 0, 0)).st_mode & 0o777 == 0o600
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, row_log_file(directory, 0, 1))
    with pytest.raises(OSError) as refused:
        RowLog(directory, 0, 1)
    assert refused.value.errno == errno.ELOOP and target.read_bytes() == b""


@pytest.mark.parametrize("planted", ["link", "open directory", "unmarked directory", "another job's", "another user's"])
def test_holder_refuses_what_it_did_not_make_at_its_path_and_leaves_it_alone(tmp_path, monkeypatch, planted):
    """Anything planted at the job's snapshot path: refused with the path in the message, the
    snapshots go through the object store (no slot), nothing there or behind a link is touched;
    the driver's cleanup leaves it too."""
    from recgrid.train.recovery import holders, slots

    base = tmp_path / "shm"
    base.mkdir(mode=0o1777)
    monkeypatch.setattr(slots, "SHM_BASE", str(base))
    path = base / "recgrid-snapshots-run-1"
    target = tmp_path / "target"
    target.mkdir()
    (target / "file").write_bytes(b"do not touch")
    if planted == "link":
        os.symlink(target, path)
        inside = target
    else:
        path.mkdir(mode=0o700)
        inside = path
        (path / "file").write_bytes(b"do not touch")
        if planted == "open directory":
            os.chmod(path, 0o755)
        elif planted == "another job's":
            (path / slots.MARKER).write_text(json.dumps({"run_id": "run-2", "node": None, "pid": os.getpid()}))
        elif planted == "another user's":
            if os.getuid() != 0:
                pytest.skip("needs root to make a directory of another user")
            os.chown(path, 4321, 4321)
    holder = holders.SnapshotHolderImpl("node-a", "run-1")
    assert holder.root is None and holder.reserve(5, "shard/0", 64) is None  # the object store instead
    problem = holder.why_no_shared_memory()
    assert problem.startswith(f"{path}: refusing") and "object store" in problem
    assert {"link": "symbolic link", "open directory": "mode 0755", "unmarked directory": "no owner marker",
            "another job's": "another job", "another user's": "uid 4321"}[planted] in problem
    holder.close()
    slots.remove_snapshot_files("run-1")
    assert (inside / "file").read_bytes() == b"do not touch" and sorted(os.listdir(target)) == ["file"]
    assert os.path.islink(path) if planted == "link" else sorted(os.listdir(path)) == sorted(os.listdir(inside))


def test_a_starting_holder_sweeps_this_users_snapshot_directories_whose_owners_are_gone(tmp_path, monkeypatch):
    from recgrid.train.recovery import holders, slots

    monkeypatch.setattr(slots, "SHM_BASE", str(tmp_path))
    live = holders.SnapshotHolderImpl("node-a", "run-live")  # a job still running (this process)
    live.reserve(5, "shard/0", 64)
    # a job whose holder ran in a process that is gone now (as when its driver was SIGKILLed)
    gone = subprocess.run([sys.executable, "-c", SWEEP_SCRIPT, str(tmp_path), "run-dead"], capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    dead = tmp_path / "recgrid-snapshots-run-dead"
    assert gone.stdout.strip() == str(dead / "node-a") and len(os.listdir(dead / "node-a")) == 3  # two slots, marker
    unmarked = tmp_path / "recgrid-snapshots-run-old"  # not made by a holder that says who it is: not ours to judge
    unmarked.mkdir(mode=0o700)
    holder = holders.SnapshotHolderImpl("node-b", "run-next")
    assert holder.swept == [str(dead)] and not dead.exists()
    assert len(live.files()) == 2 and unmarked.is_dir()
    holder.close()
    live.close()


SWEEP_SCRIPT = """
import sys
from recgrid.train.recovery import holders, slots
slots.SHM_BASE = sys.argv[1]
holder = holders.SnapshotHolderImpl("node-a", sys.argv[2])
holder.reserve(5, "shard/0", 64)
print(holder.root)
"""
