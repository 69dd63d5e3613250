"""LOMO and AdaLomo: the parameter update fused into backward, so full gradients are never all stored.

    opt = AdaLomo(model, lr=1e-3, dp_group=dp, channel=Channel("dp_gradient", "int4", error_feedback="loco"))
    for batch in data:
        loss = model(batch)
        if opt.clip_grad_norm:          # LOMO's clipping by the global norm takes a first backward pass
            opt.grad_norm(loss)
        opt.fused_backward(loss, lr)    # each parameter is reduced, updated and its gradient freed in backward

Algorithm (Lv et al., LOMO arXiv 2306.09782 and AdaLomo arXiv 2310.10195; the reference implementation's
order of operations, OpenLMLab/LOMO ``lomo_optim``). Per parameter p, in its post-accumulate-grad hook:

  1. data-parallel average: ``g = sum_r g_r / world`` through the ``dp_gradient`` channel (codec, error
     feedback keyed by the parameter's name). With DP > 1 the hook first finishes the previous parameter's
     reduction (decoded, applied), then copies ``p.grad`` into one persistent reduction buffer per dtype (the
     size of the largest parameter, allocated at construction: the "one communication bucket"), frees the
     gradient and starts the reduction of the buffer asynchronously, so it runs while autograd computes the
     next gradient. Why a persistent buffer: gloo's worker thread can still hold a finished reduction's
     tensor for a moment after ``wait()`` returns; were that a gradient, its memory could outlive its step
     next to the next gradients (the measured peak would then exceed the bound by chance);
  2. ``g`` in fp32; ``clip_grad_value``: clamp to [-v, v]; ``clip_grad_norm``: multiply by
     ``min(1, clip_grad_norm / (||g_all|| + 1e-6))``, the norm of the per-parameter norms of the averaged
     gradients computed by
     :meth:`grad_norm` in a first backward pass (LOMO's two-pass clipping; that pass reduces with the codec but
     without error feedback, so the residuals advance once per step);
  3. LOMO: ``p <- p (1 - lr wd) - lr g`` (in fp32, written back in p's dtype).
     AdaLomo (``t`` = step number from 1, ``beta2_t = 1 - t^decay_rate``):
       matrices: ``r <- beta2_t r + (1 - beta2_t) mean_cols(g^2 + eps1)``,
                 ``c <- beta2_t c + (1 - beta2_t) mean_rows(g^2 + eps1)``,
                 ``u = g / sqrt((r / mean(r)) c^T)`` (Adafactor's factored second moment);
       vectors:  ``v <- beta2_t v + (1 - beta2_t)(g^2 + eps1)``, ``u = g / sqrt(v)``;
       grouped update normalisation ``u <- u / max(1, RMS(u) / clip_threshold)``;
       ``lr_p = lr * max(eps2, RMS(p))``, ``p <- p (1 - lr_p wd) - lr_p u``.

With an identity channel the update equals the single-process update on the averaged gradient (tested bit
for bit at DP 1, 2 and 3 with gradients whose sums are exact); a lossy channel adds the codec's error to
``g`` (megacomp.comm.collectives) before step 2.

Tensor parallelism (megacomp's TP layers, ``tp_group``): the global norm counts each sharded parameter's
squares summed over TP and each replicated one once; AdaLomo's row / column means, the mean of the row
statistics, RMS(u) and RMS(p) of a sharded parameter are taken over the whole parameter (small TP
all-reduces inside the hook), so the update does not depend on the TP size beyond fp32 summation order.

Precision: parameters may be fp32, bf16 or fp16; gradients travel in the parameter's dtype (as the reference's
ZeRO-3 path all-reduces ``p.grad``), every update is computed in fp32 and written back in the parameter's dtype
(no fp32 master: that is LOMO's memory saving). fp16 takes a ``loss_scaler`` (megacomp.optimizer.DynamicLossScaler):
both passes backpropagate ``loss * scale`` and the averaged gradient is divided by the scale before clipping.
The gradients are reduced at the loss scale, so error-feedback residuals are too: when the scale changes they are
multiplied by ``new / old`` (a power of two, exact), so a residual always meets gradients of its own scale.

Overflow and non-finite gradients: an update applied inside backward cannot be undone, so the check must come
before the first update. The norm pass (:meth:`grad_norm`) is that check: when its global norm is inf/NaN
(every DP and TP rank agrees: the norm is taken of DP-averaged gradients and its flag is reduced over TP), the
step is skipped, :meth:`fused_backward` returns False without running backward, ``skipped_steps`` counts it and
the loss scale backs off. With a loss scaler the norm pass is therefore required even without
``clip_grad_norm`` (the reference instead forces ``clip_grad_norm = 1.0`` for fp16; here clipping stays what
you asked for). Without a norm pass, a non-finite averaged gradient is noticed during the update pass, after
some parameters were updated: :meth:`fused_backward` finishes the pass on every rank (so the collectives stay
matched) and raises FloatingPointError naming the parameters; the model then holds non-finite values.

Compared with the reference (OpenLMLab/LOMO ``lomo_optim/lomo.py`` and ``adalomo.py`` at commit 45d4bac, their
non-ZeRO path; tests/test_optimizer_lomo.py restates its step in plain torch, hooks included, and checks the same
bits on a tiny MLP): the expressions above are the reference's, in its order and rounding (per-parameter norms,
then their norm; value clamp before norm clipping; AdaLomo's ``RMS = ||t|| / sqrt(n)`` and ``lr * max(eps2,
RMS(p))`` rounded in fp32), with its defaults (no weight decay, no norm clipping, eps, clip_threshold,
decay_rate). Options that reproduce the rest: ``loss_scaler=Lomo.reference_loss_scaler()`` with
``clip_grad_norm=1.0`` is LOMO's fp16 policy (from 2^32, halve on overflow, never grow: the reference never runs its
growth window; it also forces that clipping for fp16, here you pass it), ``AdaLomo.reference_loss_scaler()``
AdaLomo's static 2^10 (in fp32 / bf16 no scaler gives the same bits). What remains different, on purpose: an
overflow at scale 1 or on the first step (the reference raises: at its minimum scale, or for its unset clipping
coefficient) and an overflow under AdaLomo's static scale (the reference applies it) are skipped steps here; a
:meth:`fused_backward` without :meth:`grad_norm` is refused on every step (the reference reuses the previous
step's coefficient after the first); data parallelism sums in the gradient's dtype and divides by the world in
fp32 with every rank updating whole parameters (the reference's ZeRO-3 path averages with NCCL in the
gradient's dtype and updates its partition); AdaLomo factors a >2-D parameter over its last two dims (the
reference takes 1-D and 2-D); TP and compression are additions.

Failure behaviour: ValueError for a non-positive ``clip_grad_norm``, a sharded parameter without its
``tp_group``, or a sequence-parallel layer; RuntimeError when :meth:`fused_backward` is called with
``clip_grad_norm`` or a loss scaler set but without :meth:`grad_norm` first (the reference's rule);
FloatingPointError as above.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..comm import Channel, make_channel
from .loss_scaler import DynamicLossScaler


class Lomo:
    """LOMO (see the module docstring): SGD fused into backward.

    Args:
        model: the module whose trainable parameters are updated (hooks are registered on them).
        lr: learning rate (``fused_backward`` may override it per step).
        weight_decay: decoupled weight decay (``p *= 1 - lr * wd``).
        clip_grad_norm: clip by the global norm of the averaged gradients (two backward passes), or None.
        clip_grad_value: clamp each averaged gradient element to [-v, v], or None.
        dp_group: the data-parallel group (None: the default group; a one-rank group reduces nothing).
        tp_group: the tensor-parallel group of a model built from megacomp's TP layers (needed when their TP
            size is > 1: norms, RMS values and AdaLomo's factored statistics of sharded parameters are taken
            over the whole parameter). Sequence parallelism is not supported (its replicated gradients are
            partial sums until the trainer all-reduces them, after the hooks have run).
        channel: the ``dp_gradient`` channel (codec, error feedback, small-tensor rule); None: uncompressed.
        loss_scaler: dynamic loss scaling for fp16 parameters (see the module docstring), or None;
            :meth:`reference_loss_scaler` gives the reference's policy.
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, *, weight_decay: float = 0.0,
                 clip_grad_norm: Optional[float] = None, clip_grad_value: Optional[float] = None,
                 dp_group=None, tp_group=None, channel: Optional[Channel] = None,
                 loss_scaler: Optional[DynamicLossScaler] = None) -> None:
        if clip_grad_norm is not None and clip_grad_norm <= 0:
            raise ValueError(f"clip_grad_norm must be > 0 (or None for no norm clipping), got {clip_grad_norm}")
        self.model, self.lr, self.weight_decay = model, lr, weight_decay
        self.clip_grad_norm, self.clip_grad_value = clip_grad_norm, clip_grad_value
        self.dp_group = dp_group
        self.world = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.channel = channel if channel is not None else make_channel("dp_gradient", group=dp_group)
        # the norm pass: the same codec, no error feedback (the residuals advance once per step, in the update pass)
        self._norm_channel = self.channel.without_error_feedback()
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.sharded: dict[str, int] = {}  # name -> partition dim, for TP-sharded parameters
        self.full_numel: dict[str, int] = {}
        owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
        self.params: dict[str, nn.Parameter] = {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            owner = owners.get(id(p))
            if getattr(owner, "sp", False) or getattr(getattr(owner, "config", None), "sequence_parallel", False):
                raise ValueError(f"{type(self).__name__}: {name!r} is in a sequence-parallel layer; LOMO / AdaLomo "
                                 f"update inside backward, before sequence-parallel gradients are summed over TP; "
                                 f"turn sequence parallelism off")
            if getattr(p, "tensor_model_parallel", False) and getattr(owner, "tp_size", 1) > 1:
                if self.tp_size != owner.tp_size:
                    raise ValueError(f"{type(self).__name__}: {name!r} is sharded over {owner.tp_size} tensor-parallel "
                                     f"ranks; pass tp_group (its group), got a group of {self.tp_size}")
                self.sharded[name] = int(p.partition_dim)
            self.full_numel[name] = p.numel() * (self.tp_size if name in self.sharded else 1)
            self.params[name] = p
            p.register_post_accumulate_grad_hook(self._make_hook(name))
        self.names = {id(p): n for n, p in self.params.items()}
        self.scaler = loss_scaler
        self.step_num = 0
        self.skipped_steps = 0
        self.last_grad_norm: Optional[float] = None
        self.clip_coef: Optional[torch.Tensor] = None
        self._checked = False  # grad_norm ran for the coming fused_backward
        self._overflow = False  # ... and found an inf/NaN norm: that step is skipped
        self._bad: list[tuple[str, torch.Tensor]] = []  # update pass without a check: non-finite flags per parameter
        self._gather_norm = False
        self._norms: list[torch.Tensor] = []
        self._norms_sharded: list[torch.Tensor] = []
        self._pending: Optional[tuple] = None
        # one reduction buffer per gradient dtype, the size of the largest such parameter (see step 1)
        self._comm_bufs: dict[torch.dtype, torch.Tensor] = {}
        if self.world > 1:
            for p in self.params.values():
                b = self._comm_bufs.get(p.dtype)
                if b is None or b.numel() < p.numel():
                    self._comm_bufs[p.dtype] = torch.empty(p.numel(), dtype=p.dtype, device=p.device)

    @staticmethod
    def reference_loss_scaler(init_scale: float = 2.0 ** 32) -> DynamicLossScaler:
        """The reference's fp16 loss-scale policy (OpenLMLab/LOMO ``lomo_optim/lomo.py``): start at ``init_scale``
        (its default, 2^32; its experiments' ``lomo/src/lomo.py`` starts at 2^16), halve after an overflow (that step
        is skipped), never below 1, and never grow: the reference only ever calls its scaler on overflows, so its
        1000-step growth window never runs. With ``clip_grad_norm=1.0`` (which the reference forces for fp16) this
        reproduces the reference's fp16 LOMO (tests/test_optimizer_lomo.py restates it). Left: at scale 1 the
        reference raises on an overflow, here the step is skipped again."""
        return DynamicLossScaler(scale=init_scale, growth_factor=1.0, backoff_factor=0.5, min_scale=1.0)

    # -- the per-parameter hook --------------------------------------------------------------------
    def _make_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            self._on_grad(name, p)
        return hook

    def _on_grad(self, name: str, p: nn.Parameter) -> None:
        if p.grad is None:  # a hook fired without a gradient (nothing accumulated): nothing to reduce or apply
            return
        grad, p.grad = p.grad, None  # the gradient leaves the parameter now: autograd keeps no reference
        with torch.no_grad():
            if self.world == 1:
                self._flush()
                self._pending = (name, p, grad.contiguous(), None)
                return
            self._flush()  # the buffer's previous reduction: wait, apply
            buf = self._comm_bufs[grad.dtype][:grad.numel()].view(grad.shape)
            buf.copy_(grad)
            del grad  # freed here: only the persistent buffer takes part in the collective
            channel = self._norm_channel if self._gather_norm else self.channel
            handle = channel.all_reduce(buf, group=self.dp_group, async_op=True, key=name, tag="dp_gradient")
            self._pending = (name, p, buf, handle)

    def _flush(self) -> None:
        if self._pending is not None:
            previous, self._pending = self._pending, None
            self._finish(*previous)

    def _finish(self, name: str, p: nn.Parameter, buf: torch.Tensor, handle) -> None:
        with torch.no_grad():
            if handle is not None:
                handle.wait()
            g = buf.to(torch.float32)
            if self.world > 1:
                g.div_(self.world)  # SUM then divide: the same bits as the single-process mean of exact sums
            if self.scaler is not None:
                g.div_(self.scaler.scale)
            del buf
            if not self._gather_norm and not self._checked:  # no norm pass: flag it here (no host sync per tensor)
                self._bad.append((name, ~torch.isfinite(g).all()))
            if self._gather_norm:  # per-parameter norms, then the norm of those: the reference's expressions
                (self._norms_sharded if name in self.sharded else self._norms).append(torch.norm(g, 2.0))
                return
            if self.clip_grad_value is not None and self.clip_grad_value > 0:
                g.clamp_(min=-self.clip_grad_value, max=self.clip_grad_value)
            if self.clip_grad_norm is not None and self.clip_coef is not None:
                g.mul_(self.clip_coef)
            self._update(name, p, g)

    def _update(self, name: str, p: nn.Parameter, g: torch.Tensor) -> None:
        p32 = p.detach().to(torch.float32)
        if self.weight_decay:
            p32.mul_(1.0 - self.lr * self.weight_decay)
        p32.add_(g, alpha=-self.lr)
        p.detach().copy_(p32)

    def flush_before(self, module: nn.Module) -> None:
        """Finish the reduction in flight (wait, apply, free) right before ``module``'s backward runs.

        For a module whose backward allocates a second full contribution to a parameter of which autograd
        already holds one: a word embedding tied to the output layer (the output layer's [V, h] partial is kept
        until the lookup's backward, at the very end, produces its own). Without it that moment holds both
        partials plus the gradient in flight (the position table's); with it, the two partials only, which is
        the bound of one largest gradient plus one message. A GPT with ``tied_embedding_grad_in_place`` has no
        second partial (megacomp.training.features.lomo_fused.tie_for_fused_update sets both; benchmarks/results/memory). Registers a forward hook that puts a
        pre-hook on the module output's grad_fn in every forward with grad enabled."""
        def on_forward(mod, inputs, output) -> None:
            if torch.is_grad_enabled() and getattr(output, "grad_fn", None) is not None:
                output.grad_fn.register_prehook(lambda grad_outputs: self._flush())
        module.register_forward_hook(on_forward)

    # -- whole-parameter reductions of TP-sharded parameters -------------------------------------------
    def _tp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group (in place on a copy); the caller decides that the tensor is a partial."""
        t = t.clone()
        dist.all_reduce(t, group=self.tp_group)
        return t

    def _rms(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """RMS of the whole parameter ``name``: ``||t|| / sqrt(n)`` as the reference computes it, or, when sharded,
        the square root of its shards' squares summed over TP over n."""
        if name not in self.sharded:
            return torch.norm(t, 2.0) / math.sqrt(self.full_numel[name])
        return (self._tp_sum((t * t).sum()) / self.full_numel[name]).sqrt()

    # -- the passes --------------------------------------------------------------------------------
    @property
    def needs_norm_pass(self) -> bool:
        """Whether every step must call :meth:`grad_norm` before :meth:`fused_backward` (norm clipping, or the
        overflow check of loss scaling)."""
        return self.clip_grad_norm is not None or self.scaler is not None

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def grad_norm(self, loss: torch.Tensor) -> float:
        """First pass: backward (graph kept), the averaged gradients' global norm and, with ``clip_grad_norm``,
        ``clip_coef = min(1, clip_grad_norm / (norm + 1e-6))``; no parameter changes. Returns the norm; an
        inf/NaN norm (an overflow) marks the step to be skipped by :meth:`fused_backward` and is returned as is."""
        self._gather_norm, self._norms, self._norms_sharded = True, [], []
        try:
            self._scaled(loss).backward(retain_graph=True)
            self._flush()
        finally:
            self._gather_norm = False
        total = torch.norm(torch.stack(self._norms), 2.0) if self._norms else torch.zeros(())
        if self.tp_size > 1:  # sharded parameters' squares summed over TP, replicated ones counted once
            part = (torch.stack(self._norms_sharded) ** 2).sum() if self._norms_sharded else torch.zeros(())
            dist.all_reduce(part, group=self.tp_group)
            total = (total ** 2 + part).sqrt()
        self._norms, self._norms_sharded = [], []
        bad = (~torch.isfinite(total)).to(torch.float32).reshape(1)
        if self.tp_size > 1:  # replicated parameters' squares are local: every TP rank must reach the same verdict
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.tp_group)
        self._checked, self._overflow = True, bool(bad.item())
        self.last_grad_norm = total.item()
        self.clip_coef = None
        if not self._overflow and self.clip_grad_norm is not None:
            self.clip_coef = torch.clamp(float(self.clip_grad_norm) / (total + 1e-6), max=1.0)
        return total.item()

    def _update_scale(self, overflow: bool) -> None:
        """The loss scaler's rule after a step, and the error-feedback residuals follow a changed scale: gradients
        travel at the loss scale (in the parameter's dtype, where unscaling first could underflow), so each residual
        is kept at the scale of the step that left it and is multiplied by ``new / old`` when the scale changes
        (exact for the scaler's powers of two), so that it is added to the next scaled gradient in the same units."""
        before = self.scaler.scale
        self.scaler.update(overflow)
        ef = self.channel.error_feedback
        if ef is not None and self.scaler.scale != before:
            ef.rescale(self.scaler.scale / before)

    def fused_backward(self, loss: torch.Tensor, lr: Optional[float] = None) -> bool:
        """Backward with the fused update of every trainable parameter (its gradient freed on the way). Returns
        False, without running backward, when :meth:`grad_norm` found an overflow (the step is skipped and the
        loss scale backs off), else True.

        Raises:
            RuntimeError: ``clip_grad_norm`` or a loss scaler is set and :meth:`grad_norm` was not called for
                this loss.
            FloatingPointError: no norm pass ran and an averaged gradient was inf/NaN (see the module docstring)."""
        if self.needs_norm_pass and not self._checked:
            raise RuntimeError(f"{type(self).__name__}: {'clip_grad_norm' if self.clip_grad_norm else 'loss scaling'} "
                               f"is set, call grad_norm(loss) before fused_backward(loss) (the norm and the overflow "
                               f"check come first)")
        if lr is not None:
            self.lr = lr
        if self._overflow:
            self._checked = self._overflow = False
            self.skipped_steps += 1
            self.last_grad_norm = None
            if self.scaler is not None:
                self._update_scale(True)
            return False
        self.step_num += 1
        try:
            self._scaled(loss).backward()
            self._flush()
        finally:
            self.clip_coef, self._checked = None, False
            bad, self._bad = self._bad, []
        if self.scaler is not None:
            self._update_scale(False)
        if bad:
            flags = torch.stack([b for _, b in bad]).to(torch.float32)
            if self.tp_size > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.tp_group)
            names = [n for (n, _), f in zip(bad, flags.tolist()) if f]
            if names:
                raise FloatingPointError(
                    f"{type(self).__name__}: step {self.step_num}: the averaged gradient of {len(names)} parameter(s) "
                    f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) is inf/NaN and was applied (updates "
                    f"happen inside backward); resume from the last checkpoint with a lower learning rate, and set "
                    f"clip_grad_norm so the first pass catches it before any parameter changes")
        return True

    # -- checkpointing ------------------------------------------------------------------------------
    def reload_params(self, params, *, reset_state: bool = False) -> None:
        """These parameters were replaced in place by something other than this optimizer (LoQT's merge): LOMO updates
        the model's parameters themselves and keeps no per-parameter state, so there is nothing to reload or reset
        (AdaLomo zeroes their statistics with ``reset_state``)."""

    def init_state(self) -> None:
        """Create a zero error-feedback residual for every parameter the channel compresses (the same behaviour
        as none), so a fresh optimizer's :meth:`state_dict` has the keys of a trained one and can serve as the
        template of torch.distributed.checkpoint.load."""
        ef = self.channel.error_feedback
        if ef is None or self.world == 1:
            return
        rank = dist.get_rank(self.dp_group)
        for name, p in self.params.items():
            n = p.numel()
            if self.channel.codec_for(n).is_identity:
                continue
            ef.init_key(f"{name}/worker", (n,))
            if self.world > 2:
                ef.init_key(f"{name}/server", (comm.server_numel(n, self.world, rank, self.channel),))

    def state_dict(self) -> dict[str, Any]:
        """Step and skip counters, learning rate, loss scale and the DP channel (error feedback, stochastic
        stream)."""
        return {"step_num": self.step_num, "lr": self.lr, "skipped_steps": self.skipped_steps,
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "channel": self.channel.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (ValueError when the channel's codec differs, or when loss scaling was on
        when saved and is off now or the reverse)."""
        if (state.get("loss_scaler") is None) != (self.scaler is None):
            raise ValueError(f"{type(self).__name__}: the checkpoint was saved {'with' if self.scaler is None else 'without'}"
                             f" loss scaling and this optimizer has {'none' if self.scaler is None else 'one'}; resume "
                             f"with the same parameter dtype")
        self.step_num, self.lr = int(state["step_num"]), float(state["lr"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        self.channel.load_state_dict(state["channel"])


class AdaLomo(Lomo):
    """AdaLomo (see the module docstring): LOMO with a factored second moment and grouped update normalisation.

    Args:
        eps: (eps1 added to g^2, eps2 the floor of RMS(p) in the relative step), as the reference (1e-30, 1e-3).
        clip_threshold: the RMS an update is normalised down to (1.0).
        decay_rate: ``beta2_t = 1 - t^decay_rate`` (-0.8).

    Other arguments as :class:`Lomo`.
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, *, eps=(1e-30, 1e-3), clip_threshold: float = 1.0,
                 decay_rate: float = -0.8, **kwargs) -> None:
        super().__init__(model, lr, **kwargs)
        self.eps, self.clip_threshold, self.decay_rate = tuple(eps), clip_threshold, decay_rate
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self.params.items():
            if p.dim() > 1:
                self.state[name] = {"row": torch.zeros(p.shape[:-1], dtype=torch.float32, device=p.device),
                                    "col": torch.zeros(p.shape[:-2] + p.shape[-1:], dtype=torch.float32,
                                                       device=p.device)}
            else:
                self.state[name] = {"v": torch.zeros(p.shape, dtype=torch.float32, device=p.device)}

    @staticmethod
    def reference_loss_scaler(init_scale: float = 2.0 ** 10) -> DynamicLossScaler:
        """The reference's loss scale (OpenLMLab/LOMO ``lomo_optim/adalomo.py``, ``loss_scale=2**10``): static,
        for every dtype, without an overflow check. Here: the same static scale (no growth, no back-off); an overflow
        step is skipped (the reference would apply it and leave non-finite parameters). In fp32 and bf16 a power-of-two
        scale changes no bit of the update (barring underflow), so the reference equals no scaler there."""
        return DynamicLossScaler(scale=init_scale, growth_factor=1.0, backoff_factor=1.0)

    def reload_params(self, params, *, reset_state: bool = False) -> None:
        """These parameters were replaced in place (LoQT's merge): the model holds them, so nothing to reload; with
        ``reset_state`` their second-moment statistics are zeroed (parameters it does not manage are ignored)."""
        if not reset_state:
            return
        for p in params:
            for v in self.state.get(self.names.get(id(p)), {}).values():
                v.zero_()

    def _mean(self, name: str, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Mean of ``t`` over ``dim`` of the whole parameter: a TP sum of the partial sums when ``dim`` is the
        partition dim (rows of a column-parallel weight, columns of a row-parallel one), else local."""
        if self.sharded.get(name) == dim % t.dim():
            return self._tp_sum(t.sum(dim=dim)) / (t.shape[dim] * self.tp_size)
        return t.mean(dim=dim)

    def _update(self, name: str, p: nn.Parameter, g: torch.Tensor) -> None:
        st = self.state[name]
        beta2t = 1.0 - math.pow(self.step_num, self.decay_rate)
        sq = g ** 2 + self.eps[0]
        if p.dim() > 1:
            st["row"].mul_(beta2t).add_(self._mean(name, sq, -1), alpha=1.0 - beta2t)
            st["col"].mul_(beta2t).add_(self._mean(name, sq, -2), alpha=1.0 - beta2t)
            row = st["row"]  # its mean is over every rank's rows when the rows are sharded
            r = (row / self._mean(name, row, -1).unsqueeze(-1)).rsqrt().unsqueeze(-1)
            update = (r * st["col"].unsqueeze(-2).rsqrt()).mul_(g)
        else:
            st["v"].mul_(beta2t).add_(sq, alpha=1.0 - beta2t)
            update = st["v"].rsqrt().mul_(g)
        update.div_((self._rms(name, update) / self.clip_threshold).clamp(min=1.0))
        p32 = p.detach().to(torch.float32)
        # the reference's expression: a 0-dim fp32 tensor when RMS(p) > eps2 (so lr * RMS(p) is rounded in fp32)
        lr = self.lr * max(self.eps[1], self._rms(name, p32))
        if self.weight_decay:
            p32.mul_(1.0 - lr * self.weight_decay)
        p32.add_(update, alpha=-lr)
        p.detach().copy_(p32)

    def state_dict(self) -> dict[str, Any]:
        """:meth:`Lomo.state_dict` plus the second-moment statistics per parameter name."""
        return {**super().state_dict(), "moments": {n: {k: v.clone() for k, v in s.items()} for n, s in self.state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. ValueError when the parameters or their shapes differ."""
        if set(state["moments"]) != set(self.state):
            raise ValueError(f"AdaLomo: saved for parameters {sorted(state['moments'])}, this model has "
                             f"{sorted(self.state)}")
        for n, s in state["moments"].items():
            for k, v in s.items():
                if v.shape != self.state[n][k].shape:
                    raise ValueError(f"AdaLomo: {n}.{k} saved with shape {tuple(v.shape)}, now "
                                     f"{tuple(self.state[n][k].shape)}")
                self.state[n][k].copy_(v)
        super().load_state_dict(state)
