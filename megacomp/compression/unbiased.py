"""Unbiased compressors (E[C(x)] = x) for algorithms whose analysis needs them (LoCoDL, megacomp.outer.locodl).

Two families, each a thin layer over a megacomp codec so the bytes on the wire are the codec's, counted exactly:

  ``randk``   rand-k with the d/k scaling: per chunk of ``chunk`` elements, ``k`` positions drawn uniformly
              without replacement (megacomp.compression.sparse's ``select='randk'``: an 8-byte key on the wire, the
              receiver regenerates the positions), values sent exactly (fp32), and the decoder multiplies the kept
              values by ``chunk / k`` (a last, shorter chunk of r elements by ``max(r, k) / k``). Each entry is
              kept with probability k/chunk, so E[C(x)] = x and E||C(x) - x||^2 = (chunk/k - 1) ||x||^2 per
              chunk: omega = chunk / k - 1 (0 when k >= chunk).
  ``usq2``, ``usq4``, ``usq8``   unbiased stochastic quantisation at 2, 4 or 8 bits: megacomp's int2/int4/int8
              with one fp32 scale per ``block_size`` elements, s = amax / qmax (qmax = 1, 7, 127), and stochastic
              rounding q = floor(x / s + u), u uniform in [0, 1) (megacomp.compression.counter_rng), so
              E[q s] = x up to fp32 rounding (u sits on a 2^-24 grid; x / s is rounded once, and clamping to
              [-qmax, qmax] only removes that rounding). Per element the variance is at most s * |x| and s^2 / 4,
              so E||C(x) - x||^2 <= omega ||x||^2 with omega = min(B / (4 qmax^2), sqrt(B) / qmax) for blocks of
              B elements (the first from s^2/4 and amax <= ||x||, the second from s |x| summed and Cauchy-Schwarz).

The randomness of each encoding comes from the generator the caller passes (give every sender its own, seeded
apart, so compressors of different senders are independent, as LoCoDL's omega_av = omega / n assumes).

Failure behaviour: an unknown name, k < 1, k larger than the chunk (the message says to use k <= chunk, or a
bigger chunk), a block size < 1, or a bucket smaller than k (:meth:`UnbiasedCodec.check_numel`, naming the
fix) raise ValueError; a non-float input raises TypeError (the codec's check).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

import torch

from .codecs import Codec, build_from_spec, make_codec

UNBIASED_CODEC_NAMES = ("randk", "usq2", "usq4", "usq8")
"""Names of the unbiased compressors (``make_unbiased_codec``); ``none`` is the identity (omega 0)."""


@dataclass(frozen=True)
class UnbiasedCodec:
    """An unbiased compressor over a megacomp codec (see the module docstring). Build one with
    :func:`make_unbiased_codec`. Fields:"""

    name: str = "randk"
    """``randk`` (rand-k with the chunk/k scaling) or ``usq2`` / ``usq4`` / ``usq8`` (stochastic quantisation)."""
    k: int = 0
    """randk: entries kept per chunk (1 <= k <= chunk)."""
    chunk: int = 4096
    """randk: chunk length (at most 65536)."""
    block_size: int = 128
    """usq: elements per fp32 scale."""

    def __post_init__(self) -> None:
        if self.name not in UNBIASED_CODEC_NAMES:
            raise ValueError(f"unknown unbiased codec {self.name!r}; use one of {', '.join(UNBIASED_CODEC_NAMES)}")
        if self.name == "randk":
            if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
                raise ValueError(f"unbiased codec randk: k (entries kept per chunk) must be an int >= 1, got {self.k!r}")
            if self.k > self.chunk:
                raise ValueError(f"unbiased codec randk: k={self.k} is larger than the chunk of {self.chunk}; use "
                                 f"k <= chunk (or a larger chunk)")
        elif not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"unbiased codec {self.name}: block_size must be an int >= 1, got {self.block_size!r}")
        self.inner  # builds the codec now, so impossible settings fail here

    @property
    def inner(self) -> Codec:
        """The megacomp codec that produces the bytes."""
        if self.name == "randk":
            return make_codec("none", k=self.k, chunk=self.chunk, select="randk")
        return make_codec(f"int{self.name[3:]}", block_size=self.block_size, rounding="stochastic")

    @property
    def is_identity(self) -> bool:
        """Never: the identity is ``make_unbiased_codec('none')``, a plain Codec."""
        return False

    def omega(self, numel: int) -> float:
        """omega of E||C(x) - x||^2 <= omega ||x||^2 for a message of ``numel`` elements (module docstring)."""
        if self.name == "randk":
            return max(min(self.chunk, numel) / self.k - 1.0, 0.0)
        qmax = self.inner.format.qmax
        b = min(self.block_size, max(numel, 1))
        return min(b / (4 * qmax * qmax), b ** 0.5 / qmax)

    def check_numel(self, numel: int, where: str = "") -> None:
        """Raises ValueError when a rand-k message of ``numel`` elements is smaller than k (nothing to drop: the
        compressor would send every entry, which is a setting error, not compression)."""
        if self.name == "randk" and numel < self.k:
            raise ValueError(f"{where or 'unbiased codec randk'}: k={self.k} is larger than the bucket of {numel} "
                             f"elements; use k < {numel} (or codec none to send it whole)")

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes of one encoding (the inner codec's)."""
        return self.inner.wire_bytes(numel, dtype)

    def encode_flat(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """The uint8 buffer of ``x`` (any shape, row-major), random choices drawn from ``generator``."""
        return self.inner.encode_flat(x, generator)

    def decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The unbiased estimate of the encoded message: the inner decoding, rand-k values scaled by chunk / k."""
        y = self.inner.decode_flat(buf, numel, torch.float32)
        if self.name == "randk" and self.k < self.chunk:
            full = numel // self.chunk
            y[:full * self.chunk].mul_(self.chunk / self.k)
            rest = numel - full * self.chunk
            if rest > self.k:
                y[full * self.chunk:].mul_(rest / self.k)
        return y.to(dtype)

    def roundtrip(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``decode(encode(x))`` (flat, fp32): what a receiver of ``x`` sees."""
        return self.decode_flat(self.encode_flat(x, generator), x.numel())

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the name plus the fields that matter for it."""
        keep = ("k", "chunk") if self.name == "randk" else ("block_size",)
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self) if f.name in keep}}

    def __str__(self) -> str:
        return f"randk{self.k}/{self.chunk}x{self.chunk}/{self.k}" if self.name == "randk" else \
            f"{self.name}/b{self.block_size}"


def make_unbiased_codec(spec: Any = None, **options: Any):
    """An :class:`UnbiasedCodec` from a name (``'usq4'``), a mapping (``{name: randk, k: 64, chunk: 4096}``) or an
    UnbiasedCodec; ``None`` or ``'none'`` gives the identity Codec (omega 0).

    Raises:
        ValueError: unknown names or fields, or impossible settings (see the module docstring)."""
    if spec is None or spec == "none" or (isinstance(spec, Mapping) and spec.get("name") == "none" and len(spec) == 1):
        return make_codec("none")
    if isinstance(spec, Codec):
        if spec.is_identity:
            return spec
        raise ValueError(f"codec {spec} is not unbiased; use one of {', '.join(UNBIASED_CODEC_NAMES)} (or none)")
    if isinstance(spec, UnbiasedCodec) and not options:
        return spec
    if isinstance(spec, str) and spec not in UNBIASED_CODEC_NAMES:
        raise ValueError(f"unknown unbiased codec {spec!r}; use one of {', '.join(UNBIASED_CODEC_NAMES)} (or none)")
    return build_from_spec(UnbiasedCodec, spec, options, "unbiased codec",
                           "an unbiased codec mapping needs a 'name' (e.g. {name: randk, k: 64})")


def unbiased_name(spec: Any) -> Optional[str]:
    """The name of the unbiased compressor ``spec`` selects (an UnbiasedCodec, a name or a mapping with one of
    UNBIASED_CODEC_NAMES), else None: how a config tells LoCoDL's compressors from the value codecs."""
    if isinstance(spec, UnbiasedCodec):
        return spec.name
    name = spec.get("name") if isinstance(spec, Mapping) else spec.strip() if isinstance(spec, str) else None
    return name if name in UNBIASED_CODEC_NAMES else None


def omega_of(codec, numel: int) -> float:
    """omega of a codec from :func:`make_unbiased_codec` (0 for the identity)."""
    return 0.0 if codec.is_identity else codec.omega(numel)
