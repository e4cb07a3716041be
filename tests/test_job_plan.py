"""One planner (issue 31): a job's `model.sharding: auto` and `recgrid plan` are the same search,
priced for the device the job runs on.

- For the demo's shape on this machine (jobs/local_demo.yaml: T=4 CPU workers, gloo), `recgrid plan
  --config` prints, table by table, exactly the plan the launcher makes for the job
  (`launch.ray.job_plan`, called directly: no Ray job), at M = 1 and M = 2.
- The CPU form of the cost model prices with the measured figures (constants.CPU_MEASURED, kept
  equal to bench/results/calibrate_cpu.json), `recgrid plan --device cpu` describes a CPU cluster.
- Ties between plans go to the one with less communication; the estimator speed-up is
  version-guarded; no file in plan/ is over 400 lines.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from recgrid.cli import main

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "jobs" / "local_demo.yaml"


@pytest.fixture
def recgrid(capsys, monkeypatch):
    """`recgrid ARGS...` in this process: its exit code, stdout and stderr."""
    monkeypatch.chdir(REPO)

    def run(*args: str) -> SimpleNamespace:
        code = main(list(args))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
    return run


@pytest.mark.parametrize("groups", [1, 2])
def test_recgrid_plan_recommends_the_plan_the_demo_job_runs(recgrid, groups):
    from recgrid.config import load_config
    from recgrid.engine.sharding import plan_record
    from recgrid.launch.ray import job_plan

    overrides = [f"grid.num_groups={groups}"]
    job = plan_record(job_plan(load_config(DEMO, overrides)))
    p = recgrid("plan", "--config", str(DEMO), "--set", *overrides, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["cluster"]["device"] == "cpu" and out["cluster"]["gpus"] == 4
    planned = out["job"]
    assert (planned["num_groups"], planned["layout"]) == (groups, "host-local")
    by_table = {key.rsplit(".", 1)[-1]: rec for key, rec in job.items()}
    assert set(by_table) == set(planned["tables"]) and len(by_table) == 26
    for table, label in planned["tables"].items():
        rec = by_table[table]
        assert label == f"{rec['sharding_type']}@{','.join(map(str, rec['ranks']))}", table
        assert [s["shard_rank"] for s in rec["shards"]] == rec["ranks"]
    # on this machine's measured figures the demo is planned all table-wise (one kernel, one set of
    # all-to-alls), the type the measurements found fastest at M = 1 and M = 2
    assert planned["sharding"] == {"table_wise": 26}


def test_plan_describes_a_cpu_cluster(recgrid):
    p = recgrid("plan", "--spec", "tiny", "--device", "cpu", "--gpus", "4", "--gpus-per-node", "4",
                "--batch-per-gpu", "256", "--sync-every", "1,5", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["cluster"]["device"] == "cpu" and out["cluster"]["hbm_gb"] is None
    assert "calibrate_cpu" in out["cluster"]["cpu_profile"]
    assert sorted({c["num_groups"] for c in out["candidates"]}) == [1, 2, 4]
    assert out["recommended"] is not None and "job" not in out
    p = recgrid("plan", "--spec", "tiny", "--device", "cpu", "--gpus", "4", "--batch-per-gpu", "256",
                "--cpu-profile", "/nonexistent/calibration.json")
    assert p.returncode == 2 and "--cpu-profile" in p.stderr and "/nonexistent/calibration.json" in p.stderr
    p = recgrid("plan", "--spec", "tiny", "--gpus", "4")
    assert p.returncode == 2 and "--batch-per-gpu is required" in p.stderr


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_a_one_shard_column_wise_table_is_priced_as_table_wise(device):
    """The planner runs such a table table-wise (`partitioners.one_shard_columns_as_tables`):
    TorchRec's estimators give the two options the same time and memory, shard by shard."""
    from recgrid.plan import enumerators
    from recgrid.plan.constants import CPU_MEASURED, H100_SXM
    from recgrid.plan.estimators import CpuCost, GpuCost
    from recgrid.plan.tables import tables_from_spec

    cost = CpuCost(CPU_MEASURED, 4) if device == "cpu" else GpuCost(H100_SXM, 8)
    model, L = tables_from_spec("tiny"), 4
    with enumerators.quiet_torchrec():
        from recgrid.plan.enumerators import _meta_module, _sharder  # noqa: F401 - the raw enumeration
        from torchrec.distributed.embedding_types import EmbeddingComputeKernel
        from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
        from torchrec.distributed.planner.types import ParameterConstraints

        constraints = {t.name: ParameterConstraints(sharding_types=["table_wise", "column_wise"],
                                                    compute_kernels=[EmbeddingComputeKernel.FUSED.value],
                                                    pooling_factors=[t.pooling]) for t in model.tables}
        options = EmbeddingEnumerator(topology=cost.topology(L, L), batch_size=256,
                                      constraints=constraints).enumerate(_meta_module(model), [_sharder()])
    shards = lambda so: [(s.perf.total, s.storage.hbm, s.storage.ddr) for s in so.shards]  # noqa: E731
    for t in model.tables:
        tw = next(so for so in options if so.name == t.name and so.sharding_type == "table_wise")
        cw = next(so for so in options if so.name == t.name and so.sharding_type == "column_wise")
        assert len(cw.shards) == 1 and shards(tw) == shards(cw), t.name


