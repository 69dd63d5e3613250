// Fused CPU codec kernels for megacomp (int8/int4/int2 and float8 formats, per-tensor, per-block and dual
// scaling, round to nearest or stochastic) and the Python module (Tensor checks, bindings; the element-wise
// steps are in codec_quant.h, the sign codec in codec_sign.cpp, error feedback in codec_ef.cpp). Each kernel performs exactly the arithmetic of the eager reference in
// megacomp/compression/quantize.py, element by element, so results are bit-identical:
//   fp32 absmax per block (NaN-propagating), scale = amax / qmax, y = x / safe_scale (dual: (x * 2^k) /
//   safe_coarse), round half to even, clamp, NaN -> 0, offset codes; decode (code - offset) * scale (dual:
//   (v * coarse) * 2^-k), decode-accumulate out + decoded.
// Only the memory traffic differs: a block is read once while it sits in L1 (absmax, then quantize), the
// inner loops are plain element-wise loops the compiler vectorises, and blocks run in parallel
// (at::parallel_for). Block sizes that do not align with the packed bytes take a scalar path.
#include <torch/extension.h>
#include "codec_quant.h"
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace megacomp_cpu {
namespace {

// W > 0: the block size known at compile time (32, 128), so full blocks run loops of constant length
// (unrolled, no remainder code); W = 0: any block size. (More sizes cost build time: ~25 s each.)
template <int KIND, typename F8, int W>
void encode_impl_w(const float* x, const Layout& L, float qmax, uint8_t* out, const Uniforms* u) {
  const float offset = static_cast<float>(1 << (L.bits - 1));
  uint8_t* payload = out + L.scale_bytes;
  const bool aligned = L.width % L.per == 0 || L.nb == 1;
  if (!L.dual && aligned && L.nb > 1) {  // one pass: each block's absmax and codes while it is in cache
    at::parallel_for(0, L.nb, std::max<int64_t>(1, kGrain / L.width), [&](int64_t b0, int64_t b1) {
      std::vector<uint8_t> codes(L.width);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t start = b * L.width, len = std::min(L.width, L.n - start);
        auto block = [&](int64_t m) __attribute__((always_inline)) {
          const float scale = absmax(x + start, m) / qmax;
          std::memcpy(out + 4 * b, &scale, 4);
          const float div = scale > 0.f ? scale : 1.f;
          if (KIND == 0 && u)
            quantize_span<KIND, F8, false, true>(x + start, m, 1.f, div, qmax, offset, codes.data(), u, start);
          else
            quantize_span<KIND, F8, false>(x + start, m, 1.f, div, qmax, offset, codes.data());
          pack(codes.data(), m, L.bits, payload + start / L.per);
        };
        if (W && len == W) block(W);
        else block(len);
      }
    });
    return;
  }
  // two passes: all block scales first (dual needs the global maximum), then the codes
  std::vector<float> amax(L.nb);
  if (L.nb == 1) {  // one scale: reduce chunks in parallel (max is order-independent, so still exact)
    std::vector<float> part((L.n + kGrain - 1) / kGrain);
    at::parallel_for(0, (int64_t)part.size(), 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) part[c] = absmax(x + c * kGrain, std::min(kGrain, L.n - c * kGrain));
    });
    amax[0] = absmax(part.data(), (int64_t)part.size());  // |.| of non-negative values: same maximum
  } else {
    at::parallel_for(0, L.nb, std::max<int64_t>(8, kGrain / L.width), [&](int64_t b0, int64_t b1) {
      int64_t b = b0;
      if (W)  // groups of 8 full blocks
        for (; b + 8 <= b1 && (b + 8) * L.width <= L.n; b += 8) absmax8<W ? W : 8>(x + b * L.width, &amax[b]);
      for (; b < b1; ++b) {
        const int64_t len = std::min(L.width, L.n - b * L.width);
        amax[b] = W && len == W ? absmax(x + b * L.width, W) : absmax(x + b * L.width, len);
      }
    });
  }
  // scale bytes, every block in parallel; the code passes below read them back
  float safe_coarse = 1.f;
  if (L.dual) {
    const float a = absmax(amax.data(), L.nb);  // max of non-negative maxima (NaN if any is NaN)
    const float coarse = a / qmax;
    std::memcpy(out, &coarse, 4);
    safe_coarse = coarse > 0.f ? coarse : 1.f;
    at::parallel_for(0, L.nb, kGrain, [&](int64_t b0, int64_t b1) {
      const float* __restrict am = amax.data();
      uint8_t* __restrict ks = out + 4;
      const float top = a;  // a local copy: the loop vectorises
      for (int64_t b = b0; b < b1; ++b) ks[b] = dual_exponent(top, am[b]);
    });
  } else {
    at::parallel_for(0, L.nb, kGrain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float scale = amax[b] / qmax;
        std::memcpy(out + 4 * b, &scale, 4);
      }
    });
  }
  auto div_of = [&](int64_t b) {
    if (L.dual) return safe_coarse;
    float scale;
    std::memcpy(&scale, out + 4 * b, 4);
    return scale > 0.f ? scale : 1.f;
  };
  auto mult_of = [&](int64_t b) { return L.dual ? pow2(out[4 + b]) : 1.f; };  // torch.exp2(k): exact
  auto quantize = [&](const float* xs, int64_t len, int64_t b, uint8_t* codes) __attribute__((always_inline)) {
    if (KIND == 0 && u) {
      const int64_t i0 = xs - x;
      if (L.dual) quantize_span<KIND, F8, true, true>(xs, len, mult_of(b), div_of(b), qmax, offset, codes, u, i0);
      else quantize_span<KIND, F8, false, true>(xs, len, 1.f, div_of(b), qmax, offset, codes, u, i0);
    } else if (L.dual) {
      quantize_span<KIND, F8, true>(xs, len, mult_of(b), div_of(b), qmax, offset, codes);
    } else {
      quantize_span<KIND, F8, false>(xs, len, 1.f, div_of(b), qmax, offset, codes);
    }
  };
  if (aligned) {  // spans of whole blocks (or chunks of the single block): one pack per span
    const int64_t span = span_of(L);
    const int64_t spans = (L.n + span - 1) / span;
    at::parallel_for(0, spans, std::max<int64_t>(1, kGrain / span), [&](int64_t s0, int64_t s1) {
      std::vector<uint8_t> codes(span);
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t start = s * span, len = std::min(span, L.n - start);
        for (int64_t o = 0; o < len; o += L.width) {
          const int64_t m = std::min(len - o, L.width);
          if (W && m == W) quantize(x + start + o, W, (start + o) / L.width, codes.data() + o);
          else quantize(x + start + o, m, (start + o) / L.width, codes.data() + o);
        }
        pack(codes.data(), len, L.bits, payload + start / L.per);
      }
    });
    return;
  }
  // blocks that split packed bytes (e.g. block 7 with int4): element by element
  const int64_t nbytes = (L.n * L.bits + 7) / 8;
  at::parallel_for(0, nbytes, std::max<int64_t>(1, kGrain / L.per), [&](int64_t j0, int64_t j1) {
    uint8_t c[8];
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t first = j * L.per, len = std::min<int64_t>(L.per, L.n - first);
      for (int64_t s = 0; s < len; ++s) quantize(x + first + s, 1, (first + s) / L.width, c + s);
      pack(c, len, L.bits, payload + j);
    }
  });
}

