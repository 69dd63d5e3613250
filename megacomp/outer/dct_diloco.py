"""DCT-DiLoCo's outer step: DiLoCo whose outer Nesterov momentum is shared only in its strongest DCT components.

Nedelkoski, Acker, Kao, Becker and Scheinert, "Distributed Low-Communication Training with Decoupled Momentum
Optimization" (arXiv 2510.03371, NeurIPS 2025 DynaFront workshop); the authors' release is
github.com/exalsius/diloco-training (``optim_method: demo``, its DeMo class used as DiLoCo's outer optimizer).
Per outer step, on replica r with outer weights theta_r (its own copy: the replicas' weights are not kept
equal), local weights after H inner steps theta_local and outer momentum m_r (fp32, zero at the start), for each
parameter tensor p of this rank:

    Delta_r = theta_r - theta_local                  the local pseudo-gradient (never all-reduced)
    m_r    <- beta * m_r + Delta_r                   the Nesterov momentum
    C       = DCT_tiles(m_r)                         orthonormal 2-D DCT-II per tile of up to chunk x chunk
                                                     (megacomp.compression.dct.dct_tiles, DeMo's tiling: the
                                                     largest divisors of the two sides not above ``chunk``;
                                                     vectors in 1-D tiles, >2-D tensors as [shape[0], rest])
    q_r     = the ``topk`` coefficients of largest magnitude in each tile (values in ``value codec``, fp32 as
              the release); m_r <- IDCT_tiles(C - q_r)   what is sent leaves the momentum (error feedback)
    all-gather every replica's q (indices and values)
    Q       = per coefficient, the mean of the values of the replicas that sent it (0 where none did: the
              release's ``scatter_reduce(mean, include_self=False)``)
    m_r    <- m_r + IDCT_tiles(Q)                    the shared high-energy part is put back, synchronised
    theta_r <- theta_r - lr * (Delta_r + beta * m_r) Nesterov step (SGD without momentum on that gradient)
    the model's parameters are set to theta_r

The DCT keeps the coefficients of largest magnitude, which the abstract calls the "high-frequency components" (DeMo's
"fast components"); nothing selects by frequency index. With every coefficient sent (``topk`` >= the tile
size) the momentum is synchronised exactly and is the same on every replica, but the step still adds the replica's
own Delta_r, so the replicas do not become plain DiLoCo (which steps with mean Delta): that is the published rule.

Determinism and error: every replica decodes the same bytes in replica order and sums densely, so Q is the same
on every replica. The residual is computed from the coefficients, ``IDCT(C - q)``, so it is exactly zero when
everything is sent; otherwise it equals ``m - IDCT(q)`` up to fp32 round-off of the transforms (a few ulps of each
tile's norm). Bytes per replica and exchange: its encoding, ``sum_p tiles_p * k_p * (index bytes + value bytes)``
(:func:`message_bytes`), sent to each of the R - 1 others and counted under the channel's tag; decoding costs O(R n).

Failure behaviour: a structured value codec, a ``topk`` or ``chunk`` below 1 raise ValueError at construction
(megacomp.outer.DiLoCoConfig); a tile above 65536 coefficients (chunk > 256) is refused by the codec.
"""
from __future__ import annotations

import math

import torch

from ..comm import Channel
from ..compression import Codec, dct, make_codec, sparse

DEFAULT_TOPK = 32
"""Coefficients kept per tile: the release's ``compression_topk`` (config files and default)."""
DEFAULT_CHUNK = 64
"""Largest tile side: the release's ``compression_chunk`` (fixed at 64 there: tiles of up to 64 x 64)."""
DEFAULT_LR = 0.7
"""Outer learning rate of the release's GPT-NeoX configuration (config_gpt.yaml)."""
DEFAULT_DECAY = 0.95
"""beta, the momentum decay (the release's ``compression_decay`` in every shipped configuration)."""


def check_value_codec(codec: Codec) -> None:
    """Raises ValueError when ``codec`` selects or transforms by itself (DCT-DiLoCo does the DCT and top-k)."""
    if codec.structured:
        raise ValueError(f"DCT-DiLoCo: outer codec {codec} selects or transforms by itself; DCT-DiLoCo does its own "
                         f"2-D DCT and top-k (outer_dct_topk, outer_dct_chunk), so give the kept values' format only "
                         f"(none, bf16, int8, ...)")


