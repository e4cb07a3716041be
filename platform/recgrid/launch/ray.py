"""The Ray driver: `recgrid train CONFIG.yaml [--set key=value ...]`.

The driver only wires: it validates the config (before any worker starts), opens the job's one
MLflow run, makes sure the data exists (synthetic data for the demo), connects to Ray (an
embedded local cluster sized for the job, or $RAY_ADDRESS), makes and records the sharding
plan (once per job: every restart replays it), counts the training rows, starts the job's two
actors, which outlive every worker group (job control, `train.control`; the recovery
coordinator, `train.recovery.coordinator`), translates the JobConfig once into what the workers
build from (`EngineConfig.from_job`, `LoopConfig.from_job`, `train.job.WorkerJob`), and hands the
workers to Ray Train: one `TorchTrainer` run per sharding group, side by side, with
`train.worker.train_group_worker` as their body and the job's torchft lighthouse in this process,
through `train.entry` (light to import). The runs themselves, where they go, who owns them and
when they start again: `launch.runs`. When Ray Train is done the driver logs the model, closes
the run and prints the summary.

The console: Ray's forwarding of worker output is off (`log_to_driver=False`); the workers hand
their lines to job control and the driver prints them (`launch.runs.Console`), unprefixed.

Interrupts (`Interrupts`): Ray Train's fit runs in a thread of its own, so SIGINT and SIGTERM
reach the driver's handler. The first asks the workers to stop at their next sync step (they
write a checkpoint if the job has checkpoints and skip the final evaluation; the run ends KILLED,
tagged `interrupted`, and `recgrid train` exits 128 + the signal: 130, 143); a second signal, or
workers that have not stopped within `STOP_GRACE_S`, end the job at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recgrid.cluster import connect
from recgrid.config import ConfigError, JobConfig, load_config
from recgrid.data.specs import SPARSE_NAMES, embedding_bytes
from recgrid.data.stream import head_ids, scan_inputs
from recgrid.data.synth import ensure_synth
from recgrid.engine.device import device_memory_bytes, device_type_for, process_group_backend, use_gpu_default
from recgrid.engine.model import build_model
from recgrid.engine.sharding import make_plan, plan_record, shard_position_bytes
from recgrid.engine.towers import tower_plan
from recgrid.launch.model import log_job_model
from recgrid.launch.placement import (GROUP_RUN_PLACEMENT, check_holder_room, check_room_for_data, cluster_slots,
                                      holder_bytes, label_selectors, positions_by_node, record_ranks)
from recgrid.launch.report import say, summary_table
from recgrid.launch.runs import (Console, HolderMeter, JobRuns, end_workers, node_room, placer, training_over,
                                 worker_resources, workers_finishing)
from recgrid.logs import libraries_quiet
from recgrid.plan.planner import job_sharding_plan
from recgrid.tracking import Tracker
from recgrid.train.control import STOP_NOW, FailureClock, JobControl
from recgrid.train.entry import group_worker, pack
from recgrid.train.audit import CALL_AUDIT_ENV
from recgrid.train.job import TABLE_DIGESTS_ENV, WorkerJob
from recgrid.train.recovery.coordinator import RecoveryCoordinator
from recgrid.train.recovery.holders import KEEP_GENERATIONS
from recgrid.train.recovery.peers import Lighthouse, bind_host
from recgrid.train.recovery.slots import remove_snapshot_files
from recgrid.train.schedule import Schedule
from recgrid.trainer_config import EngineConfig, LoopConfig


@dataclass(frozen=True)
class JobActors:
    """The job's two actors, owned by the driver: job control and the recovery coordinator."""

    control: Any
    recovery: Any

    def status(self, timeout: float = 30) -> dict[str, Any]:
        """Both actors' records in one dict: attempts, last step, stop (control); events, holders (recovery)."""
        import ray

        control, recovery = ray.get([self.control.status.remote(), self.recovery.status.remote()], timeout=timeout)
        return {**control, **recovery}

    def end(self) -> None:
        """The job is over: both actors go (the coordinator takes its snapshot holders with it), so
        a cluster that runs job after job (`recgrid compare`, a long-lived cluster) keeps no
        process per finished job."""
        import ray

        for actor in (self.control, self.recovery):
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone (the cluster was shut down at an interrupt)
                pass


