// Definitions of the CUDA test fixtures declared in cuda_fixture.h; in a build without CUDA, the
// one test that says so.
#include <gtest/gtest.h>

#ifdef LOCKS_WITH_CUDA

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>

#include "cuda_fixture.h"
#include "locks/attention.h"

namespace locks::test {

uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t(u >> 16);
}
float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

namespace {
enum class PageKind { kStructured, kZero, kIdentical, kRank2 };
}  // namespace

World::World(int d_, int H_, int G_, std::vector<int> lens, lc::KvType t, uint64_t seed, bool special_pages)
    : d(d_), H(H_), G(G_), dtype(t), lengths(std::move(lens)) {
  int pages = 0;
  for (int L : lengths) pages += (L + 15) / 16;
  cfg.n_layer = 1;
  cfg.n_head_kv = H;
  cfg.head_dim = d;
  cfg.page_size = 16;
  cfg.n_pages = pages + 3;
  cfg.dtype = t == lc::KvType::kF16 ? KvDtype::F16 : KvDtype::F32;
  cache = std::make_unique<PagedKvCache>(cfg);
  seqs.resize(lengths.size());
  // Interleave allocation so page tables are not contiguous runs.
  std::vector<int> done(lengths.size(), 0);
  for (bool more = true; more;) {
    more = false;
    for (size_t b = 0; b < lengths.size(); ++b) {
      const int n = std::min(16, lengths[b] - done[b]);
      if (n <= 0) continue;
      cache->append_tokens(seqs[b], n);
      done[b] += n;
      more = true;
    }
  }
  std::mt19937 rng{uint32_t(seed)};
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> k(size_t(H) * d), v(size_t(H) * d), base(size_t(H) * d), dir2(size_t(H) * d);
  for (size_t b = 0; b < lengths.size(); ++b) {
    PageKind kind = PageKind::kStructured;
    for (int pos = 0; pos < lengths[b]; ++pos) {
      if (pos % 16 == 0) {
        const int page = pos / 16;
        kind = !special_pages || page < 2 ? PageKind::kStructured
               : page % 11 == 3           ? PageKind::kZero
               : page % 11 == 6           ? PageKind::kIdentical
               : page % 11 == 8           ? PageKind::kRank2
                                          : PageKind::kStructured;
        for (auto& x : base) x = 2.0f * N(rng);
        for (auto& x : dir2) x = N(rng);
      }
      const float a = N(rng), c2 = N(rng);
      for (int i = 0; i < H * d; ++i) {
        float kx = 0.0f;
        switch (kind) {
          case PageKind::kStructured:
            kx = base[i] + 0.5f * N(rng);
            break;
          case PageKind::kZero:
            kx = 0.0f;
            break;
          case PageKind::kIdentical:
            kx = base[i];
            break;
          case PageKind::kRank2:
            kx = base[i] + a * dir2[i] + c2 * (i % 3 == 0 ? 1.0f : -0.5f);
            break;
        }
        float vx = N(rng);
        if (t == lc::KvType::kBF16) {
          kx = round_bf16(kx);
          vx = round_bf16(vx);
        }
        k[i] = kx;
        v[i] = vx;
      }
      cache->write(0, seqs[b], pos, k.data(), v.data());
    }
  }
  finish();
}

World::World(const PagedKvCache& src, const KvSequence& seq, int il, int G_)
    : d(src.config().head_dim), H(src.config().n_head_kv), G(G_), dtype(lc::KvType::kF16) {
  lengths = {seq.n_tokens};
  cfg = src.config();
  cfg.n_layer = 1;
  cfg.dtype = KvDtype::F16;
  cache = std::make_unique<PagedKvCache>(cfg);
  seqs.resize(1);
  cache->append_tokens(seqs[0], seq.n_tokens);
  std::vector<float> k(size_t(H) * d), v(size_t(H) * d), kp(size_t(16) * d), vp(size_t(16) * d);
  for (int pos = 0; pos < seq.n_tokens; ++pos) {
    const int32_t page = seq.page_table[pos / 16];
    for (int h = 0; h < H; ++h) {
      src.k_page_f32(il, page, h, kp.data());
      src.v_page_f32(il, page, h, vp.data());
      std::copy_n(&kp[size_t(pos % 16) * d], d, &k[size_t(h) * d]);
      std::copy_n(&vp[size_t(pos % 16) * d], d, &v[size_t(h) * d]);
    }
    cache->write(0, seqs[0], pos, k.data(), v.data());
  }
  finish();
}

