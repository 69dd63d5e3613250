"""ZeRO-2 in megacomp.optimizer.DistributedOptimizer (``zero_stage=2``) on real gloo groups, against ZeRO-1.

- One micro-batch per step: bit-identical to ZeRO-1 (DP 2 and 4, several buckets, clipping, int4 + LoCo with an
  int8 parameter all-gather, the hierarchical int8 mode), and the same bytes on the wire.
- Accumulation over micro-batches: bit-identical to ZeRO-1 when every fp32 sum is exact (integer-valued gradients,
  parameters unused in some micro-batches, loss scaling, clipping); on a real model within the derived
  summation-order bound (module docstring of distributed_optimizer.py) at equal parameters, and within the
  existing ZeRO-1 tolerance of single-process AdamW over a training run; M times ZeRO-1's gradient bytes.
- Compressed: int4 + LoCo over micro-batches trains; each error update stays within beta |e| + (1 - beta) x the
  codec's bound (tests/codec_bounds.py); per step the reduced shard equals the exact sum plus the telescoped
  errors (e_start - e_end) / (1 - beta) to fp32 round-off; LoCo's reset counts optimizer steps.
- Non-finite gradients and loss scaling, checkpoints between ZeRO-1 and ZeRO-2 (state_dict and DCP), bad
  configurations (ValueError naming the fix), and the memory invariant: no full-size buffer of a non-deferred
  bucket outlives its backward, at most one reduction in flight.
"""
import contextlib
import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from codec_bounds import FP32_ULP, elementwise_bound
from distributed import run_ranks
from megacomp import comm
from megacomp.compression import ErrorFeedbackConfig, make_codec
from megacomp.optimizer import DistributedOptimizer, DynamicLossScaler, OneBitAdam
from test_optimizer_distributed import RecordingAdamW, batch, loss_fn, make_model, reference_run

U = 2.0 ** -24  # unit round-off of fp32


def gamma(k):
    return k * U / (1 - k * U)


def stage2_invariant(opt):
    """After a backward under ZeRO-2: no full-size buffer of a non-deferred bucket is alive, one reduction at most
    is in flight."""
    assert all(b.grad is None for b in opt.buckets if not b.deferred), [b.grad is not None for b in opt.buckets]
    assert len(opt._in_flight) <= 1


def train(rank, opt, model, steps, micro, start=0):
    hist = []
    for step in range(start, start + steps):
        for m in range(micro):
            with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                (loss_fn(model, *batch(rank, step, m)) / micro).backward()
            if opt.zero_stage == 2:
                stage2_invariant(opt)
        assert opt.step()
        hist.append([p.detach().clone() for p in model.parameters()])
    return hist


# -- one micro-batch: ZeRO-2 is ZeRO-1 bit for bit ---------------------------------------------------
def _same_body(rank, world, stage, micro, kw, hierarchical):
    if hierarchical:
        intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
        kw = dict(kw, hierarchy=(intra, inter))
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, bucket_size=20, lr=1e-2, weight_decay=0.1,
                               zero_stage=stage, **kw)
    assert len(opt.buckets) >= 3
    comm.reset_stats()
    hist = train(rank, opt, model, 4, micro)
    return hist, {k: v.wire_bytes for k, v in comm.stats().items()}


CASES = {"dp2": (2, {}, False), "dp4-clip": (4, dict(max_grad_norm=0.05), False),
         "dp2-int4-loco-qwz": (2, dict(grad_codec="int4", error_feedback="loco", param_codec="int8",
                                       min_compress_numel=0), False),
         "dp4-hierarchical-int8-ef": (4, dict(grad_codec="int8", error_feedback="ef", min_compress_numel=0), True)}


@pytest.mark.parametrize("case", list(CASES))
def test_one_micro_batch_is_zero1_bit_for_bit(case):
    world, kw, hier = CASES[case]
    z1 = run_ranks(_same_body, world, 1, 1, kw, hier)
    z2 = run_ranks(_same_body, world, 2, 1, kw, hier)
    for (h1, w1), (h2, w2) in zip(z1, z2):
        for step, (a, b) in enumerate(zip(h1, h2)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step} differs"
        assert w1 == w2  # the same messages


