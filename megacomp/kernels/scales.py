"""Scale helpers shared by the eager reference (megacomp/compression/quantize.py) and the Triton kernels.

A leaf module (it imports only torch), so the codec layer imports the kernels and the kernels never
import the codec layer back. Both sides must compute these scales in the same bits, so each lives once,
here.
"""
from __future__ import annotations

import torch

MAX_DUAL_EXPONENT = 126  # 2**126 and 2**-126 are normal fp32 numbers


def dual_exponents(amax_b: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Dual scaling's per-block exponent k_b = floor(log2(amax / amax_b)) clamped to [0, 126], exact via
    frexp; 126 for all-zero blocks (the ratio is not finite). Returned as fp32."""
    ratio = amax / amax_b
    _, e = torch.frexp(ratio)
    k = (e - 1).clamp_(0, MAX_DUAL_EXPONENT)
    k = torch.where(torch.isfinite(ratio), k, torch.full_like(k, MAX_DUAL_EXPONENT))
    return k.to(torch.float32)


def pow2_f64(k: torch.Tensor) -> torch.Tensor:
    """2.0**k in float64 for integer k in [-1022, 1023], built from the exponent bits (exact by construction)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every NaN replaced by the NaN ``torch.full`` writes on ``t``'s device. A scale taken straight
    from a block maximum carries whichever NaN the max kernel produced (torch's CUDA ``amax``: 0x7FFFFFFF; the
    Triton kernel and the CPU: 0x7FC00000), and the bytes on the wire must not depend on which kernel ran."""
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)


def sign_scale_exponents(amax_b: torch.Tensor):
    """(ok, k) per block of the sign codec: ok = finite positive amax; k = 24 - e for amax = m 2^e
    (k = 23 where not ok), so every |x| 2^k of the block is below 2^24."""
    ok = torch.isfinite(amax_b) & (amax_b > 0)
    _, e = torch.frexp(torch.where(ok, amax_b, torch.ones_like(amax_b)))
    return ok, 24 - e.to(torch.int64)


def sign_scale_from_sums(total: torch.Tensor, k: torch.Tensor, ok: torch.Tensor, amax_b: torch.Tensor, n: int,
                         width: int) -> torch.Tensor:
    """The sign codec's scales mean_b |x| from the exact sums ``total`` = sum floor(|x| 2^k) per block
    (int64, [nb, 1]): ``fp32(fp64(total) 2^-k / count_b)``, at most amax_b 2^-23 below the exact mean; blocks
    that are not ``ok`` get their amax (inf/NaN propagate). ``n``: data elements (the last block's count),
    ``width``: the block size."""
    counts = torch.full_like(amax_b, float(width), dtype=torch.float64)
    counts[-1] = n - (amax_b.shape[0] - 1) * width  # the last block's padding is not data
    mean = ((total.double() * pow2_f64(-k)) / counts).float()
    return torch.where(ok, mean, canonical_nan(amax_b))
