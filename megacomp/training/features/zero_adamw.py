"""ZeRO-1/2 sharded AdamW (``--optimizer adamw``, the default): megacomp.optimizer.DistributedOptimizer on the
dp_gradient / dp_parameter paths, with PowerSGD or Accordion when the dp_gradient codec asks for them.

Per iteration the gradients accumulate in the optimizer's fp32 buckets (ZeRO-1), or each bucket is
reduce-scattered as soon as a micro-batch fills it and freed (ZeRO-2); the step reduce-scatters, updates this
rank's shard of the fp32 masters and all-gathers the parameters (left in flight under
``overlap_param_gather``: each module's forward waits for its own buckets). Variance freezing
(``adam_freeze_variance_step``, megacomp.optimizer.FrozenVarianceAdamW) and MT-DAO's inner optimizer (chosen by
the outer loop) replace the AdamW rule inside the sharded optimizer.

Failure behaviour: ValueError naming the flag for a ZeRO stage other than 1/2, ZeRO-2 without the sharded
optimizer or with a low-rank dp_gradient, an overlapped parameter gather with something that reads the
parameters right after the step.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Optional

from ...compression import is_accordion, is_low_rank
from ...optimizer import DistributedOptimizer, FrozenVarianceAdamW
from .base import Feature
from .param_groups import optimizer_inputs


@dataclass
class ZeROConfig:
    """The sharded optimizer's layout (ZeRO stage, sharding, the overlapped parameter gather) and AdamW's
    variance freezing."""

    shard: Optional[bool] = field(default=None, metadata={"flag": "shard_optimizer"})
    """Shard the fp32 masters and optimizer state over DP (ZeRO-1) and all-gather parameters; --no-shard-optimizer
    keeps everything whole on every rank (all-reduce, no all-gather). Default: the optimizer family's choice,
    sharded for adamw, demo, lomo and adalomo; unsharded for the 1-bit family, whose momentum is then the only
    data-parallel traffic after the warm-up (a sharded 1-bit optimizer all-gathers its parameters every step)."""
    stage: int = field(default=1, metadata={"flag": "zero_stage"})
    """1: the sharded optimizer keeps full-size fp32 gradient buckets for the whole iteration. 2 (ZeRO-2, --optimizer
    adamw with the sharded optimizer; not with powersgd / accordion dp_gradient): each bucket is reduce-scattered as
    soon as a micro-batch's backward fills it and its full-size buffer freed, so only this rank's 1/DP shard of the
    gradients persists; every micro-batch is reduced, i.e. (micro-batches - 1) x ZeRO-1's dp_gradient bytes more per
    iteration. Checkpoints of either stage resume in the other."""
    overlap_param_gather: bool = field(default=False, metadata={"flag": "overlap_param_gather"})
    """Megatron's flag: the sharded optimizer's parameter all-gather (dp_parameter) is left in flight at the end of
    the step, and each module's forward waits only for the buckets it needs (megacomp.optimizer.param_gather), so
    later buckets travel while earlier layers compute. Same results and bytes. --optimizer adamw with the sharded
    optimizer; not with an outer loop, LoQT or --overlap-optimizer."""
    freeze_variance_step: int = field(default=0, metadata={"flag": "adam_freeze_variance_step"})
    """0 = plain AdamW. N > 0: freeze Adam's second moment after N iterations (1-bit Adam's variance
    freezing, megacomp.optimizer.FrozenVarianceAdamW), which lets error feedback reach Adam's update."""


