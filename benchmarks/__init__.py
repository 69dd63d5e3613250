"""Benchmark and study drivers for megacomp: codec and kernel throughput, collectives and training over shaped
links between network namespaces, convergence studies, memory accounting, and the reports drawn from them.

Each driver is a module run as ``python -m benchmarks.<name>`` from the checkout (``bash scripts/install.sh``
installs it next to megacomp); their docstrings say what they measure and how to run them. They import
megacomp like any user would and share helpers through ordinary imports (``benchmarks.plot_metrics``'s
results files, ``benchmarks.netns_bench``'s namespaces and two-rank runner).
"""
from __future__ import annotations

import sys


def invocation() -> list[str]:
    """The arguments after ``python`` that started this process, as one would type them again:
    ``["-m", "benchmarks.<name>", *args]`` for a driver run as a module (there ``sys.argv[0]`` is the
    file's absolute path, which a results file should not record), else ``sys.argv`` unchanged."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    if name.startswith("benchmarks."):
        return ["-m", name, *sys.argv[1:]]
    return list(sys.argv)
