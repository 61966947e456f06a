// `locks`: Algorithm 2. Score every page from its summary alone (Eq. 4), per-head shares, GQA group
// average (Eq. 5), keep sink + recent + top-(k-2), or with an adaptive budget rule the fewest top
// pages whose estimated (top-p) or certified group share reaches a target.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "selectors/selectors.h"

namespace locks {

LocksSelector::LocksSelector(const KvCacheConfig& cfg, const SummaryFormat& fmt, GroupRule rule,
                             const BudgetRule& budget_rule)
    : store_(fmt, cfg.n_layer, cfg.n_head_kv, cfg.n_pages, cfg.page_size, cfg.head_dim),
      rule_(rule),
      budget_rule_(budget_rule) {
  if (budget_rule.kind == BudgetRule::Kind::kFixed) return;
  if (!(budget_rule.mass > 0 && budget_rule.mass < 1))
    throw std::invalid_argument(fmt::format("locks: target share {} outside (0, 1)", budget_rule.mass));
  if (budget_rule.min_tokens < 0)
    throw std::invalid_argument(fmt::format("locks: minimum budget {} tokens is negative", budget_rule.min_tokens));
  if (rule != GroupRule::kShareAverage)
    throw std::invalid_argument(
        fmt::format("locks: an adaptive budget reaches a share-average group share (Eq. 5); the group rule must be "
                    "share-average, not {}",
                    group_rule_name(rule)));
}

std::string LocksSelector::name() const { return "locks"; }

void LocksSelector::do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) {
  // Alg. 1 for every (page, KV head): independent, so batched across cores.
  const auto& cfg = cache.config();
  for_each_page_head(cache, il, page_ids, [&](const float* keys, int l, int h, int32_t page) {
    store_.store(l, h, page, build_page_summary(keys, cfg.page_size, cfg.head_dim, store_.format().rank), keys);
  });
}

void LocksSelector::do_select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) {
  const auto& cfg = cache.config();
  const int d = cfg.head_dim, B = cfg.page_size, n_pages = req.seq->n_pages(), G = req.n_group;
  const float scale = 1.0f / std::sqrt(float(d));
  const auto t0 = std::chrono::steady_clock::now();
  // select() runs concurrently for a layer's KV heads: per-call buffers are thread-local, not members.
  const bool certified = budget_rule_.kind == BudgetRule::Kind::kCertified;
  thread_local std::vector<float> log_mass, bound, keys;
  thread_local std::vector<int32_t> ids;
  log_mass.resize(size_t(G) * n_pages);  // [G][n_pages]
  // Pages with a summary: a prefix of the page table in a decode (every full page), scored in one
  // stream straight into log_mass; the rest (the partial recent page) from their keys.
  const int n_full = n_pages > 0 && page_tokens(*req.seq, n_pages - 1, B) < B ? n_pages - 1 : n_pages;
  const std::span<const int32_t> table(req.seq->page_table.data(), size_t(n_full));
  const int n_scored = int(store_.stored_prefix(req.il, req.kv_head, table));
  ids.assign(table.begin(), table.begin() + n_scored);
  store_.score_pages(req.il, req.kv_head, ids, req.q, G, scale, log_mass.data(), size_t(n_pages));  // Eq. 4
  size_t bytes = size_t(n_scored) * store_.summary_bytes();
  if (certified) {  // |s - s_hat| per head and page; the exactly scored partial page has none
    bound.assign(size_t(G) * n_pages, 0.0f);
    store_.log_mass_error_bounds(req.il, req.kv_head, ids, req.q, G, scale, bound.data(), size_t(n_pages));
    bytes += size_t(n_scored) * PageSummaryStore::bound_bytes();
  }
  for (int j = n_scored; j < n_pages; ++j) {
    const int32_t page = req.seq->page_table[j];
    if (store_.has(req.il, req.kv_head, page) && page_tokens(*req.seq, j, B) == B) {
      float tmp[1];
      for (int g = 0; g < G; ++g) {
        store_.score(req.il, req.kv_head, page, req.q + size_t(g) * d, 1, scale, tmp);
        log_mass[size_t(g) * n_pages + j] = tmp[0];
        if (certified)
          bound[size_t(g) * n_pages + j] =
              store_.log_mass_error_bound(req.il, req.kv_head, page, req.q + size_t(g) * d, scale);
      }
      bytes += store_.summary_bytes() + (certified ? PageSummaryStore::bound_bytes() : 0);
    } else {
      // The partial recent page has no summary yet: its exact log-mass (<= B-1 keys, which
      // attention reads anyway) keeps the per-head share normalisation honest.
      const int n_tok = page_tokens(*req.seq, j, B);
      keys.resize(size_t(B) * d);
      cache.k_page_f32(req.il, page, req.kv_head, keys.data());
      bytes += cache.kv_bytes(n_tok) / 2;
      for (int g = 0; g < G; ++g)
        log_mass[size_t(g) * n_pages + j] = exact_log_mass(keys.data(), n_tok, req.q + size_t(g) * d, d, scale);
    }
  }
  out.score_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (budget_rule_.kind == BudgetRule::Kind::kFixed) {
    select_top_pages(log_mass.data(), G, n_pages, req.budget_pages, rule_, out.pages);
  } else {
    const int min_pages = (budget_rule_.min_tokens + B - 1) / B;
    out.mass_target_met = select_pages_by_mass(log_mass.data(), certified ? bound.data() : nullptr, G, n_pages,
                                               min_pages, req.budget_pages, budget_rule_.mass, out.pages);
  }
  out.bytes_read = bytes;
  out.all_pages = int(out.pages.size()) == n_pages;
  if (req.want_estimates) out.log_mass.assign(log_mass.begin(), log_mass.end());
}

bool LocksSelector::reconstruct_keys(int il, int kv_head, int32_t page, float* out) const {
  if (!store_.has(il, kv_head, page)) return false;
  const PageSummaryF32 s = store_.load(il, kv_head, page);
  const int r = store_.format().rank, d = int(s.centroid.size()), B = int(s.coef.size()) / r;
  // k_i = mu + sum_k c_ik V_k, accumulated in k order, vectorized over channels.
  for (int i = 0; i < B; ++i) {
    float* row = out + size_t(i) * d;
    std::copy_n(s.centroid.data(), d, row);
    for (int k = 0; k < r; ++k) {
      const float cik = s.coef[size_t(i) * r + k];
      const float* vk = &s.basis[size_t(k) * d];
#pragma omp simd
      for (int c = 0; c < d; ++c) row[c] += cik * vk[c];
    }
  }
  return true;
}

}  // namespace locks
