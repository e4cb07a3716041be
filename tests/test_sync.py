"""The replica sync's arithmetic and memory on real gloo process groups (M = 3 processes), on
FBGEMM's own CPU kernels: fp16 tables averaged in fp32 keep identical rows bit-identical over
many syncs, and `align` broadcasts a shard far larger than its bucket with bounded extra memory.
One spawn serves every test here; the checks run in the parent, on what the ranks returned."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from recgrid.launch.local import run_local

M = 3
ROWS, DIM, SHARED = 64, 16, 32  # rows 0..SHARED-1 are the same on every rank, the others differ
SYNCS = 100
ALIGN_BUCKET = 2 * 2**20


def _kernel(tables: list[tuple[int, int]], precision: str) -> nn.Module:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)

    kernel = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows, dim in tables],
        weights_precision=SparseType[precision], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    return nn.ModuleDict({"kernel": kernel})  # ReplicaSync finds kernels below a model


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_extra_bytes(fn) -> int | None:
    """Peak resident memory that `fn()` added, in bytes (Linux: VmHWM after resetting it through
    /proc/self/clear_refs); None where the peak cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _rss_kib("VmRSS")
    fn()
    return (_rss_kib("VmHWM") - before) * 1024


def sync_probe(align_bucket: int = ALIGN_BUCKET) -> dict:
    from recgrid.engine.sync import ProcessGroupSum, ReplicaSync, average_

    world = ProcessGroupSum(dist.group.WORLD, M)

    rank = dist.get_rank()
    out: dict = {}

    # fp16 table: SHARED identical rows, the others drawn per rank
    model = _kernel([(ROWS, DIM)], "FP16")
    sync = ReplicaSync.of_model(model, world, sync_every=1)
    (w,) = sync.weights
    same = torch.randn(SHARED, DIM, generator=torch.Generator().manual_seed(0)).half()
    own = torch.randn(ROWS - SHARED, DIM, generator=torch.Generator().manual_seed(1 + rank)).half()
    w.copy_(torch.cat([same, own]))
    out["fp16_start"] = w.clone()
    sync.sync(1)
    out["fp16_first"] = w.clone()
    for step in range(2, SYNCS + 1):
        sync.sync(step)
    out["fp16_end"] = w.clone()
    out["bytes"] = sync.stats.last.bytes

    # bf16 and fp16 tensors through several buckets (bucket of 64 fp32 values): the same answer
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(1 + rank)).to(dtype)
        one, many = x.clone(), [x[:300].clone(), x[300:].clone()]
        average_([one], world)
        average_(many, world, bucket_bytes=256)
        out[f"{dtype}_in"], out[f"{dtype}_one"], out[f"{dtype}_many"] = x, one, torch.cat(many)

    # align: a 96 MiB fp32 shard (one 64 MiB table and 32 of 1 MiB) through 4 MiB buckets
    big = _kernel([(2**18, 64)] + [(2**12, 64)] * 32, "FP32")
    sync = ReplicaSync.of_model(big, world, sync_every=1, bucket_bytes=align_bucket)
    for i, t in enumerate(sync.weights + sync.states):
        t.fill_(rank * 1000 + i)
    tensors = sync.weights + sync.states
    out["shard_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    dist.barrier()
    out["align_extra"] = _peak_extra_bytes(lambda: sync.align(src_replica_rank=1))
    out["aligned"] = [bool((t == 1000 + i).all()) for i, t in enumerate(tensors)]
    return out


@pytest.fixture(scope="module")
def results():
    return run_local(sync_probe, M)


def test_fp16_rows_identical_on_every_replica_stay_bit_identical(results):
    for r in results:
        start, end = r["fp16_start"], r["fp16_end"]
        assert torch.equal(end[:SHARED], start[:SHARED]), (
            f"identical fp16 rows moved by up to {(end[:SHARED].float() - start[:SHARED].float()).abs().max():.3g} "
            f"after {SYNCS} syncs at M={M}")


def test_fp16_average_is_the_fp32_mean_rounded_once(results):
    mean = sum(r["fp16_start"].float() for r in results) / M
    for r in results:
        assert torch.equal(r["fp16_first"], mean.half())  # the fp32 mean, rounded to fp16 once
        assert torch.equal(r["fp16_end"], results[0]["fp16_end"])  # replicas identical
        assert r["bytes"] == ROWS * DIM * 4 + ROWS * 4  # fp32 sum of the weights, plus the fp32 states


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_average_is_the_same_whatever_the_bucket(results, dtype):
    mean = (sum(r[f"{dtype}_in"].float() for r in results) / M).to(dtype)
    for r in results:
        assert torch.equal(r[f"{dtype}_one"], mean)
        assert torch.equal(r[f"{dtype}_many"], mean)


def test_align_copies_the_source_with_memory_bounded_by_its_bucket(results):
    for r in results:
        assert all(r["aligned"])
    extras = [r["align_extra"] for r in results]
    if None in extras:
        pytest.skip("this kernel does not let a process reset its peak resident memory (/proc/self/clear_refs)")
    shard = results[0]["shard_bytes"]
    assert shard >= 40 * ALIGN_BUCKET
    # a staging bucket or a few (allocator and gloo slack: 0.5-16 MiB seen), never a copy of the shard
    assert max(extras) < shard / 4, f"align added {max(extras) / 2**20:.1f} MiB for a {shard / 2**20:.0f} MiB shard"
