// Algorithm 1 (arXiv 2607.24555, Sec. 3): the summary of one page of keys, in float64 (page_summary.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "core/summary_limits.h"
#include "locks/math.h"
#include "locks/page_summary.h"
#include "locks/sym_eigen.h"

namespace locks {

using summary_detail::kMaxHeadDim;
using summary_detail::kMaxPage;

PageSummaryF32 build_page_summary(const float* keys, int n_tok, int d, int rank) {
  if (n_tok < 1 || n_tok > kMaxPage) throw std::invalid_argument(fmt::format("page summary: {} tokens", n_tok));
  if (d < 1 || d > kMaxHeadDim) throw std::invalid_argument(fmt::format("page summary: head_dim {}", d));
  if (rank < 1 || rank > kMaxPage)
    throw std::invalid_argument(fmt::format("page summary: rank {} outside [1, {}]", rank, kMaxPage));
  if (!keys) throw std::invalid_argument("page summary: null keys");
  if (const std::ptrdiff_t i = first_non_finite(keys, size_t(n_tok) * d); i >= 0)
    throw std::invalid_argument(fmt::format("page summary: non-finite key at token {}, dim {}", i / d, i % d));

  PageSummaryF32 s;
  // Alg. 1 line 1: centroid and centered keys (in float64: the Gram matrix squares magnitudes).
  std::vector<double> mu(d, 0.0), D(size_t(n_tok) * d);
  for (int i = 0; i < n_tok; ++i)
    for (int c = 0; c < d; ++c) mu[c] += keys[i * d + c];
  for (int c = 0; c < d; ++c) mu[c] /= n_tok;
  for (int i = 0; i < n_tok; ++i)
    for (int c = 0; c < d; ++c) D[size_t(i) * d + c] = double(keys[i * d + c]) - mu[c];
  s.centroid.assign(mu.begin(), mu.end());

  // Alg. 1 line 2: Gram matrix D D^T and its eigendecomposition U Sigma^2 U^T.
  const int n = n_tok;
  double gram[kMaxPage * kMaxPage], w[kMaxPage], U[kMaxPage * kMaxPage];
  for (int i = 0; i < n; ++i)
    for (int j = i; j < n; ++j) {
      double acc = 0.0;
      for (int c = 0; c < d; ++c) acc += D[size_t(i) * d + c] * D[size_t(j) * d + c];
      gram[i * n + j] = gram[j * n + i] = acc;
    }
  sym_eigen_jacobi(n, gram, w, U);
  s.sigma2.resize(n);
  for (int k = 0; k < n; ++k) s.sigma2[k] = float(std::max(w[k], 0.0));

  // Alg. 1 lines 3-4: rank-r basis V = D^T U_r Sigma_r^-1, coefficients C = U_r Sigma_r, tail.
  // Directions with sigma below a relative floor carry no energy we can resolve; they are dropped
  // (zero column) so rank-deficient pages stay exact and zero pages never divide by zero.
  const double smax2 = std::max(w[0], 0.0);
  const double floor2 = std::max(smax2 * 1e-12, 1e-30);
  s.basis.assign(size_t(rank) * d, 0.0f);
  s.coef.assign(size_t(n) * rank, 0.0f);
  double tail = 0.0;
  for (int k = 0; k < n; ++k) {
    const double l = std::max(w[k], 0.0);
    if (k >= rank) {
      tail += l;
      continue;
    }
    if (l <= floor2) {
      tail += l;  // dropped direction: its (negligible) energy belongs to the tail
      continue;
    }
    const double sigma = std::sqrt(l);
    for (int c = 0; c < d; ++c) {
      double acc = 0.0;
      for (int i = 0; i < n; ++i) acc += D[size_t(i) * d + c] * U[i * n + k];
      s.basis[size_t(k) * d + c] = float(acc / sigma);
    }
    for (int i = 0; i < n; ++i) s.coef[size_t(i) * rank + k] = float(U[i * n + k] * sigma);
  }
  s.tail = float(tail);
  return s;
}

}  // namespace locks
