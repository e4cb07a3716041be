"""The GPU training loop: TorchRec's TrainPipelineSparseDist, phases timed with CUDA events, TF32
by default, bf16 autocast and fp16 tables.

What runs everywhere: the config's precision fields and their refusal on CPU jobs, the device
switches, the deferred phase timer on the host clock, that a CPU trainer keeps the plain loop,
and the pipelined loop itself on real gloo process groups (TorchRec's pipeline runs on CPU without
streams): its step and data accounting against the plain loop's, through replica syncs, sync-point
snapshots, evaluations in the middle of an epoch, an epoch boundary, a graceful stop and a restore.

What needs CUDA (skipped without it): T=1 with NCCL (NCCL refuses two ranks on one GPU), the
pipeline's losses against the plain loop's at fp32, the CUDA-event phase split, no
`torch.cuda.synchronize()` per step, TF32 / bf16 / fp16 tables.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from recgrid.config import defaults
from recgrid.data.specs import get_spec
from recgrid.engine.grid import Grid
from helpers import engine_config

SPEC = get_spec("tiny")
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: the GPU training pipeline, CUDA events, "
                                                 "TF32, bf16 autocast and fp16 tables run on CUDA only")


# ---- config: the new fields, validated before any worker starts ------------------------------------
def test_precision_defaults_to_tf32_on_gpu_and_fp32_on_cpu():
    cpu, gpu = defaults(), defaults("train.use_gpu=true")
    assert cpu.train.precision is None and cpu.precision == "fp32"
    assert gpu.precision == "tf32" and gpu.to_flat_dict()["train.precision"] == "tf32"
    assert defaults("train.use_gpu=true", "train.precision=bf16", "model.embedding_dtype=fp16").precision == "bf16"
    assert defaults("train.precision=fp32").precision == "fp32"  # fp32 is fine on CPU
    assert cpu.model.embedding_dtype == "fp32"


@pytest.mark.parametrize("override, field", [
    ("train.precision=tf32", "train.precision"),
    ("train.precision=bf16", "train.precision"),
    ("model.embedding_dtype=fp16", "model.embedding_dtype"),
])
def test_gpu_only_values_are_refused_on_cpu_jobs(override, field):
    from recgrid.config import ConfigError

    with pytest.raises(ConfigError) as e:
        defaults(override)
    msg = str(e.value)
    assert msg.startswith(f"{field}: ") and "train.use_gpu: true" in msg


def test_unknown_precisions_are_refused():
    from recgrid.config import ConfigError

    with pytest.raises(ConfigError, match=r"^train.precision: must be one of \['fp32', 'tf32', 'bf16'\], got 'fp16'"):
        defaults("train.use_gpu=true", "train.precision=fp16")
    with pytest.raises(ConfigError, match=r"^model.embedding_dtype: must be one of \['fp32', 'fp16'\], got 'bf16'"):
        defaults("train.use_gpu=true", "model.embedding_dtype=bf16")


def test_engine_config_carries_precision_and_table_dtype():
    from recgrid.engine.device import resolve_precision

    e = engine_config("train.use_gpu=true", "train.precision=bf16", "model.embedding_dtype=fp16")
    assert e.precision == "bf16" and e.model.embedding_dtype == "fp16"
    # null: the device's default, resolved by the trainer (fp32 on a CPU worker)
    assert resolve_precision(torch.device("cpu"), engine_config().precision) == "fp32"


def test_tables_carry_torchrec_data_type():
    from torchrec.modules.embedding_configs import DataType

    from recgrid.engine.model import embedding_tables

    assert {t.data_type for t in embedding_tables(SPEC, 8)} == {DataType.FP32}
    assert {t.data_type for t in embedding_tables(SPEC, 8, "fp16")} == {DataType.FP16}
    with pytest.raises(ValueError, match="embedding dtype"):
        embedding_tables(SPEC, 8, "int8")


# ---- the device switch -----------------------------------------------------------------------------
def test_cpu_keeps_the_plain_loop_fp32_and_the_host_clock():
    from recgrid.engine.device import Stopwatch, autocast, configure_matmul, pipelined, stopwatch

    cpu = torch.device("cpu")
    assert not pipelined(cpu) and type(stopwatch(cpu)) is Stopwatch and not stopwatch(cpu).deferred
    configure_matmul(cpu, "fp32")  # nothing to set
    for p in ("tf32", "bf16"):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            configure_matmul(cpu, p)
    with autocast(cpu, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    assert pipelined(torch.device("cuda", 0))  # decided by type: no GPU needed to ask


def test_a_launcher_assigned_device_is_kept_over_the_local_rank():
    """Under torchft every sharding group is a Ray Train run, and runs count local ranks apart:
    the device Ray assigned wins; the local rank only picks where no launcher assigned one."""
    from recgrid.engine.device import choose_device

    assert choose_device(0, 4, torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert choose_device(0, 8, torch.device("cuda", 5)) == torch.device("cuda", 5)
    assert choose_device(5, 4) == torch.device("cuda", 1)  # the local launcher: one process per GPU
    with pytest.raises(RuntimeError, match="assigned cpu, not a CUDA device"):
        choose_device(0, 4, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="no CUDA device"):
        choose_device(0, 0)


def test_batches_are_pinned_on_cuda_workers_only():
    from recgrid.data.stream import batches_of_block, collate_block
    from recgrid.data.synth import synth_table
    from recgrid.engine.device import pin_batches

    assert pin_batches(torch.device("cuda", 1)) and not pin_batches(torch.device("cpu"))
    table = synth_table(SPEC, 64, 0)
    block = collate_block({n: table.column(n).to_numpy() for n in table.column_names}, SPEC, 32)
    plain = list(batches_of_block(block, pin=pin_batches(torch.device("cpu"))))
    assert len(plain) == 2 and not plain[0].dense_features.is_pinned()
    if CUDA:  # the pinned path: the same batches, page-locked, row ids beside them
        pinned = list(batches_of_block(block, pin=pin_batches(torch.device("cuda", 0))))
        for a, b in zip(plain, pinned):
            for x in (b.dense_features, b.labels, b.sparse_features.values(), b.sparse_features.lengths()):
                assert x.is_pinned()
            assert torch.equal(a.dense_features, b.dense_features) and torch.equal(a.row_ids, b.row_ids)


def test_evaluation_never_autocasts():
    import contextlib

    from recgrid.engine.device import autocast

    # decided before torch.autocast is built: no GPU needed to ask
    assert isinstance(autocast(torch.device("cuda", 0), "bf16", training=False), contextlib.nullcontext)
    assert isinstance(autocast(torch.device("cuda", 0), "tf32"), contextlib.nullcontext)


def test_deferred_timer_nets_inner_phases_out_and_reads_late():
    from recgrid.train.metrics import DeferredPhaseTimer, PhaseTimer, TrainMetrics

    t = DeferredPhaseTimer(device="cpu")  # host stopwatches: the same bookkeeping as CUDA events
    t0 = time.perf_counter()
    t.start("dense")
    t.start("lookup")
    t.start("lookup_kernel")
    time.sleep(0.03)
    t.stop("lookup_kernel")
    time.sleep(0.02)
    t.stop("lookup")
    time.sleep(0.02)
    t.stop("dense")
    outside = time.perf_counter() - t0
    with t.phase("sync"):
        time.sleep(0.01)
    t.add("data_wait", 0.5)
    assert len(t._spans) == 4  # recorded, nothing read yet
    lap = t.lap()
    assert t.seconds["dense"] == 0.0 and not t._spans  # the lap took them
    s = lap.seconds()
    assert s["data_wait"] == 0.5 and s["sync"] >= 0.01
    assert 0.03 <= s["lookup_kernel"] and s["lookup_kernel"] + 0.02 <= s["lookup"]
    # dense is the step net of its lookup: the lookup inside it is charged once
    assert s["dense"] >= 0.02 and s["lookup"] + s["dense"] <= outside
    assert lap.seconds() == s  # read once, kept
    # a phase open across a reset stays open and nets what is recorded inside it after
    t.start("dense")
    t.reset()
    t.start("lookup")
    time.sleep(0.02)
    t.stop("lookup")
    t.stop("dense")
    assert t.seconds["lookup"] >= 0.02 and 0 <= t.seconds["dense"] < 0.02
    with pytest.raises(ValueError, match="unknown phase"):
        t.start("lookups")
    assert isinstance(TrainMetrics(deferred=True).timer, DeferredPhaseTimer)
    assert type(TrainMetrics().timer) is PhaseTimer  # CPU: the host clock, as before


# ---- the loops on real gloo process groups (one set of worker processes for all of them) ----------
STEPS, BATCH, LOG, EVAL, STOP = 16, 32, 4, 5, 8  # 12 steps per epoch: the run crosses an epoch boundary


def _probe(train_dir: str, eval_dir: str) -> dict:
    return {"fit": _fit_probe(train_dir, eval_dir), "run": _run_probe()}


def _fit_probe(train_dir: str, eval_dir: str) -> dict:
    """T=2, M=2, K=2. Plain loop A to STEPS; pipelined loop P stopped gracefully at STOP, then on to
    STEPS, then restored from its STOP snapshot and on to STEPS again. Per step: the rows trained
    and the loss; per sync point: a digest of the shards."""
    from recgrid.data.stream import scan_inputs
    from recgrid.data.units import EpochPlan
    from recgrid.config import defaults
    from recgrid.train.trainer import EvalData, FitHooks, TrainData, Trainer
    from recgrid.trainer_config import EngineConfig, LoopConfig

    rank, T = dist.get_rank(), dist.get_world_size()
    grid = Grid(T, 2)
    engine = EngineConfig.from_job(defaults(), spec=SPEC, sync_every=2, seed=5)
    train, ev = scan_inputs(train_dir, SPEC), scan_inputs(eval_dir, SPEC)

    def data():
        return TrainData(EpochPlan(train, 5, BATCH, rows_per_unit=300), SPEC, rank, T)

    eval_data = EvalData(ev, SPEC, BATCH, rank, T)

    def fit(trainer, stop_at=None, snaps=None):
        rec = {"rows": {}, "loss": {}, "digest": {}, "evals": [], "uncommitted": []}

        def on_step(t, out, batch):
            if not out.committed:  # a round that did not commit (`SkipRounds`): its batch is consumed
                rec["uncommitted"].append(out.step)
                return
            rec["rows"][t.state.step] = batch.row_ids.tolist()
            rec["loss"][t.state.step] = float(out.loss)

        def at_sync_point(step):
            if step % engine.sync_every:
                return
            t = trainer
            rec["digest"][t.state.step] = float(sum(x.double().sum() for x in t.shard_tensors()))
            if snaps is not None:  # with the NE window summed over the workers, as a restore loads it
                snaps[t.state.step] = (t.snapshot(), t.metrics.window_state(t.groups.global_pg))

        def on_log(values, step):
            if "eval/ne" in values:
                rec["evals"].append((step, values["eval/ne"]))

        hooks = FitHooks(on_log=on_log, after_step=[at_sync_point], on_step=on_step,
                         stop_requested=lambda t: stop_at is not None and t.state.step >= stop_at)
        trainer.fit(data(), LoopConfig.from_job(defaults(), max_steps=STEPS, batch_size=BATCH, log_every=LOG, eval_every=EVAL),
                    eval_data, hooks)
        rec["cursor"] = trainer.state.cursor.state_dict()
        rec["step"], rec["examples"] = trainer.state.step, trainer.state.examples
        rec["syncs"] = trainer.state.sync.count
        return rec

    import recgrid.train.trainer as trainer_module

    real, flags = trainer_module.autocast, {True: 0, False: 0}

    def spy(device, precision, training=True):  # a spy, not a mock: it returns the real context
        flags[training] += 1
        return real(device, precision, training)

    trainer_module.autocast = spy
    a = Trainer.build(grid, engine, torch.device("cpu"), pipeline=False)
    try:
        plain = fit(a)
    finally:
        trainer_module.autocast = real
    plain["autocast_training"] = flags
    p = Trainer.build(grid, engine, torch.device("cpu"), pipeline=True)
    snaps: dict = {}
    stopped = fit(p, stop_at=STOP, snaps=snaps)
    went_on = fit(p)
    snap, window = snaps[STOP]
    p.load_snapshot(snap, window)
    restored = fit(p)
    a.close()
    p.close()
    # rounds that do not commit (as a torchft round whose collective failed), in both loops
    skipped = {}
    for pipeline in (False, True):
        t = Trainer.build(grid, engine, torch.device("cpu"), pipeline=pipeline)
        t.replicas = SkipRounds(t, SKIPPED_ROUNDS)
        skipped[pipeline] = fit(t)
        t.close()
    return {"plain": plain, "stopped": stopped, "went_on": went_on, "restored": restored, "skipped": skipped,
            "pipelined": (a.pipelined, p.pipelined), "pipeline_left": p._pipeline,
            "timer": type(p.metrics.timer).__name__}


SKIPPED_ROUNDS = (3, 9)  # the rounds (batches consumed, from 1) that `SkipRounds` does not commit


def SkipRounds(trainer, skipped):
    """The grid's replica component, but the rounds numbered in `skipped` do not commit, and its
    rounds charge "sync" as torchft's do (`rounds_talk`)."""
    from recgrid.train.trainer import Replicas

    class _SkipRounds(Replicas):
        rounds_talk = True

        def __init__(self) -> None:
            super().__init__(trainer)
            self.rounds = 0

        def commit(self, step: int) -> bool:
            self.rounds += 1
            return self.rounds not in skipped

    return _SkipRounds()


