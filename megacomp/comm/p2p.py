"""Compressed point-to-point messages: ``send``/``recv`` (and ``isend``/``irecv``) with a codec.

Algorithm: the sender encodes the tensor into one uint8 buffer (payload + scales) and sends it; the
receiver knows shape, dtype and codec, so it knows the exact byte count, receives and decodes into its
tensor. ``codec=None`` sends the tensor itself through torch.distributed (bit-identical).

Without validation the receive is posted at once (so a pair of ranks that both isend then irecv
never deadlock). Validation (default on, see :func:`megacomp.comm.set_validation`; both ends must agree): a 5-integer
header (numel, dtype, codec, wire bytes, non-finite flag) precedes the payload. On a mismatch the
receiver still drains the sender's payload, so the sender never hangs, and raises ValueError naming
both ranks. With ``check_finite=True`` a non-finite input makes both ends raise FloatingPointError
after the message is delivered. ``dst``/``src`` are global ranks, as in torch.distributed.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..compression import CodecLike, make_codec
from . import _common
from . import stats as _stats
from ._common import CompressedWork, codec_code, dtype_code, has_nonfinite

_HEADER = 5


def _header(tensor, codec, nonfinite: bool) -> torch.Tensor:
    return torch.tensor([tensor.numel(), dtype_code(tensor.dtype), codec_code(codec),
                         codec.wire_bytes(tensor.numel(), tensor.dtype), int(nonfinite)], dtype=torch.int64)


def _validate(validate: Optional[bool]) -> bool:
    return _common._validate_default if validate is None else validate


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, *, codec: CodecLike = None,
          check_finite: bool = False, label: Optional[str] = None, validate: Optional[bool] = None):
    """Start sending ``tensor`` to global rank ``dst``; returns a handle with ``wait()``."""
    codec = make_codec(codec)
    codec._check_dtype(tensor.dtype)
    bad = check_finite and has_nonfinite(tensor)
    works = []
    if _validate(validate) or check_finite:
        works.append(dist.isend(_header(tensor, codec, bad), dst, group=group, tag=tag))
    raw = tensor.numel() * tensor.element_size()
    if codec.is_identity:
        payload = tensor if tensor.is_contiguous() else tensor.contiguous()
    else:
        payload = codec.encode_flat(tensor)
    _stats.record(label or "send", payload.numel() * payload.element_size(), raw)
    works.append(dist.isend(payload, dst, group=group, tag=tag))

    def finish() -> None:
        for w in works:
            w.wait()
        if bad:
            raise FloatingPointError(f"megacomp.comm.send: non-finite values (inf/NaN) in the tensor sent from rank "
                                     f"{dist.get_rank()} to rank {dst} (check_finite=True)")

    return CompressedWork(finish)


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0, *, codec: CodecLike = None,
          check_finite: bool = False, label: Optional[str] = None, validate: Optional[bool] = None):
    """Start receiving into ``tensor`` from global rank ``src``; ``wait()`` decodes into it."""
    codec = make_codec(codec)
    codec._check_dtype(tensor.dtype)
    checked = _validate(validate) or check_finite
    header = torch.empty(_HEADER, dtype=torch.int64)
    hwork = dist.irecv(header, src, group=group, tag=tag) if checked else None
    nbytes = codec.wire_bytes(tensor.numel(), tensor.dtype)
    if not checked:  # sizes agreed up front: post the receive now so paired send/recv pairs never deadlock
        buf = torch.empty(nbytes, dtype=torch.uint8) if not codec.is_identity else (
            tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format))
        work = dist.irecv(buf, src, group=group, tag=tag)

        def finish_posted() -> None:
            work.wait()
            if codec.is_identity:
                if buf is not tensor:
                    tensor.copy_(buf)
            else:
                tensor.copy_(codec.decode_flat(buf, tensor.numel(), tensor.dtype).view(tensor.shape))
            _stats.record(label or "recv", nbytes, tensor.numel() * tensor.element_size())

        return CompressedWork(finish_posted)

    def finish() -> None:
        if hwork is not None:
            hwork.wait()
            expected = _header(tensor, codec, False)
            if not torch.equal(header[:3], expected[:3]):
                sink = torch.empty(int(header[3]), dtype=torch.uint8)
                dist.recv(sink, src, group=group, tag=tag)
                names = ("numel", "dtype", "codec")
                diff = [f"{n}: sender {int(header[i])} vs receiver {int(expected[i])}"
                        for i, n in enumerate(names) if header[i] != expected[i]]
                raise ValueError(f"megacomp.comm.recv: message from rank {src} to rank {dist.get_rank()} does not match "
                                 f"the receiving tensor ({'; '.join(diff)}); both ends must use the same shape, dtype "
                                 f"and codec")
        if codec.is_identity:
            buf = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
            dist.recv(buf, src, group=group, tag=tag)
            if buf is not tensor:
                tensor.copy_(buf)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            dist.recv(buf, src, group=group, tag=tag)
            tensor.copy_(codec.decode_flat(buf, tensor.numel(), tensor.dtype).view(tensor.shape))
        _stats.record(label or "recv", nbytes, tensor.numel() * tensor.element_size())
        if hwork is not None and check_finite and int(header[4]):
            raise FloatingPointError(f"megacomp.comm.recv: rank {src} sent non-finite values (inf/NaN) to rank "
                                     f"{dist.get_rank()} (check_finite=True)")

    return CompressedWork(finish)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, *, codec: CodecLike = None,
         check_finite: bool = False, label: Optional[str] = None, validate: Optional[bool] = None) -> None:
    """``torch.distributed.send`` with an optional codec (blocking)."""
    isend(tensor, dst, group, tag, codec=codec, check_finite=check_finite, label=label, validate=validate).wait()


def recv(tensor: torch.Tensor, src: int, group=None, tag: int = 0, *, codec: CodecLike = None,
         check_finite: bool = False, label: Optional[str] = None, validate: Optional[bool] = None) -> int:
    """``torch.distributed.recv`` with an optional codec (blocking; ``src`` is required). Returns ``src``."""
    irecv(tensor, src, group, tag, codec=codec, check_finite=check_finite, label=label, validate=validate).wait()
    return src
