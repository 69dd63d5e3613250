"""Compression error during training, measured sparsely: what a channel delivers against the exact collective.

A :class:`ErrorProbe` is attached to channels (``Channel.probe``; the trainer attaches one to every channel of
a run) and armed for the calls it should measure (the trainer arms it for one iteration in every
``error_probe_interval``). On an armed call that the channel compresses:

  all_reduce / reduce_scatter_tensor / all_gather_into_tensor
      the same collective runs uncompressed (torch.distributed, blocking) on a copy of the input first, then
      the compressed one; when the compressed result is delivered (at once, or at ``wait()`` of an async
      call) this rank's part of it is compared with the exact one. The extra collective costs the
      uncompressed bytes once per probed call; they are counted in :attr:`ErrorProbe.bytes`, not in the
      channel's wire statistics (they are a diagnostic, not the run's traffic).
  isend (pipeline sends)
      the encoded message is decoded on the sender (decoding is deterministic: the receiver gets exactly
      this) and compared with the tensor handed in. No extra traffic.

Each measurement is a :class:`ProbeRecord`: the path, the call's error-feedback key (one per layer where the
caller gives one), the call's index within the armed window (the layer order, for paths whose calls share a
key), ``|delivered - exact|^2`` and ``|exact|^2`` on this rank (so relative errors aggregate exactly over
layers: sum both, then divide), and two statistics of the input that tell which tensors are hard to quantise:
the crest factor ``max|x| / rms(x)`` and the kurtosis ``E[x^4] / E[x^2]^2`` (3 for a Gaussian; large means
heavy tails), over this rank's whole input.

Not probed: all_to_all_single, the byte all-gathers of DeMo, PowerSGD and Accordion dp_gradient channels
(megacomp.comm.LowRankChannel / AccordionChannel) and AQ-SGD's delta sends; their paths are missing from the
logged table rather than reported as exact.

Probing never changes results: the exact collective works on a copy, no error-feedback state or stochastic
stream is touched, and every rank of a group must be armed alike (the trainer arms all ranks at the same
iteration; a rank armed alone would wait for the extra collective forever, as any mismatched collective does).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .common import all_gather_base, op_name, reduce_scatter_base


@dataclass(frozen=True)
class ProbeRecord:
    """One probed call, on this rank."""

    path: str
    """The channel's name (traffic path)."""
    tag: str
    """The tag the call was counted under (usually the path)."""
    key: str
    """The call's error-feedback key (per layer or bucket where the caller gives one, else the path)."""
    index: int
    """Order of the call among this path's probed calls in the armed window (the layer order)."""
    numel: int
    """Elements of the delivered tensor on this rank."""
    err_sq: float
    """Squared L2 norm of delivered - exact, on this rank."""
    ref_sq: float
    """Squared L2 norm of the exact result, on this rank."""
    crest: float
    """max|x| / rms(x) of the input (this rank's)."""
    kurtosis: float
    """E[x^4] / E[x^2]^2 of the input (this rank's); 3 for a Gaussian."""

    @property
    def rel_err(self) -> float:
        """|delivered - exact| / |exact|; 0 when both are zero, 1e30 for an error on an exact zero (finite, so
        logs stay JSON)."""
        return (self.err_sq / self.ref_sq) ** 0.5 if self.ref_sq > 0 else (0.0 if self.err_sq == 0 else 1e30)


def input_stats(x: torch.Tensor) -> tuple[float, float]:
    """Crest factor and kurtosis of ``x`` (fp64; zeros for an all-zero tensor)."""
    x = x.detach().reshape(-1).double()
    m2 = float((x * x).mean()) if x.numel() else 0.0
    if m2 == 0.0:
        return 0.0, 0.0
    return float(x.abs().max()) / m2 ** 0.5, float((x ** 4).mean()) / (m2 * m2)


