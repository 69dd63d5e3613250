"""LOMO and AdaLomo (megacomp.optimizer.lomo) on real gloo groups.

Gradients are chosen, not computed: each rank's loss is ``sum(p * c)`` so ``p.grad == c`` exactly, with ``c`` a
multiple of 1/16 in [-1/2, 1/2]; sums of such numbers are exact in fp32 in any order, so the DP sum is the same
bits on every rank and in the single-process run that sees the summed gradient (then both divide by the world).

- Compression off: parameters bit-identical at DP 1, 2 and 3 to the single-process run (clipping by value and
  by norm, weight decay), and within fp32 round-off of fp64 restatements (SGD with the same clipping; the
  AdaLomo equations).
- Compressed: LOMO's step within lr x the codec's all-reduce bound / world; error feedback keyed per
  parameter; AdaLomo resumes bit for bit from its state_dict.
- Memory: no gradient is left on a parameter after fused_backward.
- Bad input: clip_grad_norm <= 0, a missing grad_norm pass, TP-sharded parameters, a non-finite norm.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from codec_bounds import all_reduce_bound
from distributed import run_ranks
from megacomp.comm import Channel
from megacomp.compression import make_codec
from megacomp.optimizer import AdaLomo, DynamicLossScaler, Lomo

SHAPES = [(6, 5), (5,), (4, 7)]
STEPS = 4


class Params(nn.Module):
    """Three parameters; ``loss(c) = sum_i sum(p_i * c_i)`` so that ``p_i.grad == c_i``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES])

    def loss(self, cs):
        return sum((p * c).sum() for p, c in zip(self.ps, cs))


def _grads(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(-8, 9, s, generator=g).float() / 16 for s in SHAPES]


def _summed(world: int, step: int):
    """The single-process gradient: the DP ranks' gradients summed (exact), before the division by world."""
    per_rank = [_grads(r, step) for r in range(world)]
    return [sum(gs[i] for gs in per_rank) for i in range(len(SHAPES))]


KINDS = {
    "lomo": (Lomo, dict(lr=0.05, weight_decay=0.1, clip_grad_value=0.4)),
    "lomo_norm": (Lomo, dict(lr=0.05, clip_grad_norm=0.5)),
    "adalomo": (AdaLomo, dict(lr=0.05, weight_decay=0.1)),
    "adalomo_norm": (AdaLomo, dict(lr=0.05, clip_grad_norm=0.5, clip_grad_value=0.3)),
}


def _train(opt, model, cs_of_step):
    for step in range(STEPS):
        cs = cs_of_step(step)
        if opt.clip_grad_norm:
            opt.grad_norm(model.loss(cs))
        opt.fused_backward(model.loss(cs))
        assert all(p.grad is None for p in model.parameters())  # every gradient was freed in backward
    return [p.detach().clone() for p in model.parameters()]


def _dp_body(rank, world, kind):
    cls, kw = KINDS[kind]
    model = Params()
    return _train(cls(model, **kw), model, lambda step: _grads(rank, step))


def _single(kind, world):
    """The same optimizer in one process on the DP-summed gradient, divided by the world as the DP path does."""
    cls, kw = KINDS[kind]
    model = Params()
    opt = cls(model, **kw)
    opt.world = 1
    return _train(opt, model, lambda step: [g / world for g in _summed(world, step)])


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("world", [1, 2, 3])
def test_compression_off_is_bit_identical_to_the_single_process_run(kind, world):
    want = _single(kind, world)
    for got in run_ranks(_dp_body, world, kind):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


# -- fp64 restatements (written from the papers' equations, not from the module) -----------------
def _sgd64(p, gs, lr, wd, clip_value, clip_norm):
    p = [x.detach().double() for x in p]
    for g in gs:
        g = [x.double() for x in g]
        if clip_value:
            g = [x.clamp(-clip_value, clip_value) for x in g]
        if clip_norm:
            norm = math.sqrt(sum(float((x * x).sum()) for x in g))
            g = [x * min(1.0, clip_norm / (norm + 1e-6)) for x in g]
        p = [x * (1 - lr * wd) - lr * y for x, y in zip(p, g)]
    return p


