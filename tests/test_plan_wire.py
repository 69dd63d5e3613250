"""megacomp.plan.wire: the bytes the plan charges per collective are the bytes megacomp.comm sends (compared with
comm.stats() of real gloo collectives), and hand-computed cases of the codecs' sizes."""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from megacomp import comm
from megacomp.comm.common import split_sizes
from megacomp.comm.transport import pipeline_segments
from megacomp.plan import wire

CODECS = ("none", {"name": "int4", "block_size": 128}, {"name": "int8", "block_size": 256},
          {"name": "sign", "block_size": 0}, {"name": "none", "k": 32, "chunk": 4096})


def _measured(rank, world, n, m, seg):
    """Bytes this rank sent in an all-reduce of n elements, a reduce-scatter and an all-gather of m per rank, per
    codec, as megacomp.comm.stats() recorded them."""
    def sent(call) -> int:
        comm.reset_stats()
        call()
        return sum(s.wire_bytes for s in comm.stats().values())

    out = []
    opts = comm.CommOptions(segment_numel=seg)
    for spec in CODECS:
        ch = comm.make_channel("p", spec, options=opts)
        out.append((sent(lambda: ch.all_reduce(torch.randn(n))),
                    sent(lambda: ch.reduce_scatter_tensor(torch.empty(m), torch.randn(world * m))),
                    sent(lambda: ch.all_gather_into_tensor(torch.empty(world * m), torch.randn(m)))))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_equal_what_megacomp_comm_sends(world):
    n, m, seg = 10_007, 3_001, 4_000  # several pipeline segments, chunks of unequal size
    rank0 = run_ranks(lambda rank, ws: _measured(rank, ws, n, m, seg), world)[0]
    for spec, (ar, rs, ag) in zip(CODECS, rank0):
        assert wire.all_reduce_bytes(spec, n, world, segment_numel=seg) == ar, spec
        assert wire.reduce_scatter_bytes(spec, m, world, segment_numel=seg) == rs, spec
        assert wire.all_gather_bytes(spec, m, world, segment_numel=seg) == ag, spec


def test_hand_computed_sizes():
    # int4 with one fp32 scale per 128 elements: 4 bits + 32/128 = 4.25 bits per element
    assert wire.bits_per_element({"name": "int4", "block_size": 128}) == 4.25
    # two ranks, fp32: every element but its own shard, then its shard: 2 (p-1)/p n 4 = 4n bytes
    assert wire.all_reduce_bytes("none", 1000, 2) == 4000
    # four ranks, 1024 int8/b128 elements in one segment: 3 chunks of 256 out (264 bytes each: 256 + 2 scales x 4)
    # then its reduced shard to the 3 others
    assert wire.all_reduce_bytes({"name": "int8", "block_size": 128}, 1024, 4) == 3 * 264 + 3 * 264
    # bf16 parameters all-gathered uncompressed: (p-1) m 2 bytes
    assert wire.all_gather_bytes("none", 100, 8, torch.bfloat16) == 7 * 100 * 2
    # DeMo's top-32 of a 4096-element tile, fp32 values + 2-byte indices: 32 x 6 bytes per 4096 elements
    assert wire.send_bytes({"name": "none", "k": 32, "chunk": 4096}, 4096) == 32 * 6


def test_counts_equal_the_lists_they_replace():
    for numel, seg in ((10, 0), (10, 100), (250, 100), (10**6 + 3, 1 << 17), (7, 3)):
        assert wire.segment_counts(numel, seg) == __import__("collections").Counter(pipeline_segments(numel, seg))
    for numel, parts in ((10, 3), (0, 4), (5, 8), (10**7 + 1, 64)):
        assert wire.split_counts(numel, parts) == __import__("collections").Counter(split_sizes(numel, parts))
