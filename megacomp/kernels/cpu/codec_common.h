// Helpers shared by the CPU codec kernels (codec_kernels.cpp, codec_sign.cpp): block maxima, sub-byte
// packing (the first code in the low bits, as megacomp/compression/packing.py) and the wire layout.
#pragma once
#include <ATen/Parallel.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace megacomp_cpu {

constexpr int64_t kGrain = 1 << 15;  // elements per parallel task

// absmax with NaN propagation (torch.amax propagates NaN, as the default quiet NaN; inf is an ordinary
// maximum): an unsigned maximum over the bits of |x|, where every NaN sorts above inf (vectorises to vpmaxud)
#define MC_INLINE inline __attribute__((always_inline))

MC_INLINE float absmax(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    b &= 0x7FFFFFFFu;
    m = b > m ? b : m;
  }
  if (m > 0x7F800000u) return NAN;
  float r;
  std::memcpy(&r, &m, 4);
  return r;
}

// the maxima of 8 consecutive full blocks of W elements (W a multiple of 8), as absmax() gives them: one
// vector per block, then a transposing reduction (no horizontal reduction per block)
template <int W>
MC_INLINE void absmax8(const float* x, float* out) {
#ifdef __AVX2__
  static_assert(W % 8 == 0, "W: a multiple of 8");
  const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256 v[8];
  for (int k = 0; k < 8; ++k) {
    const float* p = x + k * W;
    __m256i m = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), mask);
    for (int i = 8; i < W; i += 8)
      m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)), mask));
    v[k] = _mm256_castsi256_ps(m);
  }
  // pairwise: per 128-bit half, [max(a0,a1), max(a2,a3), max(b0,b1), max(b2,b3)]
  auto pmax = [](__m256 a, __m256 b) {
    return _mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(_mm256_shuffle_ps(a, b, 0x88)),
                                                _mm256_castps_si256(_mm256_shuffle_ps(a, b, 0xDD))));
  };
  const __m256 t0 = pmax(pmax(v[0], v[1]), pmax(v[2], v[3]));  // halves: blocks 0..3
  const __m256 t1 = pmax(pmax(v[4], v[5]), pmax(v[6], v[7]));  // halves: blocks 4..7
  __m256i r = _mm256_max_epu32(_mm256_castps_si256(_mm256_permute2f128_ps(t0, t1, 0x20)),
                               _mm256_castps_si256(_mm256_permute2f128_ps(t0, t1, 0x31)));
  const __m256i inf = _mm256_set1_epi32(0x7F800000);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_cmpgt_epi32(r, inf));  // NaN: torch's NaN
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), r);
#else
  for (int k = 0; k < 8; ++k) out[k] = absmax(x + k * W, W);
#endif
}

MC_INLINE void pack(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
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
  } else if (bits == 1) {
    for (int64_t j = 0; j < full; ++j) {
      uint32_t b = 0;
      for (int k = 0; k < 8; ++k) b |= static_cast<uint32_t>(codes[8 * j + k]) << k;
      out[j] = static_cast<uint8_t>(b);
    }
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
  } else if (bits == 1) {
    for (int64_t j = 0; j < full; ++j)
      for (int k = 0; k < 8; ++k) codes[8 * j + k] = (in[j] >> k) & 1;
  }
  for (int64_t i = full * per; i < n; ++i) codes[i] = (in[i / per] >> ((i % per) * bits)) & mask;
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

// elements per span of the aligned paths: a chunk of the single block (a multiple of the codes per byte),
// else as many whole blocks as fit in kSpan
constexpr int64_t kSpan = 4096;
inline int64_t span_of(const Layout& L) {
  if (L.nb == 1) return std::max<int64_t>(L.per, kGrain - kGrain % L.per);
  return L.width * std::max<int64_t>(1, kSpan / L.width);
}

// Stochastic rounding's counter-based draws (megacomp/compression/counter_rng.py): element i of a call with
// key K gets u = (mix32((i * 0x4F1BBCDD + s0) ^ s1) >> 8) * 2^-24, s0 = mix32(K mod 2^32),
// s1 = mix32((K >> 32) ^ 0x9E3779B9). Plain uint32 arithmetic: the loops that call at() still vectorise.
MC_INLINE uint32_t mix32(uint32_t x) {
  x = ((x >> 16) ^ x) * 0x45D9F3Bu;
  x = ((x >> 16) ^ x) * 0x45D9F3Bu;
  return (x >> 16) ^ x;
}

struct Uniforms {
  uint32_t s0, s1;
  explicit Uniforms(int64_t key)
      : s0(mix32(static_cast<uint32_t>(static_cast<uint64_t>(key) & 0xFFFFFFFFu))),
        s1(mix32(static_cast<uint32_t>(static_cast<uint64_t>(key) >> 32) ^ 0x9E3779B9u)) {}
  MC_INLINE float at(uint32_t i) const {  // (h >> 8) < 2^24: exact in fp32, and a signed convert vectorises
    return static_cast<float>(static_cast<int32_t>(mix32((i * 0x4F1BBCDDu + s0) ^ s1) >> 8)) * 0x1p-24f;
  }
#ifdef __AVX2__
  MC_INLINE __m256 at8(__m256i idx) const {  // at() of 8 indices
    const __m256i mix = _mm256_set1_epi32(0x45D9F3B);
    __m256i h = _mm256_xor_si256(_mm256_add_epi32(_mm256_mullo_epi32(idx, _mm256_set1_epi32(0x4F1BBCDD)),
                                                  _mm256_set1_epi32(static_cast<int32_t>(s0))),
                                 _mm256_set1_epi32(static_cast<int32_t>(s1)));
    h = _mm256_mullo_epi32(_mm256_xor_si256(h, _mm256_srli_epi32(h, 16)), mix);
    h = _mm256_mullo_epi32(_mm256_xor_si256(h, _mm256_srli_epi32(h, 16)), mix);
    h = _mm256_srli_epi32(_mm256_xor_si256(h, _mm256_srli_epi32(h, 16)), 8);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(h), _mm256_set1_ps(0x1p-24f));
  }
#endif
};

// the sign codec (codec_sign.cpp): nearest (u null) or stochastic with the draws of u; out/buf in the wire layout
void sign_encode(const float* x, int64_t n, int64_t block, const Uniforms* u, uint8_t* out);
void sign_decode(const uint8_t* buf, int64_t n, int64_t block, float* out, bool accumulate);

// error feedback (codec_ef.cpp; kind 0 int, 1 float8 e4m3fn, 2 float8 e5m2): the update from encoded bytes,
// and the fused compensate + encode + update (per-block scales on byte boundaries, nb > 1, no dual scaling)
bool ef_update(const uint8_t* buf, const Layout& L, int kind, const float* h, const float* e, float* e_out,
               float beta, float one_minus_beta, int mode);
bool ef_encode(const float* g, const float* e, const Layout& L, int kind, float qmax, const Uniforms* u, uint8_t* out,
               float* e_out, float beta, float one_minus_beta, int mode);

}  // namespace megacomp_cpu
