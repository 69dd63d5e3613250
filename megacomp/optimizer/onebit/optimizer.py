"""1-bit Adam, 0/1 Adam and 1-bit LAMB on the (optionally sharded) data-parallel optimizer.

:class:`OneBitOptimizer` is a :class:`megacomp.optimizer.DistributedOptimizer` (buckets, fp32 masters, loss
scaling, overflow skipping, checkpoints) whose data-parallel exchange follows a schedule
(megacomp.optimizer.onebit.schedule) and whose inner optimizer is one of megacomp.optimizer.onebit.rules.
Per step ``t``, by action:

  ``grad`` (warm-up; 0/1 Adam's variance updates): the full-precision gradient reduction of the base class
      (reduce-scatter when sharded, all-reduce when not), started in backward; clipping by the global norm.
  ``grad_1bit`` (0/1 Adam): each rank's local gradient all-reduced through the momentum channel (1-bit, worker
      and server error feedback), started in backward, or in ``step()`` after clipping the local gradient
      (``max_grad_norm``) or with ``momentum_scaling="deepspeed"``.
  ``momentum`` (1-bit Adam / LAMB after ``freeze_step``): every rank forms its local momentum
      ``x = b1 M + (1-b1) g_local`` from the last exchanged momentum ``M`` (identical on every rank; LAMB scales
      each parameter's slice by its momentum scale first), all-reduces ``x`` through the momentum channel
      (compressed buckets) or in fp32 (the rest), and the rule updates its masters with the average ``M``.
      ``x`` of a bucket needs only that bucket's gradient and ``M``, so with ``overlap_momentum`` (the default)
      it is formed and its all-reduce started in backward, as soon as the bucket's gradients are complete, and
      the transfer overlaps the rest of backward, as the warm-up's gradient reduction does. The arithmetic is
      the same as in ``step()`` (a test compares the two bit for bit); ``step()`` forms and exchanges instead
      when the local gradient must be clipped first (``max_grad_norm``), at 1-bit LAMB's first compressed step
      (its momentum scales are fixed then) and, sharded, at the first compressed step after the switch or a
      resume (the full momentum is all-gathered in ``step()``).
  ``local`` (0/1 Adam after ``var_freeze_step``): no exchange; at the schedule's synchronisation steps the
      accumulated update goes through the momentum channel (:class:`~.rules.ZeroOneAdamRule`).

Sharded (``shard=True``): masters, variance and LAMB's fresh variance are this rank's shard; the full
exchanged momentum ``M`` is kept on every rank (it is the next step's starting point; built at the switch by
one fp32 all-gather of the warm-up momentum shards, and again after loading a checkpoint, as it equals the
all-gather of the saved momentum shards) and the updated shard is all-gathered into the parameters with the
parameter codec. Bytes per compressed step, n elements, N ranks, 1-bit codec with one scale per chunk:
about ``2 n (N-1)/N / 8`` for the momentum all-reduce (N = 2: each rank sends n/8) plus the parameter
all-gather, ``n (N-1)/N`` times its element size (4 in fp32, 1 with int8 blocks): unsharded (``shard=False``)
has no all-gather and so the largest saving (about 32x over an fp32 all-reduce); it is the default, as in
DeepSpeed (measured on the tiny GPT at DP 2: 0.09 MB per compressed step unsharded, 1.17 MB sharded with an fp32
gather, 0.38 MB with an int8 gather), at the memory cost of whole fp32 masters and state on every rank. 0/1 Adam
needs ``shard=False``: its local steps update every parameter on every rank.

Gradient clipping (``max_grad_norm``): in ``grad`` steps by the norm of the averaged gradient (over the data-
and model-parallel groups); in ``grad_1bit``, ``momentum`` and ``local`` steps each rank clips its own local
gradient by its norm over the model-parallel group before it is sent or enters the momentum, as DeepSpeed does
(its engine skips the gradient all-reduce on those steps; ``last_grad_norm`` is then this rank's). Overflow
(inf/NaN in any rank's gradient) is detected by an all-reduce of one flag over both groups on every step and
skips the step on every rank; the momentum errors are kept (DeepSpeed checks before it exchanges), unless the
step's exchange already ran in backward: they then absorbed the inf/NaN and are zeroed.

Every DP size, two ranks included, runs the two-phase compressed all-reduce (worker error, then the chunk owner's
re-quantization with its server error: ``CommOptions.two_rank_server``, set on the momentum channel), as
DeepSpeed's ``compressed_allreduce``. ``momentum_scaling="deepspeed"`` runs that function exactly
(megacomp.optimizer.onebit.deepspeed_exchange: RMS scales per param group, or the whole model for LAMB, instead
of the codec's scale per bucket x segment x chunk).

The momentum channel is built from ``momentum_codec`` / ``momentum_error_feedback`` (classic error feedback on the
worker and the server side), or handed in whole as ``momentum_channel`` (megacomp.comm.make_channel; e.g. the
``dp_momentum`` path of a CommCompressionConfig, whose unset values
megacomp.optimizer.onebit.momentum_path.resolve_momentum_setting resolves).

Traffic: the momentum channel's messages are counted under ``dp_momentum`` (0/1 Adam's 1-bit gradients under
``dp_gradient_1bit``), full-precision gradients under ``reduce_scatter``/``all_reduce``; ``rounds`` counts the
steps that sent a model-sized message (checkpointed).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from ... import comm
from ...comm import AnyChannel
from ..distributed_optimizer import DistributedOptimizer
from ..params import param_groups_of
from .deepspeed_exchange import ReferenceAllReduce
from .momentum_path import (DEFAULT_MOMENTUM_CODEC, MOMENTUM_SCALINGS, WARMUP_GRAD_CODECS, build_momentum_channel,
                            check_momentum_channel)
from .rules import OneBitAdamRule, OneBitLambRule, ZeroOneAdamRule
from .schedule import FreezeSchedule, ZeroOneSchedule


class OneBitOptimizer(DistributedOptimizer):
    """A DistributedOptimizer driven by a 1-bit schedule (module docstring). Build it through
    :func:`OneBitAdam`, :func:`ZeroOneAdam` or :func:`OneBitLamb`.

    Raises:
        ValueError: 0/1 Adam with ``shard=True``; ``zero_stage=2``; bad codecs (see :func:`build_momentum_channel`,
            :func:`check_momentum_channel`); ``momentum_channel`` together with ``momentum_codec`` or
            ``momentum_error_feedback``; a gradient codec other than :data:`WARMUP_GRAD_CODECS` for the
            full-precision phase; ``momentum_scaling`` not in :data:`MOMENTUM_SCALINGS`, or ``deepspeed`` with
            ``shard=True``, a momentum channel or a momentum codec other than the default; the base class's.
    """

    def __init__(self, params: Iterable, rule_class, rule_kwargs: dict, schedule, process_group=None, *,
                 momentum_codec: Any = DEFAULT_MOMENTUM_CODEC, momentum_error_feedback: bool = True,
                 momentum_channel: Optional[AnyChannel] = None, shard: bool = False, min_compress_numel: int = 65536,
                 grad_norm_weight=None, overlap_momentum: bool = True, momentum_scaling: str = "chunk",
                 **base: Any) -> None:
        if base.get("zero_stage", 1) != 1:
            raise ValueError(f"{rule_class.__name__.replace('Rule', '')} exchanges each rank's whole local gradient or "
                             f"momentum in step(), so its gradient buckets cannot be sharded in backward: use "
                             f"zero_stage=1 (pretraining: --zero-stage 1)")
        if rule_class is ZeroOneAdamRule and shard:
            raise ValueError("0/1 Adam takes local steps that update every parameter on every rank, so its masters "
                             "cannot be sharded; pass shard=False (pretraining: --no-shard-optimizer)")
        what = rule_class.__name__.replace("Rule", "")
        if momentum_scaling not in MOMENTUM_SCALINGS:
            raise ValueError(f"{what}: momentum_scaling must be one of {', '.join(MOMENTUM_SCALINGS)}, got "
                             f"{momentum_scaling!r}")
        if momentum_scaling == "deepspeed" and (shard or momentum_channel is not None or not momentum_error_feedback
                                                or momentum_codec is not DEFAULT_MOMENTUM_CODEC):
            raise ValueError(f"{what}: momentum_scaling='deepspeed' is DeepSpeed's unsharded 1-bit exchange with worker "
                             f"and server error feedback; drop shard=True, momentum_channel, momentum_codec and "
                             f"momentum_error_feedback=False (or use momentum_scaling='chunk')")
        # the param groups twice (here for the reference layout, in the base class for the buckets)
        params = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in params]
        self.momentum_scaling = momentum_scaling
        self.schedule, self.rounds, self._full_m = schedule, 0, {}
        self.overlap_momentum = bool(overlap_momentum)
        self._local_finite: dict[int, torch.Tensor] = {}  # per bucket launched in backward: its local grad finite
        if momentum_channel is None:
            momentum_channel = build_momentum_channel(momentum_codec, momentum_error_feedback, process_group,
                                                      min_compress_numel, what)
        elif momentum_codec is not DEFAULT_MOMENTUM_CODEC or momentum_error_feedback is not True:
            raise ValueError(f"{what}: pass either momentum_channel or momentum_codec/momentum_error_feedback, not both")
        self.momentum_channel = check_momentum_channel(momentum_channel, what)
        self._momentum_plain = self.momentum_channel.uncompressed()
        self._rule_class, self._rule_kwargs = rule_class, rule_kwargs
        super().__init__(params, self._make_rule, process_group, shard=shard, min_compress_numel=min_compress_numel,
                         grad_norm_weight=grad_norm_weight, **base)
        ch = self.grad_channel
        if ch.lossy and ch.codec.name not in WARMUP_GRAD_CODECS:
            raise ValueError(f"{rule_class.__name__.replace('Rule', '')}: gradient codec {getattr(ch, 'codec', ch)} in "
                             f"the full-precision phase (warm-up, variance updates) rounds small gradient entries to "
                             f"0, so the variance frozen afterwards is 0 there and the update divides by eps (1-bit "
                             f"Adam with int4 + LoCo diverged to a loss of 1e13 in 20 steps); use grad_codec None or "
                             f"one of {', '.join(WARMUP_GRAD_CODECS)}")
        self._local_weights = self._build_norm_weights(grad_norm_weight, whole=True)  # local-gradient clipping
        self._master = {b.index: m for b, m in zip(self.buckets, self.masters)}
        self._reference = None
        if momentum_scaling == "deepspeed":
            where = {id(p): (b.index, o) for b in self.buckets for p, o in zip(b.params, b.offsets)}
            layouts = [[(*where[id(p)], p.numel()) for p in g["params"]] for g in param_groups_of(params)]
            if rule_class is OneBitLambRule:  # DeepSpeed's 1-bit LAMB: the whole model's momentum in one buffer
                layouts = [[piece for lay in layouts for piece in lay]]
            self._reference = ReferenceAllReduce(layouts, self.group, self.device, self.momentum_channel.stats)

    def _more_channels(self) -> tuple:
        return (self.momentum_channel,)

    @property
    def deepspeed_buffer_numels(self) -> Optional[list[int]]:
        """With ``momentum_scaling="deepspeed"``: the padded element count of each flat buffer DeepSpeed's exchange
        sends (one per parameter group; 1-bit LAMB: one), else None."""
        return None if self._reference is None else list(self._reference.padded)

    # -- construction -------------------------------------------------------------------------------
    def _ordered_buckets(self):
        """Buckets in the order of the rule's masters (param group by param group)."""
        return [b for gi in range(1 + max(b.group for b in self.buckets)) for b in self.buckets if b.group == gi]

    def _make_rule(self, inner_groups, **kw):
        # LAMB's per-parameter vectors: the index of each bucket's first parameter, in the rule's master order
        self._first_param, j = {}, 0
        for b in self._ordered_buckets():
            self._first_param[b.index], j = j, j + len(b.params)
        if self._rule_class is OneBitLambRule:
            segments = []
            for b in self._ordered_buckets():
                start, end = b.shard_range(self.shard_index, self.parts)
                seg = [(self._first_param[b.index] + i, max(o, start) - start, min(o + p.numel(), end) - start)
                       for i, (p, o) in enumerate(zip(b.params, b.offsets))]
                segments.append([s for s in seg if s[2] > s[1]])
            kw.update(segments=segments, num_params=j, norm_group=self.group, reduce_norms=self.sharded and self.world > 1)
        return self._rule_class(inner_groups, **{**self._rule_kwargs, **kw})

    # -- the schedule -------------------------------------------------------------------------------
    def _action(self) -> str:
        return self.schedule.action(self.step_count + 1)

    def _launch(self, b) -> None:
        action = self._action()
        if action == "grad":
            return super()._launch(b)
        if action == "grad_1bit" and self._grad_1bit_in_backward():  # 0/1 Adam: the 1-bit average gradient
            self._local_finite[b.index] = torch.isfinite(b.grad).all()
            b.reduced = b.grad
            b.work = self._momentum_all_reduce(b, b.grad, tag="dp_gradient_1bit", async_op=True)
            return None
        if action == "momentum" and self._momentum_in_backward():
            # read before the gradient becomes the momentum; a 0-dim tensor, so no device sync in backward
            self._local_finite[b.index] = torch.isfinite(b.grad).all()
            x, _ = self._form_momentum(b)
            b.reduced = x  # marks the bucket as exchanged in backward
            b.work = self._momentum_all_reduce(b, x, async_op=True)
            return None
        b.work, b.reduced = comm.CompressedWork(lambda: None), None  # momentum / grad_1bit / local: in step()
        return None

    def _grad_1bit_in_backward(self) -> bool:
        """Whether 0/1 Adam's 1-bit gradient exchange starts in backward: not when each rank's local gradient is
        clipped first (DeepSpeed clips the local gradient: its backward all-reduce is off on these steps) or with
        DeepSpeed's scaling (one buffer per param group)."""
        return self.max_grad_norm is None and self._reference is None

    def _momentum_all_reduce(self, b, x: torch.Tensor, tag: str = "dp_momentum", async_op: bool = False):
        """Sum ``x`` (bucket ``b``'s message) over the group through the momentum channel (compressed buckets) or
        in fp32; with ``async_op`` returns a work handle (never None)."""
        ch = self.momentum_channel if b.compressed else self._momentum_plain
        work = ch.all_reduce(x, group=self.group, async_op=async_op, key=f"dp_momentum/b{b.index}", tag=tag,
                             validate=not self._validated)
        return (work or comm.CompressedWork(lambda: None)) if async_op else None

    def _momentum_in_backward(self) -> bool:
        """Whether this step's momentum exchange starts in backward (the same answer for every bucket of a step
        and on every rank: it reads settings and state that only ``step()`` changes)."""
        if not self.overlap_momentum or self.max_grad_norm is not None or self._reference is not None:
            return False  # clipping needs the whole local gradient's norm first; DeepSpeed's buffers span buckets
        if self.sharded and len(self._full_m) < len(self.buckets):
            return False  # the full momentum is all-gathered in step() first (the switch, a resume)
        if isinstance(self.optimizer, OneBitLambRule):
            scaled = self.optimizer.state[self.masters[0]].get("scaled")
            return scaled is not None and bool(float(scaled))  # the scales are fixed at the first compressed step
        return True

    def step(self, closure=None) -> bool:
        """One step of the schedule's action (module docstring). Returns False when the step was skipped."""
        t = self.step_count + 1
        action = self.schedule.action(t)
        self.optimizer.action = action
        if action == "grad":
            stepped = super().step(closure)
        else:
            stepped = self._deferred_step(action, t)
        if stepped:
            self.rounds += int(self.schedule.communicates(t))
            self.schedule.advance(t)
        return stepped

    def _skip_step(self) -> bool:
        """The base class's skip. The momentum errors are kept, as DeepSpeed keeps them (its overflow check comes
        before the exchange), unless this step's exchange already ran in backward: its errors then hold the
        non-finite values and are zeroed."""
        if (self._action() in ("momentum", "grad_1bit") and any(b.reduced is not None for b in self.buckets)
                and self.momentum_channel.error_feedback is not None):
            self.momentum_channel.error_feedback.reset()
        return super()._skip_step()

    def _deferred_step(self, action: str, t: int) -> bool:
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
            b.work.wait()
            b.work = None
        in_backward = action in ("momentum", "grad_1bit") and all(b.reduced is not None for b in self.buckets)
        if in_backward:  # the buckets now hold the exchanged momentum: the local gradients' flags were kept
            bad = any(not bool(f) for f in self._local_finite.values())
        else:
            bad = any(not bool(torch.isfinite(b.grad).all()) for b in self.buckets)
        self._local_finite.clear()
        overflow = self._all_reduce_max(float(bad))
        if overflow:
            return self._skip_step()
        if self.max_grad_norm is not None:
            self._clip_local()
        if action == "momentum":
            self._exchange_momentum(in_backward)
        elif action == "grad_1bit":
            self._exchange_grad(in_backward)
        else:
            self._local(t)
        return self._finish_step()

    def _average(self, xs: dict, tag: str) -> None:
        """Average every bucket's ``xs[b.index]`` over the group in place: DeepSpeed's exchange, or the momentum
        channel bucket by bucket; the padding zeroed."""
        if self._reference is not None:
            self._reference.average(xs, tag)
        for b in self.buckets:
            x = xs[b.index]
            if self._reference is None:
                self._momentum_all_reduce(b, x, tag=tag)
                x.mul_(1.0 / self.world)
            x[b.numel:].zero_()  # padding carries nothing (a sign codec decodes 0 as +scale)

    def _exchange_grad(self, in_backward: bool) -> None:
        """0/1 Adam's 1-bit step: average the (clipped) local gradients, or take what backward averaged."""
        if in_backward:
            for b in self.buckets:
                b.grad.mul_(1.0 / self.world)[b.numel:].zero_()
        else:
            self._average({b.index: b.grad for b in self.buckets}, "dp_gradient_1bit")
        for b in self.buckets:
            self._master[b.index].grad = b.grad
        self.optimizer.step()

    def _clip_local(self) -> None:
        """Clip this rank's local gradient by its norm over the model-parallel group (no DP reduction)."""
        sq = torch.stack([(b.grad.double().square() * w if w is not None else b.grad.double().square()).sum()
                          for b, w in zip(self.buckets, self._local_weights)]).sum().reshape(1)
        if self.grad_norm_group is not None:
            dist.all_reduce(sq, group=self.grad_norm_group)
        self.last_grad_norm = sq.sqrt().item()
        coef = self.max_grad_norm / (self.last_grad_norm + 1e-6)
        if coef < 1.0:
            for b in self.buckets:
                b.grad.mul_(coef)

    def _full_momentum(self, b) -> torch.Tensor:
        """The last exchanged momentum of bucket ``b`` (unscaled), whole, identical on every rank."""
        m = self.optimizer.state[self._master[b.index]]["exp_avg"]
        if not self.sharded:
            return m
        if b.index not in self._full_m:  # the switch (or a resume): all-gather the momentum shards once, fp32
            full = torch.empty(b.padded, dtype=torch.float32, device=m.device)
            self._momentum_plain.all_gather_into_tensor(full, m.contiguous(), group=self.group,
                                                        tag="dp_momentum_gather")
            self._full_m[b.index] = full
        return self._full_m[b.index]

    def _scales(self, b) -> Optional[list]:
        """1-bit LAMB: each parameter's momentum scale, fixed at the first compressed step."""
        if not isinstance(self.optimizer, OneBitLambRule):
            return None
        first = self.optimizer.state[self.masters[0]]
        if not float(first["scaled"]):
            scales = self.optimizer.momentum_scales()
            for m in self.masters:
                self.optimizer.state[m]["scaling_coeff"].copy_(scales)
                self.optimizer.state[m]["scaled"].fill_(1.0)
        j0 = self._first_param[b.index]
        return first["scaling_coeff"][j0:j0 + len(b.params)].tolist()

    def _form_momentum(self, b):
        """This rank's ``b1 M + (1-b1) g_local`` of bucket ``b``, in place of its gradient (LAMB: scaled per
        parameter); returns it and LAMB's scales (None for Adam)."""
        beta1 = self.optimizer.param_groups[b.group]["betas"][0]
        x, m_prev, scales = b.grad, self._full_momentum(b), self._scales(b)
        x.mul_(1 - beta1).add_(m_prev, alpha=beta1)
        if scales is not None:
            for (p, o), s in zip(zip(b.params, b.offsets), scales):
                x[o:o + p.numel()].mul_(s)
        return x, scales

    def _exchange_momentum(self, in_backward: bool = False) -> None:
        """Average every bucket's local momentum (exchanged here, or already in backward) and update."""
        formed = {b.index: (b.reduced, self._scales(b)) if in_backward else self._form_momentum(b)
                  for b in self.buckets}
        if in_backward:
            for b in self.buckets:
                b.reduced.mul_(1.0 / self.world)[b.numel:].zero_()  # padding carries nothing
        else:
            self._average({i: x for i, (x, _) in formed.items()}, "dp_momentum")
        for b in self.buckets:
            x, scales = formed[b.index]
            if scales is not None:
                for (p, o), s in zip(zip(b.params, b.offsets), scales):
                    x[o:o + p.numel()].div_(s)
            self._master[b.index].grad = x[slice(*b.shard_range(self.shard_index, self.parts))]
        self.optimizer.step()
        if self.sharded:
            for b in self.buckets:
                self._full_m[b.index].copy_(b.grad)

    def _local(self, t: int) -> None:
        """0/1 Adam after the variance freeze: a local step, and a synchronisation when the schedule says."""
        if t == self.schedule.var_freeze_step + 1:  # the 1-bit gradients' residuals do not carry over (DeepSpeed)
            if self.momentum_channel.error_feedback is not None:
                self.momentum_channel.error_feedback.reset()
            if self._reference is not None:
                self._reference.reset()
        for b in self.buckets:
            self._master[b.index].grad = b.grad
        self.optimizer.step()
        if not self.schedule.syncs(t):
            return
        ws = {b.index: self.optimizer.sync_buffer(self._master[b.index]) for b in self.buckets}
        self._average(ws, "dp_momentum")
        for b in self.buckets:
            self.optimizer.finish_sync(self._master[b.index], ws[b.index])

    # -- checkpointing ------------------------------------------------------------------------------
    def init_state(self) -> None:
        """Every rule state and error-feedback key, zero (the template of torch.distributed.checkpoint.load)."""
        self.optimizer.init_state()
        self._init_momentum_keys()

    def _init_momentum_keys(self) -> None:
        ef = self.momentum_channel.error_feedback
        if ef is None:
            return
        for b in self.buckets:
            if b.compressed:
                ef.init_key(f"dp_momentum/b{b.index}/worker", (b.padded,))
                options = getattr(self.momentum_channel, "options", None)
                if self.world > 2 or self.world == 2 and options is not None and options.two_rank_server:
                    ef.init_key(f"dp_momentum/b{b.index}/server",
                                (comm.server_numel(b.padded, self.world, self.rank, self.momentum_channel),))

    def state_dict(self) -> dict[str, Any]:
        """The base class's shard plus the schedule position, the rounds and the momentum channel (errors)."""
        self._init_momentum_keys()
        out = super().state_dict()
        out[f"dp_rank_{self.rank}"]["onebit"] = {
            "schedule": self.schedule.state_dict(), "rounds": self.rounds,
            "momentum_channel": self.momentum_channel.state_dict()}
        if self._reference is not None:
            out[f"dp_rank_{self.rank}"]["onebit"]["deepspeed_errors"] = self._reference.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises ValueError for a checkpoint of another optimizer or schedule."""
        s = state.get(f"dp_rank_{self.rank}", {})
        if "onebit" not in s:
            raise ValueError(f"optimizer checkpoint has no 1-bit optimizer state (saved by {s.get('rule', 'another')} "
                             f"optimizer); resume with the optimizer that wrote it")
        super().load_state_dict(state)
        o = s["onebit"]
        self.schedule.load_state_dict(o["schedule"])
        self.rounds = int(o["rounds"])
        self.momentum_channel.load_state_dict(o["momentum_channel"])
        if self._reference is not None:
            if "deepspeed_errors" not in o:
                raise ValueError("optimizer checkpoint was written with momentum_scaling='chunk'; resume with it")
            self._reference.load_state_dict(o["deepspeed_errors"])
        self._full_m = {}  # rebuilt from the loaded momentum shards at the next compressed step


def OneBitAdam(params, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True, betas=(0.9, 0.999),
               eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float = 0.0, *, process_group=None,
               momentum_codec: Any = DEFAULT_MOMENTUM_CODEC, momentum_error_feedback: bool = True,
               momentum_channel: Optional[AnyChannel] = None, shard: bool = False, **kwargs: Any) -> OneBitOptimizer:
    """1-bit Adam with DeepSpeed's hyperparameter names and defaults (``max_grad_norm=0``: no clipping).
    ``momentum_channel``: a ready ``dp_momentum`` channel instead of ``momentum_codec`` / ``momentum_error_feedback``.
    Further keyword arguments go to :class:`OneBitOptimizer` / DistributedOptimizer (param_codec, loss_scaler,
    grad_norm_group, bucket_size, ...). Raises ValueError for ``freeze_step < 1`` and bad hyperparameters."""
    from .rules import _check_freeze
    _check_freeze(freeze_step)
    return OneBitOptimizer(params, OneBitAdamRule, dict(freeze_step=freeze_step, bias_correction=bias_correction),
                           FreezeSchedule(freeze_step), process_group, momentum_codec=momentum_codec,
                           momentum_error_feedback=momentum_error_feedback, momentum_channel=momentum_channel,
                           shard=shard,
                           max_grad_norm=max_grad_norm or None, lr=lr, betas=tuple(betas), eps=eps,
                           weight_decay=weight_decay, **kwargs)


def ZeroOneAdam(params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 0.0, max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
                var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16, *,
                process_group=None, momentum_codec: Any = DEFAULT_MOMENTUM_CODEC, momentum_error_feedback: bool = True,
                momentum_channel: Optional[AnyChannel] = None, shard: bool = False, **kwargs: Any) -> OneBitOptimizer:
    """0/1 Adam with DeepSpeed's names and defaults; unsharded (``shard=True`` raises ValueError).
    ``momentum_channel``: as :func:`OneBitAdam`."""
    return OneBitOptimizer(params, ZeroOneAdamRule, dict(bias_correction=bias_correction),
                           ZeroOneSchedule(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper),
                           process_group, momentum_codec=momentum_codec, momentum_error_feedback=momentum_error_feedback,
                           momentum_channel=momentum_channel, shard=shard, max_grad_norm=max_grad_norm or None, lr=lr,
                           betas=tuple(betas), eps=eps, weight_decay=weight_decay, **kwargs)


def OneBitLamb(params, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True, betas=(0.9, 0.999),
               eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
               min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
               factor_threshold: float = 0.1, *, process_group=None, momentum_codec: Any = DEFAULT_MOMENTUM_CODEC,
               momentum_error_feedback: bool = True, momentum_channel: Optional[AnyChannel] = None, shard: bool = False,
               **kwargs: Any) -> OneBitOptimizer:
    """1-bit LAMB with DeepSpeed's names and defaults. Per-layer norms are over each rank's local slice of a
    tensor-parallel parameter (its own layer, as Megatron's per-rank optimizer sees it). ``momentum_channel``: as
    :func:`OneBitAdam`."""
    from .rules import _check_freeze
    _check_freeze(freeze_step)
    rule = dict(freeze_step=freeze_step, bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff,
                coeff_beta=coeff_beta, factor_max=factor_max, factor_min=factor_min, factor_threshold=factor_threshold)
    return OneBitOptimizer(params, OneBitLambRule, rule, FreezeSchedule(freeze_step), process_group,
                           momentum_codec=momentum_codec, momentum_error_feedback=momentum_error_feedback,
                           momentum_channel=momentum_channel, shard=shard, max_grad_norm=max_grad_norm or None, lr=lr,
                           betas=tuple(betas), eps=eps, weight_decay=weight_decay, **kwargs)
