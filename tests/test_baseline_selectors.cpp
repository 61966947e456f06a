// The baseline selectors (quest, centroid, second-moment, sequence-basis, global-basis,
// streaming): each estimate against a float64 reference written here, the documented byte counts,
// and the selection invariants shared by every selector.
#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "locks/kv_cache.h"
#include "locks/model.h"
#include "locks/page_summary.h"
#include "locks/selector.h"
#include "locks/session.h"
#include "locks/shared_basis.h"
#include "selectors/selectors.h"
#include "test_paths.h"
#include "test_util.h"

using namespace locks;

namespace {

constexpr int B = 16;

using test::randn;

using Keys = std::vector<std::vector<std::vector<float>>>;  // [il][h] -> [n_tokens][d]

// A cache with two sequences appended in alternation (page tables are not contiguous): `seq` holds
// `keys`, `other` holds `other_keys` (or unrelated junk when empty). Values are random.
struct TestCache {
  KvCacheConfig cfg;
  std::unique_ptr<PagedKvCache> cache;
  KvSequence seq, other;
  Keys keys, other_keys;
};

TestCache make_cache(std::mt19937& rng, int d, int n_tokens, const Keys& keys, KvDtype dtype = KvDtype::F32,
                     const Keys& other_keys = {}, int other_tokens = 0) {
  TestCache tc;
  tc.cfg.n_layer = int(keys.size());
  tc.cfg.n_head_kv = int(keys[0].size());
  tc.cfg.head_dim = d;
  tc.cfg.page_size = B;
  if (other_keys.empty()) other_tokens = n_tokens;
  tc.cfg.n_pages = (n_tokens + B - 1) / B + (other_tokens + B - 1) / B + 3;
  tc.cfg.dtype = dtype;
  tc.cache = std::make_unique<PagedKvCache>(tc.cfg);
  for (int t = 0; t < std::max(n_tokens, other_tokens); t += B) {
    if (t < n_tokens) tc.cache->append_tokens(tc.seq, std::min(B, n_tokens - t));
    if (t < other_tokens) tc.cache->append_tokens(tc.other, std::min(B, other_tokens - t));
  }
  tc.keys = keys;
  tc.other_keys = other_keys;
  const int H = tc.cfg.n_head_kv;
  std::vector<float> kb(size_t(H) * d);
  for (int il = 0; il < tc.cfg.n_layer; ++il) {
    for (int t = 0; t < n_tokens; ++t) {
      for (int h = 0; h < H; ++h) std::copy_n(&keys[il][h][size_t(t) * d], d, &kb[size_t(h) * d]);
      tc.cache->write(il, tc.seq, t, kb.data(), randn(rng, size_t(H) * d).data());
    }
    for (int t = 0; t < other_tokens; ++t) {
      if (other_keys.empty())
        kb = randn(rng, size_t(H) * d, 4.0);
      else
        for (int h = 0; h < H; ++h) std::copy_n(&other_keys[il][h][size_t(t) * d], d, &kb[size_t(h) * d]);
      tc.cache->write(il, tc.other, t, kb.data(), randn(rng, size_t(H) * d).data());
    }
  }
  return tc;
}

// Keys with page structure: a per-(layer, head) base, a per-page center, low-rank page variation
// and noise. When f16 is set, values are rounded to f16 (what an f16 cache stores).
Keys page_keys(std::mt19937& rng, int L, int H, int d, int n_tokens, bool f16 = false) {
  std::normal_distribution<double> N(0.0, 1.0);
  Keys K(L, std::vector<std::vector<float>>(H));
  for (int il = 0; il < L; ++il)
    for (int h = 0; h < H; ++h) {
      const auto base = randn(rng, d);
      auto& k = K[il][h];
      k.resize(size_t(n_tokens) * d);
      for (int p = 0; p * B < n_tokens; ++p) {
        const auto center = randn(rng, d, 1.5);
        const auto dirs = randn(rng, size_t(3) * d);
        for (int i = p * B; i < std::min(n_tokens, (p + 1) * B); ++i) {
          const double a0 = 1.5 * N(rng), a1 = N(rng), a2 = 0.5 * N(rng);
          for (int c = 0; c < d; ++c) {
            float x =
                float(base[c] + center[c] + a0 * dirs[c] + a1 * dirs[d + c] + a2 * dirs[2 * d + c] + 0.1 * N(rng));
            if (f16) x = f16_to_f32(f32_to_f16(x));
            k[size_t(i) * d + c] = x;
          }
        }
      }
    }
  return K;
}

// Keys confined to a rank-`rho0` affine subspace per (layer, head): k = m + U a with U fixed per
// (layer, head) (drawn from `subspace_seed`, so two sequences can share it) and m, a per token.
Keys subspace_keys(std::mt19937& rng, int L, int H, int d, int n_tokens, int rho0, unsigned subspace_seed) {
  std::mt19937 srng(subspace_seed);
  std::normal_distribution<double> N(0.0, 1.0);
  Keys K(L, std::vector<std::vector<float>>(H));
  for (int il = 0; il < L; ++il)
    for (int h = 0; h < H; ++h) {
      const auto U = randn(srng, size_t(rho0) * d);  // [rho0][d]
      const auto m = randn(srng, d, 2.0);
      auto& k = K[il][h];
      k.resize(size_t(n_tokens) * d);
      for (int p = 0; p * B < n_tokens; ++p) {
        std::vector<double> pc(rho0);  // per-page center inside the subspace
        for (auto& x : pc) x = 1.5 * N(rng);
        std::vector<double> a(rho0);
        for (int i = p * B; i < std::min(n_tokens, (p + 1) * B); ++i) {
          for (int t = 0; t < rho0; ++t) a[t] = pc[t] + 0.7 * N(rng);
          for (int c = 0; c < d; ++c) {
            double x = m[c];
            for (int t = 0; t < rho0; ++t) x += a[t] * U[size_t(t) * d + c];
            k[size_t(i) * d + c] = float(x);
          }
        }
      }
    }
  return K;
}

double dot(const float* a, const float* b, int d) {
  double s = 0.0;
  for (int c = 0; c < d; ++c) s += double(a[c]) * b[c];
  return s;
}

double ref_lse(const float* keys, int n, const float* q, int d) {
  std::vector<double> z(n);
  double m = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < n; ++i) m = std::max(m, z[i] = dot(q, keys + size_t(i) * d, d) / std::sqrt(double(d)));
  double l = 0.0;
  for (int i = 0; i < n; ++i) l += std::exp(z[i] - m);
  return m + std::log(l);
}

