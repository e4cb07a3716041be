"""Model quality of QR-compressed embeddings (with and without a head cache) against their
memory, on the real engine (T = 4 gloo workers on CPU, M = 2 sharding groups): issue 16, part 5,
after RecScale's Table 2.

The question: QR compression (a quotient table of ceil(n / c) rows and a remainder table of c
rows per large table) cuts embedding memory by about c, at some cost in eval NE; does a small
full-precision head cache for each compressed table's most frequent ids recover that cost at
equal memory? Every run trains the same rows in the same order; only the embedding layout (and,
for the "wide" runs, the over-arch width) differs.

Configurations (all at T = 4, M = 2, so L = 2; 3 seeds; a seed draws the planted model, its rows
and the initialisation):
- `none`: uncompressed tables (the baseline every gap is paired with, by seed);
- `qr`: QR with c in {4, 16}, each of the operations mult, add, concat;
- `qr+head`: the same six, plus a head cache;
- `qr+head+wide`: QR + head cache at c = 16, each operation, with the bytes it frees against the
  uncompressed model reinvested in the over-arch: its first layer is widened to the widest W whose
  extra parameters fit in the freed bytes (`wide_over_arch`), so the model's total bytes are the
  uncompressed model's (RecScale's ablation: is the memory better spent on the MLP?).

The one setting, fixed up front for every configuration (nothing is tuned per configuration):
- data: `data.synth`'s planted-signal rows of the `tiny` spec (26 one-hot tables of 3 to 4,000
  rows, dim 16; power-law ids with signal on frequent and rare ids). A single pass over fresh rows:
  300 steps of 4 x 256 rows = 307k training rows (the same rows as bench/quality.py's), 65k
  held-out rows of the same planted model (stream 1) for eval.
- compression: `qr_threshold_rows` = 1000, so the 14 tables of 1,024 to 4,000 rows (31,832 of the
  34,459 rows) are compressed and the 12 small ones (2,627 rows) are kept; c and the operation as
  listed. Head cache: `head_rows` = 256 per compressed table (3,584 head rows in all), the 256 most
  frequent ids of each counted over the seed's training rows exactly as a job counts them
  (`data.stream.id_counts`, one Ray Data pass over the training file, then
  `data.specs.head_from_counts`: what `data.stream.head_ids` does); the JSON records the share
  of lookups the head covers. With this H, QR + head at c = 16 needs fewer bytes than QR alone at
  c = 4, which is the equal-memory comparison the verdict makes.
- optimizers: the engine's defaults (embedding row-wise AdaGrad lr 0.05, eps 1e-8, c = M moment
  scaling; dense AdaGrad lr 0.01), K = 1, table-wise sharding, fp32 tables.
- 300 steps keeps the 48 runs (3 seeds x 16 configurations) inside about 20-25 minutes on 2 CPU
  cores (the committed run took 15 minutes, 879 s, on the shared 2-core machine).

The verdict's rule (`verdict`), fixed before the study was run. gap(X) = NE(X, seed) -
NE(none, seed), mean and standard error (std / sqrt(n)) over seeds. For each QR + head
configuration H, its equal-memory comparator Q is the QR-alone configuration with the same
operation and the fewest embedding bytes that are still >= H's (so the head cache never gets
more memory than the QR run it is judged against); H without such a Q is not judged. "QR loses"
when gap(Q) > 2 SE; H "recovers" QR's loss when QR loses and gap(H) <= max(2 SE of gap(H),
gap(Q) / 4) (within noise of uncompressed, or under a quarter of QR's loss). The answer is "yes"
if every judged pair recovers, "no" if none does, "partly" otherwise; if QR loses nothing
measurable in any pair, there is nothing to recover and the answer says so.

Writes bench/results/compression.json (configuration, machine, per-run figures, the aggregated
table, the verdict) and bench/results/compression.png; prints the table. Progress goes to stderr.
One `run_local` spawn holds all seeds and configurations: each worker reads its rows once per
seed and builds a fresh trainer per configuration on the same process groups.

SRP against dense row-wise (issue 16 part 5's other half: exchange bytes and step time at L = 2
and 4, one-hot and multi-hot) is `bench/srp.py`'s measurement: this script calls its `measure()`
with its defaults and keeps the rows under "srp" in the same JSON. `--parts` runs one part alone
(quality ~20 min, srp a few minutes on 2 cores); the other part's entry already in `--out` is
kept, so the two may run as separate invocations.

    .venv/bin/python bench/compression.py [--parts quality,srp] [--seeds 0,1,2] [--steps 300] [--out PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from recgrid.data.specs import Compression, embedding_bytes, head_from_counts
from recgrid.data.specs import SPARSE_NAMES, DatasetSpec, get_spec
from recgrid.engine.grid import Grid
from recgrid.launch.local import run_local
from recgrid.launch.report import write_result

# bench/quality.py's data plumbing and arithmetic (the same rows, read the same way) and
# bench/srp.py, imported by their own names from this folder: the local launcher's processes
# import this module again, and they get this process's sys.path
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from quality import HeldOut, int_list, mean_std, read_arrow, train_rows  # noqa: E402

WORLD_SIZE = 4
NUM_GROUPS = 2
BASE_OVER_ARCH = (64, 32, 1)  # the engine's default (engine.model.ModelSpec.over_arch)


@dataclass(frozen=True)
class Setting:
    """The study's one setting (see the module docstring for why these values)."""

    spec: str = "tiny"
    embedding_dim: int = 16
    batch_per_worker: int = 256
    steps: int = 300
    eval_rows: int = 65_536
    eval_batch: int = 1024
    qr_threshold_rows: int = 1000
    head_rows: int = 256
    sharding: str = "table_wise"


