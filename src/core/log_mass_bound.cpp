// PageSummaryStore::log_mass_error_bound(s): a certified bound on how far Eq. 4 on a stored
// (quantized) summary may be from the page's exact log-mass, from the stored scales and spectral
// tail alone.
//
// For token i, k_i = mu + V c_i + P_perp delta_i (V the unquantized orthonormal basis) and Eq. 4 uses
// k_hat_i = mu_hat + V_hat c_hat_i, so
//   q.(k_i - k_hat_i) = q.(mu - mu_hat) + q.(V - V_hat) c_i + (V_hat^T q).(c_i - c_hat_i) + q.P_perp delta_i
// with |q.P_perp delta_i| <= ||P_perp q|| ||P_perp delta_i|| <= ||q_perp|| sqrt(tau) (Eq. 7) and
// ||q_perp||^2 = ||q||^2 - ||V^T q||^2 <= ||q||^2 - (||V_hat^T q|| - ||(V - V_hat)^T q||)_+^2. A
// log-sum-exp moves by at most the largest move of its terms, so the token maximum times `scale`
// bounds |s_j - s_hat_j|.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "locks/page_summary.h"

namespace locks {

namespace {

// Half a rounding step of one stored part: the per-element error of round-to-nearest codes with
// f16 scale `scale`, of bf16 values up to `vmax` (relative 2^-9), or 0 for float32.
double half_step(int bits, float scale, double vmax) {
  return bits == 32 ? 0.0 : bits == 16 ? vmax * 0x1p-8 : 0.5 * double(scale);
}

struct QueryNorms {
  double l1 = 0, l2sq = 0;
  explicit QueryNorms(const float* q, int d) {
    for (int c = 0; c < d; ++c) l1 += std::abs(double(q[c])), l2sq += double(q[c]) * q[c];
  }
};

// What every form shares once the token maximum `worst` of |q.(k_i - k_hat_i)| and the largest
// logit magnitude are known: float rounding of the stored float parts and of Eq. 4's arithmetic
// (the last rounding of the float result included), then the scale. log_B: log(page size).
inline float finish_bound(double worst, double logit_max, double q_norm, double mu_norm, double coef_norm_max,
                          double sqrt_tail, double log_B, float scale) {
  const double rounding = 1e-5 * (logit_max + q_norm * (mu_norm + coef_norm_max + sqrt_tail));
  const double result_rounding = 1e-6 * (1.0 + log_B + std::abs(double(scale)) * logit_max);
  return float(((worst + rounding) * std::abs(double(scale)) + result_rounding) * (1.0 + 1e-6));
}

}  // namespace

float PageSummaryStore::log_mass_error_bound(int il, int kv_head, int32_t page, const float* q, float scale) const {
  const size_t idx = stored_index(il, kv_head, page);
  const PageSummaryF32 s = load_at(idx);
  const int r = fmt_.rank, d = d_, B = B_;
  const QueryNorms qn(q, d);
  std::vector<double> e_basis(r), w(r);
  double w_norm2 = 0, a_norm2 = 0, w_abs = 0;
  for (int k = 0; k < r; ++k) {
    const float* v = &s.basis[size_t(k) * d];
    double dot = 0, vmax = 0;
    for (int c = 0; c < d; ++c) dot += double(v[c]) * q[c], vmax = std::max(vmax, std::abs(double(v[c])));
    e_basis[k] = half_step(fmt_.basis_bits, f16_to_f32(basis_scale_[idx * r + k]), vmax);
    w[k] = dot;
    w_norm2 += dot * dot;
    w_abs += std::abs(dot);
    a_norm2 += (e_basis[k] * qn.l1) * (e_basis[k] * qn.l1);  // |(V - V_hat)_k . q| <= e_k ||q||_1
  }
  const double shortfall = std::max(0.0, std::sqrt(w_norm2) - std::sqrt(a_norm2));
  const double q_perp = std::sqrt(std::max(0.0, qn.l2sq - shortfall * shortfall));
  const double e_centroid = half_step(fmt_.centroid_bits, f16_to_f32(centroid_scale_[idx]), 0.0);
  double mu_dot = 0, mu_norm2 = 0;
  for (int c = 0; c < d; ++c) mu_dot += double(s.centroid[c]) * q[c], mu_norm2 += double(s.centroid[c]) * s.centroid[c];
  const double tail_term = q_perp * std::sqrt(std::max(0.0, double(s.tail)));
  double worst = 0, logit_max = std::abs(mu_dot), coef_norm_max = 0;
  for (int i = 0; i < B; ++i) {
    const double e_coef = half_step(fmt_.coef_bits, f16_to_f32(coef_scale_[idx * B + i]), 0.0);
    double err = qn.l1 * e_centroid + e_coef * w_abs + tail_term, logit = mu_dot, cn = 0;
    for (int k = 0; k < r; ++k) {
      const double c_hat = s.coef[size_t(i) * r + k];
      err += (std::abs(c_hat) + e_coef) * e_basis[k] * qn.l1;
      logit += c_hat * w[k];
      cn += c_hat * c_hat;
    }
    worst = std::max(worst, err);
    logit_max = std::max(logit_max, std::abs(logit));
    coef_norm_max = std::max(coef_norm_max, std::sqrt(cn));
  }
  return finish_bound(worst, logit_max, std::sqrt(qn.l2sq), std::sqrt(mu_norm2), coef_norm_max,
                      std::sqrt(std::max(0.0, double(s.tail))), std::log(double(B)), scale);
}

void PageSummaryStore::store_bound_terms(size_t idx, const float* keys) {
  const PageSummaryF32 s = load_at(idx);
  const int r = fmt_.rank, d = d_;
  // The stored form's own residual, k_i - (mu_hat + V_hat^T c_hat_i), in float64.
  double resid_max = keys ? 0.0 : INFINITY, basis_frob2 = 0;
  for (float v : s.basis) basis_frob2 += double(v) * v;
  for (int i = 0; keys && i < B_; ++i) {
    double r2 = 0;
    for (int c = 0; c < d; ++c) {
      double k_hat = s.centroid[c];
      for (int k = 0; k < r; ++k) k_hat += double(s.coef[size_t(i) * r + k]) * s.basis[size_t(k) * d + c];
      const double e = double(keys[size_t(i) * d + c]) - k_hat;
      r2 += e * e;
    }
    resid_max = std::max(resid_max, std::sqrt(r2));
  }
  std::vector<double> e_basis(r);
  double e_basis2 = 0;
  for (int k = 0; k < r; ++k) {
    double vmax = 0;
    for (int c = 0; c < d; ++c) vmax = std::max(vmax, std::abs(double(s.basis[size_t(k) * d + c])));
    e_basis[k] = half_step(fmt_.basis_bits, f16_to_f32(basis_scale_[idx * r + k]), vmax);
    e_basis2 += e_basis[k] * e_basis[k];
  }
  double coef_term = 0, e_coef_max = 0, coef_norm_max = 0, mu_norm2 = 0;
  for (int i = 0; i < B_; ++i) {
    const double e_coef = half_step(fmt_.coef_bits, f16_to_f32(coef_scale_[idx * B_ + i]), 0.0);
    double t = 0, cn = 0;
    for (int k = 0; k < r; ++k) {
      const double c_hat = s.coef[size_t(i) * r + k];
      t += (std::abs(c_hat) + e_coef) * e_basis[k];
      cn += c_hat * c_hat;
    }
    coef_term = std::max(coef_term, t);
    e_coef_max = std::max(e_coef_max, e_coef);
    coef_norm_max = std::max(coef_norm_max, std::sqrt(cn));
  }
  for (float m : s.centroid) mu_norm2 += double(m) * m;
  const double e_centroid = half_step(fmt_.centroid_bits, f16_to_f32(centroid_scale_[idx]), 0.0);
  // Rounded up so that the float terms stay upper bounds of the float64 ones.
  const auto up = [](double x) { return std::nextafter(float(x), INFINITY); };
  float* t = bound_terms_.data() + idx * kBoundTerms;
  t[0] = up(e_centroid + coef_term);
  t[1] = up(e_coef_max);
  t[2] = up(e_basis2);
  t[3] = up(std::max(0.0, double(s.tail)));
  t[4] = up(std::sqrt(mu_norm2));
  t[5] = up(coef_norm_max);
  t[6] = up(resid_max * (1.0 + 1e-12));
  t[7] = up(std::sqrt(basis_frob2));
}

void PageSummaryStore::log_mass_error_bounds(int il, int kv_head, std::span<const int32_t> pages, const float* q,
                                             int n_group, float scale, float* out, size_t out_stride) const {
  if (n_group < 1 || out_stride < pages.size())
    throw std::invalid_argument(
        fmt::format("log_mass_error_bounds: GQA group of {} heads, output stride {} for {} pages", n_group, out_stride,
                    pages.size()));
  const int r = fmt_.rank, d = d_;
  std::vector<QueryNorms> qn;
  std::vector<double> q_norm;
  for (int g = 0; g < n_group; ++g) qn.emplace_back(q + size_t(g) * d, d), q_norm.push_back(std::sqrt(qn.back().l2sq));
  const double log_B = std::log(double(B_));
  thread_local std::vector<float> V;
  V.resize(size_t(r) * d);
  for (size_t j = 0; j < pages.size(); ++j) {
    const size_t idx = stored_index(il, kv_head, pages[j]);
    const float* t = bound_terms_.data() + idx * kBoundTerms;
    const double coef_term = t[0], e_coef_max = t[1], e_basis2 = t[2], tail = t[3], mu_norm = t[4], cn_max = t[5],
                 resid = t[6], basis_frob = t[7];
    if (resid < INFINITY) {
      // |q.(k_i - k_hat_i)| <= ||q|| resid; |logit| <= ||q|| (||mu_hat|| + ||c_hat_i|| ||V_hat||_F).
      for (int g = 0; g < n_group; ++g) {
        out[size_t(g) * out_stride + j] =
            finish_bound(q_norm[size_t(g)] * resid, q_norm[size_t(g)] * (mu_norm + cn_max * basis_frob),
                         q_norm[size_t(g)], mu_norm, cn_max, std::sqrt(tail), log_B, scale);
      }
      continue;
    }
    dequant_basis(idx, V.data());
    for (int g = 0; g < n_group; ++g) {
      const float* qg = q + size_t(g) * d;
      double w_norm2 = 0, w_abs = 0;
      for (int k = 0; k < r; ++k) {
        const float* v = &V[size_t(k) * d];
        float dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int c = 0; c < d; ++c) dot += v[c] * qg[c];
        // A float dot of d terms is within d ulps of its magnitude sum: widened by that relative amount.
        const double wk = std::abs(double(dot)) * (1.0 + 1e-7 * d) + 1e-30;
        w_norm2 += wk * wk;
        w_abs += wk;
      }
      const double l1 = qn[size_t(g)].l1, qg_norm = q_norm[size_t(g)];
      // ||V_hat^T q|| from below for the shortfall: the widening above only applies upward.
      const double w_lo = std::sqrt(w_norm2) / (1.0 + 1e-7 * d) - 1e-30;
      const double shortfall = std::max(0.0, w_lo - l1 * std::sqrt(e_basis2));
      const double q_perp = std::sqrt(std::max(0.0, qn[size_t(g)].l2sq - shortfall * shortfall));
      const double worst = l1 * coef_term + e_coef_max * w_abs + q_perp * std::sqrt(tail);
      const double logit_max = mu_norm * qg_norm + cn_max * std::sqrt(w_norm2);
      out[size_t(g) * out_stride + j] =
          finish_bound(worst, logit_max, qg_norm, mu_norm, cn_max, std::sqrt(tail), log_B, scale);
    }
  }
}

}  // namespace locks