def _run_probe() -> dict:
    """T=2, M=1 (L=2: the ids' all-to-all is real). The CPU default trainer, then a pipelined one
    fed the same batches through two `run` calls on one iterator."""
    import itertools

    from recgrid.engine.sharding import watch_forwards
    from recgrid.launch.smoke import random_batches
    from recgrid.config import defaults
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    engine = EngineConfig.from_job(defaults(), spec=SPEC, sharding="row_wise", seed=4)
    batches = list(itertools.islice(random_batches(SPEC, 32, seed=dist.get_rank()), 12))
    a = Trainer.build(Grid(2, 1), engine, torch.device("cpu"))  # the CPU default
    plain = a.run(iter(batches), 8).losses
    ebc = next(m for m in a.model.modules() if type(m).__name__ == "ShardedEmbeddingBagCollection")
    default = {"pipelined": a.pipelined, "pipeline": a._pipeline, "timer": type(a.metrics.timer).__name__,
               "forward": type(ebc.forward).__name__, "precision": a.precision}
    b = Trainer.build(Grid(2, 1), engine, torch.device("cpu"), pipeline=True)
    synced, real_sync = [], b.replicas.sync

    def sync_spy(step):  # a spy, not a mock: the real sync runs
        synced.append(step)
        return real_sync(step)

    b.replicas.sync = sync_spy
    forwards = watch_forwards(b.model)
    it = iter(batches)
    first, second = b.run(it, 5), b.run(it, 8)
    phases = {k: first.phase_seconds[k] + second.phase_seconds[k] for k in first.phase_seconds}
    return {"default": default, "plain": plain, "pipelined": first.losses + second.losses, "left": len(list(it)),
            "forwards": forwards,
            "steps": (first.steps, b.state.step), "phases": phases, "synced": synced,
            "step_seconds": first.step_seconds + second.step_seconds}


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    from recgrid.data.synth import write_synth
    from recgrid.launch.local import run_local

    tmp = tmp_path_factory.mktemp("gpu_loop")
    write_synth(str(tmp / "train"), 800, files=2, fmt="parquet", spec=SPEC, seed=1)
    write_synth(str(tmp / "eval"), 200, files=1, fmt="parquet", spec=SPEC, seed=1, stream=1)
    return run_local(_probe, 2, str(tmp / "train" / "*.parquet"), str(tmp / "eval" / "*.parquet"))


