"""README.md stays short, and every Python snippet in it runs.

Each ```python block of README.md is written to a temporary file and launched on 2 CPU gloo ranks with
``python -m torch.distributed.run --nproc-per-node 2 --standalone <file>`` (OMP_NUM_THREADS=1, this checkout
first on PYTHONPATH); it must exit with status 0. A block that is not meant to run has a ``<!-- norun -->``
line right before it (blank lines may sit between). A block that imports megatron is skipped where
megatron-core is not installed (``bash scripts/install.sh test`` installs it).
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MAX_LINES = 210
NORUN = "<!-- norun -->"
TIMEOUT_S = 300  # the first run on a machine may build the C++ codec kernels (about a minute)


def readme_lines() -> list[str]:
    with open(README, encoding="utf-8") as f:
        return f.read().splitlines()


def python_blocks(lines: list[str]) -> list[tuple[int, str, bool]]:
    """(line number of the opening fence, code, runs) for every ```python block."""
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, j = i + 1, i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            assert j < len(lines), f"README.md:{start}: the ```python block is not closed"
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            runs = not (k >= 0 and lines[k].strip() == NORUN)
            blocks.append((start, "\n".join(lines[i + 1:j]) + "\n", runs))
            i = j
        i += 1
    return blocks


BLOCKS = python_blocks(readme_lines())


def test_readme_is_short_and_has_a_quickstart():
    lines = readme_lines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; keep it at most {MAX_LINES} (detail goes to docs/guide/)"
    assert any(re.match(r"^#{1,6}\s+Quickstart\s*$", line) for line in lines), "README.md needs a 'Quickstart' heading"
    assert "bash scripts/install.sh test && python -m pytest -q tests" in lines, "CI runs the README's test command"


def test_readme_has_runnable_snippets():
    assert sum(runs for _, _, runs in BLOCKS) >= 4, "README.md should show runnable python snippets"


@pytest.mark.slow
@pytest.mark.parametrize("line,code,runs", BLOCKS, ids=[f"README.md:{line}" for line, _, _ in BLOCKS])
def test_readme_snippet_runs_on_two_ranks(line, code, runs, tmp_path):
    if not runs:
        pytest.skip(f"README.md:{line} is marked {NORUN}")
    if re.search(r"^\s*(from|import)\s+megatron\b", code, re.M) and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (bash scripts/install.sh test installs it)")
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    # a session of its own, so that a hung run's ranks are ended with the launcher (and nothing else)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                             str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"README.md:{line}: the snippet did not finish within {TIMEOUT_S} s\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, (f"README.md:{line}: the snippet exited with status {proc.returncode}\n"
                                  f"{out[-4000:]}\n{err[-6000:]}")