STOP_GRACE_S = 20.0  # after the first interrupt, how long the workers get to stop before they are ended
RUNS_END_GRACE_S = 10.0  # after the job's training ended, how long its groups' runs get to end on their own
# ... and how long when a worker that trained is still finishing (the writing group's final checkpoint,
# which the driver logs as the model: a loaded machine took more than RUNS_END_GRACE_S)
RUNS_FINISH_GRACE_S = 180.0
CONSOLE_POLL_S = 0.25  # how often the driver prints what the workers said
EXIT_INTERRUPTED = 128 + signal.SIGINT  # the shell's code for a command ended by Ctrl-C (SIGTERM's: 128 + 15)


class FailuresSpent(RuntimeError):
    """A sharding group's Ray Train run failed more often than `train.max_failures` allows (its
    last failure is the `__cause__`); the job fails with it."""

    def __init__(self, group: int, max_failures: int) -> None:
        super().__init__(f"sharding group {group} failed {max_failures + 1} times, more than train.max_failures="
                         f"{max_failures} allows" if max_failures else
                         f"sharding group {group} failed, and train.max_failures=0 survives no failure")
        self.group, self.max_failures = group, max_failures


class Interrupted(KeyboardInterrupt):
    """The job was interrupted (SIGINT or SIGTERM); `step` is where it stopped, when known."""

    def __init__(self, why: str, step: int | None = None) -> None:
        super().__init__(why)
        self.why, self.step = why, step

    def __str__(self) -> str:
        return self.why + (f" at step {self.step}" if self.step is not None else "")

    @property
    def exit_code(self) -> int:
        """The shell's code for a command ended by the signal that interrupted it (Ctrl-C's when unknown)."""
        name = self.why.split(";", 1)[0].strip()
        return 128 + int(getattr(signal, name)) if name in ("SIGINT", "SIGTERM") else EXIT_INTERRUPTED


@dataclass
class JobResult:
    run_id: str | None
    status: str  # FINISHED, FAILED or KILLED (interrupted)
    metrics: dict[str, float]
    error: str | None = None
    seconds: float = 0.0
    ui_command: str = ""
    events: list[dict] = field(default_factory=list)  # recovery events, in order
    attempts: list[dict] = field(default_factory=list)  # worker groups Ray Train started
    exit_code: int | None = None  # `recgrid train`'s exit status when not 0 (FINISHED) or 1 (FAILED)


def run_cli(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.set)
    except (ConfigError, FileNotFoundError) as e:
        print(f"recgrid train: invalid job config: {e}", file=sys.stderr)
        return 2
    result = run_job(config)
    return result.exit_code if result.exit_code is not None else {"FINISHED": 0}.get(result.status, 1)


