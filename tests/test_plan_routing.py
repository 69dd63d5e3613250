"""megacomp.plan.routing: bytes on the busiest link of each tier, hand-counted on small clusters."""
from __future__ import annotations

import pytest

from megacomp.plan import Cluster, Layout, device
from megacomp.plan.routing import Routes, crossing_bytes, groups, split_groups, tier_loads

B = 1200.0


def cluster(gpus, nodes, sites=1):
    return Cluster(device("h100"), gpus, nodes, sites)


def test_ring_over_two_nodes():
    c, dp = cluster(4, 2), groups(Layout(1, 1, 4), "dp")
    assert dp == ((0, 1, 2, 3),)
    # edges 0->1 and 2->3 stay inside a node, 1->2 and 3->0 each leave one node
    assert tier_loads(c, dp, "ring", B) == {"intra_node": B, "inter_node": B, "inter_site": 0.0}
    assert crossing_bytes(c, dp, "ring", B) == {"intra_node": 2 * B, "inter_node": 2 * B, "inter_site": 0.0}


def test_direct_exchange_is_not_topology_aware():
    c, dp = cluster(4, 2), groups(Layout(1, 1, 4), "dp")
    # each rank sends B/3 to each of 3 peers; a node holds m = 2 of p = 4: m (p - m) B / 3 leave it
    loads = tier_loads(c, dp, "direct", B)
    assert loads["inter_node"] == pytest.approx(2 * 2 * B / 3) and loads["intra_node"] == pytest.approx(B / 3)
    total = crossing_bytes(c, dp, "direct", B)
    assert total["intra_node"] == pytest.approx(4 * B / 3) and total["inter_node"] == pytest.approx(8 * B / 3)


def test_pipeline_chain_and_sites():
    c = cluster(4, 2)
    pp = groups(Layout(1, 2, 2), "pp")  # rank = t + tp (d + dp p): stages are 2 ranks apart
    assert pp == ((0, 2), (1, 3))
    # both pipelines cross the node boundary, each way: node 0 sends 2 B
    assert tier_loads(c, pp, "chain", B)["inter_node"] == 2 * B
    c8 = cluster(8, 4, 2)
    loads = tier_loads(c8, groups(Layout(1, 1, 8), "dp"), "ring", B)
    assert loads == {"intra_node": B, "inter_node": B, "inter_site": B}  # 3->4 leaves node 1 and site 0


def test_local_step_groups_and_memo():
    inner, outer = split_groups(((0, 1, 2, 3, 4, 5, 6, 7),), 2)
    assert inner == ((0, 1, 2, 3), (4, 5, 6, 7)) and outer == ((0, 4), (1, 5), (2, 6), (3, 7))
    with pytest.raises(ValueError, match="replicas do not divide"):
        split_groups(((0, 1, 2),), 2)
    c = cluster(8, 4, 2)
    r = Routes(c)
    assert r.tier_loads(outer, "ring", B) == tier_loads(c, outer, "ring", B)
    assert r.crossing_bytes(outer, "ring", 2 * B) == crossing_bytes(c, outer, "ring", 2 * B)
    with pytest.raises(ValueError, match="unknown traffic pattern"):
        tier_loads(c, outer, "tree", B)


def test_hop_stages_and_the_slow_link_carrying_each_node_once():
    from megacomp.compression import make_codec
    from megacomp.plan import wire
    from megacomp.plan.estimate import collective_seconds, hop_by_hop_seconds
    from megacomp.plan.routing import hop_stages

    c, dp = cluster(8, 2), groups(Layout(1, 1, 8), "dp")
    assert hop_stages(c, dp) == (("intra_node", ((0, 1, 2, 3), (4, 5, 6, 7))),
                                 ("inter_node", ((0, 4), (1, 5), (2, 6), (3, 7))))
    assert hop_stages(cluster(8, 8), dp) == () and hop_stages(cluster(8, 1), dp) == ()  # flat: nothing to combine
    assert hop_stages(cluster(8, 2), groups(Layout(4, 1, 2), "dp")) == ()  # TP 4: one DP rank per node
    routes, shard, int4 = Routes(c), 1 << 16, {"name": "int4", "block_size": 128}
    _, flat = collective_seconds(routes, dp, "reduce_scatter", int4, shard)
    _, hier = hop_by_hop_seconds(routes, dp, "reduce_scatter", int4, shard)
    w = make_codec(int4).wire_bytes(shard)
    # flat: each of 8 ranks sends a chunk to each of the 4 ranks of the other node; hop by hop: to its one peer there
    assert flat["inter_node"] == pytest.approx(8 * 4 * w) and hier["inter_node"] == pytest.approx(8 * w)
    # the fast hop: an uncompressed ring reduce-scatter of 2 shards per rank inside each node, 3/4 of it sent
    assert hier["intra_node"] == pytest.approx(8 * wire.reduce_scatter_bytes(None, 2 * shard, 4))
    _, ag = hop_by_hop_seconds(routes, dp, "all_gather", int4, shard)
    assert ag["inter_node"] == pytest.approx(8 * w)  # each shard encoded once, sent to the other node once
    # uncompressed: torch's collective over the whole group, as at run time
    assert hop_by_hop_seconds(routes, dp, "reduce_scatter", None, shard) == \
        collective_seconds(routes, dp, "reduce_scatter", None, shard)
