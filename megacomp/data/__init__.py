"""The GPT pretraining data pipeline: corpus files -> sentencepiece BPE tokenizer -> memory-mapped token
file -> fixed-length samples -> deterministic data-parallel micro-batches.

```python
from megacomp.data import prepare_data, DistributedBatchSampler, get_batch

tokenizer, dataset = prepare_data(vocab_size=8192, seq_length=512)     # default corpus: Python's stdlib
sampler = DistributedBatchSampler(len(dataset), micro_batch_size=8, dp_rank=r, dp_size=d, seed=1234,
                                  start_iteration=resumed_iteration)
for iteration, indices in enumerate(sampler, start=resumed_iteration):
    tokens, labels = get_batch(dataset, indices)                          # int64 [8, 512] each
```
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from .corpus import collect_files, corpus_fingerprint, default_corpus_files
from .dataset import TokenDataset, build_token_file, read_index, token_dtype
from .sampler import DistributedBatchSampler, get_batch
from .tokenizer import DEFAULT_MAX_BYTES, Tokenizer, train_tokenizer

__all__ = ["collect_files", "corpus_fingerprint", "default_corpus_files", "Tokenizer", "train_tokenizer",
           "build_token_file", "read_index", "token_dtype", "TokenDataset", "DistributedBatchSampler", "get_batch",
           "prepare_data", "default_cache_dir"]


def default_cache_dir() -> str:
    """``$MEGACOMP_DATA_CACHE``, else ``~/.cache/megacomp/data``."""
    return os.environ.get("MEGACOMP_DATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megacomp", "data")


def _build(corpus_paths, vocab_size: int, cache_dir: str, max_bytes: int, seed: int) -> tuple[Tokenizer, str]:
    files = default_corpus_files() if corpus_paths is None else collect_files(corpus_paths)
    tokenizer = train_tokenizer(files, vocab_size, os.path.join(cache_dir, "tokenizers"), max_bytes=max_bytes,
                                seed=seed)
    prefix = os.path.join(cache_dir, "tokens", f"v{vocab_size}-{tokenizer.fingerprint[:12]}-"
                                               f"{corpus_fingerprint(files)[:12]}")
    build_token_file(files, tokenizer, prefix)
    return tokenizer, prefix


class DataPreparationFailed(ValueError):
    """Raised on ranks other than 0 when rank 0 could not build the tokenizer or the token file."""


def prepare_data(corpus_paths: Optional[Sequence[str]] = None, vocab_size: int = 8192, seq_length: int = 1024,
                 cache_dir: Optional[str] = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 seed: int = 0) -> tuple[Tokenizer, TokenDataset]:
    """Train (or load) the tokenizer and build (or reuse) the token file; return ``(tokenizer, dataset)``.

    ``corpus_paths``: files and directories (see ``collect_files``); None = the Python standard library's
    sources. Everything is cached under ``cache_dir`` (default ``default_cache_dir()``) by fingerprint, so
    a second call only loads. Under an initialized ``torch.distributed`` only global rank 0 builds, then
    broadcasts the model and token-file paths (or its error) to the other ranks, which load exactly those
    files: ``cache_dir`` must be on a file system all ranks see. Under NCCL set each rank's CUDA device
    first (the broadcast of the paths uses it).

    The process that builds says so on stderr (``megacomp: training the tokenizer on ...``, ``megacomp:
    tokenizing ...``, each with a done line and its seconds); a call served from the cache says nothing.
    Cache files are read as data only (a sentencepiece model, JSON, raw integers: nothing is unpickled); a
    truncated or garbled cached tokenizer model or token-file index is built again, with a line saying so.

    Raises:
        FileNotFoundError: a corpus path that does not exist.
        ValueError: an empty corpus or a named file that is not UTF-8 text (:func:`collect_files`); a
            ``vocab_size`` that is too small or does not fit the corpus (:func:`train_tokenizer`);
            ``seq_length`` < 1 or longer than the token file allows (:class:`TokenDataset`).
        DataPreparationFailed (a ValueError): on ranks other than 0 when rank 0 failed (its message
            included), so that the entry point treats it as the same bad input; rank 0 raises its
            own error.
    """
    import torch.distributed as dist

    cache_dir = cache_dir or default_cache_dir()
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        tokenizer, prefix = _build(corpus_paths, vocab_size, cache_dir, max_bytes, seed)
        return tokenizer, TokenDataset(prefix, seq_length)

    tokenizer, error = None, None
    if dist.get_rank() == 0:
        try:
            tokenizer, prefix = _build(corpus_paths, vocab_size, cache_dir, max_bytes, seed)
            payload = [(tokenizer.model_path, prefix, None)]
        except Exception as e:  # tell the other ranks instead of leaving them waiting
            error = e
            payload = [(None, None, f"{type(e).__name__}: {e}")]
    else:
        payload = [None]
    dist.broadcast_object_list(payload, src=0)
    if error is not None:
        raise error
    model_path, prefix, message = payload[0]
    if message is not None:
        raise DataPreparationFailed(f"rank 0 failed to prepare the data, so rank {dist.get_rank()} stops too: {message}")
    if tokenizer is None:
        tokenizer = Tokenizer(model_path)
    return tokenizer, TokenDataset(prefix, seq_length)
