// The tail finding (locks/tail_finding.h): TailProbe's per-page errors and properties against an
// independent float64 computation on the reference model, and summarize_tails on pages whose answer
// is known by construction.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>
#include <vector>

#include "locks/model.h"
#include "locks/session.h"
#include "locks/tail_finding.h"
#include "test_paths.h"
#include "test_util.h"

using namespace locks;

namespace {

// Forwards to the probe and keeps the queries of one (layer, KV head).
class Recorder final : public DecodeObserver {
 public:
  Recorder(TailProbe& probe, int il, int h) : probe_(probe), il_(il), h_(h) {}
  void observe(const PagedKvCache& cache, const KvSequence& seq, const Selector& sel, int il, int kv_head,
               const float* q, int n_group, int budget_pages, const Selection& s) override {
    probe_.observe(cache, seq, sel, il, kv_head, q, n_group, budget_pages, s);
    if (il == il_ && kv_head == h_) queries.emplace_back(q, q + size_t(n_group) * cache.config().head_dim);
  }
  std::vector<std::vector<float>> queries;

 private:
  TailProbe& probe_;
  int il_, h_;
};

}  // namespace

TEST(TailFinding, ProbeMatchesAnIndependentComputationOnTheReferenceModel) {
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  std::ifstream in(test::source_path("examples/haystack.txt"));
  std::stringstream ss;
  ss << in.rdbuf();
  const auto ids = model.tokenizer.encode(ss.str().substr(3000, 4000), true);
  ASSERT_GT(ids.size(), 330u);
  SessionConfig cfg;
  cfg.n_ctx = 512;
  cfg.selector = "full";
  Session s(model, cfg);
  s.prefill(std::span<const int32_t>(ids.data(), 320));
  const SummaryFormat fmt;  // the shipped format
  TailProbe probe(s.cache(), s.sequence(), fmt);
  const int il = 3, h = 1, n_pages = 320 / 16, d = model.hp.head_dim, G = model.hp.n_group();
  Recorder rec(probe, il, h);
  s.set_observer(&rec);
  for (int t = 320; t < 326; ++t) s.decode(ids[size_t(t)]);
  s.set_observer(nullptr);
  const auto pages = probe.pages();
  ASSERT_EQ(pages.size(), size_t(model.hp.n_layer) * model.hp.n_head_kv * n_pages);
  ASSERT_EQ(rec.queries.size(), 6u);
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<float> keys(size_t(16) * d);
  for (int j : {0, 7, n_pages - 1}) {
    const TailPage& p = pages[(size_t(il) * model.hp.n_head_kv + h) * n_pages + j];
    ASSERT_EQ(p.layer, il);
    ASSERT_EQ(p.kv_head, h);
    ASSERT_EQ(p.page, j);
    s.cache().k_page_f32(il, s.sequence().page_table[size_t(j)], h, keys.data());
    PageSummaryStore store(fmt, 1, 1, 1, 16, d);
    const PageSummaryF32 sum = build_page_summary(keys.data(), 16, d, fmt.rank);
    store.store(0, 0, 0, sum);
    double err = 0, err_max = 0;
    for (const auto& q : rec.queries)
      for (int g = 0; g < G; ++g) {
        float est = 0;
        store.score(0, 0, 0, &q[size_t(g) * d], 1, float(scale), &est);
        const double e = std::abs(est - test::ref_lse(keys.data(), 16, &q[size_t(g) * d], d, scale));
        err += e, err_max = std::max(err_max, e);
      }
    EXPECT_EQ(p.queries, 6 * G);
    EXPECT_NEAR(p.err_mean, err / (6 * G), 1e-4) << "page " << j;
    EXPECT_NEAR(p.err_max, err_max, 1e-4) << "page " << j;
    double n_max = 0, n_min = 1e300, energy = 0;
    for (int i = 0; i < 16; ++i) {
      double n2 = 0;
      for (int c = 0; c < d; ++c) n2 += double(keys[size_t(i) * d + c]) * keys[size_t(i) * d + c];
      n_max = std::max(n_max, std::sqrt(n2)), n_min = std::min(n_min, std::sqrt(n2));
    }
    for (float v : sum.sigma2) energy += v;
    EXPECT_NEAR(p.norm_range, n_max / n_min, 1e-6 * n_max / n_min);
    EXPECT_NEAR(p.tail_frac, sum.tail / energy, 1e-6);
    EXPECT_NEAR(p.gap, std::sqrt(double(sum.sigma2[7]) / sum.sigma2[8]), 1e-5 * p.gap);
    EXPECT_DOUBLE_EQ(p.position, double(j) / (n_pages - 1));
    EXPECT_GT(p.resid, 0.0);
    // Every key is within resid of its reconstruction, so no query's error exceeds scale ||q|| resid.
    double q_max = 0;
    for (const auto& q : rec.queries)
      for (int g = 0; g < G; ++g) {
        double n2 = 0;
        for (int c = 0; c < d; ++c) n2 += double(q[size_t(g) * d + c]) * q[size_t(g) * d + c];
        q_max = std::max(q_max, std::sqrt(n2));
      }
    EXPECT_LE(p.err_max, scale * q_max * p.resid + 1e-4);
  }
}

// Error = a property (monotone), another property independent: Spearman 1 vs ~0, precision 1 vs ~0.1,
// the deciles of the first rise from ~0.05 to ~0.95.
TEST(TailFinding, SummaryRecoversAPredictorByConstruction) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> U(0, 1);
  std::vector<TailPage> pages;
  std::vector<int> ctx;
  for (int c = 0; c < 2; ++c)
    for (int il = 0; il < 3; ++il)
      for (int j = 0; j < 200; ++j) {
        TailPage p;
        p.layer = il, p.page = j;
        p.tail_frac = U(rng);
        p.err_mean = 0.5 * std::pow(p.tail_frac, 3);  // a heavy tail, a monotone function of tail_frac
        p.norm_range = 1 + U(rng);
        p.position = j / 199.0;
        pages.push_back(p), ctx.push_back(c);
      }
  const TailSummary s = summarize_tails(pages, ctx);
  EXPECT_EQ(s.pages, 1200);
  EXPECT_NEAR(s.spearman[2], 1.0, 1e-12);  // tail_frac
  EXPECT_NEAR(s.precision_top10[2], 1.0, 1e-12);
  EXPECT_LT(std::abs(s.spearman[0]), 0.2);  // norm_range: unrelated
  EXPECT_LT(s.precision_top10[0], 0.3);
  EXPECT_NEAR(s.decile_property_pct[0][2], 0.045, 0.01);
  EXPECT_NEAR(s.decile_property_pct[9][2], 0.955, 0.01);
  for (size_t dc = 1; dc < 10; ++dc) EXPECT_GT(s.decile_err[dc], s.decile_err[dc - 1]);
  EXPECT_THROW(summarize_tails(pages, {}), std::invalid_argument);
}
