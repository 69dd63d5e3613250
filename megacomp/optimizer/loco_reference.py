"""LoCo's gradient exchange as its authors' code runs it, exactly: an option beside megacomp's LoCo (an int4 codec
with per-block absmax scales and round-to-nearest, plus ``error_feedback="loco"``).

Reference: LoCo (Xie et al., arXiv 2407.04480), the authors' Megatron-LM fork (github.com/XingyuXie/Megatron-LM,
commit 429a18dc: ``megatron/model/distributed.py`` ``_make_param_hook``, ``megatron/optimizer/compressed_optimizer4.py``
``reduce_model_grads`` and ``step``). Per element of a rank's gradient ``g``, with error ``e`` (zero at first):

    h = g + e
    q = trunc(clamp(h * S, -8, 7))         # int4, one fixed global scale S (the fork: 2048 * 48)
    e = beta e + (1 - beta) (h - q / S)    # beta = 0.8
    shard_r = sum_j q_j / (S N)            # rank r's chunk, summed in rank order (all-to-all of the int4 codes)

and every error is zeroed after the optimizer step that takes the step counter above ``reset_interval`` (512), so
every 513 steps. The fork feeds that shard to its sharded optimizer (one quantization per step); as a DDP hook
(:func:`loco_reference_hook`) the shards are all-gathered in fp32, so every rank holds exactly the average that
sharded optimizer sees, at the cost of a full-precision second phase (8x the int4 phase's bytes).

Left out, with reasons: the fork's "reference point" term (``h`` also minus ``1.5 r^3`` of an exponential average
``r`` of the parameters, added back to the rank's own shard) is not in the paper's algorithm; its error buffer is
kept in the parameters' dtype (bf16 in bf16 training), here in fp32; its first iterations (DDP's first pass) are
uncompressed, here the first ``start_iter``.

Bound: per element, ``|q / S - h| < 1 / S`` inside the range ``[-8 / S, 7 / S]``; outside it the value is clipped
(the fixed scale never adapts: a gradient larger than 7 / S loses the excess to the error, which then grows). Failure
behaviour: inf/NaN clamp to -8 or 7 (NaN casts to an unspecified int8), so a non-finite gradient does not propagate
through the exchange; the error takes the non-finite value until the next reset.
"""
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..comm import group_ops
from ..comm.stats import PROCESS_STATS
from ..comm.transport import all_gather_bytes, all_to_all_bytes, next_tags, use_duplex
from ..compression.packing import pack_bits, unpack_bits

FORK_SCALE = 2048.0 * 48.0
"""The fork's fixed quantization scale (``lowbit_scale``)."""