def _adalomo64(p, gs, lr, wd, clip_norm=None, eps1=1e-30, eps2=1e-3, d=1.0, decay=-0.8):
    p = [x.detach().double() for x in p]
    state = [None] * len(p)
    for t, g in enumerate(gs, start=1):
        g = [x.double() for x in g]
        if clip_norm:
            norm = math.sqrt(sum(float((x * x).sum()) for x in g))
            g = [x * min(1.0, clip_norm / (norm + 1e-6)) for x in g]
        beta = 1 - t ** decay
        out = []
        for i, (x, y) in enumerate(zip(p, g)):
            sq = y * y + eps1
            if x.dim() == 2:
                r, c = state[i] if state[i] is not None else (torch.zeros(x.shape[0], dtype=torch.float64),
                                                               torch.zeros(x.shape[1], dtype=torch.float64))
                r, c = beta * r + (1 - beta) * sq.mean(1), beta * c + (1 - beta) * sq.mean(0)
                state[i] = (r, c)
                u = y / torch.sqrt(torch.outer(r / r.mean(), c))
            else:
                v = state[i] if state[i] is not None else torch.zeros_like(x)
                v = beta * v + (1 - beta) * sq
                state[i] = v
                u = y / torch.sqrt(v)
            rms = lambda z: float(z.norm()) / math.sqrt(z.numel())  # noqa: E731
            u = u / max(1.0, rms(u) / d)
            lr_p = lr * max(eps2, rms(x))
            out.append(x * (1 - lr_p * wd) - lr_p * u)
        p = out
    return p


def _fp32_bound(p64, lr_scale, n_max):
    """fp32 round-off of STEPS steps: each element passes through at most ~32 rounded operations per step on
    values no larger than |p| + lr_scale * sqrt(n) (an update normalised to RMS <= 1 has |u| <= sqrt(n))."""
    return [STEPS * 32 * 2.0 ** -24 * (x.abs() + lr_scale * math.sqrt(n_max)) for x in p64]


def test_lomo_matches_sgd_with_the_same_clipping_in_fp64():
    for kind in ("lomo", "lomo_norm"):
        _, kw = KINDS[kind]
        got = _single(kind, 1)
        want = _sgd64(Params().ps, [_grads(0, s) for s in range(STEPS)], kw["lr"], kw.get("weight_decay", 0.0),
                      kw.get("clip_grad_value"), kw.get("clip_grad_norm"))
        for a, b, bound in zip(got, want, _fp32_bound(want, kw["lr"], 35)):
            assert ((a.double() - b).abs() <= bound).all(), kind


def test_adalomo_matches_the_paper_equations_in_fp64():
    for kind in ("adalomo",):
        _, kw = KINDS[kind]
        got = _single(kind, 1)
        want = _adalomo64(Params().ps, [_grads(0, s) for s in range(STEPS)], kw["lr"], kw["weight_decay"])
        scale = kw["lr"] * max(float(x.abs().max()) for x in want)
        for a, b, bound in zip(got, want, _fp32_bound(want, scale, 35)):
            assert ((a.double() - b).abs() <= bound).all(), (a - b).abs().max()


