"""Spawned gloo ranks for the benchmark drivers that measure inside fresh processes (no rank inherits another
configuration's heap, CUDA context or process group).

``spawn_ranks(target, world, extra, timeout, prefix)`` starts ``world`` processes with the ``spawn`` method, each calling
``target(rank, world, init_file, *extra, queue)``; the target initialises its process group from ``file://init_file``
and puts ``(rank, True, value)`` or ``(rank, False, traceback text)`` on ``queue``. Returns the values in rank order.

Failure behaviour: a rank that reports an error raises RuntimeError with every failed rank's text; a rank that reports
nothing within ``timeout`` seconds raises queue.Empty; processes still alive after that are killed and the rendezvous
file is removed, whatever happened.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from typing import Callable, Sequence


def spawn_ranks(target: Callable, world: int, extra: Sequence = (), timeout: float = 600.0,
                prefix: str = "megacomp-bench-") -> list:
    """Run ``target`` on ``world`` spawned ranks (see the module docstring); their values in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix=prefix)
    os.close(fd)
    os.unlink(init_file)  # the first rank creates it: a file:// rendezvous must not find an old one
    procs = [ctx.Process(target=target, args=(r, world, init_file, *extra, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in procs:
            rank, ok, value = queue.get(timeout=timeout)
            (results if ok else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    if errors:
        raise RuntimeError(f"rank(s) {sorted(errors)} failed:\n" + "\n".join(errors[r] for r in sorted(errors)))
    return [results[r] for r in range(world)]
