"""Tokenizers a Megatron-LM user already has, under Megatron's ``--tokenizer-type`` names, read from local files
only (nothing is downloaded):

- ``HuggingFaceTokenizer``: ``--tokenizer-model`` a ``tokenizer.json`` file or a folder holding one (the
  ``tokenizers`` package). Encoding applies the file's post-processor (e.g. Llama's BOS), as Megatron's
  HuggingFaceTokenizer (``transformers``' ``tokenizer(text).input_ids``) does; the vocabulary counts the added
  tokens; EOS is ``eos_token`` of a ``tokenizer_config.json`` (or ``special_tokens_map.json``) beside the file,
  else the one added special token named ``</s>``, ``<|endoftext|>``, ``<|end_of_text|>`` or ``<eos>``.
- ``GPT2BPETokenizer``: ``--vocab-file`` (``vocab.json``) and ``--merge-file`` (``merges.txt``): GPT-2's byte-level
  BPE (the ``tokenizers`` package's BPE with GPT-2's byte-level pre-tokenizer and decoder); EOS ``<|endoftext|>``,
  vocabulary the entries of ``vocab.json`` (Megatron's ``len(encoder)``).
- ``SentencePieceTokenizer``: ``--tokenizer-model`` a sentencepiece ``.model``, with Megatron-LM's special tokens:
  ``<CLS>``, ``<SEP>``, ``<EOD>``, ``<MASK>`` and the model's pad, BOS and EOS pieces are added after the
  model's pieces when missing (so ``<EOD>``, the end-of-document id, is usually the model's size + 2), and those
  strings in the text encode as their ids, as Megatron's ``_SentencePieceTokenizer`` does.
- ``GPTSentencePieceTokenizer``: a ``.model`` as it is: EOS the model's own, vocabulary the model's pieces.
- none (the default): megacomp trains a sentencepiece BPE on the corpus (:func:`~megacomp.data.train_tokenizer`).

Every tokenizer, this module's and :class:`~megacomp.data.tokenizer.Tokenizer`, offers :class:`TokenizerLike`:
``encode``, ``encode_batch``, ``decode``, ``vocab_size``, ``eos_id``, ``fingerprint`` (sha256 over the type and
its files: token caches are keyed by it) and ``model_path``; each pickles as its files' paths.

Failure behaviour: an unknown type, a missing or unreadable file, a file of another format, a vocabulary without
an end-of-document token: ValueError, one line naming the file and the fix.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Optional, Protocol, Sequence, runtime_checkable

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer")
"""The ``--tokenizer-type`` names served here (Megatron-LM's)."""

HF_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
"""EOS tokens a tokenizer.json without a tokenizer_config.json may name (the first one present is taken)."""


@runtime_checkable
class TokenizerLike(Protocol):
    """What the data pipeline needs of a tokenizer (the trained :class:`~megacomp.data.tokenizer.Tokenizer` and
    this module's classes)."""

    fingerprint: str
    model_path: str

    @property
    def vocab_size(self) -> int:
        """Ids run from 0 to ``vocab_size - 1``."""

    @property
    def eos_id(self) -> int:
        """The end-of-document id (token files put it after each document)."""

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``."""

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """``[encode(t) for t in texts]``."""

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``."""


def _digest(kind: str, *paths: str) -> str:
    h = hashlib.sha256(kind.encode())
    for path in paths:
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _need_file(path: Optional[str], flag: str, kind: str, what: str) -> str:
    if not path:
        raise ValueError(f"--tokenizer-type {kind} needs {flag} ({what})")
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path}: no such file; give the {what} (local files only: nothing is downloaded)")
    return os.path.abspath(path)


def _as_list(ids) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


def _hf_package():
    try:
        import tokenizers
    except ImportError:
        raise ValueError("HuggingFaceTokenizer and GPT2BPETokenizer read their files with the tokenizers package: "
                         "pip install tokenizers") from None
    return tokenizers