def run_job(config: JobConfig, on_start: Any = None, parent_run_id: str | None = None,
            summary: bool = True) -> JobResult:
    """Run one training job end to end; its MLflow run ends FINISHED, FAILED with the error, or
    KILLED when SIGINT or SIGTERM interrupted it (`Interrupts`; the result's error then starts
    with "KeyboardInterrupt").
    With `parent_run_id` the run is a child of that run (one configuration of `recgrid compare`);
    `summary=False` leaves the end-of-job table unprinted (`compare` prints one line per job).

    `on_start(actors)`, if given, is called once the job's actors exist (`JobActors`: tests and
    benchmarks watch the job and ask it to stop through them).
    """
    t0 = time.perf_counter()
    grid = config.build_grid()
    tracker = Tracker(config.tracking.experiment, config.tracking.tracking_uri)
    tracker.start(config.run_name, params=config.run_params(),
                  tags={"layout": grid.layout, "num_groups": grid.num_groups, "launcher": "ray"},
                  parent_run_id=parent_run_id)
    tracker.log_stack_versions()
    say(f"MLflow run {tracker.run_id} ({config.run_name}) in experiment {config.tracking.experiment!r} "
        f"at {tracker.display_uri}")
    say(tracker.ui_hint())
    status: dict[str, Any] = {}
    try:
        with Interrupts() as interrupts:
            ensure_data(config)
            connect_ray(config)
            status = fit_on_ray(config, tracker, on_start, interrupts)
    except Interrupted as e:
        message = f"interrupted at step {e.step}" if e.step is not None else "interrupted before training"
        tracker.kill(f"{message} ({e.why})")
        say(f"KILLED: {message} ({e.why}); MLflow run {tracker.run_id} marked KILLED")
        return JobResult(tracker.run_id, "KILLED", {}, f"KeyboardInterrupt: {message}", time.perf_counter() - t0,
                         tracker.ui_command(), status.get("events", []), status.get("attempts", []), e.exit_code)
    except BaseException as e:  # noqa: BLE001 - the run records every failure, then it propagates as a status
        spent = e if isinstance(e, FailuresSpent) else None
        inner = e.__cause__ if spent is not None and e.__cause__ is not None else e
        cause = _root_cause(inner)
        tracker.fail(cause)  # the user's error, not Ray's wrapper around it (its traceback: error.txt)
        error = f"{type(cause).__name__}: {cause}".splitlines()[0]
        if spent is not None:  # why the job gave up, then what failed last
            error = f"{spent}; its last failure: {error}"
            tracker.set_tags({"error": error[:5000]})
        error = error[:2000]
        if cause is not inner and _is_train_failure(inner):  # the workers' tracebacks, as Ray Train gathered them
            print(str(inner), file=sys.stderr, flush=True)
        say(f"FAILED: {error}")
        return JobResult(tracker.run_id, "FAILED", {}, error, time.perf_counter() - t0, tracker.ui_command(),
                         status.get("events", []), status.get("attempts", []))
    tracker.log_interval_medians(config.train.max_steps)
    if config.tracking.log_model:
        try:
            with libraries_quiet():
                log_job_model(config, tracker, status)
        except Exception as e:  # noqa: BLE001 - the trained job stands; the run says why it has no model
            tracker.set_tags({"model_error": f"{type(e).__name__}: {e}"})
            say(f"model: not logged ({type(e).__name__}: {e})")
    tracker.finish()
    metrics = dict(tracker.client.get_run(tracker.run_id).data.metrics)
    result = JobResult(tracker.run_id, "FINISHED", metrics, None, time.perf_counter() - t0, tracker.ui_command(),
                       status.get("events", []), status.get("attempts", []))
    if not summary:
        return result
    g = config.build_grid()
    heading = [("run", f"{config.run_name} ({result.run_id}) {result.status} in {result.seconds:,.1f} s"),
               ("grid", f"T={g.world_size} M={g.num_groups} L={g.group_size} K={config.grid.sync_every} "
                        f"c={config.moment_scale:g} layout={g.layout}")]
    if status.get("holder_bytes"):  # what each host's snapshot holder kept at most
        heading.append(("snapshot holders (most per host)", "; ".join(
            f"{node[:12]} {b / 2**20:,.1f} MiB" for node, b in sorted(status["holder_bytes"].items()))))
    # the group count and recoveries only when they say something: an elastic job's change, a recovery
    skip = (() if metrics.get("grid/num_groups", g.num_groups) != g.num_groups else ("grid/num_groups",)) \
        + (() if metrics.get("recovery/count") else ("recovery/count",))
    print(summary_table(heading, metrics, result.events, skip), flush=True)
    return result


