// `quest` (Tang et al., Quest, ICML 2024): per page and channel the key min and max; the score
//   U_j(q) = sum_c max(q_c max_{j,c}, q_c min_{j,c}) / sqrt(d)  >=  max_{i in page j} q.k_i / sqrt(d)
// is an upper bound of the page's max logit (each term bounds q_c k_{i,c} for every token i). It is
// used as the page's log-mass estimate in select_top_pages; note it is a bound of the max logit, not
// an estimate of the page LSE (which lies in [max logit, max logit + log B]).
// Stored per (page, KV head): d min then d max, f16, rounded outward (min down, max up) so the
// bound survives rounding: 2 * d * 2 = 4d bytes, all read at every step.
#include <fmt/format.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "locks/math.h"
#include "selectors/qvec.h"
#include "selectors/selectors.h"

namespace locks {

QuestSelector::QuestSelector(const KvCacheConfig& cfg, GroupRule rule)
    : EstimatingSelector(rule), store_(cfg, page_bytes(cfg.head_dim)) {}

void QuestSelector::do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) {
  const int B = cache.page_size(), d = cache.config().head_dim;
  for_each_page_head(cache, il, page_ids, [&](const float* keys, int l, int h, int32_t page) {
    f16_t* mm = reinterpret_cast<f16_t*>(store_.blob(l, h, page));  // [2][d]: min, max
    for (int c = 0; c < d; ++c) {
      float lo = keys[c], hi = keys[c];
      for (int i = 1; i < B; ++i) {
        lo = std::min(lo, keys[size_t(i) * d + c]);
        hi = std::max(hi, keys[size_t(i) * d + c]);
      }
      if (!(std::abs(lo) <= 65504.0f && std::abs(hi) <= 65504.0f))
        throw std::invalid_argument(
            fmt::format("quest: key channel {} of page {} (layer {}, KV head {}) beyond the f16 range", c, page, l, h));
      mm[c] = f16_round_down(lo);
      mm[d + c] = f16_round_up(hi);
    }
    store_.set_valid(l, h, page);
  });
}

size_t QuestSelector::estimate(const PagedKvCache& cache, const SelectionRequest& req, std::vector<float>& log_mass) {
  const auto& cfg = cache.config();
  const int d = cfg.head_dim, B = cfg.page_size, n_pages = req.seq->n_pages(), G = req.n_group;
  const float scale = 1.0f / std::sqrt(float(d));
  log_mass.assign(size_t(G) * n_pages, kNegInf);
  std::vector<float> mn(d), mx(d), keys;
  size_t bytes = 0;
  for (int j = 0; j < n_pages; ++j) {
    const int32_t page = req.seq->page_table[j];
    if (!store_.has(req.il, req.kv_head, page) || page_tokens(*req.seq, j, B) != B) {
      bytes += exact_page_estimate(cache, req, j, /*max_logit=*/true, keys, log_mass.data());
      continue;
    }
    const f16_t* mm = reinterpret_cast<const f16_t*>(store_.blob(req.il, req.kv_head, page));
    f16_to_f32_row(mm, mn.data(), d);
    f16_to_f32_row(mm + d, mx.data(), d);
    bytes += store_.blob_bytes();
    for (int g = 0; g < G; ++g) {
      const float* q = req.q + size_t(g) * d;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int c = 0; c < d; ++c) acc += std::max(q[c] * mx[c], q[c] * mn[c]);
      log_mass[size_t(g) * n_pages + j] = acc * scale;
    }
  }
  return bytes;
}

}  // namespace locks
