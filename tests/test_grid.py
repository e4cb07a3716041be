"""The grid: rank lists for both layouts, coordinates, and the errors for impossible shapes."""

import json
import subprocess
import sys

import pytest

from recgrid.grid import Grid, GridError


def test_host_local_t8_m2_matches_design():
    g = Grid(8, 2)
    assert g.group_size == 4
    assert g.sharding_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g.replica_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_inter_host_t8_m2():
    g = Grid(8, 2, "inter-host")
    assert g.sharding_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g.replica_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("layout", ["host-local", "inter-host"])
@pytest.mark.parametrize("T,M", [(1, 1), (4, 1), (4, 2), (4, 4), (8, 2), (12, 3), (16, 4)])
def test_groups_partition_ranks_and_coords_agree(layout, T, M):
    g = Grid(T, M, layout)
    for groups, count, size in ((g.sharding_groups, M, T // M), (g.replica_groups, T // M, M)):
        assert len(groups) == count and all(len(x) == size for x in groups)
        assert sorted(r for x in groups for r in x) == list(range(T))
    for rank in range(T):
        c = g.coords(rank)
        assert g.sharding_groups[c.sharding_group][c.shard_rank] == rank
        assert g.replica_groups[c.replica_group][c.replica_rank] == rank
        assert g.global_rank(c.sharding_group, c.shard_rank) == rank


def test_m1_is_one_sharding_group_of_everyone():
    g = Grid(4, 1)
    assert g.sharding_groups == [[0, 1, 2, 3]]
    assert g.replica_groups == [[0], [1], [2], [3]]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world_size=6, num_groups=4), "T=6 is not divisible by num_groups M=4"),
    (dict(world_size=4, num_groups=0), "num_groups (M) must be a positive integer, got 0"),
    (dict(world_size=0, num_groups=1), "world_size (T) must be a positive integer, got 0"),
    (dict(world_size=8, num_groups=4, workers_per_node=2), "M=4 to divide workers_per_node=2"),
    (dict(world_size=8, num_groups=2, workers_per_node=3), "not a whole number of nodes"),
    (dict(world_size=8, num_groups=2, layout="diagonal"), "layout must be one of"),
])
def test_invalid_shapes_name_values(kwargs, needle):
    with pytest.raises(GridError) as e:
        Grid(**kwargs)
    assert needle in str(e.value)


def test_invalid_shape_says_what_would_work():
    with pytest.raises(GridError, match=r"valid values: \[1, 2, 3, 6\]"):
        Grid(6, 4)
    with pytest.raises(GridError, match=r"use M in \[1, 2\], or layout='inter-host'"):
        Grid(8, 4, workers_per_node=2)


def test_inter_host_allows_m_not_dividing_workers_per_node():
    assert Grid(8, 4, "inter-host", workers_per_node=2).replica_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_check_placement_on_real_node_ids():
    nodes = ["a"] * 4 + ["b"] * 4  # Ray Train numbers ranks contiguously per node
    Grid(8, 2).check_placement(nodes)
    Grid(8, 2, "inter-host").check_placement(nodes)
    with pytest.raises(GridError, match="replica group 1 .* spans nodes"):
        Grid(8, 2).check_placement(["a", "a", "a", "b", "b", "b", "b", "a"])
    with pytest.raises(GridError, match="sits wholly on node"):
        Grid(8, 2, "inter-host").check_placement(["a", "b"] * 4)


def _layout(*args):
    return subprocess.run([sys.executable, "-m", "recgrid.cli", "layout", *args], capture_output=True, text=True)


def test_layout_command_json():
    p = _layout("--world-size", "8", "--groups", "2", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"sharding_groups": [[0, 2, 4, 6], [1, 3, 5, 7]],
                                    "replica_groups": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    p = _layout("--world-size", "8", "--groups", "2", "--inter-host", "--json")
    assert json.loads(p.stdout)["replica_groups"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layout_command_rejects_bad_shape():
    p = _layout("--world-size", "6", "--groups", "4", "--json")
    assert p.returncode != 0
    assert "T=6" in p.stderr and "M=4" in p.stderr and p.stdout == ""
