"""The one helper every multi-rank test uses: run a function on N gloo ranks in forked processes.

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes (torch is already imported, so a
fork costs milliseconds, not the ~1.5 s of a fresh interpreter), initialises a gloo process group from
a file store with one intra-op thread per rank, calls ``fn(rank, world_size, *args)`` and returns the
per-rank return values (they must be picklable). An exception on any rank fails the test with that
rank's traceback; ranks that hang fail it after ``timeout`` seconds (10 s after another rank failed),
and every process is killed.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def _worker(fn, rank, world_size, init_file, args, queue, pg_timeout):
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args)
        # Wait for every rank before tearing down: a fast rank closing its sockets while a peer still
        # sets up a group (new_group is not a barrier for non-members) fails the peer spuriously.
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=30))
        except Exception:
            pass  # another rank failed: its own report says why
        # Serialise tensors by value: torch's default queue pickling shares them through file
        # descriptors that vanish when this process exits.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, assertion errors included, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


class RankFailure(AssertionError):
    """A multi-rank test failed; ``results`` (rank -> return value) and ``errors`` (rank -> text) say how."""

    def __init__(self, message: str, results=None, errors=None) -> None:
        super().__init__(message)
        self.results, self.errors = results or {}, errors or {}


def _load(results: dict) -> dict:
    return {r: torch.load(io.BytesIO(v), weights_only=False) for r, v in results.items()}


def _report(errors: dict) -> str:
    return "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 60.0,
              start_method: str = "fork"):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the list of results.

    ``start_method``: "fork" (fast: torch is already imported) or "spawn" (a clean process: for bodies that start
    threads of their own, e.g. torchft's Manager, which a fork of a long-running test process can deadlock or
    abort in; ``fn`` and ``args`` must then be importable / picklable)."""
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="megacomp-pg-")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, init_file, args, queue, pg_timeout), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, value = queue.get(timeout=0.5)
                (results if ok else errors)[rank] = value
            except queue_mod.Empty:
                pass
            for r, p in enumerate(procs):  # a rank that exited without reporting (crash, os._exit)
                if r not in results and r not in errors and not p.is_alive() and queue.empty():
                    errors[r] = f"rank {r} exited with code {p.exitcode} without reporting"
            if errors:  # the others may be stuck in a collective with the failed rank: short grace period
                deadline = min(deadline, time.monotonic() + 10.0)
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise RankFailure(f"rank(s) {missing} did not finish in time (hang?){_report(errors)}",
                                  _load(results), errors)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    if errors:
        raise RankFailure(f"{len(errors)} of {world_size} rank(s) failed{_report(errors)}", _load(results), errors)
    loaded = _load(results)
    return [loaded[r] for r in range(world_size)]