void World::finish() {
  indptr = {0};
  for (const auto& s : seqs) {
    indices.insert(indices.end(), s.page_table.begin(), s.page_table.end());
    indptr.push_back(int32_t(indices.size()));
    last_len.push_back(s.n_pages() ? s.n_tokens - 16 * (s.n_pages() - 1) : 16);
    max_pages = std::max(max_pages, s.n_pages());
  }
  // Device copy of the layer: [n_pages][H][16][d] of the device dtype.
  const size_t elems = size_t(cfg.n_pages) * H * 16 * d;
  std::vector<uint16_t> hk(elems), hv(elems);
  if (cfg.dtype == KvDtype::F16) {
    std::memcpy(hk.data(), cache->k_page(0, 0, 0), elems * 2);
    std::memcpy(hv.data(), cache->v_page(0, 0, 0), elems * 2);
  } else {
    std::vector<float> buf(size_t(16) * d);
    for (int pg = 0; pg < cfg.n_pages; ++pg)
      for (int h = 0; h < H; ++h) {
        const size_t o = (size_t(pg) * H + h) * 16 * d;
        cache->k_page_f32(0, pg, h, buf.data());
        for (size_t i = 0; i < buf.size(); ++i) hk[o + i] = bf16_bits(buf[i]);
        cache->v_page_f32(0, pg, h, buf.data());
        for (size_t i = 0; i < buf.size(); ++i) hv[o + i] = bf16_bits(buf[i]);
      }
  }
  // The rows past a sequence's last token in its last page are never part of the result: poisoned
  // here (K NaN, V +inf, as stale pool memory may be) so that any kernel reading them shows it.
  const uint16_t nan_bits = cfg.dtype == KvDtype::F16 ? 0x7e00 : 0x7fc0;
  const uint16_t inf_bits = cfg.dtype == KvDtype::F16 ? 0x7c00 : 0x7f80;
  for (size_t b = 0; b < seqs.size(); ++b) {
    if (seqs[b].n_pages() == 0 || last_len[b] == 16) continue;
    const int32_t pg = seqs[b].page_table.back();
    for (int h = 0; h < H; ++h)
      for (int row = last_len[b]; row < 16; ++row) {
        const size_t o = ((size_t(pg) * H + h) * 16 + row) * d;
        std::fill_n(&hk[o], d, nan_bits);
        std::fill_n(&hv[o], d, inf_bits);
      }
  }
  dk = Dev<uint16_t>(hk);
  dv = Dev<uint16_t>(hv);
  d_indptr = Dev<int32_t>(indptr);
  d_indices = Dev<int32_t>(indices.empty() ? std::vector<int32_t>{0} : indices);
  d_last = Dev<int32_t>(last_len);
}

std::vector<int32_t> World::full_pages() const {
  std::vector<int32_t> pages;
  for (const auto& s : seqs)
    for (int j = 0; j < s.n_pages(); ++j)
      if (s.n_tokens - 16 * j >= 16) pages.push_back(s.page_table[j]);
  return pages;
}

std::vector<float> World::queries(uint64_t seed) const {
  std::mt19937 rng{uint32_t(seed)};
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> q(size_t(B()) * H * G * d);
  for (int b = 0; b < B(); ++b)
    for (int h = 0; h < H; ++h)
      for (int g = 0; g < G; ++g) {
        float* qq = &q[((size_t(b) * H + h) * G + g) * d];
        const int n = seqs[b].n_tokens;
        if (n > 0 && g % 2 == 0) {
          const int pos = int(rng() % uint32_t(n));
          const auto k = keys(seqs[b].page_table[pos / 16], h);
          const float s = 0.5f + float(rng() % 100) / 50.0f;
          for (int x = 0; x < d; ++x) qq[x] = s * k[size_t(pos % 16) * d + x] + 0.3f * N(rng);
        } else {
          for (int x = 0; x < d; ++x) qq[x] = N(rng);
        }
      }
  return q;
}

