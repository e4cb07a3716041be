"""What a benchmark ran on: machine, Python and the pinned stack's versions, for its JSON."""

from __future__ import annotations

import json
import os
import platform as _platform  # the stdlib module (the repo's platform/ folder is not a package)
import socket
from datetime import datetime, timezone
from pathlib import Path

from recgrid.tracking import stack_versions


def machine_info() -> dict:
    info = {
        "hostname": socket.gethostname(),
        "platform": _platform.platform(),
        "processor": _platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": _platform.python_version(),
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": stack_versions(),  # python, torch, torchrec, fbgemm_gpu, ray, mlflow
    }
    try:
        from recgrid.engine.device import accelerator_names

        info["cuda_devices"] = accelerator_names()
    except Exception:  # noqa: BLE001 - benchmarks must still write their JSON
        info["cuda_devices"] = []
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


# ---- a job's progress and summary ---------------------------------------------------------------------
# what the summary table shows, in order: (metric, label, format)
SUMMARY = (
    ("eval/ne", "eval NE", "{:.4f}"),
    ("eval/auc", "eval AUC", "{:.4f}"),
    ("train/ne", "train NE (window)", "{:.4f}"),
    ("train/loss", "train loss", "{:.4f}"),
    ("train/qps_median", "QPS (global, median of intervals)", "{:,.0f}"),
    ("train/step_time_s_median", "step time s (median of intervals)", "{:.4f}"),
    ("memory/peak_mb_max", "peak memory MiB (max worker)", "{:,.0f}"),
    ("memory/peak_mb_mean", "peak memory MiB (mean)", "{:,.0f}"),
    ("imbalance/lookup_max_over_mean_median", "lookup imbalance max/mean (median)", "{:.3f}"),
    ("sync/count", "replica syncs", "{:.0f}"),
    ("sync/seconds_total", "replica sync s (total)", "{:.3f}"),
    ("train/examples_total", "examples trained", "{:,.0f}"),
    ("grid/num_groups", "sharding groups at the end", "{:.0f}"),
    ("recovery/count", "recoveries", "{:.0f}"),
)


def say(msg: str) -> None:
    print(f"[recgrid] {msg}", flush=True)


def summary_table(heading: list[tuple[str, str]], metrics: dict[str, float], events: list[dict],
                  ui_command: str) -> str:
    """The driver's end-of-job table: `heading` rows, the SUMMARY metrics the run has, and one
    line per recovery event."""
    rows = list(heading)
    rows += [(label, fmt.format(metrics[key])) for key, label, fmt in SUMMARY if key in metrics]
    for n, e in enumerate(events, 1):
        lost = e.get("steps_lost")
        secs = e.get("seconds")
        rows.append((f"recovery {n}", f"{e['source']} at step {e['step']}"
                     + (f", {lost} steps lost" if lost is not None else "")
                     + (f", {secs:.1f} s" if secs is not None else "")
                     + f", T={e['world_size']} M={e['num_groups']}"
                     + (f" ({e['detail']})" if e.get("detail") else "")))
    width = max(len(k) for k, _ in rows)
    lines = ["", "recgrid job summary", "-" * (width + 40)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["-" * (width + 40), f"open the MLflow UI on these runs:  {ui_command}", ""]
    return "\n".join(lines)


def write_result(path: str | Path, result: dict) -> Path:
    """Write a benchmark's JSON (indented) to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path
