"""Build (once, cached by torch under TORCH_EXTENSIONS_DIR) and load the C++ codec kernels."""
from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from typing import Optional

from torch.utils.cpp_extension import load as _load

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "megacomp_codec_kernels"
SOURCES = [os.path.join(HERE, f) for f in ("codec_kernels.cpp", "codec_sign.cpp", "codec_ef.cpp")]
HEADERS = [os.path.join(HERE, f) for f in ("codec_common.h", "codec_quant.h")]


def _cflags() -> list[str]:
    # -ffp-contract=off: no fused multiply-adds, so decode-accumulate rounds exactly like the eager
    # reference (a multiply, then an add). -fno-trapping-math lets gcc if-convert the selects around the
    # float8 conversion's float add, so that loop vectorises too (results are unchanged: it only drops the
    # assumption that FP exceptions trap). -O3 -march=native vectorises the loops for this CPU (the
    # extension is built on the machine that runs it; keep TORCH_EXTENSIONS_DIR per machine type).
    # OpenMP via ATen's parallel_for, so torch.set_num_threads applies.
    # the headers' hash as a define: torch re-versions the extension when sources or flags change
    digest = hashlib.sha1()
    for path in HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    header = digest.hexdigest()[:12]
    return ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-DAT_PARALLEL_OPENMP=1",
            f"-DMEGACOMP_COMMON_H={header}"]


def build_directory() -> Optional[str]:
    """The folder torch builds and caches the extension in (``$TORCH_EXTENSIONS_DIR/megacomp_codec_kernels``
    or torch's per-user default), or None when torch's (private) helper for it is unavailable."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory(NAME, verbose=False)
    except Exception:
        return None


def build_needed() -> Optional[bool]:
    """Whether :func:`load` will compile (True) or only load torch's cached build (False); None when that
    cannot be told. Cheap (a few milliseconds): the cached ``build.ninja`` must name this checkout's sources
    and the current flags and torch headers, and ``ninja -n`` (a dry run, which also follows the recorded
    header dependencies) must find no work. Never raises."""
    try:
        from torch.utils.cpp_extension import include_paths

        folder = build_directory()
        if folder is None:
            return None
        ninja_file = os.path.join(folder, "build.ninja")
        if not os.path.isfile(ninja_file) or not os.path.isfile(os.path.join(folder, NAME + ".so")):
            return True
        with open(ninja_file, encoding="utf-8", errors="replace") as f:
            text = f.read()
        expected = SOURCES + _cflags() + include_paths()[:1] + [f"-DTORCH_EXTENSION_NAME={NAME} "]
        if not all(s in text for s in expected):
            return True  # torch rewrites build.ninja with other sources, flags or headers: a rebuild
        dry = subprocess.run(["ninja", "-n", "-C", folder], capture_output=True, text=True, timeout=30)
        if dry.returncode != 0:
            return None
        return "no work to do" not in dry.stdout
    except Exception:  # no ninja, an unreadable cache folder...: load() will say what is wrong
        return None


FLOCK_NAME = "megacomp.flock"
"""The file in the cache folder whose ``flock`` serialises megacomp's builds and loads (see :func:`load`)."""


def load():
    """Build the extension if torch's cache is not current (about a minute), then import it; returns the
    module. Raises whatever torch's ``cpp_extension.load`` raises (no compiler, no ninja, a compile error).

    Steps: take an exclusive ``flock`` on ``megacomp.flock`` in the cache folder (other processes building
    or loading wait here), remove torch's ``lock`` file if one is left there, call torch's loader, release.
    Why: torch's loader guards a build with a ``lock`` file that it creates and deletes, and waits, silently
    and forever, while that file exists; a build that was killed (a test or job timeout, Ctrl-C, a
    preempted node) leaves it behind, and every later process on that cache would hang. A ``flock`` is
    dropped by the kernel when its holder dies, so a ``lock`` file found while holding it belongs to no
    live megacomp build: it is removed, with one line on stderr. On a file system without ``flock`` (some
    network mounts) only torch's lock file guards the build, as before."""
    folder = build_directory()
    fd = _flock(folder) if folder is not None else None
    if fd is None:
        return _load_unlocked()
    try:
        stale = os.path.join(folder, "lock")
        try:
            os.remove(stale)
            print(f"megacomp: removed {stale}, left by a CPU codec kernel build that did not finish (killed?); "
                  f"building again", file=sys.stderr, flush=True)
        except FileNotFoundError:
            pass
        return _load_unlocked()
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _flock(folder: str) -> Optional[int]:
    """A descriptor holding the exclusive flock on ``folder/FLOCK_NAME`` (blocks while another process holds
    it), or None where the folder cannot hold one: not writable (torch's loader then says what is wrong, if
    anything is) or a file system without flock (some network mounts)."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, FLOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def _load_unlocked():
    return _load(name=NAME, sources=SOURCES, extra_cflags=_cflags(), extra_ldflags=["-fopenmp"], verbose=False)
