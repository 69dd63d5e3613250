"""A PowerSGD traffic path: :class:`LowRankChannel`, the low-rank counterpart of :class:`Channel`.

The algorithm (rank, warm start, orthonormalisation, error feedback, bounds) is stated in
megacomp.compression.low_rank. This module runs its exchange over a process group, batched per call as
torch's hook does: one call (a DDP bucket, a sharded-optimizer bucket) issues

  1. one all-reduce of every compressed matrix's ``P`` factors, concatenated;
  2. one all-reduce of every ``Q`` factor, concatenated;
  3. one plain all-reduce of everything it does not compress (1-D tensors, matrices under the
     compression rate), concatenated.

All three are issued from the calling thread, in the same order on every rank, and the call returns
when they are done. That is why it works on gloo with any number of buckets: torch's PowerSGD hook
issues its second all-reduce from a future's callback on another thread, where it races the next
bucket's collective (with several buckets on gloo it fails with a collective size mismatch). The price is that the exchange does not
overlap the rest of backward.

Bytes, per rank and call: the factor all-reduces carry ``sum (n + m) r`` elements (fp32, or the
``factor_codec``; counted by the all-reduce model of megacomp.comm.stats), the plain one the rest; the
``uncompressed`` column counts the same all-reduce of the dense tensors. Reduction cost per rank: two
matrix products per matrix (``n m r`` multiply-adds each), one QR of ``n x r``, and the same all-reduce
algorithm as the dense path on a much smaller buffer.

State (checkpointed by :meth:`state_dict`): the warm-start ``Q`` per matrix (identical on every rank),
the error-feedback residual per matrix (per rank) and how many start matrices each key has drawn.
Keys are ``<call key>/<index of the tensor in the call>``.

Failure behaviour: non-float tensors raise TypeError; tensors whose sizes differ across ranks raise the
plain all-reduce's ValueError when ``validate`` is on (the first call of a run); a key whose tensor changed
shape raises ValueError naming it.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ..compression import ErrorFeedback
from ..compression.codecs import FLOAT_DTYPES
from ..compression.low_rank import PowerSGD, initial_q, make_low_rank, matrix_shape, orthonormalize, q_seed
from .channel import Channel
from .common import all_reduce_bytes, op_name
from .options import CommOptions
from .stats import StatsTable
from .whole_bucket import WholeBucketChannel

log = logging.getLogger("megacomp")


class LowRankChannel(WholeBucketChannel):
    """A traffic path compressed with PowerSGD (see the module docstring).

    Args:
        name: the tag its traffic is counted under in ``comm.stats()``.
        codec: a :class:`~megacomp.compression.low_rank.PowerSGD`, ``'powersgd'`` or a mapping.
        group: the default process group of its calls.
        min_compress_numel: the small-tensor rule its owners apply with :meth:`compresses` (a hook or optimizer
            sends smaller calls through :meth:`uncompressed`; ``all_reduce_coalesced`` itself always compresses).
        options: ``CommOptions`` of its collectives (default: from the environment).
        stats: the wire-statistics table (default: the process's).
    """

    def __init__(self, name: str, codec: Any = "powersgd", *, group=None, min_compress_numel: int = 0,
                 options: Optional[CommOptions] = None, stats: Optional[StatsTable] = None) -> None:
        self.codec: PowerSGD = make_low_rank(codec)
        super().__init__(name, group=group, min_compress_numel=min_compress_numel, options=options, stats=stats)
        self.error_feedback: Optional[ErrorFeedback] = ErrorFeedback("ef") if self.codec.error_feedback else None
        # the factor all-reduces run on a private table; each call records its total under this path's name,
        # next to the dense tensors' uncompressed bytes
        self._factor_stats = StatsTable()
        self._factors = Channel(name, self.codec.factor_codec, group=group, options=self.options,
                                stats=self._factor_stats)
        self._rest = Channel(name, None, group=group, options=self.options, stats=self._factor_stats)
        self.q: dict[str, torch.Tensor] = {}
        self.draws: dict[str, int] = {}  # start matrices drawn per key (warm_start=False: one per step)


    def set_validate(self, enabled: bool) -> None:
        """Turn the cross-rank argument check of later calls on or off."""
        self.options = replace(self.options, validate=bool(enabled))
        self._factors.set_validate(enabled)
        self._rest.set_validate(enabled)

    # -- the exchange --------------------------------------------------------------------------------
    @torch.no_grad()
    def all_reduce_coalesced(self, tensors: Sequence[torch.Tensor], op=ReduceOp.SUM, group=None, *,
                             key: Optional[str] = None, validate: Optional[bool] = None) -> None:
        """Reduce every tensor of ``tensors`` in place over the group (SUM or AVG), PowerSGD on the matrices
        worth compressing (``PowerSGD.rank_for``), plainly on the rest. Returns when done (see the module
        docstring for the order of the collectives and why it is synchronous)."""
        group = self.group if group is None else group
        key = key or self.name
        if op_name(op) not in ("SUM", "AVG"):
            raise ValueError(f"megacomp.comm.LowRankChannel: PowerSGD supports ReduceOp SUM and AVG, got {op_name(op)}")
        for t in tensors:
            if t.dtype not in FLOAT_DTYPES:
                raise TypeError(f"powersgd compresses floating tensors (float32, bfloat16, float16, float64), got "
                                f"{t.dtype}; reduce other dtypes with an uncompressed channel")
        if not tensors:
            return
        world = dist.get_world_size(group)
        avg = op_name(op) == "AVG"
        low = [i for i, t in enumerate(tensors) if self.codec.rank_for(t.shape)]
        rest = [i for i, t in enumerate(tensors) if not self.codec.rank_for(t.shape)]
        self._factor_stats.reset()  # this call's factor and rest bytes only
        if low:
            self._low_rank([tensors[i] for i in low], [f"{key}/{i}" for i in low], group, world, avg, validate)
        if rest:
            self._plain([tensors[i] for i in rest], group, world, avg, validate)
        wire = self._factor_stats.snapshot()[self.name].wire_bytes
        rank = dist.get_rank(group)
        dense = sum(all_reduce_bytes(t.numel(), t.element_size(), world, rank) for t in tensors)
        self.stats.record(self.name, wire, dense)

    def _low_rank(self, tensors, keys, group, world, avg, validate) -> None:
        ef, device = self.error_feedback, tensors[0].device
        hs, qs = [], []
        for t, k in zip(tensors, keys):
            n, m = matrix_shape(t.shape)
            mat = t.reshape(n, m)
            h = ef.compensate(k, mat) if ef is not None else mat.to(torch.float32)
            hs.append(h.to(torch.float32))
            qs.append(self._start_q(k, m, self.codec.rank_for(t.shape), device))
        # step 2-3: P = H Q for every matrix, one all-reduce of them all
        p_flat = torch.cat([(h @ q).reshape(-1) for h, q in zip(hs, qs)])
        self._factors.all_reduce(p_flat, group=group, key=f"{self.name}/P", validate=validate)
        p_hats, pos = [], 0
        for h, q in zip(hs, qs):
            n, r = h.shape[0], q.shape[1]
            p_hats.append(orthonormalize(p_flat[pos:pos + n * r].view(n, r)))
            pos += n * r
        # step 4: Q_i = H_i^T P̂, one all-reduce
        q_locals = [h.t() @ p for h, p in zip(hs, p_hats)]
        q_flat = torch.cat([q.reshape(-1) for q in q_locals])
        self._factors.all_reduce(q_flat, group=group, key=f"{self.name}/Q", validate=validate)
        pos = 0
        for t, k, h, p, q_local in zip(tensors, keys, hs, p_hats, q_locals):
            m, r = q_local.shape
            q_sum = q_flat[pos:pos + m * r].view(m, r)
            pos += m * r
            if ef is not None:  # step 6: rank i's own approximation P̂ Q_i^T
                ef.update(k, h, p @ q_local.t())
            out = p @ q_sum.t()
            if avg:
                out /= world
            t.copy_(out.view(t.shape))
            if self.codec.warm_start:
                if bool(torch.isfinite(q_sum).all()):
                    self.q[k] = q_sum.clone()
                else:  # an inf/NaN gradient (every rank sees the same all-reduced Q): start afresh next step
                    self.q.pop(k, None)

    def _start_q(self, key: str, m: int, r: int, device) -> torch.Tensor:
        q = self.q.get(key) if self.codec.warm_start else None
        if q is not None and q.shape != (m, r):
            raise ValueError(f"powersgd key {key!r} holds a Q of shape {tuple(q.shape)} but the tensor needs ({m}, {r}); "
                             f"use a distinct key per tensor layout")
        if q is not None and q.device != torch.device(device):
            q = self.q[key] = q.to(device)  # loaded (or created by init_keys) on another device
        if q is None:
            draw = self.draws.get(key, 0)
            self.draws[key] = draw + 1
            q = initial_q(m, r, q_seed(self.codec.init_seed, key, draw), device)
        return q

    def _plain(self, tensors, group, world, avg, validate) -> None:
        work = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        flat = torch.cat([t.reshape(-1).to(work) for t in tensors])
        self._rest.all_reduce(flat, group=group, validate=validate)
        if avg:
            flat /= world
        pos = 0
        for t in tensors:
            t.copy_(flat[pos:pos + t.numel()].view(t.shape))
            pos += t.numel()

    # -- checkpointing -------------------------------------------------------------------------------
    def init_keys(self, key: str, shapes: Sequence[torch.Size], device=None) -> None:
        """Zero errors and the start Q of the compressed tensors of a call (keys as the call makes them; the
        Q the first step would draw anyway), so saved and template state dicts (torch.distributed.checkpoint)
        have the same keys and shapes before the first step."""
        for i, shape in enumerate(shapes):
            r, k = self.codec.rank_for(shape), f"{key}/{i}"
            if not r:
                continue
            self.draws.setdefault(k, 0)
            if self.error_feedback is not None:
                self.error_feedback.init_key(k, matrix_shape(shape))
            if self.codec.warm_start and k not in self.q:
                self.q[k] = self._start_q(k, matrix_shape(shape)[1], r, device or "cpu")

    def state_dict(self, error_feedback: bool = True) -> dict[str, Any]:
        """Settings (for the compatibility check), warm-start Q and start matrices drawn per key, and (unless
        ``error_feedback=False``: its owner saves it) the residuals."""
        out = {"codec": self.codec.to_dict(), "q": {k: v.clone() for k, v in self.q.items()},
               "draws": torch.tensor([self.draws.get(k, 0) for k in sorted(self.draws)], dtype=torch.int64),
               "draw_keys": sorted(self.draws), "factors": self._factors.state_dict(error_feedback=False)}
        if error_feedback:
            out["error_feedback"] = self.error_feedback.state_dict() if self.error_feedback is not None else None
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises ValueError when it was saved with other PowerSGD settings."""
        if state["codec"] != self.codec.to_dict():
            raise ValueError(f"channel {self.name!r}: state saved with {state['codec']}, this channel uses "
                             f"{self.codec.to_dict()}; resume with the same compression config")
        self.q = {k: v.clone() for k, v in state["q"].items()}
        self.draws = dict(zip(state["draw_keys"], (int(d) for d in state["draws"])))
        self._factors.load_state_dict(state["factors"])  # a seeded stochastic factor codec's stream
        if state.get("error_feedback") is not None and self.error_feedback is not None:
            self.error_feedback.load_state_dict(state["error_feedback"])

