"""ACCO over DistributedOptimizer on real gloo groups (megacomp.optimizer.acco).

- Compression off: every step's parameters equal an independent single-process restatement of ACCO's two updates
  (θ̃_{t+1} = AdamW(θ_t, scale · mean G_A(θ̃_t)) on a copy of the state; θ_{t+1} = AdamW(θ_t, mean (G_A(θ̃_t) +
  G_B(θ_t)))) bit for bit (DP 2: the sum of two rank terms has one rounding in any order), with weight decay,
  clipping, several and uneven buckets, 2 and 4 micro-batches.
- The estimate never advances committed state: masters, AdamW moments and error feedback after an estimate equal
  those before it.
- Compressed (int4 + LoCo gradients, int8 parameters) trains, and the real update keeps error feedback per bucket.
- Resume: 3 steps, state_dict inside synchronized(), a fresh optimizer loads it, 3 more steps: bit-identical to 6
  uninterrupted steps (compressed, with error feedback); a ZeRO-1 checkpoint resumes with θ̃ = θ.
- Bad input: unsupported optimizers and calls out of order raise errors naming the fix; an error in the
  background job reaches the caller.
"""
import copy

import pytest
import torch
from torch import nn

from distributed import run_ranks
from megacomp.optimizer import DistributedOptimizer
from megacomp.optimizer.acco import ACCO
from test_optimizer_distributed import RecordingAdamW, batch, loss_fn, make_model

ADAM = dict(lr=1e-2, weight_decay=0.1)


def lr_at(step):
    """A schedule that changes every step: both updates of step t must use step t's value, even when the caller sets
    step t + 1's while step t's update is still in flight."""
    return 1e-2 * (1 + step % 3) / 3


def grads_at(model, params, world, step, micro_range, micro_batches):
    """Per rank: Σ over the given micro-batches of ∇(loss / M), accumulated in order as the rank's fp32 bucket does."""
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    per_rank = []
    for r in range(world):
        acc = [torch.zeros_like(p) for p in model.parameters()]
        for m in micro_range:
            model.zero_grad()
            (loss_fn(model, *batch(r, step, m)) / micro_batches).backward()
            for a, p in zip(acc, model.parameters()):
                a += p.grad
        per_rank.append(acc)
    return per_rank


def rank_sum(per_rank):
    total = per_rank[0]
    for acc in per_rank[1:]:
        total = [t + a for t, a in zip(total, acc)]
    return total


def adamw_step(params, state_opt, grads, max_norm):
    """One AdamW step of ``state_opt`` (over tensors ``params``) on ``grads`` (clipped by their global norm)."""
    for p, g in zip(params, grads):
        p.grad = g.clone()
    if max_norm is not None:  # DistributedOptimizer's documented rule: the fp64 norm, scaled when over max_norm
        norm = torch.stack([p.grad.double().square().sum() for p in params]).sum().sqrt().item()
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
    state_opt.step()


