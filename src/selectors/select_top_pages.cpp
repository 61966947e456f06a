// Alg. 2 lines 6-9: shares, group rule, sink + recent + top-(k-2).
#include <fmt/format.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>

#include "locks/math.h"
#include "locks/selector.h"

namespace locks {

std::string group_rule_name(GroupRule r) {
  switch (r) {
    case GroupRule::kShareAverage:
      return "share-average";
    case GroupRule::kMax:
      return "max";
    case GroupRule::kMassSum:
      return "mass-sum";
  }
  return "?";
}

GroupRule parse_group_rule(const std::string& s) {
  if (s == "share-average") return GroupRule::kShareAverage;
  if (s == "max") return GroupRule::kMax;
  if (s == "mass-sum") return GroupRule::kMassSum;
  throw std::invalid_argument(fmt::format("unknown group rule '{}' (expected share-average, max or mass-sum)", s));
}

void select_top_pages(const float* log_mass, int n_group, int n_pages, int budget_pages, GroupRule rule,
                      std::vector<int32_t>& out, std::vector<float>* scores_out) {
  out.clear();
  if (n_pages <= 0) return;
  if (!log_mass || n_group < 1)
    throw std::invalid_argument(fmt::format(
        "select_top_pages: {} for {} pages",
        !log_mass ? std::string("no log-mass estimates (null)") : fmt::format("GQA group of {} heads", n_group),
        n_pages));
  // One pass per head: validity (-inf, no mass, is valid; NaN and +inf are not) and the head's max.
  thread_local std::vector<float> score, share, head_max;
  head_max.resize(n_group);
  bool any_neg_inf = false;
  for (int g = 0; g < n_group; ++g) {
    const float* lm = log_mass + size_t(g) * n_pages;
    // Eight lanes at a time: NaN or +inf (not less than +inf, unordered included), -inf, the max.
    const __m256 pinf = _mm256_set1_ps(std::numeric_limits<float>::infinity()), ninf = _mm256_set1_ps(kNegInf);
    __m256 vmax = ninf, vbad = _mm256_setzero_ps(), vneg = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n_pages; j += 8) {
      const __m256 x = _mm256_loadu_ps(lm + j);
      vbad = _mm256_or_ps(vbad, _mm256_cmp_ps(x, pinf, _CMP_NLT_UQ));
      vneg = _mm256_or_ps(vneg, _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ));
      vmax = _mm256_max_ps(vmax, x);
    }
    float mx = hmax8(vmax);
    bool bad = _mm256_movemask_ps(vbad) != 0;
    any_neg_inf |= _mm256_movemask_ps(vneg) != 0;
    for (; j < n_pages; ++j) {
      bad |= !(lm[j] < std::numeric_limits<float>::infinity());
      any_neg_inf |= lm[j] == kNegInf;
      mx = std::max(mx, lm[j]);
    }
    if (bad)
      for (int i = 0; i < n_pages; ++i)
        if (std::isnan(lm[i]) || lm[i] == std::numeric_limits<float>::infinity())
          throw std::invalid_argument(fmt::format("select_top_pages: log-mass {} at head {}, page {}", lm[i], g, i));
    head_max[g] = mx;
  }
  const int k = std::max(budget_pages, 2);
  score.assign(n_pages, 0.0f);
  // Per-head shares m_g(j) = softmax_j(log_mass[g][j]) (Eq. 5), combined across the group.
  for (int g = 0; g < n_group; ++g) {
    const float* lm = log_mass + size_t(g) * n_pages;
    if (rule == GroupRule::kMassSum) {
      for (int j = 0; j < n_pages; ++j) score[j] += lm[j];
      continue;
    }
    const float mx = head_max[g];
    if (mx == kNegInf) continue;  // head with no finite estimate contributes no share
    share.assign(lm, lm + n_pages);
    const float inv_z = 1.0f / exp_shift_sum(share.data(), n_pages, mx);  // -inf -> share 0
    if (rule == GroupRule::kShareAverage) {
      const float w = inv_z / float(n_group);
      for (int j = 0; j < n_pages; ++j) score[j] += share[j] * w;
    } else {
      for (int j = 0; j < n_pages; ++j) score[j] = std::max(score[j], share[j] * inv_z);
    }
  }
  if (rule == GroupRule::kMassSum)
    for (int j = 0; j < n_pages; ++j)
      if (std::isnan(score[j])) score[j] = kNegInf;
  // A page no head could estimate (-inf everywhere) ranks below every finite page, even one whose
  // share underflowed to 0.
  if (any_neg_inf)
    for (int j = 0; j < n_pages; ++j) {
      bool finite = false;
      for (int g = 0; g < n_group && !finite; ++g) finite = log_mass[size_t(g) * n_pages + j] > kNegInf;
      if (!finite) score[j] = rule == GroupRule::kMassSum ? kNegInf : -1.0f;
    }
  if (scores_out) scores_out->assign(score.begin(), score.end());

  if (n_pages <= k) {
    out.resize(n_pages);
    std::iota(out.begin(), out.end(), 0);
    return;
  }
  // Sink (page 0) and recent (last page) always; the rest by combined score, ties to lower index:
  // the (k-2)-th best score by a selection on the values, then one scan in page order.
  const int kk = k - 2;
  float kth = std::numeric_limits<float>::infinity();
  int ties = 0;
  if (kk > 0) {
    thread_local std::vector<float> vals;
    vals.assign(score.begin() + 1, score.begin() + (n_pages - 1));
    std::nth_element(vals.begin(), vals.begin() + (kk - 1), vals.end(), std::greater<float>());
    kth = vals[size_t(kk - 1)];
    ties = kk - int(std::count_if(score.begin() + 1, score.begin() + (n_pages - 1), [&](float v) { return v > kth; }));
  }
  out.assign(1, 0);
  for (int32_t j = 1; j < n_pages - 1; ++j)
    if (score[j] > kth || (score[j] == kth && ties-- > 0)) out.push_back(j);
  out.push_back(n_pages - 1);
}

}  // namespace locks
