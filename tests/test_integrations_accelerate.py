"""megacomp.integrations.accelerate with Accelerate 1.16 on gloo, CPU.

- Bad input: compress_ddp on a model that is not DDP-wrapped, compress_fsdp2 on an accelerator that is not
  running FSDP2 (Accelerate never shards on CPU).
- The Accelerate example on 2 ranks (slow): int4 + LoCo trains, bytes printed, resume from save_state continues
  the curve (first loss bit-identical).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from megacomp.integrations.accelerate import compress_ddp, compress_fsdp2, wire_megabytes  # noqa: E402
from megacomp.optimizer import CompressedHookState  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def test_refuses_models_and_accelerators_it_cannot_compress():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # one process: prepare leaves the model unwrapped
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="not DDP"):
        compress_ddp(accelerator, model, CompressedHookState(codec="int4", error_feedback="loco"))
    with pytest.raises(ValueError, match="not FSDP2"):
        compress_fsdp2(accelerator, model, {"dp_gradient": "int4"})
    assert set(wire_megabytes()) <= {"megacomp/dp_gradient_MB", "megacomp/dp_parameter_MB"}


@pytest.mark.slow
def test_accelerate_example_trains_logs_bytes_and_resumes():
    """examples/accelerate_gpt.py on 2 ranks (about 2 minutes on a loaded CPU)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "examples/accelerate_gpt.py", "--steps", "8"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "accelerate ddp: resumed from accelerator.save_state at step 4: first loss bit-identical" in r.stdout
    assert "megacomp/dp_gradient_MB" in r.stdout
