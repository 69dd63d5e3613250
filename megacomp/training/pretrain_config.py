"""The pretraining configuration as a tree: one dataclass per component (model, parallel layout, data,
training schedule and optimizer choice, checkpointing, logging, evaluation), one per training family (owned by the
family's module in megacomp.training.features and added here from the registry), and the compression preset.

    cfg = PretrainConfig(num_layers=4, optimizer="onebit_adam", freeze_step=100)   # flat, Megatron-style names
    cfg.onebit.freeze_step, cfg.training.optimizer                                  # the tree
    cfg.freeze_step                                                                 # the flat view, same value

Every field has a flat name (megacomp.training.config_tree), unique across the tree: the constructor,
attribute reads and writes, ``dataclasses.replace``, the YAML file and the command line accept it, so the
flags and keys users script against keep working. YAML files may also nest (``onebit: {freeze_step: 100}``).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ..config import CommCompressionConfig, load_yaml
from .config_tree import component_fields, did_you_mean, flat_name
from .features import FEATURES

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@dataclass
class ModelConfig:
    """The model: a GPT, or a Llama-style model with the Llama fields below (megacomp.models.llama; megatron-core's
    names, e.g. configs/llama_tiny.yaml)."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 4
    """Attention heads."""
    ffn_hidden_size: Optional[int] = None
    """MLP width (default 4 x hidden)."""
    seq_length: int = 64
    """Tokens per sample."""
    vocab_size: int = 1024
    """Tokenizer vocabulary (rounded up to a multiple of the TP size for the embedding)."""
    params_dtype: str = "float32"
    """float32 or bfloat16 model parameters (masters stay fp32); with lomo / adalomo also float16 (dynamic loss
    scaling; no masters: parameters are updated in their own dtype, the update computed in fp32)."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` (GPT: a learned position table) or ``rope`` (Llama: rotary positions in attention)."""
    rotary_base: float = 10000.0
    """RoPE base theta (Llama 2: 10000, Llama 3: 500000)."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` (GPT) or ``RMSNorm`` (Llama), both with ``layernorm_epsilon``."""
    layernorm_epsilon: float = 1e-5
    """The normalization's epsilon."""
    swiglu: bool = False
    """SwiGLU MLP (Llama; gate and up projections fused in one column-parallel layer) instead of GELU."""
    num_query_groups: Optional[int] = None
    """Grouped-query attention's key/value heads (Llama 3: 8), dividing the heads and divisible by the TP size;
    unset: one per head (multi-head attention)."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linear layers (Llama: false, Megatron-LM's --disable-bias-linear)."""
    untie_embeddings_and_output_weights: bool = False
    """A separate output layer instead of the word embedding's transpose (Llama: true)."""


MODEL_OPTION_FIELDS = ("position_embedding_type", "rotary_base", "normalization", "layernorm_epsilon", "swiglu",
                       "num_query_groups", "add_bias_linear", "untie_embeddings_and_output_weights")
"""The ModelConfig fields passed as they are to megacomp.models.gpt.GPTConfig (the Llama options and their GPT
defaults)."""

@dataclass
class ParallelConfig:
    """The TP x PP x DP layout and its process groups."""

    tensor_model_parallel_size: int = 1
    """TP size."""
    pipeline_model_parallel_size: int = 1
    """PP size (1F1B schedule)."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per virtual pipeline stage (Megatron's flag): the interleaved 1F1B schedule with
    num_layers / (PP x this) model chunks per stage; None = the non-interleaved schedule."""
    sequence_parallel: bool = False
    """Sequence parallelism inside TP."""
    distributed_timeout_minutes: float = 10.0
    """Timeout of collectives: a dead rank makes the others fail after at most this long."""
    validate_collectives_every: int = 0
    """Check collective arguments across ranks on every call (1) or only in the first iteration (0)."""
    ranks_per_node: int = 0
    """Ranks on each node, for launchers that do not say (torchrun, Slurm and MPI do; namespaces on one machine share
    a host name): ranks r x k ... r x k + k - 1 on node r. 0 = what the launcher says (host names as the fallback).
    A value that contradicts the launcher is refused (megacomp.placement)."""
    nodes_per_site: int = 0
    """Nodes per site (launchers do not know sites): nodes n x s ... n x s + s - 1 in site n. 0 = one site."""
    dp_collectives: str = "auto"
    """auto: a DP group with several ranks on each of several nodes exchanges hop by hop (inside each node
    uncompressed, then across nodes with the path's codec; megacomp.comm.hierarchical), so the slow link carries each
    node's bytes once; other groups exchange flat. flat: one exchange over the whole DP group (a node's data crosses
    the slow link once per rank of it on the node)."""


