"""The torch.distributed-mirroring free functions: one call, one traffic path built for it.

Same names and arguments as torch.distributed plus keyword-only ``codec=`` (and ``error_feedback=`` for the
reducing collectives and ``send``). ``codec=None`` or ``"none"`` calls the torch.distributed collective of
the same name on the same tensors: bit-identical. Each call builds a one-off :class:`Channel`
(``CommOptions.from_env(validate=validate)``, no small-tensor threshold) and runs it; code that moves the
same traffic every step should build a Channel once and keep it (its options, its error-feedback state
and its stochastic-rounding stream then persist).

Explicit state only: ``error_feedback`` is None or an ``ErrorFeedback`` object the caller owns (the
residual lives in it, under ``ef_key``, else ``tag``, else the collective's name, plus '/worker' and
'/server'). A spec string or config raises ValueError: nothing is kept per call site.
``group`` may be a megacomp.comm.HierarchicalGroup (megacomp.comm.new_hierarchical_group): all_reduce,
reduce_scatter_tensor and all_gather_into_tensor then run hop by hop (megacomp.comm.hierarchical), ``codec`` being
the slowest hop's codec or a mapping from link kind to codec; the other calls run flat over its whole group.
A seeded stochastic codec used here starts its stream at the seed on every call (a pure function of
input and seed); pass ``generator=`` or use a Channel for a stream that continues.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.distributed import ReduceOp

from ..compression import CodecLike, ErrorFeedback
from .channel import Channel
from .hierarchical import HierarchicalChannel
from .hop_groups import HierarchicalGroup
from .options import CommOptions


def _one_off(what: str, codec: CodecLike, group, error_feedback, validate: Optional[bool],
             generator: Optional[torch.Generator] = None) -> Channel:
    if error_feedback is not None and not isinstance(error_feedback, ErrorFeedback):
        raise ValueError(f"megacomp.comm ({what}): error_feedback must be an ErrorFeedback object that you own and "
                         f"checkpoint (e.g. ErrorFeedback('loco')), got {error_feedback!r}; state is never kept per "
                         f"call site. For traffic sent every step, build a megacomp.comm.Channel once instead")
    if isinstance(group, HierarchicalGroup):  # a hop per link kind: the codec on the slowest, or one per hop
        return HierarchicalChannel(what, codec, group=group, error_feedback=error_feedback,
                                   options=CommOptions.from_env(validate=validate), generator=generator)
    return Channel(what, codec, group=group, error_feedback=error_feedback,
                   options=CommOptions.from_env(validate=validate), generator=generator)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, *,
               codec: CodecLike = None, error_feedback: Optional[ErrorFeedback] = None, check_finite: bool = False,
               tag: Optional[str] = None, validate: Optional[bool] = None, ef_key: Optional[str] = None,
               generator: Optional[torch.Generator] = None):
    """``torch.distributed.all_reduce`` with an optional codec, in place (algorithm and error bound:
    megacomp.comm.collectives). ``tag`` names the traffic in ``comm.stats()`` (default 'all_reduce').

    Raises:
        ValueError: mismatched numel/dtype/codec/op/group across ranks (validation), an op other than SUM/AVG with a
            lossy codec, or ``error_feedback`` that is not an ErrorFeedback / used without a lossy codec.
        FloatingPointError: ``check_finite=True`` and some rank's input holds inf/NaN (names the ranks).
        TypeError: a non-float dtype with a lossy codec."""
    ch = _one_off("all_reduce", codec, group, error_feedback, validate, generator)
    return ch.all_reduce(tensor, op, async_op=async_op, key=ef_key or tag or "all_reduce", check_finite=check_finite,
                         tag=tag or "all_reduce")


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, *, codec: CodecLike = None,
                          error_feedback: Optional[ErrorFeedback] = None, check_finite: bool = False,
                          tag: Optional[str] = None, validate: Optional[bool] = None, ef_key: Optional[str] = None,
                          generator: Optional[torch.Generator] = None):
    """``torch.distributed.reduce_scatter_tensor`` with an optional codec: rank r receives the reduction of
    chunk r of every rank's ``input``. Raises as :func:`all_reduce`, plus ValueError/TypeError when the
    input is not ``world * output.numel()`` elements of the output's dtype."""
    ch = _one_off("reduce_scatter", codec, group, error_feedback, validate, generator)
    return ch.reduce_scatter_tensor(output, input, op, async_op=async_op, key=ef_key or tag or "reduce_scatter",
                                    check_finite=check_finite, tag=tag or "reduce_scatter")


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                           async_op: bool = False, *, codec: CodecLike = None, check_finite: bool = False,
                           tag: Optional[str] = None, validate: Optional[bool] = None,
                           generator: Optional[torch.Generator] = None):
    """``torch.distributed.all_gather_into_tensor`` with an optional codec: every slot, the own one included,
    holds the decoded value so all ranks agree (per element error: one quantization, see
    megacomp.compression.quantize). Raises ValueError/TypeError for a wrong output size or dtype, and as
    :func:`all_reduce` for mismatches across ranks."""
    ch = _one_off("all_gather", codec, group, None, validate, generator)
    return ch.all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op, check_finite=check_finite,
                                     tag=tag or "all_gather")


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False, *, codec: CodecLike = None, check_finite: bool = False,
                      tag: Optional[str] = None, validate: Optional[bool] = None,
                      generator: Optional[torch.Generator] = None):
    """``torch.distributed.all_to_all_single`` with an optional codec (split sizes count rows of dim 0).
    Raises ValueError when the split sizes do not add up or do not match across ranks."""
    ch = _one_off("all_to_all", codec, group, None, validate, generator)
    return ch.all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op=async_op,
                                check_finite=check_finite, tag=tag or "all_to_all")


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, *, codec: CodecLike = None,
          error_feedback: Optional[ErrorFeedback] = None, ef_key: Optional[str] = None, check_finite: bool = False,
          label: Optional[str] = None, validate: Optional[bool] = None, generator: Optional[torch.Generator] = None):
    """Start sending ``tensor`` to global rank ``dst``; returns a handle with ``wait()``. With
    ``error_feedback`` (an ErrorFeedback) the message is ``Q(tensor + e)`` and ``e`` (key ``ef_key``, else
    ``label``, else 'send') is updated from exactly the bytes sent. Algorithm: megacomp.comm.p2p."""
    ch = _one_off("send", codec, group, error_feedback, validate, generator)
    return ch.isend(tensor, dst, tag=tag, key=ef_key or label or "send", check_finite=check_finite,
                    label=label or "send")


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0, *, codec: CodecLike = None,
          check_finite: bool = False, label: Optional[str] = None, validate: Optional[bool] = None):
    """Start receiving into ``tensor`` from global rank ``src``; ``wait()`` decodes into it and raises
    ValueError on a header mismatch (shape, dtype or codec differ from the sender's)."""
    ch = _one_off("recv", codec, group, None, validate)
    return ch.irecv(tensor, src, tag=tag, check_finite=check_finite, label=label or "recv")


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, *, codec: CodecLike = None,
         error_feedback: Optional[ErrorFeedback] = None, ef_key: Optional[str] = None, check_finite: bool = False,
         label: Optional[str] = None, validate: Optional[bool] = None,
         generator: Optional[torch.Generator] = None) -> None:
    """``torch.distributed.send`` with an optional codec (blocking); see :func:`isend`."""
    isend(tensor, dst, group, tag, codec=codec, error_feedback=error_feedback, ef_key=ef_key,
          check_finite=check_finite, label=label, validate=validate, generator=generator).wait()


def recv(tensor: torch.Tensor, src: int, group=None, tag: int = 0, *, codec: CodecLike = None,
         check_finite: bool = False, label: Optional[str] = None, validate: Optional[bool] = None) -> int:
    """``torch.distributed.recv`` with an optional codec (blocking; ``src`` is required). Returns ``src``.
    On a mismatch the sender's payload is drained (neither end hangs) and ValueError names both ranks."""
    ch = _one_off("recv", codec, group, None, validate)
    return ch.recv(tensor, src, tag=tag, check_finite=check_finite, label=label or "recv")
