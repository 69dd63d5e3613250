"""Triton kernel bodies for the fused codecs (imported only when triton is installed; see codec_triton.py).

Every kernel repeats the eager reference's arithmetic element by element (megacomp/compression/quantize.py):
fp32 math on the loaded values (bf16/fp16 inputs are widened exactly), IEEE division (``tl.math.div_rn``,
never the approximate ``/``), no fused multiply-adds (launched with ``enable_fp_fusion=False``), no
libdevice calls (whose flush-to-zero reflection would flush subnormals). The block maximum is an integer
maximum over the bits of ``|x|``: for non-negative floats the bit order is the numeric order and every NaN
sorts above inf, so it propagates NaN like ``torch.amax`` (made the default quiet NaN, as torch does).

Tiles: a "rows" kernel holds ``R`` whole blocks as an ``[R, W]`` tile (``W`` >= block size, a power of two;
contiguous when the block is ``W``); ``P`` codes per payload byte are packed by a reshape to ``[R, W/P, P]``
and a shifted sum over the last axis; it needs blocks that start on a byte boundary. A "flat" kernel walks
``T * P`` contiguous elements (``T`` payload bytes) and looks up each element's block (any block size, or
one scale for the whole tensor with ``ONE``).

KIND: 0 int, 1 float8 e4m3fn, 2 float8 e5m2, 3 sign (decode, and stochastic encode through enc_flat; nearest
encode: the sign_* kernels at the end). EPI (decode): 0 store, 1 accumulate into fp32, 2/3/4 error
feedback update modes 0/1/2 (``h - d``, ``(1-beta)(h - d)``, ``beta e + (1-beta)(h - d)``).
"""
import triton
import triton.language as tl


@triton.jit
def _imax(v, axis: tl.constexpr):
    # tl.reduce with triton's own combine functions (not tl.max/tl.sum, which are jit functions that the
    # interpreter cannot call when triton was first imported without TRITON_INTERPRET)
    return tl.reduce(v, axis, tl.standard._elementwise_max)


@triton.jit
def _imin(v, axis: tl.constexpr):
    return tl.reduce(v, axis, tl.standard._elementwise_min)


@triton.jit
def _div(x, d):
    """x / d (d: one divisor per row, or a scalar), rounded exactly like IEEE division. When every d lies in
    [2^-80, 2^100]: r = RN(1/d), q = RN(x r), e = x - d q (exact by fma), q' = RN(q + e r), which is RN(x/d)
    (Markstein) wherever the residual does not underflow, i.e. for all |x/d| >= 2^-20; smaller quotients
    keep their sign and stay below 2^-19, where every int and float8 code is the same (0). Where the
    residual is 0 (q exact, e.g. -0) or NaN (x = inf or NaN), q itself is the quotient. Three flops instead of a division per element; other divisors take tl.math.div_rn."""
    ok = _imin(((d >= 8.271806125530277e-25) & (d <= 1.2676506002282294e30)).to(tl.int32), 0)
    if ok == 1:
        r = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
        if len(d.shape) == 1:
            r = r[:, None]
            dd = d[:, None]
        else:
            dd = d
        q = x * r
        e = tl.fma(-dd, q, x)
        y = tl.where((e == 0.0) | (e != e), q, tl.fma(e, r, q))  # q exact (keeps -0), or x = +-inf / NaN
    else:
        if len(d.shape) == 1:
            y = tl.math.div_rn(x, d[:, None])
        else:
            y = tl.math.div_rn(x, d)
    return y


@triton.jit
def _isum(v, axis: tl.constexpr):
    return tl.reduce(v, axis, tl.standard._sum_combine)


@triton.jit
def _canonical(amax_bits):
    # torch.amax returns the default quiet NaN (0x7FC00000) whatever NaN it met
    return tl.where(amax_bits > 0x7F800000, 0x7FC00000, amax_bits)


