"""Data pipeline benchmark: prepare against pyarrow's own CSV parse, and what the stream delivers.

Writes bench/results/data_pipeline.json (configuration, machine, figures) and prints it.

Figures:
  pyarrow_csv        pyarrow.csv.read_csv of the same raw files, one thread: rows/s per core
  parse_transform    recgrid's parse + validate + transform, in process, one core (no write)
  prepare_one_core   one prepare unit's work in process (parse, transform, parquet write)
  prepare_ray        `prepare` on Ray Data over all cores: rows/s, rows/s per core, and the
                     ratio per core against pyarrow_csv (the issue's prepare-vs-pyarrow figure)
  collate            numpy batch -> torchrec Batch alone
  stream_*           rows/s of read_dataset -> iter_batches (stream + collate) per consumer,
                     for prepared parquet and raw TSV, one consumer and T consumers (Ray actors)
  training_qps       stream-vs-memory and units-vs-memory QPS of the 2-D training loop (see
                     measure_training_qps)

Usage: .venv/bin/python bench/data_pipeline.py [--rows N] [--files F] [--workers T] [--batch-size B]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np


def best_of(fn, repeat: int) -> float:
    """Fastest of `repeat` runs, in seconds: the machine is shared, the minimum is the signal."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_parse(files: list[str], rows: int, spec, repeat: int) -> dict:
    import pyarrow.csv as pacsv

    from recgrid.data.criteo import TSV, read_raw
    from recgrid.data.prepare import _process_unit

    def pyarrow_parse(threads: bool):
        for p in files:
            pacsv.read_csv(p, read_options=pacsv.ReadOptions(autogenerate_column_names=True, use_threads=threads),
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

    t_pa = best_of(lambda: pyarrow_parse(False), repeat)
    t_pa_mt = best_of(lambda: pyarrow_parse(True), repeat)
    t_ours = best_of(ours, repeat)
    t_unit = best_of(one_unit, repeat)
    shutil.rmtree(out_dir)
    return {
        "pyarrow_csv": {"rows_per_s_per_core": rows / t_pa, "rows_per_s_all_threads": rows / t_pa_mt},
        "parse_transform": {"rows_per_s_per_core": rows / t_ours, "ratio_to_pyarrow": t_pa / t_ours},
        "prepare_one_core": {"rows_per_s_per_core": rows / t_unit, "ratio_to_pyarrow": t_pa / t_unit},
    }


def bench_prepare_ray(files: list[str], out: str, rows: int, spec, pyarrow_rate: float, rows_per_file: int) -> dict:
    from recgrid.data.prepare import prepare

    cores = os.cpu_count() or 1
    # warm-up: Ray's worker processes start and import once; a long prepare pays that once too
    prepare(files, out + "-warmup", spec, rows_per_file=rows_per_file // 8 or 1, log=lambda *_: None)
    shutil.rmtree(out + "-warmup")
    shutil.rmtree(out, ignore_errors=True)
    r = prepare(files, out, spec, rows_per_file=rows_per_file, log=lambda *_: None)
    assert r.rows == rows, r
    per_core = r.rows_per_second / cores
    return {"rows_per_s": r.rows_per_second, "cores": cores, "rows_per_s_per_core": per_core,
            "ratio_per_core_to_pyarrow": per_core / pyarrow_rate, "seconds": r.seconds,
            "shards": r.shards_written}


def bench_collate(prepared_dir: str, spec, batch_size: int, repeat: int) -> dict:
    import pyarrow.parquet as pq

    from recgrid.data.criteo import PREPARED_SCHEMA
    from recgrid.data.stream import Collator

    t = pq.read_table(sorted(os.path.join(prepared_dir, n) for n in os.listdir(prepared_dir))[0])
    cols = {n: t.column(n).to_numpy() for n in PREPARED_SCHEMA.names}
    n = (len(t) // batch_size) * batch_size
    out = {}
    for name, s in (("one_hot", spec), ("multi_hot", spec.with_multi_hot())):
        collator = Collator(s)

        def run():
            for i in range(0, n, batch_size):
                collator({k: v[i:i + batch_size] for k, v in cols.items()})

        out[name] = {"rows_per_s": n / best_of(run, repeat)}
    return out


def bench_stream_one(paths, spec, batch_size: int, repeat: int) -> dict:
    from recgrid.data.stream import iter_batches, read_dataset

    ds = read_dataset(paths, spec)
    for _ in iter_batches(ds, batch_size, spec):  # warm-up pass: worker processes, imports, page cache
        pass
    rows = sum(len(b.labels) for b in iter_batches(ds, batch_size, spec))
    dt = best_of(lambda: sum(1 for _ in iter_batches(ds, batch_size, spec)), repeat)
    return {"rows": rows, "seconds": dt, "rows_per_s": rows / dt}


def bench_stream_workers(paths, spec, batch_size: int, workers: int, repeat: int) -> dict:
    import ray

    from recgrid.data.stream import read_dataset, worker_streams

    @ray.remote(num_cpus=0.25)
    class Consumer:
        def run(self, stream, spec, batch_size):
            from recgrid.data.stream import iter_batches

            t = time.perf_counter()
            rows = sum(len(b.labels) for b in iter_batches(stream, batch_size, spec))
            return rows, time.perf_counter() - t

    consumers = [Consumer.remote() for _ in range(workers)]
    streams = worker_streams(read_dataset(paths, spec), workers)
    ray.get([c.run.remote(s, spec, batch_size) for c, s in zip(consumers, streams)])  # warm-up epoch
    wall, res = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        r = ray.get([c.run.remote(s, spec, batch_size) for c, s in zip(consumers, streams)])
        if time.perf_counter() - t < wall:
            wall, res = time.perf_counter() - t, r
    for c in consumers:
        ray.kill(c)
    rows = [r for r, _ in res]
    return {"workers": workers, "rows_per_worker": rows, "seconds": wall, "rows_per_s_total": sum(rows) / wall,
            "rows_per_s_per_worker": sum(rows) / wall / workers}


def _qps_worker(cfg: dict) -> None:
    """One Ray Train worker: the same 2-D loop fed from the stream, then from memory."""
    import itertools

    import ray.train
    import torch

    from recgrid.data.stream import iter_batches, memory_batches
    from recgrid.engine.grid import Grid
    from recgrid.config import defaults
    from recgrid.train.trainer import EngineConfig, Trainer

    ctx = ray.train.get_context()
    torch.set_num_threads(1)
    grid = Grid(ctx.get_world_size(), cfg["num_groups"])
    spec, B, warmup, steps = cfg["spec"], cfg["batch_size"], cfg["warmup"], cfg["steps"]
    state = Trainer.build(grid, EngineConfig.from_job(defaults(), spec=spec, sync_every=cfg["sync_every"]), torch.device("cpu"))
    shard = ray.train.get_dataset_shard("train")

    def timed(batches) -> dict:
        state.run(batches, state.state.step + warmup)
        result = state.run(batches, state.state.step + steps)
        return {"steps": result.steps, "seconds": result.wall_seconds, "phase_seconds": result.phase_seconds}

    # this worker's rows of one pass, collated before the clock starts
    held = memory_batches(shard, B, spec)
    memory = timed(itertools.cycle(held))
    stream = timed(iter(iter_batches(shard, B, spec)))
    # the trainer's own input: this worker's part of the epoch plan, read by its prefetch thread
    from recgrid.data.stream import unit_batches
    from recgrid.data.units import DataCursor, EpochPlan

    seg = EpochPlan(cfg["inputs"], seed=0, batch_size=B).segment(DataCursor(), ctx.get_world_size())
    units = timed(unit_batches(cfg["inputs"], seg.part(ctx.get_world_rank()), spec, B))
    for name, got in (("stream", stream), ("units", units)):
        if got["steps"] < steps:
            raise RuntimeError(f"the {name} input ran out after {got['steps']} timed steps; give the benchmark more rows")
    with open(os.path.join(cfg["out"], f"rank{ctx.get_world_rank()}.json"), "w") as f:
        json.dump({"stream": stream, "memory": memory, "units": units}, f)


def measure_training_qps(spec, paths, batch_size: int, workers: int, num_groups: int = 2, sync_every: int = 5,
                         warmup: int = 20, steps: int = 100) -> dict:
    """Stream-vs-memory QPS of the 2-D training loop (goal: ratio >= 0.9).

    One Ray Train job, T workers, M sharding groups: each worker runs the same loop three times on
    the same model, `warmup` + `steps` steps fed from batches of its own rows held in memory,
    then from its Ray Data stream (`get_dataset_shard` -> `iter_batches`), then from its part of
    the epoch plan read by the trainer's own prefetching reader (`unit_batches`: the production
    path since training became resumable). QPS = T * batch_size * steps / the slowest worker's
    seconds.
    """
    import ray.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from recgrid.data.stream import read_dataset, scan_inputs

    out = tempfile.mkdtemp(prefix="recgrid-bench-qps-")
    trainer = TorchTrainer(
        _qps_worker,
        train_loop_config={"spec": spec, "batch_size": batch_size, "num_groups": num_groups, "sync_every": sync_every,
                           "warmup": warmup, "steps": steps, "out": out, "inputs": scan_inputs(paths, spec)},
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=os.path.join(out, "ray")),
        datasets={"train": read_dataset(paths, spec)},
    )
    trainer.fit()
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(workers)]
    shutil.rmtree(out, ignore_errors=True)
    figures: dict = {"T": workers, "M": num_groups, "K": sync_every, "batch_size_per_worker": batch_size,
                     "steps": steps, "warmup": warmup}
    for mode in ("stream", "memory", "units"):
        slowest = max(r[mode]["seconds"] for r in ranks)
        figures[f"qps_{mode}"] = workers * batch_size * min(r[mode]["steps"] for r in ranks) / slowest
        # where a step's time goes, mean over workers: compute slowed by contention vs waiting for data
        figures[f"ms_per_step_{mode}"] = {
            phase: round(1000 * sum(r[mode]["phase_seconds"][phase] for r in ranks) / len(ranks) / steps, 2)
            for phase in ("data_wait", "lookup", "dense", "sync")}
    figures["ratio"] = figures["qps_stream"] / figures["qps_memory"]
    figures["ratio_units"] = figures["qps_units"] / figures["qps_memory"]  # the trainer's own input
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="raw rows, split over --files files")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4, help="T, consumers of the split stream")
    ap.add_argument("--batch-size", type=int, default=512, help="per-worker batch size")
    ap.add_argument("--spec", default="tiny")
    ap.add_argument("--repeat", type=int, default=2, help="runs per figure; the fastest counts")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "data_pipeline.json"))
    args = ap.parse_args(argv)

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
        ray.init(num_cpus=(os.cpu_count() or 1) + 1, log_to_driver=False)
        try:
            prepared = os.path.join(work, "prepared")
            figures["prepare_ray"] = bench_prepare_ray(
                raw, prepared, args.rows, spec, figures["pyarrow_csv"]["rows_per_s_per_core"],
                rows_per_file=max(1, args.rows // args.files),
            )
            figures["collate"] = bench_collate(prepared, spec, args.batch_size, args.repeat)
            figures["stream_parquet_one_consumer"] = bench_stream_one(prepared, spec, args.batch_size, args.repeat)
            figures["stream_raw_one_consumer"] = bench_stream_one(raw, spec, args.batch_size, args.repeat)
            figures["stream_parquet_workers"] = bench_stream_workers(
                prepared, spec, args.batch_size, args.workers, args.repeat)
            figures["training_qps"] = measure_training_qps(spec, prepared, args.batch_size, args.workers)
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
