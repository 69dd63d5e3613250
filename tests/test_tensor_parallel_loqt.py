"""LoQT on megacomp's linear layers (megacomp.tensor_parallel.loqt): single process and real gloo ranks.

- Compression off (base codec ``none``, B = 0 after a (re)initialisation): forward, input gradient and bias
  gradient bit-identical to the original Column/RowParallelLinear at TP 1 and TP 2 (and TP 2 with sequence
  parallelism).
- Quantised base (int8, int4): forward error within ``sum_j |x_j| * bound_ij`` with the per-element bound of
  tests/codec_bounds.py, plus fp32 matmul round-off ``2 (n + 2) u sum_j |x_j w_ij|`` (n the reduction length).
- TP 2 against TP 1 (each layer fed its own input and upstream gradient): deq(Q) shards bit-equal; P the same bits
  on both TP ranks, the top-r singular vectors of the full gradient (fp64 SVD, up to sign) and TP 1's P within the
  Davis-Kahan bound of the Gram matrices' round-off; outputs, input and factor gradients within fp32 round-off
  ``2 (n + 2) u * envelope`` per reduction of length n in their chain; merge results within one quantisation step.
- Merge: deq(Q_new) within the codec bound of the pre-merge weight deq(Q_old) + alpha*low-rank; B reset; the
  schedule's intervals are tau, then tau + floor(psi^k); error compensation never worse than plain quantisation.
- Training at TP 2 x DP 2 with megacomp's DistributedOptimizer (AdamW, int8 dp_gradient): the loss decreases; the
  DP gradient traffic is exactly the factors' and biases' buckets; P, Q, B agree over DP.
- state_dict round trip bit for bit (also through megacomp.training.checkpoint at TP 2); bad input.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from codec_bounds import elementwise_bound
from distributed import run_ranks
from megacomp import comm, parallel_state
from megacomp.compression import make_codec
from megacomp.config import ModelParallelConfig
from megacomp.optimizer import DistributedOptimizer
from megacomp.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megacomp.tensor_parallel.loqt import LoQT, LoQTLinear, LoQTSchedule, convert_to_loqt, sync_optimizer

S, NB, H, O, R = 4, 3, 16, 32, 3  # seq, batch, hidden, ffn (divisible by TP 2), LoQT rank
L = S * NB  # rows of a weight gradient's sum
INT8 = {"name": "int8", "block_size": 8}
INT8_CODEC = make_codec(INT8)
U = 2.0 ** -24  # fp32 unit round-off
EPS64 = 2.0 ** -53


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def roundoff(n, envelope):
    """Difference of two fp32 evaluations of sums of length n (any order) with |terms| summing to ``envelope``."""
    return 2 * (n + 2) * U * envelope


def pair(tp, *, sp=False, tp_group=None, seed=1):
    """(ColumnParallelLinear H->O, RowParallelLinear O->H) at TP size ``tp``, the same full weights at every TP
    size (torch seeded alike), biases from fixed full vectors."""
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
    torch.manual_seed(seed)
    col = ColumnParallelLinear(H, O, config=cfg, tp_group=tp_group)
    torch.manual_seed(seed + 1)
    row = RowParallelLinear(O, H, config=cfg, tp_group=tp_group)
    rank = dist.get_rank(col.tp_group)
    with torch.no_grad():
        col.bias.copy_(randn(O, seed=seed + 2)[rank * O // tp:(rank + 1) * O // tp])
        row.bias.copy_(randn(H, seed=seed + 3))
    return col, row


def gather(t, dim, group=None):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def capture(ctl, layers, inputs, grads):
    """One captured backward per layer (each with its own input and upstream gradient); returns the captured
    local weight gradients (cloned: merge_and_reinit consumes them)."""
    ctl.start_full_gradient()
    for m, x, g in zip(layers, inputs, grads):
        (m(x)[0] * g).sum().backward()
    return [m._grad.clone() for m in layers]


# -- compression off -----------------------------------------------------------------------------
def _identity_body(rank, world, sp):
    parallel_state.initialize_model_parallel(world)
    seq = slice(rank * S // world, (rank + 1) * S // world) if sp else slice(None)
    X, G = randn(S, NB, H, seed=10)[seq], randn(S, NB, H, seed=11)[seq]
    orig = pair(world, sp=sp)
    loqt = [LoQTLinear(m, R, codec="none") for m in pair(world, sp=sp)]
    ctl = LoQT(loqt)
    ctl.start_full_gradient()
    (loqt[1](F.gelu(loqt[0](X)[0]))[0] * G).sum().backward()
    ctl.merge_and_reinit(0)
    assert all(m.initialized and m.proj.abs().sum() > 0 and not m.factor.any() for m in loqt)
    for p in (p for m in loqt for p in m.parameters()):
        p.grad = None  # the capture backward gave the biases gradients too
    got = []
    for c, r in (orig, loqt):
        x = X.clone().requires_grad_()
        out = r(F.gelu(c(x)[0]))[0]
        (out * G).sum().backward()
        got.append([out, x.grad, c.bias.grad, r.bias.grad])
    for a, b in zip(*got):
        assert torch.equal(a, b)
    assert all(m.factor.grad is not None for m in loqt)  # B trains; no weight parameter is left
    assert not any(n.endswith("weight") for m in loqt for n, _ in m.named_parameters())


@pytest.mark.parametrize("world,sp", [(1, False), (2, False), (2, True)])
def test_compression_off_is_bit_identical_to_the_original_layer(world, sp):
    run_ranks(_identity_body, world, sp)


# -- quantised base: forward error bound ------------------------------------------------------------
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(O, H), (H, O)])  # column form (in <= out) and row form
def test_quantised_forward_error_within_the_codec_bound(name, shape):
    codec = make_codec(name, block_size=8)
    torch.manual_seed(0)
    lin = nn.Linear(shape[1], shape[0])
    w, b = lin.weight.detach().double().clone(), lin.bias.detach().double().clone()
    m = LoQTLinear(lin, R, codec=codec)
    assert m.kind == ("column" if shape[1] <= shape[0] else "row")
    assert m.qweight.dtype == torch.uint8 and m.qweight.numel() == codec.wire_bytes(w.numel())
    x = randn(S, NB, shape[1], seed=3)
    y = m(x).double()
    bound = elementwise_bound(codec, w.float()).view(shape)
    allowed = x.double().abs() @ bound.t() + roundoff(shape[1], x.double().abs() @ m.dequantized().double().abs().t()
                                                      + b.abs())
    assert ((y - (x.double() @ w.t() + b)).abs() <= allowed).all()


# -- TP 2 against TP 1 --------------------------------------------------------------------------------
def _gram_and_gap(g, kind):
    g = g.double()
    gram = g.t() @ g if kind == "column" else g @ g.t()
    lam = torch.linalg.eigvalsh(gram).flip(0)
    gaps = [min(lam[i - 1] - lam[i] if i else math.inf, lam[i] - lam[i + 1]) for i in range(R)]
    return gram, float(min(gaps))


def _p_tolerance(g_full, dg, kind, n):
    """Per-entry bound of |P' - P| for eigenvectors of the Gram matrices of g_full and g_full + dg (|dg| <= dg):
    Davis-Kahan, sin(theta) <= ||dM||_F / (gap - ||dM||_F), |dv| <= sqrt(2) sin(theta), plus the fp32 rounding of
    both (|v| <= 1) and fp64 round-off of the Gram (n its reduction length)."""
    gram, gap = _gram_and_gap(g_full, kind)
    a = g_full.double().abs()
    dm = (a.t() @ dg + dg.t() @ a + dg.t() @ dg) if kind == "column" else (a @ dg.t() + dg @ a.t() + dg @ dg.t())
    dm_norm = float(dm.norm()) + 4 * (n + 2) * EPS64 * float((a.t() @ a if kind == "column" else a @ a.t()).norm())
    assert gap > 1e3 * dm_norm, "degenerate test data: the top-r eigenvalues are not separated"
    return math.sqrt(2) * dm_norm / (gap - dm_norm) + 2 * U


def _aligned(p, ref):
    return ref * torch.sign((p.double() * ref).sum(0))


def _tp_body(rank, world):
    parallel_state.initialize_model_parallel(world)
    singles = [dist.new_group([r]) for r in range(world)]
    cut = slice(rank * O // world, (rank + 1) * O // world)  # this rank's part of the O dim

    def shard(t, kind):  # a TP 1 tensor -> this rank's part (column: rows, row: columns)
        return t[cut] if kind == "column" else t[:, cut]

    two = [LoQTLinear(m, R, codec=INT8) for m in pair(world)]
    one = [LoQTLinear(m, R, codec=INT8) for m in pair(1, tp_group=singles[rank])]
    for a, b in zip(two, one):
        assert torch.equal(a.dequantized(), shard(b.dequantized(), a.kind))
    ctl2, ctl1 = LoQT(two), LoQT(one, dp_group=singles[rank])
    with pytest.raises(RuntimeError, match="start_full_gradient"):
        ctl2.merge_and_reinit(0)
    for step in (0, 1):
        xs = [randn(S, NB, H, seed=20 + step), randn(S, NB, O, seed=30 + step)]
        gs = [randn(S, NB, O, seed=40 + step), randn(S, NB, H, seed=50 + step)]
        g2 = capture(ctl2, two, [xs[0], xs[1][..., cut]], [gs[0][..., cut], gs[1]])
        g1 = capture(ctl1, one, xs, gs)
        pre2, pre1 = [m.effective_weight() for m in two], [m.effective_weight() for m in one]
        ctl2.merge_and_reinit(step)
        ctl1.merge_and_reinit(step)
        for i, (a, b) in enumerate(zip(two, one)):
            dim = 0 if a.kind == "column" else 1
            x, gu = xs[i].reshape(L, -1).double().abs(), gs[i].reshape(L, -1).double().abs()
            env = gu.t() @ x  # |upstream|^T |input|: the weight gradient's envelope
            assert (gather(g2[i], dim) - g1[i]).abs().le(roundoff(L, env)).all()
            assert torch.equal(gather(a.proj, 1), a.proj.repeat(1, world))  # the same bits on every TP rank
            full = g1[i].double()
            u_, _, vh = torch.linalg.svd(full)
            ref = vh[:R].t() if a.kind == "column" else u_[:, :R]
            tol_svd = _p_tolerance(full, torch.zeros_like(full), a.kind, O)
            assert (b.proj.double() - _aligned(b.proj, ref)).abs().max() <= tol_svd
            tol_tp = _p_tolerance(full, roundoff(L, env), a.kind, O)
            assert (a.proj.double() - b.proj.double()).abs().max() <= tol_tp
            assert not a.factor.any() and not b.factor.any() and int(a.loqt_step) == step == int(a.loqt_merges) - 1
            # merge: within one quantisation step of the pre-merge weight; TP 2 and TP 1 within two steps + their gap
            e2, e1 = [elementwise_bound(INT8_CODEC, w).view(w.shape) for w in (pre2[i], pre1[i])]
            assert ((a.dequantized() - pre2[i]).abs().double() <= e2).all()
            assert ((b.dequantized() - pre1[i]).abs().double() <= e1).all()
            slack = e2 + shard(e1, a.kind) + (pre2[i] - shard(pre1[i], a.kind)).abs().double()
            assert ((a.dequantized() - shard(b.dequantized(), a.kind)).abs().double() <= slack).all()
        # forward/backward with a random B (the same full B) and the same P on both sizes
        with torch.no_grad():
            for i, (a, b) in enumerate(zip(two, one)):
                b.proj.copy_(a.proj)
                full_b = randn(*b.factor.shape, seed=60 + i) * 0.1
                b.factor.copy_(full_b)
                a.factor.copy_(shard(full_b, a.kind))
        for i, (a, b) in enumerate(zip(two, one)):
            x1 = xs[i].clone().requires_grad_()
            x2 = (xs[i] if i == 0 else xs[i][..., cut]).clone().requires_grad_()
            out2, out1 = a(x2)[0], b(x1)[0]
            g2_, g1_ = (gs[0][..., cut], gs[0]) if i == 0 else (gs[1], gs[1])
            (out2 * g2_).sum().backward()
            (out1 * g1_).sum().backward()
            lr_abs = (b.factor.double().abs() @ b.proj.double().abs().t() if b.kind == "column"
                      else b.proj.double().abs() @ b.factor.double().abs())
            dw = roundoff(R, b.alpha * lr_abs)  # |W_eff(TP 2) - W_eff(TP 1)|
            weff = b.effective_weight().double().abs() + dw
            n_in = H if i == 0 else O
            xa = xs[i].reshape(L, -1).double().abs()
            tol_out = xa @ dw.t() + roundoff(n_in + 1, xa @ weff.t() + b.base.bias.double().abs())
            want = out1.detach().reshape(L, -1)
            assert (out2.detach().reshape(L, -1) - (want[:, cut] if i == 0 else want)).abs().le(
                tol_out[:, cut] if i == 0 else tol_out).all()
            ga = gs[i].reshape(L, -1).double().abs()
            tol_dx = ga @ dw + roundoff(weff.shape[0], ga @ weff)
            want_dx = x1.grad.reshape(L, -1)
            if i == 1:  # the row layer's input gradient is this rank's slice
                want_dx, tol_dx = want_dx[:, cut], tol_dx[:, cut]
            assert (x2.grad.reshape(L, -1) - want_dx).abs().le(tol_dx).all()
            gw = ga.t() @ xa  # envelope of the weight gradient; dB = alpha G P (column) or alpha P^T G (row)
            p = b.proj.double().abs()
            tol_db = b.alpha * ((roundoff(L, gw) @ p + roundoff(H, gw @ p)) if b.kind == "column"
                                else (p.t() @ roundoff(L, gw) + roundoff(H, p.t() @ gw)))
            assert (a.factor.grad - shard(b.factor.grad, a.kind)).abs().double().le(shard(tol_db, a.kind)).all()
            with torch.no_grad():  # an SGD step before the next merge
                a.factor.sub_(0.1 * a.factor.grad)
                b.factor.sub_(0.1 * b.factor.grad)
                a.factor.grad = b.factor.grad = None



def test_tp2_matches_tp1_and_the_fp64_svd():
    run_ranks(_tp_body, 2)


# -- merge, schedule, compensation (single process) ------------------------------------------------------
def _channels_body(rank, world):
    """Merge channels handed in (megacomp.comm.make_channel, as the loqt_merge / loqt_merge_tp paths give): identity
    ones merge bit for bit as the defaults; a lossy TP Gram channel keeps P the same bits on every TP rank."""
    from megacomp.comm import make_channel

    parallel_state.initialize_model_parallel(world)
    cut = slice(rank * O // world, (rank + 1) * O // world)
    runs = {}
    for name, kw in (("default", {}), ("identity", dict(channel=make_channel("loqt_merge"),
                                                         tp_channel=make_channel("loqt_merge_tp"))),
                     ("bf16", dict(tp_channel=make_channel("loqt_merge_tp", "bf16")))):
        layers = [LoQTLinear(m, R, codec=INT8) for m in pair(world)]
        ctl = LoQT(layers, **kw)
        comm.reset_stats()
        for step in (0, 1):
            xs = [randn(S, NB, H, seed=20 + step), randn(S, NB, O, seed=30 + step)]
            gs = [randn(S, NB, O, seed=40 + step), randn(S, NB, H, seed=50 + step)]
            capture(ctl, layers, [xs[0], xs[1][..., cut]], [gs[0][..., cut], gs[1]])
            assert ctl.merge_and_reinit(step)
        runs[name] = ([t.clone() for m in layers for t in (m.proj, m.qweight, m.factor)], comm.stats()["loqt_merge_tp"])
    same = all(torch.equal(x, y) for x, y in zip(runs["default"][0], runs["identity"][0]))
    lossy = runs["bf16"]
    projs = [t for i, t in enumerate(lossy[0]) if i % 3 == 0]
    agree = all(torch.equal(gather(p, 1), p.repeat(1, world)) for p in projs)  # the same bits on every TP rank
    with pytest.raises(ValueError, match="compresses by structure"):
        LoQT([LoQTLinear(m, R, codec=INT8) for m in pair(world)], tp_channel=make_channel("x", "powersgd"))
    return same, agree, runs["default"][1].wire_bytes == runs["default"][1].uncompressed_bytes, \
        lossy[1].wire_bytes < lossy[1].uncompressed_bytes


def test_merge_channels_from_the_factory():
    for result in run_ranks(_channels_body, 2):
        assert all(result), result


def test_schedule_intervals_grow_as_the_paper_says():
    sched = LoQTSchedule(gap=100, growth=1.2)
    steps = sched.merge_steps(3000)
    intervals = [b - a for a, b in zip(steps, steps[1:])]
    assert steps[:2] == [0, 100]
    assert intervals == [100] + [100 + math.floor(1.2 ** k) for k in range(1, len(intervals))]
    assert intervals[-1] > intervals[1] and all(b >= a for a, b in zip(intervals[1:], intervals[2:]))
    assert all(sched.is_merge_step(s) for s in steps) and not sched.is_merge_step(150)
    ended = LoQTSchedule(gap=100, growth=1.2, total_steps=300)
    assert ended.merge_steps(400) == [0, 100]  # 201 + 100 >= 300: no merge just before the end
    assert LoQTSchedule(gap=5, progression="static").merge_steps(20) == [0, 5, 10, 15, 20]


def _trained_model(seed=0, steps=7, codec=INT8, compensate=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(H, O), nn.GELU(), nn.Linear(O, H))
    convert_to_loqt(model, R, codec=codec, compensate_iters=compensate)
    ctl = LoQT(model, LoQTSchedule(gap=3))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x, t = randn(L, H, seed=1), randn(L, H, seed=2)
    losses = []
    for step in range(steps):
        if ctl.wants_full_gradient(step):
            ctl.start_full_gradient()
            F.mse_loss(model(x), t).backward()
            ctl.merge_and_reinit(step)
            sync_optimizer(opt, ctl.layers)
            opt.zero_grad()
            continue
        loss = F.mse_loss(model(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, ctl, opt, losses


@pytest.mark.parametrize("compensate", [0, 3])
def test_merge_quantises_the_merged_weight_and_compensation_is_never_worse(compensate):
    codec = make_codec("int4", block_size=8)
    torch.manual_seed(0)
    m = LoQTLinear(nn.Linear(H, O), R, codec=codec, compensate_iters=compensate)
    ctl = LoQT([m])
    x, g = randn(L, H, seed=1), randn(L, O, seed=2)
    for step in (0, 1):
        ctl.start_full_gradient()
        (m(x) * g).sum().backward()
        target = m.effective_weight()  # the pre-merge weight deq(Q) + alpha * low-rank
        ctl.merge_and_reinit(step)
        assert int(m.loqt_step) == step and int(m.loqt_merges) == step + 1
        if step == 0:
            with torch.no_grad():
                m.factor.copy_(randn(*m.factor.shape, seed=3) * 0.2)  # moves the weight off the quantisation grid
    plain = codec.decode_flat(codec.encode_flat(target), target.numel()).view(target.shape)
    after = m.effective_weight()
    if compensate:
        assert m.factor.any() and float((target - after).norm()) <= float((target - plain).norm())
    else:  # B reset, Q = quantise(merged weight): within the codec's bound of it
        assert not m.factor.any() and torch.equal(after, plain)
        assert ((after - target).abs().double() <= elementwise_bound(codec, target).view(target.shape)).all()


def test_state_dict_round_trip_is_bit_exact_and_reset_is_optional():
    model, ctl, opt, _ = _trained_model(steps=5)
    other, _, _, _ = _trained_model(seed=1, steps=1)
    other.load_state_dict(model.state_dict())
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), k
    x = randn(L, H, seed=9)
    assert torch.equal(model(x), other(x))
    restored = LoQT(other, LoQTSchedule(gap=3))
    assert not restored.wants_full_gradient(3) and restored.wants_full_gradient(7)
    assert all(int(m.loqt_merges) == 2 for m in restored.layers)
    assert all(opt.state[m.factor] for m in ctl.layers)  # the reference keeps B's optimizer state ...
    sync_optimizer(opt, ctl.layers, reset_state=True)  # ... the option drops it
    assert all(m.factor not in opt.state for m in ctl.layers)
    torch.manual_seed(0)
    int4 = nn.Sequential(nn.Linear(H, O), nn.GELU(), nn.Linear(O, H))
    convert_to_loqt(int4, R, codec={"name": "int4", "block_size": 16})
    with pytest.raises(ValueError, match="convert with the same settings"):
        int4.load_state_dict(model.state_dict())


def _checkpoint_body(rank, world, root):
    from megacomp.training.checkpoint import load_checkpoint, save_checkpoint

    groups = parallel_state.initialize_model_parallel(world)

    def build(seed):
        model = nn.ModuleList(pair(world, seed=seed))
        convert_to_loqt(model, R, codec=INT8)
        return model, DistributedOptimizer([p for p in model.parameters() if p.requires_grad],
                                           process_group=groups.dp, lr=1e-2)

    model, opt = build(1)
    ctl = LoQT(model, LoQTSchedule(gap=2))
    x = randn(S, NB, H, seed=3)

    def loss(m):
        return (m[1](F.gelu(m[0](x)[0]))[0] ** 2).mean()

    for step in range(4):  # merges at 0 and 2
        if ctl.wants_full_gradient(step):
            ctl.start_full_gradient()
            loss(model).backward()
            ctl.merge_and_reinit(step)
            sync_optimizer(opt, ctl.layers)
            opt.zero_grad()
            continue
        loss(model).backward()
        opt.step()
    save_checkpoint(root, 4, model, opt, {}, groups, {})
    other, opt2 = build(5)
    assert load_checkpoint(root, other, opt2, groups, {})[0] == 4
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), k
    assert torch.equal(loss(model), loss(other))
    assert not LoQT(other, LoQTSchedule(gap=2)).wants_full_gradient(2)


def test_megacomp_checkpoint_round_trip_at_tp2(tmp_path):
    run_ranks(_checkpoint_body, 2, str(tmp_path))


# -- training at TP 2 x DP 2 ------------------------------------------------------------------------
def _train_body(rank, world):
    groups = parallel_state.initialize_model_parallel(2)
    blocks = nn.ModuleList([nn.ModuleList(pair(2, seed=7 + 10 * k)) for k in range(2)])
    layers = convert_to_loqt(blocks, R, codec=INT8, compensate_iters=2)
    with pytest.raises(ValueError, match="dp_group"):
        LoQT(blocks)
    ctl = LoQT(blocks, LoQTSchedule(gap=3), dp_group=groups.dp)
    opt = DistributedOptimizer([p for p in blocks.parameters() if p.requires_grad], process_group=groups.dp,
                               grad_codec=INT8, min_compress_numel=0, lr=2e-2, weight_decay=0.0)
    factors = {id(m.factor) for m in layers}
    biases = {id(m.base.bias) for m in layers}
    assert {id(p) for b in opt.buckets for p in b.params} == factors | biases
    x = randn(S, NB, H, seed=100 + groups.dp_rank)
    target = torch.tanh(x @ randn(H, H, seed=5) * 0.5)

    def loss_fn():
        h = x
        for col, row in blocks:
            h = h + row(F.gelu(col(h)[0]))[0]
        return F.mse_loss(h, target)

    losses, merged = [], []
    for step in range(11):
        if ctl.wants_full_gradient(step):
            ctl.start_full_gradient()
            loss_fn().backward()
            ctl.merge_and_reinit(step)
            sync_optimizer(opt, ctl.layers)
            opt.zero_grad()
            merged.append(step)
            continue
        comm.reset_stats()
        loss = loss_fn()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        st = comm.stats()["dp_gradient"]
        want = sum(b.padded * 4 * (groups.dp_size - 1) // groups.dp_size for b in opt.buckets)
        assert st.uncompressed_bytes == want and st.wire_bytes < want
        assert not any(k.startswith("loqt") for k in comm.stats())
    assert merged == [0, 3, 7] and losses[-1] < 0.7 * losses[0], losses
    for t in [m.proj for m in layers] + [m.qweight for m in layers] + [m.factor.detach() for m in layers]:
        assert torch.equal(gather(t.unsqueeze(0), 0, groups.dp)[0], gather(t.unsqueeze(0), 0, groups.dp)[1])
    return losses


def test_training_tp2_dp2_trains_only_the_factors_over_dp():
    run_ranks(_train_body, 4)


# -- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(rank=0), "rank must be"), (dict(rank=H + 1), "rank must be"), (dict(rank=True), "rank must be"),
    (dict(codec="fp8_e4m3"), "int8 or int4"), (dict(codec="int2"), "int8 or int4"),
    (dict(codec={"name": "int8", "block_size": 8, "hadamard": 8}), "drop hadamard"),
    (dict(codec={"name": "int8", "block_size": 8, "rounding": "stochastic"}), "drop hadamard"),
    (dict(codec={"name": "int8", "block_size": 0}), "block_size must divide"),
    (dict(codec={"name": "int8", "block_size": 12}), "block_size must divide"),
    (dict(alpha=0.0), "alpha"), (dict(compensate_iters=-1), "compensate_iters"),
])
def test_bad_input_raises_naming_the_fix(kwargs, match):
    kw = dict(rank=R, codec=INT8)
    kw.update(kwargs)
    rank = kw.pop("rank")
    with pytest.raises(ValueError, match=match):
        LoQTLinear(nn.Linear(H, O), rank, **kw)


def test_bad_models_and_schedules_raise():
    with pytest.raises(TypeError, match="converts"):
        LoQTLinear(nn.Embedding(4, 4), 1)
    with pytest.raises(ValueError, match="no ColumnParallelLinear"):
        convert_to_loqt(nn.Sequential(nn.GELU()), R)
    with pytest.raises(ValueError, match="wrap a single layer"):
        convert_to_loqt(nn.Linear(H, O), R)
    with pytest.raises(ValueError, match="convert the model first"):
        LoQT(nn.Sequential(nn.Linear(H, O)))
    with pytest.raises(ValueError, match="gap"):
        LoQTSchedule(gap=0)
    with pytest.raises(ValueError, match="growth"):
        LoQTSchedule(growth=0.5)
    m = LoQTLinear(nn.Linear(H, O), R, codec=INT8)
    with pytest.raises(ValueError, match="already in LoQT form"):
        LoQTLinear(m.base, R)
    ctl = LoQT([m])
    ctl.start_full_gradient()
    (m(torch.full((2, H), float("inf"))).sum()).backward()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert ctl.merge_and_reinit(0) is False  # an overflow: nothing merged, the capture dropped, retried later
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    with pytest.raises(RuntimeError, match="no captured gradient"):
        ctl.merge_and_reinit(0)
    ctl.start_full_gradient()
    (m(torch.ones(2, H)).sum()).backward()
    assert ctl.merge_and_reinit(1) is True and int(m.loqt_step) == 1


def test_backward_recomputes_the_dense_weight_instead_of_keeping_it():
    torch.manual_seed(0)
    m = LoQTLinear(nn.Linear(H, O), R, codec=INT8)
    with torch.no_grad():
        m.proj.copy_(torch.linalg.qr(randn(H, R, seed=1)).Q)
        m.factor.copy_(randn(O, R, seed=2))
        m.loqt_step.fill_(0)
    calls = []
    recompute = m._recompute
    m._recompute = lambda: calls.append(1) or recompute()
    x = randn(S, NB, H, seed=3).requires_grad_()
    g = randn(S, NB, O, seed=4)
    y = m(x)
    assert calls == []  # the forward keeps only a marker of the weight ...
    (y * g).sum().backward()
    assert calls == [1]  # ... and backward dequantises it again for the input gradient
    w = m.effective_weight()
    want = F.linear(x.detach(), w, m.bias.detach())
    assert torch.equal(y.detach(), want)
    assert torch.allclose(x.grad, g @ w, rtol=0, atol=roundoff(O, float((g.abs() @ w.abs()).max())))


def test_lomo_updates_the_factors_in_backward_and_not_on_merge_steps():
    from megacomp.optimizer import Lomo

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, O), nn.GELU(), nn.Linear(O, H))
    layers = convert_to_loqt(model, R, codec=INT8)
    ctl, opt = LoQT(model, LoQTSchedule(gap=3)), Lomo(model, lr=0.5)
    assert set(opt.params) == {"0.factor", "0.base.bias", "2.factor", "2.base.bias"}
    x, t = randn(L, H, seed=1), randn(L, H, seed=2)
    losses = []
    for step in range(6):
        if ctl.wants_full_gradient(step):  # LOMO updates inside backward: the merge step's backward runs through it
            ctl.start_full_gradient()
            opt.fused_backward(F.mse_loss(model(x), t))
            ctl.merge_and_reinit(step)
            assert all(not m.factor.any() for m in layers)  # the capture gave B no gradient, so LOMO left it at 0
            continue
        loss = F.mse_loss(model(x), t)
        opt.fused_backward(loss)
        losses.append(loss.item())
    assert all(m.factor.any() for m in layers) and losses[-1] < losses[0]


def _restated_forward(x, weights, biases):
    return F.linear(F.gelu(F.linear(x, weights[0], biases[0])), weights[1], biases[1])


def test_merge_step_equals_the_reference_first_commit_restated():
    """sebulo/LoQT's first commit (3ab2ead) restated in plain torch on two nn.Linear layers (one of each
    orientation; base codec none, so Q holds W exactly): a merge iteration sets W = W + alpha * low-rank, takes
    W's gradient there with the low-rank path off, sets P to its top-r singular vectors (SVD) and B = 0, and takes
    no optimizer step (the biases and their AdamW state stay as they were); any other iteration trains B and the
    biases with AdamW (the factor's moments kept across merges, as both commits). megacomp's LoQT driven as its
    docstring says matches it at every iteration, fp32 round-off apart (P's signs by megacomp's rule)."""
    alpha, steps = 0.5, 6
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, O), nn.GELU(), nn.Linear(O, H))
    weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    biases = [model[i].bias.detach().clone().requires_grad_() for i in (0, 2)]
    convert_to_loqt(model, R, codec="none", alpha=alpha, compensate_iters=0)
    layers = [model[0], model[2]]
    assert [m.kind for m in layers] == ["column", "row"]  # the reference's rule: 'left' when in <= out
    ctl = LoQT(model, LoQTSchedule(gap=2))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    factors = [torch.zeros_like(m.factor).requires_grad_() for m in layers]
    projs = [None, None]
    ref_opt = torch.optim.AdamW([factors[0], biases[0], factors[1], biases[1]], lr=1e-2)

    def low_rank(i):
        if projs[i] is None:
            return torch.zeros_like(weights[i])
        return factors[i] @ projs[i].t() if i == 0 else projs[i] @ factors[i]

    x, t = randn(L, H, seed=1), randn(L, H, seed=2)
    merges = []
    for step in range(steps):
        if ctl.wants_full_gradient(step):  # the merge iteration
            merges.append(step)
            bias_before = [m.bias.detach().clone() for m in layers]
            state_before = {k: v.clone() for k, v in opt.state[layers[0].bias].items()} if step else {}
            ctl.start_full_gradient()
            F.mse_loss(model(x), t).backward()
            ctl.merge_and_reinit(step)
            sync_optimizer(opt, ctl.layers)
            opt.zero_grad()
            # the reference: merge, then the gradient at the merged weight with the low-rank path off
            with torch.no_grad():
                weights = [w + alpha * low_rank(i) for i, w in enumerate(weights)]
            dense = [w.clone().requires_grad_() for w in weights]
            F.mse_loss(_restated_forward(x, dense, biases), t).backward()
            for i, w in enumerate(dense):
                u, _, vh = torch.linalg.svd(w.grad.double())
                vecs = vh[:R].t() if i == 0 else u[:, :R]  # column: right singular vectors, row: left
                # the SVD's signs are arbitrary; the factor's AdamW moments carry over a merge, so the sign matters
                # from the second merge on: megacomp's documented rule, each column's largest-magnitude entry > 0
                top = vecs.abs().argmax(dim=0)
                projs[i] = (vecs * vecs[top, torch.arange(R)].sign()).to(torch.float32)
                with torch.no_grad():
                    factors[i].zero_()
            ref_opt.zero_grad()  # no optimizer step on a merge iteration
            assert all(torch.equal(m.bias, b) for m, b in zip(layers, bias_before))
            assert all(torch.equal(opt.state[layers[0].bias][k], v) for k, v in state_before.items())
            assert all(not m.factor.any() for m in layers)
        else:
            F.mse_loss(model(x), t).backward()
            opt.step()
            opt.zero_grad()
            eff = [w + alpha * low_rank(i) for i, w in enumerate(weights)]
            F.mse_loss(_restated_forward(x, eff, biases), t).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for i, m in enumerate(layers):
            got_proj = m.proj @ m.proj.t()
            want_proj = projs[i] @ projs[i].t()
            assert torch.allclose(got_proj, want_proj, atol=1e-5), f"step {step} layer {i}: P"
            want = (weights[i] + alpha * low_rank(i)).detach()
            assert torch.allclose(m.effective_weight(), want, rtol=1e-5, atol=1e-6), f"step {step} layer {i}: W"
            assert torch.allclose(m.bias, biases[i], rtol=1e-5, atol=1e-6), f"step {step} layer {i}: bias"
    assert merges == [0, 2, 5]
