// The streamed Eq. 4 score pass (PageSummaryStore::score_pages) on every kernel this CPU runs,
// checked against Eq. 4 in float64 on the stored (dequantized) summary, against the per-page scorer
// score(), and inside the LOCKS selector against select_top_pages on score()'s estimates.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "locks/kv_cache.h"
#include "locks/page_summary.h"
#include "locks/selector.h"
#include "test_util.h"

using namespace locks;
using test::randn;

namespace {

constexpr ScoreKernel kKernels[] = {ScoreKernel::kPortable, ScoreKernel::kAvx2, ScoreKernel::kAvx512Vnni};

// Keys with page structure: an offset, a few decaying directions and noise.
std::vector<float> structured_page(std::mt19937& rng, int d) {
  std::normal_distribution<double> N(0.0, 1.0);
  std::vector<double> off(d), dirs(size_t(6) * d);
  for (auto& x : off) x = 2.0 * N(rng);
  for (auto& x : dirs) x = N(rng);
  std::vector<float> k(size_t(16) * d);
  for (int i = 0; i < 16; ++i) {
    double a[6];
    for (int t = 0; t < 6; ++t) a[t] = 2.0 * N(rng) / (1.0 + t);
    for (int c = 0; c < d; ++c) {
      double x = off[c] + 0.3 * N(rng);
      for (int t = 0; t < 6; ++t) x += a[t] * dirs[size_t(t) * d + c];
      k[size_t(i) * d + c] = float(x);
    }
  }
  return k;
}

// Eq. 4 in float64 on a float summary, and the largest |reconstructed key|_1 (a bound of the query
// rounding's effect: |d s_hat| <= scale * max_c |d q_c| * max_i |k_i|_1).
struct Ref {
  double lse;
  double key_l1;
};
Ref ref_eq4(const PageSummaryF32& s, const float* q, int d, double scale) {
  const int r = int(s.basis.size()) / d, n = int(s.coef.size()) / r;
  double m = -std::numeric_limits<double>::infinity(), key_l1 = 0.0;
  std::vector<double> z(n);
  for (int i = 0; i < n; ++i) {
    double acc = 0.0, l1 = 0.0;
    for (int c = 0; c < d; ++c) {
      double k = s.centroid[c];
      for (int t = 0; t < r; ++t) k += double(s.coef[size_t(i) * r + t]) * s.basis[size_t(t) * d + c];
      acc += double(q[c]) * k;
      l1 += std::abs(k);
    }
    z[i] = acc * scale;
    m = std::max(m, z[i]);
    key_l1 = std::max(key_l1, l1);
  }
  double l = 0.0;
  for (double x : z) l += std::exp(x - m);
  return {m + std::log(l), key_l1};
}

double q_step(const float* q, int d) {  // half a 21-bit code step of this query (its rounding bound)
  double amax = 0.0;
  for (int c = 0; c < d; ++c) amax = std::max(amax, double(std::abs(q[c])));
  return amax / (2.0 * ((1 << 20) - 1));
}

}  // namespace