class ErrorProbe:
    """Sparse compression-error measurement shared by a run's channels (see the module docstring).

    Thread-safe: the DDP hook and the sharded optimizer finish collectives on other threads."""

    def __init__(self) -> None:
        self.armed = False
        """Whether calls are measured now (set with :meth:`arm`, the same on every rank)."""
        self.bytes = 0
        """Bytes this rank sent for the exact reference collectives since the last :meth:`take`."""
        self._records: list[ProbeRecord] = []
        self._index: dict[str, int] = {}
        self._lock = threading.Lock()

    def arm(self, on: bool) -> None:
        """Measure the calls from now on (True) or stop (False); arming restarts the per-path call index."""
        with self._lock:
            if on and not self.armed:
                self._index.clear()
            self.armed = bool(on)

    def take(self) -> tuple[list[ProbeRecord], int]:
        """The records and reference bytes since the last call, and forget them."""
        with self._lock:
            out, sent = self._records, self.bytes
            self._records, self.bytes = [], 0
        return out, sent

    def _next_index(self, path: str) -> int:
        with self._lock:
            i = self._index.get(path, 0)
            self._index[path] = i + 1
            return i

    def record(self, path: str, tag: str, key: str, index: int, delivered: torch.Tensor, exact: torch.Tensor,
               stats: tuple[float, float]) -> None:
        """Compare ``delivered`` with ``exact`` (same numel) and keep the record."""
        d = delivered.detach().reshape(-1).double()
        e = exact.detach().reshape(-1).double()
        err_sq, ref_sq = float(((d - e) ** 2).sum()), float((e * e).sum())
        with self._lock:
            self._records.append(ProbeRecord(path, tag, key, index, e.numel(), err_sq, ref_sq, *stats))

    def _add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes += int(n)

    # -- the wrappers the channel calls --------------------------------------------------------------
    def reference(self, kind: str, path: str, tag: str, key: str, inp: torch.Tensor, group, op,
                  out_numel: int) -> Callable[[torch.Tensor], None]:
        """Run the exact collective ``kind`` on a copy of ``inp`` now; returns ``compare(delivered)`` to call
        once the compressed result is in ``delivered``."""
        index = self._next_index(path)
        stats = input_stats(inp)
        world = dist.get_world_size(group)
        avg = op_name(op) == "AVG"
        sum_op = dist.ReduceOp.SUM  # gloo has no AVG: sum, then divide
        x = inp.detach().reshape(-1).clone()
        if kind == "all_reduce":
            dist.all_reduce(x, op=sum_op if avg else op, group=group)
            exact = x
            sent = 2 * (world - 1) * (x.numel() // world) * x.element_size()
        elif kind == "reduce_scatter":
            exact = torch.empty(out_numel, dtype=x.dtype, device=x.device)
            reduce_scatter_base(exact, x, op=sum_op if avg else op, group=group)
            sent = (world - 1) * out_numel * x.element_size()
        elif kind == "all_gather":
            exact = torch.empty(out_numel, dtype=x.dtype, device=x.device)
            all_gather_base(exact, x, group=group)
            sent = (world - 1) * x.numel() * x.element_size()
        else:
            raise ValueError(f"ErrorProbe.reference: unknown collective {kind!r}")
        if avg:
            exact = exact / world
        self._add_bytes(sent)
        return lambda delivered: self.record(path, tag, key, index, delivered, exact, stats)

    def message(self, path: str, tag: str, key: str, tensor: torch.Tensor, decoded: torch.Tensor) -> None:
        """Record a point-to-point message: ``decoded`` is what the receiver gets for ``tensor``."""
        self.record(path, tag, key, self._next_index(path), decoded, tensor, input_stats(tensor))


def combine(records: list[ProbeRecord]) -> list[ProbeRecord]:
    """Merge the records of one call made on several ranks (same path, key and index: e.g. the TP ranks of a
    layer, or every rank's shard of a bucket): errors and norms add, numels add, the statistics take the max."""
    merged: dict[tuple, ProbeRecord] = {}
    for r in records:
        k = (r.path, r.key, r.index)
        m = merged.get(k)
        merged[k] = r if m is None else ProbeRecord(r.path, r.tag, r.key, r.index, m.numel + r.numel,
                                                    m.err_sq + r.err_sq, m.ref_sq + r.ref_sq,
                                                    max(m.crest, r.crest), max(m.kurtosis, r.kurtosis))
    return [merged[k] for k in sorted(merged, key=lambda k: (k[0], k[2], k[1]))]


def summarise(records: list[ProbeRecord]) -> dict[str, list[float]]:
    """Per path: ``[relative error over all its probed calls (sqrt(sum err^2 / sum ref^2)), worst call's
    relative error, largest crest factor, largest kurtosis, calls]`` (the trainer logs this per probed
    iteration)."""
    out: dict[str, list[float]] = {}
    for path in sorted({r.path for r in records}):
        rs = [r for r in records if r.path == path]
        err, ref = sum(r.err_sq for r in rs), sum(r.ref_sq for r in rs)
        out[path] = [(err / ref) ** 0.5 if ref > 0 else 0.0, max(r.rel_err for r in rs),
                     max(r.crest for r in rs), max(r.kurtosis for r in rs), len(rs)]
    return out


def per_call(records: list[ProbeRecord]) -> list[list]:
    """Every record as ``[path, key, index, numel, rel_err, crest, kurtosis]`` (rounded for a log line)."""
    return [[r.path, r.key, r.index, r.numel, round(r.rel_err, 6), round(r.crest, 3), round(r.kurtosis, 3)]
            for r in records]


def optional_probe(probe: Optional[ErrorProbe]) -> Optional[ErrorProbe]:
    """``probe`` when it is armed, else None (the channel's fast check)."""
    return probe if probe is not None and probe.armed else None