@dataclass
class TrainingConfig:
    """Batch, schedule, the optimizer family and the run's stopping rules."""

    micro_batch_size: int = 4
    """Samples per micro-batch per DP rank."""
    global_batch_size: int = 16
    """Samples per iteration over all DP ranks (a multiple of micro_batch_size x DP size)."""
    train_iters: int = 100
    """Iterations to train."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    lr_warmup_iters: int = 10
    """Linear warm-up iterations."""
    optimizer: str = "adamw"
    """adamw: the sharded optimizer (gradients reduce-scattered over DP, megacomp.optimizer.DistributedOptimizer);
    demo: DeMo (megacomp.optimizer.DeMo): no gradient reduction, each DP rank keeps its own momentum and
    all-gathers only its top-k DCT components; --lr is then the sign-SGD step size (6e-3 was best on the tiny
    GPT: benchmarks/results/convergence_demo_sweep); onebit_adam, zero_one_adam, onebit_lamb: the 1-bit family
    (megacomp.optimizer.onebit; DeepSpeed's hyperparameter names below, momentum over the dp_momentum path):
    1-bit Adam (Adam whose momentum travels as signs after a full-precision warm-up that freezes the variance),
    0/1 Adam (1-bit Adam with adaptive variance freezing and local steps between synchronisations) and 1-bit LAMB
    (the same on LAMB, with frozen per-layer trust ratios);
    lomo, adalomo: LOMO / AdaLomo (megacomp.optimizer.lomo): each parameter is all-reduced over DP (the
    dp_gradient path), updated and its gradient freed inside backward, so no gradient buffer, fp32 master or
    (LOMO) optimizer state exists; one micro-batch per iteration, no pipeline or sequence parallelism."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    seed: int = 1234
    """Seed of the initialisation and the data order. Stochastic-rounding codecs without their own seed
    draw from torch's generator, whose state the checkpoints save."""
    initial_loss_scale: float = 65536.0
    """float16 parameters: the starting dynamic loss scale (halved after an overflow step, which is skipped)."""
    loss_scale_window: int = 1000
    """float16 parameters: clean steps in a row before the loss scale doubles."""
    max_skipped_steps: int = 10
    """Consecutive steps skipped for inf/NaN gradients or loss that are tolerated; one more stops the run
    (non-zero exit, no checkpoint of the diverged state)."""
    loss_divergence_factor: float = 10.0
    """Stop when the loss exceeds this times the lowest loss so far (0 = off)."""
    exit_interval: int = 0
    """Stop (after saving) when the iteration is a multiple of this (0 = off), e.g. to test resume."""
    exit_on_signal: bool = True
    """On SIGTERM or SIGUSR1 (Slurm: sbatch --signal=USR1@120), save a checkpoint at the next iteration
    boundary and exit with status 0."""


@dataclass
class DataConfig:
    """The corpus, its tokenizer and the token cache."""

    data_path: Optional[list] = None
    """Corpus files or directories (plain text; ``*.jsonl``: one document per line and --json-keys key), or Megatron
    indexed datasets by prefix (PREFIX.bin / PREFIX.idx, from megacomp-preprocess-data or Megatron's
    preprocess_data.py), one or several, or weighted as Megatron takes them: ``0.7 PREFIX_A 0.3 PREFIX_B`` (samples
    drawn in those proportions). Default: the Python standard library's sources."""
    split: Optional[str] = None
    """Megatron's train, validation and test proportions by document, e.g. ``969,30,1`` (normalised; each dataset of
    a blend is split alike). Default None: no split, every document trains (today's samples, the same as ``100,0,0``)
    and there is no validation or test set."""
    tokenizer_type: Optional[str] = None
    """Megatron's tokenizer name: HuggingFaceTokenizer (--tokenizer-model: tokenizer.json or its folder),
    GPT2BPETokenizer (--vocab-file, --merge-file), SentencePieceTokenizer or GPTSentencePieceTokenizer
    (--tokenizer-model: a .model); local files only. The model's vocabulary then follows the tokenizer's (vocab_size
    and tokenizer_max_bytes do not apply). Default: train a sentencepiece BPE of vocab_size pieces on the corpus.
    Indexed data needs the tokenizer it was preprocessed with."""
    tokenizer_model: Optional[str] = None
    """The tokenizer file of HuggingFaceTokenizer (tokenizer.json or its folder) or of the SentencePiece types
    (.model)."""
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer's vocab.json."""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer's merges.txt."""
    json_keys: Optional[list] = None
    """The JSON keys holding the text in ``*.jsonl`` corpus files (default: text)."""
    data_cache_dir: Optional[str] = None
    """Where the tokenizer and token files are cached (default $MEGACOMP_DATA_CACHE or ~/.cache/megacomp)."""
    dataset_samples: Optional[int] = None
    """Train on the first N samples only, for several epochs (a fine-tuning-style set, as AQ-SGD needs);
    None = every sample of the corpus."""
    tokenizer_max_bytes: int = 5 * 1024 * 1024
    """Text used to train the tokenizer."""


@dataclass
class CheckpointConfig:
    """Where checkpoints are written and read."""

    save: Optional[str] = None
    """Checkpoint directory to write."""
    save_interval: int = 0
    """Iterations between checkpoints (0: only at the end when --save is set)."""
    load: Optional[str] = None
    """Checkpoint directory to resume from (latest iteration)."""
    finetune: bool = False
    """With ``load``: start from the checkpoint's model weights only (Megatron's --finetune): iteration 0, fresh
    optimizer, RNG and error feedback; compression, optimizer and data may differ from the checkpoint's run.
    When ``save`` (which must differ from ``load``) already holds a checkpoint, the run resumes from it instead."""
    keep_checkpoints: int = 0
    """Keep only the newest this many checkpoints under --save (0 = keep all)."""
    allow_data_order_change: bool = False
    """Resume although a field that decides which samples an iteration sees (seed, data path, dataset samples,
    global batch size, tokenizer bytes, split, the tokenizer's type and files, JSON keys) differs from the checkpoint's;
    without it such a resume is refused."""
    load_fallback: bool = False
    """When the latest checkpoint under --load fails verification (a file's SHA-256 differs from its manifest, a
    file is missing or truncated), resume from the newest older one that verifies, saying so (without it the run
    refuses, naming the file and that checkpoint)."""


@dataclass
class LoggingConfig:
    """What the run writes besides the console."""

    log_dir: Optional[str] = None
    """Directory for metrics.jsonl (rank 0)."""
    log_interval: int = 1
    """Iterations between log lines."""
    tensorboard_dir: Optional[str] = None
    """Directory for TensorBoard event files (rank 0, torch.utils.tensorboard; ``pip install tensorboard``): at each
    logged iteration the loss, learning rate, tokens/s, grad norm, wire bytes per traffic kind and per link kind, the
    compression-error probe, and after each evaluation the validation loss and PPL and the evaluation's wire bytes
    (megacomp.training.trackers). A resumed run drops the events a killed attempt wrote after its checkpoint."""
    wandb_project: Optional[str] = None
    """Weights & Biases project (rank 0; ``pip install wandb``) receiving the same scalars as TensorBoard. Offline
    (``wandb sync DIR`` uploads it later) when no API key is set (``WANDB_API_KEY`` or ``wandb login``); the
    ``WANDB_MODE`` environment variable, when set, decides instead."""
    wandb_exp_name: Optional[str] = None
    """The W&B run's name (default: one W&B chooses)."""
    wandb_save_dir: Optional[str] = None
    """Directory of the W&B run's files (default: ``--save``/wandb with --save, else ``--log-dir``/wandb, else
    ./wandb)."""


@dataclass
class EvaluationConfig:
    """Validation during training (Megatron's flags; megacomp.training.evaluation)."""

    eval_interval: Optional[int] = None
    """Evaluate on the validation split every this many iterations and at the last one (with the test split then,
    when --split gives it samples): ``eval_iters`` forward-only rounds of one global batch, no gradient, no optimizer
    step; None = never. Needs a validation share in --split."""
    eval_iters: int = 100
    """Rounds of one global batch per evaluation: the same first ``eval_iters x global_batch_size`` validation
    samples every time (wrapping around a smaller split)."""


BASE_COMPONENTS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig, "data": DataConfig,
                   "checkpoint": CheckpointConfig, "logging": LoggingConfig, "evaluation": EvaluationConfig}