TEST(ScorePass, EveryKernelMatchesFloat64Eq4AndThePerPageScorer) {
  std::mt19937 rng(301);
  const SummaryFormat fmt{8, 4, 8, 8};  // the shipped point
  for (int d : {64, 128, 192}) {
    const int n_pages = 40;
    PageSummaryStore store(fmt, 2, 2, n_pages, 16, d);
    ASSERT_TRUE(store.integer_scoring());
    std::vector<PageSummaryF32> loaded(n_pages);
    for (int p = 0; p < n_pages; ++p) {
      const auto keys = structured_page(rng, d);
      store.store(1, 0, p, build_page_summary(keys.data(), 16, d, 8));
      loaded[p] = store.load(1, 0, p);
    }
    std::vector<int32_t> pages(n_pages);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    pages.resize(33);  // a subset, in any order
    const float scale = 1.0f / std::sqrt(float(d));
    for (int G : {1, 4, 7, 9}) {
      const auto q = randn(rng, size_t(G) * d, G % 2 ? 3.0 : 0.7);
      const size_t stride = pages.size() + 3;
      std::vector<float> per_page(size_t(G) * pages.size());
      for (size_t j = 0; j < pages.size(); ++j)
        for (int g = 0; g < G; ++g)
          store.score(1, 0, pages[j], &q[size_t(g) * d], 1, scale, &per_page[size_t(g) * pages.size() + j]);
      std::vector<float> portable;
      for (ScoreKernel k : kKernels) {
        if (!score_kernel_supported(k)) continue;
        SCOPED_TRACE(testing::Message() << score_kernel_name(k) << " d=" << d << " G=" << G);
        std::vector<float> out(size_t(G) * stride, 123.0f), hmax(G);
        store.score_pages(1, 0, pages, q.data(), G, scale, out.data(), stride, hmax.data(), k);
        for (int g = 0; g < G; ++g) {
          float mx = -INFINITY;
          for (size_t j = 0; j < pages.size(); ++j) {
            const float got = out[size_t(g) * stride + j];
            const Ref ref = ref_eq4(loaded[pages[j]], &q[size_t(g) * d], d, scale);
            const double bound = scale * q_step(&q[size_t(g) * d], d) * ref.key_l1 + 2e-5 * (1.0 + std::abs(ref.lse));
            EXPECT_NEAR(got, ref.lse, bound) << "page " << pages[j] << " g=" << g;
            const float today = per_page[size_t(g) * pages.size() + j];
            EXPECT_NEAR(got, today, bound + 1e-4 * (1.0 + std::abs(today))) << "page " << pages[j] << " g=" << g;
            mx = std::max(mx, got);
          }
          EXPECT_EQ(hmax[g], mx);
          for (size_t j = pages.size(); j < stride; ++j) EXPECT_EQ(out[size_t(g) * stride + j], 123.0f);  // untouched
        }
        // The SIMD kernels do the portable kernel's integer arithmetic: only float sums differ in order.
        std::vector<float> packed(size_t(G) * pages.size());
        for (int g = 0; g < G; ++g)
          std::copy_n(&out[size_t(g) * stride], pages.size(), &packed[size_t(g) * pages.size()]);
        if (k == ScoreKernel::kPortable)
          portable = packed;
        else
          for (size_t i = 0; i < packed.size(); ++i)
            EXPECT_NEAR(packed[i], portable[i], 1e-5 * (1.0 + std::abs(portable[i]))) << i;
      }
    }
  }
}

TEST(ScorePass, ZeroAndHugeQueries) {
  // q = 0: every logit is 0, s_hat = log 16 exactly in real arithmetic. A huge q stays finite and
  // tracks the float64 value relatively.
  std::mt19937 rng(302);
  const int d = 64;
  PageSummaryStore store(SummaryFormat{8, 4, 8, 8}, 1, 1, 3, 16, d);
  for (int p = 0; p < 3; ++p) store.store(0, 0, p, build_page_summary(structured_page(rng, d).data(), 16, d, 8));
  const std::vector<int32_t> pages = {2, 0, 1};
  for (ScoreKernel k : kKernels) {
    if (!score_kernel_supported(k)) continue;
    SCOPED_TRACE(score_kernel_name(k));
    std::vector<float> q(size_t(2) * d, 0.0f), out(6);
    for (int c = 0; c < d; ++c) q[d + c] = (c % 3 ? 1e4f : -3e4f) * float(c + 1) / d;
    store.score_pages(0, 0, pages, q.data(), 2, 0.125f, out.data(), 3, nullptr, k);
    for (int j = 0; j < 3; ++j) {
      EXPECT_NEAR(out[j], std::log(16.0), 1e-6);
      const Ref ref = ref_eq4(store.load(0, 0, pages[j]), &q[d], d, 0.125);
      ASSERT_TRUE(std::isfinite(out[3 + j]));
      EXPECT_NEAR(out[3 + j], ref.lse, 0.125 * q_step(&q[d], d) * ref.key_l1 + 1e-5 * std::abs(ref.lse));
    }
  }
}

