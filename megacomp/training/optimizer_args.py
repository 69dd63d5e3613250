"""Optimizer and outer-loop settings of a pretraining run, turned into the keyword arguments of the classes
that take them (megacomp.optimizer, megacomp.outer); each function raises ValueError naming the fix for a
value the class would reject, so :func:`megacomp.training.arguments.check` fails before any group exists."""
from __future__ import annotations

from typing import TYPE_CHECKING

import yaml

from ..compression import make_codec

if TYPE_CHECKING:
    from .arguments import PretrainConfig

OUTER_ALGORITHMS = ("none", "diloco", "streaming_diloco", "noloco", "mt_dao", "sparseloco")
SPARSELOCO_CODEC = make_codec("int2", k=64, chunk=4096)
"""SparseLoCo's default outer codec: top-64 of every 4096 (1.6% density, inside the paper's 1-3%), 2-bit values."""
ONEBIT_OPTIMIZERS = ("onebit_adam", "zero_one_adam", "onebit_lamb")
LOMO_OPTIMIZERS = ("lomo", "adalomo")
OPTIMIZERS = ("adamw", "demo") + ONEBIT_OPTIMIZERS + LOMO_OPTIMIZERS


def lomo_kwargs(cfg: PretrainConfig) -> dict:
    """The keyword arguments of megacomp.optimizer.Lomo / AdaLomo taken from the config (the groups, channel and
    loss scaler are passed by the trainer): weight decay, LOMO's clipping by the global norm (``clip_grad``; 0 =
    off, which also drops the first backward pass unless fp16 needs it for the overflow check) and, for
    AdaLomo, the reference's eps / clip_threshold / decay_rate (its defaults; not configurable)."""
    return {"weight_decay": cfg.weight_decay, "clip_grad_norm": cfg.clip_grad or None}


def loqt_kwargs(cfg: PretrainConfig) -> dict:
    """megacomp.tensor_parallel.loqt settings of a run: ``convert`` (convert_to_loqt's keywords) and ``schedule``
    (LoQTSchedule's). Raises ValueError for a negative rank, alpha <= 0, an interval < 1, growth < 1, negative
    compensation rounds, or an optimizer / outer loop that LoQT does not drive (its merges reset the factor
    under the optimizer: the sharded AdamW and LOMO / AdaLomo handle that)."""
    if cfg.loqt_rank < 0 or cfg.loqt_alpha <= 0 or cfg.loqt_update_interval < 1 or cfg.loqt_growth < 1 \
            or cfg.loqt_compensate_iters < 0:
        raise ValueError(f"LoQT needs loqt_rank >= 0, loqt_alpha > 0, loqt_update_interval >= 1, loqt_growth >= 1 and "
                         f"loqt_compensate_iters >= 0; got {cfg.loqt_rank}, {cfg.loqt_alpha}, "
                         f"{cfg.loqt_update_interval}, {cfg.loqt_growth} and {cfg.loqt_compensate_iters}")
    if cfg.optimizer not in ("adamw",) + LOMO_OPTIMIZERS or cfg.outer_algorithm != "none" \
            or cfg.adam_freeze_variance_step:
        raise ValueError(f"LoQT (loqt_rank {cfg.loqt_rank}) runs with --optimizer adamw, lomo or adalomo and no outer "
                         f"loop or variance freezing (got optimizer {cfg.optimizer}, outer {cfg.outer_algorithm}); "
                         f"set loqt_rank 0 or change the optimizer")
    codec = cfg.loqt_codec
    if isinstance(codec, str) and codec.strip().startswith("{"):
        codec = yaml.safe_load(codec)
    return {"convert": {"rank": cfg.loqt_rank, "codec": codec, "alpha": cfg.loqt_alpha,
                        "compensate_iters": cfg.loqt_compensate_iters},
            "schedule": {"gap": cfg.loqt_update_interval, "growth": cfg.loqt_growth, "total_steps": cfg.train_iters}}


