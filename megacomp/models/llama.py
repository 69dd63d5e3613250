"""Llama-style models: megacomp's GPT with Megatron's Llama options switched on.

    ids [b, s] -> word embedding (vocab parallel) -> [s, b, h]
        -> L pre-RMSNorm blocks: x + proj(attn(rope(q), rope(k), v)) with grouped-query attention,
                                 x + fc2(silu(gate) * up)   (no linear biases)
        -> final RMSNorm -> untied output layer (ColumnParallelLinear, vocab parallel) -> cross entropy

It is :class:`megacomp.models.gpt.GPTModel` built from a :class:`GPTConfig` with the fields in
:data:`LLAMA_OPTIONS` (their algorithms, per-TP-rank layouts and errors: megacomp.models.transformer), so pipeline
stages, interleaved chunks, checkpoints and the TP / SP compression channels are the GPT's: the same
ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding layers carry the same traffic paths (plus the
untied output layer's input gradient, a tp_backward all-reduce as the tied one's).

The options, under megatron-core's names (Megatron-LM flags in brackets):

=====================================  ===========================================================================
``position_embedding_type: rope``       rotary positions in attention, no learned table [--position-embedding-type rope]
``rotary_base``                         RoPE base theta (Llama 2: 10000, Llama 3: 500000) [--rotary-base]
``normalization: RMSNorm``              RMSNorm with ``layernorm_epsilon`` (Llama: 1e-5) [--normalization RMSNorm]
``swiglu: true``                        SwiGLU MLP, gate and up fused in fc1 (gated_linear_unit + silu) [--swiglu]
``num_query_groups``                    grouped-query attention's key/value heads [--group-query-attention
                                        --num-query-groups]
``add_bias_linear: false``              no linear biases [--disable-bias-linear]
``untie_embeddings_and_output_weights`` separate output layer [--untie-embeddings-and-output-weights]
=====================================  ===========================================================================

Refusals (ValueError, one line): ``num_query_groups`` not dividing ``num_attention_heads`` (at config time); a TP
size not dividing ``num_attention_heads`` or ``num_query_groups`` (when the layers are built); a TP size not
dividing ``ffn_hidden_size`` or the vocabulary (the TP layers' own checks).
"""
from __future__ import annotations

import torch

from .gpt import GPTConfig

LLAMA_OPTIONS = (("position_embedding_type", "rope"), ("normalization", "RMSNorm"), ("swiglu", True),
                 ("add_bias_linear", False), ("untie_embeddings_and_output_weights", True))
"""The (GPTConfig field, value) pairs that make the GPT a Llama-style model (shape fields are the caller's)."""


def llama_config(**fields) -> GPTConfig:
    """A :class:`GPTConfig` with :data:`LLAMA_OPTIONS`, then ``fields`` (shapes, ``num_query_groups``,
    ``rotary_base``, ... ; a field given here overrides the option). Raises ValueError as GPTConfig does."""
    return GPTConfig(**{**dict(LLAMA_OPTIONS), **fields})


def fc1_from_megatron(weight: torch.Tensor, tp: int = 1) -> torch.Tensor:
    """Megatron-core's SwiGLU ``linear_fc1`` weight (or bias) -> megacomp's full ``mlp.fc1`` one.

    ``weight``: Megatron's TP shards concatenated along dim 0, shard r being ``[gate_r; up_r]`` (``tp`` shards; its
    full weight at TP 1 is ``[gate; up]``). Returns the rows interleaved per unit, ``[gate_0; up_0; gate_1; ...]``,
    which megacomp shards contiguously at any TP size. The QKV weight needs no conversion: both use the per-group
    layout ``[q of group j's heads; k_j; v_j]``. Raises ValueError when dim 0 does not split into ``2 tp`` equal parts.
    """
    if weight.shape[0] % (2 * tp):
        raise ValueError(f"fc1 has {weight.shape[0]} rows, which do not split into {tp} TP shards of [gate; up]")
    halves = [shard.chunk(2, dim=0) for shard in weight.chunk(tp, dim=0)]
    gate, up = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
    return torch.stack([gate, up], dim=1).flatten(0, 1)
