// The sign codec on CPU (one bit per element and an fp32 scale per block), bit-identical to the eager
// reference in megacomp/compression/quantize.py:
//   nearest:    bit = x >= 0; scale = mean_b |x| as the reference defines it (_sign_mean_scale): with
//               amax_b = m 2^e and k = 24 - e, fp32(fp64(sum floor(|x| 2^k)) * 2^-k / count), an exact
//               integer sum, so this file's order (8 lanes, then the lanes, then the chunks) gives the
//               reference's value;
//   stochastic: scale = amax_b, bit = u < (1 + x / safe) * 0.5 with the reference's counter-based draws u;
//   decode:     (2 * bit - 1) * scale, or added to out.
// Raw pointers only (the Tensor checks and bindings are in codec_kernels.cpp): this file does not parse
// the torch extension headers, which dominate build time.
#include "codec_common.h"

namespace megacomp_cpu {

namespace {

// [start, start + len) split at block boundaries: f(offset, length, block) per piece
template <typename F>
inline void by_block(int64_t start, int64_t len, int64_t width, F f) {
  for (int64_t o = 0; o < len;) {
    const int64_t b = (start + o) / width, m = std::min(len - o, (b + 1) * width - (start + o));
    f(o, m, b);
    o += m;
  }
}

inline float scale_at(const uint8_t* out, int64_t b) {
  float s;
  std::memcpy(&s, out + 4 * b, 4);
  return s;
}

inline float pow2f(int k) {  // k in [-126, 127]
  const uint32_t b = static_cast<uint32_t>(k + 127) << 23;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline double pow2d(int k) {  // k in [-1022, 1023]
  const uint64_t b = static_cast<uint64_t>(k + 1023) << 52;
  double d;
  std::memcpy(&d, &b, 8);
  return d;
}

// k = 24 - e for amax = m 2^e, m in [0.5, 1): every |x| 2^k of the block is below 2^24
inline int mean_exponent(float amax) {
  int e;
  std::frexp(amax, &e);
  return 24 - e;
}

// sum of floor(|x_i| 2^k): every term is an integer below 2^24. |x| 2^k is formed as (|x| 2^k1) 2^k2 with
// both factors normal fp32 numbers; each product is exact (or, below 1, still floors to the same 0).
int64_t scaled_abs_sum(const float* x, int64_t n, int k) {
  const int k1 = k / 2, k2 = k - k1;
  const float f1 = pow2f(k1), f2 = pow2f(k2);
  int64_t total = 0, i = 0;
#ifdef __AVX2__
  const __m256 v1 = _mm256_set1_ps(f1), v2 = _mm256_set1_ps(f2);
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  while (n - i >= 8) {
    // int32 lanes take at most 64 terms (< 2^30) before they are widened
    const int64_t stop = i + std::min<int64_t>(64 * 8, (n - i) / 8 * 8);
    __m256i acc = _mm256_setzero_si256();
    for (; i < stop; i += 8) {
      const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), mask);
      acc = _mm256_add_epi32(acc, _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_mul_ps(a, v1), v2)));
    }
    alignas(32) int32_t lane[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane), acc);
    for (int j = 0; j < 8; ++j) total += lane[j];
  }
#endif
  for (; i < n; ++i) total += static_cast<int32_t>((std::fabs(x[i]) * f1) * f2);
  return total;
}

inline float mean_scale(float amax, int64_t total, int k, int64_t count) {
  if (!std::isfinite(amax) || amax == 0.f) return amax;  // inf/NaN propagate; an all-zero block: 0
  return static_cast<float>((static_cast<double>(total) * pow2d(-k)) / static_cast<double>(count));
}

// the sign bits of x[0, n) (bit k of byte j: x[8j + k] >= 0; NaN gives 0), written from out[0]
inline void sign_bits(const float* x, int64_t n, uint8_t* out) {
  int64_t j = 0;
#ifdef __AVX2__
  const __m256 zero = _mm256_setzero_ps();
  for (; 8 * j + 8 <= n; ++j)
    out[j] = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + 8 * j), zero, _CMP_GE_OQ)));
#endif
  for (; 8 * j < n; ++j) {
    uint32_t b = 0;
    for (int64_t i = 8 * j; i < std::min(n, 8 * j + 8); ++i) b |= static_cast<uint32_t>(x[i] >= 0.f) << (i - 8 * j);
    out[j] = static_cast<uint8_t>(b);
  }
}

// stochastic bits of x[0, n), elements i0 .. i0 + n - 1 of the tensor, one block scale: bit = u_i <
// (1 + x_i / safe) * 0.5 (NaN gives 0), written from out[0] (x[0] is bit 0 of out[0])
inline void stochastic_sign_bits(const float* x, int64_t n, float safe, const Uniforms& U, uint32_t i0,
                                 uint8_t* out) {
  int64_t j = 0;
#ifdef __AVX2__
  const __m256 vs = _mm256_set1_ps(safe), one = _mm256_set1_ps(1.f), half = _mm256_set1_ps(0.5f);
  __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (; 8 * j + 8 <= n; ++j) {
    const __m256 t = _mm256_mul_ps(_mm256_add_ps(one, _mm256_div_ps(_mm256_loadu_ps(x + 8 * j), vs)), half);
    out[j] = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_cmp_ps(U.at8(idx), t, _CMP_LT_OQ)));
    idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
  }
#endif
  for (; 8 * j < n; ++j) {
    uint32_t b = 0;
    for (int64_t i = 8 * j; i < std::min(n, 8 * j + 8); ++i)
      b |= static_cast<uint32_t>(U.at(i0 + static_cast<uint32_t>(i)) < (1.0f + x[i] / safe) * 0.5f) << (i - 8 * j);
    out[j] = static_cast<uint8_t>(b);
  }
}

