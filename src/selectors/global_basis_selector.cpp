// `global-basis` (Loki's scope, Singhania et al. 2024): one rank-rho basis per (layer, KV head),
// calibrated once offline on other text (calibrate_global_basis: PCA of the centered keys of a
// calibration sequence) and shared by every sequence. Each page stores its centroid mu_j and the
// coefficients c_i = V (k_i - mu_j) of its tokens in that basis and is scored with Eq. 4:
//   s_hat_j(q) = logsumexp_i (q.mu_j + (V q).c_i) / sqrt(d).
// rho may be smaller than the calibrated rank (the leading rho directions are used). Bytes read per
// step: the basis once (rho * d * 4) plus shared_basis_page_bytes() per page with metadata.
#include <fmt/format.h>

#include <stdexcept>
#include <utility>

#include "selectors/selectors.h"

namespace locks {

GlobalBasisSelector::GlobalBasisSelector(const KvCacheConfig& cfg, const SummaryFormat& fmt, int rho,
                                         std::shared_ptr<const GlobalBasis> basis, GroupRule rule)
    : EstimatingSelector(rule), global_(std::move(basis)), pages_(cfg, rho, fmt.coef_bits, fmt.centroid_bits) {
  if (!global_)
    throw std::invalid_argument(
        "selector 'global-basis' needs a calibrated basis: set SelectorOptions::global_basis "
        "(calibrate_global_basis on a calibration sequence)");
  const GlobalBasis& g = *global_;
  if (g.n_layer != cfg.n_layer || g.n_head_kv != cfg.n_head_kv || g.head_dim != cfg.head_dim ||
      g.basis.size() != size_t(cfg.n_layer) * cfg.n_head_kv)
    throw std::invalid_argument(
        fmt::format("global-basis: calibrated for {} layers x {} KV heads x head_dim {}, cache has {} x {} x {}",
                    g.n_layer, g.n_head_kv, g.head_dim, cfg.n_layer, cfg.n_head_kv, cfg.head_dim));
  if (g.rank < rho)
    throw std::invalid_argument(fmt::format(
        "global-basis: the calibrated basis has rank {}, the selector needs rho = {} (calibrate with rank >= {})",
        g.rank, rho, rho));
  for (const auto& b : g.basis)
    if (b.size() != size_t(g.rank) * g.head_dim)
      throw std::invalid_argument(fmt::format("global-basis: a basis holds {} floats, expected rank {} x head_dim {}",
                                              b.size(), g.rank, g.head_dim));
}

void GlobalBasisSelector::do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) {
  for_each_page_head(cache, il, page_ids, [&](const float* keys, int l, int h, int32_t page) {
    pages_.build(l, h, page, keys, global_->of(l, h));  // the first rho rows
  });
}

size_t GlobalBasisSelector::estimate(const PagedKvCache& cache, const SelectionRequest& req,
                                     std::vector<float>& log_mass) {
  return pages_.estimate(global_->of(req.il, req.kv_head), cache, req, log_mass);
}

bool GlobalBasisSelector::reconstruct_keys(int il, int kv_head, int32_t page, float* out) const {
  return pages_.reconstruct(il, kv_head, page, global_->of(il, kv_head), out);
}

}  // namespace locks