TEST(ScorePass, OtherFormatsGoThroughThePerPageScorer) {
  std::mt19937 rng(303);
  for (const SummaryFormat& fmt :
       {SummaryFormat{8, 8, 8, 8}, SummaryFormat{4, 4, 8, 8}, SummaryFormat::unquantized(8)}) {
    for (int d : {64, 72}) {
      PageSummaryStore store(fmt, 1, 1, 4, 16, d);
      EXPECT_FALSE(store.integer_scoring());
      for (int p = 0; p < 4; ++p)
        store.store(0, 0, p, build_page_summary(structured_page(rng, d).data(), 16, d, fmt.rank));
      const std::vector<int32_t> pages = {3, 1, 2};
      const int G = 3;
      const auto q = randn(rng, size_t(G) * d);
      std::vector<float> out(size_t(G) * 3), want(G);
      store.score_pages(0, 0, pages, q.data(), G, 0.125f, out.data(), 3);
      for (int j = 0; j < 3; ++j) {
        store.score(0, 0, pages[j], q.data(), G, 0.125f, want.data());
        for (int g = 0; g < G; ++g) EXPECT_EQ(out[size_t(g) * 3 + j], want[g]) << fmt.describe();
      }
    }
  }
  // d not a multiple of 64 in the shipped format: also the per-page scorer.
  PageSummaryStore odd(SummaryFormat{8, 4, 8, 8}, 1, 1, 1, 16, 96);
  EXPECT_FALSE(odd.integer_scoring());
}

TEST(ScorePass, BadRequestsThrow) {
  std::mt19937 rng(304);
  const int d = 64;
  PageSummaryStore store(SummaryFormat{8, 4, 8, 8}, 1, 1, 4, 16, d);
  store.store(0, 0, 1, build_page_summary(structured_page(rng, d).data(), 16, d, 8));
  auto q = randn(rng, size_t(2) * d);
  std::vector<float> out(8);
  const std::vector<int32_t> one = {1}, two = {1, 1};
  EXPECT_EQ(
      test::error_of<std::invalid_argument>([&] { store.score_pages(0, 0, two, q.data(), 2, 0.125f, out.data(), 1); }),
      "score_pages: output stride 1 < 2 pages");
  EXPECT_EQ(
      test::error_of<std::invalid_argument>([&] { store.score_pages(0, 0, one, q.data(), 0, 0.125f, out.data(), 1); }),
      "score_pages: GQA group of 0 heads");
  EXPECT_THROW(store.score_pages(0, 0, std::vector<int32_t>{1, 2}, q.data(), 2, 0.125f, out.data(), 2),
               std::logic_error);  // page 2 has no summary
  EXPECT_THROW(store.score_pages(0, 1, one, q.data(), 2, 0.125f, out.data(), 1), std::out_of_range);
  q[d + 5] = NAN;
  EXPECT_EQ(
      test::error_of<std::invalid_argument>([&] { store.score_pages(0, 0, one, q.data(), 2, 0.125f, out.data(), 1); }),
      "score_pages: non-finite query at head 1, dim 5");
  for (ScoreKernel k : kKernels) {
    if (score_kernel_supported(k)) continue;
    EXPECT_EQ(test::error_of<std::invalid_argument>(
                  [&] { store.score_pages(0, 0, one, q.data(), 2, 0.125f, out.data(), 1, nullptr, k); }),
              std::string("score_pages: this CPU does not run the ") + score_kernel_name(k) + " kernel");
  }
  EXPECT_NE(best_score_kernel(), ScoreKernel::kAuto);
  EXPECT_TRUE(score_kernel_supported(best_score_kernel()));
}

