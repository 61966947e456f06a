// `oracle`: the exact page log-mass s_j(q) from every key (reads the whole K cache), then the same
// selection rules as LOCKS. It is the ceiling a summary-based selector can reach.
#include <cmath>
#include <vector>

#include "selectors/selectors.h"

namespace locks {

void OracleSelector::do_select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) {
  const auto& cfg = cache.config();
  const int d = cfg.head_dim, B = cfg.page_size, n_pages = req.seq->n_pages();
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<float> log_mass(size_t(req.n_group) * n_pages);
  std::vector<float> keys(size_t(B) * d);
  size_t bytes = 0;
  for (int j = 0; j < n_pages; ++j) {
    const int n_tok = page_tokens(*req.seq, j, B);
    cache.k_page_f32(req.il, req.seq->page_table[j], req.kv_head, keys.data());
    bytes += cache.kv_bytes(n_tok) / 2;  // K only
    for (int g = 0; g < req.n_group; ++g)
      log_mass[size_t(g) * n_pages + j] = exact_log_mass(keys.data(), n_tok, req.q + size_t(g) * d, d, scale);
  }
  select_top_pages(log_mass.data(), req.n_group, n_pages, req.budget_pages, rule_, out.pages);
  out.bytes_read = bytes;
  out.all_pages = int(out.pages.size()) == n_pages;
  if (req.want_estimates) out.log_mass = std::move(log_mass);
}

}  // namespace locks