// u: stochastic rounding's counter-based draws (int kinds), or null for round to nearest
template <int KIND, typename F8>
void encode_impl(const float* x, const Layout& L, float qmax, uint8_t* out, const Uniforms* u) {
  switch (L.nb > 1 ? L.width : 0) {
    case 32: return encode_impl_w<KIND, F8, 32>(x, L, qmax, out, u);
    case 128: return encode_impl_w<KIND, F8, 128>(x, L, qmax, out, u);  // the codecs' default block
    default: return encode_impl_w<KIND, F8, 0>(x, L, qmax, out, u);
  }
}

template <int KIND, typename F8>
void decode_impl(const uint8_t* buf, const Layout& L, float* out, bool accumulate) {
  const float offset = static_cast<float>(1 << (L.bits - 1));
  const uint8_t* payload = buf + L.scale_bytes;
  float coarse = 0.f;
  if (L.dual) std::memcpy(&coarse, buf, 4);
  auto block_scale = [&](int64_t b, float* scale, float* down) {
    if (L.dual) *down = std::ldexp(1.0f, -static_cast<int>(buf[4 + b]));
    else std::memcpy(scale, buf + 4 * b, 4);
  };
  const bool aligned = L.width % L.per == 0 || L.nb == 1;
  if (aligned) {  // spans of whole blocks (or chunks of the single block): one unpack per span
    const int64_t span = span_of(L);
    const int64_t spans = (L.n + span - 1) / span;
    at::parallel_for(0, spans, std::max<int64_t>(1, kGrain / span), [&](int64_t s0, int64_t s1) {
      std::vector<uint8_t> codes(span);
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t start = s * span, len = std::min(span, L.n - start);
        unpack(payload + start / L.per, len, L.bits, codes.data());
        for (int64_t o = 0; o < len; o += L.width) {  // each block of the span
          const int64_t blen = std::min(len - o, L.width);
          float scale = 0.f, down = 0.f;
          block_scale((start + o) / L.width, &scale, &down);
          dequantize_span<KIND, F8>(codes.data() + o, blen, scale, coarse, down, L.dual, offset, out + start + o,
                                    accumulate);
        }
      }
    });
    return;
  }
  at::parallel_for(0, L.n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float scale = 0.f, down = 0.f;
      block_scale(i / L.width, &scale, &down);
      const uint8_t code = (payload[i / L.per] >> ((i % L.per) * L.bits)) & ((1 << L.bits) - 1);
      dequantize_span<KIND, F8>(&code, 1, scale, coarse, down, L.dual, offset, out + i, accumulate);
    }
  });
}

