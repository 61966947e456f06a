// The paper's per-step fidelity chain (Sec. 5): summary accuracy -> page-score ranking -> coverage
// -> carrier survival -> output error, measured on the real KV cache during decode.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "locks/kv_cache.h"
#include "locks/selector.h"
#include "locks/session.h"

namespace locks {

/// Sums over observations; FidelityStats::mean() turns them into averages.
struct FidelityStats {
  double obs = 0;          // (layer, KV head, step) observations
  double lse_abs_err = 0;  // sum over pages and heads of |s_hat_j - s_j| (LSE MAE numerator)
  double lse_n = 0;
  double logit_abs_err = 0;  // sum over tokens and heads of |q.(k_hat_i - k_i)| / sqrt(d)
  double logit_n = 0;
  double spearman = 0;  // Spearman(s_hat(q_g), s(q_g)) over pages, summed over heads
  double spearman_n = 0;
  double coverage = 0;             // group-average gamma_S (attention mass inside S), summed over obs
  double worst_head_coverage = 0;  // min over the group's heads of gamma_S, summed over obs
  double oracle_coverage = 0;      // gamma of the exact-mass selection at the same budget
  double output_rel_err = 0;       // ||o_S - o|| / ||o|| summed over heads
  double output_n = 0;
  double carrier_obs = 0, carrier_kept = 0;          // carrier page holds >= 5% group-average mass
  double carrier_any_obs = 0, carrier_any_kept = 0;  // every (layer, head, step), unconditional

  void add(const FidelityStats& o);
  struct Means {
    double lse_mae, logit_mae, spearman, coverage, worst_head_coverage, oracle_coverage, output_rel_err,
        carrier_retention, carrier_retention_any;  // NaN where there was nothing to average
  };
  Means mean() const;
};

/// Observes decode steps of a Session (Session::set_observer) and accumulates FidelityStats against
/// exact attention. It reads every key of every page (a dense pass per step), so it is for
/// evaluation only.
class FidelityProbe final : public DecodeObserver {
 public:
  /// carrier_positions: token positions whose pages are carrier pages (e.g. the asked needle).
  explicit FidelityProbe(std::vector<int32_t> carrier_positions = {}, double carrier_mass_threshold = 0.05)
      : carrier_positions_(std::move(carrier_positions)), threshold_(carrier_mass_threshold) {}

  /// The session skips the probe (and its cost) while disabled; enabled from construction.
  bool enabled() const override { return enabled_; }
  void set_enabled(bool on) { enabled_ = on; }
  /// Token positions whose pages count as carrier pages from now on.
  void set_carriers(std::vector<int32_t> positions) { carrier_positions_ = std::move(positions); }

  /// One (layer, KV head) of a decode step: q [G][d], the selector's result (with log_mass when it
  /// scores pages), the budget it had. Thread-safe for distinct kv_head values.
  void observe(const PagedKvCache& cache, const KvSequence& seq, const Selector& selector, int il, int kv_head,
               const float* q, int n_group, int budget_pages, const Selection& sel) override;

  /// Totals over every observation, and per (layer, KV head) ([il * n_head_kv + h]).
  FidelityStats total() const;
  const std::vector<FidelityStats>& per_head() const { return per_head_; }
  void reset() { per_head_.clear(); }

 private:
  bool enabled_ = true;
  std::vector<int32_t> carrier_positions_;
  double threshold_;
  std::vector<FidelityStats> per_head_;
  // A full page's reconstruction error k_hat_i - k_i is fixed once the page is full and the
  // selector has built its metadata (before its first select(), which precedes observe()), so it
  // is computed once per (layer, KV head, page) and reused at every later step of the same
  // selector. [il * n_head_kv + h] -> per page id: state (0 not seen, 1 error kept, 2 the selector
  // keeps no reconstruction) and the error transposed, [d][B].
  struct ReconErrors {
    std::vector<char> state;
    std::vector<float> diff_t;
  };
  const Selector* recon_owner_ = nullptr;
  std::vector<ReconErrors> recon_;
};

/// Spearman rank correlation of two equal-length samples (average ranks for ties); NaN when either
/// is constant or n < 2.
double spearman_correlation(std::span<const float> a, std::span<const float> b);
/// Ranks 0..n-1 of x ascending, tied values given their mean rank (Spearman's ranks).
std::vector<double> average_ranks(std::span<const double> x);
/// Pearson correlation of two equal-length samples; NaN when either is constant or n < 2.
double pearson_correlation(std::span<const double> a, std::span<const double> b);

}  // namespace locks
