"""LoQT in the pretraining loop (``--loqt-rank R``): the model's transformer linears converted to quantised base
weights plus trainable rank-R factors (megacomp.tensor_parallel.loqt), and the merge iterations driven.

Per iteration ``it`` (0-based):
  - a merge iteration (iteration 0 and the schedule's steps): the usual forward/backward with the full weight
    gradients captured, then every layer's merge and re-initialisation (DP sum of the captured gradient, the
    projection from the TP-summed Gram matrix, ``Q = quantise(deq Q + alpha low-rank)``, the factor restarted),
    the optimizer's fp32 copy of the factors refreshed, and no optimizer step (as the reference): LOMO / AdaLomo
    still update the other parameters inside that backward; the sharded optimizer drops the iteration's gradients;
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

from ..tensor_parallel.loqt import LoQT, LoQTSchedule, convert_to_loqt, sync_optimizer
from .fused import FusedStep
from .guard import TrainingDiverged
from .optimizer_args import loqt_kwargs


class LoQTDriver:
    """The LoQT layers of one rank's model and their merge schedule (see the module docstring)."""

    def __init__(self, cfg, model, groups) -> None:
        kw = loqt_kwargs(cfg)
        self.layers = convert_to_loqt(model, **kw["convert"])
        self.loqt = LoQT(self.layers, LoQTSchedule(**kw["schedule"]), dp_group=groups.dp)
        self.merges = 0
        self.deferred = False  # a merge found inf/NaN gradients: the next iteration merges instead

    def begin(self, iteration: int) -> bool:
        """Whether ``iteration`` merges; if so, the coming backward captures the full weight gradients."""
        if not (self.deferred or self.loqt.wants_full_gradient(iteration)):
            return False
        self.loqt.start_full_gradient()
        return True

    def finish(self, iteration: int, optimizer) -> bool:
        """After the merge iteration's backward: merge, re-initialise, refresh the optimizer's view of the factors
        and drop the iteration's gradients (no optimizer step). Returns False when the gradients were inf/NaN:
        nothing merged (and the loss scale backs off), the next iteration merges."""
        merged = self.loqt.merge_and_reinit(iteration)
        if merged:
            sync_optimizer(getattr(optimizer, "opt", optimizer), self.layers)  # training.fused wraps LOMO / AdaLomo
            self.merges += 1
        elif isinstance(optimizer, FusedStep) and optimizer.step():  # no norm pass saw it: already applied
            raise TrainingDiverged(f"LoQT merge at iteration {iteration + 1}: the captured weight gradients are "
                                   f"inf/NaN and the other parameters were already updated inside backward; "
                                   f"resume from the last checkpoint with a lower learning rate")
        self.deferred = not merged
        if hasattr(optimizer, "zero_grad"):
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
        return (f"LoQT on {len(self.layers)} linears (this rank): rank {layer.rank}, base {layer.codec}, "
                f"{trainable:,} trainable factor elements, base weights {stored / 1e6:.2f} MB stored vs "
                f"{dense / 1e6:.2f} MB dense; merges at iterations {', '.join(str(s + 1) for s in first)}, ... "
                f"(no optimizer step there)")
