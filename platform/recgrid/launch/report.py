"""What a benchmark ran on: machine, Python and the pinned stack's versions, for its JSON."""

from __future__ import annotations

import json
import os
import platform as _platform  # the stdlib module (the repo's platform/ folder is not a package)
import socket
from datetime import datetime, timezone
from pathlib import Path

from recgrid.engine.device import accelerator_names
from recgrid.tracking import redact_uri, stack_versions


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
# what the summary table shows, in order: (label, ((metric, format), ...)); related metrics share a row
SUMMARY = (
    ("eval NE | AUC", (("eval/ne", "{:.4f}"), ("eval/auc", "{:.4f}"))),
    ("train NE (window) | loss", (("train/ne", "{:.4f}"), ("train/loss", "{:.4f}"))),
    ("QPS | step time s (medians)", (("train/qps_median", "{:,.0f}"), ("train/step_time_s_median", "{:.4f}"))),
    ("peak memory MiB (max | mean)", (("memory/peak_mb_max", "{:,.0f}"), ("memory/peak_mb_mean", "{:,.0f}"))),
    ("lookup imbalance (median max/mean)", (("imbalance/lookup_max_over_mean_median", "{:.3f}"),)),
    ("replica syncs | seconds", (("sync/count", "{:.0f}"), ("sync/seconds_total", "{:.3f}"))),
    ("examples trained", (("train/examples_total", "{:,.0f}"),)),
    ("sharding groups at the end", (("grid/num_groups", "{:.0f}"),)),
    ("recoveries", (("recovery/count", "{:.0f}"),)),
)


def say(msg: str) -> None:
    print(f"[recgrid] {redact_uri(msg)}", flush=True)  # a URI's credentials and query tokens masked


def summary_table(heading: list[tuple[str, str]], metrics: dict[str, float], events: list[dict],
                  skip: tuple[str, ...] = ()) -> str:
    """The driver's end-of-job table: `heading` rows, the SUMMARY metrics the run has (a row whose
    first metric is in `skip` is left out: nothing to say), and one line per recovery event. (How
    to open the run in MLflow is printed once, as the job starts.)"""
    rows = list(heading)
    for label, fields in SUMMARY:
        values = [fmt.format(metrics[key]) for key, fmt in fields if key in metrics]
        if values and fields[0][0] not in skip:
            rows.append((label, " | ".join(values)))
    for n, e in enumerate(events, 1):
        lost = e.get("steps_lost")
        secs = e.get("seconds")
        rows.append((f"recovery {n}", f"{e['source']} at step {e['step']}"
                     + (f", {lost} steps lost" if lost is not None else "")
                     + (f", {secs:.1f} s" if secs is not None else "")
                     + f", T={e['world_size']} M={e['num_groups']}"
                     + (f" ({e['detail']})" if e.get("detail") else "")))
    width = max(len(k) for k, _ in rows)
    title = " recgrid job summary "
    lines = [f"{'-' * 3}{title}{'-' * (width + 37 - len(title))}"]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["-" * (width + 40)]
    return "\n".join(lines)


def write_result(path: str | Path, result: dict) -> Path:
    """Write a benchmark's JSON (indented) to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path
