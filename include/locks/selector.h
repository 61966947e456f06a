// Page selectors: one interface, chosen by name at run time. A selector sees the post-RoPE queries
// of one GQA group and returns which pages of the sequence that group attends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "locks/kv_cache.h"
#include "locks/page_summary.h"

namespace locks {

struct GlobalBasis;  // locks/shared_basis.h

/// How per-head page scores become one shared choice for the GQA group.
enum class GroupRule {
  kShareAverage,  // Eq. 5: mean over heads of per-head softmax shares (LOCKS default; Cor. 3)
  kMax,           // max over heads of the per-head share
  kMassSum,       // softmax of the summed per-head log-mass (sum of queries' scores)
};
std::string group_rule_name(GroupRule r);
GroupRule parse_group_rule(const std::string& s);  // "share-average" | "max" | "mass-sum"

/// How many pages a step keeps. kFixed: the budget k (Alg. 2). kTopP (`locks/p=P`): sink + recent +
/// the fewest top-ranked pages whose estimated group share (Eq. 5, share-average) reaches `mass`.
/// kCertified (`locks/cert=P`): pages until a certified lower bound of the kept group share (from
/// PageSummaryStore::log_mass_error_bounds) reaches `mass`, so the dropped share, and by Eq. 1 the
/// output error (<= 2 R (1 - P)), is guaranteed. Adaptive rules keep at least `min_tokens` (rounded
/// up to whole pages, at least 2 pages) and at most the request's budget k.
struct BudgetRule {
  enum class Kind { kFixed, kTopP, kCertified } kind = Kind::kFixed;
  double mass = 0;     // P in (0, 1): the group share to reach
  int min_tokens = 0;  // tokens kept at least (0: sink + recent)
  bool operator==(const BudgetRule&) const = default;
};
/// "fixed", "p=0.9 min=64", "cert=0.95 min=0".
std::string describe_budget_rule(const BudgetRule& r);
/// "fixed", "p=P" or "cert=P" (P a decimal number strictly between 0 and 1), min_tokens 0. Throws
/// std::invalid_argument naming the bad text.
BudgetRule parse_budget_rule(const std::string& s);
/// `value`, the text of option `key`, as a number strictly between 0 and 1 (a `what`: "share",
/// "fraction"). Throws std::invalid_argument: "KEY='VALUE' is not a number" or "KEY=VALUE is not a
/// WHAT strictly between 0 and 1".
double parse_unit_fraction(const std::string& key, const std::string& value, const char* what);

/// What a selector is made from; each selector reads some of it (selector_inputs).
struct SelectorOptions {
  SummaryFormat summary;  // LOCKS summary format (rank, precisions)
  GroupRule group_rule = GroupRule::kShareAverage;
  BudgetRule budget_rule;  // `locks`: fixed k, top-p or certified
  /// `locks/bytes=F`: each page's rank (<= summary.rank) chosen at build time so that the mean
  /// summary bytes per page come to about F times the fixed rank's (F in (0, 1)); 0: every page at
  /// summary.rank. The rule: per (layer, KV head), the smallest rank whose spectral tail
  /// sqrt(tau_{j,r}) is at most one threshold, set over the pages seen so far to meet the target.
  double rank_bytes = 0;
  // Baselines. `centroid` stores its mean at summary.centroid_bits; `second-moment` uses
  // summary.rank / basis_bits / centroid_bits; the shared-basis scopes store centroids and
  // coefficients at summary.centroid_bits / coef_bits.
  int shared_rank = 0;  // rho of sequence-basis / global-basis; 0 = matched bytes (matched_bytes_rank)
  std::shared_ptr<const GlobalBasis> global_basis;  // required by "global-basis" (calibrate_global_basis)
};

/// The inputs a selector reads, as bits (selector_inputs): the SelectorOptions fields it is made
/// from and the budget. An input a selector does not read cannot change it: same_selector ignores
/// it, `locks run` warns that it does not apply, `locks eval` refuses it in a selector spec.
enum SelectorInput : unsigned {
  kInputBudget = 1u << 0,        // SelectionRequest::budget_pages (`full` attends every page)
  kInputRank = 1u << 1,          // summary.rank
  kInputBasisBits = 1u << 2,     // summary.basis_bits
  kInputCoefBits = 1u << 3,      // summary.coef_bits
  kInputCentroidBits = 1u << 4,  // summary.centroid_bits
  kInputGroupRule = 1u << 5,     // group_rule
  kInputSharedRank = 1u << 6,    // shared_rank
  kInputGlobalBasis = 1u << 7,   // global_basis (an offline calibration pass: `locks eval` only)
  kInputBudgetRule = 1u << 8,    // budget_rule
  kInputRankBytes = 1u << 9,     // rank_bytes
};

/// One selection request: the GQA group of KV head `kv_head` in layer `il` of sequence `seq`.
struct SelectionRequest {
  const float* q = nullptr;  // [n_group][head_dim] float32, post-RoPE
  int n_group = 1;           // G query heads sharing the KV head
  int il = 0;
  int kv_head = 0;
  const KvSequence* seq = nullptr;
  int budget_pages = 32;        // k (>= 2): sink + recent + top-(k-2)
  bool want_estimates = false;  // fill Selection::log_mass (evaluation probes only)
};

/// Selected pages as positions in the sequence's page table (ascending), plus the bytes the
/// selector read to decide (summaries, exact keys for the oracle, ...), not counting attention.
struct Selection {
  std::vector<int32_t> pages;
  size_t bytes_read = 0;
  bool all_pages = false;  // true when every page was kept (budget covers the sequence, or dense)
  /// [n_group][n_pages] the selector's page log-mass estimates, when the request asked for them
  /// and the selector scores pages (empty for full / streaming).
  std::vector<float> log_mass;
  /// Seconds the selector spent estimating page log-masses (Eq. 4 for `locks`, with the error
  /// bounds of a certified budget), a part of its select() time; 0 for selectors that do not report it.
  double score_seconds = 0;
  /// An adaptive budget rule's outcome: 1 when the kept pages reached the target share (estimated for
  /// top-p, certified for cert) within the budget, 0 when the budget ran out first; -1 for a fixed k.
  int mass_target_met = -1;
};

/// Bytes one GQA group's decode step reads: the selector's own reads plus the K/V of the selected
/// pages (partial last page counted at its length).
inline size_t step_bytes_read(const PagedKvCache& cache, const KvSequence& seq, const Selection& sel) {
  size_t bytes = sel.bytes_read;
  for (int32_t j : sel.pages) bytes += cache.kv_bytes(page_tokens(seq, j, cache.page_size()));
  return bytes;
}

class Selector {
 public:
  virtual ~Selector() = default;
  virtual std::string name() const = 0;
  /// Pages just filled in layer `il` (their K is final: every one of its page_size tokens written;
  /// the cache cannot tell), as page ids of the pool. Selectors build per-page metadata here. Throws
  /// std::out_of_range for a layer or page id outside the cache, or a page no sequence holds.
  void on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids);
  /// Choose the pages for one GQA group: always page 0 (sink) and the last page (recent), at most
  /// max(budget_pages, 2) pages. Throws std::invalid_argument for a request without q or sequence,
  /// with n_group < 1, a NaN/inf in q or a sequence whose length does not fit its page table, and
  /// std::out_of_range for a layer, KV head or page id outside the cache (or a page not in use).
  void select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out);
  /// Deep copy (metadata included), so an evaluation can fork a prefilled sequence.
  virtual std::unique_ptr<Selector> clone() const = 0;
  /// Keys of a full page as the selector's metadata represents them (e.g. LOCKS: mu + V c_i),
  /// out: [B][head_dim]. Returns false when the selector keeps no per-token reconstruction.
  virtual bool reconstruct_keys(int il, int kv_head, int32_t page, float* out) const { return false; }
  /// The sequence `seq` (prefilled, every full page passed to on_pages_filled) is about to decode.
  /// A selector may do here work that its first select() would otherwise do, where doing it now
  /// gives the same result (Session::prepare_selector, so that forks share it).
  virtual void prepare_for_decode(const PagedKvCache& cache, const KvSequence& seq) {}
  /// Whether select() chooses how many pages to keep (an adaptive BudgetRule): the engine then asks
  /// it even when the budget covers every page, instead of attending densely.
  virtual bool adaptive_budget() const { return false; }
  /// The cache layout this selector's per-page data is sized for (make_selector sets it): the
  /// entry points above then refuse, with std::invalid_argument, a cache of any other layout.
  void bind_cache(const KvCacheConfig& cfg) {
    bound_ = cfg;
    has_bound_ = true;
  }
  /// The options it was made with, those it does not read at their defaults (make_selector sets
  /// them), so that Session::fork(cfg, prepared) can refuse a selector made with other options.
  const SelectorOptions& options() const { return options_; }
  void bind_options(SelectorOptions opts) { options_ = std::move(opts); }

 protected:
  /// What on_pages_filled and select do once they have checked their arguments.
  virtual void do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) {}
  virtual void do_select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) = 0;

 private:
  void check_cache(const char* what, const PagedKvCache& cache) const;
  KvCacheConfig bound_;
  bool has_bound_ = false;
  SelectorOptions options_;
};

