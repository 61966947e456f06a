#include "locks/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace locks {

int32_t argmax(std::span<const float> logits) {
  if (logits.empty()) throw std::invalid_argument("argmax: no logits");
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = int32_t(i);
  return best;
}

Sampler::Sampler(const SamplerConfig& cfg) : cfg_(cfg), rng_(cfg.seed) {
  if (!(cfg.temperature >= 0.0f) || !std::isfinite(cfg.temperature))
    throw std::invalid_argument(fmt::format("temperature {} must be a finite value >= 0", cfg.temperature));
  if (!(cfg.top_p > 0.0f && cfg.top_p <= 1.0f))
    throw std::invalid_argument(fmt::format("top-p {} must be in (0, 1]", cfg.top_p));
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (logits.empty()) throw std::runtime_error("sampler: empty logits");
  std::vector<int32_t> pos_inf;  // +inf logits: the softmax's limit puts all the mass on them, equally
  bool any_mass = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float l = logits[i];
    if (std::isnan(l)) throw std::runtime_error("sampler: NaN in the model's logits (NaN/Inf in its weights?)");
    if (l == INFINITY) pos_inf.push_back(int32_t(i));
    any_mass |= l != -INFINITY;
  }
  if (!any_mass) throw std::runtime_error("sampler: every logit is -inf (no token has any probability)");
  if (cfg_.temperature == 0.0f) return argmax(logits);  // (the first +inf, if any)
  if (!pos_inf.empty())
    return pos_inf.size() == 1 ? pos_inf.front()
                               : pos_inf[std::uniform_int_distribution<size_t>(0, pos_inf.size() - 1)(rng_)];
  // Softmax at temperature T, then the nucleus: sort by probability, keep the prefix reaching top_p.
  const float mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double z = 0.0;
  for (size_t i = 0; i < p.size(); ++i) z += p[i] = std::exp(double(logits[i] - mx) / cfg_.temperature);
  std::vector<int32_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  double cum = 0.0;
  size_t keep = 0;
  while (keep < order.size()) {
    cum += p[order[keep++]] / z;
    if (cum >= cfg_.top_p) break;
  }
  double kept = 0.0;
  for (size_t i = 0; i < keep; ++i) kept += p[order[i]];
  const double u = std::uniform_real_distribution<double>(0.0, kept)(rng_);
  double acc = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    acc += p[order[i]];
    if (u < acc) return order[i];
  }
  return order[keep - 1];
}

}  // namespace locks
