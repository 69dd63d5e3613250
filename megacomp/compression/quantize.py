"""Scaled quantization: the reference (eager torch) encode/decode for ``int``, ``sign`` and ``float8``.

Wire layout of one encoded tensor of ``n`` elements (a flat uint8 buffer, scales first so that they
stay 4-byte aligned when the buffer starts at an aligned offset):

  single scale  (block_size = 0):   [fp32 scale]                       [payload]
  per block     (block_size = B):   [fp32 scale x nb]                  [payload]
  dual scale    (block_size = B):   [fp32 coarse][uint8 exponent x nb] [payload]

with ``nb = ceil(n / B)``. The payload holds ``n`` codes only (no block padding is sent):
``ceil(n * bits / 8)`` bytes.

Algorithm (per block b of the zero-padded input, in fp32):
  int:    s_b = amax_b / qmax;  q = round(x / s_b) (or floor(x / s_b + u) for stochastic, u in [0, 1) the
          counter-based draw of counter_rng.py: one key per call from the generator, u a function of
          (key, element index), so every backend computes the same draws without storing them),
          clamped to [-qmax, qmax]; decode q * s_b.  |error| <= s_b / 2 (nearest), < s_b (stochastic).
  sign:   nearest: s_b = mean_b |x|, bit = x >= 0, decode +-s_b; |error| <= amax_b. The mean is an exact
          integer sum (see _sign_mean_scale), so any summation order, in any kernel, gives the same bits.
          stochastic: s_b = amax_b, P(+1) = (1 + x / s_b) / 2 (unbiased); |error| <= 2 amax_b.
  float8: s_b = amax_b / fmax; y = float8(x / s_b) (round to nearest even); decode y * s_b.
          |error| <= max(|x| * 2^-(m+1), s_b * min_subnormal / 2), m = mantissa bits.
  dual:   a coarse scale c = amax / qmax for the whole tensor and, per block, an integer
          k_b = floor(log2(amax / amax_b)) in [0, 126] (one byte); s_b = c * 2^-k_b, so
          amax_b / qmax <= s_b < 2 amax_b / qmax: near-zero blocks get their own magnification for one
          byte per block instead of four. Scaling uses x * 2^k / c so no scale ever underflows.

Non-finite inputs: amax (and the sign codec's mean |x|) propagate inf/NaN into the block's scale, codes are
sanitised, and decode multiplies by that scale, so every element of such a block decodes to inf or
NaN; a non-finite input never decodes to a finite number.
"""
from __future__ import annotations

from typing import Optional

import torch

try:  # the scale helpers the reference shares with the Triton kernels (a leaf module: no import cycle)
    from megacomp.kernels.scales import canonical_nan, sign_scale_exponents, sign_scale_from_sums
    from megacomp.kernels.scales import dual_exponents as _dual_exponents
    from megacomp.kernels.scales import pow2_f64 as _pow2_f64
except ModuleNotFoundError as exc:  # pragma: no cover - an install without kernels/
    if exc.name not in ("megacomp.kernels", "megacomp.kernels.scales"):
        raise
    raise ImportError("megacomp.kernels is missing: install megacomp from its checkout (bash scripts/install.sh, "
                      "or pip install -e .), or put the checkout that holds megacomp/ and kernels/ on PYTHONPATH") from exc

from . import counter_rng
from .formats import Format
from .packing import pack_bits, packed_nbytes, unpack_bits