@dataclass(frozen=True)
class RunConfig:
    """One configuration: kind "none" | "qr" | "qr+head" | "qr+head+wide"; c and op for QR."""

    kind: str
    c: int = 0
    op: str = "-"

    @property
    def label(self) -> str:
        return "uncompressed" if self.kind == "none" else f"{self.kind} c={self.c} {self.op}"

    def compression(self, setting: Setting) -> Compression | None:
        if self.kind == "none":
            return None
        head = setting.head_rows if self.kind != "qr" else 0
        return Compression(setting.qr_threshold_rows, self.c, self.op, head_rows=head)


OPS = ("mult", "add", "concat")


def study_configs() -> list[RunConfig]:
    return ([RunConfig("none")]
            + [RunConfig("qr", c, op) for c in (4, 16) for op in OPS]
            + [RunConfig("qr+head", c, op) for c in (4, 16) for op in OPS]
            + [RunConfig("qr+head+wide", 16, op) for op in OPS])


# ---- sizes ------------------------------------------------------------------------------------------
def over_arch_params(in_dim: int, layers: tuple[int, ...]) -> int:
    """Weights and biases of an MLP of `layers` on `in_dim` inputs."""
    n, prev = 0, in_dim
    for width in layers:
        n += prev * width + width
        prev = width
    return n


def over_arch_in_dim(dim: int) -> int:
    """DLRM's interaction output: the dense embedding and the pairwise dots of the 26 + 1 vectors."""
    f = len(SPARSE_NAMES) + 1
    return dim + f * (f - 1) // 2


def wide_over_arch(freed_bytes: int, dim: int, bytes_per_param: int = 4) -> tuple[int, ...]:
    """BASE_OVER_ARCH with its first layer widened to the widest W whose extra parameters fit in
    `freed_bytes` (fp32 parameters)."""
    budget = over_arch_params(over_arch_in_dim(dim), BASE_OVER_ARCH) + freed_bytes // bytes_per_param
    w = BASE_OVER_ARCH[0]
    while over_arch_params(over_arch_in_dim(dim), (w + 1,) + BASE_OVER_ARCH[1:]) <= budget:
        w += 1
    return (w,) + BASE_OVER_ARCH[1:]


# ---- data -------------------------------------------------------------------------------------------
def draw(spec: DatasetSpec, rows: int, seed: int, stream: int) -> Any:
    from recgrid.data.synth import synth_table

    return synth_table(spec, rows, seed, stream=stream)


