// paged_decode_attention on the device against the CPU's paged_decode_attention (relative error
// < 1e-3): dense and sparse lists, f16 and bf16, split merges, empty lists, lists beyond the launch.
#include <gtest/gtest.h>

#ifdef LOCKS_WITH_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cuda_fixture.h"

using namespace locks;
using namespace locks::test;

namespace {

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

}  // namespace

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
      const std::string what =
          std::string(cluster ? "cluster merge" : "last-CTA merge") + ", n_selected " + std::to_string(n_bad);
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

#endif  // LOCKS_WITH_CUDA
