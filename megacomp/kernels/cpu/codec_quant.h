// The element-wise quantize and dequantize steps of the CPU codec kernels (codec_kernels.cpp: encode and
// decode; codec_ef.cpp: error feedback): each repeats the eager reference's fp32 operations in its order
// (megacomp/compression/quantize.py), so every kernel built from them is bit-identical to it.
#pragma once
#include "codec_common.h"
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace megacomp_cpu {
namespace {


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

// Clamp target of the float8 encode: the code of qmax (the format's max), by c10's own conversion
struct F8Clamp {
  uint32_t qmax_code;
};

template <typename F8>
F8Clamp f8_clamp(float qmax) {
  return {static_cast<uint32_t>(F8(qmax).x)};
}

// fp8 code of y as the reference computes it: float8(nan_to_num(clamp(y, -qmax, qmax))). The clamp and the
// NaN are applied to the integer result (|y| > qmax, inf included: the code of qmax, a minimum because the
// code grows with |y|; NaN: +0), so the float ops run on every lane and only integer selects follow (the
// loop vectorises). The rounding is c10's integer round-to-nearest-even (fp8e4m3fn_from_fp32_value /
// fp8e5m2_from_fp32_value, here as selects) for |y| <= qmax; its overflow branches are
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

}  // namespace
}  // namespace megacomp_cpu