TEST(ScorePass, LocksSelectorKeepsThePagesOfThePerPageEstimates) {
  // The selector's streamed estimates against score() page by page, and its pages against
  // select_top_pages on those estimates: a page may differ only at a near tie of the group share.
  std::mt19937 rng(305);
  KvCacheConfig cfg;
  cfg.n_layer = 1;
  cfg.n_head_kv = 2;
  cfg.head_dim = 64;
  cfg.n_pages = 80;
  PagedKvCache cache(cfg);
  KvSequence seq;
  const int n_tok = 16 * 70 + 9;
  cache.append_tokens(seq, n_tok);
  std::vector<float> kv(size_t(2) * 64);
  std::vector<float> page_keys[2];
  for (int t = 0; t < n_tok; ++t) {
    if (t % 16 == 0)
      for (int h = 0; h < 2; ++h) page_keys[h] = structured_page(rng, 64);
    for (int h = 0; h < 2; ++h) std::copy_n(&page_keys[h][size_t(t % 16) * 64], 64, &kv[size_t(h) * 64]);
    const auto v = randn(rng, kv.size());
    cache.write(0, seq, t, kv.data(), v.data());
  }
  auto sel = make_selector("locks", cfg);
  std::vector<int32_t> full(seq.page_table.begin(), seq.page_table.begin() + n_tok / 16);
  sel->on_pages_filled(cache, 0, full);
  const int G = 4, n_pages = seq.n_pages();
  for (int trial = 0; trial < 6; ++trial) {
    const auto q = randn(rng, size_t(G) * 64, 1.0 + trial);
    SelectionRequest req;
    req.q = q.data();
    req.n_group = G;
    req.kv_head = trial % 2;
    req.seq = &seq;
    req.budget_pages = 12;
    req.want_estimates = true;
    Selection out;
    sel->select(cache, req, out);
    ASSERT_EQ(out.log_mass.size(), size_t(G) * n_pages);
    // Reference estimates: a fresh store with the same summaries, scored page by page.
    PageSummaryStore ref_store(SummaryFormat{8, 4, 8, 8}, 1, 2, cfg.n_pages, 16, 64);
    std::vector<float> ref(size_t(G) * n_pages), keys(size_t(16) * 64);
    for (int j = 0; j < n_pages; ++j) {
      cache.k_page_f32(0, seq.page_table[j], req.kv_head, keys.data());
      const int nt = page_tokens(seq, j, 16);
      for (int g = 0; g < G; ++g) {
        if (nt == 16) {
          if (g == 0) ref_store.store(0, req.kv_head, seq.page_table[j], build_page_summary(keys.data(), 16, 64, 8));
          ref_store.score(0, req.kv_head, seq.page_table[j], &q[size_t(g) * 64], 1, 0.125f,
                          &ref[size_t(g) * n_pages + j]);
        } else {
          ref[size_t(g) * n_pages + j] = exact_log_mass(keys.data(), nt, &q[size_t(g) * 64], 64, 0.125f);
        }
        const float got = out.log_mass[size_t(g) * n_pages + j];
        EXPECT_NEAR(got, ref[size_t(g) * n_pages + j], 2e-4 * (1.0 + std::abs(got))) << "page " << j << " g=" << g;
      }
    }
    std::vector<int32_t> want;
    std::vector<float> share;
    select_top_pages(ref.data(), G, n_pages, req.budget_pages, GroupRule::kShareAverage, want, &share);
    ASSERT_EQ(out.pages.size(), want.size());
    std::vector<float> sorted(share.begin() + 1, share.end() - 1);
    std::sort(sorted.rbegin(), sorted.rend());
    const float kth = sorted[req.budget_pages - 3];
    for (int32_t p : out.pages) {
      if (std::binary_search(want.begin(), want.end(), p)) continue;
      EXPECT_NEAR(share[p], kth, 1e-3 * kth) << "page " << p << " chosen over a clearly better one";
    }
  }
}
