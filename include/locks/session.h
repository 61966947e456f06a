// One sequence being generated: the model's forward pass (llama_forward, locks/forward.h) over a
// paged KV cache, with dense prefill and selector-driven sparse decode (Alg. 2 inside every layer's
// attention), on the CPU or on a CUDA GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "locks/forward.h"
#include "locks/kv_cache.h"
#include "locks/model.h"
#include "locks/selector.h"

namespace locks {

class CpuForward;

/// The longest context a Session accepts, in tokens (2^26; the page ids of a pool stay 32-bit).
constexpr int kMaxContextTokens = 1 << 26;

/// Where the forward pass runs.
enum class Device { kCpu, kCuda };
std::string device_name(Device d);          // "cpu" / "cuda"
Device parse_device(const std::string& s);  // throws std::invalid_argument on anything else
/// Why `device` does not run `selector` with `opts`, "" where it does (CUDA decodes with full, or
/// locks in its shipped summary format, or oracle with the share-average rule); Session throws
/// std::invalid_argument with it.
/// Why `device` cannot run here ("" where it can): no CUDA backend in this build, no usable GPU or
/// driver. A check for before a long setup; Session also throws it (std::runtime_error).
std::string device_unavailable(Device device);
std::string device_refusal(Device device, const std::string& selector, const SelectorOptions& opts);

/// The GPU engine's own settings (SessionConfig::device == Device::kCuda).
struct CudaSessionOptions {
  bool kv_bf16 = true;  // KV cache elements bf16 (else f16); SessionConfig::kv_dtype is the CPU's
  /// Matrix weights on the GPU: bf16, or float32 (the CPU engine's arithmetic, for models whose float32
  /// weights take at most 2 GiB: auto picks it for those, bf16 above).
  enum class Weights { kAuto, kBF16, kF32 } weights = Weights::kAuto;
  int gpu = -1;  // CUDA device ordinal; -1: the current one
};

struct SessionConfig {
  int n_ctx = 0;  // max tokens; 0 = the model's training context (negative: refused)
  KvDtype kv_dtype = KvDtype::F16;
  std::string selector = "full";  // see selector_names(); with Device::kCuda: full or locks
  int budget_tokens = 512;        // b = k * B tokens per KV head (multiple of B, >= 2B)
  SelectorOptions selector_opts;
  int prefill_chunk = 0;  // tokens per prefill forward (bounds activation memory); 0: 512 CPU, 4096 CUDA
  Device device = Device::kCpu;
  CudaSessionOptions cuda;
};

/// Sees the selections of a Session's decode steps (Session::set_observer): what an evaluation
/// measures against exact attention (FidelityProbe). The session calls it from its worker threads.
class DecodeObserver {
 public:
  virtual ~DecodeObserver() = default;
  /// Read once per layer of a decode step: while false the session neither calls observe() nor
  /// asks the selector for its page estimates (Selection::log_mass), so it pays nothing.
  virtual bool enabled() const { return true; }
  /// One (layer `il`, KV head `kv_head`) of a decode step, after attention: the cache and sequence
  /// (the step's token appended), the selector, q [n_group][head_dim] float32 post-RoPE, the budget
  /// in pages and the selection (with log_mass when the selector scores pages). Called concurrently
  /// for distinct kv_head values of one layer: an implementation must be thread-safe for those.
  virtual void observe(const PagedKvCache& cache, const KvSequence& seq, const Selector& selector, int il, int kv_head,
                       const float* q, int n_group, int budget_pages, const Selection& sel) = 0;
};

class Session {
 public:
  /// Throws std::invalid_argument for a bad budget (not a multiple of the page size or < 2 pages),
  /// an unknown selector, a context (cfg.n_ctx, or the model's when it is 0) outside [1, 2^26], or,
  /// on CUDA, a selector or shape the GPU engine does not run; std::runtime_error naming what is
  /// missing when Device::kCuda has no usable GPU, no cuBLAS or too little GPU memory (or the build
  /// has no CUDA backend).
  Session(const LlamaModel& model, const SessionConfig& cfg);
  /// CPU sessions only (a GPU sequence is not copied): throws std::logic_error on CUDA.
  Session(const Session& other);
  ~Session();
  /// A copy of this session's sequence (cache and last logits) that decodes with another selector
  /// and budget (`cfg.selector`, `cfg.budget_tokens`, `cfg.selector_opts`; n_ctx, dtype and device
  /// are kept). The new selector's per-page metadata is built for every full page (batched), exactly
  /// as if it had run from the start: prefill is dense, so the cache does not depend on the selector.
  /// On CUDA the copy is a second GPU engine sharing the weights (its KV pages copied on the device;
  /// std::runtime_error when they do not fit), with the selectors device_refusal allows.
  Session fork(const SessionConfig& cfg) const;
  /// The selector `cfg` names, with its per-page metadata built for every full page of this
  /// sequence (what fork(cfg) builds), for fork(cfg, prepared): forks that differ only in the
  /// budget then share one build (the metadata does not depend on the budget).
  std::unique_ptr<Selector> prepare_selector(const SessionConfig& cfg) const;
  /// fork(cfg) with a clone of `prepared` (prepare_selector(cfg) on this session, same selector and
  /// options; the sequence unchanged since) as the new selector; same result, no metadata build.
  /// Throws std::invalid_argument when `prepared` is not the selector cfg.selector names, or was
  /// made with other values of the options it reads (same_selector).
  Session fork(const SessionConfig& cfg, const Selector& prepared) const;
  Session& operator=(const Session&) = delete;

