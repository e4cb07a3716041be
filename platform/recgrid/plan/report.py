"""The report: a plan (every candidate, the recommendation and why) as the text table and the JSON
`recgrid plan` prints, and the sentence that says why a candidate was recommended."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from recgrid.plan.cluster import Cluster
from recgrid.plan.constants import GB
from recgrid.plan.rating import QPS_TOLERANCE, Candidate, choose
from recgrid.plan.recscale import MemorySummary, describe, exchange_label
from recgrid.plan.tables import ModelTables


@dataclass
class Plan:
    model: ModelTables
    cluster: Cluster
    candidates: list[Candidate]
    recommended: Candidate | None
    reason: str
    seconds: float
    memory: MemorySummary | None = None

    @property
    def max_feasible_groups(self) -> int:
        """The largest M among the candidates that fit (0: none)."""
        return max((c.num_groups for c in self.candidates if c.feasible), default=0)

    def to_json(self) -> dict:
        c = self.cluster
        return {
            "model": {"name": self.model.name, "tables": len(self.model.tables),
                      "table_bytes": self.model.total_bytes, "dense_params": self.model.dense_params,
                      "features": self.model.features},
            "cluster": {"gpus": c.gpus, "gpus_per_node": c.gpus_per_node, "batch_per_gpu": c.batch_per_gpu,
                        "device": c.device,
                        "hbm_gb": round(c.cost.capacity / GB, 3) if c.device == "cuda" else None,
                        **({"cpu_profile": c.cost.profile.source} if c.device == "cpu" else {})},
            "candidates": [x.to_json() for x in self.candidates],
            "recommended": ({"num_groups": self.recommended.num_groups, "sync_every": self.recommended.sync_every}
                            if self.recommended else None),
            "reason": self.reason,
            "planner_seconds": round(self.seconds, 2),
            "exchange": {"row_wise": self.model.row_wise_exchange, "sharding": self.model.sharding},
            "memory": {**(self.memory.to_json() if self.memory else {}),
                       "max_feasible_groups": self.max_feasible_groups},
            **({"job": self.job_json()} if self.job is not None else {}),
        }


    job: Candidate | None = None
    """With `recgrid plan --config`: the job's own (M, K, layout), whose plan the job runs."""

    def job_json(self) -> dict | None:
        j = self.job
        if j is None:
            return None
        return {"num_groups": j.num_groups, "sync_every": j.sync_every, "layout": j.layout,
                "sharding": j.sharding, "tables": {p.name: p.label() for p in j.placements}}


def recommend(candidates: Sequence[Candidate]) -> tuple[Candidate | None, str]:
    """`rating.choose`'s candidate and a sentence saying why."""
    chosen = choose(candidates)
    if chosen is None:
        leanest = min(candidates, key=lambda c: c.peak_bytes)
        return None, (f"no group count fits: the leanest, M={leanest.num_groups}, needs "
                      f"{leanest.peak_bytes / GB:.1f} GB per GPU of {leanest.capacity_bytes / GB:.0f} GB; "
                      f"use more GPUs, a smaller batch or smaller tables")
    return chosen, _reason(chosen, candidates, max(c.qps for c in candidates if c.feasible))


def _memory(c: Candidate, text: str) -> str:
    """`text` with the candidate's peak memory, or "" where memory is not priced (CPU workers)."""
    return "" if c.capacity_bytes == float("inf") else text.format(f"{c.peak_bytes / GB:.1f} GB")


def _reason(rec: Candidate, candidates: Sequence[Candidate], top: float) -> str:
    M, K = rec.num_groups, rec.sync_every
    parts = [f"M={M}, K={K}: {rec.qps / 1e6:.2f} M samples/s" + _memory(rec, " at {} per GPU")]
    base = next((c for c in candidates if c.num_groups == 1), None)
    if base is not None and M > 1:
        gain = [f"{rec.qps / base.qps:.2f}x the QPS of full model parallelism (M=1)"]
        if base.lookup_imbalance > rec.lookup_imbalance * 1.05:
            gain.append(f"lookup imbalance {base.lookup_imbalance:.2f} -> {rec.lookup_imbalance:.2f}")
        d_a2a = (base.lookup_a2a_s + base.lookup_s) - (rec.lookup_a2a_s + rec.lookup_s)
        if d_a2a > 0:
            gain.append(f"{d_a2a * 1e3:.1f} ms less lookup + all-to-all per step with sharding groups of "
                        f"L={rec.group_size}")
        parts.append("; ".join(gain))
    elif M == 1:
        parts.append("full model parallelism: no 2-D candidate beats it by more than "
                     f"{QPS_TOLERANCE:.0%}")
    larger = sorted({c.num_groups for c in candidates if c.num_groups > M})
    if larger:
        nxt = [c for c in candidates if c.num_groups == larger[0]]
        best_next = max(nxt, key=lambda c: (c.feasible, c.qps))
        if not best_next.feasible:
            parts.append(f"M={larger[0]} needs {best_next.peak_bytes / GB:.1f} GB per GPU "
                         f"(> {best_next.capacity_bytes / GB:.0f} GB)")
        elif best_next.qps <= rec.qps:
            parts.append(f"M={larger[0]} is slower ({best_next.qps / 1e6:.2f} M/s at best, replica sync "
                         f"{best_next.sync_per_sync_s * 1e3:.0f} ms per sync)"
                         + _memory(best_next, " and needs {} per GPU"))
        else:
            parts.append(f"M={larger[0]} is at most {best_next.qps / rec.qps - 1:.1%} faster "
                         f"({best_next.qps / 1e6:.2f} M/s), within the {QPS_TOLERANCE:.0%} tie band, for "
                         f"{larger[0] // M}x the copies" + _memory(best_next, " and {} per GPU"))
    if M > 1:
        same_m = [c for c in candidates if c.num_groups == M and c.feasible]
        if K > min(c.sync_every for c in same_m):
            parts.append(f"K={K} is the smallest sync interval within {QPS_TOLERANCE:.0%} of the best QPS "
                         f"(a sync costs {rec.sync_per_sync_s * 1e3:.0f} ms); smaller K keeps replicas closer")
        else:
            parts.append(f"syncing every {K} step(s) costs {rec.sync_s * 1e3:.1f} ms per step")
    return "Recommend " + "; ".join(parts) + "."


