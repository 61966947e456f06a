// The adaptive budget of `locks` (BudgetRule): select_pages_by_mass against a float64 reimplementation
// (top-p), the certified share against every log-mass the bounds allow, and on the reference model
// the certificate against the exact group share of the pages a decode step kept.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "locks/eval_runner.h"
#include "locks/model.h"
#include "locks/selector.h"
#include "locks/session.h"
#include "selectors/selectors.h"
#include "test_paths.h"
#include "test_util.h"

using namespace locks;

namespace {

// Share-average group share (Eq. 5) of the pages `kept` under log-masses lm [G][n], in float64.
double group_share(const std::vector<double>& lm, int G, int n, const std::vector<int32_t>& kept) {
  double total = 0;
  for (int g = 0; g < G; ++g) {
    const double* l = &lm[size_t(g) * n];
    const double mx = *std::max_element(l, l + n);
    double z = 0, in = 0;
    for (int j = 0; j < n; ++j) z += std::exp(l[j] - mx);
    for (int32_t j : kept) in += std::exp(l[j] - mx);
    total += in / z;
  }
  return total / G;
}

// Middle pages (not sink, not recent) by float64 share-average score, best first, ties to the lower index.
std::vector<int32_t> ranked_middle(const std::vector<double>& lm, int G, int n) {
  std::vector<double> score(n, 0.0);
  for (int j = 0; j < n; ++j) score[j] = group_share(lm, G, n, {j});
  std::vector<int32_t> mid(size_t(n - 2));
  std::iota(mid.begin(), mid.end(), 1);
  std::stable_sort(mid.begin(), mid.end(), [&](int32_t a, int32_t b) { return score[a] > score[b]; });
  return mid;
}

struct Case {
  std::vector<double> lm;  // [G][n]
  std::vector<float> lm_f;
  int G = 4, n = 0;
};

Case random_case(std::mt19937& rng, int G, int n, double spread) {
  Case c;
  c.G = G;
  c.n = n;
  c.lm.resize(size_t(G) * n);
  const auto base = test::randn(rng, size_t(n), spread);  // pages hot for every head, plus per-head noise
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < n; ++j) c.lm[size_t(g) * n + j] = double(base[j]) + test::randn(rng, 1, 0.5)[0];
  c.lm_f.assign(c.lm.begin(), c.lm.end());
  for (int i = 0; i < G * n; ++i) c.lm[size_t(i)] = c.lm_f[size_t(i)];  // the float values the selector sees
  return c;
}

void check_shape(const std::vector<int32_t>& got, int n, int lo, int hi) {
  ASSERT_GE(int(got.size()), std::min(lo, n));
  ASSERT_LE(int(got.size()), std::max(hi, 2));
  ASSERT_EQ(got.front(), 0) << "sink page missing";
  ASSERT_EQ(got.back(), n - 1) << "recent page missing";
  for (size_t i = 1; i < got.size(); ++i) ASSERT_LT(got[i - 1], got[i]) << "not strictly ascending";
}

}  // namespace

// Top-p: the kept set is sink + recent + a best-first prefix of the float64 ranking, the shortest one
// whose float64 share reaches P (within float rounding), unless min or max decides.
TEST(AdaptiveBudget, TopPIsTheShortestRankedPrefixReachingTheShare) {
  std::mt19937 rng(301);
  int met_count = 0, capped = 0;
  for (int n : {3, 12, 64, 400})
    for (double spread : {0.5, 3.0})
      for (double P : {0.5, 0.9, 0.99})
        for (auto [lo, hi] : {std::pair{2, 1 << 20}, {6, 1 << 20}, {2, 8}}) {
          SCOPED_TRACE(testing::Message()
                       << "n=" << n << " spread=" << spread << " P=" << P << " min=" << lo << " max=" << hi);
          const Case c = random_case(rng, 4, n, spread);
          std::vector<int32_t> got;
          const bool met = select_pages_by_mass(c.lm_f.data(), nullptr, c.G, n, lo, hi, P, got);
          check_shape(got, n, lo, hi);
          const auto mid = ranked_middle(c.lm, c.G, n);
          std::vector<int32_t> want = {0, n - 1};
          const int k_max = std::clamp(hi, 2, n);
          size_t used = 0;
          while (int(want.size()) < k_max &&
                 (group_share(c.lm, c.G, n, want) < P || int(want.size()) < std::min(lo, k_max)))
            want.push_back(mid[used++]);
          std::sort(want.begin(), want.end());
          const double share = group_share(c.lm, c.G, n, want);
          // A float-rounding tie at the boundary may move the stop by one page; otherwise exact.
          const bool boundary_tie =
              std::abs(share - P) < 1e-5 || (want.size() > 2 && std::abs(group_share(c.lm, c.G, n, {}) - P) < 1e-5);
          if (!boundary_tie) {
            EXPECT_EQ(got, want);
          }
          EXPECT_EQ(met, group_share(c.lm, c.G, n, got) >= P - 1e-5 || n <= 2);
          met_count += met;
          capped += !met;
        }
  EXPECT_GT(met_count, 20);
  EXPECT_GT(capped, 5);  // max=8 binds on wide pages at high P
}

