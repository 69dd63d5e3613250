"""benchmarks.ddp_convergence (the torch-DDP side of the PowerSGD convergence study) launched for real with
torchrun on 2 gloo ranks: it trains, logs metrics.jsonl in the pretraining format, and counts the bytes of
megacomp's and torch's PowerSGD hooks alike (same factor sizes, the same all-reduce model)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _launch(tmp: Path, hook: str, cache: Path) -> list[dict]:
    log = tmp / hook.replace(":", "_").replace("{", "").replace("}", "").replace(" ", "").replace(",", "_")
    log.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "benchmarks.ddp_convergence", "--hook", hook, "--num-layers", "2", "--hidden-size", "32",
           "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--train-iters", "5", "--lr-warmup-iters", "1", "--log-dir", str(log),
           "--data-cache-dir", str(cache), "--tokenizer-max-bytes", "400000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("ddp-data")


def test_megacomp_and_torch_powersgd_hooks_train_and_count_alike(tmp_path, cache):
    ours = _launch(tmp_path, "megacomp:{name: powersgd, rank: 2, min_compression_rate: 2}", cache)
    theirs = _launch(tmp_path, "torch_powersgd:2", cache)
    for recs in (ours, theirs):
        assert [r["iteration"] for r in recs] == [1, 2, 3, 4, 5]
        first, last = recs[0]["traffic"]["dp_gradient"], recs[-1]["traffic"]["dp_gradient"]
        assert first[0] == first[1]  # the two uncompressed warm-up iterations
        assert last[0] < 0.5 * last[1]  # then the factors only
    assert ours[0]["loss"] == theirs[0]["loss"]  # same model, data and first (uncompressed) step


@pytest.mark.parametrize("hook", ["torch_powersgd:2", "fsdp2:none"])
def test_bucket_mb_is_refused_where_the_engine_keeps_its_own_buckets(hook):
    # the check runs before the process group starts, so a plain python launch reaches it
    r = subprocess.run([sys.executable, "-m", "benchmarks.ddp_convergence", "--hook", hook, "--bucket-mb", "0.25"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2
    assert "--bucket-mb applies to megacomp's hooks" in r.stderr and hook in r.stderr
