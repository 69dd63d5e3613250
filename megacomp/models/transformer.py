"""A pre-norm transformer block built from the tensor-parallel layers: GPT-style by default, Llama-style by option.

Activations are ``[seq, batch, hidden]``; under sequence parallelism each TP rank holds ``seq / tp`` rows
outside the attention / MLP matmuls (norms and residual adds run on the slice).

    x = x + proj(attention(qkv(N1(x))))          qkv: ColumnParallelLinear(h, (n + 2 g) d), heads split over TP
    x = x + fc2(act(fc1(N2(x))))                 fc1: ColumnParallelLinear(h, f, or 2 f with SwiGLU),
                                                 fc2: RowParallelLinear(f, h)

n query heads of width d = h / n, g key/value heads (``num_query_groups``; g = n by default). The fused QKV weight
is laid out per query group, as Megatron-core's ``linear_qkv``: rows ``[q_{j,0}; ...; q_{j,n/g-1}; k_j; v_j]`` for
group j (``[q_i; k_i; v_i]`` per head when g = n), so a contiguous TP shard holds whole groups and the layer is
parallelism-invariant. Attention is causal ``F.scaled_dot_product_attention``.

The Llama options, under Megatron's names (all off by default, which is the GPT block, unchanged):

* ``normalization: RMSNorm`` -- ``y = x / sqrt(mean(x^2 over h) + eps) * weight`` (no mean subtraction, no bias;
  eps = ``layernorm_epsilon``), computed in fp32 and cast back to the input dtype before the weight multiplies.
* ``position_embedding_type: rope`` -- rotary position embedding on q and k of every head, after the QKV
  projection and before attention (no learned position table). Megatron's default non-interleaved form
  (``rotary_interleaved=False``, GPT-NeoX / Hugging Face Llama ``rotate_half``): with d the head width,
  ``theta_i = rotary_base^(-2 i / d)`` for i < d / 2, and at position p dims i and i + d / 2 rotate as one pair,
  ``(x_i, x_{i+d/2}) -> (x_i cos(p theta_i) - x_{i+d/2} sin(p theta_i),
  x_{i+d/2} cos(p theta_i) + x_i sin(p theta_i))``.
  All d dims rotate (Megatron's ``rotary_percent`` 1.0). Positions count from 0 over the full sequence (under
  sequence parallelism the QKV projection has already gathered it).
* ``num_query_groups: g`` -- grouped-query attention: query head i uses key/value head ``i // (n / g)``. TP rank r
  of t holds groups ``[r g / t, (r + 1) g / t)``, i.e. query heads ``[r n / t, (r + 1) n / t)`` and exactly the
  key/value heads they use, so attention needs no communication. t must divide g (and g must divide n).
* ``swiglu: true`` -- ``fc2(silu(gate) * up)`` with the gate and up projections fused in one
  ColumnParallelLinear of 2 f outputs (Megatron's ``gated_linear_unit`` with ``activation_func=silu``, flag
  ``--swiglu``). Its rows are interleaved per unit, ``[gate_0; up_0; gate_1; up_1; ...]``, so every contiguous TP
  shard holds the gate and up rows of the same f / t units (the pairs stay together at any TP size, and the
  parallelism-invariant init and resharding by concatenation work unchanged). Megatron's shard of TP rank r is
  ``[gate_r; up_r]``: this layout's shard rows ``0::2`` then ``1::2``.
* ``add_bias_linear: false`` -- no biases in the four linear layers (Megatron's flag ``--disable-bias-linear``);
  ``add_qkv_bias`` keeps the QKV bias alone.

Norms are apex's FusedLayerNorm when apex is installed (optional), torch's LayerNorm otherwise, or the RMSNorm here;
under sequence parallelism their parameters are marked ``sequence_parallel`` so
:func:`megacomp.tensor_parallel.allreduce_sequence_parallel_gradients` sums their gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
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
    """Shape of the transformer layers (field names are megatron-core's TransformerConfig / GPTModel arguments).

    Raises:
        ValueError: ``hidden_size`` is not divisible by ``num_attention_heads``; ``num_query_groups`` does not divide
            ``num_attention_heads``; an unknown ``normalization`` or ``position_embedding_type``; rope with an odd
            head width or a non-positive ``rotary_base``.
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
    num_query_groups: Optional[int] = None
    """Key/value heads of grouped-query attention, each shared by ``num_attention_heads / num_query_groups`` query
    heads (divisible by the TP size); None: ``num_attention_heads`` (multi-head attention)."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` or ``RMSNorm``, both with ``layernorm_epsilon``."""
    swiglu: bool = False
    """SwiGLU MLP ``fc2(silu(gate) * up)`` (fc1 holds the gate and up rows, 2 x ffn_hidden_size) instead of GELU."""
    add_bias_linear: bool = True
    """Biases in the QKV, attention output and MLP linear layers; False: none (Llama)."""
    add_qkv_bias: bool = False
    """A QKV bias even when ``add_bias_linear`` is False."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` (a learned position table added to the word embeddings) or ``rope`` (rotary, in
    attention)."""
    rotary_base: float = 10000.0
    """RoPE base (Llama 2: 10000, Llama 3: 500000)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_query_groups ({self.num_query_groups}) must divide num_attention_heads "
                             f"({self.num_attention_heads}): each key/value head serves a whole number of query heads")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization {self.normalization!r} is not one of {list(NORMALIZATIONS)}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type {self.position_embedding_type!r} is not one of "
                             f"{list(POSITION_EMBEDDING_TYPES)}")
        if self.position_embedding_type == "rope":
            if (self.hidden_size // self.num_attention_heads) % 2:
                raise ValueError(f"rope needs an even head width; hidden_size / num_attention_heads = "
                                 f"{self.hidden_size // self.num_attention_heads}")
            if not self.rotary_base > 0:
                raise ValueError(f"rotary_base must be > 0, got {self.rotary_base}")


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""The ``normalization`` values."""
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
"""The ``position_embedding_type`` values."""


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


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2 over the last dim) + eps) * weight`` (Megatron's ``normalization: RMSNorm``): the
    normalisation in fp32, cast back to the input dtype, then scaled by the weight (ones at init; no bias)."""

    def __init__(self, hidden: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised ``x`` (any shape ``[..., hidden]``), in ``x``'s dtype."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def norm_layer(cfg: TransformerConfig, sequence_parallel: bool, dtype: torch.dtype) -> nn.Module:
    """The block's norm per ``cfg.normalization``: :func:`layer_norm` or :class:`RMSNorm` (its weight marked
    ``sequence_parallel`` like the LayerNorm's)."""
    if cfg.normalization == "LayerNorm":
        return layer_norm(cfg.hidden_size, cfg.layernorm_epsilon, sequence_parallel, dtype)
    norm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon, dtype)
    norm.weight.sequence_parallel = sequence_parallel
    return norm