Summaries::Summaries(const World& w) : store(SummaryFormat{8, 4, 8, 8}, 1, w.H, w.cfg.n_pages, 16, w.d) {
  const size_t rb = lc::summary_record_bytes(w.d);
  records.assign(size_t(w.H) * w.cfg.n_pages * rb, 0);
  tails.assign(size_t(w.H) * w.cfg.n_pages, 0.0f);
  for (const auto& s : w.seqs)
    for (int j = 0; j < s.n_pages(); ++j) {
      if (s.n_tokens - 16 * j < 16) continue;  // full pages only
      const int32_t page = s.page_table[j];
      for (int h = 0; h < w.H; ++h) {
        const auto k = w.keys(page, h);
        const PageSummaryF32 f = build_page_summary(k.data(), 16, w.d, 8);
        store.store(0, h, page, f);
        lc::pack_summary_record(f.centroid.data(), f.basis.data(), f.coef.data(), w.d,
                                &records[(size_t(h) * w.cfg.n_pages + page) * rb]);
        tails[size_t(h) * w.cfg.n_pages + page] = f.tail;
      }
    }
}

std::vector<float> cpu_log_mass(const World& w, const PageSummaryStore& st, const std::vector<float>& q, int stride) {
  std::vector<float> lm(size_t(w.B()) * w.H * w.G * stride, 0.0f);
  const float scale = 1.0f / std::sqrt(float(w.d));
  std::vector<float> tmp(w.G);
  for (int b = 0; b < w.B(); ++b)
    for (int h = 0; h < w.H; ++h) {
      const float* qq = &q[(size_t(b) * w.H + h) * w.G * w.d];
      const auto& s = w.seqs[b];
      for (int j = 0; j < s.n_pages(); ++j) {
        const int n_tok = s.n_tokens - 16 * j >= 16 ? 16 : s.n_tokens - 16 * j;
        if (n_tok == 16) {
          st.score(0, h, s.page_table[j], qq, w.G, scale, tmp.data());
        } else {
          const auto k = w.keys(s.page_table[j], h);
          for (int g = 0; g < w.G; ++g) tmp[g] = exact_log_mass(k.data(), n_tok, qq + size_t(g) * w.d, w.d, scale);
        }
        for (int g = 0; g < w.G; ++g) lm[((size_t(b) * w.H + h) * w.G + g) * stride + j] = tmp[g];
      }
    }
  return lm;
}

double lse_of(const float* x, int n) {
  double m = -INFINITY;
  for (int i = 0; i < n; ++i) m = std::max(m, double(x[i]));
  if (m == -INFINITY) return m;
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += std::exp(double(x[i]) - m);
  return m + std::log(s);
}

ScoreOut run_score(const World& w, const std::vector<uint8_t>& records, const std::vector<float>& q, int chunk_pages,
                   int grid, bool defer, bool balance) {
  ScoreOut out;
  out.stride = (w.max_pages + 7) / 8 * 8;
  const int n_chunks =
      balance ? (w.max_pages + 31) / 32 + 5 : std::max(1, (w.max_pages + chunk_pages - 1) / chunk_pages);
  out.n_chunks = n_chunks;
  Dev<uint8_t> drec(records);
  Dev<float> dq(q), dlm(size_t(w.B()) * w.H * w.G * out.stride), dlse(size_t(w.B()) * w.H * w.G),
      dstats(size_t(w.B()) * w.H * n_chunks * 32);
  Dev<uint32_t> dcnt(lc::score_counters(w.B(), w.H));
  dcnt.fill_bytes(0);
  dlm.fill_bytes(0x7f);  // poison: every scored entry must be written
  dlse.fill_bytes(0x7f);
  dstats.fill_bytes(0xff);  // NaN: a chunk statistic left unwritten would poison the deferred merge
  lc::ScoreParams p;
  p.q = dq.p;
  p.kv = w.view();
  p.summaries = drec.p;
  p.n_pages_pool = w.cfg.n_pages;
  p.group = w.G;
  p.scale = 1.0f / std::sqrt(float(w.d));
  p.chunk_pages = chunk_pages;
  p.n_chunks = n_chunks;
  p.log_mass = dlm.p;
  p.log_mass_stride = out.stride;
  p.lse_total = dlse.p;
  p.chunk_stats = dstats.p;
  p.counters = dcnt.p;
  p.grid = grid;
  p.pdl = true;
  p.defer_lse_total = defer;
  p.balance_chunks = balance;
  ck(lc::score_pages(p, nullptr), "score_pages");
  dev_sync();
  out.log_mass = dlm.down();
  out.lse_total = dlse.down();
  out.chunk_stats = dstats.down();
  const auto cnt = dcnt.down();
  for (uint32_t c : cnt) EXPECT_EQ(c, 0u) << "score counters must be left at zero";
  return out;
}