def test_accumulation_sends_m_times_the_gradient_bytes():
    """The docstring's wire statement: M reduce-scatters per bucket and step instead of one; parameters unchanged."""
    kw = dict(grad_codec="int4", error_feedback="loco", min_compress_numel=0)
    _, w1 = run_ranks(_same_body, 2, 1, 3, kw, False)[0]
    _, w2 = run_ranks(_same_body, 2, 2, 3, kw, False)[0]
    assert w2["dp_gradient"] == 3 * w1["dp_gradient"] and w2["dp_parameter"] == w1["dp_parameter"]


# -- accumulation: exact where the sums are exact ----------------------------------------------------
def _exact_body(rank, world, stage, micro):
    torch.manual_seed(0)
    shapes = [(6, 5), (7,), (4, 9), (3,), (5, 5), (10, 6)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    scaler = DynamicLossScaler(scale=2.0 ** 4, growth_interval=1000)
    opt = DistributedOptimizer(params, torch.optim.AdamW, bucket_size=40, lr=1e-2, weight_decay=0.1,
                               max_grad_norm=20.0, loss_scaler=scaler, zero_stage=stage)
    assert len(opt.buckets) >= 3
    for step in range(5):
        for m in range(micro):
            g = torch.Generator().manual_seed(100 * step + 10 * rank + m)
            # parameter 5 never gets a gradient; the others skip one micro-batch each: partial buckets
            used = [i for i in range(5) if (i + m + step) % micro != 0]
            loss = sum((params[i] * torch.randint(-8, 9, shapes[i], generator=g).float()).sum() for i in used)
            with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                (loss / micro * scaler.scale).backward()
            if stage == 2:
                stage2_invariant(opt)
        assert opt.step()
    return [p.detach().clone() for p in params], opt.last_grad_norm


def test_accumulation_is_exact_when_the_sums_are_exact():
    """Gradients that do not depend on the parameters and are integers / 4: every partial sum over ranks and
    micro-batches is exact in fp32, whatever the order, so ZeRO-2 must give ZeRO-1's parameters bit for bit: each
    micro-batch's gradient enters the shard once, scaled like ZeRO-1's, buckets with some or no gradients
    included."""
    z1 = run_ranks(_exact_body, 4, 1, 4)
    z2 = run_ranks(_exact_body, 4, 2, 4)
    for (p1, n1), (p2, n2) in zip(z1, z2):
        assert all(torch.equal(a, b) for a, b in zip(p1, p2)) and n1 == n2


# -- accumulation on a real model: the summation-order bound -----------------------------------------
def _order_body(rank, world, stage, micro, steps):
    model = make_model()
    params = list(model.parameters())
    opt = DistributedOptimizer(params, RecordingAdamW, bucket_size=50, lr=0.0, zero_stage=stage)  # lr 0: same params
    sums = []
    for step in range(steps):
        acc = [torch.zeros(b.padded, dtype=torch.float64) for b in opt.buckets]
        for m in range(micro):
            loss = loss_fn(model, *batch(rank, step, m)) / micro
            grads = dict(zip(map(id, params), torch.autograd.grad(loss, params, retain_graph=True)))
            for b, a in zip(opt.buckets, acc):
                for p, o in zip(b.params, b.offsets):
                    a[o:o + p.numel()] += grads[id(p)].reshape(-1).double().abs()
            with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                loss.backward()
        for a in acc:
            dist.all_reduce(a)
        sums.append([a[slice(*b.shard_range(opt.rank, opt.world))] for a, b in zip(acc, opt.buckets)])
        assert opt.step()
    return opt.optimizer.seen, sums


def test_accumulation_differs_from_zero1_only_by_summation_order():
    """At equal parameters (lr 0), each step's averaged gradient of ZeRO-2 is within 2 gamma(NM - 1) sum|g| / N of
    ZeRO-1's: two summation orders of the same N M fp32 terms (N = 4, M = 3; the / N is exact)."""
    world, micro = 4, 3
    z1 = run_ranks(_order_body, world, 1, micro, 3)
    z2 = run_ranks(_order_body, world, 2, micro, 3)
    for (seen1, sums), (seen2, _) in zip(z1, z2):
        for s1, s2, ss in zip(seen1, seen2, sums):
            for a, b, s in zip(s1, s2, ss):
                bound = 2 * gamma(world * micro - 1) * s / world
                assert ((a.double() - b.double()).abs() <= bound).all()


def _trajectory_body(rank, world, micro, max_norm):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, bucket_size=50, lr=1e-2, weight_decay=0.1,
                               max_grad_norm=max_norm, zero_stage=2)
    return train(rank, opt, model, 4, micro)


