"""The compressed collective algorithms, run on behalf of a :class:`megacomp.comm.Channel`.

Each ``run_*`` function takes the channel (codec, error-feedback state, options, stats table, stream)
and the call's tensors; the public entry points are the channel's methods and the free functions of
megacomp.comm.functional that mirror torch.distributed. With an identity codec (or a tensor below the
channel's small-tensor threshold) each calls the torch.distributed collective of the same name on the
same tensors, so results are bit-identical to it. With a lossy codec:

  reduce_scatter_tensor: [error feedback] -> encode each destination chunk -> all_to_all_single of
      the byte buffers (payload + scales) -> decode every received chunk -> sum in fp32 in rank order
      (/N for AVG) -> cast. Quantized payloads are never summed by the backend (uint8 SUM wraps).
  all_reduce: the reduce-scatter above on N near-equal chunks of the flattened tensor, then the reduced
      shard is re-encoded ([server error feedback]) and all-gathered; every rank decodes the same bytes,
      so all ranks end with identical results (own shard included). Two ranks instead all-gather their
      whole encodings and both decode-sum them in rank order: the same bytes on the wire as the two
      phases, one quantization instead of two, half the encode work, no server error
      (``CommOptions.two_rank_server`` keeps the two phases and the server error at two ranks too).
  Pipelining: tensors over ``CommOptions.segment_numel`` elements (default 1M) are cut into
      segments (reduce-scatter / all-gather: pieces of every chunk) that run the steps above independently, so encoding, transfer and decoding of
      consecutive segments overlap. Segments start new scale blocks (and per-tensor scales become
      per-segment scales); bytes travel as in megacomp.comm.transport (full-duplex p2p on gloo).
  all_gather_into_tensor: encode the input -> all-gather bytes -> decode every slot (own slot included).
  all_to_all_single: encode each outgoing chunk -> all_to_all_single of bytes -> decode.

Error bound: each element of a reduce-scatter result equals the fp32 sum of the dequantized inputs up
to fp32 round-off; versus the exact sum the error is at most the sum over ranks of each codec's
per-element bound (see megacomp.compression.quantize). All-reduce over more than two ranks adds one
more quantization of the reduced shard.

Failure behaviour: every validated call (``CommOptions.validate``, or ``check_finite=True``) first meets the
other members of its group in the rendezvous store (megacomp.comm.group_check), so ranks that pass different
groups (a subset, or another group of the same members) all raise one ValueError naming each rank's group within
seconds, before any collective is issued; it then all-gathers a small description of its arguments (``validate``)
so that mismatched sizes, dtypes, codecs or ops raise the same ValueError on every rank instead of hanging. With
validation off neither runs (no store traffic). ``check_finite=True`` raises FloatingPointError naming the ranks whose
input holds inf/NaN. Otherwise inf/NaN propagate (they never decode to finite values). Only SUM and
AVG are supported with a lossy codec; dtypes other than float32/bfloat16/float16/float64 need
``codec=None``. A group of one rank sends nothing and applies no codec.

Groups: a torch.distributed group, or a process-group object served by its own methods (torchft's; see
megacomp.comm.group_ops, through which every backend call here goes: for a registered group it is the same
torch.distributed call).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch

from ..compression.ef_encoder import chunk_encoder
from . import common as _common
from . import group_check, group_ops
from .common import (CompressedWork, all_reduce_bytes, codec_code, dtype_code, has_nonfinite, offsets, op_code, op_name,
                     split_sizes)
from .spans import enabled as _spans_on, span
from .transport import all_gather_bytes, all_to_all_bytes, next_tags, pipeline_segments, use_duplex


def _spanned(name: str):
    """Time every call of the decorated helper as phase ``name`` (megacomp.comm.spans; free when off)."""
    def deco(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if not _spans_on():
                return fn(*args, **kwargs)
            with span(name):
                return fn(*args, **kwargs)
        return inner
    return deco


_NO_SPAN = contextlib.nullcontext()


def _wait(work) -> None:
    """Wait for an exchange's bytes (phase ``wire``)."""
    with span("wire"):
        work.wait()


