"""`recgrid compare CONFIG --groups 1,2,4 [--sync-every 1,5] [--set key=value ...]`: the group-count
comparison (the 2D paper's Table 1) as one command.

This module owns the sweep and its table. Every configuration is the same job (same T, so the same
global batch, the same data, seed and model) with only M (`grid.num_groups`) and K
(`grid.sync_every`) changed; all of them are validated before the first one starts, and a value
that cannot work is refused naming it. `M = 1` has no replica groups, so K does not apply to it:
it runs once, as the baseline of every K.

One parent MLflow run holds the sweep; each configuration is a child run (`mlflow.parentRunId`),
the same run `recgrid train` makes. The table compares, per configuration: QPS (median over
logging intervals), peak and mean worker memory, lookup imbalance (median over intervals), the
replica-sync share of step time (sync seconds / wall seconds over the run), eval NE and AUC, each
also relative to M = 1 (percent change; the sync share in percentage points), and what each
configuration ran: the sharding types of its recorded plan by count (with `model.sharding: auto`
every M runs its planner's plan, `plan.planner`: the search `recgrid plan` runs, priced for the
device, so the M = 1 baseline is planned as well as the rest). Without M = 1 in
the sweep, the smallest M is the reference and the table says so. Each change is marked better or
worse (QPS and AUC: higher is better; memory, imbalance, sync share and NE: lower), and a caveat
under the table says how short and how few the runs were (one seed each: quality differences this
small are within run-to-run noise). The table is printed and stored on the parent run as
`compare/table.csv`, `compare/table.md` and `compare/chart.png` (every axis starts at zero).

While the sweep runs, each configuration prints one line when it starts and one when it ends (its
own summary table is not printed). A configuration that fails for its own reasons (it needs more
memory than a worker has, a layout its M cannot take) is recorded and the sweep goes on; any other
failure (the cluster, the data, the environment) stops the sweep there, since the next
configuration would meet it too.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from recgrid.config import ConfigError, JobConfig, load_config
from recgrid.launch.ray import run_job
from recgrid.launch.report import say
from recgrid.plan.report import mix_text
from recgrid.tracking import Tracker

# the table's columns: (row key, header, format, how it is compared with the reference: "pct" =
# percent change, "pp" = difference in percentage points)
COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    ("qps", "QPS", "{:,.0f}", "pct"),
    ("peak_memory_mib", "peak memory MiB", "{:,.0f}", "pct"),
    ("mean_memory_mib", "mean memory MiB", "{:,.0f}", "pct"),
    ("lookup_imbalance", "lookup imbalance", "{:.3f}", "pct"),
    ("sync_share", "replica-sync share", "{:.1%}", "pp"),
    ("eval_ne", "eval NE", "{:.4f}", "pct"),
    ("eval_auc", "eval AUC", "{:.4f}", "pct"),
)
# which way is better, per column: +1 higher, -1 lower
BETTER: dict[str, int] = {"qps": 1, "peak_memory_mib": -1, "mean_memory_mib": -1, "lookup_imbalance": -1,
                          "sync_share": -1, "eval_ne": -1, "eval_auc": 1}
# errors that belong to one configuration (the sweep goes on past them); any other stops it
CONFIGURATION_FAULTS = ("ConfigError", "GridError", "TowerError", "OutOfMemoryError", "MemoryError")
ARTIFACT_DIR = "compare"


class CompareError(Exception):
    """A sweep that cannot run; the message names the value."""


@dataclass
class Variant:
    num_groups: int
    sync_every: int
    config: JobConfig

    @property
    def label(self) -> str:
        return f"M={self.num_groups}" if self.num_groups == 1 else f"M={self.num_groups} K={self.sync_every}"


@dataclass
class CompareResult:
    parent_run_id: str
    status: str  # FINISHED, or FAILED when a configuration failed
    rows: list[dict[str, Any]] = field(default_factory=list)
    reference: str = ""
    markdown: str = ""
    seconds: float = 0.0


def run_cli(args: argparse.Namespace) -> int:
    try:
        groups = parse_list("--groups", args.groups)
        syncs = parse_list("--sync-every", args.sync_every) if args.sync_every else None
        variants = plan_sweep(args.config, groups, syncs, args.set)
    except CompareError as e:
        print(f"recgrid compare: {e}", file=sys.stderr)
        return 2
    except (ConfigError, FileNotFoundError) as e:
        print(f"recgrid compare: invalid job config: {e}", file=sys.stderr)
        return 2
    result = run_compare(variants, args.config)
    return 0 if result.status == "FINISHED" else 1


# ---- the sweep --------------------------------------------------------------------------------------
def parse_list(flag: str, text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]; anything else is refused naming the value."""
    values = []
    for item in str(text).split(","):
        item = item.strip()
        try:
            value = int(item)
        except ValueError:
            raise CompareError(f"{flag} {item!r}: not an integer (give a comma-separated list, e.g. 1,2,4)") from None
        if value in values:
            raise CompareError(f"{flag} {value}: given twice")
        values.append(value)
    if not values:
        raise CompareError(f"{flag}: no values")
    return values