@pytest.mark.parametrize("world,micro,max_norm", [(3, 2, None), (4, 3, 0.05)], ids=["dp3-accum2", "dp4-accum3-clip"])
def test_accumulation_trains_like_single_process_adamw(world, micro, max_norm):
    """Over a training run, the same tolerance as ZeRO-1's test against single-process AdamW on the averaged
    gradients (tests/test_optimizer_distributed.py)."""
    ref = reference_run(world, 4, micro, max_norm, lr=1e-2, weight_decay=0.1)
    for hist in run_ranks(_trajectory_body, world, micro, max_norm):
        for step, (got, want) in enumerate(zip(hist, ref)):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")


# -- compressed: int4 + LoCo over micro-batches ------------------------------------------------------
def _loco_body(rank, world, micro, steps):
    codec = make_codec("int4", block_size=32)
    model = make_model()
    params = list(model.parameters())
    opt = DistributedOptimizer(params, RecordingAdamW, grad_codec=codec, error_feedback="loco", min_compress_numel=0,
                               bucket_size=50, lr=1e-2, zero_stage=2)
    beta = opt.ef.config.beta
    comp = [b for b in opt.buckets if b.compressed]
    assert comp and beta == 0.8

    def err(b):
        e = opt.ef.error(f"dp_gradient/b{b.index}/worker")
        return torch.zeros(b.padded) if e is None else e.clone()

    losses, update_ok, identity = [], True, []
    for step in range(steps):
        e_start = {b.index: err(b) for b in comp}
        exact = {b.index: torch.zeros(b.padded, dtype=torch.float64) for b in comp}
        mass = {b.index: torch.zeros(b.padded, dtype=torch.float64) for b in comp}  # sum of |g|, |e|, |h|, bound
        step_loss = 0.0
        for m in range(micro):
            loss = loss_fn(model, *batch(rank, 0, m)) / micro  # the same batches every step: the loss must fall
            grads = dict(zip(map(id, params), torch.autograd.grad(loss, params, retain_graph=True)))
            before = {b.index: err(b) for b in comp}
            with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                loss.backward()  # launches every bucket: a compressed reduce-scatter encodes and updates e now
            stage2_invariant(opt)
            step_loss += loss.item()
            for b in comp:
                g = torch.zeros(b.padded)
                for p, o in zip(b.params, b.offsets):
                    g[o:o + p.numel()] = grads[id(p)].reshape(-1)
                h = g + before[b.index]  # what the encoder compensates: h = g + e, in fp32
                n = b.padded // world  # each destination's chunk is encoded on its own (its own scale blocks)
                bound = torch.cat([elementwise_bound(codec, h[j * n:(j + 1) * n]) for j in range(world)])
                after = err(b).double()
                limit = (beta * before[b.index].double().abs() + (1 - beta) * bound) * (1 + 8 * FP32_ULP)
                update_ok &= bool((after.abs() <= limit).all())
                exact[b.index] += g.double()
                mass[b.index] += g.double().abs() + before[b.index].double().abs() + h.double().abs() + bound
        assert opt.step()
        losses.append(step_loss)
        for b, shard in zip(opt.buckets, opt.optimizer.seen[-1]):
            if not b.compressed:
                continue
            start, end = b.shard_range(opt.rank, opt.world)
            tele = (e_start[b.index] - err(b)).double()  # this rank's (e_start - e_end)
            for t in (exact[b.index], tele, mass[b.index]):
                dist.all_reduce(t)
            real = slice(0, max(0, min(end, b.numel) - start))  # padding is zeroed by step()
            got = shard.double()[real] * world
            want = (exact[b.index] + tele / (1 - beta))[start:end][real]
            # fp32 round-off: the decoded sums over N ranks and M micro-batches (|decoded| <= |h| + bound) and the
            # compensation / error arithmetic of each update, amplified by 1 / (1 - beta) through the telescope
            slack = (gamma(world * micro) + 8 * U / (1 - beta)) * mass[b.index][start:end][real]
            identity.append(float(((got - want).abs() - slack).max()))
    return losses, update_ok, identity


