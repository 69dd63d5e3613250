"""The training, validation and test datasets of a run, from Megatron-style data flags.

``build_datasets(data_path, seq_length, ...)`` picks the source from ``data_path`` (:mod:`megacomp.data.blend`):

- None, or corpus files / folders (plain text, ``*.jsonl``): tokenized into megacomp's token cache by
  :func:`~megacomp.data.prepare_data`, with the tokenizer ``tokenizer_type`` names or, without one, a
  sentencepiece BPE trained on the corpus (today's default, unchanged);
- Megatron indexed datasets (``PREFIX`` of ``PREFIX.bin`` / ``PREFIX.idx``), one, several, or weighted
  (``0.7 a 0.3 b``): read with megatron-core's reader (:mod:`megacomp.data.indexed`); they need the tokenizer
  they were preprocessed with (``tokenizer_type`` and its files), whose vocabulary is checked against the
  largest token id.

``split`` (Megatron's ``--split``, e.g. ``969,30,1``) cuts each source's documents into train, validation and
test (:mod:`megacomp.data.split`); a weighted blend blends each part with the same weights. ``split=None`` (the
default) is no split: every document trains, the samples are today's (the same as ``100,0,0``), and there is no
validation or test set. A part without one full sample is None; :meth:`Datasets.require` turns that into the
one-line error a caller that needs the part (evaluation) raises.

Failure behaviour: every bad input (unknown tokenizer type, missing file, unparsable weights or split, indexed
data without its tokenizer or with another one, no training sample) raises ValueError with one line naming the
fix (FileNotFoundError for a corpus path that does not exist, as :func:`~megacomp.data.collect_files`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .blend import BlendedDataset, parse_data_path
from .dataset import TokenDataset
from .indexed import IndexedTokenDataset, check_vocab, looks_indexed
from .prepare import prepare_data
from .split import SPLIT_NAMES, parse_split, split_documents
from .tokenizer import DEFAULT_MAX_BYTES
from .tokenizer_files import TokenizerLike, build_tokenizer, describe



def _word(part: str) -> str:
    return {"train": "training", "valid": "validation"}.get(part, part)


@dataclass
class Datasets:
    """A run's tokenizer and datasets (see the module docstring)."""

    tokenizer: TokenizerLike
    """The tokenizer (the model's vocabulary follows its ``vocab_size``)."""
    train: torch.utils.data.Dataset
    """Training samples (never empty)."""
    valid: Optional[torch.utils.data.Dataset] = None
    """Validation samples; None without ``split`` or when its part has no full sample."""
    test: Optional[torch.utils.data.Dataset] = None
    """Test samples; None as ``valid``."""
    split: Optional[str] = None
    """The ``split`` as given (None: no split)."""
    documents: dict = field(default_factory=dict)
    """Documents per part (``train``, ``valid``, ``test``), summed over the sources."""
    seq_length: int = 0
    """Tokens per sample (each sample holds one more)."""

    @property
    def samples(self) -> dict:
        """Samples per part (0 for an empty one)."""
        return {name: len(getattr(self, name)) if getattr(self, name) is not None else 0 for name in SPLIT_NAMES}

    def require(self, part: str, because: str) -> torch.utils.data.Dataset:
        """The dataset of ``part`` (``valid`` or ``test``); ValueError (one line, ``because`` says who needs it,
        e.g. ``"--eval-interval 100"``) when it is empty."""
        data = getattr(self, part)
        if data is not None:
            return data
        total = sum(self.documents.values())
        if self.split is None:
            raise ValueError(f"{because} needs a {_word(part)} set, but without --split every document "
                             f"trains; give it a share, e.g. --split 969,30,1 (train, validation, test by document)")
        raise ValueError(f"{because} needs a {_word(part)} set, but --split {self.split} leaves it "
                         f"{self.documents.get(part, 0)} of {total} documents and no sample of {self.seq_length + 1} "
                         f"tokens; give it a larger share (e.g. --split 969,30,1) or more data")


def _combine(parts: list, weights: Optional[list], seed: int, part: str, prefixes: Sequence[str]):
    """One dataset from the sources' datasets of one part: a weighted blend, else their concatenation."""
    keep = [i for i, d in enumerate(parts) if len(d) > 0]
    if part == "train" and len(keep) < len(parts):
        empty = prefixes[next(i for i, d in enumerate(parts) if len(d) == 0)]
        raise ValueError(f"{empty} has no training sample of seq_length + 1 tokens ({parts[0].seq_length + 1}); "
                         f"lower --seq-length, give its training part a larger --split share, or leave it out")
    if not keep:
        return None
    if len(keep) == 1:
        return parts[keep[0]]
    if weights is None:
        return torch.utils.data.ConcatDataset([parts[i] for i in keep])
    return BlendedDataset([parts[i] for i in keep], [weights[i] for i in keep], seed=seed)


