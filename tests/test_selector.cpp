// Page selection (Alg. 2 lines 6-9), the Eq. 8 coverage guarantee, and the selectors chosen by name,
// checked against float64 reimplementations written here.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "locks/kv_cache.h"
#include "locks/model.h"
#include "locks/page_summary.h"
#include "locks/selector.h"
#include "locks/session.h"
#include "test_paths.h"
#include "test_util.h"

using namespace locks;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

using test::randn;

// Per-head shares softmax_j(lm[g][j]) in float64 ([G][n]); heads with no finite value give zeros.
std::vector<double> ref_shares(const std::vector<double>& lm, int G, int n) {
  std::vector<double> sh(size_t(G) * n, 0.0);
  for (int g = 0; g < G; ++g) {
    double mx = -kInf;
    for (int j = 0; j < n; ++j) mx = std::max(mx, lm[size_t(g) * n + j]);
    if (mx == -kInf) continue;
    double z = 0.0;
    for (int j = 0; j < n; ++j) z += std::exp(lm[size_t(g) * n + j] - mx);
    for (int j = 0; j < n; ++j) sh[size_t(g) * n + j] = std::exp(lm[size_t(g) * n + j] - mx) / z;
  }
  return sh;
}

// Combined float64 page scores for a group rule (mass-sum: summed log-mass, a monotone stand-in
// for its softmax).
std::vector<double> ref_scores(const std::vector<double>& lm, int G, int n, GroupRule rule) {
  std::vector<double> sc(n, 0.0);
  if (rule == GroupRule::kMassSum) {
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < n; ++j) sc[j] += lm[size_t(g) * n + j];
    return sc;
  }
  const auto sh = ref_shares(lm, G, n);
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < n; ++j) {
      const double x = sh[size_t(g) * n + j];
      sc[j] = rule == GroupRule::kShareAverage ? sc[j] + x / G : std::max(sc[j], x);
    }
  return sc;
}

// Reference rule: sink + recent + top-(k-2) of the middle pages by score (ties to lower index).
std::vector<int32_t> ref_select(const std::vector<double>& sc, int k) {
  const int n = int(sc.size());
  k = std::max(k, 2);
  std::vector<int32_t> out;
  if (n <= k) {
    out.resize(n);
    std::iota(out.begin(), out.end(), 0);
    return out;
  }
  std::vector<int32_t> mid(n - 2);
  std::iota(mid.begin(), mid.end(), 1);
  std::stable_sort(mid.begin(), mid.end(), [&](int32_t a, int32_t b) { return sc[a] > sc[b]; });
  out.assign(mid.begin(), mid.begin() + (k - 2));
  out.push_back(0);
  out.push_back(n - 1);
  std::sort(out.begin(), out.end());
  return out;
}

// Checks the invariants of a selection and that it is a top-(k-2) choice under the float64 scores
// `sc` (up to float rounding `tol`); equal to the reference when the boundary is not a near-tie.
void check_selection(const std::vector<int32_t>& got, const std::vector<double>& sc, int k, double tol) {
  const int n = int(sc.size());
  const int want_size = std::min(std::max(k, 2), n);
  ASSERT_EQ(int(got.size()), want_size);
  for (size_t i = 1; i < got.size(); ++i) ASSERT_LT(got[i - 1], got[i]) << "not strictly ascending";
  for (int32_t p : got) ASSERT_TRUE(p >= 0 && p < n);
  ASSERT_EQ(got.front(), 0) << "sink page missing";
  ASSERT_EQ(got.back(), n - 1) << "recent page missing";
  const std::set<int32_t> in(got.begin(), got.end());
  double min_in = kInf, max_out = -kInf;
  for (int j = 1; j < n - 1; ++j) {
    if (in.count(j))
      min_in = std::min(min_in, sc[j]);
    else
      max_out = std::max(max_out, sc[j]);
  }
  if (min_in != kInf && max_out != -kInf) {
    EXPECT_GE(min_in, max_out - tol) << "a lower-scored page was kept";
  }
  const auto ref = ref_select(sc, k);
  // Near-tie at the boundary: any top choice is acceptable; otherwise the sets must be equal.
  std::vector<double> mid;
  for (int j = 1; j < n - 1; ++j) mid.push_back(sc[j]);
  std::sort(mid.rbegin(), mid.rend());
  const int kk = std::max(k, 2) - 2;
  const bool near_tie = kk > 0 && kk < int(mid.size()) && mid[kk - 1] - mid[kk] <= tol;
  if (!near_tie) {
    EXPECT_EQ(got, ref);
  }
}

std::vector<float> to_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

}  // namespace

// =============================================================================================
// select_top_pages
// =============================================================================================