double ref_max_logit(const float* keys, int n, const float* q, int d) {
  double m = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < n; ++i) m = std::max(m, dot(q, keys + size_t(i) * d, d) / std::sqrt(double(d)));
  return m;
}

std::vector<double> page_mean(const float* keys, int n, int d) {
  std::vector<double> mu(d, 0.0);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) mu[c] += keys[size_t(i) * d + c];
  for (auto& x : mu) x /= n;
  return mu;
}

SelectionRequest request(const TestCache& tc, const std::vector<float>& q, int G, int il, int h, int k) {
  SelectionRequest r;
  r.q = q.data();
  r.n_group = G;
  r.il = il;
  r.kv_head = h;
  r.seq = &tc.seq;
  r.budget_pages = k;
  return r;
}

std::vector<int32_t> full_pages(const KvSequence& seq) {
  return std::vector<int32_t>(seq.page_table.begin(), seq.page_table.begin() + seq.n_tokens / B);
}

void fill_all(Selector& s, const TestCache& tc) {
  for (int il = 0; il < tc.cfg.n_layer; ++il) s.on_pages_filled(*tc.cache, il, full_pages(tc.seq));
}

EstimatingSelector& est_of(Selector& s) { return dynamic_cast<EstimatingSelector&>(s); }

// Queries of a group: random plus a pull toward one page's keys so the page masses are uneven.
std::vector<float> group_query(std::mt19937& rng, const TestCache& tc, int il, int h, int G, int hot_page) {
  const int d = tc.cfg.head_dim;
  auto q = randn(rng, size_t(G) * d, 0.6);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < d; ++c) q[size_t(g) * d + c] += 0.5f * tc.keys[il][h][size_t(hot_page * B + g % B) * d + c];
  return q;
}

// Reference Eq. 4 with a shared basis V [rho][d] (float64, unquantized): also returns the int8
// quantization tolerance of the stored centroid and coefficient rows (per-element error <= 0.51
// amax / 127 of its group, including the f16 rounding of the scale).
double ref_shared_eq4(const float* keys, const float* q, const float* V, int rho, int d, double* tol_int8) {
  const auto mu = page_mean(keys, B, d);
  std::vector<double> wq(rho, 0.0);
  for (int k = 0; k < rho; ++k)
    for (int c = 0; c < d; ++c) wq[k] += double(q[c]) * V[size_t(k) * d + c];
  double a = 0.0, amax_mu = 0.0, sum_q = 0.0;
  for (int c = 0; c < d; ++c) {
    a += double(q[c]) * mu[c];
    amax_mu = std::max(amax_mu, std::abs(mu[c]));
    sum_q += std::abs(q[c]);
  }
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> z(B);
  double m = -std::numeric_limits<double>::infinity(), worst_coef = 0.0;
  for (int i = 0; i < B; ++i) {
    double acc = a, amax_c = 0.0, sum_w = 0.0;
    for (int k = 0; k < rho; ++k) {
      double ck = 0.0;
      for (int c = 0; c < d; ++c) ck += double(V[size_t(k) * d + c]) * (double(keys[size_t(i) * d + c]) - mu[c]);
      acc += wq[k] * ck;
      amax_c = std::max(amax_c, std::abs(ck));
      sum_w += std::abs(wq[k]);
    }
    worst_coef = std::max(worst_coef, sum_w * 0.51 * amax_c / 127.0);
    m = std::max(m, z[i] = acc * scale);
  }
  if (tol_int8) *tol_int8 = scale * (sum_q * 0.51 * amax_mu / 127.0 + worst_coef);
  double l = 0.0;
  for (int i = 0; i < B; ++i) l += std::exp(z[i] - m);
  return m + std::log(l);
}

// Check selection invariants: ascending, unique, sink + recent, size min(max(k, 2), n), all pages
// when the budget covers the sequence.
void check_invariants(const Selection& s, int n_pages, int k) {
  const int want = std::min(std::max(k, 2), n_pages);
  ASSERT_EQ(int(s.pages.size()), want);
  for (size_t i = 1; i < s.pages.size(); ++i) ASSERT_LT(s.pages[i - 1], s.pages[i]);
  for (int32_t p : s.pages) ASSERT_TRUE(p >= 0 && p < n_pages);
  EXPECT_EQ(s.pages.front(), 0);
  EXPECT_EQ(s.pages.back(), n_pages - 1);
  EXPECT_EQ(s.all_pages, want == n_pages);
  if (k >= n_pages) {
    std::vector<int32_t> all(n_pages);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(s.pages, all);
  }
}

}  // namespace

// =============================================================================================
// Registry, options, matched bytes
// =============================================================================================

