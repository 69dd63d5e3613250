"""Which text files make up the corpus, and a fingerprint that changes when any of them does.

``default_corpus_files()`` is the Python standard library's own source: ~700 files / ~12 MB of real text
on every machine that runs this code, so tests and demos need no download. ``collect_files(paths)``
turns files and directories (walked recursively) into the sorted list of UTF-8 text files a
tokenizer and a token file are built from. Both return absolute paths in a deterministic order.

Documents (:func:`iter_documents`): a plain text file is one document; a ``.jsonl`` file holds one JSON object per
line (Megatron's ``--input`` format: ``{"text": ...}``), and each of its ``json_keys`` gives one document per line.
A line that is not a JSON object, lacks a key or holds a non-string there raises ValueError naming the file and
line; blank lines are skipped.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from typing import Iterable, Iterator, Optional, Sequence, Union

PathLike = Union[str, "os.PathLike[str]"]

JSONL_SUFFIX = ".jsonl"
"""Files with this suffix are read as JSON lines (one document per line and key), others as one document each."""
DEFAULT_JSON_KEYS = ("text",)
"""The JSON key that holds a document's text unless ``--json-keys`` names others (Megatron's default)."""

# Directories never walked: the stdlib's test suites (not representative text, and large), installed
# third-party packages that live under the stdlib directory, byte-code caches.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def is_utf8_text(path: str) -> bool:
    """True when the file at ``path`` decodes as UTF-8 (an empty file counts as text)."""
    try:
        with open(path, "rb") as f:
            f.read().decode("utf-8")
        return True
    except (UnicodeDecodeError, OSError):
        return False


def default_corpus_files() -> list[str]:
    """The standard library's ``*.py`` files (test directories, ``test_*.py`` and non-UTF-8 files skipped),
    sorted: a real, deterministic corpus present wherever Python is. Empty files are skipped too.

    Raises:
        ValueError: no such file was found (pass corpus paths explicitly).
    """
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("test_"):
                path = os.path.join(dirpath, name)
                if os.path.getsize(path) > 0 and is_utf8_text(path):
                    out.append(os.path.abspath(path))
    if not out:
        raise ValueError(f"corpus is empty: no readable *.py files under the standard library directory {root}; "
                         f"pass corpus paths explicitly")
    return sorted(out)


def _walk(directory: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]  # .git, .venv, ...
        for name in filenames:
            if not name.startswith("."):
                yield os.path.join(dirpath, name)


def collect_files(paths: Union[PathLike, Iterable[PathLike]]) -> list[str]:
    """Absolute paths of the corpus's text files, sorted and without duplicates.

    Each entry of ``paths`` is a file or a directory. Directories are walked recursively; hidden entries
    (``.git``, ``.venv``...) and files that are not UTF-8 text are skipped there. A file named directly must
    be UTF-8 text. Empty files are dropped: they contribute no text.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: no paths; a file named directly that is not UTF-8 text; a path that is neither a
            regular file nor a directory; or no non-empty text file in the end.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ValueError("corpus is empty: no corpus paths given; give files or directories, or no data path at all "
                         "(pretraining: leave out --data-path) for the default corpus, the Python standard "
                         "library's sources")
    found: set[str] = set()
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(f"corpus path {p!r} does not exist; fix the path (files and directories "
                                    f"are accepted; a Megatron indexed dataset by its prefix, PREFIX.bin and "
                                    f"PREFIX.idx), or leave the data path out (pretraining: no --data-path) "
                                    f"for the default corpus")
        if os.path.isdir(p):
            found.update(os.path.abspath(f) for f in _walk(p) if os.path.isfile(f) and is_utf8_text(f))
        elif os.path.isfile(p):
            if not is_utf8_text(p):
                raise ValueError(f"corpus file {p!r} is not UTF-8 text; convert it (e.g. iconv -t utf-8) or "
                                 f"leave it out")
            found.add(os.path.abspath(p))
        else:
            raise ValueError(f"corpus path {p!r} is neither a regular file nor a directory")
    files = sorted(f for f in found if os.path.getsize(f) > 0)
    if not files:
        raise ValueError(f"corpus is empty: no non-empty UTF-8 text files in {paths}; point at files that "
                         f"contain text")
    return files


