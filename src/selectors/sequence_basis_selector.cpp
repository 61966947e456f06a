// `sequence-basis` (ShadowKV's scope, Sun et al. 2024): one rank-rho basis per (sequence, layer, KV
// head) instead of one per page. The basis is the PCA of the centered post-RoPE keys of every full
// page present when the (layer, KV head) is first scored — after a dense prefill, the prefill keys
// (ShadowKV factorises pre-RoPE keys; the scope, one basis per sequence, is what this baseline
// tests). Each page then stores its centroid mu_j and the coefficients c_i = V (k_i - mu_j) of its
// tokens in the shared basis, and is scored with Eq. 4:
//   s_hat_j(q) = logsumexp_i (q.mu_j + (V q).c_i) / sqrt(d).
// Pages filled after the fit are projected on the existing basis. Bytes read per step: the shared
// basis once (rho * d * 4) plus shared_basis_page_bytes() per page with metadata; the one-time fit
// reads the prefill keys once (a prefill cost, like building LOCKS summaries) and is not counted.
#include <vector>

#include "selectors/selectors.h"

namespace locks {

SequenceBasisSelector::SequenceBasisSelector(const KvCacheConfig& cfg, const SummaryFormat& fmt, int rho,
                                             GroupRule rule)
    : EstimatingSelector(rule),
      n_layer_(cfg.n_layer),
      n_head_kv_(cfg.n_head_kv),
      pages_(cfg, rho, fmt.coef_bits, fmt.centroid_bits),
      basis_(size_t(cfg.n_layer) * cfg.n_head_kv),
      fit_pages_(size_t(cfg.n_layer) * cfg.n_head_kv, -1),
      fit_used_(size_t(cfg.n_layer) * cfg.n_head_kv, 0) {}

void SequenceBasisSelector::fit(const PagedKvCache& cache, const KvSequence& seq, int il, int h) {
  const int B = cache.page_size(), d = cache.config().head_dim;
  const int n_full = seq.n_tokens / B;
  if (n_full == 0) return;  // nothing to fit on yet: pages are scored exactly until there is
  std::vector<float> keys(size_t(n_full) * B * d);
  for (int j = 0; j < n_full; ++j) cache.k_page_f32(il, seq.page_table[j], h, &keys[size_t(j) * B * d]);
  std::vector<float> basis = pca_key_basis(keys.data(), size_t(n_full) * B, d, pages_.rank());
  for (int j = 0; j < n_full; ++j) pages_.build(il, h, seq.page_table[j], &keys[size_t(j) * B * d], basis.data());
  basis_[size_t(il) * n_head_kv_ + h] = std::move(basis);
  fit_pages_[size_t(il) * n_head_kv_ + h] = n_full;
}

void SequenceBasisSelector::prepare_for_decode(const PagedKvCache& cache, const KvSequence& seq) {
  // The fit the first select() would make, done once here so that clones share it: the prefill's
  // full pages are final, so fitting them now or at the first select() gives the same basis and
  // coefficients. estimate() refits if the full pages changed in between.
  const int n = n_layer_ * n_head_kv_;
  parallel_for(
      n,
      [&](int t) {
        if (!fit_used_[t]) fit(cache, seq, t / n_head_kv_, t % n_head_kv_);
      },
      2, /*dynamic_chunk=*/1);
}

void SequenceBasisSelector::do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) {
  // Before the fit nothing is built: the fit projects every full page of the sequence.
  bool any_fitted = false;
  for (int h = 0; h < n_head_kv_; ++h) any_fitted = any_fitted || !basis_[size_t(il) * n_head_kv_ + h].empty();
  if (!any_fitted) return;
  for_each_page_head(cache, il, page_ids, [&](const float* keys, int l, int h, int32_t page) {
    const auto& basis = basis_[size_t(l) * n_head_kv_ + h];
    if (!basis.empty()) pages_.build(l, h, page, keys, basis.data());
  });
}

size_t SequenceBasisSelector::estimate(const PagedKvCache& cache, const SelectionRequest& req,
                                       std::vector<float>& log_mass) {
  // Only this KV head's slot is written here, so concurrent select() calls over heads are safe.
  const size_t slot = size_t(req.il) * n_head_kv_ + req.kv_head;
  auto& basis = basis_[slot];
  if (!fit_used_[slot]) {  // first select() of this head: fit on the full pages present now
    if (basis.empty() || fit_pages_[slot] != req.seq->n_tokens / cache.page_size())
      fit(cache, *req.seq, req.il, req.kv_head);
    fit_used_[slot] = basis.empty() ? 0 : 1;
  }
  return pages_.estimate(basis.empty() ? nullptr : basis.data(), cache, req, log_mass);
}

bool SequenceBasisSelector::reconstruct_keys(int il, int kv_head, int32_t page, float* out) const {
  const auto& basis = basis_[size_t(il) * n_head_kv_ + kv_head];
  return pages_.reconstruct(il, kv_head, page, basis.empty() ? nullptr : basis.data(), out);
}

}  // namespace locks