double check_scores(const World& w, const ScoreOut& g, const std::vector<float>& ref, const char* what,
                    double range_rel) {
  double worst = 0.0;
  for (int b = 0; b < w.B(); ++b)
    for (int h = 0; h < w.H; ++h)
      for (int gg = 0; gg < w.G; ++gg) {
        const size_t row = ((size_t(b) * w.H + h) * w.G + gg) * g.stride;
        const int n = w.seqs[b].n_pages();
        double row_max = 0.0;
        for (int j = 0; j < n; ++j) row_max = std::max(row_max, double(std::abs(ref[row + j])));
        for (int j = 0; j < n; ++j) {
          const double a = g.log_mass[row + j], r = ref[row + j];
          const double err = std::abs(a - r);
          worst = std::max(worst, err);
          EXPECT_LE(err, 1e-3 + 1e-4 * std::abs(r) + range_rel * row_max)
              << what << ": b " << b << " h " << h << " g " << gg << " page " << j << " gpu " << a << " cpu " << r;
        }
        const float got_lt = g.lse_total[(size_t(b) * w.H + h) * w.G + gg];
        if (n > 0) {
          const double lt = lse_of(&ref[row], n);
          EXPECT_NEAR(got_lt, lt, 1e-3 + 1e-4 * std::abs(lt) + range_rel * row_max) << what;
        } else {
          EXPECT_EQ(got_lt, -INFINITY) << what << ": the log of an empty sum, b " << b << " h " << h;
        }
      }
  return worst;
}

double check_attention(const World& w, const std::vector<float>& q, const AttnOut& g,
                       const std::vector<std::vector<int32_t>>& lists, const char* what) {
  double worst = 0.0;
  const float scale = 1.0f / std::sqrt(float(w.d));
  std::vector<float> o(size_t(w.G) * w.d), lse(w.G);
  for (int b = 0; b < w.B(); ++b)
    for (int h = 0; h < w.H; ++h) {
      const size_t bh = size_t(b) * w.H + h;
      const auto& pages = lists[bh];
      paged_decode_attention(*w.cache, 0, h, w.seqs[b], pages, &q[bh * w.G * w.d], w.G, scale, o.data(), lse.data());
      for (int gg = 0; gg < w.G; ++gg) {
        double num = 0.0, den = 0.0;
        for (int x = 0; x < w.d; ++x) {
          const double a = g.o[(bh * w.G + gg) * w.d + x], r = o[size_t(gg) * w.d + x];
          num += (a - r) * (a - r);
          den += r * r;
        }
        if (pages.empty()) {
          EXPECT_EQ(num, 0.0) << what << ": empty list must give o = 0";
          EXPECT_EQ(g.lse[bh * w.G + gg], -INFINITY) << what;
          continue;
        }
        const double rel = std::sqrt(num / std::max(den, 1e-30));
        worst = std::max(worst, rel);
        EXPECT_LT(rel, 1e-3) << what << ": b " << b << " h " << h << " g " << gg;
        EXPECT_NEAR(g.lse[bh * w.G + gg], lse[gg], 1e-3 + 1e-5 * std::abs(lse[gg])) << what;
      }
    }
  return worst;
}

std::vector<std::vector<int32_t>> dense_lists(const World& w) {
  std::vector<std::vector<int32_t>> l(size_t(w.B()) * w.H);
  for (int b = 0; b < w.B(); ++b)
    for (int h = 0; h < w.H; ++h) {
      l[size_t(b) * w.H + h].resize(w.seqs[b].n_pages());
      std::iota(l[size_t(b) * w.H + h].begin(), l[size_t(b) * w.H + h].end(), 0);
    }
  return l;
}

}  // namespace locks::test

#else  // !LOCKS_WITH_CUDA

TEST(CudaBuild, NotBuiltWithCuda) { GTEST_SKIP() << "built without CUDA (no CUDA compiler found at configure time)"; }

#endif
