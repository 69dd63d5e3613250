"""Codecs by structure: top-k and random-k per chunk, optionally after a chunked DCT.

A codec with ``k > 0`` or ``transform='dct'`` (see :class:`~megacomp.compression.codecs.Codec`) encodes a
flat message in four steps:

  1. transform: ``dct`` cuts the message into chunks of ``chunk`` elements (the last one zero-padded) and
     replaces each by its orthonormal DCT-II coefficients (megacomp.compression.dct); ``none`` keeps the
     elements (the last chunk may be short);
  2. select (only with ``k > 0``): per chunk, ``topk`` keeps the ``k`` entries of largest magnitude (ties:
     torch.topk's choice, the same for the same input on the same device), ``randk`` keeps ``k`` entries
     drawn uniformly without replacement from a 64-bit key; a chunk shorter than ``k`` keeps all of it.
     Kept positions are sorted ascending within the chunk, so the payload is canonical;
  3. values: the kept entries, concatenated chunk after chunk, go through the dense value codec named by
     the codec's ``name`` (``none``: the input's dtype; ``bf16``/``fp16``; int/fp8/sign with their block
     scales over the kept values, stochastic rounding included);
  4. bytes: ``[indices][values]`` for ``topk`` (one byte per index for chunks of at most 256, else two),
     ``[key: 8 bytes][values]`` for ``randk`` (the receiver regenerates the positions from the key).

Decoding scatters the values back into zero chunks and inverts the transform (fp32; fp64 input stays
fp64), then casts to the message's dtype.

Error bound: with ``k = chunk`` and ``name='none'`` the codec is exact for the plain layout and exact up to
fp32 round-off of the two transforms with ``dct`` (a few ulps of the chunk norm). Otherwise the error of a
chunk is the part it drops (for ``topk``: the ``chunk - k`` entries of smallest magnitude, so
``||x - x̂||² <= (1 - k/chunk)·||x||²``; for ``randk``: ``E||x - x̂||² = (1 - k/chunk)·||x||²``, and
``E[x̂] = (k/chunk)·x``, a biased but contractive compressor, meant to run with error feedback) plus the
value codec's bound on the kept entries. With ``dct`` both statements hold in the coefficient basis and
carry over because the transform is orthonormal.

Failure behaviour: impossible settings (``k > chunk``, a chunk above 65536, a structure together with
Hadamard rotation or dual scales, ``select='randk'`` with ``k = 0``) raise ValueError when the codec is built; a buffer of the
wrong size raises ValueError at decode. Non-finite inputs: an inf/NaN entry that is kept decodes to
inf/NaN through the value codec, and under ``dct`` it spreads to its whole chunk; ``topk`` ranks NaN
above every finite magnitude (torch.topk), so a NaN is always sent.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from . import counter_rng, dct

SELECTS = ("topk", "randk")
TRANSFORMS = ("none", "dct")
MAX_CHUNK = 65536


def index_bytes(chunk: int) -> int:
    """Bytes per transmitted index: 1 for chunks of at most 256 elements, else 2."""
    return 1 if chunk <= 256 else 2


def _chunk_lengths(numel: int, chunk: int, padded: bool) -> tuple[int, int]:
    """(full chunks, length of the last partial chunk or 0) of a message of ``numel`` elements."""
    if padded:
        return -(-numel // chunk), 0
    return numel // chunk, numel % chunk


def kept(codec, numel: int) -> int:
    """Values a structured codec sends for ``numel`` elements (coefficients with ``dct``)."""
    full, rest = _chunk_lengths(numel, codec.chunk, codec.transform == "dct")
    if not codec.k:
        return full * codec.chunk + rest
    return full * min(codec.k, codec.chunk) + min(codec.k, rest)


def value_codec(codec):
    """The dense codec of the kept values: the same name, scaling and rounding, no structure."""
    return replace(codec, k=0, chunk=None, select="topk", transform="none")


def value_dtype(codec, dtype: torch.dtype) -> torch.dtype:
    """dtype the value codec sees: the message's dtype (DCT coefficients are cast to it)."""
    return dtype


