// Fused CPU codec kernels for megacomp (int8/int4/int2 and float8 formats, per-tensor, per-block and dual
// scaling, round to nearest). Each kernel performs exactly the arithmetic of the eager reference in
// megacomp/compression/quantize.py, element by element, so results are bit-identical:
//   fp32 absmax per block (NaN-propagating), scale = amax / qmax, y = x / safe_scale (dual: (x * 2^k) /
//   safe_coarse), round half to even, clamp, NaN -> 0, offset codes; decode (code - offset) * scale (dual:
//   (v * coarse) * 2^-k), decode-accumulate out + decoded.
// Only the memory traffic differs: a block is read once while it sits in L1 (absmax, then quantize), the
// inner loops are plain element-wise loops the compiler vectorises, and blocks run in parallel
// (at::parallel_for). Block sizes that do not align with the packed bytes take a scalar path.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per parallel task

// absmax with NaN propagation (torch.amax propagates NaN; inf is an ordinary maximum)
// (8 independent lanes so the compiler can keep them in one vector register)
inline float absmax(const float* x, int64_t n) {
  float m[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int nan[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t full = n - n % 8;
  for (int64_t i = 0; i < full; i += 8) {
    for (int l = 0; l < 8; ++l) {
      const float a = std::fabs(x[i + l]);
      nan[l] |= (a != a);
      m[l] = a > m[l] ? a : m[l];
    }
  }
  float r = 0.f;
  int any_nan = 0;
  for (int l = 0; l < 8; ++l) { any_nan |= nan[l]; r = m[l] > r ? m[l] : r; }
  for (int64_t i = full; i < n; ++i) {
    const float a = std::fabs(x[i]);
    any_nan |= (a != a);
    r = a > r ? a : r;
  }
  return any_nan ? NAN : r;
}

// fp32 -> float8 bits, round to nearest even: the same integer arithmetic as c10's
// fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value, written with selects instead of branches so the
// quantize loop vectorises. Callers pass finite values already clamped to the format's range.
template <typename F8>
inline uint8_t f8_bits(float f);

template <>
inline uint8_t f8_bits<c10::Float8_e4m3fn>(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = b & 0x80000000u;
  b ^= sign;
  float fa;
  std::memcpy(&fa, &b, 4);
  const float dn = fa + 16384.0f;  // fp32_from_bits(141 << 23): aligns subnormals to the fp8 grid
  uint32_t dnb;
  std::memcpy(&dnb, &dn, 4);
  const uint32_t den = dnb - (141u << 23);
  const uint32_t norm = (b + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;
  const uint32_t r = b >= (1087u << 20) ? 0x7Fu : (b < (121u << 23) ? den : norm);
  return static_cast<uint8_t>(r | (sign >> 24));
}

template <>
inline uint8_t f8_bits<c10::Float8_e5m2>(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = b & 0x80000000u;
  b ^= sign;
  float fa;
  std::memcpy(&fa, &b, 4);
  const float dn = fa + 128.0f;  // fp32_from_bits(134 << 23)
  uint32_t dnb;
  std::memcpy(&dnb, &dn, 4);
  const uint32_t den = dnb - (134u << 23);
  const uint32_t norm = (b + (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFFu + ((b >> 21) & 1u)) >> 21;
  const uint32_t big = b > (255u << 23) ? 0x7Fu : 0x7Cu;
  const uint32_t r = b >= (143u << 23) ? big : (b < (113u << 23) ? den : norm);
  return static_cast<uint8_t>(r | (sign >> 24));
}

// float8 bits -> fp32 through a 256-entry table built with c10's own conversion (exact)
template <typename F8>
const float* f8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) {
      F8 v;
      const uint8_t c = static_cast<uint8_t>(i);
      std::memcpy(&v, &c, 1);
      t[i] = static_cast<float>(v);
    }
    return t;
  }();
  return table.data();
}

// codes[i] for y_i = (x_i * mult) / div, the reference's op sequence; KIND 0 = int, 1 = float8
template <int KIND, typename F8, bool DUAL>
void quantize_span(const float* x, int64_t n, float mult, float div, float qmax, float offset, uint8_t* codes) {
  if (KIND == 0) {
    for (int64_t i = 0; i < n; ++i) {
      const float y = DUAL ? (x[i] * mult) / div : x[i] / div;
      float q = std::nearbyint(y);                    // torch.round: half to even
      q = q < -qmax ? -qmax : (q > qmax ? qmax : q);  // clamp_ (NaN passes through)
      q = (q != q) ? 0.f : q;                         // nan_to_num
      codes[i] = static_cast<uint8_t>(static_cast<int>(q + offset));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float y = DUAL ? (x[i] * mult) / div : x[i] / div;
      float c = y < -qmax ? -qmax : (y > qmax ? qmax : y);
      c = (c != c) ? 0.f : c;
      codes[i] = f8_bits<F8>(c);
    }
  }
}

inline void pack(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, codes, n);
    return;
  }
  const int per = 8 / bits;
  const int64_t full = n / per;
  if (bits == 4) {
    for (int64_t j = 0; j < full; ++j) out[j] = codes[2 * j] | (codes[2 * j + 1] << 4);
  } else if (bits == 2) {
    for (int64_t j = 0; j < full; ++j)
      out[j] = codes[4 * j] | (codes[4 * j + 1] << 2) | (codes[4 * j + 2] << 4) | (codes[4 * j + 3] << 6);
  }
  if (n % per) {
    uint32_t b = 0;
    for (int64_t i = full * per; i < n; ++i) b |= static_cast<uint32_t>(codes[i]) << ((i - full * per) * bits);
    out[full] = static_cast<uint8_t>(b);
  }
}