def test_int4_loco_over_micro_batches_trains_within_the_codec_bound():
    for losses, update_ok, identity in run_ranks(_loco_body, 2, 3, 25):
        assert update_ok  # |e'| <= beta |e| + (1 - beta) bound(h), every update of every bucket
        assert max(identity) <= 0, identity  # shard = exact + sum_r (e_start - e_end) / (1 - beta)
        assert losses[-1] < 0.7 * losses[0]


def _reset_body(rank, world, stage, micro):
    ef = ErrorFeedbackConfig(beta=0.8, reset_interval=2)
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, grad_codec="int4", error_feedback=ef,
                               min_compress_numel=0, bucket_size=50, lr=1e-2, zero_stage=stage)
    out = []
    for step in range(4):
        train(rank, opt, model, 1, micro, start=step)
        out.append({k: (opt.ef.steps[k], bool(opt.ef.error(k).abs().max() > 0)) for k in opt.ef.keys()})
    return out


def test_loco_reset_counts_optimizer_steps_not_reductions():
    """Three reductions per bucket and step: the count advances once per step, and the error is zero after steps 2
    and 4 (reset_interval 2) as under ZeRO-1, not after every second reduction."""
    z1 = run_ranks(_reset_body, 2, 1, 3)[0]
    z2 = run_ranks(_reset_body, 2, 2, 3)[0]
    for s, (a, b) in enumerate(zip(z1, z2), start=1):
        assert a.keys() == b.keys() and a
        assert all(count == s and nonzero == (s % 2 == 1) for count, nonzero in b.values()), (s, b)
        assert [c for c, _ in a.values()] == [c for c, _ in b.values()]


# -- overflow, loss scaling ---------------------------------------------------------------------------
def _overflow_body(rank, world):
    scaler = DynamicLossScaler(scale=2.0 ** 10, growth_interval=2)
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, loss_scaler=scaler, grad_codec="int8",
                               error_feedback="ef", min_compress_numel=0, bucket_size=50, lr=0.1, zero_stage=2)

    def step(s, nan_micro=None):
        for m in range(2):
            x, y = batch(rank, s, m)
            if rank == 1 and m == nan_micro:
                x[0, 0] = float("nan")
            (loss_fn(model, x, y) / 2 * scaler.scale).backward()
            stage2_invariant(opt)
        return opt.step()

    assert step(0)
    before = [p.detach().clone() for p in model.parameters()]
    assert step(1, nan_micro=1) is False and opt.skipped_steps == 1 and scaler.scale == 2.0 ** 9
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # every rank skipped
    assert not list(opt.ef.keys())  # the residuals of the discarded gradients are gone
    assert all(b.reduced is None and b.grad is None for b in opt.buckets)
    assert step(2) and all(torch.isfinite(p).all() for p in model.parameters())
    return True


def test_non_finite_micro_batch_skips_the_step_everywhere():
    assert all(run_ranks(_overflow_body, 2))


