// CUDA kernels against their CPU twins (test-backend-ops style): summary build vs
// build_page_summary + PageSummaryStore, score pass vs PageSummaryStore::score / exact_log_mass,
// select vs select_top_pages (by captured share mass; exact on ties), attention vs
// paged_decode_attention (relative error < 1e-3), and the whole LOCKS step (also replayed from a
// CUDA graph). Random pages with realistic spectra, degenerate pages, and real keys from the
// reference model. Every device test skips when no usable CUDA device is present.
#include <gtest/gtest.h>

#ifdef LOCKS_WITH_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "locks/attention.h"
#include "locks/cuda/kernels.h"
#include "locks/kv_cache.h"
#include "locks/model.h"
#include "locks/page_summary.h"
#include "locks/selector.h"
#include "locks/session.h"
#include "test_paths.h"

using namespace locks;
namespace lc = locks::cuda;

namespace {

#define SKIP_WITHOUT_CUDA()                                 \
  do {                                                      \
    std::string why_;                                       \
    if (!lc::device_available(&why_)) GTEST_SKIP() << why_; \
  } while (0)

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  Dev() = default;
  explicit Dev(size_t count) : n(count) {
    ck(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(1, n) * sizeof(T)), "cudaMalloc");
  }
  explicit Dev(const std::vector<T>& v) : Dev(v.size()) { up(v); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  Dev(Dev&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr; }
  Dev& operator=(Dev&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    return *this;
  }
  ~Dev() {
    if (p) cudaFree(p);
  }
  void up(const std::vector<T>& v) { ck(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "up"); }
  std::vector<T> down() const {
    std::vector<T> v(n);
    ck(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "down");
    return v;
  }
  void fill_bytes(int value) { ck(cudaMemset(p, value, std::max<size_t>(1, n) * sizeof(T)), "memset"); }
};

void dev_sync() { ck(cudaDeviceSynchronize(), "kernel"); }

