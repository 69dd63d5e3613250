"""Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, what Megatron-LM's tools/preprocess_data.py and
``megacomp-preprocess-data`` write) served as fixed-length samples.

The files are read with megatron-core's own reader, ``megatron.core.datasets.indexed_dataset.IndexedDataset``
(memory-mapped); megacomp keeps no copy of the format. :class:`IndexedTokenDataset` concatenates the sequences
of a range of documents (Megatron's GPT split unit: one sequence per document unless the data was preprocessed
with ``--split-sentences``) and serves sample ``i`` as tokens ``[i*s, i*s + s + 1)`` of that stream: the
contract of :class:`~megacomp.data.dataset.TokenDataset` (int64 tensors of ``seq_length + 1``), so ``get_batch``
and ``DistributedBatchSampler`` work unchanged, and every sample is a function of the files and ``i`` alone
(deterministic across data-parallel ranks and resumes).

Failure behaviour: without megatron-core installed, a missing ``.idx`` or ``.bin``, an index megatron-core
cannot read or a ``.bin`` of another size than its index says: ValueError, one line naming the file and the
fix. :func:`check_vocab` compares the largest token id (of every token up to ``_CHECK_TOKENS``, else of evenly
spaced windows of that many in all) with the tokenizer's vocabulary.
"""
from __future__ import annotations

import os
import struct
import warnings
from typing import Optional

import numpy as np
import torch

_CHECK_TOKENS = 1 << 22  # tokens read by check_vocab: every token of a dataset this small, else this many
_CHECK_WINDOWS = 64  # ... in this many evenly spaced windows


def megatron_indexed():
    """megatron-core's ``indexed_dataset`` module.

    Raises:
        ValueError: megatron-core is not installed (one line: how to install it).
    """
    try:
        with warnings.catch_warnings():
            # importing megatron.core warns that Transformer Engine and Apex are missing: irrelevant to reading files
            warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
            from megatron.core.datasets import indexed_dataset
    except ImportError:
        raise ValueError("Megatron indexed data (PREFIX.bin / PREFIX.idx) is read and written with megatron-core's "
                         "own reader and builder: pip install megatron-core") from None
    return indexed_dataset


def looks_indexed(path: str) -> bool:
    """True when ``path`` is the prefix of an indexed dataset (``path.idx`` or ``path.bin`` exists), or names one
    of its files."""
    return (os.path.isfile(path + ".idx") or os.path.isfile(path + ".bin")
            or (path.endswith((".idx", ".bin")) and os.path.isfile(path)))


def check_prefix(prefix: str) -> str:
    """``prefix`` (a ``.idx`` / ``.bin`` suffix removed) when both its files exist.

    Raises:
        ValueError: a file is missing (one line naming it and the fix).
    """
    if prefix.endswith((".idx", ".bin")):
        prefix = prefix[:-4]
    for suffix in (".idx", ".bin"):
        if not os.path.isfile(prefix + suffix):
            raise ValueError(f"indexed dataset {prefix!r} has no {prefix}{suffix}; --data-path takes the prefix of a "
                             f"PREFIX.bin / PREFIX.idx pair (megacomp-preprocess-data or Megatron's "
                             f"preprocess_data.py writes OUTPUT_PREFIX_text_document.bin/.idx)")
    return prefix


def open_indexed(prefix: str):
    """megatron-core's ``IndexedDataset`` for ``prefix`` (memory-mapped), checked against its ``.bin`` size.

    Raises:
        ValueError: megatron-core missing (:func:`megatron_indexed`), a missing file (:func:`check_prefix`), an
            index megatron-core cannot read, or a ``.bin`` whose size is not the tokens its index lists.
    """
    prefix = check_prefix(prefix)
    module = megatron_indexed()
    # refused before megatron-core's reader sees them: it cannot map an empty .bin, and a reader that fails half-built
    # prints "Exception ignored in __del__" tracebacks after our line
    header = getattr(module, "_INDEX_HEADER", b"")
    with open(prefix + ".idx", "rb") as f:
        if f.read(len(header)) != header:
            raise ValueError(f"{prefix}.idx is not a Megatron index (its header is not megatron-core's); write it "
                             f"again with megacomp-preprocess-data or Megatron's preprocess_data.py")
    if os.path.getsize(prefix + ".bin") == 0:
        raise ValueError(f"{prefix}.bin is empty: the dataset holds no tokens; preprocess a corpus with text")
    try:
        data = module.IndexedDataset(prefix, multimodal=False, mmap=True)
    except (AssertionError, ValueError, KeyError, struct.error) as e:  # megatron-core asserts on a bad header
        raise ValueError(f"{prefix}.idx is not an index megatron-core can read ({e or type(e).__name__}); write it "
                         f"again with megacomp-preprocess-data or Megatron's preprocess_data.py") from None
    itemsize = np.dtype(data.index.dtype).itemsize
    expected = int(np.asarray(data.sequence_lengths, dtype=np.int64).sum()) * itemsize
    actual = os.path.getsize(prefix + ".bin")
    if actual != expected:
        raise ValueError(f"{prefix}.bin has {actual} bytes, its index lists {expected} ({itemsize}-byte tokens): the "
                         f"pair is truncated or from two runs; write it again with megacomp-preprocess-data")
    return data


class IndexedTokenDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens (int64) over the concatenated documents ``documents`` of an indexed
    dataset.

    ``len(ds) == max(0, (num_tokens - 1) // seq_length)`` where ``num_tokens`` counts the tokens of the chosen
    documents; sample ``i`` starts at token ``i * seq_length`` and its last token is the first of sample ``i + 1``
    (as :class:`~megacomp.data.dataset.TokenDataset`). Samples run across document boundaries (the data carries
    its own end-of-document tokens when preprocessed with ``--append-eod``). Negative indices count from the end;
    others out of range raise IndexError. Pickles as its prefix and document range (megatron-core's reader
    reopens the files).

    Args:
        prefix: the ``PREFIX`` of ``PREFIX.bin`` / ``PREFIX.idx``.
        seq_length: tokens per sample (each sample holds one more: the last target).
        documents: a ``range`` of document (sequence) indices; None = all.

    Raises:
        ValueError: ``seq_length`` < 1; a range outside the dataset; and as :func:`open_indexed`.
    """

    def __init__(self, prefix: str, seq_length: int, documents: Optional[range] = None):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.indexed = open_indexed(prefix)
        self.prefix = self.indexed.path_prefix
        self.seq_length = seq_length
        lengths = np.asarray(self.indexed.sequence_lengths, dtype=np.int64)
        documents = range(len(lengths)) if documents is None else documents
        if documents.step != 1 or not 0 <= documents.start <= documents.stop <= len(lengths):
            raise ValueError(f"documents {documents} is not a contiguous range inside the {len(lengths)} documents "
                             f"of {self.prefix}")
        self.documents = documents
        self._offsets = np.zeros(len(documents) + 1, dtype=np.int64)
        np.cumsum(lengths[documents.start:documents.stop], out=self._offsets[1:])
        self.num_tokens = int(self._offsets[-1])
        """Tokens of the chosen documents."""

    @property
    def num_docs(self) -> int:
        """Documents (sequences) in this dataset's range."""
        return len(self.documents)

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_length)

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` of the concatenated documents (their stored dtype), read document by
        document with megatron-core's ``IndexedDataset.get``; ``0 <= start``, ``start + count <= num_tokens``."""
        out = []
        doc = int(np.searchsorted(self._offsets, start, side="right")) - 1
        while count > 0:
            offset = start - int(self._offsets[doc])
            take = min(count, int(self._offsets[doc + 1]) - start)
            if take > 0:
                out.append(self.indexed.get(self.documents.start + doc, offset=offset, length=take))
                start += take
                count -= take
            doc += 1
        return np.concatenate(out) if len(out) != 1 else out[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        n = len(self)
        index = int(index)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples")
        tokens = self.read((index % n) * self.seq_length, self.seq_length + 1)
        return torch.from_numpy(tokens.astype(np.int64))

    def max_token_id(self) -> int:
        """The largest token id among every token when there are at most ``_CHECK_TOKENS``, else among
        ``_CHECK_WINDOWS`` evenly spaced windows of ``_CHECK_TOKENS / _CHECK_WINDOWS`` tokens (a bound on the cost,
        not a proof: an id outside every window is not seen); -1 when there are no tokens."""
        if self.num_tokens == 0:
            return -1
        if self.num_tokens <= _CHECK_TOKENS:
            windows = [(start, min(_CHECK_TOKENS // _CHECK_WINDOWS, self.num_tokens - start))
                       for start in range(0, self.num_tokens, _CHECK_TOKENS // _CHECK_WINDOWS)]
        else:
            size = _CHECK_TOKENS // _CHECK_WINDOWS
            starts = np.linspace(0, self.num_tokens - size, _CHECK_WINDOWS).astype(np.int64)
            windows = [(int(s), size) for s in starts]
        return max(int(self.read(start, count).max()) for start, count in windows)

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix, "seq_length": self.seq_length, "documents": self.documents}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"], state["seq_length"], state["documents"])

    def __repr__(self) -> str:
        return (f"IndexedTokenDataset({self.prefix!r}, seq_length={self.seq_length}, documents={self.documents}: "
                f"{len(self)} samples)")


def check_vocab(dataset: IndexedTokenDataset, vocab_size: int, tokenizer_name: str) -> None:
    """Refuse data whose token ids do not fit the tokenizer's vocabulary (see :meth:`IndexedTokenDataset.max_token_id`
    for which tokens are read).

    Raises:
        ValueError: a token id >= ``vocab_size`` (one line: the data was preprocessed with another tokenizer).
    """
    top = dataset.max_token_id()
    if top >= vocab_size:
        raise ValueError(f"indexed data {dataset.prefix} holds token id {top}, but the tokenizer ({tokenizer_name}) "
                         f"has {vocab_size} ids: the data was preprocessed with another tokenizer; pass the "
                         f"--tokenizer-type and --tokenizer-model (or --vocab-file / --merge-file) it was made with")
