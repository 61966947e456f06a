// Decoder-only transformer loaded from GGUF, by `general.architecture` (llama.cpp's conventions):
//   llama  RoPE "normal" (interleaved pairs 2i, 2i+1), optional `rope_freqs.weight` (Llama-3.1 RoPE
//          scaling: per-pair frequency divisors), tied output when `output.weight` is absent;
//   qwen2  as llama plus Q/K/V biases, NEOX RoPE (pairs i, i + n_rot/2);
//   qwen3  as llama plus per-head RMSNorm of q and k before RoPE, NEOX RoPE, head_dim from
//          `qwen3.attention.key_length` (need not be n_embd / n_head), no biases.
// All share RMSNorm, SwiGLU FFN and GQA; the forward pass is one (llama_forward, locks/forward.h),
// its operations switched by the flags in LlamaHparams. Weights are dequantized to float32 at load.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "locks/gguf.h"
#include "locks/tokenizer.h"

namespace locks {

/// Which dimensions RoPE rotates together (llama.cpp's LLAMA_ROPE_TYPE_NORM / _NEOX).
enum class RopeStyle {
  kNormal,  // pairs (2i, 2i+1) of each head (llama)
  kNeox     // pairs (i, i + n_rot/2) (qwen2, qwen3)
};

struct LlamaHparams {
  std::string arch = "llama";  // general.architecture; the GGUF keys below are prefixed by it
  int n_vocab = 0;
  int n_ctx_train = 0;  // <arch>.context_length
  int n_embd = 0;       // d_model
  int n_layer = 0;
  int n_ff = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;  // <arch>.attention.key_length, else n_embd / n_head
  int n_rot = 0;     // rope dimension count (<= head_dim)
  float rope_freq_base = 10000.0f;
  float rms_eps = 1e-5f;
  RopeStyle rope_style = RopeStyle::kNormal;
  bool attn_bias = false;     // q, k, v += bq, bk, bv after the projections (qwen2)
  bool attn_qk_norm = false;  // q, k of each head RMSNormed with attn_q_norm / attn_k_norm before RoPE (qwen3)
  int n_group() const { return n_head / n_head_kv; }  // G
};

/// Row-major float32 matrix [rows][cols]; y = W x multiplies rows by x. A tensor the file stores as
/// Q8_0 also keeps its codes: q8 [rows][cols] int8 and q8_scale [rows][cols / 32] float32, with
/// data[r][c] == q8[r][c] * q8_scale[r][c / 32] exactly; the CPU decode step reads those (a quarter
/// of the bytes), prefill and the GPU upload read `data`.
struct Matrix {
  int rows = 0, cols = 0;
  std::vector<float> data;
  std::vector<int8_t> q8;
  std::vector<float> q8_scale;
  bool has_q8() const { return !q8.empty(); }
};

struct LlamaLayer {
  std::vector<float> attn_norm;                 // [n_embd]
  Matrix wq, wk, wv, wo;                        // [n_head*hd][n_embd], [n_kv*hd][n_embd] x2, [n_embd][n_head*hd]
  std::vector<float> bq, bk, bv;                // [n_head*hd], [n_kv*hd] x2; empty unless hp.attn_bias
  std::vector<float> attn_q_norm, attn_k_norm;  // [head_dim] each; empty unless hp.attn_qk_norm
  std::vector<float> ffn_norm;                  // [n_embd]
  Matrix w_gate, w_up, w_down;                  // [n_ff][n_embd] x2, [n_embd][n_ff]
};

/// What LlamaModel::from_gguf builds besides the weights.
struct ModelLoadOptions {
  /// Build the tokenizer from `tokenizer.ggml.*`. Off: `tokenizer` stays empty and n_vocab comes from
  /// the token list's length, `<arch>.vocab_size` or token_embd's rows (for callers that feed ids).
  bool tokenizer = true;
};

class LlamaModel {
 public:
  /// Map the file (GgufFile::open) and load hyper-parameters, weights and tokenizer. Throws
  /// std::runtime_error naming the file and: the unsupported architecture (with the supported ones),
  /// the required keys that are missing (all of them, in one message), an invalid key or tensor
  /// (wrong shape, unsupported type, head counts that do not divide), or the memory the weights need
  /// as f32 when /proc/meminfo's MemAvailable is smaller (checked before anything is allocated).
  static LlamaModel load(const std::string& path, const ModelLoadOptions& opts = {});
  /// The same from a parsed file (the memory check included).
  static LlamaModel from_gguf(const GgufFile& gguf, const ModelLoadOptions& opts = {});
  /// Bytes the weights of `gguf` take once loaded (every tensor as float32; Q8_0 tensors also keep
  /// their codes, counted as 2 bytes per weight): what loading needs.
  static uint64_t weight_bytes(const GgufFile& gguf);

  LlamaHparams hp;
  Matrix tok_embd;  // [n_vocab][n_embd]
  Matrix output;    // [n_vocab][n_embd]; empty when tied to tok_embd
  std::vector<float> output_norm;
  /// [n_rot/2] divisors of the RoPE frequencies (`rope_freqs.weight`, Llama-3.1 scaling): pair i
  /// turns by pos * base^(-2i/n_rot) / rope_freqs[i]. Empty: no scaling.
  std::vector<float> rope_freqs;
  std::vector<LlamaLayer> layers;
  Tokenizer tokenizer;
  std::string name;
  /// Optional GGUF keys the file lacks, each with the llama.cpp default that replaced it, e.g.
  /// "llama.rope.freq_base is missing: 10000 (llama.cpp's default)". A model whose converter left
  /// them out may decode differently from the model it was made from; the CLI prints them as warnings.
  std::vector<std::string> defaults_used;

  const Matrix& output_matrix() const { return output.data.empty() ? tok_embd : output; }
};

}  // namespace locks
