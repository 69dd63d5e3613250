"""megacomp.plan per backend and link kind: the bytes a flat compressed exchange, gloo's reduce-scatter and megacomp's
hop-by-hop exchange put on each link kind, derived by hand for m ranks per node over n nodes (D = n m ranks), and
the plan's per-link bytes against comm.stats() of a real hop-by-hop exchange on gloo."""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from megacomp import comm
from megacomp.compression import make_codec
from megacomp.placement import Topology
from megacomp.plan import Cluster, Layout, Method, ModelSpec, device, estimate
from megacomp.plan import wire
from megacomp.plan.estimate import collective_seconds, hop_by_hop_seconds, phases
from megacomp.plan.routing import Routes, groups

INT4 = {"name": "int4", "block_size": 128}
INT8 = {"name": "int8", "block_size": 256}
SHARD = 4096  # elements per rank: one pipeline segment, whole scale blocks
NODE_SHAPES = [(2, 1), (2, 2), (2, 4), (3, 2), (4, 4)]  # (n nodes, m ranks per node)


def routes(n, m, backend="nccl"):
    c = Cluster(device("h100"), n * m, n, backend=backend)
    return Routes(c), groups(Layout(1, 1, n * m), "dp")


@pytest.mark.parametrize("n,m", NODE_SHAPES)
def test_flat_direct_exchange_sends_every_local_ranks_chunks_across(n, m):
    D, w = n * m, make_codec(INT4).wire_bytes(SHARD)
    for backend in ("nccl", "gloo"):
        r, dp = routes(n, m, backend)
        # megacomp's compressed reduce-scatter on either backend: each rank sends an encoded chunk to each of the
        # D - 1 others, so the m ranks of a node send m (D - m) chunks out of it and m (m - 1) inside it
        _, rs = collective_seconds(r, dp, "reduce_scatter", INT4, SHARD)
        assert rs["inter_node"] == pytest.approx(n * m * (D - m) * w)
        assert rs["intra_node"] == pytest.approx(n * m * (m - 1) * w)
        assert r.tier_loads(dp, "direct", (D - 1) * w)["inter_node"] == pytest.approx(m * (D - m) * w)
    # compressed all-gather: gloo moves the encoded shards as direct p2p (the same m (D - m) shards leave a node)...
    r, dp = routes(n, m, "gloo")
    _, ag = collective_seconds(r, dp, "all_gather", INT8, SHARD)
    w8 = make_codec(INT8).wire_bytes(SHARD)
    assert ag["inter_node"] == pytest.approx(n * m * (D - m) * w8)
    assert ag["intra_node"] == pytest.approx(n * m * (m - 1) * w8)
    # ... NCCL's ring all-gather sends D - 1 shards over each of the n ring edges that leave a node
    r, dp = routes(n, m, "nccl")
    _, ring = collective_seconds(r, dp, "all_gather", INT8, SHARD)
    assert ring["inter_node"] == pytest.approx(n * (D - 1) * w8)
    assert ring["intra_node"] == pytest.approx((D - n) * (D - 1) * w8)


@pytest.mark.parametrize("n,m", NODE_SHAPES)
def test_gloo_reduce_scatter_moves_all_reduce_bytes(n, m):
    D = n * m
    _, nccl = collective_seconds(*routes(n, m, "nccl"), "reduce_scatter", None, SHARD)
    _, gloo = collective_seconds(*routes(n, m, "gloo"), "reduce_scatter", None, SHARD)
    # ring: each rank sends D - 1 chunks of SHARD fp32 (NCCL); gloo all-reduces the whole input: 2 (D - 1) chunks
    assert sum(nccl.values()) == pytest.approx(D * (D - 1) * SHARD * 4)
    assert sum(gloo.values()) == pytest.approx(D * 2 * (D - 1) * SHARD * 4)
    # over n nodes the ring leaves each node once
    assert gloo["inter_node"] == pytest.approx(n * 2 * (D - 1) * SHARD * 4) == 2 * nccl["inter_node"]
    # the other uncompressed collectives are rings on both backends
    for op in ("all_reduce", "all_gather"):
        assert collective_seconds(*routes(n, m, "gloo"), op, None, SHARD) == \
            collective_seconds(*routes(n, m, "nccl"), op, None, SHARD)


