"""Number formats a codec can put on the wire, and their registry.

A format says how one element is represented; a :class:`~megacomp.compression.codecs.Codec` adds the
scaling (per tensor / per block / dual), the rounding mode and the block size.

Kinds:
  ``identity``  the input's own bytes (``none``)
  ``cast``      a plain dtype cast, no scale (``bf16``, ``fp16``)
  ``int``       symmetric integers in ``[-qmax, qmax]``, ``qmax = 2**(bits-1) - 1``, absmax scaled
  ``sign``      one bit per element, with a per-block magnitude
  ``float8``    torch float8 dtypes, absmax scaled so the block maximum maps to the format's maximum
  ``taco``      TACO's codec (megacomp.compression.taco): fp8 e4m3 after its own reshape and transform
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

KINDS = ("identity", "cast", "int", "sign", "float8", "taco")


@dataclass(frozen=True)
class Format:
    """One wire format.

    Attributes:
        kind: one of ``KINDS``.
        bits: bits per element in the payload (0 for ``identity``: the input dtype decides).
        qmax: largest magnitude after scaling (int: ``2**(bits-1)-1``; float8: the dtype's max; sign: 1).
        dtype: the torch dtype of the payload for ``cast`` and ``float8`` kinds, else None.
        default_block_size: block size a codec uses when none is given (None: not scaled).
        rel_precision: unit round-off of the element format (half an ulp relative to the value) for
            ``cast``/``float8``; 0 for the others. Used to state error bounds.
        min_subnormal: smallest positive value of the element format (``cast``/``float8``), else 0.
    """

    kind: str
    bits: int
    qmax: float
    dtype: Optional[torch.dtype] = None
    default_block_size: Optional[int] = None
    rel_precision: float = 0.0
    min_subnormal: float = 0.0

    @property
    def scaled(self) -> bool:
        """Whether encoded tensors carry scales (int, sign and float8 kinds)."""
        return self.kind in ("int", "sign", "float8")


def _float_format(kind: str, dtype: torch.dtype, block: Optional[int]) -> Format:
    fi = torch.finfo(dtype)
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10, torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    return Format(kind, fi.bits, float(fi.max), dtype, block, 2.0 ** -(mantissa_bits + 1), float(fi.smallest_normal) * 2.0 ** -mantissa_bits)


FORMATS: dict[str, Format] = {
    "none": Format("identity", 0, float("inf")),
    "bf16": _float_format("cast", torch.bfloat16, None),
    "fp16": _float_format("cast", torch.float16, None),
    "fp8_e4m3": _float_format("float8", torch.float8_e4m3fn, 128),
    "fp8_e5m2": _float_format("float8", torch.float8_e5m2, 128),
    "int8": Format("int", 8, 127.0, None, 128),
    "int4": Format("int", 4, 7.0, None, 128),
    "int2": Format("int", 2, 1.0, None, 128),
    "sign": Format("sign", 1, 1.0, None, 128),
    "taco": Format("taco", 8, 448.0, torch.float8_e4m3fn, 128, 2.0 ** -4, 2.0 ** -9),
}


def register_format(name: str, fmt: Format) -> None:
    """Add a format under ``name`` so that ``make_codec(name)`` and YAML configs can use it.

    Raises ValueError if the name is taken or the kind is unknown (the codec layer has no code for it).
    """
    if name in FORMATS:
        raise ValueError(f"codec format {name!r} is already registered")
    if fmt.kind not in KINDS:
        raise ValueError(f"format kind must be one of {KINDS}, got {fmt.kind!r}")
    FORMATS[name] = fmt


def get_format(name: str) -> Format:
    """The registered format called ``name``. Raises ValueError for an unknown name (listing the known)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known codecs: {', '.join(sorted(FORMATS))}") from None
