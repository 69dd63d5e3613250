"""PowerSGD (megacomp.compression.low_rank settings, megacomp.comm.low_rank_channel exchange) on real gloo groups.

Tolerances: fp32 products and a Householder QR of an ``n x r`` matrix are backward stable, so the computed
projection differs from the exact one by about ``c (n + m) eps`` relative to ``||sum||_F``, amplified by the
condition number of ``P`` where the span of ``P`` is what matters (tall matrices). The bounds below use
``c = 8`` and the measured condition number of the exact ``P``.
"""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp.comm import LowRankChannel, StatsTable
from megacomp.compression import PowerSGD, make_compressor, make_low_rank
from megacomp.compression.low_rank import initial_q, matrix_shape, q_seed

EPS = torch.finfo(torch.float32).eps
SHAPES = [(24, 8), (8, 24), (6, 4, 5), (40,), (16, 16)]


def _grads(rank: int, step: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _full_rank(rank, world):
    ch = LowRankChannel("dp_gradient", PowerSGD(rank=64, min_compression_rate=0, error_feedback=False))
    mine = _grads(rank)
    out = [t.clone() for t in mine]
    ch.all_reduce_coalesced(out)
    exact = [t.clone() for t in mine]
    for t in exact:
        dist.all_reduce(t)
    return out, exact


def test_full_rank_equals_the_uncompressed_sum():
    world = 3
    for out, exact in run_ranks(_full_rank, world):
        for i, (o, e, shape) in enumerate(zip(out, exact, SHAPES)):
            mat = matrix_shape(shape)
            if mat is None:  # 1-D: the plain all-reduce, bit for bit
                assert torch.equal(o, e)
                continue
            n, m = mat
            e2 = e.reshape(n, m).double()
            r = min(n, m)
            q = initial_q(m, r, q_seed(0, f"dp_gradient/{i}"), "cpu").double()
            cond = torch.linalg.cond(e2 @ q).item()
            bound = 8 * (n + m) * EPS * max(cond, 1.0) * e2.norm().item()
            assert (o.double() - e.double()).norm().item() <= bound, shape


def test_every_rank_delivers_the_same_bits():
    per_rank = [out for out, _ in run_ranks(_full_rank, 3)]
    for other in per_rank[1:]:
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0], other))


def _restatement(rank, world, steps, r):
    """megacomp's PowerSGD next to an fp64 single-process restatement of the paper's Algorithm 2 that sees
    every rank's gradients (all-gathered), with the same initial Q."""
    ch = LowRankChannel("dp_gradient", PowerSGD(rank=r, min_compression_rate=0))
    shapes = [s for s in SHAPES if len(s) > 1]
    ref_q = [initial_q(matrix_shape(s)[1], min(r, *matrix_shape(s)), q_seed(0, f"dp_gradient/{j}"), "cpu").double()
             for j, s in enumerate(shapes)]
    ref_e = [[torch.zeros(matrix_shape(s), dtype=torch.float64) for s in shapes] for _ in range(world)]
    worst = 0.0
    for step in range(steps):
        mine = [t for t, s in zip(_grads(rank, step), SHAPES) if len(s) > 1]
        everyone = [[t for t, s in zip(_grads(k, step), SHAPES) if len(s) > 1] for k in range(world)]
        out = [t.clone() for t in mine]
        ch.all_reduce_coalesced(out, op=dist.ReduceOp.AVG)
        for j, s in enumerate(shapes):
            n, m = matrix_shape(s)
            hs = [everyone[k][j].reshape(n, m).double() + ref_e[k][j] for k in range(world)]
            p = sum(h @ ref_q[j] for h in hs)
            p_hat = torch.linalg.qr(p).Q
            qs = [h.t() @ p_hat for h in hs]
            q = sum(qs)
            expect = (p_hat @ q.t()) / world
            for k in range(world):
                ref_e[k][j] = hs[k] - p_hat @ qs[k].t()
            ref_q[j] = q
            rel = (out[j].reshape(n, m).double() - expect).norm() / expect.norm()
            worst = max(worst, rel.item())
    return worst


def test_matches_an_fp64_restatement_of_the_paper():
    # rank 2 of matrices with n + m <= 48: the fp32 round-off of each step (8 (n + m) eps, module docstring)
    # compounds over the 5 steps through E and the warm-start Q (measured: about 8 eps in all)
    steps = 5
    for worst in run_ranks(_restatement, 2, steps, 2):
        assert worst < 8 * steps * 48 * EPS, worst


def _telescopes(rank, world, steps):
    ch = LowRankChannel("dp_gradient", PowerSGD(rank=1, min_compression_rate=0))
    delivered = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    sent = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for step in range(steps):
        g = _grads(rank, step)
        for acc, t in zip(sent, g):
            acc += t.double()
        out = [t.clone() for t in g]
        ch.all_reduce_coalesced(out, key="b0")
        for acc, t in zip(delivered, out):
            acc += t.double()
    errors = []
    for i, s in enumerate(SHAPES):
        e = ch.error_feedback.error(f"b0/{i}") if len(s) > 1 else None
        errors.append(torch.zeros(s, dtype=torch.float64) if e is None else e.double().view(s))
    for acc in sent:
        dist.all_reduce(acc)
    for e in errors:
        dist.all_reduce(e)
    return delivered, sent, errors