# ---- data -----------------------------------------------------------------------------------------
def ensure_data(config: JobConfig) -> None:
    """With data.synth_if_missing, generate synthetic Criteo data where the globs match nothing,
    into missing or empty directories only (`data.synth.ensure_synth`: a glob that matches nothing
    beside other files is an error); eval rows are a held-out draw (another stream) of the same
    planted model."""
    d = config.data
    if not d.synth_if_missing:
        return
    for role, patterns, rows, stream in (("train", d.train, d.synth_rows, 0), ("eval", d.eval, d.synth_eval_rows, 1)):
        for pattern in patterns:
            try:
                ensure_synth(pattern, rows, config.dataset_spec(), config.train.seed, stream,
                             say=lambda m: say(f"data.{role}: {m}"))
            except ValueError as e:
                raise ConfigError(f"data.{role}: {e}") from None


# ---- Ray --------------------------------------------------------------------------------------------
def connect_ray(config: JobConfig) -> None:
    """Join $RAY_ADDRESS if set, else start recgrid's own local cluster sized for the job
    (`recgrid.cluster`: never a stale or unrelated local cluster)."""
    # RUST_LOG: torchft's lighthouse and quorum servers log every round at INFO
    env_vars = {"PYTHONWARNINGS": "ignore", "TORCHREC_LOG_LEVEL": "ERROR", "RUST_LOG": "warn"}
    if os.environ.get("RAY_ADDRESS"):
        if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:
            # submitted with the Ray Job API: the job's own runtime env (working dir) carries the code
            connect(say=say, log_to_driver=False)
        else:
            # from outside the cluster: ship this package with the job; the image must hold the stack
            package = str(Path(__file__).resolve().parents[1])
            connect(say=say, runtime_env={"py_modules": [package], "env_vars": env_vars}, log_to_driver=False)
        return
    T, per_worker = config.grid.world_size, config.train.cpus_per_worker
    # the workers' share, plus room for the driver-side actors and tasks
    num_cpus = max(os.cpu_count() or 1, math.ceil(T * per_worker + 1))
    # the one node offers the workers' custom resources (train.resources_per_worker) too
    resources = {name: T * amount for name, amount in config.train.resources_per_worker.items()}
    # the dashboard stays on: Ray Train's placement-group cleaner asks the state API it serves
    # the workers' lines reach the console through job control (`Console`), not Ray's log forwarding
    connect(num_cpus, num_gpus=None if config.train.use_gpu else 0, say=say, log_to_driver=False,
            runtime_env={"env_vars": env_vars}, resources=resources or None)


