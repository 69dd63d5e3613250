"""Error feedback: the LoCo identity, telescoping of classic EF, reset, storage, checkpointing, failures
(megacomp.compression.error_feedback)."""
import pytest
import torch

from megacomp.compression import ErrorFeedback, ErrorFeedbackConfig, make_codec, make_error_feedback_config


def run(ef, codec, grads, key="g"):
    """Drive ``ef`` through ``grads``; return the transmitted (decoded) values and the errors after each step."""
    sent, errors = [], []
    for g in grads:
        h = ef.compensate(key, g)
        h_hat = codec.roundtrip(h)
        ef.update(key, h, h_hat)
        sent.append(h_hat)
        errors.append(ef.error(key))
    return sent, errors


def grads(steps=20, n=1000, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=dtype) for _ in range(steps)]


def test_loco_identity_exact_in_fp64():
    beta = 0.8
    codec = make_codec("int4", block_size=64)
    ef = ErrorFeedback(ErrorFeedbackConfig(beta=beta))
    e = torch.zeros(1000, dtype=torch.float64)
    for g in grads():
        h = ef.compensate("g", g)
        assert torch.equal(h, g + e)
        h_hat = codec.roundtrip(h)
        ef.update("g", h, h_hat)
        e = beta * e + (1 - beta) * (h - h_hat)
        assert torch.equal(ef.error("g"), e)


def test_loco_reference_form_agrees():
    """LoCo's code writes e += (1-beta)(g - h_hat) with h_hat = Q(g + e); equal up to fp64 round-off."""
    beta, codec = 0.9, make_codec("int4", block_size=0)
    ef = ErrorFeedback(ErrorFeedbackConfig(beta=beta))
    e = torch.zeros(1000, dtype=torch.float64)
    for g in grads():
        h = ef.compensate("g", g)
        h_hat = codec.roundtrip(h)
        ef.update("g", h, h_hat)
        e = e + (1 - beta) * (g - h_hat)
        assert torch.allclose(ef.error("g"), e, rtol=0, atol=1e-12)


def test_classic_ef_telescopes():
    """beta = 0: sum of transmitted values + final residual == sum of inputs (fp64 round-off)."""
    codec = make_codec("int2", block_size=32)
    ef = ErrorFeedback("ef")
    gs = grads(steps=50)
    sent, errors = run(ef, codec, gs)
    total_in = torch.stack(gs).sum(0)
    assert torch.allclose(torch.stack(sent).sum(0) + errors[-1], total_in, rtol=0, atol=1e-10)
    # and the time-averaged transmitted value converges to the mean input, unlike plain int2
    plain = torch.stack([codec.roundtrip(g) for g in gs]).sum(0)
    assert (torch.stack(sent).sum(0) - total_in).norm() < 0.2 * (plain - total_in).norm()


def test_reset_interval_zeroes_the_error():
    codec = make_codec("int4")
    ef = ErrorFeedback(ErrorFeedbackConfig(beta=0.8, reset_interval=5))
    _, errors = run(ef, codec, grads(steps=12))
    for step, e in enumerate(errors, start=1):
        assert (e.abs().sum() == 0) == (step % 5 == 0), step
    assert make_error_feedback_config("loco") == ErrorFeedbackConfig(beta=0.8, reset_interval=512)


def test_deferred_count_counts_a_block_of_updates_once():
    """ZeRO-2's several messages per optimizer step: updates inside deferred_count() keep their LoCo arithmetic (the
    same errors as counted updates) but advance the key's count once, at count_deferred(), where the periodic reset
    then applies: with 3 messages per step and reset_interval 2, the error is zero after steps 2 and 4."""
    codec = make_codec("int4")
    cfg = ErrorFeedbackConfig(beta=0.8, reset_interval=2)
    ef, ref = ErrorFeedback(cfg), ErrorFeedback(ErrorFeedbackConfig(beta=0.8))
    gs = grads(steps=12)
    for step in range(4):
        with ef.deferred_count():
            with ef.deferred_count():  # nested blocks are one block
                run(ef, codec, gs[3 * step:3 * step + 2])
            run(ef, codec, gs[3 * step + 2:3 * step + 3])
            assert ef.steps.get("g", 0) == step  # nothing counted inside
        _, want = run(ref, codec, gs[3 * step:3 * step + 3])
        assert torch.equal(ef.error("g"), want[-1])  # the errors before the count: the unreset arithmetic
        ef.count_deferred()
        assert ef.steps["g"] == step + 1
        assert (ef.error("g").abs().sum() == 0) == (step % 2 == 1), step
        if step % 2 == 1:
            ref.reset("g")  # the reference restarts from zero where the counted state reset
    ef.count_deferred()  # nothing deferred since: no count
    assert ef.steps["g"] == 4


