"""The `recgrid` command line. Parses arguments and hands each command to the module that owns it.

The parser's description is the tool's own (`DESCRIPTION`); every option's help says its default.

The verbs' modules are imported here, except those that import torch, TorchRec, MLflow or pyarrow:
those when their verb runs (`run_verb`), so `recgrid layout` and `recgrid --help` answer at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from recgrid.config import SECTIONS, field_defaults, field_docs
from recgrid.engine.grid import Grid, GridError
from recgrid.engine.sharding import SHARDINGS
from recgrid.launch import submit
from recgrid.plan import cli as plan_cli
from recgrid.plan import constants, simulate

DESCRIPTION = """\
recgrid trains DLRM-family recommendation models with two-dimensional sparse parallelism on Ray:
T workers form M sharding groups (each holds one whole copy of the embedding tables, sharded over
its L = T / M workers) whose replicas are averaged every K steps. Metrics go to MLflow.

common verbs:
  recgrid train CONFIG.yaml [--set KEY=VALUE]   run a job here (a local Ray cluster) or on $RAY_ADDRESS
  recgrid submit CONFIG.yaml --address URL      run it on a Ray cluster through the Job API
  recgrid compare CONFIG.yaml --groups 1,2,4    the same job at several group counts, side by side
  recgrid keys [SECTION]                        every config key, its default and what it does
  recgrid plan / simulate                       choose M and K for a model and cluster