// Certified: whenever the target is reported met, the true group share is at least P for every
// log-mass inside the bounds, the adversarial corner (kept pages at s_hat - beta, dropped at
// s_hat + beta, where the bound is tight) and random draws inside. With zero bounds it is top-p.
TEST(AdaptiveBudget, CertifiedShareHoldsForEveryLogMassInsideTheBounds) {
  std::mt19937 rng(302);
  std::uniform_real_distribution<double> U(0.0, 1.0);
  int met_count = 0, tight = 0;
  for (int n : {5, 40, 300})
    for (double beta_max : {0.0, 0.05, 0.5, 2.0})
      for (double P : {0.5, 0.9, 0.99}) {
        SCOPED_TRACE(testing::Message() << "n=" << n << " beta<=" << beta_max << " P=" << P);
        const Case c = random_case(rng, 4, n, 3.0);
        std::vector<float> beta(size_t(c.G) * n);
        for (auto& b : beta) b = float(beta_max * U(rng));
        std::vector<int32_t> got;
        const bool met = select_pages_by_mass(c.lm_f.data(), beta.data(), c.G, n, 2, n, P, got);
        check_shape(got, n, 2, n);
        if (beta_max == 0) {
          std::vector<int32_t> top_p;
          select_pages_by_mass(c.lm_f.data(), nullptr, c.G, n, 2, n, P, top_p);
          EXPECT_EQ(got, top_p) << "zero bounds: the certified share is the estimated one";
        }
        if (!met) {
          EXPECT_EQ(int(got.size()), n);
          continue;
        }
        ++met_count;
        const std::set<int32_t> in(got.begin(), got.end());
        std::vector<double> corner(c.lm.size());
        for (int g = 0; g < c.G; ++g)
          for (int j = 0; j < n; ++j) {
            const size_t i = size_t(g) * n + j;
            corner[i] = c.lm[i] + (in.count(j) ? -1.0 : 1.0) * beta[i];
          }
        const double worst = group_share(corner, c.G, n, got);
        EXPECT_GE(worst, P - 1e-9);
        tight += worst < P + 0.02;
        for (int draw = 0; draw < 20; ++draw) {
          std::vector<double> s(c.lm.size());
          for (size_t i = 0; i < s.size(); ++i) s[i] = c.lm[i] + (2 * U(rng) - 1) * beta[i];
          EXPECT_GE(group_share(s, c.G, n, got), P - 1e-9);
        }
      }
  EXPECT_GT(met_count, 15);
  EXPECT_GT(tight, 3) << "the certificate never came near its corner: it keeps more than it needs";
}