def test_cpu_trainer_does_not_construct_the_pipeline(gloo_results):
    for r in gloo_results:
        assert r["run"]["default"] == {"pipelined": False, "pipeline": None, "timer": "PhaseTimer",
                                       "forward": "method", "precision": "fp32"}


def test_training_forwards_ask_for_autocast_and_evaluation_forwards_do_not(gloo_results):
    for r in gloo_results:
        flags, evals = r["fit"]["plain"]["autocast_training"], r["fit"]["plain"]["evals"]
        assert flags[True] == STEPS  # one training forward per step of the plain loop
        assert evals and flags[False] >= len(evals)  # every evaluation's forwards: training=False


def test_pipelined_loop_counts_steps_rows_and_syncs_as_the_plain_loop(gloo_results):
    for r in (g["fit"] for g in gloo_results):
        plain, stopped, went_on, restored = r["plain"], r["stopped"], r["went_on"], r["restored"]
        assert r["pipelined"] == (False, True) and r["pipeline_left"] is None
        assert r["timer"] == "DeferredPhaseTimer"
        assert sorted(plain["rows"]) == list(range(1, STEPS + 1))
        # the graceful stop: exactly STOP steps trained, the cursor there, prefetched batches not counted
        assert stopped["step"] == STOP and sorted(stopped["rows"]) == list(range(1, STOP + 1))
        assert stopped["examples"] == STOP * BATCH * 2
        # every step trains the plain loop's rows: the stop, the resume, the evaluations in the
        # middle of the epoch (the pipeline is dropped and its prefetched batches fed again) and
        # the epoch boundary at step 12 skip nothing and repeat nothing
        assert {**stopped["rows"], **went_on["rows"]} == plain["rows"]
        assert restored["rows"] == {s: plain["rows"][s] for s in range(STOP + 1, STEPS + 1)}
        assert went_on["cursor"] == restored["cursor"] == plain["cursor"] and plain["cursor"]["epoch"] == 1
        assert went_on["step"] == restored["step"] == STEPS and went_on["examples"] == plain["examples"]
        # the same training: losses per step and the shards at every sync point (K=2, M=2)
        for s, loss in {**stopped["loss"], **went_on["loss"]}.items():
            assert abs(loss - plain["loss"][s]) <= 1e-6, s
        for s, loss in restored["loss"].items():
            assert abs(loss - plain["loss"][s]) <= 1e-6, s
        digests = {**stopped["digest"], **went_on["digest"]}
        assert sorted(digests) == list(range(2, STEPS + 1, 2))
        for s, d in digests.items():
            assert d == pytest.approx(plain["digest"][s], rel=1e-6), s
        assert went_on["syncs"] == plain["syncs"] == STEPS // 2
        # evaluations at 5, 10, 15 (and at the stop) see the same model
        evals = dict(stopped["evals"] + went_on["evals"])
        for s, ne in plain["evals"]:
            assert evals[s] == pytest.approx(ne, rel=1e-6)
    assert gloo_results[0]["fit"]["plain"]["rows"] != gloo_results[1]["fit"]["plain"]["rows"]  # disjoint parts


