"""GPT pretraining entry point: ``python -m megacomp.pretrain --config FILE.yaml [--flag value ...]``.

Works unchanged under torchrun, srun (SLURM_* environment) and mpirun (OMPI_*/PMI_* environment, or
mpi4py); with no launcher it runs as a single process. See megacomp/training/pretrain_config.py (the configuration tree) or --help for the flags
(``--help`` lists them with one line each, and the compression presets).

Exit status: 0 when training finished, or stopped at an exit signal after saving; 2 for bad input (flags,
config or preset files, data paths, parallel sizes, a checkpoint that cannot be resumed); 3 when the run
diverged (see megacomp.training.guard; nothing of the diverged state is saved); 4 when a replica of a
local-step run did not reach an outer exchange within ``--outer-timeout`` (megacomp.outer.liveness: the
survivors stop, naming it; restart from the last checkpoint); 1 for anything else
(a traceback: a bug, or a failure of the machine).

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
import sys
import time
import traceback

import torch.distributed as dist

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_REPLICA_LOST = 4


def _rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
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
        SystemExit: ``--help``, or bad command-line flags (argparse prints the usage; status 2).
        Exception: anything that is not a user-facing error propagates with its traceback.
    """
    from .outer import ReplicaLost
    from .training import Trainer, TrainingDiverged, parse_args

    try:
        cfg = parse_args(argv)
    except (ValueError, OSError) as e:  # a bad or missing --config file, unknown keys, inconsistent sizes
        _say(str(e) if not isinstance(e, OSError) else f"cannot read {e.filename}: {e.strerror}")
        return EXIT_BAD_INPUT
    _configure_logging()
    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.train()
    except TrainingDiverged as e:
        _say(f"{e} (nothing was saved after the last checkpoint)")
        return EXIT_DIVERGED
    except ReplicaLost as e:
        _say(str(e))
        return EXIT_REPLICA_LOST
    except (ValueError, OSError) as e:  # bad configuration or input: one line, no traceback soup
        _say(str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror or e}")
        return EXIT_BAD_INPUT
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
