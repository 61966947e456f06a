// Paged decode and prefill attention against float64 dense softmax references written here, and
// the Eq. 1 output identity.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "locks/attention.h"
#include "locks/kv_cache.h"
#include "test_util.h"

using namespace locks;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

using test::randn;

// Value as the cache stores it (f16 round-to-nearest-even via the compiler's _Float16, or f32).
float stored(float x, KvDtype dt) { return dt == KvDtype::F16 ? float(static_cast<_Float16>(x)) : x; }

// A cache with one sequence of n_tokens written in every layer; K/V kept as stored, [il][t][h][d].
struct Fixture {
  KvCacheConfig cfg;
  std::unique_ptr<PagedKvCache> cache;
  KvSequence seq, other;
  std::vector<std::vector<float>> K, V;  // [il] -> [n_tokens][n_head_kv][d] (stored values)

  float k(int il, int t, int h, int c) const { return K[il][(size_t(t) * cfg.n_head_kv + h) * cfg.head_dim + c]; }
  float v(int il, int t, int h, int c) const { return V[il][(size_t(t) * cfg.n_head_kv + h) * cfg.head_dim + c]; }
};

Fixture make_fixture(std::mt19937& rng, int n_layer, int n_head_kv, int d, int n_tokens, KvDtype dt,
                     int extra_pages = 4) {
  Fixture f;
  f.cfg.n_layer = n_layer;
  f.cfg.n_head_kv = n_head_kv;
  f.cfg.head_dim = d;
  f.cfg.page_size = 16;
  f.cfg.n_pages = 2 * ((n_tokens + 15) / 16) + extra_pages;
  f.cfg.dtype = dt;
  f.cache = std::make_unique<PagedKvCache>(f.cfg);
  // Interleave with another sequence so the page table is not the identity.
  for (int t = 0; t < n_tokens; t += 16) {
    f.cache->append_tokens(f.other, std::min(16, n_tokens - t));
    f.cache->append_tokens(f.seq, std::min(16, n_tokens - t));
  }
  f.K.resize(n_layer);
  f.V.resize(n_layer);
  for (int il = 0; il < n_layer; ++il) {
    for (int t = 0; t < n_tokens; ++t) {
      auto k = randn(rng, size_t(n_head_kv) * d, 1.0);
      auto v = randn(rng, size_t(n_head_kv) * d, 1.0);
      f.cache->write(il, f.seq, t, k.data(), v.data());
      const auto junk = randn(rng, size_t(n_head_kv) * d, 30.0);
      f.cache->write(il, f.other, t, junk.data(), junk.data());
      for (auto& x : k) x = stored(x, dt);
      for (auto& x : v) x = stored(x, dt);
      f.K[il].insert(f.K[il].end(), k.begin(), k.end());
      f.V[il].insert(f.V[il].end(), v.begin(), v.end());
    }
  }
  return f;
}

// float64 softmax attention of query q over tokens `toks` of (il, h): output [d] and lse.
void ref_attend(const Fixture& f, int il, int h, const float* q, double scale, const std::vector<int>& toks,
                std::vector<double>& o, double& lse) {
  const int d = f.cfg.head_dim;
  o.assign(d, 0.0);
  if (toks.empty()) {
    lse = -kInf;
    return;
  }
  std::vector<double> z(toks.size());
  double m = -kInf;
  for (size_t i = 0; i < toks.size(); ++i) {
    double acc = 0.0;
    for (int c = 0; c < d; ++c) acc += double(q[c]) * f.k(il, toks[i], h, c);
    z[i] = acc * scale;
    m = std::max(m, z[i]);
  }
  double l = 0.0;
  for (size_t i = 0; i < toks.size(); ++i) {
    const double p = std::exp(z[i] - m);
    l += p;
    for (int c = 0; c < d; ++c) o[c] += p * f.v(il, toks[i], h, c);
  }
  for (auto& x : o) x /= l;
  lse = m + std::log(l);
}

std::vector<int> tokens_of_pages(const Fixture& f, const std::vector<int32_t>& pages) {
  std::vector<int> toks;
  for (int32_t j : pages)
    for (int t = j * 16; t < std::min(f.seq.n_tokens, (j + 1) * 16); ++t) toks.push_back(t);
  return toks;
}

