"""Data pipeline benchmark: prepare against pyarrow's own CSV parse, the input path per CPU core
against pyarrow's bare parquet read, and training fed by Ray Data against training fed from memory.

Writes bench/results/data_pipeline.json (configuration, machine, figures) and prints it.

Figures (each run `--repeat` times, the measurements taking turns; rows/s per core from the
median CPU seconds (`*_cpu`, process time) and from the median wall seconds (`*_wall`)):
  pyarrow_csv        pyarrow.csv.read_csv of the same raw files, one thread: the reference
  parse_transform    recgrid's parse + validate + transform, in process, one core (no write)
  prepare_one_core   one prepare unit's work in process (parse, transform, parquet write)
  prepare_ray        `prepare` on Ray Data over all cores, each run beside a pyarrow_csv run:
                     rows/s over the cores (wall) and over the prepare tasks' CPU seconds (cpu),
                     and both as ratios to pyarrow's
  input_per_core     prepared parquet -> ready batches on one core, one-hot and multi-hot: the
                     work of a read task (read the units' rows, collate), stage by stage, beside
                     pyarrow.parquet's bare read of the same files (the limit), and the training
                     process's wrap into torchrec Batches
  ray_stream         rows/s of one worker's stream through Ray Data (`ray_batches`, the training
                     path) over every file, and Ray Data's own per-operator stats
  training_qps       stream_over_memory: QPS of the 2-D training loop fed by Ray Data over QPS
                     fed from memory (see measure_training_qps)

Usage: .venv/bin/python bench/data_pipeline.py [--rows N] [--files F] [--workers T] [--batch-size B]
       .venv/bin/python bench/data_pipeline.py --training-only   # prints stream_over_memory only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time



def rounds_of(fns: dict, rounds: int) -> dict:
    """Each of `fns` run `rounds` times, taking turns (a burst of load elsewhere hits all alike):
    name -> {"cpu": [process seconds], "wall": [seconds]}."""
    out = {name: {"cpu": [], "wall": []} for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            c, w = time.process_time(), time.perf_counter()
            fn()
            out[name]["cpu"].append(time.process_time() - c)
            out[name]["wall"].append(time.perf_counter() - w)
    return out


def rates(rows: int, times: dict) -> dict:
    """rows/s per core from the median CPU and the median wall seconds of a figure's runs."""
    return {"rows_per_s_per_core_cpu": rows / statistics.median(times["cpu"]),
            "rows_per_s_per_core_wall": rows / statistics.median(times["wall"]),
            "cpu_seconds": times["cpu"], "wall_seconds": times["wall"]}


def bench_parse(files: list[str], rows: int, spec, repeat: int) -> dict:
    """pyarrow's CSV reader (one thread, the same files, its own type inference), recgrid's parse +
    validate + transform, and one prepare unit's whole work (parse, transform, parquet write),
    in process, taking turns; ratios of the medians, CPU and wall."""
    import pyarrow.csv as pacsv

    from recgrid.data.criteo import TSV, read_raw
    from recgrid.data.prepare import _process_unit

    def pyarrow_parse():
        for p in files:
            pacsv.read_csv(p, read_options=pacsv.ReadOptions(autogenerate_column_names=True, use_threads=False),
                           parse_options=pacsv.ParseOptions(delimiter="\t"))

    def ours():
        for p in files:
            for _ in read_raw(p, spec, fmt=TSV):
                pass

    out_dir = tempfile.mkdtemp(prefix="recgrid-bench-prep-")

    def one_unit():
        shutil.rmtree(out_dir)
        os.makedirs(out_dir)
        for p in files:
            unit = {"path": p, "fmt": TSV, "part": 0, "start": 0, "end": os.path.getsize(p), "first_line": 1}
            s = _process_unit(unit, spec=spec, out=out_dir, skip_bad=False, rows_per_file=10**9)
            assert not s["error"], s["error"]

    t = rounds_of({"pyarrow_csv": pyarrow_parse, "parse_transform": ours, "prepare_one_core": one_unit}, repeat)
    shutil.rmtree(out_dir)
    out = {name: rates(rows, times) for name, times in t.items()}
    for name in ("parse_transform", "prepare_one_core"):
        for kind in ("cpu", "wall"):
            out[name][f"ratio_to_pyarrow_{kind}"] = (statistics.median(t["pyarrow_csv"][kind])
                                                     / statistics.median(t[name][kind]))
    return out