# -- compressed ------------------------------------------------------------------------------------
def _lossy_body(rank, world, spec):
    import torch.distributed as dist

    model = Params()
    before = [p.detach().clone() for p in model.parameters()]
    ch = Channel("dp_gradient", spec, error_feedback="ef", min_compress_numel=0)
    opt = Lomo(model, lr=0.05, channel=ch)
    opt.fused_backward(model.loss(_grads(rank, 0)))
    codec = make_codec(spec)
    ok = []
    for i, (b, p) in enumerate(zip(before, model.parameters())):
        partials = [_grads(r, 0)[i] for r in range(world)]
        exact = sum(x.double() for x in partials) / world
        moved = (b.double() - p.detach().double()) / 0.05
        bound = all_reduce_bound(codec, partials) / world + 64 * 2.0 ** -24 * (b.double().abs() / 0.05 + 1)
        ok.append(bool(((moved - exact).abs() <= bound).all()))
    keys = sorted(ch.error_feedback.keys())
    same = [torch.empty_like(model.ps[0]) for _ in range(world)]
    dist.all_gather(same, model.ps[0].detach())
    return all(ok), keys, all(torch.equal(same[0], x) for x in same)


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_lomo_step_is_within_the_codec_bound(world):
    for ok, keys, replicated in run_ranks(_lossy_body, world, {"name": "int4", "block_size": 8}):
        assert ok and replicated  # every rank applies the same decoded average
        assert {k.split("/")[0] for k in keys} == {"ps.0", "ps.1", "ps.2"}  # one error per parameter


def _resume_body(rank, world):
    def build():
        model = Params()
        ch = Channel("dp_gradient", {"name": "int8", "block_size": 8}, error_feedback="loco", min_compress_numel=0)
        return model, AdaLomo(model, lr=0.05, channel=ch, clip_grad_norm=1.0)

    def run(model, opt, steps):
        for s in steps:
            opt.grad_norm(model.loss(_grads(rank, s)))
            opt.fused_backward(model.loss(_grads(rank, s)))

    model, opt = build()
    run(model, opt, range(3))
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    run(model, opt, range(3, 5))
    straight = [p.detach().clone() for p in model.parameters()]
    model, opt = build()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    run(model, opt, range(3, 5))
    return all(torch.equal(a, p.detach()) for a, p in zip(straight, model.parameters()))


def test_adalomo_resumes_bit_for_bit_with_error_feedback():
    assert all(run_ranks(_resume_body, 2))


def test_bad_input_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="clip_grad_norm must be > 0"):
        Lomo(Params(), clip_grad_norm=0.0)
    model = Params()
    opt = AdaLomo(model, clip_grad_norm=1.0)
    with pytest.raises(RuntimeError, match="call grad_norm"):
        opt.fused_backward(model.loss(_grads(0, 0)))
    model = Params()
    opt = Lomo(model, loss_scaler=DynamicLossScaler())  # the overflow check needs the first pass too
    with pytest.raises(RuntimeError, match="loss scaling is set, call grad_norm"):
        opt.fused_backward(model.loss(_grads(0, 0)))
    sharded = Params()
    sharded.ps.tp_size = 2  # what megacomp's TP layers record on the module that owns the shards
    for p in sharded.parameters():
        p.tensor_model_parallel = True
    with pytest.raises(ValueError, match="sharded over 2 tensor-parallel ranks; pass tp_group"):
        AdaLomo(sharded)


def test_reload_params_resets_adalomo_statistics_and_leaves_lomo_alone():
    """What LoQT's merge asks (megacomp.tensor_parallel.loqt.sync_optimizer): the model holds the parameters, so
    nothing is reloaded; reset_state zeroes only the replaced parameters' AdaLomo statistics."""
    model = Params()
    opt = AdaLomo(model, lr=0.05)
    opt.fused_backward(model.loss(_grads(0, 0)))
    before = {n: {k: v.clone() for k, v in s.items()} for n, s in opt.state.items()}
    params = list(model.ps)
    opt.reload_params([params[0]])  # no reset: nothing changes
    assert all(torch.equal(v, before[n][k]) for n, s in opt.state.items() for k, v in s.items())
    opt.reload_params([params[0]], reset_state=True)
    first = opt.names[id(params[0])]
    for n, s in opt.state.items():
        for k, v in s.items():
            assert (not v.any()) if n == first else torch.equal(v, before[n][k]), (n, k)
    assert any(before[first][k].any() for k in before[first])
    lomo_model = Params()
    weights = [p.detach().clone() for p in lomo_model.ps]
    Lomo(lomo_model).reload_params(list(lomo_model.ps), reset_state=True)  # no state: nothing to do
    assert all(torch.equal(p, w) for p, w in zip(lomo_model.ps, weights))


