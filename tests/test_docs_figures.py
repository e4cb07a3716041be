"""The figures the docs quote are the committed bench/results files' (issue 17, acceptance 6;
issue 30): each is recomputed here from its file and looked up in the page that quotes it
(docs/performance.md, docs/design-notes.md, README.md), so a rerun of `make bench` that moves a
figure fails until the page says the new one, and so does a page whose figure is edited. A doc
that quotes a results file names it with the key its figure comes from (`node_loss.json`,
`results.group_per_node`): every file named so must be read here. Pure Python, no runs."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


DOCS = ("README.md", "docs/performance.md", "docs/design-notes.md", "docs/reference.md", "k8s/README.md",
        "dashboards/README.md")


def page(doc: str = "docs/performance.md") -> str:
    return f"{doc}: " + re.sub(r"\s+", " ", (ROOT / doc).read_text())


def said(text: str, *figures: str) -> None:
    for f in figures:
        assert re.sub(r"\s+", " ", f) in text, f"{text.split(':', 1)[0]} does not say {f!r}"


def listing(values: list[float], fmt: str = "{:.2f}") -> str:
    """`a, b, c and d`, as the page writes a list of figures."""
    out = [fmt.format(v) for v in values]
    return ", ".join(out[:-1]) + " and " + out[-1]


def test_simulate_figures():
    text = page()
    runs = json.loads((RESULTS / "simulate.json").read_text())["runs"]
    t2 = runs["table2_1.7tb"]["summary"]
    big = ["512", "1024", "2048", "4096"]
    said(text, listing([t2["2d"][T]["scaling_factor"] for T in big]),
         listing([t2["model_parallel"][T]["scaling_factor"] for T in big]))
    rows = [r for r in runs["table2_1.7tb"]["rows"] if r["strategy"] == "model_parallel"]
    assert not any(r["oom"] for r in rows)
    peak = [r["peak_memory_gb"] for r in rows]
    said(text, f"at most {max(r['memory_gb']['lookup_activations'] for r in rows):.1f} GB",
         f"{min(peak):.0f}-{max(peak):.0f} GB in all")
    for batch, cr1, cr4 in ((4096, "batch 4096: {}x", "{}x at CR = 4"), (1024, "batch 1024, {}x", "and {}x.")):
        ranges = []
        for cr in (1, 4):
            rows = runs[f"dmt_0.5tb_b{batch}_cr{cr}"]["rows"]
            mp = {r["gpus"]: r["qps"] for r in rows if r["strategy"] == "model_parallel"}
            ratio = [r["qps"] / mp[r["gpus"]] for r in rows if r["strategy"] == "dmt"]
            ranges.append(f"{min(ratio):.2f}-{max(ratio):.2f}")
        said(text, cr1.format(ranges[0]), cr4.format(ranges[1]))


def test_calibration_figures():
    cal = json.loads((RESULTS / "calibrate_cpu.json").read_text())
    pct = lambda rows: listing([r["error"] * 100 for r in rows], "{:+.0f}%")  # noqa: E731
    said(page(), pct(cal["check"]["rows"]), pct(cal["check_microbenchmark_latencies"]["rows"]))


def test_plan_quality_figures():
    summary = json.loads((RESULTS / "plan_quality.json").read_text())["summary"]
    for m in ("1", "2"):
        s = summary[m]
        best = s["best_fixed"]
        assert s["meets_bar"]
        said(page(), f"{s['auto_over_best_fixed']:.2f}x at M = {m} ({s['median_qps']['auto']:,.0f} vs "
                     f"{best.replace('_', '-')} {s['median_qps'][best]:,.0f}")


def test_quality_figures():
    text = page()
    q = json.loads((RESULTS / "quality.json").read_text())
    mp = {r["seed"]: r["eval_ne"] for r in q["runs"] if r["kind"] == "model_parallel"}
    gap = {(r["num_groups"], r["c"], r["sync_every"], r["delayed"], r["seed"]): 100 * (r["eval_ne"] / mp[r["seed"]] - 1)
           for r in q["runs"] if r["kind"] == "2d"}
    pairs = [(M, K, s) for M in (4, 8) for K in (1, 5, 25) for s in mp]
    wins = sum(gap[(M, "M", K, False, s)] < gap[(M, "1", K, False, s)] for M, K, s in pairs)
    said(text, f"c = M beats c = 1 in {wins} of {len(pairs)} seed-paired runs")
    k25 = {M: statistics.mean(gap[(M, "M", 25, False, s)] - gap[(M, "M", 5, False, s)] for s in mp) for M in (4, 8)}
    assert all(gap[(M, "M", 25, False, s)] > gap[(M, "M", 5, False, s)] for M in (4, 8) for s in mp)
    said(text, f"by {k25[8]:.2f} points on average at M = 8 and {k25[4]:.2f} at M = 4")
    row = {(r["num_groups"], r["c"], r["sync_every"], r["delayed"]): r for r in q["table"] if r["kind"] == "2d"}
    r = row[(8, "1", 1, False)]
    said(text, f"{r['gap_pct_mean']:+.2f} ± {r['gap_pct_std']:.2f} at M = 8")
    for K in (1, 5, 25):
        for c in ("1", "M"):
            cells = " | ".join(f"{row[(M, c, K, False)]['gap_pct_mean']:+.2f}".replace("-", "−") for M in (2, 4, 8))
            said(text, f"| {K} | {c} | {cells} |")
    moved = max(abs(row[(M, c, K, True)]["gap_pct_mean"] - row[(M, c, K, False)]["gap_pct_mean"])
                for M in (2, 4, 8) for c in ("1", "M") for K in (1, 5, 25))
    assert moved <= 0.08, moved
    said(text, "no gap by more than 0.08 points")
    e = q["embedding_learning_matters"]
    said(text, f"M = 1 reaches eval NE {e['model_parallel_ne']:.3f} (a dense-only model {e['dense_only_ne']:.3f}, "
               f"the planted model itself {e['bayes_ne']:.3f})")


def test_towers_figures():
    text = page()
    t = json.loads((RESULTS / "towers.json").read_text())
    for p in t["partitioner"]:
        said(text, f"| {p['towers']} | {p['purity']:.3f} ({p['strided_purity']:.3f}) |")
    for s in t["summary"]:
        said(text, f"| {s['eval_ne']['mean']:.3f} ± {s['eval_ne']['std']:.3f} | {s['eval_auc']['mean']:.3f} ± "
                   f"{s['eval_auc']['std']:.3f} | {s['step_time_s']['mean'] * 1000:.1f} | "
                   f"{s['cross_host_bytes_per_step']:,.0f} | {s['cross_host_world_size']:.0f} |")


def test_compression_figures():
    text = page()
    c = json.loads((RESULTS / "compression.json").read_text())
    for r in c["table"]:
        gap = "—" if r["kind"] == "none" else f"{r['gap_pct_mean']:+.2f} ± {r['gap_pct_std']:.2f}".replace("-", "−")
        agap = "—" if r["kind"] == "none" else f"{r['auc_gap_mean']:+.4f}".replace("-", "−")
        said(text, f"| {r['label']} | {r['embedding_bytes'] / 1024:.0f} | {r['compression_ratio']:.2f}× | "
                   f"{r['ne_mean']:.4f} ± {r['ne_std']:.4f} | {r['auc_mean']:.4f} ± {r['auc_std']:.4f} | {gap} | {agap} |")
    v = c["verdict"]
    assert v["answer"] == "no"  # the page says "does not recover"; a rerun that changes it must change the page
    said(text, "does not recover QR's loss at equal memory on this data",
         f"{sum(p['recovers'] for p in v['pairs'])} of {len(v['pairs'])} judged pairs pass")
    cov = [x for seed in c["head_coverage"].values() for x in seed.values()]
    said(text, f"covering {100 * min(cov):.0f}-{100 * max(cov):.0f}% of each table's lookups")
    ne = {(r["kind"], r["c"], r["op"], r["seed"]): r["eval_ne"] for r in c["runs"]}
    seeds = sorted({r["seed"] for r in c["runs"]})
    wide = [ne[("qr+head+wide", 16, op, s)] > ne[("qr+head", 16, op, s)] for op in ("mult", "add", "concat") for s in seeds]
    said(text, f"({sum(wide)} of {len(wide)} seed-paired runs)")
    assert all(ne[("qr+head", 16, "mult", s)] < ne[("qr", 4, "mult", s)] for s in seeds)  # "in all 3 seeds"
    for r in c["srp"]["rows"]:
        said(text, f"| {r['L']} | {'multi-hot' if r['multi_hot'] else 'one-hot'} | {r['dense_bytes_per_step']:,.0f} | "
                   f"{r['sparse_bytes_per_step']:,.0f} | {r['sparse_over_dense']:.3f} | "
                   f"{r['expected_sparse_over_dense_uniform_ids']:.3f} | {r['dense_step_time_median_s'] * 1e3:.1f} | "
                   f"{r['sparse_step_time_median_s'] * 1e3:.1f} |")


def test_failure_free_figures():
    """What fault tolerance costs when nothing fails, as performance.md quotes it (issue 46, line 5)."""
    ff = json.loads((RESULTS / "recovery.json").read_text())["results"]["tiny"]["failure_free"]
    off = [j["median_qps"] for j in ff["jobs"]["off"]]
    said(page(), f"every mechanism off {ff['off']['median_qps']:,.0f} QPS; failures allowed")
    said(page(), f"{ff['failures_allowed']['median_qps']:,.0f} QPS, {ff['failures_allowed_over_off_qps']:.2f}x")
    said(page(), f"without snapshots {ff['failures_allowed_no_snapshots']['median_qps']:,.0f} QPS, "
                 f"{ff['failures_allowed_no_snapshots_over_off_qps']:.2f}x")
    jobs = ff["jobs"]["failures_allowed"]
    snap, n = [j["snapshot_s"] for j in jobs], [j["snapshots"] for j in jobs]
    said(page(), f"{min(n)}-{max(n)} a job", f"The snapshots took {min(snap):.2f}-{max(snap):.2f} s of a job",
         f"{1e3 * sum(s / k for s, k in zip(snap, n)) / len(n):.1f} ms a snapshot")
    demo = ff["demo"]["median_qps"]
    where = "inside" if min(off) <= demo <= max(off) else "below" if demo < min(off) else "above"
    said(page(), f"{demo:,.0f} QPS, {ff['demo_over_off_qps']:.2f}x, {where} the off jobs' spread "
                 f"({min(off):,.0f}-{max(off):,.0f})")
    assert ff["configuration"]["variants"]["demo"]["snapshot_every_syncs"] == 0  # "the off job's settings"


def test_torchft_quality_figures():
    """A kill's eval NE against failure-free jobs, and against failure-free jobs of as many rows,
    as performance.md quotes it (issue 28, line 9: the measured reason)."""
    q = json.loads((RESULTS / "recovery.json").read_text())["results"]["tiny"]["torchft_quality"]
    same = q["same_rows"]
    rows = sorted(same["rows_trained_with_kill"].values())
    said(page(), f"final eval NE {q['mean_difference']:.4f} worse than the failure-free jobs, "
                 f"{q['mean_difference'] / q['seed_stdev_failure_free']:.1f} seed standard deviations "
                 f"({q['seed_stdev_failure_free']:.4f})",
         f"the killed jobs trained {rows[0]:,}-{rows[-1]:,} rows against {same['rows_trained_failure_free']:,}",
         f"end {-same['mean_difference']:.4f} worse than the killed ones, within 2 seed standard deviations")
    assert not q["within_2_seed_stdev"] and same["within_2_seed_stdev"] and same["mean_difference"] < 0


def test_torchft_recovery_figures():
    """A killed worker's group rebuilt while the others train, as design-notes and the README quote it
    (issue 28, line 1)."""
    r = json.loads((RESULTS / "recovery.json").read_text())["results"]["tiny"]
    a, b = r["torchft"], r["torchft_T6_M3"]
    ratio = lambda x: x["survivors_qps_during"] / x["survivors_qps_before"]  # noqa: E731
    sa, sb = a["seconds"], b["seconds"]
    cpu = a["cpu_during_recovery"]
    core_s, each = cpu["core_s"], cpu["new_train_worker_core_s_before_training_function"]
    said(page("docs/design-notes.md"),
         f"{sa['total']:.1f} s from the kill to the rebuilt group's first committed step (detection "
         f"{sa['detection']:.1f} s; Ray Train's new worker group until recgrid's training function starts "
         f"{sa['replacement']:.1f} s; heal {sa['heal']:.1f} s; first step {sa['first_step']:.1f} s)",
         f"at {ratio(a):.2f}x its QPS before ({a['survivors_qps_during']:,.0f} against {a['survivors_qps_before']:,.0f})",
         f"at T = 6, M = 3 {sb['total']:.1f} s (replacement {sb['replacement']:.1f} s) with both surviving groups "
         f"training throughout ({b['survivors_steps_during']} steps) at {ratio(b):.2f}x",
         f"in those {cpu['window_s']:.1f} s at T = 4", f"workers {core_s['new_train_workers']:.1f} core-seconds, each "
         f"{sum(each) / len(each):.1f} before", f"ahead) {core_s['new_ray_train_actors']:.1f};",
         f"the surviving workers {core_s['surviving_train_workers']:.1f} ({cpu['surviving_train_workers_cores_during']:.2f} "
         f"cores, {cpu['surviving_train_workers_cores_before']:.2f} before the kill); Ray's own processes, job control "
         f"and the driver {core_s['other']:.1f}")
    assert len(b["kept_training"]) == 2 and cpu["cores"] == 2
    said(page("README.md"), f"{sa['total']:.1f} s from the kill to the group's first committed step at T = 4, M = 2",
         f"the survivors at {ratio(a):.2f}x their QPS meanwhile")


def test_node_loss_figures():
    """A lost host under both layouts, as design-notes quotes it (issue 46, acceptance 1)."""
    r = json.loads((RESULTS / "node_loss.json").read_text())["results"]
    for case in r.values():
        assert case["status"] == "FINISHED" and case["mlflow_runs"] == 1 and case["row_audit"]["skipped"] == 0
        assert case["ranks_json_records_every_process"]
    hl4, hl6 = r["host_local_T4_M2"], r["host_local_T6_M3"]
    assert all(e["source"] in ("holder", "peer") for e in hl4["recoveries"] + hl6["recoveries"])
    assert {e["source"] for e in hl6["recoveries"]} == {"holder"}
    first = next(e for e in hl4["recoveries"] if e["source"] == "holder")
    cpu = hl6["cpu_during_recovery"]
    each = cpu["new_train_worker_core_s_before_training_function"]
    said(page("docs/design-notes.md"),
         f"{r['one_per_node']['first_step_after_node_added_s']:.1f} s from the node's join to the group's first "
         f"committed step with one worker per node (T = 2, M = 2), "
         f"{r['group_per_node']['first_step_after_node_added_s']:.1f} s with a group of two per node",
         f"at T = 4, M = 2 the first committed step came {hl4['first_step_after_node_added_s']:.1f} s after the join "
         f"(group {first['sharding_group']} from the holders, {first['steps_lost']} steps trained again of a "
         f"{first['snapshot_interval_steps']}-step snapshot interval",
         f"at T = 6, M = 3 {hl6['first_step_after_node_added_s']:.1f} s (all three from the holders, none trained again)",
         f"{max(c['holder_bytes_max'] or 0 for c in r.values()) / 1e6:.1f} MB the most a host's holder kept",
         f"the six new workers spent {min(each):.1f}-{max(each):.1f} core-seconds each",
         f"synchronization, dataset and placement-group actors) {cpu['core_s']['new_ray_train_actors']:.0f} core-seconds")
    assert all(e["steps_lost"] == 0 for e in hl6["recoveries"])


def test_peer_figures():
    """recgrid train against the fastest plain loop of its shape, as performance.md quotes it (issue 49)."""
    d = json.loads((RESULTS / "peer.json").read_text())
    m, r, runs = d["median_qps"], d["ratios"], d["runs"]
    assert all(len(v) == d["configuration"]["reps"] for v in runs.values())
    assert r["recgrid_m1_over_bare_dmp"] == round(m["recgrid_m1"] / m["bare_dmp"], 4)
    said(page(), f"a bare TorchRec DMP loop {m['bare_dmp']:,.0f} QPS (median of "
                 + ", ".join(f"{x:,.0f}" for x in runs["bare_dmp"]) + ")",
         f"every mechanism off {m['recgrid_m1']:,.0f} QPS, {r['recgrid_m1_over_bare_dmp']:.2f}x",
         f"a bare 2-D loop {m['bare_2d']:,.0f} QPS", f"{m['recgrid_m2']:,.0f} QPS, {r['recgrid_m2_over_bare_2d']:.2f}x",
         f"ran {m['bare_dmp_warm']:,.0f} QPS, {r['bare_dmp_warm_over_bare_dmp']:.2f}x the plain bare loop, within",
         f"`recgrid train` at M = 1 is {m['recgrid_m1'] / m['bare_dmp_warm']:.2f}x")


def test_data_pipeline_figures():
    """Input at the step's speed, as performance.md quotes it (issue 49, acceptance 4)."""
    f = json.loads((RESULTS / "data_pipeline.json").read_text())["figures"]
    mh, oh, pr = f["input_per_core"]["multi_hot"], f["input_per_core"]["one_hot"], f["prepare_ray"]
    said(page(), f"one-hot rows reach ready batches at {oh['rows_per_s_per_core_cpu'] / 1e6:.2f} M rows/s per core",
         f"multi-hot at {mh['rows_per_s_per_core_cpu'] / 1e6:.2f} M (goal 1 M; its repeats spread "
         f"{min(mh['cpu_seconds']):.2f}-{max(mh['cpu_seconds']):.2f} CPU seconds)",
         f"{pr['ratio_per_core_to_pyarrow_cpu']:.2f}x pyarrow's CSV reader per core by CPU time, "
         f"{pr['ratio_per_core_to_pyarrow_wall']:.2f}x by wall time (goal 0.5x)")


