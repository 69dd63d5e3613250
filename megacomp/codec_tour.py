"""Codec tour: compressed collectives on several local ranks, with the error and bytes on the wire per codec.

    python -m megacomp.codec_tour --nproc 4        # spawns 4 gloo ranks itself
    torchrun --standalone --nproc-per-node 4 -m megacomp.codec_tour

Every rank all-reduces (SUM) a gradient-like tensor (heavy-tailed, mixed magnitudes) with each codec
and compares it with the exact fp64 sum. Then it repeats one all-reduce over several steps with int2
and with int2 + error feedback / LoCo to show how the time-averaged error shrinks. Rank 0 prints
Markdown tables; wire bytes come from ``megacomp.comm.stats()`` (bytes this rank sent).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from megacomp import comm
from megacomp.compression import make_codec, relative_error
from megacomp.launch import init_distributed, spawn_local

CODECS = ["none", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2", "sign"]


def gradient_like(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s test gradient: ``numel`` fp32 normals times a log-normal magnitude ``exp(2 N(0, 1))``
    shared by each run of 256 elements, times 1e-3. A pure function of ``(rank, numel)``, so any rank can
    rebuild any other rank's tensor."""
    g = torch.Generator().manual_seed(rank)
    scale = torch.exp(torch.randn(numel // 256 + 1, generator=g) * 2).repeat_interleave(256)[:numel]
    return torch.randn(numel, generator=g) * scale * 1e-3


def exact_sum(world: int, numel: int) -> torch.Tensor:
    """The reference result: the fp64 sum of every rank's gradient_like tensor, computed locally."""
    return torch.stack([gradient_like(r, numel).double() for r in range(world)]).sum(0)


def codec_table(numel: int) -> list[str]:
    """Markdown rows, one per codec of ``CODECS``: all-reduce (SUM) this rank's gradient_like tensor with
    ``comm.all_reduce`` and compare the result with exact_sum.

    Columns: relative error, max absolute error, this rank's wire and fp32 bytes (``comm.stats()`` under
    the tag ``demo``, reset before each codec), their ratio, and the wall time. Error bound of a lossy
    codec: per element at most the sum over ranks of the codec's per-element bound, plus one more
    quantization of the reduced shard on more than two ranks (megacomp.comm.collectives); ``none`` is the
    backend's fp32 sum. A collective: every rank of the initialised default group must call it.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    exact = exact_sum(world, numel)
    rows = ["| codec | rel. error | max abs error | wire bytes/rank | fp32 bytes/rank | ratio | ms |",
            "|---|---|---|---|---|---|---|"]
    for name in CODECS:
        codec = make_codec(name)
        x = gradient_like(rank, numel)
        comm.reset_stats()
        dist.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(x, codec=codec, tag="demo")
        ms = (time.perf_counter() - t0) * 1e3
        s = comm.stats()["demo"]
        err = (x.double() - exact).abs().max().item()
        rows.append(f"| {codec} | {relative_error(exact, x):.2e} | {err:.2e} | {s.wire_bytes:,} | "
                    f"{s.uncompressed_bytes:,} | {s.ratio:.3f} | {ms:.1f} |")
    return rows


def feedback_table(numel: int, steps: int) -> list[str]:
    """Markdown rows: ``steps`` int2 all-reduces (SUM) without error feedback, with classic EF and with
    LoCo, each on its own ``comm.Channel`` that carries the residual from step to step, and the relative
    error of the mean result over the steps against exact_sum.

    Every step sends the same tensor (gradient_like is deterministic) and int2 rounds to nearest, so
    without error feedback every step repeats the same error and the mean keeps it; with error feedback
    the residual fed into the next step compensates it, and the mean's error shrinks as ``steps`` grows
    (classic EF: the sent values telescope to the true sum up to the last residuals). A collective: every
    rank of the initialised default group must call it.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    exact = exact_sum(world, numel)
    rows = [f"| int2 all-reduce, {steps} steps | rel. error of the mean result |", "|---|---|"]
    for label, ef in [("no error feedback", None), ("classic EF", "ef"), ("LoCo (beta 0.8)", "loco")]:
        total = torch.zeros(numel, dtype=torch.float64)
        channel = comm.Channel(f"demo-{label}", "int2", error_feedback=ef)  # owns the residual across steps
        for _ in range(steps):
            x = gradient_like(rank, numel)
            channel.all_reduce(x)
            total += x.double()
        rows.append(f"| {label} | {relative_error(exact, total / steps):.3e} |")
    return rows


def run(numel: int, steps: int) -> None:
    """One rank of the demo: initialise torch.distributed from the launcher's environment, build both
    tables, print them on rank 0, destroy the default process group. Every rank must call it.

    Raises:
        RuntimeError: no rendezvous address (see megacomp.launch.init_distributed).
    """
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    comm_rows = codec_table(numel)
    ef_rows = feedback_table(min(numel, 1 << 16), steps)
    if rank == 0:
        print(f"\nmegacomp demo: all_reduce(SUM) of {numel:,} fp32 elements on {world} {dist.get_backend()} ranks\n")
        print("\n".join(comm_rows))
        print()
        print("\n".join(ef_rows))
    dist.destroy_process_group()


def main(argv=None) -> None:
    """Command-line entry point (``--nproc``, ``--numel``, ``--steps``): spawns ``--nproc`` local ranks when no
    launcher started this process and ``--nproc`` > 1, else runs this process as one rank.

    Raises:
        SystemExit: bad flags (argparse).
        torch.multiprocessing.ProcessRaisedException / ProcessExitedException: a spawned rank raised or
            exited with an error (see megacomp.launch.spawn_local).
    """
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="ranks to spawn when not started by a launcher")
    p.add_argument("--numel", type=int, default=1 << 20, help="elements per all-reduce")
    p.add_argument("--steps", type=int, default=20, help="steps of the error-feedback comparison")
    args = p.parse_args(argv)
    from megacomp.launch import detect_launch_env

    if detect_launch_env().launcher == "none" and args.nproc > 1:
        spawn_local(run, args.nproc, args.numel, args.steps)
    else:
        run(args.numel, args.steps)


if __name__ == "__main__":
    main()
