"""Flat, padded gradient buckets for the sharded optimizer.

Parameters are packed into buckets in reverse registration order (backward produces the last layers'
gradients first, so a bucket fills early and its communication overlaps the rest of backward). Each
bucket holds parameters of one param group, is either compressed or not (1-D parameters stay uncompressed, and so do
buckets that the caller's ``compresses(numel)`` rejects: the channels' small-tensor rule), and is padded to a multiple
of the data-parallel size so every rank owns an equal shard ``[rank * shard, (rank + 1) * shard)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn


@dataclass
class Bucket:
    """One flat gradient buffer and the shard of it this rank owns."""

    index: int
    """Position in the bucket list (also the error-feedback key)."""
    group: int
    """Index of the param group the parameters belong to."""
    params: list[nn.Parameter]
    """Parameters in the bucket, in buffer order."""
    offsets: list[int]
    """Start of each parameter in the flat buffer."""
    numel: int
    """Elements of real parameters (unpadded)."""
    padded: int
    """Buffer length: ``numel`` rounded up to a multiple of the DP size."""
    compressed: bool
    """Whether the gradient reduce-scatter / parameter all-gather use the codecs."""
    deferred: bool = False
    """Reduced only in ``step()``, so the caller can first all-reduce these gradients over other groups
    (tied embeddings over the embedding group, sequence-parallel norms over TP)."""
    grad: Optional[torch.Tensor] = None
    """fp32 accumulation buffer of the (unscaled) gradients, length ``padded``: for the whole run under ZeRO-1 (and
    for deferred buckets), under ZeRO-2 only from a backward's first gradient of the bucket until its reduce-scatter
    starts (None otherwise)."""
    ready: set = field(default_factory=set)
    """ids of parameters whose gradient arrived in the current backward."""
    work: object = None
    """Handle of the in-flight reduce-scatter."""
    reduced: Optional[torch.Tensor] = None
    """fp32 reduce-scatter output: this rank's shard, summed over ranks (under ZeRO-2 also over this step's
    reductions, one per micro-batch)."""
    pending: Optional[torch.Tensor] = None
    """ZeRO-2: the output of a later micro-batch's reduce-scatter while in flight, added into ``reduced`` when it
    is waited for."""

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """[start, end) of rank ``rank``'s equal shard of the padded buffer."""
        size = self.padded // world
        return rank * size, (rank + 1) * size


def build_buckets(param_groups: list[list[nn.Parameter]], dp_size: int, bucket_size: int,
                  compresses: Callable[[int], bool], deferred: frozenset = frozenset()) -> list[Bucket]:
    """Assign parameters to buckets (see module docstring). ``compresses(numel)``: whether a bucket of
    2-D+ parameters with that many elements would be compressed (False for every size: nothing is).
    Raises ValueError for ``bucket_size`` <= 0."""
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be > 0 elements, got {bucket_size}")
    buckets: list[Bucket] = []

    def close(group: int, params: list[nn.Parameter], is_compressed: bool, is_deferred: bool = False) -> None:
        if not params:
            return
        offsets, n = [], 0
        for p in params:
            offsets.append(n)
            n += p.numel()
        padded = -(-n // dp_size) * dp_size
        ok = is_compressed and compresses(n)
        buckets.append(Bucket(len(buckets), group, list(params), offsets, n, padded, ok, is_deferred))

    for gi, params in enumerate(param_groups):
        order = [p for p in reversed(params) if id(p) not in deferred]
        late = [p for p in reversed(params) if id(p) in deferred]
        if compresses(1 << 62):  # some channel is lossy: 2-D parameters may be compressed
            passes = [([p for p in order if p.dim() > 1], True, False), ([p for p in order if p.dim() <= 1], False, False),
                      ([p for p in late if p.dim() > 1], True, True), ([p for p in late if p.dim() <= 1], False, True)]
        else:
            passes = [(order, False, False), (late, False, True)]
        for plist, wants_codec, is_deferred in passes:
            current, size = [], 0
            for p in plist:
                current.append(p)
                size += p.numel()
                if size >= bucket_size:
                    close(gi, current, wants_codec, is_deferred)
                    current, size = [], 0
            close(gi, current, wants_codec, is_deferred)
    return buckets