uint16_t bf16_bits(float x) {  // x must already be bf16-representable
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

enum class PageKind { kStructured, kZero, kIdentical, kRank2 };

/// A CPU paged cache (one layer) with several sequences whose page tables interleave, plus its
/// device copy and CSR page table.
struct World {
  int d = 128, H = 2, G = 4;
  lc::KvType dtype = lc::KvType::kF16;
  std::vector<int> lengths;
  KvCacheConfig cfg;
  std::unique_ptr<PagedKvCache> cache;
  std::vector<KvSequence> seqs;
  std::vector<int32_t> indptr, indices, last_len;
  Dev<uint16_t> dk, dv;
  Dev<int32_t> d_indptr, d_indices, d_last;
  int max_pages = 0;

  World(int d_, int H_, int G_, std::vector<int> lens, lc::KvType t, uint64_t seed, bool special_pages = true)
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

  /// From an existing cache (real model keys): one layer `il`, one sequence.
  World(const PagedKvCache& src, const KvSequence& seq, int il, int G_)
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

  void finish() {
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

  lc::PagedKvView view() const {
    lc::PagedKvView v;
    v.k = dk.p;
    v.v = dv.p;
    v.dtype = dtype;
    v.n_head_kv = H;
    v.head_dim = d;
    v.batch = int(seqs.size());
    v.indptr = d_indptr.p;
    v.indices = d_indices.p;
    v.last_page_len = d_last.p;
    return v;
  }
  int B() const { return int(seqs.size()); }
  // Page ids of every full page (those with a summary).
  std::vector<int32_t> full_pages() const {
    std::vector<int32_t> pages;
    for (const auto& s : seqs)
      for (int j = 0; j < s.n_pages(); ++j)
        if (s.n_tokens - 16 * j >= 16) pages.push_back(s.page_table[j]);
    return pages;
  }
  // summary_build of `pages` into `records` ([H][pool][record bytes]).
  lc::SummaryBuildParams build_params(const Dev<int32_t>& pages, int n_pages, uint8_t* records) const {
    lc::SummaryBuildParams bp;
    bp.k = dk.p;
    bp.dtype = dtype;
    bp.n_head_kv = H;
    bp.head_dim = d;
    bp.pages = pages.p;
    bp.n_pages = n_pages;
    bp.n_pages_pool = cfg.n_pages;
    bp.records = records;
    return bp;
  }
  lc::DecodeShape decode_shape(int budget_pages) const {
    lc::DecodeShape sh;
    sh.batch = B();
    sh.n_head_kv = H;
    sh.group = G;
    sh.head_dim = d;
    sh.dtype = dtype;
    sh.max_pages = max_pages;
    sh.budget_pages = budget_pages;
    return sh;
  }
  std::vector<float> keys(int32_t page, int h) const {
    std::vector<float> k(size_t(16) * d);
    cache->k_page_f32(0, page, h, k.data());
    return k;
  }
  /// Queries [B][H*G][d]: for realism, a key of the sequence plus noise, random scale.
  std::vector<float> queries(uint64_t seed) const {
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
};

/// CPU summaries (the reference store) and the same summaries packed for the device.
struct Summaries {
  PageSummaryStore store;
  std::vector<uint8_t> records;
  std::vector<float> tails;
  Summaries(const World& w) : store(SummaryFormat{8, 4, 8, 8}, 1, w.H, w.cfg.n_pages, 16, w.d) {
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
};

/// CPU log-mass [B][H][G][stride] as the CPU LOCKS selector computes it.
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

struct ScoreOut {
  std::vector<float> log_mass, lse_total, chunk_stats;
  int stride = 0, n_chunks = 0;
};

// defer: ScoreParams::defer_lse_total (lse_total left to select_pages; chunk_stats returned).
// balance: chunks sized from the page table at run time (ScoreParams::balance_chunks) with a
// capacity of one chunk per 32 pages of the longest sequence plus 5 (so that statistics past a
// sequence's chunks, and with one sequence empty items, occur); chunk_pages is then unused.
ScoreOut run_score(const World& w, const std::vector<uint8_t>& records, const std::vector<float>& q, int chunk_pages,
                   int grid = 0, bool defer = false, bool balance = false) {
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

// Compare GPU and CPU log-mass of every page; returns the max abs error.
// Tolerance per page: 1e-3 + 1e-4 |s| + range_rel * (largest |s| of the head's row). q enters the
// tensor cores with 16 bits of max|q| (two int8 limbs), so the absolute error grows with the logit
// scale of the whole row, not with the page's own value; range_rel covers that for extreme scales.
double check_scores(const World& w, const ScoreOut& g, const std::vector<float>& ref, const char* what,
                    double range_rel = 0.0) {
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

struct SelectOut {
  std::vector<int32_t> sel, n_sel;
  std::vector<float> shares, lse_total;
};

// chunk_stats (with n_chunks): the score pass's deferred statistics, merged into lse_total here.
// candidates: with the share kernel's per-CTA candidate lists (as the decode step runs it).
// cluster_pages: the one-kernel select (SelectParams::cluster_pages). launch_error: where a launch
// the device cannot schedule goes (the result is then empty) instead of failing the test.
SelectOut run_select_once(int B, int H, int G, const std::vector<int32_t>& indptr, const std::vector<float>& lm,
                          const std::vector<float>& lse_total, int stride, int k, const std::vector<float>* chunk_stats,
                          int n_chunks, bool candidates, int cluster_pages = 0, cudaError_t* launch_error = nullptr) {
  Dev<int32_t> dindptr(indptr), dsel(size_t(B) * H * k), dn(size_t(B) * H);
  Dev<float> dlm(lm), dlse(lse_total), dsh(size_t(B) * H * stride);
  Dev<float> dstats(chunk_stats ? *chunk_stats : std::vector<float>{});
  Dev<uint32_t> dkeys(size_t(B) * H * stride), dhist(size_t(B) * H * lc::kHistBins);
  Dev<unsigned long long> dcand(size_t(B) * H * stride);
  Dev<int32_t> dncand(size_t(B) * H * ((stride + 1023) / 1024));
  dhist.fill_bytes(0);
  dsh.fill_bytes(0x7f);  // positions without a page keep this in every way of running select
  dsel.fill_bytes(0xff);
  dcand.fill_bytes(0xff);   // stale entries must never be read
  dncand.fill_bytes(0x7f);  // nor stale counts (a huge count would read far out of a list)
  lc::SelectParams p;
  p.batch = B;
  p.n_head_kv = H;
  p.group = G;
  p.indptr = dindptr.p;
  p.log_mass = dlm.p;
  p.log_mass_stride = stride;
  p.lse_total = dlse.p;
  p.budget_pages = k;
  p.keys = dkeys.p;
  p.hist = dhist.p;
  p.selected = dsel.p;
  p.n_selected = dn.p;
  p.shares = dsh.p;
  p.pdl = true;
  if (chunk_stats) {
    p.chunk_stats = dstats.p;
    p.n_chunks = n_chunks;
  }
  if (candidates) {
    p.candidates = dcand.p;
    p.n_candidates = dncand.p;
  }
  p.cluster_pages = cluster_pages;
  if (cluster_pages) p.keys = nullptr, p.hist = nullptr;  // not used by the one-kernel select
  const cudaError_t e = lc::select_pages(p, nullptr);
  if (launch_error && (e == cudaErrorInvalidClusterSize || e == cudaErrorLaunchOutOfResources)) {
    *launch_error = e;
    cudaGetLastError();
    return {};
  }
  ck(e, "select_pages");
  dev_sync();
  SelectOut o{dsel.down(), dn.down(), dsh.down(), dlse.down()};
  const auto hist = dhist.down();
  for (uint32_t c : hist) EXPECT_EQ(c, 0u) << "select histograms must be left at zero";
  return o;
}

// Every way (every key scanned; the candidate lists; one kernel, as the plan sizes its clusters and with
// the most CTAs per cluster): the same selection, position for position, and the same shares and
// lse_total, bit for bit.
SelectOut run_select(int B, int H, int G, const std::vector<int32_t>& indptr, const std::vector<float>& lm,
                     const std::vector<float>& lse_total, int stride, int k,
                     const std::vector<float>* chunk_stats = nullptr, int n_chunks = 0) {
  const SelectOut all = run_select_once(B, H, G, indptr, lm, lse_total, stride, k, chunk_stats, n_chunks, false);
  const SelectOut lists = run_select_once(B, H, G, indptr, lm, lse_total, stride, k, chunk_stats, n_chunks, true);
  auto same = [&](const SelectOut& o, const std::string& how) {
    EXPECT_EQ(all.n_sel, o.n_sel) << how << ": n_selected";
    for (int bh = 0; bh < B * H; ++bh)
      for (int i = 0; i < std::max(0, all.n_sel[bh]); ++i)
        EXPECT_EQ(all.sel[size_t(bh) * k + i], o.sel[size_t(bh) * k + i]) << how << ": (b, h) " << bh << " position " << i;
    for (size_t i = 0; i < all.shares.size(); ++i)
      if (std::memcmp(&all.shares[i], &o.shares[i], sizeof(float)) != 0) {
        ADD_FAILURE() << how << ": share " << i << " " << all.shares[i] << " vs " << o.shares[i];
        break;
      }
    for (size_t i = 0; i < all.lse_total.size(); ++i)
      if (std::memcmp(&all.lse_total[i], &o.lse_total[i], sizeof(float)) != 0) {
        ADD_FAILURE() << how << ": lse_total " << i << " " << all.lse_total[i] << " vs " << o.lse_total[i];
        break;
      }
  };
  same(lists, "select with candidate lists");
  // The fewest CTAs (up to 8 rounds of loads each), the most, and a count between them (not a power
  // of two in general, as the plan picks).
  const int fewest = (stride + lc::kClusterSelectPages - 1) / lc::kClusterSelectPages;
  const int most = std::min(16, (stride + 31) / 32);
  std::vector<int> counts = {fewest, (fewest + most + 1) / 2, most};
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  for (int clusters : counts) {
    const int pages = ((stride + clusters - 1) / clusters + 31) / 32 * 32;
    cudaError_t unschedulable = cudaSuccess;  // e.g. no 16-CTA clusters on a GPU with smaller GPCs (MIG)
    const SelectOut one =
        run_select_once(B, H, G, indptr, lm, lse_total, stride, k, chunk_stats, n_chunks, false, pages, &unschedulable);
    if (unschedulable != cudaSuccess) {
      std::printf("[ select ] one kernel with %d CTAs per cluster not run: %s\n", clusters,
                  cudaGetErrorString(unschedulable));
      continue;
    }
    same(one, "one-kernel select, " + std::to_string(pages) + " pages per CTA");
  }
  return lists;
}

// For every (b, h): the GPU set is valid (sorted, unique, sink + recent, size min(k, n)) and captures
// the same CPU share mass as the CPU selection.
void check_selection(int B, int H, int G, const std::vector<int32_t>& indptr, const std::vector<float>& lm, int stride,
                     int k, const SelectOut& o, double tol, bool exact_sets) {
  double worst = 0.0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int n = indptr[b + 1] - indptr[b];
      const size_t bh = size_t(b) * H + h;
      std::vector<float> lmc(size_t(G) * n);
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < n; ++j) lmc[size_t(g) * n + j] = lm[(bh * G + g) * stride + j];
      std::vector<int32_t> ref;
      std::vector<float> score;
      select_top_pages(lmc.data(), G, n, k, GroupRule::kShareAverage, ref, &score);
      const int cnt = o.n_sel[bh];
      ASSERT_EQ(cnt, std::min(n, std::max(k, 2))) << "b " << b << " h " << h;
      std::vector<int32_t> got(o.sel.begin() + bh * k, o.sel.begin() + bh * k + cnt);
      ASSERT_TRUE(std::is_sorted(got.begin(), got.end()));
      ASSERT_TRUE(std::adjacent_find(got.begin(), got.end()) == got.end()) << "duplicate page";
      if (n > 0) {
        ASSERT_EQ(got.front(), 0) << "sink page";
        ASSERT_EQ(got.back(), n - 1) << "recent page";
      }
      for (int32_t j : got) {
        ASSERT_TRUE(j >= 0 && j < n);
      }
      double mg = 0.0, mr = 0.0;
      for (int32_t j : got) mg += score[j];
      for (int32_t j : ref) mr += score[j];
      worst = std::max(worst, std::abs(mg - mr));
      EXPECT_NEAR(mg, mr, tol) << "captured share mass, b " << b << " h " << h;
      if (exact_sets) {
        EXPECT_EQ(got, ref) << "b " << b << " h " << h;
      }
    }
  std::printf("[ select G=%d k=%d ] max captured-mass difference %.2e\n", G, k, worst);
}

struct AttnOut {
  std::vector<float> o, lse;
};

AttnOut run_attention(const World& w, const std::vector<float>& q, const std::vector<int32_t>* sel,
                      const std::vector<int32_t>* n_sel, int sel_stride, int pps, bool group_halves = false,
                      int merge_kernel_above = 16, bool balance_splits = false, bool cluster_merge = false,
                      int n_splits = 0, uint32_t* status_out = nullptr) {
  int max_list = 0;
  for (int b = 0; b < w.B(); ++b)
    for (int h = 0; h < w.H; ++h)
      max_list = std::max(max_list, sel ? (*n_sel)[size_t(b) * w.H + h] : w.seqs[b].n_pages());
  const int splits = n_splits > 0 ? n_splits : std::max(1, (max_list + pps - 1) / pps);
  Dev<float> dq(q), d_o(q.size()), dl(size_t(w.B()) * w.H * w.G), dpo(size_t(w.B()) * w.H * splits * 16 * w.d),
      dpl(size_t(w.B()) * w.H * splits * 16);
  Dev<uint32_t> dcnt(size_t(w.B()) * w.H), dstatus(1);
  dcnt.fill_bytes(0);
  dstatus.fill_bytes(0);
  d_o.fill_bytes(0x7f);
  dl.fill_bytes(0x7f);
  Dev<int32_t> dsel(sel ? *sel : std::vector<int32_t>{0}), dn(n_sel ? *n_sel : std::vector<int32_t>{0});
  lc::AttentionParams p;
  p.q = dq.p;
  p.kv = w.view();
  p.group = w.G;
  p.scale = 1.0f / std::sqrt(float(w.d));
  p.selected = sel ? dsel.p : nullptr;
  p.n_selected = sel ? dn.p : nullptr;
  p.selected_stride = sel_stride;
  p.pages_per_split = pps;
  p.n_splits = splits;
  p.o = d_o.p;
  p.lse = dl.p;
  p.partial_o = dpo.p;
  p.partial_lse = dpl.p;
  p.counters = dcnt.p;
  p.pdl = true;
  p.group_halves = group_halves;
  p.merge_kernel_above = merge_kernel_above;
  p.balance_splits = balance_splits;
  p.cluster_merge = cluster_merge;
  p.status = dstatus.p;
  ck(lc::paged_decode_attention(p, nullptr), "paged_decode_attention");
  dev_sync();
  if (status_out) *status_out = dstatus.down()[0];
  for (uint32_t c : dcnt.down()) EXPECT_EQ(c, 0u) << "attention counters must be left at zero";
  return {d_o.down(), dl.down()};
}

// GPU output vs CPU paged_decode_attention over the same page lists; returns max relative error.
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

const LlamaModel& reference_model() {
  static const LlamaModel m = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  return m;
}

/// Real KV: prefill of the reference model on the haystack text (keys of layer `il`).
const Session& real_session() {
  static std::unique_ptr<Session> s;
  if (!s) {
    const LlamaModel& m = reference_model();
    std::ifstream in(test::source_path("examples/haystack.txt"), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    std::vector<int32_t> ids = m.tokenizer.encode(ss.str(), true);
    ids.resize(std::min<size_t>(ids.size(), 1500 + 7));  // 94 pages, the last one partial
    SessionConfig sc;
    sc.n_ctx = 2048;
    s = std::make_unique<Session>(m, sc);
    s->prefill(ids);
  }
  return *s;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Host-only: the device record packs exactly the CPU store's quantization (runs without a GPU).
TEST(CudaPack, RecordRoundTripMatchesCpuStore) {
  std::mt19937 rng(5);
  std::normal_distribution<float> N(0.0f, 1.0f);
  for (int d : {64, 128}) {
    PageSummaryStore st(SummaryFormat{8, 4, 8, 8}, 1, 1, 4, 16, d);
    for (int page = 0; page < 4; ++page) {
      std::vector<float> keys(size_t(16) * d);
      for (auto& x : keys) x = page == 1 ? 0.0f : 3.0f * N(rng);
      const PageSummaryF32 f = build_page_summary(keys.data(), 16, d, 8);
      st.store(0, 0, page, f);
      std::vector<uint8_t> rec(lc::summary_record_bytes(d));
      lc::pack_summary_record(f.centroid.data(), f.basis.data(), f.coef.data(), d, rec.data());
      std::vector<float> mu(d), V(size_t(8) * d), C(16 * 8);
      lc::unpack_summary_record(rec.data(), d, mu.data(), V.data(), C.data());
      const PageSummaryF32 ref = st.load(0, 0, page);
      EXPECT_EQ(mu, ref.centroid) << "d " << d;
      EXPECT_EQ(V, ref.basis) << "d " << d;
      EXPECT_EQ(C, ref.coef) << "d " << d;
    }
  }
  EXPECT_EQ(lc::summary_record_bytes(128), 832u);
  EXPECT_EQ(lc::summary_record_bytes(64), 512u);
  EXPECT_EQ(lc::summary_record_bytes(96), 0u) << "no device format at head_dim 96";
  EXPECT_EQ(lc::describe_decode_status(lc::kStatusBadPageId | lc::kStatusBadLastPageLen),
            "last_page_len outside 1..16; page id outside [0, n_pages_pool)");
  EXPECT_EQ(lc::describe_decode_status(0u), "");
  EXPECT_EQ(lc::describe_decode_status(lc::kStatusBadPageCount | 0x40u),
            "page count out of range (indptr descending, or more pages than the plan covers: max_pages); unknown "
            "status bits 0x40");
}

// ------------------------------------------------------------------------------------------------
TEST(CudaSummary, BuildMatchesCpuOnRandomAndDegeneratePages) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128}) {
    World w(d, 2, 4, {16 * 60, 16 * 37 + 9}, lc::KvType::kF16, 11 + d);
    Summaries ref(w);
    std::vector<int32_t> pages;
    for (const auto& s : w.seqs)
      for (int j = 0; j < s.n_pages(); ++j)
        if (s.n_tokens - 16 * j >= 16) pages.push_back(s.page_table[j]);
    const size_t rb = lc::summary_record_bytes(d);
    Dev<uint8_t> drec(ref.records.size());
    Dev<float> dtail(ref.tails.size());
    Dev<int32_t> dpages(pages);
    drec.fill_bytes(0);
    lc::SummaryBuildParams p;
    p.k = w.dk.p;
    p.dtype = w.dtype;
    p.n_head_kv = w.H;
    p.head_dim = d;
    p.pages = dpages.p;
    p.n_pages = int(pages.size());
    p.n_pages_pool = w.cfg.n_pages;
    p.records = drec.p;
    p.tails = dtail.p;
    ck(lc::summary_build(p, nullptr), "summary_build");
    dev_sync();
    const auto rec = drec.down();
    const auto tails = dtail.down();
    double worst_rec = 0.0, sum_rec = 0.0;
    int n_items = 0;
    for (int32_t page : pages)
      for (int h = 0; h < w.H; ++h) {
        const size_t idx = size_t(h) * w.cfg.n_pages + page;
        std::vector<float> mu(d), V(size_t(8) * d), C(128), mu_r(d), V_r(size_t(8) * d), C_r(128);
        lc::unpack_summary_record(&rec[idx * rb], d, mu.data(), V.data(), C.data());
        lc::unpack_summary_record(&ref.records[idx * rb], d, mu_r.data(), V_r.data(), C_r.data());
        for (float x : V) ASSERT_TRUE(std::isfinite(x));
        for (float x : C) ASSERT_TRUE(std::isfinite(x));
        // Centroid: same codes up to one rounding step.
        float ms = 0.0f;
        for (float x : mu_r) ms = std::max(ms, std::abs(x));
        for (int c = 0; c < d; ++c) EXPECT_LE(std::abs(mu[c] - mu_r[c]), 1.01f * ms / 127.0f + 1e-7f);
        // Rank-8 reconstruction C V (invariant to eigenvector signs).
        double num = 0.0, den = 0.0;
        for (int i = 0; i < 16; ++i)
          for (int c = 0; c < d; ++c) {
            double a = 0.0, r = 0.0;
            for (int k = 0; k < 8; ++k) {
              a += double(C[i * 8 + k]) * V[size_t(k) * d + c];
              r += double(C_r[i * 8 + k]) * V_r[size_t(k) * d + c];
            }
            num += (a - r) * (a - r);
            den += r * r;
          }
        const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
        worst_rec = std::max(worst_rec, rel);
        sum_rec += rel;
        ++n_items;
        EXPECT_LT(rel, 0.05) << "page " << page << " h " << h;
        EXPECT_NEAR(tails[idx], ref.tails[idx], 1e-4 * std::max(1.0f, ref.tails[idx]) + 1e-3f) << "tail";
      }
    EXPECT_LT(sum_rec / n_items, 2e-3) << "mean reconstruction difference";
    std::printf("[ summary d=%d ] %d (page, head) items, reconstruction rel diff max %.2e mean %.2e\n", d, n_items,
                worst_rec, sum_rec / n_items);

    // The score from GPU-built summaries agrees with the CPU-built ones.
    const auto q = w.queries(3);
    const ScoreOut g = run_score(w, rec, q, 32);
    const ScoreOut c = run_score(w, ref.records, q, 32);
    double worst = 0.0;
    for (size_t i = 0; i < g.log_mass.size(); ++i)
      if (std::isfinite(c.log_mass[i]) && std::abs(c.log_mass[i]) < 1e30)
        worst = std::max(worst, double(std::abs(g.log_mass[i] - c.log_mass[i])));
    EXPECT_LT(worst, 0.25) << "score from GPU- vs CPU-built summaries";
    std::printf("[ summary d=%d ] max |score(GPU build) - score(CPU build)| = %.3e\n", d, worst);
  }
}

// summary_build's parameters for a bf16 K pool (one layer).
lc::SummaryBuildParams bf16_build_params(const uint16_t* k, int H, int d, int pool, const int32_t* pages, int n_pages) {
  lc::SummaryBuildParams p;
  p.k = k;
  p.dtype = lc::KvType::kBF16;
  p.n_head_kv = H;
  p.head_dim = d;
  p.n_pages_pool = pool;
  p.pages = pages;
  p.n_pages = n_pages;
  return p;
}

// Keys that are not finite (an f16 overflow in the cache, a NaN) are bad input: the page's record
// is NaN, the status word says so, and no other page's record changes (memcheck: no access out of
// bounds, as an unsorted eigenvalue order once made possible). Pages: NaN key, Inf key, finite keys.
TEST(CudaSummary, NonFiniteKeysGiveANaNRecordAndTheStatusBit) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128}) {
    const int H = 1, pool = 3;
    std::mt19937 rng(5 + d);
    std::normal_distribution<float> N(0.0f, 1.0f);
    std::vector<uint16_t> k(size_t(pool) * H * 16 * d);
    for (auto& x : k) x = bf16_bits(round_bf16(N(rng)));
    k[7 * d + 3] = 0x7fc0;                    // page 0: a NaN
    k[size_t(16) * d + 11 * d + 5] = 0x7f80;  // page 1: +Inf
    const size_t rb = lc::summary_record_bytes(d);
    Dev<uint16_t> dk(k);
    Dev<int32_t> dpages(std::vector<int32_t>{0, 1, 2}), dgood(std::vector<int32_t>{2});
    Dev<uint8_t> drec(size_t(pool) * rb), dref(size_t(pool) * rb);
    Dev<uint32_t> dstatus(1), dstatus_ref(1);
    drec.fill_bytes(0);
    dref.fill_bytes(0);
    dstatus.fill_bytes(0);
    dstatus_ref.fill_bytes(0);
    lc::SummaryBuildParams p = bf16_build_params(dk.p, H, d, pool, dpages.p, 3);
    p.records = drec.p;
    p.status = dstatus.p;
    ck(lc::summary_build(p, nullptr), "summary_build");
    p.pages = dgood.p;
    p.n_pages = 1;
    p.records = dref.p;
    p.status = dstatus_ref.p;
    ck(lc::summary_build(p, nullptr), "summary_build (finite page alone)");
    dev_sync();
    EXPECT_EQ(dstatus.down()[0], uint32_t(lc::kStatusBadKeys)) << lc::describe_decode_status(dstatus.down()[0]);
    EXPECT_EQ(dstatus_ref.down()[0], 0u);
    const auto rec = drec.down(), ref = dref.down();
    for (int page : {0, 1}) {
      std::vector<float> mu(d), V(size_t(8) * d), C(128);
      lc::unpack_summary_record(&rec[page * rb], d, mu.data(), V.data(), C.data());
      bool any_nan = false;
      for (float x : mu) any_nan |= std::isnan(x);
      EXPECT_TRUE(any_nan) << "d " << d << " page " << page << ": a NaN centroid";
    }
    EXPECT_TRUE(std::equal(rec.begin() + 2 * rb, rec.begin() + 3 * rb, ref.begin() + 2 * rb))
        << "d " << d << ": the finite page's record does not depend on its neighbours";
  }
}

