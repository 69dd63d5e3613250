"""The one place that turns a traffic path's compression setting into its channel.

:func:`make_channel` reads the setting's kind (megacomp.compression.make_compressor) and builds

  a value codec (``int4``, ``{name: sign, block_size: 0}``, None = identity)   -> :class:`Channel`
  PowerSGD settings (``powersgd``, ``{name: powersgd, rank: 4}``)              -> :class:`LowRankChannel`
  Accordion settings (``{name: accordion, low: ..., high: ...}``)              -> :class:`AccordionChannel`
  LGC settings (``{name: lgc, variant: ps}``)                                 -> :class:`LGCChannel`
  lgc_pca settings (``{name: lgc_pca, latent: 32, chunk: 512}``)              -> :class:`LearnedChannel`

and, over a megacomp.comm.hop_groups.HierarchicalGroup, a value codec or a codec per hop ->
:class:`HierarchicalChannel` (PowerSGD, Accordion and LGC see whole buckets: they run flat on the whole group);

with the rule of megacomp.compression.compressor applied once here: PowerSGD (and Accordion over PowerSGD
levels) keeps its own error feedback, so ``error_feedback`` must then be None; a value codec (or Accordion
over codec levels) gets the error feedback it is given. Every config, optimizer, hook and outer loop that
builds a channel itself goes through this function; whoever uses the channel afterwards asks its properties
(``keeps_own_error_feedback``, ``reduces_whole_buckets``, ``low_rank``, ``adaptive``, ``levels``,
``level_for``), not its class.

Failure behaviour: ValueError for error feedback on a compressor that keeps its own (naming the argument to
leave at None), for error feedback without a lossy codec, and for settings the builders reject (unknown
names or fields, bad sizes); TypeError for a setting that is neither None, a name, a mapping nor a codec or
settings object.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from ..compression import Accordion, PowerSGD, check_own_error_feedback, make_compressor
from .accordion_channel import AccordionChannel
from .channel import Channel
from .low_rank_channel import LowRankChannel
from .learned_channel import LearnedChannel
from .lgc_channel import LGCChannel
from ..compression.learned import LGC, LGCPCA
from .hierarchical import HierarchicalChannel
from .hop_groups import HierarchicalGroup, HopCodecs, is_hop_mapping
from .options import CommOptions
from .stats import StatsTable

AnyChannel = Union[Channel, HierarchicalChannel, LowRankChannel, AccordionChannel, LearnedChannel, LGCChannel]
"""A traffic path's channel, whichever compressor it carries."""


def make_channel(name: str, spec: Any = None, *, group=None, error_feedback: Any = None, min_compress_numel: int = 0,
                 options: Optional[CommOptions] = None, stats: Optional[StatsTable] = None,
                 error_feedback_arg: str = "error_feedback") -> AnyChannel:
    """The channel of path ``name`` for the compression setting ``spec`` (see the module docstring).

    Args:
        name: the path's name: its stats tag and default error-feedback key.
        spec: None (identity), a codec name or mapping, a ``Codec``, or PowerSGD / Accordion settings (or their
            mappings).
        group: the default process group of its calls.
        error_feedback: 'ef', 'loco', a mapping, an ``ErrorFeedbackConfig`` or an ``ErrorFeedback`` for a value
            codec (or Accordion over codec levels); must be None for PowerSGD.
        min_compress_numel: the small-tensor rule (messages below it travel uncompressed).
        options: ``CommOptions`` (default: ``CommOptions.from_env()``, read when the channel is built).
        stats: the wire-statistics table (default: the process's).
        error_feedback_arg: how the caller's user spells the error-feedback setting, for the error message
            (``dp_gradient_error_feedback`` in a config, ``error_feedback`` in Python).

    Raises:
        ValueError / TypeError: see the module docstring.
    """
    if isinstance(group, HierarchicalGroup):
        if isinstance(spec, HopCodecs) or is_hop_mapping(spec) or not _whole_bucket(spec):
            return HierarchicalChannel(name, spec, group=group, error_feedback=error_feedback,
                                       min_compress_numel=min_compress_numel, options=options, stats=stats)
        group = group.group  # PowerSGD / Accordion / LGC see whole buckets: they run flat (their owners say so)
    elif isinstance(spec, HopCodecs) or is_hop_mapping(spec):
        raise ValueError(f"megacomp channel {name!r}: a codec per hop ({spec}) needs a group that crosses several link "
                         f"kinds (a HierarchicalGroup); this group is flat: give the path one codec")
    compressor = make_compressor(spec)
    check_own_error_feedback(compressor, error_feedback, f"megacomp channel {name!r}", error_feedback_arg)
    common = dict(group=group, min_compress_numel=min_compress_numel, options=options, stats=stats)
    if isinstance(compressor, Accordion):
        return AccordionChannel(name, compressor, error_feedback=error_feedback, **common)
    if isinstance(compressor, PowerSGD):
        return LowRankChannel(name, compressor, **common)
    if isinstance(compressor, LGC):  # LGC as published (megacomp.comm.lgc_channel)
        return LGCChannel(name, compressor, **common)
    if isinstance(compressor, LGCPCA):  # the chunked PCA / MLP code (megacomp.comm.learned_channel)
        return LearnedChannel(name, compressor, **common)
    return Channel(name, compressor, error_feedback=error_feedback, **common)


def _whole_bucket(spec: Any) -> bool:
    """Whether a setting names a compressor that must see whole buckets (PowerSGD, Accordion, LGC)."""
    return isinstance(make_compressor(spec), (Accordion, PowerSGD, LGC, LGCPCA))
