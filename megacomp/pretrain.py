"""GPT pretraining entry point: ``python -m megacomp.pretrain --config FILE.yaml [--flag value ...]``.

Works unchanged under torchrun, srun (SLURM_* environment) and mpirun (OMPI_*/PMI_* environment, or
mpi4py); with no launcher it runs as a single process. See megacomp/training/pretrain_config.py (the configuration tree) or --help for the flags
(``--help`` lists them with one line each, and the compression presets).

Exit status: 0 when training finished, or stopped at an exit signal (SIGTERM, SIGUSR1, a first Ctrl-C) after
saving (megacomp.training.signals); 130 when a second Ctrl-C (more than 2 s after the first), or one outside the
training loop (start-up, shut-down), stopped the run at once without saving (one line from rank 0 naming the
iteration and the last checkpoint); 2 for bad input (flags, config or preset files, data, checkpoint and log
paths, parallel sizes, a checkpoint that cannot be resumed) and for a file system that fails under the run (a
full or read-only ``--save`` or ``--log-dir``: the line says what was saved first); 3 when the run
diverged (see megacomp.training.guard; nothing of the diverged state is saved); 4 when a replica of a
local-step run did not reach an outer exchange within ``--outer-timeout`` (megacomp.outer.liveness: the
survivors stop, naming it; restart from the last checkpoint), a torchft replica group found no quorum within
``--ft-quorum-timeout`` (the Lighthouse gone, or too few groups: it saves first), or a rank stalled or was lost (its heartbeat
stood still for ``--distributed-timeout-minutes``, or a collective failed while it stood still:
megacomp.training.heartbeat; one survivor names the rank, its host and the last iteration it reached, the
others stop without a word), or torchrun died under its live workers (they stop together at the next iteration
boundary, saving it with ``--save``; rank 0 names the launcher and the checkpoint); 1 for anything else (a
traceback: a bug, or a failure of the machine).

A rank that stops on an error it reported itself (an unwritable ``--log-dir``, say: only rank 0 writes there)
says so in its last heartbeat before its sockets close; the ranks whose collectives then fail exit with the
same status and print nothing (no gloo tracebacks after the line).

Failure output: every user-facing error is one line, ``megacomp-pretrain: error: ...``, printed by one
rank (rank 0; every rank raises it alike, since all read the same inputs). The other ranks wait up to
``MEGACOMP_ERROR_GRACE`` seconds (default 20) before exiting with the same status: the launcher
(torchrun, ``srun --kill-on-bad-exit``, mpirun) stops the whole job at the first rank that exits, and a
rank other than 0 exiting at once could take rank 0 down before it printed. A rank still alive after the
grace period has an error of its own (a file missing on one node, say) and prints it, naming its rank.
``MEGACOMP_DEBUG=1`` adds the traceback on every rank.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback

# torch is imported inside main(), after the start-up SIGINT handler is in place: importing it takes seconds, and a
# Ctrl-C then must be one line, not a KeyboardInterrupt traceback through torch's import machinery
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_REPLICA_LOST = 4
EXIT_RANK_LOST = 4  # as for a lost replica: the job stops and restarts from the last checkpoint


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")  # imported by main(): before that no group exists
    if dist is not None and dist.is_initialized():
        return dist.get_rank()
    return _launcher_rank()


def _launcher_rank() -> int:
    """This process's rank by its launcher's variables (0 without one)."""
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _say(message: str) -> None:
    """One line on stderr from rank 0 (the traceback too, on every rank, under MEGACOMP_DEBUG=1).

    Any other rank first waits out the grace period (see the module docstring), so that the launcher
    stops it after rank 0 has printed; if it is still running then, the error is its own and it prints it.
    """
    if os.environ.get("MEGACOMP_DEBUG", "") not in ("", "0"):
        traceback.print_exc()
    rank = _rank()
    if rank != 0:
        time.sleep(_error_grace())
    where = f"rank {rank}: " if rank != 0 else ""
    print(f"megacomp-pretrain: error: {where}{message}", file=sys.stderr, flush=True)


def _error_grace() -> float:
    """Seconds a rank other than 0 waits before printing its error (``MEGACOMP_ERROR_GRACE``, default 20)."""
    value = os.environ.get("MEGACOMP_ERROR_GRACE", "20")
    try:
        return max(0.0, float(value))
    except ValueError:
        return 20.0


def _configure_logging() -> None:
    """megacomp's INFO lines (small-tensor policy, optimizer buckets) on rank 0's stderr, warnings elsewhere."""
    log = logging.getLogger("megacomp")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO if _rank() == 0 else logging.WARNING)
        log.propagate = False


def main(argv=None) -> int:
    """Parse the flags, train, and return the exit status (see the module docstring).

    Raises:
        SystemExit: ``--help``, or bad command-line flags (argparse prints the usage once, from rank 0; status 2).
        Exception: anything that is not a user-facing error propagates with its traceback.
    """
    _interrupt_during_start_up()  # first: the imports below take seconds
    import torch.distributed as dist

    from .launch import init_distributed
    from .outer import ReplicaLost
    from .training import Trainer, TrainingDiverged, parse_args
    from .training.heartbeat import Heartbeat
    from .training.signals import EXIT_INTERRUPTED, StopNow

    try:
        cfg = parse_args(argv)
    except (ValueError, OSError) as e:  # a bad or missing --config file, unknown keys, inconsistent sizes
        _say(str(e) if not isinstance(e, OSError) else f"cannot read {e.filename}: {e.strerror}")
        return EXIT_BAD_INPUT
    _configure_logging()
    trainer = heartbeat = peer_status = None

    def stop_cleanup() -> None:  # a Ctrl-C that stops at once: no peer may take this rank for lost
        if heartbeat is not None:
            heartbeat.stop(EXIT_INTERRUPTED)
        if trainer is not None and trainer.lock is not None:
            trainer.lock.release()
    StopNow(_rank, lambda: trainer.iteration if trainer is not None else None, cfg.checkpoint.save,
            stop_cleanup).install()
    status = 1  # an exception that propagates: a traceback
    try:
        timeout_s = cfg.parallel.distributed_timeout_minutes * 60
        init_distributed(timeout_s=timeout_s)  # Trainer finds it initialised; the heartbeat covers its setup
        heartbeat = Heartbeat(timeout_s, progress=lambda: trainer.iteration if trainer is not None else 0,
                              on_verdict=_lost_rank_verdict).start()
        trainer = Trainer(cfg)
        trainer.train(watch=heartbeat.launcher_stop if heartbeat.launcher_pid is not None else None)
        status = 0
        if trainer.stop_reason is not None:  # the launcher died: the ranks stopped together (and saved)
            status = EXIT_RANK_LOST
            if _rank() == 0:
                from .training.checkpoint_paths import last_checkpoint_clause
                saved = (f"every rank stopped at iteration {trainer.iteration}, "
                         f"{last_checkpoint_clause(cfg.checkpoint.save)}")
                print(f"megacomp-pretrain: error: {heartbeat.launcher_line(saved, trainer.stop_reason)}",
                      file=sys.stderr, flush=True)
    except TrainingDiverged as e:
        _say(f"{e} (nothing was saved after the last checkpoint)")
        status = EXIT_DIVERGED
    except ReplicaLost as e:
        _say(str(e))
        status = EXIT_REPLICA_LOST
    except (ValueError, OSError) as e:  # bad configuration or input: one line, no traceback soup
        _say(str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror or e}")
        status = EXIT_BAD_INPUT
    except RuntimeError:  # a failed collective: a lost or stalled peer, or a peer that stopped on its own error
        peer_status = _failed_collective(heartbeat)
        if peer_status is None:
            raise
        status = peer_status
    finally:
        if heartbeat is not None:  # first: peers whose collectives fail when our sockets close read why
            heartbeat.stop(status)
        if peer_status is not None:
            # a peer is gone: the trainer's groups, background threads and gloo pairs still wait on it, and
            # tearing them down (or the interpreter's exit doing so) can block for many seconds; the line is
            # out and nothing is left to save, so the process ends here
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return status


def _interrupt_during_start_up() -> None:
    """Make a Ctrl-C (SIGINT) before the run's own handler is in place (megacomp.training.signals.StopNow, installed
    once the flags are parsed) one line and exit status 130 (128 + SIGINT, as signals.EXIT_INTERRUPTED), instead of
    a KeyboardInterrupt traceback from inside an import: rank 0 (by the launcher's variables) writes
    ``megacomp-pretrain: interrupted during start-up: stopped without saving``, every rank ends at once (nothing
    was started: no process group, no checkpoint, no lock). A SIGINT ignored at start (a background job) stays
    ignored; outside the main thread nothing is installed."""
    def stop(signum, frame) -> None:
        if _launcher_rank() == 0:  # not dist's: torch may be half imported
            try:  # not print(): the main thread may be inside a print
                os.write(2, b"megacomp-pretrain: interrupted during start-up: stopped without saving\n")
            except OSError:
                pass
        os._exit(128 + signal.SIGINT)

    try:
        if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
            signal.signal(signal.SIGINT, stop)
    except ValueError:  # not the main thread
        pass


def _lost_rank_verdict(line: str, claimed: bool) -> None:
    """The heartbeat thread's verdict: a watched peer stood still for the timeout while this rank may be
    blocked in a collective that waits longer. The claimant prints the line; every rank ends its process."""
    if claimed:
        print(f"megacomp-pretrain: error: {line}", file=sys.stderr, flush=True)
    else:
        time.sleep(min(_error_grace(), 5.0))  # the claimant prints first; a launcher then stops us anyway
    sys.stdout.flush()
    os._exit(EXIT_RANK_LOST)


def _failed_collective(heartbeat) -> "int | None":
    """The exit status after a collective failed (or None: not a peer's fault, let the traceback show).

    Asks the heartbeat which peer caused it (:meth:`Heartbeat.diagnose`: at most three beats). A lost or stalled
    peer: the first rank to claim the verdict prints the one line, status EXIT_RANK_LOST. A peer that stopped
    on an error it reported: its status, nothing printed. SIGTERM is held off meanwhile: torchrun sends it to
    every rank the moment one dies, and the line must come out first.
    """
    from .training.heartbeat import lost_line

    import torch.distributed as dist

    if heartbeat is None or not dist.is_initialized():
        return None
    if heartbeat.launcher_lost is not None:  # the store went with it: no diagnosis, one line per node
        if heartbeat.local_rank == 0:
            print(f"megacomp-pretrain: error: {heartbeat.launcher_line(None)}", file=sys.stderr, flush=True)
        return EXIT_RANK_LOST
    old = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        kind, beats = heartbeat.diagnose()
        if kind == "lost":
            if heartbeat.claim():
                line = lost_line(beats, max(1.0, 3 * heartbeat.interval), int(heartbeat.progress()))
                print(f"megacomp-pretrain: error: {line}", file=sys.stderr, flush=True)
            return EXIT_RANK_LOST
        if kind == "store":
            if heartbeat.claim():
                print(f"megacomp-pretrain: error: {heartbeat.store_lost_line()}", file=sys.stderr, flush=True)
            return EXIT_RANK_LOST
        if kind == "exited":
            return int(beats[0].exit_status)
        return None
    finally:
        signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    sys.exit(main())
