// Shared machinery of the baseline selectors: per-page metadata blobs, the estimate -> select rule,
// and the exact fallback for pages without metadata (the partial recent page).
#include <cmath>
#include <utility>
#include <vector>

#include "locks/math.h"
#include "selectors/selectors.h"

namespace locks {

PageBlobStore::PageBlobStore(const KvCacheConfig& cfg, size_t blob_bytes)
    : n_head_kv_(cfg.n_head_kv), n_pages_(cfg.n_pages), blob_bytes_(blob_bytes) {
  const size_t n = size_t(cfg.n_layer) * cfg.n_head_kv * cfg.n_pages;
  data_ = ZeroedArray<uint8_t>(n * blob_bytes_);
  valid_ = ZeroedArray<uint8_t>(n);
}

void EstimatingSelector::do_select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) {
  std::vector<float> log_mass;
  const size_t bytes = estimate(cache, req, log_mass);
  const int n_pages = req.seq->n_pages();
  select_top_pages(log_mass.data(), req.n_group, n_pages, req.budget_pages, rule_, out.pages);
  out.bytes_read = bytes;
  out.all_pages = int(out.pages.size()) == n_pages;
  if (req.want_estimates)
    out.log_mass = std::move(log_mass);
  else
    out.log_mass.clear();
}

size_t exact_page_estimate(const PagedKvCache& cache, const SelectionRequest& req, int j, bool max_logit,
                           std::vector<float>& keys, float* log_mass) {
  const auto& cfg = cache.config();
  const int d = cfg.head_dim, B = cfg.page_size, n_pages = req.seq->n_pages();
  const int n_tok = page_tokens(*req.seq, j, B);
  const float scale = 1.0f / std::sqrt(float(d));
  keys.resize(size_t(B) * d);
  cache.k_page_f32(req.il, req.seq->page_table[j], req.kv_head, keys.data());
  for (int g = 0; g < req.n_group; ++g) {
    const float* q = req.q + size_t(g) * d;
    float v;
    if (max_logit) {
      double m = -INFINITY;  // no keys: -inf (share 0)
      for (int i = 0; i < n_tok; ++i) {
        double acc = 0.0;
        for (int c = 0; c < d; ++c) acc += double(q[c]) * keys[size_t(i) * d + c];
        m = std::max(m, acc * scale);
      }
      v = float(m);
    } else {
      v = exact_log_mass(keys.data(), n_tok, q, d, scale);
    }
    log_mass[size_t(g) * n_pages + j] = v;
  }
  return cache.kv_bytes(n_tok) / 2;  // K only
}

}  // namespace locks