def onebit_kwargs(cfg: PretrainConfig) -> dict:
    """The keyword arguments of megacomp.optimizer.OneBitAdam / ZeroOneAdam / OneBitLamb taken from the config
    (hyperparameters and the momentum path; lr, betas, weight decay and clipping are passed by the trainer).
    Raises ValueError for values the optimizer rejects (it is built once on a throwaway parameter)."""
    from ..optimizer.onebit import DEFAULT_MOMENTUM_CODEC
    from ..optimizer.onebit.optimizer import check_momentum_codec
    from ..optimizer.onebit.rules import _check_freeze
    from ..optimizer.onebit.schedule import ZeroOneSchedule

    codec = cfg.momentum_codec
    if isinstance(codec, str) and codec.strip().startswith("{"):
        codec = yaml.safe_load(codec)
    out = {"momentum_codec": DEFAULT_MOMENTUM_CODEC if codec is None else codec,
           "momentum_error_feedback": cfg.momentum_error_feedback, "shard": cfg.shard_optimizer}
    if cfg.optimizer == "zero_one_adam":
        ZeroOneSchedule(cfg.var_freeze_step, cfg.var_update_scaler, cfg.local_step_scaler, cfg.local_step_clipper)
        out.update(var_freeze_step=cfg.var_freeze_step, var_update_scaler=cfg.var_update_scaler,
                   local_step_scaler=cfg.local_step_scaler, local_step_clipper=cfg.local_step_clipper)
    else:
        _check_freeze(cfg.freeze_step)
        out["freeze_step"] = cfg.freeze_step
    if cfg.optimizer == "onebit_lamb":
        out.update(max_coeff=cfg.max_coeff, min_coeff=cfg.min_coeff, coeff_beta=cfg.coeff_beta,
                   factor_max=cfg.factor_max, factor_min=cfg.factor_min, factor_threshold=cfg.factor_threshold)
    check_momentum_codec(out["momentum_codec"], cfg.momentum_error_feedback, cfg.optimizer)  # before any group exists
    return out


