"""Multi-rank tests of megacomp.comm.hierarchical (a codec and error feedback per hop) on real gloo groups.

Topologies are set by hand (megacomp.placement.Topology.uniform): 4 ranks as 2 nodes x 2 ranks, 8 ranks as 2 sites
x 2 nodes x 2 ranks. Checked:
- compression off (codec None, or every hop 'none') is torch.distributed's collective on the whole group, bit for bit;
- compressed: reduce-scatter gives rank g chunk g (torch's order), all-reduce and all-gather agree on every rank,
  and every result is within the bound derived from the codec on what each lossy hop encodes: each node's partial
  sum (reduce-scatter, all-reduce) or each rank's shard (all-gather), never each rank's whole tensor;
- bytes per hop, counted under each hop's link kind, equal the algorithm's count (the slow hop carries each
  node's data once);
- error feedback per hop: the residual of the slow hop sits on the chunk it sends, survives state_dict/load_state_dict
  (the resumed channel continues bit for bit), and a lossy fast hop keeps its own;
- bad settings: a per-hop codec for a hop the group does not cross, a call on another group.
"""
import pytest
import torch
import torch.distributed as dist

from codec_bounds import elementwise_bound
from distributed import run_ranks
from megacomp import comm
from megacomp.compression import ErrorFeedback, make_codec
from megacomp.placement import Topology

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
INT4 = {"name": "int4", "block_size": 128}


