// The Selector interface's checked entry points: every selector gets the same argument checks
// before its own on_pages_filled / select work (non-virtual interface).
#include <stdexcept>

#include <fmt/format.h>

#include "locks/selector.h"

namespace locks {

void Selector::on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) {
  cache.check_layer_head("on_pages_filled", il);
  for (int32_t id : page_ids) cache.check_page_id("on_pages_filled", id);
  do_on_pages_filled(cache, il, page_ids);
}

void Selector::select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) {
  if (req.q == nullptr || req.seq == nullptr)
    throw std::invalid_argument("select: the request needs q and seq");
  if (req.n_group < 1) throw std::invalid_argument(fmt::format("select: n_group {} < 1", req.n_group));
  cache.check_layer_head("select", req.il, req.kv_head);
  do_select(cache, req, out);
}

}  // namespace locks
