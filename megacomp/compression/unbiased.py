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
  ``natural`` natural compression (Horvath et al., "Natural compression for distributed deep learning", 2019):
              each entry x = sign * 2^e * (1 + m), m in [0, 1), becomes sign * 2^e with probability 1 - m and
              sign * 2^(e+1) with probability m, so E[C(x)] = x and the entry's variance is 4^e m (1 - m); over m
              in [0, 1), m (1 - m) / (1 + m)^2 peaks at m = 1/3 with value 1/8, so omega = 1/8 (attained when
              every |x| is 4/3 times a power of two). On the wire: the sign bit and the 8-bit biased fp32 exponent
              of the result (0 for a zero), 9 bits an entry: numel exponent bytes, then ceil(numel / 8) sign bytes.
              Entries below 2^-126 (fp32's smallest normal) round to 0 or 2^-126, still unbiased, with an error
              below 2^-126 but outside the relative bound; |x| >= 2^127 raises ValueError (no fp32 exponent
              above). One float64 uniform is drawn per entry whatever the dtype, so fp32 and fp64 inputs use the
              same stream.
  ``randk_natural``   rand-k, then natural compression of the kept values (the composition of the two): the
              rand-k key, then the kept values' 9-bit codes. Composition of independent unbiased compressors
              gives 1 + omega = (1 + omega_randk)(1 + 1/8): E||N(R x) - x||^2 = E||N(R x) - R x||^2 +
              E||R x - x||^2 <= (1/8) E||R x||^2 + omega_randk ||x||^2 and E||R x||^2 = (1 + omega_randk)||x||^2,
              so omega = 9/8 chunk / k - 1 (rand-1 + natural over d entries: 9 d / 8 - 1).

The randomness of each encoding comes from the generator the caller passes (give every sender its own, seeded
apart, so compressors of different senders are independent, as LoCoDL's omega_av = omega / n assumes).

Failure behaviour: natural compression of an entry >= 2^127 in magnitude or of a non-finite one, an unknown name, k < 1, k larger than the chunk (the message says to use k <= chunk, or a
bigger chunk), a block size < 1, or a bucket smaller than k (:meth:`UnbiasedCodec.check_numel`, naming the
fix) raise ValueError; a non-float input raises TypeError (the codec's check).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

import torch

from .codecs import Codec, build_from_spec, make_codec
from .packing import pack_bits, unpack_bits

UNBIASED_CODEC_NAMES = ("randk", "usq2", "usq4", "usq8", "natural", "randk_natural")
"""Names of the unbiased compressors (``make_unbiased_codec``); ``none`` is the identity (omega 0)."""


NATURAL_OMEGA = 1.0 / 8.0
"""omega of natural compression: max over m in [0, 1) of m (1 - m) / (1 + m)^2 (at m = 1/3)."""
_TINY = 2.0 ** -126  # fp32's smallest normal: the smallest power of two the 8-bit exponent code holds
_HUGE = 2.0 ** 127  # from here up, rounding up would need exponent 128 (fp32's infinity)


def natural_nbytes(numel: int) -> int:
    """Bytes of ``numel`` natural-compressed entries: one exponent byte each, then the sign bits."""
    return numel + (numel + 7) // 8


def natural_round(x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Natural compression of ``x`` (fp32 or fp64, any shape), in x's dtype: every entry stochastically rounded to
    one of the two powers of two around it, unbiased (module docstring); one float64 uniform an entry, drawn
    from ``generator`` on its own device. Raises ValueError for an entry >= 2^127 or not finite."""
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"natural compression takes fp32 or fp64, got {x.dtype}; cast the message first")
    ax = x.abs()
    if x.numel() and not bool((ax < _HUGE).all()):
        raise ValueError(f"natural compression: an entry is >= 2^127 in magnitude or not finite (max |x| = "
                         f"{float(ax.max()):.3g}); scale the message into fp32's range")
    where = generator.device if generator is not None else x.device
    return natural_round_with(x, torch.rand(x.shape, generator=generator, dtype=torch.float64, device=where).to(x.device))


def natural_round_with(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`natural_round` with the uniforms ``u`` (float64, x's shape) given: entry j rounds up when u_j < m_j
    (batched simulations draw each sender's uniforms from its own generator, then round all at once)."""
    ax = x.abs()
    mant, exp = torch.frexp(ax.double())  # |x| = mant 2^exp, mant in [0.5, 1): |x| = 2^(exp-1) (1 + m)
    m = 2 * mant - 1
    low = torch.ldexp(torch.ones_like(mant), exp - 1)
    rounded = torch.where(u < m, 2 * low, low)
    tiny = ax.double() < _TINY  # below fp32's normals (and zero): 0 or 2^-126, unbiased
    rounded = torch.where(tiny, torch.where(u < ax.double() / _TINY, _TINY, 0.0), rounded)
    return (torch.sign(x.double()) * rounded).to(x.dtype)


def natural_encode(x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The 9-bit codes of :func:`natural_round` (flat ``x``): exponent bytes, then packed sign bits."""
    r = natural_round(x.reshape(-1), generator)
    _, exp = torch.frexp(r.double())  # r = 0.5 * 2^exp: its exponent is exp - 1, biased by 127
    code = torch.where(r == 0, torch.zeros_like(exp), exp - 1 + 127).to(torch.uint8)
    return torch.cat([code, pack_bits((r < 0).to(torch.uint8), 1)])


def natural_decode(buf: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of :func:`natural_encode`'s ``numel`` codes. Raises ValueError for a buffer of another size."""
    if buf.numel() != natural_nbytes(numel):
        raise ValueError(f"natural compression: expected {natural_nbytes(numel)} bytes for {numel} entries, got "
                         f"{buf.numel()}")
    code = buf[:numel].to(torch.int32)
    sign = 1.0 - 2.0 * unpack_bits(buf[numel:].contiguous(), 1, numel).to(torch.float64)
    val = torch.where(code == 0, 0.0, torch.ldexp(torch.ones(numel, dtype=torch.float64, device=buf.device),
                                                  code - 127))
    return (sign * val).to(dtype)


@dataclass(frozen=True)
class UnbiasedCodec:
    """An unbiased compressor over a megacomp codec (see the module docstring). Build one with
    :func:`make_unbiased_codec`. Fields:"""

    name: str = "randk"
    """``randk`` (rand-k with the chunk/k scaling), ``usq2`` / ``usq4`` / ``usq8`` (stochastic quantisation),
    ``natural`` (stochastic rounding to powers of two) or ``randk_natural`` (rand-k, then natural)."""
    k: int = 0
    """randk, randk_natural: entries kept per chunk (1 <= k <= chunk)."""
    chunk: int = 4096
    """randk, randk_natural: chunk length (at most 65536)."""
    block_size: int = 128
    """usq: elements per fp32 scale."""

    def __post_init__(self) -> None:
        if self.name not in UNBIASED_CODEC_NAMES:
            raise ValueError(f"unknown unbiased codec {self.name!r}; use one of {', '.join(UNBIASED_CODEC_NAMES)}")
        if self.name in ("randk", "randk_natural"):
            if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
                raise ValueError(f"unbiased codec {self.name}: k (entries kept per chunk) must be an int >= 1, got "
                                 f"{self.k!r}")
            if self.k > self.chunk:
                raise ValueError(f"unbiased codec {self.name}: k={self.k} is larger than the chunk of {self.chunk}; use "
                                 f"k <= chunk (or a larger chunk)")
        elif self.name.startswith("usq") and not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"unbiased codec {self.name}: block_size must be an int >= 1, got {self.block_size!r}")
        self.inner  # builds the codec now, so impossible settings fail here

    @property
    def inner(self) -> Optional[Codec]:
        """The megacomp codec that produces the bytes (for randk_natural: the rand-k part; None for natural)."""
        if self.name == "natural":
            return None
        if self.name in ("randk", "randk_natural"):
            return make_codec("none", k=self.k, chunk=self.chunk, select="randk")
        return make_codec(f"int{self.name[3:]}", block_size=self.block_size, rounding="stochastic")

    @property
    def is_identity(self) -> bool:
        """Never: the identity is ``make_unbiased_codec('none')``, a plain Codec."""
        return False

    def omega(self, numel: int) -> float:
        """omega of E||C(x) - x||^2 <= omega ||x||^2 for a message of ``numel`` elements (module docstring)."""
        if self.name == "natural":
            return NATURAL_OMEGA
        if self.name in ("randk", "randk_natural"):
            randk = max(min(self.chunk, numel) / self.k - 1.0, 0.0)
            return randk if self.name == "randk" else (1 + randk) * (1 + NATURAL_OMEGA) - 1
        qmax = self.inner.format.qmax
        b = min(self.block_size, max(numel, 1))
        return min(b / (4 * qmax * qmax), b ** 0.5 / qmax)

    def check_numel(self, numel: int, where: str = "") -> None:
        """Raises ValueError when a rand-k message of ``numel`` elements is smaller than k (nothing to drop: the
        compressor would send every entry, which is a setting error, not compression)."""
        if self.name in ("randk", "randk_natural") and numel < self.k:
            raise ValueError(f"{where or 'unbiased codec ' + self.name}: k={self.k} is larger than the bucket of {numel} "
                             f"elements; use k < {numel} (or codec none to send it whole)")

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes of one encoding (the inner codec's; natural: 9 bits an entry, see the module docstring)."""
        if self.name == "natural":
            return natural_nbytes(numel)
        if self.name == "randk_natural":
            return 8 + natural_nbytes(self.kept(numel))
        return self.inner.wire_bytes(numel, dtype)

    def kept(self, numel: int) -> int:
        """randk, randk_natural: how many entries of a ``numel``-element message are sent."""
        full, rest = divmod(numel, self.chunk)
        return full * min(self.k, self.chunk) + min(rest, self.k)

    def encode_flat(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """The uint8 buffer of ``x`` (any shape, row-major), random choices drawn from ``generator``."""
        if self.name == "natural":
            return natural_encode(x.reshape(-1), generator)
        if self.name == "randk_natural":  # the key, then the kept values (fp32 or fp64) natural-compressed
            x = x if x.dtype in (torch.float32, torch.float64) else x.float()
            buf = self.inner.encode_flat(x, generator)
            return torch.cat([buf[:8], natural_encode(buf[8:].view(x.dtype), generator)])
        return self.inner.encode_flat(x, generator)

    def decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The unbiased estimate of the encoded message: the inner decoding, rand-k values scaled by chunk / k.
        rand-k encodings of fp64 messages carry fp64 values: decode them with ``dtype=torch.float64``."""
        if self.name == "natural":
            return natural_decode(buf, numel, dtype)
        if self.name == "randk_natural":  # back to a rand-k buffer of fp32 values (powers of two: exact)
            vals = natural_decode(buf[8:], self.kept(numel), torch.float32)
            buf = torch.cat([buf[:8], vals.view(torch.uint8)])
            dtype_inner = torch.float32
        else:
            dtype_inner = dtype if self.name == "randk" and dtype == torch.float64 else torch.float32
        y = self.inner.decode_flat(buf, numel, dtype_inner)
        if self.name in ("randk", "randk_natural") and self.k < self.chunk:
            full = numel // self.chunk
            y[:full * self.chunk].mul_(self.chunk / self.k)
            rest = numel - full * self.chunk
            if rest > self.k:
                y[full * self.chunk:].mul_(rest / self.k)
        return y.to(dtype)

    def roundtrip(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``decode(encode(x))`` (flat): what a receiver of ``x`` sees; fp64 for an fp64 ``x`` (rand-k values
        then travel in fp64, natural codes are exact powers of two), else fp32."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        return self.decode_flat(self.encode_flat(x, generator), x.numel(), dtype)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the name plus the fields that matter for it."""
        keep = ("k", "chunk") if self.name in ("randk", "randk_natural") else () if self.name == "natural" else \
            ("block_size",)
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self) if f.name in keep}}

    def __str__(self) -> str:
        if self.name in ("randk", "randk_natural"):
            tail = "+natural" if self.name == "randk_natural" else ""
            return f"randk{self.k}/{self.chunk}x{self.chunk}/{self.k}{tail}"
        return "natural" if self.name == "natural" else f"{self.name}/b{self.block_size}"


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
