"""Accordion (Agarwal et al., MLSys 2021, arXiv 2010.16248): settings of a policy that switches a path between two
compression strengths by the training regime.

The rule, for each compressed tensor (a bucket, keyed as its error feedback), with ``W = window`` and
``I = interval`` steps (``W`` divides ``I``; ``window: null`` means ``W = I``):

  1. ``a_new`` = the norm of the reduced gradient the tensor delivered (``norm_of: local``: of rank 0's own
     gradient before compression), summed over the window of steps ``[k I, k I + W)`` (alike on every rank);
  2. at the window's end (step ``k I + W``) the regime is *critical* when ``|a_old - a_new| / a_old >= eta``
     (the gradient is changing fast), else not; the first decision (``k = 0``, no ``a_old``) and an ``a_old``
     of 0 are critical; ``a_old = a_new``;
  3. with ``lr_trigger``, at the end of every ``W`` steps, a learning rate lower for the next step than for the
     last one makes every tensor critical until the next decision (learning-rate decay is a critical regime);
  4. critical regimes use ``low`` (light compression: a higher PowerSGD rank, more top-k entries, more bits),
     the others ``high``. Training starts critical (``low``) and stays so through the first decision.

The reference code (github.com/uw-mad-dash/Accordion, ``main.py`` and ``auto_scale.py``) counts in epochs: ``W`` is
one epoch, ``I`` ten (five for its LSTM and ImageNet configs), the threshold 0.5, the learning-rate trigger on,
the norm that of rank 0's uncompressed gradient; ``window`` / ``interval`` in steps, ``lr_trigger: true`` and
``norm_of: local`` restate it. The defaults are megacomp's earlier rule: ``window: null`` (one sum per interval,
compared with the previous interval's), ``norm_of: reduced`` (no extra fp64 sum of whole buckets) and
``lr_trigger: false`` (under a schedule that decays every step, as the pretraining trainer's cosine, the trigger
fires at every window and holds ``low`` for the whole run). On a switch of PowerSGD rank the level entered starts
a fresh power iteration (a new random start Q), as the reference builds a new PowerSGD reducer; ``keep_q: true``
resumes each level's last Q instead (megacomp's earlier behaviour). The error-feedback residual is kept across
switches in both (as the reference).

The exchange itself is megacomp.comm.accordion_channel's; this module holds the settings (YAML:
``{name: accordion, low: {name: powersgd, rank: 4}, high: {name: powersgd, rank: 1}, eta: 0.5,
interval: 25}``).

Failure behaviour: ``eta`` outside (0, inf), ``interval`` < 1, a ``window`` that is not an int in [1, interval]
dividing ``interval``, a level that is uncompressed, or one PowerSGD level with one codec level (their
error-feedback residuals have different shapes, so the switch would drop the residual) raise ValueError when
the settings are built; ``lr_trigger`` on a channel nobody gives the learning rate raises ValueError at its
first window's end (megacomp.comm.AccordionChannel.follow_lr).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from .codecs import Codec, build_from_spec, make_codec
from .low_rank import PowerSGD, StructuredCompressor, is_low_rank, make_low_rank


def _level(spec: Any) -> "Codec | PowerSGD":
    return make_low_rank(spec) if is_low_rank(spec) else make_codec(spec)


@dataclass(frozen=True)
class Accordion(StructuredCompressor):
    """Settings of the Accordion policy (see the module docstring)."""

    low: Any = None
    """The light compression used in critical regimes (a codec or PowerSGD settings), e.g. PowerSGD rank 4."""
    high: Any = None
    """The strong compression used otherwise (same kind as ``low``), e.g. PowerSGD rank 1."""
    eta: float = 0.5
    """Relative change of the accumulated gradient norm between intervals that marks a critical regime."""
    interval: int = 10
    """Optimizer steps between regime decisions (the reference decides every 10 epochs)."""
    window: Optional[int] = None
    """Optimizer steps whose gradient is summed for the norm, from the start of each interval (the reference:
    one epoch); it must divide ``interval``. None: the whole interval (consecutive intervals compared)."""
    lr_trigger: bool = False
    """Make every tensor critical until the next decision when the learning rate drops between two windows (the
    reference's second rule). Off by default: a schedule decaying every step would hold ``low`` throughout."""
    norm_of: str = "reduced"
    """Whose gradient the norm reads: ``reduced`` (the compressed, averaged gradient, already in hand) or ``local``
    (rank 0's own uncompressed gradient, as the reference; every rank keeps an fp64 sum of its whole buckets)."""
    keep_q: bool = False
    """PowerSGD levels: resume each level's warm-start Q after a switch (megacomp's earlier behaviour); False
    starts the level entered from a fresh random Q, as the reference's new reducer per switch."""
    name: str = "accordion"
    """Always ``accordion`` (names the policy in YAML and checkpoints)."""

    def __post_init__(self) -> None:
        if self.name != "accordion":
            raise ValueError(f"Accordion settings have name 'accordion', got {self.name!r}")
        if self.low is None or self.high is None:
            raise ValueError("accordion needs both levels: low (used in critical regimes, e.g. {name: powersgd, rank: 4}) "
                             "and high (otherwise, e.g. {name: powersgd, rank: 1})")
        low, high = _level(self.low), _level(self.high)
        for which, level in (("low", low), ("high", high)):
            if level.is_identity:
                raise ValueError(f"accordion: level {which} is uncompressed; both levels must compress (use the plain "
                                 f"codec instead of accordion to leave a path uncompressed)")
        if isinstance(low, PowerSGD) != isinstance(high, PowerSGD):
            raise ValueError(f"accordion: levels {low} and {high} mix PowerSGD with an element codec; their residuals "
                             f"differ in shape, so pick two PowerSGD ranks or two codecs")
        if not isinstance(self.eta, (int, float)) or not self.eta > 0:
            raise ValueError(f"accordion: eta must be a number > 0 (the paper uses 0.5), got {self.eta!r}")
        if not isinstance(self.interval, int) or isinstance(self.interval, bool) or self.interval < 1:
            raise ValueError(f"accordion: interval must be an int >= 1 (optimizer steps per decision), got {self.interval!r}")
        w = self.window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= self.interval
                              or self.interval % w):
            raise ValueError(f"accordion: window must be an int that divides interval {self.interval} (steps summed "
                             f"per decision, e.g. one epoch with interval = 10 epochs) or null, got {w!r}")
        if self.norm_of not in ("reduced", "local"):
            raise ValueError(f"accordion: norm_of must be 'reduced' or 'local' (rank 0's uncompressed gradient, as the "
                             f"reference), got {self.norm_of!r}")
        for flag in ("lr_trigger", "keep_q"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"accordion: {flag} must be true or false, got {getattr(self, flag)!r}")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

    @property
    def steps_summed(self) -> int:
        """Steps per window (``window``, or the whole ``interval``)."""
        return self.interval if self.window is None else self.window

    @property
    def low_rank(self) -> bool:
        """Whether the levels are PowerSGD ranks."""
        return isinstance(self.low, PowerSGD)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for YAML and checkpoints."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["low"], out["high"] = self.low.to_dict(), self.high.to_dict()
        return out

    def __str__(self) -> str:
        window = "" if self.window is None else f" on the first {self.window}"
        lr = ", lr decay critical" if self.lr_trigger else ""
        return (f"accordion({self.low} critical / {self.high} otherwise, eta {self.eta:g}, every {self.interval} "
                f"steps{window}{lr})")


def is_accordion(spec: Any) -> bool:
    """Whether ``spec`` names Accordion settings."""
    return isinstance(spec, Accordion) or (isinstance(spec, Mapping) and spec.get("name") == "accordion")


def make_accordion(spec: Any) -> Accordion:
    """Build :class:`Accordion` from a mapping (YAML) or an Accordion; unknown fields raise ValueError."""
    return build_from_spec(Accordion, spec, {}, "accordion")
