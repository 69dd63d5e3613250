"""AQ-SGD: pipeline activations sent as the quantised change of each sample's activation since its last visit.

Algorithm (Wang et al., "Fine-tuning language models over slow networks using activation compression
with guarantees", reference code DS3Lab/AC-SGD), for sample xi crossing stage boundary b with activation a:
  both sides of b keep a cache m_b(xi), equal on the two ranks by construction;
  warm-up     the first ``warmup_visits`` visits of xi send a itself, and both sides set m_b(xi) = a;
  afterwards  the sender sends  delta = Q(a - m_b(xi))  (Q: the pp_activation channel's codec) and sets
              m_b(xi) += deq(delta); the receiver adds the same deq(delta) to its m_b(xi) and uses m_b(xi)
              as the activation. Both add the same decoded bytes to the same numbers on the same device type,
              so the two caches stay bit-identical (tests check it after every step).
A micro-batch travels as a whole: if any of its samples is still in warm-up, all of it goes uncompressed
(and refreshes every sample's cache). Gradients going back use the pp_gradient codec (optionally with error
feedback) throughout, unless ``warmup_full_gradients``: then, as in the reference (whose warm-up epochs switch
every compressor off), an iteration in which any sample is still in warm-up on a boundary between two ranks
sends all of its gradients between those two ranks uncompressed. Both ranks decide from their caches' visit
counters at :meth:`ActivationDeltaCache.set_sample_ids` (the gradient sender from its receiving sides, the
receiver from its sending sides: the same boundaries with equal counters), so they agree without a message;
with epochs that are whole iterations (every sample once per epoch) this is the reference's epoch rule.

Quantiser: the pp_activation codec (megacomp's block-scaled formats; with ``bits`` 0), or with ``bits`` 1..8 the
reference's (megacomp.compression.channel_max: one fp16 max-scale per hidden channel over the micro-batch,
``2**bits`` levels). With the latter the decoded delta is added to the cache in float32 and the sum rounded once
to the activation dtype, as the reference does; the receiver's activation is that rounded sum. With fp16
activations (the paper's setting) this is the reference's arithmetic bit for bit; the reference keeps its cache
in fp16 whatever the model dtype, megacomp in the activation dtype.

Error: the receiver's activation differs from a by the codec's error on the *delta* a - m_b(xi), which
shrinks as training converges and the activation of a sample changes little between visits; direct
quantisation pays the codec's error on a itself. For a b-bit block-scaled codec the per-element error is at
most max|delta in the block| / (2^(b-1) - 1) / 2 (round to nearest); for the reference's quantiser about
max|delta in the channel| / 2^(b-1) (a whole step at the channel's top value; megacomp.compression.channel_max).

With an identity codec (or a message below the channel's min_compress_numel) the activation itself is sent
and the cache is set to it: bit-identical to the plain pipeline.

Non-finite activations: a cache row that becomes inf/NaN (an overflowing activation, or a scale block shared
with one) is cleared and its visits reset on both sides (the same check on the same numbers), so that sample's
next visit travels uncompressed again instead of carrying NaN forever; the step that saw it reaches the loss
as non-finite, which the trainer's divergence policy handles.

Memory: one cache entry of ``sample_shape`` per sample, per boundary side this rank holds (a stage in the
middle holds two, and V chunks per stage hold up to 2V). :func:`cache_bytes` says how much; the trainer
refuses a run whose caches would not fit before allocating them. Samples are identified by a stable id
(the dataset index); ``num_slots`` ids map to cache rows through ``slot_of`` (every rank of a data-parallel
group caches only its own shard of the data, see megacomp.data.DistributedBatchSampler(shard_samples=True)).

Failure behaviour: ValueError for ids outside the cache, an unknown boundary, a message whose shape differs
from the cache's sample shape, or a missing sample-id table (``set_sample_ids`` was not called).
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch

from ..compression import Codec
from ..compression.channel_max import ChannelMaxQuantizer

DeltaCodec = Union[Codec, ChannelMaxQuantizer]
"""What quantises the deltas: a megacomp codec (the pp_activation channel's) or the reference's quantiser."""


def cache_bytes(num_slots: int, sample_shape: Sequence[int], dtype: torch.dtype, sides: int) -> int:
    """Bytes of ``sides`` caches of ``num_slots`` samples of ``sample_shape`` (plus their visit counters)."""
    per = 1
    for d in sample_shape:
        per *= d
    return sides * num_slots * (per * torch.empty((), dtype=dtype).element_size() + 4)


class ActivationDeltaCache:
    """m_b for the boundary sides one pipeline rank holds (see the module docstring).

    Args:
        sides: ``(boundary, side)`` pairs, side ``'send'`` or ``'recv'``; the boundary is the receiving virtual
            stage (the stage with one chunk per rank).
        slot_of: int64 tensor mapping a sample id to its cache row (-1: not cached here); its length is the
            dataset size.
        sample_shape: one sample's activation, ``(s, h)`` (``s / tp`` under sequence parallelism).
        dtype: the activation dtype (the cache stores it exactly).
        warmup_visits: visits of a sample that send the activation itself (AQ-SGD's warm-up epochs).
        device: where the caches live (the arithmetic runs on the activation's device).
        bits: 0: deltas are quantised with the codec the caller passes (the pp_activation codec); 1..8: with the
            reference's per-channel quantiser at this many bits (:attr:`quantizer`; the caller passes it).
        warmup_full_gradients: gradients of an iteration with a sample in warm-up travel uncompressed (the
            reference's warm-up; see the module docstring and :meth:`gradients_uncompressed`).
    """

    def __init__(self, sides: Iterable[tuple[int, str]], slot_of: torch.Tensor, sample_shape: Sequence[int],
                 dtype: torch.dtype, *, warmup_visits: int = 1, device="cpu", bits: int = 0,
                 warmup_full_gradients: bool = False) -> None:
        if warmup_visits < 1:
            raise ValueError(f"AQ-SGD needs warmup_visits >= 1 (the first visit fills the cache), got {warmup_visits}")
        self.quantizer = ChannelMaxQuantizer(bits, int(sample_shape[-1])) if bits else None
        self.warmup_full_gradients = bool(warmup_full_gradients)
        self._grad_warm = {"send": False, "recv": False}
        self.slot_of = slot_of.to(torch.int64)
        self.num_slots = int(self.slot_of.max().item()) + 1 if self.slot_of.numel() else 0
        self.sample_shape, self.dtype, self.warmup_visits = tuple(sample_shape), dtype, warmup_visits
        self.values: dict[str, torch.Tensor] = {}
        self.visits: dict[str, torch.Tensor] = {}
        for boundary, side in sides:
            if side not in ("send", "recv"):
                raise ValueError(f"cache side must be 'send' or 'recv', got {side!r}")
            key = self.key(boundary, side)
            self.values[key] = torch.zeros((self.num_slots, *self.sample_shape), dtype=dtype, device=device)
            self.visits[key] = torch.zeros(self.num_slots, dtype=torch.int32)
        self._ids: Optional[list[torch.Tensor]] = None

    @staticmethod
    def key(boundary: int, side: str) -> str:
        """The name of one boundary side's cache, e.g. ``'b1/send'``."""
        return f"b{boundary}/{side}"

    @property
    def nbytes(self) -> int:
        """Bytes held by the caches and their visit counters."""
        return sum(v.numel() * v.element_size() for v in self.values.values()) + 4 * self.num_slots * len(self.visits)

    def set_sample_ids(self, ids: Sequence[Sequence[int]]) -> None:
        """The sample ids of this iteration's micro-batches (``ids[k]``: micro-batch k's samples, in order)."""
        self._ids = [torch.as_tensor(list(x), dtype=torch.int64) for x in ids]
        if self.warmup_full_gradients:  # decided now, from the counters before this iteration's visits
            slots = torch.cat([self._slots(k) for k in range(len(self._ids))])
            for direction, side in (("send", "recv"), ("recv", "send")):
                self._grad_warm[direction] = any(self._warm(self.visits[key], slots) for key in self.visits
                                                 if key.endswith("/" + side))

    def gradients_uncompressed(self, direction: str) -> bool:
        """Whether this iteration's gradients this rank sends back (``direction`` ``'send'``) or receives from the
        next rank (``'recv'``) travel uncompressed: ``warmup_full_gradients`` and a sample of the iteration in
        warm-up on a boundary between the two ranks (see the module docstring)."""
        return self._grad_warm[direction]

    def _slots(self, mb: int) -> torch.Tensor:
        if self._ids is None:
            raise ValueError("AQ-SGD (pp_activation_delta) needs the sample ids of every micro-batch: call "
                             "set_sample_ids(...) on the pipeline communicator before the schedule")
        ids = self._ids[mb]
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.slot_of.numel()):
            raise ValueError(f"AQ-SGD: sample ids {ids.tolist()} outside the dataset of {self.slot_of.numel()} samples")
        slots = self.slot_of[ids]
        if (slots < 0).any():
            raise ValueError(f"AQ-SGD: samples {ids[slots < 0].tolist()} are not in this rank's cache (each data-parallel "
                             f"rank caches its own shard: sample with DistributedBatchSampler(shard_samples=True))")
        return slots

    def _entry(self, boundary: int, side: str):
        key = self.key(boundary, side)
        if key not in self.values:
            raise ValueError(f"AQ-SGD: this rank holds no {side} cache for boundary {boundary} (has {sorted(self.values)})")
        return self.values[key], self.visits[key]

    def in_warmup(self, boundary: int, side: str, mb: int) -> bool:
        """Whether micro-batch ``mb`` crosses ``boundary`` uncompressed (a sample still in warm-up)."""
        _, visits = self._entry(boundary, side)
        return self._warm(visits, self._slots(mb))

    def _warm(self, visits: torch.Tensor, slots: torch.Tensor) -> bool:
        return bool((visits[slots] < self.warmup_visits).any())

    def _check(self, activation: torch.Tensor, slots: torch.Tensor) -> None:
        want = (self.sample_shape[0], slots.numel(), *self.sample_shape[1:])
        if tuple(activation.shape) != want:
            raise ValueError(f"AQ-SGD: activation of shape {tuple(activation.shape)} does not match the cache's "
                             f"(seq, micro-batch, hidden) = {want}")

    def encode(self, boundary: int, mb: int, activation: torch.Tensor, codec: DeltaCodec,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Sender: the message for ``activation`` (``[s, b, h]``) of micro-batch ``mb`` across ``boundary`` (the
        activation itself in warm-up or under an identity codec, else the encoded delta); updates the cache."""
        values, visits = self._entry(boundary, "send")
        slots = self._slots(mb)
        self._check(activation, slots)
        a = activation.detach().transpose(0, 1)  # [b, s, h]: one row per sample
        if codec.is_identity or self._warm(visits, slots):
            new = a
            msg = activation.detach().contiguous()
        else:
            m = values[slots].to(a.device)
            msg = codec.encode_flat(a - m, generator, strict=False)
            new = self._updated(m, msg, codec)
        self._store(values, visits, slots, new)
        return msg

    @staticmethod
    def _updated(m: torch.Tensor, msg: torch.Tensor, codec) -> torch.Tensor:
        """The cache rows ``m`` plus the decoded message: in the codec's dtype for a megacomp codec; in float32 and
        rounded once to the cache's dtype for the reference's quantiser (its arithmetic)."""
        if isinstance(codec, ChannelMaxQuantizer):
            return (m.float() + codec.decode_flat(msg, m.numel()).view(m.shape)).to(m.dtype)
        return m + codec.decode_flat(msg, m.numel(), m.dtype).view(m.shape)

    @staticmethod
    def _store(values: torch.Tensor, visits: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
        """Write the samples' new cache rows and count the visit; a non-finite row is cleared and its visits reset
        (see the module docstring). Both sides run this on equal numbers, so their caches stay equal."""
        bad = ~torch.isfinite(new.reshape(new.shape[0], -1)).all(dim=1).cpu()
        values[slots] = new.to(values.device)
        visits[slots] += 1
        if bad.any():
            values[slots[bad]] = 0
            visits[slots[bad]] = 0

    def message_buffer(self, boundary: int, mb: int, shape: Sequence[int], codec: DeltaCodec, device) -> torch.Tensor:
        """Receiver: an empty buffer of the size micro-batch ``mb``'s message across ``boundary`` has."""
        numel = 1
        for d in shape:
            numel *= d
        if codec.is_identity or self.in_warmup(boundary, "recv", mb):
            return torch.empty(tuple(shape), dtype=self.dtype, device=device)
        return torch.empty(codec.wire_bytes(numel, self.dtype), dtype=torch.uint8, device=device)

    def decode(self, boundary: int, mb: int, msg: torch.Tensor, out: torch.Tensor, codec: DeltaCodec) -> None:
        """Receiver: apply the message to the cache and write the activation (``m_b`` of the samples) into ``out``."""
        values, visits = self._entry(boundary, "recv")
        slots = self._slots(mb)
        self._check(out, slots)
        with torch.no_grad():
            if msg.dtype != torch.uint8 or codec.is_identity:
                new = msg.transpose(0, 1)
                out.copy_(msg)
            else:
                m = values[slots].to(out.device)
                new = self._updated(m, msg, codec)
                out.copy_(new.transpose(0, 1))
            self._store(values, visits, slots, new)

    # -- checkpointing ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The caches and visit counters (a resumed run continues with the same caches)."""
        return {"values": dict(self.values), "visits": dict(self.visits), "slots": self.num_slots,
                "shape": list(self.sample_shape), "slot_of": self.slot_of}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; raises ValueError when its boundaries or sizes differ from this cache's."""
        if sorted(state["values"]) != sorted(self.values) or state["slots"] != self.num_slots \
                or tuple(state["shape"]) != self.sample_shape:
            raise ValueError(f"AQ-SGD cache in the checkpoint ({sorted(state['values'])}, {state['slots']} samples of "
                             f"{tuple(state['shape'])}) does not match this run's ({sorted(self.values)}, "
                             f"{self.num_slots} of {self.sample_shape}); resume with the same layout and data")
        saved_slots = state.get("slot_of")
        if saved_slots is None or not torch.equal(saved_slots, self.slot_of):
            raise ValueError("AQ-SGD cache in the checkpoint maps other samples to its rows than this run (another "
                             "--seed, --dataset-samples or data-parallel size changes each rank's shard); resume with "
                             "the settings it was written with")
        for k in self.values:
            self.values[k].copy_(state["values"][k])
            self.visits[k].copy_(state["visits"][k])