"""
KEYS_EPILOG = "Config keys (for the YAML and --set): `recgrid keys`, or docs/reference.md."


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and adds each option's default to its help, unless the
    help already says it (flags and options without a default are left as they are)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (action.option_strings and d is not None and d is not argparse.SUPPRESS
                and not isinstance(d, (bool, list)) and "default" not in text):
            text += " (default: %(default)s)"
        return text


def _add_layout(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("layout", help="print the sharding and replica groups of a grid")
    p.add_argument("--world-size", "-T", type=int, required=True, help="T, number of workers")
    p.add_argument("--groups", "-M", type=int, required=True, help="M, number of sharding groups")
    p.add_argument("--inter-host", action="store_true", help="use the inter-host sync layout")
    p.add_argument("--workers-per-node", type=int, default=None, help="check the layout against N workers per node")
    p.add_argument("--json", action="store_true", help="print JSON only")


def _add_smoke(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("smoke", help="train the tiny model on T local gloo processes and check the 2-D sync")
    p.add_argument("--world-size", "-T", type=int, default=4, help="T, number of local gloo worker processes")
    p.add_argument("--groups", "-M", type=int, default=2, help="M, number of sharding groups (must divide T)")
    p.add_argument("--steps", type=int, default=20, help="training steps")
    p.add_argument("--sync-every", "-K", type=int, default=5, help="K, steps between replica-group syncs")
    p.add_argument("--sharding", default="table_wise", choices=SHARDINGS,
                   help="a TorchRec sharding type, or auto (the planner's choice per table)")
    p.add_argument("--inter-host", action="store_true", help="use the inter-host sync layout (default host-local)")
    p.add_argument("--batch-size", type=int, default=64, help="per-worker batch size")
    p.add_argument("--moment-scale", type=float, default=None, help="c, the AdaGrad moment scale (default: M)")
    p.add_argument("--delayed-moment-sync", action="store_true",
                   help="sync optimizer states one sync interval behind the weights")
    p.add_argument("--model", default="dlrm", choices=["dlrm", "dcn"], help="dense architecture")
    p.add_argument("--seed", type=int, default=0, help="seeds the model and the synthetic batches")
    p.add_argument("--json", action="store_true", help="print one JSON object only")


def _add_synth(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="write synthetic Criteo-format data with a planted, learnable signal")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--rows", type=int, required=True, help="rows in total, split evenly over the files")
    p.add_argument("--files", type=int, default=1, help="files to split the rows over")
    p.add_argument("--format", default="tsv", choices=["tsv", "tsv.gz", "parquet"],
                   help="raw Criteo logs (tsv, tsv.gz) or already-prepared parquet shards")
    p.add_argument("--spec", default="tiny", help="dataset spec: tiny, criteo_kaggle, criteo_1tb or a .yaml")
    p.add_argument("--seed", type=int, default=0, help="fixes the planted model; same arguments, same bytes")
    p.add_argument("--stream", type=int, default=0,
                   help="an independent draw from the same planted model: 0 for training, 1 for held-out data")
    p.add_argument("--interaction-groups", type=int, default=0, metavar="N",
                   help="plant pairwise interactions within N known groups of features (printed), for `recgrid "
                        "towers` to recover; 0 (default): none, and the output is what it always was")
    p.add_argument("--interaction-strength", type=float, default=1.0,
                   help="standard deviation of each group's interaction term in the logit (default 1.0)")
    p.add_argument("--max-rows-per-table", type=int, default=None, help="cap every table's rows (the id modulus)")


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="raw Criteo TSV/gz -> parquet shards, on Ray Data, resumable")
    p.add_argument("inputs", nargs="+", help="raw files, globs or directories (plain or gzip, told by content)")
    p.add_argument("--out", required=True, help="output directory; a rerun skips the shards already there")
    p.add_argument("--spec", required=True,
                   help="dataset spec the shards are prepared for: tiny, criteo_kaggle, criteo_1tb or a .yaml "
                        "(its table rows are the categorical modulus; training checks the shards against it)")
    p.add_argument("--rows-per-file", type=int, default=None, help="lines per output shard (default 1,000,000)")
    p.add_argument("--allow-bad-rows", type=float, default=0.0, metavar="FRACTION",
                   help="skip and count bad rows; fail if more than this fraction of lines is bad "
                        "(default 0: stop at the first)")
    p.add_argument("--max-rows-per-table", type=int, default=None, help="cap every table's rows (the id modulus)")


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run a 2-D sparse-parallel training job on Ray", epilog=KEYS_EPILOG)
    p.add_argument("config", help="job config YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit a training job to a running Ray cluster (Ray Job API) and follow it",
                       epilog=KEYS_EPILOG)
    p.add_argument("config", help="job config YAML, inside the current directory: the project, a git work tree whose "
                                  "tracked files are shipped with the job (untracked files never are)")
    p.add_argument("--address", default=None,
                   help="the cluster's dashboard / Job API: https://head:8265, or http:// to a loopback address "
                        "through a port-forward (default: $RAY_ADDRESS)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return instead of following its logs")


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="run the job at several group counts M (and K); one MLflow parent run, "
                                       "the paper's Table 1 relative to M=1", epilog=KEYS_EPILOG)
    p.add_argument("config", help="job config YAML (T, data, model and batch are shared by every configuration)")
    p.add_argument("--groups", "-M", required=True, metavar="M[,M...]", help="group counts to compare, e.g. 1,2,4")
    p.add_argument("--sync-every", "-K", default=None, metavar="K[,K...]",
                   help="sync intervals to compare for every M > 1 (default: the config's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")


def _add_cluster_args(p: argparse.ArgumentParser, job: bool = False) -> None:
    """The model and cluster arguments `plan` and `simulate` share (`job`: `plan`'s --config too)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--spec", help="dataset spec: tiny, criteo_kaggle, criteo_1tb (+multihot) or a spec .yaml")
    src.add_argument("--tables", help="tables YAML: tables: [{name, rows, dim, pooling}] (pooling = mean ids per sample)")
    if job:
        src.add_argument("--config", help="a job config YAML: plan for its T, workers per node, batch, device and "
                                          "model, and print the plan the job runs with model.sharding: auto")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="with --config: override a config value")
        p.add_argument("--device", default="gpu", choices=["gpu", "cpu"],
                       help="gpu: published GPU figures (default); cpu: CPU workers with gloo, measured figures "
                            "(--cpu-profile); with --config the job's train.use_gpu decides")
        p.add_argument("--cpu-profile", default=None, metavar="PATH",
                       help="a bench/calibrate_cpu.py result to price CPU workers with (default: this project's "
                            "machine as measured, or $RECGRID_CPU_PROFILE)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="G, GPUs (or CPU workers) per node (default 8)")
    p.add_argument("--batch-per-gpu", type=int, required=not job, default=None,
                   help="B, samples per GPU (or CPU worker) per step")
    p.add_argument("--hbm-gb", type=float, default=None, help="GPU memory in GB (default: the GPU's, 80)")
    p.add_argument("--gpu", default="h100-sxm", help="hardware profile of the published figures")
    p.add_argument("--intra-node-gbps", type=float, default=None, help="override NVLink bandwidth per GPU, GB/s")
    p.add_argument("--inter-node-gbps", type=float, default=None, help="override NIC bandwidth per GPU, GB/s")
    p.add_argument("--sync-every", default="1,5,25", metavar="K[,K...]",
                   help="sync intervals K to consider (default 1,5,25)")
    p.add_argument("--json", action="store_true", help="print JSON only")
    job = p.add_argument_group("the job's model settings (flags mirror the config's model.* fields, same defaults "
                               "and checks; `recgrid keys model`)")
    job.add_argument("--sharding", default=None, help="model.sharding: auto (the planner's choice per table) or one type")
    job.add_argument("--row-wise-exchange", default=None, metavar="dense|sparse",
                     help="model.row_wise_exchange: sparse prices SRP (row-wise output x occupancy 1-(1-1/W)^P)")
    job.add_argument("--compression", default=None, metavar="none|qr", help="model.compression")
    job.add_argument("--qr-threshold-rows", type=int, default=None, help="model.qr_threshold_rows")
    job.add_argument("--qr-collisions", type=int, default=None, metavar="C", help="model.qr_collisions")
    job.add_argument("--qr-operation", default=None, metavar="mult|add|concat", help="model.qr_operation")
    job.add_argument("--head-rows", type=int, default=None, metavar="H", help="model.head_rows")
    job.add_argument("--head-coverage", type=float, default=None, metavar="P",
                     help="model.head_coverage (needs --id-zipf-exponent: the planner has no id counts)")
    job.add_argument("--id-zipf-exponent", type=float, default=None, metavar="A",
                     help="the ids' power-law exponent (as recgrid synth draws them): sizes a head by coverage and "
                          "the head's share of the lookups; without it a head catches no lookups (an upper bound)")
    job.add_argument("--srp-runs", default=None, metavar="DENSE_RUN,SPARSE_RUN",
                     help="MLflow run ids of one job at one L, dense and sparse: their exchange/bytes/row_wise ratio "
                          "replaces the uniform-ids occupancy at that L")


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict step time, memory and QPS for every M dividing T; recommend M and K")
    p.add_argument("--gpus", "-T", type=int, default=None, help="T, the number of GPUs (or CPU workers)")
    _add_cluster_args(p, job=True)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="full model parallelism vs 2-D at many GPU counts: QPS, scaling, memory")
    p.add_argument("--gpus", required=True, metavar="T[,T...]", help="GPU counts, e.g. 256,512,1024,2048,4096")
    p.add_argument("--sharding-group-size", "-L", type=int, required=True, help="L, workers per 2-D sharding group")
    p.add_argument("--dmt", action="store_true",
                   help="add a Disaggregated Multi-Tower row per GPU count: the model-parallel plan with its "
                        "embedding all-to-all split into an intra-tower one (T/N GPUs) and a cross-host peer one "
                        "(N ranks); one tower per host unless --towers is given")
    p.add_argument("--towers", "-N", type=int, default=None, metavar="N",
                   help="DMT towers of whole hosts, the same N at every GPU count (must divide the number of hosts); "
                        "default with --dmt: one per host, N = T / --gpus-per-node; implies --dmt")
    p.add_argument("--tower-compression", type=float, default=None, metavar="CR",
                   help="DMT: the tower modules' compression ratio; the embeddings crossing hosts shrink by CR "
                        "(the ids do not); default 1; implies --dmt")
    _add_failure_args(p)
    _add_cluster_args(p)