void expect_decode_matches(const Fixture& f, int il, int h, const std::vector<int32_t>& pages,
                           const std::vector<float>& q, int G, const char* what) {
  const int d = f.cfg.head_dim;
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<float> o(size_t(G) * d, 123.0f), lse(G, 123.0f);
  paged_decode_attention(*f.cache, il, h, f.seq, pages, q.data(), G, scale, o.data(), lse.data());
  const auto toks = tokens_of_pages(f, pages);
  for (int g = 0; g < G; ++g) {
    std::vector<double> ro;
    double rl;
    ref_attend(f, il, h, &q[size_t(g) * d], scale, toks, ro, rl);
    EXPECT_NEAR(lse[g], rl, 2e-5 * (1.0 + std::abs(rl))) << what << " g=" << g;
    double err = 0.0, nrm = 0.0;
    for (int c = 0; c < d; ++c) {
      err = std::max(err, std::abs(o[size_t(g) * d + c] - ro[c]));
      nrm = std::max(nrm, std::abs(ro[c]));
    }
    EXPECT_LE(err, 1e-5 * (1.0 + nrm)) << what << " g=" << g;
  }
}

std::vector<int32_t> all_pages(const KvSequence& s) {
  std::vector<int32_t> p(s.n_pages());
  std::iota(p.begin(), p.end(), 0);
  return p;
}

}  // namespace

TEST(Attention, DecodeMatchesFloat64Reference) {
  std::mt19937 rng(201);
  for (KvDtype dt : {KvDtype::F32, KvDtype::F16}) {
    for (int d : {64, 128, 80}) {
      for (int len : {1, 15, 17, 33, 100}) {
        Fixture f = make_fixture(rng, 2, 2, d, len, dt);
        for (int G : {1, 4, 5, 6, 7, 12}) {
          for (int il = 0; il < 2; ++il)
            for (int h = 0; h < 2; ++h) {
              // Queries that produce peaked and flat softmaxes.
              const auto q = randn(rng, size_t(G) * d, (G % 2) ? 3.0 : 1.0);
              SCOPED_TRACE(testing::Message() << kv_dtype_name(dt) << " d=" << d << " len=" << len << " G=" << G
                                              << " il=" << il << " h=" << h);
              expect_decode_matches(f, il, h, all_pages(f.seq), q, G, "all pages");
            }
        }
      }
    }
  }
}

TEST(Attention, DecodePageSubsetAnyOrder) {
  std::mt19937 rng(202);
  for (KvDtype dt : {KvDtype::F32, KvDtype::F16}) {
    const int d = 64, len = 16 * 9 + 5;
    Fixture f = make_fixture(rng, 1, 3, d, len, dt);
    const int n = f.seq.n_pages();
    for (int trial = 0; trial < 30; ++trial) {
      std::vector<int32_t> pages;
      for (int j = 0; j < n; ++j)
        if (rng() % 2) pages.push_back(j);
      if (trial % 3 == 0) pages.push_back(n - 1);  // include the partial page (maybe twice: dedupe)
      std::sort(pages.begin(), pages.end());
      pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
      if (pages.empty()) pages.push_back(0);
      std::shuffle(pages.begin(), pages.end(), rng);
      const int G = 1 + trial % 7;
      const auto q = randn(rng, size_t(G) * d, 2.0);
      SCOPED_TRACE(testing::Message() << kv_dtype_name(dt) << " trial=" << trial);
      expect_decode_matches(f, 0, trial % 3, pages, q, G, "subset");
    }
  }
}

TEST(Attention, DecodeEmptyPageListGivesZerosAndNegInf) {
  std::mt19937 rng(203);
  Fixture f = make_fixture(rng, 1, 1, 64, 40, KvDtype::F16);
  const int G = 5;
  const auto q = randn(rng, size_t(G) * 64);
  std::vector<float> o(size_t(G) * 64, std::numeric_limits<float>::quiet_NaN()), lse(G, 0.0f);
  paged_decode_attention(*f.cache, 0, 0, f.seq, {}, q.data(), G, 0.125f, o.data(), lse.data());
  for (float x : o) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  // lse may be omitted.
  paged_decode_attention(*f.cache, 0, 0, f.seq, all_pages(f.seq), q.data(), G, 0.125f, o.data(), nullptr);
  for (float x : o) EXPECT_TRUE(std::isfinite(x));
}

