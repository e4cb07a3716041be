"""The one place where CPU and GPU differ: which device a worker computes on and which backend
its process groups use, whether the training loop runs TorchRec's pipeline, how device work is
timed and copied out to host memory, and in what precision dense compute runs. Everything else
takes a `torch.device` and asks here."""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the sharding choices and config validation reach this module without torch
    import torch


# Dense compute precisions a job can name (config.py's train.precision takes them from here):
# "fp32" IEEE float32 matmuls; "tf32" float32 tensors with TensorFloat-32 matmuls (Ampere and
# later); "bf16" bfloat16 autocast of the forward, TF32 for what autocast leaves in float32.
PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16")
GPU_PRECISIONS: tuple[str, ...] = ("tf32", "bf16")  # CUDA only: CPU workers compute in fp32


def default_precision(use_gpu: bool) -> str:
    """The precision of a job that names none: TF32 matmuls on GPU workers (NVIDIA's DLRM reports
    its figures with TF32), fp32 on CPU workers (which have no TF32)."""
    return "tf32" if use_gpu else "fp32"


def resolve_precision(device: "torch.device", precision: str | None) -> str:
    """The precision a worker on `device` computes in: `precision`, or the default for its kind."""
    return precision or default_precision(device.type == "cuda")


def process_group_backend(device_type: str) -> str:
    """The torch.distributed backend of a worker's process groups: NCCL on CUDA, gloo on CPU
    (Ray Train's backend config, the local launcher and torchft's replica groups all ask here)."""
    return "nccl" if device_type == "cuda" else "gloo"


def use_gpu_default() -> bool:
    import torch

    return torch.cuda.is_available()


def choose_device(local_rank: int, device_count: int, assigned: "torch.device | None" = None) -> "torch.device":
    """The CUDA device a GPU worker computes on: the one its launcher `assigned` (Ray Train's
    `ray.train.torch.get_device()`, from the GPU ids Ray gave the worker), kept as it is; without
    one, cuda:<local rank> (the local launcher's processes, one per GPU). Never the local rank
    over an assigned device: under torchft Ray counts local ranks per replica group of one worker,
    so every worker's local rank is 0. No CUDA call: the choice is testable anywhere."""
    import torch

    if assigned is not None:
        assigned = torch.device(assigned)
        if assigned.type != "cuda":
            raise RuntimeError(f"use_gpu is set but this worker was assigned {assigned}, not a CUDA device: "
                               f"did the launcher reserve a GPU per worker?")
        return assigned if assigned.index is not None else torch.device("cuda", 0)
    if device_count < 1:
        raise RuntimeError("use_gpu is set but torch sees no CUDA device on this worker")
    return torch.device("cuda", local_rank % device_count)


def worker_device(local_rank: int | None = None, use_gpu: bool | None = None,
                  assigned: "torch.device | None" = None) -> "torch.device":
    """This worker's device, made current: `choose_device` on a GPU worker (the `assigned` device
    if the launcher gave one, else cuda:<local rank>), cpu otherwise. `local_rank` defaults to
    $LOCAL_RANK."""
    import torch

    if use_gpu is None:
        use_gpu = use_gpu_default()
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("use_gpu is set but torch sees no CUDA device on this worker")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = choose_device(local_rank, torch.cuda.device_count(), assigned)
    torch.cuda.set_device(device)
    return device


def pin_batches(device: "torch.device") -> bool:
    """Whether host batches bound for `device` are read into pinned (page-locked) memory: on CUDA,
    where only a pinned source lets the `non_blocking` host-to-device copy run asynchronously
    (the training pipeline's copy stream overlaps it with compute); never on CPU, where pinning
    needs a CUDA driver and would only cost a copy."""
    return device.type == "cuda"


