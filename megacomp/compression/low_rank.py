"""PowerSGD low-rank compression (Vogels et al., 2019): the settings as data, and the local linear algebra.

A gradient tensor of shape ``(n, d1, d2, ...)`` is read as an ``n x m`` matrix ``M`` (``m = d1 * d2 * ...``).
One step of rank ``r`` over N ranks (the exchange lives in megacomp.comm.low_rank_channel):

  1. compensate: ``H_i = M_i + E_i`` (error feedback, ``E_i`` = what rank i's last approximation missed);
  2. ``P_i = H_i Q``, with ``Q`` (``m x r``) the previous step's ``Q`` (warm start) or, on the first step
     (every step without warm start), a Gaussian matrix seeded from the settings' seed, the tensor's key
     and the draw number (identical on every rank);
  3. all-reduce ``P = sum_i P_i`` and orthonormalise its columns: ``P̂`` (reduced QR; Householder, so a
     rank-deficient ``P`` still gives orthonormal columns, where Gram-Schmidt would divide by ~0);
  4. ``Q_i = H_i^T P̂``, all-reduce ``Q = sum_i Q_i``;
  5. deliver ``P̂ Q^T = P̂ P̂^T sum_i H_i`` (the sum projected onto the span of ``P̂``); keep ``Q`` for step 2;
  6. error feedback: ``E_i = H_i - P̂ Q_i^T`` (rank i's own part of the approximation, as in the paper's
     Algorithm 2; torch's hook subtracts the averaged approximation instead). The sum over ranks of what is
     delivered plus the new errors then equals the sum of the ``H_i`` exactly, so the errors telescope:
     ``sum_t delivered_t + sum_i E_i,T = sum_t sum_i M_i,t``.

With a lossy ``factor_codec`` the decoded ``Q`` sum replaces the exact one in step 5, and its quantisation error
is not fed back (the residual uses the exact ``Q_i``): the telescoping and projection statements below then
hold only up to the factor codec's error.

Wire: ``(n + m) r`` factor elements per matrix instead of ``n m`` (each all-reduced, in fp32 or in the
``factor_codec``). A matrix is compressed only when ``n m >= min_compression_rate (n + m) r``; 1-D tensors
and matrices below that rate are all-reduced uncompressed, as one flat buffer per call.

Error bound: the delivered matrix is an orthogonal projection of the exact sum, so
``||sum H - delivered||_F <= ||sum H||_F`` (a contraction, meant to run with error feedback). With
``r >= min(n, m)`` and a full-rank ``P`` the projection is the identity: the result equals the uncompressed
sum up to fp32 round-off of the products and the QR.

Failure behaviour: ``rank <= 0``, a negative compression rate or an unknown field raise ValueError when the
settings are built; non-float tensors raise TypeError at the call. Non-finite inputs make ``P`` non-finite
on every rank, so every rank delivers inf/NaN (the optimizer's overflow check then skips the step), the
error feedback drops that residual and the non-finite ``Q`` is not kept (the next step draws a fresh start).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

import torch

from .codecs import CodecLike, build_from_spec, make_codec
from .error_feedback import data_numel


class StructuredCompressor:
    """What PowerSGD and Accordion settings answer where a path's ``Codec`` is asked: never the identity, and
    not a plain element format (so DeMo and the element-wise collectives refuse them)."""

    @property
    def is_identity(self) -> bool:
        """Never the identity (a lossy compressor)."""
        return False

    @property
    def structured(self) -> bool:
        """Compresses by structure (not element by element)."""
        return True


@dataclass(frozen=True)
class PowerSGD(StructuredCompressor):
    """Settings of PowerSGD low-rank compression (YAML: ``{name: powersgd, rank: 4}``)."""

    name: str = "powersgd"
    """Always ``powersgd`` (names the compressor in YAML and checkpoints)."""
    rank: int = 4
    """Rank ``r`` of the approximation (torch's ``matrix_approximation_rank``); capped at ``min(n, m)``."""
    factor_codec: CodecLike = None
    """Value codec of the P and Q all-reduces (None: fp32; e.g. bf16 halves the factor bytes)."""
    error_feedback: bool = True
    """Keep each rank's residual ``E_i`` and add it to the next gradient (the paper's error feedback)."""
    warm_start: bool = True
    """Start each step's power iteration from the previous step's ``Q`` (False: a fresh seeded matrix per step)."""
    min_compression_rate: float = 2.0
    """Compress a matrix only when ``n m >= rate (n + m) r`` (torch's default 2); 0 compresses every matrix."""
    init_seed: int = 0
    """Seed of the initial Gaussian ``Q`` matrices (the same on every rank; never offset per rank)."""

    def __post_init__(self) -> None:
        if self.name != "powersgd":
            raise ValueError(f"PowerSGD settings have name 'powersgd', got {self.name!r}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise ValueError(f"powersgd: rank must be an int >= 1 (the approximation rank), got {self.rank!r}")
        if not isinstance(self.min_compression_rate, (int, float)) or self.min_compression_rate < 0:
            raise ValueError(f"powersgd: min_compression_rate must be a number >= 0, got {self.min_compression_rate!r}")
        codec = make_codec(self.factor_codec)
        if codec.structured:
            raise ValueError(f"powersgd: factor_codec must be a dense value codec (bf16, int8, ...), got {codec}; "
                             f"top-k or DCT of the factors is not supported")
        object.__setattr__(self, "factor_codec", codec)

    # -- the Codec-like surface channels and configs read ---------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data for YAML and checkpoints (``make_low_rank`` rebuilds an equal value)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["factor_codec"] = None if self.factor_codec.is_identity else self.factor_codec.to_dict()
        return out

    def __str__(self) -> str:
        factor = "" if self.factor_codec.is_identity else f"/{self.factor_codec}"
        return f"powersgd{self.rank}{factor}{'+ef' if self.error_feedback else ''}"

    # -- per-matrix decisions --------------------------------------------------------------------------
    def rank_for(self, shape) -> int:
        """The rank used for a tensor of ``shape``: ``min(rank, n, m)``, or 0 when it travels uncompressed
        (1-D, empty, or below ``min_compression_rate``)."""
        mat = matrix_shape(shape)
        if mat is None:
            return 0
        n, m = mat
        r = min(self.rank, n, m)
        return r if n * m >= self.min_compression_rate * (n + m) * r else 0

    def wire_numel(self, shape) -> int:
        """Elements all-reduced for a tensor of ``shape``: ``(n + m) r`` when compressed, else its numel."""
        r = self.rank_for(shape)
        if not r:
            return data_numel(shape)
        n, m = matrix_shape(shape)
        return (n + m) * r


def matrix_shape(shape) -> Optional[tuple[int, int]]:
    """``(shape[0], product of the rest)`` for tensors of 2+ dimensions and nonzero size, else None."""
    if len(shape) < 2 or data_numel(shape) == 0:
        return None
    return int(shape[0]), data_numel(shape) // int(shape[0])


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p``'s (``n x r``, fp32) column space: the Q of a reduced QR.

    Deterministic for the same input on the same device, so ranks holding the same all-reduced ``p`` get
    the same result; column signs may differ from Gram-Schmidt's, which leaves ``P̂ P̂^T`` unchanged."""
    return torch.linalg.qr(p, mode="reduced").Q


def initial_q(m: int, r: int, seed: int, device) -> torch.Tensor:
    """A seeded ``m x r`` Gaussian start matrix (drawn on the CPU, so it is the same on every device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, r, generator=g, dtype=torch.float32).to(device)


def q_seed(init_seed: int, key: str, draw: int = 0) -> int:
    """Seed of the ``draw``-th start matrix of ``key``: a pure function of the settings' seed and the key
    (crc32), so every rank draws the same matrix whatever order it meets its keys in."""
    return (init_seed * 1_000_003 + zlib.crc32(key.encode()) * 7919 + draw) % (1 << 63)


def is_low_rank(spec: Any) -> bool:
    """Whether ``spec`` names a PowerSGD compressor (a PowerSGD, ``'powersgd'`` or a mapping with that name)."""
    if isinstance(spec, PowerSGD):
        return True
    if isinstance(spec, str):
        return spec == "powersgd"
    return isinstance(spec, Mapping) and spec.get("name") == "powersgd"


def make_low_rank(spec: Any, **options: Any) -> PowerSGD:
    """Build :class:`PowerSGD` from ``'powersgd'``, a mapping (YAML) or a PowerSGD; extra keyword options
    override fields. Raises ValueError naming unknown fields and the allowed ones."""
    return build_from_spec(PowerSGD, spec, options, "powersgd")