def _indexed(prefixes, weights, tokenizer, seq_length: int, fractions, seed: int):
    if tokenizer is None:
        raise ValueError(f"indexed data ({prefixes[0]}) holds token ids: give the tokenizer it was preprocessed with "
                         f"(--tokenizer-type with --tokenizer-model, or --vocab-file and --merge-file)")
    by_part = {name: [] for name in SPLIT_NAMES}
    documents = dict.fromkeys(SPLIT_NAMES, 0)
    for prefix in prefixes:
        whole = IndexedTokenDataset(prefix, seq_length)
        check_vocab(whole, tokenizer.vocab_size, describe(tokenizer))
        ranges = (split_documents(whole.num_docs, fractions) if fractions is not None
                  else [whole.documents, range(0), range(0)])
        for name, docs in zip(SPLIT_NAMES, ranges):
            by_part[name].append(whole if docs == whole.documents else IndexedTokenDataset(prefix, seq_length, docs))
            documents[name] += len(docs)
    sets = {name: _combine(by_part[name], weights, seed, name, prefixes) for name in SPLIT_NAMES}
    return sets, documents


def build_datasets(data_path: Optional[Sequence[str]], seq_length: int, *, vocab_size: int = 8192,
                   cache_dir: Optional[str] = None, max_bytes: Optional[int] = None, seed: int = 0,
                   tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None,
                   vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                   json_keys: Optional[Sequence[str]] = None, split: Optional[str] = None) -> Datasets:
    """The run's :class:`Datasets` (see the module docstring).

    Args:
        data_path: None (the default corpus), corpus files / folders, or indexed prefixes with optional weights.
        seq_length: tokens per sample.
        vocab_size: the vocabulary to train when no ``tokenizer_type`` is given.
        cache_dir: the token cache (:func:`prepare_data`).
        max_bytes: the text the tokenizer trains on (:func:`prepare_data`).
        seed: seeds the blend's walk over each dataset (the sampler's order has its own seed).
        tokenizer_type: Megatron's ``--tokenizer-type`` (:func:`~megacomp.data.tokenizer_files.build_tokenizer`).
        tokenizer_model: ``--tokenizer-model``: a tokenizer.json, its folder, or a sentencepiece model.
        vocab_file: ``--vocab-file`` (GPT2BPETokenizer's vocab.json).
        merge_file: ``--merge-file`` (GPT2BPETokenizer's merges.txt).
        json_keys: the JSON keys of ``*.jsonl`` corpus files (default ``text``).
        split: Megatron's ``--split`` (None: no split).

    Raises:
        ValueError, FileNotFoundError: see the module docstring.
    """
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    fractions = parse_split(split) if split is not None else None
    prefixes, weights = parse_data_path(data_path) if data_path is not None else (None, None)
    if prefixes is not None and (weights is not None or any(looks_indexed(p) for p in prefixes)):
        sets, documents = _indexed(prefixes, weights, tokenizer, seq_length, fractions, seed)
        return Datasets(tokenizer, sets["train"], sets["valid"], sets["test"], split, documents, seq_length)
    tokenizer, whole = prepare_data(prefixes, vocab_size, seq_length, cache_dir,
                                    max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes,
                                    tokenizer=tokenizer, json_keys=json_keys)
    if fractions is None:
        return Datasets(tokenizer, whole, split=None, documents={"train": whole.num_docs, "valid": 0, "test": 0},
                        seq_length=seq_length)
    parts = []
    for docs in split_documents(whole.num_docs, fractions):
        part = TokenDataset(whole.prefix, seq_length, documents=docs)
        parts.append(part if len(part) > 0 else None)
    if parts[0] is None:
        raise ValueError(f"--split {split} leaves the training part of the corpus ({whole.num_docs} documents) no "
                         f"sample of {seq_length + 1} tokens; give training a larger share or add text")
    documents = {name: len(docs) for name, docs in zip(SPLIT_NAMES, split_documents(whole.num_docs, fractions))}
    return Datasets(tokenizer, parts[0], parts[1], parts[2], split, documents, seq_length)
