"""A pre-LayerNorm transformer block built from the tensor-parallel layers (GPT-style).

Activations are ``[seq, batch, hidden]``; under sequence parallelism each TP rank holds ``seq / tp`` rows
outside the attention / MLP matmuls (LayerNorms and residual adds run on the slice).

    x = x + proj(attention(qkv(LN1(x))))         qkv: ColumnParallelLinear(h, 3h), heads split over TP
    x = x + fc2(gelu(fc1(LN2(x))))               fc1: ColumnParallelLinear(h, f), fc2: RowParallelLinear(f, h)

The fused QKV weight is laid out per head (rows ``[q_i; k_i; v_i]`` for head i), so a contiguous TP shard
holds whole heads and the layer is parallelism-invariant. Attention is causal
``F.scaled_dot_product_attention``. LayerNorm is apex's FusedLayerNorm when apex is installed (optional),
torch's otherwise; under sequence parallelism its parameters are marked ``sequence_parallel`` so
:func:`megacomp.tensor_parallel.allreduce_sequence_parallel_gradients` sums their gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..config import ModelParallelConfig
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, init_method_normal, scaled_init_method_normal


def apex_layer_norm_class():
    """apex's ``FusedLayerNorm``, or None when apex is absent, broken, or the unrelated PyPI package named
    ``apex`` (NVIDIA apex is not on PyPI and needs a CUDA build of torch; it stays optional)."""
    try:
        from apex.normalization import FusedLayerNorm  # type: ignore
    except Exception:  # ImportError, or an "apex" whose import fails in any other way
        return None
    return FusedLayerNorm


@dataclass
class TransformerConfig:
    """Shape of the transformer layers.

    Raises:
        ValueError: ``hidden_size`` is not divisible by ``num_attention_heads``.
    """

    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Attention heads (divisible by the TP size)."""
    ffn_hidden_size: Optional[int] = None
    """MLP width (default 4h)."""
    num_layers: int = 1
    """Used for the scaled init of output projections."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon."""
    init_std: float = 0.02
    """Std of the normal weight init."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size


def layer_norm(hidden: int, eps: float, sequence_parallel: bool, dtype: torch.dtype) -> nn.Module:
    """A LayerNorm over ``hidden`` features in ``dtype``: apex's FusedLayerNorm when apex imports and CUDA is
    available, else ``nn.LayerNorm``. apex's constructor takes no dtype and makes fp32 parameters, so they
    are cast to ``dtype`` here (with bf16 params otherwise the sharded optimizer, which needs one dtype per
    model, refuses them). Its parameters get ``sequence_parallel`` set, so that
    allreduce_sequence_parallel_gradients sums their gradients over TP when sequence parallelism is on."""
    apex_ln = apex_layer_norm_class()
    if apex_ln is not None and torch.cuda.is_available():
        ln = apex_ln(hidden, eps=eps).to(dtype=dtype)
    else:
        ln = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
    for p in ln.parameters():
        p.sequence_parallel = sequence_parallel
    return ln


class ParallelAttention(nn.Module):
    """Causal self-attention with heads split over the TP group.

    Raises:
        ValueError: ``num_attention_heads`` is not divisible by the TP size (or the TP layers' own checks).
    """

    def __init__(self, cfg: TransformerConfig, config: ModelParallelConfig, tp_group=None) -> None:
        super().__init__()
        tp = config.tensor_model_parallel_size
        if cfg.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by the tensor-parallel "
                             f"size ({tp})")
        self.heads_per_rank = cfg.num_attention_heads // tp
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.qkv = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, config=config,
                                        init_method=init_method_normal(cfg.init_std), tp_group=tp_group)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, config=config, input_is_parallel=True,
                                      init_method=scaled_init_method_normal(cfg.init_std, cfg.num_layers),
                                      tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention output for ``x`` ``[s, b, h]`` (sequence parallel: ``[s / tp, b, h]``), same shape.

        Steps: fused QKV projection (ColumnParallelLinear; under SP it first all-gathers ``x`` along the
        sequence) -> this rank's heads -> causal ``scaled_dot_product_attention`` -> output projection
        (RowParallelLinear: all-reduce of the partial outputs, under SP a reduce-scatter along the sequence).

        Error with compression on: the SP all-gather adds one quantization of each input element
        (sp_all_gather codec); the all-reduce / reduce-scatter of the output adds at most the sum over TP
        ranks of the codec's per-element bound on the partial outputs (tp_forward / sp_reduce_scatter), and
        an all-reduce over more than two ranks one more quantization of the reduced shard (per-element
        bounds: megacomp.compression.quantize; algorithm: megacomp.comm.collectives). The backward
        collectives use the tp_backward codec. Nothing is quantized with one TP rank or for messages below
        the channel's ``min_compress_numel``.

        Raises:
            ValueError: the input's last dim is not ``hidden_size`` (from ColumnParallelLinear).
        """
        qkv, _ = self.qkv(x)                                   # [s, b, 3 h / tp]
        # each head's q, k, v are adjacent in the fused projection (Megatron's layout): views, no copies
        q, k, v = rearrange(qkv, "s b (h three d) -> three b h s d", three=3, d=self.head_dim)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ctx = rearrange(ctx, "b h s d -> s b (h d)")
        out, _ = self.proj(ctx)
        return out


class ParallelMLP(nn.Module):
    """h -> ffn (column parallel) -> GELU -> h (row parallel).

    Raises:
        ValueError: ``ffn_hidden_size`` is not divisible by the TP size (from the TP layers).
    """

    def __init__(self, cfg: TransformerConfig, config: ModelParallelConfig, tp_group=None) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, config=config,
                                        init_method=init_method_normal(cfg.init_std), tp_group=tp_group)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, config=config, input_is_parallel=True,
                                     init_method=scaled_init_method_normal(cfg.init_std, cfg.num_layers),
                                     tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``fc2(gelu(fc1(x)))`` for ``x`` ``[s, b, h]`` (sequence parallel: ``[s / tp, b, h]``), same shape.

        Communication and its error with compression on are those of :meth:`ParallelAttention.forward`:
        fc1 all-gathers the input under SP, fc2 all-reduces (SP: reduce-scatters) its partial outputs.

        Raises:
            ValueError: the input's last dim is not ``hidden_size`` (from ColumnParallelLinear).
        """
        h, _ = self.fc1(x)
        out, _ = self.fc2(F.gelu(h))
        return out


class TransformerBlock(nn.Module):
    """Pre-LN block: ``x + attn(LN1(x))`` then ``+ mlp(LN2(x))``.

    Raises:
        ValueError: as :class:`ParallelAttention` and :class:`ParallelMLP` (sizes not divisible by TP).
    """

    def __init__(self, cfg: TransformerConfig, config: ModelParallelConfig, tp_group=None) -> None:
        super().__init__()
        sp = config.sequence_parallel
        self.ln1 = layer_norm(cfg.hidden_size, cfg.layernorm_epsilon, sp, config.params_dtype)
        self.attention = ParallelAttention(cfg, config, tp_group)
        self.ln2 = layer_norm(cfg.hidden_size, cfg.layernorm_epsilon, sp, config.params_dtype)
        self.mlp = ParallelMLP(cfg, config, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x = x + attention(LN1(x))``, then ``x + mlp(LN2(x))``; shape ``[s, b, h]`` (SP: ``[s / tp, b, h]``)
        in and out. With compression on, each sublayer's output carries the error of its collectives
        (:meth:`ParallelAttention.forward`); the residual stream itself is never communicated here.

        Raises:
            ValueError: the input's last dim is not ``hidden_size``.
        """
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))
