"""Which text files make up the corpus, and a fingerprint that changes when any of them does.

``default_corpus_files()`` is the Python standard library's own source: ~700 files / ~12 MB of real text
on every machine that runs this code, so tests and demos need no download. ``collect_files(paths)``
turns files and directories (walked recursively) into the sorted list of UTF-8 text files a
tokenizer and a token file are built from. Both return absolute paths in a deterministic order.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from typing import Iterable, Iterator, Sequence, Union

PathLike = Union[str, "os.PathLike[str]"]

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
                                    f"are accepted), or leave the data path out (pretraining: no --data-path) "
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


def corpus_fingerprint(files: Sequence[str]) -> str:
    """sha256 (hex) of the files' absolute paths, sizes and modification times, in order: changes when a
    file is added, removed, reordered or edited, without reading the text. Raises FileNotFoundError (from
    ``os.stat``) for a file that no longer exists."""
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(json.dumps([os.path.abspath(f), st.st_size, st.st_mtime_ns]).encode())
        h.update(b"\n")
    return h.hexdigest()


def read_text(path: str) -> str:
    """The file's text, exactly (no newline translation: ``\\r\\n`` stays ``\\r\\n``). Raises OSError
    (e.g. FileNotFoundError) when the file cannot be read and UnicodeDecodeError when it is not UTF-8."""
    with open(path, "r", encoding="utf-8", newline="") as f:
        return f.read()