/// Construct a selector by name: "full", "oracle", "locks", and the baselines "quest", "centroid",
/// "second-moment", "sequence-basis", "global-basis", "streaming" (src/selectors/*.cpp document
/// their estimates and byte counts). `cache_cfg` sizes per-page metadata.
/// Throws std::invalid_argument listing the known names when `name` is unknown, and naming the
/// problem for bad options (global-basis without a calibrated basis or with mismatched shapes, a
/// shared rank outside [1, head_dim], an invalid summary format).
std::unique_ptr<Selector> make_selector(const std::string& name, const KvCacheConfig& cache_cfg,
                                        const SelectorOptions& opts = {});
/// Names accepted by make_selector.
std::vector<std::string> selector_names();
/// The inputs selector `name` reads (SelectorInput bits); 0 for a name make_selector does not know.
unsigned selector_inputs(const std::string& name);
/// Whether (name_a, a) and (name_b, b) make the same selector: the same name and equal values of
/// every option that selector reads (the global basis by identity), so equal metadata and
/// selections (Session::fork(cfg, prepared), `locks eval`'s check for two spellings of one).
bool same_selector(const std::string& name_a, const SelectorOptions& a, const std::string& name_b,
                   const SelectorOptions& b);
/// The name and the options it reads, for messages: "locks r=8 basis=int4 coef=int8 centroid=int8
/// share-average", "sequence-basis ... rho=0", "full".
std::string describe_selector(const std::string& name, const SelectorOptions& opts);