TEST(BaselineSelectors, NamesAndConstruction) {
  KvCacheConfig cfg;
  cfg.n_pages = 4;
  const auto names = selector_names();
  for (const char* want : {"quest", "centroid", "second-moment", "sequence-basis", "global-basis", "streaming"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  for (const auto& n : names) {
    if (n == "global-basis") continue;
    EXPECT_EQ(make_selector(n, cfg)->name(), n);
  }
  // global-basis needs a calibrated basis.
  try {
    make_selector("global-basis", cfg);
    FAIL() << "global-basis without calibration accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("global_basis"), std::string::npos) << e.what();
  }
  auto gb = std::make_shared<GlobalBasis>();
  gb->n_layer = cfg.n_layer;
  gb->n_head_kv = cfg.n_head_kv;
  gb->head_dim = cfg.head_dim;
  gb->rank = 8;
  gb->basis.assign(1, std::vector<float>(size_t(8) * cfg.head_dim, 0.0f));
  SelectorOptions opts;
  opts.global_basis = gb;
  opts.shared_rank = 8;
  EXPECT_EQ(make_selector("global-basis", cfg, opts)->name(), "global-basis");
  opts.shared_rank = 9;  // more directions than calibrated
  EXPECT_THROW(make_selector("global-basis", cfg, opts), std::invalid_argument);
  opts.shared_rank = 0;  // matched bytes: 25 at d = 64 > 8
  EXPECT_THROW(make_selector("global-basis", cfg, opts), std::invalid_argument);
  KvCacheConfig other = cfg;
  other.n_head_kv = 2;
  opts.shared_rank = 4;
  EXPECT_THROW(make_selector("global-basis", other, opts), std::invalid_argument);
  opts.shared_rank = cfg.head_dim + 1;
  EXPECT_THROW(make_selector("sequence-basis", cfg, opts), std::invalid_argument);
  opts.shared_rank = -1;
  EXPECT_THROW(make_selector("sequence-basis", cfg, opts), std::invalid_argument);
  SelectorOptions bad;
  bad.summary.centroid_bits = 4;
  EXPECT_THROW(make_selector("centroid", cfg, bad), std::invalid_argument);
  EXPECT_THROW(make_selector("second-moment", cfg, bad), std::invalid_argument);
}

TEST(BaselineSelectors, MatchedBytesRank) {
  // Shipped format: LOCKS = (r d/2 + 2r) + (B r + 2B) + (d + 2); shared = (d + 2) + B (rho + 2).
  EXPECT_EQ(matched_bytes_rank(SummaryFormat{}, 16, 64), 25);
  EXPECT_EQ(matched_bytes_rank(SummaryFormat{}, 16, 128), 41);
  EXPECT_EQ(shared_basis_page_bytes(SummaryFormat{}, 16, 64, 25), size_t(66 + 16 * 27));
  for (int d : {16, 64, 128})
    for (int r : {1, 2, 8, 16})
      for (int bb : {32, 16, 8, 4, 2})
        for (int cb : {32, 8}) {
          SummaryFormat f{r, bb, cb, cb};
          const int rho = matched_bytes_rank(f, 16, d);
          const size_t L = f.bytes(16, d);
          ASSERT_GE(rho, 1);
          ASSERT_LE(rho, d);
          if (rho > 1) {
            EXPECT_LE(shared_basis_page_bytes(f, 16, d, rho), L) << f.describe();
          }
          if (rho < d) {
            EXPECT_GT(shared_basis_page_bytes(f, 16, d, rho + 1), L) << f.describe();
          }
        }
  // The registry's default rank for the shared scopes is the matched one.
  KvCacheConfig cfg;
  cfg.n_pages = 2;
  auto sb = make_selector("sequence-basis", cfg);
  EXPECT_EQ(dynamic_cast<SequenceBasisSelector&>(*sb).pages().rank(), 25);
}

// =============================================================================================
// quest
// =============================================================================================

TEST(BaselineSelectors, QuestIsAnUpperBoundOfTheMaxLogit) {
  std::mt19937 rng(401);
  for (KvDtype dtype : {KvDtype::F32, KvDtype::F16}) {
    for (int d : {16, 64}) {
      const int n_tokens = 7 * B + 5;
      const Keys K = page_keys(rng, 2, 2, d, n_tokens, dtype == KvDtype::F16);
      TestCache tc = make_cache(rng, d, n_tokens, K, dtype);
      auto sel = make_selector("quest", tc.cfg);
      fill_all(*sel, tc);
      const int n_pages = tc.seq.n_pages();
      for (int G : {1, 4, 5}) {
        for (int il = 0; il < 2; ++il)
          for (int h = 0; h < 2; ++h) {
            const auto q = group_query(rng, tc, il, h, G, 3);
            std::vector<float> est;
            est_of(*sel).estimate(*tc.cache, request(tc, q, G, il, h, 4), est);
            ASSERT_EQ(est.size(), size_t(G) * n_pages);
            for (int j = 0; j < n_pages; ++j) {
              const int n = std::min(B, n_tokens - j * B);
              const float* keys = &K[il][h][size_t(j) * B * d];
              for (int g = 0; g < G; ++g) {
                const float* qg = &q[size_t(g) * d];
                const double got = est[size_t(g) * n_pages + j];
                const double mx = ref_max_logit(keys, n, qg, d);
                // Float64 bound from the exact per-channel min / max.
                double bound = 0.0, mag = 0.0;
                for (int c = 0; c < d; ++c) {
                  double lo = keys[c], hi = keys[c];
                  for (int i = 1; i < n; ++i) {
                    lo = std::min(lo, double(keys[size_t(i) * d + c]));
                    hi = std::max(hi, double(keys[size_t(i) * d + c]));
                  }
                  bound += std::max(qg[c] * hi, qg[c] * lo);
                  mag += std::abs(qg[c]) * std::max(std::abs(lo), std::abs(hi));
                }
                bound /= std::sqrt(double(d));
                mag /= std::sqrt(double(d));
                SCOPED_TRACE(testing::Message() << "d=" << d << " G=" << G << " page " << j << " head " << g);
                if (j == n_pages - 1) {  // partial page: its exact max logit
                  EXPECT_NEAR(got, mx, 1e-5 * (1.0 + std::abs(mx)));
                  continue;
                }
                EXPECT_GE(got, mx - 1e-6 * mag) << "not an upper bound";
                EXPECT_GE(got, bound - 1e-6 * mag);
                // f16 storage: exact on an f16 cache; outward rounding (<= 2^-11 relative) on f32.
                EXPECT_LE(got, bound + (dtype == KvDtype::F16 ? 1e-6 : 1e-3) * mag + 1e-6);
              }
            }
          }
      }
    }
  }
}

// =============================================================================================
// centroid
// =============================================================================================

TEST(BaselineSelectors, CentroidEstimateFormula) {
  std::mt19937 rng(402);
  for (int cbits : {32, 8}) {
    for (int d : {16, 64}) {
      const int n_tokens = 6 * B + 9;
      const Keys K = page_keys(rng, 2, 2, d, n_tokens);
      TestCache tc = make_cache(rng, d, n_tokens, K);
      SelectorOptions opts;
      opts.summary.centroid_bits = cbits;
      auto sel = make_selector("centroid", tc.cfg, opts);
      fill_all(*sel, tc);
      const int n_pages = tc.seq.n_pages();
      for (int G : {1, 4, 5})
        for (int il = 0; il < 2; ++il)
          for (int h = 0; h < 2; ++h) {
            const auto q = group_query(rng, tc, il, h, G, 2);
            std::vector<float> est;
            est_of(*sel).estimate(*tc.cache, request(tc, q, G, il, h, 3), est);
            for (int j = 0; j < n_pages; ++j) {
              const float* keys = &K[il][h][size_t(j) * B * d];
              for (int g = 0; g < G; ++g) {
                const float* qg = &q[size_t(g) * d];
                const double got = est[size_t(g) * n_pages + j];
                if (j == n_pages - 1) {
                  EXPECT_NEAR(got, ref_lse(keys, n_tokens - j * B, qg, d), 1e-4);
                  continue;
                }
                const auto mu = page_mean(keys, B, d);
                double a = 0.0, amax = 0.0, sq = 0.0;
                for (int c = 0; c < d; ++c) {
                  a += qg[c] * mu[c];
                  amax = std::max(amax, std::abs(mu[c]));
                  sq += std::abs(qg[c]);
                }
                const double want = a / std::sqrt(double(d)) + std::log(double(B));
                const double tol =
                    (cbits == 8 ? sq * 0.51 * amax / 127.0 / std::sqrt(double(d)) : 0.0) + 1e-5 * (1 + std::abs(want));
                EXPECT_NEAR(got, want, tol) << "cbits=" << cbits << " d=" << d << " page " << j;
                // Jensen: the rank-0 estimate never exceeds the exact page LSE (unquantized).
                if (cbits == 32) {
                  EXPECT_LE(got, ref_lse(keys, B, qg, d) + 1e-4);
                }
              }
            }
          }
    }
  }
}

// =============================================================================================
// second-moment
// =============================================================================================

TEST(BaselineSelectors, SecondMomentGaussianEstimate) {
  std::mt19937 rng(403);
  for (int d : {16, 64}) {
    const int n_tokens = 5 * B + 3;
    const Keys K = page_keys(rng, 1, 2, d, n_tokens);
    TestCache tc = make_cache(rng, d, n_tokens, K);
    // r = 16 = B covers the whole page covariance (rank <= 15); r = 4 keeps the top 4 eigenpairs;
    // int8 directions with f16 standard deviations: within quantization tolerance.
    for (SummaryFormat fmt :
         {SummaryFormat::unquantized(16), SummaryFormat::unquantized(4), SummaryFormat{16, 8, 8, 8}}) {
      SelectorOptions opts;
      opts.summary = fmt;
      auto sel = make_selector("second-moment", tc.cfg, opts);
      fill_all(*sel, tc);
      const int n_pages = tc.seq.n_pages();
      const bool quantized = fmt.basis_bits != 32;
      for (int G : {1, 4, 5})
        for (int h = 0; h < 2; ++h) {
          const auto q = group_query(rng, tc, 0, h, G, 1);
          std::vector<float> est;
          est_of(*sel).estimate(*tc.cache, request(tc, q, G, 0, h, 3), est);
          for (int j = 0; j + 1 < n_pages; ++j) {
            const float* keys = &K[0][h][size_t(j) * B * d];
            // Float64 reference: covariance Sigma = (1/B) sum delta delta^T, its top-r eigenpairs.
            const auto mu = page_mean(keys, B, d);
            Eigen::MatrixXd S = Eigen::MatrixXd::Zero(d, d);
            for (int i = 0; i < B; ++i) {
              Eigen::VectorXd dl(d);
              for (int c = 0; c < d; ++c) dl[c] = keys[size_t(i) * d + c] - mu[c];
              S += dl * dl.transpose() / double(B);
            }
            Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(S);
            for (int g = 0; g < G; ++g) {
              const float* qg = &q[size_t(g) * d];
              Eigen::VectorXd qv(d);
              for (int c = 0; c < d; ++c) qv[c] = qg[c];
              double quad = 0.0;
              for (int k = 0; k < fmt.rank; ++k) {
                const double p = es.eigenvectors().col(d - 1 - k).dot(qv);
                quad += es.eigenvalues()[d - 1 - k] * p * p;
              }
              double a = 0.0;
              for (int c = 0; c < d; ++c) a += qg[c] * mu[c];
              const double want = std::log(double(B)) + a / std::sqrt(double(d)) + 0.5 * quad / d;
              const double got = est[size_t(g) * n_pages + j];
              const double tol = quantized ? 0.05 * (1.0 + std::abs(want)) : 1e-4 * (1.0 + std::abs(want));
              EXPECT_NEAR(got, want, tol) << fmt.describe() << " d=" << d << " page " << j << " head " << g;
            }
          }
        }
    }
  }
}

// =============================================================================================
// sequence-basis
// =============================================================================================

TEST(BaselineSelectors, SequenceBasisIsEq4WithTheFittedBasis) {
  std::mt19937 rng(404);
  for (int d : {16, 64}) {
    const int n_tokens = 8 * B + 6;
    const Keys K = page_keys(rng, 2, 2, d, n_tokens);
    TestCache tc = make_cache(rng, d, n_tokens, K);
    for (int cbits : {32, 8}) {
      SelectorOptions opts;
      opts.summary = cbits == 32 ? SummaryFormat::unquantized(8) : SummaryFormat{};
      opts.shared_rank = d == 16 ? 5 : 12;
      auto sel = make_selector("sequence-basis", tc.cfg, opts);
      fill_all(*sel, tc);  // before the fit: nothing built yet
      auto& sb = dynamic_cast<SequenceBasisSelector&>(*sel);
      const int n_pages = tc.seq.n_pages(), n_full = n_tokens / B, rho = opts.shared_rank;
      for (int G : {1, 4, 5})
        for (int il = 0; il < 2; ++il)
          for (int h = 0; h < 2; ++h) {
            const auto q = group_query(rng, tc, il, h, G, 4);
            std::vector<float> est;
            const size_t bytes = sb.estimate(*tc.cache, request(tc, q, G, il, h, 3), est);
            // The lazy fit is the PCA of every full page's keys at the first select.
            const auto& V = sb.basis(il, h);
            ASSERT_EQ(V.size(), size_t(rho) * d);
            EXPECT_EQ(V, pca_key_basis(K[il][h].data(), size_t(n_full) * B, d, rho));
            for (int a = 0; a < rho; ++a)
              for (int b = 0; b < rho; ++b)
                EXPECT_NEAR(dot(&V[size_t(a) * d], &V[size_t(b) * d], d), a == b ? 1.0 : 0.0, 1e-5);
            for (int j = 0; j < n_pages; ++j) {
              const float* keys = &K[il][h][size_t(j) * B * d];
              for (int g = 0; g < G; ++g) {
                const float* qg = &q[size_t(g) * d];
                const double got = est[size_t(g) * n_pages + j];
                if (j == n_pages - 1) {
                  EXPECT_NEAR(got, ref_lse(keys, n_tokens - j * B, qg, d), 1e-4);
                  continue;
                }
                double tol8 = 0.0;
                const double want = ref_shared_eq4(keys, qg, V.data(), rho, d, &tol8);
                EXPECT_NEAR(got, want, (cbits == 8 ? tol8 : 0.0) + 1e-4 * (1 + std::abs(want)))
                    << "d=" << d << " bits=" << cbits << " page " << j;
              }
            }
            // Bytes: basis once + (centroid + B coefficient rows) per full page + the partial page's K.
            const size_t page =
                cbits == 8 ? size_t(d + 2) + size_t(B) * (rho + 2) : size_t(4 * d) + size_t(B) * 4 * rho;
            EXPECT_EQ(bytes, size_t(rho) * d * 4 + size_t(n_full) * page + size_t(n_tokens - n_full * B) * d * 4);
          }
    }
  }
}

// The fit done ahead by prepare_for_decode (Session::prepare_selector) is the fit the first
// select() makes: kept when the sequence has the same full pages, redone when a page was completed
// in between (here: prepared on a view with one full page fewer).
TEST(BaselineSelectors, SequenceBasisPreparedFitEqualsTheLazyFit) {
  std::mt19937 rng(406);
  const int d = 16, n_tokens = 6 * B + 5;
  const Keys K = page_keys(rng, 2, 2, d, n_tokens);
  TestCache tc = make_cache(rng, d, n_tokens, K);
  SelectorOptions opts;
  opts.shared_rank = 5;
  KvSequence shorter = tc.seq;
  shorter.page_table.resize(6);
  shorter.n_tokens = 5 * B + 5;
  for (const KvSequence* prep : {&tc.seq, &shorter}) {
    auto lazy = make_selector("sequence-basis", tc.cfg, opts), ahead = make_selector("sequence-basis", tc.cfg, opts);
    fill_all(*lazy, tc);
    fill_all(*ahead, tc);
    ahead->prepare_for_decode(*tc.cache, *prep);
    for (int il = 0; il < 2; ++il)
      for (int h = 0; h < 2; ++h) {
        const auto q = group_query(rng, tc, il, h, 4, 2);
        std::vector<float> want, got;
        const size_t want_bytes = est_of(*lazy).estimate(*tc.cache, request(tc, q, 4, il, h, 3), want);
        const size_t got_bytes = est_of(*ahead).estimate(*tc.cache, request(tc, q, 4, il, h, 3), got);
        EXPECT_EQ(got, want) << "prepared on " << prep->n_tokens << " tokens, layer " << il << " head " << h;
        EXPECT_EQ(got_bytes, want_bytes);
        EXPECT_EQ(dynamic_cast<SequenceBasisSelector&>(*ahead).basis(il, h),
                  dynamic_cast<SequenceBasisSelector&>(*lazy).basis(il, h));
      }
  }
}

TEST(BaselineSelectors, SharedBasisExactWhenKeysSpanAtMostRhoDirections) {
  std::mt19937 rng(405);
  const int d = 64, rho0 = 6;
  const int n_tokens = 9 * B + 4, more = 3 * B;  // 3 pages appended after the fit
  const Keys K = subspace_keys(rng, 2, 2, d, n_tokens + more, rho0, 77);
  const Keys C = subspace_keys(rng, 2, 2, d, 11 * B + 3, rho0, 77);  // calibration text, same subspace
  // Build the sequence with all tokens, but let the selector see only the first n_tokens at first.
  TestCache tc = make_cache(rng, d, n_tokens + more, K, KvDtype::F32, C, 11 * B + 3);
  auto gb = std::make_shared<const GlobalBasis>(calibrate_global_basis(*tc.cache, tc.other, 8));
  // Calibration = PCA of every calibration token (partial page included).
  EXPECT_EQ(gb->basis[1 * 2 + 1], pca_key_basis(C[1][1].data(), size_t(11 * B + 3), d, 8)) << "calibration";
  for (const char* name : {"sequence-basis", "global-basis"}) {
    for (int rho : {rho0, rho0 + 2}) {
      SelectorOptions opts;
      opts.summary = SummaryFormat::unquantized(8);
      opts.shared_rank = rho;
      opts.global_basis = gb;
      auto sel = make_selector(name, tc.cfg, opts);
      KvSequence prefix = tc.seq;  // the first n_tokens, then grown
      prefix.page_table.resize(size_t(n_tokens + B - 1) / B);
      prefix.n_tokens = n_tokens;
      for (int il = 0; il < 2; ++il) sel->on_pages_filled(*tc.cache, il, full_pages(prefix));
      for (int stage = 0; stage < 2; ++stage) {
        if (stage == 1) {  // grow to the whole sequence: later pages get projected on the existing basis
          const std::vector<int32_t> fresh(tc.seq.page_table.begin() + n_tokens / B,
                                           tc.seq.page_table.begin() + (n_tokens + more) / B);
          prefix = tc.seq;
          for (int il = 0; il < 2; ++il) sel->on_pages_filled(*tc.cache, il, fresh);
        }
        const int n_pages = prefix.n_pages();
        for (int G : {1, 4, 5})
          for (int il = 0; il < 2; ++il)
            for (int h = 0; h < 2; ++h) {
              const auto q = group_query(rng, tc, il, h, G, 2);
              SelectionRequest req = request(tc, q, G, il, h, 3);
              req.seq = &prefix;
              std::vector<float> est;
              est_of(*sel).estimate(*tc.cache, req, est);
              for (int j = 0; j < n_pages; ++j) {
                const int n = std::min(B, prefix.n_tokens - j * B);
                for (int g = 0; g < G; ++g) {
                  const double want = ref_lse(&K[il][h][size_t(j) * B * d], n, &q[size_t(g) * d], d);
                  EXPECT_NEAR(est[size_t(g) * n_pages + j], want, 2e-4 * (1 + std::abs(want)))
                      << name << " rho=" << rho << " stage " << stage << " page " << j;
                }
              }
              // The per-token reconstruction mu + V^T c_i is the keys themselves.
              std::vector<float> rec(size_t(B) * d);
              for (int j = 0; j < prefix.n_tokens / B; ++j) {
                ASSERT_TRUE(sel->reconstruct_keys(il, h, prefix.page_table[j], rec.data()));
                for (int x = 0; x < B * d; ++x)
                  ASSERT_NEAR(rec[x], K[il][h][size_t(j) * B * d + x],
                              1e-4 * (1 + std::abs(K[il][h][size_t(j) * B * d + x])));
              }
            }
      }
    }
  }
}

TEST(BaselineSelectors, GlobalBasisIsEq4WithTheCalibratedBasis) {
  std::mt19937 rng(406);
  for (int d : {16, 64}) {
    const int n_tokens = 7 * B + 2, n_cal = 10 * B;
    const Keys K = page_keys(rng, 2, 2, d, n_tokens), C = page_keys(rng, 2, 2, d, n_cal);
    TestCache tc = make_cache(rng, d, n_tokens, K, KvDtype::F32, C, n_cal);
    const int cal_rank = d == 16 ? 10 : 20, rho = d == 16 ? 6 : 16;  // leading rho of the calibrated rows
    auto gb = std::make_shared<const GlobalBasis>(calibrate_global_basis(*tc.cache, tc.other, cal_rank));
    for (int cbits : {32, 8}) {
      SelectorOptions opts;
      opts.summary = cbits == 32 ? SummaryFormat::unquantized(8) : SummaryFormat{};
      opts.shared_rank = rho;
      opts.global_basis = gb;
      auto sel = make_selector("global-basis", tc.cfg, opts);
      fill_all(*sel, tc);
      auto clone = sel->clone();
      const int n_pages = tc.seq.n_pages(), n_full = n_tokens / B;
      for (int G : {1, 4, 5})
        for (int il = 0; il < 2; ++il)
          for (int h = 0; h < 2; ++h) {
            const auto q = group_query(rng, tc, il, h, G, 5);
            std::vector<float> est;
            const size_t bytes = est_of(*sel).estimate(*tc.cache, request(tc, q, G, il, h, 3), est);
            for (int j = 0; j + 1 < n_pages; ++j) {
              for (int g = 0; g < G; ++g) {
                double tol8 = 0.0;
                const double want =
                    ref_shared_eq4(&K[il][h][size_t(j) * B * d], &q[size_t(g) * d], gb->of(il, h), rho, d, &tol8);
                EXPECT_NEAR(est[size_t(g) * n_pages + j], want,
                            (cbits == 8 ? tol8 : 0.0) + 1e-4 * (1 + std::abs(want)));
              }
            }
            const size_t page =
                cbits == 8 ? size_t(d + 2) + size_t(B) * (rho + 2) : size_t(4 * d) + size_t(B) * 4 * rho;
            EXPECT_EQ(bytes, size_t(rho) * d * 4 + size_t(n_full) * page + size_t(n_tokens - n_full * B) * d * 4);
            Selection a, b;
            sel->select(*tc.cache, request(tc, q, G, il, h, 4), a);
            clone->select(*tc.cache, request(tc, q, G, il, h, 4), b);
            EXPECT_EQ(a.pages, b.pages);
          }
    }
  }
}

// =============================================================================================
// streaming
// =============================================================================================

TEST(BaselineSelectors, StreamingKeepsSinkAndRecentWindow) {
  std::mt19937 rng(407);
  const int d = 16;
  const Keys K = page_keys(rng, 1, 1, d, 12 * B + 1);
  TestCache tc = make_cache(rng, d, 12 * B + 1, K);
  auto sel = make_selector("streaming", tc.cfg);
  const int n_pages = tc.seq.n_pages();  // 13
  const auto q = randn(rng, size_t(4) * d);
  for (int k : {0, 1, 2, 3, 5, 12, 13, 40}) {
    Selection s;
    sel->select(*tc.cache, request(tc, q, 4, 0, 0, k), s);
    std::vector<int32_t> want;
    const int kk = std::max(k, 2);
    if (kk >= n_pages) {
      want.resize(n_pages);
      std::iota(want.begin(), want.end(), 0);
    } else {
      want.push_back(0);
      for (int j = n_pages - (kk - 1); j < n_pages; ++j) want.push_back(j);
    }
    EXPECT_EQ(s.pages, want) << "k=" << k;
    EXPECT_EQ(s.bytes_read, 0u);
    EXPECT_EQ(s.all_pages, kk >= n_pages);
  }
}

// =============================================================================================
// Every baseline: invariants, budgets, documented bytes, clones, concurrent heads
// =============================================================================================

TEST(BaselineSelectors, InvariantsAndDocumentedBytes) {
  std::mt19937 rng(408);
  const int d = 64, n_tokens = 13 * B + 7;
  const Keys K = page_keys(rng, 2, 2, d, n_tokens), C = page_keys(rng, 2, 2, d, 4 * B);
  TestCache tc = make_cache(rng, d, n_tokens, K, KvDtype::F32, C, 4 * B);
  auto gb = std::make_shared<const GlobalBasis>(calibrate_global_basis(*tc.cache, tc.other, d));
  const int n_pages = tc.seq.n_pages(), n_full = n_tokens / B, last = n_tokens - n_full * B;
  const size_t partial_k = size_t(last) * d * 4;              // f32 cache
  const int rho = matched_bytes_rank(SummaryFormat{}, B, d);  // 25
  // Documented per-page bytes at the default (shipped) format: r = 8, int4 basis, int8 coef/centroid.
  struct Case {
    const char* name;
    size_t per_page, per_step;
  };
  const Case cases[] = {
      {"quest", size_t(2 * d * 2), 0},
      {"centroid", size_t(d + 2), 0},
      {"second-moment", size_t(d + 2) + 8 * size_t(d / 2 + 2) + 8 * 2, 0},
      {"sequence-basis", size_t(d + 2) + size_t(B) * (rho + 2), size_t(rho) * d * 4},
      {"global-basis", size_t(d + 2) + size_t(B) * (rho + 2), size_t(rho) * d * 4},
      {"streaming", 0, 0},
  };
  SelectorOptions opts;
  opts.global_basis = gb;
  for (const Case& c : cases) {
    auto sel = make_selector(c.name, tc.cfg, opts);
    fill_all(*sel, tc);
    for (int G : {1, 4, 5})
      for (int il = 0; il < 2; ++il) {
        // Both KV heads at once, as Session's decode does (sequence-basis fits lazily per head).
        std::vector<std::vector<float>> qs(2);
        for (int h = 0; h < 2; ++h) qs[h] = group_query(rng, tc, il, h, G, 6);
        bool first = true;
        for (int k : {3, 0, 1, 2, 5, n_pages - 1, n_pages, n_pages + 3}) {
          std::vector<Selection> par(2), ser(2);
          auto copy = sel->clone();  // before the first select of this layer: not fitted yet
          if (first) {
#pragma omp parallel for num_threads(2)
            for (int h = 0; h < 2; ++h) sel->select(*tc.cache, request(tc, qs[h], G, il, h, k), par[h]);
          } else {
            for (int h = 0; h < 2; ++h) sel->select(*tc.cache, request(tc, qs[h], G, il, h, k), par[h]);
          }
          first = false;
          for (int h = 0; h < 2; ++h) copy->select(*tc.cache, request(tc, qs[h], G, il, h, k), ser[h]);
          for (int h = 0; h < 2; ++h) {
            SCOPED_TRACE(testing::Message() << c.name << " G=" << G << " il=" << il << " h=" << h << " k=" << k);
            check_invariants(par[h], n_pages, k);
            EXPECT_EQ(par[h].pages, ser[h].pages);
            const bool reads = std::string(c.name) != "streaming";
            EXPECT_EQ(par[h].bytes_read, reads ? n_full * c.per_page + c.per_step + partial_k : 0u);
          }
        }
      }
  }
}

// =============================================================================================
// On the reference model through Session: fork a dense prefill to every baseline and decode
// =============================================================================================

// ~900 tokens of real text (examples/haystack.txt from character 30000) with BOS.
static std::vector<int32_t> haystack_ids(const LlamaModel& model) {
  std::ifstream in(test::source_path("examples/haystack.txt"));
  std::stringstream ss;
  ss << in.rdbuf();
  return model.tokenizer.encode(ss.str().substr(30000, 4000), true);
}

TEST(BaselineSelectors, ForkAndDecodeOnTheReferenceModel) {
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  const auto ids = haystack_ids(model);
  ASSERT_GT(ids.size(), 460u);
  SessionConfig cfg;
  cfg.n_ctx = 512;
  SessionConfig cal_cfg = cfg;
  cfg.prefill_chunk = 112;  // two prefill batches before the sequence-basis fit
  Session base(model, cfg);
  base.prefill(std::span<const int32_t>(ids.data(), 200));
  // Global basis calibrated on other text of the same model.
  Session cal(model, cal_cfg);
  cal.prefill(std::span<const int32_t>(ids.data() + 220, 240));
  SelectorOptions opts;
  opts.global_basis = std::make_shared<const GlobalBasis>(
      calibrate_global_basis(cal.cache(), cal.sequence(), matched_bytes_rank(SummaryFormat{}, 16, model.hp.head_dim)));
  const int steps = 2;
  for (const char* name : {"quest", "centroid", "second-moment", "sequence-basis", "global-basis", "streaming"}) {
    SCOPED_TRACE(name);
    SessionConfig fc = cfg;
    fc.selector = name;
    fc.budget_tokens = 4 * 16;
    fc.selector_opts = opts;
    Session s = base.fork(fc);
    for (int t = 0; t < steps; ++t) {
      const auto& logits = s.decode(ids[200 + t]);
      for (float x : logits) ASSERT_TRUE(std::isfinite(x));
    }
    const DecodeTotals& tot = s.totals();
    EXPECT_EQ(tot.steps, steps);
    EXPECT_LT(tot.bytes_read, tot.dense_bytes);  // 13 pages, 4 attended
    if (std::string(name) == "streaming") {
      // Reads nothing itself: exactly the K+V (f16) of pages {0, 10, 11, 12} per (layer, KV head,
      // step), the last one partial (201 + t tokens in the sequence at step t).
      double want = 0.0;
      for (int t = 0; t < steps; ++t) want += 2.0 * (3 * 16 + (201 + t - 12 * 16)) * model.hp.head_dim * 2;
      EXPECT_EQ(tot.bytes_read, want * model.hp.n_layer * model.hp.n_head_kv);
    }
  }
  // With a budget covering the sequence a baseline decodes exactly like dense attention.
  Session dense = base.fork(cfg);
  std::vector<float> want = dense.decode(ids[200]);
  for (const char* name : {"quest", "sequence-basis"}) {
    SessionConfig fc = cfg;
    fc.selector = name;
    fc.budget_tokens = 512;
    fc.selector_opts = opts;
    Session s = base.fork(fc);
    EXPECT_EQ(s.decode(ids[200]), want) << name;
  }
}

// One prepared selector cloned into several forks (as `locks eval` does for the budgets of one
// selector) decodes exactly like fresh forks, also for sequence-basis's fit done at preparation:
// kept when the first decode step leaves the full pages unchanged (200 tokens), refit when that
// step completes a page (207 + 1 = 13 pages).
TEST(BaselineSelectors, PreparedSelectorForksDecodeLikeFreshForks) {
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  const auto ids = haystack_ids(model);
  ASSERT_GT(ids.size(), 480u);
  SessionConfig cfg;
  cfg.n_ctx = 512;
  Session cal(model, cfg);
  cal.prefill(std::span<const int32_t>(ids.data() + 240, 240));
  SelectorOptions opts;
  opts.global_basis = std::make_shared<const GlobalBasis>(
      calibrate_global_basis(cal.cache(), cal.sequence(), matched_bytes_rank(SummaryFormat{}, 16, model.hp.head_dim)));
  for (int n_prefill : {200, 207}) {
    Session base(model, cfg);
    base.prefill(std::span<const int32_t>(ids.data(), n_prefill));
    for (const std::string& name : selector_names()) {
      SCOPED_TRACE(name + " after " + std::to_string(n_prefill) + " tokens");
      SessionConfig fc = cfg;
      fc.selector = name;
      fc.selector_opts = opts;
      fc.budget_tokens = 64;
      const auto prepared = base.prepare_selector(fc);
      for (int budget : {64, 96}) {
        fc.budget_tokens = budget;
        Session fresh = base.fork(fc), shared = base.fork(fc, *prepared);
        for (int t = 0; t < 3; ++t) {
          const std::vector<float> want = fresh.decode(ids[size_t(n_prefill) + t]);
          ASSERT_EQ(shared.decode(ids[size_t(n_prefill) + t]), want) << "budget " << budget << " step " << t;
        }
        EXPECT_EQ(shared.totals().bytes_read, fresh.totals().bytes_read);
        if (name == "sequence-basis") {
          const auto& a = dynamic_cast<const SequenceBasisSelector&>(shared.selector());
          const auto& b = dynamic_cast<const SequenceBasisSelector&>(fresh.selector());
          for (int il = 0; il < model.hp.n_layer; ++il)
            for (int h = 0; h < model.hp.n_head_kv; ++h) {
              EXPECT_EQ(a.basis(il, h), b.basis(il, h)) << "layer " << il << " head " << h;
            }
        }
      }
    }
  }
}

TEST(BaselineSelectors, EstimatesAndReconstructionsForTheFidelityProbe) {
  std::mt19937 rng(410);
  const int d = 16, n_tokens = 6 * B + 3;
  const Keys K = page_keys(rng, 1, 2, d, n_tokens), C = page_keys(rng, 1, 2, d, 3 * B);
  TestCache tc = make_cache(rng, d, n_tokens, K, KvDtype::F32, C, 3 * B);
  SelectorOptions opts;
  opts.summary = SummaryFormat::unquantized(8);
  opts.global_basis = std::make_shared<const GlobalBasis>(calibrate_global_basis(*tc.cache, tc.other, d));
  for (const char* name : {"quest", "centroid", "second-moment", "sequence-basis", "global-basis", "streaming"}) {
    SCOPED_TRACE(name);
    auto sel = make_selector(name, tc.cfg, opts);
    fill_all(*sel, tc);
    const auto q = randn(rng, size_t(4) * d);
    SelectionRequest req = request(tc, q, 4, 0, 1, 3);
    req.want_estimates = true;
    Selection s;
    sel->select(*tc.cache, req, s);
    if (auto* e = dynamic_cast<EstimatingSelector*>(sel.get())) {
      std::vector<float> est;
      e->estimate(*tc.cache, req, est);
      EXPECT_EQ(s.log_mass, est);
      req.want_estimates = false;
      sel->select(*tc.cache, req, s);
      EXPECT_TRUE(s.log_mass.empty());
    } else {
      EXPECT_TRUE(s.log_mass.empty());
    }
    // Per-token reconstructions: centroid (every row = the mean) and the shared bases; quest and
    // second-moment keep none.
    std::vector<float> rec(size_t(B) * d);
    const bool has = sel->reconstruct_keys(0, 1, tc.seq.page_table[2], rec.data());
    const std::string n = name;
    EXPECT_EQ(has, n == "centroid" || n == "sequence-basis" || n == "global-basis");
    if (n == "centroid") {
      const auto mu = page_mean(&K[0][1][size_t(2) * B * d], B, d);
      for (int i = 0; i < B; ++i)
        for (int c = 0; c < d; ++c) EXPECT_NEAR(rec[size_t(i) * d + c], mu[c], 1e-5);
    }
    if (n == "global-basis") {  // calibrated at full rank d (rho 16 = d): exact
      for (int x = 0; x < B * d; ++x) EXPECT_NEAR(rec[x], K[0][1][size_t(2) * B * d + x], 1e-4);
    }
  }
}

TEST(BaselineSelectors, ShortSequencesAndPageAlignedLengths) {
  // Shorter than one page, exactly one page, page-aligned (the recent page is full and scored from
  // its metadata), one token past a page boundary.
  std::mt19937 rng(409);
  const int d = 16;
  for (int n_tokens : {5, 16, 48, 49}) {
    const Keys K = page_keys(rng, 1, 2, d, n_tokens), C = page_keys(rng, 1, 2, d, 2 * B);
    TestCache tc = make_cache(rng, d, n_tokens, K, KvDtype::F32, C, 2 * B);
    SelectorOptions opts;
    opts.global_basis = std::make_shared<const GlobalBasis>(calibrate_global_basis(*tc.cache, tc.other, d));
    const int n_pages = tc.seq.n_pages(), n_full = n_tokens / B;
    for (const char* name : {"quest", "centroid", "second-moment", "sequence-basis", "global-basis", "streaming"}) {
      auto sel = make_selector(name, tc.cfg, opts);
      fill_all(*sel, tc);
      for (int G : {1, 5})
        for (int k : {2, 3}) {
          SCOPED_TRACE(testing::Message() << name << " tokens=" << n_tokens << " G=" << G << " k=" << k);
          const auto q = randn(rng, size_t(G) * d);
          Selection s;
          sel->select(*tc.cache, request(tc, q, G, 0, 1, k), s);
          check_invariants(s, n_pages, k);
          if (auto* e = dynamic_cast<EstimatingSelector*>(sel.get())) {
            std::vector<float> est;
            const size_t bytes = e->estimate(*tc.cache, request(tc, q, G, 0, 1, k), est);
            for (float x : est) EXPECT_TRUE(std::isfinite(x));
            EXPECT_EQ(bytes, s.bytes_read);
            // Full pages from metadata, the partial page (if any) from its keys.
            EXPECT_GE(bytes, size_t(n_tokens - n_full * B) * d * 4);
            if (n_full == 0) {
              EXPECT_EQ(bytes, size_t(n_tokens) * d * 4);
            }
          }
        }
    }
  }
}