# -- overflow, non-finite gradients, fp16 with loss scaling, bf16 ----------------------------------
def _overflow_body(rank, world):
    """Rank 1's gradient is inf at step 1: the averaged gradient is inf on every rank, the norm pass says so,
    both ranks skip the step (nothing changes), and the next step goes on as usual."""
    model = Params()
    opt = Lomo(model, lr=0.05, clip_grad_norm=10.0)
    before = [p.detach().clone() for p in model.parameters()]
    cs = _grads(rank, 1)
    if rank == 1:
        cs[2][0, 0] = float("inf")
    norm = opt.grad_norm(model.loss(cs))
    stepped = opt.fused_backward(model.loss(cs))
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.grad_norm(model.loss(_grads(rank, 2)))
    return norm, stepped, unchanged, opt.skipped_steps, opt.fused_backward(model.loss(_grads(rank, 2))), opt.step_num


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    for norm, stepped, unchanged, skipped, next_step, steps in run_ranks(_overflow_body, 2):
        assert not math.isfinite(norm) and not stepped and unchanged and skipped == 1
        assert next_step and steps == 1


def test_without_a_norm_pass_a_non_finite_gradient_is_reported_after_the_pass():
    model = Params()
    opt = Lomo(model, lr=0.05)
    cs = _grads(0, 0)
    cs[1][3] = float("nan")
    with pytest.raises(FloatingPointError, match=r"1 parameter\(s\) \(ps.1\) is inf/NaN and was applied"):
        opt.fused_backward(model.loss(cs))
    assert torch.isnan(model.ps[1][3]) and torch.isfinite(model.ps[0]).all()  # the others were updated normally


def _fp16_body(rank, world, scale):
    model = Params().half()
    opt = Lomo(model, lr=0.0625, clip_grad_norm=0.5, loss_scaler=DynamicLossScaler(scale=scale, growth_interval=3))
    out = []
    for step in range(STEPS):
        cs = [c.half() for c in _grads(rank, step)]
        opt.grad_norm(model.loss(cs))
        out.append((opt.fused_backward(model.loss(cs)), opt.scaler.scale))
    return [p.detach().clone() for p in model.parameters()], out


@pytest.mark.parametrize("world", [1, 2])
def test_fp16_with_loss_scaling_is_bit_identical_to_the_single_process_run(world):
    """Gradients k/16 scaled by 2^10 and summed over 2 ranks are exact in fp16, the scale and the world are
    powers of two: unscaling is exact, so DP equals the single process on the summed gradient bit for bit, and
    the scale grows every 3 clean steps."""
    model = Params().half()
    opt = Lomo(model, lr=0.0625, clip_grad_norm=0.5, loss_scaler=DynamicLossScaler(scale=2.0 ** 10, growth_interval=3))
    for step in range(STEPS):
        cs = [(g / world).half() for g in _summed(world, step)]
        opt.grad_norm(model.loss(cs))
        opt.fused_backward(model.loss(cs))
    for got, trace in run_ranks(_fp16_body, world, 2.0 ** 10):
        assert all(torch.equal(a, b) for a, b in zip(got, model.parameters()))
        assert trace == [(True, 1024.0), (True, 1024.0), (True, 2048.0), (True, 2048.0)]


def test_fp16_overflow_skips_steps_and_backs_off_the_scale():
    """|g| <= 1/2 per rank, summed over 2 ranks <= 1 before scaling: at 2^17 and 2^16 a scaled gradient of 1/2
    or its DP sum reaches 65536 > fp16's largest finite 65504; the scale halves until the step is clean."""
    (got, trace), _ = run_ranks(_fp16_body, 2, 2.0 ** 17)
    steps = [s for s, _ in trace]
    assert steps[0] is False and all(t[1] < 2.0 ** 17 for t in trace)
    first = steps.index(True)
    assert all(steps[first:]) and trace[first - 1][1] == trace[first][1]  # the scale stops falling once clean
    assert all(math.isfinite(float(p.float().abs().max())) for p in got)