def restated_acco(world, steps, micro_batches, max_norm, warmup=0):
    """ACCO restated from its formulas on one process: returns θ_t after every step. The first ``warmup`` steps are
    plain undelayed steps (both halves at θ_t, no estimate), after which θ̃ = θ."""
    model = make_model()
    theta = [p.detach().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(theta, **ADAM)
    estimate = [t.detach().clone() for t in theta]
    half = micro_batches // 2
    history = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ga = grads_at(model, estimate, world, step, range(half), micro_batches)
        gb = grads_at(model, [t.detach() for t in theta], world, step, range(half, micro_batches), micro_batches)
        if step < warmup:  # one undelayed step on the whole batch; the next step's half A runs at θ_{t+1}
            adamw_step(theta, opt, [g / world for g in rank_sum([[a + b for a, b in zip(ra, rb)]
                                                                 for ra, rb in zip(ga, gb)])], max_norm)
            estimate = [t.detach().clone() for t in theta]
            history.append([t.detach().clone() for t in theta])
            continue
        # estimate on a copy of the parameters and state
        shadow = [t.detach().clone().requires_grad_() for t in theta]
        shadow_opt = torch.optim.AdamW(shadow, **ADAM)
        shadow_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # carries this step's lr
        adamw_step(shadow, shadow_opt, [g / world * (micro_batches / half) for g in rank_sum(ga)], max_norm)
        # the real update on the whole batch (each rank adds its halves, then the ranks are summed)
        both = rank_sum([[a + b for a, b in zip(ra, rb)] for ra, rb in zip(ga, gb)])
        adamw_step(theta, opt, [g / world for g in both], max_norm)
        estimate = [s.detach().clone() for s in shadow]
        history.append([t.detach().clone() for t in theta])
    return history


def run_acco(rank, model, acco, steps, micro_batches, start=0):
    """ACCO's training loop: half A, estimate, half B, step; θ_t recorded inside synchronized()."""
    half = micro_batches // 2
    history = []
    for step in range(start, start + steps):
        for g in acco.param_groups:
            g["lr"] = lr_at(step)
        for m in range(half):
            (loss_fn(model, *batch(rank, step, m)) / micro_batches).backward()
        acco.estimate(micro_batches / half)
        for m in range(half, micro_batches):
            (loss_fn(model, *batch(rank, step, m)) / micro_batches).backward()
        acco.step()
        with acco.synchronized():
            history.append([p.detach().clone() for p in model.parameters()])
    return history


def _exact_body(rank, world, micro_batches, max_norm, warmup=0):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, bucket_size=50, max_grad_norm=max_norm, **ADAM)
    assert len(opt.buckets) > 1
    acco = ACCO(opt, warmup_steps=warmup)
    hist = run_acco(rank, model, acco, 4, micro_batches)
    acco.finish()
    return hist, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("micro,max_norm,warmup", [(2, None, 0), (4, None, 0), (4, 0.05, 0), (2, None, 2)],
                         ids=["m2", "m4", "m4-clip", "m2-warmup2"])
def test_uncompressed_equals_restated_acco_bit_for_bit(micro, max_norm, warmup):
    want = restated_acco(2, 4, micro, max_norm, warmup)
    for hist, final in run_ranks(_exact_body, 2, micro, max_norm, warmup):
        for step, (got, ref) in enumerate(zip(hist, want)):
            for a, b in zip(got, ref):
                assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3g}"
        for a, b in zip(final, want[-1]):
            assert torch.equal(a, b)


def _estimate_is_side_effect_free_body(rank, world):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, grad_codec="int4", error_feedback="loco",
                               bucket_size=60, min_compress_numel=0, **ADAM)
    acco = ACCO(opt)
    run_acco(rank, model, acco, 2, 2)  # state exists: moments, residuals
    with acco.synchronized():
        before = ([m.detach().clone() for m in opt.masters], copy.deepcopy(opt.optimizer.state_dict()),
                  copy.deepcopy(opt.ef.state_dict()))
    loss_fn(model, *batch(rank, 9, 0)).backward()
    acco.estimate(2.0)
    acco._wait()  # the estimate alone has finished
    after = ([m.detach().clone() for m in opt.masters], opt.optimizer.state_dict(), opt.ef.state_dict())
    moved = [not torch.equal(a, b) for a, b in zip(acco._estimate, acco._real)]
    return before, after, moved, opt.step_count


def test_estimate_does_not_advance_committed_state():
    for before, after, moved, steps in run_ranks(_estimate_is_side_effect_free_body, 2):
        assert steps == 2
        for a, b in zip(before[0], after[0]):
            assert torch.equal(a, b)
        for k, st in before[1]["state"].items():
            for name, v in st.items():
                assert torch.equal(v, after[1]["state"][k][name]), name
        assert _tensors_equal(before[2], after[2]), "the estimate changed the error feedback"
        assert any(moved), "the estimate should differ from θ_t"


def _tensors_equal(a, b):
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


COMPRESSED = dict(grad_codec="int4", param_codec="int8", error_feedback="loco", bucket_size=60, min_compress_numel=0)


