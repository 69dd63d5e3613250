"""SparseLoCo's and DCT-momentum DiLoCo's outer step: an error-feedback accumulator in place of outer momentum.

SparseLoCo (Sarfi et al., 2025, arXiv 2508.15706), per outer step, on
replica r with outer weights theta, local weights theta_r after H inner steps and accumulator e_r:

    Delta_r    = theta - theta_r                      the pseudo-gradient
    e_r       <- beta * e_r + Delta_r                 decayed accumulator (it plays the outer momentum)
    Dhat_r     = C(e_r)                               the outer codec: top-k per chunk, values in 2 bits
    e_r       <- e_r - Dhat_r                         what was sent leaves the accumulator
    theta     <- theta - alpha * mean_r Dhat_r        plain averaged step, no momentum state

The exchange is an all-gather of every replica's encoding (``Channel.all_gather_into_tensor``), decoded
slot by slot and summed in fp32 in replica order, so the mean is exact for the decoded values and the
same on every rank, and there is a single compression per step (a reduce-scatter/all-gather all-reduce
would re-compress the reduced shard). ``Dhat_r`` is this replica's own slot, decoded from the very bytes
the others received, so ``e_r - Dhat_r`` is exactly the residual of what was sent. Cost per replica and
outer step: it sends its encoding to the R - 1 others (``(R - 1) * wire_bytes``, counted under the
channel's tag) and decodes R encodings (O(R * n) work, an R * n fp32 buffer for this rank's parameters).

Against the authors' code (tplr-ai/SparseLoCo, src/tplr/sparseloco.py): the rule and alpha = 1, beta = 0.95 are
theirs; their top-k runs over each tensor's 64 x 64 tiles (here by default: runs of ``chunk`` entries of the flat
buffer; ``sparseloco_tiles='reference'`` takes their tiles, :class:`Tiles`), their 2-bit quantizer decodes to the mean
of each of 4 bins of a tensor's kept values (here by default: int2, symmetric, a scale per 128;
``sparseloco_quantizer='stat2'`` is theirs, megacomp.compression.stat2), and their aggregate divides each entry by
the replicas that sent it (here and in the paper: by R). With both options the reference layout's messages are
encoded here (per tensor ``[indices][values]``) and all-gathered as bytes, and ``e <- e - Dhat_self`` is done when
encoding, as theirs. tests/test_outer_sparseloco.py restates their step with and without the options.

DCT-momentum DiLoCo (arXiv 2510.03371) is the same rule with a DCT codec (``transform='dct'`` plus top-k
per chunk: the accumulated Nesterov-style momentum is split in the frequency domain, the strongest
components are synchronised, the rest stay local). Only the paper's abstract is in our references, so this
is a reconstruction in DeMo's decoupled-momentum form, not the authors' exact update; the README says so.

Error bound: the applied step is alpha times the exact mean of the decoded Dhat_r (fp32 round-off of an
R-term sum); whatever the codec drops stays in e_r and is sent later, so sum over steps of Dhat_r plus the
final e_r telescopes to the decayed sum of the Delta_r. With an identity codec, beta = 0 and alpha = 1 the
step is theta - mean(Delta_r) = mean(theta_r) up to fp32 round-off.

Across nodes and sites: the replicas' messages are all-gathered flat over the outer groups (one rank per replica and
position); ranks of a replica that hold the same parameters each send theirs across the slow link (not hop by hop).
"""
from __future__ import annotations

import math

import torch

from ..comm import Channel
from ..compression import Codec, dct, make_codec, sparse, stat2

DEFAULT_LR, DEFAULT_DECAY = 1.0, 0.95
"""alpha and beta of the paper's runs (the reference code's outer_learning_rate 1 and error_decay 0.95): the outer_lr
and outer_momentum of megacomp.outer.DiLoCoConfig(algorithm='sparseloco') left unset, and of the CLI."""

DEFAULT_CODEC = make_codec("int2", k=64, chunk=4096)
"""SparseLoCo's outer codec when none is set: top-64 of every 4096 entries (1.6% density, inside the paper's 1-3%),
values in 2 bits (the ``outer`` path of a CommCompressionConfig left unset means this for SparseLoCo)."""


