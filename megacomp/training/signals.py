"""Exit signals (Slurm's warning signal, a scheduler's SIGTERM): checkpoint at the next iteration boundary.

Slurm sends ``--signal=USR1@120`` (sbatch) 120 s before the time limit, and SIGTERM when it preempts or
cancels a job; torchrun forwards SIGTERM to its workers. A handler only sets a flag. At every iteration
boundary the trainer asks :meth:`ExitSignals.received_anywhere`, a MAX all-reduce of the flag over all
ranks (one 8-byte collective), because the signal reaches the ranks at slightly different times and they
must all stop at the same iteration; then it saves a checkpoint and exits with status 0, as Megatron's
exit-signal handler does. A second signal while saving is not special: the first already decided.
"""
from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class ExitSignals:
    """Installs flag-setting handlers for ``names`` (restored by :meth:`restore`).

    Raises:
        ValueError: an unknown signal name.
    """

    def __init__(self, names=DEFAULT_SIGNALS) -> None:
        self.received: Optional[str] = None
        self._old = {}
        for name in names:
            sig = getattr(signal, name, None)
            if not isinstance(sig, signal.Signals):
                raise ValueError(f"unknown signal {name!r}; use names such as SIGTERM or SIGUSR1")
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be handled here
                pass

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def received_anywhere(self, device) -> bool:
        """Whether any rank got a signal (a collective: every rank calls it at the same boundary)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
