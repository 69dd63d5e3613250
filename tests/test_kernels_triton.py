"""Triton codec kernels are bit-identical to the eager reference (megacomp/kernels/triton).

Without a GPU the kernels run under triton's interpreter (``codec_triton.interpreted()``, TRITON_INTERPRET
semantics) on tiny CPU tensors (~1 MB/s) and are compared with the reference on CPU; the tests on CUDA
compare the compiled kernels with the reference on the GPU. The dispatch and import-guard tests run
everywhere.
"""
import importlib.util
import itertools
import logging
import sys

import pytest
import torch

import megacomp.kernels as kernels
from megacomp.compression import counter_rng, make_codec, quantize
from megacomp.kernels.triton import codec_triton as ct

needs_triton = pytest.mark.skipif(not ct.HAVE_TRITON, reason=f"triton is not installed ({ct.IMPORT_ERROR}); "
                                  "`pip install triton` or `bash scripts/install.sh test`")
needs_cuda = pytest.mark.skipif(not (ct.HAVE_TRITON and torch.cuda.is_available()),
                                reason="compiled Triton kernels need a CUDA GPU and triton (none here)")
quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf/NaN arithmetic inside the interpreter
NAMES = ["int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"]
CONFIGS = [(0, False), (128, False), (7, False), (100, False), (32, True), (5, True)]


def kind(fmt):
    return quantize._kind_code(fmt)