def test_pipelined_loop_consumes_an_uncommitted_rounds_batch_as_the_plain_loop(gloo_results):
    """The pipeline's optimizer step is the round's commit: a round that does not commit consumes its
    batch without a step (no dense update, no count), in the pipelined loop as in the plain one."""
    for r in (g["fit"] for g in gloo_results):
        plain, pipe, base = r["skipped"][False], r["skipped"][True], r["plain"]
        assert plain["uncommitted"] == pipe["uncommitted"] == [SKIPPED_ROUNDS[0], SKIPPED_ROUNDS[1] - 1]
        assert sorted(pipe["rows"]) == list(range(1, STEPS + 1)) and pipe["step"] == STEPS
        assert pipe["rows"] == plain["rows"] and pipe["cursor"] == plain["cursor"]
        assert pipe["rows"][SKIPPED_ROUNDS[0]] == base["rows"][SKIPPED_ROUNDS[0] + 1]  # the skipped batch is gone
        for s, loss in pipe["loss"].items():
            assert abs(loss - plain["loss"][s]) <= 1e-6, s
        for s, d in pipe["digest"].items():
            assert d == pytest.approx(plain["digest"][s], rel=1e-6), s


def test_run_reads_only_what_it_trains_and_matches_the_plain_loop(gloo_results):
    for r in (g["run"] for g in gloo_results):
        assert r["left"] == 4 and r["steps"] == (5, 8)
        # no replica sync of the grid's own (M = 1): the replica component's runs after every committed step,
        # as in the plain loop (under torchft it lands the table average and tells its listener)
        assert r["synced"] == list(range(1, 9))
        assert r["pipelined"] == r["plain"]  # L=2: the ids' all-to-all runs a step ahead
        # TorchRec really pipelined the embedding collection (it falls back to plain forwards silently)
        assert len(r["forwards"]) >= 8 and set(r["forwards"]) == {"pipelined"}
        assert all(v >= 0 for v in r["phases"].values()) and r["phases"]["lookup"] > 0
        assert len(r["step_seconds"]) == 8 and all(s > 0 for s in r["step_seconds"])


