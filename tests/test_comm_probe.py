"""megacomp.comm.probe: the compression-error probe measures what a channel delivers, and never changes it."""
import math

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp.comm import Channel
from megacomp.comm.probe import ErrorProbe, ProbeRecord, combine, input_stats, summarise
from megacomp.compression import make_codec

INT8 = {"name": "int8", "block_size": 64}


def _inputs(rank, n=4096):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g) * (1 + rank)


def _collectives(rank, world, probed, error_feedback):
    """Every probed collective of a channel, twice (error feedback carries state), armed or not."""
    probe = ErrorProbe() if probed else None
    ch = Channel("tp_backward", INT8, error_feedback=error_feedback, probe=probe)
    outs = []
    for step in range(2):
        if probe is not None:
            probe.arm(True)
        x = _inputs(rank) + step
        y = x.clone()
        ch.all_reduce(y, key="layer0")
        rs = torch.empty(x.numel() // world)
        work = ch.reduce_scatter_tensor(rs, x, key="layer1", async_op=True)
        work.wait()
        ag = torch.empty(world * 1024)
        ch.all_gather_into_tensor(ag, x[:1024])
        outs += [y, rs, ag]
        # the exact results, to check the probe's numbers against
        ex_ar = x.clone()
        dist.all_reduce(ex_ar)
        ex_rs = ex_ar[rank * rs.numel():(rank + 1) * rs.numel()]
        ex_ag = torch.empty(world * 1024)
        dist.all_gather_into_tensor(ex_ag, x[:1024])
        outs += [ex_ar, ex_rs, ex_ag]
    records, sent = probe.take() if probe is not None else ([], 0)
    return outs, [tuple(r.__dict__.values()) for r in records], sent


@pytest.mark.parametrize("error_feedback", [None, "loco"])
def test_probe_changes_nothing_and_measures_the_delivered_error(error_feedback):
    world = 2
    plain = run_ranks(_collectives, world, False, error_feedback)
    probed = run_ranks(_collectives, world, True, error_feedback)
    for rank in range(world):
        got, want = probed[rank][0], plain[rank][0]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), "probing changed a result"
        outs, rows, sent = probed[rank]
        records = [ProbeRecord(*r) for r in rows]
        # one armed window (arming again while armed keeps counting): calls are numbered in order
        assert [(r.key, r.index) for r in records] == list(zip(["layer0", "layer1", "tp_backward"] * 2, range(6)))
        for step in range(2):
            y, rs, ag, ex_ar, ex_rs, ex_ag = outs[6 * step:6 * step + 6]
            for r, delivered, exact in zip(records[3 * step:3 * step + 3], (y, rs, ag), (ex_ar, ex_rs, ex_ag)):
                # the probe's exact reference is torch.distributed's own result, on the same rank
                assert r.err_sq == pytest.approx(float(((delivered.double() - exact.double()) ** 2).sum()), rel=1e-9)
                assert r.ref_sq == pytest.approx(float((exact.double() ** 2).sum()), rel=1e-9)
                assert r.numel == delivered.numel()
                # int8 with one scale per 64 elements rounds each element to within half a step, amax / 254,
                # where amax is its block's largest |value|: at most M, the largest |value| of any rank's input
                # or of the sum. Every rank's input is encoded once (plus, for the all-reduce, at most one
                # encode of a partial sum), so |delivered - exact| <= encodes * sqrt(n) * M / 254
                encodes = world + 1 if r.key == "layer0" else world
                m = max(max(float((_inputs(q) + step).abs().max()) for q in range(world)), float(ex_ar.abs().max()))
                assert math.sqrt(r.err_sq) <= encodes * math.sqrt(r.numel) * m / 254
                assert r.rel_err > 0  # int8 is lossy: a zero would mean the probe compared the result with itself
        # reference bytes: all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of the fp32 tensor, twice
        assert sent == 2 * (2 * (world - 1) * 4096 // world * 4 + (world - 1) * 4096 // world * 4 + (world - 1) * 1024 * 4)


def _pipeline(rank, world, probed):
    probe = ErrorProbe() if probed else None
    ch = Channel("pp_activation", INT8, probe=probe)
    if probe is not None:
        probe.arm(True)
    x = _inputs(0, 2048).reshape(32, 64)
    if rank == 0:
        ch.send(x, 1, key="boundary0")
        records, _ = probe.take() if probe is not None else ([], 0)
        return x, [tuple(r.__dict__.values()) for r in records]
    y = torch.empty_like(x)
    ch.recv(y, 0)
    return y, []


def test_probe_measures_a_pipeline_message_as_the_receiver_decodes_it():
    plain, probed = run_ranks(_pipeline, 2, False), run_ranks(_pipeline, 2, True)
    assert torch.equal(plain[1][0], probed[1][0])
    x, rows = probed[0]
    (r,) = [ProbeRecord(*row) for row in rows]
    received = probed[1][0]
    assert r.key == "boundary0" and r.numel == x.numel()
    assert r.err_sq == pytest.approx(float(((received.double() - x.double()) ** 2).sum()), rel=1e-9)
    assert r.err_sq > 0


def _identity_and_small(rank, world):
    probe = ErrorProbe()
    probe.arm(True)
    y = _inputs(rank)
    Channel("dp_gradient", None, probe=probe).all_reduce(y)
    Channel("dp_gradient", INT8, probe=probe, min_compress_numel=10_000).all_reduce(y)  # below the threshold
    return probe.take()


def test_uncompressed_calls_are_not_probed():
    for records, sent in run_ranks(_identity_and_small, 2):
        assert records == [] and sent == 0


def test_statistics_and_aggregation():
    crest, kurt = input_stats(torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert crest == 1.0 and kurt == 1.0
    crest, kurt = input_stats(torch.tensor([0.0, 0.0, 0.0, 2.0]))
    assert crest == pytest.approx(2.0) and kurt == pytest.approx(4.0)  # max/rms = 2/1; E x^4 / (E x^2)^2 = 4/1
    assert input_stats(torch.zeros(3)) == (0.0, 0.0)
    a = ProbeRecord("p", "p", "k", 0, 10, 1.0, 100.0, 2.0, 3.0)
    b = ProbeRecord("p", "p", "k", 0, 10, 3.0, 300.0, 5.0, 1.0)
    c = ProbeRecord("p", "p", "k", 1, 10, 0.0, 4.0, 1.0, 1.0)
    (ab, c2) = combine([a, b, c])
    assert (ab.numel, ab.err_sq, ab.ref_sq, ab.crest, ab.kurtosis) == (20, 4.0, 400.0, 5.0, 3.0) and c2 == c
    rel, worst, crest, kurt, calls = summarise([ab, c2])["p"]
    assert rel == pytest.approx(math.sqrt(4.0 / 404.0)) and worst == pytest.approx(0.1) and calls == 2
    assert ProbeRecord("p", "p", "k", 0, 1, 1.0, 0.0, 0, 0).rel_err == 1e30


def test_arming_restarts_the_call_index():
    probe = ErrorProbe()
    probe.arm(True)
    assert probe._next_index("p") == 0 and probe._next_index("p") == 1
    probe.arm(False)
    probe.arm(True)
    assert probe._next_index("p") == 0
    make_codec("int8")  # the codec module is importable next to the probe (no import cycle)
