"""Joining Ray, or starting recgrid's own local Ray cluster: the one place every command
(`train`, `compare`, `prepare`) connects from.

With `$RAY_ADDRESS` set the command joins that cluster and passes no resources (a cluster that
exists decides its own). Without it the command always starts a local cluster of its own
(`address="local"`), sized for the work, and says so: Ray's default would instead join the
cluster named in its temp directory's `ray_current_cluster` file, which outlives a local
cluster that died (then `ray.init` fails with "When connecting to an existing cluster, num_cpus
and num_gpus must not be provided") and which names a live `ray start` cluster whose resources a
local job must not assume.

Ray's own driver-side logging is kept to errors (`logging_level`, unless the caller passes one):
its WARNINGs are about Ray's defaults, not about the user's job; without a terminal, what Ray
still prints on the driver comes without colour codes (`RAY_COLOR_PREFIX=0`). A local cluster
runs with `LOCAL_SYSTEM_CONFIG` (why: its comment).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable


# Ray's system config for a local cluster recgrid starts (Ray's defaults: an idle time of 1000 ms,
# and as many worker processes starting at once as the node has CPUs). Idle pooled workers live
# 2 min: with 1 s, every burst of Ray Data reads started processes that import pyarrow again (the
# demo's end-of-job eval took 5-7 s, not 0.5 s; bench/data_pipeline.py --training-only). 8 start at
# once: fewer raylet "N PYTHON worker processes have been started" lines, no slower on 2 cores.
LOCAL_SYSTEM_CONFIG = {"idle_worker_killing_time_threshold_ms": 120_000, "worker_maximum_startup_concurrency": 8}


class ClusterError(RuntimeError):
    """Ray could not be joined or started; the message says what to change."""


def connect(num_cpus: float | None = None, *, num_gpus: int | None = None, say: Callable[[str], None] = print,
            **init_kwargs: Any) -> bool:
    """Join `$RAY_ADDRESS` or start a local cluster with `num_cpus` logical CPUs (default: the
    machine's cores). Returns True when this call started or joined Ray (the caller shuts it
    down), False when Ray was already initialised in this process."""
    import ray

    if ray.is_initialized():
        return False
    init_kwargs.setdefault("logging_level", "ERROR")
    if not sys.stdout.isatty():  # what Ray still prints here (its raylet's warnings) without colour codes
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    address = os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray.init(address=address, **init_kwargs)
            say(f"joined Ray cluster at {address}")
            return True
        cpus = num_cpus if num_cpus is not None else (os.cpu_count() or 1)
        ray.init(address="local", num_cpus=cpus, num_gpus=num_gpus,
                 **{"_system_config": LOCAL_SYSTEM_CONFIG, **init_kwargs})
    except ConnectionError as e:
        raise ClusterError(f"cannot join the Ray cluster at RAY_ADDRESS={address}: {e}; "
                           f"check the address, or unset RAY_ADDRESS to run on a local cluster of recgrid's own") from None
    say(f"started a local Ray cluster of its own: {cpus:g} logical CPUs (set RAY_ADDRESS to use an existing one)")
    return True
