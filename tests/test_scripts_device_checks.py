"""scripts/device_checks.sh, the one command of a lent GPU session: without a GPU the plain command says so in one line
with exit status 77, and the page writer's targets are checked on a hand-made measurement file. Its CPU dry run
(DEVICE_CHECKS_CPU=1: every step on CPU with tiny sizes, about 2 minutes) is a CI stage of its own,
scripts/ci_device_checks_cpu.sh, which checks the page it writes."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest
import torch

from benchmarks import gpu_report

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_checks.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the line printed where there is no GPU")
def test_without_a_gpu_one_line_and_exit_77(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DEVICE_CHECKS_CPU"}
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=dict(env, OUT=str(tmp_path)),
                         timeout=120)
    assert res.returncode == 77
    assert res.stdout.strip().splitlines() == [
        "device_checks: skipped: no CUDA GPU here (torch.cuda.is_available() is False); DEVICE_CHECKS_CPU=1 is the CPU "
        "dry run"]


def test_page_marks_the_targets_at_the_largest_size(tmp_path):
    rows = [{"op": op, "codec": codec, "dtype": "bf16", "numel": n, "ms": 1.0, "mb": 1.0, "gbps": 1.0, "ratio": ratio,
             "first_s": 0.1, "identical": "yes"}
            for n in (16, 256) for op, codec, ratio in (("memcpy copy_", "bf16", 1.0), ("encode bf16", "int8/b128", 0.75),
                                                         ("decode -> bf16", "fp8_e4m3/b128", 0.79),
                                                         ("decode+accumulate fp32", "int8/b128", 0.1),
                                                         ("ef step fp32 (LoCo)", "int4/b128", 0.61))]
    (tmp_path / "bench_bf16.json").write_text(json.dumps({"backend": "triton", "repeats": 10, "rows": rows}))
    page = gpu_report.page(tmp_path, "bash scripts/device_checks.sh")
    assert "| 256 | encode bf16 | int8/b128 | 1 | 1 | 0.75 | >= 0.70 | yes | yes |" in page
    assert "| 256 | decode -> bf16 | fp8_e4m3/b128 | 1 | 1 | 0.79 | >= 0.80 | **NO** | yes |" in page
    assert "| 16 | encode bf16 | int8/b128 | 1 | 1 | 0.75 |  |  | yes |" in page  # targets only at the largest size
    assert "Targets at the largest size: 2 of 3 met; missed: bf16 256 decode -> bf16 fp8_e4m3/b128 (0.79 < 0.80)" in page
    assert "sync_check.md missing" in page and "e2e.md missing" in page and "triton.log missing" in page
