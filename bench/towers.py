"""Disaggregated Multi-Tower on planted data: eval NE/AUC and step time of the flat exchange
against DMT (N towers x compression CR), and the tower partitioner against the strided one.

1. Synthetic Criteo rows with pairwise interactions planted within known feature groups
   (`recgrid synth --interaction-groups G`), a training stream and a held-out stream.
2. The tower partitioner (`recgrid towers`, coherent) for every N; its purity and adjusted Rand
   index against the planted groups, next to the paper's naive strided assignment.
3. T = 4 local gloo workers (M = 1): flat (TorchRec, table-wise) and DMT with N towers (hosts
   emulated: N hosts of 4 / N workers) and "dlrm" tower modules of CR 1, 2, 4 on the
   partitioner's towers; each configuration for every seed, trained with `Trainer.fit` and
   evaluated on the held-out rows; mean ± std over seeds of eval NE and AUC, the median step
   time and the exchange metrics of the run.
Writes bench/results/towers.json (configuration, machine, figures) as it goes and prints a table.

    .venv/bin/python bench/towers.py [--steps 300] [--seeds 0,1,2] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_configs(configs: list[dict], data: str, eval_data: str, spec_name: str, steps: int, batch: int,
                seed: int) -> list[dict]:
    """On every worker: train each configuration from scratch and evaluate it; returns rank 0's figures."""
    import torch
    import torch.distributed as dist

    from recgrid.data.specs import get_spec
    from recgrid.data.stream import scan_inputs
    from recgrid.data.units import EpochPlan
    from recgrid.engine.grid import Grid
    from recgrid.engine.towers import TowerConfig
    from recgrid.config import defaults
    from recgrid.train.trainer import EvalData, FitHooks, TrainData, Trainer
    from recgrid.trainer_config import EngineConfig, LoopConfig

    spec = get_spec(spec_name)
    rank, T = dist.get_rank(), dist.get_world_size()
    train_inputs, eval_inputs = scan_inputs(data, spec), scan_inputs(eval_data, spec)
    out = []
    for c in configs:
        towers = None
        if c["towers"]:
            towers = TowerConfig(tuple(tuple(t) for t in c["partition"]), module=c["module"],
                                 compression=c["cr"], source=c["source"])
        grid = Grid(T, 1, workers_per_node=c["workers_per_node"])
        config = EngineConfig.from_job(defaults(), spec=spec, sharding="table_wise", seed=seed, towers=towers)
        t0 = time.perf_counter()
        trainer = Trainer.build(grid, config, torch.device("cpu"))
        step_times: list[float] = []
        last: dict = {}

        def on_log(values: dict, step: int) -> None:
            if "train/step_time_s" in values:
                step_times.append(values["train/step_time_s"])
            last.update({k: v for k, v in values.items() if k.startswith(("exchange/", "time/lookup_s", "time/dense_s"))})

        loop = LoopConfig.from_job(defaults(), max_steps=steps, batch_size=batch, log_every=25)
        metrics = trainer.fit(TrainData(EpochPlan(train_inputs, seed, batch, 65_536), spec, rank, T), loop,
                              EvalData(eval_inputs, spec, 1024, rank, T), FitHooks(on_log=on_log))
        trainer.close()
        out.append({**{k: c[k] for k in ("name", "towers", "cr", "module")}, "seed": seed,
                    "eval_ne": metrics["eval/ne"], "eval_auc": metrics["eval/auc"],
                    "step_time_median_s": statistics.median(step_times[1:] or step_times),
                    "effective_cr": towers.effective_compression() if towers else 1.0,
                    "exchange": last, "wall_s": round(time.perf_counter() - t0, 1)})
        if rank == 0:
            print(f"[towers] seed {seed} {c['name']}: NE {metrics['eval/ne']:.4f} AUC {metrics['eval/auc']:.4f} "
                  f"step {out[-1]['step_time_median_s'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    return out


def main() -> None:
    from recgrid.data.specs import SPARSE_NAMES
    from recgrid.data.synth import planted_groups, write_synth
    from recgrid.launch.local import run_local
    from recgrid.launch.report import machine_info, write_result
    from recgrid.launch.towers import pooled_embeddings
    from recgrid.plan.feature_clusters import adjusted_rand_index, labels_from_groups, partition_features, purity, \
        strided_labels

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=160_000, help="training rows")
    ap.add_argument("--eval-rows", type=int, default=40_000)
    ap.add_argument("--groups", type=int, default=4, help="planted interaction groups")
    ap.add_argument("--strength", type=float, default=2.0, help="planted interaction strength (at 1.0 the partitioner is at chance)")
    ap.add_argument("--data-seed", type=int, default=1, help="fixes the planted model")
    ap.add_argument("--steps", type=int, default=300, help="training steps per run (T=4 workers)")
    ap.add_argument("--batch-size", type=int, default=128, help="rows per worker per step")
    ap.add_argument("--tp-steps", type=int, default=1000, help="steps of the partitioner's short run")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--towers", default="2,4")
    ap.add_argument("--crs", default="1,2,4")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench_towers"), help="where the data is written")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "towers.json"))
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    tower_counts = [int(n) for n in a.towers.split(",")]
    crs = [float(c) for c in a.crs.split(",")]
    work = Path(a.work)
    train_glob, eval_glob = str(work / "train" / "*.parquet"), str(work / "eval" / "*.parquet")
    t_start = time.perf_counter()
    if not list((work / "train").glob("*.parquet")):
        write_synth(str(work / "train"), a.rows, 2, "parquet", "tiny", a.data_seed, 0, a.groups, a.strength)
        write_synth(str(work / "eval"), a.eval_rows, 1, "parquet", "tiny", a.data_seed, 1, a.groups, a.strength)
    result: dict = {
        "benchmark": "towers",
        "configuration": {"world_size": 4, "num_groups": 1, "spec": "tiny", "rows": a.rows, "eval_rows": a.eval_rows,
                          "planted_groups": [[SPARSE_NAMES[f] for f in g] for g in planted_groups(a.groups, a.data_seed)],
                          "interaction_strength": a.strength, "data_seed": a.data_seed, "steps": a.steps,
                          "batch_per_worker": a.batch_size, "seeds": seeds, "tower_module": "dlrm",
                          "flat_sharding": "table_wise", "partitioner_steps": a.tp_steps,
                          "backend": "gloo", "device": "cpu", "threads_per_worker": 1,
                          "note": "hosts emulated: N towers = N hosts of 4/N workers; step time = median over "
                                  "logging intervals of the slowest worker's wall time per step, on a shared "
                                  "2-core machine (compare configurations, not absolute values)"},
        "machine": machine_info(),
    }

    # the partitioner, once per tower count, against the planted groups
    pooled = pooled_embeddings(train_glob, "tiny", a.tp_steps, 256, 4096, 0)
    partitions, result["partitioner"] = {}, []
    for n in tower_counts:
        part = partition_features(pooled, n, "coherent")
        truth = labels_from_groups(planted_groups(a.groups, a.data_seed), len(SPARSE_NAMES))
        strided = strided_labels(len(SPARSE_NAMES), n)
        partitions[n] = part.towers(SPARSE_NAMES)
        result["partitioner"].append({
            "towers": n, "sizes": part.sizes(), "partition": partitions[n],
            "purity": purity(part.labels, truth), "ari": adjusted_rand_index(part.labels, truth),
            "strided_purity": purity(strided, truth), "strided_ari": adjusted_rand_index(strided, truth)})
        print(f"[towers] partitioner N={n}: {result['partitioner'][-1]}", file=sys.stderr, flush=True)

    configs = [{"name": "flat", "towers": 0, "cr": 1.0, "module": "none", "workers_per_node": 2}]
    for n in tower_counts:
        configs += [{"name": f"dmt N={n} CR={cr:g}", "towers": n, "cr": cr, "module": "dlrm",
                     "partition": partitions[n], "source": "recgrid towers (coherent)", "workers_per_node": 4 // n}
                    for cr in crs]
    runs = []
    for seed in seeds:
        runs += run_local(run_configs, 4, configs, train_glob, eval_glob, "tiny", a.steps, a.batch_size, seed,
                          timeout_s=7200)[0]
        result["runs"] = runs
        write_result(a.out, result)

    def stat(rows: list[dict], key: str) -> dict:
        v = [r[key] for r in rows]
        return {"mean": statistics.mean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0}

    result["summary"] = []
    for c in configs:
        rows = [r for r in runs if r["name"] == c["name"]]
        ex = rows[0]["exchange"]
        result["summary"].append({
            "name": c["name"], "towers": c["towers"], "cr": c["cr"], "effective_cr": rows[0]["effective_cr"],
            "eval_ne": stat(rows, "eval_ne"), "eval_auc": stat(rows, "eval_auc"),
            "step_time_s": stat(rows, "step_time_median_s"),
            "cross_host_bytes_per_step": ex.get("exchange/bytes/cross_host"),
            "cross_host_world_size": ex.get("exchange/world_size/cross_host")})
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    write_result(a.out, result)
    print(f"{'config':<16} {'eval NE':>17} {'eval AUC':>17} {'step ms':>12} {'x-host B/step':>14} {'a2a ws':>6}")
    for s in result["summary"]:
        print(f"{s['name']:<16} {s['eval_ne']['mean']:.4f} ± {s['eval_ne']['std']:.4f}  "
              f"{s['eval_auc']['mean']:.4f} ± {s['eval_auc']['std']:.4f}  "
              f"{s['step_time_s']['mean'] * 1e3:6.1f} ± {s['step_time_s']['std'] * 1e3:4.1f} "
              f"{s['cross_host_bytes_per_step'] or 0:14.0f} {s['cross_host_world_size'] or 0:6.0f}")


if __name__ == "__main__":
    main()
