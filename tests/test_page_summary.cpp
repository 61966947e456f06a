// Algorithm 1 (page summaries), the Eq. 4 score, the Eq. 7 error bound and the quantized store,
// checked against float64 references written here (plain loops and Eigen) and the paper's bounds.
#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "family_models.h"
#include "locks/kv_cache.h"
#include "locks/model.h"
#include "locks/page_summary.h"
#include "locks/session.h"
#include "locks/sym_eigen.h"
#include "test_paths.h"
#include "test_util.h"

using namespace locks;

namespace {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// ---------------------------------------------------------------------------------------------
// float64 references
// ---------------------------------------------------------------------------------------------

using test::ref_lse;

// Eq. 4 evaluated in float64 on a float summary (any number of coefficient rows).
double ref_summary_lse(const PageSummaryF32& s, const float* q, int d, double scale) {
  const int r = int(s.basis.size()) / d;
  const int n = int(s.coef.size()) / r;
  double a = 0.0;
  for (int c = 0; c < d; ++c) a += double(q[c]) * s.centroid[c];
  std::vector<double> w(r, 0.0), z(n);
  for (int k = 0; k < r; ++k)
    for (int c = 0; c < d; ++c) w[k] += double(q[c]) * s.basis[size_t(k) * d + c];
  double m = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < n; ++i) {
    double acc = a;
    for (int k = 0; k < r; ++k) acc += w[k] * s.coef[size_t(i) * r + k];
    z[i] = acc * scale;
    m = std::max(m, z[i]);
  }
  double l = 0.0;
  for (int i = 0; i < n; ++i) l += std::exp(z[i] - m);
  return m + std::log(l);
}

// Centered keys D (float64, [n][d]) and their centroid.
MatD centered(const float* keys, int n, int d, std::vector<double>* mu_out = nullptr) {
  std::vector<double> mu(d, 0.0);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) mu[c] += keys[size_t(i) * d + c];
  for (double& x : mu) x /= n;
  MatD D(n, d);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) D(i, c) = double(keys[size_t(i) * d + c]) - mu[c];
  if (mu_out) *mu_out = mu;
  return D;
}

// Eigenvalues of D D^T, descending (Eigen's reference solver).
std::vector<double> gram_eigenvalues(const MatD& D) {
  const Eigen::MatrixXd gram = D * D.transpose();
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(gram);
  std::vector<double> w(es.eigenvalues().data(), es.eigenvalues().data() + gram.rows());
  std::sort(w.rbegin(), w.rend());
  return w;
}

double tail_ref(const std::vector<double>& w, int r) {
  double t = 0.0;
  for (size_t k = r; k < w.size(); ++k) t += std::max(w[k], 0.0);
  return t;
}

double frob2(const MatD& D) { return D.squaredNorm(); }

// A page of n keys: offset + sum_{k < true_rank} a_ik b_k + noise * N(0, 1).
std::vector<float> make_page(std::mt19937& rng, int n, int d, int true_rank, double noise, double offset_scale = 1.0,
                             double amp = 2.0) {
  std::normal_distribution<double> N(0.0, 1.0);
  std::vector<double> off(d), dirs(size_t(true_rank) * d);
  for (auto& x : off) x = offset_scale * N(rng);
  for (auto& x : dirs) x = N(rng);
  std::vector<float> k(size_t(n) * d);
  for (int i = 0; i < n; ++i) {
    std::vector<double> a(true_rank);
    for (int t = 0; t < true_rank; ++t) a[t] = amp * N(rng) / (1.0 + t);  // decaying spectrum
    for (int c = 0; c < d; ++c) {
      double x = off[c] + noise * N(rng);
      for (int t = 0; t < true_rank; ++t) x += a[t] * dirs[size_t(t) * d + c];
      k[size_t(i) * d + c] = float(x);
    }
  }
  return k;
}

using test::randn;

bool column_nonzero(const PageSummaryF32& s, int k, int d) {
  for (int c = 0; c < d; ++c)
    if (s.basis[size_t(k) * d + c] != 0.0f) return true;
  return false;
}

// ||q_perp|| where q_perp = q - V V^T q over the basis columns (float64).
double q_perp_norm(const PageSummaryF32& s, const float* q, int d) {
  const int r = int(s.basis.size()) / d;
  std::vector<double> qp(q, q + d);
  for (int k = 0; k < r; ++k) {
    double w = 0.0;
    for (int c = 0; c < d; ++c) w += double(q[c]) * s.basis[size_t(k) * d + c];
    for (int c = 0; c < d; ++c) qp[c] -= w * s.basis[size_t(k) * d + c];
  }
  double n2 = 0.0;
  for (double x : qp) n2 += x * x;
  return std::sqrt(n2);
}

// Checks V V^T = I_r on the nonzero columns, zero coefficients for zero columns, c_i = V^T delta_i,
// centroid = mean, sigma2 = eig(D D^T), tail = sum of dropped eigenvalues = ||D||^2 - ||C||^2.
void check_summary_structure(const std::vector<float>& keys, int n, int d, int r, const PageSummaryF32& s) {
  SCOPED_TRACE(testing::Message() << "n=" << n << " d=" << d << " r=" << r);
  std::vector<double> mu;
  const MatD D = centered(keys.data(), n, d, &mu);
  const double dn2 = frob2(D);
  const double key_scale = std::max(1.0, D.cwiseAbs().maxCoeff());
  ASSERT_EQ(s.centroid.size(), size_t(d));
  ASSERT_EQ(s.basis.size(), size_t(r) * d);
  ASSERT_EQ(s.coef.size(), size_t(n) * r);
  for (int c = 0; c < d; ++c) EXPECT_NEAR(s.centroid[c], mu[c], 1e-6 * (1.0 + std::abs(mu[c])));

  // Orthonormal nonzero columns.
  for (int a = 0; a < r; ++a) {
    if (!column_nonzero(s, a, d)) {
      for (int i = 0; i < n; ++i) EXPECT_EQ(s.coef[size_t(i) * r + a], 0.0f) << "zero column " << a << " row " << i;
      continue;
    }
    for (int b = 0; b < r; ++b) {
      if (!column_nonzero(s, b, d)) continue;
      double dot = 0.0;
      for (int c = 0; c < d; ++c) dot += double(s.basis[size_t(a) * d + c]) * s.basis[size_t(b) * d + c];
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 2e-5) << "columns " << a << ", " << b;
    }
  }
  // c_i = V^T delta_i.
  double c2 = 0.0;
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < r; ++k) {
      double want = 0.0;
      for (int c = 0; c < d; ++c) want += double(s.basis[size_t(k) * d + c]) * D(i, c);
      const double got = s.coef[size_t(i) * r + k];
      EXPECT_NEAR(got, want, 2e-5 * key_scale * std::sqrt(double(d))) << "c[" << i << "][" << k << "]";
      c2 += got * got;
    }
  // Spectrum and tail.
  const std::vector<double> w = gram_eigenvalues(D);
  ASSERT_EQ(s.sigma2.size(), size_t(n));
  for (int k = 0; k < n; ++k) EXPECT_NEAR(s.sigma2[k], std::max(w[k], 0.0), 1e-6 * (w[0] + 1e-30)) << "sigma2 " << k;
  const double dropped = tail_ref(w, std::min(r, n));
  EXPECT_NEAR(s.tail, dropped, 1e-6 * dn2 + 1e-12) << "tail vs sum of dropped eigenvalues";
  EXPECT_NEAR(s.tail, dn2 - c2, 2e-6 * dn2 + 1e-12) << "tail vs ||D||^2 - ||C||^2";
}

}  // namespace

