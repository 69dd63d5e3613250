"""AdamW with several first moments at different timescales: MT-DAO's inner optimizer.

Why (Iacob et al., "MT-DAO", ICLR 2026): a fast momentum (beta 0.9) has
a half-life of about 6.6 steps, so after K = 32 local steps it has forgotten the state it shared with the
other replicas at the last synchronisation (0.9^32 ~ 0.03). Slow momenta (beta ~ 0.999) keep it; mixing
them into the update quasi-hyperbolically (QHAdam) keeps the fast momentum's responsiveness.

Steps per parameter (``t`` counts its steps; decoupled weight decay as torch.optim.AdamW):

    m   = beta1 * m + (1 - beta1) * g                      the fast first moment (AdamW's exp_avg)
    s_j = b_j * s_j + (1 - b_j) * g        j = 1..N        slow first moments, betas ``slow_betas``
    v   = beta2 * v + (1 - beta2) * g^2
    u   = (1 - sum_j w_j) * m / (1 - beta1^t) + sum_j w_j * s_j / (1 - b_j^t)     weights ``slow_weights``
    p   = p * (1 - lr * wd) - lr * u / (sqrt(v) / sqrt(1 - beta2^t) + eps)

With ``beta1 = 0`` the fast term is the raw gradient: the reference code's form (one slow momentum, beta
0.999, weight 0.9, on an ADOPT base; this class keeps Adam's second moment instead). With no slow momenta
every step is the same floating-point sequence as ``torch.optim.AdamW(foreach=False)`` (tested
bit-identical). Non-finite gradients are not filtered here: the DistributedOptimizer skips those steps.

State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq`` (AdamW's names and shapes) and ``slow_avg_<j>``,
so sharded checkpoints and MT-DAO's state averaging (megacomp.outer.mt_dao) see plain tensors.
"""
from __future__ import annotations

import torch

from .frozen_adam import FrozenVarianceAdamW


class MultiTimescaleAdamW(FrozenVarianceAdamW):
    """AdamW plus ``slow_betas`` first moments mixed in with ``slow_weights`` (see the module docstring); the
    AdamW part, ``freeze_step`` included, is FrozenVarianceAdamW's.

    Raises:
        ValueError: as FrozenVarianceAdamW; a slow beta outside ``[0, 1)``; ``slow_betas`` and
            ``slow_weights`` of different lengths; a weight < 0 or weights summing to more than 1.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 slow_betas=(0.999,), slow_weights=(0.9,), freeze_step=None) -> None:
        slow_betas, slow_weights = tuple(float(b) for b in slow_betas), tuple(float(w) for w in slow_weights)
        if not all(0.0 <= b < 1.0 for b in slow_betas):
            raise ValueError(f"slow betas must be in [0, 1), got {slow_betas}")
        if len(slow_betas) != len(slow_weights):
            raise ValueError(f"one weight per slow momentum: slow_betas {slow_betas}, slow_weights {slow_weights}")
        if any(w < 0 for w in slow_weights) or sum(slow_weights) > 1.0:
            raise ValueError(f"slow_weights must be >= 0 and sum to at most 1 (the fast momentum gets the rest), got "
                             f"{slow_weights}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=freeze_step)
        for group in self.param_groups:
            group.setdefault("slow_betas", slow_betas)
            group.setdefault("slow_weights", slow_weights)

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        super()._init_state(p, state, group)
        for j in range(len(group["slow_betas"])):
            state[f"slow_avg_{j}"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _apply(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict, t: int, bias_correction1: float,
               denom: torch.Tensor) -> None:
        slow = list(zip(group["slow_betas"], group["slow_weights"]))
        if not slow:  # AdamW's own last operation: bit-identical to torch.optim.AdamW
            super()._apply(p, g, state, group, t, bias_correction1, denom)
            return
        u = state["exp_avg"] * ((1 - sum(w for _, w in slow)) / bias_correction1)
        for j, (b, w) in enumerate(slow):
            s = state[f"slow_avg_{j}"]
            s.lerp_(g, 1 - b)
            u.add_(s, alpha=w / (1 - b ** t))
        p.addcdiv_(u, denom, value=-group["lr"])
