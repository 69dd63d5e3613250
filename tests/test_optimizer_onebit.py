"""1-bit Adam, 0/1 Adam and 1-bit LAMB (megacomp.optimizer.onebit) on real gloo groups.

Gradients are chosen, not computed: each rank's loss is ``sum(p * c)`` so ``p.grad == c`` exactly, with ``c``
a multiple of 1/16 in [-1/2, 1/2]; sums of such numbers are exact in fp32 in any order, so the averaged
gradient is the same bits on every rank and in the single-process reference.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp.optimizer import DistributedOptimizer, OneBitAdam, OneBitLamb, ZeroOneAdam

SHAPES = [(6, 5), (5,), (4, 7)]
OFF = dict(momentum_codec=None, momentum_error_feedback=False)


def _params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(-8, 9, s, generator=g).float() / 16 for s in SHAPES]


def _backward(params, rank: int, step: int) -> None:
    sum((p * c).sum() for p, c in zip(params, _grads(rank, step))).backward()


def _run(opt, params, rank: int, steps: range):
    for t in steps:
        _backward(params, rank, t)
        assert opt.step()


# -- compression off, freeze never reached: torch.optim.AdamW bit for bit ------------------------------------
def _adamw_case(rank, world, which, shard):
    params = _params()
    kw = dict(lr=0.05, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6, bucket_size=20, min_compress_numel=0)
    if which == "onebit_adam":
        opt = OneBitAdam(params, freeze_step=100, shard=shard, **OFF, **kw)
    else:
        opt = ZeroOneAdam(params, var_freeze_step=100, var_update_scaler=100, **OFF, **kw)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in _params()]
    ref_opt = torch.optim.AdamW(ref, lr=0.05, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6, foreach=False)
    for t in range(6):
        _backward(params, rank, t)
        assert opt.step()
        sums = [sum(_grads(r, t)[i] for r in range(world)) for i in range(len(SHAPES))]
        for p, s in zip(ref, sums):
            p.grad = s.mul_(1.0 / world)
        ref_opt.step()
        for a, b in zip(params, ref):
            assert torch.equal(a, b), (which, t)
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("which,shard", [("onebit_adam", True), ("onebit_adam", False), ("zero_one_adam", False)])
def test_compression_off_is_adamw_bit_for_bit(world, which, shard):
    assert all(run_ranks(_adamw_case, world, which, shard))


# -- fp64 scalar restatements of each rule, compression off, different gradients per rank ------------------
def _ulp_bound(steps: int, *scales: float) -> float:
    """fp32 round-off of ``steps`` steps of about 16 roundings each (2^-24 relative) on values this large."""
    return steps * 16 * 2.0 ** -24 * sum(scales)


def _adam_reference(world, steps, freeze, lr, b1, b2, eps, wd):
    p = [x.double().clone() for x in _params()]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    ratio = 0.0
    for t in range(1, steps + 1):
        gs = [[c.double() for c in _grads(r, t - 1)] for r in range(world)]
        for i in range(len(p)):
            gbar = sum(g[i] for g in gs) / world
            if t <= freeze:
                m[i] = b1 * m[i] + (1 - b1) * gbar
                v[i] = b2 * v[i] + (1 - b2) * gbar ** 2
            else:  # the average of every rank's local momentum
                m[i] = sum(b1 * m[i] + (1 - b1) * g[i] for g in gs) / world
            r = (m[i] / (1 - b1 ** t)) / ((v[i] / (1 - b2 ** min(t, freeze))).sqrt() + eps)
            ratio = max(ratio, float(r.abs().max()))
            p[i] = p[i] * (1 - lr * wd) - lr * r
    return p, ratio


def _onebit_adam_case(rank, world, shard):
    params = _params()
    opt = OneBitAdam(params, lr=0.05, freeze_step=3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, shard=shard,
                     bucket_size=20, min_compress_numel=0, **OFF)
    _run(opt, params, rank, range(8))
    ref, ratio = _adam_reference(world, 8, 3, 0.05, 0.8, 0.9, 1e-6, 0.1)
    tol = _ulp_bound(8, max(float(x.abs().max()) for x in ref), 0.05 * ratio)
    for a, b in zip(params, ref):
        assert (a.double() - b).abs().max() <= tol
    return True


@pytest.mark.parametrize("world,shard", [(2, True), (3, False)])
def test_onebit_adam_matches_fp64_restatement(world, shard):
    assert all(run_ranks(_onebit_adam_case, world, shard))


def _zero_one_reference(rank, world, steps, sched, lr, b1, b2, eps, wd):
    """0/1 Adam (rules.ZeroOneAdamRule's equations) for every rank in fp64; returns rank ``rank``'s params."""
    var_freeze, var_scaler, local_scaler, clipper = sched
    P = [[x.double().clone() for x in _params()] for _ in range(world)]
    M = [[torch.zeros_like(x) for x in P[0]] for _ in range(world)]
    v = [torch.zeros_like(x) for x in P[0]]
    A = [[x.clone() for x in P[0]] for _ in range(world)]
    n_v, lrs, var_iv, var_c, loc_iv, loc_c = 0, 0.0, 1, 0, 1, 0
    kinds, step_max = [], 0.0
    for t in range(1, steps + 1):
        gs = [[c.double() for c in _grads(r, t - 1)] for r in range(world)]
        if t <= var_freeze:
            kind = "grad" if t % var_iv == 0 else "grad_1bit"
        else:
            kind = "sync" if t % loc_iv == 0 else "local"
        kinds.append(kind)
        if kind == "grad":
            n_v += 1
        for r in range(world):
            for i in range(len(v)):
                g = sum(x[i] for x in gs) / world if kind in ("grad", "grad_1bit") else gs[r][i]
                if kind in ("local", "sync") and lrs == 0.0:
                    A[r][i] = P[r][i].clone()
                M[r][i] = b1 * M[r][i] + (1 - b1) * g
                if kind == "grad" and r == 0:
                    v[i] = b2 * v[i] + (1 - b2) * g ** 2
        for r in range(world):
            for i in range(len(v)):
                denom = (v[i] / (1 - b2 ** n_v)).sqrt() + eps
                d = lr * (M[r][i] / (1 - b1 ** t)) / denom
                step_max = max(step_max, float(d.abs().max()))
                P[r][i] = P[r][i] * (1 - lr * wd) - d
        if kind in ("local", "sync"):
            lrs += lr
        if kind == "sync":
            for i in range(len(v)):
                denom = (v[i] / (1 - b2 ** n_v)).sqrt() + eps
                w = sum((A[r][i] - P[r][i]) * denom for r in range(world)) / world
                for r in range(world):
                    M[r][i] = (1 - b1 ** t) * w / lrs
                    P[r][i] = A[r][i] - w / denom
            lrs = 0.0
        if t <= var_freeze:
            if t % var_iv == 0:
                var_c += 1
                if var_c == var_scaler:
                    var_c, var_iv = 0, var_iv * 2
        else:
            loc_c += 1
            if loc_c == local_scaler:
                loc_c, loc_iv = 0, min(clipper, loc_iv * 2)
    return P[rank], kinds, step_max


def _zero_one_case(rank, world):
    params = _params()
    sched = (7, 2, 2, 4)
    opt = ZeroOneAdam(params, lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, var_freeze_step=7,
                      var_update_scaler=2, local_step_scaler=2, local_step_clipper=4, bucket_size=20,
                      min_compress_numel=0, **OFF)
    _run(opt, params, rank, range(20))
    ref, kinds, step_max = _zero_one_reference(rank, world, 20, sched, 0.05, 0.8, 0.9, 1e-6, 0.1)
    # every kind of step and boundary was crossed: variance interval doubling, freeze, growing sync interval
    assert {"grad", "grad_1bit", "local", "sync"} <= set(kinds)
    assert opt.rounds == sum(k != "local" for k in kinds) < 20
    tol = _ulp_bound(20, max(float(x.abs().max()) for x in ref), step_max)
    for a, b in zip(params, ref):
        assert (a.double() - b).abs().max() <= tol
    return [p.detach().clone() for p in params]


def test_zero_one_adam_matches_fp64_restatement():
    out = run_ranks(_zero_one_case, 2)
    assert all(torch.equal(a, b) for a, b in zip(*out))  # the last step synchronised: same bits on both ranks


def _lamb_reference(world, steps, freeze, lr, b1, b2, eps, wd, cfg):
    max_c, min_c, cb, fmax, fmin, thr = cfg
    p = [x.double().clone() for x in _params()]
    n = len(p)
    m, v, vf = [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p]
    frozen, last = [0.0] * n, [1.0] * n
    step_max = 0.0  # the largest |lr c u| of any element: the scale of each step's round-off
    for t in range(1, steps + 1):
        gs = [[c.double() for c in _grads(r, t - 1)] for r in range(world)]
        for i in range(n):
            gbar = sum(g[i] for g in gs) / world
            if t <= freeze:
                m[i] = b1 * m[i] + (1 - b1) * gbar
                v[i] = b2 * v[i] + (1 - b2) * gbar ** 2
                if t == freeze:
                    vf[i] = v[i].clone()
                denom = (v[i] / (1 - b2 ** t)).sqrt() + eps
                r = (m[i] / (1 - b1 ** t)) / denom
                u = r + wd * p[i]
                wn, un = float(p[i].detach().norm()), float(u.detach().norm())
                c = min(max(wn / un, min_c), max_c) if wn > 0 and un > 0 else 1.0
                if c != 1.0:
                    frozen[i] = cb * frozen[i] + (1 - cb) * c
            else:
                new_m = sum(b1 * m[i] + (1 - b1) * g[i] for g in gs) / world
                g_rec = (new_m - b1 * m[i]) / (1 - b1)
                vf[i] = b2 * vf[i] + (1 - b2) * g_rec ** 2
                m[i] = new_m
                denom = (v[i] / (1 - b2 ** freeze)).sqrt() + eps
                r = (m[i] / (1 - b1 ** t)) / denom
                u = r + wd * p[i]
                f = float((denom / ((vf[i] / (1 - b2 ** t)).sqrt() + eps)).max())
                q = min(1.0, float(r.norm()) / float(u.norm()))
                f = f * q + (1 - q)
                f = min(max(f, fmin), fmax)
                f = min(max(f, last[i] * (1 - thr)), last[i] * (1 + thr))
                last[i] = f
                c = frozen[i] * f
            step_max = max(step_max, float((lr * c * u).abs().max()))
            p[i] = p[i] - lr * c * u
    return p, step_max


def _lamb_case(rank, world, shard):
    params = _params()
    cfg = (10.0, 0.01, 0.9, 4.0, 0.5, 0.1)
    opt = OneBitLamb(params, lr=0.05, freeze_step=3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, shard=shard,
                     bucket_size=20, min_compress_numel=0, **OFF)
    _run(opt, params, rank, range(7))
    ref, step_max = _lamb_reference(world, 7, 3, 0.05, 0.8, 0.9, 1e-6, 0.1, cfg)
    tol = _ulp_bound(7, max(float(x.abs().max()) for x in ref), step_max)
    for a, b in zip(params, ref):
        assert (a.double() - b).abs().max() <= tol
    return True


@pytest.mark.parametrize("world,shard", [(2, True), (3, True), (2, False)])
def test_onebit_lamb_matches_fp64_restatement(world, shard):
    assert all(run_ranks(_lamb_case, world, shard))


# -- compression off, freeze never reached: an fp32 LAMB written from the paper, bit for bit ----------------
def _lamb_fp32_step(p, m, v, g, t, lr, b1, b2, eps, wd, min_c, max_c):
    """One LAMB step (You et al. 2020, Algorithm 2, with DeepSpeed's clamp of the trust ratio) on one fp32 tensor:
    Adam's moments, the bias-corrected ratio r = m^ / (sqrt(v^) + eps), u = r + wd p, and p -= lr c u with the
    layer's trust ratio c = clamp(|p| / |u|, min_c, max_c) (1 where either norm is 0), the norms in fp64."""
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
    u = (m / (1 - b1 ** t)).div_(denom) + p * wd
    wn, un = p.double().square().sum().sqrt(), u.double().square().sum().sqrt()
    c = float((wn / un).clamp(min_c, max_c)) if wn > 0 and un > 0 else 1.0
    p.add_(u, alpha=-lr * c)


def _lamb_fp32_case(rank, world, shard):
    params = _params()
    opt = OneBitLamb(params, lr=0.05, freeze_step=100, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, shard=shard,
                     bucket_size=20, min_compress_numel=0, **OFF)
    ref = [p.detach().clone() for p in _params()]
    m, v = [torch.zeros_like(p) for p in ref], [torch.zeros_like(p) for p in ref]
    for t in range(6):
        _backward(params, rank, t)
        assert opt.step()
        for i, p in enumerate(ref):
            g = sum(_grads(r, t)[i] for r in range(world)).mul_(1.0 / world)  # exact: multiples of 1/16
            _lamb_fp32_step(p, m[i], v[i], g, t + 1, 0.05, 0.8, 0.9, 1e-6, 0.1, 0.01, 10.0)
        for a, b in zip(params, ref):
            assert torch.equal(a.detach(), b), (t, shard)
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shard", [True, False])
def test_compression_off_is_lamb_bit_for_bit(world, shard):
    assert all(run_ranks(_lamb_fp32_case, world, shard))


# -- compressed: the exchange keeps the codec's promise and every rank the same bits ----------------------
def _sign_exchange_case(rank, world):
    params = _params()
    opt = OneBitAdam(params, lr=0.05, freeze_step=2, betas=(0.8, 0.9), eps=1e-6, shard=False, bucket_size=20,
                     min_compress_numel=0)
    _run(opt, params, rank, range(2))
    masters = {b.index: m for b, m in zip(opt.buckets, opt.masters)}
    before = {i: opt.optimizer.state[m]["exp_avg"].clone() for i, m in masters.items()}
    _run(opt, params, rank, range(2, 3))  # the first 1-bit momentum exchange (errors start at zero)
    ef = opt.momentum_channel.error_feedback
    out = []
    for b in opt.buckets:
        if not b.compressed:
            continue
        g = torch.zeros(b.padded)
        for c, p in zip(_grads(rank, 2), params):
            for q, o in zip(b.params, b.offsets):
                if q is p:
                    g[o:o + p.numel()] = c.reshape(-1)
        x = before[b.index] * 0.8 + 0.2 * g
        x[b.numel:] = 0
        e = ef.error(f"dp_momentum/b{b.index}/worker").reshape(-1)
        # the sign codec's promise per chunk: |x - decode(encode(x))| <= max |x| of the chunk (one scale per chunk)
        assert float(e.abs().max()) <= float(x.abs().max()) * (1 + 2 ** -20)
        server = ef.error(f"dp_momentum/b{b.index}/server").reshape(-1)  # this rank's chunk (DP 2 too: DeepSpeed)
        out.append((b.numel, x, e, server, opt.optimizer.state[masters[b.index]]["exp_avg"].clone()))
    return out


def test_sign_exchange_is_mean_of_decoded_local_momenta_requantized_by_the_chunk_owner():
    """At DP 2 as at any size (DeepSpeed's compressed all-reduce): worker signs with worker error, the chunk owner
    averages them, adds its server error and sends signs again; so the result on chunk r is the mean of what the
    workers sent minus half of rank r's new server error (the channel re-quantizes the sum; the optimizer halves)."""
    from megacomp.comm.common import split_sizes

    per_rank = run_ranks(_sign_exchange_case, 2)
    for items in zip(*per_rank):
        (n, x0, e0, s0, m0), (_, x1, e1, s1, m1) = items
        assert torch.equal(m0, m1)  # every rank decoded the same bytes
        decoded_mean = ((x0 - e0) + (x1 - e1)) / 2  # decode = x - new error, exactly what was sent
        sent = decoded_mean - torch.cat([s0, s1]) / 2  # the owner sent y - its new server error (y: the sum)
        assert [s0.numel(), s1.numel()] == split_sizes(m0.numel(), 2) and s0.abs().max() > 0
        scale = max(float(x0.abs().max()), float(x1.abs().max()))
        # fp32 round-off: x formed in another operation order here (1 ulp), x - e, the sum, the halving, y - e_s
        assert (m0 - sent)[:n].abs().max() <= 8 * 2 ** -24 * scale
        assert not m0[n:].any()  # padding carries nothing


# -- checkpoints: bit-identical resume mid-schedule -------------------------------------------------------
def _make(which, params, world):
    kw = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, bucket_size=20, min_compress_numel=0)
    if which == "onebit_adam":
        return OneBitAdam(params, freeze_step=2, shard=True, **kw)
    if which == "zero_one_adam":
        return ZeroOneAdam(params, var_freeze_step=3, var_update_scaler=1, local_step_scaler=1, local_step_clipper=4,
                           **kw)
    return OneBitLamb(params, freeze_step=2, shard=True, **kw)


def _resume_case(rank, world, which):
    params = _params()
    opt = _make(which, params, world)
    _run(opt, params, rank, range(5))
    saved = opt.state_dict()
    _run(opt, params, rank, range(5, 9))
    want = [p.detach().clone() for p in params]
    fresh = _params(seed=7)
    opt2 = _make(which, fresh, world)
    opt2.init_state()
    template = opt2.state_dict()  # the same keys (torch.distributed.checkpoint's template)
    assert _keys(template) == _keys(saved)
    opt2.load_state_dict(saved)
    _run(opt2, fresh, rank, range(5, 9))
    assert all(torch.equal(a, b) for a, b in zip(want, fresh))
    assert opt2.rounds == opt.rounds
    return True


def _keys(d, prefix=""):
    out = set()
    if isinstance(d, dict):
        for k, v in d.items():
            out |= _keys(v, f"{prefix}/{k}")
    elif isinstance(d, (list, tuple)) and d and isinstance(d[0], (dict, torch.Tensor)):
        for i, v in enumerate(d):
            out |= _keys(v, f"{prefix}/{i}")
    else:
        out.add(prefix)
    return out


@pytest.mark.parametrize("which,world", [("onebit_adam", 3), ("zero_one_adam", 2), ("onebit_lamb", 2)])
def test_resume_is_bit_identical(which, world):
    assert all(run_ranks(_resume_case, world, which))


# -- bad input ---------------------------------------------------------------------------------------------
def _bad_case(rank, world):
    params = _params()
    with pytest.raises(ValueError, match="freeze_step must be an int >= 1"):
        OneBitAdam(params, freeze_step=0)
    with pytest.raises(ValueError, match="freeze_step must be an int >= 1"):
        OneBitLamb(params, freeze_step=0)
    with pytest.raises(ValueError, match="lossless"):
        OneBitAdam(params, freeze_step=2, momentum_codec=None)
    with pytest.raises(ValueError, match="value codec"):
        OneBitAdam(params, freeze_step=2, momentum_codec={"name": "none", "k": 4})
    with pytest.raises(ValueError, match="cannot be sharded"):
        ZeroOneAdam(params, shard=True)
    with pytest.raises(ValueError, match="var_update_scaler must be an int >= 1"):
        ZeroOneAdam(params, var_update_scaler=0)
    with pytest.raises(ValueError, match="rounds small gradient entries to 0.*grad_codec None or one of bf16"):
        OneBitAdam(_params(), freeze_step=2, grad_codec="int4", error_feedback="loco", min_compress_numel=0)
    with pytest.raises(ValueError, match="rounds small gradient entries to 0"):
        OneBitLamb(_params(), freeze_step=2, grad_codec={"name": "powersgd", "rank": 1}, min_compress_numel=0,
                   shard=True)  # unsharded, PowerSGD is refused earlier (it needs the reduce-scatter)
    assert OneBitAdam(_params(), freeze_step=2, grad_codec="bf16", min_compress_numel=0).grad_channel.lossy
    adamw = DistributedOptimizer(params, torch.optim.AdamW, min_compress_numel=0, lr=0.01)
    onebit = OneBitAdam(_params(), freeze_step=2, min_compress_numel=0)
    with pytest.raises(ValueError, match="no 1-bit optimizer state"):
        onebit.load_state_dict(adamw.state_dict())
    lamb = OneBitLamb(_params(), freeze_step=2, min_compress_numel=0)
    with pytest.raises(ValueError, match="saved by OneBitAdamRule"):
        lamb.load_state_dict(onebit.state_dict())
    with pytest.raises(ValueError, match="saved by OneBitAdamRule"):
        DistributedOptimizer(_params(), torch.optim.AdamW, min_compress_numel=0, lr=0.01).load_state_dict(
            onebit.state_dict())
    return True


def test_bad_input_names_the_problem():
    assert all(run_ranks(_bad_case, 2))


def _overflow_case(rank, world):
    params = _params()
    opt = OneBitAdam(params, lr=0.05, freeze_step=1, shard=True, bucket_size=20, min_compress_numel=0)
    _run(opt, params, rank, range(3))
    before = [p.detach().clone() for p in params]
    grads = _grads(rank, 3)
    if rank == 1:  # one rank's gradient overflows in backward (its momentum exchange starts there): every rank
        for c in grads:  # skips, nothing moves
            c[0] = math.inf
    sum((p * c).sum() for p, c in zip(params, grads)).backward()
    assert not opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params)) and opt.skipped_steps == 1
    _run(opt, params, rank, range(4, 5))
    return [p.detach().clone() for p in params]