def rotary_cos_sin(seq: int, dim: int, base: float, device=None, dtype: torch.dtype = torch.float32):
    """``(cos, sin)``, each ``[seq, dim]``, of the angles ``p theta_i`` (``theta_i = base^(-2 i / dim)``, i < dim / 2)
    repeated over both halves of the head dims; computed in fp32, returned in ``dtype``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[..., seq, d]``: ``x cos + rotate_half(x) sin`` with ``rotate_half(x) = [-x2, x1]`` for the
    halves ``x1, x2`` of the last dim (Megatron's non-interleaved rotary)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class ParallelAttention(nn.Module):
    """Causal self-attention with query heads and key/value groups split over the TP group (optionally
    grouped-query, optionally with RoPE: see the module docstring).

    Raises:
        ValueError: ``num_attention_heads`` or ``num_query_groups`` is not divisible by the TP size (or the TP
            layers' own checks).
    """

    def __init__(self, cfg: TransformerConfig, config: ModelParallelConfig, tp_group=None) -> None:
        super().__init__()
        tp = config.tensor_model_parallel_size
        if cfg.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by the tensor-parallel "
                             f"size ({tp})")
        if cfg.num_query_groups % tp:
            raise ValueError(f"num_query_groups ({cfg.num_query_groups}) is not divisible by the tensor-parallel size "
                             f"({tp}): every TP rank needs whole key/value heads; use a TP size that divides it")
        self.heads_per_rank = cfg.num_attention_heads // tp
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.q_per_group = cfg.num_attention_heads // cfg.num_query_groups
        self.rope_base = cfg.rotary_base if cfg.position_embedding_type == "rope" else None
        self._rope_cache = None  # (seq, device, dtype, cos, sin) of the last forward
        qkv_size = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * self.head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden_size, qkv_size, config=config,
                                        init_method=init_method_normal(cfg.init_std),
                                        bias=cfg.add_bias_linear or cfg.add_qkv_bias, tp_group=tp_group)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, config=config, input_is_parallel=True,
                                      init_method=scaled_init_method_normal(cfg.init_std, cfg.num_layers),
                                      bias=cfg.add_bias_linear, tp_group=tp_group)

    def _rotary(self, seq: int, like: torch.Tensor):
        """RoPE's (cos, sin) for ``seq`` positions in ``like``'s device and dtype, kept for the next forward."""
        c = self._rope_cache
        if c is None or c[:3] != (seq, like.device, like.dtype):
            c = self._rope_cache = (seq, like.device, like.dtype,
                                    *rotary_cos_sin(seq, self.head_dim, self.rope_base, like.device, like.dtype))
        return c[3], c[4]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention output for ``x`` ``[s, b, h]`` (sequence parallel: ``[s / tp, b, h]``), same shape.

        Steps: fused QKV projection (ColumnParallelLinear; under SP it first all-gathers ``x`` along the
        sequence) -> this rank's heads (and key/value groups) -> RoPE on q and k (``rope``) -> each key/value head
        repeated for its n / g query heads (GQA) -> causal ``scaled_dot_product_attention`` -> output projection
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
        qkv, _ = self.qkv(x)                                   # [s, b, (n + 2 g) d / tp]
        if self.q_per_group == 1:
            # each head's q, k, v are adjacent in the fused projection (Megatron's layout): views, no copies
            q, k, v = rearrange(qkv, "s b (h three d) -> three b h s d", three=3, d=self.head_dim)
        else:  # per group: its n / g query heads, then its k and v
            parts = rearrange(qkv, "s b (g x d) -> x b g s d", x=self.q_per_group + 2, d=self.head_dim)
            q = rearrange(parts[:-2], "x b g s d -> b (g x) s d")
            k, v = parts[-2], parts[-1]
        if self.rope_base is not None:
            cos, sin = self._rotary(q.shape[-2], q)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.q_per_group > 1:  # query head i of this rank reads key/value head i // (n / g) of this rank
            k = repeat(k, "b g s d -> b (g x) s d", x=self.q_per_group)
            v = repeat(v, "b g s d -> b (g x) s d", x=self.q_per_group)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ctx = rearrange(ctx, "b h s d -> s b (h d)")
        out, _ = self.proj(ctx)
        return out


class ParallelMLP(nn.Module):
    """h -> ffn (column parallel) -> GELU -> h (row parallel); with ``swiglu`` h -> 2 ffn (gate and up rows
    interleaved, column parallel) -> ``silu(gate) * up`` -> h (row parallel).

    Raises:
        ValueError: ``ffn_hidden_size`` is not divisible by the TP size (from the TP layers).
    """

    def __init__(self, cfg: TransformerConfig, config: ModelParallelConfig, tp_group=None) -> None:
        super().__init__()
        self.swiglu = cfg.swiglu
        fc1_size = 2 * cfg.ffn_hidden_size if cfg.swiglu else cfg.ffn_hidden_size
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, fc1_size, config=config,
                                        init_method=init_method_normal(cfg.init_std), bias=cfg.add_bias_linear,
                                        tp_group=tp_group)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, config=config, input_is_parallel=True,
                                     init_method=scaled_init_method_normal(cfg.init_std, cfg.num_layers),
                                     bias=cfg.add_bias_linear, tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``fc2(gelu(fc1(x)))`` (SwiGLU: ``fc2(silu(gate) * up)``) for ``x`` ``[s, b, h]`` (sequence parallel:
        ``[s / tp, b, h]``), same shape.

        Communication and its error with compression on are those of :meth:`ParallelAttention.forward`:
        fc1 all-gathers the input under SP, fc2 all-reduces (SP: reduce-scatters) its partial outputs.

        Raises:
            ValueError: the input's last dim is not ``hidden_size`` (from ColumnParallelLinear).
        """
        h, _ = self.fc1(x)
        if self.swiglu:  # rows 2 j and 2 j + 1 of fc1 are unit j's gate and up
            gate, up = h.unflatten(-1, (-1, 2)).unbind(-1)
            act = F.silu(gate) * up
        else:
            act = F.gelu(h)
        out, _ = self.fc2(act)
        return out


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(N1(x))`` then ``+ mlp(N2(x))`` (N: LayerNorm or RMSNorm per ``normalization``).

    Raises:
        ValueError: as :class:`ParallelAttention` and :class:`ParallelMLP` (sizes not divisible by TP).
    """

    def __init__(self, cfg: TransformerConfig, config: ModelParallelConfig, tp_group=None) -> None:
        super().__init__()
        sp = config.sequence_parallel
        self.ln1 = norm_layer(cfg, sp, config.params_dtype)
        self.attention = ParallelAttention(cfg, config, tp_group)
        self.ln2 = norm_layer(cfg, sp, config.params_dtype)
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