bool ef_update_into(torch::Tensor buf, torch::Tensor h, torch::Tensor e, torch::Tensor e_out, int64_t kind,
                    int64_t bits, int64_t block, bool dual, double beta, int64_t mode) {
  TORCH_CHECK(buf.dtype() == torch::kUInt8 && buf.is_contiguous(), "buf: contiguous uint8");
  TORCH_CHECK(h.dtype() == torch::kFloat32 && h.is_contiguous() && e_out.dtype() == torch::kFloat32 &&
              e_out.is_contiguous() && e_out.numel() == h.numel(), "h, e_out: contiguous fp32 of one size");
  TORCH_CHECK(mode != 2 || (e.dtype() == torch::kFloat32 && e.is_contiguous() && e.numel() == h.numel()), "e");
  if (h.numel() == 0) return true;
  const Layout L(h.numel(), block, dual, kind == 0 ? (int)bits : 8);
  TORCH_CHECK(L.width % L.per == 0 || L.nb == 1, "blocks must start on a byte boundary");
  TORCH_CHECK(buf.numel() == L.scale_bytes + (L.n * L.bits + 7) / 8, "buf has the wrong size");
  const float* ep = mode == 2 ? e.data_ptr<float>() : nullptr;
  const float b = static_cast<float>(beta), omb = static_cast<float>(1.0 - beta);
  return ef_update(buf.data_ptr<uint8_t>(), L, (int)kind, h.data_ptr<float>(), ep, e_out.data_ptr<float>(), b, omb,
                   (int)mode);
}