// Pages the float32 Jacobi finds hardest: one direction dominating the keys (the rest at 1e-3 of
// it), and one token 300x the others. The GPU record's rank-8 reconstruction of the centred keys must
// be as close to them as the CPU's float64 build is (int4/int8 quantization dominates both).
TEST(CudaSummary, DominatedPagesReconstructAsWellAsTheCpuBuild) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128})
    for (int kind = 0; kind < 3; ++kind) {
      std::mt19937 rng(900 + 10 * d + kind);
      std::normal_distribution<float> N(0.0f, 1.0f);
      std::vector<float> u(d), mean(d), keys(size_t(16) * d);
      for (int c = 0; c < d; ++c) {
        u[c] = N(rng);
        mean[c] = 2.0f * N(rng);
      }
      for (int i = 0; i < 16; ++i) {
        const float a = 4.0f * N(rng);
        for (int c = 0; c < d; ++c) {
          float x = kind == 0   ? mean[c] + a * u[c] + 1e-3f * N(rng)                    // one direction
                    : kind == 1 ? mean[c] + a * u[c] + 0.2f * a * N(rng) * (c % 3 == 0)  // two, skewed
                                : N(rng) * (i == 5 ? 300.0f : 1.0f);                     // an outlier token
          keys[size_t(i) * d + c] = round_bf16(x);
        }
      }
      std::vector<uint16_t> kb(keys.size());
      for (size_t e = 0; e < keys.size(); ++e) kb[e] = bf16_bits(keys[e]);
      const size_t rb = lc::summary_record_bytes(d);
      std::vector<uint8_t> cpu_rec(rb);
      const PageSummaryF32 f = build_page_summary(keys.data(), 16, d, 8);
      lc::pack_summary_record(f.centroid.data(), f.basis.data(), f.coef.data(), d, cpu_rec.data());
      Dev<uint16_t> dk(kb);
      Dev<int32_t> dpage(std::vector<int32_t>{0});
      Dev<uint8_t> drec(rb);
      lc::SummaryBuildParams p = bf16_build_params(dk.p, 1, d, 1, dpage.p, 1);
      p.records = drec.p;
      ck(lc::summary_build(p, nullptr), "summary_build");
      dev_sync();
      const auto gpu_rec = drec.down();
      // || centroid + C V - keys ||_F / || keys - mean ||_F for a record.
      auto rel_err = [&](const uint8_t* rec) {
        std::vector<float> mu(d), V(size_t(8) * d), C(128);
        lc::unpack_summary_record(rec, d, mu.data(), V.data(), C.data());
        std::vector<double> m(d, 0.0);
        for (int i = 0; i < 16; ++i)
          for (int c = 0; c < d; ++c) m[c] += keys[size_t(i) * d + c] / 16.0;
        double num = 0.0, den = 0.0;
        for (int i = 0; i < 16; ++i)
          for (int c = 0; c < d; ++c) {
            double r = mu[c];
            for (int k = 0; k < 8; ++k) r += double(C[i * 8 + k]) * V[size_t(k) * d + c];
            const double x = keys[size_t(i) * d + c];
            num += (r - x) * (r - x);
            den += (x - m[c]) * (x - m[c]);
          }
        return std::sqrt(num / den);
      };
      const double eg = rel_err(gpu_rec.data()), ec = rel_err(cpu_rec.data());
      std::printf("[ summary dominated d=%d kind=%d ] reconstruction error GPU %.3e, CPU %.3e\n", d, kind, eg, ec);
      EXPECT_LE(eg, 1.02 * ec + 1e-4) << "d " << d << " kind " << kind;  // H200: equal to 4 digits
    }
}