TILES = ("flat", "reference")
"""``DiLoCoConfig.sparseloco_tiles``: 'flat' runs the codec's top-k over ``chunk``-entry runs of the flat buffer;
'reference' over each tensor's tiles as the reference code cuts them (:class:`Tiles`)."""
QUANTIZERS = ("codec", "stat2")
"""``DiLoCoConfig.sparseloco_quantizer``: 'codec' sends the kept values in the codec's format; 'stat2' in the
reference code's statistical 2-bit code (megacomp.compression.stat2, one table per tensor; needs tiles 'reference')."""


def check_options(algorithm: str, tiles: str, quantizer: str, codec: Codec) -> None:
    """Raises ValueError (one line naming the fix) for options that do not fit together."""
    if algorithm != "sparseloco":
        raise ValueError(f"sparseloco_tiles and sparseloco_quantizer are SparseLoCo's options; algorithm is "
                         f"{algorithm!r}: leave them at 'flat' and 'codec'")
    if tiles not in TILES:
        raise ValueError(f"sparseloco_tiles must be one of {TILES}, got {tiles!r}")
    if quantizer not in QUANTIZERS:
        raise ValueError(f"sparseloco_quantizer must be one of {QUANTIZERS}, got {quantizer!r}")
    if quantizer == "stat2" and tiles != "reference":
        raise ValueError("sparseloco_quantizer 'stat2' quantizes each tensor's kept values: set sparseloco_tiles "
                         "'reference' too")
    if tiles == "reference":
        side = math.isqrt(codec.chunk or 0)
        if not (codec.k and codec.select == "topk" and codec.transform == "none" and side * side == codec.chunk):
            raise ValueError(f"sparseloco_tiles 'reference' needs a top-k codec whose chunk is a square tile (e.g. "
                             f"{{name: int2, k: 64, chunk: 4096}}: top-64 per 64 x 64 tile), got {codec}")


