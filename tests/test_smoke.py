"""`recgrid smoke` as a user runs it: a subprocess, T=4 gloo workers, JSON on stdout."""

import json
import os
import subprocess
import sys

KEYS = {"sharding_groups", "replica_groups", "peer_weight_diff_before_sync", "peer_weight_diff_after_sync",
        "peer_optim_diff_before_sync", "peer_optim_diff_after_sync", "dense_diff", "step_time_median_s",
        "sync_seconds", "sync_bytes"}


def test_smoke_command_reports_exact_sync():
    p = subprocess.run([sys.executable, "-m", "recgrid.cli", "smoke", "--world-size", "4", "--groups", "2",
                        "--steps", "20", "--sync-every", "5", "--json"],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert KEYS <= set(out)
    assert out["sharding_groups"] == [[0, 2], [1, 3]] and out["replica_groups"] == [[0, 1], [2, 3]]
    assert out["peer_weight_diff_after_sync"] == 0 and out["peer_optim_diff_after_sync"] == 0
    assert out["peer_weight_diff_before_sync"] > 0 and out["peer_optim_diff_before_sync"] > 0
    assert out["dense_diff"] == 0
    assert out["syncs"] == 4 and out["sync_bytes"] > 0 and out["sync_seconds"] > 0
    assert out["step_time_median_s"] > 0


def test_smoke_rejects_bad_grid_before_spawning():
    p = subprocess.run([sys.executable, "-m", "recgrid.cli", "smoke", "--world-size", "6", "--groups", "4", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "M=4" in p.stderr and p.stdout == ""
