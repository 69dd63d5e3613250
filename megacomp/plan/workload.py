"""What is trained and how it is laid out: the GPT's sizes and batch, and the TP x PP x DP layout.

Parameter count and FLOPs follow Megatron-LM (Narayanan et al. 2021, arXiv 2104.04473, eq. 3): per token of a
forward and backward pass without recomputation, ``72 L h^2 (1 + s / (6 h) + V / (12 h L))`` FLOPs (= 6 x the
parameters in matmuls plus attention scores and the vocabulary projection); parameters ``12 L h^2 (1 + 13 / (12 h)
+ (V + s) / (12 L h))`` for a 4h MLP. Activation memory per layer ``s b h (34 + 5 a s / h)`` bytes (Korthikanti et al.
2022, arXiv 2205.05198), divided by TP with sequence parallelism.

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
    """The GPT model and its batch."""

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

    def __post_init__(self) -> None:
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"params_dtype {self.params_dtype!r}: use one of {', '.join(PARAMS_DTYPES)}")

    @property
    def ffn(self) -> int:
        """MLP width."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def params(self) -> int:
        """Parameters: per layer QKV + output projection (4h^2 + 4h), MLP (2 h ffn + ffn + h), two layer norms
        (4h); embeddings V h + s h; final norm 2h (output layer tied to the embedding)."""
        h, L = self.hidden_size, self.num_layers
        per_layer = 4 * h * h + 4 * h + 2 * h * self.ffn + self.ffn + h + 4 * h
        return L * per_layer + (self.vocab_size + self.seq_length) * h + 2 * h

    def parameter_shapes(self) -> list[tuple]:
        """The shapes of megacomp.models.gpt's parameters without TP, in its order: position and word embeddings,
        per layer ln1 (weight, bias), QKV (3h x h, 3h), projection (h x h, h), ln2, fc1 (ffn x h, ffn), fc2
        (h x ffn, h); the final norm. Their sizes add up to :attr:`params`."""
        h, f = self.hidden_size, self.ffn
        layer = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (f, h), (f,), (h, f), (h,)]
        return [(self.seq_length, h), (self.vocab_size, h)] + layer * self.num_layers + [(h,), (h,)]

    @property
    def vector_params(self) -> int:
        """Parameters of the 1-D tensors (biases, norms): megacomp's sharded optimizer keeps their buckets
        uncompressed (megacomp.optimizer.buckets), so their exchange travels as it is."""
        return sum(shape[0] for shape in self.parameter_shapes() if len(shape) == 1)

    @property
    def flops_per_token(self) -> float:
        """Forward + backward FLOPs per token (Megatron's formula, no recomputation; for a 4h MLP)."""
        h, L, s, V = self.hidden_size, self.num_layers, self.seq_length, self.vocab_size
        return 72.0 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))

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
                   t.micro_batch_size, t.global_batch_size, m.ffn_hidden_size, name, m.params_dtype)


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