def test_overflow_on_one_rank_skips_everywhere():
    out = run_ranks(_overflow_case, 2)
    assert all(torch.equal(a, b) for a, b in zip(*out))


def _shard_case(rank, world, shard, which, overlap=True):
    params = _params()
    cls = OneBitAdam if which == "onebit_adam" else OneBitLamb
    opt = cls(params, lr=0.05, freeze_step=2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, shard=shard,
              bucket_size=20, min_compress_numel=0, overlap_momentum=overlap)
    in_backward = []
    for t in range(8):
        _backward(params, rank, t)
        # the momentum exchanges started in backward (in the warm-up b.reduced is the gradient reduction's)
        in_backward.append(opt._action() == "momentum" and all(b.reduced is not None for b in opt.buckets))
        assert opt.step()
    return [p.detach().clone() for p in params], in_backward


@pytest.mark.parametrize("which,shard,world", [("onebit_adam", False, 2), ("onebit_adam", False, 3),
                                               ("onebit_adam", True, 3), ("onebit_lamb", True, 2)])
def test_momentum_exchanged_in_backward_equals_in_step_bit_for_bit(which, shard, world):
    """overlap_momentum starts each bucket's 1-bit momentum all-reduce in backward; the numbers are those of the
    exchange in step(). Steps 1-2 are the warm-up; step 3 exchanges in step() where the momentum is first
    gathered (sharded) or LAMB's scales are fixed, and in backward otherwise."""
    on, where = run_ranks(_shard_case, world, shard, which, True)[0]
    off, never = run_ranks(_shard_case, world, shard, which, False)[0]
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    first = 3 if which == "onebit_adam" and not shard else 4
    assert where == [t >= first for t in range(1, 9)] and not any(never)