# -- checkpoints --------------------------------------------------------------------------------------
def _ckpt_body(rank, world, save_stage, load_stages, micro):
    import torch.distributed.checkpoint as dcp

    kw = dict(grad_codec="int4", param_codec="int8", error_feedback="loco", bucket_size=60, min_compress_numel=0,
              lr=1e-2)
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, zero_stage=save_stage, **kw)
    train(rank, opt, model, 3, micro)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict()
    holder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(holder)
    dcp.save({"optim": saved}, checkpoint_id=holder[0])
    full = train(rank, opt, model, 3, micro, start=3)[-1]
    out = {}
    for stage in load_stages:
        for way in ("state_dict", "dcp"):
            fresh = make_model(seed=7)  # a different init: everything must come from the checkpoint
            fresh.load_state_dict(saved_model)
            opt2 = DistributedOptimizer(fresh.parameters(), torch.optim.AdamW, zero_stage=stage,
                                        check_replicated=False, **kw)
            if way == "dcp":
                opt2.init_state()
                template = {"optim": opt2.state_dict()}
                dcp.load(template, checkpoint_id=holder[0])
                opt2.load_state_dict(template["optim"])
            else:  # a copy: torch optimizers adopt the loaded moments' tensors, and this dict is loaded twice
                opt2.load_state_dict(copy.deepcopy(saved))
            got = train(rank, opt2, fresh, 3, micro, start=3)[-1]
            out[(stage, way)] = (all(torch.equal(a, b) for a, b in zip(full, got)), dict(opt2.ef.steps))
    return out, dict(opt.ef.steps)


def test_checkpoints_move_between_zero1_and_zero2():
    """One micro-batch: a ZeRO-1 checkpoint continued by ZeRO-2 (and the reverse) gives the uninterrupted run's
    parameters bit for bit. Three micro-batches: a ZeRO-2 checkpoint resumes ZeRO-2 bit for bit and loads into
    ZeRO-1 (the same state: masters, AdamW moments, LoCo residuals and their step counts)."""
    for out, _ in run_ranks(_ckpt_body, 2, 1, (1, 2), 1):
        assert all(same for same, _ in out.values()), out
    for out, steps in run_ranks(_ckpt_body, 2, 2, (1, 2), 3):
        assert out[(2, "state_dict")][0] and out[(2, "dcp")][0]
        assert all(s == steps for _, s in out.values()) and set(steps.values()) == {6}  # one count per step


# -- bad configurations and the deferred path -------------------------------------------------------------
def _refusals_body(rank, world):
    params = lambda: make_model().parameters()  # noqa: E731
    cases = [(dict(zero_stage=3), "zero_stage must be 1"), (dict(zero_stage=2, shard=False), "drop shard=False"),
             (dict(zero_stage=2, grad_codec="powersgd"), "use zero_stage=1"),
             (dict(zero_stage=2, grad_codec={"name": "accordion", "low": "int8", "high": "int4"}), "use zero_stage=1")]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            DistributedOptimizer(params(), torch.optim.AdamW, **kw)
    with pytest.raises(ValueError, match="use zero_stage=1"):
        OneBitAdam(params(), zero_stage=2)
    # main_grad: whole for deferred parameters, refused for the others (their full gradient is gone)
    model = make_model()
    last = model[4].weight
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, deferred_params=[last], zero_stage=2, lr=0.1)
    x, y = batch(rank, 0)
    want = torch.autograd.grad(loss_fn(model, x, y), [last])[0]
    for m in range(2):  # accumulated over two backwards (no no_sync needed)
        (loss_fn(model, x, y) / 2).backward()
        stage2_invariant(opt)
    torch.testing.assert_close(opt.main_grad(last), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="deferred_params"):
        opt.main_grad(model[0].weight)
    assert opt.step()
    return True


def test_bad_configurations_are_refused_and_deferred_params_stay_whole():
    assert all(run_ranks(_refusals_body, 2))
