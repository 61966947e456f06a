// The selector table: one row per selector with its name, the inputs it reads and its factory.
// make_selector, selector_names, same_selector and the front ends' option checks all read it.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sstream>
#include <stdexcept>

#include "selectors/selectors.h"

namespace locks {

namespace {

// rho of the shared-basis scopes: the option, or matched bytes with the LOCKS summary format.
int shared_rank(const KvCacheConfig& cfg, const SelectorOptions& opts) {
  if (opts.shared_rank < 0 || opts.shared_rank > cfg.head_dim)
    throw std::invalid_argument(fmt::format("shared basis rank {} outside [1, head_dim {}] (0 = matched bytes)",
                                            opts.shared_rank, cfg.head_dim));
  if (opts.shared_rank > 0) return opts.shared_rank;
  opts.summary.validate(cfg.page_size, cfg.head_dim);
  return matched_bytes_rank(opts.summary, cfg.page_size, cfg.head_dim);
}

using Factory = std::unique_ptr<Selector> (*)(const KvCacheConfig& cfg, const SelectorOptions& opts);

struct SelectorRow {
  const char* name;
  unsigned inputs;  // SelectorInput bits
  Factory make;
};

constexpr unsigned kSummary = kInputRank | kInputBasisBits | kInputCoefBits | kInputCentroidBits;
// (the shared-basis scopes size rho from the whole summary format when shared_rank is 0)
constexpr unsigned kSharedBasis = kInputBudget | kSummary | kInputGroupRule | kInputSharedRank;

const SelectorRow kSelectors[] = {
    {"full", 0,
     [](const KvCacheConfig&, const SelectorOptions&) -> std::unique_ptr<Selector> {
       return std::make_unique<FullSelector>();
     }},
    {"oracle", kInputBudget | kInputGroupRule,
     [](const KvCacheConfig&, const SelectorOptions& o) -> std::unique_ptr<Selector> {
       return std::make_unique<OracleSelector>(o.group_rule);
     }},
    {"locks", kInputBudget | kSummary | kInputGroupRule | kInputBudgetRule | kInputRankBytes,
     [](const KvCacheConfig& c, const SelectorOptions& o) -> std::unique_ptr<Selector> {
       return std::make_unique<LocksSelector>(c, o.summary, o.group_rule, o.budget_rule, o.rank_bytes);
     }},
    {"quest", kInputBudget | kInputGroupRule,
     [](const KvCacheConfig& c, const SelectorOptions& o) -> std::unique_ptr<Selector> {
       return std::make_unique<QuestSelector>(c, o.group_rule);
     }},
    {"centroid", kInputBudget | kInputCentroidBits | kInputGroupRule,
     [](const KvCacheConfig& c, const SelectorOptions& o) -> std::unique_ptr<Selector> {
       return std::make_unique<CentroidSelector>(c, o.summary.centroid_bits, o.group_rule);
     }},
    {"second-moment", kInputBudget | kInputRank | kInputBasisBits | kInputCentroidBits | kInputGroupRule,
     [](const KvCacheConfig& c, const SelectorOptions& o) -> std::unique_ptr<Selector> {
       return std::make_unique<SecondMomentSelector>(c, o.summary, o.group_rule);
     }},
    {"sequence-basis", kSharedBasis,
     [](const KvCacheConfig& c, const SelectorOptions& o) -> std::unique_ptr<Selector> {
       return std::make_unique<SequenceBasisSelector>(c, o.summary, shared_rank(c, o), o.group_rule);
     }},
    {"global-basis", kSharedBasis | kInputGlobalBasis,
     [](const KvCacheConfig& c, const SelectorOptions& o) -> std::unique_ptr<Selector> {
       if (!o.global_basis)
         throw std::invalid_argument(
             "selector 'global-basis' needs a calibrated basis: set SelectorOptions::global_basis "
             "(calibrate_global_basis on a calibration sequence)");
       return std::make_unique<GlobalBasisSelector>(c, o.summary, shared_rank(c, o), o.global_basis, o.group_rule);
     }},
    {"streaming", kInputBudget,
     [](const KvCacheConfig&, const SelectorOptions&) -> std::unique_ptr<Selector> {
       return std::make_unique<StreamingSelector>();
     }},
};

const SelectorRow* find_row(const std::string& name) {
  for (const SelectorRow& row : kSelectors)
    if (name == row.name) return &row;
  return nullptr;
}

// `opts` with every input the selector does not read at its default.
SelectorOptions read_options(unsigned inputs, const SelectorOptions& opts) {
  SelectorOptions n;
  if (inputs & kInputRank) n.summary.rank = opts.summary.rank;
  if (inputs & kInputBasisBits) n.summary.basis_bits = opts.summary.basis_bits;
  if (inputs & kInputCoefBits) n.summary.coef_bits = opts.summary.coef_bits;
  if (inputs & kInputCentroidBits) n.summary.centroid_bits = opts.summary.centroid_bits;
  if (inputs & kInputGroupRule) n.group_rule = opts.group_rule;
  if (inputs & kInputSharedRank) n.shared_rank = opts.shared_rank;
  if (inputs & kInputGlobalBasis) n.global_basis = opts.global_basis;
  if (inputs & kInputBudgetRule) n.budget_rule = opts.budget_rule;
  if (inputs & kInputRankBytes) n.rank_bytes = opts.rank_bytes;
  return n;
}

}  // namespace

std::vector<std::string> selector_names() {
  std::vector<std::string> names;
  for (const SelectorRow& row : kSelectors) names.emplace_back(row.name);
  return names;
}

unsigned selector_inputs(const std::string& name) {
  const SelectorRow* row = find_row(name);
  return row ? row->inputs : 0;
}

bool same_selector(const std::string& name_a, const SelectorOptions& a, const std::string& name_b,
                   const SelectorOptions& b) {
  if (name_a != name_b) return false;
  const unsigned in = selector_inputs(name_a);
  const SelectorOptions x = read_options(in, a), y = read_options(in, b);
  return x.summary.rank == y.summary.rank && x.summary.basis_bits == y.summary.basis_bits &&
         x.summary.coef_bits == y.summary.coef_bits && x.summary.centroid_bits == y.summary.centroid_bits &&
         x.group_rule == y.group_rule && x.shared_rank == y.shared_rank && x.global_basis == y.global_basis &&
         x.budget_rule == y.budget_rule && x.rank_bytes == y.rank_bytes;
}

std::string describe_selector(const std::string& name, const SelectorOptions& opts) {
  const unsigned in = selector_inputs(name);
  std::vector<std::string> words = {name};
  // The summary fields read, as SummaryFormat::describe words them ("r=8 basis=int4 coef=int8 centroid=int8").
  std::istringstream summary(opts.summary.describe());
  for (unsigned bit : {kInputRank, kInputBasisBits, kInputCoefBits, kInputCentroidBits}) {
    std::string word;
    summary >> word;
    if (in & bit) words.push_back(word);
  }
  if (in & kInputGroupRule) words.push_back(group_rule_name(opts.group_rule));
  if (in & kInputSharedRank) words.push_back(fmt::format("rho={}", opts.shared_rank));
  if ((in & kInputBudgetRule) && opts.budget_rule.kind != BudgetRule::Kind::kFixed)
    words.push_back(describe_budget_rule(opts.budget_rule));
  if ((in & kInputRankBytes) && opts.rank_bytes > 0) words.push_back(fmt::format("bytes={:g}", opts.rank_bytes));
  if (in & kInputGlobalBasis)
    words.push_back(fmt::format("global-basis@{}", static_cast<const void*>(opts.global_basis.get())));
  return fmt::format("{}", fmt::join(words, " "));
}

std::unique_ptr<Selector> make_selector(const std::string& name, const KvCacheConfig& cfg,
                                        const SelectorOptions& opts) {
  const SelectorRow* row = find_row(name);
  if (!row)
    throw std::invalid_argument(
        fmt::format("unknown selector '{}' (known: {})", name, fmt::join(selector_names(), ", ")));
  std::unique_ptr<Selector> sel = row->make(cfg, opts);
  sel->bind_cache(cfg);  // its per-page data is sized for this layout
  sel->bind_options(read_options(row->inputs, opts));
  return sel;
}

}  // namespace locks
