"""Timed spans of the communication path, for profiles of where a step's time goes (scripts/netns_bench.py profile).

Names (one per phase; which thread a span ran on says whether it was on the step's critical path):
  ``encode``            a codec encoding a message (error feedback included), in a compressed collective
  ``wire``              waiting for bytes: a compressed collective's exchange, or a whole uncompressed collective
                        called synchronously
  ``decode``            decoding received bytes (and summing them, for reductions)
  ``reduce_wait``       the sharded optimizer waiting for its gradient reductions in ``step()``
  ``update``            the inner optimizer's step on this rank's shard
  ``param_all_gather``  the sharded optimizer's parameter all-gather
  ``acco_estimate``, ``acco_update``   ACCO's background jobs (megacomp.optimizer.acco); ``acco_wait``: the main
                        thread waiting for one
  ``forward_backward``  the caller's compute (benchmarks mark it)
Spans nest (``wire`` inside ``reduce_wait`` inside ...); summaries count each name on its own.

Off by default: :func:`span` is then one global check, no clock read. :func:`enable` turns recording on (also as
``torch.profiler.record_function`` ranges, so a torch.profiler trace shows the same phases). Records are
(thread name, span name, start ns, end ns) on the perf_counter clock of this process.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict

import torch

class SpanRecorder:
    """Whether spans are recorded, and the records (thread-safe: background jobs record too)."""

    def __init__(self) -> None:
        self.enabled = False
        self._records: list[tuple[str, str, int, int]] = []
        self._lock = threading.Lock()

    def add(self, record: tuple[str, str, int, int]) -> None:
        """Append one (thread, name, start ns, end ns)."""
        with self._lock:
            self._records.append(record)

    def records(self) -> list[tuple[str, str, int, int]]:
        """A copy of the records so far."""
        with self._lock:
            return list(self._records)

    def reset(self) -> None:
        """Forget the records."""
        with self._lock:
            self._records.clear()


RECORDER = SpanRecorder()
"""The process's recorder (a profiler's switch and buffer: timing only, never an input to the numbers)."""


def enable(on: bool = True) -> None:
    """Start (or stop) recording spans in this process."""
    RECORDER.enabled = bool(on)


def enabled() -> bool:
    """Whether spans are being recorded."""
    return RECORDER.enabled


@contextlib.contextmanager
def span(name: str):
    """Time the body as phase ``name`` on the calling thread (nothing when recording is off)."""
    if not RECORDER.enabled:
        yield
        return
    t0 = time.perf_counter_ns()
    try:
        with torch.profiler.record_function(f"megacomp.{name}"):
            yield
    finally:
        RECORDER.add((threading.current_thread().name, name, t0, time.perf_counter_ns()))


def records() -> list[tuple[str, str, int, int]]:
    """A copy of the spans recorded so far."""
    return RECORDER.records()


def reset() -> None:
    """Forget the recorded spans."""
    RECORDER.reset()


def totals(recs: list[tuple[str, str, int, int]], start_ns: int = 0, end_ns: int = 1 << 62,
           exclusive: bool = False) -> dict[str, dict[str, float]]:
    """Seconds per thread kind ('main' for the main thread, 'background' for any other) and span name, of the spans
    that start inside [start_ns, end_ns). ``exclusive``: a span's time less that of the spans nested in it on the same
    thread (e.g. ``reduce_wait`` without the ``wire`` and ``decode`` inside it), so a thread's names add up to the
    time it spent inside spans."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_thread: dict[str, list] = defaultdict(list)
    for rec in recs:
        if start_ns <= rec[2] < end_ns:
            by_thread[rec[0]].append(rec)
    for thread, rows in by_thread.items():
        kind = "main" if thread == "MainThread" else "background"
        rows.sort(key=lambda r: (r[2], -r[3]))  # parents before the children they contain
        child_time = [0] * len(rows)
        stack: list[int] = []
        for i, (_, _, t0, t1) in enumerate(rows):
            while stack and rows[stack[-1]][3] <= t0:
                stack.pop()
            if stack and t1 <= rows[stack[-1]][3]:
                child_time[stack[-1]] += t1 - t0
            stack.append(i)
        for i, (_, name, t0, t1) in enumerate(rows):
            out[kind][name] += ((t1 - t0) - (child_time[i] if exclusive else 0)) / 1e9
    return {k: dict(v) for k, v in out.items()}
