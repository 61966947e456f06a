#include "locks/fidelity.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "locks/attention.h"
#include "locks/math.h"
#include "locks/page_summary.h"

namespace locks {

namespace {

double nan_div(double a, double b) { return b > 0 ? a / b : std::numeric_limits<double>::quiet_NaN(); }

}  // namespace

std::vector<double> average_ranks(std::span<const double> x) {
  std::vector<size_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return x[a] < x[b]; });
  std::vector<double> r(x.size());
  for (size_t i = 0; i < idx.size();) {
    size_t j = i;
    while (j + 1 < idx.size() && x[idx[j + 1]] == x[idx[i]]) ++j;
    for (size_t t = i; t <= j; ++t) r[idx[t]] = 0.5 * double(i + j);
    i = j + 1;
  }
  return r;
}

double pearson_correlation(std::span<const double> a, std::span<const double> b) {
  const size_t n = a.size();
  if (n < 2 || b.size() != n) return std::numeric_limits<double>::quiet_NaN();
  const double ma = std::accumulate(a.begin(), a.end(), 0.0) / n, mb = std::accumulate(b.begin(), b.end(), 0.0) / n;
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < n; ++i) {
    sab += (a[i] - ma) * (b[i] - mb);
    saa += (a[i] - ma) * (a[i] - ma);
    sbb += (b[i] - mb) * (b[i] - mb);
  }
  return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : std::numeric_limits<double>::quiet_NaN();
}

double spearman_correlation(std::span<const float> a, std::span<const float> b) {
  if (a.size() < 2 || b.size() != a.size()) return std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> da(a.begin(), a.end()), db(b.begin(), b.end());
  return pearson_correlation(average_ranks(da), average_ranks(db));
}

void FidelityStats::add(const FidelityStats& o) {
  obs += o.obs;
  lse_abs_err += o.lse_abs_err;
  lse_n += o.lse_n;
  logit_abs_err += o.logit_abs_err;
  logit_n += o.logit_n;
  spearman += o.spearman;
  spearman_n += o.spearman_n;
  coverage += o.coverage;
  worst_head_coverage += o.worst_head_coverage;
  oracle_coverage += o.oracle_coverage;
  output_rel_err += o.output_rel_err;
  output_n += o.output_n;
  carrier_obs += o.carrier_obs;
  carrier_kept += o.carrier_kept;
  carrier_any_obs += o.carrier_any_obs;
  carrier_any_kept += o.carrier_any_kept;
}

FidelityStats::Means FidelityStats::mean() const {
  return {nan_div(lse_abs_err, lse_n),
          nan_div(logit_abs_err, logit_n),
          nan_div(spearman, spearman_n),
          nan_div(coverage, obs),
          nan_div(worst_head_coverage, obs),
          nan_div(oracle_coverage, obs),
          nan_div(output_rel_err, output_n),
          nan_div(carrier_kept, carrier_obs),
          nan_div(carrier_any_kept, carrier_any_obs)};
}

