// Google Benchmark micro-benchmarks of the CPU kernels, per page: Algorithm 1 (summary build),
// Eq. 4 (score from a stored summary, whole GQA group), exact decode attention. For kernel work;
// the side-by-side speedups users read come from `locks bench` (dense vs LOCKS in one run).
//   ./build/bin/bench_cpu_kernels [--benchmark_filter=Score]
#include <benchmark/benchmark.h>

#include <numeric>
#include <random>
#include <vector>

#include "locks/attention.h"
#include "locks/kv_cache.h"
#include "locks/page_summary.h"
#include "locks/selector.h"

namespace {

std::vector<float> gaussian(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = N(rng);
  return v;
}

// One page of 16 keys, head_dim d: build_page_summary (float64 Jacobi, rank 8).
void BM_SummaryBuild(benchmark::State& state) {
  const int d = int(state.range(0));
  const auto keys = gaussian(size_t(16) * d, 1);
  for (auto _ : state) benchmark::DoNotOptimize(locks::build_page_summary(keys.data(), 16, d, 8));
  state.SetItemsProcessed(state.iterations());  // pages
}
BENCHMARK(BM_SummaryBuild)->Arg(64)->Arg(128);

// n_pages random pages in the shipped format, stored with their keys.
locks::PageSummaryStore random_store(int d, int n_pages) {
  const locks::SummaryFormat fmt;
  locks::PageSummaryStore store(fmt, 1, 1, n_pages, 16, d);
  for (int p = 0; p < n_pages; ++p) {
    const auto keys = gaussian(size_t(16) * d, uint32_t(p + 2));
    store.store(0, 0, p, locks::build_page_summary(keys.data(), 16, d, fmt.rank), keys.data());
  }
  return store;
}

// Eq. 4 over 4096 stored pages for a GQA group of G = 4 (the shipped int4/int8 format).
void BM_ScorePages(benchmark::State& state) {
  const int d = int(state.range(0)), G = 4, n_pages = 4096;
  const locks::PageSummaryStore store = random_store(d, n_pages);
  const auto q = gaussian(size_t(G) * d, 9);
  std::vector<float> out(G);
  for (auto _ : state)
    for (int p = 0; p < n_pages; ++p) {
      store.score(0, 0, p, q.data(), G, 0.125f, out.data());
      benchmark::DoNotOptimize(out.data());
    }
  state.SetItemsProcessed(state.iterations() * n_pages);
  state.SetBytesProcessed(state.iterations() * n_pages * int64_t(store.summary_bytes()));
}
BENCHMARK(BM_ScorePages)->Arg(64)->Arg(128);

// The streamed score pass (score_pages) over the same 4096 pages, per kernel: 0 portable, 1 AVX2,
// 2 AVX-512 VNNI (skipped where the CPU lacks it).
void BM_ScorePass(benchmark::State& state) {
  const int d = int(state.range(0)), G = 4, n_pages = int(state.range(2));
  const locks::ScoreKernel kernels[] = {locks::ScoreKernel::kPortable, locks::ScoreKernel::kAvx2,
                                        locks::ScoreKernel::kAvx512Vnni};
  const locks::ScoreKernel kernel = kernels[state.range(1)];
  if (!locks::score_kernel_supported(kernel)) {
    state.SkipWithError("this CPU does not run the kernel");
    return;
  }
  state.SetLabel(locks::score_kernel_name(kernel));
  const locks::PageSummaryStore store = random_store(d, n_pages);
  const auto q = gaussian(size_t(G) * d, 9);
  std::vector<int32_t> pages(n_pages);
  std::iota(pages.begin(), pages.end(), 0);
  std::vector<float> out(size_t(G) * n_pages);
  for (auto _ : state) {
    store.score_pages(0, 0, pages, q.data(), G, 0.125f, out.data(), size_t(n_pages), nullptr, kernel);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * n_pages);
  state.SetBytesProcessed(state.iterations() * n_pages * int64_t(store.summary_bytes()));
}
BENCHMARK(BM_ScorePass)->ArgsProduct({{64, 128}, {0, 1, 2}, {4096, 16384}});

// Alg. 2 lines 6-9 for a G = 4 group over 1020 pages (16K tokens), budget 32 pages.
void BM_SelectTopPages(benchmark::State& state) {
  const int G = 4, n_pages = 1020;
  auto lm = gaussian(size_t(G) * n_pages, 4);
  for (float& v : lm) v *= 3.0f;
  std::vector<int32_t> out;
  for (auto _ : state) {
    locks::select_top_pages(lm.data(), G, n_pages, 32, locks::GroupRule::kShareAverage, out);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * n_pages);
}
BENCHMARK(BM_SelectTopPages);

// The certified error bounds of a G = 4 group over the same pages (log_mass_error_bounds), the
// extra work of `locks/cert=P` over the score pass.
void BM_ErrorBounds(benchmark::State& state) {
  const int d = int(state.range(0)), G = 4, n_pages = 4096;
  const locks::PageSummaryStore store = random_store(d, n_pages);
  const auto q = gaussian(size_t(G) * d, 9);
  std::vector<int32_t> pages(n_pages);
  std::iota(pages.begin(), pages.end(), 0);
  std::vector<float> out(size_t(G) * n_pages);
  for (auto _ : state) {
    store.log_mass_error_bounds(0, 0, pages, q.data(), G, 0.125f, out.data(), size_t(n_pages));
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * n_pages);
}
BENCHMARK(BM_ErrorBounds)->Arg(64)->Arg(128);

// Alg. 2 with an adaptive k (top-p, and certified with bounds of 0.3 nats) over 1020 pages.
void BM_SelectByMass(benchmark::State& state) {
  const int G = 4, n_pages = 1020;
  auto lm = gaussian(size_t(G) * n_pages, 4);
  for (float& v : lm) v *= 3.0f;
  const std::vector<float> bound(lm.size(), 0.3f);
  std::vector<int32_t> out;
  for (auto _ : state) {
    locks::select_pages_by_mass(lm.data(), state.range(0) ? bound.data() : nullptr, G, n_pages, 2, 64, 0.9, out);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * n_pages);
}
BENCHMARK(BM_SelectByMass)->Arg(0)->Arg(1);

// Exact decode attention of a G = 4 group over 1024 f16 pages.
void BM_DecodeAttention(benchmark::State& state) {
  const int d = int(state.range(0)), G = 4, T = 16 * 1024;
  locks::KvCacheConfig cfg;
  cfg.head_dim = d;
  cfg.n_pages = T / 16;
  locks::PagedKvCache cache(cfg);
  locks::KvSequence seq;
  cache.append_tokens(seq, T);
  for (int t = 0; t < T; ++t) {
    const auto kv = gaussian(size_t(2) * d, uint32_t(t));
    cache.write(0, seq, t, kv.data(), kv.data() + d);
  }
  std::vector<int32_t> pages(seq.n_pages());
  std::iota(pages.begin(), pages.end(), 0);
  const auto q = gaussian(size_t(G) * d, 3);
  std::vector<float> o(size_t(G) * d);
  for (auto _ : state) {
    locks::paged_decode_attention(cache, 0, 0, seq, pages, q.data(), G, 0.125f, o.data(), nullptr);
    benchmark::DoNotOptimize(o.data());
  }
  state.SetItemsProcessed(state.iterations() * int64_t(pages.size()));
  state.SetBytesProcessed(state.iterations() * int64_t(pages.size()) * int64_t(cache.kv_bytes(16)));
}
BENCHMARK(BM_DecodeAttention)->Arg(64)->Arg(128);

}  // namespace

BENCHMARK_MAIN();