// =============================================================================================
// sym_eigen_jacobi
// =============================================================================================

namespace {
void check_eigen_decomposition(int n, const std::vector<double>& A, const std::vector<double>& w,
                               const std::vector<double>& u, double tol) {
  for (double x : w) ASSERT_TRUE(std::isfinite(x));
  for (double x : u) ASSERT_TRUE(std::isfinite(x));
  for (int k = 0; k + 1 < n; ++k) EXPECT_GE(w[k], w[k + 1]) << "eigenvalues not descending at " << k;
  Eigen::Map<const MatD> Am(A.data(), n, n), Um(u.data(), n, n);
  const MatD UtU = Um.transpose() * Um;
  EXPECT_LT((UtU - MatD::Identity(n, n)).cwiseAbs().maxCoeff(), 1e-12) << "U not orthonormal";
  MatD W = MatD::Zero(n, n);
  for (int k = 0; k < n; ++k) W(k, k) = w[k];
  const MatD R = Um.transpose() * Am * Um - W;
  EXPECT_LT(R.cwiseAbs().maxCoeff(), tol) << "|U^T A U - diag(w)|";
}
}  // namespace

TEST(SymEigen, RandomSymmetric16MatchesEigen) {
  std::mt19937 rng(11);
  std::normal_distribution<double> N(0.0, 1.0);
  for (int trial = 0; trial < 50; ++trial) {
    const int n = 16;
    std::vector<double> A(n * n);
    for (int i = 0; i < n; ++i)
      for (int j = i; j < n; ++j) A[i * n + j] = A[j * n + i] = N(rng) * (trial % 5 == 0 ? 1e4 : 1.0);
    std::vector<double> w(n), u(n * n);
    sym_eigen_jacobi(n, A.data(), w.data(), u.data());
    Eigen::Map<const MatD> Am(A.data(), n, n);
    const Eigen::MatrixXd Ad = Am;
    Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(Ad);
    const double norm = es.eigenvalues().cwiseAbs().maxCoeff();
    for (int k = 0; k < n; ++k) EXPECT_NEAR(w[k], es.eigenvalues()[n - 1 - k], 1e-12 * norm) << "trial " << trial;
    check_eigen_decomposition(n, A, w, u, 1e-12 * norm);
  }
}

TEST(SymEigen, GramMatricesOfPagesMatchEigen) {
  // PSD rank-deficient matrices as Algorithm 1 produces them (16 keys of d = 64, rank 5).
  std::mt19937 rng(12);
  for (int trial = 0; trial < 20; ++trial) {
    const auto keys = make_page(rng, 16, 64, 5, 0.0);
    const MatD D = centered(keys.data(), 16, 64);
    const MatD G = D * D.transpose();
    std::vector<double> A(G.data(), G.data() + 256), w(16), u(256);
    sym_eigen_jacobi(16, A.data(), w.data(), u.data());
    const std::vector<double> ref = gram_eigenvalues(D);
    for (int k = 0; k < 16; ++k) EXPECT_NEAR(w[k], ref[k], 1e-12 * ref[0]);
    check_eigen_decomposition(16, A, w, u, 1e-12 * ref[0]);
  }
}

TEST(SymEigen, ZeroMatrixGivesZerosAndOrthonormalVectors) {
  for (int n : {1, 2, 16, 32}) {
    std::vector<double> A(n * n, 0.0), w(n, 7.0), u(n * n, 7.0);
    sym_eigen_jacobi(n, A.data(), w.data(), u.data());
    for (int k = 0; k < n; ++k) EXPECT_EQ(w[k], 0.0);
    check_eigen_decomposition(n, A, w, u, 1e-300);
  }
}

TEST(SymEigen, RepeatedEigenvalues) {
  std::mt19937 rng(13);
  std::normal_distribution<double> N(0.0, 1.0);
  const int n = 16;
  // Spectrum with multiplicities: 5 (x4), 2 (x5), 0 (x3), -1 (x4).
  std::vector<double> spec;
  for (int i = 0; i < 4; ++i) spec.push_back(5.0);
  for (int i = 0; i < 5; ++i) spec.push_back(2.0);
  for (int i = 0; i < 3; ++i) spec.push_back(0.0);
  for (int i = 0; i < 4; ++i) spec.push_back(-1.0);
  for (int trial = 0; trial < 10; ++trial) {
    Eigen::MatrixXd X(n, n);
    for (int i = 0; i < n * n; ++i) X.data()[i] = N(rng);
    const Eigen::MatrixXd Q = Eigen::HouseholderQR<Eigen::MatrixXd>(X).householderQ();
    Eigen::VectorXd sv = Eigen::Map<Eigen::VectorXd>(spec.data(), n);
    const MatD A = Q * sv.asDiagonal() * Q.transpose();
    MatD As = 0.5 * (A + A.transpose());
    std::vector<double> Av(As.data(), As.data() + n * n), w(n), u(n * n);
    sym_eigen_jacobi(n, Av.data(), w.data(), u.data());
    std::vector<double> want = spec;
    std::sort(want.rbegin(), want.rend());
    for (int k = 0; k < n; ++k) EXPECT_NEAR(w[k], want[k], 1e-12);
    check_eigen_decomposition(n, Av, w, u, 1e-12);
    // Eigenvectors of the repeated value 5 span the same space as Q's first 4 columns.
    Eigen::Map<const MatD> Um(u.data(), n, n);
    const Eigen::MatrixXd P = Um.leftCols(4) * Um.leftCols(4).transpose();
    const Eigen::MatrixXd Pw = Q.leftCols(4) * Q.leftCols(4).transpose();
    EXPECT_LT((P - Pw).cwiseAbs().maxCoeff(), 1e-10);
  }
}

