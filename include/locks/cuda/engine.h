// The whole model on the GPU: what Session uses for `--device cuda`, and what `locks bench --device
// cuda --e2e` times. The engine is ForwardOps (locks/forward.h) on CUDA; the forward pass itself is
// llama_forward, the same as on the CPU.
#pragma once

#include <memory>

#include "locks/cuda/kernels.h"
#include "locks/forward.h"

namespace locks {
class LlamaModel;
}

namespace locks::cuda {

/// Matrix weights on the GPU: bf16 or float32; auto: float32 where they take at most 2 GiB (small
/// models then compute as the CPU engine does), else bf16.
enum class EngineWeights { kAuto, kBF16, kF32 };

struct EngineConfig {
  int n_ctx = 0;                    // tokens per sequence (the decode plan's bound; > 0)
  int max_seqs = 1;                 // sequences decoded together (1..64)
  int max_rows = 512;               // tokens per prefill call (the prefill chunk)
  KvType kv_dtype = KvType::kBF16;  // KV cache elements
  bool locks = false;               // decode with LOCKS (score -> select -> sparse attention); else dense
  int budget_pages = 128;           // LOCKS budget k in pages (b = 16 k tokens)
  bool balance = true;              // DecodePlan's run-time balancing of ragged batches
  int n_pages_pool = 0;             // 0: sized from the GPU's free memory after the weights
  EngineWeights weights = EngineWeights::kAuto;
  int device = -1;  // -1: the current device
};

/// The GPU engine for `model` (weights uploaded as bf16). Throws std::runtime_error naming what is
/// missing when there is no usable GPU, cuBLAS cannot be loaded, or the weights or the context do not
/// fit ("... needs 17.2 GiB ...; 12.0 GiB are free"), and std::invalid_argument for a shape the
/// kernels do not support (LOCKS: head_dim 64 or 128 and GQA group <= 16).
std::unique_ptr<ForwardOps> make_cuda_forward(const LlamaModel& model, const EngineConfig& cfg);

}  // namespace locks::cuda