def test_compressed_all_reduce_phases_per_backend():
    numel, p = 4 * 1024, 4
    total = wire.all_reduce_bytes(INT8, numel, p)
    nccl, gloo = phases("nccl", "all_reduce", INT8, numel, p), phases("gloo", "all_reduce", INT8, numel, p)
    assert [pat for pat, _ in nccl] == ["direct", "ring"] and [pat for pat, _ in gloo] == ["direct", "direct"]
    assert sum(b for _, b in nccl) == sum(b for _, b in gloo) == total
    # two ranks: the whole encoding once, direct, on both
    assert phases("gloo", "all_reduce", INT8, numel, 2) == phases("nccl", "all_reduce", INT8, numel, 2) == \
        [("direct", wire.all_reduce_bytes(INT8, numel, 2))]
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        phases("gloo", "broadcast", None, numel, p)


def test_default_backend_is_nccl_and_a_bad_one_is_one_line():
    model = ModelSpec(4, 256, 4, 64, 1024, 2, 16)
    method = Method("flat", "zero1", dp_gradient=INT4, dp_parameter=INT8, dp_collectives="flat")
    plain, nccl = Cluster(device("h100"), 8, 2), Cluster(device("h100"), 8, 2, backend="nccl")
    assert plain == nccl and estimate(model, Layout(1, 1, 8), plain, method).transfers == \
        estimate(model, Layout(1, 1, 8), nccl, method).transfers
    with pytest.raises(ValueError, match=r"^unknown backend 'mpi': use one of nccl, gloo") as err:
        Cluster(device("h100"), 8, 2, backend="mpi")
    assert "\n" not in str(err.value)


def test_parameters_travel_in_params_dtype():
    shapes = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=64, vocab_size=1024,
                  micro_batch_size=2, global_batch_size=16)
    c, lay, plain = Cluster(device("h100"), 8, 2), Layout(1, 1, 8), Method("none", "zero1")
    ag = {dt: {t.path: t for t in estimate(ModelSpec(**shapes, params_dtype=dt), lay, c, plain).transfers}
          ["dp_parameter"].tier_bytes for dt in ("float32", "bfloat16")}
    assert ag["float32"]["inter_node"] == pytest.approx(2 * ag["bfloat16"]["inter_node"])  # 4 bytes, not 2
    assert ModelSpec(**shapes).params_dtype == "bfloat16"
    with pytest.raises(ValueError, match="params_dtype 'int8': use one of float32, bfloat16, float16"):
        ModelSpec(**shapes, params_dtype="int8")
    from megacomp.plan.cli import REPO
    assert ModelSpec.from_yaml(str(REPO / "configs" / "gpt_7b.yaml")).params_dtype == "bfloat16"
    assert ModelSpec.from_yaml(str(REPO / "configs" / "gpt_tiny.yaml")).params_dtype == "float32"  # the default


def _hop_by_hop_stats(rank, world, per_node, shard):
    """comm.stats() (tag -> wire bytes) of a compressed hop-by-hop reduce-scatter (int4) and all-gather (int8)."""
    h = comm.new_hierarchical_group(Topology.uniform(world, per_node, 0), [list(range(world))])
    comm.reset_stats()
    comm.reduce_scatter_tensor(torch.empty(shard), torch.randn(world * shard), group=h, codec=INT4, tag="rs")
    comm.all_gather_into_tensor(torch.empty(world * shard), torch.randn(shard), group=h, codec=INT8, tag="ag")
    return {k: v.wire_bytes for k, v in comm.stats().items()}


@pytest.mark.parametrize("world,per_node", [(4, 2), (8, 4)])
def test_hop_by_hop_bytes_per_link_kind_equal_megacomp_counters(world, per_node):
    shard = 2048
    counted = run_ranks(_hop_by_hop_stats, world, per_node, shard)
    total = {k: sum(c.get(k, 0) for c in counted) for k in counted[0]}
    n = world // per_node
    plan = {}
    for backend in ("nccl", "gloo"):
        r, dp = routes(n, per_node, backend)
        plan[backend] = {op: hop_by_hop_seconds(r, dp, op, spec, shard)[1]
                         for op, spec in (("reduce_scatter", INT4), ("all_gather", INT8))}
    # megacomp books every stage at NCCL's algorithm: the slow hop under the call's tag, the fast one @intra_node
    for op, tag in (("reduce_scatter", "rs"), ("all_gather", "ag")):
        assert plan["nccl"][op]["inter_node"] == total[tag]
        assert plan["nccl"][op]["intra_node"] == total[f"{tag}@intra_node"]
    # on gloo the fast hop's uncompressed reduce-scatter is gloo's all-reduce: twice what megacomp books for it
    assert plan["gloo"]["reduce_scatter"]["intra_node"] == 2 * total["rs@intra_node"]
    assert plan["gloo"]["all_gather"] == plan["nccl"]["all_gather"]  # ring inside a node, two ranks across
    assert plan["gloo"]["reduce_scatter"]["inter_node"] == total["rs"]
