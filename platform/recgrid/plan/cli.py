"""`recgrid plan`: for every group count M dividing T, predict the step time split, the peak
memory per worker and the QPS of 2-D sparse parallelism, recommend M and K and say why.

On GPUs (`--device gpu`, the default) with the published figures; on CPU workers with gloo
(`--device cpu`) with the measured ones (`--cpu-profile PATH`, default this machine's,
constants.CPU_MEASURED). `--config JOB.yaml` plans for a job's shape: its T, workers per node,
batch, device, model and sync interval; the output adds the job's own plan, table by table, which
is exactly what the job runs with `model.sharding: auto` (the same function makes both:
`planner.job_candidate`).
"""

from __future__ import annotations

import argparse
import json
import sys

from recgrid.config import ConfigError, load_config
from recgrid.engine.model import build_model
from recgrid.plan.cluster import Cluster, PlanError
from recgrid.plan.constants import PROFILES
from recgrid.plan.estimators import CpuCost, GpuCost
from recgrid.plan.planner import cpu_profile, job_candidate, job_cluster, job_tables, make_plan
from recgrid.plan.recscale import OptionsError, apply_args
from recgrid.plan.report import format_plan
from recgrid.plan.tables import TablesError, resolve_model
from recgrid.trainer_config import EngineConfig

DEVICES = ("gpu", "cpu")


def parse_int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"{flag} must be a comma-separated list of positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise PlanError(f"{flag} must be a comma-separated list of positive integers, got {text!r}")
    return values


def gpu_cost(args: argparse.Namespace) -> GpuCost:
    if args.gpu not in PROFILES:
        raise PlanError(f"--gpu must be one of {sorted(PROFILES)}, got {args.gpu!r}")
    for flag in ("hbm_gb", "intra_node_gbps", "inter_node_gbps"):
        v = getattr(args, flag)
        if v is not None and not v > 0:
            raise PlanError(f"--{flag.replace('_', '-')} must be positive, got {v}")
    profile = PROFILES[args.gpu].with_overrides(args.hbm_gb, args.intra_node_gbps, args.inter_node_gbps)
    return GpuCost(profile, args.gpus_per_node)


def cluster_cost(args: argparse.Namespace, world_size: int) -> GpuCost | CpuCost:
    """The cost form `--device` names: GPU (published figures) or CPU (measured ones)."""
    device = getattr(args, "device", "gpu")
    if device not in DEVICES:
        raise PlanError(f"--device must be one of {list(DEVICES)}, got {device!r}")
    if device == "gpu":
        return gpu_cost(args)
    try:
        return CpuCost(cpu_profile(getattr(args, "cpu_profile", None)), world_size)
    except (FileNotFoundError, KeyError, ValueError) as e:
        raise PlanError(f"--cpu-profile: {e}") from None


def progress_printer(enabled: bool):
    if not enabled:
        return None
    return lambda msg: print(f"[plan] {msg}", file=sys.stderr, flush=True)


def job_inputs(args: argparse.Namespace):
    """--config: the job's model, cluster, sync intervals and own candidate."""
    try:
        config = load_config(args.config, getattr(args, "set", []))
    except (ConfigError, FileNotFoundError) as e:
        raise PlanError(f"--config {args.config}: {e}") from None
    engine = EngineConfig.from_job(config)
    module = build_model(engine.spec, engine.model, seed=engine.seed)
    profile = cpu_profile(args.cpu_profile) if getattr(args, "cpu_profile", None) else None
    cluster = job_cluster(config, profile=profile)
    model = job_tables(config, module)
    job = job_candidate(config, module, profile=profile)
    ks = sorted(set(parse_int_list(args.sync_every, "--sync-every")) | {config.grid.sync_every})
    return model, cluster, ks, job


def run_cli(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "config", None):
            model, cluster, ks, job = job_inputs(args)
        else:
            for flag in ("gpus", "batch_per_gpu"):
                if getattr(args, flag) is None:
                    raise PlanError(f"--{flag.replace('_', '-')} is required (or --config JOB.yaml)")
            model, _ = apply_args(resolve_model(args.spec, args.tables), args)
            ks = parse_int_list(args.sync_every, "--sync-every")
            cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node, batch_per_gpu=args.batch_per_gpu,
                              cost=cluster_cost(args, args.gpus))
            job = None
        if not args.json:
            print(f"[plan] planning {len(model.tables)} tables for every M dividing T={cluster.gpus} "
                  f"with TorchRec's planner ...", file=sys.stderr, flush=True)
        plan = make_plan(model, cluster, ks, progress=progress_printer(not args.json), job=job)
    except (PlanError, TablesError, OptionsError) as e:
        print(f"recgrid plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json()) if args.json else format_plan(plan))
    return 0


