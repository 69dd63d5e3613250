"""AQ-SGD's reference quantizer: one max-scale per hidden channel, ``2**bits`` levels, bits packed densely.

The quantizer of Wang et al.'s code (DS3Lab/AC-SGD, ``compress/fixpoint.py``: ``compress_flexible_nbits`` with
``scale_method='max'`` and ``scale_dims=(0, 1)``, the defaults AQ-SGD's deltas use), restated in plain torch.
For ``x`` of shape ``[..., h]`` (every leading dimension is a row: micro-batch x sequence), ``f = bits - 1``:

  s_j  = fp16(max_i |x_ij|)                                 one fp16 scale per channel j (amax, then rounded)
  d_j  = fp16(s_j + 1e-6)                                   the divisor (the sum is taken in fp16, as there)
  q_ij = clip(round(x_ij / d_j * 2^f), -2^f, 2^f - 1)       round half to even: ``2**bits`` levels
  x'_ij = q_ij / 2^f * s_j                                  decoded in float32 (exact: q is small, s has 11 bits)

so the largest positive value decodes to ``(1 - 2^-f) s_j`` and the most negative to ``-s_j`` (with 2 bits the
levels are ``{-s, -s/2, 0, s/2}``; with 1 bit ``{-s, 0}``). Wire: the codes ``q + 2^f`` as ``bits``-bit unsigned
integers, most significant bit first, in row-major order, zero-padded to a whole byte (numpy's
``packbits(unpackbits(.)[..., -bits:])``, as the reference packs), then the ``h`` scales as fp16:
``ceil(n * bits / 8) + 2 h`` bytes for ``n`` elements.

Error bound, per element: with ``t = x / d * 2^f`` unclipped (``-2^f <= t <= 2^f - 1/2``) the error is at most
``d_j / 2^(f+1) + |d_j - s_j|``; the top-clipped values (``t > 2^f - 1/2``: the channel's largest) lose at most
``d_j / 2^f * (1 + 2^(f-10)) + |d_j - s_j|`` (a whole step, plus the fp16 rounding of the max); add ``u |x_ij|``
for the rounding of ``x / d`` in x's dtype (``u``: its unit round-off, 2^-11 for fp16 input). Non-finite input:
an inf or NaN makes its channel's scale non-finite, and every element of that channel decodes to NaN or inf (as
in the reference); callers check the result.

Failure behaviour: ValueError for ``bits`` outside 1..8, a dtype that is not floating point, or a buffer whose size
is not :meth:`ChannelMaxQuantizer.wire_bytes`.
"""
from __future__ import annotations

from typing import Optional

import torch

BITS = range(1, 9)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"AQ-SGD's channel quantizer takes 1 to 8 bits per element, got {bits!r}")


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``x`` (``[..., h]``): codes ``q + 2^(bits-1)`` as uint8 in ``x``'s shape, one fp16
    scale per channel (see the module docstring)."""
    _check_bits(bits)
    if not x.is_floating_point():
        raise ValueError(f"AQ-SGD's channel quantizer needs a floating-point tensor, got {x.dtype}")
    f = bits - 1
    rows = x.reshape(-1, x.shape[-1])
    scale = rows.abs().amax(dim=0).half()  # amax in x's dtype, then fp16 (a max rounded down is clipped below)
    t = (rows / (scale + 1e-6)) * (2.0 ** f)  # an exact power-of-two scaling, as the reference's ldexp
    q = t.round().clamp(-(1 << f), (1 << f) - 1)
    return (q + (1 << f)).to(torch.uint8).view(x.shape), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 values of ``codes`` (``[..., h]``) with the channel scales ``scale`` (``[h]``, fp16)."""
    f = bits - 1
    return (codes.float() - (1 << f)) / (1 << f) * scale


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The low ``bits`` bits of each code, most significant first, row-major, zero-padded to whole bytes."""
    flat = codes.reshape(-1).to(torch.uint8)
    shifts = torch.arange(bits - 1, -1, -1, device=flat.device, dtype=torch.uint8)
    stream = ((flat.unsqueeze(1) >> shifts) & 1).reshape(-1)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)])
    weights = torch.arange(7, -1, -1, device=flat.device, dtype=torch.uint8)
    return (stream.view(-1, 8) << weights).sum(dim=1, dtype=torch.uint8)


def unpack(buf: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The ``numel`` codes :func:`pack` wrote into ``buf`` (uint8)."""
    shifts = torch.arange(7, -1, -1, device=buf.device, dtype=torch.uint8)
    stream = ((buf.reshape(-1).unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel * bits]
    weights = torch.arange(bits - 1, -1, -1, device=buf.device, dtype=torch.uint8)
    return (stream.view(numel, bits) << weights).sum(dim=1, dtype=torch.uint8)


class ChannelMaxQuantizer:
    """The quantizer as a message codec over tensors whose last dimension is ``channels`` (see the module
    docstring). It offers the part of :class:`megacomp.compression.Codec`'s interface AQ-SGD's caches use
    (``encode_flat``, ``decode_flat``, ``wire_bytes``, ``check_dtype``, ``is_identity``); ``decode_flat`` returns
    float32 whatever ``dtype`` says, because the reference adds the decoded delta to its cache in float32 and
    rounds once (megacomp.pipeline_parallel.aqsgd)."""

    is_identity = False

    def __init__(self, bits: int, channels: int) -> None:
        _check_bits(bits)
        if not isinstance(channels, int) or channels < 1:
            raise ValueError(f"AQ-SGD's channel quantizer needs channels >= 1 (the hidden size), got {channels!r}")
        self.bits, self.channels = bits, channels

    def __str__(self) -> str:
        return f"AQ-SGD channel-max int{self.bits} (one fp16 scale per hidden channel)"

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of one message of ``numel`` elements: packed codes, then one fp16 scale per channel."""
        return (numel * self.bits + 7) // 8 + 2 * self.channels

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ValueError unless ``dtype`` is floating point."""
        if not dtype.is_floating_point:
            raise ValueError(f"AQ-SGD's channel quantizer needs a floating-point tensor, got {dtype}")

    def _rows(self, numel: int) -> int:
        if numel % self.channels:
            raise ValueError(f"AQ-SGD's channel quantizer: {numel} elements are not whole rows of "
                             f"{self.channels} channels")
        return numel // self.channels

    def encode_flat(self, x: torch.Tensor, generator: Optional[torch.Generator] = None,
                    strict: bool = False) -> torch.Tensor:
        """The message for ``x`` (any shape ending in ``channels``; rows in row-major order). ``generator`` and
        ``strict`` are accepted for the codec interface and unused (rounding is deterministic)."""
        rows = x.reshape(self._rows(x.numel()), self.channels)
        codes, scale = quantize(rows, self.bits)
        return torch.cat([pack(codes, self.bits), scale.view(torch.uint8)])

    def decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``numel`` float32 values of message ``buf`` (flat, row-major)."""
        rows = self._rows(numel)
        if buf.numel() != self.wire_bytes(numel):
            raise ValueError(f"AQ-SGD's channel quantizer: a message of {buf.numel()} bytes, expected "
                             f"{self.wire_bytes(numel)} for {numel} elements at {self.bits} bits")
        split = buf.numel() - 2 * self.channels
        scale = buf[split:].clone().view(torch.float16)  # a copy: the slice may start at an odd byte
        codes = unpack(buf[:split], self.bits, numel).view(rows, self.channels)
        return dequantize(codes, scale, self.bits).reshape(-1)
