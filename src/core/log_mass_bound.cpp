// PageSummaryStore::log_mass_error_bound: a certified bound on how far Eq. 4 on a stored (quantized)
// summary may be from the page's exact log-mass, from the stored scales and spectral tail alone.
//
// For token i, k_i = mu + V c_i + P_perp delta_i (V the unquantized orthonormal basis) and Eq. 4 uses
// k_hat_i = mu_hat + V_hat c_hat_i, so
//   q.(k_i - k_hat_i) = q.(mu - mu_hat) + q.(V - V_hat) c_i + (V_hat^T q).(c_i - c_hat_i) + q.P_perp delta_i
// with |q.P_perp delta_i| <= ||P_perp q|| ||P_perp delta_i|| <= ||q_perp|| sqrt(tau) (Eq. 7) and
// ||q_perp||^2 = ||q||^2 - ||V^T q||^2 <= ||q||^2 - (||V_hat^T q|| - ||(V - V_hat)^T q||)_+^2. A
// log-sum-exp moves by at most the largest move of its terms, so the token maximum times `scale`
// bounds |s_j - s_hat_j|.
#include <algorithm>
#include <cmath>
#include <vector>

#include "locks/page_summary.h"

namespace locks {

float PageSummaryStore::log_mass_error_bound(int il, int kv_head, int32_t page, const float* q, float scale) const {
  const size_t idx = stored_index(il, kv_head, page);
  const PageSummaryF32 s = load(il, kv_head, page);
  const int r = fmt_.rank, d = d_, B = B_;
  double q1 = 0, q2 = 0;
  for (int c = 0; c < d; ++c) q1 += std::abs(double(q[c])), q2 += double(q[c]) * q[c];
  // Per-element rounding of each stored part (round to nearest: half a step).
  std::vector<double> e_basis(r), w(r);
  double w_norm2 = 0, a_norm2 = 0, w_abs = 0;
  for (int k = 0; k < r; ++k) {
    const float* v = &s.basis[size_t(k) * d];
    double dot = 0, vmax = 0;
    for (int c = 0; c < d; ++c) dot += double(v[c]) * q[c], vmax = std::max(vmax, std::abs(double(v[c])));
    e_basis[k] = fmt_.basis_bits == 32   ? 0.0
                 : fmt_.basis_bits == 16 ? vmax * 0x1p-8
                                         : 0.5 * f16_to_f32(basis_scale_[idx * r + k]);
    w[k] = dot;
    w_norm2 += dot * dot;
    w_abs += std::abs(dot);
    a_norm2 += (e_basis[k] * q1) * (e_basis[k] * q1);  // |(V - V_hat)_k . q| <= e_k ||q||_1
  }
  const double shortfall = std::max(0.0, std::sqrt(w_norm2) - std::sqrt(a_norm2));
  const double q_perp = std::sqrt(std::max(0.0, q2 - shortfall * shortfall));
  const double e_centroid = fmt_.centroid_bits == 32 ? 0.0 : 0.5 * f16_to_f32(centroid_scale_[idx]);
  double mu_dot = 0, mu_norm2 = 0;
  for (int c = 0; c < d; ++c) mu_dot += double(s.centroid[c]) * q[c], mu_norm2 += double(s.centroid[c]) * s.centroid[c];
  const double tail_term = q_perp * std::sqrt(std::max(0.0, double(s.tail)));
  double worst = 0, logit_max = std::abs(mu_dot), coef_norm_max = 0;
  for (int i = 0; i < B; ++i) {
    const double e_coef = fmt_.coef_bits == 32 ? 0.0 : 0.5 * f16_to_f32(coef_scale_[idx * B + i]);
    double err = q1 * e_centroid + e_coef * w_abs + tail_term, logit = mu_dot, cn = 0;
    for (int k = 0; k < r; ++k) {
      const double c_hat = s.coef[size_t(i) * r + k];
      err += (std::abs(c_hat) + e_coef) * e_basis[k] * q1;
      logit += c_hat * w[k];
      cn += c_hat * c_hat;
    }
    worst = std::max(worst, err);
    logit_max = std::max(logit_max, std::abs(logit));
    coef_norm_max = std::max(coef_norm_max, std::sqrt(cn));
  }
  // Float rounding: of the stored float parts (f32 formats) and of Eq. 4's own arithmetic, the last
  // rounding of the float result included.
  const double rounding =
      1e-5 *
      (logit_max + std::sqrt(q2) * (std::sqrt(mu_norm2) + coef_norm_max + std::sqrt(std::max(0.0, double(s.tail)))));
  const double result_rounding = 1e-6 * (1.0 + std::log(double(B)) + std::abs(double(scale)) * logit_max);
  return float(((worst + rounding) * std::abs(double(scale)) + result_rounding) * (1.0 + 1e-6));
}

}  // namespace locks