TEST(Selector, TopPagesInvariantsAndFloat64Reference) {
  std::mt19937 rng(101);
  std::uniform_real_distribution<double> U(-8.0, 8.0);
  int cases = 0;
  for (GroupRule rule : {GroupRule::kShareAverage, GroupRule::kMax, GroupRule::kMassSum}) {
    for (int G : {1, 4, 5, 7}) {
      for (int n : {1, 2, 3, 5, 17, 40, 100}) {
        for (int k : {0, 1, 2, 3, 4, 8, 16, 39, 40, 41, 200}) {
          SCOPED_TRACE(testing::Message() << group_rule_name(rule) << " G=" << G << " n=" << n << " k=" << k);
          std::vector<double> lm(size_t(G) * n);
          for (auto& x : lm) x = U(rng);
          const auto lmf = to_float(lm);
          std::vector<double> lmd(lmf.begin(), lmf.end());  // reference sees the same float inputs
          std::vector<int32_t> out;
          std::vector<float> scores;
          select_top_pages(lmf.data(), G, n, k, rule, out, &scores);
          const auto sc = ref_scores(lmd, G, n, rule);
          ASSERT_EQ(scores.size(), size_t(n));
          if (rule != GroupRule::kMassSum) {
            for (int j = 0; j < n; ++j) EXPECT_NEAR(scores[j], sc[j], 1e-6 * (1.0 + std::abs(sc[j])));
          }
          check_selection(out, sc, k, rule == GroupRule::kMassSum ? 1e-5 * G * 8 : 1e-6);
          if (k >= n) {
            std::vector<int32_t> all(n);
            std::iota(all.begin(), all.end(), 0);
            EXPECT_EQ(out, all);
          }
          ++cases;
        }
      }
    }
  }
  EXPECT_GT(cases, 500);
}

TEST(Selector, TopPagesEmptyAndSinglePage) {
  std::vector<int32_t> out = {7, 8};
  select_top_pages(nullptr, 4, 0, 8, GroupRule::kShareAverage, out);
  EXPECT_TRUE(out.empty());
  const float lm[4] = {1.0f, -2.0f, 3.0f, 0.0f};
  select_top_pages(lm, 4, 1, 8, GroupRule::kShareAverage, out);
  EXPECT_EQ(out, std::vector<int32_t>{0});
  // Estimates that are not there are refused, not read.
  EXPECT_EQ(
      test::error_of<std::invalid_argument>([&] { select_top_pages(nullptr, 1, 4, 3, GroupRule::kShareAverage, out); }),
      "select_top_pages: no log-mass estimates (null) for 4 pages");
  EXPECT_EQ(
      test::error_of<std::invalid_argument>([&] { select_top_pages(lm, 0, 4, 3, GroupRule::kShareAverage, out); }),
      "select_top_pages: GQA group of 0 heads for 4 pages");
}

TEST(Selector, TopPagesTiesBreakTowardLowerIndex) {
  for (GroupRule rule : {GroupRule::kShareAverage, GroupRule::kMax, GroupRule::kMassSum}) {
    for (int G : {1, 5}) {
      const int n = 30;
      std::vector<float> lm(size_t(G) * n, 0.25f);
      for (int k : {2, 3, 7, 29}) {
        std::vector<int32_t> out, again;
        select_top_pages(lm.data(), G, n, k, rule, out);
        std::vector<int32_t> want;
        for (int j = 0; j < k - 1; ++j) want.push_back(j);  // sink + pages 1..k-2
        want.push_back(n - 1);
        EXPECT_EQ(out, want) << group_rule_name(rule) << " k=" << k;
        select_top_pages(lm.data(), G, n, k, rule, again);
        EXPECT_EQ(out, again) << "not deterministic";
      }
      // Partial tie: pages 10, 20, 25 share the top score; k-2 = 2 keeps 10 and 20.
      std::vector<float> lm2(size_t(G) * n, 0.0f);
      for (int g = 0; g < G; ++g)
        for (int j : {10, 20, 25}) lm2[size_t(g) * n + j] = 3.0f;
      std::vector<int32_t> out;
      select_top_pages(lm2.data(), G, n, 4, rule, out);
      EXPECT_EQ(out, (std::vector<int32_t>{0, 10, 20, n - 1})) << group_rule_name(rule);
    }
  }
}

