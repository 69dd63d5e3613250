"""``prepare_data``: the tokenizer and the token file of a text corpus, built once (on rank 0 under
``torch.distributed``) and cached by fingerprint; see :func:`prepare_data`."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from .corpus import collect_files, corpus_fingerprint, default_corpus_files
from .dataset import TokenDataset, build_token_file
from .tokenizer import DEFAULT_MAX_BYTES, Tokenizer, train_tokenizer
from .tokenizer_files import TokenizerLike


def default_cache_dir() -> str:
    """``$MEGACOMP_DATA_CACHE``, else ``~/.cache/megacomp/data``."""
    return os.environ.get("MEGACOMP_DATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megacomp", "data")


def _build(corpus_paths, vocab_size: int, cache_dir: str, max_bytes: int, seed: int, tokenizer=None,
           json_keys=None) -> tuple[Tokenizer, str]:
    files = default_corpus_files() if corpus_paths is None else collect_files(corpus_paths)
    if tokenizer is None:
        tokenizer = train_tokenizer(files, vocab_size, os.path.join(cache_dir, "tokenizers"), max_bytes=max_bytes,
                                    seed=seed, json_keys=json_keys)
    prefix = os.path.join(cache_dir, "tokens", f"v{tokenizer.vocab_size}-{tokenizer.fingerprint[:12]}-"
                                               f"{corpus_fingerprint(files, json_keys)[:12]}")
    build_token_file(files, tokenizer, prefix, json_keys=json_keys)
    return tokenizer, prefix


class DataPreparationFailed(ValueError):
    """Raised on ranks other than 0 when rank 0 could not build the tokenizer or the token file."""


def prepare_data(corpus_paths: Optional[Sequence[str]] = None, vocab_size: int = 8192, seq_length: int = 1024,
                 cache_dir: Optional[str] = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 seed: int = 0, tokenizer: Optional[TokenizerLike] = None,
                 json_keys: Optional[Sequence[str]] = None) -> tuple[TokenizerLike, TokenDataset]:
    """Train (or load) the tokenizer and build (or reuse) the token file; return ``(tokenizer, dataset)``.

    ``corpus_paths``: files and directories (see ``collect_files``); None = the Python standard library's
    sources. JSON-lines files (``*.jsonl``) hold one document per line under each of ``json_keys`` (default
    ``text``). ``tokenizer``: a tokenizer from files (:func:`~megacomp.data.tokenizer_files.build_tokenizer`,
    which every rank builds alike) instead of training one (``vocab_size``, ``max_bytes`` and ``seed`` then do
    not apply). Everything is cached under ``cache_dir`` (default ``default_cache_dir()``) by fingerprint, so
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
        tokenizer, prefix = _build(corpus_paths, vocab_size, cache_dir, max_bytes, seed, tokenizer, json_keys)
        return tokenizer, TokenDataset(prefix, seq_length)

    error = None
    if dist.get_rank() == 0:
        try:
            tokenizer, prefix = _build(corpus_paths, vocab_size, cache_dir, max_bytes, seed, tokenizer, json_keys)
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