def _refusal(check: Callable[[], None]) -> Optional[Exception]:
    """The ValueError / TypeError a local check of this rank's arguments raises, or None: with validation on,
    megacomp.comm.common.validate raises it on every rank of the group (after comparing the ranks' arguments), so
    no rank is left waiting for one that refused."""
    try:
        check()
    except (ValueError, TypeError) as e:
        return e
    return None


def _raise_or_validate(ch, validate: Optional[bool], check_finite: bool, problem: Optional[Exception], what: str,
                       group, fields: dict, codec, device, tag: str, nonfinite=None, **kw) -> None:
    """The cross-rank check of a call (with this rank's local ``problem``): the group meeting in the store, then the
    arguments' all-gather; or, validation off, ``problem`` raised here (the other ranks may then wait: turning
    validation off trusts the caller). ``codec`` names the codec in a mismatch's message (None: the call has no codec
    field)."""
    if ch.validates(validate) or check_finite:
        group_check.CHECK.check(what, group)  # the ranks meet in the store first: a mismatched group cannot hang
        _common.validate(what, group, fields, nonfinite=nonfinite, tag=tag, device=device, local=problem,
                         texts={"codec": str(codec)} if codec is not None else None, **kw)
    elif problem is not None:
        raise problem


def _check_lossy(what: str, codec, tensor: torch.Tensor, op=None) -> None:
    if codec.is_identity:
        return
    codec.check_dtype(tensor.dtype)
    if op is not None and op_name(op) not in ("SUM", "AVG"):
        raise ValueError(f"megacomp.comm.{what}: codec {codec} supports ReduceOp SUM and AVG, got {op_name(op)}; "
                         f"use codec=None for other ops")


@_spanned("encode")
def _encode_chunks(src, base: int, sizes):
    """Encode consecutive chunks of the input from element ``base`` (one buffer per chunk); ``src``: the
    call's chunk encoder (megacomp.compression.ef_encoder)."""
    return [src.encode(base + o, s) for o, s in zip(offsets(sizes), sizes)]


@_spanned("decode")
def _decode_into(codec, buf: torch.Tensor, numel: int, dst: torch.Tensor) -> None:
    """Decode ``buf`` into the 1-D view ``dst`` (any float dtype; cast like ``Tensor.copy_``), in place
    when a kernel can write fp32 directly: no temporary of the decoded size."""
    out = dst if dst.dtype == torch.float32 and dst.is_contiguous() else None
    vals = codec.decode_flat(buf, numel, out=out)
    if out is None or vals.data_ptr() != out.data_ptr():
        dst.copy_(vals)


