"""The estimators: the cost model, one form per device with one interface. `GpuCost` prices GPUs
with NCCL from published H100 figures, `CpuCost` CPU workers with gloo from the figures
bench/calibrate_cpu.py measured (both in constants.py, each with its source). The planner asks
them for a TorchRec `Topology` (so TorchRec's own estimators price each shard's lookup,
communication and memory), and for the terms 2-D adds or TorchRec leaves out:

- all-to-all bandwidth as a function of the group's size and spread over nodes, handed to
  TorchRec's estimators as a `GeneralizedCommsBandwidth`, plus a per-peer latency;
- all-reduce time (the dense gradients over all T, the replica sync over M);
- dense compute time;
- what each sharding type present costs a worker whatever its bytes (`kernel_fixed_seconds`:
  its all-to-alls' latency and its fused kernel's call), which the search rates too, so where a
  collective's latency dominates (gloo on a shared CPU) a plan with fewer sharding types wins.

Times in seconds, sizes in bytes. TorchRec's estimators work in bytes per millisecond and
return milliseconds; the conversion happens here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from recgrid.plan.constants import CpuProfile, GpuProfile
from recgrid.plan.tables import ModelTables

_MS = 1e-3  # TorchRec's planner constants are bytes/ms and its Perf is in ms
# All-to-alls a step runs per sharding type present (TorchRec's KJTAllToAll sends the splits,
# then lengths and values; PooledEmbeddingsAllToAll sends the pooled embeddings forward and
# their gradients backward).
A2A_PER_SHARDING_TYPE = 5


def _comms_bandwidth_class():
    from torchrec.distributed.planner.types import CollectiveType, GeneralizedCommsBandwidth

    class RecgridCommsBandwidth(GeneralizedCommsBandwidth):
        """Per-GPU collective bandwidth for TorchRec's estimators, from `bw(world_size,
        local_world_size, collective)` in bytes/s (converted to TorchRec's bytes/ms)."""

        def __init__(self, bw, intra: float, inter: float) -> None:
            self._bw, self._intra, self._inter = bw, intra, inter

        def get_bw(self, local_world_size: int, world_size: int, collective_type: "CollectiveType") -> float:
            return self._bw(world_size, local_world_size, collective_type.value) * _MS

        @property
        def intra_host_bw(self) -> float:
            return self._intra * _MS

        @property
        def inter_host_bw(self) -> float:
            return self._inter * _MS

        def __hash__(self) -> int:
            return hash((self._intra, self._inter))

    return RecgridCommsBandwidth


@dataclass(frozen=True)
class GpuCost:
    """H100-class GPUs, `gpus_per_node` to a node, one NIC per GPU, NCCL."""

    profile: GpuProfile
    gpus_per_node: int

    compute_device = "cuda"

    @property
    def key(self) -> tuple:
        return ("gpu", self.profile, self.gpus_per_node)

    @property
    def capacity(self) -> float:
        return self.profile.hbm_bytes

    def topology(self, group_size: int, per_node: int):
        from torchrec.distributed.planner import Topology

        p = self.profile
        return Topology(
            world_size=group_size, compute_device="cuda", hbm_cap=int(p.hbm_bytes), local_world_size=per_node,
            hbm_mem_bw=p.hbm_bandwidth * _MS,
            generalized_comms_bandwidths=_comms_bandwidth_class()(self.bandwidth, p.nvlink_busbw, p.nic_bandwidth),
        )

    def bandwidth(self, world_size: int, per_node: int, collective: str) -> float:
        """Per-GPU bus bandwidth of a collective over `world_size` ranks, `per_node` of them on
        each node. Inside a node: NVLink. Across nodes: an all-to-all (or reduce-scatter,
        all-gather) is bounded by the GPU's own NIC, and NCCL's all-to-all busBw is N/(N-1) x NIC
        for N nodes (the share of traffic that stays on NVLink shrinks as N grows); an all-reduce
        rings over the NICs of a node's ranks, bounded by NVLink."""
        p = self.profile
        if world_size <= 1:
            return p.hbm_bandwidth  # a group of one only copies locally
        if world_size <= per_node:
            return p.nvls_allreduce_busbw if collective == "all_reduce" else p.nvlink_busbw
        nodes = world_size / per_node
        if collective == "all_to_all":
            return p.nic_bandwidth * nodes / (nodes - 1)
        if collective == "all_reduce":
            return min(per_node * p.nic_bandwidth, p.nvlink_busbw)
        return p.nic_bandwidth

    def a2a_latency(self, group_size: int, per_node: int) -> float:
        """One all-to-all's fixed cost: a collective launch plus a message to every peer."""
        p = self.profile
        intra = min(group_size, per_node) - 1
        inter = group_size - 1 - intra
        return p.collective_latency + intra * p.a2a_peer_latency_intra + inter * p.a2a_peer_latency_inter

    def allreduce_rate(self, ranks: int, per_node: int) -> float:
        """Bytes per rank all-reduced per second: a ring moves 2 (n-1)/n of them over the bus."""
        return self.bandwidth(ranks, per_node, "all_reduce") * ranks / (2 * (ranks - 1))

    def allreduce_seconds(self, nbytes: float, ranks: int, per_node: int) -> float:
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return self.profile.collective_latency + nbytes / self.allreduce_rate(ranks, per_node)

    def lookup_overhead(self, kernels: int) -> float:
        return 0.0  # inside the end-to-end dense measurement's launch overheads

    def dense_seconds(self, flops: float, batch: int) -> float:
        return flops / self.profile.dense_flops

    def compute_slowdown(self, world_size: int) -> float:
        return 1.0

    def step_overhead(self) -> float:
        return 0.0


@dataclass(frozen=True)
class CpuCost:
    """CPU workers on one machine talking gloo, with figures measured here (CpuProfile).

    The kernels were measured on one core alone; with T workers sharing the cores every compute
    phase is slowed by the measured contention (at the calibrated T), else by max(1, T / cores)."""

    profile: CpuProfile
    world_size: int

    compute_device = "cpu"

    @property
    def key(self) -> tuple:
        return ("cpu", id(self.profile), self.world_size)

    @property
    def capacity(self) -> float:
        return float("inf")

    @property
    def gpus_per_node(self) -> int:
        return self.world_size

    def topology(self, group_size: int, per_node: int):
        from torchrec.distributed.planner import Topology

        bw = self.profile.lookup_bandwidth / self.compute_slowdown(self.world_size)
        a2a = self.profile.a2a_bandwidth
        return Topology(
            world_size=group_size, compute_device="cpu", local_world_size=per_node,
            ddr_mem_bw=bw * _MS, ddr_cap=1 << 50,
            generalized_comms_bandwidths=_comms_bandwidth_class()(
                self.bandwidth, self.profile.at(a2a, group_size), self.profile.at(a2a, group_size)),
        )

    def bandwidth(self, world_size: int, per_node: int, collective: str) -> float:
        if world_size <= 1:
            return float("inf")  # a group of one sends nothing
        if collective in ("reduce_scatter", "all_gather"):  # a row-wise shard's output and its gradient
            return self.profile.reduce_scatter_rate(world_size)
        table = self.profile.allreduce_bandwidth if collective == "all_reduce" else self.profile.a2a_bandwidth
        return self.profile.at(table, world_size)

    def a2a_latency(self, group_size: int, per_node: int) -> float:
        return self.profile.at(self.profile.a2a_latency, group_size) if group_size > 1 else 0.0

    def allreduce_rate(self, ranks: int, per_node: int) -> float:
        return self.profile.at(self.profile.allreduce_bandwidth, ranks)

    def allreduce_seconds(self, nbytes: float, ranks: int, per_node: int) -> float:
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return self.profile.allreduce_seconds(nbytes, ranks)

    def lookup_overhead(self, kernels: int) -> float:
        return kernels * self.profile.lookup_call_overhead * self.compute_slowdown(self.world_size)

    def dense_seconds(self, flops: float, batch: int) -> float:
        p = self.profile
        return (p.dense_call_overhead + p.dense_seconds_per_sample * batch) * self.compute_slowdown(self.world_size)

    def compute_slowdown(self, world_size: int) -> float:
        if world_size == self.profile.world_size:
            return max(1.0, self.profile.compute_slowdown)
        return max(1.0, world_size / self.profile.cores)

    def step_overhead(self) -> float:
        return self.profile.sharded_step_overhead * self.compute_slowdown(self.world_size)


def kernel_fixed_seconds(cost: GpuCost | CpuCost, kernels: int, group_size: int, per_node: int) -> float:
    """What `kernels` sharding types present cost a worker of a sharding group of `group_size`
    per step whatever their bytes: A2A_PER_SHARDING_TYPE all-to-alls' latency each, and a fused
    kernel call each."""
    return A2A_PER_SHARDING_TYPE * kernels * cost.a2a_latency(group_size, per_node) + cost.lookup_overhead(kernels)


# ---- the dense part ------------------------------------------------------------------------------
def dense_flops_per_sample(model: ModelTables) -> float:
    """Training FLOP per sample: forward 2 and backward 4 per dense weight (and per
    multiply-add of a dot interaction)."""
    flops = 6.0 * sum(i * o for i, o in model.dense_layers)
    if model.dense.interaction == "dot":
        n = model.features + 1
        flops += 6.0 * n * n * model.dense.bottom_mlp[-1]
    return flops


def dense_memory_bytes(model: ModelTables, batch: int) -> int:
    """Per worker: weights, gradients and Adagrad state of the dense part, its activations and
    their gradients, and the pooled embeddings it receives (and their gradients)."""
    params = model.dense_params
    layer_out = sum(o for _, o in model.dense_layers)
    activations = batch * (layer_out + model.embedding_width + model.dense.dense_features) * 4 * 2
    return 3 * params * 4 + activations
