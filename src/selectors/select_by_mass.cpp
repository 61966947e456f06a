// Alg. 2 with an adaptive k: keep top-ranked pages until the kept group share reaches a target,
// estimated (top-p) or certified from per-page error bounds.
#include <fmt/format.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "locks/math.h"
#include "locks/selector.h"

namespace locks {

std::string describe_budget_rule(const BudgetRule& r) {
  switch (r.kind) {
    case BudgetRule::Kind::kFixed:
      return "fixed";
    case BudgetRule::Kind::kTopP:
      return fmt::format("p={:g} min={}", r.mass, r.min_tokens);
    case BudgetRule::Kind::kCertified:
      return fmt::format("cert={:g} min={}", r.mass, r.min_tokens);
  }
  return "?";
}

BudgetRule parse_budget_rule(const std::string& s) {
  if (s == "fixed") return {};
  const size_t eq = s.find('=');
  const std::string k = s.substr(0, eq), v = eq == std::string::npos ? "" : s.substr(eq + 1);
  if (eq == std::string::npos || (k != "p" && k != "cert"))
    throw std::invalid_argument(fmt::format("budget rule '{}': expected fixed, p=P or cert=P", s));
  return {k == "p" ? BudgetRule::Kind::kTopP : BudgetRule::Kind::kCertified, parse_unit_fraction(k, v, "share"), 0};
}

double parse_unit_fraction(const std::string& key, const std::string& value, const char* what) {
  double x = 0;
  size_t used = 0;
  try {
    x = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;  // no number, or out of double's range
  }
  if (used == 0 || used != value.size())
    throw std::invalid_argument(fmt::format("{}='{}' is not a number", key, value));
  if (!(x > 0 && x < 1))
    throw std::invalid_argument(fmt::format("{}={} is not a {} strictly between 0 and 1", key, value, what));
  return x;
}

namespace {

// Certified lower bound of the kept group share, maintained as pages move from the dropped set to
// the kept one: per head L = sum kept e^(s-beta), U = sum dropped e^(s+beta), both relative to the
// head's largest e^(s+beta). The exponentials are float (fast_exp8, the argument formed in float64
// and rounded once: relative error < 1e-5 for arguments in [-87, 0], lo rounded down and hi up by
// that much), the sums float64.
class CertifiedShare {
 public:
  CertifiedShare(const float* log_mass, const float* bound, int n_group, int n_pages)
      : G_(n_group),
        n_(n_pages),
        lo_(size_t(n_group) * n_pages),
        hi_(size_t(n_group) * n_pages),
        kept_(size_t(n_group), 0.0),
        moved_(size_t(n_group), 0.0),
        total_(size_t(n_group), 0.0) {
    for (int g = 0; g < G_; ++g) {
      const float* lm = log_mass + size_t(g) * n_;
      const float* bd = bound + size_t(g) * n_;
      double mx = -INFINITY;
      for (int j = 0; j < n_; ++j) mx = std::max(mx, double(lm[j]) + bd[j]);
      float* lo = &lo_[size_t(g) * n_];
      float* hi = &hi_[size_t(g) * n_];
      if (mx == -INFINITY) {  // no finite estimate: the head contributes no share either way
        std::fill_n(lo, n_, 0.0f);
        std::fill_n(hi, n_, 0.0f);
        continue;
      }
      // Arguments in float64, rounded once to float (|error| <= 2^-24 |x|, x <= 0 and below -87 gives 0).
      for (int j = 0; j < n_; ++j) {
        lo[j] = float(double(lm[j]) - bd[j] - mx);
        hi[j] = float(double(lm[j]) + bd[j] - mx);
      }
      const __m256 floor = _mm256_set1_ps(-87.0f), down = _mm256_set1_ps(1.0f - 1e-5f),
                   up = _mm256_set1_ps(1.0f + 1e-5f);
      __m256d t4 = _mm256_setzero_pd();
      int j = 0;
      for (; j + 8 <= n_; j += 8) {
        const __m256 a = _mm256_loadu_ps(lo + j);
        // fast_exp8 clamps its argument from below (an overestimate there): a lower bound takes 0.
        _mm256_storeu_ps(lo + j, _mm256_and_ps(_mm256_cmp_ps(a, floor, _CMP_GE_OQ), _mm256_mul_ps(fast_exp8(a), down)));
        const __m256 h = _mm256_mul_ps(fast_exp8(_mm256_loadu_ps(hi + j)), up);
        _mm256_storeu_ps(hi + j, h);
        t4 = _mm256_add_pd(t4, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(h)),
                                             _mm256_cvtps_pd(_mm256_extractf128_ps(h, 1))));
      }
      alignas(32) double t[4];
      _mm256_store_pd(t, t4);
      double total = (t[0] + t[1]) + (t[2] + t[3]);
      for (; j < n_; ++j) {
        lo[j] = lo[j] < -87.0f ? 0.0f : fast_exp(lo[j]) * (1.0f - 1e-5f);
        hi[j] = fast_exp(hi[j]) * (1.0f + 1e-5f);
        total += hi[j];
      }
      total_[size_t(g)] = total;
    }
  }
  void keep(int j) {
    for (int g = 0; g < G_; ++g)
      kept_[size_t(g)] += lo_[size_t(g) * n_ + j], moved_[size_t(g)] += hi_[size_t(g) * n_ + j];
  }
  double lower_bound() const {
    double sum = 0;
    for (int g = 0; g < G_; ++g) {
      const double t = total_[size_t(g)];
      // What is left of the total; the slack covers the float64 rounding of the sums (<= n ulps).
      const double u = std::max(0.0, t - moved_[size_t(g)]) + 1e-13 * t;
      const double l = kept_[size_t(g)];
      sum += l > 0 ? l / (l + u) : 0.0;
    }
    return sum / G_;
  }

