"""Placement arithmetic (issue 14, acceptance 4): how many workers each alive node can hold, and
the per-attempt rank record. The placement itself, on a real multi-node cluster with packed
nodes (refusal before start, host-local replica groups on one node, inter-host sharding groups
apart, surviving a node loss from peers), is tested in tests/test_recovery_nodes.py, whose
cluster and jobs it shares."""


def test_node_slots_count_the_workers_each_alive_node_can_hold():
    from recgrid.train.placement import node_slots, rank_records

    nodes = [
        {"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.1",
         "Resources": {"CPU": 2.0, "memory": 1e9, "node:10.0.0.1": 1.0, "trainer_node": 1.0}},
        {"NodeID": "b" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0}},
        {"NodeID": "c" * 56, "Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 8.0}},
    ]
    assert node_slots(nodes, {"CPU": 0.5}) == {"aaaaaaaaaaaa at 10.0.0.1 (CPU 2, trainer_node 1)": 4,
                                               "bbbbbbbbbbbb at 10.0.0.2 (CPU 8)": 16}
    # a custom resource only one node offers confines the workers there
    assert list(node_slots(nodes, {"CPU": 0.5, "trainer_node": 0.25}).values()) == [4, 0]
    assert list(node_slots(nodes, {"CPU": 0.3}).values()) == [6, 26]
    attempts = [{"world_size": 2, "workers": {1: {"pid": 11, "node": "n1"}, 0: {"pid": 10, "node": "n0"}}},
                {"world_size": 2, "workers": {0: {"pid": 20, "node": "n0"}}}]
    assert rank_records(attempts) == [{"attempt": 0, "rank": 0, "node": "n0", "pid": 10},
                                      {"attempt": 0, "rank": 1, "node": "n1", "pid": 11},
                                      {"attempt": 1, "rank": 0, "node": "n0", "pid": 20}]


def test_host_local_pins_each_replica_group_to_one_node_or_whole_nodes_of_its_own():
    from recgrid.train.placement import NODE_ID_LABEL, host_local_nodes, label_selectors

    def node(name, cpus, alive=True):
        return {"NodeID": name, "Alive": alive, "Resources": {"CPU": cpus}}

    one = {"CPU": 1}
    # L=2 positions, M=2: one replica group per node of 2; the largest nodes first, ties by id; dead
    # nodes and nodes of no room ignored
    nodes = [node("b", 2), node("a", 2), node("c", 0.5), node("d", 8, alive=False)]
    assert host_local_nodes(nodes, one, 2, 2) == [["a", "a"], ["b", "b"]]
    # a node of 4 holds two replica groups, on consecutive positions (Ray Train numbers a run's
    # workers node by node in bundle order, so shard rank s is bundle s)
    assert host_local_nodes([node("b", 2), node("a", 4)], one, 3, 2) == [["a", "a"], ["a", "a"], ["b", "b"]]
    # M more than a node holds: a replica group over whole nodes of its own
    assert host_local_nodes([node("b", 2), node("a", 2)], one, 1, 4) == [["a", "a", "b", "b"]]
    # room for fewer whole replica groups than positions: not pinned
    assert host_local_nodes([node("a", 3)], one, 2, 2) is None
    assert label_selectors([["a", "a"], ["b", "b"]], 1) == [{NODE_ID_LABEL: "a"}, {NODE_ID_LABEL: "b"}]