def placement(device_type: str, global_rank: int, device_index: int | None) -> str:
    """A TorchRec shard placement string for the shard on global rank `global_rank`, whose worker
    computes on device `device_index` of its node (as that worker reads it: `device_indices`).
    CPU shards reject an index ("cpu:1"); CUDA shards need the worker's real one."""
    if device_type == "cpu":
        return f"rank:{global_rank}/cpu"
    if device_index is None:
        raise ValueError(f"a {device_type} shard placement needs the device index of rank {global_rank}")
    return f"rank:{global_rank}/{device_type}:{device_index}"


def device_indices(group, device: "torch.device") -> "dict[int, int] | None":
    """Global rank -> the CUDA device index each member of `group` really computes on (read by
    that worker, gathered over `group`: collective); None on CPU, where placements carry none.
    Never computed from ranks: with uneven workers per node, or under Ray's device assignment,
    the local rank is not the device."""
    import torch
    import torch.distributed as dist

    if device.type != "cuda":
        return None
    current = torch.cuda.current_device()
    index = current if device.index is None else device.index
    if index != current:
        raise RuntimeError(f"this worker shards onto cuda:{index} but torch.cuda.current_device() is "
                           f"cuda:{current}; call torch.cuda.set_device on the worker's device first")
    got: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, (dist.get_rank(), index), group=group)
    return dict(got)


def device_memory_bytes(device: "torch.device | None" = None) -> int:
    """Total memory of a CUDA device (this process's current one by default), in bytes."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device in this process to read the device memory of")
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return int(torch.cuda.get_device_properties(index).total_memory)


def synchronize(device: "torch.device") -> None:
    """Wait for queued kernels so wall-clock timers measure work, not launches."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synchronizer(device: "torch.device"):
    """A callable that waits for `device`'s queued kernels (for phase timers), or None on CPU."""
    return (lambda: synchronize(device)) if device.type == "cuda" else None


def collective_device(group, device: "torch.device") -> "torch.device":
    """Where a tensor must live for a collective on `group`: NCCL groups take CUDA tensors only."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def peak_memory_mb(device: "torch.device | str" = "cpu") -> float:
    """This worker's peak memory in MiB: CUDA peak allocated on a GPU, else the process's peak RSS."""
    import resource
    import sys

    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux but bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def device_type_for(use_gpu: bool) -> str:
    """The torch device type of a job's workers."""
    return "cuda" if use_gpu else "cpu"


def accelerator_names() -> list[str]:
    """The CUDA devices this process sees, by name (empty on a CPU machine)."""
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