// one block (the whole tensor): maxima and integer sums per chunk in parallel (both order-free); nearest
// rounding also writes each chunk's bits while the chunk is in cache (two passes over x instead of three)
void sign_encode_single(const float* xp, int64_t n, uint8_t* op, uint8_t* payload, bool stochastic) {
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  std::vector<float> maxima(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) maxima[c] = absmax(xp + c * kGrain, std::min(kGrain, n - c * kGrain));
  });
  float amax = maxima[0];  // the same NaN-propagating maximum as absmax() over everything
  for (float m : maxima) amax = (std::isnan(amax) || std::isnan(m)) ? NAN : std::max(amax, m);
  float scale = amax;
  const bool sums_needed = !stochastic && std::isfinite(amax) && amax > 0.f;
  const int k = sums_needed ? mean_exponent(amax) : 0;
  std::vector<int64_t> sums(chunks);
  if (!stochastic) {
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t len = std::min(kGrain, n - c * kGrain);
        if (sums_needed) sums[c] = scaled_abs_sum(xp + c * kGrain, len, k);
        sign_bits(xp + c * kGrain, len, payload + c * kGrain / 8);  // kGrain is a multiple of 8
      }
    });
  }
  if (sums_needed) {
    int64_t total = 0;
    for (int64_t s : sums) total += s;
    scale = mean_scale(amax, total, k, n);
  }
  std::memcpy(op, &scale, 4);
}

}  // namespace

void sign_encode(const float* xp, int64_t n, int64_t block, const Uniforms* up, uint8_t* op) {
  const Layout L(n, block, false, 1);
  uint8_t* payload = op + L.scale_bytes;
  // scales and bits per span, the span in cache (one block: per chunk, in sign_encode_single)
  const bool fused = !up && (L.nb == 1 || L.width % 8 == 0);
  if (L.nb == 1) {
    sign_encode_single(xp, n, op, payload, up != nullptr);
  } else {
    const int64_t per_task = fused ? std::max<int64_t>(1, kSpan / L.width) : std::max<int64_t>(1, kGrain / L.width);
    at::parallel_for(0, L.nb, per_task, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float* xb = xp + b * L.width;
        const int64_t len = std::min(L.width, n - b * L.width);
        const float a = absmax(xb, len);  // torch.amax
        float s = a;
        if (!up && std::isfinite(a) && a > 0.f) {
          const int k = mean_exponent(a);
          s = mean_scale(a, scaled_abs_sum(xb, len, k), k, len);
        }
        std::memcpy(op + 4 * b, &s, 4);
        if (fused) sign_bits(xb, len, payload + b * L.width / 8);
      }
    });
  }
  if (fused) return;
  if (!up) {  // nearest: the bits do not depend on the scale
    at::parallel_for(0, (n + 7) / 8, kGrain / 8, [&](int64_t j0, int64_t j1) {
      sign_bits(xp + 8 * j0, std::min(n, 8 * j1) - 8 * j0, payload + j0);
    });
    return;
  }
  const int64_t span = kSpan;  // a multiple of 8: every span starts on a byte boundary
  if (L.nb == 1 || L.width % 8 == 0) {  // every block piece starts on a byte boundary: bits straight to the payload
    at::parallel_for(0, (n + span - 1) / span, 1, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t start = s * span, len = std::min(span, n - start);
        by_block(start, len, L.width, [&](int64_t o, int64_t m, int64_t b) {
          const float sc = scale_at(op, b), safe = sc > 0.f ? sc : 1.f;
          stochastic_sign_bits(xp + start + o, m, safe, *up, static_cast<uint32_t>(start + o),
                               payload + (start + o) / 8);
        });
      }
    });
    return;
  }
  at::parallel_for(0, (n + span - 1) / span, 1, [&](int64_t s0, int64_t s1) {
    std::vector<uint8_t> codes(span);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t start = s * span, len = std::min(span, n - start);
      const float* xs = xp + start;
      by_block(start, len, L.width, [&](int64_t o, int64_t m, int64_t b) {
        const float sc = scale_at(op, b), safe = sc > 0.f ? sc : 1.f;
        const Uniforms U = *up;
        const uint32_t base = static_cast<uint32_t>(start + o);
        for (int64_t i = 0; i < m; ++i)
          codes[o + i] = U.at(base + static_cast<uint32_t>(i)) < (1.0f + xs[o + i] / safe) * 0.5f;
      });
      pack(codes.data(), len, 1, payload + start / 8);
    }
  });
}

void sign_decode(const uint8_t* bp, int64_t n, int64_t block, float* o, bool accumulate) {
  const Layout L(n, block, false, 1);
  const uint8_t* payload = bp + L.scale_bytes;
  const int64_t span = kSpan;
  at::parallel_for(0, (n + span - 1) / span, 1, [&](int64_t s0, int64_t s1) {
    std::vector<uint8_t> codes(span);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t start = s * span, len = std::min(span, n - start);
      unpack(payload + start / 8, len, 1, codes.data());
      by_block(start, len, L.width, [&](int64_t off, int64_t m, int64_t b) {
        const float sc = scale_at(bp, b);
        const uint8_t* c = codes.data() + off;
        float* d = o + start + off;
        if (accumulate) {
          for (int64_t i = 0; i < m; ++i) d[i] = d[i] + (static_cast<float>(c[i]) * 2.0f - 1.0f) * sc;
        } else {
          for (int64_t i = 0; i < m; ++i) d[i] = (static_cast<float>(c[i]) * 2.0f - 1.0f) * sc;
        }
      });
    }
  });
}

}  // namespace megacomp_cpu
