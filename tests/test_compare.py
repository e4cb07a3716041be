"""`recgrid compare`: a real two-configuration sweep (T=2: M=1 and M=2) on one local Ray cluster, read
back through MLflow: one parent run, a child per configuration, the table as CSV and Markdown and
the chart as artifacts of the parent, the relative columns computed against M=1, and a sweep that
stops at a failure that is not its configuration's. The sweep's refusals and the reference without
M=1 need no cluster."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from recgrid.config import load_config
from recgrid.launch.compare import (
    COLUMNS,
    CompareError,
    add_relative,
    caveat,
    is_configuration_fault,
    markdown_table,
    parse_list,
    plan_sweep,
    reference_note,
    reference_row,
    run_compare,
)

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "jobs" / "local_demo.yaml"
STEPS = 10


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, shared_ray):
    tmp = tmp_path_factory.mktemp("compare")
    uri = f"sqlite:///{tmp}/mlflow.db"
    overrides = [f"data.train={tmp}/data/train/*.parquet", f"data.eval={tmp}/data/eval/*.parquet",
                 "data.synth_rows=6000", "data.synth_eval_rows=2000", "grid.world_size=2",
                 f"train.max_steps={STEPS}", "train.batch_size=64", "train.log_every=5", "train.eval_every=0",
                 "train.checkpoint_every=0", f"train.storage_path={tmp}/ray", f"tracking.tracking_uri={uri}", "tracking.experiment=test-compare"]
    variants = plan_sweep(DEMO, [1, 2], None, overrides)
    result = run_compare(variants, DEMO)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri), result


def test_one_parent_run_with_a_child_per_configuration(sweep):
    client, result = sweep
    assert result.status == "FINISHED", result.rows
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.info.run_name == "compare-T2-M1,2-K5"
    assert parent.data.params["compare.groups"] == "1,2" and parent.data.params["derived.global_batch"] == "128"
    exp = client.get_experiment(parent.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
    assert sorted(c.info.run_name for c in children) == ["T2-M1", "T2-M2-K5"]  # K does not apply to M=1
    assert all(c.info.status == "FINISHED" for c in children)
    assert len(client.search_runs([exp.experiment_id])) == 3  # nothing else
    for c in children:  # the same job but for M (and c = M, which follows it)
        assert c.data.params["grid.world_size"] == "2" and c.data.params["train.batch_size"] == "64"
        assert c.data.params["data.train"] == parent.data.params["data.train"]
        assert c.data.metrics["train/examples_total"] == STEPS * 2 * 64


def test_m1_child_differs_from_m2_only_where_it_should(sweep):
    """The M=1 baseline is the same job but for the grid: every other parameter equal, the same
    metric series, and no replica sync at M=1."""
    client, result = sweep
    runs = {r["M"]: client.get_run(r["run_id"]).data for r in result.rows}
    p1, p2 = runs[1].params, runs[2].params
    assert p1["grid.num_groups"] == "1" and p1["derived.group_size"] == "2" and p2["derived.group_size"] == "1"
    differing = {k for k in set(p1) | set(p2) if p1.get(k) != p2.get(k)}
    expected = {"grid.num_groups", "derived.group_size", "optim.moment_scale", "tracking.run_name",
                "derived.workers_per_node"}
    # where tables sit (the plan is made for L workers) is the artifact sharding_plan.json, not params
    assert differing <= expected
    assert {"grid.num_groups", "derived.group_size"} <= differing
    f1, f2 = runs[1].metrics, runs[2].metrics
    assert f1["sync/count"] == 0 and f1["sync/bytes_total"] == 0
    assert f2["sync/count"] > 0 and f2["sync/bytes_total"] > 0
    # the same metric series exist for both (MLflow's system metrics aside: a sampler logs them only
    # for runs that outlast its interval, which a 10-step child may or may not)
    def series(f):
        return {k for k in f if not k.startswith("system/")}

    # the exchange meter counts table-, column- and row-wise all-to-alls: M=1's sharding group of two
    # (the planner's plan: table-wise here) logs them, M=2's groups of one exchange nothing
    assert {k for k in series(f1) if k.startswith("exchange/bytes/")} and not any(
        k.startswith("exchange/") for k in series(f2))
    assert {k for k in series(f1) if not k.startswith("exchange/")} == series(f2)


def test_table_artifacts_and_relative_columns(sweep, tmp_path):
    client, result = sweep
    names = {a.path for a in client.list_artifacts(result.parent_run_id, "compare")}
    assert names == {"compare/table.csv", "compare/table.md", "compare/chart.png"}
    local = Path(client.download_artifacts(result.parent_run_id, "compare", str(tmp_path)))
    assert (local / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (local / "table.md").read_text() == result.markdown

    rows = {r["config"]: r for r in csv.DictReader(io.StringIO((local / "table.csv").read_text()))}
    ref, m2 = rows["M=1"], rows["M=2 K=5"]
    assert ref["reference"] == m2["reference"] == "M=1"
    assert (ref["M"], ref["L"], m2["M"], m2["L"], m2["K"]) == ("1", "2", "2", "1", "5")
    for key, _, _, kind in COLUMNS:
        rel = f"{key}_rel_{'pp' if kind == 'pp' else 'pct'}"
        assert ref[key] != "", key  # every column has a value
        assert float(ref[rel]) == 0.0
        v, b = float(m2[key]), float(ref[key])
        expected = (v - b) * 100 if kind == "pp" else (v / b - 1) * 100
        assert float(m2[rel]) == pytest.approx(expected), key
    # the figures are the child runs' own
    child = client.get_run(m2["run_id"]).data.metrics
    assert float(m2["qps"]) == pytest.approx(child["train/qps_median"])
    assert float(m2["eval_ne"]) == pytest.approx(child["eval/ne"])
    assert float(ref["sync_share"]) == 0.0 < float(m2["sync_share"]) < 1  # M=1 never syncs replicas
    assert "(ref)" in result.markdown and "relative to M=1" in result.markdown
    assert "pp, better)" in result.markdown or "pp, worse)" in result.markdown or "(+0.0 pp)" in result.markdown
    assert f"for {STEPS} steps" in result.markdown and "within run-to-run noise" in result.markdown  # the caveat
    # what each M ran: its recorded plan's sharding types by count (auto: the planner's plan)
    assert ref["sharding"] and m2["sharding"] and "| sharding " in result.markdown
    assert sum(int(part.split()[-1]) for part in ref["sharding"].split(", ")) == 26
    # one imbalance statistic: the table's is the child's own summary figure
    assert float(m2["lookup_imbalance"]) == pytest.approx(child["imbalance/lookup_max_over_mean_median"])


def test_invalid_sweeps_are_refused_naming_the_value():
    with pytest.raises(CompareError, match=r"--groups 3: grid.num_groups: M=3 must divide grid.world_size T=4"):
        plan_sweep(DEMO, [1, 3], None)
    with pytest.raises(CompareError, match=r"--groups 2 --sync-every 3: train.checkpoint_every"):
        plan_sweep(DEMO, [2], [5, 3], ["train.checkpoint_every=5"])
    with pytest.raises(CompareError, match=r"--groups 'two': not an integer"):
        parse_list("--groups", "1,two")
    with pytest.raises(CompareError, match=r"--groups 2: given twice"):
        parse_list("--groups", "2,2")
    # M=1 has no replica groups: one run for every K
    assert [(v.num_groups, v.sync_every) for v in plan_sweep(DEMO, [1, 2], [1, 5])] == [(1, 1), (2, 1), (2, 5)]


def test_without_m1_the_smallest_m_is_the_reference_and_the_table_says_so():
    rows = [{"config": f"M={m} K=5", "M": m, "L": 8 // m, "status": "FINISHED", "qps": q, "peak_memory_mib": 100.0,
             "mean_memory_mib": 90.0, "lookup_imbalance": 1.2, "sync_share": s, "eval_ne": 0.8, "eval_auc": None}
            for m, q, s in ((2, 1000.0, 0.05), (4, 1500.0, 0.08))]
    rows.reverse()  # the reference is found by compare's rule (the smallest M), not by position
    reference = reference_row(rows)
    assert reference["M"] == 2
    add_relative(rows, reference)
    m4 = rows[0]
    assert m4["qps_rel"] == pytest.approx(50.0) and m4["sync_share_rel"] == pytest.approx(3.0)
    assert m4["eval_auc_rel"] is None
    note = reference_note(rows, reference)
    assert "M=1 is not in the sweep" in note and "relative to M=2 K=5" in note and "add 1 to --groups" in note
    table = markdown_table(rows, reference, note)
    # each change says which way is better: more QPS is, a larger sync share is not
    assert "1,500 (+50.00%, better)" in table and "8.0% (+3.0 pp, worse)" in table and "n/a" in table
    assert "1,000 (ref)" in table


def test_only_a_configuration_s_own_failures_let_the_sweep_go_on():
    assert is_configuration_fault("OutOfMemoryError: CUDA out of memory") and is_configuration_fault("GridError: x")
    assert not is_configuration_fault("CriteoDataError: /data/day_0: glob matches no file")
    assert not is_configuration_fault("ClusterError: cannot join the Ray cluster") and not is_configuration_fault(None)


def test_sweep_stops_at_the_first_failure_that_is_not_the_configuration_s(tmp_path, shared_ray):
    """The data vanish after the sweep was validated (an unmounted volume): the first configuration
    fails, the sweep stops there with one FAILED child and says why, and the parent run is FAILED."""
    from mlflow.tracking import MlflowClient

    from recgrid.data.synth import ensure_synth

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    base = load_config(DEMO, ["grid.world_size=2", "train.max_steps=5", "train.batch_size=64", "data.eval=[]"])
    ensure_synth(f"{tmp_path}/train/*.parquet", 2000, base.dataset_spec(), 0, 0, say=lambda _: None)
    overrides = [f"data.train={tmp_path}/train/*.parquet", "data.eval=[]", "data.synth_if_missing=false",
                 "grid.world_size=2", "train.max_steps=5", "train.batch_size=64", "train.cpus_per_worker=0.25",
                 f"train.storage_path={tmp_path}/ray", f"tracking.tracking_uri={uri}", "tracking.experiment=stops"]
    variants = plan_sweep(DEMO, [1, 2], None, overrides)
    for f in (tmp_path / "train").iterdir():
        f.unlink()
    result = run_compare(variants, DEMO)
    assert result.status == "FAILED" and [r["status"] for r in result.rows] == ["FAILED"]
    assert "CriteoDataError" in result.rows[0]["error"]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("stops")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.status for r in runs) == ["FAILED", "FAILED"]  # the parent and one child, nothing more
    assert "1 of 1 configurations run failed (the sweep stopped; 1 not run)" in client.get_run(result.parent_run_id).data.tags["error"]


def test_the_caveat_names_the_runs_length_and_seed():
    cfg = load_config(DEMO, ["train.max_steps=40", "train.seed=3"])
    text = caveat(cfg, [])
    assert "for 40 steps" in text and "train.seed=3" in text and "other seeds" in text