def placeable_groups(config: JobConfig) -> int:
    """How many of the job's sharding groups the cluster's nodes hold (from what each alive node
    offers, `launch.placement.cluster_slots`), at most M: the first quorum waits for these, and a
    group with no room joins when there is."""
    grid = config.build_grid()
    return min(grid.num_groups, sum(cluster_slots(worker_resources(config)).values()) // grid.group_size)


def check_cluster(config: JobConfig) -> None:
    """Refuse, before any worker starts, a cluster whose nodes cannot give the job's layout
    (`Grid.check_cluster`, from what each alive node offers); the error names the layout, the
    nodes and what to change."""
    import ray

    config.build_grid().check_cluster(cluster_slots(worker_resources(config)), config.grid.min_world_size)
    total = sum(n.get("Resources", {}).get("CPU", 0.0) for n in ray.nodes() if n.get("Alive"))
    T = config.grid.world_size
    # the sharding groups the nodes hold start (the others join when there is room)
    workers = placeable_groups(config) * config.build_grid().group_size
    taken = workers * config.train.cpus_per_worker
    who = f"T={T}" if workers == T else f"{workers} starting"
    check_room_for_data(total - taken, f"the {who} workers would reserve {taken:g} of the cluster's {total:g} CPUs "
                                       f"(train.cpus_per_worker={config.train.cpus_per_worker:g})")


def storage_path(config: JobConfig) -> str:
    """Ray Train's storage for this job: train.storage_path, or the repository's runs/ray."""
    if config.train.storage_path:
        p = config.train.storage_path
        return p if "://" in p else str(Path(p).absolute())
    return str(Path(os.environ.get("RECGRID_RUNS_DIR", "runs")).absolute() / "ray")


def job_plan(config: JobConfig, engine: Any = None) -> Any:
    """The job's sharding plan, for the L workers of one sharding group: made once, here.
    `model.sharding: auto` is recgrid's planner (`plan.planner.job_sharding_plan`: the search
    `recgrid plan` runs, priced for the device the job runs on); a named type is TorchRec's planner
    restricted to it (`engine.sharding.make_plan`); towers place each tower's tables in their tower.
    `engine`: the job's EngineConfig when the driver has completed it (a compressed job's head ids);
    None = `EngineConfig.from_job(config)`."""
    engine = engine or EngineConfig.from_job(config)
    grid = config.build_grid()
    if engine.towers is not None:  # DMT: each tower's tables inside its tower (engine.towers)
        return tower_plan(engine.spec, engine.model, engine.towers, grid, device_type_for(config.train.use_gpu))
    model = build_model(engine.spec, engine.model, seed=engine.seed)
    hbm_cap = worker_gpu_memory() if config.train.use_gpu else None
    if engine.sharding == "auto":
        return job_sharding_plan(config, model, hbm_cap=hbm_cap)
    return make_plan(model, grid, device_type_for(config.train.use_gpu), engine.embedding_optimizer(grid.num_groups).fused_params(),
                     engine.sharding, hbm_cap=hbm_cap)


def job_compression(config: JobConfig, train_inputs: Any, tracker: Any) -> Any:
    """The job's QR compression (`data.specs.Compression`), or None; with a head cache, its head
    ids counted here, once per job, by one Ray Data pass over the training files
    (`data.stream.head_ids`), and recorded as the run artifact compression/head_ids.npz. The
    driver hands them to every attempt's workers, so the remapping never changes while the job lives."""
    compression = config.compression()
    if compression is None or not compression.wants_head:
        return compression
    import numpy as np

    t0 = time.perf_counter()
    heads = head_ids(train_inputs, config.dataset_spec(), compression)
    compression = compression.with_heads(heads)
    sizes = compression.head_sizes()
    say(f"head cache: counted the ids of {len(heads)} compressed table(s) over {train_inputs.total_rows:,} rows in "
        f"{time.perf_counter() - t0:.1f} s; head rows " + ", ".join(f"{SPARSE_NAMES[f]} {n:,}" for f, n in sizes.items()))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "head_ids.npz"
        np.savez(path, **{SPARSE_NAMES[f]: ids for f, ids in heads.items()})
        tracker.client.log_artifact(tracker.run_id, str(path), "compression")
    return compression


def model_embedding_bytes(engine: Any) -> int:
    """`memory/embedding_bytes`: bytes of the embedding tables of one model copy (a compressed job's
    compressed tables, head tables included) at the tables' data type."""
    m = engine.model
    return embedding_bytes(engine.spec, m.resolved_dim(engine.spec), m.embedding_dtype, m.compression)


def worker_gpu_memory(timeout_s: float = 120.0) -> int:
    """Bytes of memory of one of the cluster's GPUs (the planner's `hbm_cap`): this process's own
    GPU, or, on a driver without one (a KubeRay head), read by a one-GPU Ray task."""
    import ray

    if use_gpu_default():
        return device_memory_bytes()
    task = ray.remote(num_gpus=1)(device_memory_bytes).remote()
    ready, _ = ray.wait([task], timeout=timeout_s)
    if not ready:
        ray.cancel(task, force=True)
        raise RuntimeError(f"train.use_gpu is set but no GPU of the Ray cluster ran a task within {timeout_s:.0f}s "
                           f"to read its memory for the sharding planner; check that the cluster has GPU nodes")
    return int(ray.get(task))


def fit_on_ray(config: JobConfig, tracker: Any, on_start: Any = None,
               interrupts: "Interrupts | None" = None) -> dict[str, Any]:
    """Plan, count rows, start the job's actors and Ray Train; returns their record
    of attempts and recovery events. Raises `Interrupted` when `interrupts` stopped the job."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    spec = config.dataset_spec()
    grid = config.build_grid()
    check_cluster(config)
    train_inputs = scan_inputs([str(Path(p).absolute()) for p in config.data.train], spec)
    eval_inputs = scan_inputs([str(Path(p).absolute()) for p in config.data.eval], spec) if config.data.eval else None
    say(f"data: {train_inputs.total_rows:,} training rows in {len(train_inputs.files)} file(s)"
        + (f", {eval_inputs.total_rows:,} eval rows" if eval_inputs else ""))
    tracker.log_inputs({"training": (config.data.train, train_inputs),
                        **({"eval": (config.data.eval, eval_inputs)} if eval_inputs else {})})
    engine = EngineConfig.from_job(config).with_compression(job_compression(config, train_inputs, tracker))
    plan = job_plan(config, engine)
    tracker.log_text(json.dumps(plan_record(plan), indent=1), "sharding_plan.json")
    tracker.log_metrics({"memory/embedding_bytes": model_embedding_bytes(engine)}, 0)

    # on the driver's node (the head, under the Job API): they must outlive every worker node
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    t = config.train
    # where each sharding group's run goes (pinned per layout), known before the workers are built
    runs = JobRuns(grid, here, placer(config), t.max_failures)
    if config.snapshots.on:  # what each host's holder will keep, against its room: refused before any worker starts
        where = runs.pinned or runs.unpinned_positions(worker_resources(config))
        check_holder_room(holder_bytes(where, shard_position_bytes(plan, grid.group_size, engine.model.embedding_dtype),
                                       KEEP_GENERATIONS), node_room(list(positions_by_node(where))))
    actors = JobActors(control=JobControl.options(scheduling_strategy=here).remote(),
                       recovery=RecoveryCoordinator.options(scheduling_strategy=here).remote(tracker.run_id))
    lighthouse = meter = None  # made below, ended in the finally whatever fails before training
    status: dict[str, Any] = {}
    console = Console(actors.control, record=lambda attempts: record_ranks(tracker.run_id, tracker.tracking_uri, attempts,
                                                                          grid.world_size))
    at_once = False
    try:
        if on_start is not None:
            on_start(actors)
        # the job's torchft lighthouse, in this process (it outlives every sharding group's run)
        lighthouse = Lighthouse(bind_host(bool(os.environ.get("RAY_ADDRESS"))), config.min_groups)
        job = WorkerJob(
            engine=engine, loop=LoopConfig.from_job(config), grid=grid, use_gpu=t.use_gpu, plan=plan,
            train_inputs=train_inputs, eval_inputs=eval_inputs, run_id=tracker.run_id,
            tracking_uri=tracker.tracking_uri, control=actors.control, recovery=actors.recovery,
            run_name=config.run_name, resume_from=t.resume_from, row_log=config.data.row_log,
            rows_per_unit=config.data.rows_per_unit, schedule=Schedule.of_job(config),
            lighthouse=lighthouse.address,
            min_groups=config.min_groups, start_groups=runs.start_groups(placeable_groups(config)),
            log_model=config.tracking.log_model and config.model.towers is None,  # towers: no checkpoint, no model
            table_digests=os.environ.get(TABLE_DIGESTS_ENV) == "1",
            call_audit=os.environ.get(CALL_AUDIT_ENV) == "1",
        )

        def run_config(name: str) -> Any:
            return RunConfig(name=name, storage_path=storage_path(config),
                             failure_config=FailureConfig(max_failures=t.max_failures),
                             callbacks=[FailureClock(actors.control)])

        name = f"{config.run_name}-{tracker.run_id[:8]}"
        backend = torch_config(config)

        def group_run(g: int, positions: list[str] | None) -> Any:
            """Sharding group g's Ray Train run (L workers, its torch world; shard position s on
            `positions[s]` when pinned): Ray restarts a failed group's run alone, and the groups meet
            across runs through the job's lighthouse (train/recovery/peers.py)."""
            return TorchTrainer(
                train_loop_per_worker=group_worker,
                train_loop_config={**pack(job), "group": g},  # bytes: the controller need not import TorchRec (train/entry.py)
                scaling_config=ScalingConfig(num_workers=grid.group_size, use_gpu=t.use_gpu,
                                             resources_per_worker=worker_resources(config),
                                             placement_strategy=GROUP_RUN_PLACEMENT[grid.layout],
                                             label_selector=label_selectors(positions) if positions else None),
                torch_config=backend, run_config=run_config(f"{name}-group{g}"))

        runs.make_run, runs.control = group_run, actors.control
        low = config.min_groups
        survives = t.max_failures > 0
        say(f"training: T={grid.world_size} M={grid.num_groups} L={grid.group_size} K={config.grid.sync_every} "
            f"layout={grid.layout}, {t.max_steps} steps x {t.batch_size} rows/worker"
            + (f", down to {low} live sharding group(s)" if 1 < low < grid.num_groups else "")
            + (", each sharding group a Ray Train run" if grid.num_groups > 1 else ", one sharding group")
            + ("; a failed group is restarted and heals from a live peer group while the others train on"
               if survives and grid.num_groups > 1 else "; a failure fails the job (train.max_failures=0)"
               if not survives else "")
            + ("; in-memory snapshots on the hosts' holders" if config.snapshots.on else ""))
        if runs.unplaced:
            say("host-local: the cluster's nodes cannot hold every replica group whole yet, so the sharding groups' "
                "runs are not pinned to nodes: Ray spreads each group, and a replica group may straddle nodes")
        if config.snapshots.on:
            meter = HolderMeter(actors.recovery, tracker, console)
        _fit_watched(runs, console, interrupts or Interrupts(), actors.control, meter)
    except Interrupted:
        at_once = True
        raise
    finally:
        console.pump()
        try:
            if at_once:  # the workers were not waited for: Ray's local cluster goes, with them
                end_workers()
            else:
                status = actors.status()
                if meter is not None:
                    status["holder_bytes"] = dict(meter.peak)
                ray.get(actors.recovery.release.remote(), timeout=60)  # the holders delete their shard files
        except Exception:  # noqa: BLE001 - the job's own error matters more
            pass
        remove_snapshot_files(tracker.run_id)  # those of holders whose (simulated) node died on this machine
        if not at_once:
            actors.end()
        runs.end()  # a run still waiting for room ends with it
        if lighthouse is not None:
            lighthouse.shutdown()
    if status.get("stop") == STOP_NOW and (status.get("final") or {}).get("interrupted"):
        raise Interrupted((interrupts.why if interrupts else None) or "stopped", status["final"]["step"])
    return status