TEST(AdaptiveBudget, RefusesBadTargetsAndBounds) {
  std::vector<float> lm(4 * 10, 0.0f), bound(4 * 10, 0.1f);
  std::vector<int32_t> out;
  for (double P : {0.0, 1.0, -0.5, std::nan("")})
    EXPECT_THROW(select_pages_by_mass(lm.data(), nullptr, 4, 10, 2, 10, P, out), std::invalid_argument) << P;
  for (float b : {std::nanf(""), -1.0f, std::numeric_limits<float>::infinity()}) {
    bound[13] = b;
    const std::string msg = test::error_of<std::invalid_argument>(
        [&] { select_pages_by_mass(lm.data(), bound.data(), 4, 10, 2, 10, 0.9, out); });
    EXPECT_NE(msg.find("error bound"), std::string::npos) << msg;
    EXPECT_NE(msg.find("head 1, page 3"), std::string::npos) << msg;
  }
  lm[7] = std::nanf("");
  EXPECT_THROW(select_pages_by_mass(lm.data(), nullptr, 4, 10, 2, 10, 0.9, out), std::invalid_argument);
  SelectorOptions o;
  o.budget_rule = {BudgetRule::Kind::kCertified, 0.9, 0};
  o.group_rule = GroupRule::kMax;
  const KvCacheConfig cfg{1, 1, 64, 16, 4, KvDtype::F32};
  EXPECT_THROW(make_selector("locks", cfg, o), std::invalid_argument);
  o.group_rule = GroupRule::kShareAverage;
  o.budget_rule.mass = 1.5;
  EXPECT_THROW(make_selector("locks", cfg, o), std::invalid_argument);
}

TEST(AdaptiveBudget, SelectorSpecKeys) {
  const SelectorSpec s = parse_selector_spec("locks/cert=0.95/min=64/max=1024", SummaryFormat{});
  EXPECT_EQ(s.name, "locks");
  EXPECT_EQ(s.opts.budget_rule.kind, BudgetRule::Kind::kCertified);
  EXPECT_DOUBLE_EQ(s.opts.budget_rule.mass, 0.95);
  EXPECT_EQ(s.opts.budget_rule.min_tokens, 64);
  EXPECT_EQ(s.max_tokens, 1024);
  EXPECT_EQ(describe_selector(s.name, s.opts),
            "locks r=8 basis=int4 coef=int8 centroid=int8 share-average cert=0.95 min=64");
  const SelectorSpec p = parse_selector_spec("locks/p=0.9", SummaryFormat{});
  EXPECT_EQ(p.opts.budget_rule.kind, BudgetRule::Kind::kTopP);
  EXPECT_EQ(p.max_tokens, 0);
  EXPECT_FALSE(same_selector("locks", s.opts, "locks", p.opts));
  EXPECT_FALSE(same_selector("locks", p.opts, "locks", SelectorOptions{}));
  EXPECT_NE(device_refusal(Device::kCuda, "locks", p.opts), "");  // the GPU engine runs a fixed budget
}

namespace {

// Checks every (layer, KV head) selection of the decode steps it sees against exact attention.
class CertificateCheck final : public DecodeObserver {
 public:
  explicit CertificateCheck(double P) : P_(P) {}
  void observe(const PagedKvCache& cache, const KvSequence& seq, const Selector&, int il, int kv_head, const float* q,
               int G, int, const Selection& sel) override {
    const int n = seq.n_pages(), B = cache.page_size(), d = cache.config().head_dim;
    std::vector<double> lm(size_t(G) * n);
    std::vector<float> keys(size_t(B) * d);
    for (int j = 0; j < n; ++j) {
      cache.k_page_f32(il, seq.page_table[j], kv_head, keys.data());
      for (int g = 0; g < G; ++g)
        lm[size_t(g) * n + j] =
            test::ref_lse(keys.data(), page_tokens(seq, j, B), q + size_t(g) * d, d, 1.0 / std::sqrt(double(d)));
    }
    const double share = group_share(lm, G, n, sel.pages);
    std::lock_guard<std::mutex> lock(mu_);
    ++seen;
    kept_pages += double(sel.pages.size()) / n;
    if (sel.mass_target_met == 1) {
      ++met;
      worst = std::min(worst, share);
      EXPECT_GE(share, P_ - 1e-6) << "layer " << il << " KV head " << kv_head;
    }
  }
  int seen = 0, met = 0;
  double worst = 1, kept_pages = 0;

 private:
  double P_;
  std::mutex mu_;
};

}  // namespace

