"""Chunked orthonormal DCT-II: the transform of DeMo, of DCT-DiLoCo and of the ``transform='dct'`` codecs.

Two forms:
  1-D (codecs, which see flat messages): ``dct_chunks(x, c)`` pads the flat tensor with zeros to a multiple
      of ``c`` and multiplies each chunk of ``c`` elements by the orthonormal DCT-II matrix ``D_c``;
      ``idct_chunks`` applies ``D_c^T`` and drops the padding.
  2-D (DeMo and DCT-DiLoCo, which see parameter shapes): a matrix of shape [Y*h, X*w] is cut into Y*X tiles of h x w,
      ``h = block_size_for(rows, c)`` and ``w = block_size_for(cols, c)`` (the largest divisors not above
      ``c``, as DeMo's reference picks them), and each tile T becomes ``D_h T D_w^T``. Vectors use 1-D
      tiles of ``block_size_for(n, c)`` elements.

``D_n[k, i] = s_k cos(pi (2i + 1) k / (2n))`` with ``s_0 = sqrt(1/n)``, ``s_k = sqrt(2/n)``; the matrix is
orthogonal, so norms are kept and the inverse is the transpose. Round-off: ``idct(dct(x))`` equals ``x``
to a few fp32 ulps of the chunk norm (the matrix is built in fp64 and rounded once). Because the
transform is linear, sums of transformed tensors can be transformed back once.

Failure behaviour: a chunk size below 1 raises ValueError; inputs are computed in fp32 (fp64 stays
fp64).
"""
from __future__ import annotations

import functools
import math

import torch


def check_chunk(chunk: int, what: str = "dct chunk") -> None:
    """Raises ValueError unless ``chunk`` is an int >= 1."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"{what} must be an int >= 1, got {chunk!r}")


@functools.lru_cache(maxsize=64)
def _matrix(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(dtype=dtype, device=device)


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D_n`` (rows are frequencies). Cached; do not modify it."""
    check_chunk(n, "dct size")
    return _matrix(n, dtype, str(torch.device(device)))


def block_size_for(n: int, chunk: int) -> int:
    """The largest divisor of ``n`` that is at most ``chunk`` (DeMo's tile side; 1 for a prime ``n`` above
    ``chunk``, where the transform degenerates to the identity)."""
    check_chunk(chunk)
    for d in range(min(n, chunk), 0, -1):
        if n % d == 0:
            return d
    return 1


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def padded_numel(numel: int, chunk: int) -> int:
    """``numel`` rounded up to a multiple of ``chunk``."""
    return -(-numel // chunk) * chunk


def dct_chunks(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """1-D chunked DCT-II of a flat tensor, zero-padded to a multiple of ``chunk``: returns a 2-D tensor
    [chunks, chunk] of coefficients (fp32, or fp64 for fp64 input)."""
    check_chunk(chunk)
    x = flat.reshape(-1).to(_work_dtype(flat))
    pad = padded_numel(x.numel(), chunk) - x.numel()
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, chunk) @ dct_matrix(chunk, x.dtype, x.device).T


def idct_chunks(coeffs: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`dct_chunks`: the first ``numel`` elements of the flat signal."""
    chunk = coeffs.shape[-1]
    c = coeffs.reshape(-1, chunk)
    return (c @ dct_matrix(chunk, c.dtype, c.device)).reshape(-1)[:numel]


def tile_shape(shape: torch.Size, chunk: int) -> tuple[int, ...]:
    """DeMo's tile of a tensor: (h, w) for a matrix, (h,) for a vector (largest divisors <= ``chunk``).
    Tensors of more than two dimensions are tiled as the matrix [shape[0], prod(rest)]."""
    if len(shape) == 0:
        return (1,)
    if len(shape) == 1:
        return (block_size_for(shape[0], chunk),)
    rows, cols = shape[0], math.prod(shape[1:])
    return (block_size_for(rows, chunk), block_size_for(cols, chunk))


def _as_tiles(x: torch.Tensor, tile: tuple[int, ...]) -> torch.Tensor:
    if len(tile) == 1:
        return x.reshape(-1, tile[0])
    h, w = tile
    rows = x.shape[0]
    y, xx = rows // h, x.numel() // rows // w
    return x.reshape(y, h, xx, w).permute(0, 2, 1, 3)  # [Y, X, h, w]


def _from_tiles(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if t.dim() == 2:
        return t.reshape(shape)
    y, xx, h, w = t.shape
    return t.permute(0, 2, 1, 3).reshape(shape)


def dct_tiles(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """DeMo's transform of a parameter-shaped tensor: tiles of :func:`tile_shape`, each transformed along
    both axes (matrices) or its one axis (vectors). Returns [tiles, h*w] coefficients (one row per tile,
    row-major within the tile): the unit in which DeMo keeps its top-k."""
    tile = tile_shape(x.shape, chunk)
    t = _as_tiles(x.to(_work_dtype(x)), tile)
    if len(tile) == 1:
        return t @ dct_matrix(tile[0], t.dtype, t.device).T
    dh, dw = dct_matrix(tile[0], t.dtype, t.device), dct_matrix(tile[1], t.dtype, t.device)
    return (dh @ t @ dw.T).reshape(-1, tile[0] * tile[1])


def idct_tiles(coeffs: torch.Tensor, shape: torch.Size, chunk: int) -> torch.Tensor:
    """Inverse of :func:`dct_tiles`: a tensor of ``shape`` (fp32, or fp64 for fp64 coefficients)."""
    shape = torch.Size(shape)
    tile = tile_shape(shape, chunk)
    if len(tile) == 1:
        return (coeffs.reshape(-1, tile[0]) @ dct_matrix(tile[0], coeffs.dtype, coeffs.device)).reshape(shape)
    h, w = tile
    rows = shape[0] if len(shape) else 1
    y, xx = rows // h, math.prod(shape) // rows // w
    c = coeffs.reshape(y, xx, h, w)
    dh, dw = dct_matrix(h, c.dtype, c.device), dct_matrix(w, c.dtype, c.device)
    return _from_tiles(dh.T @ c @ dw, shape)