def write_seed_data(tmp: Path, spec: DatasetSpec, setting: Setting, seed: int, threshold: Compression) -> dict:
    """Draw one seed's training and eval rows once (Arrow files the workers map, and the training
    rows as a parquet file for the head count), and count the head ids over the training rows as
    a job does. Returns the head ids per compressed feature and what they cover."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recgrid.data.stream import id_counts, scan_inputs

    train = draw(spec, setting.steps * setting.batch_per_worker * WORLD_SIZE, seed, stream=0)
    held_out = draw(spec, setting.eval_rows, seed, stream=1)
    for name, table in (("train", train), ("eval", held_out)):
        with pa.OSFile(str(tmp / f"seed{seed}-{name}.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
    parquet = tmp / f"seed{seed}-train.parquet"
    pq.write_table(train, str(parquet))
    counts = id_counts(scan_inputs(str(parquet), spec), spec, threshold.features(spec))
    heads, coverage = {}, {}
    for f, (ids, n) in counts.items():
        heads[f] = head_from_counts(ids, n, head_rows=setting.head_rows)
        coverage[SPARSE_NAMES[f]] = round(float(n[np.isin(ids, heads[f])].sum() / n.sum()), 4)
    parquet.unlink()
    return {"heads": heads, "head_coverage": coverage}


# ---- the workers ------------------------------------------------------------------------------------
def study_worker(configs: list[RunConfig], seeds: list[int], setting: Setting, heads: dict, tmp: str) -> list[dict]:
    """Every configuration for every seed on this worker; rank 0 returns the records."""
    import torch
    import torch.distributed as dist

    from recgrid.config import defaults
    from recgrid.data.stream import memory_batches
    from recgrid.train.trainer import Trainer
    from recgrid.trainer_config import EngineConfig

    rank = dist.get_rank()
    spec = get_spec(setting.spec)
    grid = Grid(WORLD_SIZE, NUM_GROUPS)
    groups = grid.build_process_groups("cpu")  # once: every trainer of this spawn shares them
    cpu = torch.device("cpu")
    B, T = setting.batch_per_worker, WORLD_SIZE
    base_bytes = embedding_bytes(spec, setting.embedding_dim)
    records = []
    for seed in seeds:
        train_table = read_arrow(Path(tmp) / f"seed{seed}-train.arrow").take(train_rows(setting.steps, T, B, rank))
        held = read_arrow(Path(tmp) / f"seed{seed}-eval.arrow")
        per = len(held) // T
        held = held.slice(rank * per, per if rank < T - 1 else len(held) - rank * per)
        cache: dict[tuple, tuple[list, list]] = {}  # the ids' transform depends on c and the head only
        for cfg in configs:
            t0 = time.perf_counter()
            comp = cfg.compression(setting)
            if comp is not None and comp.wants_head:
                comp = comp.with_heads(heads[seed])
            key = (cfg.c, comp is not None and comp.wants_head)
            if key not in cache:
                cache[key] = (memory_batches(train_table, B, spec, compression=comp),
                              memory_batches(held, setting.eval_batch, spec, drop_last=False, compression=comp))
            train, held_out = cache[key]
            nbytes = embedding_bytes(spec, setting.embedding_dim, compression=comp)
            over = wide_over_arch(base_bytes - nbytes, setting.embedding_dim) if cfg.kind == "qr+head+wide" \
                else BASE_OVER_ARCH
            config = EngineConfig.from_job(defaults(), spec=spec, seed=seed, sharding=setting.sharding, sync_every=1,
                                           delayed_moment_sync=False)
            config = replace(config, model=replace(config.model, embedding_dim=setting.embedding_dim,
                                                   over_arch=over)).with_compression(comp)
            trainer = Trainer(grid, groups, config, cpu)
            loop = trainer.run(iter(train), setting.steps)
            metrics = trainer.evaluate(HeldOut(held_out))
            trainer.close()
            tail = loop.losses[-50:]
            record = {
                **asdict(cfg), "label": cfg.label, "seed": seed, "embedding_bytes": nbytes,
                "over_arch": list(over),
                "over_arch_params": over_arch_params(over_arch_in_dim(setting.embedding_dim), over),
                "steps": loop.steps, "eval_ne": metrics["eval/ne"], "eval_auc": metrics["eval/auc"],
                "eval_logloss": metrics["eval/logloss"], "train_loss_last50": sum(tail) / len(tail),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            dist.barrier()
            if rank == 0:
                records.append(record)
                print(f"[compression] seed {seed} {cfg.label}: {nbytes} B, eval NE {record['eval_ne']:.5f} "
                      f"AUC {record['eval_auc']:.4f} ({record['seconds']:.0f} s)", file=sys.stderr, flush=True)
        del cache
    return records


# ---- aggregation ------------------------------------------------------------------------------------
def config_key(r: dict) -> tuple:
    return (r["kind"], r["c"], r["op"])


KIND_ORDER = {"none": 0, "qr": 1, "qr+head": 2, "qr+head+wide": 3}


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per configuration: embedding bytes, compression ratio (uncompressed bytes / its
    bytes), NE and AUC mean ± std over seeds, and the gaps to uncompressed paired by seed (NE:
    absolute and in % of uncompressed's NE; AUC: absolute), mean ± std and the gap's standard error."""
    base = {r["seed"]: r for r in runs if r["kind"] == "none"}
    base_bytes = statistics.fmean(r["embedding_bytes"] for r in base.values()) if base else None
    by: dict[tuple, list[dict]] = {}
    for r in runs:
        by.setdefault(config_key(r), []).append(r)
    rows = []
    for key in sorted(by, key=lambda k: (KIND_ORDER[k[0]], k[1], OPS.index(k[2]) if k[2] in OPS else -1)):
        rs = sorted(by[key], key=lambda r: r["seed"])
        kind, c, op = key
        nbytes = statistics.fmean(r["embedding_bytes"] for r in rs)
        row = {"kind": kind, "c": c, "op": op, "label": rs[0]["label"], "seeds": [r["seed"] for r in rs],
               "n": len(rs), "embedding_bytes": int(round(nbytes)), "over_arch": rs[0]["over_arch"],
               "compression_ratio": round(base_bytes / nbytes, 3) if base_bytes else None}
        row["ne_mean"], row["ne_std"] = mean_std([r["eval_ne"] for r in rs])
        row["auc_mean"], row["auc_std"] = mean_std([r["eval_auc"] for r in rs])
        paired = [r for r in rs if r["seed"] in base]
        if paired:
            gap = [r["eval_ne"] - base[r["seed"]]["eval_ne"] for r in paired]
            row["gap_mean"], row["gap_std"] = mean_std(gap)
            row["gap_se"] = row["gap_std"] / math.sqrt(len(gap))
            row["gap_pct_mean"], row["gap_pct_std"] = mean_std(
                [100.0 * (r["eval_ne"] / base[r["seed"]]["eval_ne"] - 1.0) for r in paired])
            row["auc_gap_mean"], row["auc_gap_std"] = mean_std(
                [r["eval_auc"] - base[r["seed"]]["eval_auc"] for r in paired])
        rows.append(row)
    return rows