  /// Dense prefill of `tokens` appended to the sequence; returns logits [n_vocab] of the last one.
  /// Throws std::length_error when the sequence would exceed n_ctx, std::out_of_range on token
  /// ids outside the vocabulary.
  const std::vector<float>& prefill(std::span<const int32_t> tokens);
  /// One decode step for `token` through the selector; returns logits [n_vocab].
  const std::vector<float>& decode(int32_t token);

  int32_t n_tokens() const;
  /// Logits [n_vocab] of the last token processed (empty before the first forward).
  const std::vector<float>& logits() const { return logits_; }
  int n_ctx() const { return n_ctx_; }
  Device device() const { return cfg_.device; }
  const DecodeTotals& totals() const { return totals_; }
  /// The CPU engine's cache, sequence and selector: std::logic_error on CUDA (the cache is on the GPU).
  const PagedKvCache& cache() const;
  const KvSequence& sequence() const;
  const Selector& selector() const;
  const LlamaModel& model() const { return model_; }
  int budget_pages() const { return budget_pages_; }
  /// Attach an observer that sees every (layer, KV head) selection of later decode steps (nullptr
  /// detaches). Not owned; must outlive its use. Copies and forks start without one. CPU only: a
  /// non-null observer on CUDA throws std::logic_error.
  void set_observer(DecodeObserver* observer);

 private:
  void forward(std::span<const int32_t> tokens, bool decode_step);
  static int check_budget(int budget_tokens, int page_size);
  Session fork_with(const SessionConfig& cfg, std::unique_ptr<Selector> selector) const;
  Session fork_on_gpu(const SessionConfig& cfg) const;
  Session(const Session& base, const SessionConfig& cfg, std::unique_ptr<ForwardOps> ops);  // a GPU fork
  CpuForward& cpu(const char* what) const;

  const LlamaModel& model_;
  SessionConfig cfg_;
  int n_ctx_ = 0;
  int budget_pages_ = 0;
  int prefill_chunk_ = 0;
  std::unique_ptr<ForwardOps> ops_;  // the device's operations
  CpuForward* cpu_ = nullptr;        // ops_ on the CPU
  std::vector<float> logits_;
  DecodeTotals totals_;
};

}  // namespace locks
