"""Compression quality measures used by tests, benchmarks and training logs."""
from __future__ import annotations

import torch


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """``||x - y|| / ||x||`` in fp64 (0 when both are zero, inf when only x is zero)."""
    x64, y64 = x.double(), y.double()
    num = torch.linalg.vector_norm(x64 - y64).item()
    den = torch.linalg.vector_norm(x64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def underflow_fraction(x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of the non-zero elements of ``x`` that decode to exactly zero in ``y``."""
    nz = x != 0
    count = int(nz.sum())
    if count == 0:
        return 0.0
    return int((nz & (y == 0)).sum()) / count
