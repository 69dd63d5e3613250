"""Run megatron-core's DistributedDataParallel, DistributedOptimizer and GPTModel on a CPU-only torch
(tests, examples, CPU benchmarks).

megatron-core allocates its data-parallel buffers and a few optimizer scalars on CUDA and checks parameter
types by their CUDA names, so on a machine without a GPU its DDP and optimizer do not construct. Exactly
these things stand in the way (three in megatron-core 0.16, a fourth in 0.19), and :func:`megatron_on_cpu`
changes only them, for as long as it is entered:

1. ``torch.cuda.current_device()``: the device of the gradient and parameter buffers
   (``_ParamAndGradBuffer``) and of the distributed optimizer's gather buffers. It returns ``"cpu"``.
2. ``device="cuda"`` literals in factory calls (``torch.tensor(..., device='cuda')`` for the optimizer's
   loss scale, ``clip_grads``' norm scalars): a ``TorchFunctionMode`` turns a CUDA ``device`` argument
   into ``"cpu"``.
3. ``param.type()`` compared with ``'torch.cuda.FloatTensor'`` / ``'torch.cuda.BFloat16Tensor'`` (the
   distributed and mixed-precision optimizers' parameter check): the same mode answers a CPU tensor's
   ``.type()`` (no arguments) with the CUDA name of its dtype.
4. ``torch.cuda.current_stream()`` (0.19's ``start_grad_sync`` waits on CUDA-graph events of the parameters
   on it): it returns a CPU stand-in whose ``wait_event`` / ``wait_stream`` / ``synchronize`` do nothing
   (CPU work is ordered already; there are no events without CUDA graphs).

For a ``GPTModel``, the layer spec's core attention also needs a swap on CPU: megatron-core's
``DotProductAttention`` forks the CUDA RNG tracker for its dropout; :class:`TorchSDPA` is the same causal
softmax attention through ``torch.nn.functional.scaled_dot_product_attention`` (no dropout), for
``spec.submodules.self_attention.submodules.core_attention``.

Nothing else is changed: the arithmetic, the collectives (gloo) and the bucketing are megatron-core's own,
so stock megatron-core runs unmodified on CPU and a comparison against it is a real one. It does this even
where CUDA is available (CPU tests on a GPU machine): a GPU training job should not enter it, megatron-core
runs there as it is.

Failure behaviour: nesting it raises RuntimeError. Leaving it restores ``torch.cuda.current_device`` and
``torch.cuda.current_stream`` and pops the mode.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

def _is_cuda(device) -> bool:
    if isinstance(device, int):  # a bare index means a CUDA ordinal in torch's factory functions
        return True
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


class _CudaNamesOnCpu(TorchFunctionMode):
    """Factory calls asked for CUDA get the CPU; a CPU tensor's ``.type()`` answers with the CUDA name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and kwargs["device"] is not None and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not args[0].is_cuda else name
        return func(*args, **kwargs)


class _CpuStream:
    """What megatron-core asks of ``torch.cuda.current_stream()``, on the CPU: ordering is program order."""

    def wait_event(self, event) -> None:
        """Nothing to wait for: CPU ops run in program order."""

    def wait_stream(self, stream) -> None:
        """Nothing to wait for: CPU ops run in program order."""

    def synchronize(self) -> None:
        """Nothing to wait for: CPU ops run in program order."""


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Let megatron-core's DDP and optimizer allocate on the CPU (see the module docstring).

    Raises:
        RuntimeError: the context is already entered.
    """
    original, original_stream = torch.cuda.current_device, torch.cuda.current_stream
    if getattr(original, "_megacomp_on_cpu", False):  # refused rather than silently stacked
        raise RuntimeError("megatron_on_cpu is already entered (it cannot be nested)")

    def current_device() -> str:
        return "cpu"

    def current_stream(device=None) -> _CpuStream:
        return _CpuStream()

    current_device._megacomp_on_cpu = True
    mode = _CudaNamesOnCpu()
    torch.cuda.current_device, torch.cuda.current_stream = current_device, current_stream
    mode.__enter__()
    try:
        yield
    finally:
        mode.__exit__(None, None, None)
        torch.cuda.current_device, torch.cuda.current_stream = original, original_stream


class TorchSDPA(torch.nn.Module):
    """A drop-in for megatron-core's DotProductAttention (same constructor and forward), causal, no dropout.

    Forward: ``[s, b, heads, d]`` query/key/value -> ``softmax(q k^T / sqrt(d) + causal mask) v`` ->
    ``[s, b, heads * d]``, as megatron-core returns it. Other mask types are not supported (the arguments are
    accepted and ignored: it is always causal)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **unused):
        super().__init__()
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        """Causal attention over ``[s, b, heads, d]`` inputs; returns ``[s, b, heads * d]``."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return ctx.permute(2, 0, 1, 3).reshape(ctx.shape[2], ctx.shape[0], -1)
