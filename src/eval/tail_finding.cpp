// The tail finding: the quantized summary's log-mass error per page at real decode steps, against
// the page properties known at build time (locks/tail_finding.h).
#include "locks/tail_finding.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <stdexcept>
#include <tuple>

#include "locks/fidelity.h"

namespace locks {

std::array<double, kTailProperties> tail_properties(const TailPage& p) {
  return {p.norm_range, p.gap, p.tail_frac, p.resid, p.position};
}

const std::array<const char*, kTailProperties>& tail_property_names() {
  static const std::array<const char*, kTailProperties> names = {"norm_range", "gap", "tail_frac", "resid", "position"};
  return names;
}

TailProbe::TailProbe(const PagedKvCache& cache, const KvSequence& seq, const SummaryFormat& fmt) {
  const auto& cfg = cache.config();
  const int B = cfg.page_size, d = cfg.head_dim, r = fmt.rank;
  fmt.validate(B, d);
  n_head_kv_ = cfg.n_head_kv;
  n_pages_ = seq.n_tokens / B;
  if (n_pages_ < 1) throw std::invalid_argument("tail finding: the sequence has no full page");
  page_ids_.assign(seq.page_table.begin(), seq.page_table.begin() + n_pages_);
  store_ = PageSummaryStore(fmt, cfg.n_layer, cfg.n_head_kv, cfg.n_pages, B, d);
  pages_.resize(size_t(cfg.n_layer) * n_head_kv_ * n_pages_);
  const int n = cfg.n_layer * n_head_kv_ * n_pages_;
#pragma omp parallel for schedule(dynamic, 16)
  for (int t = 0; t < n; ++t) {
    const int il = t / (n_head_kv_ * n_pages_), h = t / n_pages_ % n_head_kv_, j = t % n_pages_;
    std::vector<float> keys(size_t(B) * d);
    cache.k_page_f32(il, page_ids_[size_t(j)], h, keys.data());
    const PageSummaryF32 s = build_page_summary(keys.data(), B, d, r);
    store_.store(il, h, page_ids_[size_t(j)], s, keys.data());
    TailPage& p = pages_[size_t(t)];
    p.layer = il, p.kv_head = h, p.page = j;
    double n_max = 0, n_min = INFINITY;
    for (int i = 0; i < B; ++i) {
      double n2 = 0;
      for (int c = 0; c < d; ++c) n2 += double(keys[size_t(i) * d + c]) * keys[size_t(i) * d + c];
      n_max = std::max(n_max, std::sqrt(n2)), n_min = std::min(n_min, std::sqrt(n2));
    }
    p.norm_range = n_min > 0 ? n_max / n_min : INFINITY;
    const double energy = std::accumulate(s.sigma2.begin(), s.sigma2.end(), 0.0);
    const double above = r < int(s.sigma2.size()) ? s.sigma2[size_t(r)] : 0.0, at = s.sigma2[size_t(r - 1)];
    // No (r+1)-th direction with energy (rank >= the page's): the gap is undefined, not large.
    p.gap = above > 0 ? std::sqrt(at / above) : std::numeric_limits<double>::quiet_NaN();
    p.tail_frac = energy > 0 ? s.tail / energy : 0.0;
    // The residual the store recorded (its bound term), recomputed here in float64 for the report.
    const PageSummaryF32 st = store_.load(il, h, page_ids_[size_t(j)]);
    double resid = 0;
    for (int i = 0; i < B; ++i) {
      double e2 = 0;
      for (int c = 0; c < d; ++c) {
        double k_hat = st.centroid[c];
        for (int k = 0; k < r; ++k) k_hat += double(st.coef[size_t(i) * r + k]) * st.basis[size_t(k) * d + c];
        e2 += (keys[size_t(i) * d + c] - k_hat) * (keys[size_t(i) * d + c] - k_hat);
      }
      resid = std::max(resid, std::sqrt(e2));
    }
    p.resid = resid;
    p.position = n_pages_ > 1 ? double(j) / (n_pages_ - 1) : 0.0;
  }
}

void TailProbe::observe(const PagedKvCache& cache, const KvSequence&, const Selector&, int il, int kv_head,
                        const float* q, int n_group, int, const Selection&) {
  const auto& cfg = cache.config();
  const int B = cfg.page_size, d = cfg.head_dim;
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<float> est(size_t(n_group) * n_pages_), keys(size_t(B) * d);
  store_.score_pages(il, kv_head, page_ids_, q, n_group, scale, est.data(), size_t(n_pages_));
  TailPage* row = &pages_[(size_t(il) * n_head_kv_ + kv_head) * n_pages_];
  for (int j = 0; j < n_pages_; ++j) {
    cache.k_page_f32(il, page_ids_[size_t(j)], kv_head, keys.data());
    for (int g = 0; g < n_group; ++g) {
      const double err =
          std::abs(double(est[size_t(g) * n_pages_ + j]) - exact_log_mass(keys.data(), B, q + size_t(g) * d, d, scale));
      row[j].err_mean += err;
      row[j].err_max = std::max(row[j].err_max, err);
      ++row[j].queries;
    }
  }
}

std::vector<TailPage> TailProbe::pages() const {
  std::vector<TailPage> out = pages_;
  for (auto& p : out) p.err_mean = p.queries ? p.err_mean / double(p.queries) : 0.0;
  return out;
}

TailSummary summarize_tails(const std::vector<TailPage>& pages, const std::vector<int>& group_of) {
  if (pages.empty() || pages.size() != group_of.size())
    throw std::invalid_argument(
        fmt::format("summarize_tails: {} pages with {} group ids", pages.size(), group_of.size()));
  TailSummary s;
  s.pages = int64_t(pages.size());
  std::vector<double> errs;
  for (const auto& p : pages) errs.push_back(p.err_mean);
  std::vector<double> sorted = errs;
  std::sort(sorted.begin(), sorted.end());
  const auto q = [&](double f) { return sorted[std::min(sorted.size() - 1, size_t(f * double(sorted.size())))]; };
  s.err_mean = std::accumulate(errs.begin(), errs.end(), 0.0) / double(errs.size());
  s.err_p50 = q(0.5), s.err_p90 = q(0.9), s.err_p99 = q(0.99), s.err_max = sorted.back();

  std::map<std::tuple<int, int, int>, std::vector<size_t>> groups;
  for (size_t i = 0; i < pages.size(); ++i) groups[{group_of[i], pages[i].layer, pages[i].kv_head}].push_back(i);
  std::array<double, 10> decile_n{};
  std::array<std::array<double, kTailProperties>, 10> decile_prop_n{};
  std::array<int, kTailProperties> n_groups{};  // per property: groups where it is defined on every page
  for (const auto& [key, idx] : groups) {
    const size_t n = idx.size();
    if (n < 10) continue;  // too few pages for deciles
    std::vector<double> e(n);
    for (size_t i = 0; i < n; ++i) e[i] = pages[idx[i]].err_mean;
    const std::vector<double> re = average_ranks(e);
    std::array<std::vector<double>, kTailProperties> rp;
    for (int k = 0; k < kTailProperties; ++k) {
      std::vector<double> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = tail_properties(pages[idx[i]])[size_t(k)];
      if (std::any_of(v.begin(), v.end(), [](double x) { return std::isnan(x); })) continue;
      ++n_groups[size_t(k)];
      rp[size_t(k)] = average_ranks(v);
      const double rho = pearson_correlation(re, rp[size_t(k)]);
      s.spearman[size_t(k)] += std::isnan(rho) ? 0.0 : rho;  // a constant property: no relation
      // Precision at the top decile: the property's top 10% against the error's top 10%.
      const double cut = double(n) - double(n) / 10.0;
      int hit = 0, top = 0;
      for (size_t i = 0; i < n; ++i)
        if (rp[size_t(k)][i] >= cut - 0.5) ++top, hit += re[i] >= cut - 0.5;
      s.precision_top10[size_t(k)] += top ? double(hit) / top : 0.0;
    }
    for (size_t i = 0; i < n; ++i) {
      const int dec = std::min(9, int(10.0 * re[i] / double(n)));
      decile_n[size_t(dec)] += 1;
      s.decile_err[size_t(dec)] += e[i];
      for (int k = 0; k < kTailProperties; ++k)
        if (!rp[size_t(k)].empty()) {
          s.decile_property_pct[size_t(dec)][size_t(k)] += rp[size_t(k)][i] / double(n - 1);
          decile_prop_n[size_t(dec)][size_t(k)] += 1;
        }
    }
  }
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  for (size_t k = 0; k < size_t(kTailProperties); ++k) {
    s.spearman[k] = n_groups[k] ? s.spearman[k] / n_groups[k] : kNaN;
    s.precision_top10[k] = n_groups[k] ? s.precision_top10[k] / n_groups[k] : kNaN;
  }
  for (size_t dc = 0; dc < 10; ++dc) {
    s.decile_err[dc] = decile_n[dc] ? s.decile_err[dc] / decile_n[dc] : kNaN;
    for (size_t k = 0; k < size_t(kTailProperties); ++k)
      s.decile_property_pct[dc][k] = decile_prop_n[dc][k] ? s.decile_property_pct[dc][k] / decile_prop_n[dc][k] : kNaN;
  }
  return s;
}

}  // namespace locks
