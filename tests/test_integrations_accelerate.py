"""megacomp.integrations.accelerate with Accelerate 1.16 on gloo, CPU.

- Bad input: compress_ddp on a model that is not DDP-wrapped, compress_fsdp2 on an accelerator that is not
  running FSDP2 (Accelerate never shards on CPU).
- Resume is bit for bit: 8 steps straight equal 4 steps + ``accelerator.save_state`` + a fresh model, optimizer,
  hook state and Accelerator ``load_state`` + 4 steps (losses and parameters, torch.equal), with int4 + LoCo
  (slow: int8 + EF) and with compression off, on 2 gloo ranks in Accelerate's MULTI_CPU mode (DDP).

The example (examples/accelerate_gpt.py: int4 + LoCo trains, bytes printed, resume from save_state continues the
curve) runs in CI through scripts/run_examples.sh, not here (about 1.5 minutes).
"""

import pytest
import torch

pytest.importorskip("accelerate")

from distributed import run_ranks  # noqa: E402
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


STEPS, HALF = 8, 4
HOOKS = {"off": dict(codec=None), "int4+loco": dict(codec="int4", error_feedback="loco", min_compress_numel=1000),
         "int8+ef": dict(codec="int8", error_feedback="ef", min_compress_numel=1000)}


def _run(hook_kwargs, ckpt, resume: bool):
    """Steps 0..HALF-1 then save_state (or, resuming: load_state, then steps HALF..STEPS-1), or all STEPS when
    ``ckpt`` is None; returns this rank's losses and final parameters."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    compress_ddp(accelerator, model, CompressedHookState(**hook_kwargs))
    steps = range(STEPS) if ckpt is None else range(HALF, STEPS) if resume else range(HALF)
    if resume:
        accelerator.load_state(ckpt)
    w_true = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    losses = []
    for step in steps:
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * step + accelerator.process_index))
        loss = ((model(x) - torch.tanh(x @ w_true)) ** 2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if ckpt is not None and not resume:
        accelerator.save_state(ckpt)
    return losses, [p.detach().clone() for p in model.parameters()]


def _resume_body(rank, world, names, tmp):
    import os

    from accelerate.state import AcceleratorState

    from megacomp import comm

    AcceleratorState._reset_state(reset_partial_state=True)  # a forked rank inherits the test process's (1 process)
    # Accelerate finds the group initialised and uses it (MULTI_CPU); these name this process's place in it
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")
    out = {}
    for name in names:
        ckpt = os.path.join(tmp, name)
        comm.reset_stats()
        straight, params = _run(HOOKS[name], None, False)
        s = comm.stats().get("dp_gradient")
        ratio = s.wire_bytes / s.uncompressed_bytes if s is not None else None
        first, _ = _run(HOOKS[name], ckpt, False)
        rest, resumed = _run(HOOKS[name], ckpt, True)
        out[name] = (straight == first + rest, all(torch.equal(a, b) for a, b in zip(params, resumed)), ratio)
    return out


def _check_resume(names, tmp_path):
    for res in run_ranks(_resume_body, 2, names, str(tmp_path), timeout=600):
        for name in names:
            losses_equal, params_equal, ratio = res[name]
            assert losses_equal and params_equal, (name, res[name])
            if name != "off":  # compression really was on (the large buckets after 2 plain steps)
                assert ratio < 0.6, (name, ratio)


def test_a_resumed_accelerator_continues_bit_for_bit(tmp_path):
    """accelerator.load_state into a fresh run equals the uninterrupted run exactly, int4 + LoCo and uncompressed
    (the fresh DDP's first iteration is reduced in the saved bucket layout)."""
    _check_resume(["int4+loco", "off"], tmp_path)


@pytest.mark.slow
def test_a_resumed_accelerator_continues_bit_for_bit_with_int8_ef(tmp_path):
    _check_resume(["int8+ef"], tmp_path)