/// The shared selection rule (Alg. 2 lines 6-9): given page log-mass estimates
/// `log_mass[g * n_pages + j]` for the G heads and every page of the sequence, form per-head
/// shares (softmax over pages), combine them by `rule`, and keep the sink page, the recent page and
/// the top-(k-2) others. Ties break toward the lower page index. Pages with -inf estimates get
/// share 0. Output ascending. `scores_out`, when non-null, receives the combined score per page.
/// Throws std::invalid_argument for a null `log_mass`, n_group < 1 (with n_pages > 0), or a NaN or
/// +inf estimate (named by head and page).
void select_top_pages(const float* log_mass, int n_group, int n_pages, int budget_pages, GroupRule rule,
                      std::vector<int32_t>& out, std::vector<float>* scores_out = nullptr);

/// Alg. 2 with an adaptive k (BudgetRule kTopP / kCertified). Pages rank as select_top_pages ranks
/// them under share-average (Eq. 5); sink and recent are always kept, then the next-ranked pages
/// until the target is met, keeping at least min_pages and at most max(max_pages, 2).
/// Target, for the kept set S: top-p (error_bound null) the estimated group share
///   (1/G) sum_g sum_{j in S} softmax_j(log_mass[g])  >=  mass;
/// certified (error_bound [n_group][n_pages], |s_gj - log_mass_gj| <= error_bound_gj) the lower bound
///   (1/G) sum_g L_g / (L_g + U_g),  L_g = sum_{j in S} e^(s_hat - beta),  U_g = sum_{j not in S} e^(s_hat + beta)
/// of the true group share, computed in float64 (the true share is at least it for every s in the
/// bounds). Output ascending. Returns whether the target was met within max_pages. Throws
/// std::invalid_argument as select_top_pages, for mass outside (0, 1), or a NaN / negative bound.
bool select_pages_by_mass(const float* log_mass, const float* error_bound, int n_group, int n_pages, int min_pages,
                          int max_pages, double mass, std::vector<int32_t>& out);

}  // namespace locks
