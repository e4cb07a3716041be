"""What a recgrid process prints: libraries kept quiet, and the progress line of a training job.

Below `train/` and `launch/` (both use it): the Ray Train workers, the local gloo launcher and
the driver keep their output to recgrid's own lines.
"""

from __future__ import annotations

import contextlib
import logging
import os

from recgrid.engine.quiet import LIBRARIES, quiet
from recgrid.engine.quiet import libraries_quiet as quiet_for_a_while


def quiet_libraries() -> None:
    """Keep a worker's output to what recgrid says: TorchRec and torch warn at every sharding."""
    # FBGEMM logs each kernel's whole configuration at INFO through the root logger, and Ray
    # Train logs every report at INFO: keep what a worker says to warnings and recgrid's lines
    quiet(dict.fromkeys(LIBRARIES, logging.ERROR) | {"": logging.WARNING, "ray.train": logging.WARNING})


def libraries_quiet() -> contextlib.AbstractContextManager[None]:
    """`quiet_libraries` for a while, in a process that goes on (the driver unsharding and logging a
    model): their warnings and their loggers' notes below ERROR, restored afterwards; and no MLflow
    artifact progress bar (a line per file, redrawn), unless the user's environment asks for one."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return quiet_for_a_while(LIBRARIES + ("torch.fx._symbolic_trace", "mlflow"))


def progress_line(m: dict[str, float], step: int, max_steps: int, elapsed: float) -> str:
    """One line per logging interval (training) or per evaluation."""
    if "eval/ne" in m:
        parts = [f"[recgrid] eval at step {step}/{max_steps}"]
        fields = (("eval/ne", "NE", "{:.4f}"), ("eval/auc", "AUC", "{:.4f}"), ("eval/examples", "rows", "{:,.0f}"))
    else:
        parts = [f"[recgrid] step {step:>6}/{max_steps}"]
        fields = (("train/qps", "qps", "{:,.0f}"), ("train/loss", "loss", "{:.4f}"), ("train/ne", "ne", "{:.4f}"),
                  ("memory/peak_mb_max", "mem MiB", "{:,.0f}"), ("sync/seconds_total", "sync s", "{:.2f}"))
    for key, label, fmt in fields:
        if key in m:
            parts.append(f"{label} {fmt.format(m[key])}")
    parts.append(f"{elapsed:,.0f}s")
    return " | ".join(parts)
