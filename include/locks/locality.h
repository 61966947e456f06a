// The paper's locality finding: how much of the within-page key energy a rank-r basis captures
// when the basis is fit per page (LOCKS), per sequence (ShadowKV's scope) or once globally
// (Loki's scope). Per (layer, KV head) and full page j with keys k_i and mean mu_j:
//   energy       E_j = sum_i ||k_i - mu_j||^2
//   page-local   sum of the top-r eigenvalues of the page's centered Gram matrix (Algorithm 1's
//                sigma^2; the best any rank-r basis can do for that page, Eckart-Young)
//   sequence     sum_i ||P_seq,r (k_i - mu_j)||^2, P_seq,r the projector onto the top-r PCA
//                directions of all the sequence's keys of that (layer, head)
//   global       the same with the first r rows of a calibrated GlobalBasis
// Pages are always centered by their own mean, as the shared-basis selectors store a per-page
// centroid; only the directions are shared.
#pragma once

#include <cstdint>
#include <vector>

#include "locks/kv_cache.h"
#include "locks/shared_basis.h"

namespace locks {

struct LocalityResult {
  std::vector<int> ranks;
  /// Captured fraction per rank: (sum of captured energy) / (sum of energy) over all full pages,
  /// layers and KV heads. 1 when the pages hold no energy at all (every key equals its page mean).
  std::vector<double> page_local, sequence;
  /// Empty when no global basis was given; NaN at ranks beyond the basis's rank.
  std::vector<double> global;
  int64_t n_pages = 0;  // full pages measured, summed over layers and KV heads
  double energy = 0;    // total within-page energy (the denominator)
};

/// Measure the locality finding on the full pages of `seq` (seq.n_tokens / B of them) in every
/// layer and KV head of `cache`. Each rank must lie in [1, head_dim]; page-local ranks at or beyond
/// B capture everything (fraction 1: a page of B keys has at most B - 1 centered directions).
/// The sequence PCA is fit once per (layer, head) at the largest rank, on all n_tokens keys of the
/// sequence (partial last page included, as calibrate_global_basis does).
/// Throws std::invalid_argument for an empty rank list, a rank out of range, a sequence without a
/// full page, or a global basis whose layer / head / head_dim shape does not match the cache.
/// Parallel (OpenMP) over (layer, KV head); the result does not depend on the thread count.
LocalityResult measure_locality(const PagedKvCache& cache, const KvSequence& seq, const std::vector<int>& ranks,
                                const GlobalBasis* global = nullptr);

/// Mean over several measurements (same rank list) of the fractions at rank index k: page-local,
/// sequence, global (NaN when any measurement has no global basis). `results` must not be empty.
struct LocalityMean {
  double page_local, sequence, global;
};
LocalityMean mean_locality(const std::vector<LocalityResult>& results, size_t k);

}  // namespace locks
