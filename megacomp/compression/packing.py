"""Sub-byte packing of unsigned codes.

A code of ``bits`` bits (1, 2, 4 or 8) is an unsigned integer in ``[0, 2**bits)`` held in a uint8
tensor. ``pack_bits`` stores ``8 // bits`` codes per byte, the first code in the least significant
bits; ``unpack_bits`` inverts it exactly. Both are pure tensor ops (no Python loops over elements) so
that ``torch.compile`` can fuse them; the interleave uses a broadcast shift rather than ``torch.stack``
because the latter defeats inductor's vectorisation (research/platform.md §6).
"""
from __future__ import annotations

import torch

SUPPORTED_BITS = (1, 2, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"packing supports {SUPPORTED_BITS} bits per code, got {bits}")


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed to hold ``numel`` codes of ``bits`` bits (the last byte may be partly unused).
    Raises ValueError when ``bits`` is not in ``SUPPORTED_BITS``."""
    _check_bits(bits)
    return (numel * bits + 7) // 8


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of codes (< 2**bits) into ``packed_nbytes(numel, bits)`` bytes.

    Codes are not range-checked here (callers produce them from clamped integers); bits above
    ``bits`` would corrupt the neighbouring code. With ``bits == 8`` the input itself is returned (no copy).

    Raises:
        ValueError: ``bits`` is not in ``SUPPORTED_BITS``.
        TypeError: ``codes`` is not a 1-D uint8 tensor.
    """
    _check_bits(bits)
    if codes.dtype != torch.uint8 or codes.dim() != 1:
        raise TypeError(f"pack_bits expects a 1-D uint8 tensor, got {codes.dtype} with shape {tuple(codes.shape)}")
    if bits == 8:
        return codes
    per = 8 // bits
    n = codes.numel()
    pad = (-n) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    grouped = codes.view(-1, per) << _shifts(bits, codes.device)
    # The shifted codes occupy disjoint bits, so their sum is their bitwise OR; sum in int16 to avoid
    # uint8 promotion surprises and cast back.
    return grouped.to(torch.int16).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: return the first ``numel`` codes as a 1-D uint8 tensor (with
    ``bits == 8`` a view of ``packed``).

    Raises:
        ValueError: ``bits`` is not in ``SUPPORTED_BITS``, or ``packed`` holds fewer than
            ``packed_nbytes(numel, bits)`` bytes.
        TypeError: ``packed`` is not a 1-D uint8 tensor.
    """
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError(f"unpack_bits expects a 1-D uint8 tensor, got {packed.dtype} with shape {tuple(packed.shape)}")
    need = packed_nbytes(numel, bits)
    if packed.numel() < need:
        raise ValueError(f"unpack_bits: {numel} codes of {bits} bits need {need} bytes, got {packed.numel()}")
    if bits == 8:
        return packed[:numel]
    mask = (1 << bits) - 1
    codes = (packed[:need].unsqueeze(-1) >> _shifts(bits, packed.device)) & mask
    return codes.reshape(-1)[:numel]
