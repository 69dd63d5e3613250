"""The Channel surface shared by the paths that reduce a bucket whole with codec state of their own (PowerSGD's
LowRankChannel, LGC's LGCChannel, lgc_pca's LearnedChannel): what the sharded optimizer and the DDP hook read to
route a bucket to ``all_reduce_coalesced``, and the steps every such ``all_reduce_coalesced`` shares (argument checks,
the flat fp32 bucket, delivering it back, the byte record). Behaviour lives in the subclasses."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from ..compression.codecs import FLOAT_DTYPES
from .channel import Channel
from .common import all_reduce_bytes, op_name
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

    def set_validate(self, enabled: bool) -> None:
        """Turn the cross-rank argument check of later calls on or off."""
        self.options = replace(self.options, validate=bool(enabled))
        self._wire.set_validate(enabled)

    # -- the steps every whole-bucket exchange shares ------------------------------------------------------
    def _private_wire(self, group) -> None:
        """The plain channel the exchanges run on (``self._wire``), with a private statistics table
        (``self._wire_stats``): each call records its own total under the path's name (:meth:`_record`)."""
        self._wire_stats = StatsTable()
        self._wire = Channel(self.name, None, group=group, options=self.options, stats=self._wire_stats)

    def _flat_bucket(self, tensors: Sequence[torch.Tensor], op, label: str) -> Optional[torch.Tensor]:
        """The bucket as one flat fp32 tensor (None when ``tensors`` is empty), after the checks every whole-bucket
        path makes: ``op`` SUM or AVG (ValueError), floating tensors (TypeError); ``label`` names the codec."""
        if op_name(op) not in ("SUM", "AVG"):
            raise ValueError(f"megacomp.comm.{type(self).__name__}: {label} supports ReduceOp SUM and AVG, got "
                             f"{op_name(op)}")
        for t in tensors:
            if t.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{label} compresses floating tensors (float32, bfloat16, float16, float64), got "
                                f"{t.dtype}; reduce other dtypes with an uncompressed channel")
        if not tensors:
            return None
        self._wire_stats.reset()  # this call's bytes only
        return torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])

    def _deliver(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], op, world: int) -> None:
        """Write the reduced bucket back into ``tensors`` (divided by ``world`` for AVG)."""
        if op_name(op) == "AVG":
            flat /= world
        pos = 0
        for t in tensors:
            t.copy_(flat[pos:pos + t.numel()].view(t.shape))
            pos += t.numel()

    def _record(self, tensors: Sequence[torch.Tensor], world: int, rank: int, extra_bytes: int = 0) -> None:
        """Record this call in the path's statistics: the private table's bytes (plus ``extra_bytes`` sent outside
        it) against a plain all-reduce of ``tensors``."""
        snap = self._wire_stats.snapshot()
        wire = (snap[self.name].wire_bytes if self.name in snap else 0) + extra_bytes
        dense = sum(all_reduce_bytes(t.numel(), t.element_size(), world, rank) for t in tensors)
        self.stats.record(self.name, wire, dense)