def _add_failure_args(p: argparse.ArgumentParser) -> None:
    """`simulate`'s goodput term: the host failure rate and the recovery constants (plan/constants.py)."""
    g = p.add_argument_group("goodput under host failures (defaults: plan/constants.py, each with its source)")
    g.add_argument("--host-failures-per-hour", type=float, default=constants.HOST_FAILURES_PER_HOUR, metavar="RATE",
                   help="failures per host per hour (Meta's Llama 3 pre-training: 78%% of 419 interruptions in 54 "
                        f"days on 2,048 hosts of 8 H100s; default: {constants.HOST_FAILURES_PER_HOUR:.3g})")
    g.add_argument("--restart-s", type=float, default=constants.RESTART_S, metavar="S",
                   help="seconds from a failure to a restarted group's training function (measured here)")
    g.add_argument("--heal-s", type=float, default=constants.HEAL_S, metavar="S",
                   help="seconds a rebuilt group heals from a live peer, inter-host (measured here)")
    g.add_argument("--snapshot-every-s", type=float, default=constants.SNAPSHOT_EVERY_S, metavar="S",
                   help="training seconds between peer-memory snapshots (host-local)")
    g.add_argument("--snapshot-cost-s", type=float, default=constants.SNAPSHOT_COST_S, metavar="S",
                   help="seconds one snapshot adds to the steps (provisional; default: "
                        f"{constants.SNAPSHOT_COST_S:.3g})")
    g.add_argument("--checkpoint-every-s", type=float, default=constants.CHECKPOINT_EVERY_S, metavar="S",
                   help="training seconds between storage checkpoints")
    g.add_argument("--checkpoint-cost-s", type=float, default=constants.CHECKPOINT_COST_S, metavar="S",
                   help="seconds one storage checkpoint adds to the steps (measured here)")