def _fit_watched(runs: "JobRuns", console: "Console", interrupts: "Interrupts", control: Any,
                 meter: "HolderMeter | None" = None) -> None:
    """Each of the job's runs (`runs.start()`: one call each that returns when its Ray Train run has
    ended) in a thread of its own (Ray Train then leaves SIGINT to this process; one run per
    sharding group, side by side), while this thread prints the workers' lines and answers
    interrupts: the first asks the workers to stop at their next sync step; a second, or
    `STOP_GRACE_S` without them stopping, raises `Interrupted`. A run that failed (its Ray Train
    failures spent) fails the job, with its error. Every second it asks `runs.moved()` whether a
    node a run is pinned to is gone (the runs it ends are not failures; it starts them again where
    the layout allows), and `meter` logs what the hosts' snapshot holders keep. It ends every run
    still going: the runs left `RUNS_END_GRACE_S` after the job's training ended (a group waiting
    for room after a drain or a node loss) are ended, and a failed run ends the others at once."""
    errors: list[BaseException] = []
    ended = threading.Event()
    threads: list[threading.Thread] = []

    def fit(run: Any, retired: threading.Event, group: int) -> None:
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            if not ended.is_set() and not retired.is_set():  # a run the driver ended is not a failure
                if _is_train_failure(e):  # Ray Train gave up on the group: its failures are spent
                    spent = FailuresSpent(group, runs.max_failures)
                    spent.__cause__ = e
                    e = spent
                errors.append(e)

    def launch(started: "list[tuple[Any, threading.Event, int]]") -> None:
        for run, retired, group in started:
            th = threading.Thread(target=fit, args=(run, retired, group), name=f"recgrid-fit-{len(threads)}",
                                  daemon=True)
            threads.append(th)
            th.start()

    interrupts.install().armed = True
    launch(runs.start())
    asked = False
    over_at, polled = None, 0.0
    try:
        while any(th.is_alive() for th in threads) or (runs.waiting and not ended.is_set() and over_at is None):
            alive = [th for th in threads if th.is_alive()]
            for th in alive:
                th.join(CONSOLE_POLL_S / len(alive))
            if not alive:
                time.sleep(CONSOLE_POLL_S)
            console.pump()
            if not ended.is_set():
                if over_at is None and time.monotonic() - polled >= 1.0:
                    polled = time.monotonic()
                    over_at = polled if training_over(control) else None
                    if over_at is None and not errors:
                        launch(runs.moved())
                    if meter is not None:
                        meter.maybe_log()
                waiting = [i for i, th in enumerate(threads) if th.is_alive()]
                late = over_at is not None and waiting and time.monotonic() - over_at > RUNS_END_GRACE_S
                if late and time.monotonic() - over_at < RUNS_FINISH_GRACE_S and workers_finishing(control):
                    late = False  # a group still ends its training (its final checkpoint, its notes): waited for
                if errors or late:
                    ended.set()
                    if not errors:
                        say(f"the job's training ended; {len(waiting)} sharding group run(s) still waited for room "
                            f"after a drain or a node loss: ended")
                    runs.end()
            if interrupts.first_at is not None and not asked:  # the handler only notes the signal
                asked = True
                control.request_stop.remote(interrupt=True)
                say(f"{interrupts.why}: stopping the workers at their next sync step (again to stop at once)")
            if interrupts.first_at is not None and time.monotonic() - interrupts.first_at > STOP_GRACE_S:
                raise Interrupted(f"{interrupts.why}; the workers had not stopped after {STOP_GRACE_S:g} s",
                                  console.last_step)
    except KeyboardInterrupt as e:  # the second signal
        raise Interrupted(interrupts.why or "KeyboardInterrupt", console.last_step) from e
    finally:
        interrupts.armed = False
        if meter is not None:
            meter.maybe_log(final=True)
    if errors:
        raise errors[0]