def _fp16_ef_body(rank, world, changing):
    """fp16 LOMO with int4 + classic error feedback; step 2 overflows on rank 1 (skipped). ``changing``: the scale
    doubles after every clean step and halves at the overflow; else it stays 2^10 (backoff and growth off)."""
    model = Params().half()
    scaler = (DynamicLossScaler(scale=2.0 ** 10, growth_interval=1) if changing else
              DynamicLossScaler(scale=2.0 ** 10, growth_interval=10 ** 9, backoff_factor=1.0))
    ch = Channel("dp_gradient", {"name": "int4", "block_size": 8}, error_feedback="ef", min_compress_numel=0)
    opt = Lomo(model, lr=0.0625, loss_scaler=scaler, channel=ch)
    scales = []
    for step in range(STEPS + 1):
        cs = [c.half() for c in _grads(rank, step)]
        if step == 2 and rank == 1:
            cs[0][0, 0] = float("inf")
        opt.grad_norm(model.loss(cs))
        opt.fused_backward(model.loss(cs))
        scales.append(scaler.scale)
    return [p.detach().clone() for p in model.parameters()], scales


def test_fp16_error_feedback_does_not_depend_on_loss_scale_changes():
    """The gradients travel at the loss scale, so the residuals are kept at the scale of their step: at every scale
    change they must follow it. Scales and world are powers of two and the int4 codec's block scale is its absmax
    over a constant, so every value (fp16 gradients, codes, residuals, the unscaled average) is the constant-scale
    run's times a power of two: the parameters must be the same bits with and without scale changes (a residual
    left at the old scale is off by 2x after each change and moves the next steps)."""
    (same, trace), _ = run_ranks(_fp16_ef_body, 2, True)
    (want, flat), _ = run_ranks(_fp16_ef_body, 2, False)
    assert trace == [2048.0, 4096.0, 2048.0, 4096.0, 8192.0] and set(flat) == {1024.0}  # grew, backed off, grew
    assert all(torch.equal(a, b) for a, b in zip(same, want))


def test_bf16_parameters_follow_sgd_rounded_to_bf16_each_step():
    """LOMO keeps no fp32 master: each step computes in fp32 and rounds to bf16; the fp64 restatement rounded
    to bf16 after every step differs by at most one bf16 ulp per step (the two roundings of a double-rounded
    value)."""
    model = Params().to(torch.bfloat16)
    opt = Lomo(model, lr=0.05, weight_decay=0.1)
    want = [p.detach().double() for p in Params().ps]
    for step in range(STEPS):
        cs = [c.to(torch.bfloat16) for c in _grads(0, step)]
        opt.fused_backward(model.loss(cs))
        want = [(w.to(torch.bfloat16).double() * (1 - 0.05 * 0.1) - 0.05 * c.double()).to(torch.bfloat16).double()
                for w, c in zip(want, cs)]
    for p, w in zip(model.parameters(), want):
        assert p.dtype == torch.bfloat16
        ulp = 2.0 ** (torch.floor(torch.log2(w.abs().clamp(min=2.0 ** -126))) - 7)
        assert ((p.double() - w).abs() <= STEPS * ulp).all()


def _template_body(rank, world):
    def build():
        model = Params()
        ch = Channel("dp_gradient", {"name": "int4", "block_size": 8}, error_feedback="loco", min_compress_numel=0)
        return model, AdaLomo(model, lr=0.05, channel=ch)

    model, trained = build()
    trained.fused_backward(model.loss(_grads(rank, 0)))
    _, fresh = build()
    fresh.init_state()

    def shapes(opt):
        return {k: tuple(v.shape) for k, v in opt.state_dict()["channel"]["error_feedback"]["errors"].items()}
    return shapes(trained), shapes(fresh)