def verdict(table: list[dict]) -> dict:
    """The rule of the module docstring: each QR + head configuration against the QR-alone
    configuration of its operation with the fewest bytes >= its own."""
    qr = [r for r in table if r["kind"] == "qr" and "gap_mean" in r]
    pairs = []
    for h in (r for r in table if r["kind"] == "qr+head" and "gap_mean" in r):
        bigger = [q for q in qr if q["op"] == h["op"] and q["embedding_bytes"] >= h["embedding_bytes"]]
        if not bigger:
            continue
        q = min(bigger, key=lambda q: q["embedding_bytes"])
        qr_loses = q["gap_mean"] > 2 * q["gap_se"]
        recovers = qr_loses and h["gap_mean"] <= max(2 * h["gap_se"], q["gap_mean"] / 4)
        pairs.append({"head": h["label"], "head_bytes": h["embedding_bytes"], "qr": q["label"],
                      "qr_bytes": q["embedding_bytes"], "qr_gap": q["gap_mean"], "qr_gap_se": q["gap_se"],
                      "head_gap": h["gap_mean"], "head_gap_se": h["gap_se"],
                      "qr_loses": qr_loses, "recovers": recovers})
    losing = [p for p in pairs if p["qr_loses"]]
    if not pairs:
        answer, text = "not judged", "no QR + head configuration has a QR-alone comparator with as many bytes"
    elif not losing:
        answer = "nothing to recover"
        text = "QR alone loses no NE above noise in any equal-memory pair, so there is no loss to recover"
    else:
        n = sum(p["recovers"] for p in losing)
        answer = "yes" if n == len(pairs) else "no" if n == 0 else "partly"
        text = (f"the head cache recovers QR's NE loss at equal memory in {n} of {len(pairs)} pairs "
                f"(QR loses above noise in {len(losing)})")
    lines = [f"{p['head']} ({p['head_bytes']} B): NE gap {p['head_gap']:+.5f} ± {p['head_gap_se']:.5f} vs "
             f"{p['qr']} ({p['qr_bytes']} B): {p['qr_gap']:+.5f} ± {p['qr_gap_se']:.5f} -> "
             f"{'recovers' if p['recovers'] else 'does not recover' if p['qr_loses'] else 'QR loses nothing'}"
             for p in pairs]
    return {"answer": answer, "text": text, "pairs": pairs, "lines": lines}


