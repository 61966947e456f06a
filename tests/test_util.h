// Helpers shared by the tests: seeded random data and float64 reference computations.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace locks::test {

/// n samples of N(0, sd^2) as float32. (noinline: inlined into callers, GCC 12 reports a false
/// -Wfree-nonheap-object on the vector's deallocation.)
[[gnu::noinline]] inline std::vector<float> randn(std::mt19937& rng, size_t n, double sd = 1.0) {
  std::normal_distribution<double> N(0.0, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = float(N(rng));
  return v;
}

/// Exact page log-mass logsumexp_i (q.k_i) * scale over n keys [n][d], in float64.
inline double ref_lse(const float* keys, int n, const float* q, int d, double scale) {
  std::vector<double> z(n);
  double m = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < n; ++i) {
    double acc = 0.0;
    for (int c = 0; c < d; ++c) acc += double(q[c]) * keys[size_t(i) * d + c];
    z[i] = acc * scale;
    m = std::max(m, z[i]);
  }
  double l = 0.0;
  for (int i = 0; i < n; ++i) l += std::exp(z[i] - m);
  return m + std::log(l);
}

/// The message of the exception of type E that fn throws ("no exception" / "other exception").
template <class E, class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (...) {
    return "other exception";
  }
  return "no exception";
}

}  // namespace locks::test
