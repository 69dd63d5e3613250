"""Exit signals (Slurm's warning signal, a scheduler's SIGTERM, Ctrl-C): checkpoint at the next iteration boundary.

Slurm sends ``--signal=USR1@120`` (sbatch) 120 s before the time limit, and SIGTERM when it preempts or
cancels a job; torchrun forwards SIGTERM to its workers. Ctrl-C sends SIGINT to the terminal's process
group: a process started without a launcher gets it directly, torchrun's workers (in sessions of their own)
get it forwarded by torchrun. A handler only sets a flag. At every iteration boundary the trainer asks
:func:`stop_requested`, a MAX all-reduce of the flag (and of a failed log write, and of a reason from the
heartbeat's launcher watch: torchrun died) over all ranks (one small collective; skipped alike on every rank when
nothing can ask for a stop: ``--no-exit-on-signal``, no launcher watched, no ``--log-dir``), because the signal
reaches the ranks at slightly different times and they must all stop at the same iteration; then it saves a
checkpoint (with ``--save``) and returns normally, as Megatron's exit-signal handler does: the entry point exits
with status 0 (4 when the launcher died). Another SIGTERM or SIGUSR1 while saving is not special:
the first already decided.

At the first Ctrl-C rank 0 says at once what happens next (one line: the run stops at the end of this
iteration, after saving). A second Ctrl-C is another SIGINT, or a SIGTERM, more than ``REPEAT_WINDOW_S`` seconds
after the first: within the window it is the same key press arriving twice (from the terminal and from a
launcher that forwards it); a SIGTERM counts because torchrun turns the second Ctrl-C it gets into a SIGTERM to
its workers (they run in sessions of their own, so the terminal's SIGINT reaches them only through torchrun).
It stops at once, without saving: the SIGINT handler that was installed before takes it (the entry point's
:class:`StopNow`: one line from rank 0 naming the iteration and the last checkpoint, exit status
``EXIT_INTERRUPTED``; Python's default: a KeyboardInterrupt). torchrun kills its workers its
``--shutdown-timeout`` (default 30 s) after the first Ctrl-C: where an iteration and a save take longer, raise
it. A process that started with SIGINT ignored (a background job of a script) keeps ignoring it.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
REPEAT_WINDOW_S = 2.0
"""A SIGINT this soon after the first is the same Ctrl-C delivered twice (terminal and torchrun), not a second."""
EXIT_INTERRUPTED = 130
"""Exit status after a Ctrl-C that stopped the run without saving (128 + SIGINT, the shell's convention)."""


class ExitSignals:
    """Installs flag-setting handlers for ``names`` (restored by :meth:`restore`); a second Ctrl-C goes to the
    SIGINT handler installed before (see the module docstring).

    Args:
        names: the signals that stop the run at the next boundary (none: ``--no-exit-on-signal``).
        save_dir: the ``--save`` directory (named in the Ctrl-C acknowledgement), or None.
        watch: polled at every boundary (:func:`stop_requested`); a text it returns stops the run like a signal,
            for that reason (the heartbeat's: the launcher died). None: nothing else stops the run.

    Raises:
        ValueError: an unknown signal name.
    """

    def __init__(self, names=DEFAULT_SIGNALS, save_dir: Optional[str] = None,
                 watch: Optional[Callable[[], Optional[str]]] = None) -> None:
        self.received: Optional[str] = None
        self.save_dir = save_dir
        self.watch = watch
        self.active = bool(names) or watch is not None
        """Whether anything can request a stop (the same on every rank: it follows the configuration)."""
        self.reason: Optional[str] = None
        """The watch's reason the ranks agreed on (the lowest rank's that had one), once they stop for it."""
        self._interrupted_at: Optional[float] = None
        self._old = {}
        for name in names:
            sig = getattr(signal, name, None)
            if not isinstance(sig, signal.Signals):
                raise ValueError(f"unknown signal {name!r}; use names such as SIGTERM or SIGUSR1")
            if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started in the background with Ctrl-C ignored: stay so
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be handled here
                pass

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if signum in (signal.SIGINT, signal.SIGTERM) and self._interrupted_at is not None:
            if now - self._interrupted_at > REPEAT_WINDOW_S:
                old = self._old.get(signal.SIGINT)
                if isinstance(old, StopNow):  # the entry point's: one line, then the process ends
                    old.stop(second=True)
                if callable(old):  # Python's default_int_handler, or a caller's own
                    old(signum, frame)
                raise KeyboardInterrupt
            return  # the same Ctrl-C, delivered twice
        if signum == signal.SIGINT:
            self._interrupted_at = now
            if not dist.is_initialized() or dist.get_rank() == 0:
                what = (f"saving a checkpoint under {self.save_dir}" if self.save_dir else
                        "no --save directory: nothing will be checkpointed")
                try:  # not print(): the main thread may be inside a print
                    os.write(2, (f"megacomp-pretrain: Ctrl-C: stopping at the end of this iteration, {what}; Ctrl-C "
                                 f"again (2 s or more later) stops at once without saving\n").encode())
                except OSError:
                    pass
        if self.received is None:  # the first signal decides; its name goes into the summary
            self.received = signal.Signals(signum).name

    def received_anywhere(self, device) -> bool:
        """Whether any rank got a signal (a collective: every rank calls it at the same boundary)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def stopped(self, iteration: int) -> str:
        """The clause of the end-of-run summary for a stop at ``iteration``."""
        if self.reason is not None and self.received is None:
            return f"stopped at iteration {iteration} because {self.reason}"
        name = self.received or "a signal on another rank"
        how = " (Ctrl-C)" if name == "SIGINT" else ""
        return f"stopped by {name}{how} at iteration {iteration}"

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


def stop_requested(signals: Optional[ExitSignals], error: Optional[OSError], device,
                   log_file: bool = True) -> tuple[bool, Optional[OSError]]:
    """At an iteration boundary, whether any rank got an exit signal or a reason from ``signals.watch``, and the
    error of the lowest rank that could not write its log (rank 0's metrics.jsonl), the same on every rank.

    A collective: one 24-byte all-reduce of the three flags, and an exchange of the error and the reasons only when
    there is one (the watch's agreed reason goes to ``signals.reason``). ``log_file``: whether a rank writes a log
    file whose failure stops the run (``--log-dir`` set: the same on every rank). When nothing can request a stop
    (no signal handlers, no watch, no log file) every rank skips the collective alike and returns (False, error).
    """
    active = signals is not None and signals.active
    if not active and not log_file:
        return False, error
    reason = signals.watch() if active and signals.watch is not None else None
    flags = torch.tensor([1.0 if active and signals.received else 0.0, 1.0 if error else 0.0,
                          1.0 if reason else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1].item() or flags[2].item():
            everyone = [None] * dist.get_world_size()
            mine = (error.errno, error.strerror, error.filename) if error else None
            dist.all_gather_object(everyone, (mine, reason))
            if flags[1].item():
                error = OSError(*next(e for e, _ in everyone if e))
            if flags[2].item():
                reason = next(r for _, r in everyone if r)
    if reason is not None:
        signals.reason = reason
    return bool(flags[0].item() or flags[2].item()), error


def log_error_line(error: OSError, save: Optional[Callable[[], None]], last: Callable[[], str]) -> OSError:
    """The error to raise after ``error`` (a log that cannot be written) stopped the run: ``save`` (a collective,
    None without ``--save`` or when this iteration is saved already) runs first; the line adds what was kept
    (``last``: the last checkpoint clause) or, when the save failed too, both reasons (the first one stays
    first)."""
    kept = ""
    if save is not None:
        try:
            save()
            kept = "; saved this iteration first"
        except (OSError, ValueError) as e:
            kept = f"; the checkpoint could not be saved either ({e})"
    return OSError(error.errno, f"{error.strerror}{kept}; {last()}", error.filename)


class StopNow:
    """The entry point's SIGINT handler: outside the training loop (start-up, teardown) the first Ctrl-C, inside
    it the second (chained from :class:`ExitSignals`), stops the process at once without saving.

    Rank 0 writes one line to stderr, e.g. ``megacomp-pretrain: second interrupt: stopped at iteration 31
    without saving; the last checkpoint is iteration 30 (ck/iter_0000030)``; every rank then runs ``cleanup``
    (the heartbeat's last beat with the status, so that no peer reports it lost; the ``--save`` lock's release)
    and ends with ``os._exit(EXIT_INTERRUPTED)``: nothing waits on a collective or a thread. A checkpoint being
    written is left as ``iter_N.tmp``, which the next run under that ``--save`` removes.

    Args:
        rank: this process's global rank (only rank 0 prints).
        progress: the iteration reached so far (None: the trainer is still being built).
        save_dir: the ``--save`` directory, or None.
        cleanup: called before the exit; its exceptions are ignored.
    """

    def __init__(self, rank: Callable[[], int], progress: Callable[[], Optional[int]], save_dir: Optional[str],
                 cleanup: Callable[[], None]) -> None:
        self.rank, self.progress, self.save_dir, self.cleanup = rank, progress, save_dir, cleanup

    def install(self) -> "StopNow":
        """Become the SIGINT handler (not when SIGINT is ignored, nor outside the main thread); returns self."""
        try:
            if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
                signal.signal(signal.SIGINT, self)
        except ValueError:
            pass
        return self

    def line(self, second: bool = False) -> str:
        """The one line rank 0 prints (``second``: the second Ctrl-C of the training loop)."""
        from .checkpoint_paths import last_checkpoint, last_checkpoint_clause
        iteration = self.progress()
        if second and iteration is not None and last_checkpoint(self.save_dir) == iteration:
            what = f"second interrupt: stopped at iteration {iteration}, after its checkpoint was written"
        elif second:
            what = f"second interrupt: stopped at iteration {iteration} without saving"
        elif iteration is None:
            what = "interrupted during start-up: stopped without saving"
        else:
            what = f"interrupted at iteration {iteration}, outside the training loop: stopped without saving"
        return f"megacomp-pretrain: {what}; {last_checkpoint_clause(self.save_dir)}"

    def __call__(self, signum=None, frame=None) -> None:
        self.stop()

    def stop(self, second: bool = False) -> None:
        """Print the line (rank 0), clean up, end the process with EXIT_INTERRUPTED; never returns."""
        try:
            text = self.line(second) if self.rank() == 0 else ""
        except Exception as e:  # noqa: BLE001 - the line must come out whatever the file system says
            text = f"megacomp-pretrain: interrupted: stopped without saving ({e})"
        try:
            self.cleanup()
        except Exception:  # noqa: BLE001 - the process ends next: nothing is left to report it to
            pass
        if text:
            try:
                os.write(2, (text + "\n").encode())  # not print(): the main thread may be inside a print
            except OSError:
                pass
        os._exit(EXIT_INTERRUPTED)