void FidelityProbe::observe(const PagedKvCache& cache, const KvSequence& seq, const Selector& selector, int il,
                            int kv_head, const float* q, int G, int budget_pages, const Selection& sel) {
  const auto& cfg = cache.config();
  const int d = cfg.head_dim, B = cfg.page_size, n_pages = seq.n_pages();
  const float scale = 1.0f / std::sqrt(float(d));
  const size_t slot = size_t(il) * cfg.n_head_kv + kv_head;
  FidelityStats st;
  st.obs = 1;

  // Exact page log-mass s_j(q_g) for every page and head (reads all keys) and the selector's
  // per-token reconstruction where it has one.
  const size_t block = size_t(d) * B;
#pragma omp critical(locks_fidelity_probe)
  {
    if (recon_owner_ != &selector) {  // reconstruction errors belong to one selector
      recon_.clear();
      recon_owner_ = &selector;
    }
    if (recon_.size() < size_t(cfg.n_layer) * cfg.n_head_kv) recon_.resize(size_t(cfg.n_layer) * cfg.n_head_kv);
  }
  ReconErrors& rec = recon_[slot];  // only this (layer, KV head)'s thread touches it
  if (rec.state.empty()) rec.state.assign(size_t(cfg.n_pages), 0);

  // One pass over the pages gives both the exact page log-mass and the dense attention output o: the
  // logits are computed once and used exactly as exact_log_mass and paged_decode_attention use them
  // (same loops, same order), so both results are bit-identical to those functions'.
  std::vector<float> exact(size_t(G) * n_pages), keys(size_t(B) * d), vals(size_t(B) * d), recon(size_t(B) * d);
  std::vector<float> o(size_t(G) * d, 0.0f), logits(B);
  std::vector<SoftmaxState> dense(G);
  std::vector<double> e(B);
  for (int j = 0; j < n_pages; ++j) {
    const int n_tok = page_tokens(seq, j, B);
    const int32_t page = seq.page_table[j];
    cache.k_page_f32(il, page, kv_head, keys.data());
    cache.v_page_f32(il, page, kv_head, vals.data());
    for (int g = 0; g < G; ++g) {
      const float* qg = q + size_t(g) * d;
      float mx = kNegInf;
      for (int i = 0; i < n_tok; ++i) {
        const float* k = keys.data() + size_t(i) * d;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int c = 0; c < d; ++c) acc += qg[c] * k[c];
        logits[i] = acc * scale;
        mx = std::max(mx, logits[i]);
      }
      SoftmaxState& sm = dense[g];  // online softmax over pages 0..n-1, as paged_decode_attention
      const float m_new = std::max(sm.m, mx);
      const float corr = sm.m == kNegInf ? 0.0f : fast_exp(sm.m - m_new);
      float* og = o.data() + size_t(g) * d;
      for (int x = 0; x < d; ++x) og[x] *= corr;
      float l = sm.l * corr;
      for (int i = 0; i < n_tok; ++i) {
        const float pi = fast_exp(logits[i] - m_new);
        l += pi;
        for (int x = 0; x < d; ++x) og[x] += pi * vals[size_t(i) * d + x];
      }
      sm.m = m_new;
      sm.l = l;
      // Last: exp_shift_sum overwrites the logits with their exponentials.
      exact[size_t(g) * n_pages + j] = n_tok > 0 ? mx + std::log(exp_shift_sum(logits.data(), n_tok, mx)) : kNegInf;
    }
    if (n_tok == B && rec.state[page] == 0) {
      rec.state[page] = 2;
      if (selector.reconstruct_keys(il, kv_head, page, recon.data())) {
        if (rec.diff_t.empty()) rec.diff_t.assign(size_t(cfg.n_pages) * block, 0.0f);
        float* diff_t = &rec.diff_t[size_t(page) * block];  // [d][B]
        for (int i = 0; i < B; ++i)
          for (int c = 0; c < d; ++c) diff_t[size_t(c) * B + i] = recon[size_t(i) * d + c] - keys[size_t(i) * d + c];
        rec.state[page] = 1;
      }
    }
    if (n_tok == B && rec.state[page] == 1) {
      // e_i = q_g.(k_hat_i - k_i) in float64, summed in channel order; the errors are transposed
      // ([d][B]) so that one pass over the channels serves all B tokens.
      const float* diff_t = &rec.diff_t[size_t(page) * block];
      for (int g = 0; g < G; ++g) {
        std::fill(e.begin(), e.end(), 0.0);
        for (int c = 0; c < d; ++c) {
          const double qc = q[size_t(g) * d + c];
          const float* dc = &diff_t[size_t(c) * B];
#pragma omp simd
          for (int i = 0; i < B; ++i) e[i] += qc * double(dc[i]);
        }
        for (int i = 0; i < B; ++i) {
          st.logit_abs_err += std::abs(e[i]) * scale;
          st.logit_n += 1;
        }
      }
    }
  }
  // Summary accuracy and ranking: full pages the selector estimated (the partial page is exact).
  if (!sel.log_mass.empty()) {
    const int n_full = seq.n_tokens / B;
    for (int g = 0; g < G; ++g) {
      const float* est = &sel.log_mass[size_t(g) * n_pages];
      const float* ex = &exact[size_t(g) * n_pages];
      for (int j = 0; j < n_full; ++j) {
        st.lse_abs_err += std::abs(double(est[j]) - ex[j]);
        st.lse_n += 1;
      }
      const double rho = spearman_correlation({est, size_t(n_full)}, {ex, size_t(n_full)});
      if (!std::isnan(rho)) {
        st.spearman += rho;
        st.spearman_n += 1;
      }
    }
  }
  // Coverage gamma_S per head: exp(LSE over S - LSE over all), and the exact-mass selection's.
  std::vector<int32_t> oracle_pages;
  select_top_pages(exact.data(), G, n_pages, budget_pages, GroupRule::kShareAverage, oracle_pages);
  std::vector<char> in_s(n_pages, 0), in_o(n_pages, 0);
  for (int32_t j : sel.pages) in_s[j] = 1;
  for (int32_t j : oracle_pages) in_o[j] = 1;
  double cov_sum = 0, cov_min = 1, ocov_sum = 0;
  std::vector<double> group_share(n_pages, 0.0), w(n_pages);  // exact group-average share (Eq. 5)
  for (int g = 0; g < G; ++g) {
    const float* ex = &exact[size_t(g) * n_pages];
    const float mx = max_of(ex, n_pages);
    double z = 0, zs = 0, zo = 0;
    for (int j = 0; j < n_pages; ++j) {
      w[j] = std::exp(double(ex[j]) - mx);
      z += w[j];
      if (in_s[j]) zs += w[j];
      if (in_o[j]) zo += w[j];
    }
    for (int j = 0; j < n_pages; ++j) group_share[j] += w[j] / z / G;
    cov_sum += zs / z;
    cov_min = std::min(cov_min, zs / z);
    ocov_sum += zo / z;
  }
  st.coverage = cov_sum / G;
  st.worst_head_coverage = cov_min;
  st.oracle_coverage = ocov_sum / G;

  // Carrier retention: pages holding the carrier tokens.
  std::vector<int> carrier_pages;
  for (int32_t pos : carrier_positions_)
    if (pos >= 0 && pos < seq.n_tokens &&
        std::find(carrier_pages.begin(), carrier_pages.end(), pos / B) == carrier_pages.end())
      carrier_pages.push_back(pos / B);
  for (const int j : carrier_pages) {
    st.carrier_any_obs += 1;
    st.carrier_any_kept += in_s[j];
    if (group_share[j] >= threshold_) {
      st.carrier_obs += 1;
      st.carrier_kept += in_s[j];
    }
  }

  // Output error of attention restricted to S against dense attention (Eq. 1's left side).
  for (int g = 0; g < G; ++g) {
    float* og = o.data() + size_t(g) * d;
    const float inv = dense[g].l > 0.0f ? 1.0f / dense[g].l : 0.0f;
    for (int x = 0; x < d; ++x) og[x] *= inv;
  }
  std::vector<float> os(size_t(G) * d);
  paged_decode_attention(cache, il, kv_head, seq, sel.pages, q, G, scale, os.data(), nullptr);
  for (int g = 0; g < G; ++g) {
    double num = 0, den = 0;
    for (int c = 0; c < d; ++c) {
      const double a = o[size_t(g) * d + c], b = os[size_t(g) * d + c];
      num += (a - b) * (a - b);
      den += a * a;
    }
    if (den > 0) {
      st.output_rel_err += std::sqrt(num / den);
      st.output_n += 1;
    }
  }
#pragma omp critical(locks_fidelity_probe)
  {
    if (per_head_.size() <= slot) per_head_.resize(size_t(cfg.n_layer) * cfg.n_head_kv);
    per_head_[slot].add(st);
  }
}

FidelityStats FidelityProbe::total() const {
  FidelityStats t;
  for (const auto& s : per_head_) t.add(s);
  return t;
}

}  // namespace locks