# ---- on CUDA: T=1 with NCCL ----------------------------------------------------------------------
def _nccl_run(fn, *args, world_size: int = 1):
    """`fn(device, *args)` on `world_size` NCCL ranks, one GPU each (recgrid's local launcher)."""
    from recgrid.launch.local import run_local

    got = run_local(_on_device, world_size, fn, *args, device_type="cuda")
    return got[0] if world_size == 1 else got


def _on_device(fn, *args):
    return fn(torch.device("cuda", torch.cuda.current_device()), *args)


def _gpu_losses(device, steps: int) -> dict:
    import itertools

    from recgrid.engine.sharding import watch_forwards
    from recgrid.launch.smoke import random_batches
    from recgrid.config import defaults
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    engine = EngineConfig.from_job(defaults(), spec=SPEC, seed=2, precision="fp32")  # IEEE fp32 matmuls: comparable losses
    batches = list(itertools.islice(random_batches(SPEC, 256, seed=0), steps))
    plain = Trainer.build(Grid(1, 1), engine, device, pipeline=False)
    a = plain.run(iter(batches), steps)
    piped = Trainer.build(Grid(1, 1), engine, device)
    forwards = watch_forwards(piped.model)
    b = piped.run(iter(batches), steps)
    return {"plain": a.losses, "pipelined": b.losses, "default": piped.pipelined, "plain_flag": plain.pipelined,
            "forwards": forwards,
            "tf32": torch.backends.cuda.matmul.fp32_precision, "phases": b.phase_seconds,
            "steps": (a.steps, b.steps)}


