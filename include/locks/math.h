// Small numerics shared by the CPU kernels: a vectorizable exp and a safe log-sum-exp merge.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace locks {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

/// Index of the first NaN or +-inf among x[0, n), or -1 when every element is finite (the entry
/// points' input checks; each names the element in its own terms).
inline std::ptrdiff_t first_non_finite(const float* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return std::ptrdiff_t(i);
  return -1;
}

/// expf for x <= 0-ish softmax arguments (valid over the whole float range: underflows to 0,
/// overflows to inf). Relative error < 2e-7. Branch-free so loops over it vectorize.
inline float fast_exp(float x) {
  // exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2].
  x = x < -104.0f ? -104.0f : (x > 88.7f ? 88.7f : x);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // Scale by 2^n in two steps so n down to -150 gives denormals/0 instead of garbage.
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  return p * s1 * s2;
}

/// Natural log for finite x > 0 (relative error < 3e-7): exponent split + atanh series on the
/// mantissa. Used where a logsumexp needs log(l) with l in [1, B], millions of times per step.
inline float fast_log(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, 4);
  int32_t e = ((bits >> 23) & 0xFF) - 127;
  bits = (bits & 0x007FFFFF) | 0x3F800000;  // mantissa m in [1, 2)
  float m;
  std::memcpy(&m, &bits, 4);
  if (m > 1.41421356f) {  // centre on 1 so the series converges fast: m in [0.707, 1.414)
    m *= 0.5f;
    e += 1;
  }
  const float t = (m - 1.0f) / (m + 1.0f), t2 = t * t;  // log m = 2 atanh t
  const float p = 2.0f * t * (1.0f + t2 * (0.33333334f + t2 * (0.2f + t2 * (0.14285715f + t2 * 0.11111111f))));
  return p + float(e) * 0.69314718f;
}

/// Horizontal sum and maximum of an AVX register's eight floats.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

/// 8-wide fast_exp (same polynomial and clamping), AVX2 + FMA.
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/// max_i x[i] over n values (-inf when n == 0).
inline float max_of(const float* x, int n) {
  __m256 m8 = _mm256_set1_ps(-INFINITY);
  int i = 0;
  for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + i));
  alignas(32) float t[8];
  _mm256_store_ps(t, m8);
  float m = *std::max_element(t, t + 8);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

/// x[i] <- exp(x[i] - mx) in place for i < n; returns the sum of the new values.
inline float exp_shift_sum(float* x, int n, float mx) {
  const __m256 m8 = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m8));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, acc);
  float sum = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
  for (; i < n; ++i) sum += x[i] = fast_exp(x[i] - mx);
  return sum;
}

/// Running softmax state for one query row: max m, normaliser l = Σ exp(s - m).
/// Merging two partial states is the split-K log-sum-exp reduction; an empty state has
/// m = -inf, l = 0 and merges without producing NaN.
struct SoftmaxState {
  float m = kNegInf;
  float l = 0.0f;
  /// log Σ exp(s) over everything seen, -inf when empty.
  float lse() const { return l > 0.0f ? m + std::log(l) : kNegInf; }
};

}  // namespace locks
