// select_pages (Algorithm 2's top-k on the device) against select_top_pages: by captured share
// mass, exactly on ties, every way of running it (candidate lists, one kernel), and the merge of the
// score pass's deferred statistics.
#include <gtest/gtest.h>

#ifdef LOCKS_WITH_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_fixture.h"
#include "locks/selector.h"

using namespace locks;
using namespace locks::test;

namespace {

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
        EXPECT_EQ(all.sel[size_t(bh) * k + i], o.sel[size_t(bh) * k + i])
            << how << ": (b, h) " << bh << " position " << i;
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

}  // namespace

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

#endif  // LOCKS_WITH_CUDA