@pytest.mark.parametrize("storage", ["fp32", "bf16", "int8"])
def test_storage_precision(storage):
    """Stored errors differ from the exact fp64 error by at most the storage format's rounding."""
    codec = make_codec("int4", block_size=0)
    ef = ErrorFeedback(ErrorFeedbackConfig(beta=0.0, storage=storage, storage_block_size=128))
    g = torch.randn(1000)
    h = ef.compensate("g", g)
    h_hat = codec.roundtrip(h)
    ef.update("g", h, h_hat)
    exact = (h - h_hat).double()
    stored = ef.error("g").double()
    if storage == "fp32":
        assert torch.equal(stored, exact)
    elif storage == "bf16":
        assert ((stored - exact).abs() <= exact.abs() * 2 ** -8).all()
    else:  # int8 per-block absmax: half a step of amax/127 per block of 128
        amax = torch.cat([exact, exact.new_zeros((-1000) % 128)]).view(-1, 128).abs().amax(1)
        step = amax.repeat_interleave(128)[:1000] / 127
        assert ((stored - exact).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()


def test_state_dict_round_trip_and_resume_bit_identical():
    codec = make_codec("int4", block_size=32)
    for storage in ("fp32", "int8"):
        cfg = ErrorFeedbackConfig(beta=0.9, reset_interval=7, storage=storage)
        gs = grads(steps=12, dtype=torch.float32)
        full = ErrorFeedback(cfg)
        sent_full, _ = run(full, codec, gs)
        first = ErrorFeedback(cfg)
        run(first, codec, gs[:5])
        state = first.state_dict()
        resumed = ErrorFeedback(cfg)
        resumed.load_state_dict(state)
        sent_rest, _ = run(resumed, codec, gs[5:])
        for a, b in zip(sent_full[5:], sent_rest):
            assert torch.equal(a, b)
        assert resumed.steps == full.steps
    with pytest.raises(ValueError, match="saved with"):
        ErrorFeedback("ef").load_state_dict(ErrorFeedback("loco").state_dict())


def test_non_finite_residual_drops_error_and_rescale():
    codec = make_codec("int8")
    ef = ErrorFeedback("ef")
    g = torch.randn(100)
    run(ef, codec, [g])
    bad = g.clone()
    bad[3] = float("inf")
    h = ef.compensate("g", bad)
    ef.update("g", h, codec.roundtrip(h))
    assert ef.dropped["g"] == 1 and torch.equal(ef.error("g"), torch.zeros(100))
    run(ef, codec, [g])
    before = ef.error("g")
    ef.rescale(0.5)
    assert torch.equal(ef.error("g"), before * 0.5)
    ef.reset()
    assert ef.error("g") is None


def test_errors_are_clear():
    ef = ErrorFeedback("ef")
    run(ef, make_codec("int8"), [torch.randn(10)])
    with pytest.raises(ValueError, match="distinct key"):
        ef.compensate("g", torch.randn(11))
    with pytest.raises(ValueError, match="beta must be in"):
        ErrorFeedbackConfig(beta=1.0)
    with pytest.raises(ValueError, match="unknown error feedback"):
        ErrorFeedback("lolo")
    with pytest.raises(ValueError, match="storage must be one of"):
        ErrorFeedbackConfig(storage="fp8")
    assert ErrorFeedback({"preset": "loco", "beta": 0.9}).config == ErrorFeedbackConfig(beta=0.9, reset_interval=512)
