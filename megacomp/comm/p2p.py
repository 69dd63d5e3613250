"""Compressed point-to-point messages run on behalf of a :class:`megacomp.comm.Channel` (the free
``send``/``recv``/``isend``/``irecv`` of megacomp.comm.functional build a one-off channel).

Algorithm: the sender encodes the tensor into one uint8 buffer (payload + scales) and sends it; the
receiver knows shape, dtype and codec, so it knows the exact byte count, receives and decodes into its
tensor. ``codec=None`` sends the tensor itself through torch.distributed (bit-identical).

Without validation the receive is posted at once (so a pair of ranks that both isend then irecv
never deadlock). Validation (default on, see ``CommOptions.validate``; both ends must agree): a 5-integer
header (numel, dtype, codec, wire bytes, non-finite flag) precedes the payload. On a mismatch the
receiver still drains the sender's payload, so the sender never hangs, and raises ValueError naming
both ranks. With ``check_finite=True`` a non-finite input makes both ends raise FloatingPointError
after the message is delivered. ``dst``/``src`` are global ranks, as in torch.distributed.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..compression.ef_encoder import chunk_encoder
from .common import CompressedWork, codec_code, dtype_code, has_nonfinite
from .probe import optional_probe

_HEADER = 5


def _header(tensor, codec, nonfinite: bool) -> torch.Tensor:
    return torch.tensor([tensor.numel(), dtype_code(tensor.dtype), codec_code(codec),
                         codec.wire_bytes(tensor.numel(), tensor.dtype), int(nonfinite)], dtype=torch.int64,
                        device=tensor.device)


def prepare_isend(ch, tensor: torch.Tensor, dst: int, key: str, check_finite: bool, label: Optional[str],
                  validate: Optional[bool]):
    """Encode one message from ``tensor`` through ``ch`` without sending it: returns ``(tensors, check)``, the
    tensors to send in order (the validation header when on, then the payload; keep them alive until sent) and
    a function to call once they were sent (raises FloatingPointError for a non-finite input under
    ``check_finite``). Error feedback (lossy codecs only): the message is ``Q(tensor + e)`` and ``e`` (key
    ``key``) is updated from exactly these bytes. For callers that post several messages as one batch (the
    pipeline's ``batch_isend_irecv`` under NCCL); :func:`run_isend` posts them itself."""
    codec = ch.codec_for(tensor.numel())
    codec.check_dtype(tensor.dtype)
    error_feedback = None if codec.is_identity else ch.error_feedback
    bad = check_finite and has_nonfinite(tensor)
    tensors = []
    if ch.validates(validate) or check_finite:
        tensors.append(_header(tensor, codec, bad))
    raw = tensor.numel() * tensor.element_size()
    if codec.is_identity:
        payload = tensor if tensor.is_contiguous() else tensor.contiguous()
    elif error_feedback is not None:
        with chunk_encoder(error_feedback, key, tensor.reshape(-1), codec, ch.generator) as src:
            payload = src.encode(0, tensor.numel())  # the new error from exactly these bytes, on exit
    else:
        payload = codec.encode_flat(tensor, ch.generator, strict=False)
    ch.stats.record(label or "send", payload.numel() * payload.element_size(), raw)
    probe = optional_probe(ch.probe) if not codec.is_identity else None
    if probe is not None:  # the receiver decodes exactly these bytes (decoding is deterministic)
        probe.message(ch.name, label or "send", key, tensor, codec.decode_flat(payload, tensor.numel(), tensor.dtype))
    tensors.append(payload)

    def check() -> None:
        if bad:
            raise FloatingPointError(f"megacomp.comm.send: non-finite values (inf/NaN) in the tensor sent from rank "
                                     f"{dist.get_rank()} to rank {dst} (check_finite=True)")
    return tensors, check


def run_isend(ch, tensor: torch.Tensor, dst: int, group, tag: int, key: str, check_finite: bool,
              label: Optional[str], validate: Optional[bool]):
    """Start sending ``tensor`` to global rank ``dst`` through ``ch``; returns a handle with ``wait()``.

    With the channel's error feedback (lossy codecs only) the message is ``Q(tensor + e)`` and ``e`` (key
    ``key``) is updated from exactly the bytes sent."""
    tensors, check = prepare_isend(ch, tensor, dst, key, check_finite, label, validate)
    works = [dist.isend(t, dst, group=group, tag=tag) for t in tensors]

    def finish() -> None:
        for w in works:
            w.wait()
        check()

    return CompressedWork(finish)


def _payload_buffer(tensor: torch.Tensor, codec, nbytes: int) -> torch.Tensor:
    if not codec.is_identity:
        return torch.empty(nbytes, dtype=torch.uint8, device=tensor.device)
    return tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _deliver(ch, tensor: torch.Tensor, codec, buf: torch.Tensor, label: Optional[str], nbytes: int) -> None:
    with torch.no_grad():  # also into tensors that require grad
        if codec.is_identity:
            if buf is not tensor:
                tensor.copy_(buf)
        else:
            tensor.copy_(codec.decode_flat(buf, tensor.numel(), tensor.dtype).view(tensor.shape))
    ch.stats.record(label or "recv", nbytes, tensor.numel() * tensor.element_size())


def _check_header(header: torch.Tensor, tensor: torch.Tensor, codec, src: int) -> Optional[str]:
    expected = _header(tensor, codec, False)
    if torch.equal(header[:3], expected[:3]):
        return None
    names = ("numel", "dtype", "codec")
    diff = [f"{n}: sender {int(header[i])} vs receiver {int(expected[i])}" for i, n in enumerate(names)
            if header[i] != expected[i]]
    return (f"megacomp.comm.recv: message from rank {src} to rank {dist.get_rank()} does not match the receiving "
            f"tensor ({'; '.join(diff)}); both ends must use the same shape, dtype and codec")


def _nonfinite_error(src: int) -> FloatingPointError:
    return FloatingPointError(f"megacomp.comm.recv: rank {src} sent non-finite values (inf/NaN) to rank "
                              f"{dist.get_rank()} (check_finite=True)")


def prepare_irecv(ch, tensor: torch.Tensor, src: int, check_finite: bool, label: Optional[str],
                  validate: Optional[bool]):
    """The receiving side of :func:`prepare_isend`: returns ``(buffers, finish)``, the buffers to receive into in
    order (header when validating, then payload) and ``finish(works)``, which waits for the receives posted for
    them (``works``, in the same order) and decodes into ``tensor``. A header mismatch raises ValueError before
    the payload is waited for (the pair of ranks is then broken, see :func:`run_irecv`)."""
    codec = ch.codec_for(tensor.numel())
    codec.check_dtype(tensor.dtype)
    checked = ch.validates(validate) or check_finite
    nbytes = codec.wire_bytes(tensor.numel(), tensor.dtype)
    header = torch.empty(_HEADER, dtype=torch.int64, device=tensor.device) if checked else None
    buf = _payload_buffer(tensor, codec, nbytes)

    def finish(works) -> None:
        if header is not None:
            works[0].wait()
            msg = _check_header(header, tensor, codec, src)
            if msg:
                raise ValueError(msg)
        works[-1].wait()
        _deliver(ch, tensor, codec, buf, label, nbytes)
        if header is not None and check_finite and int(header[4]):
            raise _nonfinite_error(src)

    return ([header] if header is not None else []) + [buf], finish


def run_irecv(ch, tensor: torch.Tensor, src: int, group, tag: int, check_finite: bool, label: Optional[str],
              validate: Optional[bool]):
    """Start receiving into ``tensor`` from global rank ``src`` through ``ch``; ``wait()`` decodes into it.

    Both the header (when validating) and the payload receive are posted at once, so several outstanding
    irecvs from one sender match its messages in order. A header mismatch raises at ``wait()``; the
    payload receive posted for the expected size then cannot complete cleanly, so treat the pair of
    ranks as broken (the blocking :func:`recv` drains the message instead and stays usable)."""
    bufs, finish = prepare_irecv(ch, tensor, src, check_finite, label, validate)
    works = [dist.irecv(b, src, group=group, tag=tag) for b in bufs]
    return CompressedWork(lambda: finish(works))


def run_recv(ch, tensor: torch.Tensor, src: int, group, tag: int, check_finite: bool, label: Optional[str],
             validate: Optional[bool]) -> int:
    """``torch.distributed.recv`` through ``ch`` (blocking; ``src`` is required). Returns ``src``.

    With validation the header is read first; on a mismatch the sender's payload is drained (so neither
    end hangs and the pair stays usable) and ValueError names both ranks and the differing fields."""
    codec = ch.codec_for(tensor.numel())
    codec.check_dtype(tensor.dtype)
    if not (ch.validates(validate) or check_finite):
        run_irecv(ch, tensor, src, group, tag, False, label, False).wait()
        return src
    header = torch.empty(_HEADER, dtype=torch.int64, device=tensor.device)
    dist.recv(header, src, group=group, tag=tag)
    msg = _check_header(header, tensor, codec, src)
    nbytes = codec.wire_bytes(tensor.numel(), tensor.dtype)
    if msg:
        dist.recv(torch.empty(int(header[3]), dtype=torch.uint8, device=tensor.device), src, group=group, tag=tag)
        raise ValueError(msg)
    buf = _payload_buffer(tensor, codec, nbytes)
    dist.recv(buf, src, group=group, tag=tag)
    _deliver(ch, tensor, codec, buf, label, nbytes)
    if check_finite and int(header[4]):
        raise _nonfinite_error(src)
    return src
