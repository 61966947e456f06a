#include "locks/sym_eigen.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace locks {

void sym_eigen_jacobi(int n, const double* a_in, double* w, double* u) {
  constexpr int kMax = 32;
  double a[kMax * kMax];
  double v[kMax * kMax];
  for (int i = 0; i < n * n; ++i) a[i] = a_in[i];
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) v[i * n + j] = i == j ? 1.0 : 0.0;

  double total = 0.0;
  for (int i = 0; i < n * n; ++i) total += a[i] * a[i];
  // Cyclic sweeps until the off-diagonal mass is negligible; 30 sweeps is far beyond the
  // quadratic convergence needed for n = 16 (typically 6-8).
  for (int sweep = 0; sweep < 30; ++sweep) {
    double off = 0.0;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) off += a[p * n + q] * a[p * n + q];
    if (off <= 1e-30 * total || off == 0.0) break;
    for (int p = 0; p < n; ++p) {
      for (int q = p + 1; q < n; ++q) {
        const double apq = a[p * n + q];
        if (std::abs(apq) <= 1e-300) continue;
        // Rotation angle that zeroes a[p][q] (Golub & Van Loan, Alg. 8.4.1, sym.schur2).
        const double theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::abs(theta) + std::sqrt(theta * theta + 1.0));
        const double c = 1.0 / std::sqrt(t * t + 1.0), s = t * c;
        for (int k = 0; k < n; ++k) {  // A <- A J (columns p, q)
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // A <- J^T A (rows p, q)
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
        a[p * n + q] = a[q * n + p] = 0.0;
        for (int k = 0; k < n; ++k) {  // V <- V J
          const double vkp = v[k * n + p], vkq = v[k * n + q];
          v[k * n + p] = c * vkp - s * vkq;
          v[k * n + q] = s * vkp + c * vkq;
        }
      }
    }
  }
  int order[kMax];
  std::iota(order, order + n, 0);
  std::stable_sort(order, order + n, [&](int x, int y) { return a[x * n + x] > a[y * n + y]; });
  for (int k = 0; k < n; ++k) {
    w[k] = a[order[k] * n + order[k]];
    for (int i = 0; i < n; ++i) u[i * n + k] = v[i * n + order[k]];
  }
}

}  // namespace locks
