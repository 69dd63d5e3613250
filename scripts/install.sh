#!/usr/bin/env bash
# Install megacomp in editable mode. If torch is missing, install the pinned CPU wheel first
# (seconds, instead of a multi-GB CUDA download); an existing torch (e.g. a CUDA build) is never replaced.
#   bash scripts/install.sh          # the package
#   bash scripts/install.sh test     # the package + test requirements (pytest, pytest-timeout, hypothesis, and
#                                      triton on Linux x86_64 so that the Triton kernel tests run under its
#                                      interpreter), then builds the C++ codec kernels once
#   bash scripts/install.sh docs     # the package + the documentation site's pinned tools (the docs extra); then
#                                      mkdocs build --strict -d /tmp/megacomp-site  (or mkdocs serve)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "install.sh: no torch found: installing the CPU wheel torch==2.13.0 (a CUDA torch you install first is kept)"
  "$PY" -m pip install --quiet "torch==2.13.0"
else
  echo "install.sh: using the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
[ "${1:-}" = "docs" ] && extra="[docs]"
echo "install.sh: installing megacomp in editable mode${extra:+ with the ${1} requirements} (pip, quiet) ..."
"$PY" -m pip install --quiet --no-build-isolation -e ".${extra}"
# triton (~286 MB wheel): only if none is importable, so a CUDA torch keeps the triton it was built with
if [ "${1:-}" = "test" ] && [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && ! "$PY" -c "import triton" >/dev/null 2>&1; then
  echo "install.sh: installing triton==3.9.0 (a 286 MB wheel: the Triton kernel tests run under its interpreter) ..."
  "$PY" -m pip install --quiet "triton==3.9.0"
fi
# megatron-core for the megatron integration's tests and example: --no-deps, because its requirements
# (torch, numpy, packaging) are already here and pip must not swap the installed torch; an installed
# megatron-core is kept (the integration checks its version and says what it supports)
if [ "${1:-}" = "test" ] && ! "$PY" -c "import megatron.core" >/dev/null 2>&1; then
  echo "install.sh: installing megatron-core==0.16.1 (the megatron integration's tests; --no-deps) ..."
  "$PY" -m pip install --quiet --no-deps "megatron-core==0.16.1"
fi
# torchft for the fault-tolerance integration's tests (megacomp.integrations.torchft); the torchft extra of setup.py
if [ "${1:-}" = "test" ] && ! "$PY" -c "import torchft" >/dev/null 2>&1; then
  echo "install.sh: installing torchft==0.2.0 (the fault-tolerance integration's tests) ..."
  "$PY" -m pip install --quiet "torchft==0.2.0"
fi
# Lightning, Accelerate and torchtitan for their integrations' tests and examples (setup.py's frameworks extra),
# with the installed torch held fixed by a constraint (pip must not swap it for their requirements' choice)
if [ "${1:-}" = "test" ] && ! "$PY" -c "import lightning, accelerate, torchtitan" >/dev/null 2>&1; then
  echo "install.sh: installing lightning, accelerate and torchtitan (the frameworks extra; torch held at its version) ..."
  "$PY" -m pip install --quiet --no-build-isolation -e ".[frameworks]" \
    -c <(echo "torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')")
fi
# the C++ codec kernels: built here for the tests, once, in one process and outside any test's time limit
# (tests fork ranks that would otherwise all wait on the first build); a failed build only warns, and the
# eager reference is used (the kernel tests then say so)
if [ "${1:-}" = "test" ]; then
  echo "install.sh: building the C++ codec kernels (about a minute, once) ..."
  "$PY" -c "from megacomp import kernels; print('install.sh: CPU codec kernels:', kernels.backend_name('cpu'))"
  echo "install.sh: done."
else
  echo "install.sh: done. The C++ codec kernels build on first use (about a minute, once; it says so)."
fi
