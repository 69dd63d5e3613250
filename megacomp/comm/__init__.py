"""Compressed collectives and p2p on torch.distributed, with wire statistics.

Two ways in:
- :class:`Channel`: one traffic path as one object (codec, error-feedback state, small-tensor threshold,
  ``CommOptions``, stats tag), built once and passed to whatever moves that traffic;
- :class:`LowRankChannel`: the same for a PowerSGD path (low-rank factors instead of a codec);
- :class:`AccordionChannel`: a path switched between two compression levels by Accordion's rule;
- :class:`LGCChannel`: the same for LGC as published (top-k, then an autoencoder of the top-k values);
- :class:`LearnedChannel`: the same for ``lgc_pca`` (a chunked PCA / MLP autoencoder per bucket);
- :class:`HierarchicalChannel`: a path over a group that spans nodes (a ``HierarchicalGroup``): a codec and error
  feedback per hop, so the slow link carries each node's bytes once;
- :func:`make_channel`: the one factory that picks among the three from a path's setting (a codec, PowerSGD
  or Accordion settings) and applies the "PowerSGD keeps its own error feedback" rule;
- the free functions, with the names and arguments of torch.distributed plus keyword-only ``codec=``
  (and ``error_feedback=``, an ``ErrorFeedback`` you own); ``codec=None`` is bit-identical to torch.distributed.

``all_gather_base`` is torch.distributed's uncompressed flat-tensor all-gather under the name this torch
version has (``all_gather_single`` or ``all_gather_into_tensor``), for callers above ``comm``.
"""
from torch.distributed import ReduceOp

from .common import CompressedWork, all_gather_base, comm_device
from .channel import Channel
from .collectives import server_numel
from .low_rank_channel import LowRankChannel
from .hierarchical import HierarchicalChannel
from .hop_groups import HierarchicalGroup, Hop, HopCodecs, hop_codecs, make_hop_codecs, new_hierarchical_group
from .accordion_channel import AccordionChannel
from .learned_channel import LearnedChannel
from .lgc_channel import LGCChannel
from .factory import AnyChannel, make_channel
from .functional import (all_gather_into_tensor, all_reduce, all_to_all_single, irecv, isend, recv,
                         reduce_scatter_tensor, send)
from .options import CommOptions
from .stats import StatsTable, WireStats, reset_stats, stats
from .transport import use_duplex

__all__ = [
    "AccordionChannel", "AnyChannel", "LGCChannel", "LearnedChannel", "Channel", "HierarchicalChannel", "HierarchicalGroup", "Hop",
    "HopCodecs", "hop_codecs", "make_hop_codecs", "new_hierarchical_group", "CommOptions", "CompressedWork", "LowRankChannel", "ReduceOp", "StatsTable", "WireStats", "all_gather_base",
    "all_gather_into_tensor", "all_reduce", "all_to_all_single", "comm_device", "irecv", "isend", "make_channel", "recv",
    "reduce_scatter_tensor", "reset_stats", "send", "server_numel", "stats", "use_duplex",
]
