"""A lost host, under both layouts (every sharding group a Ray Train run).

A real multi-node Ray cluster in one process (`ray.cluster_utils.Cluster`): a head that holds no
worker (it lacks the `worker_slot` resource the workers ask for) and two worker nodes. Once the
job trains (past `--loss-step`), a worker node is removed; `--gap` seconds later a fresh node joins
(capacity returns). For each case the script records what the job did, the seconds from the
node's removal and from the fresh node's join to the rebuilt groups' first committed step, how the
job ended (one MLflow run), whether the run's `grid/ranks.json` records every process of the job,
and the row audit (`row_audit`: each global rank's logged batches against its part of the job's
epoch plan, epoch after epoch: no batch skipped, and how many were read twice):

  one_per_node          inter-host T=2, M=2 (L=1): the lost node held one sharding group of one worker
  group_per_node        inter-host T=4, M=2 (L=2): the lost node held one sharding group; the other keeps
                        its processes and trains on, and the lost one heals from it when the node joins
  host_local_T4_M2      host-local T=4, M=2 (L=2), two workers a node: the lost node held shard position 1
                        of both groups; every group restores the hosts' in-memory snapshot (position 1
                        from the copy the other host kept), `train.checkpoint_every=1000` (no storage)
  host_local_T6_M3      the same at T=6, M=3, three workers a node

Writes bench/results/node_loss.json (configuration, machine, figures) and prints it.

    .venv/bin/python bench/node_loss.py [--cases one_per_node,...] [--gap 10] [--loss-step 300]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = {"one_per_node": {"world_size": 2, "num_groups": 2, "layout": "inter-host"},
         "group_per_node": {"world_size": 4, "num_groups": 2, "layout": "inter-host"},
         "host_local_T4_M2": {"world_size": 4, "num_groups": 2, "layout": "host-local"},
         "host_local_T6_M3": {"world_size": 6, "num_groups": 3, "layout": "host-local"}}
# as the test suite's clusters: the controller sees a dead worker within 0.5 s (Ray's default: 2 s)
RAY_ENV = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "RUST_LOG": "warn",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def run_case(tmp: Path, name: str, gap_s: float, loss_step: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from recgrid.cluster import LOCAL_SYSTEM_CONFIG
    from recgrid.config import load_config
    from recgrid.launch.ray import run_job

    shape = CASES[name]
    T, M, layout = shape["world_size"], shape["num_groups"], shape["layout"]
    L = T // M
    per_node = L if layout == "inter-host" else M  # a node holds a sharding group, or a replica group
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": LOCAL_SYSTEM_CONFIG})
    cpus = max(1, math.ceil(per_node * 0.5))  # the job's train.cpus_per_worker (0.5) for every worker it holds
    nodes = [cluster.add_node(num_cpus=cpus, resources={"worker_slot": per_node}) for _ in range(2)]
    ray.init(address=cluster.address, runtime_env={"env_vars": RAY_ENV}, logging_level="WARNING")
    cluster.wait_for_nodes()
    config = load_config(REPO / "jobs/local_demo.yaml", [
        f"data.train={tmp}/data/train/*.parquet", "data.eval=[]", "data.synth_rows=40000",
        f"grid.world_size={T}", f"grid.num_groups={M}", "grid.sync_every=5",
        f"grid.layout={layout}", "train.resources_per_worker={worker_slot: 1}",
        "train.max_steps=100000", "train.batch_size=64", "train.log_every=10", "train.max_failures=4",
        *(["train.checkpoint_every=1000"] if layout == "host-local" else []),
        f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db", f"tracking.experiment=bench-node-loss-{name}",
        f"data.row_log={tmp}/rows",
    ])
    from recovery import CpuSampler  # bench/recovery.py: every process's CPU, sampled with psutil

    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("result", run_job(config, on_start=lambda c: box.setdefault("c", c))))
    sampler = CpuSampler().__enter__()
    job.start()
    out: dict = {"case": name, **shape, "group_size": L, "snapshots": str(config.snapshots.param())}
    lost_at = before = added_at = None
    try:
        while job.is_alive():
            c = box.get("c")
            try:
                st = c.status() if c is not None else None
            except Exception:  # noqa: BLE001 - the job ended between two polls
                st = None
            workers = {r: w for a in st["attempts"] for r, w in a["workers"].items()} if st else {}
            if lost_at is None and st and sum(1 for w in workers.values() if w.get("ready")) == T \
                    and st["last_step"] > loss_step:
                # inter-host: the node of sharding group 1 (ranks L..2L-1); host-local: of shard position 1 (ranks M..2M-1)
                lost = next(n for n in nodes if n.node_id == workers[L if layout == "inter-host" else M]["node"])
                nodes.remove(lost)
                before = {r: (w["node"], w["pid"]) for r, w in workers.items()}
                out["lost_ranks"] = sorted(r for r, (n, _) in before.items() if n == lost.node_id)
                out["step_at_loss"] = st["last_step"]
                lost_at = time.time()
                cluster.remove_node(lost)
                time.sleep(gap_s)
                nodes.append(cluster.add_node(num_cpus=cpus, resources={"worker_slot": per_node}))
                added_at = time.time()
                out["node_added_s"] = round(added_at - lost_at, 2)
            events = [e for e in st["events"] if "seconds" in e] if st else []
            rebuilt = M if layout == "host-local" else 1  # the groups that come back
            if lost_at is not None and len(events) >= rebuilt and st["last_step"] >= max(e["step"] for e in events) + 10:
                kept = [r for r in before if r not in out["lost_ranks"]]
                out["survivors_kept_their_processes"] = all(workers[r]["pid"] == before[r][1] for r in kept)
                firsts = sorted(e["t_first_step"] for e in events)
                out["first_step_after_node_added_s"] = round(firsts[0] - added_at, 2)
                out["last_group_first_step_after_node_added_s"] = round(firsts[-1] - added_at, 2)
                out["first_step_after_loss_s"] = round(firsts[0] - lost_at, 2)
                out["survivors_steps_during"] = [e.get("survivors_steps") for e in events]
                # where the cores went from the node's loss to the first committed step after it
                out["cpu_during_recovery"] = sampler.recovery(lost_at, min(e["t_attempt_start"] for e in events),
                                                              firsts[0])
                out["recoveries"] = [{**{k: e.get(k) for k in ("sharding_group", "source", "step", "steps_lost",
                                                               "snapshot_interval_steps", "kept_training", "detail")},
                                      # when each phase ended, in seconds after the fresh node joined
                                      **{f"{k}_after_node_added_s": round(e[k] - added_at, 2)
                                         for k in ("t_failure_detected", "t_attempt_start", "t_heal", "t_first_step")
                                         if e.get(k)}}
                                     for e in events]
                ray.get(c.control.request_stop.remote())
                break
            time.sleep(0.2)
        job.join()
        result = box["result"]
        out["status"] = result.status
        if result.error:
            out["error"] = result.error.splitlines()[0][:300]
        else:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(config.tracking.tracking_uri)
            exp = client.get_experiment_by_name(config.tracking.experiment)
            out["mlflow_runs"] = len(client.search_runs([exp.experiment_id]))
            run = client.get_run(result.run_id)
            out["holder_bytes_max"] = run.data.metrics.get("holders/bytes_max")
            with open(client.download_artifacts(result.run_id, "grid/ranks.json")) as f:
                recorded = {(x["rank"], x["node"], x["pid"]) for x in json.load(f)}
            every = {(int(r), w["node"], w["pid"]) for a in result.attempts for r, w in a["workers"].items()}
            out["processes"] = len(every)
            out["ranks_json_records_every_process"] = every <= recorded
            lost = max((e.get("steps_lost") or 0 for e in result.events if "seconds" in e), default=0)
            out["row_audit"] = row_audit(config, tmp / "rows", lost)
    finally:
        sampler.__exit__(None, None, None)
        ray.shutdown()
        cluster.shutdown()
    return out


def row_audit(config, directory: Path, steps_lost: int = 0) -> dict:
    """Each global rank's logged batches matched against its part of the job's epoch plan, epoch
    after epoch (`train.rows.rank_positions`, a batch read again recognised up to `steps_lost`
    steps back beside a broken group's since its last sync step): `skipped` counts the batches of
    the plan before the last one read that no attempt read (the issue asks for 0), `read_again`
    the batches read twice (a broken group's since its last sync step, every group's since a
    restored snapshot)."""
    from recgrid.data.stream import scan_inputs
    from recgrid.train.rows import rank_positions, read_row_logs
    from recgrid.train.schedule import Schedule

    inputs = scan_inputs(config.data.train, config.dataset_spec())
    logs = read_row_logs(str(directory))
    out = {"batches": 0, "skipped": 0, "read_again": 0}
    for rank in range(config.grid.world_size):
        positions = rank_positions(inputs, config.train.seed, config.train.batch_size, config.data.rows_per_unit,
                                   config.grid.world_size, rank, logs,
                                   Schedule(config.grid.sync_every).reread_window + steps_lost)
        out["batches"] += len(positions)
        out["skipped"] += max(positions, default=-1) + 1 - len(set(positions))
        out["read_again"] += len(positions) - len(set(positions))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--gap", type=float, default=10.0, help="seconds between the node's removal and a fresh node's join")
    ap.add_argument("--loss-step", type=int, default=300, help="the node is removed once the job trained past this step")
    ap.add_argument("--out", default=str(REPO / "bench/results/node_loss.json"))
    a = ap.parse_args()

    from recgrid.launch.report import machine_info, write_result

    results = {}
    for name in a.cases.split(","):
        tmp = Path(tempfile.mkdtemp(prefix="recgrid-bench-node-loss-"))
        os.environ["RECGRID_RUNS_DIR"] = str(tmp / "runs")
        print(f"[bench] {name}: {CASES[name]}, a worker node lost, a fresh one {a.gap:g} s later ...",
              file=sys.stderr, flush=True)
        try:
            results[name] = run_case(tmp, name, a.gap, a.loss_step)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(json.dumps(results[name]), file=sys.stderr, flush=True)
        out = {
            "benchmark": "node_loss",
            "configuration": {"sync_every": 5, "batch_size_per_worker": 64,
                              "cluster": "ray.cluster_utils.Cluster: a head of 1 CPU (no worker slot), two worker nodes "
                                         "with the worker slots and CPUs (0.5 a worker) of one sharding group "
                                         "(inter-host) or one replica group (host-local) each",
                              "cases": {k: CASES[k] for k in results}, "gap_s": a.gap, "loss_step": a.loss_step},
            "results": results,
            "machine": machine_info(),
        }
        write_result(a.out, out)  # after every case: a case that fails keeps the ones before
    print(json.dumps(results, indent=2))  # the whole file, with the machine, is at --out


if __name__ == "__main__":
    main()
