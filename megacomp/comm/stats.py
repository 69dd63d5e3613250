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

import threading
from dataclasses import dataclass


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
        return self.wire_bytes / self.uncompressed_bytes if self.uncompressed_bytes else 0.0


_lock = threading.Lock()
_stats: dict[str, WireStats] = {}


def record(tag: str, wire_bytes: int, uncompressed_bytes: int) -> None:
    with _lock:
        s = _stats.setdefault(tag, WireStats())
        s.calls += 1
        s.wire_bytes += int(wire_bytes)
        s.uncompressed_bytes += int(uncompressed_bytes)


def stats() -> dict[str, WireStats]:
    """A copy of the per-tag totals since the last :func:`reset_stats`."""
    with _lock:
        return {k: WireStats(v.calls, v.wire_bytes, v.uncompressed_bytes) for k, v in _stats.items()}


def reset_stats() -> None:
    with _lock:
        _stats.clear()