def cluster_text(c: Cluster) -> str:
    if c.device == "cpu":
        return (f"T={c.gpus} CPU workers (gloo), {c.workers_per_node} per node, batch {c.batch_per_gpu} per worker, "
                f"CPU figures measured by {c.cost.profile.source}")
    return (f"T={c.gpus} GPUs, {c.gpus_per_node} per node, {c.cost.capacity / GB:.0f} GB each, "
            f"batch {c.batch_per_gpu} per GPU")


def format_plan(plan: Plan) -> str:
    c = plan.cluster
    m = plan.model
    lines = [
        f"{m.name}: {describe(m)}, dense {m.dense_params / 1e6:.1f} M "
        f"params | {cluster_text(c)}",
        "",
        f"{'M':>4} {'L':>5} {'K':>3} {'layout':<10} {'lookup':>7} {'a2a':>7} {'dense':>7} {'d-AR':>6} {'sync':>7} "
        f"{'step':>7} {'QPS':>9} {'imbal':>5} {'tables':>7} {'+repl':>6} {'optim':>6} {'activ':>6} {'dense':>6} "
        f"{'peak GB':>8}  fits",
        f"{'':>4} {'':>5} {'':>3} {'':<10} {'ms':>7} {'ms':>7} {'ms':>7} {'ms':>6} {'ms/step':>7} {'ms':>7} "
        f"{'M/s':>9} {'':>5} {'GB':>7} {'GB':>6} {'GB':>6} {'GB':>6} {'GB':>6}",
    ]
    for x in plan.candidates:
        mark = "*" if plan.recommended is x else " "
        fits = "yes" if x.feasible else "OOM"
        lines.append(
            f"{x.num_groups:>4} {x.group_size:>5} {x.sync_every:>3} {x.layout:<10} {x.lookup_s * 1e3:>7.2f} "
            f"{x.lookup_a2a_s * 1e3:>7.2f} {x.dense_s * 1e3:>7.2f} {x.dense_allreduce_s * 1e3:>6.2f} "
            f"{x.sync_s * 1e3:>7.2f} {x.step_s * 1e3:>7.2f} {x.qps / 1e6:>9.3f} {x.lookup_imbalance:>5.2f} "
            f"{x.tables_bytes / GB:>7.2f} {x.replica_overhead_bytes / GB:>6.2f} {x.optimizer_bytes / GB:>6.2f} "
            f"{x.activation_bytes / GB:>6.2f} {x.dense_bytes / GB:>6.2f} {x.peak_bytes / GB:>8.2f}  {fits}{mark}")
    lines += [
        "",
        "lookup, a2a: the slowest worker's embedding lookup and all-to-all inside its sharding group (TorchRec's "
        "estimators); d-AR: dense all-reduce over all T; sync: replica sync / K; memory: the fullest worker "
        "(+repl: S(M-1)/T of it is the replica overhead).",
    ]
    lines += exchange_lines(plan.candidates, m)
    if plan.memory is not None:
        lines += [""] + plan.memory.lines(c.gpus, c.cost.capacity)
        lines.append(f"largest group count among the priced candidates that fits: "
                     f"{'none' if not plan.max_feasible_groups else f'M={plan.max_feasible_groups}'}")
    lines += ["", plan.reason]
    lines += job_lines(plan.job)
    return "\n".join(lines)


def mix_text(labels: dict[str, str]) -> str:
    """Sharding types by count, from table -> "sharding_type@ranks" (or -> sharding_type):
    "column_wise 6, table_wise 20"."""
    counts = Counter(v.split("@")[0] for v in labels.values())
    return ", ".join(f"{t} {n}" for t, n in sorted(counts.items()))


def job_lines(job: Candidate | None) -> list[str]:
    """The job's own candidate and its plan, table by table (what `model.sharding: auto` runs)."""
    if job is None:
        return []
    mix = mix_text({p.name: p.sharding_type for p in job.placements})
    out = ["", f"the job's plan (M={job.num_groups}, K={job.sync_every}, {job.layout}, what model.sharding: auto "
               f"runs): {mix}; predicted {job.qps:,.0f} samples/s, step {job.step_s * 1e3:.2f} ms"]
    return out + [f"  {p.name:<12} {p.label()}" for p in job.placements]


def exchange_lines(candidates: Sequence[Candidate], model: ModelTables) -> list[str]:
    """The row-wise output exchange per M (the first K of each), when some plan shards row-wise."""
    seen: dict[int, Candidate] = {}
    for x in candidates:
        if x.row_wise_dense_bytes > 0:
            seen.setdefault(x.num_groups, x)
    if not seen:
        return []
    how = exchange_label(model)
    cells = [f"M={m} (L={x.group_size}, {x.sharding.get('row_wise', 0)} tables): "
             f"{x.row_wise_dense_bytes / 1e6:.2f} MB dense -> {x.row_wise_bytes / 1e6:.2f} MB priced"
             for m, x in sorted(seen.items())]
    return ["", f"row-wise output exchange, {how}, MB a worker sends per step forward (as many back):"] + \
        [f"  {c}" for c in cells]