// kind: 0 int, 1 float8 e4m3fn, 2 float8 e5m2
// key (int kinds, stochastic rounding): the call's counter_rng key, an int64 tensor of one element
inline c10::optional<Uniforms> uniforms_of(const c10::optional<torch::Tensor>& key, int64_t n) {
  if (!key.has_value()) return c10::nullopt;
  TORCH_CHECK(key->dtype() == torch::kInt64 && key->numel() == 1, "key: one int64 element");
  TORCH_CHECK(n < (int64_t(1) << 32), "stochastic rounding: at most 2^32 - 1 elements per call");
  return Uniforms(key->item<int64_t>());
}

void encode_into(torch::Tensor x, torch::Tensor out, int64_t kind, int64_t bits, double qmax, int64_t block, bool dual,
                 c10::optional<torch::Tensor> key) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(), "x: contiguous fp32 CPU");
  TORCH_CHECK(out.dtype() == torch::kUInt8 && out.is_contiguous(), "out: contiguous uint8");
  if (x.numel() == 0) return;
  const Layout L(x.numel(), block, dual, kind == 0 ? (int)bits : 8);
  TORCH_CHECK(out.numel() == L.scale_bytes + (L.n * L.bits + 7) / 8, "out has the wrong size");
  const c10::optional<Uniforms> u = uniforms_of(key, L.n);
  const Uniforms* up = u.has_value() && kind == 0 ? &*u : nullptr;
  const float* xp = x.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const float q = static_cast<float>(qmax);
  if (kind == 0) encode_impl<0, c10::Float8_e4m3fn>(xp, L, q, op, up);
  else if (kind == 1) encode_impl<1, c10::Float8_e4m3fn>(xp, L, q, op, nullptr);
  else encode_impl<1, c10::Float8_e5m2>(xp, L, q, op, nullptr);
}

// one error-feedback step in one pass (codec_ef.cpp): out = encode(g + e), e_out = the new error; e: the
// current error (None: none yet); mode as ef_update_into; key: stochastic rounding (int kinds). Per-block
// scales on byte boundaries, more than one block, no dual scaling (the Python dispatch checks).
bool ef_encode_into(torch::Tensor g, c10::optional<torch::Tensor> e, torch::Tensor out, torch::Tensor e_out, int64_t kind,
                    int64_t bits, double qmax, int64_t block, double beta, int64_t mode,
                    c10::optional<torch::Tensor> key) {
  TORCH_CHECK(g.dtype() == torch::kFloat32 && g.is_contiguous() && g.device().is_cpu(), "g: contiguous fp32 CPU");
  TORCH_CHECK(e_out.dtype() == torch::kFloat32 && e_out.is_contiguous() && e_out.numel() == g.numel(),
              "e_out: contiguous fp32 of g's size");
  TORCH_CHECK(!e.has_value() || (e->dtype() == torch::kFloat32 && e->is_contiguous() && e->numel() == g.numel()),
              "e: contiguous fp32 of g's size");
  TORCH_CHECK(mode != 2 || e.has_value(), "mode 2 needs e");
  TORCH_CHECK(out.dtype() == torch::kUInt8 && out.is_contiguous(), "out: contiguous uint8");
  if (g.numel() == 0) return true;
  const Layout L(g.numel(), block, false, kind == 0 ? (int)bits : 8);
  TORCH_CHECK(L.nb > 1 && L.width % L.per == 0, "ef_encode_into: per-block scales on byte boundaries, > 1 block");
  TORCH_CHECK(out.numel() == L.scale_bytes + (L.n * L.bits + 7) / 8, "out has the wrong size");
  const c10::optional<Uniforms> u = uniforms_of(key, L.n);
  return ef_encode(g.data_ptr<float>(), e.has_value() ? e->data_ptr<float>() : nullptr, L, (int)kind,
                   static_cast<float>(qmax), u.has_value() && kind == 0 ? &*u : nullptr, out.data_ptr<uint8_t>(),
                   e_out.data_ptr<float>(), static_cast<float>(beta), static_cast<float>(1.0 - beta), (int)mode);
}

