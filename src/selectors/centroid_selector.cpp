// `centroid`: the page mean only. Treating every key of the page as its mean mu_j gives the page
// log-mass estimate
//   s_hat_j(q) = log sum_i exp(q.mu_j / sqrt(d)) = q.mu_j / sqrt(d) + log(B),
// the rank-0 case of Eq. 4 (LOCKS without basis and coefficients). By Jensen it never exceeds the
// exact page LSE. Stored per (page, KV head): mu_j at centroid_bits, as LOCKS stores its centroid
// (8: int8 codes + one f16 scale, d + 2 bytes; 32: float32, 4d bytes).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "locks/math.h"
#include "selectors/qvec.h"
#include "selectors/selectors.h"

namespace locks {

size_t CentroidSelector::page_bytes(int head_dim, int centroid_bits) {
  return qvec::bytes(size_t(head_dim), centroid_bits);
}

CentroidSelector::CentroidSelector(const KvCacheConfig& cfg, int centroid_bits, GroupRule rule)
    : EstimatingSelector(rule), centroid_bits_(centroid_bits), d_(cfg.head_dim), B_(cfg.page_size) {
  if (centroid_bits != 32 && centroid_bits != 8)
    throw std::invalid_argument(fmt::format("centroid precision {} bits: expected 32 or 8", centroid_bits));
  store_ = PageBlobStore(cfg, page_bytes(cfg.head_dim, centroid_bits));
}

void CentroidSelector::do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) {
  const int B = cache.page_size(), d = cache.config().head_dim;
  for_each_page_head(cache, il, page_ids, [&](const float* keys, int l, int h, int32_t page) {
    std::vector<double> mu(d, 0.0);
    for (int i = 0; i < B; ++i)
      for (int c = 0; c < d; ++c) mu[c] += keys[size_t(i) * d + c];
    std::vector<float> muf(d);
    for (int c = 0; c < d; ++c) muf[c] = float(mu[c] / B);
    qvec::encode(muf.data(), d, centroid_bits_, store_.blob(l, h, page), "centroid");
    store_.set_valid(l, h, page);
  });
}

bool CentroidSelector::reconstruct_keys(int il, int kv_head, int32_t page, float* out) const {
  if (!store_.has(il, kv_head, page)) return false;
  qvec::decode(store_.blob(il, kv_head, page), d_, centroid_bits_, out);
  for (int i = 1; i < B_; ++i) std::copy_n(out, d_, out + size_t(i) * d_);
  return true;
}

size_t CentroidSelector::estimate(const PagedKvCache& cache, const SelectionRequest& req,
                                  std::vector<float>& log_mass) {
  const auto& cfg = cache.config();
  const int d = cfg.head_dim, B = cfg.page_size, n_pages = req.seq->n_pages(), G = req.n_group;
  const float scale = 1.0f / std::sqrt(float(d)), log_b = std::log(float(B));
  log_mass.assign(size_t(G) * n_pages, kNegInf);
  std::vector<float> mu(d), keys;
  size_t bytes = 0;
  for (int j = 0; j < n_pages; ++j) {
    const int32_t page = req.seq->page_table[j];
    if (!store_.has(req.il, req.kv_head, page) || page_tokens(*req.seq, j, B) != B) {
      bytes += exact_page_estimate(cache, req, j, /*max_logit=*/false, keys, log_mass.data());
      continue;
    }
    qvec::decode(store_.blob(req.il, req.kv_head, page), d, centroid_bits_, mu.data());
    bytes += store_.blob_bytes();
    for (int g = 0; g < G; ++g) {
      const float* q = req.q + size_t(g) * d;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int c = 0; c < d; ++c) acc += q[c] * mu[c];
      log_mass[size_t(g) * n_pages + j] = acc * scale + log_b;
    }
  }
  return bytes;
}

}  // namespace locks
