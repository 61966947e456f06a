// `locks`: Algorithm 2. Score every page from its summary alone (Eq. 4), per-head shares, GQA group
// average (Eq. 5), keep sink + recent + top-(k-2), or with an adaptive budget rule the fewest top
// pages whose estimated (top-p) or certified group share reaches a target.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "selectors/selectors.h"

namespace locks {

LocksSelector::LocksSelector(const KvCacheConfig& cfg, const SummaryFormat& fmt, GroupRule rule,
                             const BudgetRule& budget_rule, double rank_bytes)
    : store_(fmt, cfg.n_layer, cfg.n_head_kv, cfg.n_pages, cfg.page_size, cfg.head_dim),
      rule_(rule),
      budget_rule_(budget_rule),
      rank_bytes_(rank_bytes),
      n_head_kv_(cfg.n_head_kv),
      tail_profiles_(size_t(cfg.n_layer) * cfg.n_head_kv) {
  if (rank_bytes != 0 && !(rank_bytes > 0 && rank_bytes < 1))
    throw std::invalid_argument(fmt::format("locks: rank bytes {} outside (0, 1)", rank_bytes));
  if (const double floor = double(store_.bytes_at_rank(1)) / double(store_.summary_bytes());
      rank_bytes > 0 && rank_bytes < floor)
    throw std::invalid_argument(
        fmt::format("locks: bytes={:g} is below what every page at rank 1 takes ({:.3f} of the rank-{} format's bytes)",
                    rank_bytes, floor, fmt.rank));
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
  if (rank_bytes_ == 0) {
    for_each_page_head(cache, il, page_ids, [&](const float* keys, int l, int h, int32_t page) {
      store_.store(l, h, page, build_page_summary(keys, cfg.page_size, cfg.head_dim, store_.format().rank), keys);
    });
    return;
  }
  // Per-page ranks: build everything, choose each head's ranks from the spectra, then store.
  const size_t n = page_ids.size(), H = size_t(cfg.n_head_kv);
  std::vector<PageSummaryF32> built(n * H);
  std::vector<std::vector<float>> keys(n * H);
  std::unordered_map<int32_t, size_t> slot;  // page id -> position in page_ids
  for (size_t p = 0; p < n; ++p) slot.emplace(page_ids[p], p);
  for_each_page_head(cache, il, page_ids, [&](const float* k, int, int h, int32_t page) {
    const size_t t = slot.at(page) * H + size_t(h);
    keys[t].assign(k, k + size_t(cfg.page_size) * cfg.head_dim);
    built[t] = build_page_summary(k, cfg.page_size, cfg.head_dim, store_.format().rank);
  });
  std::vector<std::vector<int>> ranks(H);
  for (size_t h = 0; h < H; ++h) {
    std::vector<const PageSummaryF32*> head;
    for (size_t p = 0; p < n; ++p) head.push_back(&built[p * H + h]);
    ranks[h] = choose_ranks(il, int(h), head);
  }
  parallel_for(
      int(n * H),
      [&](int t) {
        store_.store(il, t % int(H), page_ids[size_t(t) / H], built[size_t(t)], keys[size_t(t)].data(),
                     ranks[size_t(t) % H][size_t(t) / H]);
      },
      /*min_parallel=*/9, /*dynamic_chunk=*/4);
}

std::vector<int> LocksSelector::choose_ranks(int il, int h, const std::vector<const PageSummaryF32*>& pages) {
  const int R = store_.format().rank;
  std::vector<float>& prof = tail_profiles_[size_t(il) * n_head_kv_ + h];
  // sqrt(tau_{j,r}) for r = 1..R (non-increasing in r), from the page's eigenvalues.
  for (const PageSummaryF32* s : pages) {
    double tail = 0;
    for (size_t k = size_t(R); k < s->sigma2.size(); ++k) tail += s->sigma2[k];
    std::vector<float> p(static_cast<size_t>(R));
    for (int r = R; r >= 1; --r) {
      p[size_t(r - 1)] = float(std::sqrt(tail));
      if (size_t(r - 1) < s->sigma2.size()) tail += s->sigma2[size_t(r - 1)];
    }
    prof.insert(prof.end(), p.begin(), p.end());
  }
  // The threshold follows the most recent pages (bounded work per filled page on long sequences).
  constexpr size_t kHistory = 4096;
  if (const size_t keep = std::max(kHistory, pages.size()) * size_t(R); prof.size() > keep)
    prof.erase(prof.begin(), prof.end() - std::ptrdiff_t(keep));
  const size_t n_seen = prof.size() / size_t(R);
  // The rank of a page under threshold theta: the smallest r with sqrt(tau_r) <= theta (R at most).
  const auto rank_at = [&](size_t j, float theta) {
    for (int r = 1; r < R; ++r)
      if (prof[j * R + size_t(r - 1)] <= theta) return r;
    return R;
  };
  // Mean bytes over every page seen is non-increasing in theta: the smallest theta meeting the target,
  // by bisection over the profile values.
  std::vector<float> cand(prof.begin(), prof.end());
  cand.push_back(0.0f);
  std::sort(cand.begin(), cand.end());
  cand.erase(std::unique(cand.begin(), cand.end()), cand.end());
  const double target = rank_bytes_ * double(store_.summary_bytes());
  const auto mean_bytes = [&](float theta) {
    double b = 0;
    for (size_t j = 0; j < n_seen; ++j) b += double(store_.bytes_at_rank(rank_at(j, theta)));
    return b / double(n_seen);
  };
  size_t lo = 0, hi = cand.size() - 1;  // mean_bytes(cand[hi]) is the least (every page at rank 1 or exact)
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (mean_bytes(cand[mid]) <= target)
      hi = mid;
    else
      lo = mid + 1;
  }
  std::vector<int> out;
  for (size_t j = n_seen - pages.size(); j < n_seen; ++j) out.push_back(rank_at(j, cand[lo]));
  return out;
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
  size_t bytes = 0;
  if (rank_bytes_ > 0)
    for (int j = 0; j < n_scored; ++j) bytes += store_.page_bytes(req.il, req.kv_head, ids[size_t(j)]);
  else
    bytes = size_t(n_scored) * store_.summary_bytes();
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
      bytes += store_.page_bytes(req.il, req.kv_head, page) + (certified ? PageSummaryStore::bound_bytes() : 0);
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
