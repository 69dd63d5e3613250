// The sign codec on CPU (one bit per element and an fp32 scale per block), bit-identical to the eager
// reference in megacomp/compression/quantize.py:
//   nearest:    bit = x >= 0 with the reference's scale mean_b |x|, computed by the caller with the
//               reference's own torch ops (a float sum whose order only torch reproduces);
//   stochastic: scale = amax_b, bit = u < (1 + x / safe) * 0.5 with the reference's torch.rand draws u;
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

}  // namespace

void sign_encode(const float* xp, int64_t n, int64_t block, const float* scale, const float* up, uint8_t* op) {
  const Layout L(n, block, false, 1);
  uint8_t* payload = op + L.scale_bytes;
  if (scale) {
    std::memcpy(op, scale, 4 * L.nb);
  } else {
    at::parallel_for(0, L.nb, std::max<int64_t>(1, kGrain / L.width), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float s = absmax(xp + b * L.width, std::min(L.width, n - b * L.width));  // torch.amax
        std::memcpy(op + 4 * b, &s, 4);
      }
    });
  }
  const int64_t span = kSpan;  // a multiple of 8: every span starts on a byte boundary
  at::parallel_for(0, (n + span - 1) / span, 1, [&](int64_t s0, int64_t s1) {
    std::vector<uint8_t> codes(span);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t start = s * span, len = std::min(span, n - start);
      const float* xs = xp + start;
      if (!up) {
        for (int64_t i = 0; i < len; ++i) codes[i] = xs[i] >= 0.f;  // NaN: 0
      } else {
        by_block(start, len, L.width, [&](int64_t o, int64_t m, int64_t b) {
          const float sc = scale_at(op, b), safe = sc > 0.f ? sc : 1.f;
          const float* us = up + start + o;
          for (int64_t i = 0; i < m; ++i) codes[o + i] = us[i] < (1.0f + xs[o + i] / safe) * 0.5f;
        });
      }
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
