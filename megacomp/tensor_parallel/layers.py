"""Megatron-compatible tensor-parallel layers whose collectives can be compressed per direction.

Shapes and sharding follow Megatron-core: inputs are ``[seq, batch, hidden]`` (with sequence
parallelism each TP rank holds ``seq / tp`` rows); ColumnParallelLinear's weight is
``[output_size / tp, input_size]`` (rank r holds output rows ``r*out/tp ...``); RowParallelLinear's weight
is ``[output_size, input_size / tp]`` (rank r holds input columns ``r*in/tp ...``) and its bias is full;
VocabParallelEmbedding's weight is ``[num_embeddings / tp, embedding_dim]``. ``forward`` returns
``(output, output_bias)``, with ``output_bias`` None unless ``skip_bias_add``.

Initialisation is parallelism-invariant: the full weight is drawn with ``init_method`` from torch's
default generator (every TP rank must be seeded alike, e.g. ``torch.manual_seed(seed)``) and each rank
keeps its shard, so a model's numbers do not depend on the TP size.

Each collective runs on its traffic path's channel from ``config.channels`` (megacomp.comm.Channel, built
once from ``config.compression``), which applies the codec and the small-tensor policy; with every path
uncompressed the layers are bit-identical to the same layers on plain torch.distributed. Under
``tp_backward_error_feedback`` each layer asks the tp_backward channel for its own error-feedback key at
construction (``self.ef_key``), so the residual state lives in the channel and is checkpointed with it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import ModelParallelConfig
from . import mappings
from .utils import init_method_normal


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d}); choose sizes that "
                         f"divide evenly (e.g. pad the vocabulary / hidden size)")
    return n // d


def _mark_sharded(param: nn.Parameter, dim: int) -> None:
    """Megatron's attributes of a TP-sharded parameter (read by optimizers, norms and checkpoints)."""
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1


def _init_shard(param: nn.Parameter, full_shape, dim: int, rank: int, world: int, init_method: Callable,
                initialize: bool) -> None:
    """Mark ``param`` as sharded along ``dim``; if ``initialize``, draw the full weight (fp32) with
    ``init_method`` and copy this rank's shard into it."""
    _mark_sharded(param, dim)
    if not initialize:
        return
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    with torch.no_grad():
        param.copy_(master.chunk(world, dim=dim)[rank])


class _TPModule(nn.Module):
    def __init__(self, config: ModelParallelConfig, tp_group) -> None:
        super().__init__()
        self.config = config
        self.tp_group = config.tp_group(tp_group)
        self.tp_size = dist.get_world_size(self.tp_group)
        self.tp_rank = dist.get_rank(self.tp_group)
        self.channels = config.channels
        back = self.channels.tp_backward
        self.ef_key: Optional[str] = back.new_key(type(self).__name__) if back.error_feedback is not None else None


class ColumnParallelLinear(_TPModule):
    """``Y = X A^T + b`` with ``A`` split by output rows over the TP group.

    Forward: (SP: all-gather X along seq [sp_all_gather]) -> local matmul -> (gather_output: all-gather
    along the last dim [tp_forward]). Backward: all-reduce of dX [tp_backward] (SP: reduce-scatter).
    """

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig,
                 init_method: Optional[Callable] = None, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, tp_group=None) -> None:
        super().__init__(config, tp_group)
        if gather_output and config.sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True is incompatible with sequence_parallel "
                             "(the next layer expects sequence-split activations)")
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        out_per_rank = _divide(output_size, self.tp_size, "ColumnParallelLinear output_size")
        self.weight = nn.Parameter(torch.empty(out_per_rank, input_size, dtype=config.params_dtype))
        _init_shard(self.weight, (output_size, input_size), 0, self.tp_rank, self.tp_size,
                    init_method or init_method_normal(0.02), config.perform_initialization)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_per_rank, dtype=config.params_dtype))
            _mark_sharded(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        """``(output, output_bias)`` as in the class docstring; each collective on its channel (lossy channels:
        the error bounds of megacomp.comm.collectives). Raises ValueError for an input of the wrong last dim."""
        if input_.shape[-1] != self.input_size:
            raise ValueError(f"ColumnParallelLinear expects the input's last dim to be input_size={self.input_size}, "
                             f"got shape {tuple(input_.shape)}")
        if self.config.sequence_parallel:
            if input_.dim() < 2:
                raise ValueError("sequence parallel input must be [seq/tp, batch, hidden]")
            total = mappings.gather_from_sequence_parallel_region(
                input_, self.tp_group, codec=self.channels.sp_all_gather,
                backward_codec=self.channels.tp_backward, ef_key=self.ef_key)
        else:
            total = mappings.copy_to_tensor_model_parallel_region(
                input_, self.tp_group, backward_codec=self.channels.tp_backward, ef_key=self.ef_key)
        out = F.linear(total, self.weight, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            out = mappings.gather_from_tensor_model_parallel_region(
                out, self.tp_group, codec=self.channels.tp_forward)
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_TPModule):
    """``Y = X A^T + b`` with ``A`` split by input columns over the TP group; ``b`` is full.

    Forward: (not input_is_parallel: split X along the last dim) -> local matmul -> all-reduce of the
    partial outputs [tp_forward] (SP: reduce-scatter along seq [sp_reduce_scatter]) -> + b.
    Backward: none for dX when input_is_parallel (SP: all-gather of dY [tp_backward]).
    """

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig,
                 init_method: Optional[Callable] = None, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, tp_group=None) -> None:
        super().__init__(config, tp_group)
        if config.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True (the input must "
                             "come split along the hidden dim from a ColumnParallelLinear)")
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.in_per_rank = _divide(input_size, self.tp_size, "RowParallelLinear input_size")
        self.weight = nn.Parameter(torch.empty(output_size, self.in_per_rank, dtype=config.params_dtype))
        _init_shard(self.weight, (output_size, input_size), 1, self.tp_rank, self.tp_size,
                    init_method or init_method_normal(0.02), config.perform_initialization)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype))
            # under SP each rank adds the bias to its sequence slice: grads must be summed over TP
            self.bias.sequence_parallel = config.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        """``(output, output_bias)`` as in the class docstring (the all-reduce or reduce-scatter of the partial
        outputs on its channel). Raises ValueError for an input of the wrong last dim."""
        if self.input_is_parallel:
            if input_.shape[-1] != self.in_per_rank:
                raise ValueError(f"RowParallelLinear (input_is_parallel=True) expects the input's last dim to be "
                                 f"input_size / tp = {self.in_per_rank}, got shape {tuple(input_.shape)}")
            input_parallel = input_
        else:
            if input_.shape[-1] != self.input_size:
                raise ValueError(f"RowParallelLinear (input_is_parallel=False) expects the input's last dim to be "
                                 f"input_size={self.input_size}, got shape {tuple(input_.shape)}")
            input_parallel = mappings.scatter_to_tensor_model_parallel_region(
                input_, self.tp_group, backward_codec=self.channels.tp_backward)
        partial = F.linear(input_parallel, self.weight)
        if self.config.sequence_parallel:
            out = mappings.reduce_scatter_to_sequence_parallel_region(
                partial, self.tp_group, codec=self.channels.sp_reduce_scatter,
                backward_codec=self.channels.tp_backward)
        else:
            out = mappings.reduce_from_tensor_model_parallel_region(
                partial, self.tp_group, codec=self.channels.tp_forward)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


