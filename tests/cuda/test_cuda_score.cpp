// score_pages (Eq. 4 on the device) against PageSummaryStore::score and exact_log_mass: every
// group size, balanced chunks, long items, many chunks, extreme logits.
#include <gtest/gtest.h>

#ifdef LOCKS_WITH_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda_fixture.h"

using namespace locks;
using namespace locks::test;

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
// Sequence lengths are not multiples of 8 pages (partial last octets). A race on a slot would likely
// not show under even memory latency: this exercises the ring, it does not detect races.
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

#endif  // LOCKS_WITH_CUDA
