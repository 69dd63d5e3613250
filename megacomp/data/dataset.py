"""The corpus tokenized once into a flat memory-mapped token file, served as fixed-length samples.

``build_token_file(files, tokenizer, prefix)`` writes ``prefix.bin`` (every document's tokens followed by
EOS, concatenated; uint16 when the vocabulary fits, else uint32) and ``prefix.idx.json`` (dtype, token
count, document offsets and paths, tokenizer and corpus fingerprints). Both are written to temporary
files and renamed, the index last, so an index always describes a complete token file; a token file
whose fingerprints match is reused. ``TokenDataset(prefix, seq_length)`` memory-maps it read-only
(nanoGPT-style): sample ``i`` is tokens ``[i*s, i*s + s + 1)``, i.e. an input and its next-token targets.
Nothing is unpickled: the index is JSON (checked field by field) and the token file raw integers.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from .corpus import corpus_fingerprint, iter_documents
from .cache_files import atomic_write as _atomic_write, build_lock, new_temporary, remove_stale_temporaries
from .tokenizer import Tokenizer, _mb, _say

_FORMAT = 1
_BATCH_DOCS = 64  # documents tokenized per encode_batch call
_PROGRESS_SECONDS = 10.0  # a progress line at most this often while tokenizing
_DTYPES = ("uint16", "uint32")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _paths(prefix: str) -> tuple[str, str]:
    return prefix + ".bin", prefix + ".idx.json"


def read_index(prefix: str) -> dict[str, Any]:
    """The metadata of the token file ``prefix`` (``prefix.idx.json``).

    Raises:
        FileNotFoundError: the index does not exist.
        ValueError: the index has another format version, is not valid JSON (truncated, garbled) or lacks
            a field; the message names the file and says to delete ``prefix.*`` and rebuild
            (``prepare_data`` and ``build_token_file`` rebuild such a token file by themselves).
    """
    bin_path, idx_path = _paths(prefix)
    if not os.path.isfile(idx_path):
        raise FileNotFoundError(f"token file index {idx_path!r} does not exist; build it with "
                                f"megacomp.data.build_token_file(files, tokenizer, {prefix!r}) or prepare_data()")
    fix = f"delete {prefix}.* and run again to rebuild it"
    try:
        with open(idx_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"token file index {idx_path!r} is truncated or corrupt (not JSON: {e}); {fix}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"token file index {idx_path!r} is corrupt (a JSON {type(meta).__name__}, not an "
                         f"object); {fix}")
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{idx_path!r} has format {meta.get('format')}, expected {_FORMAT}; {fix}")
    bad = _bad_fields(meta)
    if bad:
        raise ValueError(f"token file index {idx_path!r} is corrupt ({bad}); {fix}")
    return meta


def _bad_fields(meta: dict) -> str:
    """What is wrong with an index's fields ('' when nothing): types and the offsets' ends only (cheap)."""
    ints = ("num_tokens", "num_docs", "vocab_size", "eos_id")
    for key in ints:
        if not isinstance(meta.get(key), int) or meta[key] < 0:
            return f"{key} is {meta.get(key)!r}, not a count"
    for key in ("tokenizer_fingerprint", "corpus_fingerprint"):
        if not isinstance(meta.get(key), str):
            return f"{key} is missing"
    if meta.get("dtype") not in _DTYPES:
        return f"dtype is {meta.get('dtype')!r}, not one of {', '.join(_DTYPES)}"
    offsets = meta.get("doc_offsets")
    if (not isinstance(offsets, list) or len(offsets) != meta["num_docs"] + 1 or offsets[0] != 0
            or offsets[-1] != meta["num_tokens"]):
        return "doc_offsets do not run from 0 to num_tokens over num_docs documents"
    if not isinstance(meta.get("doc_paths"), list) or len(meta["doc_paths"]) != meta["num_docs"]:
        return "doc_paths does not list num_docs documents"
    return ""


def _is_current(prefix: str, tokenizer_fp: str, corpus_fp: str, say: bool = True) -> bool:
    bin_path, _ = _paths(prefix)
    try:
        meta = read_index(prefix)
    except FileNotFoundError:
        return False
    except ValueError as e:  # a truncated, garbled or outdated index: rebuilt, and said so (once: under the lock)
        if say:
            _say(f"{str(e).rsplit('; ', 1)[0]}; building the token file again")
        return False
    return (meta["tokenizer_fingerprint"] == tokenizer_fp and meta["corpus_fingerprint"] == corpus_fp
            and os.path.isfile(bin_path)
            and os.path.getsize(bin_path) == meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize)


def build_token_file(files: Sequence[str], tokenizer: Tokenizer, out_prefix: str, *,
                     num_threads: int | None = None, json_keys: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Tokenize the documents of ``files`` (a plain file is one document, a JSON-lines file one per line and key
    of ``json_keys``: :func:`~megacomp.data.corpus.iter_documents`; EOS after each) into ``out_prefix.bin`` +
    ``.idx.json``; return the index. Reuses an existing token file built from the same tokenizer and corpus
    fingerprint. ``tokenizer``: any :class:`~megacomp.data.tokenizer_files.TokenizerLike`.

    ``num_threads``: encode threads (default ``min(8, cpu_count)``). Files are tokenized in batches; the
    token file and then the index are written to temporary files and renamed, so an index always describes
    a complete token file. Tokenizing says so on stderr (``megacomp: tokenizing N files (X MB) -> PATH
    (one time)``, a progress line about every 10 s, then the token count and the seconds it took).

    Raises:
        ValueError: ``files`` is empty.
    """
    files = list(files)
    if not files:
        raise ValueError("corpus is empty: build_token_file got no files; use megacomp.data.collect_files(paths)")
    tok_fp, corpus_fp = tokenizer.fingerprint, corpus_fingerprint(files, json_keys)
    if _is_current(out_prefix, tok_fp, corpus_fp, say=False):
        return read_index(out_prefix)
    bin_path, idx_path = _paths(out_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    with build_lock(bin_path):  # one job builds; one that waited here finds the token file built
        if _is_current(out_prefix, tok_fp, corpus_fp):
            return read_index(out_prefix)
        for path in (bin_path, idx_path):
            remove_stale_temporaries(path)
        return _write_token_file(files, tokenizer, out_prefix, tok_fp, corpus_fp, num_threads, json_keys)


def _document_batches(files: list, json_keys) -> Iterator[tuple[int, list[tuple[str, str]]]]:
    """``(files started, [(name, text), ...])`` batches of ``_BATCH_DOCS`` documents in corpus order."""
    batch: list[tuple[str, str]] = []
    for done, path in enumerate(files, start=1):
        for doc in iter_documents(path, json_keys):
            batch.append(doc)
            if len(batch) == _BATCH_DOCS:
                yield done, batch
                batch = []
    if batch:
        yield len(files), batch


def _write_token_file(files: list, tokenizer: Tokenizer, out_prefix: str, tok_fp: str, corpus_fp: str,
                      num_threads: int | None, json_keys=None) -> dict[str, Any]:
    """Tokenize and write the token file and its index (under build_token_file's lock)."""
    bin_path, idx_path = _paths(out_prefix)
    dtype = token_dtype(tokenizer.vocab_size)
    threads = num_threads or max(1, min(8, os.cpu_count() or 1))
    offsets, names = [0], []
    _say(f"tokenizing {len(files)} files ({_mb(sum(os.path.getsize(p) for p in files))}) -> {bin_path} (one time)")
    began = last = time.perf_counter()
    fd, tmp_bin = new_temporary(bin_path)
    try:
        with os.fdopen(fd, "wb") as f:
            for done, batch in _document_batches(files, json_keys):
                for ids in tokenizer.encode_batch([text for _, text in batch], num_threads=threads):
                    ids = list(ids) + [tokenizer.eos_id]
                    np.asarray(ids, dtype=dtype).tofile(f)
                    offsets.append(offsets[-1] + len(ids))
                names.extend(name for name, _ in batch)
                now = time.perf_counter()
                if now - last >= _PROGRESS_SECONDS and done < len(files):
                    last = now
                    _say(f"tokenizing: {done}/{len(files)} files ({100 * done // len(files)}%), "
                         f"{offsets[-1]:,} tokens, {now - began:.0f} s")
            f.flush()
            os.fsync(f.fileno())
        meta = dict(format=_FORMAT, dtype=dtype.name, num_tokens=offsets[-1], num_docs=len(names),
                    vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                    tokenizer_fingerprint=tok_fp, corpus_fingerprint=corpus_fp,
                    tokenizer_model=tokenizer.model_path, doc_offsets=offsets, doc_paths=names)
        if os.path.exists(idx_path):
            os.unlink(idx_path)  # never leave an index next to a token file it does not describe
        os.replace(tmp_bin, bin_path)
    except BaseException:
        if os.path.exists(tmp_bin):
            os.unlink(tmp_bin)
        raise
    _atomic_write(idx_path, json.dumps(meta).encode("utf-8"))
    docs = f" ({len(names)} documents)" if len(names) != len(files) else ""
    _say(f"tokenized {len(files)} files{docs} into {offsets[-1]:,} tokens in {time.perf_counter() - began:.1f} s")
    return meta


class TokenDataset(torch.utils.data.Dataset):
    """Non-overlapping samples of ``seq_length + 1`` tokens (int64) from a token file.

    ``len(ds) == (num_tokens - 1) // seq_length``: sample ``i`` starts at token ``i * seq_length`` and its
    last token is the first of sample ``i + 1``, so every token is a target exactly once. Samples run
    across document boundaries (separated by EOS), as in GPT pretraining. Negative indices count from the
    end; others out of range raise IndexError.

    ``documents`` (a ``range`` of document indices, e.g. one part of ``--split``): the samples run over those
    documents' tokens only, ``len(ds) == max(0, (window_tokens - 1) // seq_length)`` (the caller decides whether
    an empty part is an error); None = every token, as above.

    Raises:
        FileNotFoundError, ValueError: a missing, outdated, truncated or corrupt index (see
            :func:`read_index`).
        ValueError: ``seq_length`` < 1; the ``.bin`` file is missing or not the size its index says; fewer
            than ``seq_length + 1`` tokens (without ``documents``); a ``documents`` range outside the file.
    """

    def __init__(self, prefix: str, seq_length: int, documents: Optional[range] = None):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.prefix = prefix
        self.seq_length = seq_length
        self.meta = read_index(prefix)
        self.dtype = np.dtype(self.meta["dtype"])
        self.num_tokens: int = self.meta["num_tokens"]
        self.eos_id: int = self.meta["eos_id"]
        self.vocab_size: int = self.meta["vocab_size"]
        self.doc_offsets: list[int] = self.meta["doc_offsets"]
        bin_path = _paths(prefix)[0]
        expected = self.num_tokens * self.dtype.itemsize
        if not os.path.isfile(bin_path) or os.path.getsize(bin_path) != expected:
            raise ValueError(f"token file {bin_path!r} is missing or not {expected} bytes as its index says; "
                             f"delete {prefix}.* and rebuild it")
        if documents is None and self.num_tokens < seq_length + 1:
            raise ValueError(f"token file {bin_path!r} has {self.num_tokens} tokens, fewer than seq_length + 1 = "
                             f"{seq_length + 1} needed for one sample; lower seq_length or add text to the corpus")
        if documents is not None and (documents.step != 1
                                      or not 0 <= documents.start <= documents.stop <= self.num_docs):
            raise ValueError(f"documents {documents} is not a contiguous range inside the {self.num_docs} documents "
                             f"of {prefix}")
        self.documents = documents
        self.window = ((0, self.num_tokens) if documents is None else
                       (self.doc_offsets[documents.start], self.doc_offsets[documents.stop]))
        """The token range ``[begin, end)`` the samples run over."""
        self._tokens = None

    @property
    def tokens(self) -> np.memmap:
        """All tokens, memory-mapped read-only (opened lazily, so pickling the dataset copies no data)."""
        if self._tokens is None:
            self._tokens = np.memmap(_paths(self.prefix)[0], dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._tokens

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return max(0, (self.window[1] - self.window[0] - 1) // self.seq_length)

    def __getitem__(self, index: int) -> torch.Tensor:
        n = len(self)
        index = int(index)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples")
        start = self.window[0] + (index % n) * self.seq_length
        return torch.from_numpy(self.tokens[start:start + self.seq_length + 1].astype(np.int64))

    @property
    def num_docs(self) -> int:
        """Number of documents (corpus files) in the token file."""
        return len(self.doc_offsets) - 1

    def document(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` (``doc_paths[i]`` in the index), without its trailing EOS.

        ``0 <= i < num_docs``: a larger ``i`` raises IndexError; negative ``i`` is not supported.
        """
        return np.asarray(self.tokens[self.doc_offsets[i]:self.doc_offsets[i + 1] - 1])
