"""DeMo, decoupled momentum optimization (Peng, Quesnelle and Kingma, 2024), as a data-parallel optimizer.

DeMo replaces the gradient all-reduce: each data-parallel rank keeps its own momentum ``delta`` and only
its fast-moving components are shared. Per parameter ``p`` (shape kept: matrices are cut into DeMo's 2-D
tiles, see megacomp.compression.dct) and per step, with learning rate ``lr``:

  1. ``p <- p * (1 - lr * weight_decay)``                      decoupled weight decay
  2. ``delta <- compression_decay * delta + lr * grad``       local momentum (no averaging yet)
  3. ``C = DCT_tiles(delta)``                                 orthonormal DCT-II per tile of
                                                              ``tile_shape(p.shape, compression_chunk)``
  4. keep the ``compression_topk`` coefficients of largest magnitude per tile (all of a tile smaller than
     that); the kept values go through ``value codec`` (fp32 by default, as the reference; bf16/int8/...
     allowed) and ``Chat`` is what the bytes decode to
  5. ``delta <- IDCT_tiles(C - Chat)``                        what was sent leaves the momentum; the rest,
                                                              value-codec rounding included, stays
  6. all-gather every rank's encoding (one message per step for all parameters:
     ``Channel.all_gather_encoded``); every rank decodes all of them in rank order and averages each
     coefficient over the ranks that sent it (the reference's ``scatter_reduce(mean, include_self=False)``;
     a coefficient nobody sent is 0)
  7. ``p <- p - lr * sign(IDCT_tiles(mean))``                 sign-SGD on the shared components

Determinism: the mean is a dense sum in rank order (``scatter`` with indices that are unique within one
encoding, so no two writes collide), not the reference's ``scatter_reduce``, which is non-deterministic on
CUDA; every rank applies the same update from the same bytes, so the replicas stay bit-identical. Step 5 is
computed from the coefficients rather than as ``delta - IDCT(Chat)``: equal in exact arithmetic, and exactly
zero when everything is sent (``compression_topk`` >= the tile size), where the update is sign-SGD on the
all-rank average of the momenta (up to fp32 round-off of the transforms, a few ulps of each tile's norm).

Bytes per rank and step: ``(R - 1) * sum_p tiles_p * k_p * (index bytes + value bytes)`` sent (indices in
2 bytes for tiles above 256 coefficients, else 1), counted under the channel's tag against the dense fp32
gradient; decoding costs O(R * n). With the defaults (chunk 64, top-32 of 4096) that is 32 * 6 / (4096 * 4)
~ 1.2% of the dense gradient per peer.

Against the reference (bloc97/DeMo demo.py, commit cab4606; tests/test_optimizer_demo.py restates its step
operation by operation and matches within 1e-12 in fp64): the same step 1-7, tile rule (the largest divisor of
each side not above the chunk), top-k per tile, error feedback, mean over senders and sign-SGD step, up to
round-off: step 5's form and the rank-order mean above. Differences: ``delta`` is fp32 for fp16/bf16 parameters
(the reference keeps it, the transforms and the sent values in the parameter dtype; fp32 parameters match);
``step`` consumes the gradients (clears ``.grad``, as the sharded optimizer does) instead of overwriting them with
the sign; weight decay is per parameter group (the reference has one value for every tensor; the trainer's
groups leave vectors undecayed unless ``--demo-weight-decay-vectors``); tensors of more than two dimensions are
tiled as the matrix [shape[0], rest] (the reference handles 1-D and 2-D only); gradients may be clipped by their
(model-parallel) norm first (``max_grad_norm``; the trainer passes ``--clip-grad``, 0 turns it off); a step whose
gradients hold inf/NaN on any rank is skipped everywhere (no momentum change) and counted.

Failure behaviour: ``compression_topk`` < 1, ``compression_chunk`` < 1, ``compression_decay`` outside
[0, 1) or a value codec with structure or error feedback raise ValueError at construction; a checkpoint
from another layout, DP size or codec raises ValueError naming the difference.

Across nodes: each rank's top-k message is all-gathered flat over the DP group, so it crosses the slow link to
every rank of the other nodes (an all-gather of distinct messages: combining them per node would not shrink it).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from ..comm import Channel, make_channel
from ..compression import CodecLike, make_codec
from ..compression import dct, sparse
from .params import plain_data

STATE_FORMAT = "megacomp.DeMo/1"


class DeMo(torch.optim.Optimizer):
    """DeMo over ``process_group`` (see the module docstring); hyperparameters keep the reference's names.

    Args:
        params: parameters or parameter groups (replicated over ``process_group``).
        lr: learning rate of the sign-SGD step and of the momentum accumulation.
        compression_decay: momentum decay in [0, 1) (reference default 0.999).
        compression_topk: coefficients kept per tile (reference default 32).
        compression_chunk: the largest tile side (reference default 64: tiles of up to 64 x 64).
        weight_decay: decoupled weight decay (may be set per group).
        process_group: the data-parallel group (None: the default group); ignored when ``channel`` is given.
        value_codec: the format of the kept values ('none' = the momentum's fp32, as the reference; 'bf16',
            'int8', ... with their block scales over the kept values).
        channel: the traffic path (group, stats tag, options); default: a channel ``dp_gradient`` on
            ``process_group``. Its own codec is not used (DeMo encodes its messages itself).
        max_grad_norm: clip each rank's gradient to this norm first (None: no clipping).
        grad_norm_group: the group the norm is summed over (the model-parallel group; None: this rank only).
        grad_norm_weight: callable p -> weight of p's squared norm in that sum (1/TP for replicated tensors).

    Raises:
        ValueError: bad hyperparameters, or a value codec with structure (k, transform) or an unknown name.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, compression_decay: float = 0.999,
                 compression_topk: int = 32, compression_chunk: int = 64, weight_decay: float = 0.0,
                 process_group=None, *, value_codec: CodecLike = None, channel: Optional[Channel] = None,
                 max_grad_norm: Optional[float] = None, grad_norm_group=None, grad_norm_weight=None) -> None:
        if not isinstance(compression_topk, int) or isinstance(compression_topk, bool) or compression_topk < 1:
            raise ValueError(f"DeMo: compression_topk must be an int >= 1 (coefficients kept per tile), got "
                             f"{compression_topk!r}")
        dct.check_chunk(compression_chunk, "DeMo: compression_chunk")
        if not 0 <= compression_decay < 1:
            raise ValueError(f"DeMo: compression_decay must be in [0, 1), got {compression_decay}")
        if not lr > 0:
            raise ValueError(f"DeMo: lr must be > 0, got {lr}")
        values = make_codec(value_codec)
        if values.structured:
            raise ValueError(f"DeMo: value_codec {values} selects or transforms by itself; DeMo does the DCT and "
                             f"top-k, so pass a plain value format (none, bf16, fp16, int8, int4, ...)")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.compression_decay = compression_decay
        self.compression_topk = compression_topk
        self.compression_chunk = compression_chunk
        self.value_codec = values
        self.channel = channel if channel is not None else make_channel("dp_gradient", group=process_group)
        self.group = self.channel.group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.max_grad_norm = max_grad_norm
        self.grad_norm_group = grad_norm_group
        self.grad_norm_weight = grad_norm_weight
        self.params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self.codecs = [self._codec_for(p) for p in self.params]
        for p in self.params:
            self.state[p]["delta"] = torch.zeros_like(p, dtype=torch.float32 if p.dtype != torch.float64 else p.dtype)
        self.step_count = 0
        self.skipped_steps = 0
        self.last_grad_norm: Optional[float] = None

    def _codec_for(self, p: torch.Tensor):
        """The top-k codec of ``p``'s coefficients: one chunk per tile, the kept values in ``value_codec``."""
        size = math.prod(dct.tile_shape(p.shape, self.compression_chunk))
        k = min(self.compression_topk, size)
        return make_codec(self.value_codec, k=k, chunk=size, select="topk", transform="none")

    def wire_bytes_per_step(self) -> int:
        """Bytes of this rank's message per step (it is sent to each of the other ranks)."""
        return sum(c.wire_bytes(p.numel(), self.state[p]["delta"].dtype) for p, c in zip(self.params, self.codecs))

    # -- the trainer's optimizer interface (as megacomp.optimizer.DistributedOptimizer) ------------------
    def no_sync(self):
        """Gradients accumulate in ``p.grad`` and nothing is reduced during backward: a no-op context."""
        return contextlib.nullcontext()

    def main_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The tensor holding ``param``'s accumulated gradient (its ``.grad``)."""
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return param.grad

    def init_state(self) -> None:
        """State exists from construction (zero momenta), so a fresh optimizer is a checkpoint template."""

    def load_params_from_model(self) -> None:
        """Nothing to reload: DeMo steps the model's parameters themselves."""

    # -- the step -------------------------------------------------------------------------------------
    def _grad_norm_and_finite(self) -> tuple[float, bool]:
        """This rank's gradient norm (over ``grad_norm_group``) and whether every rank's gradients are finite."""
        sq = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        for p in self.params:
            if p.grad is not None:
                w = self.grad_norm_weight(p) if self.grad_norm_weight is not None else 1.0
                sq += w * p.grad.detach().double().pow(2).sum()
        if self.grad_norm_group is not None:
            dist.all_reduce(sq, group=self.grad_norm_group)
        bad = torch.tensor([0.0 if bool(torch.isfinite(sq)) else 1.0], device=sq.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        if self.grad_norm_group is not None:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.grad_norm_group)
        return float(sq.sqrt()), not bool(bad.item())

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Steps 1-7 of the module docstring. Returns False (and changes nothing) when a rank's gradients hold
        inf/NaN; every rank of the group and of ``grad_norm_group`` then skips alike. Either way the gradients
        are consumed (``.grad`` cleared), as the sharded optimizer's step does, so the next backward starts
        from zero."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        norm, finite = self._grad_norm_and_finite()
        if not finite:
            self.skipped_steps += 1
            self.last_grad_norm = None
            self.zero_grad()
            return False
        self.last_grad_norm = norm
        clip = 1.0
        if self.max_grad_norm and norm > self.max_grad_norm:
            clip = self.max_grad_norm / (norm + 1e-6)
        lrs = [(g["lr"], g["weight_decay"]) for g in self.param_groups for p in g["params"] if p.requires_grad]
        messages, sizes = [], []
        for p, codec, (lr, wd) in zip(self.params, self.codecs, lrs):
            delta = self.state[p]["delta"]
            if wd:
                p.mul_(1.0 - lr * wd)
            delta.mul_(self.compression_decay)
            if p.grad is not None:
                delta.add_(p.grad.to(delta.dtype), alpha=lr * clip)
            coeffs = dct.dct_tiles(delta, self.compression_chunk).reshape(-1)
            msg = codec.encode_flat(coeffs.to(delta.dtype), self.channel.generator)
            sent = codec.decode_flat(msg, coeffs.numel(), delta.dtype).to(coeffs.dtype)
            delta.copy_(dct.idct_tiles(coeffs - sent, p.shape, self.compression_chunk))
            messages.append(msg)
            sizes.append(msg.numel())
        mine = torch.cat(messages) if messages else torch.empty(0, dtype=torch.uint8)
        gathered = torch.empty(self.world * mine.numel(), dtype=torch.uint8, device=mine.device)
        self.channel.all_gather_encoded(gathered, mine, numel=sum(p.numel() for p in self.params),
                                        dtype=torch.float32)
        slots = gathered.view(self.world, -1)
        offset = 0
        for p, codec, size, (lr, _) in zip(self.params, self.codecs, sizes, lrs):
            dtype = self.state[p]["delta"].dtype
            n = p.numel()
            total = torch.zeros(n, dtype=dtype, device=p.device)
            count = torch.zeros(n, dtype=dtype, device=p.device)
            for j in range(self.world):  # rank order: the same sum on every rank
                values, sent = sparse.decode_with_support(codec, slots[j, offset:offset + size], n, dtype)
                total.add_(values)
                count.add_(sent.to(dtype))
            offset += size
            mean = total / count.clamp(min=1)
            update = dct.idct_tiles(mean, p.shape, self.compression_chunk).sign_()
            p.add_(update.to(p.dtype), alpha=-lr)
        self.zero_grad()
        self.step_count += 1
        return True

    # -- checkpointing --------------------------------------------------------------------------------
    def _layout(self) -> list:
        return [[list(p.shape), c.k, c.chunk] for p, c in zip(self.params, self.codecs)]

    def state_dict(self) -> dict[str, Any]:
        """This rank's momenta under a key naming its DP rank (each rank's residual momentum is its own),
        plus the counters, the settings a resume must match and the layout."""
        local = {"format": STATE_FORMAT, "dp_size": self.world, "layout": self._layout(),
                 "value_codec": self.value_codec.to_dict(), "decay": self.compression_decay,
                 "delta": [self.state[p]["delta"].detach().clone() for p in self.params],
                 "step": self.step_count, "skipped": self.skipped_steps}
        return {f"dp_rank_{self.rank}": local}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises ValueError when it has no entry for this DP rank or its format,
        DP size, layout (shapes, top-k, tile) or value codec differ."""
        key = f"dp_rank_{self.rank}"
        if key not in state:
            raise ValueError(f"DeMo state has no entry for data-parallel rank {self.rank} (keys: {sorted(state)}); "
                             f"it was saved with another data-parallel size")
        s = state[key]
        for name, mine in [("format", STATE_FORMAT), ("dp_size", self.world), ("layout", self._layout()),
                           ("value_codec", self.value_codec.to_dict())]:
            if plain_data(s.get(name)) != plain_data(mine):
                raise ValueError(f"DeMo checkpoint {name} differs from this optimizer ({s.get(name)!r} vs {mine!r}); "
                                 f"resume with the same model, data-parallel size and DeMo settings")
        with torch.no_grad():
            for p, saved in zip(self.params, s["delta"]):
                self.state[p]["delta"].copy_(saved)
        self.step_count, self.skipped_steps = int(s["step"]), int(s["skipped"])