TEST(Selector, TopPagesNeverPreferNegInfOverFinite) {
  std::mt19937 rng(102);
  std::uniform_real_distribution<double> U(-20.0, 5.0);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (GroupRule rule : {GroupRule::kShareAverage, GroupRule::kMax, GroupRule::kMassSum}) {
    for (int G : {1, 4, 7}) {
      for (int trial = 0; trial < 30; ++trial) {
        const int n = 12 + trial;
        std::vector<float> lm(size_t(G) * n);
        for (auto& x : lm) x = float(U(rng));
        std::vector<char> dead(n, 0);
        int n_finite_mid = 0;
        for (int j = 1; j < n - 1; ++j) {
          dead[j] = (j % 3 == trial % 3) || j < 4;  // low indices dead: ties cannot rescue them
          if (dead[j])
            for (int g = 0; g < G; ++g) lm[size_t(g) * n + j] = ninf;
          else
            ++n_finite_mid;
        }
        for (int k = 2; k <= n_finite_mid + 2; k += 3) {
          std::vector<int32_t> out;
          std::vector<float> scores;
          select_top_pages(lm.data(), G, n, k, rule, out, &scores);
          for (int32_t p : out) EXPECT_FALSE(dead[p]) << group_rule_name(rule) << " selected -inf page " << p;
          for (float s : scores) EXPECT_FALSE(std::isnan(s));
        }
      }
    }
  }
  // Every head -inf everywhere: no NaN, still sink + recent + lowest indices.
  std::vector<float> all_dead(4 * 10, ninf);
  std::vector<int32_t> out;
  std::vector<float> scores;
  select_top_pages(all_dead.data(), 4, 10, 4, GroupRule::kShareAverage, out, &scores);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 2, 9}));
  // Pages no head could estimate rank below any finite page's share (>= 0): all equal, negative.
  for (float s : scores) {
    EXPECT_LT(s, 0.0f);
    EXPECT_EQ(s, scores[0]);
  }
  // NaN or +inf is no estimate at all (it would make every share NaN): refused, named.
  std::vector<float> bad(3 * 10, 0.5f);
  bad[2 * 10 + 6] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(test::error_of<std::invalid_argument>(
                [&] { select_top_pages(bad.data(), 3, 10, 4, GroupRule::kShareAverage, out, &scores); }),
            "select_top_pages: log-mass nan at head 2, page 6");
  bad[2 * 10 + 6] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(test::error_of<std::invalid_argument>(
                [&] { select_top_pages(bad.data(), 3, 10, 4, GroupRule::kMax, out, &scores); }),
            "select_top_pages: log-mass inf at head 2, page 6");
}

TEST(Selector, GroupRuleNames) {
  for (GroupRule r : {GroupRule::kShareAverage, GroupRule::kMax, GroupRule::kMassSum})
    EXPECT_EQ(parse_group_rule(group_rule_name(r)), r);
  EXPECT_THROW(parse_group_rule("average"), std::invalid_argument);
}

// =============================================================================================
// Eq. 8: LOCKS selection keeps >= e^{-4 eta} of the oracle's group-average coverage
// =============================================================================================

namespace {

// A page: centroid + low-rank structure + noise, [16][d].
std::vector<float> make_page(std::mt19937& rng, int d, int true_rank, double noise, const std::vector<float>& center) {
  std::normal_distribution<double> N(0.0, 1.0);
  std::vector<double> dirs(size_t(true_rank) * d);
  for (auto& x : dirs) x = N(rng);
  std::vector<float> k(size_t(16) * d);
  for (int i = 0; i < 16; ++i) {
    std::vector<double> a(true_rank);
    for (auto& x : a) x = 1.5 * N(rng);
    for (int c = 0; c < d; ++c) {
      double x = center[c] + noise * N(rng);
      for (int t = 0; t < true_rank; ++t) x += a[t] * dirs[size_t(t) * d + c];
      k[size_t(i) * d + c] = float(x);
    }
  }
  return k;
}

using test::ref_lse;

// Group-average coverage: mean over heads of the exact attention mass inside `sel`.
double coverage(const std::vector<double>& exact_lm, int G, int n, const std::vector<int32_t>& sel) {
  const auto sh = ref_shares(exact_lm, G, n);
  double c = 0.0;
  for (int g = 0; g < G; ++g)
    for (int32_t j : sel) c += sh[size_t(g) * n + j];
  return c / G;
}

}  // namespace