def _add_towers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("towers", help="partition the features into towers (Disaggregated Multi-Tower) from a short "
                                      "run; writes the file model.towers reads")
    p.add_argument("--data", required=True, help="glob of training files (Criteo TSV, .gz or parquet)")
    p.add_argument("--spec", default="tiny", help="dataset spec: tiny, criteo_kaggle, criteo_1tb or a .yaml")
    p.add_argument("--towers", "-N", type=int, required=True, help="N, towers per sharding group")
    p.add_argument("--strategy", default="coherent", choices=["coherent", "diverse"],
                   help="coherent: strongly interacting features share a tower; diverse: they are spread out")
    p.add_argument("--out", required=True, help="the partition file to write (JSON)")
    p.add_argument("--steps", type=int, default=400, help="steps of the short run (default 400)")
    p.add_argument("--batch-size", type=int, default=256, help="per-worker batch size of the short run")
    p.add_argument("--samples", type=int, default=4096, help="samples whose pooled embeddings are compared")
    p.add_argument("--checkpoint", default=None, help="a storage checkpoint to read the embeddings from instead")
    p.add_argument("--embedding-dim", type=int, default=None, help="default: the spec's")
    p.add_argument("--dims", type=int, default=8, help="dimensions of the fitted coordinates (default 8; 4 was fragile on the planted data)")
    p.add_argument("--balance", type=float, default=1.5, help="largest tower <= balance x smallest (default 1.5)")
    p.add_argument("--seed", type=int, default=0, help="seeds the short run and the partitioner")
    p.add_argument("--quiet", action="store_true", help="print only the partition, no progress")


# what `recgrid export` and `recgrid eval` trust in what they read (launch/model.py)
READ_AS_DATA = ("A model is read as data: its weights with torch's weights-only loader, its architecture as JSON, "
                "the model built by recgrid's own code; nothing in it is imported, unpickled or run, and a "
                "model holding anything else (a pickle, a pickle_module_info.txt, a code module) is refused, "
                "naming the file. A storage checkpoint is read with the checkpoint reader that admits only DCP's "
                "metadata and tensors.")


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a job's model, unsharded, as an MLflow model directory (from a storage "
                                      "checkpoint or a run)",
                       description="Write a job's model as a fresh MLflow model directory (0700, files 0600) "
                                   "that `mlflow models serve` serves without recgrid. " + READ_AS_DATA)
    p.add_argument("source", metavar="CHECKPOINT_OR_RUN", help="a storage checkpoint directory, a run id (its logged "
                                                               "model), an MLflow model URI or a model directory")
    p.add_argument("--out", required=True, help="the directory to write (new or empty)")
    p.add_argument("--config", default=None, help="a checkpoint's job config YAML (its spec, model and compression)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI for a run id or URI (default: as `train`)")


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="NE, AUC and rows of a logged model or a checkpoint on data files",
                       description="NE, AUC and rows of a model on every row of the data files. " + READ_AS_DATA)
    p.add_argument("model", metavar="MODEL_URI_OR_CHECKPOINT",
                   help="an MLflow model URI (models:/ID, runs:/RUN/model), a model directory, a run id, or a "
                        "storage checkpoint (with --config)")
    p.add_argument("--data", required=True, action="append", metavar="GLOB", help="data files (repeatable)")
    p.add_argument("--config", default=None, help="a checkpoint's job config YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: as `train`)")
    p.add_argument("--json", action="store_true", help="print one JSON object: ne, auc, rows")
    p.add_argument("--predictions", default=None, metavar="FILE",
                   help="also write each row's click probability to FILE, one a line, the files' rows in order")


