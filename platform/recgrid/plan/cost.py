"""The hardware side of the cost model, in two forms with one interface: `GpuCost` (published
H100 + NCCL figures from constants.py) and `CpuCost` (figures measured on this machine by
bench/calibrate_cpu.py). The planner asks them for a TorchRec `Topology` (so TorchRec's own
estimators price each shard), and for the terms 2-D adds or TorchRec leaves out:

- all-to-all bandwidth as a function of the group's size and spread over nodes, handed to
  TorchRec's estimators as a `GeneralizedCommsBandwidth`, plus a per-peer latency;
- all-reduce time (the dense gradients over all T, the replica sync over M);
- dense compute time.

Times in seconds, sizes in bytes. TorchRec's estimators work in bytes per millisecond and
return milliseconds; the conversion happens here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from recgrid.plan.constants import CpuProfile, GpuProfile

_MS = 1e-3  # TorchRec's planner constants are bytes/ms and its Perf is in ms


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
                self.bandwidth, CpuProfile._at(a2a, group_size), CpuProfile._at(a2a, group_size)),
        )

    def bandwidth(self, world_size: int, per_node: int, collective: str) -> float:
        if world_size <= 1:
            return float("inf")  # a group of one sends nothing
        table = self.profile.allreduce_bandwidth if collective == "all_reduce" else self.profile.a2a_bandwidth
        return CpuProfile._at(table, world_size)

    def a2a_latency(self, group_size: int, per_node: int) -> float:
        return CpuProfile._at(self.profile.a2a_latency, group_size) if group_size > 1 else 0.0

    def allreduce_rate(self, ranks: int, per_node: int) -> float:
        return CpuProfile._at(self.profile.allreduce_bandwidth, ranks)

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
