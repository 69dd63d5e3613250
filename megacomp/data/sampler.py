"""Deterministic, resumable data-parallel sampling of sample indices.

Iteration ``k`` is one global batch of ``dp_size * micro_batch_size`` samples: epoch ``e = k //
batches_per_epoch`` shuffles all samples with ``torch.randperm`` seeded by ``seed + e``, global batch
``k`` is the next ``dp_size * micro_batch_size`` indices of that permutation, and data-parallel rank ``r``
takes the ``r``-th slice of ``micro_batch_size``. The tail of each permutation that does not fill a global
batch is dropped. Everything is a function of ``(seed, k)``, so a run resumed with ``start_iteration=k``
(``consumed_samples // global_batch_size``) sees exactly the batches an uninterrupted run would have.
With gradient accumulation over ``m`` micro-batches per optimizer step, resume at ``step * m``.

``shard_samples=True`` (AQ-SGD, whose per-sample activation caches need every sample to come back to the
same pipeline): the samples are split once into ``dp_size`` fixed shards (a permutation seeded by ``seed``
dealt out round-robin, ``num_samples // dp_size`` each), and every epoch each rank shuffles its own shard
with ``torch.randperm`` seeded by ``seed + e``. With one data-parallel rank this is the same order as the
default.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch


class DistributedBatchSampler:
    """Yields this data-parallel rank's micro-batch of sample indices (a list of ints), forever.

    Iteration ``k`` (from ``start_iteration``) is the ``dp_rank``-th slice of global batch ``k`` (see the
    module docstring); the iterator never ends, so the training loop decides when to stop.

    Args:
        num_samples: samples in the dataset (``len(dataset)``).
        micro_batch_size: samples per rank per iteration.
        dp_rank: this rank's data-parallel rank.
        dp_size: the data-parallel size.
        seed: base seed of the per-epoch permutations (epoch ``e`` uses ``seed + e``).
        start_iteration: first iteration to yield (resume point).
        shard_samples: every rank keeps a fixed shard of the samples (see the module docstring).

    Raises:
        ValueError: ``micro_batch_size`` or ``dp_size`` < 1; ``dp_rank`` outside ``[0, dp_size)``;
            ``start_iteration`` < 0; fewer samples than one global batch.
    """

    def __init__(self, num_samples: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, start_iteration: int = 0, shard_samples: bool = False):
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(f"micro_batch_size and dp_size must be >= 1, got {micro_batch_size} and {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
        if start_iteration < 0:
            raise ValueError(f"start_iteration must be >= 0, got {start_iteration}")
        self.global_batch_size = micro_batch_size * dp_size
        if num_samples < self.global_batch_size:
            raise ValueError(f"{num_samples} samples cannot fill one global batch of dp_size * micro_batch_size = "
                             f"{dp_size} * {micro_batch_size}; lower micro_batch_size or seq_length, or add text")
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.start_iteration = start_iteration
        self.batches_per_epoch = num_samples // self.global_batch_size
        self.shard_samples = shard_samples
        self._shards = None
        if shard_samples:
            per = num_samples // dp_size
            deal = (torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
                    if dp_size > 1 else torch.arange(num_samples))
            self._shards = [deal[r::dp_size][:per] for r in range(dp_size)]
            self.batches_per_epoch = per // micro_batch_size
        self._epoch, self._perm = -1, None

    def shard(self, dp_rank: Optional[int] = None) -> torch.Tensor:
        """The sample indices rank ``dp_rank`` (default: this rank) ever sees: its shard with
        ``shard_samples``, else every sample."""
        if self._shards is None:
            return torch.arange(self.num_samples)
        return self._shards[self.dp_rank if dp_rank is None else dp_rank]

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            n = self.num_samples if self._shards is None else len(self._shards[0])
            self._epoch, self._perm = epoch, torch.randperm(n, generator=gen)
        return self._perm

    def global_batch(self, iteration: int) -> list[int]:
        """All ``dp_size * micro_batch_size`` sample indices of ``iteration``, in rank order."""
        epoch, j = divmod(iteration, self.batches_per_epoch)
        if self._shards is not None:
            m = self.micro_batch_size
            perm = self._permutation(epoch)[j * m:(j + 1) * m]
            return [i for r in range(self.dp_size) for i in self._shards[r][perm].tolist()]
        g = self.global_batch_size
        return self._permutation(epoch)[j * g:(j + 1) * g].tolist()

    def batch(self, iteration: int) -> list[int]:
        """This rank's ``micro_batch_size`` sample indices of ``iteration``."""
        m = self.micro_batch_size
        if self._shards is not None:
            epoch, j = divmod(iteration, self.batches_per_epoch)
            return self._shards[self.dp_rank][self._permutation(epoch)[j * m:(j + 1) * m]].tolist()
        return self.global_batch(iteration)[self.dp_rank * m:(self.dp_rank + 1) * m]

    def __iter__(self) -> Iterator[list[int]]:
        iteration = self.start_iteration
        while True:
            yield self.batch(iteration)
            iteration += 1

    @property
    def consumed_samples(self) -> int:
        """Samples (over all ranks) consumed before ``start_iteration``."""
        return self.start_iteration * self.global_batch_size


def get_batch(dataset: Sequence[torch.Tensor], indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, labels)``, both int64 ``[len(indices), seq_length]``: labels are tokens shifted by one.
    The dataset's indexing errors propagate (TokenDataset: IndexError for an index out of range)."""
    samples = torch.stack([dataset[i] for i in indices])
    return samples[:, :-1].contiguous(), samples[:, 1:].contiguous()