# ---- precision --------------------------------------------------------------------------------
def configure_matmul(device: "torch.device", precision: str) -> None:
    """Set how float32 matmuls run on a CUDA worker: TensorFloat-32 for "tf32" and "bf16" (for the
    float32 work autocast leaves), IEEE float32 for "fp32". PyTorch's flags are process-wide; a
    worker process trains one model. Nothing to set on CPU."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if device.type != "cuda":
        if precision in GPU_PRECISIONS:
            raise ValueError(f"precision {precision!r} needs a CUDA device; CPU workers compute in fp32")
        return
    # the one knob that sets PyTorch's legacy and new TF32 flags together: setting only
    # `torch.backends.cuda.matmul.fp32_precision` makes `torch.get_float32_matmul_precision()`
    # raise ("mix of the legacy and new APIs") wherever a library asks it
    torch.set_float32_matmul_precision("highest" if precision == "fp32" else "high")


def autocast(device: "torch.device", precision: str, training: bool = True) -> contextlib.AbstractContextManager:
    """The context a forward pass runs in: bfloat16 autocast on CUDA for a training forward of
    "bf16", nothing otherwise (the backward runs outside it, as autocast asks). Evaluation
    (`training` false) never autocasts: its predictions are float32, not rounded to bfloat16's
    8 bits (which ties AUC's bins and shifts NE); its matmuls follow `configure_matmul`."""
    import torch

    if training and device.type == "cuda" and precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---- the training pipeline and timing -----------------------------------------------------------
def pipelined(device: "torch.device") -> bool:
    """Whether the training loop runs TorchRec's `TrainPipelineSparseDist`: on CUDA, where its copy
    and data-dist streams overlap the next batches' host-to-device copy and input all-to-all with
    this batch's compute. CPU has no streams to overlap on and keeps the plain loop."""
    return device.type == "cuda"


class Stopwatch:
    """Seconds of a stretch of work on a device, timed without waiting for the work when it
    ends: `start()`, `stop()`, then `seconds` (which may wait). This one is the host clock, right
    for CPU work, which is done when the call that launched it returns."""

    deferred = False  # whether reading `seconds` may wait for the device

    def __init__(self) -> None:
        self._start: float | None = None
        self._seconds: float | None = None

    def start(self) -> "Stopwatch":
        self._start = time.perf_counter()
        return self

    def stop(self) -> "Stopwatch":
        assert self._start is not None, "stop() before start()"
        self._seconds = time.perf_counter() - self._start
        return self

    @property
    def seconds(self) -> float:
        assert self._seconds is not None, "seconds read before stop()"
        return self._seconds


class CudaStopwatch(Stopwatch):
    """A stopwatch of CUDA events recorded on the current stream: it measures the device's time
    from `start()` to `stop()` in stream order, and reading `seconds` waits for the stop event
    only (read late, e.g. once per logging interval, it costs no wait at all)."""

    deferred = True

    def __init__(self) -> None:
        import torch

        super().__init__()
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._stopped = False

    def start(self) -> "Stopwatch":
        self._events[0].record()  # on the current stream
        self._start = 0.0
        return self

    def stop(self) -> "Stopwatch":
        assert self._start is not None, "stop() before start()"
        self._events[1].record()
        self._stopped = True
        return self

    @property
    def seconds(self) -> float:
        assert self._stopped, "seconds read before stop()"
        if self._seconds is None:
            self._events[1].synchronize()  # this stopwatch's end only, not the whole device
            self._seconds = self._events[0].elapsed_time(self._events[1]) / 1000.0
        return self._seconds


def stopwatch(device: "torch.device") -> Stopwatch:
    """A stopwatch for `device`'s work: CUDA events on a GPU, the host clock on CPU."""
    return CudaStopwatch() if device.type == "cuda" else Stopwatch()


# ---- copies out of the device into host memory (in-memory snapshots) --------------------------------
def pin_host_memory(buf: "torch.Tensor") -> "Any":
    """Page-lock the host memory under `buf` (a CPU tensor over memory recgrid mapped: a snapshot's
    shared-memory slot file) so device-to-host copies into it run asynchronously, off the host's
    clock. Returns the undo (call it before the mapping goes), or None: nothing to do off CUDA, or
    the driver refused (the copies then block the host, as into pageable memory)."""
    import torch

    if not torch.cuda.is_available() or buf.numel() == 0:
        return None
    cudart = torch.cuda.cudart()
    ptr = buf.data_ptr()
    if int(cudart.cudaHostRegister(ptr, buf.numel() * buf.element_size(), 0)) != 0:
        return None
    return lambda: cudart.cudaHostUnregister(ptr)


class HostCopy:
    """Copies of device tensors into host memory issued on the current stream without waiting:
    `copy(dst, src)` queues each (in stream order, so the next step's kernels, which update the
    tables in place, run after it), `done()` says whether they have landed without waiting,
    `wait()` waits for them. On CPU every copy is done when `copy` returns."""

    def __init__(self, device: "torch.device") -> None:
        self.device = device
        self._event: Any = None

    def copy(self, dst: "torch.Tensor", src: "torch.Tensor") -> None:
        dst.copy_(src, non_blocking=self.device.type == "cuda")

    def issued(self) -> "HostCopy":
        """Mark the copies issued so far (a CUDA event on the current stream)."""
        if self.device.type == "cuda":
            import torch

            self._event = torch.cuda.Event()
            self._event.record()
        return self

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
