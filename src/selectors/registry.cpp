// Selector construction by name.
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "selectors/selectors.h"

namespace locks {

std::vector<std::string> selector_names() { return {"full", "oracle", "locks"}; }

std::unique_ptr<Selector> make_selector(const std::string& name, const KvCacheConfig& cfg, const SelectorOptions& opts) {
  if (name == "full") return std::make_unique<FullSelector>();
  if (name == "oracle") return std::make_unique<OracleSelector>(opts.group_rule);
  if (name == "locks") return std::make_unique<LocksSelector>(cfg, opts.summary, opts.group_rule);
  throw std::invalid_argument(
      fmt::format("unknown selector '{}' (known: {})", name, fmt::join(selector_names(), ", ")));
}

}  // namespace locks
