"""Bytes one rank sends in each collective, computed with the codecs' own ``wire_bytes`` and the same chunking
and pipelining as megacomp.comm, so the plan cannot drift from what the code sends.

Every function returns the bytes rank 0 of the group sends (the algorithms of megacomp.comm.collectives):

  all_reduce      identity: megacomp.comm.common.all_reduce_bytes (every chunk but its own, then its shard to the
                  others: 2 (p-1)/p n itemsize). Lossy, two ranks: its whole encoding, segment by segment.
                  Lossy, p > 2: per pipeline segment, the encoded chunks for the p - 1 others, then its re-encoded
                  shard to each of them (padded to the largest shard's encoding).
  reduce_scatter  identity: (p-1) m itemsize. Lossy: (p-1) x the encodings of its pieces of each destination chunk.
  all_gather      identity: (p-1) m itemsize. Lossy: (p-1) x the encodings of its pieces.
  send            the encoding of the tensor.

Error bound: exact (tests compare them with megacomp.comm.stats of real collectives). Failure behaviour: codec
specs that megacomp.compression.make_codec rejects raise its ValueError.
"""
from __future__ import annotations

from collections import Counter

import torch

from ..comm.common import all_reduce_bytes as _identity_all_reduce_bytes
from ..comm.options import SEGMENT_NUMEL
from ..compression import make_codec



def codec_of(spec):
    """A Codec from a name, a mapping or a Codec (None -> ``none``)."""
    return make_codec(spec if spec is not None else "none")


def split_counts(numel: int, parts: int) -> Counter:
    """``Counter(megacomp.comm.common.split_sizes(numel, parts))`` without building the list: ``numel % parts``
    chunks one element larger than the rest."""
    base, rem = divmod(numel, parts)
    return Counter({k: v for k, v in ((base + 1, rem), (base, parts - rem)) if v})


def segment_counts(numel: int, segment_numel: int = SEGMENT_NUMEL) -> Counter:
    """``Counter(megacomp.comm.transport.pipeline_segments(numel, segment_numel))``, computed in O(1)."""
    if segment_numel <= 0 or numel <= segment_numel:
        return Counter({numel: 1})
    return split_counts(numel, -(-numel // segment_numel))


def _wire_sum(codec, sizes: Counter) -> int:
    """Sum of ``codec.wire_bytes`` over a Counter of sizes."""
    return sum(n * codec.wire_bytes(s) for s, n in sizes.items())


def all_reduce_bytes(spec, numel: int, world: int, dtype: torch.dtype = torch.float32,
                     segment_numel: int = SEGMENT_NUMEL) -> int:
    """Bytes rank 0 sends in ``megacomp.comm.all_reduce`` of ``numel`` elements over ``world`` ranks."""
    codec = codec_of(spec)
    if world <= 1:
        return 0
    if codec.is_identity:
        return _identity_all_reduce_bytes(numel, dtype.itemsize, world, 0)
    segs = segment_counts(numel, segment_numel)
    if world == 2:
        return _wire_sum(codec, segs)
    total = 0
    for seg, count in segs.items():
        ss = split_counts(seg, world)
        own = seg // world + (1 if seg % world else 0)  # rank 0's chunk: split_sizes(seg, world)[0]
        others = ss - Counter({own: 1})
        total += count * (_wire_sum(codec, others) + (world - 1) * max(codec.wire_bytes(s) for s in ss))
    return total


def _pieces(m: int, world: int, segment_numel: int) -> Counter:
    """The pieces each destination chunk travels in (one per pipeline segment of the whole input)."""
    return split_counts(m, sum(segment_counts(world * m, segment_numel).values()))


def reduce_scatter_bytes(spec, out_numel: int, world: int, dtype: torch.dtype = torch.float32,
                         segment_numel: int = SEGMENT_NUMEL) -> int:
    """Bytes rank 0 sends in ``megacomp.comm.reduce_scatter_tensor`` with ``out_numel`` elements per rank."""
    codec = codec_of(spec)
    if world <= 1:
        return 0
    if codec.is_identity:
        return (world - 1) * out_numel * dtype.itemsize
    return (world - 1) * _wire_sum(codec, _pieces(out_numel, world, segment_numel))


def all_gather_bytes(spec, in_numel: int, world: int, dtype: torch.dtype = torch.float32,
                     segment_numel: int = SEGMENT_NUMEL) -> int:
    """Bytes rank 0 sends in ``megacomp.comm.all_gather_into_tensor`` of ``in_numel`` elements per rank."""
    codec = codec_of(spec)
    if world <= 1:
        return 0
    if codec.is_identity:
        return (world - 1) * in_numel * dtype.itemsize
    return (world - 1) * _wire_sum(codec, _pieces(in_numel, world, segment_numel))


def send_bytes(spec, numel: int, dtype: torch.dtype = torch.float32) -> int:
    """Payload bytes of ``megacomp.comm.isend`` of ``numel`` elements."""
    return codec_of(spec).wire_bytes(numel, dtype)


def bits_per_element(spec, numel: int = 1 << 20, dtype: torch.dtype = torch.float32) -> float:
    """Wire bits per element of a codec on a tensor of ``numel`` elements (scales, indices included)."""
    return 8.0 * codec_of(spec).wire_bytes(numel, dtype) / numel
