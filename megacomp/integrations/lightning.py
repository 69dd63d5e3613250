"""megacomp inside PyTorch Lightning (``lightning`` 2.6): the compressed DDP communication hook and FSDP2
compression, with their error-feedback state in Lightning's own checkpoints.

    from megacomp.integrations.lightning import MegacompCallback
    from megacomp.optimizer import CompressedHookState
    hook = CompressedHookState(codec="int4", error_feedback="loco")
    trainer = L.Trainer(strategy=DDPStrategy(process_group_backend="gloo"),
                        callbacks=[MegacompCallback(ddp_hook=hook)])
    trainer.fit(module)                                # trainer.fit(module, ckpt_path=...) resumes the hook too

    # FSDP2 (Lightning's ModelParallelStrategy): shard and compress in configure_model
    def configure_model(self):
        for block in self.model.layers: fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])
        self.fsdp = FSDPCompression({"dp_gradient": "int4", "dp_gradient_error_feedback": "loco"}).apply(self.model)
    callbacks=[MegacompCallback(fsdp=lambda: module.fsdp)]

What :class:`MegacompCallback` does:
- ``ddp_hook``: registers megacomp's ``compressed_allreduce_hook`` with that state on the DDP model at
  ``on_fit_start``, on any device. (``DDPStrategy(ddp_comm_hook=...)`` registers a hook on CUDA only and
  silently skips it on CPU, so the callback registers it, and refuses a strategy that also has one.)
- checkpoints: ``on_save_checkpoint`` stores every rank's state (the hook's iteration count and
  error-feedback residuals, the FSDP integration's residuals and stochastic-rounding streams) under
  ``checkpoint["megacomp"]``, gathered from all ranks (megacomp.integrations.rank_state: Lightning writes that
  part of the checkpoint from rank 0 only); ``on_load_checkpoint`` gives each rank its own entry back, so a
  ``trainer.fit(..., ckpt_path=...)`` continues with the residuals the saved run had.
- resume is bit for bit: the hook state is registered with the module's parameter names and keyed by each
  bucket's parameters, and the fresh DDP's first iteration (its initial bucket layout) is reduced in the saved
  layout, where the restored residuals belong (megacomp.optimizer.ddp_hook); FSDP2 units keep one layout. A
  ``trainer.fit(..., ckpt_path=...)`` therefore continues exactly as the uninterrupted run, compressed or not.

Error bounds and compression off: those of the hook (megacomp.optimizer.ddp_hook; ``codec=None`` is DDP's
default averaging bit for bit) and of megacomp.integrations.fsdp. Bytes: ``megacomp.comm.stats()``
(``dp_gradient``, ``dp_parameter``); the callback also logs the ``dp_gradient`` wire megabytes per epoch with
``pl_module.log`` when ``log_bytes`` is set.

Failure behaviour (ValueError, one line each): ``ddp_hook`` with a model that is not DDP-wrapped (another
strategy), a DDPStrategy that has its own ``ddp_comm_hook``, a checkpoint without megacomp state while the
callback has some to restore, or one saved with another world size.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from ..comm import stats
from ..optimizer import CompressedHookState
from .fsdp import FSDPCompression
from .rank_state import PerRankState

CHECKPOINT_KEY = "megacomp"
"""Where the callback keeps its state in Lightning's checkpoint dict."""


class MegacompCallback(Callback):
    """Registers megacomp's DDP hook and checkpoints megacomp's per-rank state (see the module docstring).

    Args:
        ddp_hook: the ``CompressedHookState`` to register as DDP's communication hook (None: no hook).
        fsdp: an ``FSDPCompression``, or a zero-argument callable returning it (it is built in
            ``configure_model``, after the callback), whose state to checkpoint (None: none).
        log_bytes: log ``dp_gradient`` wire megabytes (``megacomp/dp_gradient_MB``) at each epoch's end.
    """

    def __init__(self, ddp_hook: Optional[CompressedHookState] = None,
                 fsdp: Union[FSDPCompression, Callable[[], FSDPCompression], None] = None,
                 log_bytes: bool = True) -> None:
        self.ddp_hook, self.fsdp, self.log_bytes = ddp_hook, fsdp, log_bytes

    def _states(self) -> dict[str, PerRankState]:
        out = {}
        if self.ddp_hook is not None:
            out["ddp_hook"] = PerRankState(self.ddp_hook)
        if self.fsdp is not None:
            out["fsdp"] = PerRankState(self.fsdp)
        return out

    def on_fit_start(self, trainer, pl_module) -> None:
        """Register the DDP hook on the strategy's DDP model (keyed by its parameter names)."""
        if self.ddp_hook is None:
            return
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(f"MegacompCallback(ddp_hook=...): the model is {type(model).__name__}, not DDP; use "
                             f"DDPStrategy (FSDP2 compression: pass fsdp= instead)")
        if getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError("MegacompCallback(ddp_hook=...): the DDPStrategy has its own ddp_comm_hook; give the "
                             "hook to this callback only (Lightning registers strategy hooks on CUDA only)")
        self.ddp_hook.register(model)  # model.register_comm_hook(self.ddp_hook, compressed_allreduce_hook), named

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        """Log the data-parallel wire bytes so far (this process's count, megacomp.comm.stats)."""
        if self.log_bytes:
            s = stats().get("dp_gradient")
            if s is not None:
                pl_module.log("megacomp/dp_gradient_MB", s.wire_bytes / 1e6, rank_zero_only=True)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """Every rank's state under ``checkpoint["megacomp"]`` (a collective: Lightning calls it on all ranks)."""
        states = self._states()
        if states:
            checkpoint[CHECKPOINT_KEY] = {name: s.state_dict() for name, s in states.items()}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """This rank's state from ``checkpoint["megacomp"]``. ValueError: none there, or another world size."""
        states = self._states()
        if not states:
            return
        saved = checkpoint.get(CHECKPOINT_KEY)
        missing = sorted(set(states) - set(saved or {}))
        if missing:
            raise ValueError(f"MegacompCallback: the checkpoint has no megacomp state for {missing} (saved without "
                             f"this callback?); resume from a checkpoint saved with it, or start fresh")
        for name, s in states.items():
            s.load_state_dict(saved[name])