def plan_sweep(config_path: str | Path, groups: Sequence[int], sync_every: Sequence[int] | None,
               overrides: Sequence[str] = ()) -> list[Variant]:
    """Every configuration of the sweep, validated now: M over `groups` x K over `sync_every` (the
    config's K when None), T and everything else as the config says. M = 1 runs once."""
    base = load_config(config_path, overrides)
    syncs = list(sync_every) if sync_every else [base.grid.sync_every]
    variants = []
    for m in groups:
        for k in (syncs[:1] if m == 1 else syncs):
            flag = f"--groups {m}" if len(syncs) == 1 or m == 1 else f"--groups {m} --sync-every {k}"
            try:
                # children take the default name T<T>-M<M>-K<K>; a run_name given names the parent
                cfg = load_config(config_path, [*overrides, f"grid.num_groups={m}", f"grid.sync_every={k}",
                                                "tracking.run_name=null"])
            except ConfigError as e:
                raise CompareError(f"{flag}: {e}") from None
            variants.append(Variant(m, k, cfg))
    return variants


def run_compare(variants: list[Variant], config_path: str | Path = "") -> CompareResult:
    """Run the configurations one after another on one Ray cluster, each as a child run of one
    parent run; print and store the table. Returns the parent run and the table's rows."""
    t0 = time.perf_counter()
    base = variants[0].config
    T = base.grid.world_size
    groups = sorted({v.num_groups for v in variants})
    syncs = sorted({v.sync_every for v in variants if v.num_groups > 1}) or [variants[0].sync_every]
    name = base.tracking.run_name or f"compare-T{T}-M{','.join(map(str, groups))}-K{','.join(map(str, syncs))}"
    swept = {"grid.num_groups", "grid.sync_every", "optim.moment_scale", "tracking.run_name"}
    params = {k: v for k, v in base.to_flat_dict().items() if k not in swept}
    params.update({"compare.groups": ",".join(map(str, groups)), "compare.sync_every": ",".join(map(str, syncs)),
                   "compare.config": str(config_path), "derived.global_batch": T * base.train.batch_size})
    tracker = Tracker(base.tracking.experiment, base.tracking.tracking_uri)
    tracker.start(name, params=params, tags={"recgrid.kind": "compare", "launcher": "ray"})
    say(f"compare: {len(variants)} configurations ({', '.join(v.label for v in variants)}) at T={T}, global batch "
        f"{T * base.train.batch_size}, {base.train.max_steps} steps each; parent MLflow run {tracker.run_id} "
        f"({name}) in experiment {base.tracking.experiment!r}")
    if len(syncs) > 1 and 1 in groups:
        say("compare: M=1 has no replica groups to sync, so K does not apply: it runs once, the reference of every K")
    results = []
    with tracker:  # an exception (or Ctrl-C) ends the parent run FAILED (KILLED) and propagates
        for i, v in enumerate(variants, 1):
            g = v.config.build_grid()
            say(f"compare {i}/{len(variants)}: {v.label} (T={T} M={g.num_groups} L={g.group_size} "
                f"K={v.sync_every}) starting")
            result = run_job(v.config, parent_run_id=tracker.run_id, summary=False)
            if (result.error or "").startswith("KeyboardInterrupt"):  # run_job records Ctrl-C as a failure
                raise KeyboardInterrupt
            results.append(result)
            m = result.metrics
            say(f"compare {i}/{len(variants)}: {v.label} {result.status} in {result.seconds:,.0f} s"
                + (f": QPS {m['train/qps_median']:,.0f}" if "train/qps_median" in m else "")
                + (f", eval NE {m['eval/ne']:.4f}" if "eval/ne" in m else "")
                + (f" ({result.error})" if result.error else ""))
            if result.status != "FINISHED" and not is_configuration_fault(result.error):
                left = len(variants) - i
                say(f"compare: stopping after {v.label}: its failure is not the configuration's own "
                    f"({result.error}); the {left} configuration(s) after it would meet it too. Fix it and run again.")
                break
        ran = variants[:len(results)]
        rows = [table_row(v, r, tracker.client) for v, r in zip(ran, results)]
        reference = reference_row(rows)
        add_relative(rows, reference)
        markdown = markdown_table(rows, reference, reference_note(rows, reference) + "\n" + caveat(base, rows))
        store_artifacts(tracker, rows, reference, markdown, title=f"{base.tracking.experiment}: T={T}, global batch "
                        f"{T * base.train.batch_size}, {base.train.max_steps} steps")
        failed = [r for r in rows if r["status"] != "FINISHED"]
        if failed:  # the parent ends FAILED too, naming them
            skipped = len(variants) - len(rows)
            tracker.fail(f"{len(failed)} of {len(rows)} configurations run failed"
                         + (f" (the sweep stopped; {skipped} not run)" if skipped else "") + ": "
                         + "; ".join(f"{r['config']}: {r['error']}" for r in failed))
    seconds = time.perf_counter() - t0
    print("\n" + f"recgrid compare: {name} ({tracker.run_id}), {seconds:,.0f} s\n\n{markdown}", flush=True)
    local = not tracker.tracking_uri.startswith(("http://", "https://"))
    children = [r["run_id"] for r in rows if r["run_id"]]
    print(("open the MLflow UI:  " + tracker.ui_command() + "\n  and then " if local else "in the MLflow UI, open ")
          + f"{tracker.ui_url(f'artifacts/{ARTIFACT_DIR}/chart.png')}\n  for the chart and tables, and\n  "
          f"{tracker.compare_url(children)}\n  for the {len(children)} child runs' params and metrics side by side\n",
          flush=True)
    return CompareResult(tracker.run_id, "FAILED" if failed else "FINISHED", rows, reference["config"], markdown,
                         seconds)


