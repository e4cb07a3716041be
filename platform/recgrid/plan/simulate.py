"""`recgrid simulate`: what happens at 1024 or 4096 GPUs. For each GPU count T, full model
parallelism (one sharding group of all T workers, TorchRec's ordinary DMP) against 2-D
sparse parallelism with sharding groups of a fixed size L (M = T / L copies): QPS, the
scaling factor, peak memory per GPU, out-of-memory.

Both strategies are priced by the planner's cost model (`rating.evaluate`), so the
simulation is exactly `recgrid plan` at each T, restricted to M = 1 and M = T / L. The
scaling factor is the paper's Table 2 metric: the QPS speed-up over the first (smallest) GPU
count, divided by the GPU-count multiplier; 1.0 is linear scaling.

A strategy is one entry of STRATEGIES: a name and a function that prices it at one GPU count
(`price(model, cluster, group_size, sync_every) -> Candidate`). Another way of training is one
more entry there; the rows, the scaling factor, the table and the JSON follow.

Host failures (`--host-failures-per-hour` and the recovery constants, `FailureModel`): under the
rows, the expected goodput of the 2-D job at each T when hosts fail, for three ways of recovering
(`goodput_row`; the model is its docstring): host-local with peer-memory snapshots, host-local with
storage checkpoints only, and inter-host; each layout priced at its own planner K, so the table also
weighs the inter-host layout's slower replica sync against what it saves when a host is lost.

Disaggregated Multi-Tower (`--dmt`, `--towers N`, `--tower-compression CR`; Luo et al.,
arXiv:2403.00877) adds a "dmt" row per GPU count: the model-parallel row's plan (same shards,
lookup, memory, dense part) with its embedding all-to-all over T ranks replaced by the two of
SPTT (`dmt_exchange`): an intra-tower all-to-all over the T/N GPUs of a tower (one host by
default: NVLink) and a cross-host peer all-to-all over N ranks (one per tower) that carries the
pooled embeddings and their gradients divided by CR (the tower modules' compression; the ids
are not compressed). Both are priced with the cost form's all-to-all bandwidth and per-peer
latency for their world size, as the flat one is. Not priced: the tower modules' own compute and
parameters, and a tower-aware re-plan of the tables (the engine's `tower_plan`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from recgrid.plan.constants import (CHECKPOINT_COST_S, CHECKPOINT_EVERY_S, GB, HEAL_S, HOST_FAILURES_PER_HOUR,
                                    RESTART_S, SNAPSHOT_COST_S, SNAPSHOT_EVERY_S)
from recgrid.plan.cli import gpu_cost, parse_int_list
from recgrid.plan.cluster import Cluster, PlanError, layouts_for
from recgrid.plan.estimators import A2A_PER_SHARDING_TYPE, dense_memory_bytes
from recgrid.plan.proposers import plan_group
from recgrid.plan.rating import DEFAULT_SYNC_EVERY, QPS_TOLERANCE, Candidate, evaluate
from recgrid.plan.recscale import MemorySummary, OptionsError, apply_args, describe, exchange_label, memory_summary
from recgrid.plan.tables import ModelTables, TablesError, resolve_model


@dataclass(frozen=True)
class DmtOption:
    """DMT rows: `towers` towers of whole hosts (None: one tower per host, N = T / G, at every T),
    each tower module compressing the embeddings it sends across hosts by `compression` (CR)."""

    towers: int | None = None
    compression: float = 1.0

    def __post_init__(self) -> None:
        N = self.towers
        if N is not None and (isinstance(N, bool) or not isinstance(N, int) or N < 1):
            raise PlanError(f"--towers must be a positive integer, got {N!r}")
        cr = self.compression
        if isinstance(cr, bool) or not isinstance(cr, (int, float)) or not cr > 0 or cr == float("inf"):
            raise PlanError(f"--tower-compression must be a finite number > 0 (CR, the tower modules' "
                            f"compression ratio), got {cr!r}")

    def towers_at(self, gpus: int, gpus_per_node: int) -> int:
        """N at T = `gpus`: the given count, or one tower per host; a PlanError unless the towers are
        whole hosts (N divides the number of hosts)."""
        W = min(gpus, gpus_per_node)
        hosts = gpus // W
        N = hosts if self.towers is None else self.towers
        if hosts % N:
            valid = [n for n in range(1, hosts + 1) if hosts % n == 0]
            raise PlanError(f"--towers {N} does not cut T={gpus} GPUs ({hosts} host(s) of {W}) into towers of whole "
                            f"hosts: N must divide the number of hosts (valid at T={gpus}: {valid})")
        return N


@dataclass(frozen=True)
class DmtExchange:
    """The embedding exchange of a DMT row against the flat one it replaces, for the slowest worker,
    per step. Times in seconds, bytes per worker (what it sends; `cross_host_*`: the share that leaves
    its host)."""

    towers: int
    tower_size: int
    compression: float
    flat_s: float  # the model-parallel row's all-to-all: bandwidth part + latency
    intra_tower_s: float  # the intra-tower all-to-all (T/N ranks), bandwidth part
    cross_host_s: float  # the peer all-to-all (N ranks), bandwidth part
    latency_s: float  # both all-to-alls' fixed costs, every all-to-all of the step
    cross_host_world_size: int  # N (0 with one tower: nothing leaves it over a peer all-to-all)
    flat_cross_host_world_size: int  # T when the flat all-to-all spans hosts, else 0
    ids_bytes: float
    embedding_bytes: float
    cross_host_bytes: float
    flat_cross_host_bytes: float

    @property
    def exchange_s(self) -> float:
        return self.intra_tower_s + self.cross_host_s + self.latency_s

    def to_json(self) -> dict:
        ms = lambda s: round(s * 1e3, 4)  # noqa: E731
        return {"flat_ms": ms(self.flat_s), "exchange_ms": ms(self.exchange_s),
                "intra_tower_ms": ms(self.intra_tower_s), "cross_host_ms": ms(self.cross_host_s),
                "latency_ms": ms(self.latency_s), "tower_size": self.tower_size,
                "cross_host_world_size": self.cross_host_world_size,
                "flat_cross_host_world_size": self.flat_cross_host_world_size,
                "ids_bytes": round(self.ids_bytes), "embedding_bytes": round(self.embedding_bytes),
                "cross_host_bytes": round(self.cross_host_bytes),
                "flat_cross_host_bytes": round(self.flat_cross_host_bytes)}


@dataclass(frozen=True)
class SimRow:
    gpus: int
    strategy: str
    candidate: Candidate
    scaling_factor: float | None
    dmt: DmtExchange | None = None
    memory: MemorySummary | None = None
    goodput: "GoodputRow | None" = None

    @property
    def oom(self) -> bool:
        return not self.candidate.feasible

    def to_json(self) -> dict:
        c = self.candidate
        gb = lambda b: round(b / GB, 3)  # noqa: E731
        out = {
            "gpus": self.gpus, "strategy": self.strategy, "num_groups": c.num_groups,
            "qps": None if self.oom else round(c.qps, 1),
            "scaling_factor": None if self.scaling_factor is None else round(self.scaling_factor, 4),
            "peak_memory_gb": gb(c.peak_bytes), "oom": self.oom,
            "sync_every": c.sync_every, "layout": c.layout,
            "step_ms": round(c.step_s * 1e3, 4), "all_to_all_ms": round(c.lookup_a2a_s * 1e3, 4),
            "memory_gb": {"tables": gb(c.tables_bytes), "optimizer": gb(c.optimizer_bytes),
                          "lookup_activations": gb(c.activation_bytes), "dense": gb(c.dense_bytes)},
        }
        out["row_wise_exchange_bytes"] = {"dense": round(c.row_wise_dense_bytes), "priced": round(c.row_wise_bytes)}
        if self.memory is not None:
            out["embedding_memory"] = self.memory.to_json()
        if self.dmt is not None:
            out.update(towers=self.dmt.towers, tower_compression=self.dmt.compression, exchange=self.dmt.to_json())
        if self.goodput is not None:
            out["failures"] = self.goodput.to_json()
        return out


def _best_k(model: ModelTables, cluster: Cluster, M: int, sync_every: Sequence[int],
            layout: str | None = None) -> Candidate:
    """The planner's K rule for a fixed M (and layout, else the better one per K): the smallest K
    within QPS_TOLERANCE of the best."""
    options = [evaluate(model, cluster, M, K, layout=layout) for K in ((1,) if M == 1 else sync_every)]
    top = max(c.qps for c in options)
    return min((c for c in options if c.qps >= (1 - QPS_TOLERANCE) * top), key=lambda c: c.sync_every)


Price = Callable[[ModelTables, Cluster, int, Sequence[int]], Candidate]


def model_parallel(model: ModelTables, cluster: Cluster, group_size: int, sync_every: Sequence[int]) -> Candidate:
    """TorchRec's ordinary full model parallelism: one sharding group of all T workers."""
    return _best_k(model, cluster, 1, sync_every)


