"""Multi-rank tests of megacomp.comm collectives on real gloo process groups.

- codec=None / "none" is bit-identical to torch.distributed (world 2, 3, 4; uneven sizes; subgroups).
- Compressed results equal the fp32 reduction of the dequantized inputs (a replica of the algorithm
  computed from every rank's input), are identical on all ranks, and are within the codec's derived
  bound of the exact result; int4 puts <= 0.16x the fp32 bytes on the wire.
"""
import pytest
import torch
import torch.distributed as dist

from codec_bounds import elementwise_bound
from distributed import run_ranks
from megacomp import comm
from megacomp.compression import make_codec
from megacomp.comm.common import split_sizes

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


def rank_input(rank, numel, dtype=torch.float32, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return (torch.randn(numel, generator=g) * (rank + 1)).to(dtype)


def ring_p2p(rank, world, x, recv_into, **kw):
    """Send x to rank+1 and receive from rank-1 (even ranks send first: no deadlock)."""
    dst, src = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:
        comm.send(x, dst, **kw)
        comm.recv(recv_into, src, **kw)
    else:
        comm.recv(recv_into, src, **kw)
        comm.send(x, dst, **kw)


# ---------------------------------------------------------------------------------------------------
def _identity_body(rank, world):
    members = [r for r in range(world) if r != 1] if world > 2 else list(range(world))
    sub = dist.new_group(members)
    checked = 0
    for group, grank, gworld in [(None, rank, world), (sub, members.index(rank) if rank in members else -1, len(members))]:
        if grank < 0:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            for codec in (None, "none"):
                for op in (SUM, AVG) if dtype == torch.float32 else (SUM,):
                    x = rank_input(rank, 1001, dtype)
                    a, b = x.clone(), x.clone()
                    dist.all_reduce(a, op=op, group=group)
                    comm.all_reduce(b, op=op, group=group, codec=codec)
                    assert torch.equal(a, b)
                    inp = rank_input(rank, gworld * 333, dtype, salt=1)
                    a, b = torch.empty(333, dtype=dtype), torch.empty(333, dtype=dtype)
                    dist.reduce_scatter_tensor(a, inp, op=op, group=group)
                    comm.reduce_scatter_tensor(b, inp, op=op, group=group, codec=codec)
                    assert torch.equal(a, b)
                    checked += 2
                x = rank_input(rank, 77, dtype, salt=2)
                a, b = torch.empty(gworld * 77, dtype=dtype), torch.empty(gworld * 77, dtype=dtype)
                dist.all_gather_into_tensor(a, x, group=group)
                comm.all_gather_into_tensor(b, x, group=group, codec=codec)
                assert torch.equal(a, b)
                # uneven all-to-all: rank i sends (i + j) % 3 + 1 rows of 5 to rank j
                ins = [(grank + j) % 3 + 1 for j in range(gworld)]
                outs = [(j + grank) % 3 + 1 for j in range(gworld)]
                x = rank_input(rank, sum(ins) * 5, dtype, salt=3).view(-1, 5)
                a, b = torch.empty(sum(outs), 5, dtype=dtype), torch.empty(sum(outs), 5, dtype=dtype)
                dist.all_to_all_single(a, x, outs, ins, group=group)
                comm.all_to_all_single(b, x, outs, ins, group=group, codec=codec)
                assert torch.equal(a, b)
                checked += 2
    x, got = rank_input(rank, 129, salt=4), torch.empty(129)
    ring_p2p(rank, world, x, got, codec=None)
    assert torch.equal(got, rank_input((rank - 1) % world, 129, salt=4))
    return checked


@pytest.mark.parametrize("world", [2, 3, 4])
def test_codec_none_is_bit_identical_to_torch_distributed(world):
    assert all(c > 0 for c in run_ranks(_identity_body, world))


# ---------------------------------------------------------------------------------------------------
def replica_all_reduce(xs, codecs, avg):
    """The compressed all-reduce recomputed from every rank's input: (reduced shards, final result).
    Two ranks exchange their whole encodings (no shards, one quantization); more ranks reduce-scatter
    and all-gather the re-encoded shards. Each rank's call draws from one stream (a seeded codec's stream
    starts at its seed on every free-function call and continues across the call's chunks)."""
    world, n = len(xs), xs[0].numel()
    gens = [c.stream() for c in codecs]
    if world == 2:
        acc = torch.zeros(n)
        for r in range(world):
            acc += codecs[r].decode_flat(codecs[r].encode_flat(xs[r], gens[r]), n)
        return None, acc / world if avg else acc
    sizes = split_sizes(n, world)
    offs = [sum(sizes[:j]) for j in range(world)]
    enc = [[codecs[r].encode_flat(xs[r][o:o + s], gens[r]) for o, s in zip(offs, sizes)] for r in range(world)]
    shards = []
    for j, s in enumerate(sizes):
        acc = torch.zeros(s)
        for r in range(world):
            acc += codecs[r].decode_flat(enc[r][j], s)
        shards.append(acc / world if avg else acc)
    final = torch.cat([codecs[j].decode_flat(codecs[j].encode_flat(shards[j], gens[j]), s) for j, s in enumerate(sizes)])
    return shards, final


CODECS = [dict(name="int8"), dict(name="int4"), dict(name="int2", block_size=32), dict(name="sign"),
          dict(name="fp8_e4m3"), dict(name="fp8_e5m2", block_size=0), dict(name="bf16"), dict(name="fp16"),
          dict(name="int4", block_size=16, dual_scale=True), dict(name="int4", rounding="stochastic")]


def _compressed_body(rank, world, numel):
    results = []
    for spec in CODECS:
        for op in (SUM, AVG):
            seeded = dict(spec, seed=100 + rank) if spec.get("rounding") == "stochastic" else spec
            x = rank_input(rank, numel)
            y = x.clone()
            comm.reset_stats()
            comm.all_reduce(y, op=op, codec=make_codec(seeded), tag="ar")
            st = comm.stats()["ar"]
            rs_out = torch.empty(numel // world)
            rs_in = rank_input(rank, world * (numel // world), salt=1)
            comm.reduce_scatter_tensor(rs_out, rs_in, op=op, codec=make_codec(seeded), tag="rs")
            results.append((spec, op == AVG, y, st.wire_bytes, st.uncompressed_bytes, rs_out))
    return results


def codec_for(spec, rank):
    return make_codec(dict(spec, seed=100 + rank) if spec.get("rounding") == "stochastic" else spec)


@pytest.mark.parametrize("world,numel", [(2, 1001), (3, 1001), (4, 4099), (4, 3)])
def test_compressed_all_reduce_and_reduce_scatter(world, numel):
    per_rank = run_ranks(_compressed_body, world, numel)
    for i, (spec, avg, *_rest) in enumerate(per_rank[0]):
        xs = [rank_input(r, numel) for r in range(world)]
        shards, final = replica_all_reduce(xs, [codec_for(spec, r) for r in range(world)], avg)
        results = [per_rank[r][i][2] for r in range(world)]
        for r in range(world):  # identical on all ranks, equal to the replica
            assert torch.equal(results[r], final), (spec, avg, r)
        # within the codec's bound of the exact reduction
        exact = torch.stack([x.double() for x in xs]).sum(0) / (world if avg else 1)
        codec = make_codec(spec)
        sizes = split_sizes(numel, world)
        bound = torch.zeros(numel, dtype=torch.float64)
        o = 0
        if shards is None:  # two ranks: each whole input quantized once
            for x in xs:
                bound += elementwise_bound(codec, x) / (world if avg else 1)
        for j, s in enumerate(sizes if shards is not None else []):
            for x in xs:  # each chunk quantized by its sender, then the reduced shard re-quantized
                bound[o:o + s] += elementwise_bound(codec, x[o:o + s]) / (world if avg else 1)
            bound[o:o + s] += elementwise_bound(codec, shards[j])
            o += s
        bound += exact.abs() * world * 2.0 ** -22  # fp32 summation
        assert ((final.double() - exact).abs() <= bound).all(), (spec, avg)
        # reduce-scatter: exactly the fp32 sum of dequantized chunks, on each rank's own chunk
        m = numel // world
        ins = [rank_input(r, world * m, salt=1) for r in range(world)]
        decoded = []  # decoded[q][r]: rank q's chunk r as rank r decodes it (q encodes its chunks in order)
        for q in range(world):
            c = codec_for(spec, q)
            gen = c.stream()  # one stream per call, from the seed
            decoded.append([c.decode_flat(c.encode_flat(ins[q][r * m:(r + 1) * m], gen), m) for r in range(world)])
        for r in range(world):
            acc = torch.zeros(m)
            for q in range(world):
                acc += decoded[q][r]
            acc = acc / world if avg else acc
            assert torch.equal(per_rank[r][i][5], acc), (spec, avg, r)
    # int4 all-reduce puts at most 0.16x the fp32 bytes on the wire
    if numel > 1000:
        for spec, avg, _y, wire, raw, _rs in per_rank[0]:
            if spec == dict(name="int4"):
                assert wire <= 0.16 * raw, (wire, raw)


# ---------------------------------------------------------------------------------------------------
def _gather_a2a_async_body(rank, world):
    codec = make_codec("int8", block_size=64)
    x = rank_input(rank, 300)
    out = torch.empty(world * 300)
    comm.all_gather_into_tensor(out, x, codec=codec)
    ins = [(rank + j) % 3 + 1 for j in range(world)]
    outs = [(j + rank) % 3 + 1 for j in range(world)]
    a2a_in = rank_input(rank, sum(ins) * 7, salt=3).view(-1, 7)
    a2a_out = torch.empty(sum(outs), 7)
    comm.all_to_all_single(a2a_out, a2a_in, outs, ins, codec=codec)
    # async: start, compute meanwhile, wait; equals the synchronous result
    sync, asyn = rank_input(rank, 5000), rank_input(rank, 5000)
    comm.all_reduce(sync, codec="int4")
    handle = comm.all_reduce(asyn, codec="int4", async_op=True)
    torch.mm(torch.randn(64, 64), torch.randn(64, 64))
    handle.wait()
    assert handle.is_completed() and torch.equal(sync, asyn)
    # a group of one rank: nothing to send, tensor unchanged
    solo = [dist.new_group([r]) for r in range(world)][rank]
    y = x.clone()
    comm.all_reduce(y, group=solo, codec="int4")
    assert torch.equal(x, y)
    return out, a2a_out, a2a_in


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_all_gather_all_to_all_async(world):
    codec = make_codec("int8", block_size=64)
    res = run_ranks(_gather_a2a_async_body, world)
    expected = torch.cat([codec.roundtrip(rank_input(r, 300)) for r in range(world)])
    for r in range(world):
        assert torch.equal(res[r][0], expected)
        x = rank_input(r, 300)
        assert ((res[r][0][r * 300:(r + 1) * 300] - x).abs().double() <= elementwise_bound(codec, x)).all()
    for r in range(world):  # rank r receives from rank j the rows j sent to r, decoded
        pieces = []
        for j in range(world):
            ins_j = [(j + k) % 3 + 1 for k in range(world)]
            start = sum(ins_j[:r])
            rows = res[j][2][start:start + ins_j[r]]
            pieces.append(codec.roundtrip(rows))
        assert torch.equal(res[r][1], torch.cat(pieces))


# ---------------------------------------------------------------------------------------------------
def _ef_body(rank, world, steps):
    x = rank_input(rank, 1001)
    total = torch.zeros(1001, dtype=torch.float64)
    plain_total = torch.zeros(1001, dtype=torch.float64)
    channel = comm.Channel("ef-test", "int2", error_feedback="ef")  # the channel owns the residual
    for _ in range(steps):
        y = x.clone()
        channel.all_reduce(y)
        total += y.double()
        z = x.clone()
        comm.all_reduce(z, codec="int2")
        plain_total += z.double()
    state = channel.error_feedback
    return total, plain_total, state.error("ef-test/worker"), state.error("ef-test/server")


def test_two_level_error_feedback_telescopes_through_all_reduce():
    """Classic EF with a worker and a server error: sum_t out_t = T * exact - sum_r e_worker_r - e_server."""
    world, steps = 3, 25
    res = run_ranks(_ef_body, world, steps)
    exact = torch.stack([rank_input(r, 1001).double() for r in range(world)]).sum(0)
    worker = torch.stack([r[2].double() for r in res]).sum(0)
    server = torch.cat([r[3].double() for r in res])  # shards in rank order
    total = res[0][0]
    residual = total + worker + server - steps * exact
    assert residual.abs().max().item() <= steps * exact.abs().max().item() * world * 2.0 ** -20
    # so the time-averaged result converges, unlike int2 without error feedback
    assert (total / steps - exact).norm() < 0.25 * (res[0][1] / steps - exact).norm()


def _ef_empty_chunks_body(rank, world, spec, steps):
    """Tiny tensors cut into 2-element pipeline segments: many chunks (and own shards) are empty."""
    codec = make_codec(dict(spec, seed=100 + rank) if spec.get("rounding") == "stochastic" else spec)
    opts = comm.CommOptions(segment_numel=2)
    ar = comm.Channel("ar", codec, error_feedback="ef", options=opts)
    rs = comm.Channel("rs", codec, error_feedback="ef", options=opts)
    ef_ar, ef_rs = ar.error_feedback, rs.error_feedback
    x, xr = rank_input(rank, 6), rank_input(rank + 10, 4)
    total, rs_total = torch.zeros(6, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    for _ in range(steps):
        y = x.clone()
        ar.all_reduce(y)
        total += y.double()
        out = torch.empty(1)
        rs.reduce_scatter_tensor(out, xr)
        rs_total += out.double()
    return total, ef_ar.error("ar/worker"), ef_ar.error("ar/server"), rs_total, ef_rs.error("rs/worker")


@pytest.mark.parametrize("spec", [dict(name="sign"), dict(name="int4", block_size=16, rounding="stochastic")],
                         ids=["sign", "int4-stochastic"])
def test_error_feedback_with_empty_chunks_telescopes(spec):
    """Classic EF through chunks of 0-2 elements (world 4, 2-element segments): sum_t out_t equals
    T * exact minus the final errors (worker errors of every rank, the server shards) up to fp32 round-off,
    for the all-reduce and for the reduce-scatter (rank r: its chunk of every rank's worker error)."""
    world, steps = 4, 5
    res = run_ranks(_ef_empty_chunks_body, world, spec, steps)
    exact = torch.stack([rank_input(r, 6).double() for r in range(world)]).sum(0)
    worker = torch.stack([r[1].double() for r in res]).sum(0)
    server = torch.cat([r[2].double() for r in res if r[2] is not None and r[2].numel()])
    tol = steps * world * 64 * 2.0 ** -23 * (exact.abs().max().item() + worker.abs().max().item() + 1.0)
    assert (res[0][0] + worker + server - steps * exact).abs().max().item() <= tol
    assert all(torch.equal(r[0], res[0][0]) for r in res)  # identical on every rank
    rs_exact = torch.stack([rank_input(r + 10, 4).double() for r in range(world)]).sum(0)
    rs_err = torch.stack([r[4].double() for r in res]).sum(0)
    for r in range(world):
        assert abs(res[r][3].item() + rs_err[r].item() - steps * rs_exact[r].item()) <= tol


def _gather_encoded_body(rank, world):
    ch = comm.Channel("encoded_test", None)
    comm.reset_stats()
    mine = torch.arange(5, dtype=torch.uint8) + 10 * rank
    out = torch.empty(world * 5, dtype=torch.uint8)
    ch.all_gather_encoded(out, mine, numel=3)
    stats = comm.stats()["encoded_test"]
    try:
        ch.all_gather_encoded(torch.empty(world * (5 + rank), dtype=torch.uint8),
                              torch.zeros(5 + rank, dtype=torch.uint8), numel=3)
        mismatch = ""
    except ValueError as e:
        mismatch = str(e)
    return out, (stats.wire_bytes, stats.uncompressed_bytes), mismatch


def test_all_gather_encoded_delivers_the_bytes_unchanged_and_refuses_unequal_sizes():
    world = 3
    for out, (wire, raw), mismatch in run_ranks(_gather_encoded_body, world):
        assert torch.equal(out, torch.cat([torch.arange(5, dtype=torch.uint8) + 10 * r for r in range(world)]))
        assert (wire, raw) == ((world - 1) * 5, (world - 1) * 3 * 4)  # counted against 3 fp32 elements
        assert "bytes differs across ranks" in mismatch