@pytest.mark.parametrize("world", [2, 3])
def test_init_state_gives_a_template_with_the_trained_keys(world):
    for trained, fresh in run_ranks(_template_body, world):
        assert trained == fresh and len(trained) == 3 * (1 if world == 2 else 2)  # worker (+ server) per parameter


# -- tensor parallelism ------------------------------------------------------------------------------
H, F, S, B = 8, 16, 4, 2


def _tp_body(rank, world, tp, kind):
    import torch.distributed as dist

    from megacomp import parallel_state
    from megacomp.config import ModelParallelConfig
    from megacomp.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    groups = parallel_state.initialize_model_parallel(tp)
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, process_groups=groups)
    torch.manual_seed(0)  # every rank draws the same full weights and keeps its shard
    model = nn.ModuleDict(dict(col=ColumnParallelLinear(H, F, config=cfg), row=RowParallelLinear(F, H, config=cfg)))
    cls, kw = KINDS[kind]
    opt = cls(model, tp_group=groups.tp, dp_group=groups.dp, **kw)
    dp_rank = dist.get_rank(groups.dp)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + dp_rank)  # each DP rank its own batch, TP ranks alike
        x, w = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)

        def loss():
            return (model["row"](torch.nn.functional.gelu(model["col"](x)[0]))[0] * w).sum()
        if opt.clip_grad_norm:
            opt.grad_norm(loss())
        opt.fused_backward(loss())
    full = {}
    for name, p in model.named_parameters():
        if name in opt.sharded:
            parts = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=groups.tp)
            full[name] = torch.cat(parts, dim=opt.sharded[name])
        else:
            full[name] = p.detach().clone()
    parallel_state.destroy_model_parallel()
    return full, sorted(opt.sharded)


@pytest.mark.parametrize("kind", ["lomo_norm", "adalomo", "adalomo_norm"])
@pytest.mark.parametrize("dp", [1, 2])
def test_tensor_parallel_update_matches_tp1(kind, dp):
    """TP 2 against TP 1 on the same global batch: the same update up to fp32 summation order (the row layer's
    partial outputs and the whole-parameter statistics are summed in another order): the bound is STEPS x 64
    ulps of |p| + lr (each step's update is at most lr x max(eps2, RMS(p)) x sqrt(n) per element)."""
    ref, _ = run_ranks(_tp_body, dp, 1, kind)[0]
    for got, sharded in run_ranks(_tp_body, 2 * dp, 2, kind):
        assert sharded == ["col.bias", "col.weight", "row.weight"]
        for name, want in ref.items():
            bound = STEPS * 64 * 2.0 ** -24 * (want.abs() + KINDS[kind][1]["lr"] * math.sqrt(want.numel()))
            assert ((got[name] - want).abs() <= bound).all(), (name, (got[name] - want).abs().max())