 private:
  int G_, n_;
  std::vector<float> lo_, hi_;                // [G][n]: e^(s_hat -/+ beta - max)
  std::vector<double> kept_, moved_, total_;  // per head: L, the hi weight moved out of U, sum of hi
};

}  // namespace

bool select_pages_by_mass(const float* log_mass, const float* error_bound, int n_group, int n_pages, int min_pages,
                          int max_pages, double mass, std::vector<int32_t>& out) {
  if (!(mass > 0 && mass < 1))
    throw std::invalid_argument(fmt::format("select_pages_by_mass: target share {} outside (0, 1)", mass));
  // Validation and the share-average combined score of every page (budget n: nothing dropped here).
  thread_local std::vector<float> score;
  select_top_pages(log_mass, n_group, n_pages, n_pages, GroupRule::kShareAverage, out, &score);
  if (n_pages <= 2) return true;
  if (error_bound)
    for (size_t i = 0; i < size_t(n_group) * n_pages; ++i)
      if (!(error_bound[i] >= 0 && error_bound[i] < INFINITY))
        throw std::invalid_argument(fmt::format("select_pages_by_mass: error bound {} at head {}, page {}",
                                                error_bound[i], i / size_t(n_pages), i % size_t(n_pages)));
  const int k_max = std::clamp(max_pages, 2, n_pages), k_min = std::clamp(min_pages, 2, k_max);
  // The candidates that could be kept, best first (score descending, ties toward the lower index).
  thread_local std::vector<int32_t> order;
  order.resize(size_t(n_pages - 2));
  for (int j = 1; j < n_pages - 1; ++j) order[size_t(j - 1)] = j;
  const auto better = [&](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  const auto last = order.begin() + (k_max - 2);
  std::nth_element(order.begin(), last, order.end(), better);
  std::sort(order.begin(), last, better);

  out.assign({0, n_pages - 1});
  bool met = false;
  if (!error_bound) {
    double kept = double(std::max(score[0], 0.0f)) + std::max(score[size_t(n_pages - 1)], 0.0f);
    for (auto it = order.begin();; ++it) {
      met = kept >= mass;
      if ((met && int(out.size()) >= k_min) || it == last) break;
      out.push_back(*it);
      kept += std::max(score[size_t(*it)], 0.0f);
    }
  } else {
    CertifiedShare cert(log_mass, error_bound, n_group, n_pages);
    cert.keep(0);
    cert.keep(n_pages - 1);
    for (auto it = order.begin();; ++it) {
      met = cert.lower_bound() >= mass;
      if ((met && int(out.size()) >= k_min) || it == last) break;
      out.push_back(*it);
      cert.keep(*it);
    }
  }
  std::sort(out.begin(), out.end());
  return met;
}

}  // namespace locks
