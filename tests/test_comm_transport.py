"""megacomp.comm.transport: the full-duplex p2p byte exchange and the segment pipeline.

- The compressed collectives give bit-identical results and identical wire bytes whether their bytes
  travel over gloo's collectives or over the direction-split p2p groups (world 2, 3, 4).
- A pipelined all-reduce equals the concatenation of independent all-reduces of its segments, with and
  without error feedback (whose state is the concatenation of the segments' states).
"""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp import comm
from megacomp.comm import transport


def _inputs(rank, n, salt=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * salt + rank)) * (rank + 1)


def _collectives(rank, world, codec):
    x = _inputs(rank, 1003)
    y = x.clone()
    comm.reset_stats()
    comm.all_reduce(y, codec=codec, tag="ar")
    rs_out = torch.empty(257)
    comm.reduce_scatter_tensor(rs_out, _inputs(rank, world * 257, 1), codec=codec, tag="rs")
    ag_out = torch.empty(world * 301)
    comm.all_gather_into_tensor(ag_out, _inputs(rank, 301, 2), codec=codec, tag="ag")
    splits = [(rank + j) % 3 + 1 for j in range(world)]
    out_splits = [(j + rank) % 3 + 1 for j in range(world)]
    a2a_in = _inputs(rank, sum(splits) * 7, 3).view(-1, 7)
    a2a_out = torch.empty(sum(out_splits), 7)
    comm.all_to_all_single(a2a_out, a2a_in, out_splits, splits, codec=codec, tag="a2a")
    wire = {k: v.wire_bytes for k, v in comm.stats().items()}
    return y, rs_out, ag_out, a2a_out, wire


def _duplex_body(rank, world):
    out = {}
    for mode in (False, True):
        transport.set_duplex(mode)
        out[mode] = [_collectives(rank, world, c) for c in ("int4", "fp8_e4m3")]
    transport.set_duplex(None)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_duplex_p2p_transport_matches_backend_collectives_bit_for_bit(world):
    for res in run_ranks(_duplex_body, world):
        for plain, duplex in zip(res[False], res[True]):
            for a, b in zip(plain[:4], duplex[:4]):
                assert torch.equal(a, b)
            assert plain[4] == duplex[4]  # same bytes on the wire


def _pipeline_body(rank, world, n, seg, steps):
    x = _inputs(rank, n)
    transport.set_pipeline_numel(seg)
    piped = []
    for _ in range(steps):
        y = x.clone()
        comm.all_reduce(y, codec="int4", error_feedback="ef", tag="piped", ef_key="piped")
        piped.append(y)
    states = {k.split("#")[0]: v for k, v in comm.error_feedback_states().items()}
    piped_state = states["piped"]
    transport.set_pipeline_numel(0)
    sizes = transport.split_sizes(n, -(-n // seg))
    parts = [[] for _ in range(steps)]
    o = 0
    for i, s in enumerate(sizes):
        for t in range(steps):
            y = x[o:o + s].clone()
            comm.all_reduce(y, codec="int4", error_feedback="ef", tag=f"seg{i}", ef_key=f"seg{i}")
            parts[t].append(y)
        o += s
    transport.set_pipeline_numel(transport.PIPELINE_NUMEL)
    seg_states = {k.split("#")[0]: v for k, v in comm.error_feedback_states().items()}
    worker = torch.cat([seg_states[f"seg{i}"].error(f"seg{i}/worker") for i in range(len(sizes))])
    server = [seg_states[f"seg{i}"].error(f"seg{i}/server") for i in range(len(sizes))]
    server = torch.cat(server) if server[0] is not None else None
    return (piped, [torch.cat(p) for p in parts], piped_state.error("piped/worker"), worker,
            piped_state.error("piped/server"), server)


@pytest.mark.parametrize("world", [2, 3])
def test_pipelined_all_reduce_equals_independent_segments(world):
    n, seg = 5000, 1200  # 5 segments of 1000
    for piped, segs, w_p, w_s, s_p, s_s in run_ranks(_pipeline_body, world, n, seg, 3):
        for a, b in zip(piped, segs):
            assert torch.equal(a, b)
        assert torch.equal(w_p, w_s)  # error feedback state: the segments' states, concatenated
        if world == 2:
            assert s_p is None and s_s is None  # two ranks: one quantization, no server error
        else:
            assert torch.equal(s_p, s_s)


def test_pipeline_segments_and_settings():
    old = transport.set_pipeline_numel(100)
    try:
        assert transport.pipeline_segments(100) == [100]
        assert transport.pipeline_segments(250) == [84, 83, 83]
        transport.set_pipeline_numel(0)
        assert transport.pipeline_segments(10**9) == [10**9]
        with pytest.raises(ValueError, match="numel must be >= 0"):
            transport.set_pipeline_numel(-1)
    finally:
        transport.set_pipeline_numel(old)


def _rs_ag_pipeline_body(rank, world, m, seg):
    inp = _inputs(rank, world * m, 5)
    x = _inputs(rank, m, 6)
    transport.set_pipeline_numel(seg)
    rs = torch.empty(m)
    comm.reduce_scatter_tensor(rs, inp, codec="int4", error_feedback="ef", ef_key="rs-piped")
    ag = torch.empty(world * m)
    comm.all_gather_into_tensor(ag, x, codec="int4")
    transport.set_pipeline_numel(0)
    pieces = transport.split_sizes(m, -(-world * m // seg))
    rs_ref, ag_ref = torch.empty(m), torch.empty(world * m)
    o = 0
    for k, s in enumerate(pieces):  # each piece as its own unpipelined collective
        part = torch.cat([inp[j * m + o:j * m + o + s] for j in range(world)])
        out = torch.empty(s)
        comm.reduce_scatter_tensor(out, part, codec="int4", error_feedback="ef", ef_key=f"rs-piece{k}")
        rs_ref[o:o + s] = out
        g = torch.empty(world * s)
        comm.all_gather_into_tensor(g, x[o:o + s], codec="int4")
        for j in range(world):
            ag_ref[j * m + o:j * m + o + s] = g[j * s:(j + 1) * s]
        o += s
    transport.set_pipeline_numel(transport.PIPELINE_NUMEL)
    states = {k.split("#")[0]: v for k, v in comm.error_feedback_states().items()}
    piped_err = states["rs-piped"].error("rs-piped/worker")
    piece_errs = [states[f"rs-piece{k}"].error(f"rs-piece{k}/worker") for k in range(len(pieces))]
    # the piped error is in input order: chunk j's pieces are consecutive
    ref_err = torch.cat([e[j * s:(j + 1) * s] for j in range(world) for e, s in zip(piece_errs, pieces)])
    return torch.equal(rs, rs_ref), torch.equal(ag, ag_ref), torch.equal(piped_err, ref_err), len(pieces)


@pytest.mark.parametrize("world", [2, 3])
def test_pipelined_reduce_scatter_and_all_gather_equal_independent_pieces(world):
    for rs_ok, ag_ok, ef_ok, npieces in run_ranks(_rs_ag_pipeline_body, world, 1001, 700):
        assert npieces > 2 and rs_ok and ag_ok and ef_ok