TEST(SymEigen, DiagonalInputIsExact) {
  const int n = 16;
  std::mt19937 rng(14);
  std::uniform_real_distribution<double> U(-10.0, 10.0);
  std::vector<double> A(n * n, 0.0), diag(n);
  for (int i = 0; i < n; ++i) A[i * n + i] = diag[i] = U(rng);
  A[3 * n + 3] = diag[3] = diag[7];  // one repeated value
  std::vector<double> w(n), u(n * n);
  sym_eigen_jacobi(n, A.data(), w.data(), u.data());
  std::vector<double> want = diag;
  std::sort(want.rbegin(), want.rend());
  for (int k = 0; k < n; ++k) EXPECT_EQ(w[k], want[k]);
  // Eigenvectors are unit vectors: column k is e_i with diag[i] == w[k], each e_i used once.
  std::vector<int> used(n, 0);
  for (int k = 0; k < n; ++k) {
    int hot = -1;
    for (int i = 0; i < n; ++i) {
      const double x = u[i * n + k];
      if (x != 0.0) {
        EXPECT_EQ(std::abs(x), 1.0);
        EXPECT_EQ(hot, -1) << "column " << k << " has more than one nonzero";
        hot = i;
      }
    }
    ASSERT_GE(hot, 0);
    EXPECT_EQ(diag[hot], w[k]);
    used[hot]++;
  }
  for (int i = 0; i < n; ++i) EXPECT_EQ(used[i], 1);
}

// =============================================================================================
// build_page_summary (Algorithm 1)
// =============================================================================================

TEST(PageSummary, StructureOnRandomPages) {
  std::mt19937 rng(21);
  for (int d : {64, 128}) {
    for (int r : {1, 2, 4, 8, 16}) {
      for (int trial = 0; trial < 4; ++trial) {
        const auto keys = make_page(rng, 16, d, 12, 0.3, 2.0);
        const PageSummaryF32 s = build_page_summary(keys.data(), 16, d, r);
        check_summary_structure(keys, 16, d, r, s);
        // Noisy page: centered keys have full rank B - 1 = 15, so every kept column below it is nonzero
        // and a 16th column (rank 16) is zero (the centering removes one dimension).
        for (int k = 0; k < r; ++k) EXPECT_EQ(column_nonzero(s, k, d), k < 15) << "r=" << r << " column " << k;
      }
    }
  }
}

TEST(PageSummary, LowRankPagesAreExact) {
  std::mt19937 rng(22);
  const int d = 64;
  for (int r : {4, 8}) {
    for (int true_rank : {1, 3, r}) {
      for (int trial = 0; trial < 5; ++trial) {
        SCOPED_TRACE(testing::Message() << "r=" << r << " rank=" << true_rank << " trial=" << trial);
        const auto keys = make_page(rng, 16, d, true_rank, 0.0, 1.0, 3.0);
        const PageSummaryF32 s = build_page_summary(keys.data(), 16, d, r);
        check_summary_structure(keys, 16, d, r, s);
        const MatD D = centered(keys.data(), 16, d);
        EXPECT_LE(s.tail, 1e-9 * frob2(D)) << "rank <= r must leave no tail";
        // Reconstruction mu + V c_i = k_i.
        for (int i = 0; i < 16; ++i)
          for (int c = 0; c < d; ++c) {
            double x = s.centroid[c];
            for (int k = 0; k < r; ++k) x += double(s.coef[size_t(i) * r + k]) * s.basis[size_t(k) * d + c];
            EXPECT_NEAR(x, keys[size_t(i) * d + c], 2e-5 * (1.0 + std::abs(keys[size_t(i) * d + c])));
          }
        // s_hat == s for random queries.
        for (int t = 0; t < 10; ++t) {
          const auto q = randn(rng, d, 1.5);
          const float scale = 1.0f / std::sqrt(float(d));
          const double want = ref_lse(keys.data(), 16, q.data(), d, scale);
          EXPECT_NEAR(summary_log_mass(s, q.data(), d, scale), want, 1e-4 * (1.0 + std::abs(want)));
          EXPECT_NEAR(exact_log_mass(keys.data(), 16, q.data(), d, scale), want, 1e-5 * (1.0 + std::abs(want)));
        }
      }
    }
  }
}

TEST(PageSummary, IdenticalKeysGiveFiniteExactSummary) {
  std::mt19937 rng(23);
  const int d = 64;
  for (int r : {1, 8, 16}) {
    const auto one = randn(rng, d, 3.0);
    std::vector<float> keys;
    for (int i = 0; i < 16; ++i) keys.insert(keys.end(), one.begin(), one.end());
    const PageSummaryF32 s = build_page_summary(keys.data(), 16, d, r);
    for (int c = 0; c < d; ++c) EXPECT_FLOAT_EQ(s.centroid[c], one[c]);
    for (float x : s.basis) EXPECT_EQ(x, 0.0f);
    for (float x : s.coef) EXPECT_EQ(x, 0.0f);
    for (float x : s.sigma2) EXPECT_EQ(x, 0.0f);
    EXPECT_EQ(s.tail, 0.0f);
    for (int t = 0; t < 5; ++t) {
      const auto q = randn(rng, d);
      const float scale = 0.125f;
      // All 16 logits equal: s = q.k * scale + log 16.
      double qk = 0.0;
      for (int c = 0; c < d; ++c) qk += double(q[c]) * one[c];
      const double want = qk * scale + std::log(16.0);
      const float got = summary_log_mass(s, q.data(), d, scale);
      ASSERT_TRUE(std::isfinite(got));
      EXPECT_NEAR(got, want, 1e-5 * (1.0 + std::abs(want)));
      EXPECT_NEAR(exact_log_mass(keys.data(), 16, q.data(), d, scale), want, 1e-5 * (1.0 + std::abs(want)));
    }
  }
  // All-zero keys too.
  std::vector<float> zeros(16 * d, 0.0f);
  const PageSummaryF32 z = build_page_summary(zeros.data(), 16, d, 8);
  const auto q = randn(rng, d);
  EXPECT_NEAR(summary_log_mass(z, q.data(), d, 0.125f), std::log(16.0), 1e-6);
}

TEST(PageSummary, ShortPages) {
  std::mt19937 rng(24);
  const int d = 64;
  for (int n : {1, 2, 5, 9, 12, 15}) {
    for (int r : {4, 8}) {
      SCOPED_TRACE(testing::Message() << "n=" << n << " r=" << r);
      const auto keys = make_page(rng, n, d, 16, 0.5);
      const PageSummaryF32 s = build_page_summary(keys.data(), n, d, r);
      check_summary_structure(keys, n, d, r, s);
      const float scale = 1.0f / std::sqrt(float(d));
      for (int t = 0; t < 5; ++t) {
        const auto q = randn(rng, d);
        const double want = ref_lse(keys.data(), n, q.data(), d, scale);
        const double got = summary_log_mass(s, q.data(), d, scale);
        ASSERT_TRUE(std::isfinite(got));
        // n keys centered have rank <= n - 1: exact when n - 1 <= r, else the Eq. 7 bound.
        if (n - 1 <= r) {
          EXPECT_NEAR(got, want, 1e-4 * (1.0 + std::abs(want)));
        } else {
          const double bound = q_perp_norm(s, q.data(), d) * std::sqrt(double(s.tail)) * scale;
          EXPECT_LE(std::abs(got - want), bound + 1e-5 * (1.0 + std::abs(want)));
        }
      }
    }
  }
}