void decode_into(torch::Tensor buf, torch::Tensor out, int64_t kind, int64_t bits, int64_t block, bool dual,
                 bool accumulate) {
  TORCH_CHECK(buf.dtype() == torch::kUInt8 && buf.is_contiguous(), "buf: contiguous uint8");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous(), "out: contiguous fp32");
  if (out.numel() == 0) return;
  const Layout L(out.numel(), block, dual, kind == 0 ? (int)bits : 8);
  TORCH_CHECK(buf.numel() == L.scale_bytes + (L.n * L.bits + 7) / 8, "buf has the wrong size");
  const uint8_t* bp = buf.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (kind == 0) decode_impl<0, c10::Float8_e4m3fn>(bp, L, op, accumulate);
  else if (kind == 1) decode_impl<1, c10::Float8_e4m3fn>(bp, L, op, accumulate);
  else decode_impl<1, c10::Float8_e5m2>(bp, L, op, accumulate);
}

void sign_encode_into(torch::Tensor x, torch::Tensor out, int64_t block, c10::optional<torch::Tensor> key) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(), "x: contiguous fp32 CPU");
  TORCH_CHECK(out.dtype() == torch::kUInt8 && out.is_contiguous(), "out: contiguous uint8");
  const int64_t n = x.numel();
  if (n == 0) return;
  const Layout L(n, block, false, 1);
  TORCH_CHECK(out.numel() == L.scale_bytes + (n + 7) / 8, "out has the wrong size");
  const c10::optional<Uniforms> u = uniforms_of(key, n);
  sign_encode(x.data_ptr<float>(), n, block, u.has_value() ? &*u : nullptr, out.data_ptr<uint8_t>());
}

void sign_decode_into(torch::Tensor buf, torch::Tensor out, int64_t block, bool accumulate) {
  TORCH_CHECK(buf.dtype() == torch::kUInt8 && buf.is_contiguous(), "buf: contiguous uint8");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous(), "out: contiguous fp32");
  const int64_t n = out.numel();
  if (n == 0) return;
  TORCH_CHECK(buf.numel() == Layout(n, block, false, 1).scale_bytes + (n + 7) / 8, "buf has the wrong size");
  sign_decode(buf.data_ptr<uint8_t>(), n, block, out.data_ptr<float>(), accumulate);
}

}  // namespace
}  // namespace megacomp_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode_into", &megacomp_cpu::encode_into, "fused scaled encode (bit-identical to the eager reference)", py::arg("x"),
        py::arg("out"), py::arg("kind"), py::arg("bits"), py::arg("qmax"), py::arg("block"), py::arg("dual"),
        py::arg("key") = py::none());
  m.def("f8_decode_arithmetic", [](int64_t kind) {
    return kind == 1 ? megacomp_cpu::f8_arith_exact<c10::Float8_e4m3fn>()
                     : megacomp_cpu::f8_arith_exact<c10::Float8_e5m2>();
  }, "whether the float8 decode uses integer arithmetic (it equals c10's table for all 256 codes)");
  m.def("sign_encode_into", &megacomp_cpu::sign_encode_into, "sign codec encode", py::arg("x"), py::arg("out"),
        py::arg("block"), py::arg("key") = py::none());
  m.def("sign_decode_into", &megacomp_cpu::sign_decode_into, "sign codec decode, optionally accumulating");
  m.attr("supports_stochastic") = true;
  m.attr("supports_sign") = true;
  m.def("decode_into", &megacomp_cpu::decode_into, "fused scaled decode, optionally accumulating into out");
  m.def("ef_update_into", &megacomp_cpu::ef_update_into, "fused error-feedback update from the encoded bytes");
  m.def("ef_encode_into", &megacomp_cpu::ef_encode_into, "error feedback: compensate, encode and update in one pass",
        py::arg("g"), py::arg("e"), py::arg("out"), py::arg("e_out"), py::arg("kind"), py::arg("bits"), py::arg("qmax"),
        py::arg("block"), py::arg("beta"), py::arg("mode"), py::arg("key") = py::none());
}
