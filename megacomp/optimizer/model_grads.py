"""Gradients that several model-parallel ranks compute for one parameter, summed before the data-parallel
reduction (megacomp's counterpart of megatron-core's ``finalize_model_grads``).

Two kinds, both summed uncompressed:
- the word embedding tied to the output layer across pipeline stages (PP > 1): the first stage's embedding
  gradient and the last stage's output-layer gradient are all-reduced over the embedding group;
- under sequence parallelism (TP > 1), the parameters every TP rank holds whole but applies to its own slice
  of the sequence (layer norms, row-parallel biases): their gradients are all-reduced over the TP group, in
  one flat message.
The gradients live where the optimizer keeps them (``main_grad(param)``: its fp32 buffers).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


def tied_embedding_weight(model, groups) -> Optional[torch.nn.Parameter]:
    """This stage's half of the tied word embedding (the embedding on the first stage, the output weight on the
    last), or None with one stage, no embedding group, or an untied output layer (each stage's weight is its own:
    nothing to sum across stages)."""
    untied = getattr(getattr(model, "cfg", None), "untie_embeddings_and_output_weights", False)
    if groups.pp_size == 1 or groups.embedding is None or untied:
        return None
    return model.word_embeddings.weight if model.pre_process else model.output_weight


def sequence_parallel_params(model, groups, sequence_parallel: bool) -> list:
    """The parameters whose gradients are summed over TP under sequence parallelism (empty otherwise)."""
    if not (sequence_parallel and groups.tp_size > 1):
        return []
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def finalize_model_grads(model, main_grad: Callable[[torch.nn.Parameter], torch.Tensor], groups,
                         sequence_parallel: bool) -> None:
    """Sum the tied-embedding and sequence-parallel gradients over their groups, in place in ``main_grad(p)``."""
    tied = tied_embedding_weight(model, groups)
    if tied is not None:
        dist.all_reduce(main_grad(tied), group=groups.embedding)
    sp = sequence_parallel_params(model, groups, sequence_parallel)
    if sp:
        grads = [main_grad(p) for p in sp]
        flat = torch.cat([x.reshape(-1) for x in grads])
        dist.all_reduce(flat, group=groups.tp)
        off = 0
        for x in grads:
            x.copy_(flat[off:off + x.numel()].view_as(x))
            off += x.numel()
