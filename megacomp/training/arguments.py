"""Pretraining configuration: one flat dataclass, filled from a YAML file and Megatron-style CLI flags.

    python -m megacomp.pretrain --config configs/gpt_tiny.yaml --tensor-model-parallel-size 2 \
        --train-iters 50 --compression loco4 --log-dir runs/a

Every field can be set in the YAML file (same name) or on the command line (``--field-name``, dashes for
underscores); the command line wins. ``compression`` is a preset name (``configs/compression/NAME.yaml``),
a YAML file, or an inline mapping in the config. Unknown keys and inconsistent sizes raise ValueError
naming the fix.
"""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional, Union


from ..config import CommCompressionConfig, load_yaml
from ..models.chunks import layers_per_virtual_stage_to_chunks
from ..pipeline_parallel.interleaved import check_interleaving
from .optimizer_args import (LOMO_OPTIMIZERS, ONEBIT_OPTIMIZERS, OPTIMIZERS, OUTER_ALGORITHMS,  # noqa: F401 (re-exported)
                             SPARSELOCO_CODEC, check_lomo, check_overlap, check_zero_stage, loqt_kwargs, mt_dao_optimizer_kwargs,
                             onebit_kwargs, outer_config)

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@dataclass
class PretrainConfig:
    """Everything a pretraining run needs. Not validated on construction: :func:`parse_args` runs
    :func:`check`."""

    # model
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
    # parallelism
    tensor_model_parallel_size: int = 1
    """TP size."""
    pipeline_model_parallel_size: int = 1
    """PP size (1F1B schedule)."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per virtual pipeline stage (Megatron's flag): the interleaved 1F1B schedule with
    num_layers / (PP x this) model chunks per stage; None = the non-interleaved schedule."""
    sequence_parallel: bool = False
    """Sequence parallelism inside TP."""
    # batch and optimisation
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
    weight_decay: float = 0.1
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_freeze_variance_step: int = 0
    """0 = plain AdamW. N > 0: freeze Adam's second moment after N iterations (1-bit Adam's variance
    freezing, megacomp.optimizer.FrozenVarianceAdamW), which lets error feedback reach Adam's update."""
    optimizer: str = "adamw"
    """adamw: the sharded optimizer (gradients reduce-scattered over DP, megacomp.optimizer.DistributedOptimizer);
    demo: DeMo (megacomp.optimizer.DeMo): no gradient reduction, each DP rank keeps its own momentum and
    all-gathers only its top-k DCT components; --lr is then the sign-SGD step size (6e-3 was best on the tiny
    GPT: docs/convergence_demo_sweep); onebit_adam, zero_one_adam, onebit_lamb: the 1-bit family
    (megacomp.optimizer.onebit; DeepSpeed's hyperparameter names below, momentum over the dp_momentum path);
    lomo, adalomo: LOMO / AdaLomo (megacomp.optimizer.lomo): each parameter is all-reduced over DP (the
    dp_gradient path), updated and its gradient freed inside backward, so no gradient buffer, fp32 master or
    (LOMO) optimizer state exists; one micro-batch per iteration, no pipeline or sequence parallelism."""
    freeze_step: int = 100000
    """1-bit Adam / 1-bit LAMB: full-precision warm-up steps before the momentum goes 1-bit (DeepSpeed's default)."""
    var_freeze_step: int = 100000
    """0/1 Adam: last step that may update the variance; local steps follow."""
    var_update_scaler: int = 16
    """0/1 Adam: variance updates between doublings of the variance-update interval."""
    local_step_scaler: int = 32678
    """0/1 Adam: local steps between doublings of the synchronisation interval."""
    local_step_clipper: int = 16
    """0/1 Adam: largest synchronisation interval."""
    max_coeff: float = 10.0
    """1-bit LAMB: upper clamp of the per-layer trust ratio."""
    min_coeff: float = 0.01
    """1-bit LAMB: lower clamp of the per-layer trust ratio."""
    coeff_beta: float = 0.9
    """1-bit LAMB: EMA factor of the frozen trust ratio recorded during the warm-up."""
    factor_max: float = 4.0
    """1-bit LAMB: upper bound of the per-step factor after the freeze."""
    factor_min: float = 0.5
    """1-bit LAMB: lower bound of the per-step factor after the freeze."""
    factor_threshold: float = 0.1
    """1-bit LAMB: largest relative change of the factor from one step to the next."""
    momentum_codec: Any = None
    """1-bit family: codec of the momentum exchange (a name or mapping, also '{name: int4, block_size: 0}' on the
    command line). Default: {name: sign, block_size: 0}, signs with one scale per chunk; 'none' = uncompressed
    (then also --no-momentum-error-feedback)."""
    momentum_error_feedback: bool = True
    """1-bit family: worker and server error feedback on the momentum exchange (needs a lossy codec)."""
    shard_optimizer: bool = True
    """Shard the fp32 masters and optimizer state over DP (ZeRO-1) and all-gather parameters; --no-shard-optimizer
    keeps everything whole on every rank (all-reduce, no all-gather); 0/1 Adam needs it off."""
    zero_stage: int = 1
    """1: the sharded optimizer keeps full-size fp32 gradient buckets for the whole iteration. 2 (ZeRO-2, --optimizer
    adamw with the sharded optimizer; not with powersgd / accordion dp_gradient): each bucket is reduce-scattered as
    soon as a micro-batch's backward fills it and its full-size buffer freed, so only this rank's 1/DP shard of the
    gradients persists; every micro-batch is reduced, i.e. (micro-batches - 1) x ZeRO-1's dp_gradient bytes more per
    iteration. Checkpoints of either stage resume in the other."""
    overlap_param_gather: bool = False
    """Megatron's flag: the sharded optimizer's parameter all-gather (dp_parameter) is left in flight at the end of
    the step, and each module's forward waits only for the buckets it needs (megacomp.optimizer.param_gather), so
    later buckets travel while earlier layers compute. Same results and bytes. --optimizer adamw with the sharded
    optimizer; not with an outer loop, LoQT or --overlap-optimizer."""
    overlap_optimizer: str = "none"
    """'acco' (megacomp.optimizer.acco): each iteration's micro-batches run in two halves; the sharded optimizer's
    reduce-scatter, update and parameter all-gather of one half run in a background thread while the other half's
    gradients are computed, with ACCO's estimate compensating the delay (twice the dp_gradient / dp_parameter bytes,
    hidden behind compute). Needs --optimizer adamw, the sharded ZeRO-1 optimizer, an even number of micro-batches
    (a multiple of 2 x PP), no outer loop, LoQT or error probe. 'dpu': the same background update without the
    halves and the estimate (DistributedOptimizer's bytes; each step's gradients are applied one step late).
    'none': the step waits for its communication."""
    demo_topk: int = 32
    """DeMo: coefficients kept per DCT tile (compression_topk)."""
    demo_chunk: int = 64
    """DeMo: largest DCT tile side, tiles of up to chunk x chunk (compression_chunk)."""
    demo_decay: float = 0.999
    """DeMo: momentum decay (compression_decay), in [0, 1)."""
    loqt_rank: int = 0
    """LoQT (megacomp.tensor_parallel.loqt): 0 = off; r > 0 stores every transformer linear's weight quantised
    (--loqt-codec) and trains only a rank-r factor per layer (plus biases, norms and embeddings), merged into the
    quantised weight on the schedule below; only the trainable parameters cross the DP group."""
    loqt_codec: Any = "{name: int8, block_size: 32}"
    """LoQT: codec of the stored base weights (int8 or int4 with a block size dividing each layer's local rows)."""
    loqt_alpha: float = 0.5
    """LoQT: scale of the low-rank product in the weight (the reference's lora_alpha, used as is)."""
    loqt_update_interval: int = 100
    """LoQT: tau, iterations from the first merge to the second; the k-th later interval is tau + floor(growth^k)."""
    loqt_growth: float = 1.2
    """LoQT: growth psi of the merge intervals (1: every interval is tau + 1)."""
    loqt_compensate_iters: int = 5
    """LoQT: rounds of the reference's quantisation-error compensation at each merge (0 = the factor restarts at 0)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    seed: int = 1234
    """Seed of the initialisation and the data order. Stochastic-rounding codecs without their own seed
    draw from torch's generator, whose state the checkpoints save."""
    params_dtype: str = "float32"
    """float32 or bfloat16 model parameters (masters stay fp32); with lomo / adalomo also float16 (dynamic loss
    scaling; no masters: parameters are updated in their own dtype, the update computed in fp32)."""
    initial_loss_scale: float = 65536.0
    """float16 parameters: the starting dynamic loss scale (halved after an overflow step, which is skipped)."""
    loss_scale_window: int = 1000
    """float16 parameters: clean steps in a row before the loss scale doubles."""
    # data
    data_path: Optional[list] = None
    """Corpus files or directories (default: the Python standard library's sources)."""
    data_cache_dir: Optional[str] = None
    """Where the tokenizer and token files are cached (default $MEGACOMP_DATA_CACHE or ~/.cache/megacomp)."""
    finetune: bool = False
    """With ``load``: start from the checkpoint's model weights only (Megatron's --finetune): iteration 0, fresh
    optimizer, RNG and error feedback; compression, optimizer and data may differ from the checkpoint's run.
    When ``save`` (which must differ from ``load``) already holds a checkpoint, the run resumes from it instead."""
    dataset_samples: Optional[int] = None
    """Train on the first N samples only, for several epochs (a fine-tuning-style set, as AQ-SGD needs);
    None = every sample of the corpus."""
    tokenizer_max_bytes: int = 5 * 1024 * 1024
    """Text used to train the tokenizer."""
    # compression
    compression: Any = "none"
    """Preset name, YAML file or mapping (see megacomp.config.CommCompressionConfig)."""
    # logging and checkpoints
    log_dir: Optional[str] = None
    """Directory for metrics.jsonl (rank 0)."""
    log_interval: int = 1
    """Iterations between log lines."""
    save: Optional[str] = None
    """Checkpoint directory to write."""
    save_interval: int = 0
    """Iterations between checkpoints (0: only at the end when --save is set)."""
    load: Optional[str] = None
    """Checkpoint directory to resume from (latest iteration)."""
    exit_interval: int = 0
    """Stop (after saving) when the iteration is a multiple of this (0 = off), e.g. to test resume."""
    distributed_timeout_minutes: float = 10.0
    """Timeout of collectives: a dead rank makes the others fail after at most this long."""
    validate_collectives_every: int = 0
    """Check collective arguments across ranks on every call (1) or only in the first iteration (0)."""
    keep_checkpoints: int = 0
    """Keep only the newest this many checkpoints under --save (0 = keep all)."""
    max_skipped_steps: int = 10
    """Consecutive steps skipped for inf/NaN gradients or loss that are tolerated; one more stops the run
    (non-zero exit, no checkpoint of the diverged state)."""
    loss_divergence_factor: float = 10.0
    """Stop when the loss exceeds this times the lowest loss so far (0 = off)."""
    outer_algorithm: str = "none"
    """Local-step outer loop over model replicas: none, diloco, streaming_diloco, noloco, mt_dao or sparseloco
    (megacomp.outer; sparseloco with a DCT codec is DCT-momentum DiLoCo)."""
    num_replicas: int = 1
    """Replicas the data-parallel ranks are split into (must divide the DP size); each trains on its own
    and they exchange a pseudo-gradient every --outer-steps steps."""
    outer_steps: int = 50
    """H: inner steps between two outer synchronisations (DiLoCo)."""
    outer_lr: Optional[float] = None
    """Outer learning rate. Default: the algorithm's, 0.7 for DiLoCo and NoLoCo, 1.0 for MT-DAO (averaging) and
    SparseLoCo (alpha)."""
    outer_momentum: Optional[float] = None
    """Outer momentum (0 = none). Default: the algorithm's, 0.9 Nesterov for DiLoCo, 0.5 for NoLoCo, 0 for
    MT-DAO, and for SparseLoCo the error-feedback accumulator's decay beta, 0.95."""
    mt_dao_slow_betas: str = "0.999"
    """MT-DAO: comma list of the slow first moments' betas (the fast one is --adam-beta1; 0 = raw gradient)."""
    mt_dao_slow_weights: str = "0.9"
    """MT-DAO: comma list of the slow moments' weights in the update (sum <= 1; the fast one gets the rest)."""
    outer_group_size: int = 2
    """NoLoCo: replicas per gossip group, drawn at random every outer step (must divide num_replicas)."""
    outer_codec: Any = None
    """Codec of the pseudo-gradient all-reduce (a name, or a mapping, also as '{name: int4, ...}' on the command
    line; None = uncompressed; for sparseloco None =
    {name: int2, k: 64, chunk: 4096}; add transform: dct for DCT-momentum DiLoCo)."""
    outer_error_feedback: Any = None
    """Error feedback on the pseudo-gradient ('ef', 'loco'); needs outer_codec."""
    outer_fragments: int = 1
    """Streaming DiLoCo: parameter fragments synchronised at staggered steps (at most num_layers)."""
    outer_delay: int = 0
    """Streaming DiLoCo: inner steps an exchange overlaps before it is applied (tau < outer_steps)."""
    outer_mixing: float = 0.0
    """Streaming DiLoCo: alpha in local = alpha * local + (1 - alpha) * outer when a fragment lands."""
    outer_timeout: float = 600.0
    """Seconds a replica waits for the others at an outer exchange; then it stops with an error naming the
    replicas that did not arrive (a dead or stalled replica must not hang the rest)."""
    exit_on_signal: bool = True
    """On SIGTERM or SIGUSR1 (Slurm: sbatch --signal=USR1@120), save a checkpoint at the next iteration
    boundary and exit with status 0."""

    def compression_config(self) -> CommCompressionConfig:
        """``load_compression(self.compression)``; raises as :func:`load_compression`."""
        return load_compression(self.compression)

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain data (``dataclasses.asdict``)."""
        return asdict(self)


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_docs() -> dict[str, str]:
    """Each PretrainConfig field's docstring (the string literal under it in the class body), read from
    the source, whitespace collapsed: the ``--help`` text of its flag."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(PretrainConfig)).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def first_sentence(text: str) -> str:
    """``text`` up to the end of its first sentence: the first ``.``, ``!`` or ``?`` outside parentheses that
    ends the text or is followed by a space (so ``tp_fp8.yaml`` or ``e4m3)`` do not end it)."""
    depth = 0
    for i, c in enumerate(text):
        depth += (c in "([") - (c in ")]")
        if c in ".!?" and depth <= 0 and (i + 1 == len(text) or text[i + 1].isspace()):
            return text[:i + 1]
    return text