class Tiles:
    """The reference code's top-k layout for one fragment's tensors (tplr-ai/SparseLoCo ``ChunkingTransform`` and
    ``SparseLoCo.step`` without DCT). With ``chunk = s * s`` and ``k`` the codec's: a matrix (a tensor of more
    dimensions as [shape[0], rest]) is cut into tiles of h x w, h and w the largest divisors of its sides not
    above s; a vector into pieces of the largest divisor of its length not above s. Each tile keeps its
    ``max(1, round(h w k / chunk))`` entries of largest magnitude (Python's round, at most the tile), in
    torch.topk's unsorted order as the reference. Message per tensor: ``[indices][values]``, indices one byte per
    entry for tiles of at most 256 entries else two (little-endian int16 bit pattern), values in the codec's
    format over all the tensor's kept values, or stat2's code (shift and table per tensor)."""

    def __init__(self, shapes: list[torch.Size], codec: Codec, quantizer: str) -> None:
        side = math.isqrt(codec.chunk)
        self.shapes = [torch.Size(s) for s in shapes]
        self.tiles = [dct.tile_shape(s, side) for s in self.shapes]
        self.ks = []
        for tile in self.tiles:
            size = math.prod(tile)
            self.ks.append(min(size, int(max(1, round(size * codec.k / codec.chunk)))))
        self.values = None if quantizer == "stat2" else sparse.value_codec(codec)

    def _parts(self, i: int) -> tuple[int, int, int]:
        """(entries, kept values, index bytes) of tensor i."""
        n, size = math.prod(self.shapes[i]), math.prod(self.tiles[i])
        return n, n // size * self.ks[i], sparse.index_bytes(size)

    def _value_bytes(self, kept: int) -> int:
        return stat2.wire_bytes(kept) if self.values is None else self.values.wire_bytes(kept, torch.float32)

    def wire_bytes(self) -> int:
        """Bytes of one replica's message (what it sends to each other replica)."""
        return sum(kept * ib + self._value_bytes(kept) for _, kept, ib in map(self._parts, range(len(self.shapes))))

    def encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the uint8 message of the fp32 ``flat`` tensors, the dense fp32 values it decodes to)."""
        messages, sent, off = [], [], 0
        for i, (shape, tile, k) in enumerate(zip(self.shapes, self.tiles, self.ks)):
            n, kept, ib = self._parts(i)
            rows = dct._as_tiles(flat[off:off + n].view(shape), tile).reshape(-1, math.prod(tile))
            idx = rows.abs().topk(k, dim=-1, largest=True, sorted=False).indices
            vals = rows.gather(-1, idx)
            index = idx.to(torch.uint8 if ib == 1 else torch.int16).reshape(-1).view(torch.uint8)
            value = stat2.encode(vals) if self.values is None else self.values.encode_flat(vals.reshape(-1))
            messages += [index, value]
            sent.append(self._decode_one(i, torch.cat([index, value]), rows.shape))
            off += n
        return torch.cat(messages), torch.cat(sent)

    def _decode_one(self, i: int, buf: torch.Tensor, rows_shape) -> torch.Tensor:
        n, kept, ib = self._parts(i)
        idx = buf[:kept * ib].clone().view(torch.uint8 if ib == 1 else torch.int16).long().view(-1, self.ks[i])
        if ib == 2:
            idx = idx & 0xFFFF  # int16 bit pattern of indices up to 65535
        raw = buf[kept * ib:]
        vals = stat2.decode(raw, kept) if self.values is None else self.values.decode_flat(raw, kept, torch.float32)
        rows = torch.zeros(rows_shape, dtype=torch.float32, device=buf.device)
        rows.scatter_(-1, idx, vals.view(-1, self.ks[i]))
        shape, tile = self.shapes[i], self.tiles[i]
        if len(tile) == 2:  # back to [Y, X, h, w] for dct's inverse of its tiling
            rows = rows.view(shape[0] // tile[0], n // shape[0] // tile[1], *tile)
        return dct._from_tiles(rows, shape).reshape(-1)

    def decode(self, buf: torch.Tensor) -> torch.Tensor:
        """The dense flat fp32 tensors of one replica's message."""
        out, byte = [], 0
        for i, (shape, tile) in enumerate(zip(self.shapes, self.tiles)):
            n, kept, ib = self._parts(i)
            size = kept * ib + self._value_bytes(kept)
            out.append(self._decode_one(i, buf[byte:byte + size], (n // math.prod(tile), math.prod(tile))))
            byte += size
        return torch.cat(out)


def start_exchange(channel: Channel, accum: torch.Tensor, delta: torch.Tensor, beta: float, replicas: int,
                   async_op: bool, tiles: Tiles | None = None):
    """``e <- beta * e + Delta`` in place, then the all-gather of ``C(e)`` (encoded now, so ``e`` may change
    afterwards). Returns (work or None, the [replicas * n] fp32 buffer that holds every decoded slot after
    ``work.wait()``). With ``tiles`` (the reference layout): ``e <- e - Dhat_self`` happens here, as in the
    reference code, and the buffer is uint8, every replica's message in replica order."""
    accum.mul_(beta).add_(delta)
    if tiles is not None:
        mine, sent = tiles.encode(accum)
        accum.sub_(sent)
        gathered = torch.empty(replicas * mine.numel(), dtype=torch.uint8, device=accum.device)
        work = channel.all_gather_encoded(gathered, mine, numel=accum.numel(), dtype=torch.float32,
                                          async_op=async_op)
        return (work if async_op else None), gathered
    gathered = torch.empty(replicas * accum.numel(), dtype=torch.float32, device=accum.device)
    work = channel.all_gather_into_tensor(gathered, accum, async_op=async_op)
    return work, gathered


def outer_update(outer: torch.Tensor, accum: torch.Tensor, gathered: torch.Tensor, replica: int, replicas: int,
                 lr: float, tiles: Tiles | None = None) -> None:
    """``e <- e - Dhat_self`` (without ``tiles``: with them it was done at the start) and
    ``theta <- theta - lr * mean(Dhat)`` (fp32 sum in replica order)."""
    slots = gathered.view(replicas, -1)
    if tiles is not None:
        slots = torch.stack([tiles.decode(slots[j]) for j in range(replicas)])
    else:
        accum.sub_(slots[replica])
    mean = slots[0].clone()
    for j in range(1, replicas):
        mean.add_(slots[j])
    mean.div_(replicas)
    outer.add_(mean, alpha=-lr)