def bench_prepare_ray(files: list[str], out: str, rows: int, spec, repeat: int, rows_per_file: int) -> dict:
    """`prepare` on Ray Data over all cores, `repeat` times, each run beside a run of pyarrow's
    CSV reader over the same files (one thread), taking turns. Per core: rows/s over the cores
    (wall) and rows over the prepare tasks' CPU seconds (cpu); ratios of the medians."""
    import pyarrow.csv as pacsv

    from recgrid.data.prepare import prepare

    cores = os.cpu_count() or 1
    # warm-up: Ray's worker processes start and import once; a long prepare pays that once too
    prepare(files, out + "-warmup", spec, rows_per_file=rows_per_file // 8 or 1, log=lambda *_: None)
    shutil.rmtree(out + "-warmup")
    runs: dict = {"prepare": [], "pyarrow_cpu": [], "pyarrow_wall": []}
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        r = prepare(files, out, spec, rows_per_file=rows_per_file, log=lambda *_: None)
        assert r.rows == rows, r
        runs["prepare"].append({"seconds": r.seconds, "cpu_seconds": r.cpu_seconds, "shards": r.shards_written})
        c, w = time.process_time(), time.perf_counter()
        for p in files:
            pacsv.read_csv(p, read_options=pacsv.ReadOptions(autogenerate_column_names=True, use_threads=False),
                           parse_options=pacsv.ParseOptions(delimiter="\t"))
        runs["pyarrow_cpu"].append(time.process_time() - c)
        runs["pyarrow_wall"].append(time.perf_counter() - w)
    wall = statistics.median(p["seconds"] for p in runs["prepare"])
    cpu = statistics.median(p["cpu_seconds"] for p in runs["prepare"])
    pa_cpu, pa_wall = statistics.median(runs["pyarrow_cpu"]), statistics.median(runs["pyarrow_wall"])
    return {"cores": cores, "rows_per_s": rows / wall, "rows_per_s_per_core_wall": rows / wall / cores,
            "rows_per_s_per_core_cpu": rows / cpu,
            "ratio_per_core_to_pyarrow_wall": (rows / wall / cores) / (rows / pa_wall),
            "ratio_per_core_to_pyarrow_cpu": (rows / cpu) / (rows / pa_cpu),
            "pyarrow_rows_per_s_per_core_cpu": rows / pa_cpu, "pyarrow_rows_per_s_per_core_wall": rows / pa_wall,
            "runs": runs}


def bench_input_per_core(prepared_dir: str, spec, batch_size: int, repeat: int) -> dict:
    """One core's work from prepared parquet to ready batches, stage by stage (no Ray), the
    stages taking turns. A read task's work is read + collate (medians of CPU and of wall
    seconds); collated blocks are dropped as made, as a read task hands them to Ray."""
    import pyarrow.parquet as pq

    from recgrid.data.stream import read_task_table, batches_of_block, collate_block, read_tasks, scan_inputs

    inputs = scan_inputs(prepared_dir, spec)
    rows = inputs.total_rows - inputs.total_rows % batch_size
    tasks = read_tasks(inputs.units(), batch_size)  # what the training path's read tasks read
    blocks = []

    def bare():
        for p in inputs.files:
            pq.read_table(p, use_threads=False)

    def read():
        blocks.clear()
        for task in tasks:
            (table,) = read_task_table(inputs, task, spec)
            blocks.append({n: table.column(n).to_numpy() for n in table.column_names})

    read()
    specs = {"one_hot": spec, "multi_hot": spec.with_multi_hot()}
    fns = {"pyarrow_read_parquet": bare, "read": read}
    for name, s in specs.items():
        fns[name] = (lambda s: lambda: [collate_block(b, s, batch_size) for b in blocks] and None)(s)
    t = rounds_of(fns, repeat)
    out = {"rows": rows, "batch_size": batch_size, "rows_per_task": sum(u.rows for u in tasks[0]),
           "pyarrow_read_parquet": rates(rows, t["pyarrow_read_parquet"]), "read": rates(rows, t["read"])}
    for name, s in specs.items():
        first = collate_block(blocks[0], s, batch_size)
        sum(1 for _ in batches_of_block(first))  # warm-up: torch and torchrec imported once
        wrap = rounds_of({"wrap": lambda: sum(1 for _ in batches_of_block(first))}, repeat)["wrap"]
        task = {k: [a + b for a, b in zip(t["read"][k], t[name][k])] for k in ("cpu", "wall")}
        out[name] = {
            **rates(rows, task),  # a read task's work: read + collate
            "seconds_per_million_rows_cpu": {"read": 1e6 * statistics.median(t["read"]["cpu"]) / rows,
                                             "collate": 1e6 * statistics.median(t[name]["cpu"]) / rows},
            "training_process_rows_per_s": first["labels"].size / statistics.median(wrap["wall"]),
        }
    return out


def bench_ray_stream(prepared_dir: str, spec, batch_size: int, repeat: int) -> dict:
    """One worker's stream through Ray Data over every file: rows/s into the consumer, and Ray
    Data's stats of the last pass (where its time goes, per operator)."""
    from recgrid.data.stream import ray_batches, scan_inputs

    inputs = scan_inputs(prepared_dir, spec)
    out = {}
    for name, s in (("one_hot", spec), ("multi_hot", spec.with_multi_hot())):
        stats: list[str] = []
        sum(1 for _ in ray_batches(inputs, inputs.units(), s, batch_size))  # warm-up: worker processes, imports
        rows = (inputs.total_rows // batch_size) * batch_size
        runs = rounds_of({"stream": lambda: sum(1 for _ in ray_batches(inputs, inputs.units(), s, batch_size,
                                                                       stats=stats))}, repeat)["stream"]
        dt = statistics.median(runs["wall"])
        out[name] = {"rows": rows, "seconds": dt, "rows_per_s": rows / dt, "ray_data_stats": stats[-1].splitlines()}
    return out


def _qps_worker(cfg: dict) -> None:
    """One Ray Train worker: the same 2-D loop fed from memory, then from its Ray Data stream."""
    import itertools

    import ray.train
    import torch

    from recgrid.data.stream import local_batches, ray_batches
    from recgrid.data.units import DataCursor, EpochPlan
    from recgrid.engine.grid import Grid
    from recgrid.config import defaults
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    ctx = ray.train.get_context()
    torch.set_num_threads(1)
    rank, T = ctx.get_world_rank(), ctx.get_world_size()
    grid = Grid(T, cfg["num_groups"])
    spec, B, warmup, steps = cfg["spec"], cfg["batch_size"], cfg["warmup"], cfg["steps"]
    state = Trainer.build(grid, EngineConfig.from_job(defaults(), spec=spec, sync_every=cfg["sync_every"]), torch.device("cpu"))
    part = EpochPlan(cfg["inputs"], seed=0, batch_size=B).segment(DataCursor(), T).part(rank)

    def timed(batches) -> dict:
        state.run(batches, state.state.step + warmup)
        result = state.run(batches, state.state.step + steps)
        return {"steps": result.steps, "seconds": result.wall_seconds, "phase_seconds": result.phase_seconds}

    # this worker's rows, collated before the clock starts
    held = list(local_batches(cfg["inputs"], part, spec, B))
    best: dict = {}
    for _ in range(cfg["rounds"]):  # the modes take turns: a burst of load elsewhere hits both alike
        memory = timed(itertools.cycle(held))
        # the training path: this worker's part of the epoch plan, out of Ray Data
        stream = timed(ray_batches(cfg["inputs"], part, spec, B))
        if stream["steps"] < steps:
            raise RuntimeError(f"the stream ran out after {stream['steps']} timed steps; give the benchmark more rows")
        for mode, got in (("memory", memory), ("stream", stream)):
            if mode not in best or got["seconds"] < best[mode]["seconds"]:
                best[mode] = got
    with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
        json.dump(best, f)


def measure_training_qps(spec, paths, batch_size: int, workers: int, num_groups: int = 2, sync_every: int = 5,
                         warmup: int = 20, steps: int = 100, rounds: int = 2) -> dict:
    """Stream-vs-memory QPS of the 2-D training loop (goal: stream_over_memory >= 0.9).

    One Ray Train job, T workers at 0.5 CPU, M sharding groups: each worker runs the same loop
    on the same model, `warmup` + `steps` steps fed from batches of its own rows held in memory,
    then fed by Ray Data (`ray_batches` over its part of the epoch plan: the production path,
    read tasks reserving a quarter CPU each), `rounds` times in turn; each mode's fastest round
    counts. QPS = T * batch_size * steps / the slowest worker's seconds.
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from recgrid.data.stream import scan_inputs

    out = tempfile.mkdtemp(prefix="recgrid-bench-qps-")
    trainer = TorchTrainer(
        _qps_worker,
        train_loop_config={"spec": spec, "batch_size": batch_size, "num_groups": num_groups, "sync_every": sync_every,
                           "warmup": warmup, "steps": steps, "rounds": rounds, "out": out,
                           "inputs": scan_inputs(paths, spec)},
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=os.path.join(out, "ray")),
    )
    trainer.fit()
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(workers)]
    shutil.rmtree(out, ignore_errors=True)
    figures: dict = {"T": workers, "M": num_groups, "K": sync_every, "batch_size_per_worker": batch_size,
                     "steps": steps, "warmup": warmup, "rounds": rounds}
    for mode in ("stream", "memory"):
        slowest = max(r[mode]["seconds"] for r in ranks)
        figures[f"qps_{mode}"] = workers * batch_size * min(r[mode]["steps"] for r in ranks) / slowest
        # where a step's time goes, mean over workers: compute slowed by contention vs waiting for data
        figures[f"ms_per_step_{mode}"] = {
            phase: round(1000 * sum(r[mode]["phase_seconds"][phase] for r in ranks) / len(ranks) / steps, 2)
            for phase in ("data_wait", "lookup", "dense", "sync")}
    figures["stream_over_memory"] = figures["qps_stream"] / figures["qps_memory"]
    return figures


def training_only(args) -> dict:
    """The demo job's shapes (jobs/local_demo.yaml: spec tiny, T=4, M=2, K=5, 256 rows per
    worker) on prepared synthetic parquet, on a local Ray cluster of this machine."""
    import ray

    from recgrid.data.specs import get_spec
    from recgrid.data.synth import write_synth

    spec = get_spec("tiny")
    work = tempfile.mkdtemp(prefix="recgrid-bench-qps-data-")
    try:
        rows = args.workers * 256 * 140  # warm-up + timed steps of every worker, and some to spare
        prepared = write_synth(os.path.join(work, "prepared"), rows, args.files, "parquet", spec, seed=0)
        from recgrid.cluster import LOCAL_SYSTEM_CONFIG

        # the local cluster `recgrid train` starts keeps idle workers as long (recgrid.cluster)
        ray.init(address="local", num_cpus=(os.cpu_count() or 1) + 1, log_to_driver=False,
                 _system_config=LOCAL_SYSTEM_CONFIG)
        try:
            return measure_training_qps(spec, prepared, 256, args.workers, num_groups=2, sync_every=5,
                                        rounds=args.rounds)
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="raw rows, split over --files files")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4, help="T, training workers")
    ap.add_argument("--batch-size", type=int, default=512, help="per-worker batch size")
    ap.add_argument("--spec", default="tiny")
    ap.add_argument("--repeat", type=int, default=5, help="runs per figure, taking turns; the median counts")
    ap.add_argument("--rounds", type=int, default=4,
                    help="turns of the training-QPS measurement (memory, then stream); each mode's fastest counts")
    ap.add_argument("--training-only", action="store_true",
                    help="only the training QPS fed by Ray Data over fed from memory (demo model, T=--workers); "
                         "prints it, writes no file")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "data_pipeline.json"))
    args = ap.parse_args(argv)
    if args.training_only:
        print(json.dumps(training_only(args), indent=2))
        return 0

    import ray

    from recgrid.launch.report import machine_info
    from recgrid.data.specs import get_spec
    from recgrid.data.synth import write_synth

    spec = get_spec(args.spec)
    work = tempfile.mkdtemp(prefix="recgrid-bench-data-")
    result = {"benchmark": "data_pipeline", "config": vars(args) | {"spec": spec.name}, "machine": machine_info()}
    try:
        raw = write_synth(os.path.join(work, "raw"), args.rows, args.files, "tsv", spec, seed=0)
        result["config"]["raw_bytes"] = sum(os.path.getsize(p) for p in raw)
        figures = bench_parse(raw, args.rows, spec, args.repeat)
        # one logical CPU beyond the cores: T workers at 0.5 CPU plus read tasks must fit at once;
        # the dashboard serves the state API that Ray Train's placement-group cleaner polls
        from recgrid.cluster import LOCAL_SYSTEM_CONFIG

        # the local cluster `recgrid train` starts keeps idle workers as long (recgrid.cluster)
        ray.init(address="local", num_cpus=(os.cpu_count() or 1) + 1, log_to_driver=False,
                 _system_config=LOCAL_SYSTEM_CONFIG)
        try:
            prepared = os.path.join(work, "prepared")
            figures["prepare_ray"] = bench_prepare_ray(raw, prepared, args.rows, spec, args.repeat,
                                                       rows_per_file=max(1, args.rows // args.files))
            figures["input_per_core"] = bench_input_per_core(prepared, spec, args.batch_size, args.repeat)
            figures["ray_stream"] = bench_ray_stream(prepared, spec, args.batch_size, args.repeat)
            figures["training_qps"] = measure_training_qps(spec, prepared, 256, args.workers, rounds=args.rounds)
        finally:
            ray.shutdown()
        result["figures"] = figures
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