def two_d(model: ModelTables, cluster: Cluster, group_size: int, sync_every: Sequence[int]) -> Candidate:
    """2-D sparse parallelism: M = T / L sharding groups of `group_size`, the planner's K and layout."""
    return _best_k(model, cluster, cluster.gpus // group_size, sync_every)


# The strategies a simulation compares, in row order: name -> how to price it at one GPU count.
STRATEGIES: dict[str, Price] = {"model_parallel": model_parallel, "2d": two_d}


# ---- host failures: the goodput of each way of recovering ------------------------------------------
# The goodput table's columns: host-local with peer-memory snapshots, host-local with storage
# checkpoints only, inter-host (a lost host's sharding groups heal from a live peer).
RECOVERIES: tuple[str, ...] = ("host_local_snapshots", "host_local_storage", "inter_host")
RECOVERY_LAYOUT = {"host_local_snapshots": "host-local", "host_local_storage": "host-local",
                   "inter_host": "inter-host"}


@dataclass(frozen=True)
class FailureModel:
    """The host failure rate and the recovery constants the goodput term prices (seconds; defaults
    from plan/constants.py, each named there with its source). A field is one `recgrid simulate`
    flag: `--host-failures-per-hour`, `--restart-s`, `--heal-s`, `--snapshot-every-s`,
    `--snapshot-cost-s`, `--checkpoint-every-s`, `--checkpoint-cost-s`."""

    host_failures_per_hour: float = HOST_FAILURES_PER_HOUR
    """Failures per host per hour (a failed GPU takes its host's training processes with it)."""
    restart_s: float = RESTART_S
    """A restarted group's new workers, from the failure to its training function."""
    heal_s: float = HEAL_S
    """A rebuilt group's heal from a live peer group (inter-host)."""
    snapshot_every_s: float = SNAPSHOT_EVERY_S
    """Training seconds between two peer-memory snapshots."""
    snapshot_cost_s: float = SNAPSHOT_COST_S
    """Seconds one snapshot adds to the job's steps."""
    checkpoint_every_s: float = CHECKPOINT_EVERY_S
    """Training seconds between two storage checkpoints."""
    checkpoint_cost_s: float = CHECKPOINT_COST_S
    """Seconds one storage checkpoint adds to the job's steps."""

    def __post_init__(self) -> None:
        for f in ("host_failures_per_hour", "restart_s", "heal_s", "snapshot_cost_s", "checkpoint_cost_s",
                  "snapshot_every_s", "checkpoint_every_s"):
            v = getattr(self, f)
            positive = f.endswith("_every_s")
            ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
                  and (v > 0 if positive else v >= 0))
            if not ok:
                raise PlanError(f"--{f.replace('_', '-')} must be a finite number {'> 0' if positive else '>= 0'}, "
                                f"got {v!r}")

    def to_json(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass(frozen=True)
class GoodputRow:
    """The goodput of the 2-D job at one T under host failures (`goodput_row`). `goodput`: useful
    training time over wall time, per recovery (None where its layout cannot run the job);
    `useful_work`: goodput x its layout's failure-free step speed over the faster layout's, so the
    three compare samples trained per wall second."""

    gpus: int
    hosts: int
    num_groups: int
    groups_per_host: int  # inter-host: the sharding groups one host loss takes
    step_s: dict[str, float | None]  # layout -> failure-free step seconds at its own K (None: not allowed or OOM)
    sync_every: dict[str, int | None]
    failures_per_hour: float  # the job's: hosts x the host failure rate
    loss_s: dict[str, float | None]  # per failure: job-seconds of training lost
    overhead: dict[str, float | None]  # snapshot and checkpoint seconds per training second
    goodput: dict[str, float | None]
    useful_work: dict[str, float | None]
    snapshot_break_even_cost_s: float | None  # snapshots beat storage-only while one costs less than this
    inter_host_break_even_rate: float | None  # host failures per host-hour above which inter-host does more work
    double_failure_share: float  # wall time a host and its copy's host lost at once would cost (not in goodput)
    model: FailureModel

    @property
    def best(self) -> str | None:
        work = {k: v for k, v in self.useful_work.items() if v is not None}
        return max(work, key=work.get) if work else None

    def to_json(self) -> dict:
        r = lambda d, n=6: {k: None if v is None else round(v, n) for k, v in d.items()}  # noqa: E731
        rate = self.inter_host_break_even_rate
        rate = None if rate is None or rate == math.inf else rate  # null: inter-host never wins, or cannot run
        lam = self.model.host_failures_per_hour
        return {"hosts": self.hosts, "num_groups": self.num_groups, "groups_per_host": self.groups_per_host,
                "step_ms": {k: None if v is None else round(v * 1e3, 4) for k, v in self.step_s.items()},
                "sync_every": self.sync_every, "failures_per_day": round(self.failures_per_hour * 24, 4),
                "loss_s_per_failure": r(self.loss_s, 3), "overhead": r(self.overhead, 8),
                "goodput": r(self.goodput), "useful_work": r(self.useful_work), "best": self.best,
                "snapshot_break_even_cost_s": None if self.snapshot_break_even_cost_s is None
                else round(self.snapshot_break_even_cost_s, 6),
                "inter_host_break_even_host_failures_per_hour": None if rate is None else float(f"{rate:.4g}"),
                "inter_host_break_even_rate_multiple": None if rate is None or not lam else float(f"{rate / lam:.4g}"),
                "double_failure_share": float(f"{self.double_failure_share:.3g}"), "model": self.model.to_json()}


def goodput_row(gpus: int, gpus_per_node: int, group_size: int, step_s: dict[str, float | None],
                model: FailureModel, sync_every: dict[str, int | None] | None = None) -> GoodputRow:
    """Expected goodput at T = `gpus` with sharding groups of L = `group_size`, from each layout's
    failure-free step seconds (`step_s`, None where the layout is not allowed or does not fit).

    Hosts H = T / G fail independently at lambda = `host_failures_per_hour` each, so the job meets
    F = H lambda failures per hour of wall time. A failure costs the job `loss` seconds of training
    (first order: F x loss is the share of wall time lost, valid while it is small), and every
    training second pays `overhead` seconds of snapshots and checkpoints, so
        goodput = (1 - F x loss) / (1 + overhead),
    with R = restart_s, S = snapshot_every_s (cost s), C = checkpoint_every_s (cost c), h = heal_s:
    - host-local, peer snapshots: every group restarts and goes back to the newest snapshot, half
      an interval on average: loss = R + S/2; overhead = s/S + c/C (storage checkpoints stay, for
      a loss of both copies). With one host the snapshots die with it: loss = R + C/2.
    - host-local, storage only: every group restarts from the newest checkpoint: loss = R + C/2;
      overhead = c/C.
    - inter-host (M >= 2, two hosts or more): only the g sharding groups on the lost host (g = G/L
      when L < G, else 1) restart and heal from a live peer while the other M - g train on at full
      speed: loss = (R + h) x g/M; overhead = c/C (no snapshots: a peer holds every shard).
    Not priced: detection and the first step after a restore (0.1 and 0.2 s measured), reading a
    snapshot or a checkpoint back, waiting for a replacement host (a spare is assumed), a
    survivor's slowdown while a group heals, planned interruptions. A host lost together with a
    host keeping its copy (either ring neighbour, within R + S of each other) goes to storage;
    its expected share of wall time, F x 2 lambda (R + S) x (C - S)/2, is `double_failure_share`, kept
    out of the goodput (below 1e-6 at the published rate).

    `useful_work` multiplies each goodput by its layout's step speed relative to the faster one;
    the break-evens say where the choice turns: the snapshot cost under which snapshots beat
    storage-only, and the host failure rate above which inter-host beats snapshots."""
    G = min(gpus, gpus_per_node)
    H = max(1, gpus // G)
    M = gpus // group_size
    lam_s = model.host_failures_per_hour / 3600.0
    F = H * lam_s  # the job's failures per second of wall time
    R, S, C = model.restart_s, model.snapshot_every_s, model.checkpoint_every_s
    ckpt, snap = model.checkpoint_cost_s / C, model.snapshot_cost_s / S
    g = max(1, G // group_size)
    storage_loss = R + C / 2
    hl_ok = step_s.get("host-local") is not None
    ih_ok = step_s.get("inter-host") is not None and M >= 2 and H >= 2
    loss = {"host_local_snapshots": (R + S / 2 if H >= 2 else storage_loss) if hl_ok else None,
            "host_local_storage": storage_loss if hl_ok else None,
            "inter_host": (R + model.heal_s) * g / M if ih_ok else None}
    overhead = {"host_local_snapshots": snap + ckpt if hl_ok else None, "host_local_storage": ckpt if hl_ok else None,
                "inter_host": ckpt if ih_ok else None}
    goodput = {k: None if loss[k] is None else max(0.0, 1 - F * loss[k]) / (1 + overhead[k]) for k in RECOVERIES}
    steps = [v for v in step_s.values() if v is not None]
    fastest = min(steps) if steps else None
    speed = {k: None if goodput[k] is None else fastest / step_s[RECOVERY_LAYOUT[k]] for k in RECOVERIES}
    work = {k: None if goodput[k] is None else goodput[k] * speed[k] for k in RECOVERIES}

    s_even = None
    if hl_ok and H >= 2 and F * storage_loss < 1:  # (1 - F loss_a)/(1 + s/S + c/C) = (1 - F loss_b)/(1 + c/C)
        s_even = S * (1 + ckpt) * ((1 - F * loss["host_local_snapshots"]) / (1 - F * storage_loss) - 1)
    rate_even = None
    if hl_ok and ih_ok:  # A (1 - F D_a) = B (1 - F D_c), solved for F
        A = speed["host_local_snapshots"] / (1 + overhead["host_local_snapshots"])
        B = speed["inter_host"] / (1 + overhead["inter_host"])
        den = A * loss["host_local_snapshots"] - B * loss["inter_host"]
        if B >= A:
            rate_even = 0.0
        elif den > 0:
            rate_even = (A - B) / den * 3600.0 / H
        else:
            rate_even = math.inf
    double = F * 2 * lam_s * (R + S) * max(0.0, C - S) / 2 if hl_ok and H >= 2 else 0.0
    return GoodputRow(gpus=gpus, hosts=H, num_groups=M, groups_per_host=g, step_s=dict(step_s),
                      sync_every=dict(sync_every or {}), failures_per_hour=F * 3600.0, loss_s=loss,
                      overhead=overhead, goodput=goodput, useful_work=work, snapshot_break_even_cost_s=s_even,
                      inter_host_break_even_rate=rate_even, double_failure_share=double, model=model)


def layout_candidates(model: ModelTables, cluster: Cluster, group_size: int,
                      sync_every: Sequence[int]) -> dict[str, Candidate]:
    """The 2-D job at M = T / L in each layout the grid allows, each at its own planner K."""
    M = cluster.gpus // group_size
    return {lay: _best_k(model, cluster, M, sync_every, layout=lay) for lay in layouts_for(cluster, M)}


def dmt_exchange(model: ModelTables, cluster: Cluster, towers: int, compression: float) -> DmtExchange:
    """SPTT's exchange in place of the model-parallel plan's flat all-to-all over T ranks.

    The flat plan (TorchRec's, for one group of all T workers, as `model_parallel` prices it) gives
    each worker's all-to-all time, ids and embeddings apart; at the flat all-to-all's bandwidth
    that is the worker's exchange volume in bytes. In DMT the same volume goes over the intra-tower
    all-to-all (T/N ranks), then the peer all-to-all (N ranks, one per tower, on N different
    hosts) carries the ids and 1/CR of the embeddings; each priced at the cost form's all-to-all
    bandwidth for its world size and ranks per node. Every all-to-all of the step
    (A2A_PER_SHARDING_TYPE per sharding type) pays the latency of both instead of the flat one's.
    With N = 1 this is the flat exchange."""
    T, W, B, cost = cluster.gpus, cluster.workers_per_node, cluster.batch_per_gpu, cluster.cost
    N = towers
    Lt = T // N
    group = plan_group(model, T, W, B, cost, dense_memory_bytes(model, B))  # model_parallel's plan (cached)
    calls = A2A_PER_SHARDING_TYPE * len(group.sharding)
    flat_bw = cost.bandwidth(T, W, "all_to_all")
    intra_bw = cost.bandwidth(Lt, min(Lt, W), "all_to_all")
    peer_bw = cost.bandwidth(N, 1, "all_to_all")
    hosts, tower_hosts = T // W, max(1, Lt // W)
    ids_in = group.input_comms_s or (0.0,) * T
    best = None
    for comms, ids_s in zip(group.comms_s, ids_in):
        ids, emb = ids_s * flat_bw, (comms - ids_s) * flat_bw
        intra = (ids + emb) / intra_bw
        peer_bytes = ids + emb / compression
        cross = peer_bytes / peer_bw if N > 1 else 0.0
        if best is None or intra + cross > best[0] + best[1]:
            best = (intra, cross, ids, emb, comms, peer_bytes)
    intra, cross, ids, emb, comms, peer_bytes = best
    latency = calls * (cost.a2a_latency(Lt, min(Lt, W)) + (cost.a2a_latency(N, 1) if N > 1 else 0.0))
    # what leaves a host: the peer all-to-all's (N-1)/N, and (towers of several hosts) the intra-tower's
    cross_bytes = peer_bytes * (N - 1) / N + (ids + emb) * (tower_hosts - 1) / tower_hosts
    return DmtExchange(
        towers=N, tower_size=Lt, compression=float(compression),
        flat_s=max(group.comms_s) + calls * cost.a2a_latency(T, W), intra_tower_s=intra, cross_host_s=cross,
        latency_s=latency, cross_host_world_size=N if N > 1 else 0, flat_cross_host_world_size=T if hosts > 1 else 0,
        ids_bytes=ids, embedding_bytes=emb, cross_host_bytes=cross_bytes,
        flat_cross_host_bytes=(ids + emb) * (hosts - 1) / hosts)


def dmt(model: ModelTables, cluster: Cluster, option: DmtOption, sync_every: Sequence[int] = (1,),
        flat: Candidate | None = None) -> tuple[Candidate, DmtExchange]:
    """The DMT row at one GPU count: the model-parallel candidate (`flat`, priced if not given) with
    its embedding all-to-all replaced by `dmt_exchange`."""
    flat = flat if flat is not None else model_parallel(model, cluster, cluster.gpus, sync_every)
    ex = dmt_exchange(model, cluster, option.towers_at(cluster.gpus, cluster.gpus_per_node), option.compression)
    return replace(flat, lookup_a2a_s=ex.exchange_s), ex


def simulate(model: ModelTables, gpus: Sequence[int], group_size: int, batch_per_gpu: int, gpus_per_node: int,
             cost_for, sync_every: Sequence[int] = DEFAULT_SYNC_EVERY, progress=None,
             dmt_option: DmtOption | None = None,
             failure_model: FailureModel | None = FailureModel()) -> list[SimRow]:
    """Rows for every T in `gpus` and both strategies (and "dmt" with `dmt_option`). `cost_for(T)`
    gives the hardware cost form. With a `failure_model` every "2d" row carries its goodput under
    host failures (`goodput_row`)."""
    if not gpus:
        raise PlanError("--gpus needs at least one GPU count")
    for T in gpus:
        if T < group_size or T % group_size:
            raise PlanError(f"--gpus {T} is not a multiple of --sharding-group-size L={group_size}: 2-D needs "
                            f"T = M x L")
        if dmt_option is not None:
            if T > gpus_per_node and T % gpus_per_node:
                raise PlanError(f"--gpus T={T} is not a whole number of nodes of --gpus-per-node {gpus_per_node}")
            dmt_option.towers_at(T, gpus_per_node)
    rows: list[SimRow] = []
    base: dict[str, tuple[int, float] | None] = {}

    memory: MemorySummary | None = None

    def add(T: int, strategy: str, c: Candidate, ex: DmtExchange | None = None, good: GoodputRow | None = None) -> None:
        if strategy not in base:
            base[strategy] = (T, c.qps) if c.feasible else None
        ref = base[strategy]
        factor = None
        if ref is not None and c.feasible:
            factor = (c.qps / ref[1]) / (T / ref[0])
        rows.append(SimRow(T, strategy, c, factor, ex, memory, good))

    for T in sorted(gpus):
        t0 = time.perf_counter()
        cluster = Cluster(gpus=T, gpus_per_node=gpus_per_node, batch_per_gpu=batch_per_gpu, cost=cost_for(T))
        memory = memory_summary(model, T, cluster.cost.capacity, dense_memory_bytes(model, batch_per_gpu))
        priced: dict[str, Candidate] = {}
        for strategy, price in STRATEGIES.items():
            priced[strategy] = price(model, cluster, group_size, sync_every)
            good = None
            if strategy == "2d" and failure_model is not None:
                # every layout was priced for the row already (the planner's plans are cached)
                by_layout = layout_candidates(model, cluster, group_size, sync_every)
                good = goodput_row(T, gpus_per_node, group_size,
                                   {lay: c.step_s if c.feasible else None for lay, c in by_layout.items()},
                                   failure_model, {lay: c.sync_every for lay, c in by_layout.items()})
            add(T, strategy, priced[strategy], good=good)
        if dmt_option is not None:
            add(T, "dmt", *dmt(model, cluster, dmt_option, sync_every, flat=priced.get("model_parallel")))
        if progress:
            progress(f"T={T:<5} priced in {time.perf_counter() - t0:.1f}s")
    return rows


def format_rows(rows: Sequence[SimRow], model: ModelTables, group_size: int, batch: int) -> str:
    lines = [
        f"{model.name}: {describe(model)} | batch {batch} per GPU | "
        f"2-D sharding groups of L={group_size}",
        "",
        f"{'GPUs':>6}  {'strategy':<15} {'M':>4} {'K':>3} {'layout':<10} {'step ms':>8} {'QPS M/s':>9} {'scaling':>8} "
        f"{'tables':>7} {'optim':>6} {'activ':>6} {'dense':>6} {'peak GB':>8}  {'OOM':<3}",
    ]
    for r in rows:
        c = r.candidate
        qps = "-" if r.oom else f"{c.qps / 1e6:.3f}"
        sf = "-" if r.scaling_factor is None else f"{r.scaling_factor:.3f}"
        lines.append(f"{r.gpus:>6}  {r.strategy:<15} {c.num_groups:>4} {c.sync_every:>3} {c.layout:<10} "
                     f"{c.step_s * 1e3:>8.2f} {qps:>9} {sf:>8} {c.tables_bytes / GB:>7.2f} {c.optimizer_bytes / GB:>6.2f} "
                     f"{c.activation_bytes / GB:>6.2f} {c.dense_bytes / GB:>6.2f} {c.peak_bytes / GB:>8.2f}  "
                     f"{'OOM' if r.oom else 'no'}")
    lines += ["", "scaling: QPS speed-up over the smallest GPU count / the GPU-count multiplier (1.0 = linear); "
                  "K: the planner's sync interval for that M; memory (GB): the fullest GPU's tables, optimizer state, "
                  "lookup activations (TorchRec's input and output estimates) and dense part."]
    rw = [r for r in rows if r.candidate.row_wise_dense_bytes > 0]
    if rw:
        lines += ["", f"row-wise output exchange, {exchange_label(model)}, MB a worker sends per step forward "
                      f"(as many back): dense -> priced"]
        lines += [f"{r.gpus:>6}  {r.strategy:<15} {r.candidate.row_wise_dense_bytes / 1e6:>10.2f} -> "
                  f"{r.candidate.row_wise_bytes / 1e6:.2f}" for r in rw]
    by_t = {r.gpus: r.memory for r in rows if r.memory is not None}
    if by_t:
        lines += [""] + by_t[min(by_t)].lines(min(by_t), rows[0].candidate.capacity_bytes)[:1]
        lines += [f"  T={T}: M copies fit for " + (f"uncompressed M <= {m.max_groups_uncompressed}, compressed "
                                                   f"M <= {m.max_groups}" if m.compressed_tables else
                                                   f"M <= {m.max_groups}") for T, m in sorted(by_t.items())]
    dmt_rows = [r for r in rows if r.dmt is not None]
    if dmt_rows:
        flat = {r.gpus: r for r in rows if r.strategy == "model_parallel"}
        lines += ["", "DMT: the model-parallel plan with SPTT's exchange (slowest worker, per step; x-host MB: what "
                      "it sends to other hosts)",
                  f"{'GPUs':>6} {'N':>4} {'T/N':>4} {'CR':>5} {'x-host ranks':>12} {'flat a2a ms':>11} "
                  f"{'intra ms':>8} {'x-host ms':>9} {'lat ms':>7} {'DMT a2a ms':>10} {'x-host MB':>15} "
                  f"{'QPS vs MP':>9}"]
        for r in dmt_rows:
            ex, mp = r.dmt, flat.get(r.gpus)
            ranks = f"{ex.flat_cross_host_world_size} -> {ex.cross_host_world_size}"
            mb = f"{ex.flat_cross_host_bytes / 1e6:.1f} -> {ex.cross_host_bytes / 1e6:.1f}"
            vs = "-" if mp is None or r.oom or mp.oom else f"{r.candidate.qps / mp.candidate.qps:.2f}x"
            lines.append(f"{r.gpus:>6} {ex.towers:>4} {ex.tower_size:>4} {ex.compression:>5g} {ranks:>12} "
                         f"{ex.flat_s * 1e3:>11.2f} {ex.intra_tower_s * 1e3:>8.2f} {ex.cross_host_s * 1e3:>9.2f} "
                         f"{ex.latency_s * 1e3:>7.2f} {ex.exchange_s * 1e3:>10.2f} {mb:>15} {vs:>9}")
        lines += ["", "N towers of T/N GPUs (whole hosts); intra: the intra-tower all-to-all's bandwidth time, x-host: "
                      "the peer all-to-all's (ids + embeddings / CR), lat: both all-to-alls' fixed costs; not priced: "
                      "the tower modules' compute and a tower-aware table plan."]
    good = [r.goodput for r in rows if r.goodput is not None]
    if good:
        lines += [""] + format_goodput(good)
    return "\n".join(lines)


GOODPUT_LABELS = {"host_local_snapshots": "snapshots", "host_local_storage": "storage", "inter_host": "inter-host"}


def format_goodput(good: Sequence[GoodputRow]) -> list[str]:
    """The goodput table: one line per T, then what it assumes."""
    fm = good[0].model
    num = lambda v, f="{:.4f}": "-" if v is None else f.format(v)  # noqa: E731
    ms = lambda v: num(None if v is None else v * 1e3, "{:.2f}")  # noqa: E731
    cols = " ".join(f"{GOODPUT_LABELS[k]:>10}" for k in RECOVERIES)
    lines = ["goodput under host failures (2-D, M = T/L, each layout at its own K): goodput = useful training time / "
             "wall time; work = goodput x the layout's failure-free step speed over the faster layout's",
             f"{'GPUs':>6} {'hosts':>5} {'M':>4} {'fail/day':>8} {'HL ms':>7} {'IH ms':>7}  goodput: {cols}  "
             f"work: {cols}  {'best':<10} {'IH wins at':>10} {'snap pays <':>11}"]
    for g in good:
        rate = g.inter_host_break_even_rate
        lam = fm.host_failures_per_hour
        wins = ("-" if rate is None else "never" if rate == math.inf else f"{rate / lam:.3g}x rate" if lam
                else f"{rate:.3g}/h")
        lines.append(
            f"{g.gpus:>6} {g.hosts:>5} {g.num_groups:>4} {g.failures_per_hour * 24:>8.3f} "
            f"{ms(g.step_s.get('host-local')):>7} {ms(g.step_s.get('inter-host')):>7}  goodput: "
            + " ".join(f"{num(g.goodput[k]):>10}" for k in RECOVERIES) + "  work: "
            + " ".join(f"{num(g.useful_work[k]):>10}" for k in RECOVERIES)
            + f"  {GOODPUT_LABELS.get(g.best, '-'):<10} {wins:>10} {num(g.snapshot_break_even_cost_s, '{:.3g} s'):>11}")
    lines += [f"host failures {fm.host_failures_per_hour:.3g} per host-hour (--host-failures-per-hour; Meta's Llama 3 "
              f"pre-training, plan/constants.py); restart {fm.restart_s:g} s, heal {fm.heal_s:g} s; a snapshot every "
              f"{fm.snapshot_every_s:g} s costing {fm.snapshot_cost_s:.3g} s (provisional); a storage checkpoint every "
              f"{fm.checkpoint_every_s:g} s costing {fm.checkpoint_cost_s:.3g} s. Per failure: snapshots lose restart + "
              f"half a snapshot interval of every group, storage restart + half a checkpoint interval, inter-host "
              f"(restart + heal) of the lost host's groups only. 'IH wins at': the host failure rate (x the one above) "
              f"above which inter-host trains more; 'snap pays <': the snapshot cost under which snapshots beat "
              f"storage-only. A host and the host keeping its copy lost at once: at most "
              f"{max(g.double_failure_share for g in good):.2g} of wall time, not in the goodput."]
    return lines


def failure_model_from_args(args: argparse.Namespace) -> FailureModel:
    """The failure flags (`--host-failures-per-hour`, `--restart-s`, ...); a missing one keeps its default."""
    given = {f: getattr(args, f) for f in FailureModel.__dataclass_fields__ if getattr(args, f, None) is not None}
    return FailureModel(**given)


def dmt_option_from_args(args: argparse.Namespace) -> DmtOption | None:
    """`--dmt`, `--towers N`, `--tower-compression CR`: any of them adds the DMT rows."""
    towers, cr = getattr(args, "towers", None), getattr(args, "tower_compression", None)
    if not (getattr(args, "dmt", False) or towers is not None or cr is not None):
        return None
    return DmtOption(towers=towers, compression=1.0 if cr is None else cr)


def run_cli(args: argparse.Namespace) -> int:
    try:
        model, _ = apply_args(resolve_model(args.spec, args.tables), args)
        gpus = parse_int_list(args.gpus, "--gpus")
        ks = parse_int_list(args.sync_every, "--sync-every")
        L = args.sharding_group_size
        if isinstance(L, bool) or not isinstance(L, int) or L < 1:
            raise PlanError(f"--sharding-group-size must be a positive integer, got {L!r}")
        cost = gpu_cost(args)
        option = dmt_option_from_args(args)
        failures = failure_model_from_args(args)
        if not args.json:
            print(f"[simulate] pricing {len(gpus)} GPU counts x {2 + (option is not None)} strategies with TorchRec's "
                  f"planner ...", file=sys.stderr, flush=True)
        progress = None if args.json else (lambda m: print(f"[simulate] {m}", file=sys.stderr, flush=True))
        rows = simulate(model, gpus, L, args.batch_per_gpu, args.gpus_per_node, lambda T: cost, ks, progress,
                        dmt_option=option, failure_model=failures)
    except (PlanError, TablesError, OptionsError) as e:
        print(f"recgrid simulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps([r.to_json() for r in rows]) if args.json else format_rows(rows, model, L, args.batch_per_gpu))
    return 0
