"""The 1-bit optimizer family (``--optimizer onebit_adam | zero_one_adam | onebit_lamb``; the algorithms are
megacomp.optimizer.onebit): 1-bit Adam, 0/1 Adam and 1-bit LAMB with DeepSpeed's hyperparameter names.

After a full-precision warm-up (gradients averaged uncompressed over DP), each rank's momentum is exchanged
on the ``dp_momentum`` path (default: signs with one scale per chunk, worker and server error feedback); 0/1
Adam additionally freezes its variance and takes local steps between synchronisations. The path's codec is
set in the compression config (``dp_momentum``, ``dp_momentum_error_feedback``) or, as before, with
``--momentum-codec`` / ``--momentum-error-feedback``, which win when given.

``--momentum-scaling deepspeed`` runs DeepSpeed's compressed all-reduce exactly (one flat buffer per param group,
the whole model for 1-bit LAMB; RMS worker and server scales; megacomp.optimizer.onebit.deepspeed_exchange) instead
of the momentum channel's scale per bucket x segment x chunk.

Choices made for the user (said in the banner): 0/1 Adam takes local steps that update every parameter on
every rank, so it always runs unsharded; so does ``--momentum-scaling deepspeed`` unless --shard-optimizer is
typed, and its exchange runs in step() (a param group's buffer spans buckets, so nothing overlaps backward) and
compresses buckets of every size (min_compress_numel does not apply).

Failure behaviour: ValueError naming the flag for an outer loop or AdamW's variance freezing next to the
family, bad hyperparameters (the optimizer's own checks, run before any group exists), a structured momentum
codec, ``--momentum-scaling`` other than chunk / deepspeed, ``deepspeed`` with --shard-optimizer or a momentum
codec / error-feedback setting other than the default, and a dp_gradient path that is not uncompressed (the
warm-up reduces in full precision).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ...compression import parse_codec_arg
from ...optimizer import OneBitAdam, OneBitLamb, ZeroOneAdam
from ...optimizer.onebit import DEFAULT_MOMENTUM_CODEC, resolve_momentum_setting
from ...optimizer.onebit.momentum_path import MOMENTUM_SCALINGS
from ...optimizer.onebit.rules import _check_freeze
from ...optimizer.onebit.schedule import ZeroOneSchedule
from .base import Feature
from .param_groups import optimizer_inputs

ONEBIT_OPTIMIZERS = {"onebit_adam": OneBitAdam, "zero_one_adam": ZeroOneAdam, "onebit_lamb": OneBitLamb}


@dataclass
class OneBitConfig:
    """1-bit Adam / 0/1 Adam / 1-bit LAMB (DeepSpeed's names; flat flags without a prefix, as DeepSpeed's)."""

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
    """Codec of the momentum exchange, the compression config's dp_momentum (a name or mapping, also
    '{name: int4, block_size: 0}' on the command line); when given here it wins over the compression config.
    Default: {name: sign, block_size: 0}, signs with one scale per chunk; 'none' = uncompressed."""
    momentum_error_feedback: Optional[bool] = None
    """Worker and server error feedback on the momentum exchange (the compression config's
    dp_momentum_error_feedback; given here it wins). Default: on for a lossy codec, off for 'none'."""
    momentum_scaling: str = "chunk"
    """How the momentum exchange scales its signs: 'chunk' (the momentum codec's scale per bucket x pipeline segment
    x destination chunk, exchanged in backward where it can) or 'deepspeed' (DeepSpeed's compressed_allreduce
    exactly: one flat buffer per param group, the whole model for 1-bit LAMB, RMS worker and server scales, every
    size compressed, exchanged in step()). 'deepspeed' runs unsharded with the default codec and error feedback."""


class OneBitFamily(Feature):
    """The 1-bit optimizers (see the module docstring)."""

    name = "onebit"
    optimizer_names = tuple(ONEBIT_OPTIMIZERS)
    CONFIG = OneBitConfig
    config_key = "onebit"

    @classmethod
    def resolve(cls, cfg, world) -> list[str]:
        """Unsharded unless --shard-optimizer was given: a sharded 1-bit optimizer all-gathers its parameters every
        step, 12x the sign momentum's bytes on the tiny GPT (1.17 vs 0.09 MB per step at DP 2; 0.38 MB with an
        int8 gather); 0/1 Adam's local steps need every parameter on every rank, so it is always unsharded."""
        if cfg.zero.shard is not None:
            return []
        cfg.zero.shard = False
        why = ("its local steps update every parameter on every rank" if cfg.training.optimizer == "zero_one_adam"
               else "the momentum is then the only data-parallel traffic after the warm-up (sharded, every step "
                    "would also all-gather the parameters; --shard-optimizer)")
        return [f"optimizer: {cfg.training.optimizer} keeps its fp32 masters and state whole on every rank "
                f"(unsharded): {why}"]

    @classmethod
    def check(cls, cfg, world) -> None:
        if not cls.selected(cfg):
            return
        name, scaling = cfg.training.optimizer, cfg.onebit.momentum_scaling
        if scaling not in MOMENTUM_SCALINGS:
            raise ValueError(f"--momentum-scaling must be one of {', '.join(MOMENTUM_SCALINGS)}, got {scaling!r}")
        if scaling == "deepspeed" and cfg.zero.shard:
            raise ValueError("--momentum-scaling deepspeed is DeepSpeed's unsharded exchange (every rank keeps whole "
                             "masters and state); drop --shard-optimizer (shard_optimizer: true) or use "
                             "--momentum-scaling chunk")
        if cfg.outer.algorithm != "none" or cfg.zero.freeze_variance_step:
            raise ValueError(f"optimizer {name} replaces the data-parallel exchange and freezes its own variance; "
                             f"it does not combine with --outer-algorithm or --adam-freeze-variance-step")
        if name == "zero_one_adam" and cfg.zero.shard:
            raise ValueError("optimizer zero_one_adam takes local steps on every parameter of every rank, so its "
                             "state cannot be sharded; drop --shard-optimizer (shard_optimizer: true)")
        cls.optimizer_kwargs(cfg)  # raises on bad values

    @classmethod
    def momentum_setting(cls, cfg) -> tuple:
        """The dp_momentum codec and error-feedback switch: the flags when given, else the compression config's."""
        comp = cfg.compression_config()
        o = cfg.onebit
        codec = parse_codec_arg(o.momentum_codec) if o.momentum_codec is not None else comp.dp_momentum
        ef = o.momentum_error_feedback if o.momentum_error_feedback is not None else comp.dp_momentum_error_feedback
        return resolve_momentum_setting(codec, ef)

    @classmethod
    def optimizer_kwargs(cls, cfg) -> dict:
        """The optimizer's keyword arguments from the config (hyperparameters and the momentum path; lr, betas,
        weight decay and clipping are passed at build). Raises ValueError for values the optimizer rejects."""
        o, name = cfg.onebit, cfg.training.optimizer
        codec, ef = cls.momentum_setting(cfg)
        if o.momentum_scaling == "deepspeed":
            if codec != DEFAULT_MOMENTUM_CODEC or not ef:
                raise ValueError(f"--momentum-scaling deepspeed sends DeepSpeed's signs with RMS scales and "
                                 f"worker/server error feedback, so it takes no other momentum codec (got {codec}, "
                                 f"error feedback {ef}): drop --momentum-codec / --momentum-error-feedback and the "
                                 f"compression config's dp_momentum settings, or use --momentum-scaling chunk")
            codec = DEFAULT_MOMENTUM_CODEC  # the optimizer recognises the default by identity
        out = {"momentum_codec": codec, "momentum_error_feedback": ef, "shard": bool(cfg.zero.shard),
               "momentum_scaling": o.momentum_scaling}
        if name == "zero_one_adam":
            ZeroOneSchedule(o.var_freeze_step, o.var_update_scaler, o.local_step_scaler, o.local_step_clipper)
            out.update(var_freeze_step=o.var_freeze_step, var_update_scaler=o.var_update_scaler,
                       local_step_scaler=o.local_step_scaler, local_step_clipper=o.local_step_clipper)
        else:
            _check_freeze(o.freeze_step)
            out["freeze_step"] = o.freeze_step
        if name == "onebit_lamb":
            out.update(max_coeff=o.max_coeff, min_coeff=o.min_coeff, coeff_beta=o.coeff_beta,
                       factor_max=o.factor_max, factor_min=o.factor_min, factor_threshold=o.factor_threshold)
        return out

    def build(self, run) -> None:
        cfg, compression, channels = self.cfg, run.compression, run.channels
        ch = channels.dp_gradient
        if ch.lossy or ch.error_feedback is not None or compression.dp_gradient_warmup_steps:
            raise ValueError(f"optimizer {cfg.training.optimizer} exchanges momentum (set its codec with the "
                             f"compression config's dp_momentum or --momentum-codec) and reduces warm-up gradients in "
                             f"full precision: the compression config's dp_gradient must be none without error "
                             f"feedback or warm-up (got {ch!r}, warm-up {compression.dp_gradient_warmup_steps})")
        inputs = optimizer_inputs(run)
        t = cfg.training
        self.opt = ONEBIT_OPTIMIZERS[t.optimizer](
            inputs.groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), max_grad_norm=t.clip_grad,
            process_group=run.groups.dp, param_channel=channels.dp_parameter, grad_norm_group=inputs.norm_group,
            grad_norm_weight=inputs.norm_weight, deferred_params=inputs.deferred,
            min_compress_numel=compression.min_compress_numel, **self.optimizer_kwargs(cfg))
        run.optimizer = self.opt

    def banner(self, run) -> list[str]:
        opt, o, name = self.opt, self.cfg.onebit, self.cfg.training.optimizer
        ch = opt.momentum_channel
        ef = " + worker/server error feedback" if ch.error_feedback is not None else ""
        when = (f"variance updates until step {o.var_freeze_step}, then local steps synchronised every "
                f"1..{o.local_step_clipper}" if name == "zero_one_adam" else
                f"full-precision gradients for {o.freeze_step} steps, then momentum")
        shard = ("masters sharded over DP, parameters all-gathered" if opt.sharded else
                 "masters whole on every rank, no all-gather")
        how = f"with {ch.codec}{ef}"
        if opt.momentum_scaling == "deepspeed":
            how = ("with DeepSpeed's compressed all-reduce (--momentum-scaling deepspeed: signs, RMS worker and server "
                   "scales, one flat buffer per " + ("model" if name == "onebit_lamb" else "param group") +
                   ", every size compressed, exchanged in step() as nothing can overlap backward)")
        return [f"optimizer: {name}: {when} over dp_momentum {how}; {shard}; after the warm-up about "
                f"{self.bytes_per_step() / 1e6:.3f} MB per step on the wire over all ranks"]

    def bytes_per_step(self) -> int:
        """Data-parallel bytes of one compressed step, all ranks: each bucket's momentum all-reduce is a
        reduce-scatter plus an all-gather of 1/p chunks in the momentum codec (2 p (p - 1) chunk messages), and a
        sharded optimizer's parameter all-gather p (p - 1) chunks in the dp_parameter codec. With
        ``--momentum-scaling deepspeed``: per flat buffer of n_c padded elements, two phases of p (p - 1) messages
        of n_c / p / 8 sign bytes and a 4-byte scale."""
        opt = self.opt
        p = opt.world
        if opt.momentum_scaling == "deepspeed":  # two phases of p (p - 1) messages: each chunk's signs and a scale
            return sum(2 * p * (p - 1) * (n // p // 8 + 4) for n in opt.deepspeed_buffer_numels) if p > 1 else 0
        total = 0
        for b in opt.buckets:  # the whole bucket is the message whose size the small-tensor rule judges
            chunk = b.padded // p
            total += 2 * p * (p - 1) * opt.momentum_channel.codec_for(b.padded).wire_bytes(chunk)
            if opt.sharded:
                total += p * (p - 1) * opt.param_channel.codec_for(b.padded).wire_bytes(chunk)
        return total

    def record(self, run, record: dict) -> None:
        record["dp_rounds"] = self.opt.rounds

    def weights_loaded(self, run) -> None:
        self.opt.load_params_from_model()

    def before_save(self, run):
        self.opt.wait_params()
        return super().before_save(run)

    def finish(self, run) -> None:
        self.opt.wait_params()
