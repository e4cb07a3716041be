"""The one place where CPU and GPU differ: which device a worker computes on and which backend
its process groups use. Everything else takes a `torch.device` and stays device-agnostic."""

from __future__ import annotations

import os

import torch


def use_gpu_default() -> bool:
    return torch.cuda.is_available()


def worker_device(local_rank: int | None = None, use_gpu: bool | None = None) -> torch.device:
    """cuda:<local rank> on a GPU worker, cpu otherwise. `local_rank` defaults to $LOCAL_RANK."""
    if use_gpu is None:
        use_gpu = use_gpu_default()
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("use_gpu is set but torch sees no CUDA device on this worker")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def placement(device: torch.device, global_rank: int, local_rank: int) -> str:
    """A TorchRec shard placement string. CPU shards reject an index ("cpu:1"), CUDA needs one."""
    if device.type == "cpu":
        return f"rank:{global_rank}/cpu"
    return f"rank:{global_rank}/{device.type}:{local_rank}"


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timers measure work, not launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