inline void unpack(const uint8_t* in, int64_t n, int bits, uint8_t* codes) {
  if (bits == 8) {
    std::memcpy(codes, in, n);
    return;
  }
  const int per = 8 / bits, mask = (1 << bits) - 1;
  const int64_t full = n / per;
  if (bits == 4) {
    for (int64_t j = 0; j < full; ++j) { codes[2 * j] = in[j] & 15; codes[2 * j + 1] = in[j] >> 4; }
  } else if (bits == 2) {
    for (int64_t j = 0; j < full; ++j) {
      codes[4 * j] = in[j] & 3; codes[4 * j + 1] = (in[j] >> 2) & 3;
      codes[4 * j + 2] = (in[j] >> 4) & 3; codes[4 * j + 3] = in[j] >> 6;
    }
  }
  for (int64_t i = full * per; i < n; ++i) codes[i] = (in[i / per] >> ((i % per) * bits)) & mask;
}

template <int KIND, typename F8>
inline void dequantize_span(const uint8_t* codes, int64_t n, float scale, float coarse, float down, bool dual,
                            float offset, float* out, bool accumulate) {
  const float* table = KIND == 0 ? nullptr : f8_table<F8>();
  for (int64_t i = 0; i < n; ++i) {
    const float v = KIND == 0 ? static_cast<float>(codes[i]) - offset : table[codes[i]];
    const float r = dual ? (v * coarse) * down : v * scale;
    out[i] = accumulate ? out[i] + r : r;
  }
}

struct Layout {
  int64_t n, width, nb, scale_bytes;
  int bits, per;
  bool dual;
  Layout(int64_t n_, int64_t block, bool dual_, int bits_) : n(n_), bits(bits_), dual(dual_) {
    width = block == 0 ? n : block;
    nb = (n + width - 1) / width;
    per = 8 / bits;
    scale_bytes = dual ? 4 + nb : 4 * nb;
  }
};

// dual scale: coarse = max(amax_b) / qmax and k_b = clamp(floor(log2(max / amax_b)), 0, 126) (via frexp)
inline float dual_scales(const std::vector<float>& amax, float qmax, uint8_t* out, std::vector<int>& k) {
  float a = 0.f;
  int nan = 0;
  for (float v : amax) { nan |= (v != v); a = v > a ? v : a; }
  if (nan) a = NAN;
  const float coarse = a / qmax;
  std::memcpy(out, &coarse, 4);
  for (size_t b = 0; b < amax.size(); ++b) {
    const float ratio = a / amax[b];
    int kb = 126;
    if (std::isfinite(ratio)) {
      int e;
      std::frexp(ratio, &e);
      kb = std::min(std::max(e - 1, 0), 126);
    }
    k[b] = kb;
    out[4 + b] = static_cast<uint8_t>(kb);
  }
  return coarse;
}