# ---- the table --------------------------------------------------------------------------------------
def table_row(variant: Variant, result: Any, client: Any) -> dict[str, Any]:
    """One configuration's figures from its run (medians and sums over the logging intervals)."""
    g = variant.config.build_grid()
    m = result.metrics

    def history(key: str) -> list[float]:
        if not result.run_id:
            return []
        return [x.value for x in sorted(client.get_metric_history(result.run_id, key), key=lambda x: x.step)]

    sync_s, wall_s = history("time/sync_s"), history("time/interval_s")
    return {
        "config": variant.label, "run_id": result.run_id, "status": result.status, "error": result.error or "",
        "T": g.world_size, "M": g.num_groups, "L": g.group_size, "K": variant.sync_every,
        "qps": m.get("train/qps_median"),
        "peak_memory_mib": m.get("memory/peak_mb_max"),
        "mean_memory_mib": m.get("memory/peak_mb_mean"),
        "lookup_imbalance": m.get("imbalance/lookup_max_over_mean_median"),  # the summary's statistic
        "sync_share": (sum(sync_s) / sum(wall_s)) if wall_s and sum(wall_s) > 0 else None,
        "eval_ne": m.get("eval/ne"),
        "eval_auc": m.get("eval/auc"),
        "sharding": ran_sharding(client, result.run_id),
        "seconds": result.seconds,
    }


def ran_sharding(client: Any, run_id: str | None) -> str:
    """What a configuration ran: its recorded plan's (`sharding_plan.json`) sharding types by count,
    e.g. "table_wise 26"; "" when the run recorded none."""
    from mlflow.exceptions import MlflowException

    if not run_id:
        return ""
    with tempfile.TemporaryDirectory(prefix="recgrid-compare-") as tmp:
        try:
            record = json.loads(Path(client.download_artifacts(run_id, "sharding_plan.json", tmp)).read_text())
        except (MlflowException, OSError, ValueError):  # none recorded (a run that failed before planning)
            return ""
    return mix_text({table: r["sharding_type"] for table, r in record.items()})


def is_configuration_fault(error: str | None) -> bool:
    """Whether a configuration's error (JobResult.error, "Type: message") is its own: the sweep
    goes on past those and stops at any other."""
    return (error or "").split(":", 1)[0].strip() in CONFIGURATION_FAULTS


def caveat(config: JobConfig, rows: list[dict[str, Any]]) -> str:
    """What the table cannot show: every configuration ran once, with one seed, for max_steps."""
    steps = config.train.max_steps
    examples = steps * config.train.batch_size * config.grid.world_size
    return (f"Caveat: each configuration ran once (train.seed={config.train.seed}) for {steps:,} steps "
            f"({examples:,} examples); NE and AUC differences of a few percent at this length are within "
            f"run-to-run noise: repeat with other seeds (--set train.seed=N) and longer runs before concluding.")


def reference_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The M = 1 row, else the smallest M's first row."""
    return min(rows, key=lambda r: r["M"])


def reference_note(rows: list[dict[str, Any]], reference: dict[str, Any]) -> str:
    if reference["M"] == 1:
        return "relative to M=1 (TorchRec's full model parallelism): percent change; the sync share in percentage points"
    return (f"M=1 is not in the sweep, so the columns are relative to {reference['config']}; for the paper's "
            f"baseline (full model parallelism) add 1 to --groups")