def codecs_for(shapes: list[torch.Size], topk: int, chunk: int, value_codec: Codec) -> list[Codec]:
    """One top-k codec per tensor: a chunk per tile, ``min(topk, tile size)`` values kept per tile."""
    out = []
    for shape in shapes:
        size = math.prod(dct.tile_shape(torch.Size(shape), chunk))
        out.append(make_codec(value_codec, k=min(topk, size), chunk=size, select="topk", transform="none"))
    return out


def message_bytes(shapes: list[torch.Size], codecs: list[Codec]) -> int:
    """Bytes of one replica's encoding of tensors of ``shapes`` (what it sends to each other replica)."""
    return sum(c.wire_bytes(math.prod(s), torch.float32) for s, c in zip(shapes, codecs))


def start_exchange(channel: Channel, momentum: torch.Tensor, delta: torch.Tensor, shapes: list[torch.Size],
                   codecs: list[Codec], chunk: int, beta: float, replicas: int, async_op: bool, tag: str):
    """``m <- beta m + Delta``, the top-k of each tile's DCT encoded and removed from ``m`` (in place), then the
    all-gather of the encodings. ``momentum`` and ``delta`` are flat fp32 over ``shapes`` in order. Returns
    (work or None, the uint8 buffer holding every replica's encoding in replica order after ``work.wait()``)."""
    momentum.mul_(beta).add_(delta)
    messages, off = [], 0
    for shape, codec in zip(shapes, codecs):
        n = math.prod(shape)
        m = momentum[off:off + n].view(shape)
        coeffs = dct.dct_tiles(m, chunk).reshape(-1)
        msg = codec.encode_flat(coeffs, channel.generator)
        sent = codec.decode_flat(msg, coeffs.numel(), torch.float32)
        m.copy_(dct.idct_tiles(coeffs - sent, shape, chunk))  # from the coefficients: exactly 0 when all is sent
        messages.append(msg)
        off += n
    mine = torch.cat(messages)
    gathered = torch.empty(replicas * mine.numel(), dtype=torch.uint8, device=mine.device)
    work = channel.all_gather_encoded(gathered, mine, numel=momentum.numel(), dtype=torch.float32,
                                      async_op=async_op, tag=tag)
    return (work if async_op else None), gathered


def shared_momentum(gathered: torch.Tensor, shapes: list[torch.Size], codecs: list[Codec], chunk: int,
                    replicas: int) -> torch.Tensor:
    """IDCT_tiles(Q), flat fp32: Q per coefficient the mean over the replicas that sent it (dense sums in replica
    order, so every replica gets the same bits)."""
    slots = gathered.view(replicas, -1)
    parts, byte = [], 0
    for shape, codec in zip(shapes, codecs):
        n = math.prod(shape)
        size = codec.wire_bytes(n, torch.float32)
        total = torch.zeros(n, dtype=torch.float32, device=gathered.device)
        count = torch.zeros(n, dtype=torch.float32, device=gathered.device)
        for j in range(replicas):
            values, sent = sparse.decode_with_support(codec, slots[j, byte:byte + size], n, torch.float32)
            total.add_(values)
            count.add_(sent.to(torch.float32))
        byte += size
        parts.append(dct.idct_tiles(total / count.clamp(min=1), shape, chunk).reshape(-1))
    return torch.cat(parts)


def outer_update(outer: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, gathered: torch.Tensor,
                 shapes: list[torch.Size], codecs: list[Codec], chunk: int, replicas: int, lr: float,
                 beta: float) -> None:
    """``m <- m + IDCT(Q)`` and ``theta <- theta - lr * (Delta + beta * m)``, in place (the release's order: the
    gradient ``Delta + m * beta`` formed first, then SGD's ``theta.add_(g, alpha=-lr)``)."""
    momentum.add_(shared_momentum(gathered, shapes, codecs, chunk, replicas))
    outer.add_(delta + momentum * beta, alpha=-lr)
