"""The CPU work a data-parallel method adds to a step besides its codecs, counted from the operations its code runs:
PowerSGD's matrix products and passes (megacomp's LowRankChannel, torch's PowerSGD hook), Accordion's norm sums,
the 1-bit family's momentum forming and 1-bit LAMB's trust ratios.

Units: FLOPs (a multiply-add is 2) and bytes read + written, fp32 4 bytes and fp64 8 bytes per element. An (a x b)
by (b x c) product costs 2abc FLOPs and reads a b + b c, writes a c elements; an elementwise pass reads and writes
its operands once. Seconds: a product takes max(FLOPs / F, bytes / B) (roofline), an elementwise pass bytes / B,
with F and B the machine's FLOP rate and memory traffic rate (megacomp.plan.shaped_steps.Machine).

Per element of a matrix PowerSGD compresses (n x m, rank r; ``matrix_shape``: n = first dimension):
  megacomp (megacomp.comm.low_rank_channel, called from the DDP hook): bucket / world (2 passes), h = g + e (3),
      P = h Q, Q = h^T P (one read of h each), own approximation P Q_local^T and result P Q_sum^T (one write each),
      residual h - approximation (3), its finiteness check (1), copy into the bucket (2): 11 elementwise + 4 product
      passes, 4 products = 8 r FLOPs, plus the QR of P (2 n r^2)
  torch (powerSGD_hook, error feedback and warm start on): bucket + error (3), clone (2), copy into the batched
      matrices (2), P, Q (one read each), P Q^T into the batch (one write), copy back (2), error = copy - result (3):
      12 elementwise + 3 product passes, 3 products = 6 r FLOPs, plus the QR of P
Tensors PowerSGD leaves uncompressed (1-D, below the compression rate) cost one division (2 passes).
Accordion (megacomp.comm.accordion_channel.observe): each bucket's reduced gradient added to an fp64 sum: a cast
(read 4, write 8 bytes) and the sum (read 16, write 8): 36 bytes per element, over every element.
1-bit Adam after its warm-up (megacomp.optimizer.onebit): x = b1 M + (1 - b1) g (2 + 3 passes), x / world (2);
its frozen-variance Adam step replaces the floor's AdamW (17 against 21 passes: not counted).
1-bit LAMB, besides that: each parameter's slice scaled and unscaled (2 + 2), and its momentum step (rules.py,
no weight decay: 70 passes, counted in the docstring of :func:`onebit_work`) instead of 1-bit Adam's 17.

Error bound: an operation count, exact for the code it restates; the seconds are as good as F and B (the
validation, benchmarks/results/plan, lists every point's error). Python's per-operation overhead, allocation and
cache effects are not counted. Failure behaviour: a shape of fewer than two dimensions is not compressed (0 work).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..compression.low_rank import make_low_rank, matrix_shape

FP32, FP64 = 4, 8


@dataclass(frozen=True)
class Work:
    """CPU work of one step: matrix products (FLOPs and their bytes) and elementwise bytes."""

    matmul_flops: float = 0.0
    """FLOPs of the matrix products (a multiply-add counts 2)."""
    matmul_bytes: float = 0.0
    """Bytes the matrix products read and write."""
    elementwise_bytes: float = 0.0
    """Bytes the elementwise passes read and write."""

    def __add__(self, other: "Work") -> "Work":
        return Work(self.matmul_flops + other.matmul_flops, self.matmul_bytes + other.matmul_bytes,
                    self.elementwise_bytes + other.elementwise_bytes)

    def seconds(self, flop_rate: float, memory_Bps: float) -> float:
        """max(FLOPs / F, product bytes / B) + elementwise bytes / B."""
        return max(self.matmul_flops / flop_rate, self.matmul_bytes / memory_Bps) + self.elementwise_bytes / memory_Bps


def matmul(a: int, b: int, c: int) -> Work:
    """An (a x b) by (b x c) product in fp32: 2abc FLOPs, (ab + bc + ac) x 4 bytes."""
    return Work(2.0 * a * b * c, FP32 * (a * b + b * c + a * c), 0.0)


def qr(n: int, r: int) -> Work:
    """Reduced Householder QR of an n x r fp32 matrix: 2 n r^2 - 2 r^3 / 3 FLOPs, reads and writes n r elements."""
    return Work(2.0 * n * r * r - 2.0 * r ** 3 / 3, 2.0 * FP32 * n * r, 0.0)


def torch_rank_for(shape, rank: int) -> int:
    """The rank torch's PowerSGD hook uses for a tensor (0: uncompressed): matrices with n m > 2 (n + m) r
    (its min_compression_rate of 2), viewed as (first dimension) x (the rest)."""
    mat = matrix_shape(shape)
    if mat is None:
        return 0
    n, m = mat
    r = min(n, m, rank)
    return r if n * m > 2 * (n + m) * r else 0


def powersgd_work(shapes, rank: int, engine: str = "megacomp") -> Work:
    """CPU work of one step of PowerSGD over parameters of ``shapes`` (module docstring); ``engine``:
    ``megacomp`` (LowRankChannel, megacomp's compression rule) or ``torch`` (torch's PowerSGD hook)."""
    if engine not in ("megacomp", "torch"):
        raise ValueError(f"powersgd_work: engine {engine!r} is not 'megacomp' or 'torch'")
    codec = make_low_rank({"name": "powersgd", "rank": rank})
    out = Work()
    for shape in shapes:
        r = codec.rank_for(shape) if engine == "megacomp" else torch_rank_for(shape, rank)
        numel = math.prod(shape)
        if not r:
            out += Work(elementwise_bytes=2 * FP32 * numel)
            continue
        n, m = matrix_shape(shape)
        products = [matmul(n, m, r), matmul(m, n, r), matmul(n, r, m)] + ([matmul(n, r, m)] if engine == "megacomp" else [])
        passes = 11 if engine == "megacomp" else 12
        for w in products + [qr(n, r), Work(elementwise_bytes=passes * FP32 * numel)]:
            out += w
    return out


def accordion_observe_work(numel: int) -> Work:
    """Accordion's per-step fp64 sum of every reduced gradient element: cast (4 + 8 bytes), add (8 + 8 + 8)."""
    return Work(elementwise_bytes=36.0 * numel)


LAMB_RULE_PASSES = 70
"""fp32-element passes of OneBitLambRule's momentum step without weight decay, per element (rules.py): g~ (7),
v_f (6), m copy (2), denominator (6), r (5), the fresh denominator (6), the ratio (3), the fp64 sums of squares of
p, r and u (cast 3 + square 4 + sum 2, each: 27), the fp64 maximum of the ratio (cast 3 + max 2), the update (3)."""
ADAM_FROZEN_PASSES = 17
"""The same for 1-bit Adam's frozen-variance AdamW step (m copy 2, decay 2, lerp 3, denominator 6, update 4)."""


def onebit_work(numel: int, lamb: bool = False) -> Work:
    """Work 1-bit Adam (``lamb``: 1-bit LAMB) adds to a step after its warm-up over the floor's AdamW: forming and
    averaging the momentum (7 passes); LAMB also scales and unscales it (4) and runs its longer step
    (:data:`LAMB_RULE_PASSES` - :data:`ADAM_FROZEN_PASSES`)."""
    passes = 7 + (4 + LAMB_RULE_PASSES - ADAM_FROZEN_PASSES if lamb else 0)
    return Work(elementwise_bytes=passes * FP32 * numel)