@needs_cuda
def test_gpu_pipeline_trains_and_matches_the_plain_loop_at_fp32():
    r = _nccl_run(_gpu_losses, 30)
    assert r["default"] is True and r["plain_flag"] is False and r["tf32"] == "ieee"
    assert r["steps"] == (30, 30)
    assert len(r["forwards"]) >= 30 and set(r["forwards"]) == {"pipelined"}  # TorchRec did pipeline it
    for x, y in zip(r["plain"], r["pipelined"]):
        assert math.isfinite(y) and abs(x - y) <= 1e-4 * max(1.0, abs(x))
    assert sum(r["pipelined"][-5:]) < sum(r["pipelined"][:5])  # it learns
    assert r["phases"]["lookup"] > 0 and r["phases"]["dense"] > 0


def _gpu_fit(device, train_dir: str, steps: int, log_every: int) -> dict:
    from recgrid.data.stream import scan_inputs
    from recgrid.data.units import EpochPlan
    from recgrid.config import defaults
    from recgrid.train.trainer import FitHooks, TrainData, Trainer
    from recgrid.trainer_config import EngineConfig, LoopConfig

    engine = EngineConfig.from_job(defaults(), spec=SPEC, seed=2)  # the default precision: tf32 on CUDA
    t = Trainer.build(Grid(1, 1), engine, device)
    data = TrainData(EpochPlan(scan_inputs(train_dir, SPEC), 2, 512, rows_per_unit=4096), SPEC, 0, 1)
    t.fit(data, LoopConfig.from_job(defaults(), max_steps=log_every, batch_size=512, log_every=log_every))  # warm up: kernels, tracing
    logs: list = []
    syncs = [0]
    real = torch.cuda.synchronize

    def counting(*a, **k):  # a spy, not a mock: it calls the real one
        syncs[0] += 1
        return real(*a, **k)

    torch.cuda.synchronize = counting
    t0 = time.perf_counter()
    try:
        t.fit(data, LoopConfig.from_job(defaults(), max_steps=steps, batch_size=512, log_every=log_every),
              hooks=FitHooks(on_log=lambda v, s: logs.append(v)))
    finally:
        torch.cuda.synchronize = real
    # the last logging interval's reduction copied its sums to the host: the device was done by then
    wall = time.perf_counter() - t0
    return {"logs": logs, "synchronize_calls": syncs[0], "tf32": torch.backends.cuda.matmul.fp32_precision,
            "timer": type(t.metrics.timer).__name__, "step": t.state.step, "wall": wall}


