"""Recovery under the one fault-tolerance design (every sharding group a Ray Train run of its own),
and what it costs when nothing fails, on a tiny model and on a model of about 1 GB of tables.

The `torchft` source runs a T=4, M=2, K=5 job on a local Ray cluster with one worker SIGKILLed
once the job passed step 300 (`--recovery-kill-step`: in steady state, so the survivors' QPS before
is not the job's start-up); the other sharding group keeps training. Its seconds from the kill are
  detection   -> Ray Train's controller sees the failure
  replacement -> the replacement worker's training function starts (Ray starts a worker: a
                 process, torch, TorchRec)
  heal        -> the rebuilt group has received a live peer group's state
  first_step  -> the rebuilt group's first committed step (`total`)
and the surviving group's QPS during the recovery against as long a span before the failure, at
T=4 M=2 and T=6 M=3 (`--torchft-shapes`), and where this machine's cores went from the kill to that
first step (`cpu_during_recovery`, sampled with psutil): the processes Ray Train's restart started
(the new workers, and the run's other actors), the workers that kept training, and the rest. On
the tiny model it also sets the final eval NE of a fixed-length job with one worker killed against
the failure-free run of the same seed, for each of `--quality-seeds` seeds, and the failure-free
runs' spread over the seeds (`torchft_quality`), and against a failure-free run stopped at as many
rows as the killed job trained (`same_rows`).

The `failure_free` source runs the demo's shape with nothing failing, alternating (`--failure-free-reps`
jobs each): every mechanism off (no failure survived, no in-memory snapshot, no storage checkpoint),
failures allowed (`train.max_failures=2`, the rest derived: in-memory snapshots at their measured
cadence, storage checkpoints every 30 minutes of training), the same without in-memory snapshots
(`failures_allowed_no_snapshots`: what the snapshots cost apart), and the demo as shipped; their
wall seconds and median QPS, and each one's QPS over the mechanism-free job's: what fault
tolerance costs when nothing fails.

Writes bench/results/recovery.json (configuration, machine, figures) and prints it; a run of some
sources only keeps the other sources' figures already in the file.

    .venv/bin/python bench/recovery.py [--models tiny,1gb] [--sources torchft,failure_free] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]

MODELS = {
    # the demo's tiny tables: 0.6 M rows x 16 dims
    "tiny": ["data.spec=tiny"],
    # Criteo Kaggle's cardinalities capped at 3 M rows per table, dim 16: 14.8 M rows, ~0.95 GB of
    # fp32 weights plus ~0.06 GB of row-wise moments per model copy
    "1gb": ["data.spec=criteo_kaggle", "data.max_rows_per_table=3000000", "model.embedding_dim=16"],
}


def run_torchft_case(tmp: Path, model: str, kill_after_step: int, world_size: int = 4, num_groups: int = 2) -> dict:
    """One torchft job of `world_size` workers in `num_groups` sharding groups: rank 1 killed once
    the job passed `kill_after_step`, stopped gracefully ten steps after the rebuilt group's first
    committed step."""
    overrides = [f"grid.world_size={world_size}", f"grid.num_groups={num_groups}", "train.max_steps=100000",
                 "train.max_failures=1", "data.eval=[]",
                 # the 3 logical CPUs of the bench's cluster, less a Ray Data read task's quarter
                 f"train.cpus_per_worker={min(0.5, 0.25 * (10 // world_size))}"]
    with CpuSampler() as cpu:
        result, kill = _torchft_job(tmp, model, overrides, kill_after_step, stop_after_recovery=10)
    events = [e for e in result.events if "seconds" in e]
    if result.status != "FINISHED" or not events:
        raise RuntimeError(f"{model}/torchft: the job did not recover: {result.status} {result.error}")
    e = events[0]
    seconds = {"detection": e["t_failure_detected"] - kill["time"],
               "replacement": e["t_attempt_start"] - e["t_failure_detected"],
               "heal": e["t_heal"] - e["t_attempt_start"], "first_step": e["t_first_step"] - e["t_heal"],
               "total": e["t_first_step"] - kill["time"]}
    return {"world_size": world_size, "num_groups": num_groups, "kill_step": kill["step"],
            "healed_at_step": e["step"], "steps_lost": e["steps_lost"],
            "source": e["source"], "bit_identical": e.get("bit_identical"),
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            # no survivor figures: no other group committed a step between the failure and this one
            "kept_training": e["kept_training"], "survivors_steps_during": e.get("survivors_steps", 0),
            "survivors_qps_during": round(e.get("survivors_qps", 0.0), 1),
            "survivors_qps_before": round(e.get("survivors_qps_before", 0.0), 1),
            "cpu_during_recovery": cpu.recovery(kill["time"], e["t_attempt_start"], e["t_first_step"])}


class CpuSampler:
    """Every process's CPU seconds on this machine, sampled every SAMPLE_S while a job runs
    (psutil), and where the cores went between a kill and the rebuilt group's first committed step
    (`recovery`): the processes the restart started (Ray Train's new workers, and the run's other new
    actors), the workers that kept training, and the rest (Ray's own processes, job control, the
    driver); in core-seconds, and the surviving workers' cores before the kill against during."""

    SAMPLE_S = 0.25

    def __init__(self) -> None:
        self.samples: list[tuple[float, dict[int, tuple[str, float, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            now, procs = time.time(), {}
            for p in psutil.process_iter(["pid", "name", "cmdline", "cpu_times", "create_time"]):
                try:
                    c, cmd = p.info["cpu_times"], p.info["cmdline"] or [p.info["name"] or "?"]
                    procs[p.info["pid"]] = (cmd[0][:60], c.user + c.system, p.info["create_time"])
                except (psutil.Error, TypeError, IndexError):
                    continue
            self.samples.append((now, procs))
            self._stop.wait(self.SAMPLE_S)

    def _at(self, t: float) -> dict[int, tuple[str, float, float]]:
        return min(self.samples, key=lambda s: abs(s[0] - t))[1]

    def recovery(self, kill: float, fn_start: float, first_step: float) -> dict[str, Any]:
        """Core-seconds from `kill` to `first_step` by kind of process; a train worker's kind by its
        name at both ends (Ray names an actor's process after its class once the actor is created,
        `ray::IDLE` before: a worker Ray had started ahead is new too)."""
        window = first_step - kill
        a, b = self._at(kill), self._at(first_step)
        used: dict[str, float] = {"new_train_workers": 0.0, "new_ray_train_actors": 0.0,
                                  "surviving_train_workers": 0.0, "ended": 0.0, "other": 0.0}
        survivors, new_workers = [], []
        by_name: dict[str, dict] = {}  # the new Ray processes other than train workers, by name
        for pid, (name, cpu, created) in b.items():
            was = a.get(pid)
            since = cpu - (was[1] if was else 0.0)
            if "RayTrainWorker" in name and was and "RayTrainWorker" in was[0]:
                used["surviving_train_workers"] += since
                survivors.append(pid)
            elif "RayTrainWorker" in name:
                used["new_train_workers"] += since
                new_workers.append(pid)
            elif was is None and name.startswith("ray::"):
                used["new_ray_train_actors"] += since
                entry = by_name.setdefault(name, {"core_s": 0.0, "processes": 0})
                entry["core_s"], entry["processes"] = round(entry["core_s"] + since, 2), entry["processes"] + 1
            else:
                used["other"] += since
        for pid, (name, cpu, created) in a.items():  # ended in the window: the failed group's other workers
            if pid not in b:
                last = [s[1][pid][1] for s in self.samples if kill <= s[0] <= first_step and pid in s[1]]
                used["ended"] += (last[-1] - cpu) if last else 0.0
        before_a = self._at(kill - window)
        survivors_before = sum(a[p][1] - before_a[p][1] for p in survivors if p in before_a)
        # each new worker's CPU seconds from the kill (or its start) to recgrid's training function:
        # Ray's start of the process and the imports
        at_fn = self._at(fn_start)
        before_fn = sorted(round(at_fn[p][1] - (a[p][1] if p in a else 0.0), 2) for p in new_workers if p in at_fn)
        return {"window_s": round(window, 2), "cores": os.cpu_count(),
                "core_s": {k: round(v, 2) for k, v in used.items()},
                "new_ray_processes": dict(sorted(by_name.items(), key=lambda kv: -kv[1]["core_s"])),
                "new_train_worker_core_s_before_training_function": before_fn,
                "surviving_train_workers_cores_before": round(survivors_before / window, 2),
                "surviving_train_workers_cores_during": round(used["surviving_train_workers"] / window, 2)}


# what a failure-free job of the demo's shape runs with, per variant of `run_failure_free`
FAILURE_FREE = {
    # every mechanism off: no failure survived, no in-memory snapshot, no storage checkpoint
    "off": ["train.max_failures=0", "train.snapshot_every_syncs=0", "train.checkpoint_every=0"],
    # failures survived, the rest derived: in-memory snapshots on the hosts' holders at their measured
    # cadence (host-local), storage checkpoints every 30 minutes of training (none in this short job)
    "failures_allowed": ["train.max_failures=2"],
    # failures survived (the live groups heal a rebuilt one) without in-memory snapshots: what the
    # snapshots cost apart from the rest
    "failures_allowed_no_snapshots": ["train.max_failures=2", "train.snapshot_every_syncs=0"],
    # the demo as shipped (jobs/local_demo.yaml)
    "demo": [],
}


def run_failure_free(tmp: Path, model: str, reps: int, variants: list[str]) -> dict:
    """What fault tolerance costs when nothing fails: the demo's shape (T=4, M=2, K=5, 400 steps
    of 256 rows per worker), failure-free, `reps` jobs per variant of FAILURE_FREE named in
    `variants`, alternating (in reverse order every other round, so a drift of the host's speed
    over the run falls alike on every variant).
    Per job: its wall seconds (start to end, evaluations included), the median of its logged
    `train/qps` and its final eval NE; per variant, the median QPS over the mechanism-free job's."""
    import statistics

    from mlflow.tracking import MlflowClient

    from recgrid.config import load_config
    from recgrid.launch.ray import run_job

    jobs: dict[str, list[dict]] = {name: [] for name in variants}
    paths = {}
    for rep in range(reps):
        for name in (variants if rep % 2 == 0 else variants[::-1]):
            overrides = FAILURE_FREE[name]
            config = load_config(REPO / "jobs/local_demo.yaml", [
                f"data.train={tmp}/data/demo/train/*.parquet", f"data.eval={tmp}/data/demo/eval/*.parquet",
                f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db", f"tracking.experiment=bench-failure-free-{model}",
                *MODELS[model], *overrides])
            paths[name] = {"snapshot_every_syncs": config.snapshots.param(),
                           "checkpoint_every": config.checkpoints.param(), "max_failures": config.train.max_failures}
            print(f"[bench] {model}: failure-free, {name}, job {rep + 1}/{reps} ...", file=sys.stderr, flush=True)
            t0 = time.time()
            result = run_job(config, summary=False)
            wall = time.time() - t0
            assert result.status == "FINISHED", result.error
            client = MlflowClient(config.tracking.tracking_uri)
            qps = [m.value for m in client.get_metric_history(result.run_id, "train/qps")]
            # seconds a worker spent writing storage checkpoints over the job (the phase's per-interval seconds, summed)
            ckpt = sum(m.value for m in client.get_metric_history(result.run_id, "time/checkpoint_s"))
            snap = sum(m.value for m in client.get_metric_history(result.run_id, "time/snapshot_s"))
            counts = client.get_metric_history(result.run_id, "snapshot/count")
            snapshots = int(max((m.value for m in counts), default=0))
            jobs[name].append({"wall_s": round(wall, 2), "median_qps": round(statistics.median(qps), 1),
                               "checkpoint_s": round(ckpt, 3), "snapshot_s": round(snap, 3), "snapshots": snapshots,
                               "holder_bytes_max": result.metrics.get("holders/bytes_max"),
                               "eval_ne": round(result.metrics["eval/ne"], 5),
                               "load_avg_1m": round(os.getloadavg()[0], 2)})
    out: dict[str, Any] = {"configuration": {"world_size": 4, "num_groups": 2, "sync_every": 5, "max_steps": 400,
                                             "batch_size_per_worker": 256, "jobs_per_variant": reps,
                                             "variants": {n: {"overrides": FAILURE_FREE[n], **paths[n]} for n in jobs}},
                           "jobs": jobs}
    for name, runs in jobs.items():
        out[name] = {"wall_s": round(statistics.median(r["wall_s"] for r in runs), 2),
                     "median_qps": round(statistics.median(r["median_qps"] for r in runs), 1)}
    for name in jobs:
        if name != "off":
            out[f"{name}_over_off_qps"] = round(out[name]["median_qps"] / out["off"]["median_qps"], 3)
    return out


def run_torchft_quality(tmp: Path, model: str, kill_after_step: int, steps: int, seeds: int) -> dict:
    """Final eval NE of torchft jobs with one worker killed against the failure-free runs of the same
    seeds, and the failure-free runs' spread over the seeds (the seed noise): T=4, M=2, `steps`
    steps each, 8,000 eval rows. The training rows cover the job in one epoch: over a second pass
    the eval NE of this data gets worse (from 0.614 at step 225 to 0.638 at step 300 on 120,000
    rows, seed 0), and a killed job's rebuilt group, which trails the others by the steps it was
    away, reads less of that pass, so a second epoch makes the kill look like a gain.

    The killed job trains fewer rows in its `steps` than a failure-free one: while the broken group
    is away the survivors' steps carry L x B rows each instead of T x B, and the rebuilt group
    does not catch up by the end. So each seed also runs a failure-free job of as many steps as the
    killed job's rows fill at T x B rows a step (`train/examples_total`, the job's count): the
    "same rows" comparison, which tells a worse model per row from fewer rows."""
    import statistics

    rows = -(-steps * 4 * 128 // 10_000) * 10_000 + 10_000
    evaluate = [f"data.train={tmp}/data/{model}-{rows}/train/*.parquet", f"data.synth_rows={rows}",
                f"data.eval={tmp}/data/{model}/eval/*.parquet", "data.synth_eval_rows=8000",
                f"train.max_steps={steps}", "train.max_failures=1", "train.eval_every=0"]
    free, killed, killed_rows, same_rows, same_steps = {}, {}, {}, {}, {}
    step_rows = 4 * 128  # T x B
    for seed in range(seeds):
        result, _ = _torchft_job(tmp, model, [*evaluate, f"train.seed={seed}"], None)
        free[seed] = result.metrics["eval/ne"]
        result, kill = _torchft_job(tmp, model, [*evaluate, f"train.seed={seed}"], kill_after_step)
        if result.status != "FINISHED" or not [e for e in result.events if "seconds" in e]:
            raise RuntimeError(f"{model}/torchft quality: the job did not recover: {result.status} {result.error}")
        killed[seed] = result.metrics["eval/ne"]
        killed_rows[seed] = int(result.metrics["train/examples_total"])
        same_steps[seed] = round(killed_rows[seed] / step_rows)
        result, _ = _torchft_job(tmp, model, [*evaluate, f"train.seed={seed}", f"train.max_steps={same_steps[seed]}"],
                                 None)
        same_rows[seed] = result.metrics["eval/ne"]
    diffs = [killed[k] - free[k] for k in free]
    same_diffs = [killed[k] - same_rows[k] for k in free]
    noise = statistics.stdev(free.values()) if seeds > 1 else float("nan")
    mean_diff, mean_same = statistics.fmean(diffs), statistics.fmean(same_diffs)
    return {"steps": steps, "kill_after_step": kill_after_step, "seeds": seeds, "train_rows": rows,
            "eval_ne_failure_free": {str(k): round(v, 5) for k, v in free.items()},
            "eval_ne_with_kill": {str(k): round(v, 5) for k, v in killed.items()},
            "difference_per_seed": [round(d, 5) for d in diffs], "mean_difference": round(mean_diff, 5),
            "seed_stdev_failure_free": round(noise, 5), "within_2_seed_stdev": abs(mean_diff) <= 2 * noise,
            "same_rows": {
                "rows_trained_with_kill": {str(k): v for k, v in killed_rows.items()},
                "rows_trained_failure_free": steps * step_rows,
                "steps": {str(k): v for k, v in same_steps.items()},
                "eval_ne_failure_free": {str(k): round(v, 5) for k, v in same_rows.items()},
                "difference_per_seed": [round(d, 5) for d in same_diffs], "mean_difference": round(mean_same, 5),
                "within_2_seed_stdev": abs(mean_same) <= 2 * noise}}


def _torchft_job(tmp: Path, model: str, overrides: list[str], kill_after_step: int | None,
                 stop_after_recovery: int | None = None) -> tuple:
    """One torchft job (T=4 M=2 unless `overrides` say otherwise) through `run_with_kill`."""
    from recgrid.config import load_config

    config = load_config(REPO / "jobs/local_demo.yaml", [
        f"data.train={tmp}/data/{model}/train/*.parquet", "data.synth_rows=120000",
        "grid.world_size=4", "grid.num_groups=2", "grid.sync_every=5",
        "train.batch_size=128", "train.log_every=5",
        f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db", f"tracking.experiment=bench-recovery-{model}",
        *MODELS[model], *overrides,
    ])
    return run_with_kill(config, kill_after_step, stop_after_recovery)


def run_with_kill(config: Any, kill_after_step: int | None, stop_after_recovery: int | None = None,
                  on_kill: Callable[[dict], None] | None = None) -> tuple:
    """Run `config` on the bench's Ray cluster, SIGKILLing rank 1 once the job passed
    `kill_after_step` (None: no kill; `on_kill(kill)` right after); with `stop_after_recovery`,
    stop it gracefully that many steps after the first recovery's step. Returns (JobResult, the kill)."""
    from recgrid.launch.ray import run_job

    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("result", run_job(config, on_start=lambda c: box.setdefault("c", c))))
    job.start()
    kill, stopped = None, False
    # poll until the kill and the stop asked for are done (the job's status is read no longer than needed)
    while job.is_alive() and not ((kill_after_step is None or kill) and (stop_after_recovery is None or stopped)):
        c = box.get("c")
        try:
            st = c.status() if c is not None else None
        except Exception:  # noqa: BLE001 - the job ended between two polls: its actors are gone
            continue
        if st and kill_after_step is not None and kill is None and st["last_step"] >= kill_after_step:
            victim = {r: w for a in st["attempts"] for r, w in a["workers"].items()}[1]["pid"]
            os.kill(victim, signal.SIGKILL)
            kill = {"time": time.time(), "step": st["last_step"], "rank": 1}
            if on_kill is not None:
                on_kill(kill)
        events = [e for e in st["events"] if "seconds" in e] if st else []
        if stop_after_recovery is not None and events and not stopped and \
                st["last_step"] >= events[0]["step"] + stop_after_recovery:
            ray_get_stop(c)
            stopped = True
        time.sleep(0.05)
    job.join()
    return box["result"], kill


def ray_get_stop(actors) -> None:
    import ray

    ray.get(actors.control.request_stop.remote())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,1gb")
    ap.add_argument("--sources", default="torchft,failure_free",
                    help="torchft: a killed worker's group rebuilt while the others train; failure_free: wall "
                         "seconds and QPS when nothing fails")
    ap.add_argument("--failure-free-reps", type=int, default=3, help="failure_free: jobs per variant")
    ap.add_argument("--failure-free-variants", default=",".join(FAILURE_FREE),
                    help="failure_free: the variants that alternate (off is always one: the ratios' base)")
    ap.add_argument("--kill-after-step", type=int, default=41,
                    help="torchft_quality: kill once the job passed this step")
    ap.add_argument("--recovery-kill-step", type=int, default=300,
                    help="the torchft shapes: kill once the job passed this step, in steady state (the survivors' "
                         "QPS before is over as long a span as the recovery: after a kill at step 45 it reached back "
                         "into the job's first, slow steps)")
    ap.add_argument("--torchft-shapes", default="4x2,6x3",
                    help="T x M of the torchft jobs (the first is reported as `torchft`, the others as `torchft_T<T>_M<M>`)")
    ap.add_argument("--quality-seeds", type=int, default=3,
                    help="torchft: failure-free runs (seeds 0..N-1) the killed run's final eval NE is set against "
                         "(0: skip); tiny model only")
    ap.add_argument("--quality-steps", type=int, default=300)
    ap.add_argument("--out", default=str(REPO / "bench/results/recovery.json"))
    ap.add_argument("--keep", action="store_true",
                    help="keep the work directory (runs, checkpoints, MLflow store: about 10 GB for the 1 GB model)")
    a = ap.parse_args()
    ff_variants = ["off"] + [v for v in a.failure_free_variants.split(",") if v and v != "off"]
    unknown = [v for v in ff_variants if v not in FAILURE_FREE]
    if unknown:
        raise SystemExit(f"--failure-free-variants: unknown {unknown}; the variants are {', '.join(FAILURE_FREE)}")

    import ray

    from recgrid.launch.report import machine_info, write_result

    tmp = Path(tempfile.mkdtemp(prefix="recgrid-bench-recovery-"))
    os.environ["RECGRID_RUNS_DIR"] = str(tmp / "runs")
    ray.init(num_cpus=3, runtime_env={"env_vars": {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}},
             logging_level="WARNING")
    old = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    results: dict = old.get("results", {})

    command = " ".join(["bench/recovery.py", *sys.argv[1:]])

    def save() -> dict:
        """Write what has been measured so far (a case that fails keeps the ones before it). A run of
        some models or sources replaces only those entries; each keeps the command that made it."""
        for r in results.values():  # the restart path's figures: that path is gone
            for key in ("peer", "storage", "peer_over_storage_restore"):
                r.pop(key, None)

        out = {
            "benchmark": "recovery",
            "configuration": {"world_size": 4, "num_groups": 2, "sync_every": 5, "layout": "host-local",
                              "batch_size_per_worker": 128,
                              "models": {m: MODELS[m] for m in results}, "killed": "one worker (rank 1), SIGKILL",
                              "torchft": "every sharding group a Ray Train run: the other groups keep training "
                                         "(T x M: each result's world_size and num_groups)"},
            "machine": machine_info(),
            "results": results,
        }
        write_result(a.out, out)
        return out

    try:
        for model in a.models.split(","):
            for source in a.sources.split(","):
                if source == "failure_free":
                    results.setdefault(model, {})[source] = run_failure_free(tmp, model, a.failure_free_reps,
                                                                               ff_variants) | {
                        "command": command}
                    print(json.dumps(results[model][source]), file=sys.stderr, flush=True)
                    save()
                    continue
                if source != "torchft":
                    raise SystemExit(f"--sources: unknown source {source!r}; the sources are torchft and failure_free")
                for i, shape in enumerate(x for x in a.torchft_shapes.split(",") if x):
                    t, m = (int(x) for x in shape.split("x"))
                    key = "torchft" if i == 0 else f"torchft_T{t}_M{m}"
                    print(f"[bench] {model}: torchft, T={t} M={m}, one worker killed ...", file=sys.stderr, flush=True)
                    results.setdefault(model, {})[key] = run_torchft_case(tmp, model, a.recovery_kill_step, t, m) | {
                        "command": command}
                    print(json.dumps(results[model][key]), file=sys.stderr, flush=True)
                    save()
                if model == "tiny" and a.quality_seeds:
                    print(f"[bench] {model}: torchft, final eval NE with a kill against {a.quality_seeds} failure-free "
                          f"seeds ...", file=sys.stderr, flush=True)
                    results[model]["torchft_quality"] = run_torchft_quality(tmp, model, a.kill_after_step,
                                                                            a.quality_steps, a.quality_seeds) | {
                        "command": command}
                    print(json.dumps(results[model]["torchft_quality"]), file=sys.stderr, flush=True)
                    save()
    finally:
        ray.shutdown()
        if a.keep:
            print(f"[bench] kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(save(), indent=2))


if __name__ == "__main__":
    main()
