"""The update rules of 1-bit Adam, 0/1 Adam and 1-bit LAMB, applied to the fp32 masters of a
:class:`megacomp.optimizer.onebit.OneBitOptimizer` (whole buckets, or this rank's shard of them).

A rule is a torch optimizer whose ``action`` the OneBitOptimizer sets before each ``step()``; ``p.grad`` then
holds what that action exchanged:

  ``grad``       the full-precision average gradient (warm-up; 0/1 Adam's variance-update steps);
  ``grad_1bit``  0/1 Adam: the 1-bit average gradient (error feedback); the variance is not updated;
  ``momentum``   1-bit Adam / LAMB: the 1-bit average of every rank's local momentum (it replaces ``m``);
  ``local``      0/1 Adam: this rank's own gradient (no communication; parameters drift apart until the
                 next synchronisation, see :meth:`ZeroOneAdamRule.sync_buffer`).

The equations (``t``: steps taken, ``bc1 = 1 - beta1^t``, ``bc2 = 1 - beta2^n`` for the ``n`` variance updates
so far; both 1 with ``bias_correction=False``, which is what DeepSpeed computes: it accepts the flag and never
applies it) are in each class docstring. tests/test_optimizer_onebit.py checks each against an independent
fp64 scalar restatement.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ..frozen_adam import FrozenVarianceAdamW

class OneBitAdamRule(FrozenVarianceAdamW):
    """1-bit Adam (Tang et al., 2021): AdamW for ``freeze_step`` steps, then the variance is frozen and the
    exchanged momentum replaces the local one.

    ``grad`` (t <= freeze_step): ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``, then
    ``p = p (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps)``: torch.optim.AdamW's operations in its order,
    so with bias correction this is AdamW bit for bit.
    ``momentum`` (t > freeze_step): ``m = grad`` (the average of every rank's ``b1 m + (1-b1) g_local``, formed
    and exchanged by the OneBitOptimizer), ``v`` frozen at step freeze_step, same parameter update.
    """

    action = "grad"

    def _update(self, p, g, state, group, t):
        if self.action == "momentum":
            if group["freeze_step"] is None or t <= group["freeze_step"]:
                raise RuntimeError(f"1-bit Adam: momentum exchange at step {t}, inside the warm-up (freeze_step="
                                   f"{group['freeze_step']})")
            state["exp_avg"].copy_(g)  # then m.lerp_(g, .) in the AdamW sequence is exact: m + w (g - m) = m
        elif self.action != "grad":
            raise ValueError(f"1-bit Adam has no action {self.action!r}")
        super()._update(p, g, state, group, t)

    def init_state(self) -> None:
        """Create every master's state (zeros), for a checkpoint template."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self._init_state(p, self.state[p], group)


