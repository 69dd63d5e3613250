"""Stage-to-stage communication with compressed activations and gradients.

Activations go forward on the ``pp_activation`` channel, activation gradients go backward on the
``pp_gradient`` channel (megacomp.comm.Channel: codec, small-tensor rule, error-feedback state); gradients
may use error feedback (``pp_gradient_error_feedback``), with one error key per stage boundary and micro-batch slot (slot k of every iteration sees the same tensor shape,
and its residual is carried into slot k of the next iteration, as Optimus-CC's lazy error propagation).

Under the interleaved schedule (megacomp.pipeline_parallel.interleaved) the stages form a ring: the last
stage's chunk v sends to the first stage's chunk v + 1, so :meth:`PipelineCommunicator.exchange` addresses
neighbours modulo the stage count and gradient error-feedback keys name the *virtual* stage boundary. The
two kinds of message travel under their own tags (activations 1, gradients 2): with two stages the previous
and the next stage are the same rank, and each kind must match its own receives in order.

Every step of a schedule is one :meth:`PipelineCommunicator.exchange`: its messages are encoded first
(megacomp.comm.p2p.prepare_isend / prepare_irecv: codec, error feedback, AQ-SGD deltas; AQ-SGD's reference
warm-up sends gradients raw), then all its
receives and sends are posted together and waited for. Under NCCL they are posted as one
``batch_isend_irecv`` (as Megatron's batched p2p): NCCL runs a pair's operations in issue order on one stream,
so two neighbours that each post a receive before their send would wait on each other forever; a batch is
matched as a group. Elsewhere (gloo) each operation is posted on its own, receives first.

Shapes are agreed up front: :meth:`PipelineCommunicator.handshake` sends each stage's expected shape,
dtype and codecs to the next stage once (a chain, so it cannot deadlock) and raises a ValueError on both
sides naming the mismatch; later messages carry no header and no pickling. Paired exchanges
(send forward + receive backward, and the reverse) post both operations before waiting on either.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import comm_device
from ..comm import p2p as comm_p2p
from ..comm.common import codec_code, dtype_code
from ..compression import make_codec
from ..config import Channels, CommCompressionConfig
from .aqsgd import ActivationDeltaCache

_RAW = make_codec("none")  # a message below min_compress_numel under the reference's quantiser travels raw
ACTIVATION_TAG, GRADIENT_TAG = 1, 2  # p2p tags of the two message kinds (see the module docstring)


class PipelineCommunicator:
    """Sends and receives between this stage and its neighbours in ``pp_ranks`` (global ranks, stage order).

    ``channels``: the run's channels (``pp_activation`` and ``pp_gradient`` are used); None builds them
    from ``compression`` (default: uncompressed). ``activation_delta``: AQ-SGD's caches for this rank's
    boundary sides (megacomp.pipeline_parallel.aqsgd); activations then travel as quantised deltas and every
    activation send and receive names its micro-batch (:meth:`set_sample_ids` gives the samples).
    ``batched_p2p``: post each step's sends and receives as one ``torch.distributed.batch_isend_irecv`` (default:
    on under NCCL, see the module docstring). Raises ValueError from :meth:`handshake` when stages disagree on
    shape, dtype or codecs."""

    def __init__(self, pp_ranks: Sequence[int], compression: Optional[CommCompressionConfig] = None, *,
                 channels: Optional[Channels] = None, activation_delta: Optional[ActivationDeltaCache] = None,
                 batched_p2p: Optional[bool] = None) -> None:
        self.pp_ranks = list(pp_ranks)
        self.stage = self.pp_ranks.index(dist.get_rank())
        self.num_stages = len(self.pp_ranks)
        if channels is None:
            channels = (compression or CommCompressionConfig()).build_channels()
        self.activation, self.gradient = channels.pp_activation, channels.pp_gradient
        self.activation_delta = activation_delta
        self.batched = dist.get_backend() == "nccl" if batched_p2p is None else bool(batched_p2p)
        self._agreed: Optional[tuple] = None
        self.device = comm_device()  # where received activations and gradients are allocated

    @property
    def is_first(self) -> bool:
        """Whether this is the first stage (it receives no activations)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this is the last stage (it sends no activations)."""
        return self.stage == self.num_stages - 1

    def _describe(self, shape, dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        act, grad = self.activation.codec_for(numel), self.gradient.codec_for(numel)
        return torch.tensor([len(shape)] + list(shape) + [0] * (8 - len(shape)) +
                            [dtype_code(dtype), codec_code(act), codec_code(grad)], dtype=torch.int64,
                            device=self.device)

    def handshake(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Check once that neighbouring stages expect the same activation shape, dtype and codecs."""
        key = (tuple(shape), dtype)
        if self._agreed == key or self.num_stages == 1:
            return
        mine = self._describe(shape, dtype)
        if not self.is_first:
            theirs = torch.empty_like(mine)
            dist.recv(theirs, self.pp_ranks[self.stage - 1])
            ok = torch.equal(theirs, mine)
            dist.send(torch.tensor([int(ok)], device=self.device), self.pp_ranks[self.stage - 1])
            if not ok:
                raise ValueError(self._mismatch(theirs, mine, self.stage - 1, self.stage))
        if not self.is_last:
            dist.send(mine, self.pp_ranks[self.stage + 1])
            verdict = torch.empty(1, dtype=torch.int64, device=self.device)
            dist.recv(verdict, self.pp_ranks[self.stage + 1])
            if not verdict.item():
                raise ValueError(f"pipeline stage {self.stage + 1} expects a different activation shape, dtype or "
                                 f"codec than stage {self.stage} sends ({tuple(shape)}, {dtype}); see the error on "
                                 f"that stage's rank")
        self._agreed = key

    @staticmethod
    def _mismatch(theirs: torch.Tensor, mine: torch.Tensor, a: int, b: int) -> str:
        def shape_of(t):
            return tuple(t[1:1 + int(t[0])].tolist())
        return (f"pipeline stages {a} and {b} disagree on the activation they exchange: stage {a} sends shape "
                f"{shape_of(theirs)} (dtype/codec codes {theirs[-3:].tolist()}), stage {b} expects {shape_of(mine)} "
                f"(codes {mine[-3:].tolist()}); use the same micro-batch size, sequence length, hidden size, "
                f"sequence-parallel setting and compression config on every stage")

    # -- messages (encoded, not yet posted) -------------------------------------------------------
    # shapes were agreed by the handshake: the messages carry no validation header
    @property
    def next_rank(self) -> int:
        """Global rank of the next stage (the first stage after the last: the interleaved ring)."""
        return self.pp_ranks[(self.stage + 1) % self.num_stages]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous stage (the last stage before the first: the interleaved ring)."""
        return self.pp_ranks[(self.stage - 1) % self.num_stages]

    def gradient_key(self, virtual_stage: int, slot: int) -> str:
        """Error-feedback key of the gradient virtual stage ``virtual_stage`` sends back for micro-batch ``slot``
        (with one chunk per stage the virtual stage is the stage)."""
        return f"pp_gradient/s{virtual_stage}->s{virtual_stage - 1}/mb{slot}"

    def set_sample_ids(self, ids: Sequence[Sequence[int]]) -> None:
        """AQ-SGD: the sample ids of this iteration's micro-batches (no-op without ``activation_delta``)."""
        if self.activation_delta is not None:
            self.activation_delta.set_sample_ids(ids)

    def _delta_codec(self, boundary: Optional[int], mb: Optional[int], t: torch.Tensor):
        if boundary is None or mb is None:
            raise ValueError("AQ-SGD (pp_activation_delta): every activation send and receive must name its boundary "
                             "and micro-batch; use the schedules of megacomp.pipeline_parallel")
        quantizer = self.activation_delta.quantizer
        if quantizer is not None:  # the reference's quantiser replaces the codec; the small-tensor rule still holds
            codec = quantizer if t.numel() >= self.activation.min_compress_numel else _RAW
        else:
            codec = self.activation.codec_for(t.numel())
        codec.check_dtype(t.dtype)
        return codec

    def _activation_message(self, t: torch.Tensor, boundary: Optional[int], mb: Optional[int]) -> list:
        """The tensors that carry activation ``t`` (micro-batch ``mb``, to ``boundary``) to the next stage."""
        t = t.detach().contiguous()
        if self.activation_delta is None:
            return comm_p2p.prepare_isend(self.activation, t, self.next_rank, self.activation.name, False,
                                          self.activation.name, False)[0]
        codec = self._delta_codec(boundary, mb, t)
        msg = self.activation_delta.encode(boundary, mb, t, codec, self.activation.generator)
        self.activation.stats.record(self.activation.name, msg.numel() * msg.element_size(),
                                     t.numel() * t.element_size())
        return [msg]

    def _activation_receive(self, out: torch.Tensor, boundary: Optional[int], mb: Optional[int]):
        """``(buffers, finish(works))`` receiving the previous stage's activation of ``mb`` into ``out``."""
        if self.activation_delta is None:
            return comm_p2p.prepare_irecv(self.activation, out, self.prev_rank, False, self.activation.name + "_recv",
                                          False)
        codec = self._delta_codec(boundary, mb, out)
        cache = self.activation_delta
        buf = cache.message_buffer(boundary, mb, out.shape, codec, out.device)

        def finish(works) -> None:
            for w in works:
                w.wait()
            cache.decode(boundary, mb, buf, out, codec)
            self.activation.stats.record(self.activation.name + "_recv", buf.numel() * buf.element_size(),
                                         out.numel() * out.element_size())
        return [buf], finish

    def _full_gradients(self, direction: str) -> bool:
        """AQ-SGD's reference warm-up: this iteration's gradients to or from the neighbour travel uncompressed."""
        return self.activation_delta is not None and self.activation_delta.gradients_uncompressed(direction)

    def _gradient_message(self, g: torch.Tensor, virtual_stage: int, slot: int) -> list:
        """The tensors that carry gradient ``g`` back (error feedback under its boundary and slot's key; the raw
        gradient, error feedback untouched, in AQ-SGD's reference warm-up)."""
        if self._full_gradients("send"):
            g = g.detach().contiguous()
            self.gradient.stats.record(self.gradient.name, g.numel() * g.element_size(), g.numel() * g.element_size())
            return [g]
        return comm_p2p.prepare_isend(self.gradient, g.detach().contiguous(), self.prev_rank,
                                      self.gradient_key(virtual_stage, slot), False, self.gradient.name, False)[0]

    def _gradient_receive(self, out: torch.Tensor):
        if self._full_gradients("recv"):
            def finish(works) -> None:
                for w in works:
                    w.wait()
                nbytes = out.numel() * out.element_size()
                self.gradient.stats.record(self.gradient.name + "_recv", nbytes, nbytes)
            return [out], finish
        return comm_p2p.prepare_irecv(self.gradient, out, self.next_rank, False, self.gradient.name + "_recv", False)

    def _post(self, sends: list, recvs: list) -> list:
        """Post ``sends`` (tensor, dst, tag) and ``recvs`` (buffer, src, tag); returns the works of ``recvs`` in order
        followed by those of ``sends``. Batched (one ``batch_isend_irecv``) when ``self.batched``, else each posted on
        its own, the receives first."""
        if self.batched:
            ops = ([dist.P2POp(dist.irecv, b, src, tag=tag) for b, src, tag in recvs]
                   + [dist.P2POp(dist.isend, t, dst, tag=tag) for t, dst, tag in sends])
            return dist.batch_isend_irecv(ops) if ops else []
        return ([dist.irecv(b, src, tag=tag) for b, src, tag in recvs]
                + [dist.isend(t, dst, tag=tag) for t, dst, tag in sends])

    # -- the one exchange every schedule step goes through -----------------------------------------
    def exchange(self, shape=None, dtype=None, *, send_next: Optional[tuple] = None,
                 send_prev: Optional[tuple] = None, recv_prev: Optional[tuple] = None, recv_next: bool = False):
        """Post a schedule step's receives and sends together, then wait for all of them.

        ``send_next``: ``(activation, boundary, micro-batch)`` for the next stage; ``send_prev``: ``(gradient,
        virtual stage, micro-batch)`` for the previous stage; ``recv_prev``: ``(boundary, micro-batch)`` of an
        activation to receive from the previous stage; ``recv_next``: receive a gradient from the next stage.
        A boundary is the receiving virtual stage. Returns ``(activation or None, gradient or None)``; the
        activation requires grad. Neighbours are ring neighbours (see the module docstring). Receiving needs
        ``shape`` and ``dtype``."""
        recvs, finishes, sends = [], [], []
        act = grad = None
        if recv_prev is not None:
            act = torch.empty(shape, dtype=dtype, device=self.device)
            bufs, fin = self._activation_receive(act, *recv_prev)
            finishes.append((len(recvs), len(bufs), fin))
            recvs += [(b, self.prev_rank, ACTIVATION_TAG) for b in bufs]
        if recv_next:
            grad = torch.empty(shape, dtype=dtype, device=self.device)
            bufs, fin = self._gradient_receive(grad)
            finishes.append((len(recvs), len(bufs), fin))
            recvs += [(b, self.next_rank, GRADIENT_TAG) for b in bufs]
        if send_next is not None:
            sends += [(t, self.next_rank, ACTIVATION_TAG) for t in self._activation_message(*send_next)]
        if send_prev is not None:
            g, vs, slot = send_prev
            sends += [(t, self.prev_rank, GRADIENT_TAG) for t in self._gradient_message(g, vs, slot)]
        works = self._post(sends, recvs)
        for start, n, fin in finishes:  # wait for and decode the receives
            fin(works[start:start + n])
        for w in works[len(recvs):]:  # the sends (their buffers are alive in ``sends`` until here)
            w.wait()
        return (act.requires_grad_() if act is not None else None), grad

    # -- schedule-level ops of the non-interleaved schedule (one exchange each) ---------------------
    def recv_forward(self, shape, dtype, mb: Optional[int] = None) -> Optional[torch.Tensor]:
        """The previous stage's activation of micro-batch ``mb`` (decoded from the pp_activation codec, requires
        grad); None on stage 0."""
        if self.is_first:
            return None
        return self.exchange(shape, dtype, recv_prev=(self.stage, mb))[0]

    def send_forward(self, t: Optional[torch.Tensor], mb: Optional[int] = None) -> None:
        """Send this stage's output of micro-batch ``mb`` to the next stage (pp_activation); nothing on the last
        stage."""
        if not self.is_last:
            self.exchange(send_next=(t, self.stage + 1, mb))

    def recv_backward(self, shape, dtype) -> Optional[torch.Tensor]:
        """The next stage's gradient of this stage's output (pp_gradient); None on the last stage."""
        if self.is_last:
            return None
        return self.exchange(shape, dtype, recv_next=True)[1]

    def send_backward(self, g: Optional[torch.Tensor], slot: int) -> None:
        """Send the input gradient to the previous stage (pp_gradient, error feedback under key slot ``slot``)."""
        if not self.is_first:
            self.exchange(send_prev=(g, self.stage, slot))

    def send_forward_recv_backward(self, t, shape, dtype, mb: Optional[int] = None) -> Optional[torch.Tensor]:
        """Send the output of micro-batch ``mb`` forward and receive a gradient, in one exchange."""
        if self.is_last:
            return None
        return self.exchange(shape, dtype, send_next=(t, self.stage + 1, mb), recv_next=True)[1]

    def send_backward_recv_forward(self, g, slot: int, shape, dtype, mb: Optional[int] = None) -> Optional[torch.Tensor]:
        """Send the input gradient back and receive the activation of micro-batch ``mb``, in one exchange."""
        if self.is_first:
            return None
        return self.exchange(shape, dtype, send_prev=(g, self.stage, slot), recv_prev=(self.stage, mb))[0]

    @property
    def error_feedback(self):
        """The pp_gradient channel's error-feedback state (None when off); checkpointed with the channels."""
        return self.gradient.error_feedback

