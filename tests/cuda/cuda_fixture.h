// Fixtures of the CUDA kernel tests (tests/cuda/test_cuda_*.cpp, one file per kernel), which hold
// each kernel against its CPU twin (test-backend-ops style): a paged cache of random pages with
// realistic spectra, degenerate pages, or real keys from the reference model, in host and device
// memory; the CPU summaries and their device records; the score pass and its CPU log-mass; attention
// checked against paged_decode_attention. Every device test skips when no usable CUDA device is
// present. Included only where LOCKS_WITH_CUDA is defined.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "locks/cuda/kernels.h"
#include "locks/kv_cache.h"
#include "locks/page_summary.h"

#define SKIP_WITHOUT_CUDA()                                            \
  do {                                                                 \
    std::string why_;                                                  \
    if (!::locks::cuda::device_available(&why_)) GTEST_SKIP() << why_; \
  } while (0)

namespace locks::test {

namespace lc = locks::cuda;

inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// A device array of n T (at least one element allocated), freed on destruction.
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

inline void dev_sync() { ck(cudaDeviceSynchronize(), "kernel"); }

uint16_t bf16_bits(float x);  // x must already be bf16-representable
float round_bf16(float x);    // to the nearest bf16, ties to even

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

  /// Random keys and values, one sequence per entry of `lens` (tokens); special_pages: some pages
  /// all zero, all one key, or of rank 2.
  World(int d_, int H_, int G_, std::vector<int> lens, lc::KvType t, uint64_t seed, bool special_pages = true);
  /// From an existing cache (real model keys): one layer `il`, one sequence.
  World(const PagedKvCache& src, const KvSequence& seq, int il, int G_);

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
  std::vector<int32_t> full_pages() const;
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
  std::vector<float> queries(uint64_t seed) const;

 private:
  void finish();  // page table, device copy (rows past a sequence's end poisoned)
};

/// CPU summaries (the reference store) and the same summaries packed for the device.
struct Summaries {
  PageSummaryStore store;
  std::vector<uint8_t> records;
  std::vector<float> tails;
  explicit Summaries(const World& w);
};

/// CPU log-mass [B][H][G][stride] as the CPU LOCKS selector computes it.
std::vector<float> cpu_log_mass(const World& w, const PageSummaryStore& st, const std::vector<float>& q, int stride);

/// log(sum_i exp(x[i])) in float64; -inf for no terms.
double lse_of(const float* x, int n);

struct ScoreOut {
  std::vector<float> log_mass, lse_total, chunk_stats;
  int stride = 0, n_chunks = 0;
};

// defer: ScoreParams::defer_lse_total (lse_total left to select_pages; chunk_stats returned).
// balance: chunks sized from the page table at run time (ScoreParams::balance_chunks) with a
// capacity of one chunk per 32 pages of the longest sequence plus 5 (so that statistics past a
// sequence's chunks, and with one sequence empty items, occur); chunk_pages is then unused.
ScoreOut run_score(const World& w, const std::vector<uint8_t>& records, const std::vector<float>& q, int chunk_pages,
                   int grid = 0, bool defer = false, bool balance = false);

// Compare GPU and CPU log-mass of every page; returns the max abs error.
// Tolerance per page: 1e-3 + 1e-4 |s| + range_rel * (largest |s| of the head's row). q enters the
// tensor cores with 16 bits of max|q| (two int8 limbs), so the absolute error grows with the logit
// scale of the whole row, not with the page's own value; range_rel covers that for extreme scales.
double check_scores(const World& w, const ScoreOut& g, const std::vector<float>& ref, const char* what,
                    double range_rel = 0.0);

struct AttnOut {
  std::vector<float> o, lse;
};

// GPU output vs CPU paged_decode_attention over the same page lists; returns max relative error.
double check_attention(const World& w, const std::vector<float>& q, const AttnOut& g,
                       const std::vector<std::vector<int32_t>>& lists, const char* what);

/// Every page of every sequence, for each (b, h).
std::vector<std::vector<int32_t>> dense_lists(const World& w);

}  // namespace locks::test
