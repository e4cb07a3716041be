"""Every number the cost model uses that is not computed from the model itself: published
hardware figures and published (or this machine's) measurements, each with its source.

Nothing here is fitted to the 2-D paper's tables. The GPU figures describe an H100 SXM5 node
of 8 GPUs on NVLink 4 / NVSwitch with one 400 Gb/s ConnectX-7 NIC per GPU (the DGX/HGX H100
shape); `recgrid plan --hbm-gb/--intra-node-gbps/--inter-node-gbps` override the headline ones.
The CPU figures (`CPU_MEASURED`, what a CPU/gloo job's `model.sharding: auto` and `recgrid plan
--device cpu` price with) are this project's 2-core machine as bench/calibrate_cpu.py measured it
and wrote it to bench/results/calibrate_cpu.json (a test keeps the two equal); `--cpu-profile PATH`
(or $RECGRID_CPU_PROFILE) loads another machine's calibration (`CpuProfile.load`).

Units: bytes, seconds, bytes per second, FLOP per second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from recgrid.config import CHECKPOINT_EVERY_S  # noqa: F401 - the job's derived cadence (config.py's), priced here

GB = 1e9  # the decimal gigabyte NVIDIA and nccl-tests quote bandwidths and capacities in


@dataclass(frozen=True)
class Source:
    """Where a figure comes from: a URL (or paper + table), and what exactly was read there."""

    url: str
    note: str


@dataclass(frozen=True)
class GpuProfile:
    """One GPU type in its usual node. Field docs say what the figure is; SOURCES says where
    it comes from."""

    name: str
    hbm_bytes: float
    """Device memory capacity."""
    hbm_bandwidth: float
    """Device memory bandwidth: what TorchRec's estimator divides embedding-lookup bytes by."""
    nvlink_busbw: float
    """Effective NVLink bandwidth NCCL reaches per GPU for all-to-all, reduce-scatter and
    all-gather inside a node (nccl-tests busBw, non-all-reduce collectives)."""
    nvls_allreduce_busbw: float
    """All-reduce bus bandwidth inside one 8-GPU node (NVLink SHARP)."""
    nic_bandwidth: float
    """Achieved bandwidth of one GPU's NIC: all-to-all cannot aggregate several NICs, so this
    bounds a GPU's inter-node all-to-all."""
    a2a_peer_latency_intra: float
    """Added all-to-all time per peer inside a node (small messages, nccl-tests alltoall_perf)."""
    a2a_peer_latency_inter: float
    """Added all-to-all time per peer across nodes."""
    collective_latency: float
    """Fixed cost of launching one NCCL collective (zero-byte alltoall_perf time)."""
    dense_samples_per_s: float
    """Measured training throughput of a reference DLRM on one GPU (TF32), samples/s."""
    dense_reference_flops_per_sample: float
    """Training FLOP per sample of that reference model (6 x its dense weights, computed by
    `reference_dense_flops`), so dense_samples_per_s x this = achieved dense FLOP/s."""

    @property
    def dense_flops(self) -> float:
        """Achieved dense training FLOP/s (an end-to-end measurement, so it already holds the
        step's launch overheads and the small embedding part of the reference model)."""
        return self.dense_samples_per_s * self.dense_reference_flops_per_sample

    def with_overrides(self, hbm_gb: float | None = None, intra_node_gbps: float | None = None,
                       inter_node_gbps: float | None = None) -> "GpuProfile":
        """The profile with the user's figures (`--hbm-gb`, `--intra-node-gbps`, `--inter-node-gbps`,
        GB/s per GPU) in place of the published ones."""
        p = self
        if hbm_gb is not None:
            p = replace(p, hbm_bytes=hbm_gb * GB)
        if intra_node_gbps is not None:
            p = replace(p, nvlink_busbw=intra_node_gbps * GB, nvls_allreduce_busbw=intra_node_gbps * GB)
        if inter_node_gbps is not None:
            p = replace(p, nic_bandwidth=inter_node_gbps * GB)
        return p