class VocabParallelEmbedding(_TPModule):
    """Embedding with the vocabulary split over the TP group.

    Each rank looks up the ids in its range ``[r*V/tp, (r+1)*V/tp)`` (zeros elsewhere) and the partial
    embeddings are all-reduced [tp_forward]. Input ``[batch, seq]`` ids, output ``[batch, seq, hidden]``;
    with ``reduce_scatter_embeddings`` the output is ``[seq/tp, batch, hidden]`` (reduce-scatter along seq
    [sp_reduce_scatter]), ready for sequence-parallel layers. Ids outside ``[0, num_embeddings)`` raise.
    ``forward(ids, tied=...)`` looks up through a :class:`~megacomp.tensor_parallel.tied_embedding.TiedEmbeddingGrad`
    (the weight tied to an output layer: one gradient buffer for both uses; same values).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, config: ModelParallelConfig,
                 init_method: Optional[Callable] = None, reduce_scatter_embeddings: bool = False, tp_group=None) -> None:
        super().__init__(config, tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        per_rank = _divide(num_embeddings, self.tp_size, "VocabParallelEmbedding num_embeddings")
        self.vocab_start, self.vocab_end = self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, dtype=config.params_dtype))
        _init_shard(self.weight, (num_embeddings, embedding_dim), 0, self.tp_rank, self.tp_size,
                    init_method or init_method_normal(0.02), config.perform_initialization)

    def forward(self, input_: torch.Tensor, tied=None) -> torch.Tensor:
        """The embeddings (see the class docstring); ``tied``: a TiedEmbeddingGrad of this weight, or None. Raises
        TypeError for non-integer ids and ValueError for ids outside ``[0, num_embeddings)``."""
        lookup = F.embedding if tied is None else tied.lookup
        if input_.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"VocabParallelEmbedding expects integer token ids, got {input_.dtype}")
        if input_.numel() and (int(input_.min()) < 0 or int(input_.max()) >= self.num_embeddings):
            raise ValueError(f"token ids must lie in [0, {self.num_embeddings}), got [{int(input_.min())}, "
                             f"{int(input_.max())}]; check the tokenizer's vocabulary size")
        if self.tp_size > 1:
            outside = (input_ < self.vocab_start) | (input_ >= self.vocab_end)
            local = (input_ - self.vocab_start).masked_fill(outside, 0)
            partial = lookup(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            partial = lookup(input_, self.weight)
        if self.reduce_scatter_embeddings:
            partial = partial.transpose(0, 1).contiguous()
            return mappings.reduce_scatter_to_sequence_parallel_region(
                partial, self.tp_group, codec=self.channels.sp_reduce_scatter,
                backward_codec=self.channels.tp_backward)
        return mappings.reduce_from_tensor_model_parallel_region(
            partial, self.tp_group, codec=self.channels.tp_forward)