def print_table(table: list[dict], extra: dict) -> None:
    print(f"{'configuration':<28} {'emb. bytes':>10} {'ratio':>6} {'eval NE':>19} {'eval AUC':>17} "
          f"{'NE gap, %':>16} {'AUC gap':>18}")
    for r in table:
        gap = f"{r['gap_pct_mean']:+.3f} ± {r['gap_pct_std']:.3f}" if r["kind"] != "none" and "gap_pct_mean" in r else "-"
        agap = f"{r['auc_gap_mean']:+.4f} ± {r['auc_gap_std']:.4f}" if r["kind"] != "none" and "auc_gap_mean" in r else "-"
        print(f"{r['label']:<28} {r['embedding_bytes']:>10} {r['compression_ratio'] or 0:>6.2f} "
              f"{r['ne_mean']:>9.5f} ± {r['ne_std']:.5f} {r['auc_mean']:>8.4f} ± {r['auc_std']:.4f} "
              f"{gap:>16} {agap:>18}")
    for k, v in extra.items():
        print(f"{k}: {v}")


# ---- plot -------------------------------------------------------------------------------------------
def plot(table: list[dict], path: Path) -> None:
    """Left: eval NE (mean ± std over seeds) against embedding bytes; right: the NE gap to
    uncompressed paired by seed (mean ± std), which the seeds' spread of NE does not blur.
    Operations sharing a size are drawn slightly apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {"mult": "tab:blue", "add": "tab:orange", "concat": "tab:green", "-": "black"}
    shift = {"mult": 0.97, "add": 1.0, "concat": 1.03, "-": 1.0}
    markers = {"none": "*", "qr": "o", "qr+head": "s", "qr+head+wide": "^"}
    for ax, y, err in ((left, "ne_mean", "ne_std"), (right, "gap_pct_mean", "gap_pct_std")):
        seen = set()
        for r in table:
            if y not in r:
                continue
            tag = (r["kind"], r["op"])
            label = None if tag in seen else "uncompressed" if r["kind"] == "none" else f"{r['kind']} {r['op']}"
            seen.add(tag)
            x = r["embedding_bytes"] / 1024 * shift[r["op"]]
            ax.errorbar([x], [r[y]], yerr=[r[err]], color=colors[r["op"]], marker=markers[r["kind"]],
                        ms=10 if r["kind"] == "none" else 7, capsize=3, ls="none", label=label,
                        mfc="none" if r["kind"] == "qr+head+wide" else None)
            if r["kind"] in ("qr", "qr+head") and r["op"] == "mult":
                ax.annotate(f"c={r['c']}", (x, r[y]), textcoords="offset points", xytext=(-22, 4), fontsize=7)
        base = next((r for r in table if r["kind"] == "none"), None)
        if base and y in base:
            ax.axhline(base[y], color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("embedding bytes of one model copy (KiB, log)")
    left.set_ylabel("eval NE (mean ± std over seeds)")
    left.set_title("eval NE")
    right.set_ylabel("eval NE gap to uncompressed, % (paired by seed, mean ± std)")
    right.set_title("NE gap to uncompressed")
    right.legend(fontsize=7, ncol=2)
    fig.suptitle("recgrid: QR compression and the head cache (tiny spec, T = 4, M = 2, 3 seeds)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------------------
def srp_measure() -> list[dict]:
    """bench/srp.py's rows (SRP against dense row-wise at L = 2, 4; one-hot and multi-hot)."""
    import srp

    return srp.measure()