@needs_cuda
def test_gpu_phase_split_from_cuda_events_adds_up_without_a_synchronize_per_step(tmp_path):
    from recgrid.data.synth import write_synth

    write_synth(str(tmp_path / "train"), 512 * 40, files=2, fmt="parquet", spec=SPEC, seed=1)
    r = _nccl_run(_gpu_fit, str(tmp_path / "train" / "*.parquet"), 30, 10)
    assert r["tf32"] == "tf32" and r["timer"] == "DeferredPhaseTimer" and r["step"] == 30
    assert r["synchronize_calls"] == 0  # the plain loop calls it every step
    assert len(r["logs"]) == 2
    device_steps = data_wait = 0.0
    for v in r["logs"]:
        phases = {k: v[f"time/{k}_s"] for k in ("data_wait", "lookup", "lookup_kernel", "dense", "sync")}
        assert all(x >= 0 for x in phases.values()) and phases["lookup"] > 0 and phases["dense"] > 0
        assert phases["lookup_kernel"] <= phases["lookup"]
        device_steps += phases["lookup"] + phases["dense"] + phases["sync"]
        data_wait += phases["data_wait"]
    # the steps' device spans are disjoint in stream order (lookup is netted out of dense), all
    # inside the measured fit; with the host's waits for data they cover most of it (the rest:
    # metrics, logging and hooks between steps)
    assert device_steps <= r["wall"]
    assert device_steps + data_wait >= 0.5 * r["wall"]


def _gpu_mixed(device, steps: int) -> dict:
    import itertools

    from recgrid.engine.model import ModelSpec
    from recgrid.engine.sync import embedding_weights, optimizer_states
    from recgrid.launch.smoke import random_batches
    from recgrid.config import defaults
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    engine = EngineConfig.from_job(defaults(), spec=SPEC, model=ModelSpec(embedding_dtype="fp16"), seed=2, precision="bf16")
    t = Trainer.build(Grid(1, 1), engine, device)
    batches = list(itertools.islice(random_batches(SPEC, 512, seed=0), steps))
    r = t.run(iter(batches), steps)
    return {"losses": r.losses, "weights": {str(w.dtype) for w in embedding_weights(t.model)},
            "states": {str(s.dtype) for s in optimizer_states(t.model)},
            "tf32": torch.backends.cuda.matmul.fp32_precision, "precision": t.precision}


@needs_cuda
def test_gpu_bf16_autocast_and_fp16_tables_train():
    r = _nccl_run(_gpu_mixed, 40)
    assert r["precision"] == "bf16" and r["tf32"] == "tf32"
    assert r["weights"] == {"torch.float16"} and r["states"] == {"torch.float32"}
    assert all(math.isfinite(x) for x in r["losses"])
    assert sum(r["losses"][-5:]) < sum(r["losses"][:5])


# ---- on CUDA: M = 2 over two GPUs ------------------------------------------------------------------
def _gpu_two_groups(device, steps: int) -> dict:
    """T=2, M=2, K=2 at fp32: the plain loop, then the pipelined one on the same batches; per sync
    a digest of this worker's shards."""
    import itertools

    from recgrid.engine.sharding import watch_forwards
    from recgrid.launch.smoke import random_batches
    from recgrid.config import defaults
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    engine = EngineConfig.from_job(defaults(), spec=SPEC, seed=2, precision="fp32", sync_every=2)
    batches = list(itertools.islice(random_batches(SPEC, 256, seed=dist.get_rank()), steps))
    out = {}
    for name, pipeline in (("plain", False), ("pipelined", True)):
        t = Trainer.build(Grid(2, 2), engine, device, pipeline=pipeline)
        digests: list = []
        t.replica_sync.after_sync.append(
            lambda s, t=t, d=digests: d.append(float(sum(x.double().sum() for x in t.shard_tensors()))))
        forwards = watch_forwards(t.model)
        r = t.run(iter(batches), steps)
        out[name] = {"losses": r.losses, "digests": digests, "forwards": forwards, "syncs": t.state.sync.count}
        t.close()
    return out


@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one rank per GPU)")
def test_gpu_two_sharding_groups_sync_and_pipeline():
    ranks = _nccl_run(_gpu_two_groups, 12, world_size=2)
    for r in ranks:
        assert r["plain"]["syncs"] == r["pipelined"]["syncs"] == 6
        for x, y in zip(r["plain"]["losses"], r["pipelined"]["losses"]):
            assert math.isfinite(y) and abs(x - y) <= 1e-4 * max(1.0, abs(x))
        assert set(r["pipelined"]["forwards"]) == {"pipelined"} and set(r["plain"]["forwards"]) == {"plain"}
    for loop in ("plain", "pipelined"):  # M=2, L=1: both workers hold the whole model; after a sync, the same
        assert ranks[0][loop]["digests"] == ranks[1][loop]["digests"]
