// Concrete selectors (internal header). Public construction goes through make_selector().
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "locks/parallel_for.h"
#include "locks/selector.h"
#include "locks/shared_basis.h"

namespace locks {

class FullSelector final : public Selector {
 public:
  std::string name() const override { return "full"; }
  void do_select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<FullSelector>(*this); }
};

class OracleSelector final : public Selector {
 public:
  explicit OracleSelector(GroupRule rule) : rule_(rule) {}
  std::string name() const override { return "oracle"; }
  void do_select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<OracleSelector>(*this); }

 private:
  GroupRule rule_;
};

class LocksSelector final : public Selector {
 public:
  /// Throws std::invalid_argument for an adaptive budget rule with a target share outside (0, 1), a
  /// negative minimum, or a group rule other than share-average (the target is an Eq. 5 share).
  LocksSelector(const KvCacheConfig& cfg, const SummaryFormat& fmt, GroupRule rule, const BudgetRule& budget_rule = {},
                double rank_bytes = 0);
  std::string name() const override;
  void do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) override;
  void do_select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<LocksSelector>(*this); }
  bool reconstruct_keys(int il, int kv_head, int32_t page, float* out) const override;
  bool adaptive_budget() const override { return budget_rule_.kind != BudgetRule::Kind::kFixed; }
  const PageSummaryStore& store() const { return store_; }

 private:
  /// SelectorOptions::rank_bytes: each page's rank from its spectral tail, per (layer, KV head)
  /// against one threshold that keeps the mean bytes of the pages seen so far at the target.
  std::vector<int> choose_ranks(int il, int h, const std::vector<const PageSummaryF32*>& pages);

  PageSummaryStore store_;
  GroupRule rule_;
  BudgetRule budget_rule_;
  double rank_bytes_ = 0;
  int n_head_kv_ = 0;
  // Per (layer, KV head): sqrt(tau_{j,r}) for r = 1..rank of every page seen (rank values per page).
  std::vector<std::vector<float>> tail_profiles_;
};

// =============================================================================================
// Baselines (issue 4). Each estimates a per-head page log-mass from its own per-page metadata and
// keeps sink + recent + top-(k-2) with select_top_pages, except `streaming`. Metadata is built for
// full pages in on_pages_filled; a page without metadata (the partial recent page) is scored from
// its exact keys, which are counted in bytes_read exactly as the LOCKS selector counts them.
// Metadata lives in fixed-size per-(layer, KV head, page) blobs, so select() for different KV heads
// (run concurrently) only reads shared state or writes its own (layer, KV head) slots.
// =============================================================================================

/// Fixed-size metadata blobs per (layer, KV head, page id), laid out [layer][kv_head][page].
class PageBlobStore {
 public:
  PageBlobStore() = default;
  PageBlobStore(const KvCacheConfig& cfg, size_t blob_bytes);
  size_t blob_bytes() const { return blob_bytes_; }
  uint8_t* blob(int il, int h, int32_t page) { return data_.data() + index(il, h, page) * blob_bytes_; }
  const uint8_t* blob(int il, int h, int32_t page) const { return data_.data() + index(il, h, page) * blob_bytes_; }
  bool has(int il, int h, int32_t page) const { return valid_[index(il, h, page)] != 0; }
  void set_valid(int il, int h, int32_t page) { valid_[index(il, h, page)] = 1; }
  /// Slot of (il, h, page) in [layer][kv_head][page] order; slots() of them.
  size_t index(int il, int h, int32_t page) const { return (size_t(il) * n_head_kv_ + h) * n_pages_ + page; }
  size_t slots() const { return valid_.size(); }

 private:
  int n_head_kv_ = 0, n_pages_ = 0;
  size_t blob_bytes_ = 0;
  ZeroedArray<uint8_t> data_;   // [L][H][P][blob_bytes], committed as pages are stored
  ZeroedArray<uint8_t> valid_;  // [L][H][P]
};

/// Build per-page metadata for every (page, KV head) of `page_ids` in layer `il` with
/// build(keys [B][d] float32, il, h, page), batched across cores (the first exception rethrown).
template <class Build>
void for_each_page_head(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids, Build&& build) {
  const auto& cfg = cache.config();
  const int n = static_cast<int>(page_ids.size()) * cfg.n_head_kv;
  parallel_for(
      n,
      [&](int t) {
        const int32_t page = page_ids[t / cfg.n_head_kv];
        const int h = t % cfg.n_head_kv;
        std::vector<float> keys(size_t(cfg.page_size) * cfg.head_dim);
        cache.k_page_f32(il, page, h, keys.data());
        build(keys.data(), il, h, page);
      },
      /*min_parallel=*/9, /*dynamic_chunk=*/4);
}

