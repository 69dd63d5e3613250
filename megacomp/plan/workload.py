"""What is trained and how it is laid out: the model's sizes and batch (a GPT, or a Llama-style model with RoPE,
RMSNorm, SwiGLU, grouped-query attention, no biases and an untied output layer), and the TP x PP x DP layout.

FLOPs follow Megatron-LM (Narayanan et al. 2021, arXiv 2104.04473, eq. 3), written for any of these shapes: per token
of a forward and backward pass without recomputation, 6 x the parameters of the matmuls (QKV, projection, MLP, the
vocabulary projection) plus ``12 L s h`` for the attention scores; for a GPT with a 4h MLP this is Megatron's
``72 L h^2 (1 + s / (6 h) + V / (12 h L))``. Parameters are counted from the tensors megacomp.models.gpt builds
(:meth:`ModelSpec.parameter_shapes`). Activation memory per layer ``s b h (34 + 5 a s / h)`` bytes (Korthikanti et al.
2022, arXiv 2205.05198, for the GPT layer; used for the Llama layer too), divided by TP with sequence parallelism.

Failure behaviour: a layout that does not divide the cluster, the heads, the layers or the batch, or an unknown
``params_dtype``, raises ValueError in one line naming the fix (the same rules as megacomp.training.arguments.check).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PARAMS_DTYPES = ("float32", "bfloat16", "float16")
"""Parameter dtypes pretraining accepts (megacomp.training.arguments.check)."""


@dataclass(frozen=True)
class ModelSpec:
    """The model (a GPT by default; the Llama fields as megacomp.training.pretrain_config.ModelConfig) and its
    batch."""

    num_layers: int
    """Transformer layers (L)."""
    hidden_size: int
    """Model width (h)."""
    num_attention_heads: int
    """Attention heads (a)."""
    seq_length: int
    """Tokens per sample (s)."""
    vocab_size: int
    """Vocabulary (V)."""
    micro_batch_size: int = 1
    """Samples per micro-batch per DP rank (b)."""
    global_batch_size: int = 1
    """Samples per iteration over all DP ranks."""
    ffn_hidden_size: Optional[int] = None
    """MLP width (default 4h)."""
    name: str = "gpt"
    """Label for tables."""
    params_dtype: str = "bfloat16"
    """Dtype of the model's parameters (pretraining's ``params_dtype``): the sharded optimizer all-gathers them in
    it (``float32``, ``bfloat16`` or ``float16``)."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` (a learned s x h table) or ``rope`` (no parameters)."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only)."""
    swiglu: bool = False
    """SwiGLU MLP: fc1 holds the gate and up projections (2 ffn x h), three matmuls instead of two."""
    num_query_groups: Optional[int] = None
    """Key/value heads of grouped-query attention (None: one per head)."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linear layers."""
    untie_embeddings_and_output_weights: bool = False
    """A separate V x h output layer instead of the word embedding's transpose."""

    def __post_init__(self) -> None:
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"params_dtype {self.params_dtype!r}: use one of {', '.join(PARAMS_DTYPES)}")
        groups = self.num_query_groups
        if groups is not None and (groups < 1 or self.num_attention_heads % groups):
            raise ValueError(f"num_query_groups {groups} must divide the {self.num_attention_heads} attention heads")

    @property
    def ffn(self) -> int:
        """MLP width."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused QKV weight: h queries plus 2 x (key/value heads) x head width."""
        h, a = self.hidden_size, self.num_attention_heads
        return h + 2 * (self.num_query_groups or a) * (h // a)

    @property
    def params(self) -> int:
        """Parameters of the tensors megacomp.models.gpt builds (:meth:`parameter_shapes`); for a GPT with a 4h MLP,
        Megatron's ``12 L h^2 (1 + 13 / (12 h) + (V + s) / (12 L h))``."""
        total = 0
        for shape in self.parameter_shapes():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def parameter_shapes(self) -> list[tuple]:
        """The shapes of megacomp.models.gpt's parameters without TP, in its order: the position table (learned
        positions only), the word embedding; per layer ln1 (weight, and bias for LayerNorm), QKV (:attr:`qkv_rows`
        x h, bias), projection (h x h, bias), ln2, fc1 ((2 for SwiGLU) ffn x h, bias), fc2 (h x ffn, bias), each
        bias only with ``add_bias_linear``; the final norm; the output layer when untied."""
        h, f = self.hidden_size, self.ffn
        bias = self.add_bias_linear
        norm = [(h,), (h,)] if self.normalization == "LayerNorm" else [(h,)]
        fc1 = (2 * f if self.swiglu else f)
        layer = (norm + [(self.qkv_rows, h)] + ([(self.qkv_rows,)] if bias else []) + [(h, h)]
                 + ([(h,)] if bias else []) + norm + [(fc1, h)] + ([(fc1,)] if bias else []) + [(h, f)]
                 + ([(h,)] if bias else []))
        head = ([(self.seq_length, h)] if self.position_embedding_type == "learned_absolute" else [])
        tail = [(self.vocab_size, h)] if self.untie_embeddings_and_output_weights else []
        return head + [(self.vocab_size, h)] + layer * self.num_layers + norm + tail

    @property
    def vector_params(self) -> int:
        """Parameters of the 1-D tensors (biases, norms): megacomp's sharded optimizer keeps their buckets
        uncompressed (megacomp.optimizer.buckets), so their exchange travels as it is."""
        return sum(shape[0] for shape in self.parameter_shapes() if len(shape) == 1)

    @property
    def flops_per_token(self) -> float:
        """Forward + backward FLOPs per token without recomputation: 6 x the matmul parameters (QKV, projection,
        fc1, fc2 per layer; the vocabulary projection) + 12 L s h for the attention scores (Megatron's formula
        for a GPT with a 4h MLP)."""
        h, L, s, V, f = self.hidden_size, self.num_layers, self.seq_length, self.vocab_size, self.ffn
        layer = self.qkv_rows * h + h * h + (3 if self.swiglu else 2) * h * f
        return 6.0 * (L * layer + V * h) + 12.0 * L * s * h

    @property
    def tokens_per_iteration(self) -> int:
        """Tokens in one global batch."""
        return self.global_batch_size * self.seq_length

    @classmethod
    def from_yaml(cls, path: str) -> "ModelSpec":
        """The model and batch of a pretraining YAML (``configs/gpt_7b.yaml``), read with pretraining's own
        loader so the keys mean what they mean there."""
        from ..config import load_yaml
        from ..training.arguments import config_values
        from ..training.pretrain_config import PretrainConfig
        cfg = PretrainConfig(**{k: v for k, v in config_values(load_yaml(path), path).items()})
        m, t = cfg.model, cfg.training
        name = str(path).rsplit("/", 1)[-1].removesuffix(".yaml")
        return cls(m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size,
                   t.micro_batch_size, t.global_batch_size, m.ffn_hidden_size, name, m.params_dtype,
                   m.position_embedding_type, m.normalization, m.swiglu, m.num_query_groups, m.add_bias_linear,
                   m.untie_embeddings_and_output_weights)


@dataclass(frozen=True)
class Layout:
    """TP x PP x DP (ranks: TP fastest, then DP, then PP, as megacomp.parallel_state.rank_grid)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel replicas."""
    vp: int = 1
    """Model chunks per pipeline stage (interleaved 1F1B; 1 = plain 1F1B)."""
    sequence_parallel: bool = False
    """Sequence parallelism inside TP (all-gather / reduce-scatter instead of all-reduce)."""

    @property
    def world(self) -> int:
        """TP x PP x DP."""
        return self.tp * self.pp * self.dp

    def micro_batches(self, model: ModelSpec) -> int:
        """Micro-batches per iteration per pipeline: global / (micro x DP)."""
        return model.global_batch_size // (model.micro_batch_size * self.dp)

    def check(self, model: ModelSpec, gpus: Optional[int] = None) -> None:
        """Raises ValueError (one line, naming the fix) when the layout does not fit the model or the GPUs."""
        if min(self.tp, self.pp, self.dp, self.vp) < 1:
            raise ValueError(f"layout TP {self.tp} x PP {self.pp} x DP {self.dp} (VP {self.vp}): every size must be >= 1")
        if gpus is not None and self.world != gpus:
            raise ValueError(f"layout TP {self.tp} x PP {self.pp} x DP {self.dp} = {self.world} ranks does not match "
                             f"{gpus} GPUs: pick sizes whose product is the GPU count")
        if model.num_attention_heads % self.tp or model.hidden_size % self.tp:
            raise ValueError(f"TP {self.tp} does not divide the {model.num_attention_heads} heads / hidden "
                             f"{model.hidden_size} of {model.name}: pick a TP size that divides both")
        if model.num_query_groups and model.num_query_groups % self.tp:
            raise ValueError(f"TP {self.tp} does not divide the {model.num_query_groups} key/value heads of "
                             f"{model.name}: pick a TP size that divides num_query_groups")
        if model.num_layers % (self.pp * self.vp):
            raise ValueError(f"PP {self.pp} x VP {self.vp} does not divide the {model.num_layers} layers of "
                             f"{model.name}: pick stages (and chunks) that divide the layer count")
        if model.global_batch_size % (model.micro_batch_size * self.dp):
            raise ValueError(f"global batch {model.global_batch_size} is not a multiple of micro batch "
                             f"{model.micro_batch_size} x DP {self.dp}: raise the global batch or lower DP")
        if self.micro_batches(model) % self.pp:
            raise ValueError(f"{self.micro_batches(model)} micro-batches per iteration is not a multiple of the "
                             f"{self.pp} pipeline stages: raise the global batch")
        if self.sequence_parallel and model.seq_length % self.tp:
            raise ValueError(f"sequence parallelism needs seq_length {model.seq_length} divisible by TP {self.tp}")

    def __str__(self) -> str:
        vp = f" VP{self.vp}" if self.vp > 1 else ""
        return f"TP{self.tp} PP{self.pp}{vp} DP{self.dp}" + (" SP" if self.sequence_parallel else "")
