"""Launchers for the Triton codec kernels (megacomp/kernels/triton/kernels.py): the same three entry points as the
C++ extension (``encode_into``, ``decode_into``, ``ef_update_into``), for fp32/bf16/fp16 inputs on the
device the tensors live on, each bit-identical to the eager reference run on that device.

This module imports without triton (``HAVE_TRITON`` is then False and ``backend()`` raises). The
production backend (``backend()``) compiles for CUDA; ``interpreted()`` loads a second copy of the kernels
under ``TRITON_INTERPRET=1`` that runs on CPU tensors (about 1 MB/s: tests on tiny inputs only). The
production dispatch never sends CPU tensors here.

Work split per call: the heavy element-wise passes run in Triton; the per-block scale metadata that the
reference computes with small torch ops on ``numel / block`` values (dual-scale exponents, ``exp2`` of
them, scales of blocks too large for one tile) is computed here with the very same torch ops on the same
device, so it is identical by construction. Where torch's CUDA and CPU arithmetic differ (``amax / qmax``
is a multiplication by the fp32 reciprocal on CUDA, a true division on CPU) the kernel follows the device.

Paths: blocks up to ``ROW_MAX`` elements that start on a byte boundary run as whole rows (scale and codes
in one pass, no index division); larger or unaligned blocks, dual scaling and one scale per tensor take a
block-maximum pass and then a flat pass (dual: a row pass where aligned).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import threading

import torch

try:
    import triton

    HAVE_TRITON = True
    IMPORT_ERROR = ""
except Exception as e:  # not installed, or broken: the dispatch uses the other backends
    triton = None
    HAVE_TRITON = False
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

ROW_MAX = 4096      # largest padded block handled as whole rows of one tile
TILE = 4096         # elements per program
SEG = 1 << 16       # elements per program of the block-maximum pass over large blocks
SEG_TILE = 1024
NUM_WARPS = 8
MAX_NUMEL = (1 << 31) - (1 << 20)  # int32 index arithmetic in the kernels
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_F8 = {1: torch.float8_e4m3fn, 2: torch.float8_e5m2}
_KERNELS_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.py")


class Unsupported(ValueError):
    """A case these kernels do not take (size, dtype, layout): the dispatch runs the reference for this call
    and keeps the Triton backend on (unlike a compile or launch failure)."""


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


class TritonCodecs:
    """The three codec entry points over one copy of the kernels (compiled, or interpreted)."""

    name = "triton"
    supports_stochastic = True
    supports_sign = True
    input_dtypes = INPUT_DTYPES

    def __init__(self, kmod, interpreted: bool):
        self.K = kmod
        self.interpreted = interpreted
        self.opts = {} if interpreted else {"enable_fp_fusion": False, "num_warps": NUM_WARPS}
        self._tables: dict = {}

    # -- helpers -----------------------------------------------------------------------------------
    @staticmethod
    def _layout(n: int, block: int, dual: bool, bits: int):
        width = n if block == 0 else block
        nb = -(-n // width)
        per = 8 // bits
        return width, nb, per, (4 + nb if dual else 4 * nb), (width % per == 0 or nb == 1)

    def _recip(self, device: torch.device) -> bool:
        return device.type == "cuda"  # the reference's amax / qmax: see the module docstring

    def _table(self, kind: int, device: torch.device) -> torch.Tensor:
        key = (kind, str(device))
        if key not in self._tables:
            self._tables[key] = torch.arange(256, dtype=torch.uint8, device=device).view(_F8[kind]).to(torch.float32)
        return self._tables[key]

    @staticmethod
    def _f32(buf: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """fp32 view of ``count`` floats at byte ``start`` of a uint8 tensor (a copy when misaligned)."""
        sl = buf[start:start + 4 * count]
        return sl.view(torch.float32) if sl.data_ptr() % 4 == 0 else sl.clone().view(torch.float32)

    def _rows_cfg(self, width: int, nb: int, per: int):
        bp2 = max(_next_pow2(width), per)
        r = max(1, min(TILE // bp2, _next_pow2(nb)))
        return bp2, r

    def _block_amax(self, x: torch.Tensor, n: int, width: int, nb: int) -> torch.Tensor:
        """Per-block max |x| (NaN-propagating), fp32 [nb]."""
        bp2 = _next_pow2(width)
        if bp2 <= ROW_MAX:
            _, r = self._rows_cfg(width, nb, 1)
            amax = torch.empty(nb, dtype=torch.float32, device=x.device)
            self.K.enc_rows[(triton.cdiv(nb, r),)](
                x, amax, x, x, x, x, n, width, nb, 1.0, 1.0, 0, R=r, W=bp2, P=1, BITS=8, KIND=0, STAGE=1,
                STOCH=False, RECIP=False, BF16=x.dtype == torch.int16, FULL=bp2 == width, **self.opts)
            return amax
        nseg = triton.cdiv(width, SEG)
        part = torch.empty(nb * nseg, dtype=torch.int32, device=x.device)
        self.K.amax_segments[(nb, nseg)](x, part, n, width, nseg, SEG, T=SEG_TILE, BF16=x.dtype == torch.int16,
                                         **self.opts)
        return part.view(nb, nseg).amax(dim=1).view(torch.float32)

    # -- entry points ------------------------------------------------------------------------------
    def encode_into(self, x: torch.Tensor, out: torch.Tensor, kind: int, bits: int, qmax: float, block: int,
                    dual: bool, key: torch.Tensor | None = None) -> None:
        """Encode flat ``x`` (fp32/bf16/fp16) into ``out`` (the wire layout of quantize.py).
        ``key``: stochastic rounding's counter_rng key (int kinds), an int64 tensor of one element on x's device."""
        from ..scales import dual_exponents as _dual_exponents

        n = x.numel()
        if x.dtype not in INPUT_DTYPES or not x.is_contiguous() or n > MAX_NUMEL:
            raise Unsupported(f"triton encode: contiguous fp32/bf16/fp16 up to {MAX_NUMEL} elements, got {x.dtype}")
        if n == 0:
            return
        bits = bits if kind == 0 else 8
        width, nb, per, ns, aligned = self._layout(n, block, dual, bits)
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != ns + (n * bits + 7) // 8:
            raise Unsupported("triton encode: out must be a contiguous uint8 buffer of the wire size")
        bf16 = x.dtype == torch.bfloat16
        x = x.view(-1).view(torch.int16) if bf16 else x.view(-1)  # bf16 widened in the kernel by a shift
        pay = out[ns:]
        stoch = key is not None and kind == 0
        if stoch and (key.dtype != torch.int64 or key.numel() != 1 or key.device != x.device):
            raise Unsupported("triton encode: key must be one int64 element on the input's device")
        uu = key if stoch else x
        offset = 1 << (bits - 1)
        inv_q = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(qmax, dtype=torch.float32))
        bp2, r = self._rows_cfg(width, nb, per)
        common = dict(BITS=bits, KIND=kind, STOCH=stoch, BF16=bf16, **self.opts)
        if not dual and aligned and bp2 <= ROW_MAX:  # one pass: scales and codes
            scale = self._f32(out, 0, nb)
            self.K.enc_rows[(triton.cdiv(nb, r),)](
                x, scale, x, x, uu, pay, n, width, nb, float(qmax), inv_q, offset, R=r, W=bp2, P=per, STAGE=0,
                RECIP=self._recip(x.device), FULL=bp2 == width, **common)
            if scale.data_ptr() != out.data_ptr():
                out[:4 * nb].copy_(scale.view(torch.uint8))
            return
        amax_b = self._block_amax(x, n, width, nb).view(nb, 1)
        if dual:  # the reference's own torch ops on the block maxima
            amax = amax_b.amax()
            coarse = (amax / qmax).reshape(1)
            k = _dual_exponents(amax_b, amax)
            mult = torch.exp2(k).reshape(-1)
            div = torch.where(coarse > 0, coarse, torch.ones_like(coarse)).expand(nb).contiguous()
            out[:4].copy_(coarse.view(torch.uint8))
            out[4:4 + nb].copy_(k.reshape(-1).to(torch.uint8))
        else:
            scale = (amax_b / qmax).reshape(-1)
            out[:4 * nb].copy_(scale.view(torch.uint8))
            div = torch.where(scale > 0, scale, torch.ones_like(scale))
            mult = div
        if dual and aligned and bp2 <= ROW_MAX:
            self.K.enc_rows[(triton.cdiv(nb, r),)](
                x, x, mult, div, uu, pay, n, width, nb, float(qmax), inv_q, offset, R=r, W=bp2, P=per, STAGE=2,
                RECIP=False, FULL=bp2 == width, **common)
            return
        t = TILE // per
        nbytes = (n * bits + 7) // 8
        self.K.enc_flat[(triton.cdiv(nbytes, t),)](
            x, mult, div, uu, pay, n, width, float(qmax), offset, T=t, P=per, DUAL=dual, ONE=nb == 1, **common)

    def _decode(self, buf, out, kind, bits, block, dual, epi, h=None, e=None, beta=0.0):
        n = out.numel()
        if n == 0:
            return None
        if n > MAX_NUMEL or not out.is_contiguous():
            raise Unsupported("triton decode: contiguous output up to MAX_NUMEL elements")
        bits = bits if kind in (0, 3) else 8
        width, nb, per, ns, aligned = self._layout(n, block, dual, bits)
        if buf.dtype != torch.uint8 or buf.numel() != ns + (n * bits + 7) // 8:
            raise Unsupported("triton decode: buf must be a uint8 buffer of the wire size")
        buf = buf.contiguous()
        pay = buf[ns:]
        if dual:
            coarse = self._f32(buf, 0, 1)
            down = torch.exp2(-buf[4:4 + nb].to(torch.float32))  # the reference's torch.exp2(-k)
            scale = coarse
        else:
            scale = self._f32(buf, 0, nb)
            coarse = down = scale
        table = self._table(kind, buf.device) if kind in _F8 else scale
        offset = 1 << (bits - 1)
        hh = h if h is not None else out
        ee = e if e is not None else out
        omb = 1.0 - beta
        bp2, r = self._rows_cfg(width, nb, per)
        common = dict(P=per, BITS=bits, KIND=kind, DUAL=dual, EPI=epi, **self.opts)
        if aligned and bp2 <= ROW_MAX:
            grid = triton.cdiv(nb, r)
            flags = torch.zeros(grid, dtype=torch.int8, device=buf.device) if epi >= 2 else None
            self.K.dec_rows[(grid,)](pay, scale, down, table, out, hh, ee, pay if flags is None else flags, n, width,
                                     nb, offset, coarse, float(beta), omb, R=r, W=bp2, FULL=bp2 == width, **common)
        else:
            t = TILE // per
            grid = triton.cdiv((n * bits + 7) // 8, t)
            flags = torch.zeros(grid, dtype=torch.int8, device=buf.device) if epi >= 2 else None
            self.K.dec_flat[(grid,)](pay, scale, down, table, out, hh, ee, pay if flags is None else flags, n, width,
                                     offset, coarse, float(beta), omb, T=t, ONE=nb == 1, **common)
        return flags

    def decode_into(self, buf: torch.Tensor, out: torch.Tensor, kind: int, bits: int, block: int, dual: bool,
                    accumulate: bool) -> None:
        """Decode into ``out`` (fp32, or bf16/fp16: rounded like ``.to(dtype)``), or add into fp32 ``out``."""
        if out.dtype not in INPUT_DTYPES or (accumulate and out.dtype != torch.float32):
            raise Unsupported(f"triton decode: output fp32/bf16/fp16 (accumulate: fp32), got {out.dtype}")
        out = out.view(-1)
        self._decode(buf, out.view(torch.int16) if out.dtype == torch.bfloat16 else out, kind, bits, block, dual,
                     1 if accumulate else 0)

    def sign_encode_into(self, x: torch.Tensor, out: torch.Tensor, block: int, key: torch.Tensor | None = None) -> None:
        """The sign codec (the C++ entry point's signature). Nearest: bits and exact block sums in Triton, the
        scale formula on the sums with the reference's torch ops (../scales.py: sign_scale_from_sums). Stochastic
        (``key``: the call's counter_rng key): block maxima, then the bits from the counter-based draws."""
        from ..scales import canonical_nan, sign_scale_exponents, sign_scale_from_sums

        n = x.numel()
        if x.dtype not in INPUT_DTYPES or not x.is_contiguous() or n > MAX_NUMEL:
            raise Unsupported(f"triton encode: contiguous fp32/bf16/fp16 up to {MAX_NUMEL} elements, got {x.dtype}")
        if n == 0:
            return
        width, nb, per, ns, aligned = self._layout(n, block, False, 1)
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != ns + (n + 7) // 8:
            raise Unsupported("triton encode: out must be a contiguous uint8 buffer of the wire size")
        bf16 = x.dtype == torch.bfloat16
        x = x.view(-1).view(torch.int16) if bf16 else x.view(-1)
        pay = out[ns:]
        if key is not None:  # stochastic: scale = amax_b, then the bits with the counter-based draws
            if key.dtype != torch.int64 or key.numel() != 1 or key.device != x.device:
                raise Unsupported("triton encode: key must be one int64 element on the input's device")
            amax_b = canonical_nan(self._block_amax(x, n, width, nb))  # the reference's NaN on this device
            out[:4 * nb].copy_(amax_b.view(torch.uint8))
            div = torch.where(amax_b > 0, amax_b, torch.ones_like(amax_b))
            t = TILE // 8
            self.K.enc_flat[(triton.cdiv((n + 7) // 8, t),)](
                x, div, div, key, pay, n, width, 1.0, 0, T=t, P=8, BITS=1, KIND=3, DUAL=False, ONE=nb == 1,
                STOCH=True, BF16=bf16, **self.opts)
            return
        bp2, r = self._rows_cfg(width, nb, per)
        if nb > 1 and width % 8 == 0 and bp2 <= ROW_MAX:  # one pass: maxima, sums and bits
            amax = torch.empty(nb, dtype=torch.float32, device=x.device)
            total = torch.empty(nb, dtype=torch.int64, device=x.device)
            self.K.sign_rows[(triton.cdiv(nb, r),)](x, amax, total, pay, n, width, nb, R=r, W=bp2,
                                                    FULL=bp2 == width, BF16=bf16, **self.opts)
            amax_b = amax.view(nb, 1)
            ok, k = sign_scale_exponents(amax_b)
            total = total.view(nb, 1)
        else:  # block maxima, then sums per segment (and the bits where blocks start on byte boundaries)
            amax_b = self._block_amax(x, n, width, nb).view(nb, 1)
            ok, k = sign_scale_exponents(amax_b)
            k1 = torch.div(k, 2, rounding_mode="floor")
            f1 = torch.where(ok, ((k1 + 127) << 23).to(torch.int32).view(torch.float32), 0.0).reshape(-1)
            f2 = (((k - k1) + 127) << 23).to(torch.int32).view(torch.float32).reshape(-1)
            t = min(SEG_TILE, max(8, _next_pow2(width)))  # small blocks: small tiles, one segment each
            seg = SEG if width > SEG else t * triton.cdiv(width, t)
            nseg = triton.cdiv(width, seg)
            part = torch.empty(nb * nseg, dtype=torch.int64, device=x.device)
            self.K.sign_segments[(nb, nseg)](x, f1, f2, part, pay, n, width, nseg, seg, T=t,
                                             BITS_OUT=aligned, BF16=bf16, **self.opts)
            total = part.view(nb, nseg).sum(dim=1, keepdim=True)
            if not aligned:
                t = TILE // 8
                self.K.sign_bits[(triton.cdiv((n + 7) // 8, t),)](x, pay, n, T=t, BF16=bf16, **self.opts)
        scale = sign_scale_from_sums(total, k, ok, amax_b, n, width)
        out[:4 * nb].copy_(scale.reshape(-1).view(torch.uint8))

    def sign_decode_into(self, buf: torch.Tensor, out: torch.Tensor, block: int, accumulate: bool) -> None:
        """The sign codec's decode (the C++ entry point's signature): (2 bit - 1) * scale, or added into out."""
        self.decode_into(buf, out, 3, 1, block, False, accumulate)

    def ef_encode_covers(self, n: int, kind: int, bits: int, block: int) -> bool:
        """Whether :meth:`ef_encode_into` takes this case (the dispatch asks first and otherwise runs the
        three steps, with the same stochastic key)."""
        bits = bits if kind == 0 else 8
        width, nb, per, _, _ = self._layout(n, block, False, bits)
        return 0 < n <= MAX_NUMEL and block > 0 and nb > 1 and width % per == 0 and \
            self._rows_cfg(width, nb, per)[0] <= ROW_MAX

    def ef_encode_into(self, g, e, out, e_out, kind, bits, qmax, block, beta, mode, key=None) -> bool:
        """One error-feedback step in one pass (the C++ entry point's signature): ``out`` = encode(g + e) (``g``
        if ``e`` is None), ``e_out`` = the new error from those codes (mode 0/1/2 as ef_update_into; may be
        ``e``); returns whether every residual was finite (a 0-dim bool tensor on the device, never read back here).
        Per-block scales that fit one row tile."""
        n = g.numel()
        if not self.ef_encode_covers(n, kind, bits, block):
            raise Unsupported("triton ef encode: per-block scales on byte boundaries, > 1 block, one row tile")
        for t in (g, e_out) + ((e,) if e is not None else ()):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n:
                raise Unsupported("triton ef encode: contiguous fp32 tensors of one size")
        if mode == 2 and e is None:
            raise Unsupported("triton ef encode: mode 2 needs e")
        stoch = key is not None and kind == 0
        if stoch and (key.dtype != torch.int64 or key.numel() != 1 or key.device != g.device):
            raise Unsupported("triton encode: key must be one int64 element on the input's device")
        bits = bits if kind == 0 else 8
        width, nb, per, ns, _ = self._layout(n, block, False, bits)
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != ns + (n * bits + 7) // 8:
            raise Unsupported("triton encode: out must be a contiguous uint8 buffer of the wire size")
        bp2, r = self._rows_cfg(width, nb, per)
        scale = self._f32(out, 0, nb)
        grid = triton.cdiv(nb, r)
        flags = torch.zeros(grid, dtype=torch.int8, device=g.device)
        table = self._table(kind, g.device) if kind in _F8 else g
        inv_q = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(qmax, dtype=torch.float32))
        ee = e if e is not None else g
        self.K.ef_rows[(grid,)](
            g.view(-1), ee.view(-1), scale, key if stoch else g, out[ns:], e_out.view(-1), flags, table, n, width, nb,
            float(qmax), inv_q, 1 << (bits - 1), float(beta), 1.0 - float(beta), R=r, W=bp2, P=per, BITS=bits,
            KIND=kind, STOCH=stoch, RECIP=self._recip(g.device), HAS_E=e is not None, EPI=2 + int(mode),
            FULL=bp2 == width, **self.opts)
        if scale.data_ptr() != out.data_ptr():
            out[:4 * nb].copy_(scale.view(torch.uint8))
        return flags.any().logical_not()  # on the device: reading it back would stop the host (zero_unless uses it)

    def ef_update_into(self, buf, h, e, e_out, kind, bits, block, dual, beta, mode) -> bool:
        """e_out = (h - d) | (1-beta)(h - d) | beta e + (1-beta)(h - d) for mode 0/1/2, d = decode(buf);
        returns whether every residual h - d was finite, as a 0-dim bool tensor on the device (never read back)."""
        for t in (h, e_out) + ((e,) if mode == 2 else ()):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != h.numel():
                raise Unsupported("triton ef update: contiguous fp32 tensors of one size")
        flags = self._decode(buf, e_out.view(-1), kind, bits, block, dual, 2 + mode, h.view(-1),
                             e.view(-1) if mode == 2 else None, beta)
        return True if flags is None else flags.any().logical_not()

    def zero_unless(self, e: torch.Tensor, ok: torch.Tensor) -> None:
        """``e`` (contiguous fp32) zeroed in place when the 0-dim bool ``ok`` on its device is False, decided on the
        device: error feedback drops a non-finite error without reading the flag back (no host synchronisation)."""
        if e.dtype != torch.float32 or not e.is_contiguous() or ok.numel() != 1 or ok.device != e.device:
            raise Unsupported("triton zero_unless: a contiguous fp32 tensor and a one-element flag on its device")
        n = e.numel()
        if n == 0:
            return
        nprog = min(triton.cdiv(n, TILE), 1024)
        self.K.zero_unless[(nprog,)](e.view(-1), ok.reshape(1).to(torch.uint8), n, nprog, T=TILE, **self.opts)


_lock = threading.Lock()
_backends: dict = {}


def _load_kernels(interpret: bool):
    """kernels.py as a module; the interpreted copy is a separate module object decorated under
    TRITON_INTERPRET=1 (triton.jit decides at decoration time)."""
    if not interpret:
        from . import kernels
        return kernels
    name = "megacomp.kernels.triton._kernels_interpreted"
    if name in sys.modules:
        return sys.modules[name]
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location(name, _KERNELS_PY)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    sys.modules[name] = mod
    return mod


def _get(interpret: bool) -> TritonCodecs:
    if not HAVE_TRITON:
        raise RuntimeError(f"triton is not available ({IMPORT_ERROR})")
    with _lock:
        if interpret not in _backends:
            _backends[interpret] = TritonCodecs(_load_kernels(interpret), interpreted=interpret)
        return _backends[interpret]


def backend() -> TritonCodecs:
    """The compiled kernels (kernels compile on first launch per configuration and are cached by triton).
    With TRITON_INTERPRET=1 in the environment triton interprets them (then CPU tensors work too)."""
    return _get(bool(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")))


def interpreted() -> TritonCodecs:
    """The kernels under the triton interpreter: launchable on CPU tensors (tests, tiny inputs)."""
    return _get(True)
