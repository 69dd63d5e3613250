"""megatron-core's tensor-parallel linear, with its collectives on megacomp channels.

megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` do not route their linear's own traffic
through the mapping functions: ``linear_with_grad_accumulation_and_async_allreduce`` (and
``linear_with_frozen_weight`` for a frozen weight) all-reduce the input gradient with
``torch.distributed.all_reduce`` and, under sequence parallelism, all-gather the input and reduce-scatter
the input gradient with ``torch.distributed`` directly. The two functions here take the same arguments
and do the same arithmetic in the same order (forward ``X W^T + b``; backward ``dX = dY W``, the dgrad
collective started asynchronously, then ``dW = dY^T X`` on 2-D views and ``db = sum dY``), with each
collective on its megacomp channel:

  forward  (sequence parallel) all-gather of X along the sequence dim     sp_all_gather
  backward (sequence parallel) the same all-gather again, for dW          sp_all_gather (as megatron: X is
                                                                          not kept gathered, to save memory)
  backward all-reduce of dX (allreduce_dgrad) / reduce-scatter of dX (SP) tp_backward, with the layer's
                                                                          error-feedback key

With identity channels every value equals megatron-core's (the collectives are the same torch.distributed
calls); with a lossy codec each collective's error is the codec's bound (megacomp.comm.collectives).
The re-gather in backward uses the forward codec, so a deterministic codec gives dW exactly the X that
forward used; a stochastic-rounding codec draws again (both are unbiased estimates of X).

Not reimplemented (megatron-core's own function runs when every channel of the call is the identity,
and a lossy channel raises ValueError naming the setting): ``gradient_accumulation_fusion`` (a CUDA
kernel from apex that accumulates dW into ``main_grad``) and Megatron-FSDP parameters (``__fsdp_param__``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..tensor_parallel.mappings import _gather

_FWD = torch.amp.custom_fwd(device_type="cuda")  # what megatron-core applies: autocast-safe under CUDA AMP
_BWD = torch.amp.custom_bwd(device_type="cuda")


def _affine(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """megatron-core's forward arithmetic: ``matmul(x, W^T)``, then ``+ b`` (not fused into addmm)."""
    out = torch.matmul(x, weight.t())
    return out + bias if bias is not None else out


def _two_d(grad_output: torch.Tensor, total_input: torch.Tensor):
    """megatron-core's ``prepare_input_tensors_for_wgrad_compute``: contiguous, [s, b, h] -> [s*b, h]."""
    grad_output, total_input = grad_output.contiguous(), total_input.contiguous()
    if grad_output.dim() == 3:
        grad_output = grad_output.view(-1, grad_output.shape[2])
        total_input = total_input.view(-1, total_input.shape[2])
    return grad_output, total_input


def _dgrad_collective(grad_input: torch.Tensor, input_shape, sequence_parallel: bool, allreduce_dgrad: bool,
                      group, channel, key: Optional[str]):
    """Start the input-gradient collective (async); returns (result tensor, handle or None)."""
    if sequence_parallel:
        out = torch.empty(input_shape, dtype=grad_input.dtype, device=grad_input.device)
        handle = channel.reduce_scatter_tensor(out, grad_input.contiguous(), group=group, async_op=True, key=key,
                                               tag="tp_backward")
        return out, handle
    if allreduce_dgrad:
        handle = channel.all_reduce(grad_input, group=group, async_op=True, key=key, tag="tp_backward")
        return grad_input, handle
    return grad_input, None


class CompressedLinear(torch.autograd.Function):
    """megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication`` (without gradient-accumulation
    fusion) on megacomp channels; see the module docstring."""

    @staticmethod
    @_FWD
    def forward(ctx, input, weight, bias, allreduce_dgrad, sequence_parallel, grad_output_buffer,
                wgrad_deferral_limit, tp_group, paths, ef_key):
        """``X W^T + b``, X all-gathered along the sequence dim first under sequence parallelism."""
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel = allreduce_dgrad, sequence_parallel
        ctx.grad_output_buffer, ctx.wgrad_deferral_limit = grad_output_buffer, wgrad_deferral_limit
        ctx.tp_group, ctx.paths, ctx.ef_key = tp_group, paths, ef_key
        total_input = _gather(input, tp_group, 0, paths.sp_all_gather, "sp_all_gather") if sequence_parallel else input
        return _affine(total_input, weight, bias)

    @staticmethod
    @_BWD
    def backward(ctx, grad_output):
        """dX (its collective started first), then dW on 2-D views and db; waits for dX's collective last."""
        input, weight = ctx.saved_tensors
        buffer, limit = ctx.grad_output_buffer, ctx.wgrad_deferral_limit
        wgrad_compute = True
        if buffer is not None and (limit == 0 or len(buffer) < limit):  # megatron's deferred embedding wgrad
            buffer.append(grad_output)
            wgrad_compute = False
        total_input = input
        if wgrad_compute and ctx.sequence_parallel:
            total_input = _gather(input, ctx.tp_group, 0, ctx.paths.sp_all_gather, "sp_all_gather")
        grad_input = grad_output.matmul(weight)
        grad_input, handle = _dgrad_collective(grad_input, input.shape, ctx.sequence_parallel, ctx.allreduce_dgrad,
                                               ctx.tp_group, ctx.paths.tp_backward, ctx.ef_key)
        grad_weight = None
        if wgrad_compute:
            grad_output, total_input = _two_d(grad_output, total_input)
            grad_weight = grad_output.t().matmul(total_input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        if handle is not None:  # the dgrad collective overlapped the wgrad matmul, as in megatron-core
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


class CompressedFrozenLinear(torch.autograd.Function):
    """megatron-core's ``LinearWithFrozenWeight`` (no weight gradient) with the dgrad all-reduce on the
    tp_backward channel; under sequence parallelism the caller gathers the input first (a mapping)."""

    @staticmethod
    @_FWD
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group, paths, ef_key):
        """``X W^T + b``; only the weight is saved (no weight gradient)."""
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad, ctx.tp_group, ctx.paths, ctx.ef_key = allreduce_dgrad, tp_group, paths, ef_key
        return _affine(input, weight, bias)

    @staticmethod
    @_BWD
    def backward(ctx, grad_output):
        """dX = dY W, all-reduced over TP when ``allreduce_dgrad``."""
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            ctx.paths.tp_backward.all_reduce(grad_input, group=ctx.tp_group, key=ctx.ef_key, tag="tp_backward")
        return grad_input, None, None, None, None, None, None