def _resume_body(rank, world):
    model = make_model()
    acco = ACCO(DistributedOptimizer(model.parameters(), torch.optim.AdamW, **COMPRESSED, **ADAM))
    straight = run_acco(rank, model, acco, 6, 2)
    losses = [loss_fn(model, *batch(rank, 0, 0)).item()]

    model = make_model()
    acco = ACCO(DistributedOptimizer(model.parameters(), torch.optim.AdamW, **COMPRESSED, **ADAM))
    first = run_acco(rank, model, acco, 3, 2)
    with acco.synchronized():
        state = copy.deepcopy(acco.state_dict())
        weights = {k: v.clone() for k, v in model.state_dict().items()}
    model2 = make_model(seed=5)
    model2.load_state_dict(weights)
    acco2 = ACCO(DistributedOptimizer(model2.parameters(), torch.optim.AdamW, **COMPRESSED, **ADAM))
    acco2.load_state_dict(state)
    second = run_acco(rank, model2, acco2, 3, 2, start=3)
    ef_bytes = acco2.opt.ef is not None and len(acco2.opt.ef.state_dict()) > 0
    return straight, first + second, losses, ef_bytes


def test_resume_is_bit_identical_with_error_feedback():
    for straight, resumed, losses, has_ef in run_ranks(_resume_body, 2):
        assert has_ef
        for step, (a, b) in enumerate(zip(straight, resumed)):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"step {step}"


def _compressed_trains_body(rank, world, kw):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, **kw, **ADAM)
    acco = ACCO(opt)
    start = sum(loss_fn(model, *batch(r, s, 0)).item() for r in range(world) for s in range(30))
    run_acco(rank, model, acco, 30, 2)
    acco.finish()
    end = sum(loss_fn(model, *batch(r, s, 0)).item() for r in range(world) for s in range(30))
    keys = sorted(opt.ef.state_dict().get("errors", opt.ef.state_dict())) if opt.ef is not None else []
    return start, end, opt.step_count, keys


def test_compressed_acco_trains_with_error_feedback_per_bucket():
    """A smoke test of the whole loop with codecs (their error bounds are tested in test_comm_collectives.py): the
    training loss over the seen batches falls with int4 + LoCo gradients and int8 parameters by at least half as
    much as without compression, and the real update keeps one error-feedback residual per bucket."""
    (plain_start, plain_end, _, _), = run_ranks(_compressed_trains_body, 2, {})[:1]
    for start, end, steps, keys in run_ranks(_compressed_trains_body, 2, COMPRESSED):
        assert steps == 30
        assert start == plain_start
        assert start - end >= 0.5 * (plain_start - plain_end) > 0, (start, end, plain_end)
        assert any("dp_gradient/b" in str(k) for k in keys), keys


def _checkpoint_without_estimate_body(rank, world):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, **ADAM)
    for step in range(2):
        loss_fn(model, *batch(rank, step)).backward()
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    theta = [p.detach().clone() for p in model.parameters()]
    model2 = make_model(seed=3)
    acco = ACCO(DistributedOptimizer(model2.parameters(), torch.optim.AdamW, **ADAM))
    acco.load_state_dict(state)
    return theta, [p.detach().clone() for p in model2.parameters()]


def test_zero1_checkpoint_resumes_with_estimate_equal_to_parameters():
    for theta, loaded in run_ranks(_checkpoint_without_estimate_body, 2):
        for a, b in zip(theta, loaded):
            assert torch.equal(a, b)