@_spanned("decode")
def _decode_sum(codec, recv: torch.Tensor, numel: int, world: int, avg: bool,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum the ``world`` encodings in ``recv`` in fp32 (in the rotated basis for Hadamard codecs, which is
    rotated back once at the end); ``out``: an fp32 destination to sum into (ignored for Hadamard)."""
    w = codec.wire_bytes(numel)
    if not world:
        return torch.zeros(numel, device=recv.device)
    out = out if out is not None and not codec.hadamard and out.dtype == torch.float32 and out.is_contiguous() else None
    acc = codec.decode_flat(recv[:w], numel, rotated=True, out=out)
    if out is not None and acc.data_ptr() != out.data_ptr():
        acc = out.copy_(acc)
    elif acc.untyped_storage().data_ptr() == recv.untyped_storage().data_ptr():  # a view of the bytes: own it
        acc = acc.clone()
    for j in range(1, world):  # fixed rank order: deterministic, identical on every rank
        acc = codec.decode_accumulate(recv[j * w:(j + 1) * w], numel, acc)
    if avg:
        acc /= world
    return codec.unrotate(acc, numel)


def _all_reduce_direct(ch, tensor, src, codec, group, avg, segs):
    """Two ranks: each sends its whole encoded tensor to the other (all-gather of the encodings) and both
    decode-sum the two in rank order. Same bytes on the wire as reduce-scatter + all-gather for two ranks,
    but one quantization instead of two and half the encode work; no server-side error."""
    n = tensor.numel()
    gathers, wire, base = [], 0, 0
    duplex = use_duplex(group, ch.options.duplex, tensor.device)
    tag = next_tags(group)
    for length in segs:
        with span("encode"):
            enc = src.encode(base, length)
        gathered = torch.empty(2 * enc.numel(), dtype=torch.uint8, device=tensor.device)
        gathers.append((gathered, all_gather_bytes(gathered, enc, group, tag, duplex)))
        wire += enc.numel()
        base += length
    src.commit()  # error feedback: the new error from the bytes sent

    def finish() -> None:
        dst = tensor.view(-1) if tensor.is_contiguous() else torch.empty(n, dtype=tensor.dtype, device=tensor.device)
        pos = 0
        with torch.no_grad():
            for length, (gathered, work) in zip(segs, gathers):
                _wait(work)
                seg = dst[pos:pos + length]
                total = _decode_sum(codec, gathered, length, 2, avg, out=seg)
                if total.data_ptr() != seg.data_ptr():
                    seg.copy_(total)
                pos += length
            if not tensor.is_contiguous():
                tensor.copy_(dst.view(tensor.shape))

    return finish, wire


def _all_reduce_rs_ag(ch, tensor, src, codec, group, avg, segments, skey):
    """Reduce-scatter (all-to-all of encoded chunks, fp32 decode-sum) then all-gather of the re-encoded
    shard (server error under ``skey``); returns (finish, wire bytes sent by this rank)."""
    world, rank, n = group_ops.get_world_size(group), group_ops.get_rank(group), tensor.numel()
    ef = ch.error_feedback
    duplex = use_duplex(group, ch.options.duplex, tensor.device)
    # Pipeline: every segment is an independent reduce-scatter + all-gather; all segments' all-to-alls
    # are issued while the next segment is encoded, then each is reduced and its all-gather issued as
    # soon as its bytes are in, so encode, wire and decode overlap.
    segs = [split_sizes(length, world) for length in segments]
    recvs, works, wire, base = [], [], 0, 0
    tag = next_tags(group)  # tag: the all-to-alls, tag + 1: the all-gathers (issued later, maybe elsewhere)
    for ss in segs:
        seg_bufs = _encode_chunks(src, base, ss)
        in_splits = [b.numel() for b in seg_bufs]
        w_own = codec.wire_bytes(ss[rank])
        recv = torch.empty(world * w_own, dtype=torch.uint8, device=tensor.device)
        works.append(all_to_all_bytes(recv, torch.cat(seg_bufs), [w_own] * world, in_splits, group, tag, duplex))
        recvs.append(recv)
        wire += sum(in_splits) - in_splits[rank] + (world - 1) * max(codec.wire_bytes(s) for s in ss)
        base += sum(ss)
    src.commit()  # error feedback: from the bytes actually sent, while they are on the wire

    def finish() -> None:
        own = [ss[rank] for ss in segs]
        # the reduced own shard, filled segment by segment; its chunk encoder adds the server error
        # (h = shard + e_srv, per segment) and, after the last segment, updates it from the bytes sent
        shard = torch.empty(sum(own), dtype=torch.float32, device=tensor.device)
        gathers, o = [], 0
        with chunk_encoder(ef, skey, shard, codec, ch.generator) as src_srv:  # commits after the last segment
            for ss, recv, work in zip(segs, recvs, works):
                _wait(work)
                seg = shard[o:o + ss[rank]]
                hs = _decode_sum(codec, recv, ss[rank], world, avg, out=seg)
                if hs.data_ptr() != seg.data_ptr():
                    seg.copy_(hs)
                with span("encode"):
                    enc = src_srv.encode(o, ss[rank])
                o += ss[rank]
                wmax = max(codec.wire_bytes(s) for s in ss)
                padded = torch.zeros(wmax, dtype=torch.uint8, device=tensor.device)
                padded[:enc.numel()] = enc
                gathered = torch.empty(world * wmax, dtype=torch.uint8, device=tensor.device)
                gathers.append((gathered, wmax, all_gather_bytes(gathered, padded, group, tag + 1, duplex)))
        # decode straight into the tensor (no full-size temporary: fresh large buffers cost page faults)
        dst = tensor.view(-1) if tensor.is_contiguous() else torch.empty(n, dtype=tensor.dtype, device=tensor.device)
        pos = 0
        with torch.no_grad():  # also for tensors that require grad, as torch's in-place collectives
            for ss, (gathered, wmax, work) in zip(segs, gathers):
                _wait(work)
                for j, s in enumerate(ss):
                    _decode_into(codec, gathered[j * wmax:j * wmax + codec.wire_bytes(s)], s, dst[pos:pos + s])
                    pos += s
            if not tensor.is_contiguous():
                tensor.copy_(dst.view(tensor.shape))

    return finish, wire


def server_numel(numel: int, world: int, rank: int, ch) -> int:
    """Length of the server error (key ``.../server``) that ``ch.all_reduce`` keeps on ``rank`` for a tensor of
    ``numel`` elements over ``world`` > 2 ranks (or 2 with ``CommOptions.two_rank_server``): this rank's chunk of
    every pipeline segment."""
    return sum(split_sizes(length, world)[rank] for length in pipeline_segments(numel, ch.options.segment_numel))


def _shown(tag: Optional[str], default: str) -> str:
    """The tag named in validation errors: only one the caller chose."""
    return "" if not tag or tag == default else tag


def _handle(finish, async_op: bool):
    handle = CompressedWork(finish)
    if async_op:
        return handle
    handle.wait()
    return None


def run_all_reduce(ch, tensor: torch.Tensor, op, group, async_op: bool, key: str, check_finite: bool,
                   tag: Optional[str], validate: Optional[bool]):
    """``torch.distributed.all_reduce`` (in place) through channel ``ch``; see the module docstring.

    Error-feedback keys: ``key + '/worker'`` (the full tensor) and ``key + '/server'`` (this rank's shard,
    more than two ranks, or two with ``CommOptions.two_rank_server``)."""
    codec = ch.codec_for(tensor.numel())
    world = group_ops.get_world_size(group)
    n = tensor.numel()
    problem = _refusal(lambda: _check_lossy("all_reduce", codec, tensor, op))
    _raise_or_validate(ch, validate, check_finite, problem, "all_reduce", group,
                       {"numel": n, "dtype": dtype_code(tensor.dtype), "codec": codec_code(codec), "op": op_code(op)},
                       codec, tensor.device, _shown(tag, "all_reduce"),
                       nonfinite=has_nonfinite(tensor) if check_finite else None)
    rank = group_ops.get_rank(group)
    label = tag or "all_reduce"
    uncompressed = all_reduce_bytes(n, tensor.element_size(), world, rank)
    if codec.is_identity or world == 1:
        ch.stats.record(label, uncompressed, uncompressed)
        with span("wire") if not async_op else _NO_SPAN:
            return group_ops.all_reduce(tensor, op=op, group=group, async_op=async_op)

    ef = ch.error_feedback
    src = chunk_encoder(ef, key + "/worker", tensor.reshape(-1), codec, ch.generator)  # h = g + e, chunk by chunk
    segs = pipeline_segments(n, ch.options.segment_numel)
    avg = op_name(op) == "AVG"
    try:  # the algorithm commits src after its last encode; a failure before that drops a half-updated error
        if world == 2 and not ch.options.two_rank_server:
            finish, wire = _all_reduce_direct(ch, tensor, src, codec, group, avg, segs)
        else:
            finish, wire = _all_reduce_rs_ag(ch, tensor, src, codec, group, avg, segs, key + "/server")
    except BaseException:
        src.abort()
        raise
    ch.stats.record(label, wire, uncompressed)
    return _handle(finish, async_op)


def run_reduce_scatter_tensor(ch, output: torch.Tensor, input: torch.Tensor, op, group, async_op: bool, key: str,
                              check_finite: bool, tag: Optional[str], validate: Optional[bool]):
    """``torch.distributed.reduce_scatter_tensor`` through ``ch``: rank r receives the reduction of chunk r
    (``output.numel()`` elements) of every rank's ``input`` (``world * output.numel()``). Error-feedback key:
    ``key + '/worker'``."""
    world = group_ops.get_world_size(group)
    m = output.numel()
    codec = ch.codec_for(input.numel())

    def local() -> None:
        if input.numel() != world * m:
            raise ValueError(f"megacomp.comm.reduce_scatter_tensor: input has {input.numel()} elements but must have "
                             f"world_size * output.numel() = {world} * {m} = {world * m}")
        if input.dtype != output.dtype:
            raise TypeError(f"megacomp.comm.reduce_scatter_tensor: input dtype {input.dtype} != output dtype "
                            f"{output.dtype}")
        _check_lossy("reduce_scatter_tensor", codec, input, op)

    _raise_or_validate(ch, validate, check_finite, _refusal(local), "reduce_scatter_tensor", group,
                       {"numel": m, "dtype": dtype_code(input.dtype), "codec": codec_code(codec), "op": op_code(op)},
                       codec, input.device, _shown(tag, "reduce_scatter"),
                       nonfinite=has_nonfinite(input) if check_finite else None)
    label = tag or "reduce_scatter"
    raw = (world - 1) * m * input.element_size()
    if codec.is_identity or world == 1:
        ch.stats.record(label, raw, raw)
        with span("wire") if not async_op else _NO_SPAN:
            return group_ops.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)

    src = chunk_encoder(ch.error_feedback, key + "/worker", input.reshape(-1), codec, ch.generator)
    # pipeline: piece k of every destination chunk travels in exchange k, encoded while k-1 is on the wire
    pieces = split_sizes(m, len(pipeline_segments(world * m, ch.options.segment_numel)))
    duplex = use_duplex(group, ch.options.duplex, input.device)
    msg_tag, exchanges, wire = next_tags(group), [], 0
    enc = [[None] * len(pieces) for _ in range(world)]  # enc[j][k]: piece k of the chunk for rank j
    with src:  # error feedback: commit (the new error from the bytes sent) after the last piece
        for k, (o, s) in enumerate(zip(offsets(pieces), pieces)):
            with span("encode"):
                for j in range(world):
                    enc[j][k] = src.encode(j * m + o, s)
            w = codec.wire_bytes(s)
            recv = torch.empty(world * w, dtype=torch.uint8, device=input.device)
            exchanges.append((recv, all_to_all_bytes(recv, torch.cat([enc[j][k] for j in range(world)]), [w] * world,
                                                     [w] * world, group, msg_tag, duplex)))
            wire += (world - 1) * w
    ch.stats.record(label, wire, raw)

    def finish() -> None:
        dst = output.view(-1) if output.is_contiguous() else torch.empty(m, dtype=output.dtype, device=output.device)
        with torch.no_grad():
            for (recv, work), o, s in zip(exchanges, offsets(pieces), pieces):
                _wait(work)
                seg = dst[o:o + s]
                total = _decode_sum(codec, recv, s, world, op_name(op) == "AVG", out=seg)
                if total.data_ptr() != seg.data_ptr():
                    seg.copy_(total)
            if not output.is_contiguous():
                output.copy_(dst.view(output.shape))

    return _handle(finish, async_op)


def run_all_gather_into_tensor(ch, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool,
                               check_finite: bool, tag: Optional[str], validate: Optional[bool]):
    """``torch.distributed.all_gather_into_tensor`` through ``ch``: slot r of ``output_tensor``
    (``world * input.numel()`` elements) receives rank r's input; every slot, the own one included, holds
    the decoded value so all ranks agree."""
    world = group_ops.get_world_size(group)
    m = input_tensor.numel()
    codec = ch.codec_for(m)

    def local() -> None:
        if output_tensor.numel() != world * m:
            raise ValueError(f"megacomp.comm.all_gather_into_tensor: output has {output_tensor.numel()} elements but "
                             f"must have world_size * input.numel() = {world} * {m} = {world * m}")
        if input_tensor.dtype != output_tensor.dtype:
            raise TypeError(f"megacomp.comm.all_gather_into_tensor: input dtype {input_tensor.dtype} != output dtype "
                            f"{output_tensor.dtype}")
        _check_lossy("all_gather_into_tensor", codec, input_tensor)

    _raise_or_validate(ch, validate, check_finite, _refusal(local), "all_gather_into_tensor", group,
                       {"numel": m, "dtype": dtype_code(input_tensor.dtype), "codec": codec_code(codec)},
                       codec, input_tensor.device, _shown(tag, "all_gather"),
                       nonfinite=has_nonfinite(input_tensor) if check_finite else None)
    label = tag or "all_gather"
    raw = (world - 1) * m * input_tensor.element_size()
    if codec.is_identity or world == 1:
        ch.stats.record(label, raw, raw)
        with span("wire") if not async_op else _NO_SPAN:
            return group_ops.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    flat = input_tensor.reshape(-1)
    pieces = split_sizes(m, len(pipeline_segments(world * m, ch.options.segment_numel)))  # encoded, sent, decoded in turn
    duplex = use_duplex(group, ch.options.duplex, input_tensor.device)
    msg_tag, exchanges, wire = next_tags(group), [], 0
    for o, s in zip(offsets(pieces), pieces):
        with span("encode"):
            enc = codec.encode_flat(flat[o:o + s], ch.generator, strict=False)
        gathered = torch.empty(world * enc.numel(), dtype=torch.uint8, device=input_tensor.device)
        exchanges.append((gathered, enc.numel(), all_gather_bytes(gathered, enc, group, msg_tag, duplex)))
        wire += (world - 1) * enc.numel()
    ch.stats.record(label, wire, raw)

    def finish() -> None:
        out = output_tensor
        dst = out.view(-1) if out.is_contiguous() else torch.empty(world * m, dtype=out.dtype, device=out.device)
        with torch.no_grad():
            for (gathered, w, work), o, s in zip(exchanges, offsets(pieces), pieces):
                _wait(work)
                for j in range(world):
                    _decode_into(codec, gathered[j * w:(j + 1) * w], s, dst[j * m + o:j * m + o + s])
            if not out.is_contiguous():
                out.copy_(dst.view(out.shape))

    return _handle(finish, async_op)


def _split_check(in_splits: list[int], out_splits: list[int]):
    def check(table: torch.Tensor) -> Optional[str]:
        world = table.shape[0]
        sent = table[:, :world]      # sent[i][j]: rows rank i sends to rank j
        expected = table[:, world:]  # expected[j][i]: rows rank j expects from rank i
        if not torch.equal(sent, expected.t()):  # host sync: argument validation (CommOptions.validate), not a hot path
            bad = [(i, j, int(sent[i, j]), int(expected[j, i])) for i in range(world) for j in range(world)
                   if sent[i, j] != expected[j, i]]
            desc = "; ".join(f"rank {i} sends {s} rows to rank {j}, which expects {e}" for i, j, s, e in bad[:4])
            return f"input_split_sizes and output_split_sizes do not match across ranks ({desc})"
        return None
    return check


def run_all_to_all_single(ch, output: torch.Tensor, input: torch.Tensor, output_split_sizes, input_split_sizes,
                          group, async_op: bool, check_finite: bool, tag: Optional[str], validate: Optional[bool]):
    """``torch.distributed.all_to_all_single`` through ``ch``. Split sizes count rows (dim 0), as in torch;
    None means equal splits. The small-tensor rule looks at the whole input."""
    world = group_ops.get_world_size(group)
    rank = group_ops.get_rank(group)
    codec = ch.codec_for(input.numel())
    rows_in = input.shape[0] if input.dim() else 1
    rows_out = output.shape[0] if output.dim() else 1
    row = input.numel() // rows_in if rows_in else 0
    in_splits = list(input_split_sizes) if input_split_sizes else split_sizes(rows_in, world)
    out_splits = list(output_split_sizes) if output_split_sizes else split_sizes(rows_out, world)

    def local() -> None:
        _check_lossy("all_to_all_single", codec, input)
        if input.dtype != output.dtype:
            raise TypeError(f"megacomp.comm.all_to_all_single: input dtype {input.dtype} != output dtype {output.dtype}")
        if not input_split_sizes and rows_in % world or not output_split_sizes and rows_out % world:
            raise ValueError(f"megacomp.comm.all_to_all_single: without split sizes dim 0 ({rows_in} in, {rows_out} "
                             f"out) must divide by the world size {world}")
        if (len(in_splits) != world or len(out_splits) != world or sum(in_splits) != rows_in
                or sum(out_splits) != rows_out):
            raise ValueError(f"megacomp.comm.all_to_all_single: split sizes {in_splits} / {out_splits} must have "
                             f"{world} entries summing to dim 0 of input ({rows_in}) / output ({rows_out})")

    problem = _refusal(local)
    splits = in_splits + out_splits if problem is None else [0] * (2 * world)  # every row the same length
    _raise_or_validate(ch, validate, check_finite, problem, "all_to_all_single", group,
                       {"row numel": row, "dtype": dtype_code(input.dtype), "codec": codec_code(codec)},
                       codec, input.device, _shown(tag, "all_to_all"),
                       nonfinite=has_nonfinite(input) if check_finite else None,
                       extra=splits, extra_check=_split_check(in_splits, out_splits))
    label = tag or "all_to_all"
    raw = (rows_in - in_splits[rank]) * row * input.element_size()
    if codec.is_identity or world == 1:
        ch.stats.record(label, raw, raw)
        return group_ops.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                           async_op=async_op)

    bufs = _encode_chunks(chunk_encoder(None, "", input.reshape(-1), codec, ch.generator), 0,
                          [s * row for s in in_splits])
    in_bytes = [b.numel() for b in bufs]
    out_bytes = [codec.wire_bytes(s * row) for s in out_splits]
    recv = torch.empty(sum(out_bytes), dtype=torch.uint8, device=input.device)
    ch.stats.record(label, sum(in_bytes) - in_bytes[rank], raw)
    work = all_to_all_bytes(recv, torch.cat(bufs), out_bytes, in_bytes, group, next_tags(group),
                            use_duplex(group, ch.options.duplex, input.device))

    def finish() -> None:
        _wait(work)
        parts = [codec.decode_flat(recv[o:o + b], s * row) for o, b, s in zip(offsets(out_bytes), out_bytes, out_splits)]
        with torch.no_grad():
            output.copy_(torch.cat(parts).view(output.shape))

    return _handle(finish, async_op)


def run_all_gather_encoded(ch, output: torch.Tensor, input: torch.Tensor, numel: int, dtype: torch.dtype, group,
                           async_op: bool, tag: Optional[str], validate: Optional[bool]):
    """All-gather byte messages the caller encoded itself (an optimizer that must see each rank's encoding,
    e.g. DeMo's indices): slot r of the uint8 ``output`` (``world * input.numel()`` bytes) receives rank r's
    ``input``, unchanged. Wire statistics count the bytes sent against ``numel`` elements of ``dtype`` (what
    the message would be uncompressed). Every rank's message must have the same size (validated)."""
    world = group_ops.get_world_size(group)
    w = input.numel()

    def local() -> None:
        if input.dtype != torch.uint8 or output.dtype != torch.uint8:
            raise TypeError(f"megacomp.comm.all_gather_encoded: messages are uint8 byte buffers, got input "
                            f"{input.dtype} and output {output.dtype}")
        if output.numel() != world * w:
            raise ValueError(f"megacomp.comm.all_gather_encoded: output has {output.numel()} bytes but must have "
                             f"world_size * input.numel() = {world} * {w} = {world * w}")

    _raise_or_validate(ch, validate, False, _refusal(local), "all_gather_encoded", group,
                       {"bytes": w, "numel": numel, "dtype": dtype_code(dtype)}, None, input.device,
                       _shown(tag, "all_gather_encoded"))
    raw = (world - 1) * numel * torch.empty((), dtype=dtype).element_size()
    ch.stats.record(tag or "all_gather_encoded", (world - 1) * w, raw)
    if world == 1:
        output.copy_(input)
        return _handle(lambda: None, async_op)
    work = all_gather_bytes(output, input.contiguous(), group, next_tags(group), use_duplex(group, ch.options.duplex, input.device))
    return _handle(work.wait, async_op)
