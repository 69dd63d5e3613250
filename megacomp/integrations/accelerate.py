"""megacomp inside Hugging Face Accelerate (``accelerate`` 1.16): the compressed DDP communication hook and
FSDP2 compression on a prepared model, with their error-feedback state in ``Accelerator.save_state``.

    from megacomp.integrations.accelerate import compress_ddp, compress_fsdp2
    from megacomp.optimizer import CompressedHookState
    accelerator = Accelerator()
    model, opt = accelerator.prepare(model, opt)
    compress_ddp(accelerator, model, CompressedHookState(codec="int4", error_feedback="loco"))
    ...                                                    # accelerator.backward(loss); opt.step()
    accelerator.save_state(path)                          # later, in a fresh run: accelerator.load_state(path)

    # FSDP2 (an FSDP plugin with fsdp_version=2; Accelerate shards on accelerators only):
    comp = compress_fsdp2(accelerator, model, {"dp_gradient": "int4", "dp_gradient_error_feedback": "loco"})

What each does:
- :func:`compress_ddp`: registers megacomp's ``compressed_allreduce_hook`` with the state on the prepared
  (DDP-wrapped) model, and the state with ``accelerator.register_for_checkpointing``. (Accelerate's own
  ``DistributedDataParallelKwargs(comm_hook=...)`` offers torch's fp16 / bf16 / PowerSGD hooks only.)
- :func:`compress_fsdp2`: ``FSDPCompression(config).apply(model)`` on the prepared FSDP2 model, registered for
  checkpointing the same way.
- checkpoints: Accelerate writes custom objects from the main process only, so the registered object
  (megacomp.integrations.rank_state) gathers every rank's state when ``save_state`` asks for it (all ranks
  call ``save_state``) and gives each rank its own entry back in ``load_state``. Resume is bit for bit: the hook
  state is keyed by each bucket's parameters (names, from the prepared model) and the fresh DDP's first
  iteration (its initial bucket layout) is reduced in the saved layout (megacomp.optimizer.ddp_hook); FSDP2
  units keep one layout.

Error bounds and compression off: those of megacomp.optimizer.ddp_hook (``codec=None`` is DDP's default
averaging bit for bit) and megacomp.integrations.fsdp. Bytes: ``megacomp.comm.stats()``; :func:`wire_megabytes`
reads the ``dp_gradient`` / ``dp_parameter`` totals for ``accelerator.log``.

Failure behaviour (ValueError, one line each): :func:`compress_ddp` on a model that is not DDP-wrapped (not
prepared, or an FSDP/DeepSpeed run), :func:`compress_fsdp2` when the accelerator is not running FSDP2 (on CPU
Accelerate 1.16 never does: it ignores an FSDP plugin there and wraps the model in DDP).
"""
from __future__ import annotations

from typing import Any, Mapping, Union

import torch
from torch.nn.parallel import DistributedDataParallel

from ..comm import stats
from ..config import CommCompressionConfig
from ..optimizer import CompressedHookState
from .fsdp import FSDPCompression
from .rank_state import PerRankState


def compress_ddp(accelerator, model: torch.nn.Module, state: CompressedHookState) -> PerRankState:
    """Register megacomp's DDP hook with ``state`` on the prepared ``model`` (keyed by its parameter names) and
    ``state`` for checkpointing; returns the registered checkpoint object. ValueError: ``model`` is not DDP-wrapped."""
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"compress_ddp: the model is {type(model).__name__}, not DDP; pass the model returned by "
                         f"accelerator.prepare in a multi-process data-parallel run (FSDP2: compress_fsdp2)")
    state.register(model)  # model.register_comm_hook(state, compressed_allreduce_hook), keyed by parameter name
    saved = PerRankState(state)
    accelerator.register_for_checkpointing(saved)
    return saved


def compress_fsdp2(accelerator, model: torch.nn.Module,
                   config: Union[CommCompressionConfig, Mapping[str, Any], None]) -> FSDPCompression:
    """Install megacomp's FSDP2 collectives on the prepared ``model`` and register their state for checkpointing.
    ValueError: the accelerator is not running FSDP2, or FSDPCompression's own checks."""
    if not getattr(accelerator, "is_fsdp2", False):
        raise ValueError(f"compress_fsdp2: the accelerator runs {accelerator.distributed_type}, not FSDP2 (use an FSDP "
                         f"plugin with fsdp_version=2; Accelerate 1.16 shards on accelerators only, on CPU it wraps "
                         f"the model in DDP: use compress_ddp there)")
    comp = FSDPCompression(config).apply(model)
    accelerator.register_for_checkpointing(PerRankState(comp))
    return comp


def wire_megabytes() -> dict[str, float]:
    """This process's data-parallel wire megabytes so far (megacomp.comm.stats), e.g. for ``accelerator.log``."""
    return {f"megacomp/{path}_MB": s.wire_bytes / 1e6 for path, s in stats().items()
            if path in ("dp_gradient", "dp_parameter")}
