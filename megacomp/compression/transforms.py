"""Block Hadamard rotation: spreads outliers before quantization (TACO / QuaRot style).

``rotate(x, B)`` pads the flat tensor with zeros to a multiple of ``B`` (a power of two) and multiplies
each block of ``B`` by the orthonormal Walsh-Hadamard matrix ``H_B / sqrt(B)``; ``unrotate`` applies
the same matrix again (it is symmetric and orthogonal, so it is its own inverse) and drops the
padding. Because the rotation is linear, partial sums can be reduced in the rotated space and
rotated back once. Round-off: ``unrotate(rotate(x))`` equals ``x`` to a few fp32 ulps of the block norm.

Why it helps: a block with one outlier of size ``a`` among near-zero values has ``amax/rms ~ sqrt(B)``;
after rotation the energy is spread evenly (``amax/rms`` of a Gaussian), so a shared absmax scale
wastes far fewer levels and the overall relative error drops. Near-zero values that sit next to an
outlier in the same block are mixed with it, so per-element error on them does not improve: dual or
smaller-block scaling is the tool for those.
"""
from __future__ import annotations

import functools

import torch


def check_size(size: int) -> None:
    """Raises ValueError unless ``size`` is a power of two >= 2 (a valid Hadamard block size)."""
    if size < 2 or size & (size - 1):
        raise ValueError(f"hadamard block size must be a power of two >= 2, got {size}")


@functools.lru_cache(maxsize=16)
def _matrix(size: int, device_type: str) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / size ** 0.5).to(device_type)


def padded_numel(numel: int, size: int) -> int:
    """``numel`` rounded up to a multiple of ``size``."""
    return -(-numel // size) * size


def rotate(flat: torch.Tensor, size: int) -> torch.Tensor:
    """fp32 rotation of a flat tensor, padded to a multiple of ``size``.

    Each block of ``size`` elements is multiplied by ``H / sqrt(size)`` (orthonormal, so norms are kept up
    to fp32 round-off). ``size`` is not checked here: call :func:`check_size` first (with a size > 2 that
    is not a power of two the matmul raises RuntimeError).
    """
    x = flat.reshape(-1).to(torch.float32)
    pad = padded_numel(x.numel(), size) - x.numel()
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return (x.view(-1, size) @ _matrix(size, x.device.type)).reshape(-1)


def unrotate(rotated: torch.Tensor, size: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`rotate`: the first ``numel`` elements in the original basis (fp32).

    ``unrotate(rotate(x))`` equals ``x`` to a few fp32 ulps of the block norm. ``rotated.numel()`` must be a
    multiple of ``size`` (torch raises RuntimeError otherwise).
    """
    return (rotated.view(-1, size) @ _matrix(size, rotated.device.type)).reshape(-1)[:numel]
