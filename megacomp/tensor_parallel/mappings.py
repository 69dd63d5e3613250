"""Autograd functions that move activations in and out of the tensor-parallel region (Megatron names).

| function                                   | forward                    | backward                      |
|--------------------------------------------|----------------------------|-------------------------------|
| copy_to_tensor_model_parallel_region       | identity                   | all-reduce   (backward_codec) |
| reduce_from_tensor_model_parallel_region   | all-reduce (codec)         | identity                      |
| scatter_to_tensor_model_parallel_region    | split last dim             | all-gather last (backward)    |
| gather_from_tensor_model_parallel_region   | all-gather last (codec)    | split last dim                |
| scatter_to_sequence_parallel_region        | split first dim            | all-gather first (backward)   |
| gather_from_sequence_parallel_region       | all-gather first (codec)   | reduce-scatter first (backward), or split if the output grad is not a TP partial sum |
| reduce_scatter_to_sequence_parallel_region | reduce-scatter first       | all-gather first (backward)   |

``codec`` / ``backward_codec`` take the :class:`megacomp.comm.Channel` of the traffic path (what the
layers pass: its codec, small-tensor threshold, options and error-feedback state), or a codec for a
one-off call, or None (plain). Each collective goes through megacomp.comm, so an identity codec is
bit-identical to torch.distributed and a lossy codec follows the compressed algorithms (fp32 reduction of
dequantized partials; error bounds in megacomp.comm.collectives). Every collective is counted under its
traffic path (``tp_forward``, ``tp_backward``, ``sp_all_gather``, ``sp_reduce_scatter``) in
``megacomp.comm.stats()``. ``ef_key`` (backward collectives only) names the error-feedback state in the
backward channel that this layer's residual lives under (the channel must have error feedback on).
A group of size 1 short-circuits. ``group=None`` means the parallel_state façade's tensor-parallel group.
Raises ValueError when a split dimension does not divide by the TP size.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from ..comm import Channel
from ..compression import CodecLike


def _channel(codec, tag: str) -> Channel:
    """The channel a collective runs on: the layer's own, or a one-off one for a codec (None: identity)."""
    return codec if isinstance(codec, Channel) else Channel(tag, codec)


def _group(group):
    if group is None:
        from .. import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group


# -- collectives on plain tensors ------------------------------------------------------------------
def _all_reduce(x: torch.Tensor, group, codec, tag: str, ef_key=None) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    out = x.contiguous().clone()
    # the channel applies its small-tensor rule; below it nothing is quantized and there is no error to feed back
    _channel(codec, tag).all_reduce(out, group=group, key=ef_key, tag=tag)
    return out


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {world} tensor-parallel ranks; "
                         f"make it divisible by the tensor-parallel size")
    return x.chunk(world, dim=dim)[dist.get_rank(group)].contiguous()


def _gather(x: torch.Tensor, group, dim: int, codec, tag: str) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _channel(codec, tag).all_gather_into_tensor(out, x, group=group, tag=tag)
    if dim == 0:
        return out
    return torch.cat(out.chunk(world, dim=0), dim=dim)


def _reduce_scatter_first(x: torch.Tensor, group, codec, tag: str, ef_key=None) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[0] % world:
        raise ValueError(f"sequence parallelism: the first (sequence) dim {x.shape[0]} is not divisible by the "
                         f"tensor-parallel size {world}; pad the sequence length to a multiple of it")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _channel(codec, tag).reduce_scatter_tensor(out, x, group=group, key=ef_key, tag=tag)
    return out


# -- autograd functions -----------------------------------------------------------------------------
class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, backward_codec, ef_key):
        ctx.group, ctx.codec, ctx.ef_key = group, backward_codec, ef_key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.codec, "tp_backward", ctx.ef_key), None, None, None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, codec):
        return _all_reduce(x, group, codec, "tp_forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, backward_codec):
        ctx.group, ctx.codec = group, backward_codec
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, -1, ctx.codec, "tp_backward"), None, None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, codec):
        ctx.group = group
        return _gather(x, group, -1, codec, "tp_forward")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, -1), None, None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, backward_codec):
        ctx.group, ctx.codec = group, backward_codec
        return _split(x, group, 0)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, 0, ctx.codec, "tp_backward"), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad, codec, backward_codec, ef_key):
        ctx.group, ctx.tp_grad, ctx.codec, ctx.ef_key = group, tensor_parallel_output_grad, backward_codec, ef_key
        return _gather(x, group, 0, codec, "sp_all_gather")

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp_grad:  # each rank holds a partial gradient of the gathered tensor: sum and scatter
            g = _reduce_scatter_first(grad, ctx.group, ctx.codec, "tp_backward", ctx.ef_key)
        else:  # the gradient is already complete on every rank: keep our part
            g = _split(grad, ctx.group, 0)
        return g, None, None, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, codec, backward_codec):
        ctx.group, ctx.codec = group, backward_codec
        return _reduce_scatter_first(x, group, codec, "sp_reduce_scatter")

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, 0, ctx.codec, "tp_backward"), None, None, None


# -- public functions -------------------------------------------------------------------------------
def copy_to_tensor_model_parallel_region(input_, group=None, *, backward_codec: Union[Channel, CodecLike] = None,
                                         ef_key: Optional[str] = None):
    """Identity forward; all-reduce of the gradient backward (``backward_codec``, error feedback key ``ef_key``)."""
    return _CopyToModelParallelRegion.apply(input_, _group(group), backward_codec, ef_key)


def reduce_from_tensor_model_parallel_region(input_, group=None, *, codec: Union[Channel, CodecLike] = None):
    """All-reduce of the partial outputs forward (``codec``); identity backward."""
    return _ReduceFromModelParallelRegion.apply(input_, _group(group), codec)


def scatter_to_tensor_model_parallel_region(input_, group=None, *, backward_codec: Union[Channel, CodecLike] = None):
    """Keep this rank's slice of the last dim forward; all-gather of the gradient backward."""
    return _ScatterToModelParallelRegion.apply(input_, _group(group), backward_codec)


def gather_from_tensor_model_parallel_region(input_, group=None, *, codec: Union[Channel, CodecLike] = None):
    """All-gather along the last dim forward (``codec``); keep this rank's slice of the gradient backward."""
    return _GatherFromModelParallelRegion.apply(input_, _group(group), codec)


def scatter_to_sequence_parallel_region(input_, group=None, *, backward_codec: Union[Channel, CodecLike] = None):
    """Keep this rank's slice of the first (sequence) dim forward; all-gather of the gradient backward."""
    return _ScatterToSequenceParallelRegion.apply(input_, _group(group), backward_codec)


def gather_from_sequence_parallel_region(input_, group=None, tensor_parallel_output_grad: bool = True, *,
                                         codec: Union[Channel, CodecLike] = None, backward_codec: Union[Channel, CodecLike] = None,
                                         ef_key: Optional[str] = None):
    """All-gather along the sequence dim forward (``codec``); backward a reduce-scatter of the gradient
    (``backward_codec``, error feedback key ``ef_key``), or a split if the gradient is not a TP partial sum."""
    return _GatherFromSequenceParallelRegion.apply(input_, _group(group), tensor_parallel_output_grad, codec,
                                                   backward_codec, ef_key)


def reduce_scatter_to_sequence_parallel_region(input_, group=None, *, codec: Union[Channel, CodecLike] = None,
                                               backward_codec: Union[Channel, CodecLike] = None):
    """Reduce-scatter of the partial outputs along the sequence dim forward; all-gather backward."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_, _group(group), codec, backward_codec)
