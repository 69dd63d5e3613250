"""A sentencepiece BPE tokenizer trained on the corpus, cached by the corpus's fingerprint.

``train_tokenizer(files, vocab_size, cache_dir)`` trains once and afterwards loads the cached model
for the same files (paths, sizes, mtimes) and settings. The model round-trips any text exactly:
byte fallback covers characters outside the vocabulary, normalization is off (identity), whitespace
is kept as is and ``\\n`` is a piece of its own. Training reads at most ``max_bytes`` of the corpus (the
files in order), which keeps it to seconds; the model is written to a temporary file and renamed, so
a crash never leaves a half-written model in the cache.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from typing import Iterable, Iterator, Optional, Sequence

from .cache_files import atomic_write as _atomic_write, build_lock, remove_stale_temporaries
from .corpus import corpus_fingerprint, iter_documents

DEFAULT_MAX_BYTES = 5 * 2**20
_CACHE_FORMAT = 1
_MAX_LINE_CHARS = 4096  # longer lines are cut into pieces for training (sentencepiece skips over-long lines)
_META = "\u2581"  # sentencepiece's whitespace symbol: a literal one in the text is encoded as its UTF-8 bytes

# Everything except vocab_size and the seed that decides what the trained model is.
TRAINER_OPTIONS = dict(
    model_type="bpe",
    byte_fallback=True,  # unknown characters become <0xNN> byte pieces: every string encodes
    character_coverage=0.9995,  # the rarest 0.05% of characters are left to byte fallback
    normalization_rule_name="identity",  # no NFKC: decode(encode(s)) == s
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    allow_whitespace_only_pieces=True,  # indentation runs become single pieces
    split_digits=True,
    user_defined_symbols=["\n"],
    unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
    input_sentence_size=0,  # we bound the text ourselves (max_bytes), in a fixed order
    shuffle_input_sentence=False,
    max_sentence_length=4 * _MAX_LINE_CHARS,  # bytes
    num_threads=2,  # the pieces do not depend on it, but the model file records it: fixed for a stable hash
)


class Tokenizer:
    """A trained sentencepiece model: ``encode(str) -> list[int]``, ``decode(ids) -> str``.

    Pickles as its path, so DataLoader workers reload the model instead of copying it.

    Args:
        model_path: a sentencepiece ``.model`` file (:func:`train_tokenizer` writes them).
        trained: whether the caller just trained this model (kept as ``self.trained``).

    The file is parsed as a sentencepiece model (a protobuf message: data, never code).

    Raises:
        FileNotFoundError: ``model_path`` is not a file.
        ValueError: the file is empty, truncated or otherwise not a sentencepiece model (the message names
            it: delete it, and ``train_tokenizer``/``prepare_data`` train it again).
    """

    def __init__(self, model_path: str, trained: bool = False):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model {model_path!r} does not exist; train one with "
                                    f"megacomp.data.train_tokenizer")
        with open(model_path, "rb") as f:
            proto = f.read()
        self.model_path = os.path.abspath(model_path)
        self.trained = trained
        """True when this call trained the model, False when it was loaded from the cache."""
        self.fingerprint = hashlib.sha256(proto).hexdigest()
        """sha256 of the model file: token files record it, so a different tokenizer forces a rebuild."""
        self.sp = _parse_model(proto, self.model_path)
        self._meta_ids = [self.sp.piece_to_id(f"<0x{b:02X}>") for b in _META.encode("utf-8")]

    @property
    def vocab_size(self) -> int:
        """Number of pieces; ids run from 0 to ``vocab_size - 1``."""
        return self.sp.vocab_size()

    @property
    def eos_id(self) -> int:
        """End-of-sequence id (2 in models from train_tokenizer); token files put it after each document."""
        return self.sp.eos_id()

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id (1 in models from train_tokenizer)."""
        return self.sp.bos_id()

    @property
    def unk_id(self) -> int:
        """Unknown-piece id (0 in models from train_tokenizer)."""
        return self.sp.unk_id()

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, without BOS/EOS.

        A literal U+2581 (sentencepiece's own whitespace symbol) in ``text`` would be taken for a space, so
        the text is split there and each occurrence is encoded as its UTF-8 byte pieces.
        """
        if _META not in text:
            return self.sp.encode(text)
        ids: list[int] = []
        for i, part in enumerate(text.split(_META)):
            if i:
                ids.extend(self._meta_ids)
            ids.extend(self.sp.encode(part))
        return ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """``[encode(t) for t in texts]``, on ``num_threads`` threads."""
        if any(_META in t for t in texts):
            return [self.encode(t) for t in texts]
        return self.sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids (a list, numpy array or tensor).

        Raises:
            IndexError: an id outside ``[0, vocab_size)`` (sentencepiece's "piece id is out of range").
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.sp.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        """The piece string of ``token_id`` (byte pieces read ``<0xNN>``).

        Raises:
            IndexError: ``token_id`` outside ``[0, vocab_size)`` (sentencepiece's check).
        """
        return self.sp.id_to_piece(int(token_id))

    def __len__(self) -> int:
        return self.vocab_size

    def __reduce__(self):  # pickles as its path (e.g. into DataLoader workers)
        return (Tokenizer, (self.model_path, self.trained))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, model_path={self.model_path!r})"


def _parse_model(proto: bytes, path: str):
    """A SentencePieceProcessor from the bytes of the model file ``path``, or a ValueError naming it."""
    import sentencepiece as spm

    reason = "the file is empty" if not proto else None
    if reason is None:
        try:
            sp = spm.SentencePieceProcessor(model_proto=proto)
        except Exception as e:  # sentencepiece's "INTERNAL: ... ParseFromArray(...)" for a truncated file
            reason = f"sentencepiece cannot parse it: {(str(e).splitlines() or [type(e).__name__])[0]}"
        else:
            if sp.get_piece_size() < 260:  # byte fallback's 256 pieces plus the specials
                reason = f"it has {sp.get_piece_size()} pieces"
    if reason is not None:
        raise ValueError(f"tokenizer model {path!r} is truncated or corrupt ({reason}); delete it and run again "
                         f"to train it anew")
    return sp


def _say(message: str) -> None:
    """One progress line on stderr, flushed (the data pipeline's "one time" work: training, tokenizing)."""
    print(f"megacomp: {message}", file=sys.stderr, flush=True)


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.1f} MB"


def training_lines(files: Sequence[str], max_bytes: int, json_keys: Optional[Sequence[str]] = None) -> Iterator[str]:
    """The corpus as sentencepiece training sentences: the lines of the documents in order (a plain file is one
    document, a JSON-lines file one per line and key: :func:`~megacomp.data.corpus.iter_documents`), over-long
    lines cut into pieces, stopping after ``max_bytes`` bytes of text (one byte more per piece, for its
    newline). Errors reading a file propagate (see :func:`~megacomp.data.corpus.iter_documents`)."""
    budget = max_bytes
    for path in files:
        for _, text in iter_documents(path, json_keys):
            for line in text.split("\n"):
                for start in range(0, max(len(line), 1), _MAX_LINE_CHARS):
                    piece = line[start:start + _MAX_LINE_CHARS]
                    budget -= len(piece.encode("utf-8")) + 1
                    if budget < 0:
                        return
                    if piece:
                        yield piece


def tokenizer_cache_key(files: Sequence[str], vocab_size: int, max_bytes: int, seed: int,
                        json_keys: Optional[Sequence[str]] = None) -> str:
    """sha256 over the corpus fingerprint (with ``json_keys`` when the corpus has JSON lines) and every training
    setting: equal keys give equal models. Raises FileNotFoundError for a file that no longer exists (see
    corpus_fingerprint)."""
    spec = dict(format=_CACHE_FORMAT, corpus=corpus_fingerprint(files, json_keys), vocab_size=vocab_size,
                max_bytes=max_bytes, seed=seed, options=TRAINER_OPTIONS)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def train_tokenizer(files: Sequence[str], vocab_size: int, model_prefix_dir: str, *,
                    max_bytes: int = DEFAULT_MAX_BYTES, seed: int = 0,
                    json_keys: Optional[Sequence[str]] = None) -> Tokenizer:
    """Train (or load from ``model_prefix_dir``) a BPE model of ``vocab_size`` pieces on ``files`` (JSON-lines
    files: the texts under ``json_keys``, default ``text``).

    The cached model is named by a hash of the corpus fingerprint (paths, sizes, mtimes), ``vocab_size``,
    ``max_bytes``, ``seed`` and the trainer options; ``Tokenizer.trained`` says whether this call trained.
    Training is deterministic: the same key gives a byte-identical model file. The model (and a ``.json``
    with the settings next to it) is written to a temporary file and renamed. Training says so on stderr
    (``megacomp: training the tokenizer on N files (X MB) -> PATH (one time)``, then the seconds it took);
    a cached model that is truncated or corrupt is trained again, with a line that says so.

    Raises:
        ValueError: no files; ``vocab_size`` < 300 (byte fallback needs 256 pieces plus the specials);
            ``max_bytes`` <= 0; or a ``vocab_size`` that does not fit the text read (sentencepiece's reason,
            with the fix).
        RuntimeError: any other sentencepiece training failure (re-raised as is).
    """
    files = list(files)
    if not files:
        raise ValueError("corpus is empty: train_tokenizer got no files; use megacomp.data.collect_files(paths) "
                         "or default_corpus_files()")
    if vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte fallback alone takes 256 pieces plus 4 "
                         f"special ones; use at least 300 (e.g. 4096, 8192, 32000)")
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    key = tokenizer_cache_key(files, vocab_size, max_bytes, seed, json_keys)
    os.makedirs(model_prefix_dir, exist_ok=True)
    path = os.path.join(model_prefix_dir, f"spm-bpe-{vocab_size}-{key[:16]}.model")
    cached = _cached_model(path, vocab_size, say=False)
    if cached is not None:
        return cached
    with build_lock(path):  # one job trains; one that waited here finds the model trained
        cached = _cached_model(path, vocab_size, say=True)
        if cached is not None:
            return cached
        for done in (path, path[:-len(".model")] + ".json"):
            remove_stale_temporaries(done)
        return _train(files, vocab_size, path, max_bytes, seed, json_keys)


def _cached_model(path: str, vocab_size: int, say: bool):
    """The cached model at ``path``, or None (missing; truncated or garbled, said when ``say``)."""
    if not os.path.isfile(path):
        return None
    try:
        cached = Tokenizer(path, trained=False)
        if cached.vocab_size != vocab_size:
            raise ValueError(f"tokenizer model {path!r} has {cached.vocab_size} pieces, not {vocab_size}")
        return cached
    except ValueError as e:  # a truncated or garbled cache entry: the key says exactly what to train
        if say:
            _say(f"{str(e).rsplit('; ', 1)[0]}; training it again")
        return None


def _train(files: list, vocab_size: int, path: str, max_bytes: int, seed: int, json_keys=None) -> "Tokenizer":
    """Train the model (under train_tokenizer's lock) and write it and its settings to ``path`` (.model/.json)."""
    import sentencepiece as spm

    total = sum(os.path.getsize(f) for f in files)
    read = f"{_mb(min(total, max_bytes))} of {_mb(total)} read" if total > max_bytes else _mb(total)
    _say(f"training the tokenizer on {len(files)} files ({read}) -> {path} (one time)")
    start = time.perf_counter()
    spm.set_random_generator_seed(seed)
    writer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=training_lines(files, max_bytes, json_keys),
                                       model_writer=writer,
                                       vocab_size=vocab_size, minloglevel=2,
                                       **TRAINER_OPTIONS)
    except RuntimeError as e:
        msg = str(e)
        if "Vocabulary size too high" in msg or "Vocabulary size is smaller" in msg:
            raise ValueError(f"vocab_size={vocab_size} does not fit this corpus ({len(files)} files, at most "
                             f"{max_bytes} bytes read): {msg.split('] ')[-1]} Change vocab_size, or give more text "
                             f"(more files or a larger max_bytes)") from None
        raise
    _atomic_write(path, writer.getvalue())
    meta = dict(vocab_size=vocab_size, max_bytes=max_bytes, seed=seed, num_files=len(files),
                first_file=files[0], last_file=files[-1], corpus_fingerprint=corpus_fingerprint(files, json_keys),
                sentencepiece=spm.__version__, options=TRAINER_OPTIONS)
    _atomic_write(path[:-len(".model")] + ".json", json.dumps(meta, indent=1).encode())
    tokenizer = Tokenizer(path, trained=True)
    _say(f"trained the tokenizer ({tokenizer.vocab_size} pieces) in {time.perf_counter() - start:.1f} s")
    return tokenizer
