"""The Ray launcher: `recgrid train CONFIG.yaml [--set key=value ...]`.

The driver validates the config (before any worker starts), opens the job's MLflow run, makes
sure the data exists (synthetic data for the demo), connects to Ray (an embedded local cluster
sized for the job, or $RAY_ADDRESS), and hands T workers to Ray Train's `TorchTrainer`. The
workers check the grid against the nodes Ray placed them on, build the 2-D engine and run the
shared training loop (train_loop.fit); rank 0 logs the reduced metrics into the run. The driver
then prints the summary and the command that opens the MLflow UI.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recgrid.config import ConfigError, JobConfig, load_config

# what the summary table shows, in order: (metric, label, format)
SUMMARY = (
    ("eval/ne", "eval NE", "{:.4f}"),
    ("eval/auc", "eval AUC", "{:.4f}"),
    ("train/ne", "train NE (window)", "{:.4f}"),
    ("train/loss", "train loss", "{:.4f}"),
    ("train/qps_median", "QPS (global, median of intervals)", "{:,.0f}"),
    ("train/step_time_s_median", "step time s (median of intervals)", "{:.4f}"),
    ("memory/peak_mb_max", "peak memory MiB (max worker)", "{:,.0f}"),
    ("memory/peak_mb_mean", "peak memory MiB (mean)", "{:,.0f}"),
    ("imbalance/lookup_max_over_mean", "lookup imbalance max/mean", "{:.3f}"),
    ("sync/count", "replica syncs", "{:.0f}"),
    ("sync/seconds_total", "replica sync s (total)", "{:.3f}"),
    ("train/examples_total", "examples trained", "{:,.0f}"),
)


@dataclass
class JobResult:
    run_id: str | None
    status: str  # FINISHED or FAILED
    metrics: dict[str, float]
    error: str | None = None
    seconds: float = 0.0
    ui_command: str = ""


def run_cli(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.set)
    except (ConfigError, FileNotFoundError) as e:
        print(f"recgrid train: invalid job config: {e}", file=sys.stderr)
        return 2
    result = run_job(config)
    return 0 if result.status == "FINISHED" else 1


def run_job(config: JobConfig) -> JobResult:
    """Run one training job end to end; its MLflow run ends FINISHED or FAILED with the error."""
    from recgrid.tracking import Tracker

    t0 = time.perf_counter()
    grid = config.build_grid()
    tracker = Tracker(config.tracking.experiment, config.tracking.tracking_uri)
    tracker.start(config.run_name, params=job_params(config),
                  tags={"layout": grid.layout, "num_groups": grid.num_groups, "launcher": "ray"})
    tracker.log_stack_versions()
    _say(f"MLflow run {tracker.run_id} ({config.run_name}) in experiment {config.tracking.experiment!r} "
         f"at {tracker.tracking_uri}")
    try:
        ensure_data(config)
        connect_ray(config)
        _fit_on_ray(config, tracker)
    except BaseException as e:  # noqa: BLE001 - the run records every failure, then it propagates as a status
        cause = _root_cause(e)
        tracker.fail(cause)  # the user's error, not Ray's wrapper around it
        error = f"{type(cause).__name__}: {cause}".splitlines()[0][:2000]
        _say(f"FAILED: {error}")
        return JobResult(tracker.run_id, "FAILED", {}, error, time.perf_counter() - t0, tracker.ui_command())
    tracker.log_metrics(interval_medians(tracker, config.train.max_steps), config.train.max_steps)
    tracker.finish()
    metrics = dict(tracker.client.get_run(tracker.run_id).data.metrics)
    result = JobResult(tracker.run_id, "FINISHED", metrics, None, time.perf_counter() - t0, tracker.ui_command())
    print(summary_table(config, result), flush=True)
    return result


def interval_medians(tracker: Any, step: int) -> dict[str, float]:
    """Median over the logging intervals of QPS and step time: the run's typical speed, which an
    interval holding an epoch's start-up or an evaluation does not skew."""
    import statistics

    out = {}
    for name in ("train/qps", "train/step_time_s"):
        values = [m.value for m in tracker.client.get_metric_history(tracker.run_id, name)]
        if values:
            out[f"{name}_median"] = statistics.median(values)
    return out