TEST(Selector, Eq8CoverageBoundOnRandomGroups) {
  std::mt19937 rng(111);
  const int d = 64;
  const double scale = 1.0 / std::sqrt(double(d));
  int cases = 0, differ = 0, tight = 0;
  for (int G : {1, 4, 5, 7}) {
    for (int n_pages : {6, 13, 24}) {
      for (int trial = 0; trial < 4; ++trial) {
        // From nearly exact summaries (rank <= r, tiny noise: small eta, a sharp bound) to lossy ones.
        const int r = trial < 3 ? 4 : 2;
        const double noise = trial == 0 ? 0.003 : trial == 1 ? 0.02 : 0.15;
        // Pages around a few shared directions so several compete for the mass.
        std::vector<float> base = randn(rng, d, 1.0);
        std::vector<std::vector<float>> pages;
        std::vector<PageSummaryF32> sums;
        for (int j = 0; j < n_pages; ++j) {
          auto center = base;
          const auto jitter = randn(rng, d, 1.0 + 0.5 * (j % 3));
          for (int c = 0; c < d; ++c) center[c] += jitter[c];
          pages.push_back(make_page(rng, d, 2 + (j % 3), noise, center));
          sums.push_back(build_page_summary(pages.back().data(), 16, d, r));
        }
        // Queries of the group: a shared direction plus per-head variation (GQA heads correlate).
        const auto qbase = randn(rng, d, 1.0);
        std::vector<float> q(size_t(G) * d);
        for (int g = 0; g < G; ++g) {
          const auto qv = randn(rng, d, 0.7);
          for (int c = 0; c < d; ++c) q[size_t(g) * d + c] = 1.5f * (qbase[c] + qv[c]);
        }
        std::vector<double> exact(size_t(G) * n_pages), est(size_t(G) * n_pages);
        double eta = 0.0;
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < n_pages; ++j) {
            const float* qg = &q[size_t(g) * d];
            exact[size_t(g) * n_pages + j] = ref_lse(pages[j].data(), 16, qg, d, scale);
            est[size_t(g) * n_pages + j] = summary_log_mass(sums[j], qg, d, float(scale));
            eta = std::max(eta, std::abs(est[size_t(g) * n_pages + j] - exact[size_t(g) * n_pages + j]));
          }
        for (int k : {2, 3, 4, n_pages / 2, n_pages - 1}) {
          SCOPED_TRACE(testing::Message() << "G=" << G << " pages=" << n_pages << " k=" << k << " eta=" << eta);
          std::vector<int32_t> sel_locks, sel_oracle;
          const auto estf = to_float(est), exactf = to_float(exact);
          select_top_pages(estf.data(), G, n_pages, k, GroupRule::kShareAverage, sel_locks);
          select_top_pages(exactf.data(), G, n_pages, k, GroupRule::kShareAverage, sel_oracle);
          const double cov_l = coverage(exact, G, n_pages, sel_locks);
          const double cov_o = coverage(exact, G, n_pages, sel_oracle);
          // The oracle maximises coverage among valid sets, LOCKS keeps e^{-4 eta} of it.
          EXPECT_GE(cov_o, cov_l - 1e-6);
          EXPECT_GE(cov_l, std::exp(-4.0 * eta) * cov_o - 1e-6);
          ++cases;
          if (sel_locks != sel_oracle) ++differ;
          if (std::exp(-4.0 * eta) > 0.5) ++tight;
        }
      }
    }
  }
  EXPECT_GT(cases, 200);
  // The data must exercise the theorem: some selections differ, and often the bound is non-trivial.
  EXPECT_GT(differ, 0);
  EXPECT_GT(tight, cases / 4);
}

