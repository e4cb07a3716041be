"""The local launcher: run a function on T processes of this machine, each a rank of a real
process group (gloo on CPU; NCCL with one GPU per rank on CUDA). Used by `recgrid smoke`, the
tests and the benchmarks (`bench/gpu_check.py` on GPUs); the Ray launcher is the production path
and shares the training loop with it."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from recgrid.engine.device import process_group_backend, worker_device
from recgrid.logs import quiet_libraries


class LocalRunError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports, imported once by the fork server its processes start from: under
# "spawn" each rank imported torch, TorchRec and FBGEMM itself (4-5 s of CPU per rank on this
# project's 2-core machine). The server never initialises CUDA, so a rank may (one GPU each).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torchrec.distributed", "fbgemm_gpu", "recgrid.train.trainer"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # takes effect when the server first starts
    return ctx


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 900,
              threads_per_worker: int = 1, device_type: str = "cpu", **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return their results by rank.

    `device_type` "cpu": gloo ranks; "cuda": rank r computes on cuda:r (made current before `fn`
    runs) in an NCCL process group (`engine.device` picks the device and the backend).
    `fn` must be importable (module level). If any rank fails, every rank is stopped and the
    failing rank's traceback is raised here.
    """
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)  # the caller's environment now, not the fork server's of its start
    # a rank whose data streams through Ray Data starts a Ray instance of its own: a bare ray.init() would
    # join whatever cluster this machine started last (its ray_current_cluster file), another job's or
    # test's, taking its CPUs or hanging on it once it ends. RAY_ADDRESS, where the caller sets it, stays.
    env.setdefault("RAY_ADDRESS", "local")
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, threads_per_worker, device_type, results, fn, args,
                                          kwargs, env), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise LocalRunError(f"no result from ranks {sorted(set(range(world_size)) - set(out))} "
                                    f"within {timeout_s:.0f}s") from None
            if not ok:
                raise LocalRunError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=30 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(world_size)]


def _worker(rank: int, world_size: int, port: int, threads: int, device_type: str, results: Any,
            fn: Callable[..., Any], args: tuple, kwargs: dict, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)  # T processes share this machine's cores
    quiet_libraries()
    try:
        device = worker_device(rank, use_gpu=device_type == "cuda")  # cuda:<rank>, made current
        dist.init_process_group(process_group_backend(device.type), rank=rank, world_size=world_size,
                                device_id=device if device.type == "cuda" else None)
        value = fn(*args, **kwargs)
        dist.barrier()
        dist.destroy_process_group()
        # plain pickle copies tensor data; the default queue would share memory that dies with us
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank named
        results.put((rank, False, traceback.format_exc()))