TEST(Attention, DecodeExtremeLogitsStayFinite) {
  // Large logits (|q.k| scale ~ 1e3) in pages visited in an order where later pages dominate.
  std::mt19937 rng(204);
  Fixture f = make_fixture(rng, 1, 1, 64, 64, KvDtype::F32);
  const int G = 3;
  auto q = randn(rng, size_t(G) * 64, 100.0);
  for (std::vector<int32_t> pages : {std::vector<int32_t>{0, 1, 2, 3}, std::vector<int32_t>{3, 2, 1, 0}}) {
    std::vector<float> o(size_t(G) * 64), lse(G);
    paged_decode_attention(*f.cache, 0, 0, f.seq, pages, q.data(), G, 0.125f, o.data(), lse.data());
    for (float x : o) ASSERT_TRUE(std::isfinite(x));
    for (int g = 0; g < G; ++g) {
      std::vector<double> ro;
      double rl;
      ref_attend(f, 0, 0, &q[size_t(g) * 64], 0.125, tokens_of_pages(f, pages), ro, rl);
      EXPECT_NEAR(lse[g], rl, 1e-5 * std::abs(rl));
      for (int c = 0; c < 64; ++c) EXPECT_NEAR(o[size_t(g) * 64 + c], ro[c], 1e-4);
    }
  }
}

TEST(Attention, Eq1OutputIdentity) {
  // o - o_S = eps (vbar_{S^c} - vbar_S), eps = 1 - gamma_S, gamma_S = exp(lse_S - lse_all), where
  // vbar_X is attention restricted to X (o_S itself).
  std::mt19937 rng(205);
  for (KvDtype dt : {KvDtype::F32, KvDtype::F16}) {
    const int d = 64, len = 16 * 12 + 9;
    Fixture f = make_fixture(rng, 1, 2, d, len, dt);
    const int n = f.seq.n_pages();
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<int32_t> S, Sc;
      for (int j = 0; j < n; ++j) (j == 0 || j == n - 1 || rng() % 3 == 0 ? S : Sc).push_back(j);
      if (Sc.empty()) Sc.push_back(S[1]), S.erase(S.begin() + 1);
      const int G = 4;
      const auto q = randn(rng, size_t(G) * d, 2.5);
      const float scale = 1.0f / std::sqrt(float(d));
      std::vector<float> o(G * d), oS(G * d), oSc(G * d), l(G), lS(G), lSc(G);
      const int h = trial % 2;
      paged_decode_attention(*f.cache, 0, h, f.seq, all_pages(f.seq), q.data(), G, scale, o.data(), l.data());
      paged_decode_attention(*f.cache, 0, h, f.seq, S, q.data(), G, scale, oS.data(), lS.data());
      paged_decode_attention(*f.cache, 0, h, f.seq, Sc, q.data(), G, scale, oSc.data(), lSc.data());
      for (int g = 0; g < G; ++g) {
        const double gamma = std::exp(double(lS[g]) - l[g]);
        const double eps = 1.0 - gamma;
        ASSERT_GE(gamma, 0.0);
        ASSERT_LE(gamma, 1.0 + 1e-5);
        // Masses add up: exp(lse_S) + exp(lse_Sc) = exp(lse_all).
        EXPECT_NEAR(std::exp(double(lSc[g]) - l[g]), eps, 1e-5);
        for (int c = 0; c < d; ++c) {
          const double lhs = double(o[g * d + c]) - oS[g * d + c];
          const double rhs = eps * (double(oSc[g * d + c]) - oS[g * d + c]);
          EXPECT_NEAR(lhs, rhs, 2e-5) << "g=" << g << " c=" << c;
        }
        // And in norm: ||o - o_S|| <= eps * ||vbar_Sc - vbar_S||.
      }
    }
  }
}

// =============================================================================================
// Prefill
// =============================================================================================