def test_error_feedback_telescopes():
    # sum_t delivered_t + sum_i E_i = sum_t sum_i g_i up to fp32 round-off: each step adds at most
    # 8 (n + m) eps times the norm of that step's compensated gradients (module docstring), bounded here by the
    # run's largest per-step norm, ||sum_t sum_i g|| + ||sum_i E|| (the errors never exceed what was sent)
    steps, world = 6, 3
    for delivered, sent, errors in run_ranks(_telescopes, world, steps):
        for d, s, e, shape in zip(delivered, sent, errors, SHAPES):
            mat = matrix_shape(shape)
            n_plus_m = sum(mat) if mat else shape[0]
            gap = (d + e - s).norm().item()
            scale = world * steps * (s.norm().item() + e.norm().item())
            assert gap <= 8 * n_plus_m * EPS * scale, (shape, gap)
            if len(shape) > 1:
                assert e.norm() > 0  # rank 1 really dropped something


def _bytes_and_resume(rank, world):
    stats = StatsTable()
    spec = PowerSGD(rank=2)
    a = LowRankChannel("dp_gradient", spec, stats=stats)
    out = [t.clone() for t in _grads(rank)]
    a.all_reduce_coalesced(out, key="b")
    rec = stats.snapshot()["dp_gradient"]
    saved = a.state_dict()
    out_a = [t.clone() for t in _grads(rank, 1)]
    a.all_reduce_coalesced(out_a, key="b")
    b = LowRankChannel("dp_gradient", spec)
    b.load_state_dict(saved)
    out_b = [t.clone() for t in _grads(rank, 1)]
    b.all_reduce_coalesced(out_b, key="b")
    return rec.wire_bytes, rec.uncompressed_bytes, all(torch.equal(x, y) for x, y in zip(out_a, out_b))


def test_bytes_follow_the_factor_sizes_and_state_resumes_bit_for_bit():
    world = 2
    spec = PowerSGD(rank=2)
    factor = sum(spec.wire_numel(s) for s in SHAPES)
    dense = sum(torch.Size(s).numel() for s in SHAPES)
    # two ranks: each sends half of each all-reduced buffer twice (reduce-scatter + all-gather model)
    compressed = [s for s in SHAPES if spec.rank_for(s)]
    assert compressed == [(24, 8), (8, 24), (6, 4, 5), (16, 16)]  # 6 x 20: 120 >= 2 * (6 + 20) * 2
    assert not PowerSGD(rank=4).rank_for((6, 4, 5))  # 120 < 2 * 26 * 4: all-reduced plainly
    for wire, uncompressed, same in run_ranks(_bytes_and_resume, world):
        assert same
        assert uncompressed == 4 * dense  # 2 (N-1)/N * 4 bytes per element
        p = sum(matrix_shape(s)[0] * 2 for s in compressed)
        q = sum(matrix_shape(s)[1] * 2 for s in compressed)
        rest = factor - p - q
        assert wire == 4 * (p + q + rest)  # P, Q and the plain rest, each one all-reduce


def test_bad_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        make_low_rank({"name": "powersgd", "rank": -2})
    with pytest.raises(ValueError, match="unknown powersgd option"):
        make_low_rank({"name": "powersgd", "rnak": 2})
    with pytest.raises(ValueError, match="dense value codec"):
        PowerSGD(factor_codec={"name": "bf16", "k": 4, "chunk": 64})
    with pytest.raises(ValueError, match="min_compression_rate"):
        PowerSGD(min_compression_rate=-1)
    assert isinstance(make_compressor({"name": "powersgd", "rank": 1}), PowerSGD)
    assert make_low_rank(PowerSGD(rank=3).to_dict()) == PowerSGD(rank=3)


def _int_tensor(rank, world):
    ch = LowRankChannel("dp_gradient", "powersgd")
    with pytest.raises(TypeError, match="floating tensors"):
        ch.all_reduce_coalesced([torch.ones(8, 8, dtype=torch.int32)])
    with pytest.raises(ValueError, match="SUM and AVG"):
        ch.all_reduce_coalesced([torch.ones(8, 8)], op=dist.ReduceOp.MAX)
    return True


def test_bad_tensors_raise_clear_errors():
    assert all(run_ranks(_int_tensor, 2))


def _non_finite_step(rank, world):
    ch = LowRankChannel("dp_gradient", PowerSGD(rank=2, min_compression_rate=0))
    bad = [torch.randn(24, 8)]
    if rank == 1:
        bad[0][3, 2] = float("inf")
    ch.all_reduce_coalesced(bad, key="b")
    after = [torch.randn(24, 8, generator=torch.Generator().manual_seed(rank))]
    ch.all_reduce_coalesced(after, key="b")
    return bool(torch.isfinite(bad[0]).all()), bool(torch.isfinite(after[0]).all()), "b/0" in ch.q


def test_a_non_finite_step_reaches_every_rank_and_the_next_step_recovers():
    for first, second, kept in run_ranks(_non_finite_step, 2):
        assert not first  # every rank sees the overflow (the optimizer skips the step)
        assert second and kept  # the poisoned Q and residual were dropped: a fresh start, finite again
