"""megacomp.comm.transport: the full-duplex p2p byte exchange and the segment pipeline.

- The compressed collectives give bit-identical results and identical wire bytes whether their bytes
  travel over gloo's collectives or over the direction-split p2p groups (world 2, 3, 4).
- A pipelined all-reduce equals the concatenation of independent all-reduces of its segments, with and
  without error feedback (whose state is the concatenation of the segments' states).
"""
import pytest
import torch

from distributed import run_ranks
from megacomp import comm
from megacomp.comm import transport
from megacomp.comm.common import split_sizes


def _inputs(rank, n, salt=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * salt + rank)) * (rank + 1)


def _collectives(rank, world, codec, duplex):
    ch = comm.Channel("t", codec, options=comm.CommOptions(duplex=duplex), stats=comm.StatsTable())
    x = _inputs(rank, 1003)
    y = x.clone()
    ch.all_reduce(y, tag="ar")
    rs_out = torch.empty(257)
    ch.reduce_scatter_tensor(rs_out, _inputs(rank, world * 257, 1), tag="rs")
    ag_out = torch.empty(world * 301)
    ch.all_gather_into_tensor(ag_out, _inputs(rank, 301, 2), tag="ag")
    splits = [(rank + j) % 3 + 1 for j in range(world)]
    out_splits = [(j + rank) % 3 + 1 for j in range(world)]
    a2a_in = _inputs(rank, sum(splits) * 7, 3).view(-1, 7)
    a2a_out = torch.empty(sum(out_splits), 7)
    ch.all_to_all_single(a2a_out, a2a_in, out_splits, splits, tag="a2a")
    wire = {k: v.wire_bytes for k, v in ch.stats.snapshot().items()}
    return y, rs_out, ag_out, a2a_out, wire


def _duplex_body(rank, world):
    return {mode: [_collectives(rank, world, c, mode) for c in ("int4", "fp8_e4m3")] for mode in (False, True)}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_duplex_p2p_transport_matches_backend_collectives_bit_for_bit(world):
    for res in run_ranks(_duplex_body, world):
        for plain, duplex in zip(res[False], res[True]):
            for a, b in zip(plain[:4], duplex[:4]):
                assert torch.equal(a, b)
            assert plain[4] == duplex[4]  # same bytes on the wire


def _left_out_body(rank, world):
    import torch.distributed as dist
    dist.new_group([0, 1])  # rank 2 is left out: it now belongs to fewer groups than ranks 0 and 1
    ch = comm.Channel("left_out", "int8", options=comm.CommOptions(duplex=True))
    t = torch.ones(300)
    ch.all_reduce(t)
    return t


def test_duplex_works_after_a_group_that_left_a_rank_out():
    """The direction communicators are agreed over the group, not named by torch's local-synchronization rule
    (after how many groups the process belongs to), which differs between these ranks: that hung."""
    for t in run_ranks(_left_out_body, 3, timeout=60):
        assert torch.equal(t, torch.full((300,), 3.0))


