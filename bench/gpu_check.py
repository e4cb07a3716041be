"""Checks recgrid's GPU path on a machine with CUDA GPUs, and measures its training QPS.

    .venv/bin/python bench/gpu_check.py [--dry-run] [--only CHECK ...] [--steps 40] [--qps-steps 50]
                                        [--batch-per-gpu 4096] [--rows-cap N] [--out bench/results/gpu_check.json]

T = the GPUs present (one worker per GPU, NCCL), M = 2 where T >= 2 (T even), else 1. Each check
is one function below, named as `--dry-run` lists it; each records "pass", "fail" (with what it
saw), "skip" (with why) or "error" (with the exception) and the figures it measured, and the
script goes on to the next. Everything it needs is local: random Criteo-shaped batches and
synthetic parquet files written to a temporary folder (no download; the wheels come from
`make install ACCEL=cuda`).

Writes the JSON (configuration, machine, per-check results) to --out and prints it.
Exit status: 0 every check that ran passed, 1 some check failed or errored, 2 no CUDA device here.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from recgrid.data.specs import get_spec
from recgrid.engine.grid import Grid
from recgrid.engine.model import ModelSpec
from recgrid.launch.report import machine_info, write_result

SMALL = get_spec("tiny")
# Criteo Kaggle's 26 tables at dim 128, MLPerf DLRM's MLPs (bottom 512-256-128, top 1024-1024-512-256-1)
MLPERF = ModelSpec(embedding_dim=128, dense_arch=(512, 256, 128), over_arch=(1024, 1024, 512, 256, 1))
PRECISIONS = ("fp32", "tf32", "bf16")
LOOPS = ("recgrid", "torchrec_plain", "torchrec_pipeline")


# ---- running on every GPU ----------------------------------------------------------------------------
def nccl_run(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 1200) -> list[Any]:
    """`fn(device, *args)` on `world_size` spawned processes, rank r on cuda:r of one NCCL group
    (recgrid's local launcher); their results by rank (a failing rank's traceback is raised here)."""
    from recgrid.launch.local import run_local

    threads = max(1, (os.cpu_count() or 1) // world_size)
    return run_local(_on_device, world_size, fn, *args, timeout_s=timeout_s, threads_per_worker=threads,
                     device_type="cuda")


def _on_device(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(torch.device("cuda", torch.cuda.current_device()), *args)


def _groups(T: int) -> int:
    return 2 if T >= 2 and T % 2 == 0 else 1


def _digest(tensors: list[torch.Tensor]) -> float:
    return float(sum(t.double().sum() for t in tensors))


# ---- the loop probe: checks 1-3 share one run ---------------------------------------------------------
def loop_probe(device: torch.device, M: int, steps: int) -> dict:
    """The plain loop, then the pipelined one (TorchRec's TrainPipelineSparseDist), on the same
    batches at fp32 with K=2: losses, how the sharded modules ran, and per sync a shard digest."""
    from recgrid.engine.sharding import watch_forwards
    from recgrid.launch.smoke import random_batches
    from recgrid.config import defaults
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    T, rank = dist.get_world_size(), dist.get_rank()
    grid = Grid(T, M)
    engine = EngineConfig.from_job(defaults(), spec=SMALL, seed=3, precision="fp32", sync_every=2)
    batches = list(itertools.islice(random_batches(SMALL, 512, seed=rank), steps))
    out: dict[str, Any] = {"shard_rank": grid.coords(rank).shard_rank}
    for name, pipeline in (("plain", False), ("pipelined", True)):
        t = Trainer.build(grid, engine, device, pipeline=pipeline)
        digests: list[float] = []
        t.replica_sync.after_sync.append(lambda s, t=t, d=digests: d.append(_digest(t.shard_tensors())))
        forwards = watch_forwards(t.model)
        r = t.run(iter(batches), steps)
        out[name] = {"losses": [float(x) for x in r.losses], "forwards": forwards, "digests": digests,
                     "syncs": t.state.sync.count}
        t.close()
    return out


@functools.cache
def _loop_results(T: int, steps: int) -> tuple[int, list[dict]]:
    M = _groups(T)
    return M, nccl_run(loop_probe, T, M, steps)


def check_pipeline_matches_plain(a: argparse.Namespace, T: int) -> dict:
    """Pipelined and plain loops give the same losses (fp32, T GPUs, M=2 where T >= 2)."""
    M, ranks = _loop_results(T, a.steps)
    worst = max(abs(x - y) / max(1.0, abs(x)) for r in ranks
                for x, y in zip(r["plain"]["losses"], r["pipelined"]["losses"]))
    same_count = all(len(r["plain"]["losses"]) == len(r["pipelined"]["losses"]) == a.steps for r in ranks)
    finite = all(math.isfinite(x) for r in ranks for x in r["pipelined"]["losses"])
    ok = same_count and finite and worst <= 1e-4
    return {"status": "pass" if ok else "fail", "T": T, "M": M, "steps": a.steps,
            "max_relative_loss_difference": worst, "tolerance": 1e-4}


def check_embeddings_really_pipelined(a: argparse.Namespace, T: int) -> dict:
    """TorchRec's pipeline really ran the sharded embedding collection pipelined (it falls back silently)."""
    M, ranks = _loop_results(T, a.steps)
    kinds = [sorted(set(r["pipelined"]["forwards"])) for r in ranks]
    calls = [len(r["pipelined"]["forwards"]) for r in ranks]
    ok = all(k == ["pipelined"] for k in kinds) and all(c >= a.steps for c in calls)
    return {"status": "pass" if ok else "fail", "forward_kinds_per_rank": kinds, "calls_per_rank": calls}


def check_replica_digests_equal(a: argparse.Namespace, T: int) -> dict:
    """After every replica sync, the M copies of each shard are identical (digests per replica group)."""
    M, ranks = _loop_results(T, a.steps)
    if M == 1:
        return {"status": "skip", "why": "M = 1 with one GPU (or an odd T): there is no replica group to sync"}
    bad = []
    for loop in ("plain", "pipelined"):
        by_shard: dict[int, list[list[float]]] = {}
        for r in ranks:
            by_shard.setdefault(r["shard_rank"], []).append(r[loop]["digests"])
        for shard, copies in by_shard.items():
            if any(c != copies[0] for c in copies) or not copies[0]:
                bad.append({"loop": loop, "shard_rank": shard, "digests": copies})
    syncs = ranks[0]["pipelined"]["syncs"]
    return {"status": "pass" if not bad and syncs == a.steps // 2 else "fail", "M": M, "syncs": syncs,
            "mismatches": bad}


# ---- fp16 tables at M = 3 ---------------------------------------------------------------------------
def fp16_probe(device: torch.device, steps: int) -> dict:
    """T=3, M=3, K=1, fp16 tables: ids only in the lower half of every table, so the upper half
    is never trained; it must come out of `steps` syncs bit-identical to where it started."""
    from recgrid.launch.smoke import random_batches
    from recgrid.config import defaults
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    T, rank = dist.get_world_size(), dist.get_rank()
    spec = SMALL
    engine = EngineConfig.from_job(defaults(), spec=spec, model=ModelSpec(embedding_dtype="fp16"), seed=3, sync_every=1)
    t = Trainer.build(Grid(T, T), engine, device)
    weights = [w for w in t.shard_tensors() if w.dtype == torch.float16]
    before = [w.detach().clone() for w in weights]
    half = [max(1, r // 2) for r in spec.table_rows]

    def lower_half(batch):
        kjt = batch.sparse_features
        caps = torch.tensor(half).repeat_interleave(kjt.lengths().view(len(half), -1).sum(1))
        batch.sparse_features = type(kjt).from_lengths_sync(keys=kjt.keys(), values=kjt.values() % caps,
                                                            lengths=kjt.lengths())
        return batch

    batches = [lower_half(b) for b in itertools.islice(random_batches(spec, 512, seed=rank), steps)]
    t.run(iter(batches), steps)
    moved = []
    for i, (w, b) in enumerate(zip(weights, before)):
        rows = w.shape[0]
        # weights are per table in the fused kernels' order; a row of the upper half of every table
        # is untouched when the table's ids were capped at half of its rows
        upper = slice(rows // 2 + 1, rows) if rows > 2 else slice(rows, rows)
        if not torch.equal(w[upper], b[upper]):
            moved.append({"tensor": i, "max_abs_change": float((w[upper].float() - b[upper].float()).abs().max())})
    out = {"syncs": t.state.sync.count, "fp16_tensors": len(weights), "moved": moved}
    t.close()
    return out


def check_fp16_untouched_rows_unchanged(a: argparse.Namespace, T: int) -> dict:
    """fp16 tables' rows that no batch touches are bit-identical after many syncs at M=3 (needs 3 GPUs)."""
    if T < 3:
        return {"status": "skip", "why": f"needs 3 GPUs for M=3, this machine has {T}"}
    ranks = nccl_run(fp16_probe, 3, a.steps)
    ok = all(not r["moved"] and r["fp16_tensors"] > 0 and r["syncs"] == a.steps for r in ranks)
    return {"status": "pass" if ok else "fail", "T": 3, "M": 3, "syncs": ranks[0]["syncs"],
            "moved_per_rank": [r["moved"] for r in ranks]}


# ---- memory at start-up -----------------------------------------------------------------------------
def memory_probe(device: torch.device, M: int, rows_cap: int) -> dict:
    from recgrid.config import defaults
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    T = dist.get_world_size()
    spec = get_spec("criteo_kaggle", rows_cap)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    t = Trainer.build(Grid(T, M), EngineConfig.from_job(defaults(), spec=spec, model=MLPERF, seed=3), device)  # plans, shards, aligns
    torch.cuda.synchronize(device)
    shard = sum(x.numel() * x.element_size() for x in t.shard_tensors())
    dense = sum(p.numel() * p.element_size() for n, p in t.model.named_parameters() if "embedding_bag" not in n)
    out = {"peak_bytes": torch.cuda.max_memory_allocated(device) - base, "shard_bytes": shard, "dense_bytes": dense,
           "held_bytes": torch.cuda.memory_allocated(device) - base}
    t.close()
    return out


def check_startup_peak_memory(a: argparse.Namespace, T: int) -> dict:
    """Peak device memory of start-up (plan, shard, align) stays near the shard's own bytes (no second copy)."""
    M = _groups(T)
    ranks = nccl_run(memory_probe, T, M, a.rows_cap)
    ratios = [r["peak_bytes"] / max(1, r["shard_bytes"]) for r in ranks]
    slack = 512 * 2**20
    # a second copy of the shard (the old align's flat buffer) would put the peak at ~2x
    ok = all(r["peak_bytes"] <= 1.25 * r["shard_bytes"] + 4 * r["dense_bytes"] + slack for r in ranks)
    return {"status": "pass" if ok else "fail", "T": T, "M": M, "rows_cap": a.rows_cap,
            "peak_over_shard_per_rank": [round(x, 3) for x in ratios], "per_rank": ranks}


# ---- the device each Ray worker uses ----------------------------------------------------------------
def _device_report(cfg: dict) -> None:
    """Ray Train worker body: the device recgrid's workers choose (`train.worker.ray_worker_device`,
    what the worker body calls), against the device Ray assigned to this worker."""
    import ray.train
    import ray.train.torch

    from recgrid.train.worker import ray_worker_device

    ctx = ray.train.get_context()
    ours = ray_worker_device(use_gpu=True)
    ray_device = ray.train.torch.get_device()
    row = {"rank": ctx.get_world_rank(), "local_rank": ctx.get_local_rank(), "ours": str(ours),
           "current_device": torch.cuda.current_device(), "ray": str(ray_device),
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    with open(os.path.join(cfg["dir"], f"{cfg['run']}-{ctx.get_world_rank()}.json"), "w") as f:
        json.dump(row, f)


def check_device_matches_ray(a: argparse.Namespace, T: int) -> dict:
    """Each Ray Train worker computes on the GPU Ray gave it: one run of all T workers, and T runs
    of one worker side by side (as every sharding group of M = T is a run of its own, whose workers
    count local ranks apart)."""
    import threading

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from recgrid.config import load_config
    from recgrid.launch.ray import torch_config

    out: dict[str, Any] = {}
    ray.init(num_gpus=T, num_cpus=max(2, T + 1), logging_level="WARNING", include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config = load_config(None, ["data.train=x/*.parquet", "train.use_gpu=true", f"grid.world_size={T}",
                                        f"grid.num_groups={T}"])

            def fit(run: str, workers: int) -> None:
                TorchTrainer(_device_report, train_loop_config={"dir": tmp, "run": run},
                             scaling_config=ScalingConfig(num_workers=workers, use_gpu=True,
                                                          resources_per_worker={"CPU": 1, "GPU": 1}),
                             torch_config=torch_config(config),
                             run_config=RunConfig(name=f"gpu-check-{run}", storage_path=tmp)).fit()

            for mode, runs in (("one_run", [("all", T)]), ("run_per_group", [(f"g{g}", 1) for g in range(T)])):
                try:
                    errors: list[BaseException] = []

                    def go(run: str, workers: int) -> None:
                        try:
                            fit(run, workers)
                        except BaseException as e:  # noqa: BLE001 - reported below
                            errors.append(e)

                    threads = [threading.Thread(target=go, args=r) for r in runs]
                    for th in threads:
                        th.start()
                    for th in threads:
                        th.join()
                    if errors:
                        raise errors[0]
                    rows = [json.load(open(os.path.join(tmp, f))) for f in sorted(os.listdir(tmp))
                            if f.endswith(".json") and f.split("-")[0] in {r for r, _ in runs}]
                    wrong = [r for r in rows if r["ours"] != r["ray"] or f"cuda:{r['current_device']}" != r["ray"]]
                    out[mode] = {"workers": rows, "mismatches": len(wrong), "devices": len({r["ray"] for r in rows})}
                except Exception as e:  # noqa: BLE001 - the other mode still runs
                    out[mode] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        ray.shutdown()
    ok = all(v.get("mismatches") == 0 for v in out.values()) and out.get("run_per_group", {}).get("devices") == T
    return {"status": "pass" if ok else "fail", **out}


# ---- torchft's collectives on the GPU -----------------------------------------------------------------
def ft_probe(device: torch.device, lighthouse: str, n: int) -> dict:
    """One torchft replica per GPU (its own manager, NCCL across replicas, as `train.recovery.peers.make_manager`
    builds them): the component's average of identical fp16 rows and per-replica fp32 values, its
    stop agreement and its metric reduction, every tensor on the GPU as NCCL needs."""
    from datetime import timedelta
    from types import SimpleNamespace

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupNCCL

    from recgrid.engine.sync import SyncState, average_
    from recgrid.train.recovery.peers import TorchftReplicas

    rank = dist.get_rank()
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=60)
    manager = Manager(pg=ProcessGroupNCCL(timeout=timeout), load_state_dict=lambda sd: None, state_dict=lambda: {},
                      min_replica_size=n, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout, rank=0,
                      world_size=1, replica_id=f"gpu_check_{rank}", store_addr="localhost", store_port=store.port,
                      lighthouse_addr=lighthouse)
    try:
        manager.start_quorum()
        # no model: the probe averages its own tensors (the component turns DDP's all-reduce off in a module)
        trainer = SimpleNamespace(device=device, model=torch.nn.Module(), state=SimpleNamespace(sync=SyncState()),
                                  config=SimpleNamespace(sync_every=1, delayed_moment_sync=False),
                                  replica_sync=SimpleNamespace(weights=[], states=[]))
        reps = TorchftReplicas(trainer, manager, heal=None, listener=None)
        reps.live = live = manager.num_participants()
        g = torch.Generator().manual_seed(0)
        rows = (torch.rand(1 << 16, generator=g) * 2 - 1).to(torch.float16).to(device)
        tensors = [rows.clone(), torch.full((8,), float(rank), device=device)]
        average_(tensors, reps.trainer.replica_sync.transport)
        stop = reps.agree_stop(rank == 0)
        sums, maxes = torch.ones(3, dtype=torch.float64, device=device), torch.full((2,), float(rank), dtype=torch.float64,
                                                                                       device=device)
        reps._reduce_sums(sums, maxes)
        torch.cuda.synchronize(device)
        return {"live": live, "fp16_rows_changed": int((tensors[0] != rows).sum()),
                "fp32_mean": float(tensors[1][0]), "stop": stop, "sums": sums.tolist(), "maxes": maxes.tolist()}
    finally:
        manager.shutdown(wait=False)


def check_torchft_collectives_on_gpu(a: argparse.Namespace, T: int) -> dict:
    """torchft's replica average, stop flag and metric sums run on NCCL with GPU tensors; identical fp16 rows stay bit-identical."""
    from torchft._torchft import LighthouseServer

    n = min(T, 3)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=n, join_timeout_ms=30_000)
    try:
        ranks = nccl_run(ft_probe, n, lighthouse.address(), n)
    finally:
        lighthouse.shutdown()
    mean = sum(range(n)) / n
    ok = all(r["live"] == n and r["fp16_rows_changed"] == 0 and abs(r["fp32_mean"] - mean) < 1e-6
             and r["sums"] == [float(n)] * 3 and r["maxes"] == [float(n - 1)] * 2 and (r["stop"] or n == 1)
             for r in ranks)
    return {"status": "pass" if ok else "fail", "replicas": n, "per_replica": ranks,
            "note": "one GPU: a quorum of one (the stop agreement needs no collective there)" if n == 1 else ""}


# ---- pinned batches ----------------------------------------------------------------------------------
def check_batches_pinned(a: argparse.Namespace, T: int) -> dict:
    """A CUDA worker's batches out of Ray Data are pinned, so the pipeline's non_blocking copies are asynchronous."""
    import ray

    from recgrid.data.stream import TrainData, scan_inputs
    from recgrid.data.synth import write_synth
    from recgrid.data.units import DataCursor, EpochPlan
    from recgrid.engine.device import pin_batches

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    batch = 8192
    ray.init(num_cpus=4, logging_level="WARNING", include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_synth(os.path.join(tmp, "train"), 8 * batch, files=1, fmt="parquet", spec=SMALL, seed=1)
            inputs = scan_inputs(os.path.join(tmp, "train", "*.parquet"), SMALL)
            out: dict[str, Any] = {}
            for pin in (pin_batches(device), False):
                data = TrainData(EpochPlan(inputs, 0, batch, 8 * batch), SMALL, 0, 1, pin=pin)
                _, batches = data.segment_batches(DataCursor())
                got = list(batches)
                pinned = [b.dense_features.is_pinned() and b.sparse_features.values().is_pinned() for b in got]
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()  # the host's time to issue the copies (asynchronous only from pinned memory)
                moved = [b.to(device, non_blocking=True) for b in got]
                issue_s = time.perf_counter() - t0
                torch.cuda.synchronize(device)
                del moved
                out["pinned" if pin else "pageable"] = {"batches": len(got), "all_pinned": all(pinned),
                                                         "none_pinned": not any(pinned), "issue_seconds": issue_s}
    finally:
        ray.shutdown()
    ok = out["pinned"]["all_pinned"] and out["pageable"]["none_pinned"] and out["pinned"]["batches"] == 8
    return {"status": "pass" if ok else "fail", "batch": batch, **out}


# ---- in-memory snapshots out of device memory --------------------------------------------------------
def check_snapshot_to_host_memory(a: argparse.Namespace, T: int) -> dict:
    """An in-memory snapshot of a CUDA trainer (NCCL) lands in its host's holder and restores bit for bit, its copy issued without waiting."""
    import uuid

    import ray

    from recgrid.config import SnapshotCadence, defaults
    from recgrid.engine.device import HostCopy, pin_host_memory
    from recgrid.launch.smoke import random_batches
    from recgrid.train.checkpoint import Checkpointer
    from recgrid.train.control import JobControl
    from recgrid.train.recovery import holders, slots
    from recgrid.train.recovery.coordinator import RecoveryCoordinator
    from recgrid.train.recovery.storage import StorageFallback
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    out: dict[str, Any] = {}
    # the copy itself: a 256 MiB table into a page-locked slot file is issued without the host waiting for it
    src = torch.randn(64 << 20, device=device)
    with tempfile.TemporaryDirectory(dir=slots.SHM_BASE if os.path.isdir(slots.SHM_BASE) else None) as tmp:
        path = os.path.join(tmp, "slot")
        with open(path, "wb") as f:
            f.truncate(src.numel() * 4)
        mm, buf = slots.map_slot(path, src.numel() * 4)
        undo = pin_host_memory(buf)
        torch.cuda.synchronize(device)
        copier, t0 = HostCopy(device), time.perf_counter()
        slots.write_into(buf, [src], [("float32", [src.numel()], 0)], copier)
        copier.issued()
        out["issue_seconds"] = time.perf_counter() - t0
        copier.wait()
        out["copy_seconds"] = time.perf_counter() - t0
        out["pinned"], out["copy_equal"] = undo is not None, bool(torch.equal(buf.view(torch.float32).cpu(), src.cpu()))
        if undo is not None:
            undo()
        del buf
        mm.close()
    # the whole path: a trainer on one GPU (NCCL), its snapshot on a holder, a fresh trainer restored from it
    spec = SMALL
    engine = EngineConfig.from_job(defaults(), spec=spec, sync_every=2, seed=5)
    batches = [b for b, _ in zip(random_batches(spec, 256, seed=0), range(4))]
    ray.init(num_cpus=4, logging_level="WARNING", include_dashboard=False)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            node = ray.get_runtime_context().get_node_id()
            control, coordinator = JobControl.remote(), RecoveryCoordinator.remote(uuid.uuid4().hex)
            grid = Grid(1, 1)
            trainer = Trainer.build(grid, engine, device)
            snapshotter = holders.Snapshotter(trainer, coordinator, grid, trainer.groups, [node],
                                              SnapshotCadence(every_syncs=1))
            trainer.run(iter(batches), 4)
            t0 = time.perf_counter()
            snapshotter.snapshot()
            out["snapshot_seconds"] = time.perf_counter() - t0
            snapshotter.close()
            want = holders.digest([t.detach().cpu().numpy() for t in trainer.shard_tensors()])
            fresh = Trainer.build(grid, engine, device)
            restored = StorageFallback(Checkpointer(), control, coordinator, 0, 0,
                                       holders=holders.HolderRestore(coordinator, grid, fresh.groups, [node])).restore(fresh)
            got = holders.digest([t.detach().cpu().numpy() for t in fresh.shard_tensors()])
            out.update(restored_source=restored["source"], restored_step=restored["step"], bit_identical=got == want,
                       via=restored["shards"][0]["via"])
            ray.get(coordinator.release.remote())
        finally:
            dist.destroy_process_group()
            ray.shutdown()
    ok = out["copy_equal"] and out["bit_identical"] and out["restored_step"] == 4 and out["restored_source"] == "holder"
    return {"status": "pass" if ok else "fail", **out,
            "note": "issue_seconds well under copy_seconds: the host did not wait for the device-to-host copy"}


# ---- evaluation precision ---------------------------------------------------------------------------
def eval_probe(device: torch.device, eval_glob: str, steps: int) -> dict:
    """A bf16 job trained `steps` steps; its evaluation (Trainer.evaluate) against the same model's
    predictions computed in fp32 and under bf16 autocast."""
    from recgrid.data.stream import scan_inputs
    from recgrid.engine.device import autocast
    from recgrid.launch.smoke import random_batches
    from recgrid.train.metrics import EvalMetrics, reduce_metrics
    from recgrid.config import defaults
    from recgrid.train.trainer import EvalData, Trainer
    from recgrid.trainer_config import EngineConfig

    T, rank = dist.get_world_size(), dist.get_rank()
    t = Trainer.build(Grid(T, 1), EngineConfig.from_job(defaults(), spec=SMALL, seed=3, precision="bf16"), device)
    t.run(itertools.islice(random_batches(SMALL, 1024, seed=rank), steps), steps)
    data = EvalData(scan_inputs(eval_glob, SMALL), SMALL, 1024, rank, T)
    ours = t.evaluate(data)

    def by_hand(precision: str) -> dict:
        evaluation, distinct = EvalMetrics(device=device), set()
        t.model.eval()
        with torch.no_grad():
            for batch in data.batches():
                with autocast(device, precision):
                    _, (_, logits, labels) = t.model(batch.to(device))
                p = torch.sigmoid(logits.float())
                distinct.update(p.reshape(-1).tolist())
                evaluation.update(p, labels)
        t.model.train()
        return {**reduce_metrics(t.groups.global_pg, evaluation=evaluation), "distinct_predictions": len(distinct)}

    out = {"recgrid": ours, "fp32": by_hand("fp32"), "bf16": by_hand("bf16")}
    t.close()
    return out


def check_eval_bf16_vs_fp32(a: argparse.Namespace, T: int) -> dict:
    """A bf16 job's evaluation NE/AUC equal the fp32 evaluation's (bf16 predictions tie and shift NE)."""
    from recgrid.data.synth import write_synth

    with tempfile.TemporaryDirectory() as tmp:
        write_synth(os.path.join(tmp, "eval"), 50_000, files=1, fmt="parquet", spec=SMALL, seed=1, stream=1)
        ranks = nccl_run(eval_probe, 1, os.path.join(tmp, "eval", "*.parquet"), a.steps)
    r = ranks[0]

    def gap(x: dict, y: dict, key: str) -> float:
        return abs(x.get(key, math.nan) - y.get(key, math.nan))

    ok = gap(r["recgrid"], r["fp32"], "eval/ne") <= 1e-5 and gap(r["recgrid"], r["fp32"], "eval/auc") <= 1e-5
    return {"status": "pass" if ok else "fail",
            "ne": {k: r[k].get("eval/ne") for k in ("recgrid", "fp32", "bf16")},
            "auc": {k: r[k].get("eval/auc") for k in ("recgrid", "fp32", "bf16")},
            "auc_max_error": {k: r[k].get("eval/auc_max_error") for k in ("recgrid", "fp32", "bf16")},
            "distinct_predictions": {k: r[k]["distinct_predictions"] for k in ("fp32", "bf16")}}


# ---- training QPS: recgrid's loop against TorchRec's -------------------------------------------------
def qps_probe(device: torch.device, loop: str, precision: str, batch: int, steps: int, rows_cap: int | None,
              M: int) -> dict:
    """Examples per second of one loop on Criteo Kaggle shapes (dim 128, MLPerf MLPs)."""
    from recgrid.engine.device import autocast, configure_matmul, device_memory_bytes
    from recgrid.engine.model import build_model
    from recgrid.launch.smoke import random_batches

    T, rank = dist.get_world_size(), dist.get_rank()
    spec = get_spec("criteo_kaggle", rows_cap)
    configure_matmul(device, precision)
    pool = [b.pin_memory() for b in itertools.islice(random_batches(spec, batch, seed=rank), 16)]
    warmup = 10

    if loop == "recgrid":
        from recgrid.config import defaults
        from recgrid.train.trainer import Trainer
        from recgrid.trainer_config import EngineConfig

        t = Trainer.build(Grid(T, M), EngineConfig.from_job(defaults(), spec=spec, model=MLPERF, seed=3, precision=precision), device)
        t.run(itertools.cycle(pool), warmup)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        t.run(itertools.cycle(pool), warmup + steps)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        t.close()
    else:
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
        from torchrec.distributed.types import ShardingEnv
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        from recgrid.engine.optimizer import MomentScaledRowWiseAdagrad

        model = build_model(spec, MLPERF, seed=3, dense_device=device)
        sharder = EmbeddingBagCollectionSharder(fused_params=MomentScaledRowWiseAdagrad(lr=0.05, eps=1e-8, moment_scale=1).fused_params())
        topology = Topology(world_size=T, compute_device="cuda", hbm_cap=device_memory_bytes(device))
        plan = EmbeddingShardingPlanner(topology=topology).collective_plan(model, [sharder], dist.group.WORLD)
        dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                       plan=plan, sharders=[sharder])
        opt = torch.optim.Adagrad([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=0.01)

        def forward(b):
            with autocast(device, precision):
                return dmp(b)

        if loop == "torchrec_plain":
            def step(it):
                b = next(it).to(device, non_blocking=True)
                opt.zero_grad()
                loss, _ = forward(b)
                loss.backward()
                opt.step()
        else:
            pipe = TrainPipelineSparseDist(dmp, opt, device, custom_model_fwd=forward)

            def step(it):
                pipe.progress(it)
        it = itertools.cycle(pool)
        for _ in range(warmup):
            step(it)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(it)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "examples": batch * T * steps}


def check_training_qps(a: argparse.Namespace, T: int) -> dict:
    """Training QPS: recgrid's loop vs a bare TorchRec loop vs TrainPipelineSparseDist (fp32/TF32/bf16)."""
    rows = []
    M = 1  # TorchRec's loops are M = 1: the same model, the same parallelism
    for precision in PRECISIONS:
        for loop in LOOPS:
            try:
                ranks = nccl_run(qps_probe, T, loop, precision, a.batch_per_gpu, a.qps_steps, a.rows_cap, M)
                seconds = max(r["seconds"] for r in ranks)
                rows.append({"loop": loop, "precision": precision, "M": M,
                             "qps": round(ranks[0]["examples"] / seconds, 1),
                             "step_seconds": round(seconds / a.qps_steps, 6)})
            except Exception as e:  # noqa: BLE001 - the other loops still run
                rows.append({"loop": loop, "precision": precision, "error": f"{type(e).__name__}: {e}"[-2000:]})
    by = {(r["loop"], r["precision"]): r.get("qps") for r in rows}
    vs = {p: {"recgrid_over_torchrec_pipeline": (by[("recgrid", p)] / by[("torchrec_pipeline", p)])
              if by.get(("recgrid", p)) and by.get(("torchrec_pipeline", p)) else None} for p in PRECISIONS}
    ok = all("error" not in r for r in rows)
    return {"status": "pass" if ok else "error", "T": T, "batch_per_gpu": a.batch_per_gpu, "steps": a.qps_steps,
            "rows_cap": a.rows_cap, "spec": "criteo_kaggle", "model": "dlrm dim 128, bottom 512-256-128, "
            "top 1024-1024-512-256-1", "runs": rows, "ratios": vs}


CHECKS: list[tuple[str, Callable[[argparse.Namespace, int], dict]]] = [
    ("pipeline_matches_plain", check_pipeline_matches_plain),
    ("embeddings_really_pipelined", check_embeddings_really_pipelined),
    ("replica_digests_equal", check_replica_digests_equal),
    ("fp16_untouched_rows_unchanged", check_fp16_untouched_rows_unchanged),
    ("startup_peak_memory", check_startup_peak_memory),
    ("device_matches_ray", check_device_matches_ray),
    ("torchft_collectives_on_gpu", check_torchft_collectives_on_gpu),
    ("batches_pinned", check_batches_pinned),
    ("snapshot_to_host_memory", check_snapshot_to_host_memory),
    ("eval_bf16_vs_fp32", check_eval_bf16_vs_fp32),
    ("training_qps", check_training_qps),
]


def describe(fn: Callable) -> str:
    return (fn.__doc__ or "").strip().splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="list the checks and exit")
    ap.add_argument("--only", nargs="+", choices=[n for n, _ in CHECKS], help="run these checks only")
    ap.add_argument("--steps", type=int, default=40, help="training steps of the correctness checks")
    ap.add_argument("--qps-steps", type=int, default=50, help="measured steps per QPS run (after 10 warm-up)")
    ap.add_argument("--batch-per-gpu", type=int, default=4096)
    ap.add_argument("--rows-cap", type=int, default=None,
                    help="cap Criteo Kaggle's tables at this many rows (memory and QPS checks); default: full size")
    ap.add_argument("--out", default="bench/results/gpu_check.json")
    a = ap.parse_args(argv)
    chosen = [(n, f) for n, f in CHECKS if not a.only or n in a.only]
    if a.dry_run:
        for name, fn in chosen:
            print(f"{name}: {describe(fn)}")
        return 0
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a machine with GPUs.",
              file=sys.stderr)
        return 2
    T = torch.cuda.device_count()
    results: dict[str, dict] = {}
    for name, fn in chosen:
        t0 = time.perf_counter()
        try:
            res = fn(a, T)
        except Exception:  # noqa: BLE001 - every check gets its line
            res = {"status": "error", "error": traceback.format_exc()[-4000:]}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = res
        print(f"{name}: {res['status']} ({res['seconds']} s)", file=sys.stderr, flush=True)
    result = {
        "benchmark": "gpu_check",
        "configuration": {"gpus": T, "steps": a.steps, "qps_steps": a.qps_steps, "batch_per_gpu": a.batch_per_gpu,
                          "rows_cap": a.rows_cap, "checks": [n for n, _ in chosen]},
        "machine": machine_info(),
        "checks": results,
    }
    write_result(a.out, result)
    print(json.dumps(result, indent=2))
    return 0 if all(r["status"] in ("pass", "skip") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