def job_params(config: JobConfig) -> dict[str, Any]:
    """Every config value, plus T, M, L, K, c and the layout under the names the paper uses."""
    grid = config.build_grid()
    return {
        **config.to_flat_dict(),
        "world_size": grid.world_size, "num_groups": grid.num_groups, "group_size": grid.group_size,
        "sync_every": config.grid.sync_every, "moment_scale": config.moment_scale, "layout": grid.layout,
    }


# ---- data -----------------------------------------------------------------------------------------
def ensure_data(config: JobConfig) -> None:
    """With data.synth_if_missing, generate synthetic Criteo data where the globs match nothing."""
    d = config.data
    if not d.synth_if_missing:
        return
    # eval rows are a held-out draw (another stream) of the same planted model as the training rows
    for role, patterns, rows, stream in (("train", d.train, d.synth_rows, 0), ("eval", d.eval, d.synth_eval_rows, 1)):
        for pattern in patterns:
            if _matches(pattern):
                continue
            out = _glob_root(pattern)
            fmt = "parquet" if pattern.endswith(".parquet") else "tsv.gz" if pattern.endswith(".gz") else "tsv"
            _say(f"data.{role}: {pattern!r} matches nothing; writing {rows:,} synthetic rows ({fmt}) to {out}/")
            from recgrid.synth import write_synth

            files = max(1, min(8, rows // 25_000))
            written = write_synth(str(out), rows, files=files, fmt=fmt, spec=config.dataset_spec(),
                                  seed=config.train.seed, stream=stream)
            if not _matches(pattern):
                raise ConfigError(f"data.{role}: wrote synthetic data to {written[0]} and others, but {pattern!r} "
                                  f"still matches none of it; use a glob such as {out}/*.{fmt}")


def _matches(pattern: str) -> bool:
    from recgrid.criteo import CriteoDataError, expand_inputs

    try:
        return bool(expand_inputs(pattern))
    except CriteoDataError:  # matches no file, or an empty directory
        return False


def _glob_root(pattern: str) -> Path:
    """The directory part of a glob before its first wildcard."""
    parts = Path(pattern).parts
    wild = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts) - 1)
    return Path(*parts[:wild]) if wild else Path(".")


# ---- Ray --------------------------------------------------------------------------------------------
def connect_ray(config: JobConfig) -> None:
    """Join $RAY_ADDRESS if set, else start an embedded local cluster sized for the job."""
    import ray

    if ray.is_initialized():
        return
    env_vars = {"PYTHONWARNINGS": "ignore", "TORCHREC_LOG_LEVEL": "ERROR"}
    address = os.environ.get("RAY_ADDRESS")
    if address:
        if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:
            # submitted with the Ray Job API: the job's own runtime env (working dir) carries the code
            ray.init(address=address, log_to_driver=True)
        else:
            # from outside the cluster: ship this package with the job; the image must hold the stack
            package = str(Path(__file__).resolve().parent)
            ray.init(address=address, runtime_env={"py_modules": [package], "env_vars": env_vars}, log_to_driver=True)
        _say(f"joined Ray cluster at {address}")
        return
    T, per_worker = config.grid.world_size, config.train.cpus_per_worker
    # the workers' share, plus room for Ray Data's read tasks so the stream never waits on them
    num_cpus = max(os.cpu_count() or 1, math.ceil(T * per_worker + 1))
    num_gpus = None if config.train.use_gpu else 0
    # the dashboard stays on: Ray Train's placement-group cleaner asks the state API it serves
    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, log_to_driver=True,
             runtime_env={"env_vars": env_vars}, logging_level="WARNING")
    _say(f"started a local Ray cluster: {num_cpus} logical CPUs for T={T} workers x {per_worker} CPU")


