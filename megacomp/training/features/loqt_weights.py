"""LoQT in the pretraining loop (``--loqt-rank R``, the ``loqt`` component): the model's transformer linears converted to quantised base
weights plus trainable rank-R factors (megacomp.tensor_parallel.loqt), and the merge iterations driven.

Per iteration ``it`` (0-based):
  - a merge iteration (iteration 0 and the schedule's steps): the usual forward/backward with the full weight
    gradients captured, then every layer's merge and re-initialisation (DP sum of the captured gradient, the
    projection from the TP-summed Gram matrix, ``Q = quantise(deq Q + alpha low-rank)``, the factor restarted),
    the optimizer's fp32 copy of the factors refreshed, and no optimizer step (as sebulo/LoQT's first commit
    3ab2ead): LOMO / AdaLomo still update the other parameters inside that backward; the sharded optimizer drops the
    iteration's gradients (``--loqt-merge-optimizer-step``: it steps on them instead, the factors' gradients zero,
    as the reference's head 375b41a does);
  - any other iteration is an ordinary step: only the factors, biases, norms and embeddings have gradients, so
    only they cross the data-parallel group (dp_gradient), compressed as configured.
The merge gradients travel as traffic kind ``loqt_merge`` (DP, uncompressed) and ``loqt_merge_tp`` (the Gram
matrices), counted in the iteration's wire bytes.

A merge whose captured gradients hold inf/NaN (an fp16 loss-scale overflow: with fp16 the first iterations, one
of them the first merge, often overflow until the scale has backed off) merges nothing and counts as a skipped
step; the next iteration captures again and merges (so the schedule's later merges keep their steps).

Failure behaviour: ValueError from the conversion for settings the layers reject (a block size that does not
divide a layer's local rows names the layer and the fix); skipped merges count against ``--max-skipped-steps``
like any skipped step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...compression import parse_codec_arg
from ...tensor_parallel.loqt import LoQT, LoQTSchedule, convert_to_loqt, sync_optimizer
from ..guard import TrainingDiverged
from .base import Feature
from .lomo_fused import LOMO_OPTIMIZERS


@dataclass
class LoQTConfig:
    """LoQT: quantised base weights with trainable low-rank factors, merged on a schedule."""

    FLAT_PREFIX = "loqt_"
    rank: int = 0
    """LoQT (megacomp.tensor_parallel.loqt): 0 = off; r > 0 stores every transformer linear's weight quantised
    (--loqt-codec) and trains only a rank-r factor per layer (plus biases, norms and embeddings), merged into the
    quantised weight on the schedule below; only the trainable parameters cross the DP group."""
    codec: Any = "{name: int8, block_size: 32}"
    """LoQT: codec of the stored base weights (int8 or int4 with a block size dividing each layer's local rows)."""
    alpha: float = 0.5
    """LoQT: scale of the low-rank product in the weight (the reference's lora_alpha, used as is)."""
    update_interval: int = 100
    """LoQT: tau, iterations from the first merge to the second; the k-th later interval is tau + floor(growth^k)."""
    growth: float = 1.2
    """LoQT: growth psi of the merge intervals (1: every interval is tau + 1)."""
    compensate_iters: int = 5
    """LoQT: rounds of the reference's quantisation-error compensation at each merge (0 = the factor restarts at 0)."""
    merge_optimizer_step: bool = False
    """LoQT: whether a merge iteration also takes an optimizer step. False (default): no step, its gradients are
    dropped (sebulo/LoQT's first commit 3ab2ead, and the paper's loop). True: the step of the reference's current
    head (375b41a): the factors' gradients are zero (AdamW still decays their moments and moves the restarted factor
    by its momentum term) and the other parameters (embeddings, norms, biases) step on the merge iteration's
    gradients. --optimizer adamw only."""


def loqt_kwargs(cfg) -> dict:
    """megacomp.tensor_parallel.loqt settings of a run: ``convert`` (convert_to_loqt's keywords) and ``schedule``
    (LoQTSchedule's). Raises ValueError for a negative rank, alpha <= 0, an interval < 1, growth < 1, negative
    compensation rounds, or an optimizer / outer loop that LoQT does not drive (its merges reset the factor
    under the optimizer: the sharded AdamW and LOMO / AdaLomo handle that)."""
    q = cfg.loqt
    if q.rank < 0 or q.alpha <= 0 or q.update_interval < 1 or q.growth < 1 or q.compensate_iters < 0:
        raise ValueError(f"LoQT needs loqt_rank >= 0, loqt_alpha > 0, loqt_update_interval >= 1, loqt_growth >= 1 and "
                         f"loqt_compensate_iters >= 0; got {q.rank}, {q.alpha}, {q.update_interval}, {q.growth} and "
                         f"{q.compensate_iters}")
    name = cfg.training.optimizer
    if q.merge_optimizer_step and name != "adamw":
        raise ValueError(f"loqt_merge_optimizer_step needs --optimizer adamw ({name} updates inside backward, so a "
                         f"merge iteration already updates its other parameters); drop the flag")
    if name not in ("adamw",) + tuple(LOMO_OPTIMIZERS) or cfg.outer.algorithm != "none" or cfg.zero.freeze_variance_step:
        raise ValueError(f"LoQT (loqt_rank {q.rank}) runs with --optimizer adamw, lomo or adalomo and no outer "
                         f"loop or variance freezing (got optimizer {name}, outer {cfg.outer.algorithm}); "
                         f"set loqt_rank 0 or change the optimizer")
    return {"convert": {"rank": q.rank, "codec": parse_codec_arg(q.codec), "alpha": q.alpha,
                        "compensate_iters": q.compensate_iters},
            "schedule": {"gap": q.update_interval, "growth": q.growth, "total_steps": cfg.training.train_iters}}


class LoQTDriver:
    """The LoQT layers of one rank's model and their merge schedule (see the module docstring)."""

    def __init__(self, cfg, model, groups, compression) -> None:
        kw = loqt_kwargs(cfg)
        self.layers = convert_to_loqt(model, **kw["convert"])
        # the merge's DP gradient sum and TP Gram all-reduce: the compression config's loqt_merge / loqt_merge_tp
        # paths (not set: exact, as the reference)
        merge, gram = compression.loqt_merge, compression.loqt_merge_tp
        channel = compression.channel("loqt_merge", merge, group=groups.dp) if merge is not None else None
        tp_channel = compression.channel("loqt_merge_tp", gram, group=groups.tp) if gram is not None else None
        self.loqt = LoQT(self.layers, LoQTSchedule(**kw["schedule"]), dp_group=groups.dp,
                         channel=channel, tp_channel=tp_channel)
        self.merges = 0
        self.updates_in_backward = cfg.training.optimizer in LOMO_OPTIMIZERS  # a step() says whether it updated
        self.deferred = False  # a merge found inf/NaN gradients: the next iteration merges instead
        self.step_on_merge = cfg.loqt.merge_optimizer_step
        self.merged = False  # whether the last merge iteration merged

    def begin(self, iteration: int) -> bool:
        """Whether ``iteration`` merges; if so, the coming backward captures the full weight gradients."""
        if not (self.deferred or self.loqt.wants_full_gradient(iteration)):
            return False
        self.loqt.start_full_gradient()
        return True

    def finish(self, iteration: int, optimizer, step=None) -> bool:
        """After the merge iteration's backward: merge, re-initialise, refresh the optimizer's view of the factors
        and drop the iteration's gradients (no optimizer step), or, with ``loqt_merge_optimizer_step``, run ``step``
        (the optimizer step; the factors' gradients are zero: they got none in the capturing backward) and return
        what it returns. Returns False when the gradients were inf/NaN: nothing merged (and the loss scale backs
        off), the next iteration merges."""
        merged = self.loqt.merge_and_reinit(iteration)
        self.merged = merged
        if merged:
            sync_optimizer(optimizer, self.layers)
            self.merges += 1
            if self.step_on_merge and step is not None:
                self.deferred = False
                return step()
        elif self.updates_in_backward and optimizer.step():  # LOMO: no norm pass saw it, already applied
            raise TrainingDiverged(f"LoQT merge at iteration {iteration + 1}: the captured weight gradients are "
                                   f"inf/NaN and the other parameters were already updated inside backward; "
                                   f"resume from the last checkpoint with a lower learning rate")
        self.deferred = not merged
        optimizer.zero_grad()
        return merged

    def summary(self) -> str:
        """One line for the banner: layers, rank, codec, trainable share, schedule."""
        stats = self.loqt.stats()
        trainable = sum(s["factor_params"] for s in stats)
        dense = sum(s["dense_bytes"] for s in stats)
        stored = sum(s["quantized_bytes"] for s in stats)
        layer = self.layers[0]
        sched = self.loqt.schedule
        first = sched.merge_steps(10 * sched.gap)[:4]
        return (f"LoQT on {len(self.layers)} linears (this rank): rank {layer.rank}, base {layer.codec}, merge sums "
                f"loqt_merge {self.loqt.channel.codec} / loqt_merge_tp {self.loqt.tp_channel.codec}, "
                f"{trainable:,} trainable factor elements, base weights {stored / 1e6:.2f} MB stored vs "
                f"{dense / 1e6:.2f} MB dense; merges at iterations {', '.join(str(s + 1) for s in first)}, ... "
                f"({'an optimizer step there too' if self.step_on_merge else 'no optimizer step there'})")


class LoQTWeights(Feature):
    """LoQT in the loop (see the module docstring): converts the model before the optimizer sees it, captures the
    full weight gradients on merge iterations and merges instead of stepping there."""

    name = "loqt"
    CONFIG = LoQTConfig
    config_key = "loqt"

    @classmethod
    def selected(cls, cfg) -> bool:
        return bool(cfg.loqt.rank)

    @classmethod
    def check(cls, cfg, world) -> None:
        if cls.selected(cfg):
            loqt_kwargs(cfg)  # raises on bad values

    def build(self, run) -> None:
        self.driver = LoQTDriver(self.cfg, run.model, run.groups, run.compression)
        self.merging = False

    def banner(self, run) -> list[str]:
        return [f"weights: {self.driver.summary()}"]

    def iteration(self, run, batches, inner):
        self.merging = self.driver.begin(run.iteration)  # captures full weight gradients
        return inner(batches)

    def step(self, run, inner) -> bool:
        if not self.merging:
            return inner()
        # merge and re-initialise instead of an optimizer step (as the reference); False: inf/NaN, merged next time
        return self.driver.finish(run.iteration, run.optimizer, inner)

    def record(self, run, record: dict) -> None:
        if self.merging:
            if not self.driver.step_on_merge:
                record["grad_norm"] = None
            record["loqt_merge"] = self.driver.merged
