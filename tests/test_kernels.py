"""Fused codec kernels are bit-identical to the eager reference (megacomp.kernels, megacomp/kernels/cpu).

The CPU extension is built on first use; where it cannot be built the dispatch falls back to the
reference, which a test checks. The Triton kernels are tested in test_kernels_triton.py.
"""
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megacomp.kernels as kernels
from megacomp.compression import make_codec, quantize

CPU = kernels.cpu_kernels()
needs_cpu = pytest.mark.skipif(CPU is None, reason="the C++ CPU kernels could not be built on this machine")
NAMES = ["int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"]


def inputs(n, seed, mode):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if mode == "near_zero":
        x = x * 2.0 ** -120  # ~1e-36: scales near the bottom of fp32
    elif mode == "subnormal":
        x = x * 1e-42
    elif mode == "mixture":
        x = torch.where(torch.rand(n, generator=g) < 0.01, x, x * 1e-4)
    elif mode == "non_finite" and n:
        idx = torch.randint(0, n, (max(1, n // 50),), generator=g)
        x[idx] = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(len(idx))[:len(idx)]
    elif mode == "zeros":
        x.zero_()
    return x


def check_identical(codec, x):
    fmt = codec.format
    ref = quantize.encode_scaled_reference(x, fmt, codec.block_size, codec.dual_scale, False, None)
    got = quantize.encode_scaled(x, fmt, codec.block_size, codec.dual_scale, False, None)
    assert torch.equal(got, ref), f"{codec}: encoded bytes differ"
    dec_ref = quantize.decode_scaled_reference(ref, x.numel(), fmt, codec.block_size, codec.dual_scale)
    dec = quantize.decode_scaled(ref, x.numel(), fmt, codec.block_size, codec.dual_scale)
    assert torch.equal(dec.view(torch.int32), dec_ref.view(torch.int32)), f"{codec}: decoded values differ"
    acc0 = torch.randn(x.numel())
    acc = quantize.decode_scaled(ref, x.numel(), fmt, codec.block_size, codec.dual_scale, accumulate_into=acc0.clone())
    assert torch.equal(acc.view(torch.int32), (acc0 + dec_ref).view(torch.int32)), f"{codec}: accumulate differs"


@needs_cpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("block,dual", [(0, False), (128, False), (7, False), (100, False), (32, True), (5, True)])
@pytest.mark.parametrize("mode", ["normal", "near_zero", "subnormal", "mixture", "non_finite", "zeros"])
def test_bit_identical_to_reference(name, block, dual, mode):
    codec = make_codec(name, block_size=block, dual_scale=dual)
    for n in (1, 13, 1000, 40_001):
        check_identical(codec, inputs(n, n + len(mode), mode))


@needs_cpu
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), block=st.sampled_from([0, 1, 3, 8, 64, 256]), dual=st.booleans(),
       n=st.integers(1, 3000), log_mag=st.integers(-40, 38), seed=st.integers(0, 1 << 20))
def test_property_bit_identical(name, block, dual, n, log_mag, seed):
    if dual and block == 0:
        block = 16
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10.0 ** log_mag
    check_identical(make_codec(name, block_size=block, dual_scale=dual), x)


@needs_cpu
def test_collectives_use_the_kernels_and_match_the_reference(monkeypatch):
    """The reduce side (decode + fp32 accumulate) gives the same bits with and without the kernels."""
    codec = make_codec("int4", block_size=64)
    bufs = [codec.encode_flat(inputs(5000, s, "normal")) for s in range(3)]
    fused = codec.decode_flat(bufs[0], 5000).clone()
    for b in bufs[1:]:
        fused = codec.decode_accumulate(b, 5000, fused)
    monkeypatch.setenv("MEGACOMP_KERNELS", "reference")
    plain = codec.decode_flat(bufs[0], 5000).clone()
    for b in bufs[1:]:
        plain = plain + codec.decode_flat(b, 5000)
    assert torch.equal(fused, plain)


def test_reference_can_be_forced_and_build_failures_fall_back(monkeypatch, caplog):
    monkeypatch.setenv("MEGACOMP_KERNELS", "reference")
    assert kernels.cpu_kernels() is None and kernels.backend_name() == "reference"
    monkeypatch.delenv("MEGACOMP_KERNELS")
    monkeypatch.setattr(kernels, "_cpu", None)
    monkeypatch.setattr(kernels, "_cpu_failed", False)
    import megacomp.kernels.cpu.build as build

    def broken():
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(build, "load", broken)
    with caplog.at_level(logging.WARNING, logger="megacomp"):
        assert kernels.cpu_kernels() is None
    assert "using the eager reference" in caplog.text and "no compiler here" in caplog.text
    x = torch.randn(300)
    codec = make_codec("int8")
    assert torch.equal(codec.encode_flat(x), quantize.encode_scaled_reference(x, codec.format, 128, False, False, None))


@needs_cpu
@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_rounding_ties_exhaustive(name, dtype):
    """Every float8 value, the midpoints between neighbours (round-half-even ties) and their fp32
    neighbours one ulp away: the kernel's conversion equals torch's, with a scale of exactly 1."""
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    vals = torch.unique(vals[torch.isfinite(vals)])
    mids = (vals[1:] + vals[:-1]) / 2
    probes = torch.cat([vals, mids, torch.nextafter(mids, torch.full_like(mids, float("inf"))),
                        torch.nextafter(mids, torch.full_like(mids, -float("inf")))])
    fmax = torch.finfo(dtype).max
    x = torch.cat([probes.clamp(-fmax, fmax), torch.tensor([fmax])])  # amax = fmax -> scale 1
    check_identical(make_codec(name, block_size=0), x)


@needs_cpu
@pytest.mark.parametrize("beta", [0.0, 0.8])
@pytest.mark.parametrize("spec", [dict(name="int4", block_size=128), dict(name="int8", block_size=0),
                                  dict(name="fp8_e4m3", block_size=32, dual_scale=True)])
def test_fused_error_feedback_update_matches_reference(beta, spec, monkeypatch):
    """ErrorFeedback.update_encoded (one fused pass per chunk) stores exactly the reference's errors,
    across steps (no error yet, then an error to decay), chunkings and a non-finite step."""
    from megacomp.compression import ErrorFeedback, ErrorFeedbackConfig

    codec = make_codec(spec)
    sizes = [700, 1300]

    def run(reference: bool):
        if reference:
            monkeypatch.setenv("MEGACOMP_KERNELS", "reference")
        else:
            monkeypatch.delenv("MEGACOMP_KERNELS", raising=False)
        ef = ErrorFeedback(ErrorFeedbackConfig(beta=beta, reset_interval=4))
        states = []
        for step in range(6):
            g = inputs(2000, step, "non_finite" if step == 3 else "normal")
            h = ef.compensate("k", g)
            bufs = [codec.encode_flat(h[o:o + s]) for o, s in zip([0, 700], sizes)]
            ef.update_encoded("k", h, codec, bufs, sizes)
            e = ef.error("k")
            states.append(None if e is None else e.clone())
        return states, dict(ef.dropped)

    fused, dropped_f = run(False)
    ref, dropped_r = run(True)
    assert dropped_f == dropped_r == {"k": 1}
    for a, b in zip(fused, ref):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@needs_cpu
@pytest.mark.parametrize("name", ["int8", "int4", "int2", "fp8_e4m3"])
@pytest.mark.parametrize("block,dual", [(0, False), (128, False), (7, False), (32, True), (5, True)])
def test_stochastic_rounding_bit_identical(name, block, dual):
    """Stochastic rounding in the kernels computes the reference's counter-based draws from the call's key
    (one draw from the same generator), so bytes and the generator's state afterwards are identical."""
    fmt = make_codec(name).format
    for n, mode in ((1, "normal"), (1000, "non_finite"), (40_001, "mixture")):
        x = inputs(n, n, mode)
        g_ref, g_k = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        ref = quantize.encode_scaled_reference(x, fmt, block, dual, True, g_ref)
        got = quantize.encode_scaled(x, fmt, block, dual, True, g_k)
        assert torch.equal(got, ref), f"{name}/{block}/{dual} n={n}"
        assert torch.equal(g_ref.get_state(), g_k.get_state())


@needs_cpu
@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_decode_every_code(name, dtype):
    """All 256 float8 codes (NaN and inf codes included) decode to the reference's bits; the kernel computes
    them arithmetically when that equals c10's conversion table (checked once at load)."""
    fmt = make_codec(name).format
    buf = torch.cat([torch.tensor([1.0, 0.5]).view(torch.uint8), torch.arange(256, dtype=torch.uint8)])
    dec = quantize.decode_scaled(buf, 256, fmt, 128, False)
    ref = quantize.decode_scaled_reference(buf, 256, fmt, 128, False)
    assert torch.equal(dec.view(torch.int32), ref.view(torch.int32))
    assert CPU.f8_decode_arithmetic(1 if dtype == torch.float8_e4m3fn else 2) in (True, False)


@needs_cpu
@pytest.mark.parametrize("block", [0, 128, 7, 100, 1])
@pytest.mark.parametrize("mode", ["normal", "near_zero", "subnormal", "mixture", "non_finite", "zeros"])
def test_sign_codec_bit_identical(block, mode):
    """The sign codec: nearest (the reference's mean |x| scale, bits in the kernel), stochastic (the
    reference's counter-based draws), decode and decode-accumulate."""
    codec = make_codec("sign", block_size=block)
    fmt = codec.format
    for n in (1, 13, 1000, 40_001):
        x = inputs(n, n + len(mode), mode)
        check_identical(codec, x)
        g_ref, g_k = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
        ref = quantize.encode_scaled_reference(x, fmt, block, False, True, g_ref)
        assert torch.equal(quantize.encode_scaled(x, fmt, block, False, True, g_k), ref)


@needs_cpu
@pytest.mark.parametrize("name", ["int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("block", [128, 32, 8])
@pytest.mark.parametrize("mode", ["normal", "near_zero", "subnormal", "mixture", "non_finite", "zeros"])
def test_error_feedback_one_pass_bit_identical(name, block, mode):
    """ef_encode_into (h = g + e, encode, e' in one pass) against the reference's three steps: every EF mode,
    stochastic rounding for int codecs, the new error written over e (in place) or elsewhere; the returned
    flag says whether every residual was finite."""
    from megacomp.compression import counter_rng
    from megacomp.compression.error_feedback import blend_error

    fmt = make_codec(name).format
    n = 40_001
    g = inputs(n, 7, mode)
    e0 = inputs(n, 8, "normal") * 0.1
    for mode_ef, beta, has_e in ((0, 0.0, True), (0, 0.0, False), (1, 0.8, False), (2, 0.8, True)):
        for stoch in ((False, True) if fmt.kind == "int" else (False,)):
            for in_place in ((False, True) if has_e else (False,)):
                e = e0.clone() if has_e else None
                key = counter_rng.draw_key(torch.Generator().manual_seed(mode_ef), "cpu") if stoch else None
                h = g.clone() if e is None else g + e
                ref = quantize.encode_scaled_reference(h, fmt, block, False, stoch, None, key=key)
                res = h - quantize.decode_scaled_reference(ref, n, fmt, block, False)
                want = blend_error(e if mode_ef == 2 else None, res, beta)
                out = torch.full_like(ref, 0xAB)
                e_out = e if in_place else torch.empty(n)
                ok = quantize.ef_encode_scaled(g, e, out, e_out, fmt, block, False, beta, key=key)
                case = (mode_ef, beta, has_e, stoch, in_place)
                assert torch.equal(out, ref), case
                assert ok == bool(torch.isfinite(res).all()), case
                if ok:
                    assert torch.equal(e_out.view(torch.int32), want.view(torch.int32)), case


@needs_cpu
def test_error_feedback_one_pass_declines_what_it_does_not_cover():
    """None (nothing written, nothing drawn) for cases the one-pass kernel does not take."""
    fmt = make_codec("int4").format
    g, out, e_out = torch.randn(1000), torch.zeros(600, dtype=torch.uint8), torch.zeros(1000)
    for block, dual, x in ((0, False, g), (128, True, g), (7, False, g), (1000, False, g), (128, False, g.double())):
        assert quantize.ef_encode_scaled(x, None, out, e_out, fmt, block, dual, 0.0) is None
    assert quantize.ef_encode_scaled(g, None, out, e_out, make_codec("sign").format, 128, False, 0.0) is None
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(e_out, torch.zeros_like(e_out))