TEST(PageSummary, NonFiniteKeysThrow) {
  std::mt19937 rng(25);
  const int d = 64;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    for (int where : {0, 5 * d + 17, 16 * d - 1}) {
      auto keys = randn(rng, 16 * d);
      keys[where] = bad;
      EXPECT_THROW(build_page_summary(keys.data(), 16, d, 8), std::invalid_argument)
          << "bad=" << bad << " at " << where;
    }
  }
}

TEST(PageSummary, BadArgumentsThrow) {
  std::mt19937 rng(26);
  const int d = 64;
  const auto keys = randn(rng, 16 * d);
  EXPECT_THROW(build_page_summary(nullptr, 16, d, 8), std::invalid_argument);
  for (int rank : {0, -1, 33, 65}) EXPECT_THROW(build_page_summary(keys.data(), 16, d, rank), std::invalid_argument);
  for (int n : {0, 33}) EXPECT_THROW(build_page_summary(keys.data(), n, d, 8), std::invalid_argument);
  for (int dd : {0, 257}) EXPECT_THROW(build_page_summary(keys.data(), 1, dd, 8), std::invalid_argument);
  // The largest page (32 rows) and rank: valid.
  const auto big = randn(rng, 32 * d);
  const PageSummaryF32 s = build_page_summary(big.data(), 32, d, 32);
  EXPECT_EQ(s.basis.size(), size_t(32) * d);
}

TEST(PageSummary, SummaryLogMassMatchesFloat64Eq4) {
  std::mt19937 rng(26);
  for (int d : {64, 128}) {
    for (int r : {2, 8}) {
      const auto keys = make_page(rng, 16, d, 10, 0.5, 3.0);
      const PageSummaryF32 s = build_page_summary(keys.data(), 16, d, r);
      for (int t = 0; t < 10; ++t) {
        const auto q = randn(rng, d, 2.0);
        const float scale = 1.0f / std::sqrt(float(d));
        const double want = ref_summary_lse(s, q.data(), d, scale);
        EXPECT_NEAR(summary_log_mass(s, q.data(), d, scale), want, 1e-5 * (1.0 + std::abs(want)));
      }
    }
  }
}

// =============================================================================================
// Eq. 7: |s_hat_j(q) - s_j(q)| <= ||q_perp|| sqrt(tau_{j,r}) / sqrt(d)
// =============================================================================================

namespace {
// Returns the largest ratio eta / bound seen (for the caller's sanity checks).
double check_eq7_page(const float* keys, int d, int r, const std::vector<std::vector<float>>& queries,
                      bool use_ref_tail) {
  const PageSummaryF32 s = build_page_summary(keys, 16, d, r);
  double tau = s.tail;
  if (use_ref_tail) tau = tail_ref(gram_eigenvalues(centered(keys, 16, d)), r);
  const double scale = 1.0 / std::sqrt(double(d));
  double worst = 0.0;
  for (const auto& q : queries) {
    const double s_exact = ref_lse(keys, 16, q.data(), d, scale);
    const double s_hat = summary_log_mass(s, q.data(), d, float(scale));
    const double eta = std::abs(s_hat - s_exact);
    const double bound = q_perp_norm(s, q.data(), d) * std::sqrt(tau) * scale;
    EXPECT_LE(eta, bound + 2e-5 * (1.0 + std::abs(s_exact))) << "r=" << r << " d=" << d;
    if (bound > 1e-3) worst = std::max(worst, eta / bound);
  }
  return worst;
}
}  // namespace

TEST(PageSummary, Eq7BoundOnStructuredRandomPages) {
  std::mt19937 rng(31);
  double worst = 0.0;
  for (int d : {64, 128}) {
    for (int page = 0; page < 60; ++page) {
      const int true_rank = 2 + page % 10;
      const double noise = page % 3 == 0 ? 0.05 : (page % 3 == 1 ? 0.3 : 1.0);
      const auto keys = make_page(rng, 16, d, true_rank, noise, 2.0);
      std::vector<std::vector<float>> queries;
      for (int t = 0; t < 8; ++t) queries.push_back(randn(rng, d, 1.0 + t));
      // Queries aligned with a key (large logits): the regime where selection matters.
      for (int t = 0; t < 4; ++t) {
        std::vector<float> q(keys.begin() + size_t(t * 3) * d, keys.begin() + size_t(t * 3 + 1) * d);
        for (auto& x : q) x *= 2.0f;
        queries.push_back(q);
      }
      for (int r : {2, 4, 8}) worst = std::max(worst, check_eq7_page(keys.data(), d, r, queries, page % 2 == 0));
    }
  }
  // The bound is a worst case; it should not be loose by orders of magnitude everywhere.
  EXPECT_GT(worst, 0.01) << "Eq. 7 never came close to binding: suspicious test data";
}