def _errors_body(rank, world):
    msgs = {}
    for name, kw in [("zero2", dict(zero_stage=2)), ("unsharded", dict(shard=False)),
                     ("powersgd", dict(grad_codec={"name": "powersgd", "rank": 1})),
                     ("stochastic", dict(grad_codec={"name": "int4", "rounding": "stochastic", "seed": 3}))]:
        model = make_model()
        try:
            ACCO(DistributedOptimizer(model.parameters(), torch.optim.AdamW, **kw, **ADAM))
        except ValueError as e:
            msgs[name] = str(e)
    model = make_model()
    try:
        ACCO(DistributedOptimizer(model.parameters(), torch.optim.AdamW, **ADAM), warmup_steps=-1)
    except ValueError as e:
        msgs["warmup"] = str(e)
    model = make_model()
    acco = ACCO(DistributedOptimizer(model.parameters(), torch.optim.AdamW, **ADAM))
    for name, call in [("step first", acco.step), ("bad scale", lambda: acco.estimate(0.0))]:
        try:
            call()
        except (RuntimeError, ValueError) as e:
            msgs[name] = str(e)
    loss_fn(model, *batch(rank, 0)).backward()
    acco.estimate(2.0)
    try:
        acco.estimate(2.0)
    except RuntimeError as e:
        msgs["estimate twice"] = str(e)
    try:
        with acco.synchronized():
            pass
    except RuntimeError as e:
        msgs["synchronized mid-step"] = str(e)
    acco._submit(lambda: 1 / 0, "update")  # a failing background job is reported at the next wait
    try:
        acco.step()
    except RuntimeError as e:
        msgs["background"] = str(e)
    return msgs


def test_bad_configurations_and_calls_raise_naming_the_fix():
    for msgs in run_ranks(_errors_body, 2):
        assert "ZeRO-2" in msgs["zero2"]
        assert "shard=False" in msgs["unsharded"]
        assert "PowerSGD" in msgs["powersgd"]
        assert "rounding: nearest" in msgs["stochastic"]
        assert "warmup_steps must be an integer >= 0" in msgs["warmup"]
        assert "estimate()" in msgs["step first"]
        assert "scale must be > 0" in msgs["bad scale"]
        assert "already called" in msgs["estimate twice"]
        assert "between steps" in msgs["synchronized mid-step"]
        assert "background update failed" in msgs["background"] and "division by zero" in msgs["background"]


def restated_dpu(world, steps, warmup=0):
    """DPU restated: θ_{t+1} = AdamW(θ_t, mean G_t(θ_{t-1})), θ_{-1} = θ_0 (step t's gradients are computed while
    θ_t is being made); the first ``warmup`` steps undelayed, θ_{t+1} = AdamW(θ_t, mean G_t(θ_t)) (ZeRO-Offload's
    warm-up)."""
    model = make_model()
    theta = [p.detach().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(theta, **ADAM)
    previous = [t.detach().clone() for t in theta]
    history = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        grads = rank_sum(grads_at(model, previous, world, step, range(2), 2))
        previous = [t.detach().clone() for t in theta]  # θ_t: where the next step's gradients are computed
        adamw_step(theta, opt, [g / world for g in grads], None)
        if step < warmup:  # undelayed: the next step's gradients at θ_{t+1}
            previous = [t.detach().clone() for t in theta]
        history.append([t.detach().clone() for t in theta])
    return history


def _dpu_body(rank, world, warmup=0):
    model = make_model()
    acco = ACCO(DistributedOptimizer(model.parameters(), torch.optim.AdamW, bucket_size=50, **ADAM),
                delay_compensation=False, warmup_steps=warmup)
    history = []
    for step in range(4):
        for g in acco.param_groups:
            g["lr"] = lr_at(step)
        for m in range(2):
            (loss_fn(model, *batch(rank, step, m)) / 2).backward()
        acco.step()
        with acco.synchronized():
            history.append([p.detach().clone() for p in model.parameters()])
    try:
        acco.estimate(2.0)
    except RuntimeError as e:
        message = str(e)
    return history, message


@pytest.mark.parametrize("warmup", [0, 2], ids=["no-warmup", "warmup2"])
def test_dpu_equals_restated_delayed_update_bit_for_bit(warmup):
    want = restated_dpu(2, 4, warmup)
    for hist, message in run_ranks(_dpu_body, 2, warmup):
        for step, (got, ref) in enumerate(zip(hist, want)):
            for a, b in zip(got, ref):
                assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3g}"
        assert "no estimate" in message