def corpus_fingerprint(files: Sequence[str], json_keys: Optional[Sequence[str]] = None) -> str:
    """sha256 (hex) of the files' absolute paths, sizes and modification times, in order: changes when a
    file is added, removed, reordered or edited, without reading the text. When a file is JSON lines, the
    ``json_keys`` (default ``DEFAULT_JSON_KEYS``) enter too (a corpus of plain files hashes as it always did).
    Raises FileNotFoundError (from ``os.stat``) for a file that no longer exists."""
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(json.dumps([os.path.abspath(f), st.st_size, st.st_mtime_ns]).encode())
        h.update(b"\n")
    if any(is_jsonl(f) for f in files):
        h.update(json.dumps({"json_keys": list(check_json_keys(json_keys))}).encode())
    return h.hexdigest()


def is_jsonl(path: str) -> bool:
    """True for a JSON-lines file (by its suffix, ``JSONL_SUFFIX``)."""
    return str(path).endswith(JSONL_SUFFIX)


def check_json_keys(json_keys: Optional[Sequence[str]]) -> tuple[str, ...]:
    """``json_keys`` as a tuple (None: ``DEFAULT_JSON_KEYS``). Raises ValueError for an empty list or a
    non-string key."""
    if json_keys is None:
        return DEFAULT_JSON_KEYS
    keys = (json_keys,) if isinstance(json_keys, str) else tuple(json_keys)
    if not keys or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"--json-keys must name one or more keys of the JSON lines (e.g. text), got {json_keys!r}")
    return keys


def json_line_texts(line: str, json_keys: Sequence[str], where: str) -> list[str]:
    """The texts under ``json_keys`` of one JSON line (``where`` names it in errors: ``FILE:LINE``).

    Raises:
        ValueError: the line is not a JSON object, lacks a key, or holds something other than a string there.
    """
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e}); a JSON-lines file holds one object per line, e.g. "
                         f'{{"text": "..."}}') from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a JSON {type(obj).__name__}, not an object like {{\"text\": \"...\"}}")
    texts = []
    for key in json_keys:
        if key not in obj:
            raise ValueError(f"{where}: no key {key!r} (keys: {', '.join(map(repr, list(obj)[:8]))}); name the key "
                             f"that holds the text with --json-keys")
        if not isinstance(obj[key], str):
            raise ValueError(f"{where}: {key!r} holds a {type(obj[key]).__name__}, not text")
        texts.append(obj[key])
    return texts


def iter_documents(path: str, json_keys: Optional[Sequence[str]] = None) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of each document of ``path`` (see the module docstring): a plain file is one, named by
    its path; a JSON-lines file gives one per line and key, named ``PATH:LINE`` (``PATH:LINE:KEY`` with several
    keys). Raises as :func:`read_text` and :func:`json_line_texts`."""
    if not is_jsonl(path):
        yield path, read_text(path)
        return
    keys = check_json_keys(json_keys)
    with open(path, "r", encoding="utf-8", newline="") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            for key, text in zip(keys, json_line_texts(line, keys, f"{path}:{number}")):
                yield (f"{path}:{number}" if len(keys) == 1 else f"{path}:{number}:{key}"), text


def read_text(path: str) -> str:
    """The file's text, exactly (no newline translation: ``\\r\\n`` stays ``\\r\\n``). Raises OSError
    (e.g. FileNotFoundError) when the file cannot be read and UnicodeDecodeError when it is not UTF-8."""
    with open(path, "r", encoding="utf-8", newline="") as f:
        return f.read()