def wire_bytes(codec, numel: int, dtype: torch.dtype) -> int:
    """Exact bytes of :func:`encode` for ``numel`` elements of ``dtype``."""
    if numel == 0:
        return 0
    n = kept(codec, numel)
    head = 0
    if codec.k:
        head = 8 if codec.select == "randk" else n * index_bytes(codec.chunk)
    return head + value_codec(codec).wire_bytes(n, value_dtype(codec, dtype))


def _chunks(codec, flat: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Step 1: (full chunks [n, chunk], last partial chunk or None) in the work dtype."""
    if codec.transform == "dct":
        return dct.dct_chunks(flat, codec.chunk), None
    work = torch.float64 if flat.dtype == torch.float64 else torch.float32
    x = flat.to(work)
    full = (x.numel() // codec.chunk) * codec.chunk
    rest = x[full:].view(1, -1) if full < x.numel() else None
    return x[:full].view(-1, codec.chunk), rest


def _positions(codec, block: torch.Tensor, key: Optional[int]) -> torch.Tensor:
    """Step 2: sorted kept positions [rows, min(k, width)] of a block of chunks."""
    k = min(codec.k, block.shape[1])
    if codec.select == "topk":
        idx = block.abs().topk(k, dim=1, sorted=False).indices
    else:
        g = torch.Generator(device=block.device)
        g.manual_seed(key)
        idx = torch.rand(block.shape, generator=g, device=block.device).topk(k, dim=1, sorted=False).indices
    return idx.sort(dim=1).values


def _random_key(codec, generator: Optional[torch.Generator], device) -> int:
    return int(counter_rng.draw_key(codec.stream(generator), device)) & 0x7FFF_FFFF_FFFF_FFFF


def encode(codec, flat: torch.Tensor, generator: Optional[torch.Generator] = None, strict: bool = True) -> torch.Tensor:
    """Steps 1-4 of the module docstring: one flat uint8 buffer of :func:`wire_bytes` bytes."""
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    full, rest = _chunks(codec, flat)
    if not codec.k:  # dense transform: every coefficient goes through the value codec
        vals = full.reshape(-1).to(flat.dtype)
        return value_codec(codec).encode_flat(vals, generator, strict=strict)
    key = _random_key(codec, generator, flat.device) if codec.select == "randk" else None
    parts, idxs = [], []
    for i, block in enumerate(b for b in (full, rest) if b is not None and b.numel()):
        pos = _positions(codec, block, None if key is None else key + i)
        parts.append(block.gather(1, pos).reshape(-1))
        idxs.append(pos.reshape(-1))
    vals = torch.cat(parts).to(flat.dtype)
    body = value_codec(codec).encode_flat(vals, generator, strict=strict)
    if key is not None:
        head = torch.tensor([key], dtype=torch.int64).view(torch.uint8).to(flat.device)
    else:
        idx_dtype = torch.uint8 if index_bytes(codec.chunk) == 1 else torch.int16
        # int16 holds 0..65535 as two's complement: decoding masks it back to 16 bits
        head = torch.cat(idxs).to(torch.int32).to(idx_dtype).view(torch.uint8)
    return torch.cat([head, body])


def _head_bytes(codec, kept_values: int) -> int:
    """Bytes before the values: the random-k key, or one index per kept value."""
    return 8 if codec.select == "randk" else kept_values * index_bytes(codec.chunk)


def _kept_positions(codec, buf: torch.Tensor, nfull: int, rest: int):
    """Yield (start element, rows, chunk width, sorted kept positions [rows, k]) for the block of full chunks
    and the last partial chunk of an encoding, read from its indices (top-k) or regenerated from its key
    (random-k). Raises ValueError for an index outside its chunk (a corrupt message)."""
    shapes = [(nfull, codec.chunk, min(codec.k, codec.chunk))] + ([(1, rest, min(codec.k, rest))] if rest else [])
    if codec.select == "randk":
        key = int(buf[:8].clone().view(torch.int64).item())
    else:
        raw = buf[:_head_bytes(codec, sum(r * k for r, _, k in shapes))].clone()
        idx_all = raw.to(torch.int64) if index_bytes(codec.chunk) == 1 else raw.view(torch.int16).to(torch.int64) & 0xFFFF
    start, ipos = 0, 0
    for i, (rows, width, k) in enumerate(s for s in shapes if s[0] * s[1]):
        if codec.select == "randk":
            pos = _positions(codec, torch.empty(rows, width, device=buf.device), key + i)
        else:
            pos = idx_all[ipos:ipos + rows * k].view(rows, k)
            ipos += rows * k
        if bool((pos >= width).any()):
            raise ValueError(f"codec {codec}: an index in the buffer is out of its chunk (corrupt message)")
        yield start, rows, width, pos
        start += rows * width


def _scatter_kept(codec, buf: torch.Tensor, n: int, nfull: int, rest: int, dtype: torch.dtype, work: torch.dtype,
                  with_support: bool):
    """The kept values of a top-k/random-k encoding scattered into zero chunks (``work`` dtype), and, with
    ``with_support``, the bool mask of the kept positions (else None), from one read of the indices."""
    vals = value_codec(codec).decode_flat(buf[_head_bytes(codec, n):], n, value_dtype(codec, dtype)).to(work)
    out = torch.zeros(nfull * codec.chunk + rest, dtype=work, device=buf.device)
    mask = torch.zeros(out.numel(), dtype=torch.bool, device=buf.device) if with_support else None
    vpos = 0
    for start, rows, width, pos in _kept_positions(codec, buf, nfull, rest):
        k = pos.shape[1]
        out[start:start + rows * width].view(rows, width).scatter_(1, pos, vals[vpos:vpos + rows * k].view(rows, k))
        if mask is not None:
            mask[start:start + rows * width].view(rows, width).scatter_(1, pos, True)
        vpos += rows * k
    return out, mask


def decode(codec, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode`: a 1-D tensor of ``numel`` elements of ``dtype``."""
    expected = wire_bytes(codec, numel, dtype)
    if buf.dtype != torch.uint8 or buf.numel() != expected:
        raise ValueError(f"codec {codec}: expected a uint8 buffer of {expected} bytes for {numel} elements, "
                         f"got {buf.dtype} with {buf.numel()} bytes")
    if numel == 0:
        return torch.empty(0, dtype=dtype, device=buf.device)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    n, padded = kept(codec, numel), codec.transform == "dct"
    nfull, rest = _chunk_lengths(numel, codec.chunk, padded)
    if not codec.k:
        coeffs = value_codec(codec).decode_flat(buf, n, value_dtype(codec, dtype)).to(work)
        return dct.idct_chunks(coeffs.view(-1, codec.chunk), numel).to(dtype)
    out, _ = _scatter_kept(codec, buf, n, nfull, rest, dtype, work, False)
    if padded:
        return dct.idct_chunks(out.view(-1, codec.chunk), numel).to(dtype)
    return out.to(dtype)


def decode_with_support(codec, buf: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32):
    """:func:`decode` of a top-k or random-k encoding (``transform='none'``; ``dtype``: what it was encoded
    from) together with which elements it carries: (values, bool mask), the mask True at every kept position,
    also where the kept value itself is (or rounds to) zero. Averaging over the senders of each position
    (DeMo's reduction) needs the mask: the values alone cannot tell a sent zero from an unsent entry.
    Raises ValueError for other codecs, a buffer of the wrong size or a corrupt index."""
    if not codec.k or codec.transform != "none":
        raise ValueError(f"codec {codec}: decode_with_support() is defined for top-k/random-k codecs without a "
                         f"transform")
    expected = wire_bytes(codec, numel, dtype)
    if buf.dtype != torch.uint8 or buf.numel() != expected:
        raise ValueError(f"codec {codec}: expected a uint8 encoding of {expected} bytes for {numel} elements, got "
                         f"{buf.dtype} with {buf.numel()} bytes")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    nfull, rest = _chunk_lengths(numel, codec.chunk, False)
    out, mask = _scatter_kept(codec, buf, kept(codec, numel), nfull, rest, dtype, work, True)
    return out.to(dtype), mask
