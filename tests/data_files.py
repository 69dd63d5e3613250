"""Small real inputs for the data tests: text from the standard library's sources, a byte-level BPE trained here
with the tokenizers package (tokenizer.json, and GPT-2's vocab.json / merges.txt from the same model), a
sentencepiece model trained here, and Megatron indexed files written by megatron-core's builder."""
import json
import os

import numpy as np

from megacomp.data import default_corpus_files
from megacomp.data.corpus import read_text


def stdlib_texts(count: int, max_chars: int = 4000) -> list:
    """``count`` documents: the first ``max_chars`` characters of the first non-empty stdlib sources."""
    return [read_text(path)[:max_chars] for path in default_corpus_files()[:count]]


def train_byte_level_bpe(folder, texts, vocab_size: int = 600) -> str:
    """Train GPT-2-style byte-level BPE on ``texts`` with ``<|endoftext|>`` as its special token; write
    ``tokenizer.json``, ``vocab.json`` and ``merges.txt`` into ``folder``; return the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    tok.model.save(str(folder))  # vocab.json, merges.txt
    return str(folder)


def train_sentencepiece(folder, texts, vocab_size: int = 400) -> str:
    """A sentencepiece BPE model (unk 0, bos 1, eos 2, no pad) trained on ``texts``; returns the .model path."""
    import io

    import sentencepiece as spm

    lines = [line for t in texts for line in t.split("\n") if line.strip()]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out, vocab_size=vocab_size,
                                   model_type="bpe", minloglevel=2, byte_fallback=True, num_threads=1)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "sp.model")
    with open(path, "wb") as f:
        f.write(out.getvalue())
    return path


def write_indexed(prefix, docs, dtype=np.uint16) -> str:
    """``prefix.bin`` / ``prefix.idx`` holding ``docs`` (lists of ids), one sequence per document, written by
    megatron-core's IndexedDatasetBuilder; returns the prefix."""
    from megacomp.data.indexed import megatron_indexed

    builder = megatron_indexed().IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_document(list(doc), [len(doc)] if len(doc) else [])  # a list, as Megatron's preprocess_data
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def write_jsonl(path, rows) -> str:
    """One JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)