class _Tied(nn.Module):
    """A word embedding tied to the output layer, as in the GPT."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = nn.Embedding(12, 6), nn.Parameter(torch.randn(5, 6))

    def forward(self, ids):
        x = torch.tanh(self.emb(ids) + self.pos)
        return torch.nn.functional.cross_entropy((x @ self.emb.weight.t()).flatten(0, 1), ids.flatten())


def _tied_body(rank, world, flush):
    model = _Tied()
    opt = AdaLomo(model, lr=0.05, clip_grad_norm=1.0)
    flushed = []  # at the embedding weight's summed gradient: whether a reduction is still in flight
    model.emb.weight.register_hook(lambda g: flushed.append(opt._pending is None))
    if flush:
        opt.flush_before(model.emb)
    for step in range(3):
        ids = torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(10 * step + rank))
        opt.grad_norm(model(ids))
        opt.fused_backward(model(ids))
    return [p.detach().clone() for p in model.parameters()], flushed


def test_flush_before_finishes_the_reduction_in_flight_and_changes_no_bit():
    """Before the tied embedding's backward nothing is in flight any more; the parameters are the same bits."""
    plain = run_ranks(_tied_body, 2, False)
    flushed = run_ranks(_tied_body, 2, True)
    for (a, before), (b, seen) in zip(plain, flushed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert len(seen) == 6 and all(seen) and not any(before)  # both passes of 3 steps; without it: pos in flight


# -- the reference's step, restated ------------------------------------------------------------------
# OpenLMLab/LOMO ``lomo_optim/lomo.py`` and ``lomo_optim/adalomo.py`` at commit 45d4bac (non-ZeRO path), restated
# in plain torch: a gradient hook on every parameter that, when it fires, updates every parameter whose gradient is
# already there (and frees it), one more sweep after backward; the first pass gathers per-parameter norms.
class _Reference:
    def __init__(self, model, lr, *, ada=False, scale=None, dynamic=False, clip_grad_norm=None, clip_grad_value=None,
                 weight_decay=0.0, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8):
        self.model, self.lr, self.ada, self.scale, self.dynamic = model, lr, ada, scale, dynamic
        self.clip_norm, self.clip_value, self.wd, self.eps, self.d, self.decay = (
            clip_grad_norm, clip_grad_value, weight_decay, eps, clip_threshold, decay_rate)
        self.gather, self.norms, self.clip_coef, self.overflow, self.step_num, self.state = False, [], None, False, 0, {}
        for p in model.parameters():
            p.register_hook(self.sweep)

    def sweep(self, x=None):
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if p.grad is None:
                    continue
                if self.dynamic and (self.overflow or not math.isfinite(float(p.grad.float().sum()))):
                    p.grad, self.overflow = None, True  # LOMO's scaler: drop the gradient, the step is lost
                    break
                g = p.grad.to(torch.float32)
                p.grad = None
                if self.scale:
                    g.div_(self.scale)
                if self.gather:
                    self.norms.append(torch.norm(g, 2.0))
                    continue
                if self.clip_value is not None and self.clip_value > 0:
                    g.clamp_(min=-self.clip_value, max=self.clip_value)
                if self.clip_norm is not None and self.clip_coef is not None:
                    g.mul_(self.clip_coef)
                p32 = p.data.to(torch.float32)
                lr, u = self.lr, g
                if self.ada:
                    beta2t = 1.0 - math.pow(self.step_num, self.decay)
                    u = g ** 2 + self.eps[0]
                    if p.dim() > 1:
                        row, col = self.state.setdefault(n, (torch.zeros(p.shape[0]), torch.zeros(p.shape[1])))
                        row.mul_(beta2t).add_(u.mean(dim=-1), alpha=1.0 - beta2t)
                        col.mul_(beta2t).add_(u.mean(dim=-2), alpha=1.0 - beta2t)
                        r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                        u = torch.mul(r, col.unsqueeze(-2).rsqrt()).mul_(g)
                    else:
                        v = self.state.setdefault(n, torch.zeros(p.shape[0]))
                        u = v.mul_(beta2t).add_(u, alpha=1.0 - beta2t).rsqrt().mul_(g)
                    u.div_((u.norm(2) / (u.numel() ** 0.5) / self.d).clamp_(min=1.0))
                    lr = self.lr * max(self.eps[1], torch.norm(p32, 2.0) / math.sqrt(p.numel()))
                if self.wd > 0.0:
                    p32.mul_(1.0 - lr * self.wd)
                p32.add_(u, alpha=-lr)
                p.data.copy_(p32)
        return x

    def grad_norm(self, loss):
        self.gather, self.norms, self.overflow = True, [], False
        (loss * self.scale if self.scale else loss).backward(retain_graph=True)
        self.sweep()
        if self.overflow:  # halve the scale, clear the gradients; the update pass then drops every gradient
            self.scale = max(self.scale / 2.0, 1.0)
            for p in self.model.parameters():
                p.grad = None
            return
        self.clip_coef = torch.clamp(float(self.clip_norm) / (torch.norm(torch.stack(self.norms), 2.0) + 1e-6), max=1.0)
        self.gather = False

    def fused_backward(self, loss):
        self.step_num += 1
        (loss * self.scale if self.scale else loss).backward()
        self.sweep()


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.b(torch.tanh(self.a(x))), y)


