"""The traffic path of ``lgc_pca`` (the chunked PCA / MLP autoencoder code): :class:`LearnedChannel`, the
autoencoder counterpart of :class:`Channel` (as megacomp.comm.low_rank_channel is PowerSGD's). LGC as published
(``lgc``) is megacomp.comm.lgc_channel.

The algorithm (chunks, scales, the autoencoder, its training, the two variants, the bounds) is stated in
megacomp.compression.learned. This module runs it over a process group, one call per bucket (a DDP bucket, a
sharded-optimizer bucket), the bucket's tensors read as one flat fp32 vector and keyed by the call's ``key``:

  training call (the first ``train_steps`` calls of a key, and ``train_steps`` calls after a retraining trigger):
    1. one plain all-reduce of ``h`` (the bucket; plus the residual left by earlier frozen calls, then zeroed);
       with no residual this is ``torch.distributed.all_reduce`` of the bucket, bit for bit;
    2. one all-gather of ``train_samples`` normalised chunks per rank (the training data of every rank);
    3. local training on those samples (the same on every rank; megacomp.compression.learned.train); on the
       last training call, one all-gather of the weights, and every rank adopts rank 0's (equal bit for bit);
  frozen call:
    one all-reduce (``ring``: the codes, scaled) or one all-gather (``ps``: codes and scales) of every rank's
    message, with the two error sums appended; the sum is decoded; the residual is ``h - `` the sender's own
    decoding.

All collectives are issued from the calling thread, in the same order on every rank, and the call returns when
they are done (as LowRankChannel, so it works on gloo with any number of buckets; it does not overlap backward).

Bytes, per rank and call (the all-reduce and all-gather models of megacomp.comm.stats, fp32):
training: the all-reduce of the bucket, plus ``(N - 1) * train_samples * chunk`` for the samples, plus on the last
call ``(N - 1) * weights`` for the weights; frozen: ``ring`` the all-reduce of ``chunks * latent + 2`` numbers,
``ps`` ``(N - 1) * (chunks * (latent + 1) + 2)`` numbers. Each call is recorded under the path's name against
the uncompressed all-reduce of the bucket. A bucket whose code would not be smaller than itself (shorter than
about a chunk) is all-reduced uncompressed every call (logged once per key).

State (checkpointed by :meth:`state_dict`): per key the autoencoder's weights and training state (second moments
or Adam's; equal on every rank), the call count, the call at which the current training phase ends, the retraining
count and the last measured relative error; the residual per key (per rank, in :attr:`error_feedback`).

Failure behaviour: ops other than SUM/AVG raise ValueError, non-float tensors TypeError; tensors whose sizes
differ across ranks raise the collectives' ValueError when ``validate`` is on (the first call of a run); a key
whose bucket changed size raises the error feedback's ValueError naming it. Non-finite gradients: see
megacomp.compression.learned.
"""
from __future__ import annotations

import logging
import math
import zlib
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ..compression import ErrorFeedback
from ..compression.learned import (LGCPCA, chunked, decode, encode, init_autoencoder, make_lgc_pca, normalise,
                                   restart_training, train, train_state)
from .options import CommOptions
from .stats import StatsTable
from .whole_bucket import WholeBucketChannel

log = logging.getLogger("megacomp")


