"""Per-element error bounds of each codec, derived in the test suite from bits and scale alone.

These formulas are written independently of megacomp.compression (they use only the codec's name,
block size and flags) so that a wrong scale or rounding in the library cannot also loosen its test.
Every bound is in fp64 and includes a small fp32 round-off term for the scaling arithmetic
(a few ulps of the value), never a hand-picked constant that "happens to pass".
"""
from __future__ import annotations

import math

import torch

FP32_ULP = 2.0 ** -23
FMT = {  # name -> (kind, bits, qmax, mantissa bits, min subnormal)
    "int8": ("int", 8, 127, None, None), "int4": ("int", 4, 7, None, None), "int2": ("int", 2, 1, None, None),
    "sign": ("sign", 1, 1, None, None),
    "fp8_e4m3": ("float8", 8, 448.0, 3, 2.0 ** -9), "fp8_e5m2": ("float8", 8, 57344.0, 2, 2.0 ** -16),
    "bf16": ("cast", 16, None, 7, 2.0 ** -133), "fp16": ("cast", 16, None, 10, 2.0 ** -24),
}
OUT_CAST = {torch.float32: (23, 2.0 ** -149), torch.bfloat16: (7, 2.0 ** -133), torch.float16: (10, 2.0 ** -24),
            torch.float64: (52, 0.0)}


def _blocks(x: torch.Tensor, block: int):
    """Per-element block amax and block mean |x| (fp64), broadcast back to x's flat shape."""
    flat = x.reshape(-1).double().abs()
    n = flat.numel()
    if n == 0:
        return flat, flat
    b = n if block == 0 else block
    nb = math.ceil(n / b) if n else 0
    padded = torch.cat([flat, flat.new_zeros(nb * b - n)]).view(nb, b)
    amax = padded.amax(1, keepdim=True)
    counts = torch.full((nb, 1), float(b), dtype=torch.float64)
    if nb:
        counts[-1] = n - (nb - 1) * b
    mean = padded.sum(1, keepdim=True) / counts
    return amax.expand(nb, b).reshape(-1)[:n], mean.expand(nb, b).reshape(-1)[:n]


def hadamard(size: int) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix (fp64), built here independently of the library."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / size ** 0.5


def elementwise_bound(codec, x: torch.Tensor) -> torch.Tensor:
    """Upper bound of |decode(encode(x)) - x| per element (flat, fp64) for a finite ``x``."""
    if getattr(codec, "name", "") == "taco":
        return taco_bound(codec, x)
    if getattr(codec, "hadamard", 0):
        # quantize in the rotated basis, rotate back: |err_i| <= (1/sqrt(B)) sum_j |err_rot_j| over i's block
        size, n = codec.hadamard, x.numel()
        flat = x.reshape(-1).double()
        flat = torch.cat([flat, flat.new_zeros((-n) % size)])
        rot = (flat.view(-1, size) @ hadamard(size)).reshape(-1).float()
        inner = type(codec)(**dict(codec.to_dict(), hadamard=0, seed=None))
        b_rot = elementwise_bound(inner, rot).view(-1, size)
        back = b_rot.sum(1, keepdim=True).expand(-1, size) / size ** 0.5
        mant_out, sub_out = OUT_CAST[x.dtype]
        ax = x.reshape(-1).double().abs()
        rounding = (flat.view(-1, size).abs().sum(1, keepdim=True).expand(-1, size).reshape(-1)[:n]) * 8 * FP32_ULP
        return back.reshape(-1)[:n] * (1 + 8 * FP32_ULP) + rounding + ax * 2.0 ** -(mant_out + 1) * 1.01 + sub_out
    name = codec.name
    ax = x.reshape(-1).double().abs()
    mant_out, sub_out = OUT_CAST[x.dtype]
    out_cast = ax * 2.0 ** -(mant_out + 1) * 1.01 + sub_out  # rounding the fp32 result back to x.dtype
    if name == "none":
        return torch.zeros_like(ax)
    kind, bits, qmax, mant, min_sub = FMT[name]
    if kind == "cast":
        # x -> bf16/fp16 (round to nearest), then back to x.dtype
        return ax * 2.0 ** -(mant + 1) + min_sub / 2 + out_cast
    amax, mean = _blocks(x, codec.block_size)
    arith = (ax + amax) * 4 * FP32_ULP  # fp32 scale/divide/multiply round-off
    if kind == "sign":
        base = 2 * amax if codec.rounding == "stochastic" else torch.maximum(amax - mean, mean)
        return base * (1 + 4 * FP32_ULP) + arith + out_cast
    # step of the quantizer grid: per block amax/qmax; dual scale rounds it up to < 2x that
    step = amax / qmax * (2.0 if codec.dual_scale else 1.0)
    if kind == "int":
        base = step if codec.rounding == "stochastic" else step / 2
        return base * (1 + 4 * FP32_ULP) + arith + out_cast
    # float8: relative rounding in the normal range, absolute half-subnormal below it
    return torch.maximum(ax * 2.0 ** -(mant + 1), step * min_sub / 2) * (1 + 4 * FP32_ULP) + arith + out_cast


def split_sizes(numel: int, parts: int) -> list[int]:
    base, rem = divmod(numel, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


def reduce_scatter_bound(codec, partial_chunks) -> torch.Tensor:
    """Bound of one reduced chunk: the sum of each rank's bound on its (separately encoded) chunk."""
    return sum(elementwise_bound(codec, c.float()) for c in partial_chunks)


def all_reduce_bound(codec, partials) -> torch.Tensor:
    """Per-element bound of a compressed all-reduce (SUM) of ``partials`` (one tensor per rank) against the
    exact sum: stage 1 encodes each rank's chunk j, stage 2 re-encodes the reduced chunk j. Stage 2 is
    bounded on the envelope |exact sum| + stage-1 bound, which dominates the decoded sum it really sees."""
    world = len(partials)
    flats = [p.reshape(-1).double() for p in partials]
    n = flats[0].numel()
    out, o = [], 0
    for s in split_sizes(n, world):
        chunks = [f[o:o + s] for f in flats]
        b1 = reduce_scatter_bound(codec, chunks)
        envelope = (sum(chunks).abs() + b1).float()
        out.append(b1 + elementwise_bound(codec, envelope))
        o += s
    return torch.cat(out).view(partials[0].shape)


def taco_bound(codec, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound of TACO's codec whatever reshape and row flags it picks: element i's row lies in its
    aligned window W of G_max = codec.hadamard elements; an orthonormal row transform keeps the row's error norm,
    and e4m3 rounds each element of the transformed row y to within 2^-4 |y_j| + 2^-10 s_b, with every fine scale
    s_b <= coarse = amax(y) / 448 <= max_W ||x_W|| / 448. So |err_i| <= 2^-4 ||x_W(i)|| + 2^-10 sqrt(G_max) max_W
    ||x_W|| / 448, plus fp32 round-off of the transforms and the cast back to x.dtype."""
    g, n = codec.hadamard, x.numel()
    flat = x.reshape(-1).double()
    if n == 0:
        return flat
    win = torch.cat([flat, flat.new_zeros((-n) % g)]).view(-1, g).norm(dim=1, keepdim=True)
    mant_out, sub_out = OUT_CAST[x.dtype]
    base = win * 2.0 ** -4 + 2.0 ** -10 * g ** 0.5 * win.max() / 448.0
    per = (base * (1 + 8 * FP32_ULP) + win * 16 * FP32_ULP).expand(-1, g).reshape(-1)[:n]
    return per + flat.abs() * 2.0 ** -(mant_out + 1) * 1.01 + sub_out