// Several layers in one launch (SummaryBuildParams::n_layers) write exactly what one launch per
// layer writes, with K per layer and with one K pool read by every layer (k_layer_stride 0);
// overlapping layer strides are refused.
TEST(CudaSummary, LayersInOneLaunchEqualOneLaunchPerLayer) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128}) {
    const int H = 2, pool = 5, L = 3;
    const size_t layer_elems = size_t(pool) * H * 16 * d, rb = lc::summary_record_bytes(d);
    const size_t rec_layer = size_t(H) * pool * rb, tail_layer = size_t(H) * pool;
    std::mt19937 rng(77 + d);
    std::normal_distribution<float> N(0.0f, 1.0f);
    std::vector<uint16_t> k(layer_elems * L);
    for (auto& x : k) x = bf16_bits(round_bf16(1.5f * N(rng)));
    Dev<uint16_t> dk(k);
    Dev<int32_t> dpages(std::vector<int32_t>{4, 1, 2});
    for (bool shared_k : {false, true}) {
      Dev<uint8_t> one(rec_layer * L), each(rec_layer * L);
      Dev<float> tone(tail_layer * L), teach(tail_layer * L);
      one.fill_bytes(0);
      each.fill_bytes(0);
      tone.fill_bytes(0);
      teach.fill_bytes(0);
      lc::SummaryBuildParams p = bf16_build_params(dk.p, H, d, pool, dpages.p, 3);
      for (int l = 0; l < L; ++l) {
        lc::SummaryBuildParams q = p;
        q.k = dk.p + (shared_k ? 0 : l * layer_elems);
        q.records = each.p + l * rec_layer;
        q.tails = teach.p + l * tail_layer;
        ck(lc::summary_build(q, nullptr), "summary_build (one layer)");
      }
      p.records = one.p;
      p.tails = tone.p;
      p.n_layers = L;
      p.k_layer_stride = shared_k ? 0 : layer_elems;
      p.records_layer_stride = rec_layer;
      p.tails_layer_stride = tail_layer;
      ck(lc::summary_build(p, nullptr), "summary_build (layers)");
      dev_sync();
      EXPECT_EQ(one.down(), each.down()) << "d " << d << (shared_k ? " one K pool" : " K per layer");
      EXPECT_EQ(tone.down(), teach.down()) << "d " << d;
      p.records_layer_stride = rec_layer - 1;  // layers would overlap
      EXPECT_EQ(lc::summary_build(p, nullptr), cudaErrorInvalidValue);
      p.records_layer_stride = rec_layer;
      p.k_layer_stride = layer_elems - 1;
      EXPECT_EQ(lc::summary_build(p, nullptr), cudaErrorInvalidValue);
      p.k_layer_stride = layer_elems + 1;  // apart, but K's 16-byte loads would be misaligned
      EXPECT_EQ(lc::summary_build(p, nullptr), cudaErrorInvalidValue);
      p.k_layer_stride = layer_elems;
      p.records_layer_stride = rec_layer + 8;  // records' 16-byte stores misaligned
      EXPECT_EQ(lc::summary_build(p, nullptr), cudaErrorInvalidValue);
    }
  }
}

TEST(CudaScore, MatchesCpuStoreAllGroupSizes) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128})
    for (int G : {1, 2, 4, 5, 6, 7, 8, 9, 12, 16}) {
      World w(d, 2, G, {16 * 45 + 3, 16 * 70, 0, 7, 16 * 3 + 15}, lc::KvType::kF16, 100 + d + G);
      Summaries s(w);
      const auto q = w.queries(7 + G);
      // Chunks of 32 or 64 pages; persistent grids of 3 CTAs (many items each) or a full device.
      const ScoreOut g = run_score(w, s.records, q, G % 2 ? 32 : 64, G % 3 ? 0 : 3);
      const auto ref = cpu_log_mass(w, s.store, q, g.stride);
      double worst = check_scores(w, g, ref, "score");
      // Balanced chunks: the ragged lengths above spread over the grid (a full device; 3 CTAs: one
      // chunk per sequence and head, several items per CTA; 13 and 23: a few spare CTAs shared in
      // proportion to the sequences' pages).
      for (int grid : {0, 3, 13, 23}) {
        const ScoreOut gb = run_score(w, s.records, q, 32, grid, false, /*balance=*/true);
        worst = std::max(worst, check_scores(w, gb, ref, "score, balanced chunks"));
      }
      std::printf("[ score d=%d G=%d ] max |gpu - cpu| = %.2e\n", d, G, worst);
    }
}

// Items much longer than the score pass's ring (G <= 8: 10 octet slots at d = 128, 16 at d = 64), as
// the decode plan makes them (hundreds of pages): every slot is refilled many times (at d = 128 by a
// warp other than the one that computes the refill), and a persistent 2-CTA grid carries the ring's
// use count across several items. G = 16 runs its private stages through the same long items.
// Sequence lengths are not multiples of 8 pages (partial last octets). With even memory latency the
// ring's old race would very likely not show here either: this is a regression test, not a detector.
TEST(CudaScore, LongItemsCycleTheRing) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128})
    for (int G : {4, 8, 16}) {
      World w(d, 2, G, {16 * 1203 + 5, 16 * 517, 16 * 261 + 9}, lc::KvType::kF16, 500 + d + G, false);
      Summaries s(w);
      const auto q = w.queries(13 + G);
      for (int grid : {0, 2}) {
        const ScoreOut g = run_score(w, s.records, q, 512, grid);
        const auto ref = cpu_log_mass(w, s.store, q, g.stride);
        const double worst = check_scores(w, g, ref, "score (long items)");
        std::printf("[ score long items d=%d G=%d grid=%d ] max |gpu - cpu| = %.2e\n", d, G, grid, worst);
      }
    }
}

// 32-page chunks over a 4500-page sequence: 141 chunks per (sequence, head), so the last CTA of each
// merges its chunk statistics in more than one round (128 chunks are loaded at once, the rest by a
// loop), and lse_total must still match the CPU.
TEST(CudaScore, ManyChunksMergeInMoreThanOneRound) {
  SKIP_WITHOUT_CUDA();
  for (int G : {4, 16}) {
    World w(128, 2, G, {16 * 4500 + 3, 16 * 40}, lc::KvType::kF16, 900 + G, false);
    Summaries s(w);
    const auto q = w.queries(17 + G);
    const ScoreOut g = run_score(w, s.records, q, 32, 0);
    const auto ref = cpu_log_mass(w, s.store, q, g.stride);
    const double worst = check_scores(w, g, ref, "score (many chunks)");
    std::printf("[ score many chunks G=%d ] max |gpu - cpu| = %.2e\n", G, worst);
  }
}

// Queries 300x larger: a page's token logits then lie hundreds of nats from its centroid logit, past
// exp2's range, so the score kernel must take its max-shifted path for those octets (Eq. 4 is still
// exact in float64 on the CPU).
TEST(CudaScore, ExtremeLogitsTakeTheShiftedPath) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128})
    for (int G : {4, 16}) {
      World w(d, 2, G, {16 * 40 + 5, 16 * 9}, lc::KvType::kF16, 300 + d + G);
      Summaries s(w);
      auto q = w.queries(11 + G);
      for (float& x : q) x *= 300.0f;
      const ScoreOut g = run_score(w, s.records, q, 32, 0);
      const auto ref = cpu_log_mass(w, s.store, q, g.stride);
      double spread = 0.0;  // largest |log-mass| seen: evidence that the range was extreme
      for (float v : ref) spread = std::max(spread, double(std::abs(v)));
      EXPECT_GT(spread, 200.0);
      // q's 16-bit quantization: |dq| <= max|q| / 64516 per dim, i.e. ~1.5e-5 of the logit scale.
      const double worst = check_scores(w, g, ref, "score (extreme)", 3e-5);
      std::printf("[ score extreme d=%d G=%d ] max |log-mass| %.0f, max |gpu - cpu| = %.2e\n", d, G, spread, worst);
    }
}