namespace {

// Appends `chunks` of tokens to a fresh cache, after each chunk runs paged_prefill_attention for
// its queries and compares with a float64 causal reference over all tokens so far.
void check_prefill(std::mt19937& rng, KvDtype dt, int n_head_kv, int G, int d, const std::vector<int>& chunks) {
  KvCacheConfig cfg;
  cfg.n_layer = 2;
  cfg.n_head_kv = n_head_kv;
  cfg.head_dim = d;
  cfg.page_size = 16;
  int total = 0;
  for (int c : chunks) total += c;
  cfg.n_pages = 2 * ((total + 15) / 16) + 2;
  cfg.dtype = dt;
  PagedKvCache cache(cfg);
  KvSequence seq, other;
  const int H = n_head_kv, NH = H * G;
  std::vector<std::vector<float>> K(cfg.n_layer), V(cfg.n_layer);  // stored values [t][h][d]
  for (int n_q : chunks) {
    const int32_t pos0 = cache.append_tokens(seq, n_q);
    // Stale junk in another sequence's pages and in the pool: must not leak into the result.
    cache.append_tokens(other, n_q);
    for (int il = 0; il < cfg.n_layer; ++il) {
      for (int t = 0; t < n_q; ++t) {
        auto k = randn(rng, size_t(H) * d, 1.0), v = randn(rng, size_t(H) * d, 1.0);
        cache.write(il, seq, pos0 + t, k.data(), v.data());
        const auto junk = randn(rng, size_t(H) * d, 50.0);
        cache.write(il, other, pos0 + t, junk.data(), junk.data());
        for (auto& x : k) x = stored(x, dt);
        for (auto& x : v) x = stored(x, dt);
        K[il].insert(K[il].end(), k.begin(), k.end());
        V[il].insert(V[il].end(), v.begin(), v.end());
      }
      const auto q = randn(rng, size_t(n_q) * NH * d, 2.0);  // [n_q][NH][d]
      std::vector<float> out(size_t(n_q) * NH * d, 99.0f);
      const double scale = 1.0 / std::sqrt(double(d));
      paged_prefill_attention(cache, il, seq, pos0, n_q, q.data(), NH, float(scale), out.data());
      double worst = 0.0;
      for (int t = 0; t < n_q; ++t) {
        const int qpos = pos0 + t;
        for (int hq = 0; hq < NH; ++hq) {
          const int h = hq / G;
          const float* qr = &q[(size_t(t) * NH + hq) * d];
          std::vector<double> z(qpos + 1), o(d, 0.0);
          double m = -kInf;
          for (int s = 0; s <= qpos; ++s) {
            double acc = 0.0;
            for (int c = 0; c < d; ++c) acc += double(qr[c]) * K[il][(size_t(s) * H + h) * d + c];
            z[s] = acc * scale;
            m = std::max(m, z[s]);
          }
          double l = 0.0;
          for (int s = 0; s <= qpos; ++s) {
            const double p = std::exp(z[s] - m);
            l += p;
            for (int c = 0; c < d; ++c) o[c] += p * V[il][(size_t(s) * H + h) * d + c];
          }
          for (int c = 0; c < d; ++c) worst = std::max(worst, std::abs(out[(size_t(t) * NH + hq) * d + c] - o[c] / l));
        }
      }
      EXPECT_LT(worst, 2e-5) << "chunk at pos0=" << pos0 << " n_q=" << n_q << " il=" << il;
    }
  }
}

}  // namespace

TEST(Attention, PrefillMatchesCausalReferenceAcrossChunks) {
  std::mt19937 rng(211);
  for (int G : {1, 4, 5}) {
    SCOPED_TRACE(testing::Message() << "G=" << G);
    check_prefill(rng, KvDtype::F32, 2, G, 64, {37, 50});
    check_prefill(rng, KvDtype::F16, 2, G, 64, {37, 50});
  }
}

TEST(Attention, PrefillLongChunksAndOddHeadDim) {
  // Crosses the 128-token key blocks and 32-token query blocks; single-token chunks; d = 80.
  std::mt19937 rng(212);
  check_prefill(rng, KvDtype::F32, 1, 4, 64, {150, 130, 1, 1, 17});
  check_prefill(rng, KvDtype::F16, 2, 5, 80, {1, 40, 33});
  check_prefill(rng, KvDtype::F32, 3, 1, 128, {16, 16, 45});
}

