"""The cost model's answers the README and docs/performance.md quote, recorded: `recgrid simulate`
on the shipped table sets, each command as the docs name it, its JSON rows kept as they came.

1. `ctr_like_1.7tb.yaml`, 256 to 4096 GPUs, sharding groups of 256, batch 1152 per GPU: full
   model parallelism (M = 1) against 2-D, the paper's Table 2 shape (scaling factors, memory, OOM).
2. `ctr_like_0.5tb.yaml`, 128 to 512 GPUs, with Disaggregated Multi-Tower rows at tower
   compression 1 and 4, at batch 4096 and 1024 per GPU: DMT's QPS over model parallelism.

3. `ctr_like_0.5tb.yaml`, 64 to 4096 GPUs, sharding groups of 16 (the plan's recommendation at
   256 GPUs), batch 4096: the goodput table under host failures (host-local with peer-memory
   snapshots, host-local with storage checkpoints only, inter-host).

A prediction from published hardware figures and this project's recovery constants
(platform/recgrid/plan/constants.py), not a measurement; it is deterministic, so a rerun gives the
same numbers on any machine. One figure is a measurement, taken only with
`--measure-snapshot-copy` (else carried over from the results file): `snapshot_copy`, this
machine's memory-copy bandwidth into POSIX shared memory (best of 21 copies of 64 MiB), the source
of `constants.SNAPSHOT_COPY_BANDWIDTH`, the lower bound beside the measured snapshot cost (a test keeps
the two equal). The rows price with `constants.SNAPSHOT_COST_S`, measured by bench/recovery.py.

    .venv/bin/python bench/simulate.py [--out bench/results/simulate.json] [--measure-snapshot-copy]
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
    "goodput_0.5tb": "recgrid simulate --tables datasets/ctr_like_0.5tb.yaml --gpus 64,256,1024,4096 "
                     "--sharding-group-size 16 --batch-per-gpu 4096",
}
COPY_BYTES = 64 * 2**20


def snapshot_copy(repeats: int = 21) -> dict:
    """Bytes/s of one numpy copy into a POSIX shared-memory buffer (what a holder's slot file is),
    best of `repeats` after a first touch of every page."""
    from multiprocessing import shared_memory

    import numpy as np

    src = np.random.default_rng(0).integers(0, 256, COPY_BYTES, dtype=np.uint8)
    shm = shared_memory.SharedMemory(create=True, size=COPY_BYTES)
    try:
        dst = np.ndarray((COPY_BYTES,), np.uint8, buffer=shm.buf)
        dst[:] = 0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        del dst
    finally:
        shm.close()
        shm.unlink()
    best = min(times)
    return {"bytes": COPY_BYTES, "repeats": repeats, "best_s": round(best, 6),
            "bandwidth": float(f"{COPY_BYTES / best:.3g}")}


def summary(rows: list[dict]) -> dict:
    """Per strategy, per GPU count: QPS, scaling factor, peak memory, OOM; per GPU count the 2-D job's goodput under
    host failures; DMT's QPS over model parallelism."""
    out: dict = {}
    for r in rows:
        out.setdefault(r["strategy"], {})[str(r["gpus"])] = {
            k: r.get(k) for k in ("num_groups", "qps", "scaling_factor", "peak_memory_gb", "oom")}
    keys = ("hosts", "num_groups", "step_ms", "goodput", "useful_work", "best", "inter_host_break_even_rate_multiple",
            "snapshot_break_even_cost_s", "double_failure_share")
    goodput = {str(r["gpus"]): {k: r["failures"][k] for k in keys} for r in rows if r.get("failures")}
    if goodput:
        out["goodput"] = goodput
    if "dmt" in out and "model_parallel" in out:
        out["dmt_over_model_parallel"] = {T: round(v["qps"] / out["model_parallel"][T]["qps"], 3)
                                          for T, v in out["dmt"].items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/simulate.json"))
    ap.add_argument("--measure-snapshot-copy", action="store_true",
                    help="measure this machine's copy bandwidth into shared memory (else keep --out's record)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "platform"))
    from recgrid import cli
    from recgrid.launch.report import machine_info, write_result

    out = Path(args.out)
    copy = None if args.measure_snapshot_copy or not out.is_file() else json.loads(out.read_text()).get("snapshot_copy")
    if copy is None:
        copy = snapshot_copy() | {"machine": machine_info()}
    result = {"benchmark": "simulate", "machine": machine_info(), "snapshot_copy": copy, "runs": {}}
    print(f"snapshot_copy: {copy['bandwidth']:.3g} bytes/s", flush=True)
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
