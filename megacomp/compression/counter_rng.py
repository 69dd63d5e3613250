"""Counter-based uniform draws for stochastic rounding, computed the same way by every backend.

Why: a stream of ``torch.rand`` draws is generated, written to memory and read back by the kernels: a
full extra pass that made stochastic encodes ~20x slower than round-to-nearest. A counter-based draw is a
pure function of (key, element index), so the C++ and Triton kernels compute it in registers, in any
order and any tiling, and still match this reference bit for bit.

Algorithm (all arithmetic on unsigned 32-bit integers, products taken mod 2^32):
  1. per encode call, one ``key`` is drawn from the caller's generator: ``torch.randint(0, 2^62)``, so
     seeding, ``manual_seed`` and per-rank seeds work as before, and successive calls get fresh keys;
  2. ``s0 = mix32(key mod 2^32)``, ``s1 = mix32((key >> 32) xor 0x9E3779B9)``;
  3. element i (its index in the flat tensor, 0 <= i < 2^32) gets
     ``h = mix32((i * 0x4F1BBCDD + s0) xor s1)`` and ``u = (h >> 8) * 2^-24``, a float32 in [0, 1) on the
     same 24-bit grid as ``torch.rand``;
  where ``mix32(x)`` is x ^= x >> 16; x *= 0x45D9F3B; x ^= x >> 16; x *= 0x45D9F3B; x ^= x >> 16 (a
  bijection of 32-bit words with good avalanche). Step 3 is a Weyl sequence (odd multiplier) through a
  finalizer, as in SplitMix; the xor after the add keeps two keys' streams from being shifted copies of
  each other. Every step is a bijection, so within one call distinct elements never share a 32-bit draw.
  One mix per element (3 multiplies) keeps the kernels near memory speed; tests check uniformity of high
  and low bits, neighbour and key-to-key correlations against bounds derived from the sample size.

Failure behaviour: tensors of 2^32 or more elements are refused (the index is a 32-bit counter); split
them into buckets.
"""
from __future__ import annotations

from typing import Optional

import torch

MIX = 0x45D9F3B  # < 2^27: x * MIX < 2^59 for 32-bit x, so the reference's int64 products never overflow
WEYL = 0x4F1BBCDD  # odd, < 2^31 (the same reason); about 2^32 / (golden ratio * 2)
GOLDEN = 0x9E3779B9
MAX_NUMEL = 1 << 32
_MASK = 0xFFFFFFFF
_CHUNK = 1 << 22  # elements per reference chunk: bounds the int64 temporaries (32 MiB each)


def draw_key(generator: Optional[torch.Generator], device: torch.device | str) -> torch.Tensor:
    """One key per encode call, drawn from ``generator`` on the generator's own device (torch's default
    generator for ``device`` when None) and placed on ``device``: an int64 tensor of shape (1,), never read
    back to the host by the CUDA path. A seeded codec's CPU generator thus also serves CUDA tensors (its key is
    copied from pinned memory, asynchronously: no host synchronisation)."""
    where = generator.device if generator is not None else torch.device(device)
    key = torch.randint(0, 1 << 62, (1,), generator=generator, device=where, dtype=torch.int64)
    target = torch.device(device)
    if key.device.type == "cpu" and target.type == "cuda":
        # from pinned memory without blocking: a copy from pageable memory would wait for the device
        return key.pin_memory().to(target, non_blocking=True)
    return key.to(target)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit mixer above on int64 tensors holding values in [0, 2^32)."""
    x = (((x >> 16) ^ x) * MIX) & _MASK
    x = (((x >> 16) ^ x) * MIX) & _MASK
    return (x >> 16) ^ x


def stream_seeds(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s0, s1) of step 2, int64 tensors of shape (1,)."""
    return mix32(key & _MASK), mix32((key >> 32) ^ GOLDEN)


def check_numel(numel: int) -> None:
    """Raises ValueError when ``numel`` >= 2^32: the draws' element counter is 32 bits wide."""
    if numel >= MAX_NUMEL:
        raise ValueError(f"stochastic rounding indexes its draws with a 32-bit counter: a tensor of {numel} "
                         f"elements (>= 2^32) must be split into smaller buckets, or use rounding='nearest'")


def uniforms(key: torch.Tensor, numel: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The draws u_0 .. u_{numel-1} (float32, on ``key``'s device), computed in chunks; written into
    ``out`` when given (at least ``numel`` elements), which is returned. Raises ValueError for
    ``numel`` >= 2^32 (:func:`check_numel`)."""
    check_numel(numel)
    s0, s1 = stream_seeds(key)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=key.device)
    for a in range(0, numel, _CHUNK):
        i = torch.arange(a, min(numel, a + _CHUNK), dtype=torch.int64, device=key.device)
        h = mix32((((i * WEYL) + s0) & _MASK) ^ s1)
        out[a:a + i.numel()] = (h >> 8).to(torch.float32) * 2.0 ** -24
    return out
