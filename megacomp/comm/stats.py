"""Wire statistics: bytes this rank sends, per tag, next to what the uncompressed collective would send.

Accounting model (bytes *sent by this rank*, its own chunk excluded):
  all_reduce      reduce-scatter phase: every chunk but its own; all-gather phase: its own shard to the
                  N-1 others (the bandwidth-optimal ring sends the same amount: 2 (N-1)/N of the tensor).
  reduce_scatter  every input chunk but its own.
  all_gather      its input to the N-1 others.
  all_to_all      every input chunk but its own.
  send            the whole message.
``uncompressed_bytes`` applies the same model to the tensor's own dtype, so ``wire/uncompressed`` is the
codec's saving on that path. Counts are local to the process; the demo and training loops sum them.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

_HELD = threading.local()  # per thread: a list while held_records() is active (see there)


@dataclass
class WireStats:
    """Totals for one tag."""

    calls: int = 0
    """Collectives or messages recorded."""
    wire_bytes: int = 0
    """Bytes this rank put on the wire (payload and scales)."""
    uncompressed_bytes: int = 0
    """Bytes the same traffic would take in the tensor's own dtype, uncompressed."""

    @property
    def ratio(self) -> float:
        """wire / uncompressed bytes (0 when nothing was recorded)."""
        return self.wire_bytes / self.uncompressed_bytes if self.uncompressed_bytes else 0.0


class StatsTable:
    """Per-tag :class:`WireStats`, thread-safe (the DDP hook finishes collectives in a background thread).

    A counter that can never change results. Each :class:`megacomp.comm.Channel` records into the table
    it was given; the free functions and channels built without one use the process's table, which
    :func:`stats` and :func:`reset_stats` read (the public contract of ``comm.stats()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, WireStats] = {}

    def record(self, tag: str, wire_bytes: int, uncompressed_bytes: int) -> None:
        """Add one call of ``tag``: bytes this rank sent and the uncompressed equivalent (held for later instead
        while this thread is inside :func:`held_records`)."""
        held = getattr(_HELD, "records", None)
        if held is not None:
            held.append((self, tag, int(wire_bytes), int(uncompressed_bytes)))
            return
        with self._lock:
            s = self._stats.setdefault(tag, WireStats())
            s.calls += 1
            s.wire_bytes += int(wire_bytes)
            s.uncompressed_bytes += int(uncompressed_bytes)

    def snapshot(self) -> dict[str, WireStats]:
        """A copy of the per-tag totals."""
        with self._lock:
            return {k: WireStats(v.calls, v.wire_bytes, v.uncompressed_bytes) for k, v in self._stats.items()}

    def reset(self) -> None:
        """Forget every total."""
        with self._lock:
            self._stats.clear()


PROCESS_STATS = StatsTable()
"""The default table (see :class:`StatsTable`)."""


def stats() -> dict[str, WireStats]:
    """A copy of the per-tag totals of the process's table since the last :func:`reset_stats`."""
    return PROCESS_STATS.snapshot()


def reset_stats() -> None:
    """Zero the process's table (the trainer does after logging each iteration)."""
    PROCESS_STATS.reset()


@contextlib.contextmanager
def held_records():
    """Inside, this thread's records go into the yielded list instead of their tables; :func:`replay` adds them
    later. A background job (megacomp.optimizer.acco) holds its traffic so that the thread that waits for it books
    the bytes at that point: per-iteration byte counts then do not depend on how far the job got by the time the
    iteration's statistics are read."""
    previous = getattr(_HELD, "records", None)
    _HELD.records = out = []
    try:
        yield out
    finally:
        _HELD.records = previous


def replay(records: list) -> None:
    """Book records kept by :func:`held_records` into their tables."""
    for table, tag, wire, uncompressed in records:
        table.record(tag, wire, uncompressed)