/// Base of the baselines that select by a per-head page estimate.
class EstimatingSelector : public Selector {
 public:
  explicit EstimatingSelector(GroupRule rule) : rule_(rule) {}
  /// estimate() then select_top_pages(rule); the estimates go to out.log_mass when requested.
  void do_select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) override;
  /// Per-head page estimates log_mass[g * n_pages + j] ([n_group][n_pages]) for the request;
  /// returns the bytes read to produce them. Non-const: `sequence-basis` fits its basis lazily.
  virtual size_t estimate(const PagedKvCache& cache, const SelectionRequest& req, std::vector<float>& log_mass) = 0;

 protected:
  GroupRule rule_;
};

/// Score page j of the request from its exact keys (pages without metadata): per head the page
/// log-mass (`max_logit` false) or the max logit (`max_logit` true), scaled by 1/sqrt(d), into
/// log_mass[g * n_pages + j]. Returns the K bytes read. `keys` is scratch.
size_t exact_page_estimate(const PagedKvCache& cache, const SelectionRequest& req, int j, bool max_logit,
                           std::vector<float>& keys, float* log_mass);

/// `quest`: per page and channel the key min and max (f16, rounded outward so they stay bounds:
/// 4d bytes per page). Estimate: the upper bound sum_c max(q_c max_c, q_c min_c) / sqrt(d) of the
/// page's max logit (not an LSE).
class QuestSelector final : public EstimatingSelector {
 public:
  QuestSelector(const KvCacheConfig& cfg, GroupRule rule);
  std::string name() const override { return "quest"; }
  void do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) override;
  size_t estimate(const PagedKvCache& cache, const SelectionRequest& req, std::vector<float>& log_mass) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<QuestSelector>(*this); }
  static size_t page_bytes(int head_dim) { return 4 * size_t(head_dim); }

 private:
  PageBlobStore store_;  // [d] f16 min, then [d] f16 max
};

/// `centroid`: the page mean only, at `centroid_bits` (8: int8 + f16 scale, d + 2 bytes; 32: 4d).
/// Estimate: q.mu / sqrt(d) + log(B).
class CentroidSelector final : public EstimatingSelector {
 public:
  CentroidSelector(const KvCacheConfig& cfg, int centroid_bits, GroupRule rule);
  std::string name() const override { return "centroid"; }
  void do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) override;
  size_t estimate(const PagedKvCache& cache, const SelectionRequest& req, std::vector<float>& log_mass) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<CentroidSelector>(*this); }
  /// Every token of the page represented by the page mean.
  bool reconstruct_keys(int il, int kv_head, int32_t page, float* out) const override;
  static size_t page_bytes(int head_dim, int centroid_bits);

 private:
  int centroid_bits_, d_, B_;
  PageBlobStore store_;
};

/// `second-moment`: page mean + the top-r eigenpairs of the page covariance (LOCKS's own Alg. 1
/// directions V_r and sigma_k^2 / B), Gaussian log-mass estimate
///   s_hat = log(B) + q.mu / sqrt(d) + (1/2) q^T Sigma_r q / d,  Sigma_r = V_r diag(sigma^2 / B) V_r^T.
/// Stored: centroid at centroid_bits, V_r at basis_bits (one scale per direction, as LOCKS), and
/// the r standard deviations sigma_k / sqrt(B) (f16, or f32 when basis_bits = 32).
class SecondMomentSelector final : public EstimatingSelector {
 public:
  SecondMomentSelector(const KvCacheConfig& cfg, const SummaryFormat& fmt, GroupRule rule);
  std::string name() const override { return "second-moment"; }
  void do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) override;
  size_t estimate(const PagedKvCache& cache, const SelectionRequest& req, std::vector<float>& log_mass) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<SecondMomentSelector>(*this); }
  /// centroid + r * (direction + standard deviation) bytes.
  static size_t page_bytes(const SummaryFormat& fmt, int head_dim);

 private:
  SummaryFormat fmt_;
  int d_ = 0;
  PageBlobStore store_;
  // Every stored page decoded once at build time (centroid [d], directions [r][d], variances
  // sigma_k^2 / B [r]: exactly the stored values), so the per-step estimate does not re-decode
  // every page. bytes_read counts the stored format (page_bytes()).
  size_t dec_stride_ = 0;
  ZeroedArray<float> dec_;  // [layer][kv_head][page][d + r * d + r], committed as pages fill
};

