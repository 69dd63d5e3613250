"""benchmarks.netns_dp_worker launched for real with torchrun on 2 gloo ranks (no shaped link): methods whose names
share letters run their own path (Accordion is a DDP hook, not ACCO's sharded optimizer) and report their bytes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("method", ["megacomp_accordion", "megacomp_acco_int4_loco_int8"])
def test_worker_runs_each_method_on_its_own_path(method):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "benchmarks.netns_dp_worker", method, "3", "32", "1", "25"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert len(res["times"]) == 3 and res["wire"] > 0
