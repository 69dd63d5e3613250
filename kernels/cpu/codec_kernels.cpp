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
#include "codec_common.h"
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace megacomp_cpu {
namespace {

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

// Clamp target of the float8 encode: the code of qmax (the format's max)
struct F8Clamp {
  uint32_t qmax_code;
};

template <typename F8>
F8Clamp f8_clamp(float qmax) {
  return {f8_bits<F8>(qmax)};
}

// fp8 code of y as the reference computes it: float8(nan_to_num(clamp(y, -qmax, qmax))). The clamp and the
// NaN are applied to the integer result (|y| > qmax, inf included: the code of qmax, a minimum because the
// code grows with |y|; NaN: +0), so the float ops run on every lane and only integer selects follow (the
// loop vectorises). The rounding is c10's (f8_bits above) for |y| <= qmax; its overflow branches are
// covered by the clamp. Comparisons are on non-negative int32 values, arithmetic in uint32.
template <typename F8>
inline uint32_t f8_code(float y, F8Clamp cl) {
  constexpr bool e4m3 = std::is_same<F8, c10::Float8_e4m3fn>::value;
  uint32_t b;
  std::memcpy(&b, &y, 4);
  const uint32_t a = b & 0x7FFFFFFFu;
  float fa;
  std::memcpy(&fa, &a, 4);
  const float dn = fa + (e4m3 ? 16384.0f : 128.0f);  // aligns subnormals to the fp8 grid
  uint32_t dnb;
  std::memcpy(&dnb, &dn, 4);
  const uint32_t den = dnb - ((e4m3 ? 141u : 134u) << 23);
  const uint32_t norm = e4m3 ? (a - (120u << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20
                             : (a - (112u << 23) + 0xFFFFFu + ((a >> 21) & 1u)) >> 21;
  const int32_t ai = static_cast<int32_t>(a);
  uint32_t r = ai < static_cast<int32_t>((e4m3 ? 121u : 113u) << 23) ? den : norm;
  r = r < cl.qmax_code ? r : cl.qmax_code;  // the clamp: the code is nondecreasing in |y| (inf, NaN: above)
  r |= (b >> 24) & 0x80u;
  return ai > 0x7F800000 ? 0u : r;
}

#ifdef __AVX2__
// The int codes of 32 elements per step with explicit AVX2: gcc vectorises the scalar loop below, but
// builds each select of the clamp and NaN handling from and/andn/or masks and spends ~2x the instructions;
// the counter-based draws then made stochastic rounding compute-bound. Same operations, same order:
// y = x / div (dual: (x * mult) / div, IEEE division), round half to even (vroundps, the mode torch.round
// uses) or floor(y + u); NaN -> 0 first, then max(-qmax) and min(qmax) (maxps/minps: NaN-free inputs, so
// this equals the reference's clamp_ then nan_to_num); + offset, exact conversion, bytes in order.
template <bool DUAL, bool STOCH>
MC_INLINE int64_t quantize_int_avx2(const float* x, int64_t n, float mult, float div, float qmax, float offset,
                                    uint8_t* codes, const Uniforms& U, uint32_t b0) {
  const __m256 vmult = _mm256_set1_ps(mult), vdiv = _mm256_set1_ps(div), lo = _mm256_set1_ps(-qmax),
               hi = _mm256_set1_ps(qmax), off = _mm256_set1_ps(offset);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(b0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i step = _mm256_set1_epi32(8);
  auto code8 = [&](const float* p) __attribute__((always_inline)) {
    __m256 v = _mm256_loadu_ps(p);
    if (DUAL) v = _mm256_mul_ps(v, vmult);
    __m256 y = _mm256_div_ps(v, vdiv);
    __m256 q;
    if (STOCH) {
      q = _mm256_round_ps(_mm256_add_ps(y, U.at8(idx)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      idx = _mm256_add_epi32(idx, step);
    } else {
      q = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    q = _mm256_and_ps(q, _mm256_cmp_ps(q, q, _CMP_ORD_Q));  // NaN -> +0
    q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
    return _mm256_cvttps_epi32(_mm256_add_ps(q, off));  // integers in [0, 255]
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i a = code8(x + i), b = code8(x + i + 8), c = code8(x + i + 16), d = code8(x + i + 24);
    const __m256i ab = _mm256_packus_epi32(a, b), cd = _mm256_packus_epi32(c, d);  // per 128-bit lane
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), bytes);
  }
  return i;
}
#endif

// codes[i] for y_i = (x_i * mult) / div, the reference's op sequence; KIND 0 = int, 1 = float8
// STOCH (int only): floor(y + u) with the reference's counter-based draws u (element base + i) instead of round(y)
template <int KIND, typename F8, bool DUAL, bool STOCH = false>
MC_INLINE void quantize_span(const float* x, int64_t n, float mult, float div, float qmax, float offset, uint8_t* codes,
                             const Uniforms* u = nullptr, int64_t base = 0) {
  if (KIND == 0) {
    const Uniforms U = STOCH ? *u : Uniforms(0);  // a local copy: the loop vectorises
    const uint32_t b0 = static_cast<uint32_t>(base);
    int64_t i = 0;
#ifdef __AVX2__
    i = quantize_int_avx2<DUAL, STOCH>(x, n, mult, div, qmax, offset, codes, U, b0);
#endif
    for (; i < n; ++i) {
      const float y = DUAL ? (x[i] * mult) / div : x[i] / div;
      // torch.floor / torch.round (half to even)
      float q = STOCH ? std::floor(y + U.at(b0 + static_cast<uint32_t>(i))) : std::nearbyint(y);
      q = q < -qmax ? -qmax : (q > qmax ? qmax : q);  // clamp_ (NaN passes through)
      q = (q != q) ? 0.f : q;                         // nan_to_num
      codes[i] = static_cast<uint8_t>(static_cast<int>(q + offset));
    }
  } else {
    // through a small 32-bit buffer: the conversion loop then runs 8 lanes per register without spills,
    // and the narrowing to bytes is a separate, cheap loop
    const F8Clamp cl = f8_clamp<F8>(qmax);
    uint32_t buf[256];
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
      const int64_t m = std::min<int64_t>(256, n - i0);
      for (int64_t i = 0; i < m; ++i) buf[i] = f8_code<F8>(DUAL ? (x[i0 + i] * mult) / div : x[i0 + i] / div, cl);
      for (int64_t i = 0; i < m; ++i) codes[i0 + i] = static_cast<uint8_t>(buf[i]);
    }
  }
}

// float8 code -> fp32 by integer arithmetic (vectorises; a table lookup is a gather): normals rebias the
// exponent, subnormals are m * 2^-(bias + mantissa bits - 1), and the special codes take torch's values
// (e4m3fn NaN: +-0x7FF00000; e5m2 inf, quieted NaN). Used only if it equals the c10 table for all 256
// codes (f8_arith_exact), else the table.
template <typename F8>
inline float f8_value(uint32_t c) {
  constexpr bool e4m3 = std::is_same<F8, c10::Float8_e4m3fn>::value;
  constexpr uint32_t M = e4m3 ? 3 : 2, EMASK = e4m3 ? 15 : 31, REBIAS = e4m3 ? 120 : 112;
  const uint32_t sign = (c & 0x80u) << 24, e = (c >> M) & EMASK, m = c & ((1u << M) - 1);
  const float sub = static_cast<float>(static_cast<int32_t>(m)) * (e4m3 ? 0x1p-9f : 0x1p-16f);
  uint32_t subb;
  std::memcpy(&subb, &sub, 4);
  uint32_t r = e == 0 ? (subb | sign) : (sign | ((e + REBIAS) << 23) | (m << (23 - M)));
  if (e4m3) {
    r = (c & 0x7Fu) == 0x7Fu ? (sign | 0x7FF00000u) : r;
  } else {
    r = e == 31 ? (sign | 0x7F800000u | (m << 21) | (m ? 0x00400000u : 0u)) : r;
  }
  float f;
  std::memcpy(&f, &r, 4);
  return f;
}

template <typename F8>
bool f8_arith_exact() {
  static const bool ok = [] {
    const float* t = f8_table<F8>();
    for (uint32_t c = 0; c < 256; ++c) {
      const float v = f8_value<F8>(c);
      if (std::memcmp(&v, t + c, 4) != 0) return false;
    }
    return true;
  }();
  return ok;
}

// out[i] (+)= decoded codes[i]: int: (code - offset) * scale; dual: (v * coarse) * down (the reference's order)
template <int KIND, typename F8, bool DUAL, bool ACC, bool TABLE>
inline void dequantize_loop(const uint8_t* codes, int64_t n, float scale, float coarse, float down, float offset,
                            float* out) {
  const float* table = f8_table<F8>();
  for (int64_t i = 0; i < n; ++i) {
    const float v = KIND == 0 ? static_cast<float>(codes[i]) - offset
                              : (TABLE ? table[codes[i]] : f8_value<F8>(codes[i]));
    const float r = DUAL ? (v * coarse) * down : v * scale;
    out[i] = ACC ? out[i] + r : r;
  }
}

template <int KIND, typename F8>
inline void dequantize_span(const uint8_t* codes, int64_t n, float scale, float coarse, float down, bool dual,
                            float offset, float* out, bool accumulate) {
  const bool table = KIND != 0 && !f8_arith_exact<F8>();
#define MC_DQ(D, A, T) dequantize_loop<KIND, F8, D, A, T>(codes, n, scale, coarse, down, offset, out)
  if (table) {
    if (dual) { if (accumulate) MC_DQ(true, true, true); else MC_DQ(true, false, true); }
    else { if (accumulate) MC_DQ(false, true, true); else MC_DQ(false, false, true); }
  } else {
    if (dual) { if (accumulate) MC_DQ(true, true, false); else MC_DQ(true, false, false); }
    else { if (accumulate) MC_DQ(false, true, false); else MC_DQ(false, false, false); }
  }
#undef MC_DQ
}

// dual scale: k_b = clamp(floor(log2(amax / amax_b)), 0, 126), 126 where the ratio is not finite; the
// reference's frexp exponent read from the ratio's bits (subnormal and zero ratios give 0 after the clamp)
inline uint8_t dual_exponent(float amax, float amax_b) {
  const float ratio = amax / amax_b;
  int32_t rb;
  std::memcpy(&rb, &ratio, 4);
  rb &= 0x7FFFFFFF;
  int32_t k = (rb >> 23) - 127;  // inf and NaN: 128, clamped to 126 like the reference's non-finite case
  k = k < 0 ? 0 : k;
  return static_cast<uint8_t>(k > 126 ? 126 : k);
}

inline float pow2(int k) {  // 2^k for -126 <= k <= 127, exactly
  const uint32_t b = static_cast<uint32_t>(k + 127) << 23;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

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
}
