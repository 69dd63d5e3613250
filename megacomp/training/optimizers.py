"""The optimizers pretraining builds on the dp_gradient / dp_parameter channels besides the sharded AdamW
(megacomp.training.trainer builds that one itself): the 1-bit family and DeMo, each refusing a compression
config whose gradient path it would silently bypass."""
from __future__ import annotations

from ..optimizer import DeMo, OneBitAdam, OneBitLamb, ZeroOneAdam
from .optimizer_args import onebit_kwargs


def build_onebit(cfg, compression, channels, dp_group, groups, norm_group, norm_weight, deferred):
    """1-bit Adam / 0/1 Adam / 1-bit LAMB over ``dp_group`` (each model-parallel rank's own); the momentum path is
    the optimizer's, so the compression config's dp_gradient must be uncompressed (ValueError otherwise)."""
    ch = channels.dp_gradient
    if ch.lossy or ch.error_feedback is not None or compression.dp_gradient_warmup_steps:
        raise ValueError(f"optimizer {cfg.optimizer} exchanges momentum (set its codec with --momentum-codec) and "
                         f"reduces warm-up gradients in full precision: the compression config's dp_gradient must "
                         f"be none without error feedback or warm-up (got {ch!r}, warm-up "
                         f"{compression.dp_gradient_warmup_steps})")
    build = {"onebit_adam": OneBitAdam, "zero_one_adam": ZeroOneAdam, "onebit_lamb": OneBitLamb}[cfg.optimizer]
    return build(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), max_grad_norm=cfg.clip_grad,
                 process_group=dp_group, param_channel=channels.dp_parameter,
                 grad_norm_group=norm_group, grad_norm_weight=norm_weight, deferred_params=deferred,
                 min_compress_numel=compression.min_compress_numel, **onebit_kwargs(cfg))


def build_demo(cfg, compression, channels, groups, norm_group, norm_weight) -> DeMo:
    """DeMo on the dp_gradient channel (its codec, if any, is the format of the kept values); there is no parameter
    all-gather, since every DP rank applies the same update. ValueError for error feedback, a structured codec, a
    warm-up or a parameter codec."""
    ch = channels.dp_gradient
    if ch.error_feedback is not None or ch.codec.structured or compression.dp_gradient_warmup_steps:
        raise ValueError(f"optimizer demo keeps its own residual (the momentum) and does its own DCT and top-k: the "
                         f"compression config's dp_gradient must be a plain value format without error feedback "
                         f"or warm-up (got {ch!r}, warm-up {compression.dp_gradient_warmup_steps}); e.g. none, bf16 or int8")
    if not channels.dp_parameter.codec.is_identity:
        raise ValueError(f"optimizer demo sends no parameters (every DP rank applies the same update), but the "
                         f"compression config sets dp_parameter {channels.dp_parameter.codec}; drop it")
    return DeMo(groups, lr=cfg.lr, compression_decay=cfg.demo_decay, compression_topk=cfg.demo_topk,
                compression_chunk=cfg.demo_chunk, value_codec=ch.codec, channel=ch, max_grad_norm=cfg.clip_grad or None,
                grad_norm_group=norm_group, grad_norm_weight=norm_weight)