def rank_input(rank, numel, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(numel, generator=g) * (rank + 1)


def hier_group(world, ranks_per_node, nodes_per_site=0):
    return comm.new_hierarchical_group(Topology.uniform(world, ranks_per_node, nodes_per_site), [list(range(world))])


def _off_body(rank, world, per_node):
    h = hier_group(world, per_node)
    out = []
    for codec in (None, "none", {"inter_node": "none", "intra_node": "none"}):
        x, y = rank_input(rank, 1001), rank_input(rank, 1001)
        comm.all_reduce(x, group=h, codec=codec)
        dist.all_reduce(y)
        rs_in = rank_input(rank, world * 250, salt=1)
        a, b = torch.empty(250), torch.empty(250)
        comm.reduce_scatter_tensor(a, rs_in, group=h, codec=codec)
        dist.reduce_scatter_tensor(b, rs_in)
        ga, gb = torch.empty(world * 250), torch.empty(world * 250)
        comm.all_gather_into_tensor(ga, a, group=h, codec=codec)
        dist.all_gather_into_tensor(gb, a)
        out.append(torch.equal(x, y) and torch.equal(a, b) and torch.equal(ga, gb))
    return out


def test_compression_off_is_torch_bit_for_bit():
    assert all(all(r) for r in run_ranks(_off_body, 4, 2))


def _compressed_body(rank, world, per_node, sites, c):
    h = hier_group(world, per_node, sites)
    codec = make_codec(INT4)
    comm.reset_stats()
    out = {}
    for op in (SUM, AVG):
        x = rank_input(rank, world * c)
        comm.all_reduce(x, op, group=h, codec=codec, tag="ar")
        rs_in = rank_input(rank, world * c, salt=1)
        rs = torch.empty(c)
        comm.reduce_scatter_tensor(rs, rs_in, op, group=h, codec=codec, tag="rs")
        out[op == AVG] = (x, rs)
    gathered = torch.empty(world * c)
    comm.all_gather_into_tensor(gathered, rank_input(rank, c, salt=2), group=h, codec=codec, tag="ag")
    stats = {k: (v.calls, v.wire_bytes) for k, v in comm.stats().items()}
    return out, gathered, stats


def _node_sums(xs, per_node):
    """Each node's partial sum, in fp32 as the intra-node reduce-scatter computes it (two addends: any order)."""
    return [xs[n * per_node] + xs[n * per_node + 1] if per_node == 2 else sum(xs[n * per_node:(n + 1) * per_node])
            for n in range(len(xs) // per_node)]


@pytest.mark.parametrize("world,per_node,sites", [(4, 2, 0), pytest.param(8, 2, 2, marks=pytest.mark.slow)])
def test_compressed_results_within_the_bound_of_what_each_hop_encodes(world, per_node, sites):
    c = 1024  # a multiple of the block size: each destination chunk starts a block
    res = run_ranks(_compressed_body, world, per_node, sites, c)
    codec = make_codec(INT4)
    xs = [rank_input(r, world * c) for r in range(world)]
    rs_ins = [rank_input(r, world * c, salt=1) for r in range(world)]
    nodes = world // per_node
    for avg in (False, True):
        div = world if avg else 1
        # all-reduce: identical everywhere; two nodes (no sites): each node's sum of its chunk quantized once
        finals = [res[r][0][avg][0] for r in range(world)]
        assert all(torch.equal(f, finals[0]) for f in finals)
        exact = torch.stack([x.double() for x in xs]).sum(0) / div
        if not sites:
            bound = sum(elementwise_bound(codec, s) for s in _node_sums(xs, per_node)) / div
            bound = bound + exact.abs() * world * 2.0 ** -22
            assert ((finals[0].double() - exact).abs() <= bound).all()
        else:  # more quantization points (the inter-node sum's re-encoding): the error stays a codec-sized one
            assert ((finals[0].double() - exact).abs() <= 2 * nodes * elementwise_bound(codec, exact * div).max()
                    / div).all()
        # reduce-scatter: rank g holds chunk g (torch's order)
        exact_rs = torch.stack([x.double() for x in rs_ins]).sum(0) / div
        sums = _node_sums(rs_ins, per_node)
        for g in range(world):
            got = res[g][0][avg][1].double()
            ref = exact_rs[g * c:(g + 1) * c]
            if not sites:
                bound = sum(elementwise_bound(codec, s[g * c:(g + 1) * c]) for s in sums) / div
                assert ((got - ref).abs() <= bound + ref.abs() * world * 2.0 ** -22).all(), g
            assert (got - ref).abs().max() < (ref.abs().max() + 1) * 0.5  # chunk g, not another chunk
    # all-gather: every rank's shard encoded once (by its owner), decoded identically everywhere, in rank order
    gathered = [res[r][1] for r in range(world)]
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    for r in range(world):
        shard = rank_input(r, c, salt=2)
        assert ((gathered[0][r * c:(r + 1) * c].double() - shard.double()).abs()
                <= elementwise_bound(codec, shard)).all()
    # bytes per hop: the slow hop carries a node's data once
    if not sites:
        w = codec.wire_bytes(c)
        stats = res[0][2]
        assert stats["rs@intra_node"] == (2, 2 * (per_node - 1) * (world * c // per_node) * 4)  # SUM and AVG
        assert stats["rs"] == (2, 2 * (nodes - 1) * w)
        assert stats["ag"] == (1, (nodes - 1) * w)
        assert stats["ag@intra_node"] == (1, (per_node - 1) * nodes * c * 4)
        assert stats["ar@intra_node"][1] == 2 * 2 * (per_node - 1) * (world * c // per_node) * 4  # RS + AG, 2 ops
        assert stats["ar"] == (2, 2 * codec.wire_bytes(world * c // per_node))  # two nodes: the chunk, once


def _ef_body(rank, world, fast):
    h = hier_group(world, 2)
    spec = {"inter_node": INT4, "intra_node": fast}
    ch = comm.HierarchicalChannel("dp", spec, group=h, error_feedback="ef")
    x = [rank_input(rank, world * 512, salt=s) for s in range(3)]
    out = torch.empty(512)
    ch.reduce_scatter_tensor(out, x[0], key="b0")
    saved = ch.state_dict()
    shapes = {k: tuple(v.shape) for k, v in ch.error_feedback.state_dict()["errors"].items()}
    ch.reduce_scatter_tensor(out, x[1], key="b0")
    first = out.clone()
    fresh = comm.HierarchicalChannel("dp", spec, group=h, error_feedback="ef")
    fresh.load_state_dict(saved)
    again = torch.empty(512)
    fresh.reduce_scatter_tensor(again, x[1], key="b0")
    without = comm.HierarchicalChannel("dp", spec, group=h)  # no error feedback: a different second result
    plain = torch.empty(512)
    without.reduce_scatter_tensor(plain, x[0], key="b0")
    without.reduce_scatter_tensor(plain, x[1], key="b0")
    return shapes, torch.equal(first, again), torch.equal(first, plain), ch.worker_numel(world * 512)


@pytest.mark.parametrize("fast", ["none", "bf16"])
def test_error_feedback_per_hop_survives_state_dict(fast):
    world = 4
    for shapes, resumed_equal, same_without_ef, worker in run_ranks(_ef_body, world, fast):
        expected = {"b0/worker": (world * 512 // 2,)}  # the slow hop's residual: on the chunk it sends
        if fast == "bf16":
            expected["b0@intra_node/worker"] = (world * 512,)  # the fast hop's own residual
        assert shapes == expected
        assert worker == world * 512 // 2
        assert resumed_equal and not same_without_ef


def _residual_body(rank, world, per_node, sites, link):
    h = hier_group(world, per_node, sites)
    ch = comm.HierarchicalChannel("dp", {hop: "bf16" for hop in h.links}, group=h, error_feedback="ef")
    c = 64
    ch.init_residuals("b0", world * c)
    chunks, share = ch.residual_chunks(link)
    e = ch.error_feedback.error(ch.residual_key("b0", link))  # the stored tensor (fp32 storage): set it in place
    # small integers (bf16-exact, sums too): rank + 1, plus the element's place in its chunk, mod 4
    e.copy_((rank + 1 + torch.arange(e.numel()) % c % 4).float())
    out = torch.empty(c)
    ch.reduce_scatter_tensor(out, torch.zeros(world * c), key="b0")  # sends exactly what the residuals owe
    return chunks, share, out


@pytest.mark.parametrize("world,per_node,sites,link", [(4, 2, 0, "inter_node"), (4, 2, 0, "intra_node"),
                                                         (8, 2, 2, "inter_site"), (8, 2, 2, "inter_node"),
                                                         (8, 2, 2, "intra_node")])
def test_residual_chunks_say_where_each_hops_residual_lands(world, per_node, sites, link):
    """What megacomp.training.reshard relies on to move hop-by-hop residuals: the chunks a hop's residual covers,
    checked against the chunk each rank receives when the residuals are all a reduce-scatter sends."""
    results = run_ranks(_residual_body, world, per_node, sites, link)
    expected = [torch.zeros(64) for _ in range(world)]
    holders = [0] * world
    for r, (chunks, share, _) in enumerate(results):
        assert len(chunks) == share
        for k, g in enumerate(chunks):
            expected[g] += r + 1 + torch.arange(64) % 4
            holders[g] += 1
    assert all(n == results[0][1] for n in holders)  # each chunk is owed by ``share`` ranks
    for g, (_, _, out) in enumerate(results):
        assert torch.equal(out, expected[g]), g


def _bad_body(rank, world):
    h = hier_group(world, 2)
    errors = []
    try:
        comm.HierarchicalChannel("dp", {"inter_site": "int4"}, group=h)
    except ValueError as e:
        errors.append(str(e))
    ch = comm.HierarchicalChannel("dp", "int4", group=h)
    try:
        ch.all_reduce(torch.ones(8), group=dist.new_group([0, 1, 2, 3]))
    except ValueError as e:
        errors.append(str(e))
    try:
        comm.make_channel("dp", {"inter_node": "int4"}, group=None)
    except ValueError as e:
        errors.append(str(e))
    try:
        ch.all_reduce(torch.ones(8), op=dist.ReduceOp.MAX)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_bad_settings_one_line_each():
    errors = run_ranks(_bad_body, 4)[0]
    assert len(errors) == 4 and all("\n" not in e for e in errors)
    assert "inter_site hop, which this group does not cross (its hops: intra_node, inter_node)" in errors[0]
    assert "called with another group" in errors[1]
    assert "this group is flat" in errors[2]
    assert "supports ReduceOp SUM and AVG, got MAX" in errors[3]
