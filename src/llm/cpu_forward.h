// ForwardOps on the CPU (include/locks/forward.h): float32 weights (a decode step reads Q8_0 codes
// where the file has them), the paged KV cache in host memory, Eigen products parallel over OpenMP
// threads, and decode attention through a Selector (Alg. 2): select the pages of each GQA group,
// then exact attention over them.
#pragma once

#include <memory>
#include <vector>

#include "locks/forward.h"
#include "locks/kv_cache.h"
#include "locks/model.h"
#include "locks/selector.h"
#include "locks/session.h"

namespace locks {

class CpuForward final : public ForwardOps {
 public:
  /// `selector` is made for `cache_cfg` (make_selector). Throws std::invalid_argument for a cache
  /// the system refuses (PagedKvCache).
  CpuForward(const LlamaModel& model, const KvCacheConfig& cache_cfg, std::unique_ptr<Selector> selector,
             int budget_pages);
  /// Deep copy of the sequence (cache, page table, selector metadata); no observer.
  CpuForward(const CpuForward& o);
  CpuForward& operator=(const CpuForward&) = delete;

  bool begin(const ForwardStep& step) override;
  void embed() override;
  void rmsnorm(int il, NormWeight w) override;
  void qkv(int il) override;
  void rope_append(int il) override;
  void attention(int il) override;
  void project_add(int il, Projection p) override;
  void gate_up_swiglu(int il) override;
  void logits() override;
  void end() override {}
  void read_logits(int seq, std::span<float> out) override;
  int32_t n_tokens(int seq) const override { return seq_.n_tokens; }

  const PagedKvCache& cache() const { return cache_; }
  const KvSequence& sequence() const { return seq_; }
  const Selector& selector() const { return *selector_; }
  int budget_pages() const { return budget_pages_; }
  /// Replaces the selector (its metadata already built for this sequence) and the budget.
  void set_selector(std::unique_ptr<Selector> selector, int budget_pages);
  void set_observer(DecodeObserver* observer) { observer_ = observer; }

 private:
  const LlamaModel& model_;
  PagedKvCache cache_;
  KvSequence seq_;
  std::unique_ptr<Selector> selector_;
  int budget_pages_ = 0;
  DecodeObserver* observer_ = nullptr;
  std::vector<double> inv_freq_;  // RoPE: base^(-2i/n_rot)

  // The current step.
  std::span<const int32_t> tokens_;
  bool decode_ = false;
  DecodeTotals* totals_ = nullptr;
  int32_t pos0_ = 0;
  std::vector<int32_t> filled_;  // pages this step completes (Alg. 1 runs on them per layer)
  // Activations of the step's T rows.
  std::vector<float> x_, xn_;     // [T][n_embd]
  std::vector<float> q_, att_;    // [T][n_head][head_dim]
  std::vector<float> k_, v_;      // [T][n_head_kv][head_dim]
  std::vector<float> gate_, up_;  // [T][n_ff]; gate_ holds the SwiGLU product
  std::vector<float> tmp_;        // [T][n_embd]
  std::vector<float> logits_;     // [n_vocab] of the last row
};

}  // namespace locks
