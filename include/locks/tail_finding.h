// Which pages carry the heavy tail of the quantized summary's error? At real decode steps, the
// error |s_hat_j(q) - s_j(q)| of Eq. 4 on the stored (quantized) summary of every full page, per
// (layer, KV head, page), beside what is known of the page when its summary is built:
//   norm_range  max_i ||k_i|| / min_i ||k_i||   (key-norm dynamic range; +inf for a zero key)
//   gap         sigma_r / sigma_{r+1}           (spectral gap at the summary's rank; NaN without sigma_{r+1})
//   tail_frac   tau_{j,r} / sum_k sigma_k^2      (energy the rank-r basis leaves out; 0 for no energy)
//   resid       max_i ||k_i - k_hat_i||          (the stored form's own residual, the certified bound's)
//   position    page index / (pages - 1)
// summarize_tails answers whether the tail is predictable: per (layer, KV head), each property's
// Spearman correlation with the error and its precision at the top decile (of the 10% of pages the
// property ranks highest, the fraction in the 10% of largest errors; 0.1 by chance).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "locks/page_summary.h"
#include "locks/session.h"

namespace locks {

/// One (layer, KV head, full page): its mean and max error over the observed queries (nats) and its
/// build-time properties (above).
struct TailPage {
  int layer = 0, kv_head = 0, page = 0;
  int64_t queries = 0;
  double err_mean = 0, err_max = 0;
  double norm_range = 0, gap = 0, tail_frac = 0, resid = 0, position = 0;
};

/// The properties in the order the report lists them, and their names.
constexpr int kTailProperties = 5;
std::array<double, kTailProperties> tail_properties(const TailPage& p);
const std::array<const char*, kTailProperties>& tail_property_names();  // "norm_range", ..., "position"

/// A DecodeObserver (attach it to a full-attention session) that scores every page that was full
/// when it was made, with the summary format `fmt`, against exact log-mass at each observed step.
class TailProbe final : public DecodeObserver {
 public:
  /// Builds and stores the summary of every full page of `seq` (every layer and KV head) and its
  /// properties. Throws std::invalid_argument for a format refused for this cache's page size and
  /// head_dim, or a sequence without a full page.
  TailProbe(const PagedKvCache& cache, const KvSequence& seq, const SummaryFormat& fmt);
  void observe(const PagedKvCache& cache, const KvSequence& seq, const Selector& selector, int il, int kv_head,
               const float* q, int n_group, int budget_pages, const Selection& sel) override;
  /// Every (layer, KV head, page) in that order, errors averaged over what was observed.
  std::vector<TailPage> pages() const;

 private:
  int n_head_kv_ = 0, n_pages_ = 0;
  std::vector<int32_t> page_ids_;  // the full pages' ids, in sequence order
  PageSummaryStore store_;
  std::vector<TailPage> pages_;  // [layer][kv_head][page]; errors summed until pages(); each
                                 // (layer, KV head) written only by the thread observing it
};

/// The answer of a set of TailPages (from one or more contexts and models of one rank).
struct TailSummary {
  int64_t pages = 0;
  double err_mean = 0, err_p50 = 0, err_p90 = 0, err_p99 = 0, err_max = 0;  // over pages (of per-page means)
  /// Pages in deciles of their error's percentile within their (context, layer, KV head); per decile
  /// the mean error and each property's mean percentile within its group (0.5 = unrelated).
  std::array<double, 10> decile_err{};
  std::array<std::array<double, kTailProperties>, 10> decile_property_pct{};
  /// Per property: mean over (context, layer, KV head) groups of the Spearman correlation with the
  /// error, and of the precision at the top decile (over the groups where the property is defined on
  /// every page; NaN where it is nowhere). Empty deciles and undefined means are NaN.
  std::array<double, kTailProperties> spearman{}, precision_top10{};
};

/// Pages are grouped by (group_of[i], layer, kv_head); group_of is the caller's context index.
/// Throws std::invalid_argument for sizes that differ or no pages.
TailSummary summarize_tails(const std::vector<TailPage>& pages, const std::vector<int>& group_of);

}  // namespace locks