def reference_dense_flops() -> float:
    """Training FLOP per sample (forward 2, backward 4 per weight) of the model measured for
    `dense_samples_per_s`: DLRM on Criteo Kaggle (26 tables, dim 128, dot interaction) with
    MLPerf's MLPs, bottom 13-512-256-128 and top 479-1024-1024-512-256-1 (479 = 128 + 27*26/2)."""
    layers = [(13, 512), (512, 256), (256, 128), (128 + 27 * 26 // 2, 1024), (1024, 1024), (1024, 512),
              (512, 256), (256, 1)]
    return 6.0 * sum(i * o for i, o in layers)


H100_SXM = GpuProfile(
    name="h100-sxm",
    hbm_bytes=80 * GB,
    hbm_bandwidth=3.35e12,
    nvlink_busbw=370 * GB,
    nvls_allreduce_busbw=480 * GB,
    nic_bandwidth=48 * GB,
    a2a_peer_latency_intra=1.06e-6,
    a2a_peer_latency_inter=3.0e-6,
    collective_latency=3.1e-6,
    dense_samples_per_s=2.27e6,
    dense_reference_flops_per_sample=reference_dense_flops(),
)

PROFILES: dict[str, GpuProfile] = {H100_SXM.name: H100_SXM}

# The narrowest column shard the planner offers, as bytes of one fp32 row: one 128-byte L1 cache
# line (SOURCES["column_shard_width"]), 32 columns. Policy anchored to a hardware figure, like
# TorchRec's own MIN_CW_DIM = 128 default.
MIN_COLUMN_SHARD_BYTES = 128
# Placements whose ratings are within this fraction of the best a search found are ones the cost
# model cannot tell apart (equal up to float noise); the one with the least communication is
# chosen (proposers.pick).
TIE_TOLERANCE = 1e-6

SOURCES: dict[str, Source] = {
    "hbm_bytes": Source(
        "https://www.nvidia.com/en-us/data-center/h100/",
        "H100 SXM datasheet: GPU memory 80 GB."),
    "hbm_bandwidth": Source(
        "https://www.nvidia.com/en-us/data-center/h100/",
        "H100 SXM datasheet: GPU memory bandwidth 3.35 TB/s."),
    "nvlink_busbw": Source(
        "https://github.com/NVIDIA/nccl-tests/issues/212",
        "NCCL maintainer (sjeaugey): NVLink 4 line rate is 450 GB/s; with ~20% protocol overhead NCCL "
        "gets an effective 370 GB/s, seen as busBw of non-all-reduce collectives."),
    "nvls_allreduce_busbw": Source(
        "https://github.com/NVIDIA/nccl-tests/issues/212",
        "Same thread: all-reduce with NVLink SHARP on 8 H100s peaks at a busBw of ~480 GB/s "
        "(also GTC 2024 talk S62129)."),
    "nic_bandwidth": Source(
        "https://github.com/NVIDIA/nccl-tests/issues/267",
        "NCCL team (AddyLaddy): CX-7 NICs at NDR rate (400 Gb/s) achieve up to 48-49 GB/s per NIC; "
        "sjeaugey: all-to-all cannot aggregate the bandwidth of several NICs."),
    "a2a_inter_node_scaling": Source(
        "https://github.com/NVIDIA/nccl-tests/issues/130",
        "sjeaugey: inter-node all-to-all busBw = N/(N-1) x the network bandwidth per GPU for N nodes "
        "(2x on 2 nodes, falling to 1x as N grows): the all-to-all bandwidth's decline with group size."),
    "allreduce_inter_node": Source(
        "https://github.com/NVIDIA/nccl-tests/issues/160",
        "sjeaugey: on 3+ nodes rings are used and all-reduce busBw reflects the total NIC bandwidth the "
        "ranks of a node drive (so ranks-per-node x NIC, bounded by NVLink); one rank per node gets one NIC."),
    "allreduce_whole_nodes": Source(
        "https://github.com/NVIDIA/nccl/issues/812",
        "A replica group of M workers on M/W whole nodes (host-local layout, M a multiple of the W GPUs per "
        "node) all-reduces over every NIC of those nodes: NCCL team (AddyLaddy) measures 192 GB/s all-reduce "
        "busBw on DGX-A100s with 8 x 200 Gb/s NICs, i.e. 8 NICs x 24 GB/s; so 8 x 48 GB/s on H100 nodes, "
        "bounded by NVLink's 370 GB/s (GpuCost.bandwidth). NVIDIA/nccl#1649 quotes ~380 GB/s multi-node "
        "all-reduce busBw on H100 without SHARP. On two nodes NCCL's tree can exceed it (nccl-tests#196); "
        "the ring figure is used."),
    "lookup_activation_memory": Source(
        "torchrec/distributed/planner/shard_estimators.py (TorchRec 1.8): calculate_shard_storages",
        "Per shard, input ids B x L x pooling x 8 bytes (row-wise: its 1/L of them; table-row-wise: 1/per-node) "
        "and output B x L x shard dim x 4 bytes for every sharding type: a row-wise or table-row-wise shard "
        "holds pooled partial sums for the whole batch of its group before the reduce-scatter. Charged input + "
        "output (its default pipeline type), as the fullest worker's lookup activations."),
    "a2a_peer_latency_intra": Source(
        "https://github.com/deepseek-ai/DeepEP/issues/303",
        "nccl-tests alltoall_perf on 8 GPUs of one NVLink node: 3.1 us at 0 bytes, 10.5 us at 128 B "
        "-> (10.5 - 3.1) / 7 peers = 1.06 us per peer."),
    "a2a_peer_latency_inter": Source(
        "https://github.com/NVIDIA/nccl/issues/1531",
        "nccl-tests alltoall_perf on 64 H800 (8 nodes, 400 Gb/s NICs): 8 MiB in 337.8 us. The bandwidth "
        "part at 8/7 x 48 GB/s is 8 MiB x 63/64 / 54.9 GB/s = 150 us; the rest, 188 us over 63 peers, "
        "= 3.0 us per peer."),
    "collective_latency": Source(
        "https://github.com/deepseek-ai/DeepEP/issues/303",
        "nccl-tests alltoall_perf, 0 bytes: 3.1 us (the fixed cost of one collective)."),
    "dense_samples_per_s": Source(
        "recgrid issue 9 (measured on one H100, torch 2.11, fbgemm-gpu 1.6.0)",
        "A bare training loop of DLRM on Criteo Kaggle, dim 128, MLPerf-size MLPs, batch 16384, TF32 "
        "matmuls: 2.27 M samples/s. x reference_dense_flops() = achieved dense FLOP/s; far below the "
        "494 TFLOP/s TF32 peak, as small-GEMM MLP training is."),
    "torchrec_estimators": Source(
        "torchrec/distributed/planner/shard_estimators.py, estimator/estimator.py (TorchRec 1.8)",
        "Per-shard lookup time (fwd/bwd compute from bytes / HBM bandwidth, TorchRec's own coefficients), "
        "per-shard communication time (bytes / the bandwidth recgrid supplies), per-shard memory "
        "(weights, row-wise AdaGrad state, lookup input and output) are TorchRec's estimates."),
    "column_shard_width": Source(
        "https://docs.nvidia.com/cuda/cuda-c-best-practices-guide/index.html#coalesced-access-to-global-memory",
        "CUDA C++ Best Practices Guide, coalesced access to global memory: a warp's loads are served in "
        "32-byte sectors of 128-byte cache lines. A column shard of 32 fp32 columns reads one whole line "
        "per looked-up row; narrower ones split lines across shards."),
    "cpu_measured": Source(
        "bench/calibrate_cpu.py -> bench/results/calibrate_cpu.json (`profile`)",
        "Every CpuProfile figure of CPU_MEASURED: gloo collectives' bandwidth (slope over message sizes) and "
        "latency under training load, the fused kernel's and dense part's times on one core, the sharded step's "
        "overhead, and the cores' contention, measured on this project's 2-core machine (its docstring says how)."),
    "cpu_reduce_scatter": Source(
        "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md",
        "A ring all-reduce moves 2(n-1)/n of its bytes, a reduce-scatter or all-gather (n-1)/n: so where the "
        "calibration has no reduce-scatter measured, it costs half the measured all-reduce's time for the same "
        "bytes (TorchRec's row-wise output, forward, and its all-gather, backward)."),
    "replica_sync": Source(
        "Zhang et al., Two-dimensional Sparse Parallelism for Large Scale Deep Learning Recommendation "
        "Model Training, arXiv:2508.03854, Eq. 1",
        "L_sync = 2 S (M - 1) / (T B_sync): a ring all-reduce of each worker's S/L shard bytes over the M "
        "workers of its replica group."),
    "host_failures_per_hour": Source(
        "Llama Team, AI @ Meta, The Llama 3 Herd of Models, arXiv:2407.21783 (2024), section 3.3.4",
        "A 54-day snapshot of pre-training on 16,384 H100 GPUs (servers of 8 GPUs) had 466 job interruptions, 47 "
        "planned and 419 unexpected; about 78% of the unexpected ones are attributed to confirmed or suspected "
        "hardware issues (GPU, HBM3, host components, unplanned host maintenance). Per host-hour: "
        "HOST_FAILURES_PER_HOUR. Checked against secondary reports of the paper (the paper itself was not at "
        "hand): 466, 47, 419, 54 days and 16,384 GPUs, and its root-cause table, whose GPU, host and unplanned "
        "host maintenance rows sum to 321 of 419 (77%); the 78% itself is the paper's text as the issue quotes it."),
    "recovery_seconds": Source(
        "bench/recovery.py -> bench/results/recovery.json, `results.tiny.torchft.seconds`",
        "A worker SIGKILLed in steady state at T = 4, M = 2 (tiny model, this project's 2-core machine): "
        "`replacement` = Ray Train's new worker group until recgrid's training function starts (RESTART_S), "
        "`heal` = the rebuilt group's heal from a live peer over torchft (HEAL_S)."),
    "checkpoint_cost": Source(
        "bench/checkpoint_cost.py -> bench/results/checkpoint_cost.json, `runs.derived`",
        "The demo job (jobs/local_demo.yaml, T = 4, M = 2) with its derived cadence wrote 10 storage checkpoints "
        "of 2,842,046 bytes; its workers spent 1.447 s in the checkpoint phase (mean over workers): "
        "CHECKPOINT_COST_S per checkpoint."),
    "snapshot_cost": Source(
        "bench/recovery.py --sources failure_free -> bench/results/recovery.json, "
        "`results.tiny.failure_free.jobs.failures_allowed`",
        "The demo job (T = 4, M = 2, 400 steps) with train.max_failures=2: its in-memory snapshots at their derived "
        "cadence (10-12 a job), the writing worker's seconds in the snapshot phase over the snapshots it took "
        "(copy into the slot files, checksum, the holder's copy for the next host awaited): SNAPSHOT_COST_S."),
    "snapshot_copy": Source(
        "bench/simulate.py -> bench/results/simulate.json, `snapshot_copy`",
        "This machine's memory-copy bandwidth into POSIX shared memory (/dev/shm, where a holder's slot files "
        "live), applied to the demo's bytes per shard position: the lower bound the measured snapshot cost "
        "replaced (no checksum, no copy to another host)."),
}


# ---- the CPU form: constants measured on this machine ------------------------------------------
DEFAULT_CPU_CALIBRATION = Path("bench/results/calibrate_cpu.json")


@dataclass(frozen=True)
class CpuProfile:
    """Figures of the CPU + gloo form, measured by bench/calibrate_cpu.py: microbenchmarks, and
    the collective latencies from bench/step_time.py runs at another batch size (never the
    step-time runs the model is checked against). Times in seconds.

    A collective of `nbytes` per rank over `n` ranks costs latency[n] + nbytes / bandwidth[n]:
    the bandwidth is the slope of the collective alone over message sizes, the latency is what
    a collective adds to a training step (on an oversubscribed machine a collective also waits
    for peers that are not running; calibrate_cpu.py's docstring says how it is measured).
    """

    cores: int
    """CPU cores of the machine."""
    world_size: int
    """T the calibration ran with."""
    compute_slowdown: float
    """Measured: a compute chunk's wall time when all `world_size` workers run it at once, over its
    time alone (about T / cores on an otherwise idle machine; more when it is shared)."""
    a2a_latency: dict[int, float]
    a2a_bandwidth: dict[int, float]
    allreduce_latency: dict[int, float]
    allreduce_bandwidth: dict[int, float]
    lookup_bandwidth: float
    """Bytes/s that, put in TorchRec's estimator as the device bandwidth, reproduce the measured
    fused-kernel (forward + backward with its fused optimizer) time on one core."""
    lookup_call_overhead: float
    """Fixed seconds per fused-kernel forward + backward call (the microbenchmark's intercept)."""
    dense_seconds_per_sample: float
    """Forward + backward + optimizer of the dense part on one core, per sample."""
    dense_call_overhead: float
    """Fixed seconds per dense step (intercept over batch sizes)."""
    sharded_step_overhead: float
    """Seconds a sharded module's step costs on one worker beyond its kernels (TorchRec's input
    and output distribution bookkeeping, awaitables, DDP hooks), measured at world size 1."""
    reduce_scatter_bandwidth: dict[int, float] = field(default_factory=dict)
    """Measured reduce-scatter slope (bytes per rank per second) inside sharding groups of n, where
    the calibration measured it; else derived from the all-reduce's (`reduce_scatter_rate`)."""
    measured: dict = field(default_factory=dict)
    """The raw microbenchmark results, for the record."""
    source: str = "bench/calibrate_cpu.py"
    """Where the figures come from (the calibration file read, or the measuring script)."""

    @classmethod
    def load(cls, path: str | Path = DEFAULT_CPU_CALIBRATION) -> "CpuProfile":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no CPU calibration; run `.venv/bin/python bench/calibrate_cpu.py` first")
        return replace(cls.from_dict(json.loads(path.read_text())["profile"]), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict) -> "CpuProfile":
        """A profile from its JSON form (rank counts as keys are strings there)."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in raw.items() if k in known}
        for k in ("a2a_latency", "a2a_bandwidth", "allreduce_latency", "allreduce_bandwidth",
                  "reduce_scatter_bandwidth"):
            if k in kw:
                kw[k] = {int(n): float(v) for n, v in kw[k].items()}
        return cls(**kw)

    @staticmethod
    def _at(table: dict[int, float], n: int) -> float:
        """The figure measured at `n` ranks, or at the nearest measured count."""
        if n in table:
            return table[n]
        return table[min(table, key=lambda k: (abs(k - n), k))]

    def at(self, table: dict[int, float], n: int) -> float:
        """`table`'s figure at `n` ranks (the nearest measured count when `n` was not measured)."""
        return self._at(table, n)

    def reduce_scatter_rate(self, n: int) -> float:
        """Bytes per rank per second of a reduce-scatter (or all-gather) over n ranks: measured, or
        twice the measured all-reduce's, since a ring all-reduce is a reduce-scatter and an
        all-gather of the same bytes (SOURCES["cpu_reduce_scatter"])."""
        if self.reduce_scatter_bandwidth:
            return self._at(self.reduce_scatter_bandwidth, n)
        return 2.0 * self._at(self.allreduce_bandwidth, n)

    def allreduce_seconds(self, nbytes: float, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return self._at(self.allreduce_latency, ranks) + nbytes / self._at(self.allreduce_bandwidth, ranks)


# This machine (2 cores, shared), measured by bench/calibrate_cpu.py: its `profile` in
# bench/results/calibrate_cpu.json (microbenchmarks; the collective latencies from the step-time
# runs at global batch 512, bench/results/step_time_b512.json). Field docs say what each is.
CPU_MEASURED = CpuProfile(
    cores=2,
    world_size=4,
    compute_slowdown=2.4671095905421696,
    a2a_latency={2: 0.0011595599148498468, 4: 0.002547791330419603},
    a2a_bandwidth={2: 12166742473.119871, 4: 2077163691.3333383},
    allreduce_latency={2: 0.0017004893999910565, 4: 0.012236538568379886},
    allreduce_bandwidth={2: 941785003.5705525, 4: 1471329000.322296},
    lookup_bandwidth=8353717474.997291,
    lookup_call_overhead=0.0,
    dense_seconds_per_sample=9.876933591255823e-06,
    dense_call_overhead=0.000519903500389773,
    sharded_step_overhead=0.002514977340554077,
    source="bench/results/calibrate_cpu.json (bench/calibrate_cpu.py on this project's 2-core machine)",
)


# ---- host failures and recovery: what `recgrid simulate`'s goodput term prices ----------------
# Published failure rate, per host (SOURCES["host_failures_per_hour"]): the hardware share of Llama 3's
# unexpected interruptions over its host-hours, 0.78 x 419 / (54 days x 24 h x 16,384 / 8 hosts)
# = 326.8 / 2,654,208 = 1.23e-4 per host-hour (a host's mean time between failures ~8,100 h, 338 days).
HOST_FAILURES_PER_HOUR = 0.78 * 419 / (54 * 24 * 16384 / 8)
# Measured here (SOURCES["recovery_seconds"], SOURCES["checkpoint_cost"]): a test keeps them equal to
# the results files.
RESTART_S = 10.938  # recovery.json results.tiny.torchft.seconds.replacement
HEAL_S = 0.499  # recovery.json results.tiny.torchft.seconds.heal
# checkpoint_cost.json runs.derived: checkpoint_s_mean_over_workers / checkpoints_written
CHECKPOINT_COST_S = 1.447 / 10
# Measured here (SOURCES["snapshot_cost"]): the demo's peer-memory snapshots, recovery.json
# results.tiny.failure_free.jobs.failures_allowed: each job's snapshot seconds (`time/snapshot_s` summed, the
# writing worker's) over its snapshots, the mean over the four jobs.
SNAPSHOT_COST_S = (0.055 / 10 + 0.059 / 11 + 0.05 / 12 + 0.056 / 11) / 4
# The lower bound it replaced (SOURCES["snapshot_copy"]): the demo's bytes per shard position at this machine's
# copy bandwidth into shared memory, no checksum and no copy to another host.
SNAPSHOT_COPY_BANDWIDTH = 4.94e9  # simulate.json snapshot_copy.bandwidth, bytes/s
DEMO_SHARD_BYTES = 2842046 / 2  # checkpoint_cost.json runs.derived.newest_checkpoint_bytes over its L = 2 positions
# Cadences the simulation assumes (policy, not measurement): a storage checkpoint every 30 minutes of
# training (the job's derived time budget, decided in config.py), a snapshot every 60 s (a stand-in for
# the job's derived interval: at most 2% of the step time, a bounded number of syncs apart).
SNAPSHOT_EVERY_S = 60.0
