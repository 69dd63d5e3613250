"""Helpers shared by the collectives and p2p: chunking, codes that describe arguments, cross-rank validation,
the async handle. Stateless (the per-call settings live in megacomp.comm.options / megacomp.comm.Channel)."""
from __future__ import annotations

import zlib
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..compression import Codec
from . import group_ops

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
           torch.float8_e5m2]
_OPS = {"SUM": 1, "AVG": 2, "MAX": 3, "MIN": 4, "PRODUCT": 5, "BAND": 6, "BOR": 7, "BXOR": 8, "PREMUL_SUM": 9}

def comm_device(group=None) -> torch.device:
    """Where small bookkeeping tensors of a collective must live: the current CUDA device under NCCL,
    the CPU otherwise."""
    if group_ops.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def split_sizes(numel: int, parts: int) -> list[int]:
    """``numel`` split into ``parts`` contiguous chunks, the first ``numel % parts`` one larger."""
    base, rem = divmod(numel, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


def all_reduce_bytes(numel: int, itemsize: int, world: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in an uncompressed all-reduce of ``numel`` elements (megacomp.comm.stats's
    model: every chunk but its own, then its own shard to the ``world - 1`` others); 0 for one rank."""
    if world <= 1:
        return 0
    own = split_sizes(numel, world)[rank]
    return (numel - own) * itemsize + (world - 1) * own * itemsize


def offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each chunk of ``sizes`` laid end to end (exclusive prefix sums)."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer naming ``dtype`` in validation headers (unknown dtypes share one code)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def codec_code(codec: Codec) -> int:
    """A CRC of the codec's spec without its seed: equal on ranks that must agree on the wire format."""
    d = codec.to_dict()
    d.pop("seed", None)  # ranks may (should) seed stochastic rounding differently
    return zlib.crc32(repr(sorted(d.items())).encode())


def op_name(op) -> str:
    """The ReduceOp's name ('SUM', 'AVG', ...), or its str() when unknown."""
    for name in _OPS:
        if op == getattr(dist.ReduceOp, name, None):
            return name
    return str(op)


def global_ranks(group) -> list[int]:
    """Global rank of every member of ``group``, in group-rank order (a process-group object's members: their rank
    in it; megacomp.comm.group_ops)."""
    return group_ops.member_ranks(group)


def has_nonfinite(t: torch.Tensor) -> bool:
    """Whether a floating tensor holds inf or NaN (one reduction pass)."""
    # host sync: check_finite=True only (an opt-in diagnostic: the answer decides whether to raise)
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


def validate(what: str, group, fields: dict[str, int], extra: Sequence[int] = (),
             extra_check: Optional[Callable[[torch.Tensor], Optional[str]]] = None,
             nonfinite: Optional[bool] = None, tag: str = "", device=None, local: Optional[BaseException] = None,
             texts: Optional[dict[str, str]] = None) -> None:
    """All-gather ``fields`` (+ ``extra``) of every rank and raise the same error on all ranks on mismatch.

    ``fields`` must be equal on every rank; ``texts`` names a field's value readably (a codec's spec), gathered
    only to word the error. ``extra`` is checked by ``extra_check(table)`` (rows = ranks), which returns an error
    text or None. ``local`` is this rank's own refusal of its arguments (a size or dtype its codec cannot take):
    checked here, after the cross-rank comparison, so a rank whose arguments fail locally never leaves the others
    waiting out the process-group timeout; every rank raises it (its type, its text, naming the ranks when only
    some refused). ``nonfinite`` (when not None) is this rank's non-finite flag; if any rank has it set a
    FloatingPointError names those ranks.
    """
    # host sync: the whole check (a table from host values, read back to compare): argument validation
    # (CommOptions.validate), which the trainer turns off after its first iteration; not on the hot path
    names = list(fields)
    row = [fields[n] for n in names] + [int(bool(nonfinite)), int(local is not None)] + list(extra)
    device = device if device is not None else comm_device(group)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    world = group_ops.get_world_size(group)
    table = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    group_ops.all_gather_into_tensor(table, mine, group)
    table = table.view(world, -1)
    ranks = global_ranks(group)
    where = f"megacomp.comm.{what}" + (f" [tag {tag}]" if tag else "")
    for i, n in enumerate(names):
        col = table[:, i].tolist()
        if len(set(col)) > 1:
            shown = (gather_texts(group, texts[n], device) if texts and n in texts
                     else [_describe(n, v) for v in col])
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in zip(ranks, shown))
            raise ValueError(f"{where}: {n} differs across ranks ({per_rank}); every rank of the group must "
                             f"call the collective with the same {n}")
    refused = [r for r, f in zip(ranks, table[:, len(names) + 1].tolist()) if f]
    if refused:  # every rank enters this gather: all of them see the same flags
        said = gather_texts(group, "" if local is None else f"{type(local).__name__}\n{local}", device)
        kind, text = next(t for t in said if t).split("\n", 1)
        if len(refused) < len(ranks):
            text += f" (on rank(s) {refused}; every rank of the group raises this)"
        raise (TypeError if kind == "TypeError" else ValueError)(text)
    if extra_check is not None:
        msg = extra_check(table[:, len(names) + 2:])
        if msg:
            raise ValueError(f"{where}: {msg}")
    if nonfinite is not None:
        bad = [r for r, f in zip(ranks, table[:, len(names)].tolist()) if f]
        if bad:
            raise FloatingPointError(f"{where}: non-finite values (inf/NaN) in the input on rank(s) {bad}; "
                                     f"check the loss scale / learning rate on those ranks (check_finite=True)")


def gather_texts(group, text: str, device=None) -> list[str]:
    """Every rank's ``text``, in group-rank order (a collective: lengths, then the UTF-8 bytes padded to the
    longest). For error messages: it costs two small all-gathers."""
    # host sync: texts of an error message, gathered only when a validation fails
    device = device if device is not None else comm_device(group)
    world = group_ops.get_world_size(group)
    data = torch.tensor(list(text.encode()), dtype=torch.int64, device=device)
    lengths = torch.empty(world, dtype=torch.int64, device=device)
    group_ops.all_gather_into_tensor(lengths, torch.tensor([data.numel()], dtype=torch.int64, device=device), group)
    longest = max(int(lengths.max()), 1)
    padded = torch.zeros(longest, dtype=torch.int64, device=device)
    padded[:data.numel()] = data
    table = torch.empty(world * longest, dtype=torch.int64, device=device)
    group_ops.all_gather_into_tensor(table, padded, group)
    rows = table.view(world, longest).tolist()
    return [bytes(row[:n]).decode() for row, n in zip(rows, lengths.tolist())]


def _describe(field: str, value: int) -> str:
    if field == "dtype":
        return str(_DTYPES[value]) if value < len(_DTYPES) else "other"
    if field == "op":
        return next((k for k, v in _OPS.items() if v == value), str(value))
    return str(value)


def op_code(op) -> int:
    """A small integer naming the ReduceOp in validation headers."""
    return _OPS.get(op_name(op), 0)


# torch 2.13 renames the flat-tensor collectives (same op, no warning); older torch has the old names
all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CompressedWork:
    """Handle returned with ``async_op=True``: ``wait()`` finishes the collective (decode, reduce, and for
    all-reduce the all-gather). Waits must happen in the same order on every rank."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Optional[Callable[[], None]] = finish

    def wait(self, timeout=None) -> bool:
        """Finish the collective (idempotent); raises what the finishing step raises, e.g. a decode error."""
        if self._finish is not None:
            fn, self._finish = self._finish, None
            fn()
        return True

    def is_completed(self) -> bool:
        """Whether :meth:`wait` has run."""
        return self._finish is None
