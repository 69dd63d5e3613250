"""Non-interleaved 1F1B pipeline schedule (PipeDream-flush / Megatron's
forward_backward_pipelining_without_interleaving), and a forward-only path for evaluation.

Stage s of P with M micro-batches:
  warm-up    min(P - s - 1, M) forwards (receive activation, forward, send activation);
  steady     M - warm-up rounds of one forward then one backward, the sends and receives paired
             (send activation + receive gradient, send gradient + receive activation);
  cool-down  the remaining warm-up backwards.
At most P - s activations are alive per stage. Each micro-batch's loss is divided by M so that the
gradients accumulate to the mean over the global batch. The backward of every micro-batch but the last
runs inside ``no_sync()`` (e.g. DistributedOptimizer.no_sync) so data-parallel gradients are
communicated once per step, as soon as the last backward produces them.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch

from .communicator import PipelineCommunicator


def _backward(output: torch.Tensor, grad: Optional[torch.Tensor], input_: Optional[torch.Tensor]):
    """Backward through one micro-batch of this stage; returns the gradient of its input (or None)."""
    if grad is None:  # last stage: output is the scaled loss
        output.backward()
    else:
        torch.autograd.backward(output, grad_tensors=grad)
    return input_.grad if input_ is not None else None


def forward_backward_pipelining_without_interleaving(
        *, stage_forward: Callable[[Optional[torch.Tensor], int], torch.Tensor], num_microbatches: int,
        communicator: PipelineCommunicator, activation_shape: Sequence[int], dtype: torch.dtype = torch.float32,
        forward_only: bool = False, no_sync: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
        model: Optional[torch.nn.Module] = None,
) -> list[float]:
    """Run one global batch through the pipeline; returns the micro-batch losses on the last stage, [] elsewhere.

    ``stage_forward(input, k)``: this stage's forward of micro-batch ``k`` (``input`` is None on the first
    stage, which reads its own data); on the last stage it returns the loss of that micro-batch.
    ``activation_shape``/``dtype``: the tensor exchanged between stages (checked once by a handshake).
    ``model``: this stage's module, checked to hold parameters.

    Raises ValueError when the micro-batch count is not a positive multiple of the stage count (every
    stage then runs whole 1F1B rounds and the bubble stays (P-1)/M; fix the global batch size) or the
    stage has no trainable parameters (split the layers differently).
    """
    c = communicator
    if num_microbatches < 1 or num_microbatches % c.num_stages:
        raise ValueError(f"num_microbatches ({num_microbatches}) must be a positive multiple of the pipeline stages "
                         f"({c.num_stages}); choose global_batch_size = k * {c.num_stages} * micro_batch_size * "
                         f"data-parallel size")
    if model is not None and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"pipeline stage {c.stage} has no trainable parameters; give every stage at least one layer")
    c.handshake(activation_shape, dtype)
    shape = tuple(activation_shape)
    losses: list[float] = []
    inputs: list = []
    outputs: list = []

    def forward(k: int, x: Optional[torch.Tensor]) -> torch.Tensor:
        out = stage_forward(x, k)
        if c.is_last:
            losses.append(out.detach().item())
            out = out / num_microbatches
        return out

    if forward_only:
        for k in range(num_microbatches):
            with torch.no_grad():
                x = c.recv_forward(shape, dtype, k)
                c.send_forward(forward(k, x), k)
        return losses

    sync_ctx = no_sync or contextlib.nullcontext
    backwards_done = 0

    def backward(out, grad, x) -> Optional[torch.Tensor]:
        nonlocal backwards_done
        last = backwards_done == num_microbatches - 1
        with (contextlib.nullcontext() if last else sync_ctx()):
            g = _backward(out, grad, x)
        backwards_done += 1
        return g

    warmup = min(c.num_stages - c.stage - 1, num_microbatches)
    steady = num_microbatches - warmup
    for k in range(warmup):
        x = c.recv_forward(shape, dtype, k)
        out = forward(k, x)
        c.send_forward(out, k)
        inputs.append(x)
        outputs.append(out)

    x = c.recv_forward(shape, dtype, warmup) if steady > 0 else None
    for i in range(steady):
        k = warmup + i
        out = forward(k, x)
        grad = c.send_forward_recv_backward(out, shape, dtype, k)
        inputs.append(x)
        outputs.append(out)
        x0, out0 = inputs.pop(0), outputs.pop(0)
        slot = k - warmup  # micro-batch whose backward this is
        g = backward(out0, grad, x0)
        if i == steady - 1:
            c.send_backward(g, slot)
        else:
            x = c.send_backward_recv_forward(g, slot, shape, dtype, k + 1)

    for j in range(warmup):
        slot = steady + j
        grad = c.recv_backward(shape, dtype)
        g = backward(outputs.pop(0), grad, inputs.pop(0))
        c.send_backward(g, slot)
    return losses
