"""Chunk encoders: what a compressed collective sends, chunk by chunk, with or without error feedback.

A collective encodes its flat input ``g`` as consecutive chunks (one per destination rank and pipeline
segment, in any order); with error feedback each chunk is ``Q(h)`` with ``h = g + e``, and the error is
then updated from exactly those bytes. :func:`chunk_encoder` returns an object with

  ``encode(offset, size)``  the bytes of elements [offset, offset + size) (each element exactly once);
  ``commit()``              after the last chunk: store the new error (nothing without error feedback).

Algorithm with error feedback (fp32 input and fp32 error storage, int/fp8 codec without Hadamard rotation):
per chunk, ``quantize.ef_encode_scaled`` runs compensate, encode and update in one pass over g and e where
a kernel covers the chunk (C++ on CPU, Triton on CUDA: per-block scales on byte boundaries, more than one
block, no dual scaling); otherwise the chunk's h is formed and encoded and the error updated from its
bytes (``ef_update_scaled``: the C++ or Triton kernel, else the reference). Other cases (bf16/int8 error
storage, the sign codec, Hadamard or cast codecs, fp64 or half inputs) form each chunk's h with
``ErrorFeedback.compensate``'s expression and encode it; ``commit`` calls ``update_encoded`` on the whole
h. Every path gives the bytes and the error of ``compensate`` + ``encode`` + ``update`` bit for bit, and
draws the same stochastic keys (tests/test_compression_ef_encoder.py); no full-size h is materialised on
the chunked path. The input is read only by ``encode``: a caller may fill ``g`` chunk by chunk between the calls (the
all-reduce's server side fills its reduced shard segment by segment).

The chunked path writes the new error into the stored fp32 error tensor in place (each element's old
value is read before its new one is written); ``ErrorFeedback.state_dict`` clones, so checkpoints are
unaffected, but a tensor obtained from ``ErrorFeedback.error`` earlier changes with the next step, and a
``state_dict`` taken while a step is in flight (the DDP hook's overlapped communication) could capture a
partly updated error: checkpoint between steps, as megacomp.training does (after the optimizer step).

Failure behaviour: as :class:`ErrorFeedback` (a non-finite residual anywhere drops the key's error, a
shape change raises ValueError); ``commit`` raises RuntimeError if the chunks did not cover the input
exactly once (a bug in the caller, never silently stored; an error already partly overwritten in place is
dropped, and the message says so). Used as a context manager (as the collectives do), an exception
between the first encode and the commit (a failed send) calls ``abort``: a partly overwritten error is
dropped and counted in ``dropped``, never kept half-updated. Empty chunks draw no stochastic key.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import counter_rng, quantize
from .error_feedback import ErrorFeedback, all_finite, blend_error, drop_nonfinite, uses_fused_update


class ChunkEncoder:
    """Without error feedback: ``encode`` is ``codec.encode_flat`` of the chunk (strict=False, as collectives
    encode: fp16 overflow becomes inf instead of raising on one rank only). As a context manager: ``commit``
    on a normal exit, ``abort`` when an exception leaves the block (it is not suppressed)."""

    def __init__(self, g: torch.Tensor, codec, generator: Optional[torch.Generator] = None) -> None:
        self.g, self.codec, self.generator = g.reshape(-1), codec, generator

    def encode(self, offset: int, size: int) -> torch.Tensor:
        """The bytes of elements [offset, offset + size) of the input."""
        return self.codec.encode_flat(self.g[offset:offset + size], self.generator, strict=False)

    def commit(self) -> None:
        """Nothing to store without error feedback."""

    def abort(self) -> None:
        """Nothing to undo without error feedback."""

    def __enter__(self) -> "ChunkEncoder":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
        return False


class _Coverage:
    """Which [offset, offset + size) ranges were encoded: commit checks each element was, exactly once."""

    def __init__(self, numel: int) -> None:
        self.numel, self.ranges = numel, []

    def add(self, offset: int, size: int) -> None:
        if size:  # an empty chunk covers nothing (collectives have them when a tensor is smaller than world)
            self.ranges.append((offset, size))

    def check(self) -> list[tuple[int, int]]:
        ranges, pos = sorted(self.ranges), 0
        for o, s in ranges:
            if o != pos:
                break
            pos += s
        if pos != self.numel or sum(s for _, s in ranges) != self.numel:
            raise RuntimeError(f"error feedback: the encoded chunks {ranges} do not cover the {self.numel} elements "
                               f"exactly once; every element must be encoded once before commit()")
        return ranges


class CompensatedEncoder(ChunkEncoder):
    """With error feedback, chunk by chunk (see the module docstring); one per collective call and key."""

    def __init__(self, ef: ErrorFeedback, key: str, g: torch.Tensor, codec,
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__(g, codec, generator)
        self.ef, self.key = ef, key
        self.coverage = _Coverage(self.g.numel())
        self.done = self.committed = False
        e = ef.error(key)
        self.chunked = uses_fused_update(ef.config, codec, self.g.dtype) and (e is None or e.dtype == torch.float32)
        if self.chunked:
            self.e = None if e is None else ef.check_shape(key, e, g).reshape(-1)
            # the new error overwrites the stored one in place: every kernel and the reference read e_i before
            # writing e'_i, and a fresh full-size tensor per step costs more in page faults than the pass itself
            self.in_place = self.e is not None and self.e.is_contiguous()
            self.new = self.e if self.in_place else torch.empty_like(self.g)
            self.finite = True
            self.touched = False  # whether the stored error was (partly) overwritten
        else:  # compensate's expression per chunk (element-wise: the same values), then update_encoded
            self.work = g.dtype if g.dtype == torch.float64 else torch.float32
            self.e = None if e is None else ef.check_shape(key, e, g).reshape(-1).to(self.work)
            self.h: dict[int, torch.Tensor] = {}
            self.bufs: dict[int, torch.Tensor] = {}

    def encode(self, offset: int, size: int) -> torch.Tensor:
        """The bytes of ``Q(g + e)`` for elements [offset, offset + size) (see the module docstring); each element
        must be encoded exactly once before :meth:`commit`."""
        self.coverage.add(offset, size)
        codec = self.codec
        if size == 0:  # no bytes, no random key drawn (as codec.encode_flat of an empty tensor), no state
            return codec.encode_flat(self.g[offset:offset], strict=False)
        if not self.chunked:
            gc = self.g[offset:offset + size].to(self.work)
            h = gc.clone() if self.e is None else gc + self.e[offset:offset + size]
            self.h[offset] = h
            self.bufs[offset] = codec.encode_flat(h, self.generator, strict=False)
            return self.bufs[offset]
        fmt, beta = codec.format, self.ef.config.beta
        g = self.g[offset:offset + size]
        e = None if self.e is None else self.e[offset:offset + size]
        new = self.new[offset:offset + size]
        stochastic = codec.rounding == "stochastic"
        key = None
        if stochastic:  # one key per chunk, as codec.encode_flat would draw it (and reused by the fallback)
            counter_rng.check_numel(size)
            key = counter_rng.draw_key(codec.stream(self.generator), g.device)
        buf = torch.empty(codec.wire_bytes(size), dtype=torch.uint8, device=g.device)
        self.touched = True
        ok = quantize.ef_encode_scaled(g, e, buf, new, fmt, codec.block_size, codec.dual_scale, beta, key=key)
        if ok is None:  # the three steps on this chunk (codec.encode_flat's steps for fp32 int/fp8 codecs)
            h = g.clone() if e is None else g + e  # ErrorFeedback.compensate
            quantize.encode_scaled(h, fmt, codec.block_size, codec.dual_scale, stochastic, None, out=buf, key=key)
            ok = quantize.ef_update_scaled(buf, h, e, new, fmt, codec.block_size, codec.dual_scale, beta)
            if ok is None:
                residual = h - codec.decode_flat(buf, size, h.dtype)
                ok = all_finite(residual)
                new.copy_(blend_error(e, residual, beta))
        self.finite = ok if self.finite is True else self.finite & ok  # a device flag stays on the device
        return buf

    def commit(self) -> None:
        """Store the new error (from exactly the bytes encoded) and advance the key's step. Raises RuntimeError
        when called twice or when the chunks did not cover the input exactly once (a partly overwritten error is
        then dropped)."""
        if self.done:
            raise RuntimeError(f"error feedback key {self.key!r}: this chunk encoder was already committed")
        self.done = True
        try:
            ranges = self.coverage.check()
        except RuntimeError:
            if self._drop_partial():
                raise RuntimeError(f"error feedback key {self.key!r}: its error was dropped (partly updated in "
                                   f"place); the encoded chunks must cover every element exactly once") from None
            raise
        self.committed = True
        if self.chunked:
            self.ef.commit(self.key, drop_nonfinite(self.new, self.finite), finite=self.finite)
        else:
            h = torch.cat([self.h[o] for o, _ in ranges]) if ranges else self.g.new_empty(0, dtype=self.work)
            self.ef.update_encoded(self.key, h, self.codec, [self.bufs[o] for o, _ in ranges], [s for _, s in ranges])

    def abort(self) -> None:
        """The call failed between the first ``encode`` and ``commit`` (e.g. a communication error): an error
        already partly overwritten in place is dropped and counted in ``ErrorFeedback.dropped`` (as after a
        non-finite step); otherwise the state is unchanged."""
        self._drop_partial()

    def _drop_partial(self) -> bool:
        if not (self.chunked and self.in_place and self.touched) or self.committed:
            return False
        self.ef.reset(self.key)
        self.ef.dropped[self.key] = self.ef.dropped.get(self.key, 0) + 1
        return True


def chunk_encoder(ef: Optional[ErrorFeedback], key: str, g: torch.Tensor, codec,
                  generator: Optional[torch.Generator] = None) -> ChunkEncoder:
    """The encoder of one collective call: with error feedback (``ef``, state key ``key``) or without;
    ``generator``: the stochastic-rounding stream (see ``Codec.stream``)."""
    return ChunkEncoder(g, codec, generator) if ef is None else CompensatedEncoder(ef, key, g, codec, generator)
