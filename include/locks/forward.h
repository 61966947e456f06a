// The Llama-family forward pass, written once over the operations of a device: llama_forward (at the
// end of this file) calls them top to bottom; the CPU engine (src/llm/cpu_forward.cpp) and the GPU
// engine (src/cuda/cuda_forward.cu) implement them. Selection (Alg. 2) is a detail of `attention`.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace locks {

/// Work done by decode steps, summed (bytes are per step summed over layers and KV heads).
struct DecodeTotals {
  int64_t steps = 0;
  double bytes_read = 0;      // selector reads + K/V of attended pages
  double dense_bytes = 0;     // K/V of every page (what full attention reads)
  double select_seconds = 0;  // CPU only: the selectors' time
  double score_seconds = 0;   // CPU only: the part of select_seconds spent estimating page log-masses
  double attend_seconds = 0;  // CPU only: decode attention's time
  double seconds = 0;         // whole decode steps
  /// CPU only: the (layer, KV head) selections of decode steps by how many pages each kept
  /// (pages_kept[n] selections kept n pages), and of the adaptive ones (BudgetRule) how many ran
  /// and how many reached their target share within the budget.
  std::vector<int64_t> pages_kept;
  int64_t mass_target_tried = 0, mass_target_met = 0;
};

/// The rows of one forward call. Prefill: `tokens` are consecutive positions of one sequence,
/// starting at its current length. Decode: one token per sequence of the batch (row b is sequence
/// b's next token), each at its sequence's current length.
struct ForwardStep {
  std::span<const int32_t> tokens;
  bool decode = false;
  DecodeTotals* totals = nullptr;  // decode: the bytes the step reads are added here (nullable)
};

/// Which RMSNorm weight a norm applies.
enum class NormWeight { kAttention, kFeedForward, kOutput };
/// Which projection a matrix product applies (x: the normed residual, att: attention output,
/// ffn: the SwiGLU product).
enum class Projection { kOutput, kDown };

/// The operations of one device. Activations live in the device's buffers for the rows of the
/// current step: x (residual stream), xn (normed), q/k/v, att, gate/up/ffn, logits. Errors throw
/// (std::invalid_argument for bad input the step names, std::runtime_error for device failures).
class ForwardOps {
 public:
  virtual ~ForwardOps() = default;
  /// Prepares the buffers and the cache positions for `step`. Returns false when the device ran the
  /// whole step itself (a CUDA graph captured from an earlier step of the same shape replayed): the
  /// calls that follow in llama_forward are what it captured.
  virtual bool begin(const ForwardStep& step) = 0;
  virtual void embed() = 0;                        // x = tok_embd[tokens]
  virtual void rmsnorm(int il, NormWeight w) = 0;  // xn = x / rms(x) * w (kOutput: last rows, il unused)
  virtual void qkv(int il) = 0;                    // q, k, v = xn W_q, xn W_k, xn W_v (+ bias: hp.attn_bias)
  /// Per-head RMSNorm of q, k (hp.attn_qk_norm), RoPE on q, k (hp.rope_style, model.rope_freqs); k, v
  /// into the paged cache; Alg. 1 on the pages that filled.
  virtual void rope_append(int il) = 0;
  virtual void attention(int il) = 0;                  // att = softmax(q K^T * scale) V (decode: over the selection)
  virtual void project_add(int il, Projection p) = 0;  // x += att W_o, or x += ffn W_down
  virtual void gate_up_swiglu(int il) = 0;             // ffn = silu(xn W_gate) * (xn W_up)
  virtual void logits() = 0;                           // logits = xn W_out for the last row of each sequence
  virtual void end() = 0;                              // the step's work is enqueued / done
  /// An operation threw between begin() and end(): drop what the step started (a graph capture).
  virtual void abort() noexcept {}
  /// Tokens sequence `seq` holds (in the cache, including a step that threw after appending).
  virtual int32_t n_tokens(int seq) const = 0;
  /// Copies sequence `seq`'s logits [n_vocab] of the last step to the host (waits for the step).
  virtual void read_logits(int seq, std::span<float> out) = 0;
};

/// Embed -> per layer {RMSNorm, QKV, RoPE + append K/V (+ Alg. 1 on pages that filled), attention
/// (decode: select -> attend, Alg. 2), output projection, RMSNorm, SwiGLU FFN} -> final norm ->
/// logits, on whatever device `ops` runs. `n_layer` is the model's layer count.
inline void llama_forward(ForwardOps& ops, int n_layer, const ForwardStep& step) {
  if (!ops.begin(step)) return;  // the device replayed a graph it captured from these same calls
  try {
    ops.embed();
    for (int il = 0; il < n_layer; ++il) {
      ops.rmsnorm(il, NormWeight::kAttention);
      ops.qkv(il);
      ops.rope_append(il);
      ops.attention(il);
      ops.project_add(il, Projection::kOutput);
      ops.rmsnorm(il, NormWeight::kFeedForward);
      ops.gate_up_swiglu(il);
      ops.project_add(il, Projection::kDown);
    }
    ops.rmsnorm(-1, NormWeight::kOutput);
    ops.logits();
  } catch (...) {
    ops.abort();
    throw;
  }
  ops.end();
}

}  // namespace locks
