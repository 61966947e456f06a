// Small numerics shared by the CPU kernels: a vectorizable exp and a safe log-sum-exp merge.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace locks {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
  const int32_t n1 = ni / 2, n2 = ni - n1;
  int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  return p * s1 * s2;
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
