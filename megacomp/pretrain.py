"""GPT pretraining entry point: ``python -m megacomp.pretrain --config FILE.yaml [--flag value ...]``.

Works unchanged under torchrun, srun (SLURM_* environment) and mpirun (OMPI_*/PMI_* environment, or
mpi4py); with no launcher it runs as a single process. See megacomp/training/arguments.py for the flags.
"""
from __future__ import annotations

import sys

import torch.distributed as dist


def main(argv=None) -> int:
    """Parse the flags, train, and return the exit status: 0 on success, 2 for a configuration error.

    A ValueError while parsing, or a ValueError / FileNotFoundError while building or running the trainer,
    is printed as one line on stderr (with the rank) instead of a traceback. After parsing, the trainer (if
    built) is closed and the default process group (if initialised) destroyed on every way out.

    Raises:
        SystemExit: bad command-line flags (argparse).
        FileNotFoundError: a missing ``--config`` file (only ValueError is caught while parsing).
        Exception: any other error of the trainer propagates.
    """
    from .training import Trainer, parse_args

    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"megacomp-pretrain: error: {e}", file=sys.stderr)
        return 2
    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.train()
    except (ValueError, FileNotFoundError) as e:  # bad configuration or input: say so, no traceback soup
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"megacomp-pretrain: error on rank {rank}: {e}", file=sys.stderr)
        return 2
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
