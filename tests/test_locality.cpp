// The locality finding (page-local vs sequence- vs global-scope captured energy), checked on
// synthetic caches with known structure and against a float64 Eigen reference.
#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "locks/kv_cache.h"
#include "locks/locality.h"
#include "locks/page_summary.h"
#include "locks/shared_basis.h"

using namespace locks;

namespace {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct Synth {
  std::unique_ptr<PagedKvCache> cache;
  KvSequence seq;
  std::vector<float> keys;  // [L][H][T][d], exactly what the (f32) cache holds
  int L, H, d, T;
  const float* key(int il, int h, int t) const { return &keys[((size_t(il) * H + h) * T + t) * d]; }
};

// key_fn(il, h, t, out[d]) fills one key.
Synth make_synth(int L, int H, int d, int T, const std::function<void(int, int, int, float*)>& key_fn) {
  Synth s{nullptr, {}, std::vector<float>(size_t(L) * H * T * d), L, H, d, T};
  KvCacheConfig cfg;
  cfg.n_layer = L;
  cfg.n_head_kv = H;
  cfg.head_dim = d;
  cfg.page_size = 16;
  cfg.n_pages = (T + 15) / 16 + 2;
  cfg.dtype = KvDtype::F32;
  s.cache = std::make_unique<PagedKvCache>(cfg);
  s.cache->append_tokens(s.seq, T);
  std::vector<float> k(size_t(H) * d), v(size_t(H) * d, 0.0f);
  for (int il = 0; il < L; ++il)
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < H; ++h) {
        float* dst = &s.keys[((size_t(il) * H + h) * T + t) * d];
        key_fn(il, h, t, dst);
        std::copy(dst, dst + d, &k[size_t(h) * d]);
      }
      s.cache->write(il, s.seq, t, k.data(), v.data());
    }
  return s;
}

void expect_monotone_in_unit(const std::vector<double>& f, const char* what) {
  for (size_t q = 0; q < f.size(); ++q) {
    if (std::isnan(f[q])) continue;
    EXPECT_GE(f[q], 0.0) << what << " rank index " << q;
    EXPECT_LE(f[q], 1.0) << what << " rank index " << q;
    if (q > 0 && !std::isnan(f[q - 1])) {
      EXPECT_GE(f[q] + 1e-12, f[q - 1]) << what << " rank index " << q;
    }
  }
}

// float64 reference of the three captured fractions for the keys of `s` (full pages only; the
// sequence and global PCA over all T keys). Global basis = PCA of the same keys at rank `rho`.
struct Ref {
  std::vector<double> page_local, sequence, global;
};
Ref reference(const Synth& s, const std::vector<int>& ranks, int rho) {
  const int B = 16, n_full = s.T / B, d = s.d;
  const size_t nr = ranks.size();
  std::vector<double> pl(nr, 0.0), sq(nr, 0.0), gl(nr, 0.0);
  double energy = 0.0;
  for (int il = 0; il < s.L; ++il)
    for (int h = 0; h < s.H; ++h) {
      MatD X(s.T, d);
      for (int t = 0; t < s.T; ++t)
        for (int c = 0; c < d; ++c) X(t, c) = s.key(il, h, t)[c];
      const Eigen::RowVectorXd m = X.colwise().mean();
      const MatD Xc = X.rowwise() - m;
      Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(Xc.transpose() * Xc);
      const Eigen::MatrixXd V = es.eigenvectors().rowwise().reverse();  // columns by decreasing eigenvalue
      for (int j = 0; j < n_full; ++j) {
        const MatD P = X.middleRows(j * B, B);
        const MatD D = P.rowwise() - P.colwise().mean();
        energy += D.squaredNorm();
        // Page spectrum from an SVD of the centered page (a different algorithm than the code's).
        Eigen::JacobiSVD<MatD> svd(D);
        const Eigen::VectorXd ev = svd.singularValues().array().square();  // descending
        const MatD C = D * V;
        for (size_t q = 0; q < nr; ++q) {
          const int r = ranks[q];
          pl[q] += ev.head(std::min(r, B)).sum();
          sq[q] += C.leftCols(r).squaredNorm();
          gl[q] += r <= rho ? C.leftCols(r).squaredNorm() : NAN;
        }
      }
    }
  Ref ref;
  for (size_t q = 0; q < nr; ++q) {
    ref.page_local.push_back(pl[q] / energy);
    ref.sequence.push_back(sq[q] / energy);
    ref.global.push_back(gl[q] / energy);
  }
  return ref;
}

}  // namespace