def test_measured_cpu_figures_are_the_calibrations():
    from recgrid.plan.constants import CPU_MEASURED, SOURCES, CpuProfile

    committed = CpuProfile.load(REPO / "bench" / "results" / "calibrate_cpu.json")
    for name in ("cores", "world_size", "compute_slowdown", "a2a_latency", "a2a_bandwidth", "allreduce_latency",
                 "allreduce_bandwidth", "lookup_bandwidth", "lookup_call_overhead", "dense_seconds_per_sample",
                 "dense_call_overhead", "sharded_step_overhead", "reduce_scatter_bandwidth"):
        assert getattr(CPU_MEASURED, name) == getattr(committed, name), name
    assert {"cpu_measured", "cpu_reduce_scatter"} <= set(SOURCES)
    # no reduce-scatter measured: a ring reduce-scatter moves half an all-reduce's bytes
    assert CPU_MEASURED.reduce_scatter_rate(2) == 2 * CPU_MEASURED.allreduce_bandwidth[2]


def test_ties_go_to_less_communication():
    from recgrid.plan.constants import TIE_TOLERANCE
    from recgrid.plan.partitioners import GroupPlan
    from recgrid.plan.proposers import Placed, pick

    def placed(rating: float, comms: float) -> Placed:
        plan = GroupPlan(group_size=2, per_node=2, sharding={"table_wise": 1}, lookup_s=(1.0, 1.0),
                         comms_s=(comms, comms), weight_bytes=(1, 1), optimizer_bytes=(1, 1), activation_bytes=(0, 0),
                         fits=True, proposals=0, seconds=0.0)
        return Placed(plan, rating, [], [])

    fast_chatty, close_quiet, slow_silent = placed(1.0, 0.5), placed(1.0 + TIE_TOLERANCE / 2, 0.1), placed(1.5, 0.0)
    assert pick([fast_chatty, close_quiet, slow_silent]) is close_quiet
    assert pick([fast_chatty, slow_silent]) is fast_chatty


def test_estimator_speedup_is_version_guarded(monkeypatch):
    from torchrec.distributed.planner.estimator import annotations

    from recgrid.plan import estimator_lookups

    assert estimator_lookups.applies("1.8.0") and not estimator_lookups.applies("1.9.2")
    original = annotations._get_annotated_method
    monkeypatch.setattr(estimator_lookups, "torchrec_version", lambda: "9.9.0")
    with estimator_lookups.memoized_estimator_lookups():
        assert annotations._get_annotated_method is original  # an untested TorchRec is left alone
    monkeypatch.setattr(estimator_lookups, "torchrec_version", lambda: "1.8.0")
    with estimator_lookups.memoized_estimator_lookups():
        assert annotations._get_annotated_method is not original
    assert annotations._get_annotated_method is original


def test_sharding_plan_from_placements():
    from recgrid.plan.partitioners import TablePlacement
    from recgrid.plan.planner import sharding_plan
    from recgrid.plan.report import mix_text

    placements = [TablePlacement("a", "table_wise", "fused", (((10, 8), (0, 0), 1),)),
                  TablePlacement("b", "column_wise", "fused", (((5, 4), (0, 0), 0), ((5, 4), (0, 4), 1)))]
    plan = sharding_plan(placements, "model.sparse_arch.embedding_bag_collection", "cpu", 2)
    module = plan.plan["model.sparse_arch.embedding_bag_collection"]
    assert module["a"].ranks == [1] and module["b"].ranks == [0, 1]
    assert [str(s.placement) for s in module["b"].sharding_spec.shards] == ["rank:0/cpu", "rank:1/cpu"]
    assert module["b"].sharding_spec.shards[1].shard_offsets == [0, 4]
    assert mix_text({p.name: p.label() for p in placements}) == "column_wise 1, table_wise 1"


def test_no_plan_module_over_400_lines():
    long = {p.name: n for p in (REPO / "platform" / "recgrid" / "plan").glob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_one_shard_column_wise_runs_table_wise_only_where_it_adds_no_type():
    from recgrid.plan.partitioners import GroupPlan, TablePlacement, one_shard_columns_as_tables

    def plan(*placements: TablePlacement) -> GroupPlan:
        from collections import Counter

        return GroupPlan(group_size=2, per_node=2, sharding=dict(Counter(p.sharding_type for p in placements)),
                         lookup_s=(1.0, 1.0), comms_s=(0.1, 0.1), weight_bytes=(1, 1), optimizer_bytes=(1, 1),
                         activation_bytes=(0, 0), fits=True, proposals=0, seconds=0.0, placements=placements)

    whole = TablePlacement("a", "column_wise", "fused", (((10, 8), (0, 0), 0),))
    split = TablePlacement("b", "column_wise", "fused", (((10, 4), (0, 0), 0), ((10, 4), (0, 4), 1)))
    tw = TablePlacement("c", "table_wise", "fused", (((10, 8), (0, 0), 1),))
    assert one_shard_columns_as_tables(plan(whole, tw)).sharding == {"table_wise": 2}
    assert one_shard_columns_as_tables(plan(whole)).sharding == {"table_wise": 1}
    assert one_shard_columns_as_tables(plan(whole, split, tw)).sharding == {"table_wise": 2, "column_wise": 1}
    kept = plan(whole, split)  # table-wise would be a type of its own: unchanged
    assert one_shard_columns_as_tables(kept) is kept
