"""Which compressor a traffic path's setting names: a value :class:`~megacomp.compression.Codec`, PowerSGD
settings (megacomp.compression.low_rank) or Accordion settings (megacomp.compression.accordion).

This is the one place that reads a spec's kind, so the two structured compressors need not know each other
(Accordion's levels are PowerSGD settings or codecs, so accordion.py imports low_rank.py, never the reverse).

It also states, once, the rule every owner of a path obeys: PowerSGD keeps its own error feedback (the
``error_feedback`` field of its settings), and so does Accordion over PowerSGD levels; an owner adds error
feedback only to a value codec or to Accordion over codec levels (:func:`check_own_error_feedback`).

Failure behaviour: as the builder of the kind the spec names (ValueError naming unknown fields or names,
TypeError for a spec that is neither a name, a mapping nor one of the settings classes).
"""
from __future__ import annotations

from typing import Any, Union

from .accordion import Accordion, is_accordion, make_accordion
from .codecs import Codec, make_codec
from .low_rank import PowerSGD, is_low_rank, make_low_rank
from .learned import LGC, LGCPCA, is_learned, make_learned

Compressor = Union[Codec, PowerSGD, Accordion]
"""What a path that accepts structured compressors (dp_gradient) holds after construction."""


def make_compressor(spec: Any) -> Compressor:
    """A :class:`~megacomp.compression.Codec`, or for a PowerSGD spec (``'powersgd'``, ``{name: powersgd, ...}``,
    a PowerSGD) a :class:`PowerSGD`, or for an Accordion spec (``{name: accordion, ...}``, an Accordion) an
    :class:`Accordion`. None is the identity codec."""
    if is_accordion(spec):
        return make_accordion(spec)
    if is_learned(spec):  # LGC as published or lgc_pca (megacomp.compression.lgc, .learned)
        return make_learned(spec)
    return make_low_rank(spec) if is_low_rank(spec) else make_codec(spec)


def keeps_own_error_feedback(compressor: Any) -> bool:
    """Whether ``compressor`` (built, see :func:`make_compressor`) brings its own error feedback: PowerSGD settings,
    or Accordion settings whose levels are PowerSGD (their residuals are per matrix, shaped by the factors)."""
    if isinstance(compressor, (LGC, LGCPCA)):  # LGC, lgc_pca: error feedback on what was delivered for the sender
        return True
    return isinstance(compressor, PowerSGD) or (isinstance(compressor, Accordion) and compressor.low_rank)


def check_own_error_feedback(compressor: Any, error_feedback: Any, where: str, arg: str = "error_feedback") -> None:
    """The rule of the module docstring.

    Raises:
        ValueError: ``error_feedback`` is set for a compressor that keeps its own, naming ``where`` and the
            argument (``arg``) to leave at None."""
    if error_feedback is not None and keeps_own_error_feedback(compressor):
        raise ValueError(f"{where}: {compressor} keeps its own error feedback (the error_feedback field of its PowerSGD "
                         f"settings, on by default); leave {arg} at None")
