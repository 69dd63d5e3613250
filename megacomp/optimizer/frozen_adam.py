"""AdamW whose second moment freezes after a warm-up: the optimizer side of 1-bit Adam.

Why: error feedback (EF, LoCo) makes the *sum* of the transmitted gradients track the sum of the true ones,
so a linear optimizer (SGD, momentum) sees the right update on average. Adam is not linear: a coordinate
whose gradient sits below the codec's step is sent as rare bursts of one full step, and the bursts inflate
``v = E[g^2]`` (about ``s*c`` instead of ``c^2`` for a step ``s`` and a mean ``c``), which shrinks that
coordinate's update by about ``sqrt(c/s)``. 1-bit Adam (Tang et al., 2021) removes the non-linearity by
freezing ``v`` after a warm-up; then ``m`` is a linear filter of the gradients and EF's telescoping sum
reaches the update.

Steps per parameter (``t`` counts this parameter's steps, decoupled weight decay as torch.optim.AdamW):

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2            only while t <= freeze_step
    p = p * (1 - lr * wd) - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t_v) + eps)

where ``t_v = min(t, freeze_step)``. Up to ``freeze_step`` (and for ``freeze_step=None``) every step is the
same floating-point sequence as ``torch.optim.AdamW(foreach=False)``, so the results are bit-identical
(tested). Non-finite gradients are not filtered here: the DistributedOptimizer skips such steps before.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


class FrozenVarianceAdamW(torch.optim.Optimizer):
    """AdamW with ``exp_avg_sq`` frozen after ``freeze_step`` steps (None = never: plain AdamW).

    ``bias_correction=False`` drops Adam's bias corrections (the steps DeepSpeed's OnebitAdam takes).
    ``freeze_step``: steps of variance warm-up (1-bit Adam uses 15-25% of training; it should cover the
    learning-rate warm-up). The state (``step``, ``exp_avg``, ``exp_avg_sq``) has AdamW's names and shapes,
    so checkpoints and sharded loading work as for AdamW.

    Raises:
        ValueError: ``lr``, ``eps`` or ``weight_decay`` < 0; a beta outside ``[0, 1)``; ``freeze_step`` not
            None or an int >= 1.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, freeze_step: Optional[int] = None, bias_correction: bool = True) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if freeze_step is not None and (not isinstance(freeze_step, int) or freeze_step < 1):
            raise ValueError(f"freeze_step must be an int >= 1 (or None for never), got {freeze_step!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      freeze_step=freeze_step, bias_correction=bool(bias_correction)))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient (the steps in the module docstring).

        Args:
            closure: optional; re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state, group)
                state["step"] += 1
                self._update(p, p.grad, state, group, int(state["step"].item()))
        return loss

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        """A parameter's first state: the step counter and AdamW's two moments (subclasses add their own)."""
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict, t: int) -> None:
        """Step ``t`` of one parameter: the operations, in the same order, of torch.optim.adamw's single-tensor
        path (the variance update skipped after ``freeze_step``), then :meth:`_apply`."""
        beta1, beta2 = group["betas"]
        lr, eps, wd, freeze = group["lr"], group["eps"], group["weight_decay"], group["freeze_step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - beta1)
        if freeze is None or t <= freeze:
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        t_v = t if freeze is None else min(t, freeze)
        bc = group.get("bias_correction", True)  # False: DeepSpeed's 1-bit Adam steps (no bias correction)
        bias_correction1 = 1 - beta1 ** t if bc else 1.0
        bias_correction2 = 1 - beta2 ** t_v if bc else 1.0
        denom = (v.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        self._apply(p, g, state, group, t, bias_correction1, denom)

    def _apply(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict, t: int, bias_correction1: float,
               denom: torch.Tensor) -> None:
        """p -= lr * m_hat / denom (AdamW's last operation; MultiTimescaleAdamW mixes in its slow moments)."""
        step_size = group["lr"] / bias_correction1
        p.addcdiv_(state["exp_avg"], denom, value=-step_size)