TEST(Selector, Eq8CoverageBoundUnderAdversarialPerturbations) {
  // Eq. 8 as a statement about the selection rule alone: any estimates within eta of the exact
  // log-masses keep e^{-4 eta} of the oracle's group-average coverage. Perturbations push low-mass
  // pages up and high-mass pages down (the adversarial direction), or are random in [-eta, eta].
  std::mt19937 rng(112);
  std::normal_distribution<double> N(0.0, 1.0);
  std::uniform_real_distribution<double> U(-1.0, 1.0);
  int cases = 0, differ = 0;
  double worst_slack = kInf;
  for (int G : {1, 4, 5, 7}) {
    for (int n_pages : {5, 12, 33, 64}) {
      for (double eta : {0.01, 0.05, 0.2, 0.5}) {
        for (int trial = 0; trial < 6; ++trial) {
          // Correlated heads: shared page profile plus per-head variation, spread of a few nats.
          std::vector<double> base(n_pages);
          for (auto& x : base) x = 1.5 * N(rng);
          std::vector<double> exact(size_t(G) * n_pages), est(size_t(G) * n_pages);
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < n_pages; ++j) exact[size_t(g) * n_pages + j] = float(base[j] + 0.7 * N(rng));
          const auto sh = ref_scores(exact, G, n_pages, GroupRule::kShareAverage);
          std::vector<double> sorted = sh;
          std::sort(sorted.begin(), sorted.end());
          const double median = sorted[n_pages / 2];
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < n_pages; ++j) {
              const double u = trial % 2 == 0 ? (sh[j] < median ? eta : -eta) : eta * U(rng);
              est[size_t(g) * n_pages + j] = exact[size_t(g) * n_pages + j] + u;
            }
          const auto estf = to_float(est), exactf = to_float(exact);
          double eta_real = 0.0;  // as the selector sees it (float inputs)
          for (size_t i = 0; i < est.size(); ++i) eta_real = std::max(eta_real, std::abs(double(estf[i]) - exact[i]));
          for (int k : {2, 3, 5, n_pages / 2 + 1}) {
            std::vector<int32_t> sel_est, sel_exact;
            select_top_pages(estf.data(), G, n_pages, k, GroupRule::kShareAverage, sel_est);
            select_top_pages(exactf.data(), G, n_pages, k, GroupRule::kShareAverage, sel_exact);
            const double cov_e = coverage(exact, G, n_pages, sel_est), cov_o = coverage(exact, G, n_pages, sel_exact);
            EXPECT_GE(cov_o, cov_e - 1e-6) << "G=" << G << " pages=" << n_pages << " k=" << k;
            EXPECT_GE(cov_e, std::exp(-4.0 * eta_real) * cov_o - 1e-6)
                << "G=" << G << " pages=" << n_pages << " k=" << k << " eta=" << eta_real;
            worst_slack = std::min(worst_slack, cov_e / cov_o - std::exp(-4.0 * eta_real));
            ++cases;
            differ += sel_est != sel_exact;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 1000);
  EXPECT_GT(differ, cases / 20) << "perturbations should change many selections";
  EXPECT_GE(worst_slack, -1e-6);
}

// =============================================================================================
// Selectors by name on a paged cache
// =============================================================================================

namespace {

struct SyntheticCache {
  KvCacheConfig cfg;
  std::unique_ptr<PagedKvCache> cache;
  KvSequence seq, other;
  // keys[il][h] = [n_tokens][d] float (as stored: f32 cache)
  std::vector<std::vector<std::vector<float>>> keys;
};

// Two sequences appended in alternation so page tables are not contiguous; seq's pages have
// centered keys of rank `true_rank` per (layer, KV head).
SyntheticCache make_cache(std::mt19937& rng, int n_tokens, int true_rank, int d = 64) {
  SyntheticCache sc;
  sc.cfg.n_layer = 2;
  sc.cfg.n_head_kv = 2;
  sc.cfg.head_dim = d;
  sc.cfg.page_size = 16;
  sc.cfg.n_pages = 2 * ((n_tokens + 15) / 16) + 2;
  sc.cfg.dtype = KvDtype::F32;
  sc.cache = std::make_unique<PagedKvCache>(sc.cfg);
  for (int t = 0; t < n_tokens; t += 16) {
    const int n = std::min(16, n_tokens - t);
    sc.cache->append_tokens(sc.seq, n);
    sc.cache->append_tokens(sc.other, n);
  }
  const int H = sc.cfg.n_head_kv;
  sc.keys.assign(sc.cfg.n_layer, std::vector<std::vector<float>>(H));
  std::vector<float> kbuf(size_t(H) * d), vbuf(size_t(H) * d);
  for (int il = 0; il < sc.cfg.n_layer; ++il) {
    for (int h = 0; h < H; ++h) {
      auto& K = sc.keys[il][h];
      const auto base = randn(rng, d);
      for (int p = 0; p * 16 < n_tokens; ++p) {
        const int n = std::min(16, n_tokens - p * 16);
        auto center = randn(rng, d, 1.5);
        for (int c = 0; c < d; ++c) center[c] += base[c];
        const auto page = make_page(rng, d, true_rank, 0.0, center);
        K.insert(K.end(), page.begin(), page.begin() + size_t(n) * d);
      }
    }
    for (int t = 0; t < n_tokens; ++t) {
      for (int h = 0; h < H; ++h) std::copy_n(&sc.keys[il][h][size_t(t) * d], d, &kbuf[size_t(h) * d]);
      vbuf = randn(rng, size_t(H) * d);
      sc.cache->write(il, sc.seq, t, kbuf.data(), vbuf.data());
      // The other sequence gets unrelated data in its own pages.
      const auto junk = randn(rng, size_t(H) * d, 5.0);
      sc.cache->write(il, sc.other, t, junk.data(), vbuf.data());
    }
  }
  return sc;
}

// Exact float64 page log-masses of the group [G][n_pages] for (il, h) of the synthetic sequence.
std::vector<double> exact_masses(const SyntheticCache& sc, int il, int h, const std::vector<float>& q, int G) {
  const int d = sc.cfg.head_dim, n_pages = sc.seq.n_pages();
  std::vector<double> lm(size_t(G) * n_pages);
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < n_pages; ++j) {
      const int n = std::min(16, sc.seq.n_tokens - j * 16);
      lm[size_t(g) * n_pages + j] =
          ref_lse(&sc.keys[il][h][size_t(j) * 16 * d], n, &q[size_t(g) * d], d, 1.0 / std::sqrt(double(d)));
    }
  return lm;
}

std::vector<int32_t> full_pages(const KvSequence& seq, int B) {
  return std::vector<int32_t>(seq.page_table.begin(), seq.page_table.begin() + seq.n_tokens / B);
}

}  // namespace

TEST(Selector, MakeSelectorByName) {
  KvCacheConfig cfg;
  cfg.n_pages = 4;
  const auto names = selector_names();
  for (const char* want : {"full", "oracle", "locks"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  for (const char* n : {"full", "oracle", "locks"}) EXPECT_EQ(make_selector(n, cfg)->name(), n);
  try {
    make_selector("bogus", cfg);
    FAIL() << "unknown selector accepted";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("bogus"), std::string::npos) << msg;
    for (const auto& n : names)
      EXPECT_NE(msg.find(n), std::string::npos) << "message should list '" << n << "': " << msg;
  }
}

// Every selector gets the same checks (Selector's non-virtual entry points): requests and filled
// pages outside the cache throw naming the index, before the selector's own work.
TEST(Selector, RequestsOutsideTheCacheThrow) {
  std::mt19937 rng(5);
  SyntheticCache sc = make_cache(rng, 16 * 6, 4);
  const std::vector<float> q = randn(rng, size_t(2) * 64);
  for (const char* name : {"full", "oracle", "locks", "quest", "streaming"}) {
    SCOPED_TRACE(name);
    auto sel = make_selector(name, sc.cfg);
    EXPECT_EQ(test::error_of<std::out_of_range>([&] {
                sel->on_pages_filled(*sc.cache, 0, std::vector<int32_t>{0, sc.cfg.n_pages});
              }),
              fmt::format("on_pages_filled: page id {} outside the pool [0, {})", sc.cfg.n_pages, sc.cfg.n_pages));
    EXPECT_EQ(test::error_of<std::out_of_range>([&] { sel->on_pages_filled(*sc.cache, sc.cfg.n_layer, {}); }),
              fmt::format("on_pages_filled: layer {} outside [0, {})", sc.cfg.n_layer, sc.cfg.n_layer));
    // A page of the pool that no sequence holds (its K was never written: metadata from zeros).
    {
      ASSERT_GT(sc.cache->n_free_pages(), 0);
      int32_t free_page = -1;
      for (int32_t p = 0; p < sc.cfg.n_pages && free_page < 0; ++p)
        if (std::find(sc.seq.page_table.begin(), sc.seq.page_table.end(), p) == sc.seq.page_table.end() &&
            std::find(sc.other.page_table.begin(), sc.other.page_table.end(), p) == sc.other.page_table.end())
          free_page = p;
      EXPECT_EQ(test::error_of<std::out_of_range>(
                    [&] { sel->on_pages_filled(*sc.cache, 0, std::vector<int32_t>{free_page}); }),
                fmt::format("on_pages_filled: page id {} is not in use (released, or not from this pool)", free_page));
    }
    SelectionRequest req;
    req.q = q.data();
    req.n_group = 2;
    req.seq = &sc.seq;
    req.budget_pages = 4;
    Selection out;
    req.kv_head = 7;
    EXPECT_EQ(test::error_of<std::out_of_range>([&] { sel->select(*sc.cache, req, out); }),
              fmt::format("select: KV head 7 outside [0, {})", sc.cfg.n_head_kv));
    req.kv_head = 0;
    req.il = -1;
    EXPECT_EQ(test::error_of<std::out_of_range>([&] { sel->select(*sc.cache, req, out); }),
              fmt::format("select: layer -1 outside [0, {})", sc.cfg.n_layer));
    req.il = 0;
    req.n_group = 0;
    EXPECT_EQ(test::error_of<std::invalid_argument>([&] { sel->select(*sc.cache, req, out); }),
              "select: n_group 0 < 1");
    req.n_group = 2;
    std::vector<float> q_bad = q;
    q_bad[64 + 3] = NAN;
    req.q = q_bad.data();
    EXPECT_EQ(test::error_of<std::invalid_argument>([&] { sel->select(*sc.cache, req, out); }),
              "select: non-finite query at head 1, dim 3");
    q_bad[64 + 3] = -INFINITY;
    EXPECT_EQ(test::error_of<std::invalid_argument>([&] { sel->select(*sc.cache, req, out); }),
              "select: non-finite query at head 1, dim 3");
    req.q = q.data();
    req.seq = nullptr;
    EXPECT_EQ(test::error_of<std::invalid_argument>([&] { sel->select(*sc.cache, req, out); }),
              "select: the request needs q and seq");
    KvSequence bad = sc.seq;
    bad.page_table[1] = 100000;
    req.seq = &bad;
    EXPECT_EQ(test::error_of<std::out_of_range>([&] { sel->select(*sc.cache, req, out); }),
              fmt::format("select: page id 100000 outside the pool [0, {})", sc.cfg.n_pages));
    bad = sc.seq;
    bad.n_tokens = 4000;
    EXPECT_EQ(test::error_of<std::invalid_argument>([&] { sel->select(*sc.cache, req, out); }),
              fmt::format("select: a sequence of 4000 tokens cannot have {} pages of 16 tokens", sc.seq.n_pages()));
    // A cache of another layout than the selector's per-page data was sized for.
    KvCacheConfig other = sc.cfg;
    other.n_pages += 100;
    PagedKvCache big(other);
    EXPECT_THAT(test::error_of<std::invalid_argument>(
                    [&] { sel->on_pages_filled(big, 0, std::vector<int32_t>{int32_t(sc.cfg.n_pages + 50)}); }),
                testing::HasSubstr("on_pages_filled: selector '" + std::string(name) + "' was made for a cache of"));
  }
}

TEST(Selector, FullOracleAndLocksOnSyntheticCache) {
  std::mt19937 rng(121);
  const int n_tokens = 16 * 14 + 7;  // partial last page
  const int d = 64, r = 8;
  SyntheticCache sc = make_cache(rng, n_tokens, 5);  // rank 5 <= r: summaries are exact
  const int n_pages = sc.seq.n_pages(), G = 4;
  ASSERT_EQ(n_pages, 15);
  SelectorOptions opts;
  opts.summary = SummaryFormat::unquantized(r);
  auto full = make_selector("full", sc.cfg, opts);
  auto oracle = make_selector("oracle", sc.cfg, opts);
  auto locks = make_selector("locks", sc.cfg, opts);
  for (int il = 0; il < sc.cfg.n_layer; ++il) locks->on_pages_filled(*sc.cache, il, full_pages(sc.seq, 16));
  auto locks_copy = locks->clone();

  for (int il = 0; il < sc.cfg.n_layer; ++il) {
    for (int h = 0; h < sc.cfg.n_head_kv; ++h) {
      for (int trial = 0; trial < 4; ++trial) {
        // Query near one page's keys so the masses are uneven.
        std::vector<float> q = randn(rng, size_t(G) * d, 0.5);
        const int hot = 1 + trial * 3;
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < d; ++c) q[size_t(g) * d + c] += 0.4f * sc.keys[il][h][size_t(hot * 16 + g) * d + c];
        const auto lm = exact_masses(sc, il, h, q, G);
        const auto want_scores = ref_scores(lm, G, n_pages, GroupRule::kShareAverage);
        for (int k : {2, 4, 6, 15, 20}) {
          SCOPED_TRACE(testing::Message() << "il=" << il << " h=" << h << " k=" << k);
          SelectionRequest req;
          req.q = q.data();
          req.n_group = G;
          req.il = il;
          req.kv_head = h;
          req.seq = &sc.seq;
          req.budget_pages = k;
          Selection s_full, s_oracle, s_locks, s_copy;
          full->select(*sc.cache, req, s_full);
          oracle->select(*sc.cache, req, s_oracle);
          locks->select(*sc.cache, req, s_locks);
          locks_copy->select(*sc.cache, req, s_copy);
          std::vector<int32_t> all(n_pages);
          std::iota(all.begin(), all.end(), 0);
          EXPECT_EQ(s_full.pages, all);
          EXPECT_TRUE(s_full.all_pages);
          check_selection(s_oracle.pages, want_scores, k, 1e-5);
          check_selection(s_locks.pages, want_scores, k, 1e-4);
          EXPECT_EQ(s_copy.pages, s_locks.pages);
          EXPECT_EQ(s_locks.all_pages, k >= n_pages);
          EXPECT_EQ(s_oracle.all_pages, k >= n_pages);
          if (k >= n_pages) {
            EXPECT_EQ(s_locks.pages, all);
          }
          // Bytes read: oracle reads every K; LOCKS reads summaries of full pages and the partial
          // recent page's keys.
          const int last = n_tokens - (n_pages - 1) * 16;
          EXPECT_EQ(s_oracle.bytes_read, size_t(n_tokens) * d * 4);
          EXPECT_EQ(s_locks.bytes_read, size_t(n_pages - 1) * opts.summary.bytes(16, d) + size_t(last) * d * 4);
        }
      }
    }
  }
}

TEST(Selector, LocksShippedFormatBudgetCoversAllPages) {
  std::mt19937 rng(122);
  SyntheticCache sc = make_cache(rng, 16 * 9, 12);  // exactly 9 full pages
  auto locks = make_selector("locks", sc.cfg);      // default options: shipped quantized format
  for (int il = 0; il < sc.cfg.n_layer; ++il) locks->on_pages_filled(*sc.cache, il, full_pages(sc.seq, 16));
  const auto q = randn(rng, 5 * sc.cfg.head_dim);
  SelectionRequest req;
  req.q = q.data();
  req.n_group = 5;
  req.il = 1;
  req.kv_head = 1;
  req.seq = &sc.seq;
  for (int k : {9, 10, 64}) {
    req.budget_pages = k;
    Selection s;
    locks->select(*sc.cache, req, s);
    std::vector<int32_t> all(9);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(s.pages, all);
    EXPECT_TRUE(s.all_pages);
  }
  req.budget_pages = 4;
  Selection s;
  locks->select(*sc.cache, req, s);
  EXPECT_EQ(s.pages.size(), 4u);
  EXPECT_FALSE(s.all_pages);
  EXPECT_EQ(s.bytes_read, size_t(9) * SummaryFormat{}.bytes(16, sc.cfg.head_dim));
}

// =============================================================================================
// LOCKS on real model pages
// =============================================================================================

namespace {

void rmsnorm_ref(const float* x, const std::vector<float>& w, int n, double eps, std::vector<double>& out) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const double inv = 1.0 / std::sqrt(ss / n + eps);
  out.resize(n);
  for (int i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// Layer-0 projection W x followed by RoPE "normal" at `pos` (float64), heads of `head_dim`.
std::vector<float> layer0_proj_rope(const LlamaModel& m, const Matrix& W, int32_t token, int32_t pos) {
  const auto& hp = m.hp;
  std::vector<double> xn;
  rmsnorm_ref(&m.tok_embd.data[size_t(token) * hp.n_embd], m.layers[0].attn_norm, hp.n_embd, hp.rms_eps, xn);
  std::vector<double> y(W.rows, 0.0);
  for (int r = 0; r < W.rows; ++r)
    for (int c = 0; c < W.cols; ++c) y[r] += double(W.data[size_t(r) * W.cols + c]) * xn[c];
  const int n_heads = W.rows / hp.head_dim;
  for (int h = 0; h < n_heads; ++h)
    for (int i = 0; i < hp.n_rot / 2; ++i) {
      const double a = pos * std::pow(double(hp.rope_freq_base), -2.0 * i / hp.n_rot);
      double* p = &y[size_t(h) * hp.head_dim + 2 * i];
      const double x0 = p[0], x1 = p[1];
      p[0] = x0 * std::cos(a) - x1 * std::sin(a);
      p[1] = x0 * std::sin(a) + x1 * std::cos(a);
    }
  return std::vector<float>(y.begin(), y.end());
}

}  // namespace

TEST(Selector, LocksKeepsOracleCoverageOnRealModelPages) {
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  std::ifstream in(test::source_path("examples/haystack.txt"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto ids = model.tokenizer.encode(ss.str().substr(20000, 6000), true);
  ASSERT_GT(ids.size(), 340u);
  const int n_prefill = 320, n_steps = 16;
  SessionConfig cfg;
  cfg.kv_dtype = KvDtype::F32;
  cfg.n_ctx = 512;
  cfg.selector = "locks";  // shipped summary format: int4 basis, int8 coefficients and centroid
  cfg.budget_tokens = 6 * 16;
  Session session(model, cfg);
  session.prefill(std::span<const int32_t>(ids.data(), n_prefill));
  const PagedKvCache& cache = session.cache();
  const KvSequence& seq = session.sequence();
  const auto& hp = model.hp;
  const int d = hp.head_dim, G = hp.n_group(), B = cache.page_size();
  const int n_pages = seq.n_pages();
  ASSERT_EQ(n_pages, n_prefill / B);

  // Our layer-0 keys must be the cache's keys: validates the query computation below.
  std::vector<float> kpage(size_t(B) * d);
  for (int t : {0, 17, 200, n_prefill - 1}) {
    const auto k = layer0_proj_rope(model, model.layers[0].wk, ids[t], t);
    for (int h = 0; h < hp.n_head_kv; ++h) {
      cache.k_page_f32(0, seq.page_table[t / B], h, kpage.data());
      for (int c = 0; c < d; ++c)
        ASSERT_NEAR(kpage[size_t(t % B) * d + c], k[size_t(h) * d + c], 2e-3 * (1.0 + std::abs(k[size_t(h) * d + c])));
    }
  }

  auto locks = session.selector().clone();
  auto oracle = make_selector("oracle", cache.config());
  const double scale = 1.0 / std::sqrt(double(d));
  double sum_ratio = 0.0, sum_locks = 0.0, sum_oracle = 0.0;
  int n = 0, top_kept = 0;
  std::vector<float> kbuf(size_t(B) * d);
  for (int step = 0; step < n_steps; ++step) {
    // Real layer-0 queries of the next tokens of the text, at their decode positions.
    const int32_t pos = n_prefill + step;
    const auto q = layer0_proj_rope(model, model.layers[0].wq, ids[pos], pos);
    for (int h = 0; h < hp.n_head_kv; ++h) {
      const float* qg = &q[size_t(h) * G * d];
      std::vector<double> lm(size_t(G) * n_pages);
      for (int j = 0; j < n_pages; ++j) {
        cache.k_page_f32(0, seq.page_table[j], h, kbuf.data());
        for (int g = 0; g < G; ++g) lm[size_t(g) * n_pages + j] = ref_lse(kbuf.data(), B, qg + size_t(g) * d, d, scale);
      }
      SelectionRequest req;
      req.q = qg;
      req.n_group = G;
      req.il = 0;
      req.kv_head = h;
      req.seq = &seq;
      req.budget_pages = session.budget_pages();
      Selection sl, so;
      locks->select(cache, req, sl);
      oracle->select(cache, req, so);
      const double cl = coverage(lm, G, n_pages, sl.pages), co = coverage(lm, G, n_pages, so.pages);
      EXPECT_GE(co, cl - 1e-5);  // the oracle is optimal
      sum_ratio += cl / co;
      sum_locks += cl;
      sum_oracle += co;
      // The oracle's best middle page (by group-average share).
      const auto sc = ref_scores(lm, G, n_pages, GroupRule::kShareAverage);
      const int best = int(std::max_element(sc.begin() + 1, sc.end() - 1) - sc.begin());
      top_kept += std::count(sl.pages.begin(), sl.pages.end(), best) > 0;
      ++n;
    }
  }
  const double mean_ratio = sum_ratio / n;
  RecordProperty("mean_coverage_ratio", std::to_string(mean_ratio));
  RecordProperty("locks_coverage", std::to_string(sum_locks / n));
  RecordProperty("oracle_coverage", std::to_string(sum_oracle / n));
  RecordProperty("top_page_kept", std::to_string(top_kept) + "/" + std::to_string(n));
  EXPECT_GE(mean_ratio, 0.9) << "locks " << sum_locks / n << " oracle " << sum_oracle / n;
  EXPECT_GE(top_kept, (8 * n) / 10) << "top oracle page kept in " << top_kept << " of " << n << " steps";
  // The budget is binding: the oracle does not capture everything.
  EXPECT_LT(sum_oracle / n, 0.999);
}
