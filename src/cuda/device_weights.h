// A Llama-family model's weights on the GPU, bf16 (dequantized and rounded once at upload) or
// float32, laid out for the engine's products: Q/K/V fused into one matrix, gate and up into another.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "locks/model.h"

namespace locks::cuda {

/// Element type of the matrices (norms are float32 either way).
enum class WeightType { kBF16, kF32 };

struct DeviceLayer {
  const void* w_qkv = nullptr;       // [(n_head + 2 n_head_kv) head_dim][n_embd]: rows of W_q, W_k, W_v
  const void* w_o = nullptr;         // [n_embd][n_head head_dim]
  const void* w_gate_up = nullptr;   // [2 n_ff][n_embd]: rows of W_gate, then W_up
  const void* w_down = nullptr;      // [n_embd][n_ff]
  const float* attn_norm = nullptr;  // [n_embd]
  const float* ffn_norm = nullptr;   // [n_embd]
  const float* b_qkv = nullptr;      // [(n_head + 2 n_head_kv) head_dim]: bq, bk, bv (hp.attn_bias; else null)
  const float* q_norm = nullptr;     // [head_dim] (hp.attn_qk_norm; else null)
  const float* k_norm = nullptr;     // [head_dim] (hp.attn_qk_norm; else null)
};

/// Owns one device allocation holding every tensor.
class DeviceWeights {
 public:
  /// Uploads `model` (float32 on the host) as `type` (bf16: round-to-nearest-even). Throws
  /// std::runtime_error when the GPU lacks the memory ("model 'x' needs 17.2 GiB of GPU memory for
  /// its bf16 weights; 12.0 GiB of 139.8 are free") or a CUDA call fails.
  static DeviceWeights upload(const LlamaModel& model, WeightType type);
  /// Random bf16 weights made on the GPU for `hp` (benchmarks; no file): products keep unit-scale
  /// activations (uniform in +-sqrt(3 / n_in)), norms 1. Same errors as upload.
  static DeviceWeights random(const LlamaHparams& hp, uint64_t seed, bool tied_output = false);

  DeviceWeights() = default;
  DeviceWeights(DeviceWeights&& o) noexcept;
  DeviceWeights& operator=(DeviceWeights&& o) noexcept;
  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;
  ~DeviceWeights();

  LlamaHparams hp;
  WeightType type = WeightType::kBF16;
  const void* tok_embd = nullptr;      // [n_vocab][n_embd]
  const void* output = nullptr;        // [n_vocab][n_embd] (tok_embd when tied)
  const float* output_norm = nullptr;  // [n_embd]
  std::vector<float> rope_freqs;       // host copy of LlamaModel::rope_freqs (empty: none)
  std::vector<DeviceLayer> layers;
  size_t bytes = 0;  // device memory held

  /// Bytes the weights of `hp` take on the device as `type`.
  static size_t bytes_for(const LlamaHparams& hp, bool tied_output, WeightType type);

 private:
  void* storage_ = nullptr;
};

}  // namespace locks::cuda
