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
from ..comm.common import CompressedWork, codec_code, dtype_code
from ..config import Channels, CommCompressionConfig
from .aqsgd import ActivationDeltaCache

ACTIVATION_TAG, GRADIENT_TAG = 1, 2  # p2p tags of the two message kinds (see the module docstring)


class PipelineCommunicator:
    """Sends and receives between this stage and its neighbours in ``pp_ranks`` (global ranks, stage order).

    ``channels``: the run's channels (``pp_activation`` and ``pp_gradient`` are used); None builds them
    from ``compression`` (default: uncompressed). ``activation_delta``: AQ-SGD's caches for this rank's
    boundary sides (megacomp.pipeline_parallel.aqsgd); activations then travel as quantised deltas and every
    activation send and receive names its micro-batch (:meth:`set_sample_ids` gives the samples). Raises
    ValueError from :meth:`handshake` when stages disagree on shape, dtype or codecs."""

    def __init__(self, pp_ranks: Sequence[int], compression: Optional[CommCompressionConfig] = None, *,
                 channels: Optional[Channels] = None, activation_delta: Optional[ActivationDeltaCache] = None) -> None:
        self.pp_ranks = list(pp_ranks)
        self.stage = self.pp_ranks.index(dist.get_rank())
        self.num_stages = len(self.pp_ranks)
        if channels is None:
            channels = (compression or CommCompressionConfig()).build_channels()
        self.activation, self.gradient = channels.pp_activation, channels.pp_gradient
        self.activation_delta = activation_delta
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

    # -- primitive ops (return handles; nothing waits here) ---------------------------------------
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

    def _delta_args(self, boundary: Optional[int], mb: Optional[int], t: torch.Tensor):
        if boundary is None or mb is None:
            raise ValueError("AQ-SGD (pp_activation_delta): every activation send and receive must name its boundary "
                             "and micro-batch; use the schedules of megacomp.pipeline_parallel")
        codec = self.activation.codec_for(t.numel())
        codec.check_dtype(t.dtype)
        return codec

    def _isend_forward(self, t: torch.Tensor, boundary: Optional[int] = None, mb: Optional[int] = None):
        if self.activation_delta is None:
            return self.activation.isend(t.detach().contiguous(), self.next_rank, tag=ACTIVATION_TAG, validate=False)
        codec = self._delta_args(boundary, mb, t)
        msg = self.activation_delta.encode(boundary, mb, t, codec, self.activation.generator)
        self.activation.stats.record(self.activation.name, msg.numel() * msg.element_size(),
                                     t.numel() * t.element_size())
        return dist.isend(msg, self.next_rank, tag=ACTIVATION_TAG)

    def _irecv_forward(self, out: torch.Tensor, boundary: Optional[int] = None, mb: Optional[int] = None):
        if self.activation_delta is None:
            return self.activation.irecv(out, self.prev_rank, tag=ACTIVATION_TAG, validate=False)
        codec = self._delta_args(boundary, mb, out)
        cache = self.activation_delta
        buf = cache.message_buffer(boundary, mb, out.shape, codec, out.device)
        work = dist.irecv(buf, self.prev_rank, tag=ACTIVATION_TAG)

        def finish() -> None:
            work.wait()
            cache.decode(boundary, mb, buf, out, codec)
            self.activation.stats.record(self.activation.name + "_recv", buf.numel() * buf.element_size(),
                                         out.numel() * out.element_size())
        return CompressedWork(finish)

    def _isend_backward(self, g: torch.Tensor, slot: int, virtual_stage: Optional[int] = None):
        vs = self.stage if virtual_stage is None else virtual_stage
        return self.gradient.isend(g.detach().contiguous(), self.prev_rank, tag=GRADIENT_TAG,
                                   key=self.gradient_key(vs, slot), validate=False)

    def _irecv_backward(self, out: torch.Tensor):
        return self.gradient.irecv(out, self.next_rank, tag=GRADIENT_TAG, validate=False)

    # -- schedule-level ops ---------------------------------------------------------------------
    def recv_forward(self, shape, dtype, mb: Optional[int] = None) -> Optional[torch.Tensor]:
        """The previous stage's activation of micro-batch ``mb`` (decoded from the pp_activation codec, requires
        grad); None on stage 0."""
        if self.is_first:
            return None
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self._irecv_forward(out, self.stage, mb).wait()
        return out.requires_grad_()

    def send_forward(self, t: Optional[torch.Tensor], mb: Optional[int] = None) -> None:
        """Send this stage's output of micro-batch ``mb`` to the next stage (pp_activation); nothing on the last
        stage."""
        if not self.is_last:
            self._isend_forward(t, self.stage + 1, mb).wait()

    def recv_backward(self, shape, dtype) -> Optional[torch.Tensor]:
        """The next stage's gradient of this stage's output (pp_gradient); None on the last stage."""
        if self.is_last:
            return None
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self._irecv_backward(out).wait()
        return out

    def send_backward(self, g: Optional[torch.Tensor], slot: int) -> None:
        """Send the input gradient to the previous stage (pp_gradient, error feedback under key slot ``slot``)."""
        if not self.is_first:
            self._isend_backward(g, slot).wait()

    def send_forward_recv_backward(self, t, shape, dtype, mb: Optional[int] = None) -> Optional[torch.Tensor]:
        """Send the output of micro-batch ``mb`` forward and receive a gradient, both posted before either is
        awaited."""
        if self.is_last:
            return None
        out = torch.empty(shape, dtype=dtype, device=self.device)
        recv = self._irecv_backward(out)
        send = self._isend_forward(t, self.stage + 1, mb)
        send.wait()
        recv.wait()
        return out

    def send_backward_recv_forward(self, g, slot: int, shape, dtype, mb: Optional[int] = None) -> Optional[torch.Tensor]:
        """Send the input gradient back and receive the activation of micro-batch ``mb``, both posted before
        either is awaited."""
        if self.is_first:
            return None
        out = torch.empty(shape, dtype=dtype, device=self.device)
        recv = self._irecv_forward(out, self.stage, mb)
        send = self._isend_backward(g, slot)
        send.wait()
        recv.wait()
        return out.requires_grad_()

    def exchange(self, shape, dtype, *, send_next: Optional[tuple] = None, send_prev: Optional[tuple] = None,
                 recv_prev: Optional[tuple] = None, recv_next: bool = False):
        """Post every receive, then every send, then wait for all (the interleaved schedule's step).

        ``send_next``: ``(activation, boundary, micro-batch)`` for the next stage; ``send_prev``: ``(gradient,
        virtual stage, micro-batch)`` for the previous stage; ``recv_prev``: ``(boundary, micro-batch)`` of an
        activation to receive from the previous stage; ``recv_next``: receive a gradient from the next stage.
        A boundary is the receiving virtual stage. Returns ``(activation or None, gradient or None)``; the
        activation requires grad. Neighbours are ring neighbours (see the module docstring)."""
        act = torch.empty(shape, dtype=dtype, device=self.device) if recv_prev is not None else None
        grad = torch.empty(shape, dtype=dtype, device=self.device) if recv_next else None
        works = []
        if act is not None:
            works.append(self._irecv_forward(act, *recv_prev))
        if grad is not None:
            works.append(self._irecv_backward(grad))
        if send_next is not None:
            t, boundary, mb = send_next
            works.append(self._isend_forward(t, boundary, mb))
        if send_prev is not None:
            g, vs, slot = send_prev
            works.append(self._isend_backward(g, slot, vs))
        for w in works:
            w.wait()
        return (act.requires_grad_() if act is not None else None), grad

    @property
    def error_feedback(self):
        """The pp_gradient channel's error-feedback state (None when off); checkpointed with the channels."""
        return self.gradient.error_feedback