class Interrupts:
    """SIGINT and SIGTERM while a job runs (on the main thread; elsewhere it does nothing). Before
    training a signal raises `Interrupted`; while it trains (`armed`), the first is only noted
    (`first_at`, `why`: `_fit_watched` acts on it) and a second raises `Interrupted`."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.armed = False
        self.first_at: float | None = None
        self.why: str | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "Interrupts":
        return self.install()

    def install(self) -> "Interrupts":
        """(Re)take the signals: `ray.init` sets a SIGTERM handler of its own. What was there is
        put back on exit (Ray's, which shuts its local cluster down)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) != self._handle:
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: Any) -> None:
        why = signal.Signals(signum).name
        if self.first_at is None and self.armed:
            self.first_at, self.why = time.monotonic(), why
            return
        self.why = self.why or why
        raise Interrupted(self.why)


def torch_config(config: JobConfig) -> Any:
    """Ray Train's torch backend of every run of the job: one process group over the run's
    workers (one sharding group's L), gloo on CPUs and NCCL on GPUs."""
    from ray.train.torch import TorchConfig

    return TorchConfig(backend=process_group_backend(device_type_for(config.train.use_gpu)))


def _is_train_failure(e: BaseException) -> bool:
    """Whether `e` is Ray Train's report of a failed training run (its text holds the workers' tracebacks)."""
    from ray.train import TrainingFailedError

    return isinstance(e, TrainingFailedError)


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