def _batch(step, dtype):
    g = torch.Generator().manual_seed(step)
    return torch.randn(5, 6, generator=g).to(dtype), torch.randint(0, 4, (5,), generator=g)


def _against_the_reference(make_ours, ref_kw, dtype=torch.float32, steps=5, big_at=None):
    """Both optimizers on their own copy of the model and the same batches; after every step the parameters must be
    the same bits (and, under loss scaling, the scale and whether the step happened). At step ``big_at`` the loss
    is weighted by 10^4 (in fp16 at the loss scale: an overflow)."""
    ours_m, ref_m = _Mlp().to(dtype), _Mlp().to(dtype)
    ours, ref = make_ours(ours_m), _Reference(ref_m, **ref_kw)
    trace = []
    for step in range(steps):
        x, y = _batch(step, dtype)
        w = 1e4 if step == big_at else 1.0
        if ours.needs_norm_pass:
            ours.grad_norm(ours_m(x, y) * w)
        stepped = ours.fused_backward(ours_m(x, y) * w)
        if ref.clip_norm is not None:
            ref.grad_norm(ref_m(x, y) * w)
        ref.fused_backward(ref_m(x, y) * w)
        assert all(torch.equal(a, b) for a, b in zip(ours_m.parameters(), ref_m.parameters())), step
        if ours.scaler is not None:
            assert ours.scaler.scale == ref.scale, step
        trace.append(stepped)
    return trace


def test_lomo_is_the_reference_step_bit_for_bit():
    for kw in (dict(clip_grad_norm=0.5, weight_decay=0.1), dict(clip_grad_norm=2.0, clip_grad_value=0.05), dict()):
        _against_the_reference(lambda m: Lomo(m, lr=0.05, **kw), dict(lr=0.05, **kw))


def test_fp16_lomo_with_the_reference_loss_scaler_is_the_reference():
    """fp16 with Lomo.reference_loss_scaler() and clip_grad_norm 1 (the reference forces it): the same bits, the
    same skipped step (a loss 10^4 times larger overflows at step 2) and the scale halves once, never grows."""
    s = Lomo.reference_loss_scaler()
    assert (s.scale, s.backoff_factor, s.growth_factor, s.min_scale) == (2.0 ** 32, 0.5, 1.0, 1.0)
    make = lambda m: Lomo(m, lr=0.05, clip_grad_norm=1.0, loss_scaler=Lomo.reference_loss_scaler(2.0 ** 8))  # noqa: E731
    trace = _against_the_reference(make, dict(lr=0.05, clip_grad_norm=1.0, scale=2.0 ** 8, dynamic=True),
                                   torch.float16, big_at=2)
    assert trace == [True, True, False, True, True]


def test_adalomo_is_the_reference_step_bit_for_bit():
    """fp32 without a loss scaler against the reference's static 2^10 (a power of two changes no bit here)."""
    for kw in (dict(weight_decay=0.1), dict(clip_grad_norm=0.5, clip_grad_value=0.05)):
        _against_the_reference(lambda m: AdaLomo(m, lr=0.05, **kw), dict(lr=0.05, ada=True, scale=2.0 ** 10, **kw))


def test_fp16_adalomo_with_the_reference_loss_scale_is_the_reference():
    make = lambda m: AdaLomo(m, lr=0.05, weight_decay=0.1, loss_scaler=AdaLomo.reference_loss_scaler())  # noqa: E731
    _against_the_reference(make, dict(lr=0.05, ada=True, scale=2.0 ** 10, weight_decay=0.1), torch.float16)