class LearnedChannel(WholeBucketChannel):
    """A traffic path compressed with a learned autoencoder (see the module docstring).

    Args:
        name: the tag its traffic is counted under in ``comm.stats()``.
        codec: an :class:`~megacomp.compression.learned.LGCPCA`, ``'lgc_pca'`` or a mapping.
        group: the default process group of its calls.
        min_compress_numel: the small-tensor rule its owners apply with :meth:`compresses`.
        options: ``CommOptions`` of its collectives (default: from the environment).
        stats: the wire-statistics table (default: the process's).
    """

    def __init__(self, name: str, codec: Any = "lgc_pca", *, group=None, min_compress_numel: int = 0,
                 options: Optional[CommOptions] = None, stats: Optional[StatsTable] = None) -> None:
        self.codec: LGCPCA = make_lgc_pca(codec)
        super().__init__(name, group=group, min_compress_numel=min_compress_numel, options=options, stats=stats)
        self.error_feedback = ErrorFeedback("ef")
        self._private_wire(group)
        self.weights: dict[str, dict[str, torch.Tensor]] = {}
        self.train_states: dict[str, dict[str, torch.Tensor]] = {}
        self.calls: dict[str, int] = {}
        self.train_until: dict[str, int] = {}
        self.retrains: dict[str, int] = {}
        self.last_error: dict[str, float] = {}
        self._said_plain: set[str] = set()


    def training(self, key: str) -> bool:
        """Whether the next call of ``key`` is a training call (uncompressed)."""
        return self.calls.get(key, 0) < self.train_until.get(key, self.codec.train_steps)

    # -- the exchange --------------------------------------------------------------------------------
    @torch.no_grad()
    def all_reduce_coalesced(self, tensors: Sequence[torch.Tensor], op=ReduceOp.SUM, group=None, *,
                             key: Optional[str] = None, validate: Optional[bool] = None) -> None:
        """Reduce every tensor of ``tensors`` in place over the group (SUM or AVG), as one flat bucket: a training
        call or a frozen call (module docstring). Returns when done."""
        group = self.group if group is None else group
        key = key or self.name
        flat = self._flat_bucket(tensors, op, "lgc_pca")
        if flat is None:
            return
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if not self.codec.compresses(flat.numel()):
            if key not in self._said_plain:
                self._said_plain.add(key)
                log.info("megacomp: %s bucket %s of %d elements travels uncompressed: its lgc_pca code (%d numbers) "
                         "would not be smaller", self.name, key, flat.numel(), self.codec.message_numel(flat.numel()))
            self._wire.all_reduce(flat, group=group, validate=validate)
        elif self.training(key):
            self._train_call(flat, key, group, world, rank, validate)
        else:
            flat = self._frozen_call(flat, key, group, world, rank, validate)
        self._deliver(flat, tensors, op, world)
        self._record(tensors, world, rank)

    def _train_call(self, flat: torch.Tensor, key: str, group, world: int, rank: int, validate) -> None:
        lgc, ef = self.codec, self.error_feedback
        w, opt = self._autoencoder(key, flat.device)
        e = ef.error(key)
        if e is not None and bool(e.any()):  # a retraining phase starts: deliver the residual too, then drop it
            flat += ef.check_shape(key, e, flat)
            ef.reset(key)
        starts = self.train_until.get(key, lgc.train_steps) - lgc.train_steps
        if self.retrains.get(key) and self.calls.get(key, 0) == starts:  # the first call of a retraining phase
            restart_training(lgc, opt)
        ef.init_key(key, (flat.numel(),))
        # this rank's training samples: normalised chunks, drawn per rank and call
        x = chunked(lgc, flat)
        g = torch.Generator().manual_seed(_seed(lgc.seed, key, self.calls.get(key, 0), rank))
        rows = torch.randint(x.shape[0], (lgc.train_samples,), generator=g).to(flat.device)
        samples = normalise(x[rows])[0].reshape(-1)
        self._wire.all_reduce(flat, group=group, validate=validate)  # what the step needs, uncompressed
        gathered = torch.empty(world * samples.numel(), dtype=torch.float32, device=flat.device)
        self._wire.all_gather_into_tensor(gathered, samples, group=group, validate=validate)
        loss = train(lgc, w, opt, gathered.view(-1, lgc.chunk))
        calls = self.calls[key] = self.calls.get(key, 0) + 1
        if calls == self.train_until.get(key, lgc.train_steps):
            self._adopt_rank0(key, group, world, validate)
            log.info("megacomp: %s lgc_pca autoencoder of %s frozen after call %d (mean squared error %.4g on "
                     "normalised chunks)", self.name, key, calls, loss)

    def _frozen_call(self, flat: torch.Tensor, key: str, group, world: int, rank: int, validate) -> torch.Tensor:
        lgc, ef, n = self.codec, self.error_feedback, flat.numel()
        w, _ = self._autoencoder(key, flat.device)
        h = ef.compensate(key, flat)
        message, own = encode_message(lgc, w, h)
        err2, norm2 = (h - own).pow(2).sum(), h.pow(2).sum()
        buf = torch.cat([message.reshape(-1), torch.stack([err2, norm2])])
        if lgc.variant == "ring":
            self._wire.all_reduce(buf, group=group, validate=validate)
            delivered = decode(lgc, w, buf[:-2].view(message.shape)).reshape(-1)[:n]
            sums = buf[-2:]
        else:
            gathered = torch.empty(world * buf.numel(), dtype=torch.float32, device=flat.device).view(world, -1)
            self._wire.all_gather_into_tensor(gathered.view(-1), buf, group=group, validate=validate)
            delivered = decode_ps(lgc, w, gathered[:, :-2].reshape(world, *message.shape), n)
            sums = gathered[:, -2:].sum(dim=0)
        ef.update(key, h, own)  # e = h - own: the sender's own decoding, exactly (classic error feedback)
        calls = self.calls[key] = self.calls.get(key, 0) + 1
        rel = math.sqrt(float(sums[0]) / float(sums[1])) if float(sums[1]) > 0 else 0.0
        self.last_error[key] = rel
        if calls == self.train_until.get(key, lgc.train_steps) + 1:  # the first frozen call after a training phase
            log.info("megacomp: %s lgc_pca %s: first frozen call, reconstruction error %.4g measured by the senders",
                     self.name, key, rel)
        if lgc.retrain_threshold and not rel <= lgc.retrain_threshold:  # NaN included
            self.train_until[key] = calls + lgc.train_steps
            self.retrains[key] = self.retrains.get(key, 0) + 1
            log.warning("megacomp: %s lgc_pca %s: reconstruction error %.4g measured by the senders exceeds "
                        "retrain_threshold %.4g at call %d; retraining for %d calls (retraining #%d)", self.name, key,
                        rel, lgc.retrain_threshold, calls, lgc.train_steps, self.retrains[key])
        return delivered

    def _autoencoder(self, key: str, device) -> tuple[dict, dict]:
        if key not in self.weights:
            self.weights[key] = init_autoencoder(self.codec, key, device)
            self.train_states[key] = train_state(self.codec, self.weights[key])
        w = self.weights[key]
        if next(iter(w.values())).device != torch.device(device):  # loaded (or created by init_keys) elsewhere
            self.weights[key] = w = {k: v.to(device) for k, v in w.items()}
            self.train_states[key] = {k: v.to(device) if k != "t" else v for k, v in self.train_states[key].items()}
        return w, self.train_states[key]

    def _adopt_rank0(self, key: str, group, world: int, validate) -> None:
        w = self.weights[key]
        flat = torch.cat([v.reshape(-1) for v in w.values()])
        gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
        self._wire.all_gather_into_tensor(gathered, flat, group=group, validate=validate)
        pos = 0
        for k, v in w.items():
            w[k] = gathered[pos:pos + v.numel()].view(v.shape).clone()
            pos += v.numel()

    # -- checkpointing -------------------------------------------------------------------------------
    def init_keys(self, key: str, shapes: Sequence[torch.Size], device=None) -> None:
        """Create the start weights, Adam state, call count and zero residual of the call ``key`` whose tensors have
        ``shapes`` (what the first call would create), so saved and template state dicts
        (torch.distributed.checkpoint) have the same keys and shapes before the first step."""
        numel = sum(math.prod(s) for s in shapes)
        if not self.codec.compresses(numel):
            return
        self._autoencoder(key, device or "cpu")
        self.calls.setdefault(key, 0)
        self.error_feedback.init_key(key, (numel,))

    def state_dict(self, error_feedback: bool = True) -> dict[str, Any]:
        """Settings (for the compatibility check), per key the weights, Adam state and counters, and (unless
        ``error_feedback=False``: its owner saves it) the residuals."""
        keys = sorted(self.weights)
        out = {"codec": self.codec.to_dict(), "keys": keys,
               "weights": {k: {n: v.clone() for n, v in self.weights[k].items()} for k in keys},
               "train_state": {k: {n: v.clone() for n, v in self.train_states[k].items()} for k in keys},
               "counters": torch.tensor([[self.calls.get(k, 0), self.train_until.get(k, self.codec.train_steps),
                                          self.retrains.get(k, 0)] for k in keys], dtype=torch.int64).view(-1, 3),
               "last_error": torch.tensor([self.last_error.get(k, float("nan")) for k in keys], dtype=torch.float64)}
        if error_feedback:
            out["error_feedback"] = self.error_feedback.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises ValueError when it was saved with other lgc_pca settings."""
        if state["codec"] != self.codec.to_dict():
            raise ValueError(f"channel {self.name!r}: state saved with {state['codec']}, this channel uses "
                             f"{self.codec.to_dict()}; resume with the same compression config")
        keys = list(state["keys"])
        self.weights = {k: {n: v.clone() for n, v in state["weights"][k].items()} for k in keys}
        self.train_states = {k: {n: v.clone() for n, v in state["train_state"][k].items()} for k in keys}
        counters = state["counters"].tolist()
        self.calls = {k: int(c[0]) for k, c in zip(keys, counters)}
        self.train_until = {k: int(c[1]) for k, c in zip(keys, counters)}
        self.retrains = {k: int(c[2]) for k, c in zip(keys, counters) if c[2]}
        self.last_error = {k: float(e) for k, e in zip(keys, state["last_error"].tolist()) if e == e}
        if state.get("error_feedback") is not None:
            self.error_feedback.load_state_dict(state["error_feedback"])


def encode_message(lgc: LGCPCA, w: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a rank sends for the compensated bucket ``h`` (fp32, 1-D) and the sender's own decoding of it.

    Per chunk ``x`` (normalised ``u``, code ``z = E(u)``, ``d = D(z)``) the scale sent is the least-squares one,
    ``a = <x, d> / ||d||^2`` (0 when ``d = 0``), which the sender can compute because it decodes its own code; then
    ``||x - a d||^2 = ||x||^2 - <x, d>^2 / ||d||^2 <= ||x||^2``: no chunk is delivered worse than not at all, whatever
    the decoder learned. ``ring``: the message is ``a * z`` (``chunks x latent``) and the decoding ``D(message)``
    (``= a d`` for the linear decoder); ``ps``: the message is ``[z, a]`` (``chunks x (latent + 1)``) and the decoding
    ``D(z) * a``, computed exactly as :func:`decode_ps` computes it for every rank. The decoding is cut to ``h``'s
    length (the padding is not sent)."""
    x = chunked(lgc, h)
    z = encode(lgc, w, normalise(x)[0])
    d = decode(lgc, w, z)
    dd = d.pow(2).sum(dim=1)
    a = (x * d).sum(dim=1) / torch.where(dd > 0, dd, torch.ones_like(dd))
    if lgc.variant == "ring":
        message = z * a.unsqueeze(1)
        return message, decode(lgc, w, message).reshape(-1)[:h.numel()]
    message = torch.cat([z, a.unsqueeze(1)], dim=1)
    return message, (d * a.unsqueeze(1)).reshape(-1)[:h.numel()]


def decode_ps(lgc: LGCPCA, w: dict, messages: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``ps`` variant's delivered sum: each rank's message (``messages[r]``, ``chunks x (latent + 1)``) decoded on
    its own (the same shapes and operations as the sender's :func:`encode_message`, so the same bits) and summed in
    rank order; fp32, ``numel`` elements."""
    total = None
    for msg in messages:
        part = (decode(lgc, w, msg[:, :-1].contiguous()) * msg[:, -1:]).reshape(-1)[:numel]
        total = part.clone() if total is None else total.add_(part)
    return total


def _seed(seed: int, key: str, call: int, rank: int) -> int:
    """Seed of rank ``rank``'s training-sample draw at call ``call`` of ``key``."""
    return (seed * 1_000_003 + zlib.crc32(key.encode()) * 7919 + call * 104_729 + rank) % (1 << 63)