namespace {
// The reference model, prefilled with ~300 tokens of examples/haystack.txt into an f32 cache.
struct RealPages {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Session> session;
  std::vector<int32_t> tokens;
};

const RealPages& real_pages() {
  static RealPages rp = [] {
    RealPages r;
    r.model = std::make_unique<LlamaModel>(LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf")));
    std::ifstream in(test::source_path("examples/haystack.txt"));
    std::stringstream ss;
    ss << in.rdbuf();
    auto ids = r.model->tokenizer.encode(ss.str().substr(0, 4000), true);
    if (ids.size() > 300) ids.resize(300);
    r.tokens = ids;
    SessionConfig sc;
    sc.kv_dtype = KvDtype::F32;
    sc.n_ctx = 512;
    r.session = std::make_unique<Session>(*r.model, sc);
    r.session->prefill(ids);
    return r;
  }();
  return rp;
}
}  // namespace

namespace {
// Eq. 7 on every other full page of every (layer, KV head) of a prefilled f32 cache; returns the
// largest eta / bound seen.
double check_eq7_on_real_pages(const RealPages& rp) {
  const PagedKvCache& cache = rp.session->cache();
  const KvSequence& seq = rp.session->sequence();
  const auto& cfg = cache.config();
  const int d = cfg.head_dim, B = cfg.page_size;
  EXPECT_GE(seq.n_tokens, 250);
  const int n_full = seq.n_tokens / B;
  std::mt19937 rng(32);
  std::vector<float> keys(size_t(B) * d), later(size_t(B) * d);
  double worst = 0.0;
  int checked = 0;
  for (int il = 0; il < cfg.n_layer; ++il) {
    for (int h = 0; h < cfg.n_head_kv; ++h) {
      for (int j = 0; j < n_full; j += 2) {
        cache.k_page_f32(il, seq.page_table[j], h, keys.data());
        // Queries: keys of later tokens (real post-RoPE vectors of this head) and random ones.
        std::vector<std::vector<float>> queries;
        const int jl = std::min(n_full - 1, j + 3);
        cache.k_page_f32(il, seq.page_table[jl], (h + 1) % cfg.n_head_kv, later.data());
        for (int t = 0; t < B; t += 5)
          queries.emplace_back(later.begin() + size_t(t) * d, later.begin() + size_t(t + 1) * d);
        for (int t = 0; t < 3; ++t) queries.push_back(randn(rng, d, 2.0));
        for (int r : {2, 4, 8}) {
          worst = std::max(worst, check_eq7_page(keys.data(), d, r, queries, false));
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
  return worst;
}
}  // namespace

TEST(PageSummary, Eq7BoundOnRealModelPages) {
  const double worst = check_eq7_on_real_pages(real_pages());
  RecordProperty("worst_eta_over_bound", std::to_string(worst));
  EXPECT_GT(worst, 0.01) << "Eq. 7 never came close to binding on real pages: suspicious";
}

// The same on the keys of the llama (Llama-3.1 RoPE scaling) and qwen2 (biases, NEOX RoPE) family
// models: LOCKS's bound does not depend on the family.
class PageSummaryFamilies : public ::testing::TestWithParam<const char*> {};

TEST_P(PageSummaryFamilies, Eq7BoundOnModelPages) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  RealPages rp;
  rp.model = std::make_unique<LlamaModel>(test::load_family_model(GetParam()));
  rp.tokens = test::family_prompt_ids(GetParam());
  rp.tokens.resize(std::min<size_t>(rp.tokens.size(), 300));
  SessionConfig sc;
  sc.kv_dtype = KvDtype::F32;
  sc.n_ctx = 512;
  rp.session = std::make_unique<Session>(*rp.model, sc);
  rp.session->prefill(rp.tokens);
  const double worst = check_eq7_on_real_pages(rp);
  RecordProperty("worst_eta_over_bound", std::to_string(worst));
  EXPECT_GT(worst, 0.01) << "Eq. 7 never came close to binding on real pages: suspicious";
}

INSTANTIATE_TEST_SUITE_P(Shared, PageSummaryFamilies, ::testing::ValuesIn(test::kFamilyModels),
                         [](const auto& p) { return test::family_test_name(p.param); });

// =============================================================================================
// PageSummaryStore: quantized storage
// =============================================================================================

namespace {
// Checks that `got` is `want` quantized symmetrically with one scale over the group and `qm` levels:
// the scale is recovered from the largest code (= qm for the largest |want|), all values are integer
// multiples of it, and |err| <= scale / 2.
void check_symmetric_group(const float* want, const float* got, int n, int qm, const char* what) {
  SCOPED_TRACE(what);
  double amax = 0.0, gmax = 0.0;
  for (int i = 0; i < n; ++i) {
    amax = std::max(amax, double(std::abs(want[i])));
    gmax = std::max(gmax, double(std::abs(got[i])));
  }
  for (int i = 0; i < n; ++i) ASSERT_TRUE(std::isfinite(got[i]));
  if (amax == 0.0) {
    for (int i = 0; i < n; ++i) EXPECT_EQ(got[i], 0.0f) << "zero group must dequantize to exact zeros";
    return;
  }
  const double scale = gmax / qm;  // the largest element maps to code +-qm
  // The f16 scale is within 2^-11 (relative) of amax / qm.
  EXPECT_NEAR(scale, amax / qm, amax / qm * 1.0 / 1024.0);
  for (int i = 0; i < n; ++i) {
    const double code = got[i] / scale;
    EXPECT_NEAR(code, std::round(code), 1e-3) << "element " << i << " is not on the quantization grid";
    EXPECT_LE(std::abs(code), qm + 1e-3);
    EXPECT_LE(std::abs(double(got[i]) - want[i]), scale / 2 * (1.0 + 1e-3) + 1e-12) << "element " << i;
  }
}

PageSummaryF32 random_summary(std::mt19937& rng, int d, int r) {
  const auto keys = make_page(rng, 16, d, 12, 0.5, 3.0);
  return build_page_summary(keys.data(), 16, d, r);
}
}  // namespace

TEST(PageSummary, StoreUnquantizedRoundTripIsExact) {
  std::mt19937 rng(41);
  const int d = 128, r = 8;
  PageSummaryStore store(SummaryFormat::unquantized(r), 2, 2, 5, 16, d);
  const PageSummaryF32 s = random_summary(rng, d, r);
  EXPECT_FALSE(store.has(1, 1, 3));
  store.store(1, 1, 3, s);
  EXPECT_TRUE(store.has(1, 1, 3));
  EXPECT_FALSE(store.has(1, 0, 3));
  EXPECT_FALSE(store.has(0, 1, 3));
  EXPECT_FALSE(store.has(1, 1, 2));
  const PageSummaryF32 l = store.load(1, 1, 3);
  EXPECT_EQ(l.basis, s.basis);
  EXPECT_EQ(l.coef, s.coef);
  EXPECT_EQ(l.centroid, s.centroid);
  EXPECT_EQ(l.tail, s.tail);
  store.clear(1, 1, 3);
  EXPECT_FALSE(store.has(1, 1, 3));
}

TEST(PageSummary, StoreQuantizationErrorBounds) {
  std::mt19937 rng(42);
  const int d = 128, r = 8;
  for (int basis_bits : {8, 4, 2}) {
    SummaryFormat fmt{r, basis_bits, 8, 8};
    PageSummaryStore store(fmt, 1, 2, 4, 16, d);
    for (int page = 0; page < 4; ++page) {
      const PageSummaryF32 s = random_summary(rng, d, r);
      store.store(0, page % 2, page, s);
      const PageSummaryF32 l = store.load(0, page % 2, page);
      const int qb = (1 << (basis_bits - 1)) - 1;
      for (int k = 0; k < r; ++k)
        check_symmetric_group(&s.basis[size_t(k) * d], &l.basis[size_t(k) * d], d, qb, "basis column");
      for (int i = 0; i < 16; ++i)
        check_symmetric_group(&s.coef[size_t(i) * r], &l.coef[size_t(i) * r], r, 127, "coef row");
      check_symmetric_group(s.centroid.data(), l.centroid.data(), d, 127, "centroid");
    }
  }
}

TEST(PageSummary, StoreBf16BasisRelativeError) {
  std::mt19937 rng(43);
  const int d = 64, r = 8;
  PageSummaryStore store(SummaryFormat{r, 16, 32, 32}, 1, 1, 1, 16, d);
  const PageSummaryF32 s = random_summary(rng, d, r);
  store.store(0, 0, 0, s);
  const PageSummaryF32 l = store.load(0, 0, 0);
  for (size_t i = 0; i < s.basis.size(); ++i)
    EXPECT_LE(std::abs(double(l.basis[i]) - s.basis[i]), std::ldexp(std::abs(double(s.basis[i])), -8)) << i;
  EXPECT_EQ(l.coef, s.coef);          // f32 coefficients untouched
  EXPECT_EQ(l.centroid, s.centroid);  // f32 centroid untouched
}

TEST(PageSummary, StoreZeroGroupsAreExactZeros) {
  std::mt19937 rng(44);
  const int d = 64, r = 8;
  // Rank-1 page: basis columns 1..7 and their coefficients are zero; zero keys: zero centroid.
  for (int basis_bits : {16, 8, 4, 2}) {
    PageSummaryStore store(SummaryFormat{r, basis_bits, 8, 8}, 1, 1, 2, 16, d);
    const auto keys = make_page(rng, 16, d, 1, 0.0, 0.0);
    std::vector<float> zkeys(16 * d, 0.0f);
    std::vector<float> ident;
    const auto one = randn(rng, d);
    for (int i = 0; i < 16; ++i) ident.insert(ident.end(), one.begin(), one.end());
    const PageSummaryF32 s1 = build_page_summary(keys.data(), 16, d, r);
    const PageSummaryF32 s0 = build_page_summary(zkeys.data(), 16, d, r);
    store.store(0, 0, 0, s1);
    store.store(0, 0, 1, s0);
    const PageSummaryF32 l1 = store.load(0, 0, 0), l0 = store.load(0, 0, 1);
    for (int k = 1; k < r; ++k)
      for (int c = 0; c < d; ++c) EXPECT_EQ(l1.basis[size_t(k) * d + c], 0.0f);
    for (int i = 0; i < 16; ++i)
      for (int k = 1; k < r; ++k) EXPECT_EQ(l1.coef[size_t(i) * r + k], 0.0f);
    for (float x : l0.basis) EXPECT_EQ(x, 0.0f);
    for (float x : l0.coef) EXPECT_EQ(x, 0.0f);
    for (float x : l0.centroid) EXPECT_EQ(x, 0.0f);
    // Scores stay finite: zero page gives log 16 exactly (16 equal zero logits).
    const auto q = randn(rng, 4 * d);
    float out[4];
    store.score(0, 0, 1, q.data(), 4, 0.125f, out);
    for (float x : out) EXPECT_NEAR(x, std::log(16.0), 1e-5);
    // Identical nonzero keys: exact except for the int8 centroid.
    store.store(0, 0, 1, build_page_summary(ident.data(), 16, d, r));
    store.score(0, 0, 1, q.data(), 4, 0.125f, out);
    const PageSummaryF32 li = store.load(0, 0, 1);
    for (int g = 0; g < 4; ++g) {
      ASSERT_TRUE(std::isfinite(out[g]));
      double qmu = 0.0;
      for (int c = 0; c < d; ++c) qmu += double(q[size_t(g) * d + c]) * li.centroid[c];
      EXPECT_NEAR(out[g], qmu * 0.125 + std::log(16.0), 1e-4 * (1.0 + std::abs(qmu)));
    }
  }
}

TEST(PageSummary, StoreScoreMatchesLoadedSummary) {
  std::mt19937 rng(45);
  const std::vector<SummaryFormat> formats = {
      SummaryFormat{8, 4, 8, 8},     SummaryFormat{8, 16, 8, 32}, SummaryFormat{4, 2, 8, 8}, SummaryFormat{8, 8, 32, 8},
      SummaryFormat::unquantized(8), SummaryFormat{16, 4, 8, 8},  SummaryFormat{1, 4, 8, 8}};
  for (const auto& fmt : formats) {
    for (int d : {64, 128}) {
      SCOPED_TRACE(fmt.describe() + " d=" + std::to_string(d));
      const int r = fmt.rank;
      PageSummaryStore store(fmt, 2, 3, 6, 16, d);
      for (int t = 0; t < 6; ++t) {
        const int il = t % 2, h = t % 3;
        const PageSummaryF32 s = random_summary(rng, d, r);
        store.store(il, h, t, s);
        const PageSummaryF32 l = store.load(il, h, t);
        for (int G : {1, 4, 7, 100}) {  // 100: more heads than one pass holds (slices of 64)
          std::vector<float> q = randn(rng, size_t(G) * d, 1.5);
          std::vector<float> out(G);
          const float scale = 1.0f / std::sqrt(float(d));
          store.score(il, h, t, q.data(), G, scale, out.data());
          for (int g = 0; g < G; ++g) {
            const double want = ref_summary_lse(l, &q[size_t(g) * d], d, scale);
            EXPECT_NEAR(out[g], want, 1e-4 * (1.0 + std::abs(want))) << "G=" << G << " g=" << g;
            EXPECT_NEAR(summary_log_mass(l, &q[size_t(g) * d], d, scale), want, 1e-5 * (1.0 + std::abs(want)));
          }
        }
      }
    }
  }
}

TEST(PageSummary, StoreScoreOfShortPageMatchesItsSummary) {
  // A summary of a page shorter than B (n_tok rows) is accepted by store(); its score must be the
  // Eq. 4 log-sum-exp over those n_tok tokens, not over B rows padded with zero coefficients.
  std::mt19937 rng(46);
  const int d = 64, r = 8;
  for (const auto& fmt : {SummaryFormat::unquantized(r), SummaryFormat{r, 4, 8, 8}}) {
    PageSummaryStore store(fmt, 1, 1, 1, 16, d);
    for (int n : {1, 5, 9}) {
      const auto keys = make_page(rng, n, d, 16, 0.5, 2.0);
      const PageSummaryF32 s = build_page_summary(keys.data(), n, d, r);
      try {
        store.store(0, 0, 0, s);
      } catch (const std::invalid_argument&) {
        continue;  // rejecting short summaries is an acceptable contract; scoring them wrongly is not
      }
      const auto q = randn(rng, d);
      const float scale = 0.125f;
      float out = 0.0f;
      store.score(0, 0, 0, q.data(), 1, scale, &out);
      // Reference: the dequantized summary restricted to its n token rows.
      PageSummaryF32 l = store.load(0, 0, 0);
      l.coef.resize(size_t(n) * r);
      const double want = ref_summary_lse(l, q.data(), d, scale);
      EXPECT_NEAR(out, want, 1e-4 * (1.0 + std::abs(want))) << fmt.describe() << " n=" << n;
      if (fmt.basis_bits == 32) {
        const double exact = ref_lse(keys.data(), n, q.data(), d, scale);  // n - 1 <= r: exact
        EXPECT_NEAR(out, exact, 1e-4 * (1.0 + std::abs(exact))) << " n=" << n;
      }
    }
  }
}

TEST(PageSummary, StoreRejectsScaleOverflow) {
  const int d = 64, r = 8;
  PageSummaryStore store(SummaryFormat{r, 4, 8, 8}, 1, 1, 1, 16, d);
  std::vector<float> keys(16 * d, 2e7f);  // centroid 2e7: int8 scale 2e7/127 > f16 max
  const PageSummaryF32 s = build_page_summary(keys.data(), 16, d, r);
  EXPECT_THROW(store.store(0, 0, 0, s), std::invalid_argument);
}

TEST(PageSummary, FormatBytesAndValidation) {
  // Shipped point: r = 8, int4 basis, int8 coefficients and centroid, d = 128, B = 16.
  const int r = 8, d = 128, B = 16;
  const size_t payload = size_t(r) * d * 4 / 8 + size_t(B) * r + size_t(d);  // 512 + 128 + 128
  const size_t scales = 2 * size_t(r + B + 1);                               // f16 scales
  EXPECT_EQ(payload, 768u);
  const SummaryFormat shipped;
  EXPECT_EQ(shipped.rank, 8);
  EXPECT_EQ(shipped.basis_bits, 4);
  EXPECT_EQ(shipped.bytes(B, d), payload + scales);
  EXPECT_EQ(shipped.bytes(B, d), 818u);
  // Relative to bf16 K+V of the page: 8192 bytes, about 10% with scales (Sec. 3).
  EXPECT_NEAR(double(shipped.bytes(B, d)) / (2.0 * B * d * 2), 0.1, 0.005);
  EXPECT_EQ(PageSummaryStore(shipped, 1, 1, 1, B, d).summary_bytes(), payload + scales);
  // Unquantized: everything f32, no scales.
  EXPECT_EQ(SummaryFormat::unquantized(r).bytes(B, d), 4 * (size_t(r) * d + size_t(B) * r + d));
  // int2 basis: r*d/4 bytes.
  EXPECT_EQ((SummaryFormat{4, 2, 8, 8}.bytes(B, 64)), size_t(4 * 64 / 4 + 2 * 4 + B * 4 + 2 * B + 64 + 2));
  // bf16 basis: 2 bytes per element, no scales.
  EXPECT_EQ((SummaryFormat{8, 16, 8, 8}.bytes(B, d)), size_t(8 * d * 2 + B * 8 + 2 * B + d + 2));

  EXPECT_NO_THROW(shipped.validate(B, d));
  EXPECT_THROW((SummaryFormat{0, 4, 8, 8}.validate(B, d)), std::invalid_argument);
  EXPECT_THROW((SummaryFormat{17, 4, 8, 8}.validate(B, d)), std::invalid_argument);
  EXPECT_THROW((SummaryFormat{-1, 4, 8, 8}.validate(B, d)), std::invalid_argument);
  EXPECT_THROW((SummaryFormat{8, 3, 8, 8}.validate(B, d)), std::invalid_argument);
  EXPECT_THROW((SummaryFormat{8, 4, 4, 8}.validate(B, d)), std::invalid_argument);
  EXPECT_THROW((SummaryFormat{8, 4, 8, 2}.validate(B, d)), std::invalid_argument);
  EXPECT_NO_THROW((SummaryFormat{16, 2, 8, 32}.validate(B, d)));
  EXPECT_THROW(PageSummaryStore(SummaryFormat{0, 4, 8, 8}, 1, 1, 1, B, d), std::invalid_argument);
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { PageSummaryStore(shipped, -1, 2, 16, B, d); }),
            "page summary store: -1 layers x 2 KV heads x 16 pages (each must be >= 1)");
  // Indices outside the store are named, never read.
  const PageSummaryStore store(shipped, 1, 2, 16, B, d);
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { (void)store.has(0, 0, 5000000); }),
            "page summary store: (layer 0, KV head 0, page id 5000000) outside [0, 1) x [0, 2) x [0, 16)");
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { (void)store.load(0, 2, 0); }),
            "page summary store: (layer 0, KV head 2, page id 0) outside [0, 1) x [0, 2) x [0, 16)");
  // A page with no stored summary is refused by load and score (it would read zeros: log B for every
  // query); stored, it scores; cleared, it is refused again.
  PageSummaryStore st(shipped, 1, 2, 16, B, d);
  std::vector<float> q(size_t(d), 0.5f);
  float out[1];
  EXPECT_EQ(test::error_of<std::logic_error>([&] { st.score(0, 1, 3, q.data(), 1, 0.125f, out); }),
            "page summary store: no summary stored for (layer 0, KV head 1, page id 3)");
  EXPECT_EQ(test::error_of<std::logic_error>([&] { (void)st.load(0, 1, 3); }),
            "page summary store: no summary stored for (layer 0, KV head 1, page id 3)");
  std::mt19937 rng(5);
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> keys(size_t(B) * d);
  for (auto& x : keys) x = N(rng);
  const PageSummaryF32 f = build_page_summary(keys.data(), B, d, shipped.rank);
  st.store(0, 1, 3, f);
  st.score(0, 1, 3, q.data(), 1, 0.125f, out);
  EXPECT_NEAR(out[0], summary_log_mass(st.load(0, 1, 3), q.data(), d, 0.125f), 1e-3f);
  st.clear(0, 1, 3);
  EXPECT_THROW(st.score(0, 1, 3, q.data(), 1, 0.125f, out), std::logic_error);
  try {
    SummaryFormat{8, 3, 8, 8}.validate(B, d);
    FAIL() << "basis bits 3 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find('3'), std::string::npos) << "message should name the value: " << e.what();
  }
}