TEST(CudaSelect, MatchesCpuByCapturedShareMass) {
  SKIP_WITHOUT_CUDA();
  std::mt19937 rng(9);
  std::normal_distribution<float> N(0.0f, 1.0f);
  for (int G : {1, 4, 7, 16})
    for (int k : {2, 3, 16, 128}) {
      const int B = 4, H = 2;
      const std::vector<int> n = {1500, 200, k + 1, 40000};  // 40000: 40 candidate lists, > 1 per select warp
      std::vector<int32_t> indptr = {0};
      int mx = 0;
      for (int x : n) {
        indptr.push_back(indptr.back() + x);
        mx = std::max(mx, x);
      }
      const int stride = (mx + 7) / 8 * 8;
      std::vector<float> lm(size_t(B) * H * G * stride, 0.0f), lse(size_t(B) * H * G);
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
          for (int g = 0; g < G; ++g) {
            float* row = &lm[((size_t(b) * H + h) * G + g) * stride];
            for (int j = 0; j < n[b]; ++j) row[j] = 3.0f * N(rng) + (j % 17 == 0 ? 4.0f : 0.0f);
            lse[(size_t(b) * H + h) * G + g] = float(lse_of(row, n[b]));
          }
      const SelectOut o = run_select(B, H, G, indptr, lm, lse, stride, k);
      check_selection(B, H, G, indptr, lm, stride, k, o, 1e-6, false);
      // Shares as the CPU computes them.
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h) {
          std::vector<float> lmc(size_t(G) * n[b]);
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < n[b]; ++j) lmc[size_t(g) * n[b] + j] = lm[((size_t(b) * H + h) * G + g) * stride + j];
          std::vector<int32_t> tmp;
          std::vector<float> sc;
          select_top_pages(lmc.data(), G, n[b], k, GroupRule::kShareAverage, tmp, &sc);
          for (int j = 0; j < n[b]; ++j)
            EXPECT_NEAR(o.shares[(size_t(b) * H + h) * stride + j], sc[j], 1e-6 + 1e-5 * sc[j]);
        }
    }
}

TEST(CudaSelect, ExactOnDuplicatesAndTiesGoToLowerIndex) {
  SKIP_WITHOUT_CUDA();
  std::mt19937 rng(21);
  // Values from a small set: many exact ties, distinct values well apart -> identical sets.
  // n = 3000 resolves ties in shared memory, n = 9000 (all equal) takes the global fallback.
  for (int mode = 0; mode < 3; ++mode) {
    const int B = 1, H = 2, G = 3, k = 100;
    const int n = mode == 2 ? 9000 : 3000;
    const int stride = (n + 7) / 8 * 8;
    std::vector<int32_t> indptr = {0, n};
    std::vector<float> lm(size_t(B) * H * G * stride, 0.0f), lse(size_t(B) * H * G);
    for (int h = 0; h < H; ++h)
      for (int g = 0; g < G; ++g) {
        float* row = &lm[(size_t(h) * G + g) * stride];
        for (int j = 0; j < n; ++j) row[j] = mode == 0 ? float(rng() % 6) : mode == 1 ? 1.5f : -2.0f;
        lse[size_t(h) * G + g] = float(lse_of(row, n));
      }
    // Heads of a group see the same values so shares tie exactly.
    for (int h = 0; h < H; ++h)
      for (int g = 1; g < G; ++g) std::copy_n(&lm[(size_t(h) * G) * stride], n, &lm[(size_t(h) * G + g) * stride]);
    for (int h = 0; h < H; ++h)
      for (int g = 0; g < G; ++g) lse[size_t(h) * G + g] = float(lse_of(&lm[(size_t(h) * G + g) * stride], n));
    const SelectOut o = run_select(B, H, G, indptr, lm, lse, stride, k);
    check_selection(B, H, G, indptr, lm, stride, k, o, 1e-7, true);
    if (mode > 0) {
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < k - 1; ++i) EXPECT_EQ(o.sel[size_t(h) * k + i], i) << "ties go to the lower index";
    }
  }
}

TEST(CudaSelect, BudgetCoveringTheSequenceSelectsEveryPage) {
  SKIP_WITHOUT_CUDA();
  const int B = 4, H = 1, G = 2, k = 8, stride = 8;
  std::vector<int32_t> indptr = {0, 1, 3, 11, 11};  // 1, 2, 8 pages and an empty sequence
  std::vector<float> lm(size_t(B) * H * G * stride, 0.5f), lse(size_t(B) * H * G, 0.0f);
  const SelectOut o = run_select(B, H, G, indptr, lm, lse, stride, k);
  for (int b = 0; b < B; ++b) {
    const int n = indptr[b + 1] - indptr[b];
    ASSERT_EQ(o.n_sel[b], n);
    for (int j = 0; j < n; ++j) EXPECT_EQ(o.sel[size_t(b) * k + j], j);
  }
}

// The decode step's split of work (ScoreParams::defer_lse_total): the score pass writes every
// chunk's statistics (unwritten ones would stay NaN: run_score poisons them) and leaves lse_total to
// the share kernel, whose CTAs merge them. lse_total must equal the log-sum-exp of the pass's own
// log-masses (float64 here), the empty sequence keeps -inf, and the selection must be the CPU's on
// those log-masses. 22 chunks of 32 pages (some empty), and 141 (more than the 128 loaded at once by
// each warp); G 12 is a head stride that is no power of two. A select without the statistics after a
// deferred pass fails loudly (n_selected = -1), not on a stale lse_total.
TEST(CudaSelect, MergesTheScorePassDeferredStatistics) {
  SKIP_WITHOUT_CUDA();
  // The last two: one sequence alone (balanced: chunks without a page-table read, many of them empty
  // items), and 40 short sequences (balanced: more than one warp's worth of sequences to scan).
  std::vector<int> many;
  for (int i = 0; i < 40; ++i) many.push_back(16 * (3 + (i * 7) % 23) + i % 16);
  const std::vector<std::vector<int>> tables = {
      {16 * 700 + 5, 0, 16 * 90, 7}, {16 * 4500 + 3, 16 * 40}, {16 * 60 + 9}, many};
  for (const auto& lens : tables)
    for (int G : {4, 12, 16}) {
      World w(128, 2, G, lens, lc::KvType::kF16, 1300 + G, false);
      Summaries s(w);
      const auto q = w.queries(23 + G);
      for (bool balance : {false, true}) {
        const ScoreOut g = run_score(w, s.records, q, 32, 0, /*defer=*/true, balance);
        const int B = int(w.lengths.size()), k = 16;
        for (int b = 0; b < B; ++b)
          for (int r = 0; r < w.H * G; ++r) {
            const float v = g.lse_total[size_t(b) * w.H * G + r];
            if (w.indptr[b + 1] == w.indptr[b])
              EXPECT_EQ(v, -INFINITY) << "deferred score pass, empty sequence " << b;
            else
              EXPECT_TRUE(std::isnan(v)) << "deferred score pass leaves lse_total NaN, sequence " << b;
          }
        const SelectOut o =
            run_select(B, w.H, G, w.indptr, g.log_mass, g.lse_total, g.stride, k, &g.chunk_stats, g.n_chunks);
        for (int b = 0; b < B; ++b)
          for (int h = 0; h < w.H; ++h)
            for (int gg = 0; gg < G; ++gg) {
              const int n = w.indptr[b + 1] - w.indptr[b];
              const size_t row = (size_t(b) * w.H + h) * G + gg;
              const float got = o.lse_total[row];
              if (n == 0) {
                EXPECT_EQ(got, -INFINITY) << "empty sequence, b " << b;
                continue;
              }
              const double ref = lse_of(&g.log_mass[row * g.stride], n);
              EXPECT_NEAR(got, ref, 1e-4 + 1e-6 * std::abs(ref)) << "b " << b << " h " << h << " g " << gg;
            }
        check_selection(B, w.H, G, w.indptr, g.log_mass, g.stride, k, o, 1e-6, false);
        std::printf("[ deferred merge G=%d%s ] %d chunks: lse_total and selection match\n", G,
                    balance ? ", balanced chunks" : "", g.n_chunks);

        const SelectOut loud = run_select(B, w.H, G, w.indptr, g.log_mass, g.lse_total, g.stride, k);
        for (int b = 0; b < B; ++b)
          for (int h = 0; h < w.H; ++h)
            if (w.indptr[b + 1] > w.indptr[b]) {
              EXPECT_EQ(loud.n_sel[size_t(b) * w.H + h], -1) << "b " << b;
            }
      }
    }
}

