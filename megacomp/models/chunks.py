"""The model chunks one pipeline stage holds under the interleaved schedule (virtual pipeline stages).

With P stages and V chunks per stage the L layers split into P x V contiguous virtual stages
(``split_layers(L, P V, i)``); stage s holds virtual stages ``s, s + P, ..., s + (V - 1) P`` as chunks
0..V-1. Virtual stage 0 (chunk 0 of stage 0) owns the embeddings; virtual stage P V - 1 (chunk V - 1 of
the last stage) owns the final norm and the tied output layer, so the tied-embedding pair (first and last
stage) is the same as without interleaving. Every layer is built from its own seed, so the chunks hold
exactly the numbers of the unsplit model's layers.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelParallelConfig
from .gpt import GPTConfig, GPTModel, split_layers


def layers_per_virtual_stage_to_chunks(num_layers: int, pp_size: int, layers_per_virtual_stage: int) -> int:
    """Chunks per stage for Megatron's ``--num-layers-per-virtual-pipeline-stage`` (its rules: PP > 1 and
    the layers of a stage divide into whole virtual stages). Raises ValueError naming the fix."""
    if layers_per_virtual_stage < 1:
        raise ValueError(f"num_layers_per_virtual_pipeline_stage must be >= 1, got {layers_per_virtual_stage}")
    if pp_size < 2:
        raise ValueError("num_layers_per_virtual_pipeline_stage needs pipeline_model_parallel_size >= 2 (the "
                         "interleaved schedule); drop it or raise the pipeline size")
    if num_layers % pp_size or (num_layers // pp_size) % layers_per_virtual_stage:
        raise ValueError(f"num_layers ({num_layers}) must split into {pp_size} pipeline stages of whole virtual "
                         f"stages of {layers_per_virtual_stage} layers (num_layers divisible by pipeline size x "
                         f"layers per virtual stage = {pp_size * layers_per_virtual_stage})")
    chunks = num_layers // pp_size // layers_per_virtual_stage
    if chunks < 2:
        raise ValueError(f"{layers_per_virtual_stage} layers per virtual stage leave one chunk per pipeline stage "
                         f"({num_layers} layers / {pp_size} stages): use fewer layers per virtual stage, or drop "
                         f"the option for the non-interleaved schedule")
    return chunks


class GPTChunks(nn.Module):
    """Chunks ``0..V-1`` of pipeline stage ``pp_rank`` (each a :class:`GPTModel` over its layers).

    ``chunks[v]`` runs virtual stage ``v * pp_size + pp_rank``. ``pre_process``/``word_embeddings`` are
    chunk 0's, ``post_process``/``output_weight`` chunk V-1's, so code that finds the tied embedding on a
    stage works unchanged (with ``untie_embeddings_and_output_weights`` the last chunk holds ``output_layer`` instead of
    a tied copy, and ``output_weight`` raises AttributeError). Call a chunk, not this module."""

    def __init__(self, cfg: GPTConfig, config: ModelParallelConfig, *, pp_size: int, pp_rank: int,
                 num_chunks: int, tp_group=None) -> None:
        super().__init__()
        total = pp_size * num_chunks
        chunks = []
        for v in range(num_chunks):
            vs = v * pp_size + pp_rank
            chunks.append(GPTModel(cfg, config, pre_process=vs == 0, post_process=vs == total - 1,
                                   layer_range=split_layers(cfg.num_layers, total, vs), tp_group=tp_group))
        self.chunks = nn.ModuleList(chunks)
        self.cfg, self.pp_size, self.pp_rank = cfg, pp_size, pp_rank

    @property
    def pre_process(self) -> bool:
        """Whether this stage holds virtual stage 0 (the embeddings)."""
        return self.chunks[0].pre_process

    @property
    def post_process(self) -> bool:
        """Whether this stage holds the last virtual stage (final norm, output layer, loss)."""
        return self.chunks[-1].post_process

    @property
    def word_embeddings(self):
        """Chunk 0's word embedding (present on the first stage only)."""
        return self.chunks[0].word_embeddings

    @property
    def output_weight(self) -> torch.Tensor:
        """The last chunk's copy of the tied word embedding (the last stage of several only)."""
        return self.chunks[-1].output_weight

    @property
    def layer_ranges(self) -> list[range]:
        """The full model's layers each chunk holds."""
        return [c.layer_range for c in self.chunks]

    def forward(self, *args, **kwargs):
        """Not callable as a whole: raises TypeError (run ``chunks[v]``)."""
        raise TypeError("GPTChunks is not called as a whole: run chunk v as model.chunks[v](...) "
                        "(the interleaved schedule does)")
