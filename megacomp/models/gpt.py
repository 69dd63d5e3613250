"""GPT (and Llama-style) models built from the tensor-parallel layers, splittable into pipeline stages.

    ids [b, s] -> word embedding (vocab parallel) + learned positions -> [s, b, h]
        -> L pre-LN TransformerBlocks -> final LayerNorm -> logits = h @ E^T (vocab parallel, tied)
        -> vocab-parallel cross entropy -> mean loss

The Llama-style model is the same class with the options of :class:`TransformerConfig` (RoPE instead of the
learned positions, RMSNorm, SwiGLU, grouped-query attention, no linear biases; megacomp.models.llama sets them)
and ``untie_embeddings_and_output_weights``: the output layer is then its own ColumnParallelLinear ``[V / tp, h]``
(vocabulary-parallel logits, ``output_layer.weight``), with nothing shared with the word embedding, so there is no
tied copy on the last stage and no embedding-group gradient sum.

A stage holds layers ``layer_range`` of the full model; the first stage (``pre_process``) owns the
embeddings, the last (``post_process``) the final norm and the output head. With tied embeddings and
several stages the last stage keeps its own copy of the word embedding; call
:func:`sync_tied_embedding_grads` after backward to sum the two copies' gradients over the embedding
group (first and last stage), as Megatron does, so they stay equal. With ``tied_embedding_grad_in_place`` and
one stage holding both uses, the lookup's backward adds into the output layer's partial gradient of the word
embedding (megacomp.tensor_parallel.tied_embedding: one [V/tp, h] gradient buffer instead of two, same values).

Initialisation does not depend on the parallel layout: every layer draws its weights from a generator
seeded with ``(seed, layer index)`` (embeddings and head from their own seeds), so TP x PP x DP splits of
the same model start from the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import ModelParallelConfig
from ..tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding, init_method_normal, mappings,
                               vocab_parallel_cross_entropy)
from ..tensor_parallel.tied_embedding import TiedEmbeddingGrad
from .transformer import TransformerBlock, TransformerConfig, norm_layer


@dataclass
class GPTConfig(TransformerConfig):
    """GPT shape: the transformer's plus vocabulary and context length."""

    vocab_size: int = 32000
    """Vocabulary size (divisible by the TP size)."""
    max_seq_length: int = 1024
    """Context length (size of the position table)."""
    seed: int = 1234
    """Seed of the parallelism-invariant initialisation."""
    cross_entropy_inplace_backward: bool = True
    """The loss's backward writes its gradient into the saved softmax (no second logits-sized tensor); False
    keeps the graph valid for a second backward, as LOMO's norm pass (``grad_norm``) needs."""
    tied_embedding_grad_in_place: bool = False
    """Where one stage holds the word embedding and the tied output layer: the lookup's backward adds its rows into
    the output layer's [V/tp, h] partial gradient instead of allocating a second one (one gradient buffer for the
    weight: LOMO's memory bound, benchmarks/results/memory). Same bits as False on CPU; one forward per backward pass (else
    RuntimeError at backward, see megacomp.tensor_parallel.tied_embedding). Pretraining turns it on for LOMO /
    AdaLomo (megacomp.training.features.lomo_fused)."""
    untie_embeddings_and_output_weights: bool = False
    """A separate output layer (ColumnParallelLinear ``[V / tp, h]``, seeded ``seed + 2``) instead of the word
    embedding's transpose (Megatron's ``--untie-embeddings-and-output-weights``; Llama)."""