TEST(Locality, PageSpecificSubspacesArePageLocal) {
  // Every page's keys lie in its own random rank-2 subspace around its own random mean.
  const int L = 2, H = 2, d = 32, T = 16 * 24;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int n_pages = T / 16;
  std::vector<float> frames(size_t(L) * H * n_pages * 3 * d);  // per page: mean, u1, u2
  for (auto& x : frames) x = nd(rng);
  std::vector<float> coef(size_t(L) * H * T * 2);
  for (auto& x : coef) x = 3.0f * nd(rng);
  Synth s = make_synth(L, H, d, T, [&](int il, int h, int t, float* out) {
    const float* f = &frames[((size_t(il) * H + h) * n_pages + t / 16) * 3 * d];
    const float* a = &coef[((size_t(il) * H + h) * T + t) * 2];
    for (int c = 0; c < d; ++c) out[c] = f[c] + a[0] * f[d + c] + a[1] * f[2 * d + c];
  });
  const std::vector<int> ranks = {1, 2, 3, 4, 8, 16, 25, 32};
  const LocalityResult r = measure_locality(*s.cache, s.seq, ranks);
  ASSERT_EQ(r.ranks, ranks);
  ASSERT_EQ(r.page_local.size(), ranks.size());
  ASSERT_EQ(r.sequence.size(), ranks.size());
  EXPECT_TRUE(r.global.empty());
  EXPECT_EQ(r.n_pages, int64_t(L) * H * n_pages);
  EXPECT_GT(r.energy, 0.0);
  EXPECT_NEAR(r.page_local[1], 1.0, 1e-5);
  EXPECT_LT(r.page_local[0], 0.95);
  EXPECT_LT(r.sequence[1], 0.5) << "a rank-2 sequence basis cannot hold 24 different planes";
  EXPECT_NEAR(r.sequence.back(), 1.0, 1e-5);  // rank d: everything
  for (size_t q = 2; q < ranks.size(); ++q) EXPECT_NEAR(r.page_local[q], 1.0, 1e-5);
  expect_monotone_in_unit(r.page_local, "page_local");
  expect_monotone_in_unit(r.sequence, "sequence");
  for (size_t q = 0; q < ranks.size(); ++q) EXPECT_LE(r.sequence[q], r.page_local[q] + 1e-6) << "Eckart-Young";
}

TEST(Locality, SharedGlobalSubspaceIsCapturedByEveryScope) {
  // All keys of a (layer, head) lie in one rank-2 plane (page means included), so the sequence and
  // calibrated global PCA find it and every scope captures everything at r = 2.
  const int L = 2, H = 2, d = 32, T = 16 * 20 + 5;  // partial last page
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> planes(size_t(L) * H * 2 * d);
  for (auto& x : planes) x = nd(rng);
  std::vector<float> page_off(size_t(L) * H * (T / 16 + 1) * 2), coef(size_t(L) * H * T * 2);
  for (auto& x : page_off) x = 4.0f * nd(rng);
  for (auto& x : coef) x = nd(rng);
  Synth s = make_synth(L, H, d, T, [&](int il, int h, int t, float* out) {
    const float* u = &planes[(size_t(il) * H + h) * 2 * d];
    const float* o = &page_off[((size_t(il) * H + h) * (T / 16 + 1) + t / 16) * 2];
    const float* a = &coef[((size_t(il) * H + h) * T + t) * 2];
    for (int c = 0; c < d; ++c) out[c] = (o[0] + a[0]) * u[c] + (o[1] + a[1]) * u[d + c];
  });
  const GlobalBasis gb = calibrate_global_basis(*s.cache, s.seq, 4);
  const std::vector<int> ranks = {1, 2, 4, 8, 25};
  const LocalityResult r = measure_locality(*s.cache, s.seq, ranks, &gb);
  ASSERT_EQ(r.global.size(), ranks.size());
  EXPECT_EQ(r.n_pages, int64_t(L) * H * (T / 16));
  EXPECT_NEAR(r.page_local[1], 1.0, 1e-5);
  EXPECT_NEAR(r.sequence[1], 1.0, 1e-5);
  EXPECT_NEAR(r.global[1], 1.0, 1e-5);
  EXPECT_LT(r.page_local[0], 0.999);
  EXPECT_NEAR(r.global[2], 1.0, 1e-5);
  EXPECT_TRUE(std::isnan(r.global[3])) << "rank 8 is beyond the rank-4 calibrated basis";
  EXPECT_TRUE(std::isnan(r.global[4]));
  EXPECT_NEAR(r.sequence[4], 1.0, 1e-5);
  expect_monotone_in_unit(r.page_local, "page_local");
  expect_monotone_in_unit(r.sequence, "sequence");
  expect_monotone_in_unit(r.global, "global");
}