TEST(Attention, PrefillLastRowEqualsDecode) {
  // The last prefill query attends every token: it must equal decode attention over all pages.
  std::mt19937 rng(213);
  const int d = 64, H = 2, G = 4, len = 16 * 5 + 3;
  Fixture f = make_fixture(rng, 1, H, d, len, KvDtype::F16);
  const auto q = randn(rng, size_t(H) * G * d, 2.0);  // one token, [NH][d]
  std::vector<float> out(size_t(H) * G * d);
  paged_prefill_attention(*f.cache, 0, f.seq, len - 1, 1, q.data(), H * G, 0.125f, out.data());
  for (int h = 0; h < H; ++h) {
    std::vector<float> o(size_t(G) * d);
    paged_decode_attention(*f.cache, 0, h, f.seq, all_pages(f.seq), &q[size_t(h) * G * d], G, 0.125f, o.data(),
                           nullptr);
    for (int i = 0; i < G * d; ++i) EXPECT_NEAR(out[size_t(h) * G * d + i], o[i], 1e-5);
  }
}

TEST(Attention, DecodeLargePagesOrHeadsAreCorrectOrRejected) {
  // Configurations beyond the kernel's fixed buffers (page_size > 32, or B * head_dim > 8192) must
  // either be computed correctly or be rejected with std::invalid_argument, never corrupt memory.
  std::mt19937 rng(206);
  struct Case {
    int B, d;
  };
  for (const Case c : {Case{64, 64}, Case{48, 32}, Case{16, 576}, Case{32, 256}, Case{8, 80}}) {
    SCOPED_TRACE(testing::Message() << "B=" << c.B << " d=" << c.d);
    KvCacheConfig cfg;
    cfg.n_layer = 1;
    cfg.n_head_kv = 1;
    cfg.head_dim = c.d;
    cfg.page_size = c.B;
    cfg.n_pages = 4;
    cfg.dtype = KvDtype::F32;
    if (c.B > 32) {  // the cache itself refuses pages beyond the kernels' limit
      EXPECT_THROW(PagedKvCache{cfg}, std::invalid_argument);
      continue;
    }
    PagedKvCache cache(cfg);
    KvSequence seq;
    const int len = 2 * c.B + 3;
    cache.append_tokens(seq, len);
    std::vector<float> K, V;
    for (int t = 0; t < len; ++t) {
      const auto k = randn(rng, c.d), v = randn(rng, c.d);
      cache.write(0, seq, t, k.data(), v.data());
      K.insert(K.end(), k.begin(), k.end());
      V.insert(V.end(), v.begin(), v.end());
    }
    const int G = 3;
    const auto q = randn(rng, size_t(G) * c.d, 2.0);
    std::vector<float> o(size_t(G) * c.d), lse(G);
    const std::vector<int32_t> pages = {0, 1, 2};
    const float scale = 1.0f / std::sqrt(float(c.d));
    try {
      paged_decode_attention(cache, 0, 0, seq, pages, q.data(), G, scale, o.data(), lse.data());
    } catch (const std::invalid_argument&) {
      EXPECT_TRUE(c.B > 32 || c.B * c.d > 32 * 256) << "a supported configuration was rejected";
      continue;
    }
    for (int g = 0; g < G; ++g) {
      std::vector<double> z(len), ro(c.d, 0.0);
      double m = -kInf, l = 0.0;
      for (int t = 0; t < len; ++t) {
        double acc = 0.0;
        for (int x = 0; x < c.d; ++x) acc += double(q[size_t(g) * c.d + x]) * K[size_t(t) * c.d + x];
        z[t] = acc * scale;
        m = std::max(m, z[t]);
      }
      for (int t = 0; t < len; ++t) {
        const double p = std::exp(z[t] - m);
        l += p;
        for (int x = 0; x < c.d; ++x) ro[x] += p * V[size_t(t) * c.d + x];
      }
      EXPECT_NEAR(lse[g], m + std::log(l), 2e-5 * (1.0 + std::abs(m)));
      for (int x = 0; x < c.d; ++x) EXPECT_NEAR(o[size_t(g) * c.d + x], ro[x] / l, 1e-5) << "g=" << g << " x=" << x;
    }
  }
}

