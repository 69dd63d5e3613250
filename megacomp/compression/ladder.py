"""``--compression auto``'s settings: a ladder of codecs per traffic path, the decision interval, the step-time target
and the error budget (the YAML ``auto:`` block of a compression config; megacomp.config.CommCompressionConfig).

A ladder lists value codecs least lossy first (``[none, bf16, int8, {name: int4, block_size: 128}]``). At run time
(megacomp.plan.auto_policy, megacomp.training.features.auto_compression) every path starts on its first rung and
every ``interval`` iterations the controller moves it to the least lossy rung whose predicted transfer hides behind
the compute it overlaps, or that meets ``step_time_target_s``.

Error budget: a rung's error is the relative L2 error of its round trip on a fixed Gaussian sample
(:func:`rung_error`: 16,384 draws of a seeded generator, the same numbers on every rank and every run). Rungs whose
error exceeds ``max_relative_error`` are never chosen; since a ladder is ordered, they are its tail. The default
budget, 0.2, admits int4 with per-block scales (about 0.11 on Gaussian data; 8-18% measured on DP gradients during
training, where int4 with LoCo stayed within the seed spread of uncompressed training:
benchmarks/results/convergence_ablation) and refuses int2 and sign. Error feedback, where a path sets it, applies
on every lossy rung and keeps its residual across switches; the budget caps the error of one message, before
feedback.

Failure behaviour: :meth:`AutoCodecConfig.check` raises ValueError in one line for an empty ladder, a setting that
is not a value codec (PowerSGD, Accordion, LGC, a codec per hop), a path that cannot switch codecs, a ladder that is
not ordered least lossy first, a budget that no rung of a path meets, and out-of-range numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

import torch

from .codecs import Codec, make_codec
from .error_metrics import relative_error

def default_ladders() -> dict:
    """The ladders of ``auto: {}``: the data-parallel exchanges, the paths that cross the slowest links of most layouts
    (their transfers overlap compute, so a faster link can carry them uncompressed)."""
    return {"dp_gradient": ["none", "bf16", {"name": "int8", "block_size": 128}, {"name": "int4", "block_size": 128}],
            "dp_parameter": ["none", "bf16", {"name": "int8", "block_size": 256}]}

ERROR_SAMPLE_NUMEL = 16384
"""Elements of the Gaussian sample :func:`rung_error` measures a codec on."""


def rung_error(codec: Codec) -> float:
    """Relative L2 error of ``codec``'s round trip on :data:`ERROR_SAMPLE_NUMEL` standard normal draws of a generator
    seeded 0 (stochastic rounding from a second generator seeded 1): a number that is the same on every rank and
    every run. 0 for the identity."""
    if codec.is_identity:
        return 0.0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ERROR_SAMPLE_NUMEL, generator=g)
    return relative_error(x, codec.roundtrip(x, generator=torch.Generator().manual_seed(1)))


@dataclass
class AutoCodecConfig:
    """The ``auto:`` block (see the module docstring)."""

    ladder: dict = field(default_factory=default_ladders)
    """Per traffic path, its value codecs least lossy first (the paths not named keep their static codec).
    Default: dp_gradient none, bf16, int8, int4; dp_parameter none, bf16, int8."""
    interval: int = 20
    """Iterations between decisions (measurements cover the iterations since the last one)."""
    step_time_target_s: Optional[float] = None
    """A step time to meet: the least lossy rungs whose predicted step is at most this (when none is, every path
    takes its most lossy rung within the budget). None: each path's transfer should hide behind the compute it
    overlaps (the backward of the last micro-batch for dp_gradient, as megacomp.plan.estimate), the others are
    on the critical path and take the rung of least predicted time."""
    max_relative_error: float = 0.2
    """The error budget: no rung whose relative error on Gaussian data exceeds it is chosen (module docstring)."""
    margin: float = 0.1
    """Hysteresis: a less lossy rung is taken only when its predicted transfer fits with this fraction to spare, and
    the current rung is left only when its transfer, shortened by this fraction, does not fit."""
    patience: int = 2
    """Hysteresis: a switch needs the same choice at this many consecutive decisions, doubled for each switch the
    path made since its link's measured rate last changed by more than 3x (at most 8x; megacomp.plan.auto_policy)."""
    slack: float = 0.05
    """Exposed transfer tolerated as a fraction of the step's compute before a rung counts as not hiding."""

    def __post_init__(self) -> None:
        if not isinstance(self.ladder, Mapping):
            raise ValueError(f"auto.ladder must map traffic paths to lists of codecs (least lossy first), got "
                             f"{type(self.ladder).__name__}")
        self.ladder = {path: [_rung(path, i, c) for i, c in enumerate(_as_list(path, rungs))]
                       for path, rungs in self.ladder.items()}
        for name, low in (("interval", 1), ("patience", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"auto.{name} must be an int >= {low}, got {value!r}")
        for name in ("margin", "slack", "max_relative_error"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"auto.{name} must be a number >= 0, got {value!r}")
        t = self.step_time_target_s
        if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or t <= 0):
            raise ValueError(f"auto.step_time_target_s must be a number of seconds > 0 (or unset), got {t!r}")

    @classmethod
    def from_value(cls, value: Any) -> "AutoCodecConfig":
        """From a mapping (YAML), ``True`` / ``{}`` (the defaults) or an AutoCodecConfig. ValueError naming unknown
        keys."""
        if isinstance(value, cls):
            return value
        if value is True or value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise ValueError(f"auto must be a mapping (ladder, interval, step_time_target_s, max_relative_error, "
                             f"margin, patience, slack), got {value!r}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"unknown auto key(s) {unknown}; allowed: {', '.join(allowed)}")
        return cls(**dict(value))

    def check(self, paths: tuple, why_not: Mapping[str, str]) -> None:
        """Raise ValueError (one line) unless every laddered path is one of ``paths`` and not in ``why_not`` (path ->
        why it cannot switch), every ladder is ordered least lossy first and some rung of each meets the budget."""
        if not self.ladder:
            raise ValueError("auto.ladder names no path: give at least one, e.g. {dp_gradient: [none, bf16, int8, "
                             "int4]}")
        for path, rungs in self.ladder.items():
            if path not in paths:
                raise ValueError(f"auto.ladder: {path} cannot switch codecs at run time; ladders apply to "
                                 f"{', '.join(paths)}")
            if path in why_not:
                raise ValueError(f"auto.ladder: {path} {why_not[path]}")
            errors = [rung_error(c) for c in rungs]
            for i in range(1, len(rungs)):
                if errors[i] < errors[i - 1]:
                    raise ValueError(f"auto.ladder.{path}: {rungs[i]} (relative error {errors[i]:.3g}) comes after "
                                     f"{rungs[i - 1]} ({errors[i - 1]:.3g}); list the codecs least lossy first")
            if errors[0] > self.max_relative_error:
                raise ValueError(f"auto.max_relative_error {self.max_relative_error:g}: no codec of the {path} ladder "
                                 f"meets it (the least lossy, {rungs[0]}, errs by {errors[0]:.3g} on Gaussian "
                                 f"data); raise the budget or start the ladder with a less lossy codec (none, bf16)")

    def allowed(self, path: str) -> list:
        """The rungs of ``path`` within the error budget (a prefix of its ladder; at least one after check)."""
        return [c for c in self.ladder[path] if rung_error(c) <= self.max_relative_error]

    def for_rank(self, rank: int) -> "AutoCodecConfig":
        """Seeded rungs offset by rank as megacomp.config.CommCompressionConfig.for_rank does for static codecs."""
        ladder = {p: [make_codec(c, seed=c.seed + rank * 1000003) if c.seed is not None else c for c in rungs]
                  for p, rungs in self.ladder.items()}
        return AutoCodecConfig(ladder, self.interval, self.step_time_target_s, self.max_relative_error, self.margin,
                               self.patience, self.slack)

    def to_dict(self) -> dict:
        """Plain data that rebuilds this config."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["ladder"] = {p: [c.to_dict() for c in rungs] for p, rungs in self.ladder.items()}
        return out


def _as_list(path: str, rungs: Any) -> list:
    if isinstance(rungs, (str, Mapping, Codec)) or not hasattr(rungs, "__iter__"):
        raise ValueError(f"auto.ladder.{path} must be a list of codecs least lossy first, got {rungs!r}")
    rungs = list(rungs)
    if not rungs:
        raise ValueError(f"auto.ladder.{path} is empty: give at least one codec, least lossy first (e.g. [none, bf16, "
                         f"int8, int4])")
    return rungs


def _rung(path: str, i: int, spec: Any) -> Codec:
    """A value codec, or one line naming the rung and why it cannot be on a ladder."""
    name = spec.get("name") if isinstance(spec, Mapping) else getattr(spec, "name", spec)
    if isinstance(spec, Mapping) and "name" not in spec:
        raise ValueError(f"auto.ladder.{path}[{i}]: {dict(spec)} names no codec; a ladder switches value codecs in "
                         f"place (none, bf16, int8, int4, ...), one setting per rung")
    if name in ("powersgd", "accordion", "lgc", "lgc_pca"):
        raise ValueError(f"auto.ladder.{path}[{i}]: {name} is not a value codec; a ladder switches value codecs in "
                         f"place (none, bf16, int8, int4, ...): give {name} as the path's static setting instead")
    try:
        return make_codec(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"auto.ladder.{path}[{i}]: {e}") from None