class _HFBase:
    """A ``tokenizers.Tokenizer`` behind :class:`TokenizerLike` (subclasses load it and pick EOS)."""

    hf = None
    eos_token = ""
    _vocab_size = 0

    @property
    def vocab_size(self) -> int:
        """Ids run from 0 to ``vocab_size - 1``."""
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        """The id of ``eos_token``."""
        return self.hf.token_to_id(self.eos_token)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, with the file's post-processor's special tokens (Megatron's HuggingFaceTokenizer)."""
        return self.hf.encode(text).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """``[encode(t) for t in texts]`` (the tokenizers package picks its own threads)."""
        return [e.ids for e in self.hf.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens kept, as Megatron's detokenize)."""
        return self.hf.decode(_as_list(ids), skip_special_tokens=False)

    def __len__(self) -> int:
        return self.vocab_size


def _hf_eos(hf, folder: str, model: str) -> str:
    """The EOS token: ``eos_token`` of tokenizer_config.json / special_tokens_map.json in ``folder``, else the first
    of HF_EOS_NAMES among the added special tokens."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token")
            except (ValueError, UnicodeDecodeError, AttributeError) as e:
                raise ValueError(f"{path} is not a JSON object ({e}); fix or remove it") from None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and hf.token_to_id(eos) is not None:
                return eos
            if eos is not None:
                raise ValueError(f"{path} names eos_token {eos!r}, which is not in {model}; fix eos_token")
    specials = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    for name in HF_EOS_NAMES:
        if name in specials:
            return name
    raise ValueError(f"{model} names no end-of-document token: no tokenizer_config.json with eos_token beside it and "
                     f"none of {', '.join(HF_EOS_NAMES)} among its special tokens ({sorted(specials)[:8]}); put the "
                     f"model's tokenizer_config.json next to tokenizer.json")


class HuggingFaceTokenizer(_HFBase):
    """A ``tokenizer.json`` (or a folder holding one), read with the ``tokenizers`` package (see the module
    docstring for EOS and the vocabulary).

    Raises:
        ValueError: the path is missing, the folder has no tokenizer.json, the file is not a tokenizer the
            package can read, or no EOS token can be named; the tokenizers package is missing.
    """

    def __init__(self, tokenizer_model: str):
        tokenizers = _hf_package()
        path = _need_file(tokenizer_model, "--tokenizer-model", "HuggingFaceTokenizer",
                          "a tokenizer.json file or a folder holding one")
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"--tokenizer-model {tokenizer_model}: no tokenizer.json in this folder; point it at the "
                             f"tokenizer.json file or the folder that holds it")
        try:
            self.hf = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # the package raises its own Exception type for a bad file
            raise ValueError(f"--tokenizer-model {file} is not a tokenizer.json the tokenizers package can read "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        self.tokenizer_model = tokenizer_model
        self.model_path = file
        self.eos_token = _hf_eos(self.hf, os.path.dirname(file), file)
        self._vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        self.fingerprint = _digest(f"HuggingFaceTokenizer:{self.eos_token}", file)

    def __reduce__(self):
        return (HuggingFaceTokenizer, (self.tokenizer_model,))

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.model_path!r}, vocab_size={self.vocab_size}, eos={self.eos_token!r})"


class GPT2BPETokenizer(_HFBase):
    """GPT-2's byte-level BPE from ``vocab.json`` and ``merges.txt`` (see the module docstring).

    Raises:
        ValueError: a file is missing or not GPT-2's format, or the vocabulary lacks ``<|endoftext|>``; the
            tokenizers package is missing.
    """

    eos_token = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str):
        tokenizers = _hf_package()
        vocab = _need_file(vocab_file, "--vocab-file", "GPT2BPETokenizer", "GPT-2's vocab.json")
        merges = _need_file(merge_file, "--merge-file", "GPT2BPETokenizer", "GPT-2's merges.txt")
        try:
            with open(vocab, encoding="utf-8") as f:
                encoder = json.load(f)
            if not isinstance(encoder, dict):
                raise ValueError("not a JSON object of token -> id")
            model = tokenizers.models.BPE.from_file(vocab, merges)
        except Exception as e:
            raise ValueError(f"--vocab-file {vocab} / --merge-file {merges} are not GPT-2's vocab.json and merges.txt "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        if self.eos_token not in encoder:
            raise ValueError(f"--vocab-file {vocab} has no {self.eos_token} (GPT-2's end-of-document token); give "
                             f"GPT-2's vocab.json")
        self.hf = tokenizers.Tokenizer(model)
        self.hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.hf.decoder = tokenizers.decoders.ByteLevel()
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self.model_path = vocab
        self._vocab_size = len(encoder)
        self.fingerprint = _digest("GPT2BPETokenizer", vocab, merges)

    def __reduce__(self):
        return (GPT2BPETokenizer, (self.vocab_file, self.merge_file))

    def __repr__(self) -> str:
        return f"GPT2BPETokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def _load_sentencepiece(tokenizer_model: Optional[str], kind: str):
    import sentencepiece as spm

    path = _need_file(tokenizer_model, "--tokenizer-model", kind, "a sentencepiece .model file")
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer-model {tokenizer_model} is a folder; {kind} takes the sentencepiece .model file")
    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except Exception as e:  # sentencepiece raises RuntimeError/OSError with its own text for a bad file
        raise ValueError(f"--tokenizer-model {path} is not a sentencepiece model "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return path, sp


class SentencePieceTokenizer:
    """A sentencepiece ``.model`` with Megatron-LM's special tokens added after its pieces (module docstring);
    ``eos_id`` is ``<EOD>``'s id, Megatron's end-of-document token.

    Raises:
        ValueError: the file is missing or not a sentencepiece model.
    """

    def __init__(self, tokenizer_model: str):
        self.tokenizer_model = tokenizer_model
        self.model_path, self.sp = _load_sentencepiece(tokenizer_model, "SentencePieceTokenizer")
        self.fingerprint = _digest("SentencePieceTokenizer", self.model_path)
        vocab = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}
        self.special: dict[str, int] = {}
        """Megatron's special tokens and their ids (added after the model's pieces when missing)."""

        def add(token: str) -> None:
            vocab.setdefault(token, len(vocab))
            self.special[token] = vocab[token]

        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            add(token)
        for piece_id, fallback in ((self.sp.pad_id(), "<PAD>"), (self.sp.bos_id(), "<BOS>"),
                                   (self.sp.eos_id(), "<EOS>")):
            add(self.sp.id_to_piece(piece_id) if 0 <= piece_id < self.sp.get_piece_size() else fallback)
        self._vocab_size = len(vocab)
        self._names = {i: t for t, i in self.special.items()}

    @property
    def vocab_size(self) -> int:
        """The model's pieces plus the special tokens added after them."""
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        """``<EOD>``'s id (Megatron's ``eod``)."""
        return self.special["<EOD>"]

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``: the special tokens' strings become their ids, the text between them the model's ids."""
        ids: list[int] = []
        at = 0
        while True:
            found = {t: text.find(t, at) for t in self.special}
            found = {t: i for t, i in found.items() if i >= 0}
            if not found:
                break
            token = min(found, key=found.get)  # the earliest; ties: the first added, as Megatron
            ids.extend(self.sp.encode_as_ids(text[at:found[token]]))
            ids.append(self.special[token])
            at = found[token] + len(token)
        ids.extend(self.sp.encode_as_ids(text[at:]))
        return ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """``[encode(t) for t in texts]``."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: each special id as its string between spaces, the rest decoded by the model (Megatron's
        detokenize)."""
        ids = _as_list(ids)
        text, last = "", 0
        for i, token_id in enumerate(ids):
            if token_id in self._names:
                text += self.sp.decode_ids(ids[last:i]) + " " + self._names[token_id] + " "
                last = i + 1
        return text + self.sp.decode_ids(ids[last:])

    def __len__(self) -> int:
        return self.vocab_size

    def __reduce__(self):
        return (SentencePieceTokenizer, (self.tokenizer_model,))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


class GPTSentencePieceTokenizer:
    """A sentencepiece ``.model`` as it is (Megatron's GPTSentencePieceTokenizer): the model's ids and EOS.

    Raises:
        ValueError: the file is missing or not a sentencepiece model, or the model has no EOS piece.
    """

    def __init__(self, tokenizer_model: str):
        self.tokenizer_model = tokenizer_model
        self.model_path, self.sp = _load_sentencepiece(tokenizer_model, "GPTSentencePieceTokenizer")
        if self.sp.eos_id() < 0:
            raise ValueError(f"--tokenizer-model {self.model_path} has no EOS piece (eos_id -1), which "
                             f"GPTSentencePieceTokenizer ends documents with; use SentencePieceTokenizer (adds <EOD>)")
        self.fingerprint = _digest("GPTSentencePieceTokenizer", self.model_path)

    @property
    def vocab_size(self) -> int:
        """The model's pieces."""
        return self.sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        """The model's EOS id."""
        return self.sp.eos_id()

    def encode(self, text: str) -> list[int]:
        """The model's ids of ``text``."""
        return self.sp.encode_as_ids(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """``[encode(t) for t in texts]`` on ``num_threads`` threads."""
        return self.sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """The model's text of ``ids``."""
        return self.sp.decode_ids(_as_list(ids))

    def __len__(self) -> int:
        return self.vocab_size

    def __reduce__(self):
        return (GPTSentencePieceTokenizer, (self.tokenizer_model,))

    def __repr__(self) -> str:
        return f"GPTSentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def build_tokenizer(tokenizer_type: Optional[str], tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None) -> Optional[TokenizerLike]:
    """The tokenizer ``--tokenizer-type`` names, from its files; None for no type (megacomp trains its own).

    Raises:
        ValueError: an unknown type (the known ones listed), and as each class.
    """
    if tokenizer_type is None:
        return None
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    from difflib import get_close_matches
    close = get_close_matches(str(tokenizer_type), TOKENIZER_TYPES, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported{hint}; use one of "
                     f"{', '.join(TOKENIZER_TYPES)}, or leave it out to train a tokenizer on the corpus")


def describe(tokenizer) -> str:
    """``TYPE FILE`` of a tokenizer, for messages."""
    return f"{type(tokenizer).__name__} {getattr(tokenizer, 'model_path', '')}".strip()
