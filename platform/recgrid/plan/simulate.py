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

Host failures (`--host-failures-per-hour` and the recovery constants, plan/goodput.py): under the
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
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from recgrid.plan.constants import GB
from recgrid.plan.cli import gpu_cost, parse_int_list
from recgrid.plan.cluster import Cluster, PlanError, layouts_for
from recgrid.plan.goodput import FailureModel, GoodputRow, failure_model_from_args, format_goodput, goodput_row
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