def num_blocks(numel: int, block_size: int) -> int:
    """Scale blocks of ``numel`` elements: 0 for an empty tensor, 1 per tensor when ``block_size`` is 0."""
    if numel == 0:
        return 0
    return 1 if block_size == 0 else -(-numel // block_size)


def scale_nbytes(numel: int, block_size: int, dual: bool) -> int:
    """Scale bytes on the wire: an fp32 per block, or (dual) one fp32 plus one exponent byte per block."""
    nb = num_blocks(numel, block_size)
    if nb == 0:
        return 0
    return 4 + nb if dual else 4 * nb


def payload_nbytes(numel: int, fmt: Format) -> int:
    """Bytes of ``numel`` packed ``fmt.bits``-bit codes (whole bytes, the last one padded)."""
    return packed_nbytes(numel, fmt.bits)


def _blocks(x32: torch.Tensor, block_size: int) -> torch.Tensor:
    n = x32.numel()
    if block_size == 0:
        return x32.view(1, n)
    pad = (-n) % block_size
    if pad:
        x32 = torch.cat([x32, x32.new_zeros(pad)])
    return x32.view(-1, block_size)


def _as_f32(buf: torch.Tensor) -> torch.Tensor:
    """View a uint8 slice as fp32, copying only when the slice is not 4-byte aligned."""
    if buf.storage_offset() % 4:
        buf = buf.clone()
    return buf.view(torch.float32)


def _kernels(fmt: Format, stochastic: bool, x: torch.Tensor):
    """The fused kernels covering this case, or None (then the eager reference below runs): Triton for
    CUDA tensors, the C++ extension for CPU tensors, nothing else. Stochastic rounding passes the call's
    counter_rng key; the kernels compute the reference's draws from it."""
    if fmt.kind not in ("int", "float8", "sign"):
        return None
    from megacomp import kernels

    if x.device.type == "cuda":
        k = kernels.triton_kernels()
        return k if fmt.kind != "sign" or getattr(k, "supports_sign", False) else None
    if x.device.type == "cpu":
        k = kernels.cpu_kernels()
        if k is None or (stochastic and not getattr(k, "supports_stochastic", False)):
            return None
        return k if fmt.kind != "sign" or getattr(k, "supports_sign", False) else None
    return None


def _sign_mean_scale(absb: torch.Tensor, amax_b: torch.Tensor, n: int) -> torch.Tensor:
    """The sign codec's nearest-rounding scale per block, mean_b |x|, defined so that its value does not
    depend on a summation order (a float sum does: only torch's own loop would reproduce torch's bits).

    With amax_b = m 2^e (m in [0.5, 1)) and k = 24 - e, every |x| 2^k is below 2^24; the scale is
    ``fp32(fp64(sum_i floor(|x_i| 2^k)) * 2^-k / count_b)``: an exact int64 sum, then two roundings.
    It is at most amax_b 2^-23 below the exact mean (the floors). A block with a non-finite amax gets that
    amax (inf, or NaN when there is a NaN), an all-zero block 0. ``absb``: the zero-padded |x| blocks,
    ``amax_b``: their maxima (nb, 1), ``n``: the number of data elements (the last block's count).
    """
    ok, k = sign_scale_exponents(amax_b)
    clean = torch.where(ok, absb, torch.zeros_like(absb)).double()
    total = torch.floor(clean * _pow2_f64(k)).to(torch.int64).sum(dim=1, keepdim=True)  # exact, any order
    return sign_scale_from_sums(total, k, ok, amax_b, n, absb.shape[1])


def _is_triton(k) -> bool:
    return getattr(k, "name", "") == "triton"


def _kernel_failed(k, exc: Exception) -> bool:
    """A Triton compile/launch failure: log once, turn Triton off, let the caller use the reference (a case
    the kernels do not take, ``Unsupported``: the reference for this call only)."""
    if not _is_triton(k):
        return False
    if type(exc).__name__ != "Unsupported":
        from megacomp import kernels

        kernels.triton_failed(exc)
    return True


def _kind_code(fmt: Format) -> int:
    if fmt.kind == "int":
        return 0
    return 1 if fmt.dtype == torch.float8_e4m3fn else 2


def encode_scaled(x32: torch.Tensor, fmt: Format, block_size: int, dual: bool, stochastic: bool,
                  generator: Optional[torch.Generator], out: Optional[torch.Tensor] = None,
                  key: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Encode a flat tensor (fp32; bf16/fp16 too, read as fp32 exactly) into the wire layout above (fused
    kernel when available, bit-identical). ``out``: a preallocated uint8 buffer of the exact size (reused
    buffers avoid page faults on big tensors). ``key``: stochastic rounding's counter_rng key when the
    caller already drew it (else one is drawn from ``generator``)."""
    k = _kernels(fmt, stochastic, x32)
    if not stochastic:
        key = None
    if k is not None and x32.dtype not in getattr(k, "input_dtypes", (torch.float32,)):  # C++: fp32 only
        x32 = x32.to(torch.float32)
    if k is not None:
        n = x32.numel()
        if out is None:
            out = torch.empty(scale_nbytes(n, block_size, dual) + payload_nbytes(n, fmt), dtype=torch.uint8,
                              device=x32.device)
        if n == 0:
            return out
        args = (x32.contiguous(), out, _kind_code(fmt), fmt.bits, float(fmt.qmax), block_size, dual)
        if stochastic and key is None:  # drawn once: a kernel failure hands the same key to the reference
            counter_rng.check_numel(n)
            key = counter_rng.draw_key(generator, x32.device)
        try:
            if fmt.kind == "sign":  # the C++ and Triton kernels take (x, out, block, key=None)
                k.sign_encode_into(args[0], out, block_size, key=key)
            else:
                k.encode_into(*args, key=key)
            return out
        except Exception as e:
            if not _kernel_failed(k, e):
                raise
    x32 = x32.to(torch.float32)
    res = encode_scaled_reference(x32, fmt, block_size, dual, stochastic, generator, key=key)
    return res if out is None else out.copy_(res)


def decode_scaled(buf: torch.Tensor, numel: int, fmt: Format, block_size: int, dual: bool,
                  accumulate_into: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode the wire layout above into fp32 (into ``out`` if given: fp32, or bf16/fp16 rounded like
    ``.to(dtype)``), or add it into ``accumulate_into`` (fp32)."""
    k = _kernels(fmt, False, buf)
    target = accumulate_into if accumulate_into is not None else out
    dtypes = (torch.float32,) if accumulate_into is not None else getattr(k, "input_dtypes", (torch.float32,))
    if k is not None and (target is None or (target.is_contiguous() and target.dtype in dtypes)):
        if target is None:
            target = torch.empty(numel, dtype=torch.float32, device=buf.device)
        try:
            if fmt.kind == "sign":
                k.sign_decode_into(buf.contiguous(), target, block_size, accumulate_into is not None)
            else:
                k.decode_into(buf.contiguous(), target, _kind_code(fmt), fmt.bits, block_size, dual,
                              accumulate_into is not None)
            return target
        except Exception as e:
            if not _kernel_failed(k, e):
                raise
    res = decode_scaled_reference(buf, numel, fmt, block_size, dual)
    if accumulate_into is not None:
        return accumulate_into.add_(res)
    return res if out is None else out.copy_(res)


def _flag(finite):
    """A kernel's "every residual finite" answer as the caller gets it: the C++ kernels' bool, or the Triton
    kernels' 0-dim bool tensor left on the device (``bool()`` of it would be a host synchronisation per chunk of
    a collective; error feedback applies it on the device, megacomp.compression.error_feedback.drop_nonfinite)."""
    return finite if torch.is_tensor(finite) else bool(finite)


def ef_update_scaled(buf: torch.Tensor, h: torch.Tensor, e: Optional[torch.Tensor], e_out: torch.Tensor, fmt: Format,
                     block_size: int, dual: bool, beta: float) -> Optional[bool]:
    """Fused ``e_out = beta * e + (1 - beta) * (h - decode(buf))`` (``h - decode`` for beta 0, ``e`` None
    means no error yet); returns whether every residual was finite (a bool, or a 0-dim bool tensor on the device
    from the Triton kernels: see :func:`_flag`), or None when no kernel covers the case (then the caller runs the
    reference)."""
    k = _kernels(fmt, False, h) if fmt.kind != "sign" else None
    n = h.numel()
    width = n if block_size == 0 else block_size
    per = 8 // fmt.bits
    if k is None or h.dtype != torch.float32:
        return None
    if not _is_triton(k) and not (width % per == 0 or num_blocks(n, block_size) == 1):
        return None
    if e is not None and e.dtype != torch.float32:
        return None
    mode = 0 if beta == 0.0 else (1 if e is None else 2)
    try:
        return _flag(k.ef_update_into(buf.contiguous(), h.contiguous(), e if e is not None else h, e_out,
                                      _kind_code(fmt), fmt.bits, block_size, dual, float(beta), mode))
    except Exception as ex:
        if not _kernel_failed(k, ex):
            raise
        return None


def ef_encode_scaled(g: torch.Tensor, e: Optional[torch.Tensor], out: torch.Tensor, e_out: torch.Tensor, fmt: Format,
                     block_size: int, dual: bool, beta: float, key: Optional[torch.Tensor] = None) -> Optional[bool]:
    """One error-feedback step in one pass: ``out`` = encode(h) with ``h = g + e`` (``g`` if ``e`` is None),
    ``e_out`` (may be ``e``) = the new error from those bytes, as :func:`ef_update_scaled` (beta 0:
    ``h - decode``, no error yet: ``(1 - beta)(h - decode)``); bit-identical to the three steps. ``key``:
    stochastic rounding's counter_rng key (drawn by the caller, who reuses it if this returns None).
    Returns whether every residual was finite (as :func:`ef_update_scaled`), or None (nothing written) when no
    kernel covers the case:
    fp32 tensors, per-block scales on byte boundaries, more than one block, no dual scaling (Triton: blocks
    that fit one row tile), the C++ kernel on CPU, Triton on CUDA."""
    n = g.numel()
    if fmt.kind not in ("int", "float8") or dual or block_size == 0 or n <= block_size:
        return None
    bits = fmt.bits if fmt.kind == "int" else 8
    if block_size % (8 // bits) or g.dtype != torch.float32 or (e is not None and e.dtype != torch.float32):
        return None
    k = _kernels(fmt, key is not None, g)
    if k is None or not hasattr(k, "ef_encode_into"):
        return None
    if _is_triton(k) and not k.ef_encode_covers(n, _kind_code(fmt), fmt.bits, block_size):
        return None
    mode = 0 if beta == 0.0 else (1 if e is None else 2)
    try:
        return _flag(k.ef_encode_into(g.contiguous(), None if e is None else e.contiguous(), out, e_out,
                                      _kind_code(fmt), fmt.bits, float(fmt.qmax), block_size, float(beta), mode,
                                     key=key))
    except Exception as ex:
        if not _kernel_failed(k, ex):
            raise
        return None


def encode_scaled_reference(
    x32: torch.Tensor,
    fmt: Format,
    block_size: int,
    dual: bool,
    stochastic: bool,
    generator: Optional[torch.Generator],
    key: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Encode a flat fp32 tensor into the wire layout above; returns a 1-D uint8 tensor (eager reference).
    Stochastic rounding draws one counter_rng key from ``generator`` (or uses ``key``, already drawn)."""
    n = x32.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x32.device)
    u = None
    if stochastic:
        counter_rng.check_numel(n)
        u = counter_rng.uniforms(key if key is not None else counter_rng.draw_key(generator, x32.device), n)
    xb = _blocks(x32, block_size)
    absb = xb.abs()
    amax_b = absb.amax(dim=1, keepdim=True)  # propagates NaN and inf

    if fmt.kind == "sign":
        scale = canonical_nan(amax_b) if stochastic else _sign_mean_scale(absb, amax_b, n)
        if stochastic:
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            bits = u < ((1.0 + xb / safe) * 0.5).reshape(-1)[:n]
        else:
            bits = (xb >= 0).reshape(-1)[:n]
        codes = bits.to(torch.uint8)
        scale_bytes = scale.reshape(-1).contiguous().view(torch.uint8)
        return torch.cat([scale_bytes, pack_bits(codes, 1)])

    qmax = fmt.qmax
    if dual:
        amax = amax_b.amax()
        coarse = (amax / qmax).reshape(1)
        k = _dual_exponents(amax_b, amax)
        safe_coarse = torch.where(coarse > 0, coarse, torch.ones_like(coarse))
        # Only finite, positive coarse scales give finite codes; others decode non-finite via the scale.
        y = (xb * torch.exp2(k)) / safe_coarse
        scale_bytes = torch.cat([coarse.view(torch.uint8), k.reshape(-1).to(torch.uint8)])
    else:
        scale = amax_b / qmax
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = xb / safe
        scale_bytes = scale.reshape(-1).contiguous().view(torch.uint8)

    y = y.reshape(-1)[:n]
    if fmt.kind == "float8":
        y = torch.nan_to_num(y.clamp(-qmax, qmax), nan=0.0)
        codes = y.to(fmt.dtype).view(torch.uint8)
    else:  # int
        if stochastic:
            q = torch.floor(y + u)
        else:
            q = torch.round(y)
        q = torch.nan_to_num(q.clamp_(-qmax, qmax), nan=0.0)
        offset = 1 << (fmt.bits - 1)
        codes = (q + offset).to(torch.uint8)
        codes = pack_bits(codes, fmt.bits)
    return torch.cat([scale_bytes, codes])


def decode_scaled_reference(buf: torch.Tensor, numel: int, fmt: Format, block_size: int, dual: bool) -> torch.Tensor:
    """Decode the wire layout above into a flat fp32 tensor of ``numel`` elements (eager reference)."""
    if numel == 0:
        return torch.empty(0, dtype=torch.float32, device=buf.device)
    nb = num_blocks(numel, block_size)
    ns = scale_nbytes(numel, block_size, dual)
    payload = buf[ns:]
    if fmt.kind == "float8":
        vals = payload[:numel].view(fmt.dtype).to(torch.float32)
    else:
        codes = unpack_bits(payload, fmt.bits, numel)
        if fmt.kind == "sign":
            vals = codes.to(torch.float32) * 2.0 - 1.0
        else:
            vals = codes.to(torch.float32) - float(1 << (fmt.bits - 1))
    width = numel if block_size == 0 else block_size
    pad = nb * width - numel
    if pad:
        vals = torch.cat([vals, vals.new_zeros(pad)])
    vals = vals.view(nb, width)
    if dual:
        coarse = _as_f32(buf[:4])
        k = buf[4:4 + nb].to(torch.float32).view(nb, 1)
        out = (vals * coarse) * torch.exp2(-k)
    else:
        out = vals * _as_f32(buf[:ns]).view(nb, 1)
    return out.reshape(-1)[:numel]
