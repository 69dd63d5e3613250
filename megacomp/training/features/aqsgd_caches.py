"""AQ-SGD in pretraining (the compression config's ``pp_activation_delta``; the algorithm is
megacomp.pipeline_parallel.aqsgd): size, check and build the activation caches of one pipeline rank, hand them
to the pipeline's communicator and checkpoint them.

A rank holds, for each of its chunks (virtual stage ``vs``), the receiving side of boundary ``vs`` (unless
``vs`` is 0) and the sending side of boundary ``vs + 1`` (unless it is the last virtual stage). Each side
caches one ``(s, h)`` activation per sample of this data-parallel rank's shard of the data (the sampler
keeps the shards fixed under AQ-SGD), in host memory, in the activation dtype.

Failure behaviour: ValueError when AQ-SGD is asked for without pipeline parallelism, and when the caches
would not fit: more than 30% of the host's available memory divided among the ranks on the node
(``LOCAL_WORLD_SIZE``), with the size they need and the ways to shrink it. A third, because a checkpoint
holds two more copies of them for a moment (the rank's extra state is serialised to bytes, then written).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ...pipeline_parallel.aqsgd import ActivationDeltaCache, cache_bytes
from .base import Feature


def available_host_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cache_sides(pp_size: int, pp_rank: int, num_chunks: int) -> list[tuple[int, str]]:
    """The (boundary, side) pairs this pipeline rank caches."""
    total = pp_size * num_chunks
    sides = []
    for v in range(num_chunks):
        vs = v * pp_size + pp_rank
        if vs > 0:
            sides.append((vs, "recv"))
        if vs < total - 1:
            sides.append((vs + 1, "send"))
    return sides


def build_activation_delta(*, num_samples: int, shard: torch.Tensor, pp_size: int, pp_rank: int, num_chunks: int,
                           sample_shape: tuple, dtype: torch.dtype, warmup_visits: int,
                           available_bytes: Optional[int] = None, bits: int = 0,
                           warmup_full_gradients: bool = False) -> ActivationDeltaCache:
    """The caches of this rank (see the module docstring); ``shard``: the sample ids this rank sees.
    ``available_bytes``: the budget for this rank (default: the host's share, see the module docstring).
    ``bits``, ``warmup_full_gradients``: the reference's quantiser and warm-up (ActivationDeltaCache)."""
    if pp_size < 2:
        raise ValueError("pp_activation_delta (AQ-SGD) compresses the activations between pipeline stages: set "
                         "pipeline_model_parallel_size >= 2, or drop it")
    sides = cache_sides(pp_size, pp_rank, num_chunks)
    need = cache_bytes(len(shard), sample_shape, dtype, len(sides))
    if available_bytes is None:
        host = available_host_bytes()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        available_bytes = int(0.3 * host / local) if host is not None else None  # caches + 2 copies when saving
    if available_bytes is not None and need > available_bytes:
        raise ValueError(f"AQ-SGD's activation caches need {need / 2**30:.2f} GiB on pipeline stage {pp_rank} "
                         f"({len(sides)} boundary sides x {len(shard)} samples x {tuple(sample_shape)} {dtype}) but "
                         f"{available_bytes / 2**30:.2f} GiB of host memory is available to this rank (a third of its share: "
                         f"checkpoints copy the caches twice); use fewer "
                         f"samples, more data-parallel ranks (each caches its shard), fewer model chunks per stage, "
                         f"or direct quantisation (pp_activation_delta: false)")
    slot_of = torch.full((num_samples,), -1, dtype=torch.int64)
    slot_of[shard] = torch.arange(len(shard))
    return ActivationDeltaCache(sides, slot_of, sample_shape, dtype, warmup_visits=warmup_visits, bits=bits,
                                warmup_full_gradients=warmup_full_gradients)


def summary(cache: ActivationDeltaCache, codec) -> str:
    """The banner's line."""
    sides = ", ".join(sorted(cache.values))
    codec = cache.quantizer or codec
    warmup = "(gradients too)" if cache.warmup_full_gradients else "(gradients on pp_gradient's codec)"
    return (f"AQ-SGD activation deltas with {codec} after {cache.warmup_visits} uncompressed visit(s) per sample "
            f"{warmup}; "
            f"caches {sides} of {cache.num_slots} samples x {cache.sample_shape}: {cache.nbytes / 2**20:.1f} MiB "
            f"host memory on this rank; data shards fixed per DP rank")


class AQSGDCaches(Feature):
    """AQ-SGD's per-sample activation caches (see the module docstring); the data shards stay fixed per DP rank."""

    name = "aqsgd"
    state_key = "aqsgd"

    @classmethod
    def selected(cls, cfg) -> bool:
        return bool(cfg.compression_config().pp_activation_delta)

    def build(self, run) -> None:
        c = run.compression
        self.cache = build_activation_delta(
            num_samples=len(run.dataset), shard=run.sampler_at(0).shard(), pp_size=run.groups.pp_size,
            pp_rank=run.groups.pp_rank, num_chunks=run.num_chunks,
            sample_shape=(run.activation_shape()[0], self.cfg.model.hidden_size),
            dtype=next(run.model.parameters()).dtype, warmup_visits=c.pp_activation_delta_warmup_visits,
            bits=c.pp_activation_delta_bits, warmup_full_gradients=c.pp_activation_delta_warmup_full_gradients)
        run.activation_delta = self.cache

    def banner(self, run) -> list[str]:
        return [f"pipeline: {summary(self.cache, run.channels.pp_activation.codec)}"]

    def state_dict(self):
        return self.cache.state_dict()

    def load_state_dict(self, state) -> None:
        self.cache.load_state_dict(state)  # compression_resolved matched, so the checkpoint has the caches
