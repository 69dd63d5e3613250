"""How the compressed collectives move their byte buffers: backend collectives, or full-duplex p2p.

Why: gloo keeps one TCP connection per pair of ranks and, measured over a shaped 100 Mbit/s veth link
(docs/netns/collectives.md), does not overlap the two directions of that connection: a 2-rank
``all_to_all_single`` or ``all_gather_into_tensor`` of 17 MB usually takes the time of a send *and then*
a receive (2.7 s instead of 1.4 s), while raw TCP on the same link moves both directions at full rate.
Splitting the directions over two process groups (one carries only lower->higher rank traffic, the other
only higher->lower) gives every TCP connection one data direction, and the same exchange takes 1.45 s.

So on gloo the byte exchanges of a compressed collective (all-to-all of encoded chunks, all-gather of
the encoded shard) run as ``isend``/``irecv`` on a pair of direction groups created once per group
(``new_group(..., use_local_synchronization=True)``: only the group's members take part, in the order
in which they first use the group, which is the same on every rank since collectives are issued in
the same order). NCCL and MPI move both directions at once and keep the backend collectives.

Bytes on the wire and results are identical with either transport (tests/test_comm_transport.py);
``set_duplex(False)`` (or ``MEGACOMP_DUPLEX=0``) turns the p2p transport off, ``set_duplex(True)``
forces it on any backend.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ._common import _all_gather_base, global_ranks, offsets, split_sizes

_mode: Optional[bool] = None  # None: auto (gloo only)
_groups: dict = {}


def set_duplex(enabled: Optional[bool]) -> Optional[bool]:
    """True: always exchange compressed bytes with direction-split p2p; False: always with the backend's
    collectives; None: automatic (p2p on gloo). Returns the old setting. Set it on all ranks alike."""
    global _mode
    old, _mode = _mode, enabled
    return old


# Elements per pipeline segment of a compressed collective: larger tensors are cut into segments whose
# encode, transfer and decode overlap (segment k+1 is encoded while segment k is on the wire).
PIPELINE_NUMEL = 1 << 20
_pipeline_numel = int(os.environ.get("MEGACOMP_PIPELINE_NUMEL", PIPELINE_NUMEL))


def set_pipeline_numel(numel: int) -> int:
    """Elements per pipeline segment of the compressed collectives (0: never segment). Returns the old
    value. Every rank must use the same value: it decides how the tensor is quantized (a segment's
    chunks start new scale blocks, per-tensor scales become per-segment scales)."""
    global _pipeline_numel
    if numel < 0:
        raise ValueError(f"megacomp.comm.set_pipeline_numel: numel must be >= 0, got {numel}")
    old, _pipeline_numel = _pipeline_numel, int(numel)
    return old


def pipeline_segments(numel: int) -> list[int]:
    """Sizes of the consecutive segments ``numel`` elements are pipelined in (one segment when small)."""
    if _pipeline_numel <= 0 or numel <= _pipeline_numel:
        return [numel]
    return split_sizes(numel, -(-numel // _pipeline_numel))


def _use_duplex(group) -> bool:
    if _mode is not None:
        return _mode
    env = os.environ.get("MEGACOMP_DUPLEX", "auto").lower()
    if env in ("0", "false", "off"):
        return False
    if env in ("1", "true", "on"):
        return True
    return dist.get_backend(group) == "gloo"


def _direction_groups(group):
    """(up, down) groups over the ranks of ``group``: ``up`` carries sends from a lower to a higher group
    rank, ``down`` the other way. Created on first use, recreated after the process group was destroyed."""
    key = id(group) if group is not None else None
    hit = _groups.get(key)
    if hit is not None and hit[0] is group:
        try:
            dist.get_group_rank(hit[1], dist.get_rank())  # raises once destroy_process_group() ran
            return hit[1], hit[2]
        except (RuntimeError, ValueError):  # destroyed with its parent: make new ones
            pass
    ranks = global_ranks(group)
    backend = dist.get_backend(group)
    up = dist.new_group(ranks, backend=backend, use_local_synchronization=True)
    down = dist.new_group(ranks, backend=backend, use_local_synchronization=True)
    _groups[key] = (group, up, down)
    return up, down


class _Exchange:
    """Outstanding p2p transfers of one exchange; ``wait()`` completes them all."""

    def __init__(self, works: list, keep: list) -> None:
        self._works, self._keep = works, keep  # keep: send buffers must live until the sends complete

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait()
        self._works, self._keep = [], []
        return True


_tags: dict = {}


def next_tags(group, count: int = 2) -> int:
    """Reserve ``count`` consecutive p2p tags for one compressed collective on ``group`` (drawn when the
    collective is issued, so equal on every rank). Messages are matched by tag, so the phases of
    different collectives may be posted in any order, e.g. a second phase from a background thread."""
    key = id(group) if group is not None else None
    base = _tags.get(key, 0)
    _tags[key] = (base + count) % (1 << 30)
    return base + 1  # tag 0 stays with untagged torch.distributed p2p


def uses_duplex(group) -> bool:
    """Whether the compressed collectives on ``group`` move their bytes with tagged p2p (see module doc)."""
    return _use_duplex(group)


def _exchange(sends: Sequence[Optional[torch.Tensor]], recvs: Sequence[Optional[torch.Tensor]], group,
              tag: int = 0) -> _Exchange:
    """Send ``sends[j]`` to group rank j and receive ``recvs[j]`` from it, for every j != own rank, all at
    once, each direction of each pair on its own connection."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    up, down = _direction_groups(group)
    ranks = global_ranks(group)
    works = []
    # post every receive before any send, so that no incoming message waits for its buffer
    for j in range(world):
        if j != rank and recvs[j] is not None and recvs[j].numel():
            works.append(dist.irecv(recvs[j], ranks[j], group=up if j < rank else down, tag=tag))
    for j in range(world):
        if j != rank and sends[j] is not None and sends[j].numel():
            works.append(dist.isend(sends[j], ranks[j], group=up if rank < j else down, tag=tag))
    return _Exchange(works, list(sends))


def all_to_all_bytes(recv: torch.Tensor, send: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                     group, tag: int = 0):
    """``all_to_all_single(recv, send, out_splits, in_splits, group, async_op=True)`` on flat uint8 buffers."""
    if not _use_duplex(group):
        return dist.all_to_all_single(recv, send, list(out_splits), list(in_splits), group=group, async_op=True)
    rank = dist.get_rank(group)
    ins = [send[o:o + s] for o, s in zip(offsets(in_splits), in_splits)]
    outs = [recv[o:o + s] for o, s in zip(offsets(out_splits), out_splits)]
    outs[rank].copy_(ins[rank])
    return _exchange(ins, outs, group, tag)


def all_gather_bytes(output: torch.Tensor, input: torch.Tensor, group, tag: int = 0):
    """``all_gather_into_tensor(output, input, group, async_op=True)`` on flat uint8 buffers."""
    if not _use_duplex(group):
        return _all_gather_base(output, input, group=group, async_op=True)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    w = input.numel()
    outs = [output[j * w:(j + 1) * w] for j in range(world)]
    outs[rank].copy_(input)
    return _exchange([input] * world, outs, group, tag)
