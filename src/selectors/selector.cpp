// The Selector interface's checked entry points: every selector gets the same argument checks
// before its own on_pages_filled / select work (non-virtual interface).
#include "locks/selector.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "locks/math.h"

namespace locks {

void Selector::check_cache(const char* what, const PagedKvCache& cache) const {
  const KvCacheConfig& c = cache.config();
  if (has_bound_ && (c.n_layer != bound_.n_layer || c.n_head_kv != bound_.n_head_kv || c.head_dim != bound_.head_dim ||
                     c.page_size != bound_.page_size || c.n_pages != bound_.n_pages))
    throw std::invalid_argument(fmt::format(
        "{}: selector '{}' was made for a cache of {} layers x {} KV heads x {} pages of {} x {}, not {} x {} x {} "
        "pages of {} x {}",
        what, name(), bound_.n_layer, bound_.n_head_kv, bound_.n_pages, bound_.page_size, bound_.head_dim, c.n_layer,
        c.n_head_kv, c.n_pages, c.page_size, c.head_dim));
}

void Selector::on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) {
  check_cache("on_pages_filled", cache);
  cache.check_layer_head("on_pages_filled", il);
  for (int32_t id : page_ids) cache.check_page_in_use("on_pages_filled", id);
  do_on_pages_filled(cache, il, page_ids);
}

void Selector::select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) {
  if (req.q == nullptr || req.seq == nullptr) throw std::invalid_argument("select: the request needs q and seq");
  if (req.n_group < 1) throw std::invalid_argument(fmt::format("select: n_group {} < 1", req.n_group));
  check_cache("select", cache);
  cache.check_layer_head("select", req.il, req.kv_head);
  cache.check_sequence("select", *req.seq, /*ids=*/true);
  // A NaN or inf query would rank every page by garbage (NaN scores compare false everywhere).
  const int d = cache.config().head_dim;
  if (const std::ptrdiff_t i = first_non_finite(req.q, size_t(req.n_group) * d); i >= 0)
    throw std::invalid_argument(fmt::format("select: non-finite query at head {}, dim {}", i / d, i % d));
  do_select(cache, req, out);
}

}  // namespace locks
