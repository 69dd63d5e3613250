"""Start torch.distributed from whatever launched us: torchrun, Slurm (srun), MPI (mpirun/mpiexec),
or nothing (then spawn local ranks ourselves).

Rank and world size are read, in order, from torchrun (RANK/WORLD_SIZE), Open MPI
(OMPI_COMM_WORLD_*), PMI/MPICH (PMI_RANK/PMI_SIZE), PMIx (PMIX_RANK) and Slurm (SLURM_PROCID /
SLURM_NTASKS). The rendezvous address is MASTER_ADDR/MASTER_PORT when set; under Slurm it defaults to
the launch node and a port derived from the job id; under MPI without MASTER_ADDR, mpi4py (when
installed) broadcasts rank 0's address and a free port. Backend: NCCL when CUDA is available, gloo
otherwise (override with MEGACOMP_BACKEND).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

_RANK_VARS = [("RANK", "WORLD_SIZE", "LOCAL_RANK"),
              ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
              ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
              ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
              ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, as told by its launcher."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    launcher: str
    """Which environment it came from: torchrun, mpi, slurm or none."""


def detect_launch_env(environ=os.environ) -> LaunchEnv:
    """Read rank/world size from the launcher's environment variables (single process if none).

    The first launcher, in the module docstring's order, whose rank and size variables are both set wins;
    a missing local-rank variable reads as 0. Raises ValueError when one of them is not an integer.
    """
    names = {"RANK": "torchrun", "OMPI_COMM_WORLD_RANK": "mpi", "PMI_RANK": "mpi", "PMIX_RANK": "mpi",
             "SLURM_PROCID": "slurm"}
    for rank_var, size_var, local_var in _RANK_VARS:
        if rank_var in environ and size_var in environ:
            return LaunchEnv(int(environ[rank_var]), int(environ[size_var]), int(environ.get(local_var, 0)),
                             names[rank_var])
    return LaunchEnv(0, 1, 0, "none")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reported free just now (another process may still take it before
    it is used). Raises OSError when no socket can be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous(env: LaunchEnv) -> str:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return f"tcp://{addr}:{port}"
    if env.launcher == "slurm" or "SLURM_JOB_ID" in os.environ:
        addr = addr or os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
        port = port or str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000)
        return f"tcp://{addr}:{port}"
    if env.launcher == "mpi":
        try:
            from mpi4py import MPI  # optional extra: megacomp[mpi]
        except ImportError:
            raise RuntimeError("launched by MPI without MASTER_ADDR/MASTER_PORT: export them (mpirun -x MASTER_ADDR=... "
                               "-x MASTER_PORT=...) or pip install mpi4py so rank 0 can broadcast its address") from None
        # MASTER_ADDR alone (no port) is honoured: gethostbyname may say 127.0.1.1 on Debian-style hosts
        info = (addr or socket.gethostbyname(socket.gethostname()), free_port()) if env.rank == 0 else None
        addr, port = MPI.COMM_WORLD.bcast(info, root=0)
        return f"tcp://{addr}:{port}"
    raise RuntimeError("no rendezvous address: set MASTER_ADDR and MASTER_PORT (torchrun sets them)")


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> LaunchEnv:
    """Initialise the default process group from the launcher's environment; returns where we are.

    A single process with no launcher gets a one-rank group on a free local port. Returns at once (without
    a new group) when torch.distributed is already initialised. Under NCCL it first selects the GPU
    ``local_rank % device_count``. ``timeout_s`` is the group's collective timeout.

    Raises:
        RuntimeError: the rendezvous cannot be found (the message names the variables to set, or mpi4py).
        ZeroDivisionError: backend ``nccl`` (e.g. from ``MEGACOMP_BACKEND``) with no visible GPU.
    """
    env = detect_launch_env()
    if dist.is_initialized():
        return env
    backend = backend or os.environ.get("MEGACOMP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    if env.world_size == 1 and env.launcher == "none":
        init = f"tcp://127.0.0.1:{free_port()}"
    else:
        init = _rendezvous(env)
    dist.init_process_group(backend, init_method=init, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s))
    return env


def _spawned(local_rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    fn(*args)


def spawn_local(fn: Callable, nprocs: int, *args) -> None:
    """Run ``fn(*args)`` in ``nprocs`` local processes with torchrun-style environment variables.

    Each process gets RANK = LOCAL_RANK = its index, WORLD_SIZE, MASTER_ADDR 127.0.0.1 and one free port, and
    one CPU thread; ``fn`` must be picklable (start method ``spawn``). Returns when all have finished.

    Raises:
        torch.multiprocessing.ProcessRaisedException: ``fn`` raised in a process.
        torch.multiprocessing.ProcessExitedException: a process exited with a non-zero code or a signal.
    """
    import torch.multiprocessing as mp

    mp.start_processes(_spawned, args=(nprocs, free_port(), fn, args), nprocs=nprocs, start_method="spawn")