def quality_part(a: argparse.Namespace) -> tuple[dict, list[dict]]:
    """The NE/AUC study: its JSON entries and the aggregated table."""
    import ray

    from recgrid.launch.report import machine_info

    setting = Setting(steps=a.steps)
    spec = get_spec(setting.spec)
    configs = study_configs()
    if a.configs:
        want = set(a.configs.split(","))
        configs = [c for c in configs if c.label in want]
    t_start = time.perf_counter()
    threshold = Compression(setting.qr_threshold_rows, 4, head_rows=setting.head_rows)
    data: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="recgrid-compression-") as tmp:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            for seed in a.seeds:
                data[seed] = write_seed_data(Path(tmp), spec, setting, seed, threshold)
        finally:
            ray.shutdown()
        heads = {seed: d["heads"] for seed, d in data.items()}
        print(f"[compression] {len(configs)} configurations x {len(a.seeds)} seeds on T={WORLD_SIZE}, "
              f"M={NUM_GROUPS}", file=sys.stderr, flush=True)
        runs = run_local(study_worker, WORLD_SIZE, configs, a.seeds, setting, heads, tmp, timeout_s=4 * 3600)[0]
    table = aggregate(runs)
    compressed = threshold.features(spec)
    return {
        "configuration": {
            "world_size": WORLD_SIZE, "num_groups": NUM_GROUPS, "global_batch": WORLD_SIZE * setting.batch_per_worker,
            **asdict(setting), "seeds": a.seeds, "model": "dlrm", "backend": "gloo", "device": "cpu",
            "base_over_arch": list(BASE_OVER_ARCH),
            "compressed_tables": [SPARSE_NAMES[f] for f in compressed],
            "compressed_rows": sum(spec.table_rows[f] for f in compressed),
            "uncompressed_rows": sum(spec.table_rows),
            "embedding_bytes": "weights of every table of one model copy, fp32 (data.specs.embedding_bytes)",
            "gap": "eval NE(config, seed) - eval NE(uncompressed, seed), paired by seed; gap_pct relative to it",
        },
        "machine": machine_info(),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "head_coverage": {str(s): d["head_coverage"] for s, d in data.items()},
        "verdict": verdict(table),
        "table": table,
        "runs": runs,
    }, table


def main() -> None:
    import json

    from recgrid.launch.report import machine_info

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="quality,srp", help="quality, srp or both (the other's entry in --out is kept)")
    ap.add_argument("--seeds", type=int_list, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=Setting.steps)
    ap.add_argument("--configs", default="", help="labels to run (comma separated; pilots only): all by default")
    ap.add_argument("--out", default="bench/results/compression.json")
    ap.add_argument("--plot", default="bench/results/compression.png")
    ap.add_argument("--plot-only", action="store_true", help="redraw --plot from --out's table; run nothing")
    a = ap.parse_args()
    if a.plot_only:
        plot(json.loads(Path(a.out).read_text())["table"], Path(a.plot))
        return
    parts = set(a.parts.split(","))
    if not parts or parts - {"quality", "srp"}:
        ap.error(f"--parts: quality and/or srp, got {a.parts!r}")
    out = Path(a.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    result["benchmark"] = "compression"
    if "quality" in parts:
        quality, table = quality_part(a)
        result.update(quality)
        write_result(out, result)
        plot(table, Path(a.plot))
        v = result["verdict"]
        print_table(table, {"verdict": f"{v['answer']}: {v['text']}",
                            **{f"pair {i}": s for i, s in enumerate(v["lines"])}, "wall_s": result["wall_s"]})
    if "srp" in parts:
        t0 = time.perf_counter()
        rows = srp_measure()
        result["srp"] = {"source": "bench/srp.py measure() with its defaults", "machine": machine_info(),
                         "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}
        write_result(out, result)
        print(f"{'L':>2} {'spec':<14} {'dense B/step':>13} {'sparse B/step':>13} {'ratio':>6} "
              f"{'dense ms':>9} {'sparse ms':>9}")
        for r in rows:
            print(f"{r['L']:>2} {r['spec']:<14} {r['dense_bytes_per_step']:13.0f} {r['sparse_bytes_per_step']:13.0f} "
                  f"{r['sparse_over_dense'] or 0:6.3f} {r['dense_step_time_median_s'] * 1e3:9.1f} "
                  f"{r['sparse_step_time_median_s'] * 1e3:9.1f}")
    print(f"written: {out}" + (f", {a.plot}" if "quality" in parts else ""))


if __name__ == "__main__":
    main()
