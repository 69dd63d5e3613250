// Error feedback on CPU, bit-identical to megacomp/compression/error_feedback.py with the eager reference:
//   update (ef_update): e' from the bytes already encoded, h_hat = decode(bytes);
//   encode (ef_encode): the whole step in one pass per block, h = g + e (ErrorFeedback.compensate), the
//     block's scale and codes (the encode kernel's steps), h_hat from those codes (the decode's arithmetic)
//     and e', so g and e are read once and neither h nor h_hat ever reaches memory.
// e' = h - h_hat (mode 0, beta = 0), (1 - beta)(h - h_hat) (mode 1, no error yet), beta e + (1 - beta)(h - h_hat)
// (mode 2), the reference's expressions in its order; both return false if a residual h - h_hat is not finite.
// Raw pointers only (Tensor checks and bindings: codec_kernels.cpp).
#include "codec_quant.h"

namespace megacomp_cpu {
namespace {

// e_out[0, n) from h, h_hat (and e for mode 2); returns whether a residual was not finite
MC_INLINE int new_error(const float* h, const float* hat, const float* e, float* e_out, int64_t n, float beta,
                        float one_minus_beta, int mode) {
  int nonfinite = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float r = h[i] - hat[i];
    nonfinite |= !std::isfinite(r);
    e_out[i] = mode == 0 ? r : (mode == 1 ? one_minus_beta * r : beta * e[i] + one_minus_beta * r);
  }
  return nonfinite;
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
      bad[s] = static_cast<char>(new_error(h + start, hat.data(), e ? e + start : nullptr, e_out + start, len, beta,
                                           one_minus_beta, mode));
    }
  });
  for (char c : bad) if (c) return false;
  return true;
}

// One pass per block (per-block scales, blocks on byte boundaries, more than one block, no dual scaling:
// the caller checks): e_in (may be null: no error yet) is the error compensated into h, e the one in mode 2.
template <int KIND, typename F8, bool STOCH>
bool ef_encode_impl(const float* g, const float* e_in, const Layout& L, float qmax, const Uniforms* u, uint8_t* out,
                    float* e_out, float beta, float one_minus_beta, int mode) {
  const float offset = static_cast<float>(1 << (L.bits - 1));
  uint8_t* payload = out + L.scale_bytes;
  std::vector<char> bad(L.nb, 0);
  at::parallel_for(0, L.nb, std::max<int64_t>(1, kGrain / L.width), [&](int64_t b0, int64_t b1) {
    std::vector<float> h(L.width), hat(L.width);
    std::vector<uint8_t> codes(L.width);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * L.width, len = std::min(L.width, L.n - start);
      const float* gb = g + start;
      if (e_in) {
        const float* eb = e_in + start;
        for (int64_t i = 0; i < len; ++i) h[i] = gb[i] + eb[i];
      } else {
        std::memcpy(h.data(), gb, len * sizeof(float));
      }
      const float scale = absmax(h.data(), len) / qmax;
      std::memcpy(out + 4 * b, &scale, 4);
      const float div = scale > 0.f ? scale : 1.f;
      quantize_span<KIND, F8, false, STOCH>(h.data(), len, 1.f, div, qmax, offset, codes.data(), u, start);
      pack(codes.data(), len, L.bits, payload + start / L.per);
      dequantize_span<KIND, F8>(codes.data(), len, scale, 0.f, 0.f, false, offset, hat.data(), false);
      bad[b] = static_cast<char>(new_error(h.data(), hat.data(), mode == 2 ? e_in + start : nullptr, e_out + start,
                                           len, beta, one_minus_beta, mode));
    }
  });
  for (char c : bad) if (c) return false;
  return true;
}

}  // namespace

bool ef_update(const uint8_t* buf, const Layout& L, int kind, const float* h, const float* e, float* e_out,
               float beta, float one_minus_beta, int mode) {
  if (kind == 0) return ef_update_impl<0, c10::Float8_e4m3fn>(buf, L, h, e, e_out, beta, one_minus_beta, mode);
  if (kind == 1) return ef_update_impl<1, c10::Float8_e4m3fn>(buf, L, h, e, e_out, beta, one_minus_beta, mode);
  return ef_update_impl<1, c10::Float8_e5m2>(buf, L, h, e, e_out, beta, one_minus_beta, mode);
}

bool ef_encode(const float* g, const float* e, const Layout& L, int kind, float qmax, const Uniforms* u, uint8_t* out,
               float* e_out, float beta, float one_minus_beta, int mode) {
  if (kind == 0 && u) return ef_encode_impl<0, c10::Float8_e4m3fn, true>(g, e, L, qmax, u, out, e_out, beta, one_minus_beta, mode);
  if (kind == 0) return ef_encode_impl<0, c10::Float8_e4m3fn, false>(g, e, L, qmax, u, out, e_out, beta, one_minus_beta, mode);
  if (kind == 1) return ef_encode_impl<1, c10::Float8_e4m3fn, false>(g, e, L, qmax, u, out, e_out, beta, one_minus_beta, mode);
  return ef_encode_impl<1, c10::Float8_e5m2, false>(g, e, L, qmax, u, out, e_out, beta, one_minus_beta, mode);
}

}  // namespace megacomp_cpu
