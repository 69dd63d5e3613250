"""megacomp.placement: where ranks sit, from each launcher's environment, the overrides, and a group's hops."""
import socket

import pytest

from megacomp.placement import Topology, launcher_placement, topology_from_placements


def test_uniform_placement_and_its_hops():
    t = Topology.uniform(8, 2, nodes_per_site=2)
    assert t.node_of_rank == (0, 0, 1, 1, 2, 2, 3, 3) and t.num_sites == 2
    assert t.describe() == "4 nodes x 2 ranks, 2 sites of 2 nodes (set by hand)"
    assert t.hops(range(8)) == [("intra_node", [[0, 1], [2, 3], [4, 5], [6, 7]]),
                                ("inter_node", [[0, 2], [1, 3], [4, 6], [5, 7]]),
                                ("inter_site", [[0, 4], [2, 6], [1, 5], [3, 7]])]
    assert t.slowest_link([0, 1]) == "intra_node" and t.slowest_link([0, 2]) == "inter_node"
    assert t.slowest_link([0, 4]) == "inter_site"
    # TP 2 x DP 4 on nodes of 4 ranks: each DP group has 2 ranks per node
    t4 = Topology.uniform(8, 4)
    assert t4.hops([1, 3, 5, 7]) == [("intra_node", [[1, 3], [5, 7]]), ("inter_node", [[1, 5], [3, 7]])]
    assert Topology.uniform(4, 1).hops(range(4)) == [("inter_node", [[0, 1, 2, 3]])]  # flat: one hop
    assert Topology.uniform(4, 4).hops(range(4)) == [("intra_node", [[0, 1, 2, 3]])]


def test_uneven_groups_and_sizes_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"sit unevenly \(node 0: 3, node 1: 1\); launch the same number"):
        Topology((0, 0, 0, 1)).hops(range(4))
    with pytest.raises(ValueError, match="ranks_per_node must be a positive int dividing the 6 ranks"):
        Topology.uniform(6, 4)
    with pytest.raises(ValueError, match="nodes_per_site must be 0 .* dividing the 3 nodes"):
        Topology.uniform(6, 2, nodes_per_site=2)


def test_each_launcher_says_where_a_rank_sits():
    torchrun = launcher_placement({"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "4", "RANK": "5"})
    assert torchrun == {"source": "torchrun GROUP_RANK/LOCAL_WORLD_SIZE", "node": 1, "local_size": 4}
    slurm = launcher_placement({"SLURM_NODEID": "3", "SLURM_PROCID": "9", "SLURM_TASKS_PER_NODE": "4(x2),2"})
    assert slurm == {"source": "Slurm SLURM_NODEID", "node": 3, "local_size": 4}
    ompi = launcher_placement({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert ompi["node"] == socket.gethostname() and ompi["local_size"] == 2 and ompi["source"].startswith("host name")
    assert launcher_placement({})["source"] == "host name"


def _torchrun(world, per_node):
    return [{"source": "torchrun GROUP_RANK/LOCAL_WORLD_SIZE", "node": r // per_node, "local_size": per_node}
            for r in range(world)]


def test_overrides_and_contradictions():
    assert topology_from_placements(_torchrun(4, 2)).node_of_rank == (0, 0, 1, 1)
    assert topology_from_placements(_torchrun(4, 2), ranks_per_node=2).node_of_rank == (0, 0, 1, 1)
    with pytest.raises(ValueError, match="ranks_per_node 4 .* contradicts the launcher .*rank 2 on node 0, the "
                                         "launcher on node 1; drop --ranks-per-node"):
        topology_from_placements(_torchrun(4, 2), ranks_per_node=4)
    # host names say nothing about namespaces sharing one: the setting decides
    hosts = [{"source": "host name", "node": "vm", "local_size": 0}] * 4
    assert topology_from_placements(hosts).num_nodes == 1
    t = topology_from_placements(hosts, ranks_per_node=2, nodes_per_site=1)
    assert t.node_of_rank == (0, 0, 1, 1) and t.num_sites == 2
    # a launcher whose claim disagrees with what it placed
    bad = _torchrun(4, 2)
    bad[3] = dict(bad[3], node=0)
    with pytest.raises(ValueError, match="says 2 ranks per node but placed 3 on node 0"):
        topology_from_placements(bad)
    with pytest.raises(ValueError, match="must divide the 4 ranks"):
        topology_from_placements(hosts, ranks_per_node=3)
