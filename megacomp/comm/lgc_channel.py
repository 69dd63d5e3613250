"""The traffic path of LGC as published: :class:`LGCChannel` (megacomp.compression.lgc states the algorithm, its
phases, instances, residuals and bytes; megacomp.compression.lgc_autoencoder the network).

One call per bucket (a DDP bucket, a sharded-optimizer bucket), the bucket's tensors read as one flat fp32 vector
keyed by the call's ``key``. The collectives, issued from the calling thread in the same order on every rank:

  warm-up call:      one all-gather of every rank's ``k`` values and int32 indices (byte messages);
  training call:     the leader's broadcast of its ``k`` indices, one all-gather of every rank's values there;
                     local training (the same on every rank); on the last one, the leader's broadcast of its weights;
  compressed call:   ``ps``: the leader's broadcast of ``[code, indices]``, one all-gather of every rank's
                     ``[output scale, input scale, innovation values, innovation positions]``; ``ring``: the
                     leader's broadcast of the indices, one all-reduce of ``[s_i * code_i, s_i]`` and (``fit_scale``)
                     one of the output scales.

A broadcast is ``torch.distributed.broadcast`` counted as the leader sending its message to the ``N - 1`` others;
the all-gathers and the all-reduce are the path's own Channel calls, counted by their models. Each call records
its total under the path's name against the uncompressed all-reduce of the bucket; a test checks it equals
``LGC.wire_bytes``. A bucket the top-k cannot shrink is one plain all-reduce (``torch.distributed.all_reduce``,
bit for bit).

State (checkpointed): per key the autoencoder's weights and Adam state (equal on every rank), the call count, and
the residual (per rank, in :attr:`error_feedback`).

Failure behaviour: ops other than SUM/AVG raise ValueError, non-float tensors TypeError, a leader outside the group
ValueError naming the group size; a key whose bucket changed size raises the error feedback's ValueError.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ..compression import ErrorFeedback
from ..compression.lgc import LGC, fitted_scale, make_lgc, normalised, rms, top_indices
from ..compression.lgc_autoencoder import (decode, encode, init_autoencoder, innovation_dense, innovation_positions,
                                           train, train_state)
from .options import CommOptions
from .stats import StatsTable
from .whole_bucket import WholeBucketChannel

log = logging.getLogger("megacomp")


class LGCChannel(WholeBucketChannel):
    """A traffic path compressed with LGC as published (see the module docstring).

    Args:
        name: the tag its traffic is counted under in ``comm.stats()``.
        codec: an :class:`~megacomp.compression.lgc.LGC`, ``'lgc'`` or a mapping.
        group: the default process group of its calls.
        min_compress_numel: the small-tensor rule its owners apply with :meth:`compresses`.
        options: ``CommOptions`` of its collectives (default: from the environment).
        stats: the wire-statistics table (default: the process's).
    """

    def __init__(self, name: str, codec: Any = "lgc", *, group=None, min_compress_numel: int = 0,
                 options: Optional[CommOptions] = None, stats: Optional[StatsTable] = None) -> None:
        self.codec: LGC = make_lgc(codec)
        super().__init__(name, group=group, min_compress_numel=min_compress_numel, options=options, stats=stats)
        self.error_feedback = ErrorFeedback("ef")
        self._private_wire(group)
        self._broadcast_bytes = 0
        self.weights: dict[str, dict[str, torch.Tensor]] = {}
        self.train_states: dict[str, dict[str, torch.Tensor]] = {}
        self.calls: dict[str, int] = {}
        self.last_loss: dict[str, tuple[float, float]] = {}

    def phase(self, key: str) -> str:
        """The phase of the next call of ``key``: ``warmup``, ``train`` or ``compressed``."""
        c, lgc = self.calls.get(key, 0), self.codec
        return "warmup" if c < lgc.warmup_steps else "train" if c < lgc.warmup_steps + lgc.train_steps \
            else "compressed"

    # -- the exchange --------------------------------------------------------------------------------
    @torch.no_grad()
    def all_reduce_coalesced(self, tensors: Sequence[torch.Tensor], op=ReduceOp.SUM, group=None, *,
                             key: Optional[str] = None, validate: Optional[bool] = None) -> None:
        """Reduce every tensor of ``tensors`` in place over the group (SUM or AVG), as one flat bucket, in the
        phase of the call (module docstring). Returns when done."""
        group = self.group if group is None else group
        key = key or self.name
        flat = self._flat_bucket(tensors, op, "lgc")
        if flat is None:
            return
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if not self.codec.leader < world:
            raise ValueError(f"lgc: leader {self.codec.leader} is not a rank of this group of {world}; "
                             f"use leader: 0 (or a rank below {world})")
        self._broadcast_bytes = 0
        if not self.codec.compresses(flat.numel()):
            self._wire.all_reduce(flat, group=group, validate=validate)
        else:
            phase = self.phase(key)
            h = self.error_feedback.compensate(key, flat)
            if phase == "warmup":
                flat, own = self._warmup(h, group, world, validate)
            elif phase == "train":
                flat, own = self._train(h, key, group, world, rank, validate)
            else:
                flat, own = self._compressed(h, key, group, world, rank, validate)
            self.error_feedback.update(key, h, own)  # e = h - what was delivered on this rank's behalf
            self.calls[key] = self.calls.get(key, 0) + 1
        self._deliver(flat, tensors, op, world)
        self._record(tensors, world, rank, self._broadcast_bytes)

    def _warmup(self, h: torch.Tensor, group, world: int, validate) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.codec.topk(h.numel())
        idx = top_indices(h, k)
        msg = _pack(h[idx], idx)
        got = self._gather(msg, k, h.numel(), group, world, validate)
        delivered = h.new_zeros(h.numel())
        for part in got:  # rank order: the same sum on every rank
            vals, ids = _unpack(part, k)
            delivered.index_add_(0, ids, vals)
        return delivered, h.new_zeros(h.numel()).index_copy_(0, idx, h[idx])

    def _train(self, h, key, group, world, rank, validate) -> tuple[torch.Tensor, torch.Tensor]:
        lgc, n = self.codec, h.numel()
        k = lgc.topk(n)
        idx = self._leader_indices(h, k, group, rank, validate)
        v = h[idx].contiguous()
        got = torch.empty(world * k, dtype=torch.float32, device=h.device)
        self._wire.all_gather_into_tensor(got, v, group=group, validate=validate)
        got = got.view(world, k)
        delivered = h.new_zeros(n).index_copy_(0, idx, _rank_order_sum(got))
        w, state = self._autoencoder(key, world, h.device)
        call = self.calls.get(key, 0) - lgc.warmup_steps
        self.last_loss[key] = train(lgc, w, state, got, call, lgc.innovation(n))
        if call == lgc.train_steps - 1:  # the last training call: every rank adopts the leader's bits
            self._adopt_leader(key, group, rank)
            log.info("megacomp: %s lgc autoencoder of %s frozen after %d training calls (reconstruction %.4g, "
                     "similarity %.4g)", self.name, key, lgc.train_steps, *self.last_loss[key])
        return delivered, h.new_zeros(n).index_copy_(0, idx, v)

    def _compressed(self, h, key, group, world, rank, validate) -> tuple[torch.Tensor, torch.Tensor]:
        lgc, n = self.codec, h.numel()
        k = lgc.topk(n)
        w, _ = self._autoencoder(key, world, h.device)
        if lgc.variant == "ring":
            idx = self._leader_indices(h, k, group, rank, validate)
            v = h[idx].unsqueeze(0)
            s = rms(v)
            z = encode(lgc, w, normalised(v, s))
            buf = torch.cat([(s * z.reshape(-1)), s])
            self._wire.all_reduce(buf, group=group, validate=validate)
            total = buf[-1:]
            if not bool(total > 0):  # every rank's values are zero: nothing to deliver
                if lgc.fit_scale:  # the second all-reduce still runs: every rank takes this branch together
                    self._wire.all_reduce(torch.zeros(1, device=h.device), group=group, validate=validate)
                return h.new_zeros(n), h.new_zeros(n)
            dbar = decode(lgc, w, 0, (buf[:-1] / total).view(z.shape), k)
            a = s
            if lgc.fit_scale:
                a = fitted_scale(v, dbar)
                total = a.clone()
                self._wire.all_reduce(total, group=group, validate=validate)
            dbar = dbar.reshape(-1)
            return h.new_zeros(n).index_copy_(0, idx, total * dbar), h.new_zeros(n).index_copy_(0, idx, a * dbar)
        # ps: the leader's indices and common code, every rank's scale and innovation
        code_numel = lgc.code_numel(n)
        lead = torch.empty(code_numel + k, dtype=torch.int32, device=h.device)
        if rank == lgc.leader:
            idx = top_indices(h, k)
            v0 = h[idx].unsqueeze(0)
            z0 = encode(lgc, w, normalised(v0, rms(v0))).reshape(-1)
            lead.copy_(torch.cat([z0.view(torch.int32), idx.to(torch.int32)]))
        self._broadcast(lead, group, rank, validate)
        z0 = lead[:code_numel].view(torch.float32).view(1, lgc.code_channels, -1)
        idx = lead[code_numel:].long()
        v = h[idx].unsqueeze(0)
        s = rms(v)
        k_inno = lgc.innovation(n)
        pos = innovation_positions(v, k_inno)
        vals = v.gather(1, pos)
        a = s
        if lgc.fit_scale:  # the scale of this rank's own decoding (the receivers decode the same bits)
            a = fitted_scale(v, decode(lgc, w, rank, z0, k, innovation_dense(k, pos, normalised(vals, s))))
        msg = torch.cat([a.view(torch.int32), s.view(torch.int32), vals.reshape(-1).view(torch.int32),
                         pos.reshape(-1).to(torch.int32)]).view(torch.uint8)
        got = torch.empty(world * msg.numel(), dtype=torch.uint8, device=h.device)
        self._wire.all_gather_encoded(got, msg, numel=n, group=group, validate=validate)
        got = got.view(world, -1).view(torch.int32)
        total, own = h.new_zeros(k), None
        for r in range(world):  # node r's decoder, from the common code and node r's innovation, in rank order
            ar, sr = got[r, :1].view(torch.float32), got[r, 1:2].view(torch.float32)
            vals = got[r, 2:2 + k_inno].view(torch.float32).unsqueeze(0)
            inno = innovation_dense(k, got[r, 2 + k_inno:].long().unsqueeze(0), normalised(vals, sr))
            part = (ar * decode(lgc, w, r, z0, k, inno)).reshape(-1)
            total += part
            own = part if r == rank else own
        return h.new_zeros(n).index_copy_(0, idx, total), h.new_zeros(n).index_copy_(0, idx, own)

    # -- helpers ---------------------------------------------------------------------------------------
    def _gather(self, msg: torch.Tensor, k: int, n: int, group, world: int, validate) -> list[torch.Tensor]:
        got = torch.empty(world * msg.numel(), dtype=torch.uint8, device=msg.device)
        self._wire.all_gather_encoded(got, msg, numel=n, group=group, validate=validate)
        return list(got.view(world, -1))

    def _leader_indices(self, h: torch.Tensor, k: int, group, rank: int, validate) -> torch.Tensor:
        idx = torch.empty(k, dtype=torch.int32, device=h.device)
        if rank == self.codec.leader:
            idx.copy_(top_indices(h, k).to(torch.int32))
        self._broadcast(idx, group, rank, validate)
        return idx.long()

    def _broadcast(self, t: torch.Tensor, group, rank: int, validate) -> None:
        """``torch.distributed.broadcast`` from the leader, counted as the leader sending ``t`` to the others."""
        leader = self.codec.leader
        src = leader if group is None or group is dist.group.WORLD else dist.get_global_rank(group, leader)
        dist.broadcast(t, src=src, group=group)
        if rank == leader:
            self._broadcast_bytes += (dist.get_world_size(group) - 1) * t.numel() * t.element_size()

    def _autoencoder(self, key: str, world: int, device) -> tuple[dict, dict]:
        if key not in self.weights:
            self.weights[key] = init_autoencoder(self.codec, key, world, device)
            self.train_states[key] = train_state(self.weights[key])
        w = self.weights[key]
        if next(iter(w.values())).device != torch.device(device):  # loaded (or created by init_keys) elsewhere
            self.weights[key] = w = {n: t.to(device) for n, t in w.items()}
            self.train_states[key] = {n: t.to(device) if n != "t" else t for n, t in self.train_states[key].items()}
        return w, self.train_states[key]

    def _adopt_leader(self, key: str, group, rank: int) -> None:
        w = self.weights[key]
        flat = torch.cat([t.reshape(-1) for t in w.values()])
        self._broadcast(flat, group, rank, None)
        pos = 0
        for n, t in w.items():
            w[n] = flat[pos:pos + t.numel()].view(t.shape).clone()
            pos += t.numel()

    def weights_numel(self, world: int) -> int:
        """fp32 numbers of the autoencoder's weights for ``world`` nodes (what the leader broadcasts at the end of
        the training phase)."""
        return sum(t.numel() for t in init_autoencoder(self.codec, "", world).values())

    # -- checkpointing -------------------------------------------------------------------------------
    def init_keys(self, key: str, shapes: Sequence[torch.Size], device=None, world: Optional[int] = None) -> None:
        """Create the start weights, Adam state, call count and zero residual of the call ``key`` whose tensors have
        ``shapes`` (what the first call would create), so saved and template state dicts have the same keys."""
        numel = sum(math.prod(s) for s in shapes)
        if not self.codec.compresses(numel):
            return
        world = world or (dist.get_world_size(self.group) if dist.is_initialized() else 1)
        self._autoencoder(key, world, device or "cpu")
        self.calls.setdefault(key, 0)
        self.error_feedback.init_key(key, (numel,))

    def state_dict(self, error_feedback: bool = True) -> dict[str, Any]:
        """Settings (for the compatibility check), per key the weights, Adam state and call count, and (unless
        ``error_feedback=False``: its owner saves it) the residuals."""
        keys = sorted(self.weights)
        out = {"codec": self.codec.to_dict(), "keys": keys,
               "weights": {k: {n: v.clone() for n, v in self.weights[k].items()} for k in keys},
               "train_state": {k: {n: v.clone() for n, v in self.train_states[k].items()} for k in keys},
               "calls": torch.tensor([self.calls.get(k, 0) for k in keys], dtype=torch.int64)}
        if error_feedback:
            out["error_feedback"] = self.error_feedback.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises ValueError when it was saved with other LGC settings."""
        if state["codec"] != self.codec.to_dict():
            raise ValueError(f"channel {self.name!r}: state saved with {state['codec']}, this channel uses "
                             f"{self.codec.to_dict()}; resume with the same compression config")
        keys = list(state["keys"])
        self.weights = {k: {n: v.clone() for n, v in state["weights"][k].items()} for k in keys}
        self.train_states = {k: {n: v.clone() for n, v in state["train_state"][k].items()} for k in keys}
        self.calls = {k: int(c) for k, c in zip(keys, state["calls"].tolist())}
        if state.get("error_feedback") is not None:
            self.error_feedback.load_state_dict(state["error_feedback"])


def _pack(vals: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``k`` fp32 values and their int32 indices as one byte message."""
    return torch.cat([vals.contiguous().view(torch.uint8), idx.to(torch.int32).view(torch.uint8)])


def _unpack(msg: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_pack`'s values (fp32) and indices (int64)."""
    return msg[:4 * k].view(torch.float32), msg[4 * k:].view(torch.int32).long()


def _rank_order_sum(rows: torch.Tensor) -> torch.Tensor:
    """Sum of the rows, added in rank order (the same bits on every rank)."""
    total = rows[0].clone()
    for r in rows[1:]:
        total += r
    return total
