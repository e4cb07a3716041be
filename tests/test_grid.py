"""The grid: rank lists for both layouts, coordinates, and the errors for impossible shapes."""

import json
import subprocess
import sys

import pytest

from recgrid.engine.grid import Grid, GridError


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
    (dict(world_size=24, num_groups=6, workers_per_node=4),
     "M=6 to divide workers_per_node=4 or be a multiple of it"),
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
    with pytest.raises(GridError, match=r"T=24, W=4 use M in \[1, 2, 4, 8, 12, 24\], or layout='inter-host'"):
        Grid(24, 6, workers_per_node=4)


def test_inter_host_allows_m_not_dividing_workers_per_node():
    assert Grid(8, 4, "inter-host", workers_per_node=2).replica_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_host_local_with_m_a_multiple_of_workers_per_node_spans_whole_nodes():
    # T=16 on 8 nodes of 2, M=4: each replica group is 2 whole nodes; a sharding group has one
    # member on every other node
    g = Grid(16, 4, workers_per_node=2)
    assert g.replica_groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g.sharding_groups == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g.sharding_group_per_node == 1
    assert Grid(16, 2, workers_per_node=4).sharding_group_per_node == 2  # M divides W: W/M per node
    # the paper's 4096 GPUs with sharding groups of 256 on 8-GPU nodes: M=16, two nodes per replica group
    big = Grid(4096, 16, workers_per_node=8)
    assert big.replica_groups[3] == list(range(48, 64)) and big.sharding_group_per_node == 1
    big.check_placement([f"n{r // 8}" for r in range(4096)])


def test_check_placement_of_replica_groups_on_whole_nodes():
    nodes = [n for n in "abcd" for _ in range(2)]  # 4 nodes x 2 workers, contiguous ranks
    Grid(8, 4, workers_per_node=2).check_placement(nodes)  # replica groups {a,b} and {c,d}
    Grid(8, 4).check_placement(nodes)  # workers_per_node unknown: the node ids decide
    with pytest.raises(GridError) as e:  # M=2 on nodes of 3, 1 and 4 workers: ranks 2, 3 straddle a and b
        Grid(8, 2).check_placement(["a", "a", "a", "b", "c", "c", "c", "c"])
    assert "replica group 1 (ranks [2, 3]) spans nodes ['a', 'b'] and shares node(s) ['a']" in str(e.value)
    assert "M=2" in str(e.value)
    uneven = ["a", "a", "a", "b", "b", "b", "b", "b"]  # replica group 0 = a's 3 + one of b's 5
    with pytest.raises(GridError) as e:
        Grid(8, 4).check_placement(uneven)
    assert "replica group 1 (ranks [4, 5, 6, 7])" not in str(e.value)  # group 1 is b's alone
    assert "replica group 0 (ranks [0, 1, 2, 3]) spans nodes ['a', 'b'] and shares node(s) ['b']" in str(e.value)


def test_check_placement_on_real_node_ids():
    nodes = ["a"] * 4 + ["b"] * 4  # Ray Train numbers ranks contiguously per node
    Grid(8, 2).check_placement(nodes)
    Grid(8, 2, "inter-host").check_placement(nodes)
    with pytest.raises(GridError, match="replica group 1 .* spans nodes"):
        Grid(8, 2).check_placement(["a", "a", "a", "b", "b", "b", "b", "a"])
    with pytest.raises(GridError, match="node a holds workers of sharding groups 0 and 1"):
        Grid(8, 2, "inter-host").check_placement(["a", "b"] * 4)


def test_inter_host_needs_sharding_groups_on_nodes_of_their_own():
    g = Grid(4, 2, "inter-host")  # sharding groups [0, 1] and [2, 3]
    g.check_placement(["a", "a", "b", "b"], cluster_nodes=2)
    g.check_placement(["a", "c", "b", "b"], cluster_nodes=3)  # a group may span nodes of its own
    g.check_placement(["a"] * 4, cluster_nodes=1)  # one node: nothing to spread
    # the placement: every worker packed on one node of a two-node cluster
    with pytest.raises(GridError) as e:
        g.check_placement(["a"] * 4, cluster_nodes=2)
    msg = str(e.value)
    assert msg.startswith("inter-host layout: node a holds workers of sharding groups 0 and 1")
    assert "{0: ['a'], 1: ['a']}" in msg and "cluster of 2 nodes" in msg and "grid.layout=host-local" in msg
    with pytest.raises(GridError, match="node b holds workers of sharding groups 0 and 1"):
        g.check_placement(["a", "b", "b", "c"], cluster_nodes=3)  # SPREAD's 1+2+1 straddles
    Grid(4, 1, "inter-host").check_placement(["a"] * 4, cluster_nodes=2)  # M=1: one group
    # host-local is unaffected by how many nodes the cluster has
    Grid(4, 2).check_placement(["a"] * 4, cluster_nodes=2)


def test_check_cluster_refuses_what_the_nodes_cannot_give():
    two = {"n1 at 10.0.0.1 (CPU 2)": 4, "n2 at 10.0.0.2 (CPU 2)": 4}
    Grid(4, 2, "inter-host").check_cluster(two)
    Grid(4, 2, "inter-host").check_cluster({"n1 at 10.0.0.1 (CPU 2)": 4})  # one node: nothing to spread
    Grid(4, 2, "inter-host").check_cluster({**two, "cpu-only (CPU 8, trainer 0)": 0})  # nodes of no slot don't count
    with pytest.raises(GridError) as e:  # 4 sharding groups, 2 nodes
        Grid(4, 4, "inter-host").check_cluster(two)
    msg = str(e.value)
    assert msg.startswith("inter-host layout: the M=4 sharding groups need nodes of their own, but this cluster has 2")
    assert "n1 at 10.0.0.1 (CPU 2): 4 worker(s); n2 at 10.0.0.2 (CPU 2): 4 worker(s)" in msg
    assert "lower grid.num_groups to 2 or fewer" in msg
    with pytest.raises(GridError, match=r"groups of L=3 workers each need nodes of their own, and these nodes cannot give each its L workers"):  # nodes of 1, 1, 4 for 2 x 3
        Grid(6, 2, "inter-host").check_cluster({"a": 1, "b": 1, "c": 4})
    with pytest.raises(GridError, match=r"^host-local layout: the cluster's nodes hold 3 of the 4 workers"):
        Grid(4, 2).check_cluster({"a": 3})
    Grid(4, 2).check_cluster({"a": 2, "b": 2})  # one replica group per node
    with pytest.raises(GridError) as e:  # M=2 on nodes of 3 and 1: the second replica group would straddle
        Grid(4, 2).check_cluster({"a": 3, "b": 1})
    assert str(e.value).startswith("host-local layout: each replica group of M=2 workers must sit on one node, "
                                   "but the cluster's nodes hold only 1 whole replica group(s), 2 of the 4 workers")
    Grid(8, 4).check_cluster({"a": 2, "b": 2, "c": 2, "d": 2})  # M a multiple of the workers per node
    # elastic: the first attempt gets what the nodes hold, in whole sharding groups
    Grid(4, 2, "inter-host").check_cluster({"a": 2}, min_world_size=2)
    with pytest.raises(GridError, match="hold 1 of the 2 workers"):
        Grid(4, 2, "inter-host").check_cluster({"a": 1}, min_world_size=2)


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
