"""The goodput term of `recgrid simulate`: the expected share of wall time a 2-D job trains when its
hosts fail, for three ways of recovering (host-local with peer-memory snapshots, host-local with
storage checkpoints only, inter-host). The model is `goodput_row`'s docstring; its constants are
plan/constants.py's, each named there with its source."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Sequence

from recgrid.plan.cluster import PlanError
from recgrid.plan.constants import (CHECKPOINT_COST_S, CHECKPOINT_EVERY_S, HEAL_S, HOST_FAILURES_PER_HOUR, RESTART_S,
                                    SNAPSHOT_COST_S, SNAPSHOT_EVERY_S)

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
              f"{fm.snapshot_every_s:g} s costing {fm.snapshot_cost_s:.3g} s; a storage checkpoint every "
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
