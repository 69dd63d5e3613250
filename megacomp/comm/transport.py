"""How the compressed collectives move their byte buffers: backend collectives, or full-duplex p2p.

Why: gloo keeps one TCP connection per pair of ranks and, measured over a shaped 100 Mbit/s veth link
(benchmarks/results/netns/collectives.md), does not overlap the two directions of that connection: a 2-rank
``all_to_all_single`` or ``all_gather_into_tensor`` of 17 MB usually takes the time of a send *and then*
a receive (2.7 s instead of 1.4 s), while raw TCP on the same link moves both directions at full rate.
Splitting the directions over two process groups (one carries only lower->higher rank traffic, the other
only higher->lower) gives every TCP connection one data direction, and the same exchange takes 1.45 s.

So on gloo the byte exchanges of a compressed collective (all-to-all of encoded chunks, all-gather of
the encoded shard) run as ``isend``/``irecv`` on a pair of direction groups created once per group
(gloo communicators built by the group's members only, on the default store under a prefix agreed over the
group, at the group's first exchange, which every member reaches at the same call). NCCL and MPI move both
directions at once and keep the backend collectives.

Bytes on the wire and results are identical with either transport (tests/test_comm_transport.py); the
choice is ``CommOptions.duplex`` of the calling channel (megacomp.comm.options), resolved by
:func:`use_duplex`.

A process-group object that torch.distributed does not serve (torchft's reconfigurable group, wrapped in
megacomp.comm.group_ops.ObjectGroup) has no direction groups: its bytes always travel by its own all-to-all and
all-gather (megacomp.comm.group_ops), and ``duplex=True`` on it is refused with one line.

Module state: one :class:`_GroupTransport` per process group (its two direction groups and its p2p tag
counter), created on first use. It is a cache of communicators and message tags, never an input to the
numbers: the tags only match messages, identically on every rank.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import group_ops
from .common import global_ranks, offsets, split_sizes


def pipeline_segments(numel: int, segment_numel: int) -> list[int]:
    """Sizes of the consecutive segments ``numel`` elements are pipelined in: one segment when
    ``segment_numel`` is 0 or not smaller than ``numel``, else near-equal segments of at most that size."""
    if segment_numel <= 0 or numel <= segment_numel:
        return [numel]
    return split_sizes(numel, -(-numel // segment_numel))


def use_duplex(group, duplex: Optional[bool], device: Optional[torch.device] = None) -> bool:
    """Whether compressed bytes on ``group`` travel as direction-split tagged p2p: ``duplex`` when set,
    else automatically on gloo for host tensors (see the module docstring). Not for CUDA tensors on gloo: gloo's
    point-to-point send cannot read device memory (it fails with ``writev ... Bad address``, measured on an H200),
    while its collectives stage CUDA tensors through the host."""
    if group_ops.is_object_group(group):  # no p2p on a process-group object: its own collectives carry the bytes
        if duplex:
            raise ValueError(f"megacomp.comm: duplex=True needs point-to-point calls, which the process-group object "
                             f"{group} does not serve; use duplex=None or False on it")
        return False
    if duplex is not None:
        return duplex
    return dist.get_backend(group) == "gloo" and (device is None or device.type == "cpu")


class _GroupTransport:
    """Per process group: the (up, down) direction communicators and the next p2p tag."""

    def __init__(self, group) -> None:
        self.group, self.up, self.down, self.tag = group, None, None, 0
        self._default = None  # the default process group the communicators were made under

    def direction_groups(self):
        """(up, down) gloo communicators over the ranks of the group: ``up`` carries sends from a lower to a higher
        group rank, ``down`` the other way; both address peers by group rank. Created on first use (a collective
        of the group's members: every member reaches it at the same call), recreated under a new default group.

        They are built directly on the default store, under a prefix agreed over the group (its name and a nonce
        broadcast from its first rank), not with ``new_group(..., use_local_synchronization=True)``: torch names
        such a group after how many groups the calling process belongs to, which differs between ranks once an
        earlier group left some of them out (megatron-core's embedding groups under PP >= 3), and the members then
        wait for each other under different names forever."""
        default = c10d._get_default_group()
        if self.up is not None and self._default is default:
            return self.up, self.down
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        nonce = torch.randint(0, 1 << 62, (1,), dtype=torch.int64) if rank == 0 else torch.zeros(1, dtype=torch.int64)
        dist.broadcast(nonce, global_ranks(self.group)[0], group=self.group)
        name = self.group.group_name if self.group is not None else dist.group.WORLD.group_name
        store = c10d._get_default_store()
        prefix = f"megacomp/duplex/{name}/{int(nonce)}"
        self.up, self.down = (dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/{d}", store), rank, world,
                                                    store.timeout) for d in ("up", "down"))
        self._default = default
        return self.up, self.down


_TRANSPORTS: dict = {}  # id(group) -> _GroupTransport: a cache of communicators, see the module docstring


def _transport(group) -> _GroupTransport:
    key = id(group) if group is not None else None
    t = _TRANSPORTS.get(key)
    if t is None or t.group is not group:
        t = _TRANSPORTS[key] = _GroupTransport(group)
    return t


class _Exchange:
    """Outstanding p2p transfers of one exchange; ``wait()`` completes them all."""

    def __init__(self, works: list, keep: list) -> None:
        self._works, self._keep = works, keep  # keep: send buffers must live until the sends complete

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait()
        self._works, self._keep = [], []
        return True


def next_tags(group, count: int = 2) -> int:
    """Reserve ``count`` consecutive p2p tags for one compressed collective on ``group`` (drawn when the
    collective is issued, so equal on every rank). Messages are matched by tag, so the phases of
    different collectives may be posted in any order, e.g. a second phase from a background thread."""
    if group_ops.is_object_group(group):  # never carries p2p (use_duplex): no tags to draw, nothing to cache
        return 1
    t = _transport(group)
    base = t.tag
    t.tag = (base + count) % (1 << 30)
    return base + 1  # tag 0 stays with untagged torch.distributed p2p


def _exchange(sends: Sequence[Optional[torch.Tensor]], recvs: Sequence[Optional[torch.Tensor]], group,
              tag: int = 0) -> _Exchange:
    """Send ``sends[j]`` to group rank j and receive ``recvs[j]`` from it, for every j != own rank, all at
    once, each direction of each pair on its own connection."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    up, down = _transport(group).direction_groups()
    works = []
    # post every receive before any send, so that no incoming message waits for its buffer
    for j in range(world):
        if j != rank and recvs[j] is not None and recvs[j].numel():
            works.append((up if j < rank else down).recv([recvs[j]], j, tag))
    for j in range(world):
        if j != rank and sends[j] is not None and sends[j].numel():
            works.append((up if rank < j else down).send([sends[j]], j, tag))
    return _Exchange(works, list(sends))


def all_to_all_bytes(recv: torch.Tensor, send: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                     group, tag: int, duplex: bool):
    """``all_to_all_single(recv, send, out_splits, in_splits, group, async_op=True)`` on flat uint8 buffers;
    ``duplex`` (from :func:`use_duplex`): as tagged direction-split p2p."""
    if not duplex:
        return group_ops.all_to_all_single(recv, send, list(out_splits), list(in_splits), group=group, async_op=True)
    rank = dist.get_rank(group)
    ins = [send[o:o + s] for o, s in zip(offsets(in_splits), in_splits)]
    outs = [recv[o:o + s] for o, s in zip(offsets(out_splits), out_splits)]
    outs[rank].copy_(ins[rank])
    return _exchange(ins, outs, group, tag)


def all_gather_bytes(output: torch.Tensor, input: torch.Tensor, group, tag: int, duplex: bool):
    """``all_gather_into_tensor(output, input, group, async_op=True)`` on flat uint8 buffers (``duplex``:
    as tagged direction-split p2p)."""
    if not duplex:
        return group_ops.all_gather_into_tensor(output, input, group=group, async_op=True)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    w = input.numel()
    outs = [output[j * w:(j + 1) * w] for j in range(world)]
    outs[rank].copy_(input)
    return _exchange([input] * world, outs, group, tag)
