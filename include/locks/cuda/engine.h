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
  /// Decode with the oracle instead (exact page log-masses from every key, then the LOCKS selection
  /// and sparse attention): the ceiling an evaluation compares LOCKS with. Not with `locks`.
  bool oracle = false;
  int budget_pages = 128;   // LOCKS budget k in pages (b = 16 k tokens)
  bool balance = true;      // DecodePlan's run-time balancing of ragged batches
  int n_pages_pool = 0;     // 0: sized from the GPU's free memory after the weights
  bool decode_gemv = true;  // batch-1 bf16 products through our GEMV (gemv.h); false: cuBLAS
  EngineWeights weights = EngineWeights::kAuto;
  int device = -1;  // -1: the current device
};

/// The GPU engine for `model` (weights uploaded as bf16). Throws std::runtime_error naming what is
/// missing when there is no usable GPU, cuBLAS cannot be loaded, or the weights or the context do not
/// fit ("... needs 17.2 GiB ...; 12.0 GiB are free"), and std::invalid_argument for a shape the
/// kernels do not support (LOCKS: head_dim 64 or 128 and GQA group <= 16).
std::unique_ptr<ForwardOps> make_cuda_forward(const LlamaModel& model, const EngineConfig& cfg);

/// A second engine holding a copy of `src`'s sequences (KV pages, lengths; the last logits are the
/// caller's) that decodes by `cfg` (its mode, budget and pool; n_ctx, max_seqs, dtype and the weights,
/// shared, are src's). The summaries of every full page are copied or, where src kept none, built (one
/// launch per layer), so a LOCKS fork selects exactly as if it had run from the start. `src` must
/// come from make_cuda_forward or cuda_fork (else std::invalid_argument); throws what
/// make_cuda_forward throws when the copy does not fit.
std::unique_ptr<ForwardOps> cuda_fork(const ForwardOps& src, EngineConfig cfg);

}  // namespace locks::cuda