class ZeROAdamW(Feature):
    """The sharded AdamW optimizer (see the module docstring)."""

    name = "adamw"
    optimizer_names = ("adamw",)
    CONFIG = ZeROConfig
    config_key = "zero"
    config_shared = True  # the other optimizer families read its sharding and variance-freeze settings

    @classmethod
    def check(cls, cfg, world) -> None:
        z = cfg.zero
        if z.freeze_variance_step < 0:
            raise ValueError(f"adam_freeze_variance_step must be >= 0 (0 = plain AdamW), got {z.freeze_variance_step}")
        if z.stage not in (1, 2) or isinstance(z.stage, bool):
            raise ValueError(f"zero_stage must be 1 (sharded masters and optimizer state) or 2 (also sharded gradients), "
                             f"got {z.stage!r}; the unsharded optimizer is --no-shard-optimizer")
        name = cfg.training.optimizer
        if z.stage == 2:
            if name != "adamw":
                why = ("keeps no gradient buffers at all (each gradient is reduced and freed inside backward)"
                       if name in ("lomo", "adalomo") else "exchanges each rank's whole local gradient or momentum")
                raise ValueError(f"zero_stage 2 shards the sharded AdamW optimizer's gradient buckets; optimizer "
                                 f"{name} {why}: use --zero-stage 1 or --optimizer adamw")
            if z.shard is False:
                raise ValueError("zero_stage 2 keeps only this rank's shard of the gradients, which needs the sharded "
                                 "optimizer: drop --no-shard-optimizer, or use --zero-stage 1")
            grad = cfg.compression_config().dp_gradient
            if is_low_rank(grad) or is_accordion(grad):
                raise ValueError(f"zero_stage 2 reduce-scatters every micro-batch's buckets as they fill, but the "
                                 f"compression config's dp_gradient {grad} all-reduces whole buckets in low rank or "
                                 f"picks codecs on whole-step gradients: use --zero-stage 1 or a value codec (e.g. "
                                 f"--compression loco4)")
        if z.overlap_param_gather:
            why = (f"optimizer {name} (use --optimizer adamw)" if name != "adamw" else
                   "--no-shard-optimizer (there is no parameter all-gather)" if z.shard is False else
                   f"--outer-algorithm {cfg.outer.algorithm} (the outer step reads the parameters right after the "
                   f"inner step)" if cfg.outer.algorithm != "none" else
                   "LoQT (its merges read the parameters after the step)" if cfg.loqt.rank else
                   f"--overlap-optimizer {cfg.overlap.mode} (it gathers in its own background thread)"
                   if cfg.overlap.mode != "none" else None)
            if why:
                raise ValueError(f"overlap_param_gather does not combine with {why}; drop --overlap-param-gather or that")

    def build(self, run) -> None:
        cfg, c = self.cfg, run.compression
        inputs = optimizer_inputs(run)
        optimizer_class = run.inner_optimizer_class
        if cfg.zero.freeze_variance_step:
            optimizer_class = functools.partial(FrozenVarianceAdamW, freeze_step=cfg.zero.freeze_variance_step)
        self.opt = DistributedOptimizer(
            inputs.groups, optimizer_class, run.dp_group,
            grad_channel=run.channels.dp_gradient, param_channel=run.channels.dp_parameter,
            grad_codec_warmup_steps=c.dp_gradient_warmup_steps,
            max_grad_norm=cfg.training.clip_grad or None, grad_norm_group=inputs.norm_group,
            grad_norm_weight=inputs.norm_weight, deferred_params=inputs.deferred, lr=cfg.training.lr,
            betas=(cfg.training.adam_beta1, cfg.training.adam_beta2), shard=cfg.zero.shard, zero_stage=cfg.zero.stage)
        if cfg.zero.overlap_param_gather:
            self.opt.overlap_param_gather(run.model)
        run.optimizer = self.opt

    def banner(self, run) -> list[str]:
        if self.cfg.zero.stage != 2:
            return []
        opt, micro = self.opt, run.num_microbatches
        whole = [b for b in opt.buckets if b.deferred]
        kept = (f"; {len(whole)} deferred bucket(s) ({sum(b.padded for b in whole) * 4 / 2**20:.2f} MiB, tied "
                f"embeddings / sequence-parallel norms summed over another group first) stay whole until the step"
                if whole else "")
        shard = sum(b.padded for b in opt.buckets) // opt.world * 4
        largest = max(b.padded for b in opt.buckets) * 4
        return [f"optimizer: ZeRO-2: fp32 gradient shard {shard / 2**20:.2f} MiB per rank; each bucket (largest "
                f"{largest / 2**20:.2f} MiB) reduce-scattered as soon as a micro-batch fills it and freed, {micro} "
                f"reduce-scatter(s) per bucket per iteration ({micro}x ZeRO-1's dp_gradient messages){kept}"]

    def weights_loaded(self, run) -> None:
        self.opt.load_params_from_model()  # the fp32 masters from the loaded weights

    def before_save(self, run):
        self.opt.wait_params()  # --overlap-param-gather: the last step's all-gathers land first
        return contextlib.nullcontext()

    def finish(self, run) -> None:
        self.opt.wait_params()  # the model ends on the last step's parameters
