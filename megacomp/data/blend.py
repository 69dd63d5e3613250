"""Megatron's ``--data-path`` syntax and the weighted blend of several datasets.

``--data-path 0.7 a 0.3 b`` (weight, prefix pairs) blends datasets ``a`` and ``b`` in the proportions 0.7 : 0.3
(weights are normalised); ``--data-path a`` or ``--data-path a b`` (prefixes without weights) serves the datasets
one after the other, each sample once per epoch. :func:`parse_data_path` tells the two apart as megatron-core's
``get_blend_from_list`` does (an even count whose every other entry is a number: weighted), but refuses what it
would silently reinterpret: entries that look like weights where they cannot pair up, a weight that is not a
number, a weight <= 0.

:class:`BlendedDataset`: blended sample ``i`` is the ``k``-th draw of dataset ``d``, where the draws are ordered by
their times ``(k + 1/2) / w_d`` (ties: the lower ``d`` first), a deterministic interleave. After any ``n``
samples dataset ``d`` has ``c_d`` draws with ``|c_d - n w_d| <= 1/2 + w_d D / 2`` (``D`` datasets): each
``c_d = floor(w_d T + 1/2)`` for the time ``T`` of the ``n``-th draw, so ``|c_d - w_d T| <= 1/2``, and summing
over ``d`` gives ``|n - T| <= D / 2``. The ``k``-th draw of ``d`` is its sample ``(a_d k + b_d) mod len_d`` with
``a_d`` coprime to ``len_d`` (a full-period walk seeded by ``seed``): a dataset drawn fewer times than it has
samples contributes a subset spread over all its documents, one drawn more often repeats each sample ``floor``
or ``ceil`` of ``draws / len_d`` times. The blend has ``sum(len_d)`` samples unless told otherwise; its samples
are functions of the datasets, weights, seed and ``i`` alone, so the sampler's order and resumes are as for one
dataset.

Failure behaviour: ValueError, one line, for the bad weights above, a dataset without samples, mismatched
lengths of datasets and weights.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import numpy as np
import torch

from .indexed import looks_indexed


def _number(text: str) -> Optional[float]:
    """``float(text)`` when ``text`` reads as a number and names no file (a folder called ``2024`` is a path)."""
    if os.path.exists(text) or looks_indexed(text):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_path(values: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """``(prefixes, weights)`` of a ``--data-path`` list: weights None when the list holds prefixes only.

    Raises:
        ValueError: an empty list; entries that look like weights but do not pair up with prefixes (an odd count,
            or a number in a prefix's place); a weight that is not a number, not finite or <= 0.
    """
    values = [str(v).strip() for v in values]
    if not values:
        raise ValueError("--data-path is empty; give corpus files or folders, indexed dataset prefixes, or "
                         "WEIGHT PREFIX pairs")
    numbers = [_number(v) for v in values]
    if not any(n is not None for n in numbers):
        return values, None
    form = "give WEIGHT PREFIX pairs (e.g. --data-path 0.7 data/a_text_document 0.3 data/b_text_document)"
    if len(values) % 2:
        raise ValueError(f"--data-path {' '.join(values)}: {len(values)} entries with weights among them cannot pair "
                         f"up; {form}")
    weights, prefixes = values[0::2], values[1::2]
    for w, n in zip(weights, numbers[0::2]):
        if n is None:
            raise ValueError(f"--data-path weight {w!r} is not a number; {form}")
        if not math.isfinite(n) or n <= 0:
            raise ValueError(f"--data-path weight {w!r} must be a finite number > 0 (leave a dataset out rather than "
                             f"weight it 0); {form}")
    for p, n in zip(prefixes, numbers[1::2]):
        if n is not None:
            raise ValueError(f"--data-path has the number {p!r} where a prefix belongs; {form}")
    return prefixes, [float(w) for w in weights]


def blend_order(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset, draw)`` arrays of the first ``num_samples`` blended samples (see the module docstring):
    ``dataset[i]`` (int16) is the dataset of sample ``i`` and ``draw[i]`` (int64) how many draws of it came
    before. ``weights`` must be positive and sum to 1."""
    w = np.asarray(weights, dtype=np.float64)
    horizon = num_samples + len(w) / 2 + 1  # by the bound, draws up to this time number more than num_samples
    counts = np.floor(w * horizon + 0.5).astype(np.int64)
    times = np.concatenate([(np.arange(c) + 0.5) / wd for c, wd in zip(counts, w)])
    which = np.repeat(np.arange(len(w), dtype=np.int16), counts)
    draws = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    order = np.lexsort((which, times))[:num_samples]
    return which[order], draws[order]


class BlendedDataset(torch.utils.data.Dataset):
    """Samples of several datasets in proportion to ``weights`` (see the module docstring).

    Args:
        datasets: datasets of equal-shaped samples (e.g. :class:`~megacomp.data.indexed.IndexedTokenDataset`).
        weights: one positive weight per dataset (normalised here).
        num_samples: the blend's length; None = the datasets' total.
        seed: seeds each dataset's walk over its samples.

    Raises:
        ValueError: no datasets, a length mismatch, a weight that is not a finite number > 0, ``num_samples`` < 1,
            or a dataset with no sample.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: Optional[int] = None,
                 seed: int = 0):
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"a blend needs one weight per dataset, got {len(datasets)} datasets and "
                             f"{len(weights)} weights")
        if any(not math.isfinite(w) or w <= 0 for w in weights):
            raise ValueError(f"blend weights must be finite numbers > 0, got {list(weights)}")
        self.datasets = list(datasets)
        self.sizes = [len(d) for d in self.datasets]
        for d, size in zip(self.datasets, self.sizes):
            if size == 0:
                raise ValueError(f"{d!r} has no sample; drop it from the blend or lower seq_length")
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        n = sum(self.sizes) if num_samples is None else int(num_samples)
        if n < 1:
            raise ValueError(f"a blend needs num_samples >= 1, got {n}")
        self.which, self.draws = blend_order(self.weights, n)
        rng = np.random.default_rng(seed)
        self._walks = []
        for size in self.sizes:
            step = int(rng.integers(1, size)) if size > 1 else 1
            while math.gcd(step, size) != 1:
                step += 1
            self._walks.append((step, int(rng.integers(0, size))))

    def __len__(self) -> int:
        return len(self.which)

    def source(self, index: int) -> tuple[int, int]:
        """``(dataset, sample)`` that blended sample ``index`` is."""
        d = int(self.which[index])
        step, start = self._walks[d]
        return d, (step * int(self.draws[index]) + start) % self.sizes[d]

    def __getitem__(self, index: int) -> torch.Tensor:
        n = len(self)
        index = int(index)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples")
        d, sample = self.source(index % n)
        return self.datasets[d][sample]

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:.3g} x {d!r}" for w, d in zip(self.weights, self.datasets))
        return f"BlendedDataset({len(self)} samples: {parts})"
