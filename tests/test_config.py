"""The job config: defaults, YAML + --set overrides, and failures that name the field."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from recgrid.config import SECTIONS, ConfigError, field_docs, load_config
from recgrid.engine.grid import LAYOUTS, Grid
from recgrid.engine.model import ARCHS
from recgrid.engine.optimizer import DENSE_OPTIMIZERS
from recgrid.engine.sharding import SHARDINGS


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """A working directory with two train shards and one eval shard."""
    (tmp_path / "data").mkdir()
    for name in ("train-0.tsv", "train-1.tsv", "eval-0.tsv"):
        (tmp_path / "data" / name).write_text("0\t1\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _yaml(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_defaults_load(data_dir) -> None:
    cfg = load_config(_yaml(data_dir, "data:\n  train: data/train-*.tsv\n"))
    assert cfg.data.train == ["data/train-*.tsv"] and cfg.data.eval == []
    assert (cfg.grid.world_size, cfg.grid.num_groups, cfg.grid.sync_every) == (4, 1, 1)
    assert cfg.grid.layout == "host-local" and not cfg.grid.delayed_moment_sync
    assert cfg.train.cpus_per_worker == 0.5 and cfg.optim.moment_scale is None
    # nulls resolve from the spec and the grid
    assert cfg.embedding_dim == 16 and cfg.dense_arch == [64, 16] and cfg.moment_scale == 1.0
    assert cfg.run_name == "T4-M1"  # K does not apply without replica groups
    assert cfg.build_grid() == cfg.grid() == Grid(4, 1, "host-local")
    assert load_config(None, ["data.train=data/train-0.tsv"]).to_dict() == load_config(
        _yaml(data_dir, "data: {train: [data/train-0.tsv]}")).to_dict()


def test_overrides(data_dir) -> None:
    cfg = load_config(_yaml(data_dir, "grid: {world_size: 2}\ndata: {train: nothing/*.tsv, synth_if_missing: true}\n"), [
        "grid.world_size=8",
        "grid.num_groups=4",
        "grid.sync_every=5",
        "grid.layout=inter-host",
        "data.train=[data/train-0.tsv, data/train-1.tsv]",
        "data.eval=data/eval-*.tsv",
        "data.spec=criteo_kaggle",
        "data.max_rows_per_table=1000",
        "train.max_steps=30",
        "train.batch_size=128",
        "optim.moment_scale=2.5",
        "optim.lr=1e-3",  # YAML 1.1 reads this as a string; float fields accept it
        "tracking.run_name=2024",
    ])
    assert (cfg.grid.world_size, cfg.grid.num_groups, cfg.grid.sync_every, cfg.grid.layout) == (8, 4, 5, "inter-host")
    assert cfg.build_grid().replica_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert cfg.data.train == ["data/train-0.tsv", "data/train-1.tsv"] and cfg.data.eval == ["data/eval-*.tsv"]
    assert cfg.dataset_spec().name == "criteo_kaggle" and max(cfg.dataset_spec().table_rows) == 1000
    assert (cfg.train.max_steps, cfg.train.batch_size) == (30, 128)
    assert cfg.moment_scale == 2.5 and cfg.optim.lr == 0.001 and cfg.run_name == "2024"
    flat = cfg.to_flat_dict()
    assert flat["grid.num_groups"] == 4 and flat["optim.moment_scale"] == 2.5 and flat["model.embedding_dim"] == 16
    assert flat["data.train"] == ["data/train-0.tsv", "data/train-1.tsv"]
    assert load_config(None, ["data.train=data/*.tsv", "grid.num_groups=2"]).to_flat_dict()["optim.moment_scale"] == 2.0


@pytest.mark.parametrize("overrides,message", [
    (["grid.world_size=6", "grid.num_groups=4"], r"^grid\.num_groups: M=4 must divide grid\.world_size T=6; valid values for T=6: \[1, 2, 3, 6\]"),
    (["data.train=missing/*.parquet"], r"^data\.train: no file matches 'missing/\*\.parquet'"),
    (["data.eval=[data/eval-0.tsv, nope.tsv]"], r"^data\.eval: no file matches 'nope\.tsv'"),
    (["optim.lr=-0.1"], r"^optim\.lr: must be > 0, got -0\.1$"),
    (["optim.nope=1"], r"^optim\.nope: unknown key in --set; valid keys in optim: lr, eps, moment_scale"),
    (["optimizer.lr=1"], r"^optimizer\.lr: unknown section"),
    (["train.max_steps=abc"], r"^train\.max_steps: must be an integer, got 'abc'$"),
    (["train.batch_size=2.5"], r"^train\.batch_size: must be an integer, got 2\.5$"),
    (["train.use_gpu=maybe"], r"^train\.use_gpu: must be true or false"),
    (["grid.layout=diagonal"], r"^grid\.layout: must be one of \['host-local', 'inter-host'\], got 'diagonal'"),
    (["grid.sync_every=0"], r"^grid\.sync_every: must be >= 1, got 0$"),
    (["data.max_rows_per_table=0"], r"^data\.max_rows_per_table: must be >= 1, got 0$"),
    (["data.spec=criteo_2tb"], r"^data\.spec: unknown dataset spec 'criteo_2tb'"),
    (["model.dense_arch=[64, 32]"], r"^model\.dense_arch: must end in the embedding dimension 16"),
    (["model.over_arch=[64, 2]"], r"^model\.over_arch: must end in 1"),
    (["optim.moment_scale=0"], r"^optim\.moment_scale: must be > 0"),
    (["train.cpus_per_worker=0"], r"^train\.cpus_per_worker: must be > 0"),
    (["train.resources_per_worker=4"], r"^train\.resources_per_worker: must be a mapping, got 4$"),
    (["train.resources_per_worker={trainer_node: 0}"], r"^train\.resources_per_worker\.trainer_node: must be > 0, got 0"),
    (["train.resources_per_worker={trainer_node: lots}"], r"^train\.resources_per_worker\.trainer_node: must be a number"),
    (["train.resources_per_worker={' ': 1}"], r"^train\.resources_per_worker: a resource name must not be empty"),
    (["train.resources_per_worker={CPU: 1}"], r"^train\.resources_per_worker\.CPU: .*use train\.cpus_per_worker$"),
    (["train.resources_per_worker={GPU: 1}"], r"^train\.resources_per_worker\.GPU: .*use train\.use_gpu$"),
    (["grid.num_groups"], r"^--set grid\.num_groups: expected SECTION\.FIELD=VALUE"),
])
def test_bad_values_fail_naming_the_field(data_dir, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.train=data/train-*.tsv", *overrides])


def test_resources_per_worker(data_dir) -> None:
    assert load_config(None, ["data.train=data/*.tsv"]).train.resources_per_worker == {}
    cfg = load_config(None, ["data.train=data/*.tsv", "train.resources_per_worker={trainer_node: 0.25, big: 2}"])
    assert cfg.train.resources_per_worker == {"trainer_node": 0.25, "big": 2.0}
    assert cfg.run_params()["train.resources_per_worker"] == {"trainer_node": 0.25, "big": 2.0}


def test_missing_glob_is_fine_when_synthesising(data_dir) -> None:
    cfg = load_config(None, ["data.train=missing/*.tsv", "data.eval=missing-eval/*.tsv", "data.synth_if_missing=true"])
    assert cfg.data.synth_if_missing and cfg.data.train == ["missing/*.tsv"]
    assert load_config(None, ["data.train=s3://bucket/criteo/*.parquet"]).data.train == ["s3://bucket/criteo/*.parquet"]


def test_yaml_errors_name_the_file_and_key(data_dir) -> None:
    path = _yaml(data_dir, "data: {train: data/train-*.tsv}\nmodel:\n  arch: dcn\n  embeding_dim: 8\n")
    with pytest.raises(ConfigError, match=rf"^model\.embeding_dim: unknown key in {path} \(did you mean "
                                          rf"model\.embedding_dim\?\); valid keys in model: arch, embedding_dim"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^trainer: unknown section in .*job\.yaml \(did you mean train\?\); "
                                          r"valid sections: grid, model"):
        load_config(_yaml(data_dir, "trainer: {max_steps: 3}\n"))
    with pytest.raises(ConfigError, match=r"^data\.train: required"):
        load_config(_yaml(data_dir, "grid: {world_size: 2}\n"))
    with pytest.raises(ConfigError, match=r"^grid\.num_group: unknown key in --set \(did you mean grid\.num_groups\?\)"):
        load_config(None, ["grid.num_group=2"])
    with pytest.raises(ConfigError, match=r"^zzz\.x: unknown section in --set; valid"):  # nothing close: no guess
        load_config(None, ["zzz.x=1"])
    with pytest.raises(ConfigError, match=r"^grid: must be a mapping of fields in .*job\.yaml"):
        load_config(_yaml(data_dir, "grid: 4\n"))
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(data_dir / "nope.yaml")


def test_construction_validates(data_dir) -> None:
    cfg = load_config(None, ["data.train=data/*.tsv"])
    with pytest.raises(ConfigError, match=r"^grid\.num_groups: M=3 must divide"):
        dataclasses.replace(cfg, grid=dataclasses.replace(cfg.grid, num_groups=3))
    cfg.optim.lr = -1.0  # a mutated config is caught by validate()
    with pytest.raises(ConfigError, match=r"^optim\.lr: must be > 0, got -1\.0$"):
        cfg.validate()


def test_every_field_is_documented_and_choices_agree() -> None:
    docs = field_docs()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert docs.get(f"{section}.{f.name}"), f"{section}.{f.name} has no docstring"
    hints = {s: typing.get_type_hints(c) for s, c in SECTIONS.items()}
    assert typing.get_args(hints["grid"]["layout"]) == LAYOUTS
    assert typing.get_args(hints["model"]["sharding"]) == SHARDINGS
    assert typing.get_args(hints["model"]["arch"]) == ARCHS
    assert typing.get_args(hints["optim"]["dense_optimizer"]) == DENSE_OPTIMIZERS


def test_readme_config_table_is_the_generated_one() -> None:
    """docs/reference.md's config reference is `reference_table()`: docs that restate code drift."""
    from pathlib import Path

    from recgrid.config import reference_table

    readme = (Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text()
    begin, end = "<!-- config-table:begin -->\n", "\n<!-- config-table:end -->"
    assert begin in readme and end in readme
    assert readme[readme.index(begin) + len(begin):readme.index(end)] == reference_table(), \
        "docs/reference.md's config table is stale: paste the output of `python -m recgrid.config`"


def test_run_params_log_each_config_key_once_and_name_derived_values_apart():
    """A run's params are the config's keys, each once, plus `config.DERIVED_PARAMS` (named so
    that no config key has the same name): no `num_groups` beside `grid.num_groups`."""
    from recgrid.config import DERIVED_PARAMS, load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "jobs/local_demo.yaml", [], check_paths=False)
    params = cfg.run_params()
    config_keys = set(cfg.to_flat_dict())
    assert set(params) - config_keys == {"derived.group_size"} and set(params) >= config_keys
    assert params["derived.group_size"] == 2 and params["grid.num_groups"] == 2 and params["optim.moment_scale"] == 2.0
    leaves = {k.rsplit(".", 1)[-1] for k in config_keys}
    assert all(k.startswith("derived.") and k.rsplit(".", 1)[-1] not in leaves for k in DERIVED_PARAMS)
    reference = (Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text()
    assert all(f"| `{k}` |" in reference for k in DERIVED_PARAMS), "docs/reference.md's params table is stale"


def test_keys_into_a_pipe_whose_reader_left_ends_quietly():
    """`recgrid keys | head`: the reader leaves before the listing ends (here: before it starts).
    No traceback; the exit code a shell tool ended by SIGPIPE gives."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "recgrid.cli", "keys"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 128 + 13 and err == "", err


def test_a_job_that_can_restore_gets_storage_checkpoints_every_30_minutes_by_default(data_dir) -> None:
    """train.checkpoint_every left null: for a job that survives failures, a checkpoint every
    CHECKPOINT_EVERY_S of training (at a sync step), whatever the job's length; none for a job
    that can never restore (train.max_failures=0) or a tower model. A written value is steps, a
    multiple of K. What the job runs with is its param, and what its workers get is the job's one
    `Schedule`: K, both cadences, a stop check every first multiple of K from 5 steps on."""
    from recgrid.config import CHECKPOINT_EVERY_S, CheckpointCadence, SnapshotCadence
    from recgrid.train.schedule import Schedule

    base = ["data.train=data/train-*.tsv"]

    def cadence(*o: str) -> CheckpointCadence:
        cfg = load_config(None, [*base, *o])
        assert cfg.run_params()["train.checkpoint_every"] == cfg.checkpoints.param()  # logged as run
        return cfg.checkpoints

    assert load_config(None, base).train.checkpoint_every is None  # the config keeps what was written
    assert cadence() == CheckpointCadence() and not cadence().on  # the demo's: failures end the job
    for steps in (50, 400, 100_000):
        assert cadence("train.max_failures=2", f"train.max_steps={steps}") == CheckpointCadence(every_s=CHECKPOINT_EVERY_S)
    assert cadence("train.max_failures=2").param() == "1800s"
    assert cadence("train.max_steps=400", "train.checkpoint_every=15") == CheckpointCadence(every_steps=15)
    assert cadence("train.max_failures=2", "train.checkpoint_every=0").param() == 0  # none, explicitly
    assert not cadence("train.max_failures=2", "model.towers=2").on
    with pytest.raises(ConfigError, match=r"^train\.checkpoint_every: must be a multiple of grid\.sync_every K=3 "
                                          r".*leave it null for the derived cadence \(every 1800 s of training\)"):
        load_config(None, [*base, "grid.num_groups=2", "grid.sync_every=3", "train.checkpoint_every=5"])
    with pytest.raises(ConfigError, match=r"^train\.checkpoint_every: must be >= 0, got -5$"):
        load_config(None, [*base, "train.checkpoint_every=-5"])
    job = load_config(None, [*base, "grid.num_groups=2", "grid.sync_every=3", "train.max_failures=2"])
    schedule = Schedule.of_job(job)
    assert (schedule.sync_every, schedule.checkpoints, schedule.snapshots) == (3, job.checkpoints, job.snapshots)
    assert [s for s in range(1, 13) if schedule.checks_stop(s)] == [6, 12]  # the first multiple of 3 from 5 on
    assert [Schedule(k).stop_check_every for k in (1, 5, 7)] == [5, 5, 7]
    assert [s for s in range(1, 13) if schedule.syncs(s)] == [3, 6, 9, 12]
    every_2nd = Schedule(3, snapshots=SnapshotCadence(every_syncs=2))
    assert [s for s in range(3, 19, 3) if every_2nd.snapshot_sync(s)] == [6, 12, 18]


def test_the_retired_fault_tolerance_keys_are_refused_with_a_sentence(data_dir, tmp_path) -> None:
    """One fault-tolerance design: an old config that names `train.fault_tolerance` (or the restart
    path's `train.resize_check_s`) fails naming the key, the file, and why, in a file and in --set."""
    base = ["data.train=data/train-*.tsv", "grid.world_size=4", "grid.num_groups=2", "grid.sync_every=5"]
    old = tmp_path / "old.yaml"
    old.write_text("data:\n  train: data/train-*.tsv\ntrain:\n  fault_tolerance: restart\n")
    with pytest.raises(ConfigError, match=r"^train\.fault_tolerance in .*old\.yaml: no longer a setting: recgrid "
                                          r"has one fault-tolerance design: .*delete the key$"):
        load_config(old)
    with pytest.raises(ConfigError, match=r"^train\.resize_check_s in --set: no longer a setting: .*delete the key$"):
        load_config(None, [*base, "train.resize_check_s=5"])
    assert not any("fault_tolerance" in k for k in load_config(None, base).run_params())

    def snapshots(*o: str):  # in-memory snapshots where a host loss can take every live copy of a shard
        cfg = load_config(None, [*base, *o])
        assert cfg.run_params()["train.snapshot_every_syncs"] == cfg.snapshots.param()
        return cfg.snapshots

    assert not snapshots().on  # the demo: no failure survived, nothing restores
    assert snapshots("train.max_failures=2").measured  # host-local M = 2: a host holds every copy of its shards
    assert snapshots("train.max_failures=2", "grid.num_groups=1", "grid.layout=inter-host").measured  # M = 1
    assert not snapshots("train.max_failures=2", "grid.layout=inter-host").on  # a whole group survives a host
    assert snapshots("train.snapshot_every_syncs=3").every_syncs == 3  # written: any M, any layout
    assert snapshots("train.max_failures=2").param().startswith("measured (<= 2% of the step time, <= 20 syncs")
    # torchft's quorum waits for grid.min_world_size / L live groups (one when null)
    assert load_config(None, [*base, "grid.min_world_size=4"]).min_groups == 2
    assert load_config(None, base).min_groups == 1