def _pipeline_body(rank, world, n, seg, steps):
    x = _inputs(rank, n)
    piped_ch = comm.Channel("piped", "int4", error_feedback="ef", options=comm.CommOptions(segment_numel=seg))
    piped = []
    for _ in range(steps):
        y = x.clone()
        piped_ch.all_reduce(y)
        piped.append(y)
    piped_state = piped_ch.error_feedback
    sizes = split_sizes(n, -(-n // seg))
    seg_chs = [comm.Channel(f"seg{i}", "int4", error_feedback="ef", options=comm.CommOptions(segment_numel=0))
               for i in range(len(sizes))]
    parts = [[] for _ in range(steps)]
    o = 0
    for ch, s in zip(seg_chs, sizes):
        for t in range(steps):
            y = x[o:o + s].clone()
            ch.all_reduce(y)
            parts[t].append(y)
        o += s
    worker = torch.cat([ch.error_feedback.error(f"{ch.name}/worker") for ch in seg_chs])
    server = [ch.error_feedback.error(f"{ch.name}/server") for ch in seg_chs]
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


def test_pipeline_segments_and_settings(monkeypatch):
    assert transport.pipeline_segments(100, 100) == [100]
    assert transport.pipeline_segments(250, 100) == [84, 83, 83]
    assert transport.pipeline_segments(10**9, 0) == [10**9]
    with pytest.raises(ValueError, match="segment_numel must be an int >= 0"):
        comm.CommOptions(segment_numel=-1)
    monkeypatch.setenv("MEGACOMP_PIPELINE_NUMEL", "4096")
    monkeypatch.setenv("MEGACOMP_DUPLEX", "0")
    assert comm.CommOptions.from_env() == comm.CommOptions(duplex=False, segment_numel=4096)
    assert comm.CommOptions.from_env(validate=False).validate is False
    monkeypatch.setenv("MEGACOMP_DUPLEX", "maybe")
    with pytest.raises(ValueError, match="MEGACOMP_DUPLEX"):
        comm.CommOptions.from_env()


def _rs_ag_pipeline_body(rank, world, m, seg):
    inp = _inputs(rank, world * m, 5)
    x = _inputs(rank, m, 6)
    piped_ch = comm.Channel("rs-piped", "int4", error_feedback="ef", options=comm.CommOptions(segment_numel=seg))
    rs = torch.empty(m)
    piped_ch.reduce_scatter_tensor(rs, inp)
    ag = torch.empty(world * m)
    comm.Channel("ag", "int4", options=comm.CommOptions(segment_numel=seg)).all_gather_into_tensor(ag, x)
    whole = comm.CommOptions(segment_numel=0)
    pieces = split_sizes(m, -(-world * m // seg))
    piece_chs = [comm.Channel(f"rs-piece{k}", "int4", error_feedback="ef", options=whole) for k in range(len(pieces))]
    rs_ref, ag_ref = torch.empty(m), torch.empty(world * m)
    o = 0
    for k, s in enumerate(pieces):  # each piece as its own unpipelined collective
        part = torch.cat([inp[j * m + o:j * m + o + s] for j in range(world)])
        out = torch.empty(s)
        piece_chs[k].reduce_scatter_tensor(out, part)
        rs_ref[o:o + s] = out
        g = torch.empty(world * s)
        comm.Channel("ag", "int4", options=whole).all_gather_into_tensor(g, x[o:o + s])
        for j in range(world):
            ag_ref[j * m + o:j * m + o + s] = g[j * s:(j + 1) * s]
        o += s
    piped_err = piped_ch.error_feedback.error("rs-piped/worker")
    piece_errs = [ch.error_feedback.error(f"{ch.name}/worker") for ch in piece_chs]
    # the piped error is in input order: chunk j's pieces are consecutive
    ref_err = torch.cat([e[j * s:(j + 1) * s] for j in range(world) for e, s in zip(piece_errs, pieces)])
    return torch.equal(rs, rs_ref), torch.equal(ag, ag_ref), torch.equal(piped_err, ref_err), len(pieces)


@pytest.mark.parametrize("world", [2, 3])
def test_pipelined_reduce_scatter_and_all_gather_equal_independent_pieces(world):
    for rs_ok, ag_ok, ef_ok, npieces in run_ranks(_rs_ag_pipeline_body, world, 1001, 700):
        assert npieces > 2 and rs_ok and ag_ok and ef_ok


def _duplex_choice(rank, world):
    cpu = transport.use_duplex(None, None, torch.device("cpu"))
    meta = transport.use_duplex(None, None, torch.device("meta"))  # stands for device memory: any non-host tensor
    return cpu, meta, transport.use_duplex(None, True, torch.device("meta")), transport.use_duplex(None, None)


def test_gloo_duplex_only_for_host_tensors():
    """gloo's point-to-point send cannot read device memory ("writev ... Bad address" with CUDA tensors on an H200),
    so the automatic choice is direction-split p2p for host tensors only; an explicit setting still wins."""
    assert run_ranks(_duplex_choice, 2)[0] == (True, False, True, True)


# -- the seam: a process-group object (torchft's reconfigurable gloo group) carries the same collectives ----------

def _torchft_group(rank, world):
    """torchft's ProcessGroupGloo over this job's ranks, configured directly (what its Manager does at a quorum) on a
    TCPStore of rank 0's; not registered with torch.distributed."""
    import torch.distributed as dist
    from torchft import ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    pg = ProcessGroupGloo()
    pg.configure(f"localhost:{port[0]}/seam", "0", rank, world)
    return pg, store


def _object_group_body(rank, world):
    pg, store = _torchft_group(rank, world)
    results = {}
    for codec in (None, "int8", "int4"):
        for mode in ("plain", "object"):
            ch = comm.Channel("t", codec, group=pg if mode == "object" else None, stats=comm.StatsTable(),
                              options=comm.CommOptions(duplex=False if mode == "plain" else None))
            results[codec, mode] = _collectives_on(ch, rank, world)
    ef = {}
    for mode in ("plain", "object"):  # error feedback carries over steps identically
        ch = comm.Channel("ef", "int4", error_feedback="ef", group=pg if mode == "object" else None,
                          options=comm.CommOptions(duplex=False if mode == "plain" else None))
        outs = []
        for step in range(3):
            y = _inputs(rank, 517, 10 + step)
            ch.all_reduce(y)
            outs.append(y)
        ef[mode] = (outs, ch.error_feedback.error("ef/worker"))
    errors = []
    ch = comm.Channel("p2p", None, group=pg)
    for call in (lambda: ch.isend(torch.zeros(3), 1 - rank), lambda: ch.irecv(torch.zeros(3), 1 - rank)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    try:
        comm.Channel("d", "int8", group=pg, options=comm.CommOptions(duplex=True)).all_reduce(torch.ones(8))
    except ValueError as e:
        errors.append(str(e))
    mismatch = None
    try:  # ranks disagree on the codec: every rank gets the same ValueError instead of a hang
        comm.Channel("m", "int8" if rank == 0 else "int4", group=pg).all_reduce(torch.ones(64))
    except ValueError as e:
        mismatch = str(e)
    return results, ef, errors, mismatch


def _collectives_on(ch, rank, world):
    y = _inputs(rank, 1003)
    ch.all_reduce(y, tag="ar")
    avg = _inputs(rank, 64, 7)
    ch.all_reduce(avg, op=torch.distributed.ReduceOp.SUM, tag="ar")
    rs_out = torch.empty(257)
    ch.reduce_scatter_tensor(rs_out, _inputs(rank, world * 257, 1), tag="rs")
    ag_out = torch.empty(world * 301)
    ch.all_gather_into_tensor(ag_out, _inputs(rank, 301, 2), tag="ag")
    a2a_out = torch.empty(world * 2, 7)
    ch.all_to_all_single(a2a_out, _inputs(rank, world * 2 * 7, 3).view(-1, 7), tag="a2a")
    wire = {k: v.wire_bytes for k, v in ch.stats.snapshot().items()}
    return [y, avg, rs_out, ag_out, a2a_out], wire


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_channel_over_a_torchft_process_group_object_equals_the_plain_group_bit_for_bit(world):
    """A Channel whose group is torchft's ProcessGroupGloo (served by its own methods, megacomp.comm.group_ops)
    gives the same bits as the registered gloo group: codec None is torch's collective on both; int8/int4 run the
    same algorithm on the same bytes (all-to-all / all-gather of the encodings), with the same wire counts and the
    same error-feedback state. What an object group cannot serve (p2p, duplex) and mismatched codecs raise one line."""
    pytest.importorskip("torchft")
    for results, ef, errors, mismatch in run_ranks(_object_group_body, world, start_method="spawn"):
        for codec in (None, "int8", "int4"):
            plain, obj = results[codec, "plain"], results[codec, "object"]
            for a, b in zip(plain[0], obj[0]):
                assert torch.equal(a, b), codec
            assert plain[1] == obj[1]  # the same wire counts
        for a, b in zip(ef["plain"][0], ef["object"][0]):
            assert torch.equal(a, b)
        assert torch.equal(ef["plain"][1], ef["object"][1])
        assert len(errors) == 3 and all("process-group object" in e for e in errors)
        assert mismatch is not None and "codec differs across ranks" in mismatch