"""The tree's components besides the families' (megacomp.training.features) and ``compression``."""

COMPRESSION_DOC = ("Preset name (configs/compression/NAME.yaml), YAML file or mapping of a codec per traffic path "
                   "(see megacomp.config.CommCompressionConfig).")


class PretrainConfigBase:
    """Methods of :class:`PretrainConfig` (the dataclass itself is assembled from the components below)."""

    def __init__(self, **settings: Any) -> None:
        comps = type(self).components()
        flat = type(self).flat_fields()
        for key, cls in comps.items():
            given = settings.pop(key, None)
            if isinstance(given, dict):
                given = _component_from_dict(key, cls, given)
            elif given is not None and not isinstance(given, cls):
                raise TypeError(f"PretrainConfig {key} must be a {cls.__name__} or a mapping, got {type(given).__name__}")
            object.__setattr__(self, key, copy.copy(given) if given is not None else cls())
        object.__setattr__(self, "compression", settings.pop("compression", "none"))
        object.__setattr__(self, "explicit", frozenset(settings.pop("explicit", ())) | frozenset(settings))
        for name, value in settings.items():  # flat names, applied on top of the components
            if name not in flat:
                raise TypeError(f"PretrainConfig got an unknown setting {name!r}{did_you_mean(name, flat)}")
            key, leaf = flat[name]
            setattr(getattr(self, key), leaf, value)

    def __getattr__(self, name: str) -> Any:  # only for names that are not attributes: the flat view
        where = type(self).flat_fields().get(name)
        if where is None:
            raise AttributeError(f"PretrainConfig has no setting {name!r}")
        return getattr(object.__getattribute__(self, where[0]), where[1])

    def __setattr__(self, name: str, value: Any) -> None:
        where = type(self).flat_fields().get(name)
        if where is not None:
            setattr(getattr(self, where[0]), where[1], value)
        else:
            object.__setattr__(self, name, value)

    @classmethod
    def components(cls) -> dict[str, type]:
        """Component key -> its dataclass, in the tree's order (``compression`` is a plain value)."""
        return dict(cls._COMPONENTS)

    @classmethod
    def flat_fields(cls) -> dict[str, tuple[str, str]]:
        """Flat name -> (component key, field name)."""
        return cls._FLAT

    def compression_config(self) -> CommCompressionConfig:
        """``load_compression(self.compression)``; raises as :func:`load_compression`."""
        return load_compression(self.compression)

    def flat(self) -> dict[str, Any]:
        """Every setting under its flat name, plus ``compression`` (what a checkpoint records)."""
        out = {name: getattr(getattr(self, key), leaf) for name, (key, leaf) in type(self).flat_fields().items()}
        out["compression"] = self.compression
        return out

    def to_dict(self) -> dict[str, Any]:
        """The tree as plain data: one mapping per component, and ``compression``."""
        out = {key: asdict(getattr(self, key)) for key in type(self).components()}
        out["compression"] = self.compression
        return out


