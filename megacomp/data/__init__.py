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

Megatron-LM's data flags (``--data-path`` with indexed datasets and blend weights, ``--split``,
``--tokenizer-type``): :func:`build_datasets` returns the training, validation and test sets; Megatron indexed
datasets are read with megatron-core's reader (:class:`IndexedTokenDataset`) and written by
``megacomp-preprocess-data`` (megacomp.preprocess_data).
"""
from __future__ import annotations

from .blend import BlendedDataset, parse_data_path
from .run_datasets import Datasets, build_datasets
from .corpus import collect_files, corpus_fingerprint, default_corpus_files, iter_documents
from .dataset import TokenDataset, build_token_file, read_index, token_dtype
from .indexed import IndexedTokenDataset
from .prepare import DataPreparationFailed, default_cache_dir, prepare_data
from .sampler import DistributedBatchSampler, get_batch
from .split import parse_split, split_documents
from .tokenizer import DEFAULT_MAX_BYTES, Tokenizer, train_tokenizer
from .tokenizer_files import TOKENIZER_TYPES, TokenizerLike, build_tokenizer

__all__ = ["collect_files", "corpus_fingerprint", "default_corpus_files", "iter_documents", "Tokenizer",
           "train_tokenizer", "build_token_file", "read_index", "token_dtype", "TokenDataset",
           "DistributedBatchSampler", "get_batch", "prepare_data", "default_cache_dir", "DataPreparationFailed",
           "build_datasets", "Datasets", "IndexedTokenDataset", "BlendedDataset", "parse_data_path", "parse_split",
           "split_documents", "build_tokenizer", "TokenizerLike", "TOKENIZER_TYPES"]