namespace {
// Stores `keys` (16 x d) in `fmt`, then for every query checks |s - s_hat| <= bound (s exact in
// float64, s_hat the stored summary's Eq. 4); returns the largest |s - s_hat| / bound.
double check_certified_bound(const float* keys, int d, const SummaryFormat& fmt,
                             const std::vector<std::vector<float>>& queries, const char* what, double& worst_batched) {
  PageSummaryStore store(fmt, 1, 1, 1, 16, d);
  store.store(0, 0, 0, build_page_summary(keys, 16, d, fmt.rank), keys);
  const float scale = 1.0f / std::sqrt(float(d));
  double worst = 0;
  for (size_t t = 0; t < queries.size(); ++t) {
    float s_hat = 0;
    store.score(0, 0, 0, queries[t].data(), 1, scale, &s_hat);
    const double s = test::ref_lse(keys, 16, queries[t].data(), d, scale);
    const double bound = store.log_mass_error_bound(0, 0, 0, queries[t].data(), scale);
    EXPECT_LE(std::abs(s - s_hat), bound) << what << " " << fmt.describe() << " d=" << d << " query " << t;
    if (bound > 0) worst = std::max(worst, std::abs(s - s_hat) / bound);
  }
  // The batched form (the smaller of the Eq. 7 form and the residual one), for a group of all queries:
  // never exceeded either.
  std::vector<float> q_all, batched(queries.size());
  for (const auto& q : queries) q_all.insert(q_all.end(), q.begin(), q.end());
  const int32_t page = 0;
  store.log_mass_error_bounds(0, 0, std::span<const int32_t>(&page, 1), q_all.data(), int(queries.size()), scale,
                              batched.data(), 1);
  for (size_t t = 0; t < queries.size(); ++t) {
    float s_hat = 0;
    store.score(0, 0, 0, queries[t].data(), 1, scale, &s_hat);
    const double s = test::ref_lse(keys, 16, queries[t].data(), d, scale);
    EXPECT_LE(std::abs(s - s_hat), batched[t]) << what << " " << fmt.describe() << " d=" << d << " query " << t;
    if (batched[t] > 0) worst_batched = std::max(worst_batched, std::abs(s - s_hat) / batched[t]);
  }
  return worst;
}

const SummaryFormat kBoundFormats[] = {{8, 4, 8, 8},
                                       {8, 2, 8, 8},
                                       {8, 8, 8, 8},
                                       {8, 16, 8, 8},
                                       {4, 4, 8, 8},
                                       SummaryFormat::unquantized(8),
                                       SummaryFormat::unquantized(4)};

std::vector<std::vector<float>> bound_queries(std::mt19937& rng, const std::vector<float>& keys, int d) {
  std::vector<std::vector<float>> qs;
  for (double sd : {0.1, 1.0, 4.0}) qs.push_back(randn(rng, size_t(d), sd));
  for (int i : {0, 7, 15}) {  // aligned with a key: the large-logit regime
    std::vector<float> q(keys.begin() + size_t(i) * d, keys.begin() + size_t(i + 1) * d);
    for (float& x : q) x *= 1.5f;
    qs.push_back(q);
  }
  // Along a key's difference from its neighbour: rich in the directions a low rank drops.
  std::vector<float> q(static_cast<size_t>(d));
  for (int c = 0; c < d; ++c) q[c] = 3.0f * (keys[size_t(5) * d + c] - keys[size_t(6) * d + c]);
  qs.push_back(q);
  return qs;
}
}  // namespace

