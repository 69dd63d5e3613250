"""LOMO / AdaLomo in the pretraining loop (``--optimizer lomo|adalomo``): the optimizer that updates inside
backward, behind the interface the trainer gives every optimizer (``param_groups`` for the learning rate, ``step()``, ``last_grad_norm``,
checkpoint state).

Per iteration (one micro-batch per DP rank: an update inside backward leaves no gradient to accumulate):
  1. forward: ``loss = model(ids, labels)``;
  2. when clipping by norm or under fp16 loss scaling, the first backward pass (:meth:`Lomo.grad_norm`): the
     DP-averaged gradients' global norm over TP, and the overflow verdict (an overflow skips the step on every
     rank, the loss scale backs off);
  3. :meth:`Lomo.fused_backward`: each parameter's gradient is all-reduced over DP on the ``dp_gradient``
     channel (codec, error feedback per parameter name) while backward goes on, then clipped, applied and freed.
With the word embedding and the tied output layer on one stage (PP 1), :func:`tie_for_fused_update` keeps one
gradient buffer for that weight (the lookup's backward adds into the output layer's partial; same bits).
``step()`` only reports whether step 3 happened. There is no fp32 master, no gradient buffer and no
parameter all-gather (every DP rank applies the same averaged gradient), so the ``dp_parameter`` path must be
uncompressed and unused.

Compared with the reference (OpenLMLab/LOMO at commit 45d4bac; the optimizer's own comparison is in
megacomp.optimizer.lomo): the step is the reference's, but this loop's defaults are the shared config's, not the
reference's: ``weight_decay`` 0.1 and ``clip_grad`` 1.0 (the reference: no weight decay; LOMO's experiments clip
at 1.0, AdaLomo's scripts do not clip) and an fp16 loss scale that doubles every ``loss_scale_window`` clean
steps (the reference's never grows). The reference's settings, as options: LOMO ``--weight-decay 0 --clip-grad 1``
(fp16: ``--initial-loss-scale 65536``, the start in its experiments' code, 2^32 in ``lomo_optim``, and a
``--loss-scale-window`` longer than the run);
AdaLomo ``--weight-decay 0 --clip-grad 0`` (fp16: ``--initial-loss-scale 1024`` and a window longer than the run,
its static 2^10 as long as no step overflows; an overflow here halves the scale and skips the step, the reference
applies it). The banner states the weight decay and clipping in use.

Failure behaviour: ValueError when the compression config asks for what LOMO cannot do (a ``dp_parameter``
codec, a low-rank or Accordion ``dp_gradient``, full-precision warm-up steps); TrainingDiverged when an update
pass without a norm pass met a non-finite gradient (already applied: the run stops without saving).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch.distributed as dist

from ...comm import Channel
from ...optimizer import AdaLomo, DynamicLossScaler, Lomo
from ..guard import TrainingDiverged
from .base import Feature

LOMO_OPTIMIZERS = {"lomo": Lomo, "adalomo": AdaLomo}


class FusedStep:
    """A :class:`~megacomp.optimizer.Lomo` (or AdaLomo) driven by the trainer (see the module docstring).

    Args:
        opt: the fused optimizer, built on the model.
        dp_rank: this rank's data-parallel rank (the checkpoint entry is per DP rank: error feedback differs).
    """

    def __init__(self, opt: Lomo, dp_rank: int) -> None:
        self.opt, self.dp_rank = opt, dp_rank
        self.param_groups = [{"lr": opt.lr}]  # the trainer writes each iteration's learning rate here
        self._stepped = False

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global gradient norm of the last norm pass (None without one, or after a skipped step)."""
        return self.opt.last_grad_norm

    def no_sync(self):
        """Nothing to defer (one micro-batch per iteration); here so the trainer's interface is complete."""
        return contextlib.nullcontext()

    def forward_backward(self, model, batches: list) -> list[float]:
        """Steps 1-3 of the module docstring on the iteration's single micro-batch; returns its loss."""
        if len(batches) != 1:
            raise ValueError(f"{type(self.opt).__name__} takes one micro-batch per iteration, got {len(batches)}; set "
                             f"global_batch_size = micro_batch_size x DP")
        ids, labels = batches[0]
        loss = model(ids, labels)
        lr = self.param_groups[0]["lr"]
        if self.opt.needs_norm_pass:
            self.opt.grad_norm(loss)
        try:
            self._stepped = self.opt.fused_backward(loss, lr)
        except FloatingPointError as e:
            raise TrainingDiverged(str(e)) from e
        return [loss.item()]

    def step(self) -> bool:
        """Whether this iteration's update happened (it was applied inside backward)."""
        return self._stepped

    def zero_grad(self) -> None:
        """Nothing to clear: each gradient is freed inside backward once its parameter is updated."""

    def reload_params(self, params, *, reset_state: bool = False) -> None:
        """The parameters were replaced in place (a LoQT merge): see :meth:`megacomp.optimizer.Lomo.reload_params`."""
        self.opt.reload_params(params, reset_state=reset_state)

    def init_state(self) -> None:
        """Zero error-feedback residuals for every compressed parameter (a checkpoint-load template)."""
        self.opt.init_state()

    def state_dict(self) -> dict[str, Any]:
        """This DP rank's optimizer state under a key naming the rank (so torch.distributed.checkpoint keeps every
        rank's error feedback; AdaLomo's moments are equal on every DP rank)."""
        return {f"dp_rank_{self.dp_rank}": {"rule": type(self.opt).__name__, **self.opt.state_dict()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. ValueError when the checkpoint holds no entry for this DP rank (another DP
        size) or was written by another optimizer."""
        key = f"dp_rank_{self.dp_rank}"
        if key not in state:
            raise ValueError(f"optimizer state has no entry for data-parallel rank {self.dp_rank} (keys: "
                             f"{sorted(state)}); it was saved with another data-parallel size")
        s = state[key]
        if s.get("rule") != type(self.opt).__name__:
            raise ValueError(f"optimizer checkpoint was saved by {s.get('rule')}, this run uses "
                             f"{type(self.opt).__name__}; resume with the same --optimizer")
        self.opt.load_state_dict({k: v for k, v in s.items() if k != "rule"})


def build_fused(name: str, model, groups, channels, compression, cfg) -> FusedStep:
    """LOMO (``name == 'lomo'``) or AdaLomo over the DP group on the ``dp_gradient`` channel, with fp16 loss
    scaling when the parameters are fp16. Raises ValueError for compression settings LOMO cannot honour."""
    ch: Channel = channels.dp_gradient
    if ch.reduces_whole_buckets:  # PowerSGD, Accordion, LGC
        raise ValueError(f"optimizer {name} all-reduces each parameter's gradient on its own inside backward: the "
                         f"dp_gradient path must be a codec (e.g. int4 + LoCo), not {ch!r} (PowerSGD / Accordion / "
                         f"LGC batch whole buckets)")
    if compression.dp_gradient_warmup_steps:
        raise ValueError(f"optimizer {name} has no full-precision warm-up path; drop dp_gradient_warmup_steps "
                         f"(got {compression.dp_gradient_warmup_steps})")
    if not channels.dp_parameter.codec.is_identity:
        raise ValueError(f"optimizer {name} sends no parameters (every DP rank applies the same averaged gradient), "
                         f"but the compression config sets dp_parameter {channels.dp_parameter.codec}; drop it")
    scaler, t = None, cfg.training
    if cfg.model.params_dtype == "float16":
        scaler = DynamicLossScaler(scale=t.initial_loss_scale, growth_interval=t.loss_scale_window)
    # weight decay and LOMO's clipping by the global norm (clip_grad; 0 = off, which also drops the first backward
    # pass unless fp16 needs it for the overflow check): the config's, which differ from the reference's defaults
    # (module docstring); AdaLomo's eps / clip_threshold / decay_rate are the reference's defaults
    opt = LOMO_OPTIMIZERS[name](model, lr=t.lr, dp_group=groups.dp, tp_group=groups.tp if groups.tp_size > 1 else None,
                                channel=ch, loss_scaler=scaler, weight_decay=t.weight_decay,
                                clip_grad_norm=t.clip_grad or None)
    tie_for_fused_update(model, opt)
    return FusedStep(opt, dist.get_rank(groups.dp))


def tie_for_fused_update(model, opt: Lomo) -> None:
    """Where ``model`` (a GPTModel) holds the word embedding and the output layer tied to it (PP 1), keep one
    gradient buffer for that weight, so LOMO's gradient memory stays within the largest gradient plus one message
    (benchmarks/results/memory): the lookup's backward adds into the output layer's partial gradient
    (``GPTConfig.tied_embedding_grad_in_place``, set on a copy of ``model.cfg``; same bits) and the reduction in
    flight is finished before that backward (:meth:`Lomo.flush_before`). Nothing to do on other stages."""
    if not (model.pre_process and model.post_process):
        return
    if not model.cfg.tied_embedding_grad_in_place:
        model.cfg = dataclasses.replace(model.cfg, tied_embedding_grad_in_place=True)
    opt.flush_before(model.word_embeddings)


def lomo_summary(step: FusedStep, name: str) -> str:
    """One line saying what LOMO / AdaLomo does and sends (the banner's)."""
    opt = step.opt
    ch = opt.channel
    ef = " + error feedback" if ch.error_feedback is not None else ""
    clip = (f"clipping by the global norm {opt.clip_grad_norm:g} (two backward passes)" if opt.clip_grad_norm
            else "no clipping" + (" (a first backward pass checks for fp16 overflow)" if opt.scaler else ""))
    scale = f", fp16 loss scale from {opt.scaler.scale:g}" if opt.scaler is not None else ""
    wd = f", weight decay {opt.weight_decay:g}"
    biggest = max(p.numel() * p.element_size() for p in opt.params.values())
    return (f"{name}: each parameter all-reduced over DP (dp_gradient, {ch.codec}{ef}) and updated inside "
            f"backward, its gradient freed: at most two gradients alive (largest {biggest / 1e6:.2f} MB), no fp32 "
            f"masters; {clip}{wd}{scale}")




class LomoFused(Feature):
    """LOMO / AdaLomo in the loop (see the module docstring): its own forward/backward, one micro-batch per DP rank
    (chosen from the config when the user did not set both batch sizes), the model's cross-entropy keeping its
    input for the second backward pass."""

    name = "lomo"
    optimizer_names = tuple(LOMO_OPTIMIZERS)

    @classmethod
    def check(cls, cfg, world) -> None:
        if not cls.selected(cfg):
            return
        name = cfg.training.optimizer
        if cfg.parallel.pipeline_model_parallel_size != 1:
            raise ValueError(f"optimizer {name} updates each parameter inside its backward: 1F1B's later micro-batches "
                             f"would run on updated weights; set pipeline_model_parallel_size 1")
        if cfg.parallel.sequence_parallel:
            raise ValueError(f"optimizer {name} updates inside backward, before sequence-parallel gradients are summed "
                             f"over TP; turn sequence_parallel off")
        if cfg.outer.algorithm != "none" or cfg.zero.freeze_variance_step:
            raise ValueError(f"optimizer {name} has no Adam state to freeze nor inner steps to hand to an outer loop; "
                             f"drop --outer-algorithm / --adam-freeze-variance-step")
        if cfg.zero.shard is False:
            raise ValueError(f"optimizer {name} keeps no sharded state (every DP rank updates every parameter); drop "
                             f"--no-shard-optimizer")
        if world:
            t, p = cfg.training, cfg.parallel
            dp = world // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size) or 1
            if t.global_batch_size != t.micro_batch_size * dp:
                raise ValueError(f"optimizer {name} updates the parameters inside backward, so an iteration is one "
                                 f"micro-batch per data-parallel rank: set global_batch_size = micro_batch_size "
                                 f"({t.micro_batch_size}) x DP ({dp}) = {t.micro_batch_size * dp} (got "
                                 f"{t.global_batch_size}), or raise micro_batch_size")

    @classmethod
    def resolve(cls, cfg, world) -> list[str]:
        """One micro-batch per DP rank: where the batch sizes disagree and the command line did not set
        global_batch_size, it becomes micro_batch_size x DP (said in the banner)."""
        t, p = cfg.training, cfg.parallel
        if not world or "global_batch_size" in cfg.explicit:
            return []
        dp = world // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size) or 1
        if t.global_batch_size == t.micro_batch_size * dp:
            return []
        was, t.global_batch_size = t.global_batch_size, t.micro_batch_size * dp
        return [f"batch: global_batch_size {t.global_batch_size} (micro_batch_size {t.micro_batch_size} x DP {dp}) "
                f"instead of {was}: {t.optimizer} updates inside backward, so an iteration is one micro-batch per DP "
                f"rank (--global-batch-size sets it)"]

    def configure_model(self, gpt_kwargs: dict) -> None:
        gpt_kwargs["cross_entropy_inplace_backward"] = False  # the norm pass and the update pass both run backward

    def build(self, run) -> None:
        self.step_driver = build_fused(self.cfg.training.optimizer, run.model, run.groups, run.channels,
                                       run.compression, self.cfg)
        run.optimizer = self.step_driver

    def banner(self, run) -> list[str]:
        return [f"optimizer: {lomo_summary(self.step_driver, self.cfg.training.optimizer)}"]

    def forward_backward(self, run, batches, inner) -> list[float]:
        return self.step_driver.forward_backward(run.model, batches)