// The reference model's decode steps with `locks/cert=P`: at every selection reported met, the exact
// group share of the kept pages (every layer, real queries, int4 summaries) is at least P.
TEST(AdaptiveBudget, CertifiedLocksOnTheReferenceModel) {
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  std::ifstream in(test::source_path("examples/haystack.txt"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto ids = model.tokenizer.encode(ss.str().substr(10000, 12000), true);
  ASSERT_GT(ids.size(), 660u);
  for (double P : {0.5, 0.8}) {
    SessionConfig cfg;
    cfg.n_ctx = 1024;
    cfg.selector = "locks";
    cfg.selector_opts.budget_rule = {BudgetRule::Kind::kCertified, P, 0};
    cfg.budget_tokens = 40 * 16;  // below the 41 pages of the sequence: the selector decides
    Session s(model, cfg);
    s.prefill(std::span<const int32_t>(ids.data(), 648));
    CertificateCheck check(P);
    s.set_observer(&check);
    for (int t = 648; t < 660; ++t) s.decode(ids[size_t(t)]);
    s.set_observer(nullptr);
    SCOPED_TRACE(testing::Message() << "P=" << P);
    EXPECT_EQ(check.seen, 12 * model.hp.n_layer * model.hp.n_head_kv);
    EXPECT_GT(check.met, check.seen / 10) << "the certificate was almost never met: vacuous";
    EXPECT_LT(check.kept_pages / check.seen, 0.97) << "kept almost everything";
    RecordProperty(P == 0.5 ? "met_p50" : "met_p80", std::to_string(double(check.met) / check.seen));
  }
}

// A page stored at rank k in a rank-8 store is the rank-k summary: same Eq. 4 scores as a rank-k
// store, its bytes those of the rank-k format, and its tail the energy the first k directions miss.
TEST(AdaptiveRank, PageStoredAtALowerRankIsThatRanksSummary) {
  std::mt19937 rng(311);
  const int d = 64, B = 16;
  for (int k : {1, 3, 4, 7}) {
    const auto keys = test::randn(rng, size_t(B) * d, 1.0);
    const SummaryFormat f8{8, 4, 8, 8}, fk{k, 4, 8, 8};
    PageSummaryStore s8(f8, 1, 1, 1, B, d), sk(fk, 1, 1, 1, B, d);
    const PageSummaryF32 full = build_page_summary(keys.data(), B, d, 8);
    s8.store(0, 0, 0, full, keys.data(), k);
    sk.store(0, 0, 0, build_page_summary(keys.data(), B, d, k), keys.data());
    EXPECT_EQ(s8.page_rank(0, 0, 0), k);
    EXPECT_EQ(s8.page_bytes(0, 0, 0), fk.bytes(B, d));
    EXPECT_NEAR(s8.load(0, 0, 0).tail, sk.load(0, 0, 0).tail, 1e-4 * sk.load(0, 0, 0).tail);
    const int32_t page = 0;
    for (int t = 0; t < 4; ++t) {
      const auto q = test::randn(rng, size_t(d), 1.0);
      float a = 0, b = 0;
      s8.score_pages(0, 0, std::span<const int32_t>(&page, 1), q.data(), 1, 0.125f, &a, 1);
      sk.score(0, 0, 0, q.data(), 1, 0.125f, &b);
      EXPECT_NEAR(a, b, 1e-4) << "rank " << k;
    }
  }
  PageSummaryStore s8(SummaryFormat{}, 1, 1, 1, B, d);
  const auto keys = test::randn(rng, size_t(B) * d, 1.0);
  EXPECT_THROW(s8.store(0, 0, 0, build_page_summary(keys.data(), B, d, 8), keys.data(), 9), std::invalid_argument);
}

// locks/bytes=F on the reference model's pages: the mean summary bytes of every stored page meet the
// target, ranks vary with the pages, and within a (layer, KV head) and one batch of pages (a prefill
// chunk of 32 pages shares a threshold) a page whose spectral tail is below another's at every rank
// never gets the higher rank.
TEST(AdaptiveRank, RankRuleMeetsTheByteTargetOnModelPages) {
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  std::ifstream in(test::source_path("examples/haystack.txt"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto ids = model.tokenizer.encode(ss.str().substr(0, 12000), true);
  ASSERT_GT(ids.size(), 900u);
  SessionConfig cfg;
  cfg.n_ctx = 1024;
  cfg.selector = "locks";
  cfg.selector_opts.rank_bytes = 0.7;
  Session s(model, cfg);
  s.prefill(std::span<const int32_t>(ids.data(), 896));
  const auto& sel = dynamic_cast<const LocksSelector&>(s.selector());
  const PageSummaryStore& st = sel.store();
  const auto& seq = s.sequence();
  const int n_pages = 896 / 16;
  double bytes = 0;
  int n = 0;
  std::set<int> ranks_seen;
  std::vector<float> keys(size_t(16) * model.hp.head_dim);
  for (int il = 0; il < model.hp.n_layer; ++il)
    for (int h = 0; h < model.hp.n_head_kv; ++h) {
      std::vector<std::vector<double>> tails;
      std::vector<int> ranks;
      for (int j = 0; j < n_pages; ++j) {
        const int32_t page = seq.page_table[size_t(j)];
        bytes += double(st.page_bytes(il, h, page));
        ++n;
        ranks.push_back(st.page_rank(il, h, page));
        ranks_seen.insert(ranks.back());
        s.cache().k_page_f32(il, page, h, keys.data());
        const PageSummaryF32 f = build_page_summary(keys.data(), 16, model.hp.head_dim, 8);
        std::vector<double> t(8, 0.0);  // tau_r for r = 1..8
        for (int r = 1; r <= 8; ++r)
          for (size_t k = size_t(r); k < f.sigma2.size(); ++k) t[size_t(r - 1)] += f.sigma2[k];
        tails.push_back(t);
      }
      for (int a = 0; a < n_pages; ++a)
        for (int b = a / 32 * 32; b < std::min(n_pages, a / 32 * 32 + 32); ++b) {
          bool below = true;
          for (int r = 0; r < 8; ++r) below &= tails[size_t(a)][size_t(r)] < 0.999 * tails[size_t(b)][size_t(r)];
          if (below) {
            EXPECT_LE(ranks[size_t(a)], ranks[size_t(b)])
                << "layer " << il << " head " << h << " pages " << a << ", " << b;
          }
        }
    }
  const double full = double(SummaryFormat{}.bytes(16, model.hp.head_dim));
  EXPECT_LE(bytes / n, 0.7 * full * 1.02);  // each batch meets it over every page seen, at its threshold
  EXPECT_GE(bytes / n, 0.6 * full) << "far below the target: the rule drops more than asked";
  EXPECT_GE(ranks_seen.size(), 3u);
  RecordProperty("mean_bytes_fraction", std::to_string(bytes / n / full));
}

// An adaptive rule decides even where the budget covers the whole sequence (the engine's dense
// shortcut is for a fixed k), and a byte target below every page at rank 1 is refused.
TEST(AdaptiveBudget, RuleDecidesWhenTheBudgetCoversTheSequence) {
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  std::ifstream in(test::source_path("examples/haystack.txt"));
  std::stringstream ss;
  ss << in.rdbuf();
  const auto ids = model.tokenizer.encode(ss.str().substr(0, 6000), true);
  ASSERT_GT(ids.size(), 330u);
  SessionConfig cfg;
  cfg.n_ctx = 512;
  cfg.selector = "locks";
  cfg.budget_tokens = 512;  // every page of the 330-token sequence
  cfg.selector_opts.budget_rule = {BudgetRule::Kind::kTopP, 0.5, 0};
  Session s(model, cfg);
  s.prefill(std::span<const int32_t>(ids.data(), 320));
  for (int t = 320; t < 330; ++t) s.decode(ids[size_t(t)]);
  const DecodeTotals& tot = s.totals();
  EXPECT_EQ(tot.mass_target_tried, 10 * model.hp.n_layer * model.hp.n_head_kv);
  EXPECT_LT(tot.bytes_read, tot.dense_bytes);
  SelectorOptions o;
  o.rank_bytes = 0.1;  // rank 1 alone takes more than a tenth of the rank-8 bytes
  EXPECT_THROW(make_selector("locks", KvCacheConfig{1, 1, 64, 16, 4, KvDtype::F32}, o), std::invalid_argument);
  o.summary.rank = 9;  // above head_dim 8
  EXPECT_THROW(o.summary.validate(16, 8), std::invalid_argument);
}