def add_relative(rows: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """`<key>_rel` on every row: percent change against the reference (percentage points for the
    sync share); None where either value is missing."""
    for row in rows:
        for key, _, _, kind in COLUMNS:
            v, b = row[key], reference[key]
            if v is None or b is None:
                row[f"{key}_rel"] = None
            elif kind == "pp":
                row[f"{key}_rel"] = (v - b) * 100
            else:
                row[f"{key}_rel"] = (v / b - 1) * 100 if b else None


def _cell(row: dict[str, Any], key: str, fmt: str, kind: str, is_reference: bool) -> str:
    v, rel = row[key], row.get(f"{key}_rel")
    if v is None:
        return "n/a"
    text = fmt.format(v)
    if is_reference:
        return f"{text} (ref)"
    if rel is None:
        return text
    change = f"{rel:+.1f} pp" if kind == "pp" else f"{rel:+.2f}%"
    return f"{text} ({change}{verdict(key, rel)})"


def verdict(key: str, rel: float) -> str:
    """', better' or ', worse' for a change of `rel` in column `key` ('' for no change)."""
    if rel == 0:
        return ""
    return ", better" if (rel > 0) == (BETTER[key] > 0) else ", worse"


def markdown_table(rows: list[dict[str, Any]], reference: dict[str, Any], note: str) -> str:
    """The table as Markdown (padded, so it reads in a terminal too), each value with its change
    against the reference in brackets, and the note under it."""
    header = ["config", "L", "status", "sharding"] + [h for _, h, _, _ in COLUMNS]
    body = [[r["config"], str(r["L"]), r["status"], r.get("sharding") or "n/a"]
            + [_cell(r, k, f, kind, r is reference) for k, _, f, kind in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)]
    return "\n".join(out) + f"\n\n{note}\n"


def csv_table(rows: list[dict[str, Any]], reference: dict[str, Any]) -> str:
    keys = ["config", "run_id", "status", "T", "M", "L", "K"]
    for key, _, _, kind in COLUMNS:
        keys += [key, f"{key}_rel_{'pp' if kind == 'pp' else 'pct'}"]
    keys += ["sharding", "reference", "seconds"]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        record = {k: r.get(k) for k in keys}
        for key, _, _, kind in COLUMNS:
            record[f"{key}_rel_{'pp' if kind == 'pp' else 'pct'}"] = r.get(f"{key}_rel")
        record["reference"] = reference["config"]
        writer.writerow({k: ("" if v is None else v) for k, v in record.items()})
    return out.getvalue()


def chart(rows: list[dict[str, Any]], reference: dict[str, Any], path: Path, title: str) -> None:
    """One bar chart per column, a bar per configuration (the reference's bar darker), each bar
    labelled with its change against the reference."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 4).flatten()
    labels = [r["config"] for r in rows]
    for ax, (key, header, fmt, kind) in zip(axes, COLUMNS):
        values = [r[key] if r[key] is not None else 0.0 for r in rows]
        scale = 100.0 if key == "sync_share" else 1.0
        bars = ax.bar(labels, [v * scale for v in values],
                      color=["#2b5d8a" if r is reference else "#7fa7cc" for r in rows])
        for bar, r in zip(bars, rows):
            rel = r.get(f"{key}_rel")
            text = "ref" if r is reference else ("n/a" if rel is None else
                                                (f"{rel:+.1f} pp" if kind == "pp" else f"{rel:+.1f}%"))
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
        better = "higher" if BETTER[key] > 0 else "lower"
        ax.set_title(header + (" %" if key == "sync_share" else "") + f" ({better} is better)", fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(y=0.15)
        ax.set_ylim(bottom=0)  # every axis starts at zero: a bar's height is its value, the label its change
    axes[-1].axis("off")
    axes[-1].text(0, 0.5, textwrap.fill(reference_note(rows, reference), 42), fontsize=9, va="center")
    fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=100)


def store_artifacts(tracker: Any, rows: list[dict[str, Any]], reference: dict[str, Any], markdown: str,
                    title: str) -> None:
    """compare/table.csv, compare/table.md and compare/chart.png on the parent run."""
    tracker.log_text(csv_table(rows, reference), f"{ARTIFACT_DIR}/table.csv")
    tracker.log_text(markdown, f"{ARTIFACT_DIR}/table.md")
    with tempfile.TemporaryDirectory(prefix="recgrid-compare-") as tmp:
        png = Path(tmp) / "chart.png"
        chart(rows, reference, png, title)
        tracker.client.log_artifact(tracker.run_id, str(png), ARTIFACT_DIR)
