// Selector construction by name.
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "selectors/selectors.h"

namespace locks {

std::vector<std::string> selector_names() {
  return {"full",           "oracle",         "locks",        "quest",    "centroid", "second-moment",
          "sequence-basis", "global-basis", "streaming"};
}

namespace {

// rho of the shared-basis scopes: the option, or matched bytes with the LOCKS summary format.
int shared_rank(const KvCacheConfig& cfg, const SelectorOptions& opts) {
  if (opts.shared_rank < 0 || opts.shared_rank > cfg.head_dim)
    throw std::invalid_argument(
        fmt::format("shared basis rank {} outside [1, head_dim {}] (0 = matched bytes)", opts.shared_rank, cfg.head_dim));
  if (opts.shared_rank > 0) return opts.shared_rank;
  opts.summary.validate(cfg.page_size, cfg.head_dim);
  return matched_bytes_rank(opts.summary, cfg.page_size, cfg.head_dim);
}

std::unique_ptr<Selector> construct_selector(const std::string& name, const KvCacheConfig& cfg,
                                             const SelectorOptions& opts) {
  if (name == "full") return std::make_unique<FullSelector>();
  if (name == "oracle") return std::make_unique<OracleSelector>(opts.group_rule);
  if (name == "locks") return std::make_unique<LocksSelector>(cfg, opts.summary, opts.group_rule);
  if (name == "quest") return std::make_unique<QuestSelector>(cfg, opts.group_rule);
  if (name == "centroid") return std::make_unique<CentroidSelector>(cfg, opts.summary.centroid_bits, opts.group_rule);
  if (name == "second-moment") return std::make_unique<SecondMomentSelector>(cfg, opts.summary, opts.group_rule);
  if (name == "sequence-basis")
    return std::make_unique<SequenceBasisSelector>(cfg, opts.summary, shared_rank(cfg, opts), opts.group_rule);
  if (name == "global-basis") {
    if (!opts.global_basis)
      throw std::invalid_argument(
          "selector 'global-basis' needs a calibrated basis: set SelectorOptions::global_basis "
          "(calibrate_global_basis on a calibration sequence)");
    return std::make_unique<GlobalBasisSelector>(cfg, opts.summary, shared_rank(cfg, opts), opts.global_basis,
                                                 opts.group_rule);
  }
  if (name == "streaming") return std::make_unique<StreamingSelector>();
  throw std::invalid_argument(
      fmt::format("unknown selector '{}' (known: {})", name, fmt::join(selector_names(), ", ")));
}

}  // namespace

std::string selector_options_key(const std::string& name, const SelectorOptions& opts) {
  return fmt::format("{} {} {} rho{} global-basis@{}", name, opts.summary.describe(), group_rule_name(opts.group_rule),
                     opts.shared_rank, static_cast<const void*>(opts.global_basis.get()));
}

std::unique_ptr<Selector> make_selector(const std::string& name, const KvCacheConfig& cfg, const SelectorOptions& opts) {
  auto sel = construct_selector(name, cfg, opts);
  sel->bind_cache(cfg);  // its per-page data is sized for this layout
  sel->bind_options_key(selector_options_key(name, opts));
  return sel;
}

}  // namespace locks
