#!/usr/bin/env bash
# CI leg: the newest megatron-core release on Python 3.12 (megatron-core 0.17+ requires Python >= 3.12; the main
# leg runs the pinned 0.16.1 on the machine's Python 3.11). In a virtual environment of its own it installs
# torch==2.13.0, megatron-core==$MEGATRON_CORE_NEWEST (--no-deps, as scripts/install.sh does) and megacomp with
# its test extra, then runs the megatron-core integration tests (tensor parallel, DDP and distributed optimizer)
# and the megatron-core example on 2 ranks, with compression on and off.
#   bash scripts/ci_py312.sh
# Environment: PY312 (a python3.12; default: python3.12 on PATH, else pyenv's newest 3.12), MEGACOMP_PY312_VENV
# (default ~/.cache/megacomp/py312-venv, kept between runs so that a second run reinstalls nothing).
# Note: PyPI has no CPU-only torch wheel for Python 3.12 on Linux, so torch==2.13.0 here is PyPI's CUDA build
# (about 4 GB with its nvidia-* wheels, downloaded once per venv); it runs on the CPU all the same.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
MEGATRON_CORE_NEWEST=0.19.2
t0=$SECONDS
PY312=${PY312:-}
if [ -z "$PY312" ]; then  # the first candidate that really runs Python 3.12 (a pyenv shim may exist but not run)
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for cand in "$(command -v python3.12 || true)" $(ls -d "$root"/versions/3.12*/bin/python 2>/dev/null | sort -rV); do
    if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      PY312=$cand
      break
    fi
  done
fi
if [ -z "$PY312" ]; then
  echo "ci_py312: no Python 3.12 found; install one (e.g. pyenv install 3.12) or set PY312=/path/to/python3.12" >&2
  exit 1
fi
VENV=${MEGACOMP_PY312_VENV:-$HOME/.cache/megacomp/py312-venv}
echo "ci_py312: $("$PY312" --version) from $PY312, venv $VENV, megatron-core $MEGATRON_CORE_NEWEST"
[ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet "torch==2.13.0"
have=$("$PY" -c "import megatron.core as m; print(m.__version__)" 2>/dev/null || true)
if [ "$have" != "$MEGATRON_CORE_NEWEST" ]; then
  "$PY" -m pip install --quiet --no-deps "megatron-core==$MEGATRON_CORE_NEWEST"
fi
PYTHON="$PY" bash scripts/install.sh test  # megacomp (editable, test extra) and its C++ kernels, built once
echo "ci_py312: installed in $((SECONDS - t0)) s"
"$PY" -c "from megacomp.integrations.megatron import check_megatron_version as v; print('ci_py312: megatron-core', v())"
"$PY" -m pytest -q -p no:cacheprovider tests/test_integrations_megatron.py tests/test_integrations_megatron_ddp.py
PATH="$VENV/bin:$PATH" bash scripts/run_examples.sh megatron_gpt megatron_gpt_off  # as the main leg runs them
echo "ci_py312: all ok ($((SECONDS - t0)) s)"
