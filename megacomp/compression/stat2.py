"""SparseLoCo's statistical 2-bit quantizer: 4 bins of 1.5 sigma, decoded to each bin's mean.

The quantizer of SparseLoCo's reference code (tplr-ai/SparseLoCo, src/tplr/sparseloco.py, ``TopKCompressor``
with ``quantization_bins=4``, ``quantization_range=6``), applied to all the values one tensor keeps:

    shift = mean(v);  c = v - shift
    sigma = ||c|| / sqrt(n - 1)            (0 for n <= 1)
    scale = 6 * sigma / 4                  (1 where that is 0, NaN or inf)
    q     = clamp(round(c / scale + 2), 0, 3)        round half to even (torch.round)
    table[b] = mean of the c with q = b    (fp32; 0 for an empty bin)
    decoded  = table[q] + shift

So the bins are centred at -3, -1.5, 0 and +1.5 sigma around the mean (values below -2.25 sigma fall in bin 0,
values from 0.75 sigma up in bin 3). Wire format per call: the codes packed 4 per byte (first code in the low
bits), then shift and the 4 table entries as fp32: ``ceil(n / 4) + 20`` bytes. The reference sends one byte per
code and the same five floats; the values decoded are the same bit for bit.

Error bound: every decoded value is the mean of its bin, so within a bin the error is at most the bin's spread; the
clamped outer bins have no bound beyond their spread (a value far out decodes to its bin's mean). The sum of the
decoded values equals the sum of the inputs up to fp32 round-off (each bin keeps its sum).

Failure behaviour: non-fp32 input is computed in fp32 (fp64 is refused with ValueError: the table is fp32); a
buffer of the wrong size raises ValueError at decode. A NaN input makes sigma NaN, so scale 1 is used and the NaN
bins its way to a NaN shift (as the reference).
"""
from __future__ import annotations

import math

import torch

from .packing import pack_bits, packed_nbytes, unpack_bits

BINS = 4
"""Quantisation levels: 2 bits (the reference's ``quantization_bins`` for SparseLoCo's 2-bit runs)."""
RANGE_SIGMAS = 6.0
"""Width of the 4 bins together, in standard deviations (the reference's ``quantization_range``)."""
_HEAD = 4 * (1 + BINS)  # shift and the table, fp32


def wire_bytes(numel: int) -> int:
    """Bytes of :func:`encode` for ``numel`` values (0 for none)."""
    return packed_nbytes(numel, 2) + _HEAD if numel else 0


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 in [0, 4), shift fp32 scalar, table fp32 [4]) of ``values`` (any shape, flattened)."""
    if values.dtype == torch.float64:
        raise ValueError("stat2 quantizes fp32 values (its table is fp32); cast the input to float32")
    v = values.float().reshape(-1)
    shift = v.mean()
    c = v - shift
    n = c.numel()
    sigma = c.norm() / math.sqrt(n - 1) if n > 1 else torch.zeros((), device=v.device)
    scale = RANGE_SIGMAS * sigma / BINS
    if scale == 0 or torch.isnan(scale) or torch.isinf(scale):  # every value equal (or no spread to measure)
        scale = torch.ones((), device=v.device)
    codes = (c / scale + BINS // 2).round().clamp(0, BINS - 1).to(torch.uint8)
    sums = torch.zeros(BINS, device=v.device).scatter_add_(0, codes.long(), c)
    counts = torch.zeros(BINS, device=v.device).scatter_add_(0, codes.long(), torch.ones_like(c))
    table = torch.where(counts > 0, sums / counts, 0.0)
    return codes, shift, table


def dequantize(codes: torch.Tensor, shift: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[codes] + shift`` (fp32)."""
    return table[codes.long()] + shift


def encode(values: torch.Tensor) -> torch.Tensor:
    """The uint8 message of ``values``: packed codes, shift, table (see the module docstring)."""
    if values.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    codes, shift, table = quantize(values)
    head = torch.cat([shift.reshape(1), table]).view(torch.uint8)
    return torch.cat([pack_bits(codes, 2), head])


def decode(buf: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values of a message of ``numel`` values. Raises ValueError on a buffer of the wrong size."""
    if buf.numel() != wire_bytes(numel):
        raise ValueError(f"stat2: a message of {numel} values has {wire_bytes(numel)} bytes, got {buf.numel()}")
    if numel == 0:
        return torch.empty(0, dtype=torch.float32, device=buf.device)
    body = packed_nbytes(numel, 2)
    head = buf[body:].clone().view(torch.float32)
    return dequantize(unpack_bits(buf[:body], 2, numel), head[0], head[1:])
