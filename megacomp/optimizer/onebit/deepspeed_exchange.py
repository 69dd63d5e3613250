"""DeepSpeed's compressed all-reduce, exactly: the 1-bit optimizers' ``momentum_scaling="deepspeed"``.

DeepSpeed (``deepspeed/runtime/comm/nccl.py``, ``compressed.py``: ``compressed_allreduce``) averages one flat
fp32 buffer over N ranks with signs and two scales:

  pad the buffer with zeros to a multiple of ``N * lcm(N, 8)`` elements (``n_c``; chunks of ``n_c / N`` bytes-
  aligned bits); worker: ``x += e_w``, ``s_w = ||x|| / sqrt(n_c)`` (the RMS, padding included),
  ``e_w = x - s_w sgn(x)`` with ``sgn(x) = +1 for x >= 0, else -1``; chunk j of the signs and ``s_w`` go to rank j;
  server (rank j, its chunk): ``y = sum_i sgn_i (s_w,i / N) + e_s``, ``s_s = ||y|| / sqrt(n_c / N)``,
  ``e_s = y - s_s sgn(y)``; every rank all-gathers every chunk's signs and ``s_s``; the result (the average) is
  ``sgn(y_j) s_s,j`` in chunk j, identical on every rank.

Which buffer: 1-bit Adam and 0/1 Adam exchange each param group's flat fp32 parameters' buffer (DeepSpeed's
FP16_Optimizer hands them one flat tensor per group), 1-bit LAMB the whole model's momentum in one flat buffer.
:class:`ReferenceAllReduce` lays those buffers out over megacomp's buckets (in parameter order, whatever the
bucket order), so its numbers do not depend on ``bucket_size`` or the pipelining segment size.

Bytes per exchange and rank: ``(N-1)/N * n_c / 8 + 4 (N-1)`` sent in each of the two phases (signs and a 4-byte
scale per chunk), the same as DeepSpeed; counted in the momentum channel's statistics under the call's tag.

Failure behaviour: inf/NaN in a buffer make its scale non-finite and so every element of the result and the
errors (the optimizer checks for overflow before it exchanges, so a skipped step never reaches here).
Bound: per element, ``|result - average| <= |e_s'| + mean_i |e_w,i'|`` after the exchange's own errors are added
back (error feedback: the sum over steps of the results plus the final errors equals the sum of the inputs).
"""
from __future__ import annotations

import math

import torch

from ...comm import group_ops
from ...comm.transport import all_gather_bytes, all_to_all_bytes, next_tags, use_duplex
from ...compression.packing import pack_bits, unpack_bits