TEST(LogMassBound, HoldsOnRandomPagesInEveryFormat) {
  std::mt19937 rng(71);
  double worst_shipped = 0;
  for (int d : {64, 128})
    for (int page = 0; page < 24; ++page) {
      const auto keys = make_page(rng, 16, d, 2 + page % 12, page % 3 == 0 ? 0.02 : 0.5, 2.0);
      const auto qs = bound_queries(rng, keys, d);
      for (const SummaryFormat& fmt : kBoundFormats) {
        double wb = 0;
        const double w = check_certified_bound(keys.data(), d, fmt, qs, "random page", wb);
        if (fmt.basis_bits == 4 && fmt.rank == 8) worst_shipped = std::max(worst_shipped, w);
      }
    }
  // A worst case, not a blanket: on the shipped format it comes within 20x of the real error.
  EXPECT_GT(worst_shipped, 0.05);
}

TEST(LogMassBound, HoldsOnAdversarialPages) {
  std::mt19937 rng(72);
  const int d = 64;
  std::vector<std::pair<const char*, std::vector<float>>> pages;
  pages.emplace_back("identical keys", std::vector<float>());
  {
    const auto k = randn(rng, size_t(d), 2.0);
    for (int i = 0; i < 16; ++i) pages.back().second.insert(pages.back().second.end(), k.begin(), k.end());
  }
  pages.emplace_back("zero page", std::vector<float>(size_t(16) * d, 0.0f));
  pages.emplace_back("one outlier key", make_page(rng, 16, d, 4, 0.1, 1.0));
  for (int c = 0; c < d; ++c) pages.back().second[size_t(9) * d + c] *= 300.0f;
  pages.emplace_back("rank 3", make_page(rng, 16, d, 3, 0.0, 1.0));
  pages.emplace_back("full rank, flat spectrum", randn(rng, size_t(16) * d, 1.0));
  pages.emplace_back("huge offset", make_page(rng, 16, d, 6, 0.3, 1.0));
  for (float& x : pages.back().second) x += 500.0f;
  for (const auto& [what, keys] : pages) {
    auto qs = bound_queries(rng, keys, d);
    qs.push_back(randn(rng, size_t(d), 300.0));  // logits in the thousands
    qs.push_back(std::vector<float>(size_t(d), 0.0f));
    for (const SummaryFormat& fmt : kBoundFormats) {
      double wb = 0;
      check_certified_bound(keys.data(), d, fmt, qs, what, wb);
    }
  }
}

