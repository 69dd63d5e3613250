"""Files of the data cache (tokenizer models, token files) that several jobs, users and nodes may share.

- :func:`atomic_write` / :func:`new_temporary`: written to a temporary ``<name>.<random>.tmp`` in the same directory,
  then renamed over the final name: a reader sees the old file or the whole new one, never a part. The file gets
  the permissions of any new file (``0666`` less the umask), not ``mkstemp``'s ``0600``, so a cache on a shared file
  system is readable by the other users and jobs that share it.
- :func:`build_lock`: an exclusive ``flock`` on the entry's directory around building it (one build at a time per
  cache directory; builds are rare, and a lock on the directory leaves no lock file behind). A second job that
  finds the entry missing waits for the first, then finds it built and only reads it: two builders never replace
  each other's files under a reader. The kernel drops the lock when its holder dies (even by SIGKILL), so a killed
  build never blocks the next one.
- :func:`remove_stale_temporaries`: under the lock, no other process writes the entry, so any ``<name>.*.tmp`` left
  is from a build that was killed: removed, with a line saying so.

Failure behaviour: OSError from the file system passes through (the caller's message names the path); on a file
system without ``flock`` (some network file systems), the lock is skipped with one line saying so, and the
renames still keep every file whole.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import sys
import tempfile
from typing import Iterator


def _default_mode() -> int:
    mask = os.umask(0)  # read the umask (the only portable way), then put it back
    os.umask(mask)
    return 0o666 & ~mask


def new_temporary(path: str) -> tuple[int, str]:
    """An open file descriptor and the name of a new temporary file next to ``path`` (``<name>.<random>.tmp``),
    with a new file's usual permissions."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=os.path.basename(path) + ".",
                               suffix=".tmp")
    os.fchmod(fd, _default_mode())
    return fd, tmp


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (fsynced first)."""
    fd, tmp = new_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def build_lock(path: str) -> Iterator[None]:
    """Hold an exclusive lock on the directory of ``path`` while building the entry ``path``."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            print(f"megacomp: the file system of {path!r} has no flock; building without a lock (concurrent jobs may "
                  f"build the same entry twice; each file is still replaced whole)", file=sys.stderr, flush=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_stale_temporaries(path: str) -> list[str]:
    """Remove the ``<name>.*.tmp`` files of ``path`` (call under :func:`build_lock`: none is being written);
    returns them."""
    stale = sorted(glob.glob(glob.escape(path) + ".*.tmp"))
    for tmp in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if stale:
        print(f"megacomp: removed {len(stale)} temporary file(s) of {os.path.basename(path)} left by a build that "
              f"was killed", file=sys.stderr, flush=True)
    return stale