def test_every_results_file_a_doc_quotes_is_checked_here():
    """A doc quotes a results file's figure as `<file>.json`, `<key>`: each such file is read above."""
    quoted = set()
    for doc in DOCS:
        quoted |= set(re.findall(r"`([\w.-]+\.json)`,\s*`[\w.<>*/]+", (ROOT / doc).read_text()))
    source = Path(__file__).read_text()
    assert quoted and all((RESULTS / f).exists() for f in quoted), quoted
    unchecked = sorted(f for f in quoted if f'"{f}"' not in source)
    assert not unchecked, f"docs quote figures of {unchecked}, which this module does not check"


def goodput_table_rows(run: dict) -> list[str]:
    """performance.md's goodput table, one line per GPU count, from a `recgrid simulate` run's 2-D rows."""
    out = []
    for r in run["rows"]:
        if r["strategy"] != "2d":
            continue
        f = r["failures"]
        cells = [f"{f[part][k]:.4f}" for part in ("goodput", "useful_work")
                 for k in ("host_local_snapshots", "host_local_storage", "inter_host")]
        out.append(f"| {r['gpus']:,} | {f['hosts']} | {f['num_groups']} | {f['failures_per_day']:.3f} | "
                   f"{f['step_ms']['host-local']:.1f} / {f['step_ms']['inter-host']:.1f} | " + " | ".join(cells)
                   + f" | {f['inter_host_break_even_rate_multiple']:,.0f}× | {f['snapshot_break_even_cost_s']:.3f} s |")
    return out