def _fit_on_ray(config: JobConfig, tracker: Any) -> None:
    import ray.data
    import ray.train
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from recgrid.data import read_dataset

    spec = config.dataset_spec()
    grid = config.build_grid()
    # one line per logging interval from rank 0 is the job's progress; per-dataset bars would bury it
    ray.data.DataContext.get_current().enable_progress_bars = False
    datasets = {"train": read_dataset([str(Path(p).absolute()) for p in config.data.train], spec)}
    eval_streams = None
    if config.data.eval:
        ds_eval = read_dataset([str(Path(p).absolute()) for p in config.data.eval], spec)
        # every eval row exactly once: unequal streams, which the loop keeps in lockstep
        eval_streams = ds_eval.streaming_split(grid.world_size, equal=False)
    loop_config = {
        "engine": engine_config(config),
        "fit": fit_config(config),
        "grid": grid,
        "use_gpu": config.train.use_gpu,
        "batch_size": config.train.batch_size,
        "eval_streams": eval_streams,
        "run_id": tracker.run_id,
        "tracking_uri": tracker.tracking_uri,
        "seed": config.train.seed,
    }
    storage = Path(os.environ.get("RECGRID_RUNS_DIR", "runs")).absolute() / "ray"
    trainer = TorchTrainer(
        train_loop_per_worker=train_worker,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=grid.world_size,
            use_gpu=config.train.use_gpu,
            resources_per_worker={"CPU": config.train.cpus_per_worker, **({"GPU": 1} if config.train.use_gpu else {})},
            # packed workers fill a node before the next; with M dividing the workers per node the
            # replica groups of the host-local layout are then host-local (the workers check it)
            placement_strategy="PACK",
        ),
        torch_config=TorchConfig(backend="nccl" if config.train.use_gpu else "gloo"),
        run_config=RunConfig(name=f"{config.run_name}-{tracker.run_id[:8]}", storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=config.train.max_failures)),
        datasets=datasets,
    )
    _say(f"training: T={grid.world_size} M={grid.num_groups} L={grid.group_size} K={config.grid.sync_every} "
         f"layout={grid.layout}, {config.train.max_steps} steps x {config.train.batch_size} rows/worker")
    trainer.fit()


def engine_config(config: JobConfig):
    from recgrid.model import ModelSpec
    from recgrid.optimizer import MomentScaledRowWiseAdagrad
    from recgrid.train_loop import EngineConfig

    m, o = config.model, config.optim
    return EngineConfig(
        spec=config.dataset_spec(),
        model=ModelSpec(arch=m.arch, embedding_dim=config.embedding_dim, dense_arch=tuple(config.dense_arch),
                        over_arch=tuple(m.over_arch), dcn_num_layers=m.dcn_num_layers,
                        dcn_low_rank_dim=m.dcn_low_rank_dim),
        embedding_optimizer=MomentScaledRowWiseAdagrad(lr=o.lr, eps=o.eps, moment_scale=config.moment_scale),
        dense_optimizer=o.dense_optimizer,
        dense_lr=o.dense_lr,
        sync_every=config.grid.sync_every,
        delayed_moment_sync=config.grid.delayed_moment_sync,
        sharding=m.sharding,
        seed=config.train.seed,
    )


def fit_config(config: JobConfig):
    from recgrid.train_loop import FitConfig

    t = config.train
    return FitConfig(max_steps=t.max_steps, log_every=t.log_every, eval_every=t.eval_every)