TEST(LogMassBound, HoldsOnRealModelPages) {
  const RealPages& rp = real_pages();
  const PagedKvCache& cache = rp.session->cache();
  const KvSequence& seq = rp.session->sequence();
  const auto& cfg = cache.config();
  const int d = cfg.head_dim, B = cfg.page_size;
  std::vector<float> keys(size_t(B) * d), later(size_t(B) * d);
  std::mt19937 rng(73);
  double worst = 0, worst_batched = 0;
  int checked = 0;
  for (int il = 0; il < cfg.n_layer; ++il)
    for (int h = 0; h < cfg.n_head_kv; ++h)
      for (int j = 0; j + 1 < seq.n_tokens / B; j += 3) {
        cache.k_page_f32(il, seq.page_table[j], h, keys.data());
        cache.k_page_f32(il, seq.page_table[j + 1], h, later.data());
        std::vector<std::vector<float>> qs;  // later keys of this head as queries, and random ones
        for (int t = 0; t < B; t += 4)
          qs.emplace_back(later.begin() + size_t(t) * d, later.begin() + size_t(t + 1) * d);
        qs.push_back(randn(rng, size_t(d), 2.0));
        worst =
            std::max(worst, check_certified_bound(keys.data(), d, SummaryFormat{}, qs, "model page", worst_batched));
        ++checked;
      }
  EXPECT_GT(checked, 50);
  RecordProperty("worst_error_over_bound", std::to_string(worst));
  RecordProperty("worst_error_over_batched_bound", std::to_string(worst_batched));
  EXPECT_GT(worst, 0.05) << "the bound never came close on real pages: suspicious";
  EXPECT_GT(worst_batched, worst) << "the residual form is no tighter than the Eq. 7 one";
}
