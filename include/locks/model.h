// Llama-architecture model loaded from GGUF (llama.cpp "llama" conventions): RMSNorm, RoPE "normal"
// (interleaved pairs 2i, 2i+1), SwiGLU FFN, GQA, tied output when `output.weight` is absent.
// Weights are dequantized to float32 at load (the reference models are small; math is float32).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "locks/gguf.h"
#include "locks/tokenizer.h"

namespace locks {

struct LlamaHparams {
  int n_vocab = 0;
  int n_ctx_train = 0;  // llama.context_length
  int n_embd = 0;       // d_model
  int n_layer = 0;
  int n_ff = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;  // n_embd / n_head
  int n_rot = 0;     // rope dimension count (<= head_dim)
  float rope_freq_base = 10000.0f;
  float rms_eps = 1e-5f;
  int n_group() const { return n_head / n_head_kv; }  // G
};

/// Row-major float32 matrix [rows][cols]; y = W x multiplies rows by x.
struct Matrix {
  int rows = 0, cols = 0;
  std::vector<float> data;
};

struct LlamaLayer {
  std::vector<float> attn_norm;  // [n_embd]
  Matrix wq, wk, wv, wo;         // [n_head*hd][n_embd], [n_kv*hd][n_embd] x2, [n_embd][n_head*hd]
  std::vector<float> ffn_norm;   // [n_embd]
  Matrix w_gate, w_up, w_down;   // [n_ff][n_embd] x2, [n_embd][n_ff]
};

class LlamaModel {
 public:
  /// Load hyper-parameters, weights and tokenizer. Throws std::runtime_error naming the file and the
  /// missing/invalid key or tensor (wrong shape, unsupported type, architecture not "llama",
  /// head counts that do not divide), or that memory ran out while loading it (the file is read
  /// whole and the weights are held as f32).
  static LlamaModel load(const std::string& path);
  static LlamaModel from_gguf(const GgufFile& gguf);

  LlamaHparams hp;
  Matrix tok_embd;  // [n_vocab][n_embd]
  Matrix output;    // [n_vocab][n_embd]; empty when tied to tok_embd
  std::vector<float> output_norm;
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