def test_goodput_figures():
    """The goodput table under host failures and its constants, as performance.md quotes them (issue 46,
    acceptance 7)."""
    from recgrid.plan import constants as k

    sim = json.loads((RESULTS / "simulate.json").read_text())
    run = sim["runs"]["goodput_0.5tb"]
    rows = [r for r in run["rows"] if r["strategy"] == "2d"]
    assert [r["gpus"] for r in rows] == [64, 256, 1024, 4096]
    said(page(), run["command"], *goodput_table_rows(run))
    model = rows[0]["failures"]["model"]
    assert model == {"host_failures_per_hour": k.HOST_FAILURES_PER_HOUR, "restart_s": k.RESTART_S,
                     "heal_s": k.HEAL_S, "snapshot_every_s": k.SNAPSHOT_EVERY_S, "snapshot_cost_s": k.SNAPSHOT_COST_S,
                     "checkpoint_every_s": k.CHECKPOINT_EVERY_S, "checkpoint_cost_s": k.CHECKPOINT_COST_S}
    derived = json.loads((RESULTS / "checkpoint_cost.json").read_text())["runs"]["derived"]
    said(page(), f"| {model['host_failures_per_hour']:.3g} per host-hour |", f"| {model['restart_s']:g} s |",
         f"| {model['heal_s']:g} s |", f"| {model['snapshot_every_s']:g} s |",
         f"| {model['checkpoint_every_s']:g} s |",
         f"{model['checkpoint_cost_s']:.4f} s ({derived['checkpoint_s_mean_over_workers']} s over "
         f"{derived['checkpoints_written']} checkpoints",
         f"{model['snapshot_cost_s'] * 1e3:.3f} ms: the demo's snapshots",
         f"{k.DEMO_SHARD_BYTES / sim['snapshot_copy']['bandwidth'] * 1e3:.3f} ms ({k.DEMO_SHARD_BYTES:,.0f} bytes at "
         f"{sim['snapshot_copy']['bandwidth'] / 1e9:.2f} GB/s")
    f = {r["gpus"]: r["failures"] for r in rows}
    lost = lambda T, key: 100 * (1 - f[T]["goodput"][key])  # noqa: E731
    said(page(), f"storage-only gives up {lost(64, 'host_local_storage'):.2f}% of the job at 64 GPUs, "
                 f"{lost(1024, 'host_local_storage'):.1f}% at 1,024 and {lost(4096, 'host_local_storage'):.1f}% at 4,096",
         f"snapshots {lost(64, 'host_local_snapshots'):.2f}-{lost(4096, 'host_local_snapshots'):.2f}%",
         f"at most {max(x['double_failure_share'] for x in f.values()):.1g} of wall time")
    work = [x["useful_work"]["inter_host"] for x in f.values()]
    said(page(), f"{min(work):.2f}-{max(work):.2f}x as much per wall second")
    slower = [100 * (x["step_ms"]["inter-host"] / x["step_ms"]["host-local"] - 1) for x in f.values()]
    said(page(), f"every step {min(slower):.0f}-{max(slower):.0f}% slower",
         f"restart plus half a snapshot interval ({f[64]['loss_s_per_failure']['host_local_snapshots']:.0f} s of the whole",
         f"half a checkpoint interval ({f[64]['loss_s_per_failure']['host_local_storage']:.0f} s)",
         f"under {f[64]['snapshot_break_even_cost_s'] * 1e3:.0f} ms a minute "
         f"({100 * f[64]['snapshot_break_even_cost_s'] / model['snapshot_every_s']:.2f}% of the time)")
    assert lost(4096, "host_local_storage") < 2  # "a snapshot that costs 2% ... loses more than it saves" everywhere
    assert len({x["goodput"]["inter_host"] for x in f.values()}) == 1  # "the same share at every T"
    assert all(x["best"] == "host_local_snapshots" for x in f.values())
