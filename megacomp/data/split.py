"""Megatron's ``--split``: train / validation / test by document.

``parse_split("969,30,1")`` gives the proportions normalised to sum 1 (``[0.969, 0.03, 0.001]``); one or two
numbers leave the later parts 0 (Megatron's padding). ``split_documents(n, fractions)`` cuts ``n`` documents into
three contiguous ranges at ``round(cumulative_fraction * n)``, exactly as megatron-core's
BlendedMegatronDatasetBuilder cuts a GPT dataset's sequences, so a Megatron-LM run and a megacomp run over the
same files train, validate and test on the same documents. A part can be empty (``100,0,0``, or too few
documents): the caller decides whether that is an error (evaluation asked for with no validation documents).

Failure behaviour: a split that is not 1 to 3 non-negative numbers with a positive sum: ValueError, one line.
"""
from __future__ import annotations

import math
import re

SPLIT_NAMES = ("train", "valid", "test")
"""The parts, in ``--split`` order."""


def parse_split(split: str) -> tuple[float, float, float]:
    """The three proportions of ``split`` (numbers separated by commas, slashes or spaces), normalised.

    Raises:
        ValueError: not 1 to 3 numbers, a negative or non-finite one, or all zero.
    """
    parts = [p for p in re.split(r"[,/\s]+", str(split).strip()) if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r} must be 1 to 3 non-negative numbers with a positive sum, the train, "
                         f"validation and test proportions by document (e.g. 969,30,1)")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return tuple(v / total for v in values)


def split_documents(num_docs: int, fractions: tuple[float, float, float]) -> list[range]:
    """The train, validation and test document ranges of ``num_docs`` documents (contiguous, in order, covering
    all): part ``k`` is ``[round(c[k] * n), round(c[k+1] * n))`` with ``c`` the cumulative fractions."""
    bounds = [0.0]
    for f in fractions:
        bounds.append(bounds[-1] + f)
    ends = [int(round(b * float(num_docs))) for b in bounds]
    ends[-1] = num_docs  # the cumulative sum may fall a rounding error short of 1
    return [range(ends[k], ends[k + 1]) for k in range(3)]