template <int KIND, typename F8>
void encode_impl(const float* x, const Layout& L, float qmax, uint8_t* out) {
  const float offset = static_cast<float>(1 << (L.bits - 1));
  uint8_t* payload = out + L.scale_bytes;
  const bool aligned = L.width % L.per == 0 || L.nb == 1;
  if (!L.dual && aligned && L.nb > 1) {  // one pass: each block's absmax and codes while it is in cache
    at::parallel_for(0, L.nb, std::max<int64_t>(1, kGrain / L.width), [&](int64_t b0, int64_t b1) {
      std::vector<uint8_t> codes(L.width);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t start = b * L.width, len = std::min(L.width, L.n - start);
        const float scale = absmax(x + start, len) / qmax;
        std::memcpy(out + 4 * b, &scale, 4);
        quantize_span<KIND, F8, false>(x + start, len, 1.f, scale > 0.f ? scale : 1.f, qmax, offset, codes.data());
        pack(codes.data(), len, L.bits, payload + start / L.per);
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
    at::parallel_for(0, L.nb, std::max<int64_t>(1, kGrain / L.width), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) amax[b] = absmax(x + b * L.width, std::min(L.width, L.n - b * L.width));
    });
  }
  std::vector<float> mult(L.nb, 1.f), div(L.nb);
  if (L.dual) {
    std::vector<int> k(L.nb);
    const float coarse = dual_scales(amax, qmax, out, k);
    const float safe = coarse > 0.f ? coarse : 1.f;
    for (int64_t b = 0; b < L.nb; ++b) { mult[b] = std::ldexp(1.0f, k[b]); div[b] = safe; }
  } else {
    for (int64_t b = 0; b < L.nb; ++b) {
      const float scale = amax[b] / qmax;
      std::memcpy(out + 4 * b, &scale, 4);
      div[b] = scale > 0.f ? scale : 1.f;
    }
  }
  if (aligned) {  // spans that start on a byte boundary: a block, or a chunk of the single block
    const int64_t span = L.nb == 1 ? std::max<int64_t>(L.per, kGrain - kGrain % L.per) : L.width;
    const int64_t spans = (L.n + span - 1) / span;
    at::parallel_for(0, spans, std::max<int64_t>(1, kGrain / span), [&](int64_t s0, int64_t s1) {
      std::vector<uint8_t> codes(span);
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t start = s * span, len = std::min(span, L.n - start), b = start / L.width;
        if (L.dual) quantize_span<KIND, F8, true>(x + start, len, mult[b], div[b], qmax, offset, codes.data());
        else quantize_span<KIND, F8, false>(x + start, len, 1.f, div[b], qmax, offset, codes.data());
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
      for (int64_t s = 0; s < len; ++s) {
        const int64_t b = (first + s) / L.width;
        if (L.dual) quantize_span<KIND, F8, true>(x + first + s, 1, mult[b], div[b], qmax, offset, c + s);
        else quantize_span<KIND, F8, false>(x + first + s, 1, 1.f, div[b], qmax, offset, c + s);
      }
      pack(c, len, L.bits, payload + j);
    }
  });
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
  if (aligned) {
    const int64_t span = L.nb == 1 ? std::max<int64_t>(L.per, kGrain - kGrain % L.per) : L.width;
    const int64_t spans = (L.n + span - 1) / span;
    at::parallel_for(0, spans, std::max<int64_t>(1, kGrain / span), [&](int64_t s0, int64_t s1) {
      std::vector<uint8_t> codes(span);
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t start = s * span, len = std::min(span, L.n - start), b = start / L.width;
        float scale = 0.f, down = 0.f;
        block_scale(b, &scale, &down);
        unpack(payload + start / L.per, len, L.bits, codes.data());
        dequantize_span<KIND, F8>(codes.data(), len, scale, coarse, down, L.dual, offset, out + start, accumulate);
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

// Error-feedback update from the encoded bytes, in one pass per span: h_hat = decode(buf) and
// mode 0: e_out = h - h_hat;  mode 1: e_out = (1 - beta) * (h - h_hat);  mode 2: e_out = beta * e + (1 - beta) * (h - h_hat)
// (the reference's expressions and order). Returns false if any residual h - h_hat is not finite.
template <int KIND, typename F8>
bool ef_update_impl(const uint8_t* buf, const Layout& L, const float* h, const float* e, float* e_out, float beta,
                    float one_minus_beta, int mode) {
  const float offset = static_cast<float>(1 << (L.bits - 1));
  const uint8_t* payload = buf + L.scale_bytes;
  float coarse = 0.f;
  if (L.dual) std::memcpy(&coarse, buf, 4);
  const int64_t span = L.nb == 1 ? std::max<int64_t>(L.per, kGrain - kGrain % L.per) : L.width;
  const int64_t spans = (L.n + span - 1) / span;
  std::vector<char> bad(spans, 0);
  at::parallel_for(0, spans, std::max<int64_t>(1, kGrain / span), [&](int64_t s0, int64_t s1) {
    std::vector<uint8_t> codes(span);
    std::vector<float> hat(span);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t start = s * span, len = std::min(span, L.n - start), b = start / L.width;
      float scale = 0.f, down = 0.f;
      if (L.dual) down = std::ldexp(1.0f, -static_cast<int>(buf[4 + b]));
      else std::memcpy(&scale, buf + 4 * b, 4);
      unpack(payload + start / L.per, len, L.bits, codes.data());
      dequantize_span<KIND, F8>(codes.data(), len, scale, coarse, down, L.dual, offset, hat.data(), false);
      int nonfinite = 0;
      for (int64_t i = 0; i < len; ++i) {
        const float r = h[start + i] - hat[i];
        nonfinite |= !std::isfinite(r);
        e_out[start + i] = mode == 0 ? r : (mode == 1 ? one_minus_beta * r : beta * e[start + i] + one_minus_beta * r);
      }
      bad[s] = static_cast<char>(nonfinite);
    }
  });
  for (char c : bad) if (c) return false;
  return true;
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
  const uint8_t* bp = buf.data_ptr<uint8_t>();
  if (kind == 0) return ef_update_impl<0, c10::Float8_e4m3fn>(bp, L, h.data_ptr<float>(), ep, e_out.data_ptr<float>(), b, omb, (int)mode);
  if (kind == 1) return ef_update_impl<1, c10::Float8_e4m3fn>(bp, L, h.data_ptr<float>(), ep, e_out.data_ptr<float>(), b, omb, (int)mode);
  return ef_update_impl<1, c10::Float8_e5m2>(bp, L, h.data_ptr<float>(), ep, e_out.data_ptr<float>(), b, omb, (int)mode);
}

// kind: 0 int, 1 float8 e4m3fn, 2 float8 e5m2
void encode_into(torch::Tensor x, torch::Tensor out, int64_t kind, int64_t bits, double qmax, int64_t block, bool dual) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(), "x: contiguous fp32 CPU");
  TORCH_CHECK(out.dtype() == torch::kUInt8 && out.is_contiguous(), "out: contiguous uint8");
  if (x.numel() == 0) return;
  const Layout L(x.numel(), block, dual, kind == 0 ? (int)bits : 8);
  TORCH_CHECK(out.numel() == L.scale_bytes + (L.n * L.bits + 7) / 8, "out has the wrong size");
  const float* xp = x.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const float q = static_cast<float>(qmax);
  if (kind == 0) encode_impl<0, c10::Float8_e4m3fn>(xp, L, q, op);
  else if (kind == 1) encode_impl<1, c10::Float8_e4m3fn>(xp, L, q, op);
  else encode_impl<1, c10::Float8_e5m2>(xp, L, q, op);
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode_into", &encode_into, "fused scaled encode (bit-identical to the eager reference)");
  m.def("decode_into", &decode_into, "fused scaled decode, optionally accumulating into out");
  m.def("ef_update_into", &ef_update_into, "fused error-feedback update from the encoded bytes");
}
