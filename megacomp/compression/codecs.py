"""Codecs: a small frozen dataclass naming a wire format plus its scaling and rounding.

A codec is data: it can be written in YAML (``{name: int4, block_size: 64}``), stored in a checkpoint
(:meth:`Codec.to_dict`) and compared. ``encode`` turns a tensor of any shape and numel into a
:class:`Packet` holding one flat uint8 buffer of exactly ``wire_bytes(numel)`` bytes, scales
included; ``decode`` returns a tensor of the original shape and dtype.

Supported inputs: float32, bfloat16, float16 (and float64, computed in fp32) for every codec;
``none`` passes any dtype through. Error bounds per element are in :mod:`.quantize` (scaled
formats) and below (casts). Failure behaviour: unknown names, impossible option combinations,
unsupported dtypes and fp16 overflow raise ``ValueError``/``TypeError``/``OverflowError`` naming the
fix; inf/NaN inputs always decode to inf/NaN.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

import torch

from . import quantize, sparse, taco, transforms
from .formats import Format, get_format

ROUNDINGS = ("nearest", "stochastic")
_STRUCTURE_FIELDS = ("k", "chunk", "select", "transform")

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class Packet:
    """An encoded tensor: ``data`` is what goes on the wire, the rest is known to both ends."""

    data: torch.Tensor
    """Flat uint8 buffer, ``codec.wire_bytes(numel, dtype)`` bytes."""
    shape: torch.Size
    """Shape of the original tensor."""
    dtype: torch.dtype
    """Dtype of the original tensor (``decode`` returns this dtype)."""

    @property
    def numel(self) -> int:
        """Elements of the original tensor (product of ``shape``)."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the length of ``data``, scales included."""
        return self.data.numel()


