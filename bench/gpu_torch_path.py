"""Checks the parts of recgrid's CUDA path that need torch alone, on a CUDA machine without
FBGEMM's CUDA build or TorchRec (a lent machine whose image has torch but nothing can be
installed on it: FBGEMM's CUDA wheel is about 450 MiB). `bench/gpu_check.py` checks the rest.

    PYTHONPATH=platform python3 bench/gpu_torch_path.py [--gib 4] [--out bench/results/gpu_torch_path.json]

Checks, on cuda:0, each recording "pass" or "fail" (with what it saw) or "error" and its figures:
  device_helpers   `engine/device.py`'s CUDA branches: matmul precision flags per precision,
                   bf16 autocast, the CUDA-event stopwatch against the host clock, memory readers
  snapshot_copy    an in-memory snapshot's copy out of the device (`train.recovery.slots` slot
                   files in /dev/shm, page-locked with `pin_host_memory`, copied by `HostCopy`):
                   bit for bit, in stream order before an in-place update queued behind it, how
                   long the host is held while issuing, and GB/s against a pageable copy
  sync_on_nccl     the replica sync's transport (`engine.sync.ProcessGroupSum`) on a one-member
                   NCCL group: `average_` of fp32, fp16 and bf16 tensors (coalesced all-reduce and
                   the fp32 buckets), `broadcast_bucketed`, `collective_device`, `device_indices`

Writes the JSON (configuration, machine, per-check results) to --out and prints it.
Exit status: 0 every check passed, 1 one failed or errored, 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from recgrid.engine import device as dev
from recgrid.launch.report import machine_info, write_result


def _timed_matmul(n: int = 8192) -> tuple[float, float]:
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    a @ b
    torch.cuda.synchronize()
    watch = dev.stopwatch(torch.device("cuda")).start()
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    watch.stop()
    torch.cuda.synchronize()
    return watch.seconds, time.perf_counter() - t0


def check_device_helpers(a: argparse.Namespace) -> dict:
    cuda = torch.device("cuda", 0)
    seen, bad = {}, []
    for precision in dev.PRECISIONS:
        dev.configure_matmul(cuda, precision)
        seen[precision] = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
        if seen[precision] != (("highest", False) if precision == "fp32" else ("high", True)):
            bad.append(f"{precision}: matmul precision {seen[precision]}")
    x = torch.randn(64, 64, device=cuda)
    with dev.autocast(cuda, "bf16"):
        y = x @ x
    with dev.autocast(cuda, "bf16", training=False):
        z = x @ x
    if y.dtype != torch.bfloat16 or z.dtype != torch.float32:
        bad.append(f"autocast: training {y.dtype}, eval {z.dtype}")
    dev.configure_matmul(cuda, "fp32")
    event_s, host_s = _timed_matmul()
    if not (0.8 < event_s / host_s < 1.2):
        bad.append(f"stopwatch: CUDA events {event_s:.4f} s vs host {host_s:.4f} s")
    if dev.pin_batches(cuda) is not True or dev.pipelined(cuda) is not True or dev.synchronizer(cuda) is None:
        bad.append("pin_batches/pipelined/synchronizer do not say CUDA")
    mem = dev.device_memory_bytes(cuda)
    peak = dev.peak_memory_mb(cuda)
    if mem < 2**30 or peak <= 0:
        bad.append(f"memory readers: total {mem}, peak MiB {peak}")
    return {"status": "fail" if bad else "pass", "problems": bad, "matmul_flags": seen,
            "stopwatch_s": {"cuda_events": round(event_s, 5), "host": round(host_s, 5)},
            "device_memory_gib": round(mem / 2**30, 1), "peak_mib": round(peak, 1)}


def check_snapshot_copy(a: argparse.Namespace) -> dict:
    from recgrid.train.recovery import slots

    cuda = torch.device("cuda", 0)
    # a shard position's tables and row-wise moments, as a snapshot copies them (fp32 weights, fp32 moments)
    rows = int(a.gib * 2**30 / 4 / 128 / 4)
    tensors = [torch.randn(rows, 128, device=cuda) for _ in range(4)] + [torch.rand(rows, device=cuda) for _ in range(4)]
    layout, nbytes = slots.shard_layout(tensors)
    want = slots.digest([t.cpu().numpy() for t in tensors])
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="recgrid-gpu-probe-")
    out: dict[str, Any] = {"gib": round(nbytes / 2**30, 2)}
    bad = []
    try:
        (path, _) = slots.allocate_slot_files(root, "shard0", nbytes) or (None, None)
        if path is None:
            return {"status": "fail", "problems": [f"no room for {nbytes} bytes in /dev/shm"]}
        mm, buf = slots.map_slot(path, nbytes)
        undo = dev.pin_host_memory(buf)
        out["pinned"] = undo is not None
        if undo is None:
            bad.append("pin_host_memory: cudaHostRegister refused the slot file's mapping")
        for rep in range(2):  # the first pays for mapping the pages into the device's tables
            torch.cuda.synchronize()
            copier = dev.HostCopy(cuda)
            t0 = time.perf_counter()
            slots.write_into(buf, tensors, layout, copier)
            copier.issued()
            issued_s = time.perf_counter() - t0
            for t in tensors:  # the next step's in-place update, queued behind the copies
                t.add_(1.0)
            landed_early = copier.done()
            copier.wait()
            total_s = time.perf_counter() - t0
            got = slots.digest(slots.read_slot(path, layout))
            if got != want:
                bad.append(f"rep {rep}: slot digest {got} != device tensors' {want} (copy not in stream order?)")
            for t in tensors:
                t.sub_(1.0)
            want = slots.digest([t.cpu().numpy() for t in tensors])
            out[f"rep{rep}"] = {"host_issue_s": round(issued_s, 4), "landed_s": round(total_s, 4),
                                "done_before_wait": landed_early, "gb_per_s": round(nbytes / total_s / 1e9, 1)}
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        slots.write_into(pageable, tensors, layout, dev.HostCopy(cuda))
        torch.cuda.synchronize()
        page_s = time.perf_counter() - t0
        out["pageable"] = {"seconds": round(page_s, 4), "gb_per_s": round(nbytes / page_s / 1e9, 1)}
        if undo is not None:
            # asynchronous: the host is free long before the copies land
            if out["rep1"]["host_issue_s"] > 0.5 * out["rep1"]["landed_s"]:
                bad.append("pinned copies held the host for most of their time")
            undo()
        del buf, mm  # unmapped once unreferenced (closing it while views of it live would raise)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return {"status": "fail" if bad else "pass", "problems": bad, **out}


def check_sync_on_nccl(a: argparse.Namespace) -> dict:
    from recgrid.engine import sync

    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=cuda)
    bad = []
    try:
        pg = dist.group.WORLD
        tensors = [torch.randn(1000, 64, device=cuda), torch.randn(3, device=cuda),
                   torch.randn(5000, 16, device=cuda).half(), torch.randn(70, 8, device=cuda).bfloat16()]
        before = [t.clone() for t in tensors]
        sent = sync.average_(tensors, sync.ProcessGroupSum(pg, 1), bucket_bytes=4096)
        if not all(torch.equal(x, y) for x, y in zip(tensors, before)):
            bad.append("average_ over one member changed a tensor")
        sync.broadcast_bucketed(tensors, pg, 0, bucket_bytes=4096)
        if not all(torch.equal(x, y) for x, y in zip(tensors, before)):
            bad.append("broadcast_bucketed from the only member changed a tensor")
        where = dev.collective_device(pg, torch.device("cpu"))
        indices = dev.device_indices(pg, cuda)
        if where.type != "cuda" or indices != {0: 0}:
            bad.append(f"collective_device {where}, device_indices {indices}")
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    return {"status": "fail" if bad else "pass", "problems": bad, "bytes_sent": sent,
            "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


CHECKS = [("device_helpers", check_device_helpers), ("snapshot_copy", check_snapshot_copy),
          ("sync_on_nccl", check_sync_on_nccl)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="size of the snapshot copied")
    ap.add_argument("--out", default="bench/results/gpu_torch_path.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_torch_path: no CUDA device here", file=sys.stderr)
        return 2
    results = {}
    for name, fn in CHECKS:
        t0 = time.perf_counter()
        try:
            res = fn(a)
        except Exception:  # noqa: BLE001 - every check gets its line
            res = {"status": "error", "error": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = res
        print(f"{name}: {res['status']} ({res['seconds']} s)", file=sys.stderr, flush=True)
    result = {"benchmark": "gpu_torch_path", "configuration": {"gib": a.gib}, "machine": machine_info(),
              "checks": results}
    write_result(a.out, result)
    print(json.dumps(result, indent=2))
    return 0 if all(r["status"] == "pass" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