@dataclass
class LoCoReference:
    """Settings and state of the authors' LoCo exchange (module docstring); one error buffer per key."""

    scale: float = FORK_SCALE
    """The fixed global scale S: codes are ``trunc(clamp(h * S, -8, 7))``."""
    beta: float = 0.8
    """Moving average of the error."""
    reset_interval: int = 512
    """Errors zeroed when the step counter exceeds it (every ``reset_interval + 1`` steps, as the fork)."""
    process_group: Optional[Any] = None
    """Group to average over (default: the world)."""
    start_iter: int = 2
    """DDP hook: iterations averaged uncompressed first (DDP finalises its buckets after iteration 1)."""
    iteration: int = field(default=0, init=False)
    """DDP hook: iterations seen."""
    gap: int = field(default=0, init=False)
    """Steps since the last reset (the fork's ``low_bit_step_gap``)."""
    errors: dict = field(default_factory=dict, init=False)
    """Per key, this rank's error (fp32, the tensor's length)."""

    def __post_init__(self) -> None:
        if not self.scale > 0 or not 0 <= self.beta < 1 or self.reset_interval < 0:
            raise ValueError(f"LoCoReference needs scale > 0, 0 <= beta < 1 and reset_interval >= 0; got {self.scale}, "
                             f"{self.beta}, {self.reset_interval}")

    def quantize(self, key: str, g: torch.Tensor) -> torch.Tensor:
        """This rank's int8 codes in [-8, 7] of flat ``g`` (fp32), its error updated."""
        e = self.errors.get(key)
        if e is None:
            e = self.errors[key] = torch.zeros(g.numel(), dtype=torch.float32, device=g.device)
        elif e.numel() != g.numel():
            raise ValueError(f"LoCoReference: key {key!r} has an error of {e.numel()} elements, the tensor {g.numel()}; "
                             f"use one key per tensor layout")
        elif e.device != g.device:  # loaded from a checkpoint
            e = self.errors[key] = e.to(g.device)
        h = g.float() + e
        q = (h * self.scale).clamp_(min=-8, max=7).to(torch.int8)
        h.add_(q, alpha=-1.0 / self.scale)
        e.mul_(self.beta).add_(h, alpha=1.0 - self.beta)
        return q

    def reduce_scatter(self, key: str, g: torch.Tensor) -> torch.Tensor:
        """Rank r's chunk of the average of every rank's flat ``g`` (its length a multiple of 2 N: whole bytes per
        chunk): int4 codes all-to-all, decoded and summed in rank order."""
        group = self.process_group
        world = group_ops.get_world_size(group)
        n = g.numel()
        if n % (2 * world):
            raise ValueError(f"LoCoReference: a tensor of {n} elements does not split into {world} chunks of whole "
                             f"bytes; pad it to a multiple of {2 * world}")
        c = n // world
        codes = self.quantize(key, g)
        send = pack_bits(codes.to(torch.uint8) & 15, 4)  # two's complement nibbles
        recv = torch.empty_like(send)
        w = c // 2
        all_to_all_bytes(recv, send, [w] * world, [w] * world, group, next_tags(group),
                         use_duplex(group, None, g.device)).wait()
        PROCESS_STATS.record("dp_gradient", (world - 1) * w, (world - 1) * c * 4)
        shard = torch.zeros(c, dtype=torch.float32, device=g.device)
        for j in range(world):  # the fork's reduce: shard.add_(decoded_j, alpha=1 / (S N)), rank order
            nib = unpack_bits(recv[j * w:(j + 1) * w], 4, c).to(torch.int16)
            shard.add_(torch.where(nib >= 8, nib - 16, nib).to(torch.int8), alpha=1.0 / (self.scale * world))
        return shard

    def all_reduce(self, key: str, g: torch.Tensor) -> None:
        """Flat ``g`` replaced by the average: :meth:`reduce_scatter`, then the fp32 shards all-gathered (lossless)."""
        group = self.process_group
        world = group_ops.get_world_size(group)
        shard = self.reduce_scatter(key, g)
        out = torch.empty(world * shard.numel() * 4, dtype=torch.uint8, device=g.device)
        all_gather_bytes(out, shard.view(torch.uint8), group, next_tags(group), use_duplex(group, None, g.device)).wait()
        PROCESS_STATS.record("dp_gradient", (world - 1) * shard.numel() * 4, (world - 1) * shard.numel() * 4)
        g.copy_(out.view(torch.float32))

    def step(self) -> None:
        """After each optimizer step (the fork's ``step``): count it; past ``reset_interval``, zero every error."""
        self.gap += 1
        if self.gap > self.reset_interval:
            self.gap = 0
            for e in self.errors.values():
                e.zero_()

    def state_dict(self) -> dict:
        """Counters and errors (CPU copies), for a checkpoint."""
        return {"iteration": self.iteration, "gap": self.gap, "errors": {k: e.cpu() for k, e in self.errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (errors move to the gradients' device at their first use)."""
        self.iteration, self.gap = int(state["iteration"]), int(state["gap"])
        self.errors = {k: e.clone().float() for k, e in state["errors"].items()}


def loco_reference_hook(state: LoCoReference, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook running :class:`LoCoReference` on every bucket (error keyed by the bucket's index, as
    the fork keys its buffers by position; DDP's buckets are fixed after its first iteration). The first
    ``start_iter`` iterations, and buckets whose length does not split into whole bytes per rank, are averaged
    uncompressed (divide, all-reduce). The exchange completes before the hook returns."""
    buf = bucket.buffer()
    world = group_ops.get_world_size(state.process_group)
    fut = torch.futures.Future()
    if state.iteration < state.start_iter or buf.numel() % (2 * world):
        buf.div_(world)
        dist.all_reduce(buf, group=state.process_group)
    else:
        flat = buf.float()
        state.all_reduce(f"b{bucket.index()}", flat)
        buf.copy_(flat)
    if bucket.is_last():
        state.iteration += 1
        if state.iteration > state.start_iter:
            state.step()
    fut.set_result(buf)
    return fut