class ZeroOneAdamRule(torch.optim.Optimizer):
    """0/1 Adam (Lu et al., 2022) on whole parameters (every rank updates everything: local steps).

    ``grad`` (variance-update step): ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``, ``n += 1``;
    ``grad_1bit``: ``m = b1 m + (1-b1) g`` with the 1-bit averaged g, ``v`` kept;
    ``local`` (after var_freeze_step): ``m = b1 m + (1-b1) g_local``.
    Then every action: ``p = p (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps)``; a local step that
    starts a local period first records the anchor ``a = p`` (the last synchronised point) and every local
    step adds ``lrs += lr``. At a synchronisation (:meth:`sync_buffer`, :meth:`finish_sync`):
    ``w = avg_ranks((a - p) * denom)`` (1-bit, error feedback), ``m = bc1 * w / lrs``, ``p = a - w / denom``,
    ``lrs = 0`` (DeepSpeed's ZeroOneAdam, which accumulates ``u = sum d`` and undoes it, ``a - p``, with the bias
    correction carried through; ``denom = sqrt(v / bc2) + eps`` is frozen, so the exchange is linear). The
    anchor makes every rank's parameters bitwise equal after a synchronisation.
    Weight decay is the decoupled (AdamW) kind, inside ``d`` as in DeepSpeed.
    """

    action = "grad"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 bias_correction: bool = True) -> None:
        _check_common(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bool(bias_correction)))

    def _init(self, p, state) -> None:
        state["step"] = torch.tensor(0.0)
        state["var_updates"] = torch.tensor(0.0)
        state["lrs"] = torch.tensor(0.0)  # fp32: torch's load_state_dict casts float state to the param dtype
        for k in ("exp_avg", "exp_avg_sq", "anchor"):
            state[k] = torch.zeros_like(p)

    def init_state(self) -> None:
        """Create every master's state (zeros), for a checkpoint template."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self._init(p, self.state[p])

    def _denom(self, state, group) -> torch.Tensor:
        n = int(state["var_updates"].item())
        bc2 = 1 - group["betas"][1] ** n if group["bias_correction"] and n > 0 else 1.0
        return (state["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(group["eps"])

    def _bc1(self, state, group) -> float:
        return 1 - group["betas"][0] ** int(state["step"].item()) if group["bias_correction"] else 1.0

    @torch.no_grad()
    def step(self, closure=None):
        """One step of :attr:`action` for every master with a gradient (equations in the class docstring)."""
        if self.action not in ("grad", "grad_1bit", "local"):
            raise ValueError(f"0/1 Adam has no action {self.action!r}")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init(p, state)
                state["step"] += 1
                g, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
                if self.action == "local" and float(state["lrs"].item()) == 0.0:
                    state["anchor"].copy_(p)
                # torch.optim.AdamW's single-tensor operations in its order (bit for bit AdamW when every step
                # updates the variance): decoupled decay, m, [v], p -= lr/bc1 * m / denom
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m.lerp_(g, 1 - beta1)
                if self.action == "grad":
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    state["var_updates"] += 1
                p.addcdiv_(m, self._denom(state, group), value=-group["lr"] / self._bc1(state, group))
                if self.action == "local":
                    state["lrs"] += group["lr"]
        return None

    @torch.no_grad()
    def sync_buffer(self, p: torch.Tensor) -> torch.Tensor:
        """Start a synchronisation of master ``p``: return ``(a - p) * denom`` (a new tensor, to be averaged
        over the ranks in place, then passed to :meth:`finish_sync`)."""
        state, group = self.state[p], self._group_of(p)
        return (state["anchor"] - p).mul_(self._denom(state, group))

    @torch.no_grad()
    def finish_sync(self, p: torch.Tensor, averaged: torch.Tensor) -> None:
        """``m = bc1 * w / lrs``, ``p = a - w / denom``, ``lrs = 0`` with ``w`` the averaged buffer."""
        state, group = self.state[p], self._group_of(p)
        lrs = float(state["lrs"].item())
        if lrs > 0:
            state["exp_avg"].copy_(averaged).mul_(self._bc1(state, group) / lrs)
        p.copy_(state["anchor"] - averaged / self._denom(state, group))
        state["lrs"].zero_()

    def _group_of(self, p):
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise KeyError("parameter not in this optimizer")


class OneBitLambRule(torch.optim.Optimizer):
    """1-bit LAMB (Li et al., 2021), per model parameter ``j`` (a master holds whole buckets or a shard of
    one: ``segments[k]`` lists ``(j, lo, hi)``, the slice of master k that is parameter j; the per-parameter
    sums and maxima are all-reduced over ``norm_group`` when ``reduce_norms``: the masters are shards).

    ``grad`` (t <= freeze_step): Adam moments; ``r = (m/bc1) / (sqrt(v/bc2) + eps)``, ``u = r + wd p``;
    ``c_j = clamp(||p_j|| / ||u_j||, min_coeff, max_coeff)`` (1 where a norm is 0); the frozen coefficient
    ``C_j = coeff_beta C_j + (1 - coeff_beta) c_j`` (where ``c_j != 1``, as DeepSpeed); ``p -= lr c_j u``.
    At t = freeze_step the fresh variance starts as ``v``.
    ``momentum`` (t > freeze_step): ``m_new = grad`` (the exchanged momentum); reconstructed gradient
    ``g~ = (m_new - b1 m) / (1 - b1)``; ``v_f = b2 v_f + (1-b2) g~^2``; ``r = (m_new/bc1) / (sqrt(v/bc2) + eps)``
    with ``v`` frozen; ``u = r + wd p``; ``f_j = max_j (sqrt(v/bc2) + eps) / (sqrt(v_f/bc2_t) + eps)``; with
    weight decay ``f_j = f_j q + (1 - q)``, ``q = min(1, ||r_j|| / ||u_j||)``; ``f_j`` clamped to
    [factor_min, factor_max], then to ``last_j (1 -+ factor_threshold)``; ``last_j = f_j``; ``p -= lr C_j f_j u``.
    """

    action = "grad"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 bias_correction: bool = True, freeze_step: int = 100000, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, segments: Optional[list] = None, num_params: Optional[int] = None,
                 norm_group=None, reduce_norms: bool = False) -> None:
        _check_common(lr, betas, eps, weight_decay)
        _check_freeze(freeze_step)
        if not 0 < min_coeff <= max_coeff:
            raise ValueError(f"1-bit LAMB needs 0 < min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        if not 0 < factor_min <= 1 <= factor_max or not 0 <= factor_threshold < 1 or not 0 <= coeff_beta < 1:
            raise ValueError(f"1-bit LAMB needs 0 < factor_min <= 1 <= factor_max, 0 <= factor_threshold < 1 and "
                             f"0 <= coeff_beta < 1; got {factor_min}, {factor_max}, {factor_threshold}, {coeff_beta}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bool(bias_correction)))
        self.freeze_step, self.max_coeff, self.min_coeff, self.coeff_beta = freeze_step, max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        masters = [p for g in self.param_groups for p in g["params"]]
        # default: every master is one whole parameter
        self.segments = segments if segments is not None else [[(k, 0, p.numel())] for k, p in enumerate(masters)]
        self.num_params = num_params if num_params is not None else len(masters)
        self.norm_group, self.reduce_norms = norm_group, reduce_norms  # None is the default group

    def _init(self, p, state) -> None:
        state["step"] = torch.tensor(0.0)
        for k in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"):
            state[k] = torch.zeros_like(p)
        # per model parameter (identical on every rank): frozen coefficient, last factor, momentum scale; stored
        # in fp32 (torch's load_state_dict casts float state to the param dtype, so fp64 would not resume exactly)
        state["lamb_coeff_freeze"] = torch.zeros(self.num_params)
        state["last_factor"] = torch.ones(self.num_params)
        state["scaling_coeff"] = torch.ones(self.num_params)
        state["scaled"] = torch.tensor(0.0)  # 1 once scaling_coeff was set at the first compressed step

    def init_state(self) -> None:
        """Create every master's state (zeros), for a checkpoint template."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self._init(p, self.state[p])

    def _masters(self):
        k = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield k, p, group
                k += 1

    def _per_param(self, pieces: list, op) -> torch.Tensor:
        """``pieces``: per master, a list of tensors of equal columns; out[j] = op over every slice of param j."""
        cols = len(pieces[0])
        fill = 0.0 if op == "sum" else -math.inf
        out = torch.full((self.num_params, cols), fill, dtype=torch.float64)
        for k, tensors in enumerate(pieces):
            for j, lo, hi in self.segments[k]:
                vals = torch.stack([(t[lo:hi].double().square().sum() if op == "sum" else t[lo:hi].double().max())
                                    if hi > lo else torch.tensor(fill, dtype=torch.float64) for t in tensors])
                out[j] = out[j] + vals if op == "sum" else torch.maximum(out[j], vals)
        if self.reduce_norms:
            dev = pieces[0][0].device
            t = out.to(dev)
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.norm_group)
            out = t.cpu()
        return out

    def momentum_scales(self) -> torch.Tensor:
        """DeepSpeed's per-parameter momentum scale at the switch: ``mean_j rms(m_j) / rms(m_j)`` (1 where m_j is
        0), so that one 1-bit scale per chunk fits every layer's momentum."""
        masters = list(self._masters())
        sq = self._per_param([[self.state[p]["exp_avg"].reshape(-1)] for _, p, _ in masters], "sum")[:, 0]
        numel = torch.zeros(self.num_params, dtype=torch.float64)
        for k, _, _ in masters:
            for j, lo, hi in self.segments[k]:
                numel[j] += hi - lo
        if self.reduce_norms:
            numel = numel.to(masters[0][1].device)
            dist.all_reduce(numel, group=self.norm_group)
            numel = numel.cpu()
        rms = (sq / numel.clamp(min=1)).sqrt()
        united = rms.mean()
        return torch.where(rms > 0, united / rms, torch.ones_like(rms))

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB step (``grad``) or 1-bit LAMB step (``momentum``) of every master (class docstring)."""
        if self.action not in ("grad", "momentum"):
            raise ValueError(f"1-bit LAMB has no action {self.action!r}")
        masters = [(k, p, g) for k, p, g in self._masters() if p.grad is not None]
        if not masters:
            return None
        work = []
        for k, p, group in masters:
            state = self.state[p]
            if not state:
                self._init(p, state)
            state["step"] += 1
            t = int(state["step"].item())
            beta1, beta2 = group["betas"]
            bc = group["bias_correction"]
            m, v, vf, g = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"], p.grad
            if self.action == "grad":
                if t > self.freeze_step:
                    raise RuntimeError(f"1-bit LAMB: a full-precision step at {t}, after freeze_step {self.freeze_step}")
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                if t == self.freeze_step:
                    vf.copy_(v)
                n_v = t
            else:
                if t <= self.freeze_step:
                    raise RuntimeError(f"1-bit LAMB: momentum exchange at step {t}, inside the warm-up")
                g_rec = (g - m * beta1) / (1 - beta1)
                vf.mul_(beta2).addcmul_(g_rec, g_rec, value=1 - beta2)
                m.copy_(g)
                n_v = self.freeze_step
            bc1 = 1 - beta1 ** t if bc else 1.0
            denom = (v.sqrt() / math.sqrt(1 - beta2 ** n_v if bc else 1.0)).add_(group["eps"])
            r = (m / bc1).div_(denom)
            u = r + p * group["weight_decay"] if group["weight_decay"] else r
            ratio = None
            if self.action == "momentum":
                real = (vf.sqrt() / math.sqrt(1 - beta2 ** t if bc else 1.0)).add_(group["eps"])
                ratio = denom / real
            work.append((k, p, group, r.reshape(-1), u.reshape(-1), ratio))
        sums = self._per_param([[p.reshape(-1), r, u] for _, p, _, r, u, _ in work], "sum")
        maxima = self._per_param([[ratio.reshape(-1)] for *_, ratio in work], "max")[:, 0] \
            if self.action == "momentum" else None
        coeff = self._coefficients(sums, maxima, self.state[work[0][1]], work[0][2]["weight_decay"])
        for k, p, group, r, u, _ in work:
            state = self.state[p]
            if self.action == "grad":
                state["lamb_coeff_freeze"].copy_(coeff[1])
            else:
                state["last_factor"].copy_(coeff[1])
            flat = p.view(-1)
            for j, lo, hi in self.segments[k]:
                flat[lo:hi].add_(u[lo:hi], alpha=-group["lr"] * float(coeff[0][j]))
        return None

    def _coefficients(self, sums: torch.Tensor, maxima: Optional[torch.Tensor], state: dict, wd: float):
        """Per parameter (the trust ratios applied, the new frozen coefficients or last factors)."""
        w, rn, un = sums[:, 0].sqrt(), sums[:, 1].sqrt(), sums[:, 2].sqrt()
        if self.action == "grad":
            c = torch.where((w > 0) & (un > 0), (w / un).clamp(self.min_coeff, self.max_coeff), torch.ones_like(w))
            old = state["lamb_coeff_freeze"].double()
            frozen = torch.where(c != 1.0, self.coeff_beta * old + (1 - self.coeff_beta) * c, old)
            return c, frozen
        f = maxima.clone()
        if wd > 0:
            q = torch.where(un > 0, (rn / un).clamp(max=1.0), torch.ones_like(un))
            f = f * q + (1.0 - q)
        f = f.clamp(self.factor_min, self.factor_max)
        last = state["last_factor"].double()
        f = torch.minimum(torch.maximum(f, last * (1 - self.factor_threshold)), last * (1 + self.factor_threshold))
        return state["lamb_coeff_freeze"].double() * f, f


def _check_common(lr, betas, eps, weight_decay) -> None:
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"betas must be in [0, 1), got {betas}")


def _check_freeze(freeze_step, name: str = "freeze_step") -> None:
    if not isinstance(freeze_step, int) or isinstance(freeze_step, bool) or freeze_step < 1:
        raise ValueError(f"{name} must be an int >= 1 (the full-precision warm-up steps), got {freeze_step!r}")
