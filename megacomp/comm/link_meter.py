"""Per-call wire measurements of a channel: what it sent, over which link, and how long the exchange took.

A :class:`LinkMeter` collects :class:`CallRecord` rows for one decision window of ``--compression auto``
(megacomp.plan.auto_policy); a channel carries a :class:`MeterTap` (``channel.meter``: the meter, the path name, the
link kind its group crosses) and reports every collective through it. Without a tap (the default) a channel does
nothing extra.

What one record holds: the collective (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``send``), its size
(elements per rank as megacomp.plan.wire counts them), the group size, the dtype's bytes per element, the codec that
sent it (bytes are attributed to it, so a switch never mixes rungs), and two times:

  seconds   from the call's issue until its completion was observed: the whole call for a synchronous one, until
            ``wait()`` returned for an asynchronous one
  exposed   the part of ``seconds`` the caller spent blocked: all of it for a synchronous call, the ``wait()`` for an
            asynchronous one

``exact`` says whether ``seconds`` is the transfer's own duration: a synchronous call, or an asynchronous one whose
``wait()`` blocked (the transfer ended when the wait returned). An asynchronous call that was already complete when
waited for only bounds its transfer from above (the completion went unobserved, and observing it would need a
poll or a synchronisation on the hot path, which this module never adds).

Clocks: ``time.perf_counter`` on host tensors. On CUDA tensors a synchronous call is bracketed by two CUDA events
on the current stream (the stream waits for the collective, so the events measure it without blocking the host);
the events are resolved lazily, in :meth:`LinkMeter.drain` at the decision point, after the iteration's loss has
synchronised the device anyway. An asynchronous CUDA call is recorded without a time (NCCL completes it on its own
stream; its transfer is not observable without a synchronisation).

Failure behaviour: none of its own; a tap never changes what a call sends or returns.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
import torch

from .common import CompressedWork


@dataclass
class CallRecord:
    """One collective of one path (see the module docstring)."""

    path: str
    """The traffic path (its channel's name)."""
    link: str
    """The link kind the call's group crosses (intra_node, inter_node, inter_site)."""
    op: str
    """all_reduce, reduce_scatter (numel: output elements per rank), all_gather (numel: input per rank) or send."""
    numel: int
    """Elements per rank, as megacomp.plan.wire counts them for ``op``."""
    world: int
    """Ranks of the group."""
    itemsize: int
    """Bytes per element of the tensor's dtype."""
    codec: dict
    """The codec that sent it (``Codec.to_dict()``)."""
    seconds: float = 0.0
    """Issue to observed completion (module docstring); 0 until resolved."""
    exposed: float = 0.0
    """Seconds the caller was blocked."""
    exact: bool = False
    """Whether ``seconds`` is the transfer's own duration."""
    timed: bool = True
    """False for an asynchronous CUDA call (no host-side time)."""
    switchable: bool = True
    """Whether a codec switch of the path changes this call (not for a hop that keeps its own codec, nor for a
    message under the small-tensor rule)."""


class LinkMeter:
    """The records of one decision window, from every channel that holds a tap of it (thread-safe: the DDP hook and
    ACCO finish collectives in background threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list = []  # (CallRecord, pending CUDA events or None)

    def tap(self, path: str, link: str, switchable: bool = True) -> "MeterTap":
        """A tap for a channel of ``path`` whose calls cross ``link`` (``switchable``: its codec follows the path's
        switches)."""
        return MeterTap(self, path, link, switchable)

    def add(self, record: CallRecord, events=None) -> None:
        """Keep ``record`` (with its CUDA events, resolved by :meth:`drain`)."""
        with self._lock:
            self._records.append((record, events))

    def drain(self) -> list:
        """The window's records, CUDA times resolved, and an empty window after."""
        with self._lock:
            rows, self._records = self._records, []
        out = []
        for rec, events in rows:
            if events is not None:
                start, end = events
                end.synchronize()  # at the decision point: the iteration's loss already waited for the device
                rec.seconds = rec.exposed = start.elapsed_time(end) / 1e3
            out.append(rec)
        return out


class MeterTap:
    """What a channel holds: its meter, path, link and whether its codec follows the path's switches. :meth:`call`
    wraps one collective."""

    def __init__(self, meter: LinkMeter, path: str, link: str, switchable: bool = True) -> None:
        self.meter, self.path, self.link, self.switchable = meter, path, link, switchable

    def call(self, op: str, numel: int, world: int, tensor: torch.Tensor, codec, compressible: bool, run):
        """Run ``run()`` (the collective; returns a work handle or None) and record it (``compressible``: the message
        is not under the small-tensor rule); returns what ``run`` did, an asynchronous handle wrapped so its
        ``wait()`` is timed."""
        if world <= 1:
            return run()
        rec = CallRecord(self.path, self.link, op, int(numel), int(world), tensor.element_size(), codec.to_dict(),
                         switchable=self.switchable and compressible)
        cuda = tensor.is_cuda
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        work = run()
        if work is None:  # synchronous
            rec.exact = True
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.meter.add(rec, (start, end))
            else:
                rec.seconds = rec.exposed = time.perf_counter() - t0
                self.meter.add(rec)
            return None
        if cuda:  # NCCL finishes it on its own stream: bytes and size only
            rec.timed = False
            self.meter.add(rec)
            return work
        meter = self.meter

        def finish() -> None:
            tw = time.perf_counter()
            work.wait()
            te = time.perf_counter()
            rec.seconds, rec.exposed = te - t0, te - tw
            rec.exact = rec.exposed > 0.05 * rec.seconds  # it blocked: the transfer ended at the wait's return
            meter.add(rec)

        return _TimedWork(work, finish)


class _TimedWork(CompressedWork):
    """An asynchronous handle whose first ``wait()`` is timed; ``is_completed`` asks the inner handle."""

    def __init__(self, inner, finish) -> None:
        super().__init__(finish)
        self._inner = inner

    def is_completed(self) -> bool:
        """Whether the inner handle reports completion (never blocks)."""
        done = getattr(self._inner, "is_completed", None)
        return bool(done()) if done is not None else False

