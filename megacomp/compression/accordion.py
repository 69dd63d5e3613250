"""Accordion (Agarwal et al., 2021): settings of a policy that switches a path between two compression
strengths by the training regime.

Every ``interval`` optimizer steps, for each compressed tensor (a bucket, keyed as its error feedback):

  1. ``a_new`` = the norm of the gradient that tensor delivered, summed over the interval's steps (the
     reduced gradient, identical on every rank);
  2. the regime is *critical* when ``|a_old - a_new| / a_old >= eta`` (the gradient is changing fast), else
     not; the first interval, with no ``a_old``, is critical (training starts in a critical regime);
  3. the next interval uses ``low`` (light compression: a higher PowerSGD rank, more top-k entries, more
     bits) in a critical regime and ``high`` (strong compression) otherwise; ``a_old = a_new``.

The exchange itself is megacomp.comm.accordion_channel's; this module holds the settings (YAML:
``{name: accordion, low: {name: powersgd, rank: 4}, high: {name: powersgd, rank: 1}, eta: 0.5,
interval: 25}``).

Failure behaviour: ``eta`` outside (0, inf), ``interval`` < 1, a level that is uncompressed, or one PowerSGD
level with one codec level (their error-feedback residuals have different shapes, so the switch would drop
the residual) raise ValueError when the settings are built.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

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
    """Optimizer steps per regime decision (the paper decides once per epoch)."""
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
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

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
        return f"accordion({self.low} critical / {self.high} otherwise, eta {self.eta:g}, every {self.interval} steps)"


def is_accordion(spec: Any) -> bool:
    """Whether ``spec`` names Accordion settings."""
    return isinstance(spec, Accordion) or (isinstance(spec, Mapping) and spec.get("name") == "accordion")


def make_accordion(spec: Any) -> Accordion:
    """Build :class:`Accordion` from a mapping (YAML) or an Accordion; unknown fields raise ValueError."""
    return build_from_spec(Accordion, spec, {}, "accordion")