def mixed(n, seed, dtype=torch.float32):
    """Blocks of different regimes in one tensor: normal, ~1e-36, subnormal, zeros, non-finite."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    q = max(1, n // 6)
    x[q:2 * q] *= 2.0 ** -120
    x[2 * q:3 * q] *= 1e-42
    x[3 * q:4 * q] = 0.0
    if n > 8:
        x[5 * q] = float("nan")
        x[5 * q + 1] = float("inf")
        x[-1] = -float("inf")
    return x.to(dtype)


def same_bits(a, b):
    """Bitwise equal; for half outputs NaN payloads are not compared (the interpreter's fp32 -> bf16/fp16
    rounding and torch's CPU one pick different NaN bits; on a GPU both are the hardware conversion)."""
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


def check(T, name, block, dual, x, out_dtype=torch.float32):
    fmt = make_codec(name).format
    n = x.numel()
    ref = quantize.encode_scaled_reference(x.float(), fmt, block, dual, False, None)
    got = torch.full_like(ref, 0xAB)
    T.encode_into(x, got, kind(fmt), fmt.bits, fmt.qmax, block, dual)
    assert torch.equal(got, ref), f"{name}/{block}/{dual}/{x.dtype} n={n}: encoded bytes differ"
    dref = quantize.decode_scaled_reference(ref, n, fmt, block, dual)
    dec = torch.empty(n, dtype=out_dtype)
    T.decode_into(ref, dec, kind(fmt), fmt.bits, block, dual, False)
    assert same_bits(dec, dref.to(out_dtype)), f"{name}/{block}/{dual}: decoded values differ"
    acc0 = torch.randn(n)
    acc = acc0.clone()
    T.decode_into(ref, acc, kind(fmt), fmt.bits, block, dual, True)
    assert torch.equal(acc.view(torch.int32), (acc0 + dref).view(torch.int32)), f"{name}/{block}/{dual}: accumulate"


@pytest.fixture(scope="module")
def T():
    return ct.interpreted()


@needs_triton
@quiet
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("block,dual", CONFIGS)
def test_interpreted_bit_identical(T, name, block, dual):
    dtype = [torch.float32, torch.bfloat16, torch.float16][(NAMES.index(name) + CONFIGS.index((block, dual))) % 3]
    for n, seed in ((1, 1), (13, 2), (301, 3)):
        x = mixed(n, seed)
        check(T, name, block, dual, x)
        if block == 0 and n > 8:  # one scale: a NaN would make every element NaN, so also finite inputs
            check(T, name, block, dual, torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    check(T, name, block, dual, mixed(301, 4).to(dtype), out_dtype=dtype)  # half inputs and half outputs


@needs_triton
@quiet
@pytest.mark.parametrize("name", ["int4", "int2", "fp8_e4m3"])
def test_interpreted_large_block_paths(T, name, monkeypatch):
    """Small tile limits send the same inputs through the block-maximum segments and the flat passes
    (one scale per tensor, big blocks, dual scaling without the row kernel)."""
    for attr, v in (("ROW_MAX", 32), ("TILE", 128), ("SEG", 64), ("SEG_TILE", 32)):
        monkeypatch.setattr(ct, attr, v)
    for block, dual in ((0, False), (100, False), (64, True), (36, False)):
        check(T, name, block, dual, mixed(301, block))
    check(T, name, 0, False, torch.randn(299, generator=torch.Generator().manual_seed(9)))


@needs_triton
@quiet
@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_interpreted_fp8_ties_exhaustive(T, name, dtype):
    """Every float8 value, the midpoints between neighbours (ties) and their fp32 neighbours, scale 1."""
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    vals = torch.unique(vals[torch.isfinite(vals)])
    mids = (vals[1:] + vals[:-1]) / 2
    inf = torch.full_like(mids, float("inf"))
    probes = torch.cat([vals, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf)])
    fmax = torch.finfo(dtype).max
    check(T, name, 0, False, torch.cat([probes.clamp(-fmax, fmax), torch.tensor([fmax])]))


@needs_triton
@quiet
@pytest.mark.parametrize("bits_name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("block,dual", [(0, False), (64, False), (7, False), (16, True)])
def test_interpreted_stochastic_rounding(T, bits_name, block, dual):
    """Stochastic rounding computes the reference's counter-based draws from the call's key in the kernel,
    so the bytes are identical."""
    fmt = make_codec(bits_name).format
    x = mixed(203, 11)
    key = counter_rng.draw_key(torch.Generator().manual_seed(5), "cpu")
    ref = quantize.encode_scaled_reference(x, fmt, block, dual, True, None, key=key)
    got = torch.empty_like(ref)
    T.encode_into(x, got, 0, fmt.bits, fmt.qmax, block, dual, key=key)
    assert torch.equal(got, ref)


@needs_triton
@quiet
@pytest.mark.parametrize("name,block,dual", [("int4", 64, False), ("int8", 0, False), ("fp8_e4m3", 32, True),
                                             ("int2", 7, False)])
def test_interpreted_error_feedback_update(T, name, block, dual):
    """e' = h - d, (1-beta)(h - d), beta e + (1-beta)(h - d) with the reference's expressions; the flag says
    whether every residual was finite."""
    fmt = make_codec(name).format
    h = mixed(300, 21)  # NaN and inf at the end
    e = torch.randn(300)
    for x, finite in ((h[:130].clone(), True), (h, False)):
        buf = quantize.encode_scaled_reference(x, fmt, block, dual, False, None)
        res = x - quantize.decode_scaled_reference(buf, x.numel(), fmt, block, dual)
        for mode, beta, want in ((0, 0.0, res), (1, 0.8, (1.0 - 0.8) * res),
                                 (2, 0.8, 0.8 * e[:x.numel()] + (1.0 - 0.8) * res)):
            out = torch.empty_like(x)
            ok = T.ef_update_into(buf, x, e[:x.numel()], out, kind(fmt), fmt.bits, block, dual, beta, mode)
            assert ok == finite
            if finite:
                assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (mode, beta)


@needs_triton
@quiet
@pytest.mark.parametrize("name,block", [("int4", 64), ("int8", 16), ("int2", 32), ("fp8_e4m3", 16), ("fp8_e5m2", 64)])
def test_interpreted_error_feedback_one_pass(T, name, block):
    """ef_encode_into: the bytes of encode(g + e) and the new error of the three reference steps, for each
    mode, with and without stochastic rounding, with the new error written over e (in place) or elsewhere."""
    from megacomp.compression.error_feedback import blend_error

    fmt = make_codec(name).format
    for n, finite in ((130, True), (300, False)):  # mixed(300) has NaN and inf from element 250
        g = mixed(300, 22)[:n].clone()
        e0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
        for (mode, beta, has_e), stoch, in_place in itertools.product(
                ((0, 0.0, True), (0, 0.0, False), (1, 0.8, False), (2, 0.8, True)),
                (False, True) if fmt.kind == "int" else (False,), (False, True)):
            e = e0.clone() if has_e else None
            key = counter_rng.draw_key(torch.Generator().manual_seed(mode), "cpu") if stoch else None
            h = g.clone() if e is None else g + e
            ref = quantize.encode_scaled_reference(h, fmt, block, False, stoch, None, key=key)
            want = blend_error(e if mode == 2 else None,
                               h - quantize.decode_scaled_reference(ref, n, fmt, block, False), beta)
            out = torch.full_like(ref, 0xAB)
            e_out = e if (in_place and e is not None) else torch.empty(n)
            ok = T.ef_encode_into(g, e, out, e_out, kind(fmt), fmt.bits, fmt.qmax, block, beta, mode, key=key)
            case = (n, mode, beta, has_e, stoch, in_place)
            assert torch.equal(out, ref), case
            assert ok == finite, case
            if finite:
                assert torch.equal(e_out.view(torch.int32), want.view(torch.int32)), case


def test_triton_error_feedback_one_pass_refuses_what_it_does_not_cover():
    t = ct.TritonCodecs(None, True)
    assert not t.ef_encode_covers(100, 0, 4, 0) and not t.ef_encode_covers(100, 0, 4, 100)
    assert not t.ef_encode_covers(100, 0, 4, 7) and t.ef_encode_covers(100, 0, 4, 8)
    with pytest.raises(ct.Unsupported, match="ef encode"):
        t.ef_encode_into(torch.zeros(100), None, torch.zeros(1, dtype=torch.uint8), torch.zeros(100), 0, 4, 7.0, 100,
                         0.0, 0)


@needs_triton
@quiet
def test_interpreted_cuda_scale_rule(T):
    """With RECIP (CUDA tensors) the per-block scale is amax * fp32(1/qmax), torch's CUDA division by a
    CPU scalar; checked on CPU against that expression."""
    fmt = make_codec("int4").format
    x = torch.randn(256, generator=torch.Generator().manual_seed(3)) * 3.7
    out = torch.empty(quantize.scale_nbytes(256, 64, False) + 128, dtype=torch.uint8)
    orig = T._recip
    T._recip = lambda device: True
    try:
        T.encode_into(x, out, 0, 4, fmt.qmax, 64, False)
    finally:
        T._recip = orig
    inv = torch.tensor(1.0) / torch.tensor(fmt.qmax)
    want = x.view(4, 64).abs().amax(dim=1) * inv
    assert torch.equal(out[:16].view(torch.float32), want)

def check_sign(T, block, x):
    fmt = make_codec("sign").format
    n = x.numel()
    ref = quantize.encode_scaled_reference(x.float(), fmt, block, False, False, None)
    got = torch.full_like(ref, 0xAB)
    T.sign_encode_into(x, got, block)
    assert torch.equal(got, ref), f"sign/{block}/{x.dtype} n={n}: encoded bytes differ"
    key = counter_rng.draw_key(torch.Generator().manual_seed(n + block), "cpu")
    sref = quantize.encode_scaled_reference(x.float(), fmt, block, False, True, None, key=key)
    got = torch.full_like(sref, 0xAB)
    T.sign_encode_into(x, got, block, key=key)
    assert torch.equal(got, sref), f"sign/{block}/{x.dtype} n={n}: stochastic bytes differ"
    dref = quantize.decode_scaled_reference(ref, n, fmt, block, False)
    dec = torch.empty(n)
    T.sign_decode_into(ref, dec, block, False)
    assert same_bits(dec, dref), f"sign/{block}: decoded values differ"
    acc0 = torch.randn(n)
    acc = acc0.clone()
    T.sign_decode_into(ref, acc, block, True)
    assert torch.equal(acc.view(torch.int32), (acc0 + dref).view(torch.int32)), f"sign/{block}: accumulate"


@needs_triton
@quiet
@pytest.mark.parametrize("block", [0, 128, 16, 8, 7, 100])
def test_interpreted_sign_bit_identical(T, block):
    """The sign codec: the one-pass row kernel (blocks of a multiple of 8), the segment sums with fused
    bits (one block), and the separate bit pass (blocks off byte boundaries); the exact integer sums give
    the reference's scale whatever the order. Magnitudes over 60 binades make float sums order-dependent."""
    for i, (n, seed) in enumerate(((1, 1), (13, 2), (301, 3), (1000, 4))):
        x = mixed(n, seed)
        check_sign(T, block, x)
        g = torch.Generator().manual_seed(seed)
        wide = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 1, (n,), generator=g).float())
        check_sign(T, block, wide.to([torch.float32, torch.bfloat16, torch.float16][i % 3]))


