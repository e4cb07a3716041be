"""The `recgrid` command line. Parses arguments and hands each command to the module that owns it.

Heavy imports (torch, ray, mlflow) happen inside the command that needs them, so `recgrid
layout` and `recgrid --help` answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys


def _add_layout(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("layout", help="print the sharding and replica groups of a grid")
    p.add_argument("--world-size", "-T", type=int, required=True, help="T, number of workers")
    p.add_argument("--groups", "-M", type=int, required=True, help="M, number of sharding groups")
    p.add_argument("--inter-host", action="store_true", help="use the inter-host sync layout")
    p.add_argument("--workers-per-node", type=int, default=None, help="check the layout against N workers per node")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.set_defaults(handler="recgrid.cli:run_layout")


def _add_smoke(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("smoke", help="train the tiny model on T local gloo processes and check the 2-D sync")
    p.add_argument("--world-size", "-T", type=int, default=4)
    p.add_argument("--groups", "-M", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sync-every", "-K", type=int, default=5)
    p.add_argument("--sharding", default="table_wise",
                   help="table_wise, column_wise, row_wise, table_row_wise, grid_shard or auto (planner's choice)")
    p.add_argument("--inter-host", action="store_true")
    p.add_argument("--batch-size", type=int, default=64, help="per-worker batch size")
    p.add_argument("--moment-scale", type=float, default=None, help="c; default M")
    p.add_argument("--delayed-moment-sync", action="store_true")
    p.add_argument("--model", default="dlrm", choices=["dlrm", "dcn"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.set_defaults(handler="recgrid.smoke:run_cli")


def _add_synth(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="write synthetic Criteo-format data with a planted, learnable signal")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--rows", type=int, required=True, help="rows in total, split evenly over the files")
    p.add_argument("--files", type=int, default=1)
    p.add_argument("--format", default="tsv", choices=["tsv", "tsv.gz", "parquet"],
                   help="raw Criteo logs (tsv, tsv.gz) or already-prepared parquet shards")
    p.add_argument("--spec", default="tiny", help="dataset spec: tiny, criteo_kaggle, criteo_1tb or a .yaml")
    p.add_argument("--seed", type=int, default=0, help="fixes the planted model; same arguments, same bytes")
    p.add_argument("--stream", type=int, default=0,
                   help="an independent draw from the same planted model: 0 for training, 1 for held-out data")
    p.add_argument("--max-rows-per-table", type=int, default=None, help="cap every table's rows (the id modulus)")
    p.set_defaults(handler="recgrid.synth:run_cli")


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="raw Criteo TSV/gz -> parquet shards, on Ray Data, resumable")
    p.add_argument("inputs", nargs="+", help="raw files, globs or directories (plain or gzip, told by content)")
    p.add_argument("--out", required=True, help="output directory; a rerun skips the shards already there")
    p.add_argument("--spec", default="tiny", help="dataset spec: tiny, criteo_kaggle, criteo_1tb or a .yaml")
    p.add_argument("--rows-per-file", type=int, default=None, help="lines per output shard (default 1,000,000)")
    p.add_argument("--allow-bad-rows", type=float, default=0.0, metavar="FRACTION",
                   help="skip and count bad rows; fail if more than this fraction of lines is bad "
                        "(default 0: stop at the first)")
    p.add_argument("--max-rows-per-table", type=int, default=None, help="cap every table's rows (the id modulus)")
    p.set_defaults(handler="recgrid.prepare:run_cli")


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run a 2-D sparse-parallel training job on Ray")
    p.add_argument("config", help="job config YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.set_defaults(handler="recgrid.launcher:run_cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recgrid", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_layout, _add_smoke, _add_synth, _add_prepare, _add_train):
        add(sub)
    return parser


def run_layout(args: argparse.Namespace) -> int:
    from recgrid.grid import Grid, GridError

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, func_name = args.handler.split(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