def padded_numel(numel: int, world: int) -> int:
    """DeepSpeed's ``corrected_tensor_size``: ``numel`` rounded up to a multiple of ``world * lcm(world, 8)``."""
    unit = world * (world * 8 // math.gcd(world, 8))
    return -(-numel // unit) * unit


def _positive(x: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's sign bit: ``x.sign() + 1 != 0`` (True for x >= 0, -0.0 and NaN included)."""
    return x.sign().add_(1).bool()


def _plus_minus(bits: torch.Tensor) -> torch.Tensor:
    return bits.float().add_(-0.5).mul_(2.0)


def _message(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The packed signs (1 bit each) followed by the fp32 scale's 4 bytes."""
    return torch.cat([pack_bits(bits.to(torch.uint8), 1), scale.reshape(1).float().view(torch.uint8)])


def _unpack(msgs: torch.Tensor, numel: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``world`` messages of ``numel`` signs each -> (+-1 signs [world, numel], scales [world, 1])."""
    w = numel // 8 + 4
    rows = msgs.view(world, w)
    signs = torch.stack([unpack_bits(rows[i, :numel // 8].contiguous(), 1, numel) for i in range(world)])
    scales = rows[:, numel // 8:].contiguous().view(torch.float32).reshape(world, 1)
    return _plus_minus(signs.bool()), scales


class ReferenceAllReduce:
    """DeepSpeed's compressed all-reduce (module docstring) over buffers laid out on megacomp's buckets.

    ``layouts``: one list per reference buffer of ``(bucket index, offset, numel)`` pieces in the reference's
    element order. The worker errors (``n_c`` elements per buffer) and server errors (``n_c / N``) are this
    object's state (:meth:`state_dict`)."""

    def __init__(self, layouts: list, group, device, stats) -> None:
        self.layouts, self.group, self.stats = layouts, group, stats
        self.world, self.rank = group_ops.get_world_size(group), group_ops.get_rank(group)
        self.numel = [sum(n for _, _, n in lay) for lay in layouts]
        self.padded = [padded_numel(n, self.world) for n in self.numel]
        self.worker = [torch.zeros(n, device=device) for n in self.padded]
        self.server = [torch.zeros(n // self.world, device=device) for n in self.padded]

    def reset(self) -> None:
        """Zero every worker and server error."""
        for e in self.worker + self.server:
            e.zero_()

    def average(self, tensors: dict, tag: str) -> None:
        """Replace the pieces of ``tensors`` (bucket index -> flat tensor) by their compressed average, in place."""
        for i, lay in enumerate(self.layouts):
            buf = torch.zeros(self.padded[i], device=self.worker[i].device)
            pos = 0
            for bi, o, n in lay:
                buf[pos:pos + n] = tensors[bi][o:o + n]
                pos += n
            out = self.all_reduce(buf, self.worker[i], self.server[i], tag)
            pos = 0
            for bi, o, n in lay:
                tensors[bi][o:o + n] = out[pos:pos + n]
                pos += n

    def all_reduce(self, buf: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                   tag: str) -> torch.Tensor:
        """The average of ``buf`` (padded, fp32) over the group, DeepSpeed's arithmetic in its order."""
        world, n = self.world, buf.numel()
        c = n // world
        buf.add_(worker_error)
        scale = torch.linalg.norm(buf) / math.sqrt(n)
        bits = _positive(buf)
        worker_error.copy_(buf - scale * _plus_minus(bits))
        send = torch.cat([_message(bits[j * c:(j + 1) * c], scale) for j in range(world)])
        w = c // 8 + 4
        duplex = use_duplex(self.group, None, buf.device)
        tags = next_tags(self.group)
        recv = torch.empty(world * w, dtype=torch.uint8, device=buf.device)
        all_to_all_bytes(recv, send, [w] * world, [w] * world, self.group, tags, duplex).wait()
        signs, scales = _unpack(recv, c, world)
        y = signs.mul_(scales.mul_(1 / world)).sum(0)
        y.add_(server_error)
        s_scale = torch.linalg.norm(y) / math.sqrt(c)
        s_bits = _positive(y)
        server_error.copy_(y - s_scale * _plus_minus(s_bits))
        gathered = torch.empty(world * w, dtype=torch.uint8, device=buf.device)
        all_gather_bytes(gathered, _message(s_bits, s_scale), self.group, tags + 1, duplex).wait()
        signs, scales = _unpack(gathered, c, world)
        self.stats.record(tag, 2 * (world - 1) * w, 2 * (world - 1) * c * 4)
        return signs.mul_(scales).reshape(-1)

    def state_dict(self) -> dict:
        """Worker and server errors (this rank's), as CPU tensors."""
        return {"worker": [e.cpu() for e in self.worker], "server": [e.cpu() for e in self.server]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. Raises ValueError when the saved buffers' sizes differ (another model,
        world size or grouping)."""
        for name in ("worker", "server"):
            mine, saved = getattr(self, name), state[name]
            if [e.numel() for e in mine] != [e.numel() for e in saved]:
                raise ValueError(f"1-bit optimizer checkpoint has DeepSpeed-scaling {name} errors of sizes "
                                 f"{[e.numel() for e in saved]}, this optimizer {[e.numel() for e in mine]}; resume "
                                 f"with the same model, data-parallel size and param groups")
            for e, s in zip(mine, saved):
                e.copy_(s)
