"""megacomp.integrations.accelerate with Accelerate 1.16 on gloo, CPU.

- Bad input: compress_ddp on a model that is not DDP-wrapped, compress_fsdp2 on an accelerator that is not
  running FSDP2 (Accelerate never shards on CPU).

The example (examples/accelerate_gpt.py: int4 + LoCo trains, bytes printed, resume from save_state continues the
curve) runs in CI through scripts/run_examples.sh, not here (about 1.5 minutes).
"""

import pytest
import torch

pytest.importorskip("accelerate")

from megacomp.integrations.accelerate import compress_ddp, compress_fsdp2, wire_megabytes  # noqa: E402
from megacomp.optimizer import CompressedHookState  # noqa: E402



def test_refuses_models_and_accelerators_it_cannot_compress():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # one process: prepare leaves the model unwrapped
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="not DDP"):
        compress_ddp(accelerator, model, CompressedHookState(codec="int4", error_feedback="loco"))
    with pytest.raises(ValueError, match="not FSDP2"):
        compress_fsdp2(accelerator, model, {"dp_gradient": "int4"})
    assert set(wire_megabytes()) <= {"megacomp/dp_gradient_MB", "megacomp/dp_parameter_MB"}