@needs_triton
@quiet
def test_interpreted_sign_segment_paths(T, monkeypatch):
    """Small tile limits send big and unaligned blocks through the segments (several per block)."""
    for attr, v in (("ROW_MAX", 32), ("TILE", 128), ("SEG", 64), ("SEG_TILE", 32)):
        monkeypatch.setattr(ct, attr, v)
    for block in (0, 96, 100, 36):
        check_sign(T, block, mixed(301, block))
    check_sign(T, 0, torch.randn(299, generator=torch.Generator().manual_seed(9)))


def test_stochastic_key_must_be_one_int64_on_the_device():
    """A key the kernels cannot read is refused as Unsupported (the dispatch then runs the reference)."""
    t = ct.TritonCodecs(None, True)
    for bad in (torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)):
        with pytest.raises(ct.Unsupported, match="key"):
            t.sign_encode_into(torch.zeros(8), torch.zeros(5, dtype=torch.uint8), 8, key=bad)
        with pytest.raises(ct.Unsupported, match="key"):
            t.encode_into(torch.zeros(8), torch.zeros(8, dtype=torch.uint8), 0, 4, 7.0, 8, False, key=bad)


def _compile_sm90(fn, sig, const):
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {name: sig.get(name, "constexpr") for name in fn.arg_names}
    div16 = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in sig if k in ("n", "B") or k.endswith("_ptr")}
    src = ASTSource(fn, full, constexprs=const, attrs=div16)
    return triton_compile(src, target=GPUTarget("cuda", 90, 32), options=dict(ct.TritonCodecs(None, False).opts))