@triton.jit
def _load_f32(ptr, idx, m, BF16: tl.constexpr):
    """fp32 values of the input; bf16 arrives as its int16 bits and widens by a shift (exact, NaN payloads
    kept, the same on every backend)."""
    if BF16:
        x = (tl.load(ptr + idx, mask=m, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptr + idx, mask=m, other=0.0).to(tl.float32)
    return x


@triton.jit
def _mix32(x):
    """megacomp/compression/counter_rng.py's mixer on uint32 values (products wrap mod 2^32)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _uniform(key_ptr, idx):
    """Stochastic rounding's counter-based draw for element ``idx`` (< 2^32) of the call with the int64 key at
    ``key_ptr`` (read on the device: no host sync): (mix32((i * 0x4F1BBCDD + s0) ^ s1) >> 8) * 2^-24."""
    key = tl.load(key_ptr)
    s0 = _mix32((key & 0xFFFFFFFF).to(tl.uint32))
    s1 = _mix32(((key >> 32) ^ 0x9E3779B9).to(tl.uint32))
    h = _mix32((idx.to(tl.uint32) * 0x4F1BBCDD + s0) ^ s1)
    return (h >> 8).to(tl.int32).to(tl.float32) * 5.9604644775390625e-08  # 2^-24, exact


@triton.jit
def _quantize(y, u, qmax, offset, KIND: tl.constexpr, STOCH: tl.constexpr):
    """Codes (int32, < 256) of the scaled values ``y``: the reference's round/floor, clamp, NaN -> 0; KIND 3
    (the sign codec, stochastic; y = x / amax): bit = u < (1 + y) * 0.5, the reference's ops (NaN -> 0)."""
    if KIND == 3:
        out = (u < (1.0 + y) * 0.5).to(tl.int32)
    elif KIND == 0:
        if STOCH:
            y = y + u  # floor(y + u) below
        c = tl.where(y < -qmax, -qmax, tl.where(y > qmax, qmax, y))  # NaN passes through, like clamp_
        c = tl.where(c != c, 0.0, c)
        # |c| <= 127: adding 1.5 * 2^23 rounds half to even onto the integer grid (exact)
        q = (c + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
        if STOCH:  # floor without tl.floor, which compiles to a flush-to-zero cvt.rmi.ftz
            q = q - (q.to(tl.float32) > c).to(tl.int32)
        out = q + offset
    else:
        c = tl.where(y < -qmax, -qmax, tl.where(y > qmax, qmax, y))
        c = tl.where(c != c, 0.0, c)
        b = c.to(tl.int32, bitcast=True)
        neg = b < 0
        b = b & 0x7FFFFFFF
        fa = b.to(tl.float32, bitcast=True)
        # c10's fp32 -> float8 round-to-nearest-even integer arithmetic (torch's own cast), as selects
        if KIND == 1:
            den = (fa + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
            norm = (b - (120 << 23) + 0x7FFFF + ((b >> 20) & 1)) >> 20
            r = tl.where(b >= (1087 << 20), 0x7F, tl.where(b < (121 << 23), den, norm))
        else:
            den = (fa + 128.0).to(tl.int32, bitcast=True) - (134 << 23)
            norm = (b - (112 << 23) + 0xFFFFF + ((b >> 21) & 1)) >> 21
            big = tl.where(b > (255 << 23), 0x7F, 0x7C)
            r = tl.where(b >= (143 << 23), big, tl.where(b < (113 << 23), den, norm))
        out = tl.where(neg, r | 0x80, r)
    return out


@triton.jit
def _dequantize(code, table_ptr, offset, KIND: tl.constexpr):
    if KIND == 0:
        v = (code - offset).to(tl.float32)
    elif KIND == 3:  # sign: the reference's code * 2 - 1
        v = code.to(tl.float32) * 2.0 - 1.0
    else:
        v = tl.load(table_ptr + code)  # torch's own float8 -> fp32 values, 256 entries
    return v


@triton.jit
def _new_error(h, r, idx, m, e_ptr, beta, omb, EPI: tl.constexpr):
    """Error feedback's new error from h and the decoded r: (h - r), (1-beta)(h - r), beta e + (1-beta)(h - r)
    for EPI 2/3/4 (the reference's expressions), and 1 where the residual h - r is not finite."""
    res = h - r
    bad = (((res.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000) & m).to(tl.int32)
    if EPI == 2:
        val = res
    elif EPI == 3:
        val = omb * res
    else:
        val = beta * tl.load(e_ptr + idx, mask=m, other=0.0) + omb * res
    return val, bad


@triton.jit
def _epilogue(r, idx, m, out_ptr, h_ptr, e_ptr, beta, omb, EPI: tl.constexpr):
    """Write decoded values ``r``; returns 1 where an error-feedback residual is not finite, else 0."""
    bad = tl.full(r.shape, 0, tl.int32)
    if EPI == 0:
        if out_ptr.dtype.element_ty == tl.int16:  # bf16 output as int16 bits: round half to even by hand
            b = r.to(tl.int32, bitcast=True)
            rb = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            tl.store(out_ptr + idx, tl.where(r != r, 0x7FC0, rb).to(tl.int16), mask=m)
        else:
            tl.store(out_ptr + idx, r.to(out_ptr.dtype.element_ty), mask=m)
    elif EPI == 1:
        acc = tl.load(out_ptr + idx, mask=m, other=0.0)
        tl.store(out_ptr + idx, acc + r, mask=m)
    else:
        val, bad = _new_error(tl.load(h_ptr + idx, mask=m, other=0.0), r, idx, m, e_ptr, beta, omb, EPI)
        tl.store(out_ptr + idx, val, mask=m)
    return bad


@triton.jit
def _pack(code, NB: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr):
    """[..., NB * P] codes (last axis contiguous elements) -> [..., NB] bytes (first code in the low bits)."""
    if P == 1:
        packed = code
    else:
        if len(code.shape) == 2:
            c3 = tl.reshape(code, [code.shape[0], NB, P])
            packed = _isum(c3 << (tl.arange(0, P)[None, None, :] * BITS), 2)
        else:
            c2 = tl.reshape(code, [NB, P])
            packed = _isum(c2 << (tl.arange(0, P)[None, :] * BITS), 1)
    return packed


@triton.jit
def _unpack(byte, NB: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr):
    """Inverse of _pack: [..., NB] bytes (int32) -> [..., NB * P] codes."""
    if P == 1:
        code = byte
    else:
        if len(byte.shape) == 2:
            c3 = (byte[:, :, None] >> (tl.arange(0, P)[None, None, :] * BITS)) & ((1 << BITS) - 1)
            code = tl.reshape(c3, [byte.shape[0], NB * P])
        else:
            c2 = (byte[:, None] >> (tl.arange(0, P)[None, :] * BITS)) & ((1 << BITS) - 1)
            code = tl.reshape(c2, [NB * P])
    return code


@triton.jit
def _row_index(pid, n, B, R: tl.constexpr, W: tl.constexpr, P: tl.constexpr, FULL: tl.constexpr):
    """Element and payload-byte indices and masks of R rows (blocks) of W (>= B, a power of two) columns;
    FULL: B == W, so the tile is one contiguous span (vector loads and stores)."""
    r2 = pid * R + tl.arange(0, R)[:, None]
    col = tl.arange(0, W)[None, :]
    c2 = tl.arange(0, W // P)[None, :]
    if FULL:
        idx = r2 * W + col
        m = idx < n
        bidx = r2 * (W // P) + c2
        bm = bidx * P < n
    else:
        idx = r2 * B + col
        m = (col < B) & (idx < n)
        bidx = r2 * (B // P) + c2
        bm = (c2 * P < B) & (r2 * B + c2 * P < n)
    return idx, m, bidx, bm


@triton.jit
def enc_rows(x_ptr, scale_ptr, mult_ptr, div_ptr, key_ptr, pay_ptr, n, B, nrows, qmax, inv_q, offset,
             R: tl.constexpr, W: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, KIND: tl.constexpr,
             STAGE: tl.constexpr, STOCH: tl.constexpr, RECIP: tl.constexpr, BF16: tl.constexpr, FULL: tl.constexpr):
    """R whole blocks per program. STAGE 0: block maxima, scales (written as fp32) and codes in one pass;
    1: block maxima only (into ``scale_ptr``); 2: codes from given per-block ``mult`` and ``div`` (dual).
    RECIP: the scale is ``amax * inv_q`` (torch's CUDA division by a CPU scalar multiplies by its fp32
    reciprocal), else ``amax / qmax`` (torch's CPU division). Blocks must start on a byte boundary (or be one)."""
    pid = tl.program_id(0)
    idx, m, bidx, bm = _row_index(pid, n, B, R, W, P, FULL)
    x = _load_f32(x_ptr, idx, m, BF16)
    rows = pid * R + tl.arange(0, R)
    if STAGE == 2:
        mult = tl.load(mult_ptr + rows, mask=rows < nrows, other=1.0)[:, None]
        y = _div(x * mult, tl.load(div_ptr + rows, mask=rows < nrows, other=1.0))
    else:
        amax = _canonical(_imax(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1)).to(tl.float32, bitcast=True)
        if STAGE == 1:
            tl.store(scale_ptr + rows, amax, mask=rows < nrows)
            y = x
        else:
            if RECIP:
                scale = amax * inv_q
            else:
                scale = tl.math.div_rn(amax, qmax)
            tl.store(scale_ptr + rows, scale, mask=rows < nrows)
            y = _div(x, tl.where(scale > 0.0, scale, 1.0))
    if STAGE != 1:
        u = 0.0
        if STOCH:
            u = _uniform(key_ptr, idx)
        code = tl.where(m, _quantize(y, u, qmax, offset, KIND, STOCH), 0)
        tl.store(pay_ptr + bidx, _pack(code, W // P, P, BITS).to(tl.uint8), mask=bm)


@triton.jit
def enc_flat(x_ptr, mult_ptr, div_ptr, key_ptr, pay_ptr, n, B, qmax, offset, T: tl.constexpr, P: tl.constexpr,
             BITS: tl.constexpr, KIND: tl.constexpr, DUAL: tl.constexpr, ONE: tl.constexpr, STOCH: tl.constexpr,
             BF16: tl.constexpr):
    """T payload bytes (T * P elements) per program, codes from given per-block ``mult`` (dual) and ``div``;
    any block size (``ONE``: a single block)."""
    pid = tl.program_id(0)
    idx = pid * (T * P) + tl.arange(0, T * P)
    m = idx < n
    x = _load_f32(x_ptr, idx, m, BF16)
    if ONE:
        div = tl.load(div_ptr)
        if DUAL:
            x = x * tl.load(mult_ptr)
    else:
        blk = idx // B
        div = tl.load(div_ptr + blk, mask=m, other=1.0)
        if DUAL:
            x = x * tl.load(mult_ptr + blk, mask=m, other=1.0)
    y = tl.math.div_rn(x, div)
    u = 0.0
    if STOCH:
        u = _uniform(key_ptr, idx)
    code = tl.where(m, _quantize(y, u, qmax, offset, KIND, STOCH), 0)
    b1 = pid * T + tl.arange(0, T)
    tl.store(pay_ptr + b1, _pack(code, T, P, BITS).to(tl.uint8), mask=b1 * P < n)


@triton.jit
def amax_segments(x_ptr, part_ptr, n, B, nseg, SEG, T: tl.constexpr, BF16: tl.constexpr):
    """Maximum of |x| (as int32 bits) over segment s of block b, for blocks too large for one tile."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    acc = tl.full([T], 0, tl.int32)
    for i in range(0, SEG, T):
        col = s * SEG + i + tl.arange(0, T)
        idx = b * B + col
        x = _load_f32(x_ptr, idx, (col < B) & (idx < n), BF16)
        acc = tl.maximum(acc, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    tl.store(part_ptr + b * nseg + s, _canonical(_imax(acc, 0)))


@triton.jit
def dec_rows(pay_ptr, scale_ptr, down_ptr, table_ptr, out_ptr, h_ptr, e_ptr, flag_ptr, n, B, nrows, offset, coarse_ptr,
             beta, omb, R: tl.constexpr, W: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, KIND: tl.constexpr,
             DUAL: tl.constexpr, EPI: tl.constexpr, FULL: tl.constexpr):
    """Decode R whole blocks per program: codes times each block's scale (DUAL: coarse scale times the
    block's power of two), then the epilogue EPI (write, accumulate, or an error-feedback residual)."""
    pid = tl.program_id(0)
    idx, m, bidx, bm = _row_index(pid, n, B, R, W, P, FULL)
    code = _unpack(tl.load(pay_ptr + bidx, mask=bm, other=0).to(tl.int32), W // P, P, BITS)
    v = _dequantize(code, table_ptr, offset, KIND)
    rows = pid * R + tl.arange(0, R)
    if DUAL:  # (v * coarse) * 2^-k, with 2^-k per block computed by torch.exp2 like the reference
        down = tl.load(down_ptr + rows, mask=rows < nrows, other=0.0)[:, None]
        r = (v * tl.load(coarse_ptr)) * down
    else:
        r = v * tl.load(scale_ptr + rows, mask=rows < nrows, other=0.0)[:, None]
    bad = _epilogue(r, idx, m, out_ptr, h_ptr, e_ptr, beta, omb, EPI)
    if EPI >= 2:
        tl.store(flag_ptr + pid, _imax(_imax(bad, 1), 0).to(tl.int8))


@triton.jit
def dec_flat(pay_ptr, scale_ptr, down_ptr, table_ptr, out_ptr, h_ptr, e_ptr, flag_ptr, n, B, offset, coarse_ptr, beta, omb,
             T: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, KIND: tl.constexpr, DUAL: tl.constexpr,
             ONE: tl.constexpr, EPI: tl.constexpr):
    """Decode T payload bytes (T * P elements) per program, each element scaled by its block's scale (ONE:
    a single scale for the whole tensor), then the epilogue EPI as in :func:`dec_rows`."""
    pid = tl.program_id(0)
    b1 = pid * T + tl.arange(0, T)
    code = _unpack(tl.load(pay_ptr + b1, mask=b1 * P < n, other=0).to(tl.int32), T, P, BITS)
    idx = pid * (T * P) + tl.arange(0, T * P)
    m = idx < n
    v = _dequantize(code, table_ptr, offset, KIND)
    if ONE:
        if DUAL:
            r = (v * tl.load(coarse_ptr)) * tl.load(down_ptr)
        else:
            r = v * tl.load(scale_ptr)
    else:
        blk = idx // B
        if DUAL:
            r = (v * tl.load(coarse_ptr)) * tl.load(down_ptr + blk, mask=m, other=0.0)
        else:
            r = v * tl.load(scale_ptr + blk, mask=m, other=0.0)
    bad = _epilogue(r, idx, m, out_ptr, h_ptr, e_ptr, beta, omb, EPI)
    if EPI >= 2:
        tl.store(flag_ptr + pid, _imax(bad, 0).to(tl.int8))


@triton.jit
def ef_rows(g_ptr, e_ptr, scale_ptr, key_ptr, pay_ptr, eout_ptr, flag_ptr, table_ptr, n, B, nrows, qmax, inv_q,
            offset, beta, omb, R: tl.constexpr, W: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr,
            KIND: tl.constexpr, STOCH: tl.constexpr, RECIP: tl.constexpr, HAS_E: tl.constexpr, EPI: tl.constexpr,
            FULL: tl.constexpr):
    """One error-feedback step over R whole blocks: h = g + e (HAS_E) or g, the block scales and codes (as
    enc_rows STAGE 0), the decoded codes (as dec_rows) and the new error (EPI 2/3/4 as _epilogue) into
    ``eout_ptr``, which may be ``e_ptr`` itself (each element is loaded before it is stored, and programs
    own disjoint blocks). Blocks must start on a byte boundary, fp32 g and e."""
    pid = tl.program_id(0)
    idx, m, bidx, bm = _row_index(pid, n, B, R, W, P, FULL)
    h = tl.load(g_ptr + idx, mask=m, other=0.0)
    if HAS_E:
        h = h + tl.load(e_ptr + idx, mask=m, other=0.0)
    amax = _canonical(_imax(h.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1)).to(tl.float32, bitcast=True)
    if RECIP:
        scale = amax * inv_q
    else:
        scale = tl.math.div_rn(amax, qmax)
    rows = pid * R + tl.arange(0, R)
    tl.store(scale_ptr + rows, scale, mask=rows < nrows)
    y = _div(h, tl.where(scale > 0.0, scale, 1.0))
    u = 0.0
    if STOCH:
        u = _uniform(key_ptr, idx)
    code = tl.where(m, _quantize(y, u, qmax, offset, KIND, STOCH), 0)
    tl.store(pay_ptr + bidx, _pack(code, W // P, P, BITS).to(tl.uint8), mask=bm)
    r = _dequantize(code, table_ptr, offset, KIND) * scale[:, None]
    val, bad = _new_error(h, r, idx, m, e_ptr, beta, omb, EPI)
    tl.store(eout_ptr + idx, val, mask=m)
    tl.store(flag_ptr + pid, _imax(_imax(bad, 1), 0).to(tl.int8))


# -- the sign codec ------------------------------------------------------------------------------------------
# Nearest rounding: bit = x >= 0 (NaN: 0) and, per block, the exact integer sum S = sum floor(|x| 2^k) with
# k = 24 - e for amax = m 2^e (megacomp/compression/quantize.py:_sign_mean_scale). The scale formula on S
# (two roundings in fp64) runs in torch on the block sums, the reference's own ops. Every |x| 2^k is formed
# as (|x| 2^k1) 2^k2 with normal factors: exact, or below 1 where it floors to 0 anyway.


@triton.jit
def _pow2(k):
    return ((k + 127) << 23).to(tl.float32, bitcast=True)  # 2^k for int32 k in [-126, 127]


@triton.jit
def _scaled_floor(ab, f1, f2, ok):
    """floor(|x| 2^k) as int64 from the bits of |x|; 0 for non-finite |x| and where not ``ok``."""
    a = tl.where(ok, tl.where(ab < 0x7F800000, ab.to(tl.float32, bitcast=True), 0.0), 0.0)
    return ((a * f1) * f2).to(tl.int32).to(tl.int64)  # < 2^24: truncation is floor


@triton.jit
def sign_rows(x_ptr, amax_ptr, sum_ptr, pay_ptr, n, B, nrows, R: tl.constexpr, W: tl.constexpr,
              FULL: tl.constexpr, BF16: tl.constexpr):
    """R whole blocks (a multiple of 8 elements each) per program: block maxima, exact sums and bits in one
    pass. k comes from the maximum's bits as torch.frexp gives it (a subnormal maximum is first scaled by
    2^64, exactly)."""
    pid = tl.program_id(0)
    idx, m, bidx, bm = _row_index(pid, n, B, R, W, 8, FULL)
    x = _load_f32(x_ptr, idx, m, BF16)
    ab = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax_bits = _canonical(_imax(ab, 1))
    amax = amax_bits.to(tl.float32, bitcast=True)
    ok = (amax_bits > 0) & (amax_bits < 0x7F800000)
    sub = amax_bits < 0x00800000
    a2 = tl.where(sub, amax * 18446744073709551616.0, amax).to(tl.int32, bitcast=True)
    k = tl.where(ok, 24 - (((a2 >> 23) & 0xFF) - 126 - tl.where(sub, 64, 0)), 0)
    k1 = k >> 1  # any split into two representable factors gives the same exact product
    f1 = _pow2(k1)[:, None]
    f2 = _pow2(k - k1)[:, None]
    s = _isum(_scaled_floor(ab, f1, f2, ok[:, None]), 1)
    rows = pid * R + tl.arange(0, R)
    tl.store(amax_ptr + rows, amax, mask=rows < nrows)
    tl.store(sum_ptr + rows, s, mask=rows < nrows)
    code = ((x >= 0.0) & m).to(tl.int32)
    tl.store(pay_ptr + bidx, _pack(code, W // 8, 8, 1).to(tl.uint8), mask=bm)


@triton.jit
def sign_segments(x_ptr, f1_ptr, f2_ptr, part_ptr, pay_ptr, n, B, nseg, SEG, T: tl.constexpr,
                  BITS_OUT: tl.constexpr, BF16: tl.constexpr):
    """Exact sums over segment s of block b (given factors 2^k1, 2^k2 per block, 0 where the block's maximum
    is not finite and positive); BITS_OUT: also the bits (blocks on byte boundaries, T a multiple of 8)."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    f1 = tl.load(f1_ptr + b)
    f2 = tl.load(f2_ptr + b)
    acc = tl.full([T], 0, tl.int64)
    for i in range(0, SEG, T):
        col = s * SEG + i + tl.arange(0, T)
        idx = b * B + col
        m = (col < B) & (idx < n)
        x = _load_f32(x_ptr, idx, m, BF16)
        acc += _scaled_floor(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, f1, f2, f1 > 0.0)
        if BITS_OUT:
            byte = (b * B + s * SEG + i) // 8 + tl.arange(0, T // 8)
            lim = tl.minimum(n, b * B + B)
            tl.store(pay_ptr + byte, _pack(((x >= 0.0) & m).to(tl.int32), T // 8, 8, 1).to(tl.uint8),
                     mask=byte * 8 < lim)
    tl.store(part_ptr + b * nseg + s, _isum(acc, 0))


@triton.jit
def sign_bits(x_ptr, pay_ptr, n, T: tl.constexpr, BF16: tl.constexpr):
    """T payload bytes of sign bits per program (any block layout: the bits do not depend on blocks)."""
    pid = tl.program_id(0)
    idx = pid * (T * 8) + tl.arange(0, T * 8)
    m = idx < n
    x = _load_f32(x_ptr, idx, m, BF16)
    b1 = pid * T + tl.arange(0, T)
    tl.store(pay_ptr + b1, _pack(((x >= 0.0) & m).to(tl.int32), T, 8, 1).to(tl.uint8), mask=b1 * 8 < n)


# -- dropping a non-finite error on the device ---------------------------------------------------------------
@triton.jit
def zero_unless(e_ptr, ok_ptr, n, nprog, T: tl.constexpr):
    """e[:n] = 0 where the byte at ``ok_ptr`` is 0 (some residual was non-finite); when it is 1 each of the
    ``nprog`` programs returns after that one load, so the usual (finite) case costs a launch, not a pass."""
    if tl.load(ok_ptr) == 0:
        pid = tl.program_id(0)
        for start in range(pid * T, n, nprog * T):
            idx = start + tl.arange(0, T)
            tl.store(e_ptr + idx, tl.full([T], 0.0, tl.float32), mask=idx < n)  # not tl.zeros (interpreter)
