"""The cost model's answers the README and docs/performance.md quote, recorded: `recgrid simulate`
on the shipped table sets, each command as the docs name it, its JSON rows kept as they came.

1. `ctr_like_1.7tb.yaml`, 256 to 4096 GPUs, sharding groups of 256, batch 1152 per GPU: full
   model parallelism (M = 1) against 2-D, the paper's Table 2 shape (scaling factors, memory, OOM).
2. `ctr_like_0.5tb.yaml`, 128 to 512 GPUs, with Disaggregated Multi-Tower rows at tower
   compression 1 and 4, at batch 4096 and 1024 per GPU: DMT's QPS over model parallelism.

A prediction from published hardware figures (platform/recgrid/plan/constants.py), not a
measurement; it is deterministic, so a rerun gives the same numbers on any machine.

    .venv/bin/python bench/simulate.py [--out bench/results/simulate.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "table2_1.7tb": "recgrid simulate --tables datasets/ctr_like_1.7tb.yaml --gpus 256,512,1024,2048,4096 "
                    "--sharding-group-size 256 --batch-per-gpu 1152",
    **{f"dmt_0.5tb_b{b}_cr{cr}": f"recgrid simulate --tables datasets/ctr_like_0.5tb.yaml --gpus 128,256,512 "
                                 f"--sharding-group-size 128 --batch-per-gpu {b} --dmt --tower-compression {cr}"
       for b in (4096, 1024) for cr in (1, 4)},
}


def summary(rows: list[dict]) -> dict:
    """Per strategy, per GPU count: QPS, scaling factor, peak memory, OOM; DMT's QPS over model parallelism."""
    out: dict = {}
    for r in rows:
        out.setdefault(r["strategy"], {})[str(r["gpus"])] = {
            k: r.get(k) for k in ("num_groups", "qps", "scaling_factor", "peak_memory_gb", "oom")}
    if "dmt" in out and "model_parallel" in out:
        out["dmt_over_model_parallel"] = {T: round(v["qps"] / out["model_parallel"][T]["qps"], 3)
                                          for T, v in out["dmt"].items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/simulate.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "platform"))
    from recgrid import cli
    from recgrid.launch.report import machine_info, write_result

    result = {"benchmark": "simulate", "machine": machine_info(), "runs": {}}
    for name, command in COMMANDS.items():
        t0 = time.perf_counter()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            rc = cli.main(shlex.split(command)[1:] + ["--json"])
        if rc != 0:
            raise SystemExit(f"{command}: exit {rc}")
        rows = json.loads(printed.getvalue())
        result["runs"][name] = {"command": command, "seconds": round(time.perf_counter() - t0, 1),
                                "summary": summary(rows), "rows": rows}
        print(f"{name}: {json.dumps(result['runs'][name]['summary'])}", flush=True)
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
