"""benchmarks.bench_kernels_gpu runs end to end (its ``--device cpu`` smoke mode), so the script kept for
the occasional GPU session is not first exercised on the GPU's clock. Times are printed, never asserted."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = ["-m", "benchmarks.bench_kernels_gpu"]


def _run(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, *SCRIPT, "--device", "cpu", "--numel", "64k", "--check", "16k",
                          "--repeats", "1", "--warmup", "1", *args], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_table_for_nearest_and_stochastic_rounding():
    for extra, codecs in ((("--dtype", "bf16", "--ef"), ("int8/b128", "int4/b128")),
                          (("--rounding", "stochastic", "--codecs", "int4,sign", "--dtype", "fp32"),
                           ("int4/b128/sr", "sign/b128/sr"))):
        out = _run(*extra)
        rows = [line for line in out.splitlines() if line.startswith("| ")]
        assert rows[1].startswith("| memcpy copy_")
        for codec in codecs:
            mine = [r for r in rows if f"| {codec} |" in r]
            assert len(mine) >= 3, (codec, out)  # encode, decode(s), decode+accumulate
            assert all(r.rstrip(" |").endswith("yes") for r in mine if not r.startswith("| ef step")), out
            assert any(r.startswith("| ef step") for r in mine) == ("--ef" in extra), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed where there is no GPU")
def test_without_cuda_the_default_device_refuses_clearly():
    res = subprocess.run([sys.executable, *SCRIPT, "--numel", "1k"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "needs a CUDA GPU" in res.stderr