TEST(Locality, MatchesFloat64Reference) {
  // Anisotropic Gaussian keys with a drifting mean: no exact structure, so every scope is partial.
  const int L = 1, H = 2, d = 16, T = 16 * 5 + 7;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> mix(size_t(H) * d * d);
  for (auto& x : mix) x = nd(rng);
  std::vector<float> z(size_t(H) * T * d);
  for (auto& x : z) x = nd(rng);
  Synth s = make_synth(L, H, d, T, [&](int, int h, int t, float* out) {
    for (int c = 0; c < d; ++c) {
      double acc = 0.05 * t * (c % 3);  // drift
      for (int e = 0; e < d; ++e) acc += mix[(size_t(h) * d + c) * d + e] * z[(size_t(h) * T + t) * d + e] / (1.0 + e);
      out[c] = float(acc);
    }
  });
  const int rho = 6;
  const GlobalBasis gb = calibrate_global_basis(*s.cache, s.seq, rho);
  const std::vector<int> ranks = {1, 2, 3, 5, 6, 8, 12, 15, 16};
  const LocalityResult r = measure_locality(*s.cache, s.seq, ranks, &gb);
  const Ref ref = reference(s, ranks, rho);
  for (size_t q = 0; q < ranks.size(); ++q) {
    EXPECT_NEAR(r.page_local[q], ref.page_local[q], 1e-5) << "rank " << ranks[q];
    EXPECT_NEAR(r.sequence[q], ref.sequence[q], 1e-5) << "rank " << ranks[q];
    if (std::isnan(ref.global[q])) {
      EXPECT_TRUE(std::isnan(r.global[q])) << "rank " << ranks[q];
    } else {
      EXPECT_NEAR(r.global[q], ref.global[q], 1e-5) << "rank " << ranks[q];
    }
  }
  EXPECT_LT(r.sequence[1], r.page_local[1]);
  // Page-local = Algorithm 1's spectrum: the top-3 sigma^2 of build_page_summary, summed.
  double top3 = 0.0, energy = 0.0;
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < T / 16; ++j) {
      const PageSummaryF32 ps = build_page_summary(s.key(0, h, j * 16), 16, d, 3);
      top3 += double(ps.sigma2[0]) + ps.sigma2[1] + ps.sigma2[2];
      energy += std::accumulate(ps.sigma2.begin(), ps.sigma2.end(), 0.0);
    }
  EXPECT_NEAR(r.page_local[2], top3 / energy, 1e-5);
  EXPECT_NEAR(r.energy, energy, 1e-5 * energy);
  EXPECT_NEAR(r.page_local.back(), 1.0, 1e-9);  // rank B: the whole page
  expect_monotone_in_unit(r.page_local, "page_local");
  expect_monotone_in_unit(r.sequence, "sequence");
  expect_monotone_in_unit(r.global, "global");
  // The same ranks in another order give the same values.
  const LocalityResult r2 = measure_locality(*s.cache, s.seq, {16, 1, 6});
  EXPECT_DOUBLE_EQ(r2.page_local[1], r.page_local[0]);
  EXPECT_DOUBLE_EQ(r2.sequence[2], r.sequence[4]);
  EXPECT_DOUBLE_EQ(r2.sequence[0], r.sequence[8]);
}

TEST(Locality, RejectsBadInput) {
  Synth s = make_synth(1, 1, 8, 20, [](int, int, int t, float* out) {
    for (int c = 0; c < 8; ++c) out[c] = float((t * 7 + c * 3) % 5);
  });
  EXPECT_THROW(measure_locality(*s.cache, s.seq, {}), std::invalid_argument);
  EXPECT_THROW(measure_locality(*s.cache, s.seq, {0}), std::invalid_argument);
  EXPECT_THROW(measure_locality(*s.cache, s.seq, {9}), std::invalid_argument);
  EXPECT_NO_THROW(measure_locality(*s.cache, s.seq, {8}));
  KvSequence short_seq = s.seq;
  short_seq.n_tokens = 15;
  EXPECT_THROW(measure_locality(*s.cache, short_seq, {1}), std::invalid_argument);
  GlobalBasis wrong = calibrate_global_basis(*s.cache, s.seq, 2);
  wrong.head_dim = 16;
  EXPECT_THROW(measure_locality(*s.cache, s.seq, {1}, &wrong), std::invalid_argument);
  // Pages of identical keys hold no energy: everything counts as captured.
  Synth flat = make_synth(1, 1, 8, 32, [](int, int, int t, float* out) {
    for (int c = 0; c < 8; ++c) out[c] = float(t / 16 + c);
  });
  const LocalityResult r = measure_locality(*flat.cache, flat.seq, {1, 4});
  EXPECT_EQ(r.energy, 0.0);
  EXPECT_EQ(r.page_local, (std::vector<double>{1.0, 1.0}));
  EXPECT_EQ(r.sequence, (std::vector<double>{1.0, 1.0}));
}

TEST(Locality, MeanOverMeasurementsPerRank) {
  LocalityResult a, b;
  a.page_local = {0.2, 0.6};
  a.sequence = {0.1, 0.3};
  a.global = {0.05, 0.25};
  b.page_local = {0.4, 1.0};
  b.sequence = {0.3, 0.5};
  b.global = {0.15, 0.35};
  const LocalityMean m = mean_locality({a, b}, 1);
  EXPECT_DOUBLE_EQ(m.page_local, 0.8);
  EXPECT_DOUBLE_EQ(m.sequence, 0.4);
  EXPECT_DOUBLE_EQ(m.global, 0.3);
  b.global.clear();  // one measurement without a global basis: no global mean
  EXPECT_TRUE(std::isnan(mean_locality({a, b}, 0).global));
  EXPECT_DOUBLE_EQ(mean_locality({a, b}, 0).page_local, 0.3);
}