@needs_triton
def test_kernels_compile_for_hopper_with_exact_arithmetic():
    """The real compiler (not only the interpreter) accepts the kernels, for sm_90 without a GPU, and the
    PTX has IEEE division only, no contracted multiply-adds and no flush-to-zero; element loads/stores
    vectorise."""
    from megacomp.kernels.triton import kernels as K

    f = "*fp32"
    enc = dict(x_ptr="*i16", scale_ptr=f, mult_ptr=f, div_ptr=f, key_ptr="*i64", pay_ptr="*u8", n="i32", B="i32",
               nrows="i32", qmax="fp32", inv_q="fp32", offset="i32")
    dec = dict(pay_ptr="*u8", scale_ptr=f, down_ptr=f, table_ptr=f, out_ptr=f, h_ptr=f, e_ptr=f, flag_ptr="*i8",
               n="i32", B="i32", nrows="i32", offset="i32", coarse_ptr=f, beta="fp32", omb="fp32")
    flat = dict(x_ptr="*fp16", mult_ptr=f, div_ptr=f, key_ptr="*i64", pay_ptr="*u8", n="i32", B="i32", qmax="fp32",
                offset="i32")
    jobs = [(K.enc_rows, enc, dict(R=32, W=128, P=2, BITS=4, KIND=0, STAGE=0, STOCH=False, RECIP=True, BF16=True,
                                   FULL=True)),
            (K.enc_rows, enc, dict(R=32, W=128, P=1, BITS=8, KIND=1, STAGE=2, STOCH=False, RECIP=True, BF16=True,
                                   FULL=True)),
            (K.enc_rows, enc, dict(R=32, W=128, P=2, BITS=4, KIND=0, STAGE=0, STOCH=True, RECIP=False, BF16=False,
                                   FULL=True)),
            (K.enc_flat, flat, dict(T=1024, P=4, BITS=2, KIND=0, DUAL=True, ONE=False, STOCH=True, BF16=False)),
            (K.dec_rows, dec, dict(R=32, W=128, P=2, BITS=4, KIND=0, DUAL=False, EPI=0, FULL=True)),
            (K.ef_rows, dict(g_ptr=f, e_ptr=f, scale_ptr=f, key_ptr="*i64", pay_ptr="*u8", eout_ptr=f, flag_ptr="*i8",
                             table_ptr=f, n="i32", B="i32", nrows="i32", qmax="fp32", inv_q="fp32", offset="i32",
                             beta="fp32", omb="fp32"),
             dict(R=32, W=128, P=2, BITS=4, KIND=0, STOCH=True, RECIP=True, HAS_E=True, EPI=4, FULL=True)),
            (K.ef_rows, dict(g_ptr=f, e_ptr=f, scale_ptr=f, key_ptr="*i64", pay_ptr="*u8", eout_ptr=f, flag_ptr="*i8",
                             table_ptr=f, n="i32", B="i32", nrows="i32", qmax="fp32", inv_q="fp32", offset="i32",
                             beta="fp32", omb="fp32"),
             dict(R=64, W=64, P=1, BITS=8, KIND=1, STOCH=False, RECIP=True, HAS_E=False, EPI=3, FULL=True)),
            (K.enc_flat, flat, dict(T=512, P=8, BITS=1, KIND=3, DUAL=False, ONE=False, STOCH=True, BF16=False)),
            (K.dec_rows, dec, dict(R=32, W=128, P=1, BITS=8, KIND=2, DUAL=True, EPI=4, FULL=True)),
            (K.dec_rows, dec, dict(R=32, W=128, P=8, BITS=1, KIND=3, DUAL=False, EPI=1, FULL=True)),
            (K.sign_rows, dict(x_ptr="*i16", amax_ptr=f, sum_ptr="*i64", pay_ptr="*u8", n="i32", B="i32",
                               nrows="i32"), dict(R=32, W=128, FULL=True, BF16=True)),
            (K.sign_segments, dict(x_ptr=f, f1_ptr=f, f2_ptr=f, part_ptr="*i64", pay_ptr="*u8", n="i32", B="i32",
                                   nseg="i32", SEG="i32"), dict(T=1024, BITS_OUT=True, BF16=False))]
    for fn, sig, const in jobs:
        ptx = _compile_sm90(fn, sig, const).asm["ptx"]
        for bad in ("div.full", "div.approx", ".ftz", "ex2.approx"):
            assert bad not in ptx, (fn.__name__, const, bad)
        if fn is K.dec_rows:  # decode (and its accumulate / EF arithmetic) must not contract into FMAs;
            assert "fma." not in ptx  # encode's fmas are the explicit ones of the exact division (_div)
        if fn is not K.sign_segments:  # its loads are 4-byte fp32 with a runtime block offset
            assert "v4.b32" in ptx, (fn.__name__, const)
        if const.get("STOCH"):  # the counter-based draws: 32-bit products and logical (unsigned) shifts
            assert "mul.lo.s32" in ptx or "mul.lo.u32" in ptx, (fn.__name__, const)
            assert "shr.u32" in ptx and "shr.s32" not in ptx, (fn.__name__, const)


