"""Build (once, cached by torch under TORCH_EXTENSIONS_DIR) and load the C++ codec kernels."""
from __future__ import annotations

import hashlib
import os

from torch.utils.cpp_extension import load as _load

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, f) for f in ("codec_kernels.cpp", "codec_sign.cpp", "codec_ef.cpp")]
HEADERS = [os.path.join(HERE, f) for f in ("codec_common.h", "codec_quant.h")]


def load():
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
    return _load(name="megacomp_codec_kernels", sources=SOURCES,
                 extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp",
                               "-DAT_PARALLEL_OPENMP=1", f"-DMEGACOMP_COMMON_H={header}"],
                 extra_ldflags=["-fopenmp"], verbose=False)
