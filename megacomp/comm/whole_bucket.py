"""The Channel surface shared by the paths that reduce a bucket whole with codec state of their own (PowerSGD's
LowRankChannel, LGC's LGCChannel, lgc_pca's LearnedChannel): what the sharded optimizer and the DDP hook read to
route a bucket to ``all_reduce_coalesced``. Behaviour lives in the subclasses; this only answers the routing questions."""
from __future__ import annotations

from typing import Optional

from .channel import Channel
from .options import CommOptions
from .stats import PROCESS_STATS, StatsTable


class WholeBucketChannel:
    """Routing answers for a whole-bucket path, and the settings every such path has (subclasses add ``codec``
    and their state)."""

    def __init__(self, name: str, *, group=None, min_compress_numel: int = 0, options: Optional[CommOptions] = None,
                 stats: Optional[StatsTable] = None) -> None:
        """Raises ValueError naming the path when ``min_compress_numel`` is not an int >= 0."""
        if not isinstance(min_compress_numel, int) or min_compress_numel < 0:
            raise ValueError(f"megacomp channel {name!r}: min_compress_numel must be an int >= 0, "
                             f"got {min_compress_numel!r}")
        self.name, self.group, self.min_compress_numel = name, group, min_compress_numel
        self.options = options if options is not None else CommOptions.from_env()
        self.stats = stats if stats is not None else PROCESS_STATS

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, codec={self.codec}, min_compress_numel={self.min_compress_numel})"

    lossy = True
    """Lossy: the dense tensor is never sent as is (the subclasses' warm-up calls are counted as uncompressed)."""
    keeps_own_error_feedback = True
    """The residuals are the path's own state, not the optimizer's."""
    reduces_whole_buckets = True
    """A bucket is reduced whole (no reduce-scatter into shards)."""
    low_rank = True
    """Reduces with ``all_reduce_coalesced`` (the call the optimizer and the hook make for a whole-bucket path)."""
    adaptive = False
    """One compression level."""

    @property
    def levels(self) -> tuple:
        """Itself: the one channel that carries this path's bytes."""
        return (self,)

    def level_for(self, key: str):
        """Itself, for every key."""
        return self

    def compresses(self, numel: int) -> bool:
        """Whether a call of ``numel`` elements in total is compressed (``numel >= min_compress_numel``)."""
        return numel >= self.min_compress_numel

    def uncompressed(self) -> Channel:
        """A plain channel with this path's name, group, options and stats table."""
        return Channel(self.name, None, group=self.group, options=self.options, stats=self.stats)