TEST(CudaAttention, DenseAndSparseMatchCpuF16AndBf16) {
  SKIP_WITHOUT_CUDA();
  std::mt19937 rng(33);
  for (auto dt : {lc::KvType::kF16, lc::KvType::kBF16})
    for (int d : {64, 128})
      for (int G : {1, 3, 4, 5, 6, 7, 8, 11, 16}) {
        World w(d, 2, G, {16 * 40 + 5, 1, 16 * 9, 16 * 2 + 1}, dt, 300 + d + G + int(dt) * 1000, false);
        const auto q = w.queries(G);
        const char* tag = dt == lc::KvType::kF16 ? "dense f16" : "dense bf16";
        double worst = 0.0;
        for (bool halves : {false, true}) {
          if (halves && G <= 8) continue;  // two CTAs of <= 8 heads: only for G > 8
          for (int pps : {1, 4, 13, 64}) {
            const AttnOut g = run_attention(w, q, nullptr, nullptr, 0, pps, halves);
            worst = std::max(worst, check_attention(w, q, g, dense_lists(w), tag));
          }
          // 41 splits merged by the last CTA instead of the merge kernel.
          const AttnOut g = run_attention(w, q, nullptr, nullptr, 0, 1, halves, 128);
          worst = std::max(worst, check_attention(w, q, g, dense_lists(w), tag));
          // Balanced splits (the grid shared in proportion to the pages: 41, 1, 9, 3).
          for (int pps : {1, 4, 13, 64}) {
            const AttnOut gb = run_attention(w, q, nullptr, nullptr, 0, pps, halves, 16, true);
            worst = std::max(worst, check_attention(w, q, gb, dense_lists(w), "dense balanced"));
          }
        }
        // Sparse: random ascending subsets with sink and recent, budget 12 pages.
        const int k = 12;
        std::vector<int32_t> sel(size_t(w.B()) * w.H * k, -1), nsel(size_t(w.B()) * w.H);
        std::vector<std::vector<int32_t>> lists(size_t(w.B()) * w.H);
        for (int b = 0; b < w.B(); ++b)
          for (int h = 0; h < w.H; ++h) {
            const int n = w.seqs[b].n_pages();
            std::set<int32_t> s;
            s.insert(0);
            s.insert(n - 1);
            while (int(s.size()) < std::min(n, k)) s.insert(int32_t(rng() % uint32_t(n)));
            auto& l = lists[size_t(b) * w.H + h];
            l.assign(s.begin(), s.end());
            nsel[size_t(b) * w.H + h] = int32_t(l.size());
            std::copy(l.begin(), l.end(), sel.begin() + (size_t(b) * w.H + h) * k);
          }
        for (bool halves : {false, true}) {
          if (halves && G <= 8) continue;
          for (int pps : {1, 3, 4}) {
            const AttnOut g = run_attention(w, q, &sel, &nsel, k, pps, halves);
            worst = std::max(worst, check_attention(w, q, g, lists, "sparse"));
            if (halves) continue;
            // The splits as one cluster, merged through distributed shared memory (12, 4 and 3 CTAs;
            // sequences of fewer listed pages leave CTAs idle): the same merge arithmetic.
            const AttnOut gc = run_attention(w, q, &sel, &nsel, k, pps, false, 16, false, /*cluster_merge=*/true);
            worst = std::max(worst, check_attention(w, q, gc, lists, "sparse, cluster merge"));
            EXPECT_EQ(gc.o, g.o) << "cluster merge: same weights and sums as the last CTA's merge";
            EXPECT_EQ(gc.lse, g.lse) << "cluster merge: the same log-sum-exp";
          }
        }
        std::printf("[ attention %s d=%d G=%d ] max rel err %.2e\n", dt == lc::KvType::kF16 ? "f16" : "bf16", d, G,
                    worst);
      }
}

// Balanced dense splits on a ragged batch: one long sequence takes most of the grid, split into
// more pieces than n_splits, merged by the last CTA (up to 128 splits staged) or by the merge kernel
// (its range found from the page table); idle slots past the ranges return at once.
TEST(CudaAttention, BalancedDenseSplitsMatchCpuOnRaggedBatches) {
  SKIP_WITHOUT_CUDA();
  for (int G : {4, 7, 16}) {
    World w(128, 2, G, {16 * 300 + 7, 16 * 2, 5, 16 * 40}, lc::KvType::kBF16, 1300 + G, false);
    const auto q = w.queries(G);
    double worst = 0.0;
    // (pps, merge_kernel_above): 5 splits -> the long sequence gets 15; 38 -> 76 through the merge
    // kernel; 38 with merges in the last CTA; 101 -> 76, capped by one split per 4 pages.
    for (auto [pps, above] : {std::pair{64, 16}, {8, 16}, {8, 128}, {3, 16}}) {
      const AttnOut g = run_attention(w, q, nullptr, nullptr, 0, pps, false, above, true);
      worst = std::max(worst, check_attention(w, q, g, dense_lists(w), "dense balanced"));
    }
    std::printf("[ balanced dense G=%d ] max rel err %.2e\n", G, worst);
  }
  // More than 32 sequences: the ranges come from the page table read again per use, not from one
  // load per lane (the kernels' path up to 32 sequences).
  {
    std::vector<int> lens = {16 * 200 + 3};
    for (int i = 0; i < 39; ++i) lens.push_back(16 * (1 + i % 7) + i % 16);
    World w(64, 1, 4, lens, lc::KvType::kF16, 1500, false);
    const auto q = w.queries(4);
    for (int above : {16, 128}) {
      const AttnOut g = run_attention(w, q, nullptr, nullptr, 0, 8, false, above, true);
      check_attention(w, q, g, dense_lists(w), "dense balanced, 40 sequences");
    }
  }
  // The most splits one sequence can take (attention_max_splits(), 128): 640 pages, 128 splits of 5
  // of the 4 x 128 slots; merged by the last CTA (d 64: its staging is full) and by the merge kernel.
  World w(64, 1, 8, {16 * 640, 16 * 2, 5, 16 * 40}, lc::KvType::kF16, 1400, false);
  const auto q = w.queries(3);
  for (int above : {16, 128}) {
    const AttnOut g = run_attention(w, q, nullptr, nullptr, 0, 5, false, above, true);
    check_attention(w, q, g, dense_lists(w), "dense balanced, 128 splits");
  }
}

TEST(CudaAttention, EmptyListGivesZeroAndNegInf) {
  SKIP_WITHOUT_CUDA();
  World w(64, 1, 5, {40}, lc::KvType::kF16, 1, false);
  const auto q = w.queries(1);
  std::vector<int32_t> sel(4, 0), nsel(1, 0);
  const AttnOut g = run_attention(w, q, &sel, &nsel, 4, 4);
  check_attention(w, q, g, {{}}, "empty");
  check_attention(w, q, run_attention(w, q, &sel, &nsel, 4, 4, false, 16, false, true), {{}}, "empty, cluster merge");
  World w11(64, 1, 11, {40}, lc::KvType::kF16, 1, false);  // G > 8 as two CTAs of <= 8 heads
  const auto q11 = w11.queries(1);
  check_attention(w11, q11, run_attention(w11, q11, &sel, &nsel, 4, 4, true), {{}}, "empty, group halves");
}

// Sparse lists the launch cannot hold: longer than its splits cover (a split past the grid, a CTA
// past the cluster) or than the list buffer, or n_selected < 0. That group gets NaN and
// kStatusBadPageCount (n_selected < 0: NaN only; select_pages reports it), with the last-CTA merge
// and with the cluster merge; the other groups are exact. Invalid cluster_merge combinations are
// refused.
TEST(CudaAttention, ListsBeyondTheLaunchAreBadInput) {
  SKIP_WITHOUT_CUDA();
  World w(64, 2, 4, {16 * 20 + 3, 16 * 15}, lc::KvType::kF16, 11, false);
  const auto q = w.queries(3);
  const int k = 12, B = w.B(), H = w.H;
  std::vector<int32_t> sel(size_t(B) * H * k), nsel(size_t(B) * H, 6);
  std::vector<std::vector<int32_t>> lists(size_t(B) * H);
  for (size_t bh = 0; bh < lists.size(); ++bh) {
    for (int i = 0; i < k; ++i) sel[bh * k + i] = int32_t(i);
    lists[bh].assign(sel.begin() + bh * k, sel.begin() + bh * k + 6);
  }
  const size_t bad = 1;  // (b 0, h 1)
  const size_t per_o = size_t(w.G) * w.d;
  for (bool cluster : {false, true})
    for (int n_bad : {9, 13, -1}) {  // 9 > 2 splits x 4 pages; 13 > the buffer's 12; -1
      auto nb = nsel;
      nb[bad] = n_bad;
      uint32_t status = 0;
      const AttnOut g = run_attention(w, q, &sel, &nb, k, 4, false, 16, false, cluster, /*n_splits=*/2, &status);
      const std::string what = std::string(cluster ? "cluster merge" : "last-CTA merge") + ", n_selected " +
                               std::to_string(n_bad);
      EXPECT_EQ(status, n_bad < 0 ? 0u : uint32_t(lc::kStatusBadPageCount)) << what;
      for (size_t i = bad * per_o; i < (bad + 1) * per_o; ++i) ASSERT_TRUE(std::isnan(g.o[i])) << what;
      for (int r = 0; r < w.G; ++r) ASSERT_TRUE(std::isnan(g.lse[bad * w.G + r])) << what;
      AttnOut others = g;
      auto ref_lists = lists;
      ref_lists[bad].clear();  // compared as an empty list below: put its expected values in place
      for (size_t i = bad * per_o; i < (bad + 1) * per_o; ++i) others.o[i] = 0.0f;
      for (int r = 0; r < w.G; ++r) others.lse[bad * w.G + r] = -INFINITY;
      check_attention(w, q, others, ref_lists, what.c_str());
    }

  // Refused before any launch.
  lc::AttentionParams p;
  Dev<float> dq(q), d_o(q.size());
  Dev<int32_t> dsel(sel), dn(nsel);
  p.q = dq.p;
  p.kv = w.view();
  p.group = w.G;
  p.scale = 0.125f;
  p.o = d_o.p;
  p.pages_per_split = 4;
  p.n_splits = 4;
  p.cluster_merge = true;
  EXPECT_EQ(lc::paged_decode_attention(p, nullptr), cudaErrorInvalidValue) << "cluster merge without a list";
  p.selected = dsel.p;
  p.n_selected = dn.p;
  p.selected_stride = k;
  p.n_splits = 17;
  EXPECT_EQ(lc::paged_decode_attention(p, nullptr), cudaErrorInvalidValue) << "a cluster of 17 CTAs";
  World w11(64, 1, 11, {40}, lc::KvType::kF16, 1, false);
  p.kv = w11.view();
  p.group = 11;
  p.n_splits = 4;
  p.group_halves = true;
  EXPECT_EQ(lc::paged_decode_attention(p, nullptr), cudaErrorInvalidValue) << "group halves in a cluster";
  cudaGetLastError();
}