// Layers, KV heads and page positions outside the cache or sequence throw std::out_of_range naming
// them (a position past the page table would read outside the pool).
TEST(Attention, IndicesOutsideTheCacheThrow) {
  std::mt19937 rng(77);
  Fixture f = make_fixture(rng, 2, 2, 16, 83, KvDtype::F16);  // 6 pages
  const auto q = randn(rng, 2 * 16);
  std::vector<float> o(2 * 16);
  auto decode = [&](int il, int h, std::vector<int32_t> pages) {
    return test::error_of<std::out_of_range>(
        [&] { paged_decode_attention(*f.cache, il, h, f.seq, pages, q.data(), 2, 0.25f, o.data(), nullptr); });
  };
  EXPECT_EQ(decode(0, 0, {0, 99}), "paged_decode_attention: page position 99 outside the sequence's 6 pages");
  EXPECT_EQ(decode(0, 0, {-1}), "paged_decode_attention: page position -1 outside the sequence's 6 pages");
  EXPECT_EQ(decode(2, 0, {0}), "paged_decode_attention: layer 2 outside [0, 2)");
  EXPECT_EQ(decode(0, 2, {0}), "paged_decode_attention: KV head 2 outside [0, 2)");
  EXPECT_EQ(decode(0, 1, {0, 5}), "no exception");
  KvSequence long_seq = f.seq;
  long_seq.n_tokens = 4000;  // the last page would hold 3920 tokens
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] {
              paged_decode_attention(*f.cache, 0, 0, long_seq, std::vector<int32_t>{5}, q.data(), 2, 0.25f, o.data(),
                                     nullptr);
            }),
            "paged_decode_attention: a sequence of 4000 tokens cannot have 6 pages of 16 tokens");
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] {
              paged_decode_attention(*f.cache, 0, 0, f.seq, std::vector<int32_t>{0}, nullptr, 2, 0.25f, o.data(),
                                     nullptr);
            }),
            "paged_decode_attention: q and o must not be null");
  // A non-finite query or scale would make every output NaN without saying why.
  std::vector<float> q_bad = q;
  q_bad[16 + 5] = NAN;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] {
              paged_decode_attention(*f.cache, 0, 0, f.seq, std::vector<int32_t>{0}, q_bad.data(), 2, 0.25f, o.data(),
                                     nullptr);
            }),
            "paged_decode_attention: non-finite query at head 1, dim 5");
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] {
              paged_decode_attention(*f.cache, 0, 0, f.seq, std::vector<int32_t>{0}, q.data(), 2, INFINITY, o.data(),
                                     nullptr);
            }),
            "paged_decode_attention: scale inf");
  const auto qp = randn(rng, size_t(4) * 4 * 16);
  std::vector<float> out(qp.size());
  EXPECT_EQ(test::error_of<std::out_of_range>(
                [&] { paged_prefill_attention(*f.cache, 3, f.seq, 0, 4, qp.data(), 4, 0.25f, out.data()); }),
            "paged_prefill_attention: layer 3 outside [0, 2)");
  EXPECT_EQ(test::error_of<std::out_of_range>(
                [&] { paged_prefill_attention(*f.cache, 0, f.seq, 80, 4, qp.data(), 4, 0.25f, out.data()); }),
            "paged_prefill_attention: queries [80, 84) outside the sequence's 83 tokens");
  EXPECT_EQ(test::error_of<std::invalid_argument>(
                [&] { paged_prefill_attention(*f.cache, 0, f.seq, 0, 4, qp.data(), 3, 0.25f, out.data()); }),
            "paged_prefill_attention: n_head 3 is not a multiple of n_head_kv 2");
  // As for decode: a non-finite query row or scale is named, not turned into NaN outputs.
  std::vector<float> qp_bad = qp;
  qp_bad[(2 * 4 + 3) * 16 + 7] = INFINITY;  // token 2, head 3, dim 7
  EXPECT_EQ(test::error_of<std::invalid_argument>(
                [&] { paged_prefill_attention(*f.cache, 0, f.seq, 10, 4, qp_bad.data(), 4, 0.25f, out.data()); }),
            "paged_prefill_attention: non-finite query at token 12, head 3, dim 7");
  EXPECT_EQ(test::error_of<std::invalid_argument>(
                [&] { paged_prefill_attention(*f.cache, 0, f.seq, 0, 4, qp.data(), 4, NAN, out.data()); }),
            "paged_prefill_attention: scale nan");
}