def _codec_bound_body(rank, world):
    from codec_bounds import FP32_ULP, reduce_scatter_bound
    from megacomp.compression import make_codec

    codec = make_codec("int8", block_size=16)
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), RecordingAdamW, grad_codec=codec, bucket_size=60,
                               min_compress_numel=0, **ADAM)
    acco = ACCO(opt)
    run_acco(rank, model, acco, 1, 2)  # step 0: both halves at θ_0 (θ̃_0 = θ_0)
    estimate_seen, update_seen = opt.optimizer.seen
    # every rank's half gradients at θ_0, as each rank's bucket accumulated them
    ga = grads_at(make_model(), [p.detach() for p in make_model().parameters()], world, 0, range(1), 2)
    gb = grads_at(make_model(), [p.detach() for p in make_model().parameters()], world, 0, range(1, 2), 2)
    param_index = {id(p): i for i, p in enumerate(model.parameters())}
    worst = []
    for b, est, upd in zip(opt.buckets, estimate_seen, update_seen):
        if not b.compressed:
            continue

        def flat(per_param):
            out = torch.zeros(b.padded)
            for p, o in zip(b.params, b.offsets):
                out[o:o + p.numel()] = per_param[param_index[id(p)]].reshape(-1)
            return out
        start, end = b.shard_range(opt.rank, world)
        real = slice(0, max(0, min(end, b.numel) - start))  # padding carries no gradient
        for got, inputs, scale in ((est, [flat(g) for g in ga], 2.0),
                                   (upd, [flat(a) + flat(c) for a, c in zip(ga, gb)], 1.0)):
            chunks = [x[start:end] for x in inputs]  # each rank encodes the chunk for this rank on its own
            exact = sum(c.double() for c in chunks) * scale / world
            bound = reduce_scatter_bound(codec, chunks).double() * scale / world
            mass = sum(c.double().abs() for c in chunks) * scale / world
            limit = bound * (1 + 8 * FP32_ULP) + 4 * FP32_ULP * mass
            err = (got.double() - exact)[real].abs()
            worst.append(float((err / limit[real].clamp_min(1e-30)).max()))
    return worst


def test_compressed_estimate_and_update_are_within_the_codec_bound():
    """int8 gradients (one scale per 16, no error feedback): the averaged gradient the estimate and the update hand
    to AdamW differs from the exact mean by at most the sum over ranks of the codec's per-element bound on each
    rank's encoded chunk, times the step's scale (estimate: M / |A| = 2) over the world size, plus fp32 round-off."""
    for worst in run_ranks(_codec_bound_body, 2):
        assert worst and max(worst) <= 1.0, worst


def _after_a_group_that_left_a_rank_out(rank, world):
    import torch.distributed as dist

    from megacomp.optimizer.acco import private_group

    dist.new_group([0, 1])  # rank 2 is not in it: the ranks now hold different numbers of groups
    dp = [dist.new_group(r) for r in ([0, 1], [2])]  # each rank's own data-parallel group, of different sizes
    mine = dp[0] if rank < 2 else dp[1]
    clone = private_group(mine)
    t = torch.ones(3)
    dist.all_reduce(t, group=clone)
    model = make_model()
    acco = ACCO(DistributedOptimizer(model.parameters(), torch.optim.AdamW, **ADAM))  # over the world group
    for step in range(2):
        loss_fn(model, *batch(rank, step, 0)).backward()
        acco.estimate(2.0)
        loss_fn(model, *batch(rank, step, 1)).backward()
        acco.step()
    with acco.synchronized():
        params = [p.detach().clone() for p in model.parameters()]
    return t.tolist(), dist.get_world_size(clone), params


def test_acco_builds_its_groups_after_a_group_that_left_a_rank_out():
    """Its private communicators are made by every rank in one order: members agree on their names even when an
    earlier group left some ranks out (only the members making them, the ranks waited under different names)."""
    out = run_ranks(_after_a_group_that_left_a_rank_out, 3, pg_timeout=20.0)
    assert [o[0] for o in out] == [[2.0] * 3, [2.0] * 3, [1.0] * 3]
    assert [o[1] for o in out] == [2, 2, 1]
    for p0, p in zip(out[0][2], out[2][2]):  # the replicas' parameters agree after the steps
        assert torch.equal(p0, p)