// The whole LOCKS step through the plan (GPU-built summaries), eager and from a CUDA graph.
// expect_defer: the plan must leave the lse_total merge to select_pages (>= 32 score chunks).
// cluster: leave the plan's sparse cluster merge and one-kernel select as they are (false: turn both off).
// select_pages_per_cta: run the one-kernel select, started per pair, with this many pages per CTA
// (more clusters than fit at once: the later ones wait for resources, not for each other).
void run_step_test(World& w, int budget_pages, const char* what, bool expect_defer = false, bool balance = true,
                   bool cluster = true, int select_pages_per_cta = 0) {
  const auto q = w.queries(77);
  // GPU summaries of every full page.
  const std::vector<int32_t> pages = w.full_pages();
  Dev<uint8_t> drec(size_t(w.H) * w.cfg.n_pages * lc::summary_record_bytes(w.d));
  Dev<int32_t> dpages(pages.empty() ? std::vector<int32_t>{0} : pages);
  ck(lc::summary_build(w.build_params(dpages, int(pages.size()), drec.p), nullptr), "summary_build");

  lc::DecodePlan plan = lc::make_decode_plan(w.decode_shape(budget_pages), -1, balance);
  if (!cluster) plan.sparse_cluster_merge = false, plan.select_cluster_pages = 0;
  if (select_pages_per_cta) {
    ASSERT_TRUE(lc::select_per_pair(plan)) << what;
    plan.select_cluster_pages = select_pages_per_cta;
  }
  EXPECT_EQ(plan.defer_lse_total, plan.score_equal_chunks >= 32);
  EXPECT_EQ(plan.score_balance, balance);
  EXPECT_EQ(plan.dense_balance, balance);
  if (balance) {
    EXPECT_GE(plan.score_chunks, plan.score_equal_chunks);  // balanced chunks: capacity
  } else {
    EXPECT_EQ(plan.score_chunks, plan.score_equal_chunks);
  }
  if (expect_defer) {
    ASSERT_TRUE(plan.defer_lse_total) << what << ": " << plan.score_equal_chunks << " score chunks";
  }
  Dev<uint8_t> ws(plan.workspace_bytes);
  ck(lc::init_decode_workspace(plan, ws.p, nullptr), "init workspace");
  Dev<float> dq(q), d_o(q.size()), dl(size_t(w.B()) * w.H * w.G);
  lc::DecodeStepParams sp;
  sp.q = dq.p;
  sp.kv = w.view();
  sp.summaries = drec.p;
  sp.n_pages_pool = w.cfg.n_pages;
  sp.scale = 1.0f / std::sqrt(float(w.d));
  sp.o = d_o.p;
  sp.lse = dl.p;
  sp.workspace = ws.p;
  ck(lc::locks_decode_step(plan, sp, nullptr), "locks_decode_step");
  dev_sync();
  const auto o1 = d_o.down();
  std::vector<float> glm(size_t(w.B()) * w.H * w.G * plan.log_mass_stride);
  ck(cudaMemcpy(glm.data(), lc::plan_log_mass(plan, ws.p), glm.size() * 4, cudaMemcpyDeviceToHost), "lm");
  std::vector<int32_t> sel(size_t(w.B()) * w.H * budget_pages), nsel(size_t(w.B()) * w.H);
  ck(cudaMemcpy(sel.data(), lc::plan_selected(plan, ws.p), sel.size() * 4, cudaMemcpyDeviceToHost), "sel");
  ck(cudaMemcpy(nsel.data(), lc::plan_n_selected(plan, ws.p), nsel.size() * 4, cudaMemcpyDeviceToHost), "nsel");

  // (1) The selected set vs the CPU LOCKS selector (CPU-built summaries): captured share mass.
  Summaries ref(w);
  const auto clm = cpu_log_mass(w, ref.store, q, plan.log_mass_stride);
  double worst_mass = 0.0;
  for (int b = 0; b < w.B(); ++b)
    for (int h = 0; h < w.H; ++h) {
      const int n = w.seqs[b].n_pages();
      const size_t bh = size_t(b) * w.H + h;
      std::vector<float> lmc(size_t(w.G) * n);
      for (int g = 0; g < w.G; ++g)
        for (int j = 0; j < n; ++j) lmc[size_t(g) * n + j] = clm[(bh * w.G + g) * plan.log_mass_stride + j];
      std::vector<int32_t> cpu_sel;
      std::vector<float> score;
      select_top_pages(lmc.data(), w.G, n, budget_pages, GroupRule::kShareAverage, cpu_sel, &score);
      ASSERT_EQ(nsel[bh], int(cpu_sel.size()));
      double mg = 0.0, mc = 0.0;
      for (int i = 0; i < nsel[bh]; ++i) mg += score[sel[bh * budget_pages + i]];
      for (int32_t j : cpu_sel) mc += score[j];
      worst_mass = std::max(worst_mass, mc - mg);
      EXPECT_GE(mg, mc - 2e-2) << what << ": GPU set captures less CPU share mass, b " << b << " h " << h;
    }
  // (2) The output equals exact attention over the GPU's selected pages.
  std::vector<std::vector<int32_t>> lists(size_t(w.B()) * w.H);
  for (size_t bh = 0; bh < lists.size(); ++bh)
    lists[bh].assign(sel.begin() + bh * budget_pages, sel.begin() + bh * budget_pages + nsel[bh]);
  const double rel = check_attention(w, q, {o1, dl.down()}, lists, what);
  std::printf(
      "[ step %s ] captured-mass shortfall vs CPU max %.2e, output rel err max %.2e, plan: score chunk %d, "
      "sparse %d x %d pages%s, select %s\n",
      what, worst_mass, rel, plan.score_chunk_pages, plan.sparse_splits, plan.sparse_pages_per_split,
      plan.sparse_cluster_merge ? " (one cluster each)" : "",
      plan.select_cluster_pages ? ("one kernel, " + std::to_string(plan.select_cluster_pages) + " pages per CTA" +
                                   (lc::select_per_pair(plan) ? ", per pair" : ""))
                                      .c_str()
                                : "two kernels");

  // (3) CUDA graph: capture once, replay with new queries; equals the eager step.
  cudaStream_t st;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ck(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "begin capture");
  ck(lc::locks_decode_step(plan, sp, st), "capture step");
  ck(cudaStreamEndCapture(st, &graph), "end capture");
  ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  const auto q2 = w.queries(78);
  for (int rep = 0; rep < 2; ++rep) {
    dq.up(rep == 0 ? q2 : q);
    ck(cudaGraphLaunch(exec, st), "graph launch");
    ck(cudaStreamSynchronize(st), "graph run");
  }
  const auto o2 = d_o.down();
  EXPECT_EQ(o1, o2) << what << ": graph replay must reproduce the eager step exactly";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);

  // (4) Dense step vs CPU dense.
  ck(lc::dense_decode_step(plan, sp, nullptr), "dense step");
  dev_sync();
  const double rel_d = check_attention(w, q, {d_o.down(), dl.down()}, dense_lists(w), "dense step");
  std::printf("[ step %s ] dense rel err max %.2e, plan: %d x %d pages\n", what, rel_d, plan.dense_splits,
              plan.dense_pages_per_split);
}

TEST(CudaDecodeStep, LocksStepMatchesCpuRandomPages) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128})
    for (int G : {4, 6, 16}) {
      World w(d, 2, G, {16 * 300 + 7, 16 * 90, 16 * 20 + 1}, lc::KvType::kF16, 500 + d + G);
      run_step_test(w, 32, "random");
      if (d == 128 && G != 6) run_step_test(w, 32, "random, no balancing", false, /*balance=*/false);
      if (G != 16 || d == 64) run_step_test(w, 32, "random, no clusters", false, true, /*cluster=*/false);
    }
  // A long sequence at batch 2: >= 32 score chunks, so the share kernel merges lse_total.
  for (int G : {4, 16}) {
    World w(128, 2, G, {16 * 1100 + 7, 16 * 40}, lc::KvType::kF16, 700 + G, false);
    run_step_test(w, 32, "random, deferred merge", /*expect_defer=*/true);
    run_step_test(w, 32, "random, deferred merge, no clusters", /*expect_defer=*/true, true, /*cluster=*/false);
  }
}

// The select started per (sequence, KV head) as the score pass completes it (select_per_pair(plan)),
// with 80 pairs of 3-CTA clusters of 1024 threads: more CTAs than SMs, so several
// waves of them. No cluster may wait on one that is not yet resident; the results must equal the CPU's.
// Sequence 3 is empty (its pairs are published by the score pass's item 0 alone).
TEST(CudaDecodeStep, PerPairSelectInSeveralWaves) {
  SKIP_WITHOUT_CUDA();
  std::vector<int> lens;
  for (int i = 0; i < 40; ++i) lens.push_back(i == 3 ? 0 : 16 * (30 + (i * 7) % 50) + i % 16);
  World w(128, 2, 4, lens, lc::KvType::kF16, 4242, false);
  run_step_test(w, 8, "per pair, several waves", false, true, true, /*select_pages_per_cta=*/32);
}