def presets_epilog() -> str:
    """The compression presets of configs/compression/ with the first sentence of each file's leading
    comment (its ``#`` lines joined)."""
    lines = ["compression presets (--compression NAME, or a YAML file):"]
    for path in sorted((REPO_CONFIGS / "compression").glob("*.yaml")):
        comment = []
        for ln in path.read_text(encoding="utf-8").splitlines():
            if not ln.startswith("#"):
                break
            comment.append(ln.lstrip("#").strip())
        lines.append(f"  {path.stem:<12} {first_sentence(' '.join(x for x in comment if x))}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: ``--config FILE`` and one ``--field-name`` flag per PretrainConfig field.

    Bool fields take ``--x/--no-x``, ``--data-path`` takes several values, the others are parsed as int,
    float or str by their annotation. Every flag defaults to None, so parse_args can tell which were given.
    """
    p = argparse.ArgumentParser(prog="megacomp-pretrain", description="GPT pretraining with compressed communication "
                                "over tensor x pipeline x data parallelism. YAML keys and flags are the same names.",
                                epilog=presets_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with PretrainConfig fields (flags override it)")
    docs = field_docs()
    for f in fields(PretrainConfig):
        default = f.default if f.default is not MISSING else None
        doc = docs.get(f.name, "")
        stated = re.search(r"\bdefault\b", doc, re.I)  # the docstring says what the default means: no second one
        text = (doc if stated else f"{doc} (default {default!r})").replace("%", "%%")
        t = str(f.type)
        if t == "bool":
            p.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif f.name == "data_path":
            p.add_argument(_flag(f.name), dest=f.name, nargs="+", default=None, help=text)
        else:
            kind = int if "int" in t else float if "float" in t else str
            p.add_argument(_flag(f.name), dest=f.name, type=kind, default=None, help=text)
    return p


def parse_args(argv=None) -> PretrainConfig:
    """YAML (``--config``) then CLI overrides -> a validated PretrainConfig (:func:`check`).

    Raises:
        ValueError: unknown keys in the YAML file, a top level that is not a mapping, or settings that
            :func:`check` rejects.
        FileNotFoundError: the ``--config`` file does not exist.
        SystemExit: bad command-line flags (argparse prints the usage).
    """
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    if args.config:
        values.update(load_yaml(args.config))
    names = {f.name for f in fields(PretrainConfig)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} in {args.config}; allowed keys: {sorted(names)}")
    for name in names:
        v = getattr(args, name)
        if v is not None:
            values[name] = v
    cfg = PretrainConfig(**values)
    check(cfg)
    return cfg


def check(cfg: PretrainConfig, world_size: Optional[int] = None) -> None:
    """Sizes that must agree; raises ValueError naming the fix.

    Always checked: ``adam_freeze_variance_step`` >= 0, hidden size divisible by the heads, ``params_dtype``
    float32 or bfloat16. With a world size (the argument, else ``$WORLD_SIZE``) also: TP x PP divides it,
    the global batch is a multiple of micro batch x DP, the micro-batches per iteration are a multiple of
    the pipeline stages, at least one layer per stage, and under sequence parallelism ``seq_length``
    divisible by TP.

    Raises:
        ValueError: the first check that fails (also a ``$WORLD_SIZE`` that is not an integer).
    """
    if cfg.adam_freeze_variance_step < 0:
        raise ValueError(f"adam_freeze_variance_step must be >= 0 (0 = plain AdamW), got {cfg.adam_freeze_variance_step}")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(f"hidden_size {cfg.hidden_size} must be divisible by num_attention_heads {cfg.num_attention_heads}")
    if cfg.keep_checkpoints < 0 or cfg.max_skipped_steps < 0:
        raise ValueError(f"keep_checkpoints and max_skipped_steps must be >= 0, got {cfg.keep_checkpoints} and "
                         f"{cfg.max_skipped_steps}")
    if cfg.loss_divergence_factor < 0 or 0 < cfg.loss_divergence_factor <= 1:
        raise ValueError(f"loss_divergence_factor must be 0 (off) or > 1, got {cfg.loss_divergence_factor}")
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}")
    if cfg.optimizer == "demo":
        if cfg.outer_algorithm != "none" or cfg.adam_freeze_variance_step:
            raise ValueError("optimizer demo replaces the data-parallel gradient exchange; it does not combine with "
                             "--outer-algorithm or --adam-freeze-variance-step")
        if cfg.demo_topk < 1 or cfg.demo_chunk < 1 or not 0 <= cfg.demo_decay < 1:
            raise ValueError(f"DeMo needs demo_topk >= 1, demo_chunk >= 1 and demo_decay in [0, 1), got "
                             f"{cfg.demo_topk}, {cfg.demo_chunk} and {cfg.demo_decay}")
    if cfg.optimizer in ONEBIT_OPTIMIZERS:
        if cfg.outer_algorithm != "none" or cfg.adam_freeze_variance_step:
            raise ValueError(f"optimizer {cfg.optimizer} replaces the data-parallel exchange and freezes its own variance; "
                             f"it does not combine with --outer-algorithm or --adam-freeze-variance-step")
        if cfg.optimizer == "zero_one_adam" and cfg.shard_optimizer:
            raise ValueError("optimizer zero_one_adam takes local steps on every parameter of every rank; add "
                             "--no-shard-optimizer (shard_optimizer: false)")
        onebit_kwargs(cfg)  # raises on bad values
    elif cfg.optimizer == "demo" and not cfg.shard_optimizer:
        raise ValueError("optimizer demo keeps no sharded state; drop --no-shard-optimizer")
    if cfg.outer_algorithm not in OUTER_ALGORITHMS:
        raise ValueError(f"outer_algorithm must be one of {', '.join(OUTER_ALGORITHMS)}, got {cfg.outer_algorithm!r}")
    if cfg.outer_algorithm in ("diloco", "mt_dao") and (cfg.outer_fragments != 1 or cfg.outer_delay or cfg.outer_mixing):
        raise ValueError("outer_fragments, outer_delay and outer_mixing are Streaming DiLoCo (and NoLoCo) settings: use "
                         "--outer-algorithm streaming_diloco")
    if cfg.outer_algorithm == "mt_dao":
        mt_dao_optimizer_kwargs(cfg)  # raises on bad lists
        if cfg.adam_freeze_variance_step:
            raise ValueError("adam_freeze_variance_step and outer_algorithm mt_dao both replace the inner optimizer; "
                             "use one of them")
    if cfg.outer_algorithm != "none":
        outer_config(cfg)  # raises on bad values
        if cfg.outer_fragments > cfg.num_layers:
            raise ValueError(f"outer_fragments {cfg.outer_fragments} is larger than the {cfg.num_layers} layers; use "
                             f"at most one fragment per layer")
        if cfg.num_replicas < 2:
            raise ValueError(f"outer_algorithm {cfg.outer_algorithm} needs num_replicas >= 2, got {cfg.num_replicas}")
        if cfg.outer_algorithm == "noloco" and cfg.num_replicas % cfg.outer_group_size:
            raise ValueError(f"outer_group_size {cfg.outer_group_size} does not divide num_replicas {cfg.num_replicas}; "
                             f"NoLoCo's gossip groups must split the replicas evenly")
    elif cfg.num_replicas != 1:
        raise ValueError(f"num_replicas {cfg.num_replicas} needs an outer algorithm (--outer-algorithm diloco)")
    if cfg.params_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"params_dtype must be float32, bfloat16 or float16, got {cfg.params_dtype!r}")
    if cfg.params_dtype == "float16" and cfg.optimizer not in LOMO_OPTIMIZERS:
        raise ValueError(f"params_dtype float16 (with dynamic loss scaling) is supported by --optimizer lomo / adalomo; "
                         f"optimizer {cfg.optimizer} keeps fp32 masters of bfloat16 parameters: use bfloat16")
    if cfg.initial_loss_scale <= 0 or cfg.loss_scale_window < 1:
        raise ValueError(f"initial_loss_scale must be > 0 and loss_scale_window >= 1, got {cfg.initial_loss_scale} and "
                         f"{cfg.loss_scale_window}")
    if cfg.optimizer in LOMO_OPTIMIZERS:
        check_lomo(cfg)
    check_zero_stage(cfg)
    check_overlap(cfg)
    if cfg.loqt_rank:
        loqt_kwargs(cfg)  # raises on bad values
    virtual_chunks(cfg)  # raises on a bad num_layers_per_virtual_pipeline_stage
    if cfg.finetune and not cfg.load:
        raise ValueError("finetune starts from a checkpoint's model weights: give it with --load DIR")
    if cfg.finetune and cfg.save and os.path.abspath(cfg.save) == os.path.abspath(cfg.load):
        raise ValueError("finetune with --save equal to --load would restart from weights only on every requeue: save "
                         "the fine-tuning run to its own directory (a restart then resumes from it)")
    if cfg.finetune and cfg.outer_algorithm != "none":
        raise ValueError("finetune with an outer loop is not supported (the replicas' outer weights are built before "
                         "the checkpoint is read); fine-tune without --outer-algorithm")
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "0")) or None
    if world_size is not None and cfg.optimizer in LOMO_OPTIMIZERS:
        dp = world_size // (cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size) or 1
        if cfg.global_batch_size != cfg.micro_batch_size * dp:
            raise ValueError(f"optimizer {cfg.optimizer} updates the parameters inside backward, so an iteration is one "
                             f"micro-batch per data-parallel rank: set global_batch_size = micro_batch_size "
                             f"({cfg.micro_batch_size}) x DP ({dp}) = {cfg.micro_batch_size * dp} (got "
                             f"{cfg.global_batch_size}), or raise micro_batch_size")
    if world_size is None:
        return
    mp = cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size
    if world_size % mp:
        raise ValueError(f"tensor_model_parallel_size ({cfg.tensor_model_parallel_size}) x "
                         f"pipeline_model_parallel_size ({cfg.pipeline_model_parallel_size}) = {mp} does not divide "
                         f"the world size {world_size}; pick sizes whose product divides the number of ranks")
    dp = world_size // mp
    if dp % cfg.num_replicas:
        raise ValueError(f"num_replicas {cfg.num_replicas} does not divide the data-parallel size {dp} (world "
                         f"{world_size} = TP {cfg.tensor_model_parallel_size} x PP {cfg.pipeline_model_parallel_size} "
                         f"x DP {dp})")
    if cfg.global_batch_size % (cfg.micro_batch_size * dp):
        raise ValueError(f"global_batch_size {cfg.global_batch_size} is not a multiple of micro_batch_size "
                         f"{cfg.micro_batch_size} x data-parallel size {dp}")
    micro = cfg.global_batch_size // (cfg.micro_batch_size * dp)
    if micro % cfg.pipeline_model_parallel_size:
        raise ValueError(f"{micro} micro-batches per iteration (global_batch_size {cfg.global_batch_size} / "
                         f"(micro_batch_size {cfg.micro_batch_size} x DP {dp})) is not a multiple of the "
                         f"{cfg.pipeline_model_parallel_size} pipeline stages; raise global_batch_size")
    if cfg.overlap_optimizer == "acco" and micro % (2 * cfg.pipeline_model_parallel_size):  # dpu: no halves
        raise ValueError(f"overlap_optimizer acco runs each iteration's {micro} micro-batches in two equal halves, each "
                         f"a multiple of the {cfg.pipeline_model_parallel_size} pipeline stage(s): raise "
                         f"global_batch_size to a multiple of 2 x {cfg.pipeline_model_parallel_size} x micro_batch_size "
                         f"x DP")
    if cfg.pipeline_model_parallel_size > cfg.num_layers:
        raise ValueError(f"{cfg.pipeline_model_parallel_size} pipeline stages for {cfg.num_layers} layers: every stage "
                         f"needs at least one layer")
    if cfg.sequence_parallel and cfg.seq_length % cfg.tensor_model_parallel_size:
        raise ValueError(f"sequence_parallel needs seq_length ({cfg.seq_length}) divisible by the TP size")
    if cfg.num_layers_per_virtual_pipeline_stage is not None:
        check_interleaving(micro, cfg.pipeline_model_parallel_size, virtual_chunks(cfg))



def virtual_chunks(cfg: PretrainConfig) -> int:
    """Model chunks per pipeline stage: 1 without ``num_layers_per_virtual_pipeline_stage``, else as Megatron
    (raises ValueError naming the fix, see megacomp.models.chunks)."""
    if cfg.num_layers_per_virtual_pipeline_stage is None:
        return 1
    return layers_per_virtual_stage_to_chunks(cfg.num_layers, cfg.pipeline_model_parallel_size,
                                              cfg.num_layers_per_virtual_pipeline_stage)