def _add_keys(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="list the job config's keys with their defaults and docs")
    p.add_argument("section", nargs="?", default=None, help="only this section (grid, model, data, train, optim, tracking)")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("recgrid")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recgrid", description=DESCRIPTION, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"recgrid {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_layout, _add_smoke, _add_synth, _add_prepare, _add_train, _add_submit, _add_compare, _add_plan,
                _add_simulate, _add_towers, _add_export, _add_eval, _add_keys):
        add(sub)
    for p in sub.choices.values():
        p.formatter_class = _HelpFormatter
    return parser


def run_keys(args: argparse.Namespace) -> int:
    if args.section is not None and args.section not in SECTIONS:
        print(f"recgrid keys: unknown section {args.section!r}; sections: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    defaults = field_defaults()
    for key, doc in field_docs().items():
        if args.section is None or key.startswith(args.section + "."):
            print(f"{key} = {json.dumps(defaults[key])}\n    {doc}")
    return 0


def run_layout(args: argparse.Namespace) -> int:
    try:
        grid = Grid(
            world_size=args.world_size,
            num_groups=args.groups,
            layout="inter-host" if args.inter_host else "host-local",
            workers_per_node=args.workers_per_node,
        )
    except GridError as e:
        print(f"recgrid layout: {e}", file=sys.stderr)
        return 2
    out = {"sharding_groups": grid.sharding_groups, "replica_groups": grid.replica_groups}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"T={grid.world_size} M={grid.num_groups} L={grid.group_size} layout={grid.layout}")
        for i, g in enumerate(out["sharding_groups"]):
            print(f"  sharding group {i}: {g}")
        for j, g in enumerate(out["replica_groups"]):
            print(f"  replica group  {j}: {g}")
    return 0


def run_verb(args: argparse.Namespace) -> int | None:
    """Runs the verb `args.command` in the module that owns it."""
    match args.command:
        case "layout":
            return run_layout(args)
        case "keys":
            return run_keys(args)
        case "submit":
            return submit.run_cli(args)
        case "plan":
            return plan_cli.run_cli(args)
        case "simulate":
            return simulate.run_cli(args)
        case "synth" | "prepare":
            # cold start: pyarrow and the data pipeline add 0.1 s that `recgrid --help` need not wait for
            from recgrid.data import prepare, synth
            return (synth if args.command == "synth" else prepare).run_cli(args)
        case "smoke" | "towers":
            # cold start: local runs of the trainer import torch and TorchRec (seconds; `--help` must not)
            from recgrid.launch import smoke, towers
            return (smoke if args.command == "smoke" else towers).run_cli(args)
        case "train" | "compare":
            # cold start: the Ray launcher imports torch, TorchRec, MLflow and the trainer (seconds)
            from recgrid.launch import compare, ray
            return (ray if args.command == "train" else compare).run_cli(args)
        case "export" | "eval":
            # cold start: reading a model imports torch, TorchRec and MLflow (seconds; `--help` must not)
            from recgrid.launch import model
            return model.run_export(args) if args.command == "export" else model.run_eval(args)
    raise AssertionError(f"no verb {args.command!r}")  # argparse refuses an unknown one first


EXIT_BROKEN_PIPE = 128 + 13  # the shell's code for a command ended by SIGPIPE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not sys.stdout.isatty():
        # Ray's log deduplicator colours its "[repeated Nx across cluster]" suffix whatever the
        # output (RAY_COLOR_PREFIX=0 does not reach it), and reads its switch once, when Ray is
        # imported: before that, here. What Ray prints then comes without colour codes, each line whole.
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        return int(run_verb(args) or 0)
    except BrokenPipeError:
        # the reader of stdout left early (`recgrid keys | head`): stop quietly, as a shell tool
        # does, and give the interpreter's last flush somewhere to go instead of another traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