/// Per-page half of a shared-basis summary: centroid mu_j (centroid_bits) and the coefficients
/// c_i = V^T (k_i - mu_j) of each of the B tokens in a shared basis V [rho][d] (coef_bits, one
/// scale per token row). Scored with Eq. 4: s_hat_j(q) = logsumexp_i (q.mu_j + (V q).c_i) / sqrt(d).
class SharedBasisPages {
 public:
  SharedBasisPages() = default;
  SharedBasisPages(const KvCacheConfig& cfg, int rho, int coef_bits, int centroid_bits);
  int rank() const { return rho_; }
  size_t page_bytes() const { return store_.blob_bytes(); }
  /// Project and store one page: keys [B][d], basis [rho][d].
  void build(int il, int h, int32_t page, const float* keys, const float* basis);
  bool has(int il, int h, int32_t page) const { return store_.has(il, h, page); }
  /// Dequantized centroid [d] and coefficients [B][rho] (tests, diagnostics).
  void load(int il, int h, int32_t page, std::vector<float>& mu, std::vector<float>& coef) const;
  /// Keys as the summary represents them, k_i = mu + V^T c_i, out [B][d]; false without metadata
  /// or basis.
  bool reconstruct(int il, int h, int32_t page, const float* basis, float* out) const;
  /// Per-head page estimates for the request with basis [rho][d] (reads the basis once, rho*d*4
  /// bytes, plus page_bytes() per page with metadata). A null basis scores every page from its
  /// keys. Returns bytes read.
  size_t estimate(const float* basis, const PagedKvCache& cache, const SelectionRequest& req,
                  std::vector<float>& log_mass) const;

 private:
  /// Decoded copy of a stored page (exactly the values load() returns): centroid [d], then the
  /// coefficients transposed, [rho][B].
  const float* decoded(int il, int h, int32_t page) const {
    return dec_.data() + store_.index(il, h, page) * dec_stride_;
  }
  int rho_ = 0, B_ = 0, d_ = 0, coef_bits_ = 8, centroid_bits_ = 8;
  PageBlobStore store_;
  // The stored pages decoded once at build time, so that the per-step Eq. 4 pass (and the
  // probe's reconstruction) runs on floats without re-decoding every page each step. bytes_read
  // still counts the stored format (page_bytes()); this is an evaluation-speed layout choice.
  size_t dec_stride_ = 0;
  ZeroedArray<float> dec_;  // [layer][kv_head][page][d + rho * B], committed as pages fill
};

/// `sequence-basis` (ShadowKV's scope): one rank-rho PCA basis per (layer, KV head) of this
/// selector's sequence, fit on all its full pages at the first select() of that (layer, KV head)
/// (after a dense prefill: the prefill keys); those pages are projected then, pages filled later on
/// arrival. One selector instance serves one sequence (as in Session). The one-time fit reads the
/// prefill keys once (a prefill cost like the LOCKS summary build) and is not in bytes_read.
class SequenceBasisSelector final : public EstimatingSelector {
 public:
  SequenceBasisSelector(const KvCacheConfig& cfg, const SummaryFormat& fmt, int rho, GroupRule rule);
  std::string name() const override { return "sequence-basis"; }
  void do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) override;
  size_t estimate(const PagedKvCache& cache, const SelectionRequest& req, std::vector<float>& log_mass) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<SequenceBasisSelector>(*this); }
  bool reconstruct_keys(int il, int kv_head, int32_t page, float* out) const override;
  const SharedBasisPages& pages() const { return pages_; }
  /// The fitted basis [rho][d] of (il, h); empty before the first select() of that head.
  const std::vector<float>& basis(int il, int h) const { return basis_[size_t(il) * n_head_kv_ + h]; }
  /// Fits every (layer, KV head) now on the full pages present; the first select() of a head keeps
  /// that fit when the sequence still has the same full pages (the fit it would make), else refits.
  void prepare_for_decode(const PagedKvCache& cache, const KvSequence& seq) override;

 private:
  void fit(const PagedKvCache& cache, const KvSequence& seq, int il, int h);
  int n_layer_ = 0, n_head_kv_ = 0;
  SharedBasisPages pages_;
  // Per [il * n_head_kv + h], written only by head h's thread: the basis [rho][d], the number of
  // full pages it was fit on, and whether a select() has used it (then it is never refit).
  std::vector<std::vector<float>> basis_;
  std::vector<int> fit_pages_;
  std::vector<char> fit_used_;
};

/// `global-basis` (Loki's scope): the first rho rows of a basis calibrated offline per (layer, KV
/// head) on other text (calibrate_global_basis), shared by every sequence.
class GlobalBasisSelector final : public EstimatingSelector {
 public:
  GlobalBasisSelector(const KvCacheConfig& cfg, const SummaryFormat& fmt, int rho,
                      std::shared_ptr<const GlobalBasis> basis, GroupRule rule);
  std::string name() const override { return "global-basis"; }
  void do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) override;
  size_t estimate(const PagedKvCache& cache, const SelectionRequest& req, std::vector<float>& log_mass) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<GlobalBasisSelector>(*this); }
  bool reconstruct_keys(int il, int kv_head, int32_t page, float* out) const override;
  const SharedBasisPages& pages() const { return pages_; }

 private:
  std::shared_ptr<const GlobalBasis> global_;  // immutable, shared by clones
  SharedBasisPages pages_;
};

/// `streaming`: the sink page and the most recent k-1 pages (StreamingLLM's window); reads nothing.
class StreamingSelector final : public Selector {
 public:
  std::string name() const override { return "streaming"; }
  void do_select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<StreamingSelector>(*this); }
};

}  // namespace locks
