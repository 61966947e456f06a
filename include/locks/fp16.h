// Half-precision storage helpers (IEEE binary16 via F16C). KV pages and summary scales are stored
// as f16; all arithmetic is float32.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace locks {

using f16_t = uint16_t;  // raw IEEE binary16 bits

inline float f16_to_f32(f16_t h) { return _cvtsh_ss(h); }
/// Round-to-nearest-even conversion; values beyond ±65504 become ±inf (callers clamp first).
inline f16_t f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

/// dst[i] = float(src[i]) for i < n.
inline void f16_to_f32_row(const f16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

/// dst[i] = f16(src[i]) for i < n (round to nearest even).
inline void f32_to_f16_row(const float* src, f16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

}  // namespace locks
