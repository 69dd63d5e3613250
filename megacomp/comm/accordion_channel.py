"""An Accordion traffic path: two channels of one path (light and strong compression) and the policy that
picks one per tensor and interval (the rule is in megacomp.compression.accordion).

:class:`AccordionChannel` holds a ``low`` and a ``high`` channel (``Channel`` for codecs, ``LowRankChannel``
for PowerSGD ranks) that share one error-feedback state, so a tensor's residual carries over a switch. With
PowerSGD levels the level a tensor enters redraws its start Q (a fresh power iteration, as the reference's new
reducer), or with ``keep_q`` resumes the Q it left. Its owner

  1. asks :meth:`channel_for` (key) which channel reduces a tensor this step;
  2. reports the reduced gradient with :meth:`observe` (key, tensor, replicated): the whole tensor on every
     rank (a DDP bucket: ``replicated=True``) or this rank's shard of it (the sharded optimizer), and this
     rank's own gradient before the reduction with :meth:`observe_local`; the channel sums the one its
     ``norm_of`` names (``local``: only rank 0's enters the decision) and not in steps outside a window;
  3. calls :meth:`end_step` once per step it took (skipped steps call :meth:`discard_step` first: their
     inf/NaN gradients must not enter the norms), on every rank of the group. At each window's end it
     all-reduces the accumulated squared norms (one fp64 vector, shards summed, replicated tensors counted
     once), so every rank takes the same decision, and logs every switch;
  4. with ``lr_trigger``, gives the learning rate with :meth:`follow_lr` (a callable read when a step asks for
     its channels: the sharded optimizer passes its own). The rate is the same on every rank, so the trigger
     needs no collective: the first :meth:`channel_for` after each window's end compares it with the rate of
     the window's last step.

Bytes are counted by the level channels under the path's name, as if there were one channel.

Failure behaviour: settings are checked by Accordion; a key observed with two different lengths raises
ValueError; loading a state saved with other settings raises ValueError; ``lr_trigger`` without
:meth:`follow_lr` raises ValueError at the first window's end.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..compression import ErrorFeedback, check_own_error_feedback, make_accordion
from .channel import Channel
from .low_rank_channel import LowRankChannel
from .options import CommOptions
from .stats import StatsTable

log = logging.getLogger("megacomp")


class AccordionChannel:
    """A path switched between two compression levels by Accordion (see the module docstring).

    Args:
        name: the tag its traffic is counted under.
        codec: :class:`~megacomp.compression.Accordion` settings or their mapping.
        group: the default process group (also the group :meth:`end_step` reduces the norms over).
        error_feedback: for codec levels, the error feedback both levels share ('ef', 'loco', a config);
            PowerSGD levels bring their own (one shared state). Must be None for PowerSGD levels.
        min_compress_numel: as :class:`Channel`.
        options: as :class:`Channel`.
        stats: as :class:`Channel`.
    """

    def __init__(self, name: str, codec: Any, *, group=None, error_feedback: Any = None, min_compress_numel: int = 0,
                 options: Optional[CommOptions] = None, stats: Optional[StatsTable] = None) -> None:
        self.name, self.codec, self.group = name, make_accordion(codec), group
        self.options = options if options is not None else CommOptions.from_env()
        c = self.codec
        check_own_error_feedback(c, error_feedback, f"megacomp channel {name!r}")
        if c.low_rank:
            self.low = LowRankChannel(name, c.low, group=group, min_compress_numel=min_compress_numel,
                                      options=self.options, stats=stats)
            self.high = LowRankChannel(name, c.high, group=group, min_compress_numel=min_compress_numel,
                                       options=self.options, stats=stats)
            if (c.low.error_feedback, c.high.error_feedback) == (True, True):
                self.high.error_feedback = self.low.error_feedback  # one residual per tensor, whatever the level
            elif c.low.error_feedback != c.high.error_feedback:
                raise ValueError("accordion: both PowerSGD levels must have error_feedback on, or both off")
        else:
            self.low = Channel(name, c.low, group=group, error_feedback=error_feedback,
                               min_compress_numel=min_compress_numel, options=self.options, stats=stats)
            self.high = Channel(name, c.high, group=group, error_feedback=self.low.error_feedback,
                                min_compress_numel=min_compress_numel, options=self.options, stats=stats)
        self.min_compress_numel = min_compress_numel
        self.critical: dict[str, bool] = {}  # regime per key for the current interval (absent: critical)
        self.previous: dict[str, float] = {}  # a_old per key (0: none yet)
        self.sums: dict[str, torch.Tensor] = {}  # this interval's accumulated reduced gradient per key (fp64)
        self.replicated: dict[str, bool] = {}
        self.steps = 0
        self.switches: list[tuple[int, str, str, float]] = []  # (step, key, level, change): a log, not state
        self.lr_source: Optional[Callable[[], float]] = None
        self._lr: Optional[float] = None  # the rate of the step in progress (read by channel_for)
        self._lr_mark: Optional[float] = None  # the rate of a window's last step, until the next step compares

    def follow_lr(self, source: Callable[[], float]) -> None:
        """Read the learning rate from ``source()`` (e.g. ``lambda: optimizer.param_groups[0]["lr"]``) when a step
        asks for its channels: the rate set for that step, the same on every rank (``lr_trigger``)."""
        self.lr_source = source

    def __repr__(self) -> str:
        return f"AccordionChannel({self.name!r}, {self.codec})"

    # -- the Channel surface -------------------------------------------------------------------------
    lossy = True
    """Both levels compress."""
    reduces_whole_buckets = True
    """Its decision reads each bucket's whole-step reduced gradient, and its regimes are state of its own."""
    adaptive = True
    """Picks a level per key and interval (:meth:`channel_for`, :meth:`observe`, :meth:`end_step`)."""

    @property
    def keeps_own_error_feedback(self) -> bool:
        """Whether the levels are PowerSGD (their residuals are PowerSGD's own)."""
        return self.codec.low_rank

    @property
    def low_rank(self) -> bool:
        """Whether the levels are PowerSGD ranks (reduced with ``all_reduce_coalesced``)."""
        return self.codec.low_rank

    @property
    def levels(self) -> tuple:
        """The two level channels, ``(low, high)``."""
        return (self.low, self.high)

    def level_for(self, key: str):
        """The level that reduces tensor ``key`` in this interval (:meth:`channel_for`)."""
        return self.channel_for(key)

    @property
    def error_feedback(self) -> Optional[ErrorFeedback]:
        """The error-feedback state both levels share, or None."""
        return self.low.error_feedback

    def compresses(self, numel: int) -> bool:
        """Whether a message of ``numel`` elements is compressed (the levels' small-tensor rule)."""
        return self.low.compresses(numel)

    def uncompressed(self) -> Channel:
        """A plain channel with this path's name, group, options and stats table."""
        return self.low.uncompressed()

    def set_validate(self, enabled: bool) -> None:
        """Turn the cross-rank argument check of both levels on or off."""
        self.low.set_validate(enabled)
        self.high.set_validate(enabled)

    # -- the policy ----------------------------------------------------------------------------------
    def channel_for(self, key: str):
        """The level channel that reduces tensor ``key`` in this interval (``low`` while critical)."""
        if self.codec.lr_trigger and self.lr_source is not None:
            self._lr = float(self.lr_source())
            if self._lr_mark is not None:  # the first step after a window's end
                if self._lr < self._lr_mark:  # learning-rate decay: critical until the next decision
                    for k in sorted(set(self.sums) | set(self.critical)):
                        self._set(k, True, float("nan"), f"the learning rate fell from {self._lr_mark:g} to {self._lr:g}")
                self._lr_mark = None
        return self.low if self.critical.get(key, True) else self.high

    def _set(self, key: str, critical: bool, change: float, why: str) -> None:
        """Set ``key``'s regime; on a change log it and (PowerSGD, not ``keep_q``) restart the entered level's Q."""
        if critical != self.critical.get(key, True):
            level = "low" if critical else "high"
            self.switches.append((self.steps, key, level, change))
            log.info("megacomp accordion: %s %s switches to %s (%s) after step %d: %s", self.name, key, level,
                     self.codec.low if critical else self.codec.high, self.steps, why)
            if self.codec.low_rank and not self.codec.keep_q:
                self._restart_q(self.low if critical else self.high, key)
        self.critical[key] = critical

    @staticmethod
    def _restart_q(level: LowRankChannel, key: str) -> None:
        # the reference builds a new PowerSGD reducer on a rank change: its first step draws a random start Q.
        # Redrawn in place (not dropped), so checkpoint templates keep their keys; the draw count makes it the
        # same on every rank and after a resume.
        for k in [k for k in level.q if k.startswith(key + "/")]:
            q = level.q.pop(k)
            level.q[k] = level._start_q(k, q.shape[0], q.shape[1], q.device)

    def observe(self, key: str, reduced: torch.Tensor, replicated: bool) -> None:
        """Add this step's reduced gradient of ``key`` (whole on every rank, or this rank's shard); a step outside
        the interval's window is not summed, nor anything with ``norm_of: local``."""
        if self.codec.norm_of == "reduced":
            self._add(key, reduced, replicated)

    def observe_local(self, key: str, local: torch.Tensor) -> None:
        """Add this rank's own gradient of ``key`` before its reduction (``norm_of: local``; else nothing). Every
        rank sums its own; the decision reads rank 0's (as replicated tensors), as the reference."""
        if self.codec.norm_of == "local":
            self._add(key, local, True)

    @torch.no_grad()
    def _add(self, key: str, reduced: torch.Tensor, replicated: bool) -> None:
        if self.steps % self.codec.interval >= self.codec.steps_summed:
            self.replicated.setdefault(key, replicated)
            return
        flat = reduced.detach().reshape(-1).to(torch.float64)
        acc = self.sums.get(key)
        if acc is None:
            self.sums[key] = flat.clone()
        elif acc.numel() != flat.numel():
            raise ValueError(f"accordion key {key!r} was observed with {acc.numel()} and now {flat.numel()} elements; "
                             f"use one key per tensor")
        else:
            acc += flat
        self.replicated[key] = replicated

    def discard_step(self) -> None:
        """Forget this interval's sums after a step whose gradients were not finite (the optimizer skipped
        it): an inf/NaN norm would decide nothing sensible, and would poison the next comparison."""
        for acc in self.sums.values():
            acc.zero_()

    @torch.no_grad()
    def end_step(self, group=None) -> None:
        """Count one optimizer step; at the end of a window decide every key's next regime (collective), and with
        ``lr_trigger`` keep the rate of the window's last step for the next :meth:`channel_for` to compare."""
        self.steps += 1
        window = self.codec.steps_summed
        if self.codec.lr_trigger and self.steps % window == 0:
            if self.lr_source is None:
                raise ValueError(f"accordion channel {self.name!r}: lr_trigger needs the learning rate: call "
                                 f"channel.follow_lr(lambda: optimizer.param_groups[0]['lr']) (the sharded optimizer "
                                 f"does), or set lr_trigger: false")
            self._lr_mark = self._lr
        if (self.steps - 1) % self.codec.interval != window - 1:
            return
        group = self.group if group is None else group
        keys = sorted(self.sums)
        first = dist.get_rank(group) == 0
        device = self.sums[keys[0]].device if keys else "cpu"  # NCCL groups reduce device tensors only
        sq = torch.tensor([float(self.sums[k].square().sum()) if (first or not self.replicated[k]) else 0.0
                           for k in keys], dtype=torch.float64, device=device)
        if dist.get_world_size(group) > 1 and keys:
            dist.all_reduce(sq, group=group)
        for k, value in zip(keys, sq.sqrt().cpu().tolist()):
            old = self.previous.get(k, 0.0)
            change = abs(old - value) / old if old > 0 else float("inf")
            critical = change >= self.codec.eta
            self._set(k, critical, change, f"accumulated gradient norm changed by {change:.3g} "
                                           f"({'>=' if critical else '<'} eta {self.codec.eta:g})")
            self.previous[k] = value
            self.sums[k].zero_()  # kept (zeroed), so a checkpoint template has the same keys at any step

    # -- checkpointing -------------------------------------------------------------------------------
    def init_key(self, key: str, numel: int, replicated: bool, device=None, local_numel: Optional[int] = None) -> None:
        """The state ``key`` has before it is first observed (critical, no a_old, a zero sum of ``numel`` reduced
        elements, or with ``norm_of: local`` of ``local_numel`` local ones), so saved and template state dicts
        (torch.distributed.checkpoint) have the same keys at any step."""
        if self.codec.norm_of == "local":
            if local_numel is None:
                raise ValueError(f"accordion channel {self.name!r}: norm_of local sums whole local tensors; "
                                 f"init_key({key!r}) needs local_numel")
            numel, replicated = local_numel, True
        if key not in self.sums:
            self.sums[key] = torch.zeros(numel, dtype=torch.float64, device=device)
            self.replicated[key] = replicated
            self.critical.setdefault(key, True)
            self.previous.setdefault(key, 0.0)

    def state_dict(self, error_feedback: bool = True) -> dict[str, Any]:
        """Settings, regimes, norms, the interval's partial sums, step count and both levels' states (the
        shared residuals once, unless ``error_feedback=False``)."""
        return {"codec": self.codec.to_dict(), "steps": self.steps, "critical": dict(self.critical),
                "previous": dict(self.previous), "sums": {k: v.clone() for k, v in self.sums.items()},
                "replicated": dict(self.replicated),
                "lr": {"step": _nan_for_none(self._lr), "mark": _nan_for_none(self._lr_mark)},
                "low": self.low.state_dict(error_feedback=error_feedback),
                "high": self.high.state_dict(error_feedback=False)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises ValueError for other settings."""
        if make_accordion(state["codec"]).to_dict() != self.codec.to_dict():  # defaults of later fields filled
            raise ValueError(f"channel {self.name!r}: state saved with {state['codec']}, this channel uses "
                             f"{self.codec.to_dict()}; resume with the same compression config")
        self.steps = int(state["steps"])
        self.critical, self.previous = dict(state["critical"]), dict(state["previous"])
        self.sums = {k: v.clone() for k, v in state["sums"].items()}
        self.replicated = dict(state["replicated"])
        lr = state.get("lr", {})  # absent in states saved before the learning-rate trigger
        self._lr, self._lr_mark = (None if v is None or v != v else float(v) for v in (lr.get("step"), lr.get("mark")))
        self.low.load_state_dict(state["low"])
        self.high.load_state_dict(state["high"])


def _nan_for_none(value: Optional[float]) -> float:
    # a float either way, so checkpoint templates (torch.distributed.checkpoint) hold the same types at any step
    return float("nan") if value is None else float(value)