def _component_from_dict(key: str, cls: type, data: dict):
    names = [f.name for f in component_fields(cls)]
    for k in data:
        if k not in names:
            raise ValueError(f"unknown key {key}.{k}{did_you_mean(k, names)}; {key} keys: {', '.join(names)}")
    return cls(**data)


def _assemble():
    comps = dict(BASE_COMPONENTS)
    for feature in FEATURES:
        if feature.CONFIG is not None:
            comps[feature.config_key] = feature.CONFIG
    flat = {}
    for key, cls in comps.items():
        for f in component_fields(cls):
            name = flat_name(cls, f)
            if name in flat or name in comps or name == "compression":
                raise TypeError(f"flat name {name!r} of {key}.{f.name} is taken by {flat.get(name, name)}")
            flat[name] = (key, f.name)
    spec = [(key, cls, field(default_factory=cls)) for key, cls in comps.items()]
    spec.append(("compression", Any, field(default="none")))
    # the flat names the user set (the command line's flags, a Python caller's keywords): a family may adapt the
    # others to what it needs (PretrainConfig.resolve), never these
    spec.append(("explicit", frozenset, field(default=frozenset(), compare=False, repr=False)))
    made = make_dataclass("PretrainConfig", spec, bases=(PretrainConfigBase,), init=False)
    made._COMPONENTS, made._FLAT = tuple(comps.items()), flat
    made.__module__ = __name__
    made.__doc__ = ("Everything a pretraining run needs, as a tree of components (see the module docstring). Not "
                    "validated on construction: megacomp.training.arguments.parse_args runs check().")
    return made


PretrainConfig = _assemble()


def load_compression(spec: Union[str, dict, None]) -> CommCompressionConfig:
    """A CommCompressionConfig from a preset name, a YAML path or a mapping.

    None gives the default (uncompressed) config and a CommCompressionConfig is returned as is. A string is
    a YAML file when one exists at that path, else the preset ``configs/compression/NAME.yaml``.

    Raises:
        ValueError: a string that is neither a file nor a preset (the presets are listed); unknown keys or
            invalid settings (CommCompressionConfig); a YAML file whose top level is not a mapping.
        TypeError: a codec setting that is neither a name, a mapping nor a Codec (make_codec).
    """
    if spec is None:
        return CommCompressionConfig()
    if isinstance(spec, dict):
        return CommCompressionConfig.from_dict(spec)
    if isinstance(spec, CommCompressionConfig):
        return spec
    path = Path(spec)
    if not path.is_file():
        path = REPO_CONFIGS / "compression" / f"{spec}.yaml"
    if not path.is_file():
        presets = sorted(p.stem for p in (REPO_CONFIGS / "compression").glob("*.yaml"))
        raise ValueError(f"--compression {spec!r} is neither a file nor a preset; presets: {presets}")
    return CommCompressionConfig.from_dict(load_yaml(str(path)))