@dataclass(frozen=True)
class Codec:
    """A wire format with its scaling and rounding.

    Build one with :func:`make_codec`. Fields:
    """

    name: str = "none"
    """Registered format name: none, bf16, fp16, fp8_e4m3, fp8_e5m2, int8, int4, int2, sign, or taco (TACO's codec,
    megacomp.compression.taco: there block_size is the fine-scale block, hadamard the largest reshape row, and
    dual_scale is always on)."""
    block_size: Optional[int] = None
    """Elements per scale. 0 = one scale for the whole tensor; None = the format's default (128 for
    scaled formats). Must be None for none/bf16/fp16, which carry no scale."""
    rounding: str = "nearest"
    """``nearest`` (round half to even) or ``stochastic`` (unbiased; int and sign formats only)."""
    dual_scale: bool = False
    """Coarse fp32 per-tensor scale times a one-byte power-of-two per-block scale (needs block_size > 0;
    int and float8 formats)."""
    hadamard: int = 0
    """Block size (a power of two) of a Walsh-Hadamard rotation applied before quantization and undone
    after decoding; 0 = off. Spreads outliers (see megacomp.compression.transforms); scaled formats only."""
    seed: Optional[int] = None
    """Seed of stochastic rounding (give each rank its own seed). A codec is a value, so it keeps no
    stream: ``encode(x)`` without a generator starts a fresh stream at the seed, a pure function of
    (x, seed). A stream that continues across calls belongs to its owner: a ``megacomp.comm.Channel``
    owns one (seeded from here, checkpointed with its state), or pass ``generator=``. None: use the
    generator passed to ``encode`` or torch's default generator."""
    k: int = 0
    """Entries kept per chunk (megacomp.compression.sparse); 0 = every entry (no selection). With ``k`` the
    codec's ``name`` is the format of the kept values (``none``: the input's dtype)."""
    chunk: Optional[int] = None
    """Chunk length of ``k`` and ``transform`` (at most 65536); None = 64 with ``transform='dct'`` (DeMo's
    chunk), 4096 otherwise. Must be None for a codec with no structure."""
    select: str = "topk"
    """How the ``k`` entries are chosen: ``topk`` (largest magnitudes; indices on the wire, 1 byte each for
    chunks <= 256, else 2) or ``randk`` (uniform, from a 64-bit key on the wire; E[decode] = k/chunk * x)."""
    transform: str = "none"
    """``dct``: a chunked orthonormal DCT-II before selection (inverted after decoding); ``none``: none."""

    def __post_init__(self) -> None:
        fmt = get_format(self.name)
        if fmt.kind == "taco":  # its own options and defaults (megacomp.compression.taco)
            return taco.configure(self)
        self._check_structure()
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"codec {self.name}: rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.hadamard:
            if not fmt.scaled:
                raise ValueError(f"codec {self.name!r}: hadamard rotation only helps scaled formats "
                                 f"(int8/int4/int2/sign/fp8_*); drop hadamard or pick one of those")
            transforms.check_size(self.hadamard)
        if not fmt.scaled:
            if self.block_size is not None or self.dual_scale:
                raise ValueError(
                    f"codec {self.name!r} is a plain cast with no scale; block_size/dual_scale do not apply "
                    f"(use int8 or fp8_e4m3 with block_size for a scaled format)")
            if self.rounding != "nearest":
                raise ValueError(f"codec {self.name!r} only rounds to nearest; use int8/int4 for stochastic rounding")
            return
        bs = fmt.default_block_size if self.block_size is None else self.block_size
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 0:
            raise ValueError(f"codec {self.name}: block_size must be an int >= 0 (0 = per tensor), got {self.block_size!r}")
        object.__setattr__(self, "block_size", bs)
        if self.rounding == "stochastic" and fmt.kind == "float8":
            raise ValueError(f"codec {self.name}: stochastic rounding is not implemented for float8 formats; "
                             f"use rounding='nearest' or an int codec")
        if self.dual_scale:
            if fmt.kind == "sign":
                raise ValueError("codec sign: dual_scale is not supported (its scale is a mean magnitude); "
                                 "use a smaller block_size instead")
            if bs == 0:
                raise ValueError(f"codec {self.name}: dual_scale needs block_size > 0 (the fine scale is per block)")

    def _check_structure(self) -> None:
        where = f"codec {self.name}"
        if self.select not in sparse.SELECTS:
            raise ValueError(f"{where}: select must be one of {sparse.SELECTS}, got {self.select!r}")
        if self.transform not in sparse.TRANSFORMS:
            raise ValueError(f"{where}: transform must be one of {sparse.TRANSFORMS}, got {self.transform!r}")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 0:
            raise ValueError(f"{where}: k (entries kept per chunk) must be an int >= 0, got {self.k!r}")
        if not self.structured:
            if self.chunk is not None:
                raise ValueError(f"{where}: chunk only applies with k > 0 or transform='dct'; set one or drop chunk")
            if self.select != "topk":
                raise ValueError(f"{where}: select={self.select!r} needs k > 0 (entries kept per chunk)")
            return
        chunk = (64 if self.transform == "dct" else 4096) if self.chunk is None else self.chunk
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= sparse.MAX_CHUNK:
            raise ValueError(f"{where}: chunk must be an int in [1, {sparse.MAX_CHUNK}] (indices are coded in "
                             f"16 bits within a chunk), got {self.chunk!r}")
        if self.k > chunk:
            raise ValueError(f"{where}: k={self.k} entries per chunk exceeds the chunk of {chunk}; use k <= chunk "
                             f"(k = chunk sends every entry)")
        if self.hadamard or self.dual_scale:
            raise ValueError(f"{where}: k/transform do not combine with hadamard or dual_scale; the kept values use "
                             f"per-block scales (block_size)")
        object.__setattr__(self, "chunk", chunk)

    # -- description -------------------------------------------------------------------------
    @property
    def structured(self) -> bool:
        """Whether the codec selects entries (``k > 0``) or transforms (``dct``) before the value format."""
        return bool(self.k) or self.transform != "none"

    @property
    def format(self) -> Format:
        """The registered wire format behind ``name`` (kind, bits, range, default block size)."""
        return get_format(self.name)

    @property
    def is_identity(self) -> bool:
        """True for ``none``: collectives then call torch.distributed directly."""
        return self.format.kind == "identity" and not self.structured

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form for YAML and checkpoints; ``make_codec(d)`` rebuilds an equal codec. The structure
        fields (k, chunk, select, transform) appear only for a structured codec, so the form of every other
        codec, and the checkpoints that record it, are what they were before those fields existed."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        if not self.structured:
            for name in _STRUCTURE_FIELDS:
                del out[name]
        return out

    def __str__(self) -> str:
        if self.format.kind == "taco":
            return taco.describe(self)
        if self.structured:
            parts = [str(sparse.value_codec(self))]
            if self.k:
                parts.append(f"{self.select}{self.k}/{self.chunk}")
            if self.transform != "none":
                parts.append(f"{self.transform}{self.chunk}")
            return "+".join(parts)
        if not self.format.scaled:
            return self.name
        parts = [self.name, f"b{self.block_size}" if self.block_size else "tensor"]
        if self.dual_scale:
            parts.append("dual")
        if self.rounding == "stochastic":
            parts.append("sr")
        if self.hadamard:
            parts.append(f"h{self.hadamard}")
        return "/".join(parts)

    # -- sizes ---------------------------------------------------------------------------------
    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes ``encode`` produces for ``numel`` elements of ``dtype`` (scales included).

        ``dtype`` only matters for ``none``, which sends the input's own bytes.
        """
        fmt = self.format
        if self.structured:
            return sparse.wire_bytes(self, numel, dtype)
        if fmt.kind == "identity":
            return numel * torch.empty((), dtype=dtype).element_size()
        if fmt.kind == "cast":
            return numel * fmt.bits // 8
        if fmt.kind == "taco":
            return taco.wire_bytes(self, numel)
        if self.hadamard and numel:
            numel = transforms.padded_numel(numel, self.hadamard)
        return quantize.scale_nbytes(numel, self.block_size, self.dual_scale) + quantize.payload_nbytes(numel, fmt)

    # -- encode / decode -----------------------------------------------------------------------
    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raises TypeError for a lossy codec and a non-float dtype, naming the fix (codec none)."""
        if not self.is_identity and dtype not in FLOAT_DTYPES:
            raise TypeError(f"codec {self.name!r} encodes floating tensors (float32, bfloat16, float16, float64), "
                            f"got {dtype}; use codec='none' for other dtypes")

    def stream(self, generator: Optional[torch.Generator] = None) -> Optional[torch.Generator]:
        """The generator stochastic rounding draws from: ``generator`` when given; else, for a seeded
        stochastic codec, a new CPU generator at ``seed`` (the caller keeps it to continue the stream);
        else None (torch's default generator)."""
        if generator is not None or self.seed is None or self.rounding != "stochastic":
            return generator
        g = torch.Generator()
        g.manual_seed(self.seed)
        return g

    def encode_flat(self, x: torch.Tensor, generator: Optional[torch.Generator] = None,
                    out: Optional[torch.Tensor] = None, strict: bool = True) -> torch.Tensor:
        """Encode the elements of ``x`` (any shape, read in row-major order) into a flat uint8 buffer
        (``out``: a reusable buffer of ``wire_bytes(numel)`` bytes; used by the fused kernels).

        ``strict=False`` lets fp16 overflow become inf instead of raising: collectives use it, because a
        reduced sum can overflow on one rank only, and raising there would leave the other ranks waiting;
        the inf then reaches every rank, where a loss scaler's overflow check sees it."""
        self.check_dtype(x.dtype)
        fmt = self.format
        flat = x.reshape(-1)
        if self.structured:
            return sparse.encode(self, flat, generator, strict)
        if fmt.kind == "identity":
            return flat.contiguous().view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        if fmt.kind == "cast":
            y = _to_fp16_checked(flat) if fmt.dtype == torch.float16 and strict else flat.to(fmt.dtype)
            return y.contiguous().view(torch.uint8)
        if fmt.kind == "taco":
            return taco.encode(self, flat)
        if self.hadamard and flat.numel():
            x32 = transforms.rotate(flat, self.hadamard)
        elif flat.is_cuda and flat.dtype in (torch.bfloat16, torch.float16):
            x32 = flat  # the Triton kernels read half inputs directly (exactly as their fp32 values)
        else:
            x32 = flat.to(torch.float32)
        return quantize.encode_scaled(x32, fmt, self.block_size, self.dual_scale,
                                      self.rounding == "stochastic", self.stream(generator), out=out)

    def decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32,
                    rotated: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decode a buffer from :meth:`encode_flat` into a 1-D tensor of ``numel`` elements of ``dtype``.

        With a Hadamard codec and ``rotated=True`` the values stay in the rotated basis (fp32, padded to a
        multiple of the rotation size): sums of such decodings are rotated back once with :meth:`unrotate`.
        Structured codecs (``k``, ``transform``) always decode to the original basis.
        """
        if self.structured:
            return sparse.decode(self, buf, numel, dtype)
        if self.format.kind == "taco":  # always the original basis (each rank's rows are transformed its own way)
            return taco.decode(self, buf, numel, dtype)
        expected = self.wire_bytes(numel, dtype)
        if buf.dtype != torch.uint8 or buf.numel() != expected:
            raise ValueError(f"codec {self}: expected a uint8 buffer of {expected} bytes for {numel} elements, "
                             f"got {buf.dtype} with {buf.numel()} bytes")
        fmt = self.format
        if fmt.kind in ("identity", "cast"):
            wire_dtype = dtype if fmt.kind == "identity" else fmt.dtype
            if numel == 0:
                return torch.empty(0, dtype=dtype, device=buf.device)
            itemsize = torch.empty((), dtype=wire_dtype).element_size()
            if buf.storage_offset() % itemsize:
                buf = buf.clone()
            return buf.view(wire_dtype).to(dtype)
        if self.hadamard and numel:
            padded = transforms.padded_numel(numel, self.hadamard)
            y = quantize.decode_scaled(buf, padded, fmt, self.block_size, self.dual_scale)
            return y if rotated else self.unrotate(y, numel).to(dtype)
        if out is not None and dtype == torch.float32:
            return quantize.decode_scaled(buf, numel, fmt, self.block_size, self.dual_scale, out=out)
        if buf.is_cuda and dtype in (torch.bfloat16, torch.float16):  # the Triton kernels write half directly
            out = torch.empty(numel, dtype=dtype, device=buf.device)
            return quantize.decode_scaled(buf, numel, fmt, self.block_size, self.dual_scale, out=out)
        return quantize.decode_scaled(buf, numel, fmt, self.block_size, self.dual_scale).to(dtype)

    def decode_accumulate(self, buf: torch.Tensor, numel: int, acc: torch.Tensor) -> torch.Tensor:
        """``acc += decode_flat(buf, numel, fp32, rotated=True)`` in one fused pass where a kernel exists
        (the reduce side of reduce-scatter); ``acc`` is fp32 with the decoded (rotated, padded) length."""
        fmt = self.format
        if fmt.scaled and not (fmt.kind == "sign") and not self.structured and buf.numel() == self.wire_bytes(numel):
            padded = transforms.padded_numel(numel, self.hadamard) if self.hadamard and numel else numel
            return quantize.decode_scaled(buf, padded, fmt, self.block_size, self.dual_scale, accumulate_into=acc)
        return acc.add_(self.decode_flat(buf, numel, rotated=True))

    def unrotate(self, rotated: torch.Tensor, numel: int) -> torch.Tensor:
        """Back from the rotated basis: the first ``numel`` elements, fp32 (identity without hadamard)."""
        if not self.hadamard or numel == 0 or self.format.kind == "taco":  # taco decodes to the original basis
            return rotated[:numel]
        return transforms.unrotate(rotated, self.hadamard, numel)

    def encode(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> Packet:
        """Encode ``x``; ``generator`` drives stochastic rounding (else the codec's seed, else torch's)."""
        return Packet(self.encode_flat(x, generator), x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        """Return a new tensor of the packet's shape and dtype (never a view of the packet or the input)."""
        y = self.decode_flat(packet.data, packet.numel, packet.dtype).view(packet.shape)
        return y.clone() if self.is_identity else y

    def roundtrip(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``decode(encode(x))``: what the receiver of ``x`` sees."""
        return self.decode(self.encode(x, generator))


def _to_fp16_checked(flat: torch.Tensor) -> torch.Tensor:
    """Cast to fp16, raising if a finite input became inf (one extra pass only when an inf appears)."""
    y = flat.to(torch.float16)
    # host sync: the fp16 cast codec's strict mode decides whether to raise (collectives pass strict=False)
    if flat.dtype != torch.float16 and bool(torch.isinf(y).any()):
        overflow = torch.isinf(y) & torch.isfinite(flat)
        if bool(overflow.any()):
            worst = flat[overflow].abs().max().item()
            raise OverflowError(
                f"codec fp16: finite values up to {worst:.3g} exceed the fp16 range (65504) and would become "
                f"inf; use bf16, or a scaled codec such as fp8_e5m2/int8, or scale the tensor first")
    return y


CodecLike = Union[None, str, Codec, Mapping[str, Any]]


def make_codec(codec: CodecLike = None, **options: Any) -> Codec:
    """Build a codec from a name, a mapping (YAML), an existing codec or None (= ``none``).

    ``make_codec("int4", block_size=128, rounding="nearest")``. Extra keyword options override the
    mapping's or codec's fields. Raises ValueError for unknown names or options.
    """
    if codec is None:
        codec = "none"
    if isinstance(codec, Codec) and not options:
        return codec
    return build_from_spec(Codec, codec, options, "codec", "a codec mapping needs a 'name' (e.g. {name: int4, block_size: 128})")


def build_from_spec(cls, spec: Any, options: Mapping[str, Any], what: str, missing_name: str = ""):
    """``cls(**fields)`` from a name (``{"name": spec}``), a mapping (YAML), or an instance (its ``to_dict()``),
    with ``options`` overriding fields: the one parser of codec-like settings (codecs, PowerSGD, Accordion).
    Raises TypeError for another kind of spec and ValueError naming unknown fields (and the allowed ones)
    or, with ``missing_name``, a mapping without a name."""
    if isinstance(spec, cls):
        base = spec.to_dict()
    elif isinstance(spec, str):
        base = {"name": spec}
    elif isinstance(spec, Mapping):
        base = dict(spec)
    else:
        raise TypeError(f"a {what} is a name, a mapping or a {cls.__name__}, got {type(spec).__name__}")
    base.update(options)
    allowed = {f.name for f in fields(cls) if f.init}
    unknown = set(base) - allowed
    if unknown:
        raise ValueError(f"unknown {what} option(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    if missing_name and "name" not in base:
        raise ValueError(missing_name)
    return cls(**base)