# ---- on every worker --------------------------------------------------------------------------------
def train_worker(cfg: dict) -> None:
    """Ray Train's per-worker function: place the grid, build the engine, run the loop."""
    import ray
    import ray.train
    import torch
    import torch.distributed as dist

    from recgrid.data import iter_batches
    from recgrid.device import worker_device
    from recgrid.sharding import sharding_summary
    from recgrid.train_loop import build_train_state, fit

    from recgrid.local import quiet_libraries

    quiet_libraries()
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    device = worker_device(ctx.get_local_rank(), cfg["use_gpu"])
    grid = place_grid(cfg["grid"], ray.get_runtime_context().get_node_id())
    state = build_train_state(grid, cfg["engine"], device)
    spec, batch_size = cfg["engine"].spec, cfg["batch_size"]

    tracker = None
    if rank == 0:
        from recgrid.tracking import Tracker

        tracker = Tracker.attach(cfg["run_id"], cfg["tracking_uri"])
        tracker.log_params({"sharding": sharding_summary(state.plan), "grid.workers_per_node": grid.workers_per_node})

    def train_epoch():
        return iter_batches(ray.train.get_dataset_shard("train"), batch_size, spec)

    eval_epoch = None
    if cfg["eval_streams"] is not None:
        stream = cfg["eval_streams"][rank]

        def eval_epoch():
            return iter_batches(stream, batch_size, spec, drop_last=False)

    max_steps = cfg["fit"].max_steps
    started = time.perf_counter()

    def on_log(values: dict[str, float], step: int) -> None:
        if tracker is None:
            return
        tracker.log_metrics(values, step)
        # to the process's own stdout: Ray Train's print patch would log the line a second time
        print(progress_line(values, step, max_steps, time.perf_counter() - started), file=sys.__stdout__, flush=True)

    fit(state, train_epoch, cfg["fit"], eval_epoch, on_log)
    state.replica_sync.close()
    dist.barrier()


def place_grid(grid, node_id: str):
    """The job's grid, checked against the nodes Ray placed the workers on (collective)."""
    import torch.distributed as dist

    from recgrid.grid import Grid

    node_of_rank: list[str] = [""] * grid.world_size
    dist.all_gather_object(node_of_rank, node_id)
    counts = Counter(node_of_rank)
    per_node = next(iter(counts.values())) if len(set(counts.values())) == 1 else None
    placed = Grid(grid.world_size, grid.num_groups, grid.layout, workers_per_node=per_node) if per_node else grid
    placed.check_placement(node_of_rank)
    return placed


def progress_line(m: dict[str, float], step: int, max_steps: int, elapsed: float) -> str:
    """One line per logging interval (training) or per evaluation."""
    if "eval/ne" in m:
        parts = [f"[recgrid] eval at step {step}/{max_steps}"]
        fields = (("eval/ne", "NE", "{:.4f}"), ("eval/auc", "AUC", "{:.4f}"), ("eval/examples", "rows", "{:,.0f}"))
    else:
        parts = [f"[recgrid] step {step:>6}/{max_steps}"]
        fields = (("train/qps", "qps", "{:,.0f}"), ("train/loss", "loss", "{:.4f}"), ("train/ne", "ne", "{:.4f}"),
                  ("memory/peak_mb_max", "mem MiB", "{:,.0f}"), ("sync/seconds_total", "sync s", "{:.2f}"))
    for key, label, fmt in fields:
        if key in m:
            parts.append(f"{label} {fmt.format(m[key])}")
    parts.append(f"{elapsed:,.0f}s")
    return " | ".join(parts)


# ---- the driver's report -------------------------------------------------------------------------------
def summary_table(config: JobConfig, result: JobResult) -> str:
    g = config.build_grid()
    rows = [("run", f"{config.run_name} ({result.run_id})"), ("status", result.status),
            ("grid", f"T={g.world_size} M={g.num_groups} L={g.group_size} K={config.grid.sync_every} "
                     f"c={config.moment_scale:g} layout={g.layout}"),
            ("wall time s", f"{result.seconds:,.1f}")]
    rows += [(label, fmt.format(result.metrics[key])) for key, label, fmt in SUMMARY if key in result.metrics]
    width = max(len(k) for k, _ in rows)
    lines = ["", "recgrid job summary", "-" * (width + 40)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["-" * (width + 40), f"open the MLflow UI on these runs:  {result.ui_command}", ""]
    return "\n".join(lines)


def _root_cause(e: BaseException) -> BaseException:
    """The user's error inside Ray's wrappers."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "cause", None) or e.__cause__
        if inner is None:
            worker_errors = getattr(e, "worker_failures", None)
            if isinstance(worker_errors, dict) and worker_errors:
                inner = next(iter(worker_errors.values()))
        if not isinstance(inner, BaseException):
            break
        e = inner
    return e


def _say(msg: str) -> None:
    print(f"[recgrid] {msg}", flush=True)
