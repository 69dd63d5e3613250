"""Fused codec kernels behind one dispatch (installed as ``megacomp.kernels``).

Backends, fastest first, each bit-identical to the eager reference in megacomp/compression/quantize.py
(the oracle):
  ``cpu``        a small C++ extension (kernels/cpu/codec_kernels.cpp) built on first use with
                 torch.utils.cpp_extension and cached; int8/int4/int2/fp8 round-to-nearest encode,
                 decode and decode-accumulate on contiguous fp32 CPU tensors.
  ``reference``  the eager torch code; always available and used for everything the others do not
                 cover (stochastic rounding, the sign codec, CUDA tensors until the Triton path lands).

``MEGACOMP_KERNELS=reference`` forces the reference. A build failure (no compiler, no headers) falls back
to the reference with one logged warning, never an error.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("megacomp")
_cpu = None
_cpu_failed = False


def forced_reference() -> bool:
    return os.environ.get("MEGACOMP_KERNELS", "auto").lower() == "reference"


def cpu_kernels():
    """The compiled CPU extension module, or None (reference forced, or the build failed: logged once)."""
    global _cpu, _cpu_failed
    if forced_reference() or _cpu_failed:
        return None
    if _cpu is None:
        try:
            from .cpu.build import load

            _cpu = load()
        except Exception as e:  # a compiler or header problem must not stop training
            _cpu_failed = True
            log.warning("megacomp.kernels: building the CPU codec kernels failed (%s); using the eager reference",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
    return _cpu


def backend_name() -> str:
    return "cpu" if cpu_kernels() is not None else "reference"


__all__ = ["backend_name", "cpu_kernels", "forced_reference"]