// Bad device-side page tables (kernels.h): the bad sequence (the last) gets NaN outputs and a status
// bit, nothing is read or written out of bounds (memcheck runs this test), and the other sequences'
// outputs are bit-identical to a run on the clean table (dense with a bad page count: equal up to
// summation order, since balanced splits follow the batch's page counts).
TEST(CudaDecodeStep, BadPageTablesGiveNaNAndStatusOthersUnaffected) {
  SKIP_WITHOUT_CUDA();
  // The second table has a 1040-page sequence: on the H200 that makes 33 score chunks per (sequence,
  // KV head) for G 4 and 16, so the plan leaves the lse_total merge to the share kernel, and bad
  // input must reach the output through it (the log line says which path ran).
  for (int first_len : {16 * 40 + 5, 16 * 1040 + 5})
    for (int G : {4, 16}) {
      World w(128, 2, G, {first_len, 16 * 30, 16 * 50 + 3, 16 * 20 + 9}, lc::KvType::kBF16, 900 + G, first_len < 1000);
      const int B = w.B(), last = B - 1, pool = w.cfg.n_pages;
      const auto q = w.queries(5);
      Dev<uint8_t> drec(size_t(w.H) * pool * lc::summary_record_bytes(w.d));
      Dev<uint32_t> dstatus(1);
      dstatus.fill_bytes(0);
      {  // summary_build skips page ids outside the pool and says so; the other records are built
        std::vector<int32_t> with_bad = w.full_pages();
        with_bad.insert(with_bad.begin() + 3, pool + 5);
        with_bad.push_back(-2);
        Dev<int32_t> dpages(with_bad);
        lc::SummaryBuildParams bp = w.build_params(dpages, int(with_bad.size()), drec.p);
        bp.status = dstatus.p;
        ck(lc::summary_build(bp, nullptr), "summary_build");
        dev_sync();
        EXPECT_EQ(dstatus.down()[0], uint32_t(lc::kStatusBadPageId));
      }

      // Balanced grids (the default) and a plan without run-time balancing (batch-invariant: the other
      // sequences stay bit-identical in every case, bad page counts included).
      // Budget 8 pages: one sparse split; 32 (balanced only, LOCKS only): four, merged inside a
      // cluster where the plan uses one (G 4 on the H200).
      for (auto [budget, balance] : {std::pair{8, true}, {8, false}, {32, true}}) {
        const lc::DecodePlan plan = lc::make_decode_plan(w.decode_shape(budget), -1, balance);
        ASSERT_EQ(plan.defer_lse_total, plan.score_equal_chunks >= 32) << plan.score_equal_chunks << " score chunks";
        Dev<uint8_t> ws(plan.workspace_bytes);
        ck(lc::init_decode_workspace(plan, ws.p, nullptr), "init workspace");
        Dev<float> dq(q), d_o(q.size()), dl(size_t(B) * w.H * w.G);
        const size_t per_seq_o = size_t(w.H) * w.G * w.d, per_seq_l = size_t(w.H) * w.G;

        // Runs the LOCKS step (or the dense step) on a page table; returns (o, lse, status).
        auto step = [&](const std::vector<int32_t>& indptr, const std::vector<int32_t>& indices,
                        const std::vector<int32_t>& last_len, bool dense) {
          Dev<int32_t> di(indptr), dx(indices), dlast(last_len);
          lc::DecodeStepParams sp;
          sp.q = dq.p;
          sp.kv = w.view();
          sp.kv.indptr = di.p;
          sp.kv.indices = dx.p;
          sp.kv.last_page_len = dlast.p;
          sp.summaries = drec.p;
          sp.n_pages_pool = pool;
          sp.scale = 1.0f / std::sqrt(float(w.d));
          sp.o = d_o.p;
          sp.lse = dl.p;
          sp.workspace = ws.p;
          d_o.fill_bytes(0x7f);  // stale garbage where a kernel fails to write
          ck(dense ? lc::dense_decode_step(plan, sp, nullptr) : lc::locks_decode_step(plan, sp, nullptr), "step");
          uint32_t status = 0;
          ck(lc::read_decode_status(plan, ws.p, &status, /*clear=*/true, nullptr), "status");
          return std::make_tuple(d_o.down(), dl.down(), status);
        };
        for (bool dense : {false, true}) {
          if (budget != 8 && dense) continue;  // (the dense step does not depend on the budget)
          const auto [o_ref, l_ref, st_ref] = step(w.indptr, w.indices, w.last_len, dense);
          ASSERT_EQ(st_ref, 0u) << "clean table";
          for (float x : o_ref) ASSERT_TRUE(std::isfinite(x));

          struct Case {
            const char* what;
            uint32_t bit;
            std::vector<int32_t> indptr, indices, last_len;
          };
          std::vector<Case> cases;
          const int beg = w.indptr[last], n_last = w.indptr[last + 1] - beg;
          {  // more pages than the launch covers (beyond max_pages and its rounding; the extra ids are valid)
            Case c{"too many pages", lc::kStatusBadPageCount, w.indptr, w.indices, w.last_len};
            for (int e = 0; e < 2 * w.max_pages + 8 - n_last; ++e) c.indices.push_back(w.indices[beg + e % n_last]);
            c.indptr[last + 1] = int32_t(c.indices.size());
            cases.push_back(c);
          }
          {
            Case c{"descending indptr", lc::kStatusBadPageCount, w.indptr, w.indices, w.last_len};
            c.indptr[last + 1] = c.indptr[last] - 1;
            cases.push_back(c);
          }
          for (int len : {0, 17, -3}) {
            Case c{"last_page_len out of range", lc::kStatusBadLastPageLen, w.indptr, w.indices, w.last_len};
            c.last_len[last] = len;
            cases.push_back(c);
          }
          for (int pos : {0, n_last / 2, n_last - 1})  // sink, middle, the partial recent page
            for (int32_t id : {pool, pool + 1000, -1, INT32_MIN}) {
              Case c{"page id outside the pool", lc::kStatusBadPageId, w.indptr, w.indices, w.last_len};
              c.indices[beg + pos] = id;
              cases.push_back(c);
            }
          for (const Case& c : cases) {
            const auto [o, l, st] = step(c.indptr, c.indices, c.last_len, dense);
            const std::string what = std::string(dense ? "dense: " : "locks: ") + c.what;
            EXPECT_EQ(st, c.bit) << what << " -> " << lc::describe_decode_status(st);
            // Balanced dense splits follow the batch's page counts, so a bad count moves the others'
            // split boundaries: the same values up to summation order. Otherwise bit-identical.
            const bool regrouped = dense && plan.dense_balance && c.bit == lc::kStatusBadPageCount;
            auto same = [&](float x, float ref) {
              return regrouped ? std::fabs(x - ref) <= 1e-5f * (1.0f + std::fabs(ref)) : std::memcmp(&x, &ref, 4) == 0;
            };
            for (size_t i = 0; i < size_t(last) * per_seq_o; ++i)
              ASSERT_TRUE(same(o[i], o_ref[i])) << what << ": another sequence's output changed at " << i;
            for (size_t i = 0; i < size_t(last) * per_seq_l; ++i)
              ASSERT_TRUE(same(l[i], l_ref[i])) << what << ": another sequence's lse changed at " << i;
            for (size_t i = size_t(last) * per_seq_o; i < o.size(); ++i)
              ASSERT_TRUE(std::isnan(o[i]))
                  << what << ": the bad sequence's o must be NaN, at " << i << " it is " << o[i];
            for (size_t i = size_t(last) * per_seq_l; i < l.size(); ++i)
              ASSERT_TRUE(std::isnan(l[i])) << what << ": the bad sequence's lse must be NaN";
          }
          // A clean step after the bad ones: the self-cleaning counters and histograms are intact.
          const auto [o2, l2, st2] = step(w.indptr, w.indices, w.last_len, dense);
          EXPECT_EQ(st2, 0u);
          EXPECT_EQ(std::memcmp(o2.data(), o_ref.data(), o2.size() * 4), 0) << "a clean step after bad ones";
          std::printf("[ bad input G=%d %s%s%s%s ] %zu cases: NaN for the bad sequence, others unaffected\n", G,
                      dense ? "dense" : "locks", plan.defer_lse_total ? " deferred merge" : "",
                      balance ? "" : ", no balancing", !dense && plan.sparse_cluster_merge ? ", cluster merge" : "",
                      cases.size());
        }
      }
    }
}

TEST(CudaDecodeStep, LocksStepMatchesCpuOnRealModelKeys) {
  SKIP_WITHOUT_CUDA();
  const Session& s = real_session();
  const int G = reference_model().hp.n_group();
  for (int il : {0, 3, 7}) {
    World w(s.cache(), s.sequence(), il, G);
    // Summaries and scores on real keys.
    Summaries ref(w);
    const auto q = w.queries(il);
    const ScoreOut g = run_score(w, ref.records, q, 32);
    const auto clm = cpu_log_mass(w, ref.store, q, g.stride);
    const double worst = check_scores(w, g, clm, "real keys score");
    std::printf("[ real keys layer %d ] %d pages, max |score gpu - cpu| = %.2e\n", il, w.max_pages, worst);
    run_step_test(w, 16, "real keys");
  }
}

#else  // !LOCKS_WITH_CUDA

TEST(CudaBuild, NotBuiltWithCuda) { GTEST_SKIP() << "built without CUDA (no CUDA compiler found at configure time)"; }

#endif
