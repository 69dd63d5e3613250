"""Fused codec kernels behind one dispatch; see megacomp/kernels/README.md.

Backends, each bit-identical to the eager reference in megacomp/compression/quantize.py (the oracle) run
on the same device; the codec layer (quantize.encode_scaled / decode_scaled / ef_update_scaled) picks:
  ``triton``     CUDA tensors (fp32, bf16, fp16 inputs): Triton kernels in megacomp/kernels/triton/ for the int8,
                 int4, int2, fp8 and sign codecs: encode, decode (into fp32/bf16/fp16), decode-accumulate, the
                 fused error-feedback update and the one-pass error-feedback step (per-block scales on byte
                 boundaries, no dual scaling); per-tensor, per-block and dual scaling; round to nearest and
                 stochastic rounding. Compiled by triton on first launch per configuration and cached. Needs
                 the ``triton`` package; ``codec_triton.interpreted()`` runs the same kernels on CPU tensors
                 under triton's interpreter (tests).
  ``cpu``        contiguous fp32 CPU tensors: a C++ extension (megacomp/kernels/cpu/) built on first use with
                 torch.utils.cpp_extension and cached; the same codecs, and error feedback's whole step
                 (h = g + e, encode, update) in one pass (quantize.ef_encode_scaled).
  ``reference``  the eager torch code: always available; everything else (other devices and dtypes, the
                 Hadamard rotation itself).

The Triton kernels have run under triton's interpreter (tests/test_kernels_triton.py) and been compiled for
sm_90, not yet on a GPU; the C++ kernels run in every test here. ``scales.py`` holds the scale helpers the
reference and the Triton kernels share (a leaf module: the codec layer imports the kernels, never back).

Stochastic rounding: the dispatch draws one key per call from the generator and every backend computes
the same counter-based uniforms from (key, element index) (megacomp/compression/counter_rng.py), so the
kernels match the reference's draws exactly without storing them.

The first use of the CPU backend on a machine builds the extension (about a minute); one line on stderr
says so before the build and one after it with the time taken (from local rank 0 only in a launched job;
nothing when torch's cache is current).

``MEGACOMP_KERNELS=reference`` forces the reference. A build, compile or launch failure (no compiler, no
triton, a triton error) falls back to the reference with one logged warning, never an error.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger("megacomp")
_cpu = None
_cpu_failed = False
_triton = None
_triton_failed = False


def forced_reference() -> bool:
    """Whether ``MEGACOMP_KERNELS=reference`` asks for the eager reference everywhere (no compiled kernels)."""
    return os.environ.get("MEGACOMP_KERNELS", "auto").lower() == "reference"


def cpu_kernels():
    """The compiled CPU extension module, or None (reference forced, or the build failed: logged once)."""
    global _cpu, _cpu_failed
    if forced_reference() or _cpu_failed:
        return None
    if _cpu is None:
        try:
            from .cpu import build

            _cpu = _load_announced(build)
        except Exception as e:  # a compiler or header problem must not stop training
            _cpu_failed = True
            log.warning("megacomp.kernels: building the CPU codec kernels failed (%s); using the eager reference",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
    return _cpu


# (global rank, local rank) variables of the launchers megacomp.launch knows, in its order
_RANK_ENV = (("RANK", "LOCAL_RANK"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
             ("PMI_RANK", "MPI_LOCALRANKID"), ("PMIX_RANK", "PMIX_LOCAL_RANK"), ("SLURM_PROCID", "SLURM_LOCALID"))


def announces() -> bool:
    """Whether this process prints the one-time build messages: a single process does, and in a job
    launched with rank variables (torchrun's LOCAL_RANK/RANK, MPI's, Slurm's) only local rank 0 does (the
    global rank where the launcher gives no local one), so that each machine says it once."""
    for rank_var, local_var in _RANK_ENV:
        value = os.environ.get(local_var, os.environ.get(rank_var))
        if value is not None:
            return value.strip() == "0"
    return True


def _load_announced(build):
    """``build.load()``, with a line on stderr before a build (about a minute) and one after it."""
    try:
        needed = build.build_needed()
    except Exception:
        needed = None
    speak = needed is not False and announces()
    if speak:
        folder = build.build_directory()
        where = f"; cached in {folder}" if folder else ""
        what = "building" if needed else "building or loading"
        when = "about a minute" if needed else "about a minute when it builds"
        print(f"megacomp: {what} the CPU codec kernels (one time, {when}{where})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    hint = threading.Timer(LOCK_HINT_AFTER_S, _lock_hint, (build, start)) if announces() else None
    if hint is not None:  # a build, or a wait on another process's build, is silent: say what to check
        hint.daemon = True
        hint.start()
    try:
        module = build.load()
    finally:
        if hint is not None:
            hint.cancel()
    if speak:
        seconds = time.perf_counter() - start
        done = "built the CPU codec kernels in" if needed else "CPU codec kernels ready after"
        print(f"megacomp: {done} {seconds:.1f} s", file=sys.stderr, flush=True)
    return module


LOCK_HINT_AFTER_S = 180.0
"""Seconds a kernel build or load may take before :func:`_lock_hint` says what may be holding it up."""


def _lock_hint(build, start: float) -> None:
    """Printed once when ``build.load()`` is still running after LOCK_HINT_AFTER_S: a slow build, or another
    live process building or loading on the same cache (``build.load`` waits for its ``flock``; a killed
    build's lock is no longer waited on, see megacomp/kernels/cpu/build.py)."""
    folder = build.build_directory()
    if folder is None:
        return
    print(f"megacomp: the CPU codec kernels are not ready after {time.perf_counter() - start:.0f} s: a slow "
          f"compile, or another process building them in {folder} (it holds {build.FLOCK_NAME} there; "
          f"ps aux | grep -e ninja -e c++ shows a compiler). Checkouts at different paths sharing one cache "
          f"rebuild it in turn: give each its own TORCH_EXTENSIONS_DIR.", file=sys.stderr, flush=True)


def triton_kernels():
    """The Triton codec backend for CUDA tensors, or None (reference forced, triton missing, or an earlier
    failure: logged once)."""
    global _triton, _triton_failed
    if forced_reference() or _triton_failed:
        return None
    if _triton is None:
        try:
            from .triton import codec_triton

            if not codec_triton.HAVE_TRITON:
                raise RuntimeError(f"triton is not importable: {codec_triton.IMPORT_ERROR}")
            _triton = codec_triton.backend()
        except Exception as e:
            triton_failed(e)
            return None
    return _triton


def triton_failed(exc: BaseException) -> None:
    """Turn the Triton backend off after ``exc`` (a missing package, a compile or launch error), with one
    logged warning; the dispatch then uses the eager reference."""
    global _triton_failed
    if not _triton_failed:
        log.warning("megacomp.kernels: the Triton codec kernels failed (%s: %s); using the eager reference",
                    type(exc).__name__, (str(exc).splitlines() or [""])[0])
    _triton_failed = True


def backend_name(device: str = "cpu") -> str:
    """The backend the codec layer uses for int/fp8 codecs on tensors of ``device`` ("cpu" or "cuda")."""
    if str(device).startswith("cuda"):
        return "triton" if triton_kernels() is not None else "reference"
    return "cpu" if cpu_kernels() is not None else "reference"


__all__ = ["announces", "backend_name", "cpu_kernels", "forced_reference", "triton_failed", "triton_kernels"]
