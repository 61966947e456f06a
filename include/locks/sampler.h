// Token samplers: greedy (temperature 0) and temperature + top-p (nucleus) with a seeded RNG.
#pragma once

#include <cstdint>
#include <random>
#include <span>

namespace locks {

struct SamplerConfig {
  float temperature = 0.0f;  // 0 = greedy (argmax, ties to the lower id)
  float top_p = 1.0f;        // keep the smallest set of tokens whose probability reaches top_p
  uint64_t seed = 0;
};

class Sampler {
 public:
  /// Throws std::invalid_argument for temperature < 0 or top_p outside (0, 1].
  explicit Sampler(const SamplerConfig& cfg);
  /// Pick the next token from logits [n_vocab]. Deterministic for a seed. NaN logits throw
  /// std::runtime_error (they mean the forward pass broke).
  int32_t sample(std::span<const float> logits);

 private:
  SamplerConfig cfg_;
  std::mt19937_64 rng_;
};

/// argmax with ties to the lower index. Throws std::invalid_argument for empty logits.
int32_t argmax(std::span<const float> logits);

}  // namespace locks
