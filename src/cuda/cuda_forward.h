// The GPU engine: ForwardOps (include/locks/forward.h) on CUDA. Weights bf16 (DeviceWeights), the
// paged KV cache and summaries on the device (DeviceKvCache), products through cuBLAS, the step's
// small operations and attention through our kernels. Prefill runs eagerly in chunks; a decode step
// of all layers is captured once as a CUDA graph per step shape and replayed for every token.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "device_kv_cache.h"
#include "device_weights.h"
#include "gemm.h"
#include "locks/cuda/engine.h"
#include "locks/forward.h"

namespace locks::cuda {

/// DecodeStatus and ModelStatus bits in words.
std::string describe_status(uint32_t status);

class CudaForward final : public ForwardOps {
 public:
  /// Throws std::invalid_argument for shapes the kernels do not support and std::runtime_error for
  /// a missing device, cuBLAS, or memory (each naming what is missing and how much was needed).
  CudaForward(std::shared_ptr<const DeviceWeights> weights, const EngineConfig& cfg);
  ~CudaForward() override;
  /// A copy of the sequences on a new engine that decodes by `cfg` (engine.h, cuda_fork).
  std::unique_ptr<CudaForward> fork(EngineConfig cfg) const;

  bool begin(const ForwardStep& step) override;
  void embed() override;
  void rmsnorm(int il, NormWeight w) override;
  void qkv(int il) override;
  void rope_append(int il) override;
  void attention(int il) override;
  void project_add(int il, Projection p) override;
  void gate_up_swiglu(int il) override;
  void logits() override;
  void end() override;
  void abort() noexcept override;
  void read_logits(int seq, std::span<float> out) override;
  int32_t n_tokens(int seq) const override { return cache_->length(seq); }

  cudaStream_t stream() const { return stream_; }
  DeviceKvCache& cache() { return *cache_; }
  const EngineConfig& config() const { return cfg_; }
  const DecodePlan* plan() const { return plan_ ? plan_.get() : nullptr; }
  /// Device logits [max_seqs][n_vocab] of the last step (decode: row b = sequence b; prefill: row 0).
  const float* device_logits() const { return logits_; }
  /// Greedy next tokens of the last step into device `ids` [max_seqs] (argmax, ties to the lower id).
  void argmax(int32_t* ids);
  /// Decode: the step runs the LOCKS selection (true) or dense attention. Graphs are kept per mode.
  void set_sparse(bool sparse) { sparse_ = sparse; }
  bool sparse() const { return sparse_; }
  /// Status bits (DecodeStatus) raised since the last call, cleared; synchronises the stream.
  uint32_t take_status();
  /// Drops the captured graphs (after the plan or buffers change).
  void reset_graphs();

  /// Parts of a decode step, for benchmarks that time them apart: steps captured while a part is
  /// off leave its launches out (the step's bookkeeping always runs). Resets the graphs.
  enum Part : unsigned {
    kPartGemm = 1,         // the matrix products (QKV, output, gate/up, down, logits)
    kPartScoreSelect = 2,  // LOCKS score pass + select
    kPartAttention = 4,    // attention (LOCKS: the sparse attention alone)
    kPartSummary = 8,      // Alg. 1 on pages that filled
    kPartOther = 16,       // embedding, norms, RoPE + append, SwiGLU, conversions
    kPartAll = 31,
  };
  void set_parts(unsigned parts);

 private:
  void check(cudaError_t e, const char* what) const;
  void account(DecodeTotals& t) const;
  void summarize_full_pages();  // Alg. 1 on every full page of every sequence and layer
  void debug(const char* op, const void* buf, size_t n, bool f32) const;  // the bytes the next decode step reads
  // y = x w^T (+ y): the GEMV at decode batch sizes, else cuBLAS. With y2, outputs from `split` on go
  // to y2 (row stride n_out - split), the others to y (row stride split).
  void gemm(const void* x, const void* w, float* y, int rows, int n_out, int n_in, bool accumulate, float* y2 = nullptr,
            int split = 0);

  std::shared_ptr<const DeviceWeights> w_;
  EngineConfig cfg_;
  LlamaHparams hp_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Gemm> gemm_;
  std::unique_ptr<DeviceKvCache> cache_;
  std::unique_ptr<DecodePlan> plan_;
  bool sparse_ = false;
  bool f32_ = false;  // float32 weights and product inputs (else bf16)
  unsigned parts_ = kPartAll;
  bool on(unsigned part) const { return (parts_ & part) != 0; }
  bool locks_capable_ = false;  // the fast decode kernels apply (head_dim 64/128, G <= 16)

  // Step state.
  bool decode_ = false;
  int rows_ = 0;         // rows of the current step
  int prefill_seq_ = 0;  // sequence of a prefill step
  bool capturing_ = false;
  cudaGraphExec_t graphs_[2][2] = {{nullptr, nullptr}, {nullptr, nullptr}};  // [sparse][fills a page]
  int graph_slot_fill_ = 0;

  // Device buffers (max_rows rows).
  void* buffers_ = nullptr;
  int32_t* tokens_ = nullptr;  // [max_rows]
  int32_t* tokens_pinned_ = nullptr;
  cudaEvent_t tokens_copied_ = nullptr;
  float* x_ = nullptr;          // [rows][n_embd] residual stream
  void* xn_ = nullptr;          // [rows][n_embd] normed, bf16 (float32 with f32_)
  float* q_ = nullptr;          // [rows][n_head][head_dim]
  float* kv_ = nullptr;         // [rows][2][n_head_kv][head_dim]: k then v of each row
  float* att_ = nullptr;        // [rows][n_head][head_dim]
  void* att_in_ = nullptr;      // att as the output projection's input: bf16 copy (att_ itself with f32_)
  float* gate_up_ = nullptr;    // [rows][2 n_ff]
  void* ffn_ = nullptr;         // [rows][n_ff] SwiGLU product, bf16 (float32 with f32_)
  float* logits_ = nullptr;     // [max_seqs][n_vocab]
  double* inv_freq_ = nullptr;  // [n_rot / 2]
  uint32_t* status_ = nullptr;  // [1] engine status word
  void* workspace_ = nullptr;   // the decode plan's
};

}  // namespace locks::cuda
