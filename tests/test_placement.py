"""Placement arithmetic: how many workers each alive node can hold, which nodes each sharding
group's run is pinned to under either layout, what each host's snapshot holder keeps, and the
per-attempt rank record. The placement itself, on a real multi-node cluster (refusal before
start, host-local replica groups on one node, inter-host sharding groups apart on roomy nodes, a
host loss under both layouts), is tested in tests/test_recovery_nodes.py."""


def test_node_slots_count_the_workers_each_alive_node_can_hold():
    from recgrid.launch.placement import node_slots, rank_records

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
    from recgrid.launch.placement import NODE_ID_LABEL, host_local_nodes, label_selectors

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
    assert label_selectors(["a", "b"]) == [{NODE_ID_LABEL: "a"}, {NODE_ID_LABEL: "b"}]


def test_inter_host_gives_each_group_nodes_of_its_own_and_holders_keep_another_hosts_copy():
    from recgrid.launch.placement import holder_bytes, inter_host_nodes, positions_by_node
    from recgrid.train.recovery.holders import ring_keeper

    def node(name, cpus, alive=True):
        return {"NodeID": name, "Alive": alive, "Resources": {"CPU": cpus}}

    one = {"CPU": 1}
    # room for both groups on either node: still one node each (the smallest that holds a group first)
    assert inter_host_nodes([node("a", 4), node("b", 4)], one, 2, [0, 1]) == {0: ["a", "a"], 1: ["b", "b"]}
    assert inter_host_nodes([node("a", 8), node("b", 2)], one, 2, [0, 1]) == {0: ["b", "b"], 1: ["a", "a"]}
    # a group of L=3 over the largest nodes together when no node holds it; the rest does not fit
    assert inter_host_nodes([node("a", 2), node("b", 1), node("c", 1)], one, 3, [0, 1]) == {0: ["a", "a", "b"]}
    # nodes other groups hold are not offered; a dead one neither
    assert inter_host_nodes([node("a", 4), node("b", 4, alive=False)], one, 2, [1], taken={"a"}) == {}
    # the holders' ring: each host keeps the next one's copy, over the hosts the positions are on
    assert [ring_keeper(["b", "a", "c"], n) for n in "abc"] == ["b", "c", "a"] and ring_keeper(["a"], "a") is None
    pinned = {0: ["a", "b"], 1: ["a", "b"]}  # host-local, L=2: position 0 on a, 1 on b
    assert positions_by_node(pinned) == {"a": [0], "b": [1]}
    assert holder_bytes(pinned, [100, 30], 2) == {"a": 2 * (100 + 30), "b": 2 * (30 + 100)}
    assert holder_bytes({0: ["a", "a", "b"]}, [1, 2, 4], 2) == {"a": 2 * (3 + 4), "b": 2 * (4 + 3)}
    assert holder_bytes({0: ["a", "a"]}, [1, 2], 2) == {"a": 2 * 3}  # one host: nowhere else to keep a copy