@pytest.mark.parametrize("which", ["onebit_adam", "onebit_lamb"])
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_equals_unsharded_bit_for_bit_with_the_sign_codec(which, world):
    """The same 1-bit exchange whatever the sharding (exact gradient sums): sharding changes where the update is
    computed (and adds the parameter all-gather), never the numbers."""
    sharded = run_ranks(_shard_case, world, True, which)[0][0]
    whole = run_ranks(_shard_case, world, False, which)[0][0]
    assert all(torch.equal(a, b) for a, b in zip(sharded, whole))


# -- a ready momentum channel (megacomp.comm.make_channel, e.g. from CommCompressionConfig's dp_momentum) ------------
def _channel_case(rank, world, which):
    from megacomp.comm import make_channel
    from megacomp.optimizer.onebit import DEFAULT_MOMENTUM_CODEC

    kw = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6, bucket_size=20, min_compress_numel=0)
    build = {"onebit_adam": lambda p, **k: OneBitAdam(p, freeze_step=2, **k, **kw),
             "onebit_lamb": lambda p, **k: OneBitLamb(p, freeze_step=2, **k, **kw),
             "zero_one_adam": lambda p, **k: ZeroOneAdam(p, var_freeze_step=2, var_update_scaler=1, local_step_scaler=4,
                                                         **k, **kw)}[which]
    a, b = _params(), _params()
    built = build(a)
    channel = make_channel("dp_momentum", DEFAULT_MOMENTUM_CODEC, error_feedback="ef", min_compress_numel=0)
    given = build(b, momentum_channel=channel)
    assert given.momentum_channel is channel
    _run(built, a, rank, range(6))
    _run(given, b, rank, range(6))
    with pytest.raises(ValueError, match="either momentum_channel or momentum_codec"):
        build(_params(), momentum_channel=channel, momentum_codec="int4")
    with pytest.raises(ValueError, match="either momentum_channel or momentum_codec"):
        build(_params(), momentum_channel=channel, momentum_error_feedback=False)
    with pytest.raises(ValueError, match="compresses by structure"):
        build(_params(), momentum_channel=make_channel("dp_momentum", {"name": "powersgd", "rank": 1}))
    assert not build(_params(), momentum_channel=make_channel("dp_momentum", None)).momentum_channel.lossy  # off
    return all(torch.equal(x, y) for x, y in zip(a, b)) and built.rounds == given.rounds


@pytest.mark.parametrize("which", ["onebit_adam", "onebit_lamb", "zero_one_adam"])
def test_a_ready_momentum_channel_equals_the_codec_arguments_bit_for_bit(which):
    assert all(run_ranks(_channel_case, 2, which))


def test_resolve_momentum_setting_gives_the_unset_defaults():
    from megacomp.compression import make_codec
    from megacomp.optimizer.onebit import DEFAULT_MOMENTUM_CODEC, resolve_momentum_setting

    assert resolve_momentum_setting() == (DEFAULT_MOMENTUM_CODEC, True)
    assert resolve_momentum_setting(None, False) == (DEFAULT_MOMENTUM_CODEC, False)
    assert resolve_momentum_setting("none") == (make_codec("none"), False)
    assert resolve_momentum_setting("int4", None) == (make_codec("int4"), True)
    with pytest.raises(ValueError, match="lossless"):
        resolve_momentum_setting("none", True)