def test_dispatch_keeps_cpu_tensors_off_triton():
    x = torch.randn(100)
    for name in NAMES:
        k = quantize._kernels(make_codec(name).format, False, x)
        assert not quantize._is_triton(k)
    assert not quantize._is_triton(quantize._kernels(make_codec("int4").format, True, x))


class _Broken:
    name = "triton"
    supports_stochastic = True
    input_dtypes = (torch.float32,)

    def encode_into(self, *a, **k):
        raise RuntimeError("PTX compile failed")

    decode_into = ef_update_into = encode_into


def test_triton_failure_falls_back_to_reference_with_warning(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_triton_failed", False)
    monkeypatch.setattr(quantize, "_kernels", lambda fmt, stochastic, x: _Broken())
    fmt = make_codec("int4").format
    x = torch.randn(300)
    with caplog.at_level(logging.WARNING, logger="megacomp"):
        got = quantize.encode_scaled(x, fmt, 64, False, True, torch.Generator().manual_seed(1))
    assert "Triton codec kernels failed" in caplog.text and "PTX compile failed" in caplog.text
    assert kernels._triton_failed and kernels.triton_kernels() is None
    assert torch.equal(got, quantize.encode_scaled_reference(x, fmt, 64, False, True, torch.Generator().manual_seed(1)))
    buf = quantize.encode_scaled_reference(x, fmt, 64, False, False, None)
    dec = quantize.decode_scaled_reference(buf, 300, fmt, 64, False)
    assert torch.equal(quantize.decode_scaled(buf, 300, fmt, 64, False), dec)
    assert quantize.ef_update_scaled(buf, x, None, torch.empty(300), fmt, 64, False, 0.0) is None


def test_unsupported_case_uses_reference_and_keeps_triton(monkeypatch, caplog):
    class Huge(_Broken):
        def encode_into(self, *a, **k):
            raise ct.Unsupported("too many elements")

    monkeypatch.setattr(kernels, "_triton_failed", False)
    monkeypatch.setattr(quantize, "_kernels", lambda fmt, stochastic, x: Huge())
    fmt = make_codec("int8").format
    x = torch.randn(300)
    with caplog.at_level(logging.WARNING, logger="megacomp"):
        got = quantize.encode_scaled(x, fmt, 64, False, False, None)
    assert torch.equal(got, quantize.encode_scaled_reference(x, fmt, 64, False, False, None))
    assert not kernels._triton_failed and "failed" not in caplog.text


def test_module_imports_without_triton(monkeypatch, caplog):
    """With triton absent codec_triton still imports (HAVE_TRITON False) and CUDA tensors would use the
    reference after one warning."""
    monkeypatch.setitem(sys.modules, "triton", None)
    spec = importlib.util.spec_from_file_location("_codec_triton_no_triton", ct.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not mod.HAVE_TRITON and "triton" in mod.IMPORT_ERROR
    with pytest.raises(RuntimeError, match="triton is not available"):
        mod.backend()
    monkeypatch.setattr(kernels, "_triton", None)
    monkeypatch.setattr(kernels, "_triton_failed", False)
    monkeypatch.setitem(sys.modules, "megacomp.kernels.triton.codec_triton", mod)
    monkeypatch.setattr(sys.modules["megacomp.kernels.triton"], "codec_triton", mod)
    with caplog.at_level(logging.WARNING, logger="megacomp"):
        assert kernels.triton_kernels() is None
    assert "using the eager reference" in caplog.text
    assert kernels.backend_name("cuda") == "reference"


def test_reference_forced_turns_triton_off(monkeypatch):
    monkeypatch.setenv("MEGACOMP_KERNELS", "reference")
    assert kernels.triton_kernels() is None and kernels.backend_name("cuda") == "reference"


# -- compiled kernels on a GPU -------------------------------------------------------------------------------
CUDA_CASES = [(name, block, dual) for name in NAMES for block, dual in CONFIGS + [(4096, False), (10000, False)]] + \
    [("sign", block, False) for block in (0, 128, 7, 100, 4096, 10000)]  # sign: no dual


@needs_cuda
@pytest.mark.parametrize("name,block,dual", CUDA_CASES)
def test_cuda_dispatch_bit_identical(name, block, dual):
    """codec.encode_flat / decode_flat / decode_accumulate on CUDA (the Triton backend) against the
    reference run on the same GPU, fp32/bf16/fp16 inputs and outputs."""
    assert kernels.backend_name("cuda") == "triton"
    codec = make_codec(name, block_size=block, dual_scale=dual)
    fmt = codec.format
    for (n, seed), dtype in itertools.product(((1, 1), (1000, 2), (100_003, 3)),
                                              (torch.float32, torch.bfloat16, torch.float16)):
        x = mixed(n, seed).to(dtype).cuda()
        ref = quantize.encode_scaled_reference(x.float(), fmt, block, dual, False, None)
        assert torch.equal(codec.encode_flat(x), ref)
        dref = quantize.decode_scaled_reference(ref, n, fmt, block, dual)
        assert torch.equal(codec.decode_flat(ref, n).view(torch.int32), dref.view(torch.int32))
        assert same_bits(codec.decode_flat(ref, n, dtype), dref.to(dtype))
        acc0 = torch.randn(n, device="cuda")
        acc = codec.decode_accumulate(ref, n, acc0.clone())
        assert torch.equal(acc.view(torch.int32), (acc0 + dref).view(torch.int32))


@needs_cuda
def test_cuda_stochastic_and_error_feedback():
    fmt = make_codec("int4").format
    x = torch.randn(50_000, device="cuda")
    g1, g2 = (torch.Generator(device="cuda").manual_seed(7) for _ in range(2))
    ref = quantize.encode_scaled_reference(x, fmt, 128, False, True, g1)
    assert torch.equal(quantize.encode_scaled(x, fmt, 128, False, True, g2), ref)
    for name, block in (("int8", 0), ("int2", 7), ("sign", 128), ("sign", 0)):  # the draws of other layouts
        f = make_codec(name).format
        for dtype in (torch.float32, torch.bfloat16):
            xs = mixed(100_003, 4).to(dtype).cuda()
            sref = quantize.encode_scaled_reference(xs.float(), f, block, False, True, g1)
            assert torch.equal(quantize.encode_scaled(xs, f, block, False, True, g2), sref), (name, block, dtype)
    e = torch.randn_like(x)
    res = x - quantize.decode_scaled_reference(ref, x.numel(), fmt, 128, False)
    out = torch.empty_like(x)
    assert quantize.ef_update_scaled(ref, x, e, out, fmt, 128, False, 0.9)
    assert torch.equal(out.view(torch.int32), (0.9 * e + (1.0 - 0.9) * res).view(torch.int32))


@needs_cuda
def test_cuda_error_feedback_one_pass_matches_three_steps():
    """The chunk encoder on CUDA (Triton ef_rows where it covers a chunk) against compensate + encode +
    update_encoded run on the same GPU, LoCo over three steps, nearest and stochastic rounding."""
    from megacomp.compression import ErrorFeedback
    from megacomp.compression.ef_encoder import chunk_encoder

    for spec in (dict(name="int4"), dict(name="int8", block_size=32), dict(name="fp8_e4m3"),
                 dict(name="int2", block_size=64, rounding="stochastic", seed=3), dict(name="int4", block_size=0)):
        ef_ref, ef_new = ErrorFeedback("loco"), ErrorFeedback("loco")
        c_ref, c_new = make_codec(spec), make_codec(spec)
        s_ref, s_new = c_ref.stream(), c_new.stream()  # two equal streams (None if unseeded)
        for step in range(3):
            g = torch.randn(300_001, device="cuda", generator=torch.Generator(device="cuda").manual_seed(step))
            h = ef_ref.compensate("k", g)
            ref = [c_ref.encode_flat(h[:100_000], s_ref), c_ref.encode_flat(h[100_000:], s_ref)]
            ef_ref.update_encoded("k", h, c_ref, ref, [100_000, 200_001])
            enc = chunk_encoder(ef_new, "k", g, c_new, s_new)
            got = [enc.encode(0, 100_000), enc.encode(100_000, 200_001)]
            enc.commit()
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (spec, step)
            assert torch.equal(ef_ref.error("k").view(torch.int32), ef_new.error("k").view(torch.int32)), (spec, step)
