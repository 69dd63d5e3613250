"""Initialisation helpers and gradient synchronisation for sequence-parallel parameters."""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``N(0, sigma^2)`` initialisation (Megatron's init_method_normal)."""
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return nn.init.normal_(tensor, mean=0.0, std=sigma)
    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``N(0, (sigma / sqrt(2 num_layers))^2)`` for output projections (GPT-2 / Megatron)."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def allreduce_sequence_parallel_gradients(parameters: Iterable[nn.Parameter], group) -> None:
    """Sum over the TP group the gradients of parameters marked ``sequence_parallel`` (LayerNorm weights and
    RowParallelLinear biases under sequence parallelism see only their rank's sequence slice).

    Uncompressed on purpose: these are small 1-D tensors where a codec would cost more than it saves.
    Call after backward and before the optimizer step (Megatron's finalize_model_grads does the same).
    """
    grads = [p.grad for p in parameters if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
