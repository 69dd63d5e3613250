"""TACO's codec for tensor-parallel traffic (Liu et al., "TACO: Efficient Communication Compression of
Intermediate Tensors for Scalable Tensor-Parallel LLM Training", HPDC'26, arXiv 2604.24088), as megacomp
reconstructs it from the paper's public description: ``make_codec("taco")``.

What the public description fixes (its abstract): FP8 quantisation of the TP intermediate tensors after a
data-driven reshape and an Adaptive Scale-Hadamard Transform, with Dual-Scale Quantization. The paper's body
(its equations, the reshape rule, the adaptivity rule, the scale formats) was not readable from any public
source megacomp could reach, so each of those three parts is megacomp's reading, stated here so a user can
compare it with the paper:

  data-driven reshape   the flat message (zero-padded to a multiple of ``G_max = hadamard``, default 256) is
                        viewed as rows of ``G`` elements, ``G`` one of ``G_max/8, G_max/4, G_max/2, G_max``
                        (at least 2): the one whose encoding has the smallest squared error on this message,
                        measured by encoding with each (the choice is data-driven and costs one encode per
                        candidate). One header byte says which.
  adaptive Hadamard     each row r is sent either as is or rotated by the orthonormal Walsh-Hadamard matrix
                        ``H_G / sqrt(G)``, whichever has the smaller largest magnitude (a rotation spreads an
                        outlier row; a dense near-zero row, already flat, is left alone). One bit per row (the
                        flags take ``ceil(P / G_min / 8)`` bytes whatever ``G``, so the size is fixed).
  dual-scale fp8        the transformed message is quantised to fp8 e4m3 with megacomp's dual scale
                        (megacomp.compression.quantize): one fp32 coarse scale ``c = amax / 448`` and, per block
                        of ``block_size`` (default 128) elements, a one-byte power of two ``2^-k_b`` so that
                        near-zero blocks get their own magnification.

Decoding dequantises, rotates the flagged rows back (the matrix is its own inverse) and drops the padding.
Every decoded message is in the original basis (sums of decodings need no rotation back).

Wire layout for ``n > 0`` elements, ``P = n`` rounded up to a multiple of ``G_max``, ``B = block_size``:
``[fp32 coarse][uint8 exponent x ceil(P/B)][fp8 x P][uint8 index of G][row flags x ceil(P/G_min/8)]``;
``wire_bytes(n)`` is its length (0 for ``n = 0``), fixed by ``n`` alone.

Error bound (the codec's promise): for a finite input ``x`` whose every block's largest magnitude in the
transformed basis is 0 or at least ``2^-126`` times the message's largest, the decoded ``x^`` obeys

    ||x^ - x||_2 <= (2^-4 + 2^-9 sqrt(B) / 448) ||x||_2     (plus fp32 round-off of the transform)

whatever reshape and flags are chosen: each row's transform is orthonormal, so the error and the norm are
those of the transformed message, where e4m3 rounds each scaled element to within half an ulp (2^-4 of it)
or half the smallest subnormal (2^-10 of the block scale ``s_b < 2 amax_b / 448 <= 2 ||y_b|| / 448``).
Inputs are computed in fp32 (float64 inputs too).

Failure behaviour: options TACO does not have (stochastic rounding, ``k``/``transform`` selection, a
``block_size`` of 0, a ``hadamard`` size that is not a power of two) raise ValueError naming the fix; a buffer
of the wrong length or with a corrupt header raises ValueError; a non-finite input decodes to non-finite values
(NaN or inf in its block and, for a rotated row, in the whole row), never to a finite number.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from . import quantize, transforms
from .formats import get_format
from .packing import pack_bits, unpack_bits

if TYPE_CHECKING:  # pragma: no cover
    from .codecs import Codec

NAME = "taco"
"""The registered codec name."""
DEFAULT_BLOCK = 128
"""Elements per fine (power-of-two) scale when ``block_size`` is not given."""
DEFAULT_MAX_GROUP = 256
"""Largest reshape row length ``G_max`` when ``hadamard`` is not given (0)."""
CANDIDATES = 4
"""Row lengths tried: ``G_max`` and its halvings, this many (stopping at 2)."""
_FP8 = "fp8_e4m3"


def configure(codec: "Codec") -> None:
    """Validate a taco codec and fill its defaults in place (it is frozen: ``object.__setattr__``).

    Raises:
        ValueError: an option TACO does not have, naming the fix.
    """
    where = f"codec {NAME}"
    if codec.rounding != "nearest":
        raise ValueError(f"{where}: rounds to nearest only (TACO's fp8 cast); drop rounding={codec.rounding!r}")
    if codec.k or codec.transform != "none" or codec.chunk is not None or codec.select != "topk":
        raise ValueError(f"{where}: k/chunk/select/transform do not apply (TACO sends every element); drop them")
    bs = DEFAULT_BLOCK if codec.block_size is None else codec.block_size
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise ValueError(f"{where}: block_size (elements per fine scale) must be an int >= 1, got {codec.block_size!r}; "
                         f"TACO's dual scale is per block")
    g = codec.hadamard or DEFAULT_MAX_GROUP
    transforms.check_size(g)
    object.__setattr__(codec, "block_size", bs)
    object.__setattr__(codec, "hadamard", g)
    object.__setattr__(codec, "dual_scale", True)  # TACO's Dual-Scale Quantization is part of the method


def groups(codec: "Codec") -> tuple[int, ...]:
    """The candidate row lengths of the reshape, smallest first."""
    g = codec.hadamard
    out = [g]
    while len(out) < CANDIDATES and out[-1] > 2:
        out.append(out[-1] // 2)
    return tuple(reversed(out))


def describe(codec: "Codec") -> str:
    """Short form for logs: ``taco/b128/g32-256``."""
    gs = groups(codec)
    return f"{NAME}/b{codec.block_size}/g{gs[0]}-{gs[-1]}"


def _sizes(codec: "Codec", numel: int) -> tuple[int, int, int]:
    """(padded length P, quantised bytes, flag bytes)."""
    padded = transforms.padded_numel(numel, codec.hadamard)
    qbytes = quantize.scale_nbytes(padded, codec.block_size, True) + quantize.payload_nbytes(padded, get_format(_FP8))
    return padded, qbytes, math.ceil(padded // groups(codec)[0] / 8)


def wire_bytes(codec: "Codec", numel: int) -> int:
    """Exact bytes :func:`encode` produces for ``numel`` elements (see the module docstring's layout)."""
    if numel == 0:
        return 0
    _, qbytes, fbytes = _sizes(codec, numel)
    return qbytes + 1 + fbytes


def _transform(rows: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """Rows with ``flags`` set multiplied by the orthonormal Hadamard matrix, the rest unchanged (flat)."""
    g = rows.shape[1]
    rot = rows @ transforms._matrix(g, rows.device.type)
    return torch.where(flags.unsqueeze(1), rot, rows).reshape(-1)


def encode(codec: "Codec", x: torch.Tensor) -> torch.Tensor:
    """The flat uint8 wire buffer of ``x`` (any shape, row-major): reshape and flags chosen from the data."""
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    padded, _, fbytes = _sizes(codec, n)
    flat = x.reshape(-1).to(torch.float32)
    if padded > n:
        flat = torch.cat([flat, flat.new_zeros(padded - n)])
    fmt = get_format(_FP8)
    best = None
    for index, g in enumerate(groups(codec)):
        rows = flat.view(-1, g)
        rot = rows @ transforms._matrix(g, rows.device.type)
        # strict <: ties (and NaN rows, where every comparison is false) stay unrotated
        flags = rot.abs().amax(1) < rows.abs().amax(1)
        y = torch.where(flags.unsqueeze(1), rot, rows).reshape(-1)
        q = quantize.encode_scaled(y, fmt, codec.block_size, True, False, None)
        err = (quantize.decode_scaled(q, padded, fmt, codec.block_size, True) - y).square().sum()
        # the error of an orthonormal row transform equals the error in the original basis, so it is measured here
        err = float(err) if bool(torch.isfinite(err)) else math.inf  # host sync: the reshape is chosen per message
        if best is None or err < best[0]:
            best = (err, index, q, flags)
    _, index, q, flags = best
    bits = torch.zeros(fbytes * 8, dtype=torch.uint8, device=flat.device)
    bits[:flags.numel()] = flags.to(torch.uint8)
    header = torch.tensor([index], dtype=torch.uint8, device=flat.device)
    return torch.cat([q, header, pack_bits(bits, 1)])


def wire_values(codec: "Codec", x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformed message before quantisation, its dequantised values): what TACO's fp8 codes carry, flat fp32 and
    padded, for measurements of the wire (underflow); the reshape and flags are those :func:`encode` picks."""
    n = x.numel()
    buf = encode(codec, x)
    if n == 0:
        return torch.empty(0, device=x.device), torch.empty(0, device=x.device)
    padded, qbytes, fbytes = _sizes(codec, n)
    g = groups(codec)[int(buf[qbytes])]  # host sync: the chosen row length
    flags = unpack_bits(buf[qbytes + 1:], 1, padded // g).bool()
    flat = torch.cat([x.reshape(-1).to(torch.float32), x.new_zeros(padded - n, dtype=torch.float32)])
    sent = _transform(flat.view(-1, g), flags)
    return sent, quantize.decode_scaled(buf[:qbytes], padded, get_format(_FP8), codec.block_size, True)


def decode(codec: "Codec", buf: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``numel`` elements of ``dtype`` (flat, original basis) from a buffer of :func:`encode`.

    Raises:
        ValueError: the buffer is not ``wire_bytes(numel)`` uint8 bytes, or its reshape index is out of range.
    """
    expected = wire_bytes(codec, numel)
    if buf.dtype != torch.uint8 or buf.numel() != expected:
        raise ValueError(f"codec {describe(codec)}: expected a uint8 buffer of {expected} bytes for {numel} elements, "
                         f"got {buf.dtype} with {buf.numel()} bytes")
    if numel == 0:
        return torch.empty(0, dtype=dtype, device=buf.device)
    padded, qbytes, fbytes = _sizes(codec, numel)
    gs = groups(codec)
    index = int(buf[qbytes])  # host sync: the row length decides the view below
    if index >= len(gs):
        raise ValueError(f"codec {describe(codec)}: corrupt buffer (reshape index {index}, expected < {len(gs)}); "
                         f"encoder and decoder must use the same taco settings")
    g = gs[index]
    y = quantize.decode_scaled(buf[:qbytes], padded, get_format(_FP8), codec.block_size, True)
    flags = unpack_bits(buf[qbytes + 1:], 1, padded // g).bool()
    return _transform(y.view(-1, g), flags)[:numel].to(dtype)