def mt_dao_optimizer_kwargs(cfg: PretrainConfig) -> dict:
    """``slow_betas`` and ``slow_weights`` of megacomp.optimizer.MultiTimescaleAdamW from the comma lists.

    Raises:
        ValueError: a list that does not parse, lists of different lengths, betas outside [0, 1), weights < 0
            or summing to more than 1."""
    out = {}
    for field, key in (("mt_dao_slow_betas", "slow_betas"), ("mt_dao_slow_weights", "slow_weights")):
        text = str(getattr(cfg, field))
        try:
            out[key] = tuple(float(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"{field} must be a comma list of numbers, got {text!r}") from None
    betas, weights = out["slow_betas"], out["slow_weights"]
    if len(betas) != len(weights) or not all(0 <= b < 1 for b in betas) or any(w < 0 for w in weights) \
            or sum(weights) > 1:
        raise ValueError(f"mt_dao_slow_betas {betas} and mt_dao_slow_weights {weights}: one weight per beta, betas in "
                         f"[0, 1), weights >= 0 summing to at most 1")
    return out


def outer_config(cfg: PretrainConfig):
    """The megacomp.outer.DiLoCoConfig of a run (DiLoCo is Streaming DiLoCo with one fragment, no delay, no
    mixing; MT-DAO is its parameter averaging, outer lr 1 and no momentum, plus megacomp.outer.mt_dao's state
    averaging). Raises ValueError for bad values (see DiLoCoConfig)."""
    from ..outer import DiLoCoConfig

    noloco, mt_dao = cfg.outer_algorithm == "noloco", cfg.outer_algorithm == "mt_dao"
    sparse = cfg.outer_algorithm == "sparseloco"
    momentum = cfg.outer_momentum if cfg.outer_momentum is not None else (
        0.5 if noloco else 0.0 if mt_dao else 0.95 if sparse else 0.9)
    lr = cfg.outer_lr if cfg.outer_lr is not None else (1.0 if mt_dao or sparse else 0.7)
    codec = cfg.outer_codec
    if isinstance(codec, str) and codec.strip().startswith("{"):  # a YAML mapping given on the command line
        codec = yaml.safe_load(codec)
    if sparse and codec is None:
        codec = SPARSELOCO_CODEC
    algorithm = "noloco" if noloco else "sparseloco" if sparse else "diloco"
    return DiLoCoConfig(outer_steps=cfg.outer_steps, outer_lr=lr, outer_momentum=momentum,
                        algorithm=algorithm, group_size=cfg.outer_group_size, seed=cfg.seed if noloco else 0,
                        codec=codec, error_feedback=cfg.outer_error_feedback,
                        fragments=cfg.outer_fragments, delay=cfg.outer_delay, mixing=cfg.outer_mixing)


def check_lomo(cfg: PretrainConfig) -> None:
    """What LOMO / AdaLomo cannot do in pretraining (each ValueError names the fix)."""
    name = cfg.optimizer
    if cfg.pipeline_model_parallel_size != 1:
        raise ValueError(f"optimizer {name} updates each parameter inside its backward: 1F1B's later micro-batches "
                         f"would run on updated weights; set pipeline_model_parallel_size 1")
    if cfg.sequence_parallel:
        raise ValueError(f"optimizer {name} updates inside backward, before sequence-parallel gradients are summed "
                         f"over TP; turn sequence_parallel off")
    if cfg.outer_algorithm != "none" or cfg.adam_freeze_variance_step:
        raise ValueError(f"optimizer {name} has no Adam state to freeze nor inner steps to hand to an outer loop; drop "
                         f"--outer-algorithm / --adam-freeze-variance-step")
    if not cfg.shard_optimizer:
        raise ValueError(f"optimizer {name} keeps no sharded state (every DP rank updates every parameter); drop "
                         f"--no-shard-optimizer")


def check_zero_stage(cfg: PretrainConfig) -> None:
    """``zero_stage`` 1 or 2, and 2 only where megacomp.optimizer.DistributedOptimizer(zero_stage=2) runs: the sharded
    AdamW optimizer (--optimizer adamw, --shard-optimizer) with a dp_gradient codec that reduce-scatters (not
    powersgd / accordion). Raises ValueError naming the fix."""
    if cfg.zero_stage not in (1, 2) or isinstance(cfg.zero_stage, bool):
        raise ValueError(f"zero_stage must be 1 (sharded masters and optimizer state) or 2 (also sharded gradients), got "
                         f"{cfg.zero_stage!r}; the unsharded optimizer is --no-shard-optimizer")
    if cfg.zero_stage == 1:
        return
    if cfg.optimizer != "adamw":
        why = ("keeps no gradient buffers at all (each gradient is reduced and freed inside backward)"
               if cfg.optimizer in LOMO_OPTIMIZERS else "exchanges each rank's whole local gradient or momentum")
        raise ValueError(f"zero_stage 2 shards the sharded AdamW optimizer's gradient buckets; optimizer "
                         f"{cfg.optimizer} {why}: use --zero-stage 1 or --optimizer adamw")
    if not cfg.shard_optimizer:
        raise ValueError("zero_stage 2 keeps only this rank's shard of the gradients, which needs the sharded "
                         "optimizer: drop --no-shard-optimizer, or use --zero-stage 1")
    from ..compression import is_accordion, is_low_rank

    grad = cfg.compression_config().dp_gradient
    if is_low_rank(grad) or is_accordion(grad):
        raise ValueError(f"zero_stage 2 reduce-scatters every micro-batch's buckets as they fill, but the compression "
                         f"config's dp_gradient {grad} all-reduces whole buckets in low rank or picks codecs on "
                         f"whole-step gradients: use --zero-stage 1 or a value codec (e.g. --compression loco4)")


def check_overlap(cfg: PretrainConfig) -> None:
    """``overlap_optimizer`` 'none' or 'acco', and 'acco' only around the sharded ZeRO-1 AdamW optimizer without an
    outer loop, LoQT or the error probe (megacomp.optimizer.acco). Raises ValueError naming the fix."""
    if cfg.overlap_param_gather:
        why = (f"optimizer {cfg.optimizer} (use --optimizer adamw)" if cfg.optimizer != "adamw" else
               "--no-shard-optimizer (there is no parameter all-gather)" if not cfg.shard_optimizer else
               f"--outer-algorithm {cfg.outer_algorithm} (the outer step reads the parameters right after the inner "
               f"step)" if cfg.outer_algorithm != "none" else
               "LoQT (its merges read the parameters after the step)" if cfg.loqt_rank else
               f"--overlap-optimizer {cfg.overlap_optimizer} (it gathers in its own background thread)"
               if cfg.overlap_optimizer != "none" else None)
        if why:
            raise ValueError(f"overlap_param_gather does not combine with {why}; drop --overlap-param-gather or that")
    if cfg.overlap_optimizer not in ("none", "acco", "dpu"):
        raise ValueError(f"overlap_optimizer must be 'none', 'acco' or 'dpu', got {cfg.overlap_optimizer!r}")
    if cfg.overlap_optimizer == "none":
        return
    why = (f"optimizer {cfg.optimizer} has its own exchange (use --optimizer adamw)" if cfg.optimizer != "adamw" else
           "needs the sharded optimizer (drop --no-shard-optimizer)" if not cfg.shard_optimizer else
           "overlaps ZeRO-1's whole-step reduce-scatter (use --zero-stage 1)" if cfg.zero_stage != 1 else
           f"does not combine with --outer-algorithm {cfg.outer_algorithm}" if cfg.outer_algorithm != "none" else
           "does not combine with LoQT (its merges replace optimizer steps)" if cfg.loqt_rank else None)
    if why is None:
        from ..compression import is_accordion, is_low_rank

        comp = cfg.compression_config()
        if is_low_rank(comp.dp_gradient) or is_accordion(comp.dp_gradient):
            why = f"reduce-scatters with a value codec; dp_gradient {comp.dp_gradient} all-reduces in low rank"
        elif comp.pp_activation_delta:
            why = ("does not combine with AQ-SGD activation deltas (pp_activation_delta: its per-sample caches are "
                   "indexed by the whole iteration's micro-batches)")
        elif comp.error_probe_interval:
            why = "does not run the error probe on its background collectives (set error_probe_interval: 0)"
    if why:
        raise ValueError(f"overlap_optimizer {cfg.overlap_optimizer} {why}")