class _Seeded:
    """Run a block of module construction with torch's RNG seeded, restoring the caller's RNG after."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __enter__(self):
        self.state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.state)


class GPTModel(nn.Module):
    """One pipeline stage of a GPT (the whole model when it is the only stage)."""

    def __init__(self, cfg: GPTConfig, config: ModelParallelConfig, *, pre_process: bool = True,
                 post_process: bool = True, layer_range: Optional[range] = None, tp_group=None) -> None:
        super().__init__()
        self.cfg, self.config = cfg, config
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_range = layer_range if layer_range is not None else range(cfg.num_layers)
        self.tp_group = config.tp_group(tp_group)
        self.sp = config.sequence_parallel
        self.untied = cfg.untie_embeddings_and_output_weights
        self.learned_positions = cfg.position_embedding_type == "learned_absolute"
        back = config.channels.tp_backward  # the output layer's input gradient is a tp_backward all-reduce too
        self.ef_key = (back.new_key("GPTModel.logits")
                       if back.error_feedback is not None and post_process and not self.untied else None)
        if pre_process:
            with _Seeded(cfg.seed):
                self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, config=config,
                                                              reduce_scatter_embeddings=self.sp, tp_group=self.tp_group)
            if self.learned_positions:
                with _Seeded(cfg.seed + 1):
                    self.position_embeddings = nn.Parameter(
                        (torch.randn(cfg.max_seq_length, cfg.hidden_size) * cfg.init_std).to(config.params_dtype))
                self.position_embeddings.sequence_parallel = self.sp
        layers = []
        for i in self.layer_range:
            with _Seeded(cfg.seed + 1000 * (i + 1)):
                layers.append(TransformerBlock(cfg, config, self.tp_group))
        self.layers = nn.ModuleList(layers)
        if post_process:
            self.final_norm = norm_layer(cfg, self.sp, config.params_dtype)
            if self.untied:
                with _Seeded(cfg.seed + 2):
                    self.output_layer = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, config=config,
                                                             init_method=init_method_normal(cfg.init_std), bias=False,
                                                             tp_group=self.tp_group)
            elif not pre_process:  # the last stage's copy of the tied word embedding
                with _Seeded(cfg.seed):
                    head = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, config=config, tp_group=self.tp_group)
                self.output_weight = head.weight
        self.output_weight_is_tied_copy = post_process and not pre_process and not self.untied
        self._tied_grad: Optional[TiedEmbeddingGrad] = None  # built at the first forward that uses it

    def tied_embedding_grad(self) -> Optional[TiedEmbeddingGrad]:
        """The shared gradient state of the tied word embedding for this forward, or None when the default graph is
        used: ``cfg.tied_embedding_grad_in_place`` off, the two uses on different stages, an untied output layer, or
        no gradient to take."""
        if not (self.cfg.tied_embedding_grad_in_place and not self.untied and self.pre_process and self.post_process
                and torch.is_grad_enabled() and self.word_embeddings.weight.requires_grad):
            return None
        if self._tied_grad is None or self._tied_grad.weight is not self.word_embeddings.weight:
            if self._tied_grad is not None:
                self._tied_grad.remove()
            self._tied_grad = TiedEmbeddingGrad(self.word_embeddings.weight)
        return self._tied_grad

    # -- pieces -----------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, tied: Optional[TiedEmbeddingGrad] = None) -> torch.Tensor:
        """``[b, s]`` ids -> ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism); ``tied``: see
        :meth:`tied_embedding_grad` (pass the same one to :meth:`logits`)."""
        s = ids.shape[1]
        if s > self.cfg.max_seq_length:
            raise ValueError(f"sequence length {s} exceeds max_seq_length {self.cfg.max_seq_length}")
        words = self.word_embeddings(ids) if tied is None else self.word_embeddings(ids, tied=tied)
        if not self.learned_positions:  # rope: positions enter in attention
            return words if self.sp else words.transpose(0, 1).contiguous()
        if self.sp:  # already reduce-scattered to [s/tp, b, h]: add the positions of this rank's slice
            tp, r = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
            pos = self.position_embeddings[r * s // tp:(r + 1) * s // tp]
            return words + pos.unsqueeze(1)
        return (words + self.position_embeddings[:s].unsqueeze(0)).transpose(0, 1).contiguous()

    def head_weight(self) -> torch.Tensor:
        """The output layer's weight: the untied output layer's, else the word embedding on the first stage (tied),
        else this stage's copy."""
        if self.untied:
            return self.output_layer.weight
        return self.word_embeddings.weight if self.pre_process else self.output_weight

    def logits(self, hidden: torch.Tensor, tied: Optional[TiedEmbeddingGrad] = None) -> torch.Tensor:
        """Final norm and the output layer (tied, or the untied ColumnParallelLinear, which communicates the same
        way): ``[s, b, V / tp]`` vocabulary-parallel logits; ``tied``: see :meth:`tied_embedding_grad`."""
        h = self.final_norm(hidden)
        if self.untied:
            return self.output_layer(h)[0]
        ch = self.config.channels
        if self.sp:
            h = mappings.gather_from_sequence_parallel_region(h, self.tp_group, codec=ch.sp_all_gather,
                                                              backward_codec=ch.tp_backward, ef_key=self.ef_key)
        else:
            h = mappings.copy_to_tensor_model_parallel_region(h, self.tp_group, backward_codec=ch.tp_backward,
                                                              ef_key=self.ef_key)
        weight = self.head_weight()
        return F.linear(h, weight if tied is None else tied.output_weight(weight))

    def forward(self, input_: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """First stage: ``input_`` is ``[b, s]`` token ids; later stages: hidden states from the previous stage.
        Last stage with ``labels`` (``[b, s]``): the mean loss; otherwise the hidden states."""
        tied = self.tied_embedding_grad()
        x = self.embed(input_, tied) if self.pre_process else input_
        for layer in self.layers:
            x = layer(x)
        if not self.post_process:
            return x
        logits = self.logits(x, tied)
        if labels is None:
            return logits
        losses = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), tp_group=self.tp_group,
                                              inplace_backward=self.cfg.cross_entropy_inplace_backward)
        return losses.mean()


def split_layers(num_layers: int, stages: int, stage: int) -> range:
    """Contiguous layers of ``stage`` when ``num_layers`` are split as evenly as possible (earlier stages
    get the remainder)."""
    if stages > num_layers:
        raise ValueError(f"{stages} pipeline stages for {num_layers} layers: every stage needs at least one layer; "
                         f"use at most {num_layers} stages")
    base, rem = divmod(num_layers, stages)
    start = stage * base + min(stage, rem)
    return range(start, start + base + (1 if stage < rem else 0))


def sync_tied_embedding_grads(model: GPTModel, embedding_group) -> None:
    """Sum the gradients of the word embedding (first stage) and its copy (last stage) over the embedding
    group (uncompressed; no-op with a single stage or an untied output layer)."""
    if embedding_group is None or model.cfg.untie_embeddings_and_output_weights:
        return
    w = model.word_embeddings.weight if model.pre_process else (model.output_weight if model.post_process else None)
    if w is None or w.grad is None:
        return
    dist.all_reduce(w.grad, group=embedding_group)
