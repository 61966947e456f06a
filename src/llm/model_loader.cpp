// GGUF -> LlamaModel: hyper-parameters from `llama.*` keys, weights dequantized to float32.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <filesystem>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

#include "locks/model.h"

namespace locks {

namespace {

Matrix load_matrix(const GgufFile& f, const std::string& name, int rows, int cols) {
  const GgufTensorInfo& t = f.tensor(name);
  if (t.ne.size() != 2 || t.ne[0] != uint64_t(cols) || t.ne[1] != uint64_t(rows))
    throw std::runtime_error(fmt::format("GGUF '{}': tensor '{}' has shape [{}], expected [{}, {}]", f.name(), name,
                                         fmt::join(t.ne, ", "), cols, rows));
  return Matrix{rows, cols, f.dequantize(t)};
}

std::vector<float> load_vector(const GgufFile& f, const std::string& name, int n) {
  const GgufTensorInfo& t = f.tensor(name);
  if (t.n_elements != uint64_t(n))
    throw std::runtime_error(
        fmt::format("GGUF '{}': tensor '{}' has {} elements, expected {}", f.name(), name, t.n_elements, n));
  return f.dequantize(t);
}

}  // namespace

LlamaModel LlamaModel::load(const std::string& path) {
  try {
    return from_gguf(GgufFile::open(path));
  } catch (const std::bad_alloc&) {  // (the caller's "use less context" advice would not apply)
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    throw std::runtime_error(fmt::format(
        "GGUF '{}': out of memory loading the model ({:.1f} GB file; it is read whole and its weights are held "
        "as f32)",
        path, ec ? 0.0 : double(size) / 1e9));
  }
}

LlamaModel LlamaModel::from_gguf(const GgufFile& f) {
  const std::string arch = f.get_string("general.architecture");
  if (arch != "llama")
    throw std::runtime_error(
        fmt::format("GGUF '{}': architecture {} is not supported (expected llama)", f.name(), gguf_quoted(arch)));
  LlamaModel m;
  m.name = f.has_key("general.name") ? f.get_string("general.name") : f.name();
  LlamaHparams& hp = m.hp;
  auto bad = [&](const std::string& what) { return std::runtime_error(fmt::format("GGUF '{}': {}", f.name(), what)); };
  // A size key read as u32 and checked before it becomes an int (0xFFFFFFFF must not wrap to -1).
  auto size_key = [&](const char* key, uint32_t v, uint32_t max) {
    if (v == 0 || v > max) throw bad(fmt::format("{} = {} is outside [1, {}]", key, v, max));
    return int(v);
  };
  hp.n_ctx_train = size_key("llama.context_length", f.get_u32("llama.context_length"), 1u << 30);
  hp.n_embd = size_key("llama.embedding_length", f.get_u32("llama.embedding_length"), 65536);
  hp.n_layer = size_key("llama.block_count", f.get_u32("llama.block_count"), 1024);
  hp.n_ff = size_key("llama.feed_forward_length", f.get_u32("llama.feed_forward_length"), 1u << 20);
  hp.n_head = size_key("llama.attention.head_count", f.get_u32("llama.attention.head_count"), 1024);
  hp.n_head_kv = size_key("llama.attention.head_count_kv",
                          f.get_u32_or("llama.attention.head_count_kv", uint32_t(hp.n_head)), 1024);
  // Optional keys: llama.cpp's defaults, noted (a silently different rope base or tokenizer changes
  // the output). head_count_kv and rope.dimension_count are left out of the notes: their absence is
  // how a multi-head model with full rotary dimensions is written.
  auto note_missing = [&](const char* key, const std::string& what) {
    if (!f.has_key(key)) m.defaults_used.push_back(fmt::format("{} is missing: {} (llama.cpp's default)", key, what));
  };
  auto f32_or_noted = [&](const char* key, float fallback) {
    note_missing(key, fmt::format("{}", fallback));
    return f.get_f32_or(key, fallback);
  };
  hp.rope_freq_base = f32_or_noted("llama.rope.freq_base", 10000.0f);
  hp.rms_eps = f32_or_noted("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  note_missing("tokenizer.ggml.scores", "every piece scored 0 (merges by piece order only)");
  note_missing("tokenizer.ggml.token_type", "every piece a normal token");
  if (hp.n_embd % hp.n_head != 0) throw bad(fmt::format("n_embd {} not divisible by n_head {}", hp.n_embd, hp.n_head));
  if (hp.n_head % hp.n_head_kv != 0)
    throw bad(fmt::format("n_head {} not divisible by n_head_kv {}", hp.n_head, hp.n_head_kv));
  hp.head_dim = hp.n_embd / hp.n_head;
  const uint32_t n_rot = f.get_u32_or("llama.rope.dimension_count", uint32_t(hp.head_dim));
  if (n_rot == 0 || n_rot > uint32_t(hp.head_dim) || n_rot % 2 != 0)
    throw bad(fmt::format("llama.rope.dimension_count {} invalid for head_dim {}", n_rot, hp.head_dim));
  hp.n_rot = int(n_rot);
  if (!(hp.rope_freq_base > 0.0f) || !(hp.rms_eps > 0.0f) || !std::isfinite(hp.rope_freq_base) ||
      !std::isfinite(hp.rms_eps))
    throw bad(
        fmt::format("rope freq_base {} and RMSNorm eps {} must be finite and positive", hp.rope_freq_base, hp.rms_eps));

  m.tokenizer = Tokenizer::from_gguf(f);
  hp.n_vocab = m.tokenizer.n_vocab();
  // Optional, but when present it must agree with the token list the embedding rows are sized by.
  if (f.has_key("llama.vocab_size") && f.get_u32("llama.vocab_size") != uint32_t(hp.n_vocab))
    throw bad(fmt::format("llama.vocab_size = {} disagrees with the {} tokens of tokenizer.ggml.tokens",
                          f.get_u32("llama.vocab_size"), hp.n_vocab));
  const int E = hp.n_embd, HD = hp.head_dim;
  m.tok_embd = load_matrix(f, "token_embd.weight", hp.n_vocab, E);
  m.output_norm = load_vector(f, "output_norm.weight", E);
  if (f.find_tensor("output.weight")) m.output = load_matrix(f, "output.weight", hp.n_vocab, E);
  // A block count below the file's blocks would silently run a truncated model.
  for (const GgufTensorInfo& t : f.tensors()) {
    if (t.name.rfind("blk.", 0) != 0) continue;
    const size_t end = t.name.find_first_not_of("0123456789", 4);
    if (end == 4 || end == std::string::npos || t.name[end] != '.') continue;  // not "blk.<digits>."
    const std::string_view digits(t.name.data() + 4, end - 4);
    if (digits.size() > 9 || std::stoi(std::string(digits)) >= hp.n_layer)
      throw bad(fmt::format("tensor {} belongs to block {}, but llama.block_count is {}", gguf_quoted(t.name), digits,
                            hp.n_layer));
  }
  m.layers.resize(hp.n_layer);
  for (int il = 0; il < hp.n_layer; ++il) {
    const std::string p = fmt::format("blk.{}.", il);
    LlamaLayer& L = m.layers[il];
    L.attn_norm = load_vector(f, p + "attn_norm.weight", E);
    L.wq = load_matrix(f, p + "attn_q.weight", hp.n_head * HD, E);
    L.wk = load_matrix(f, p + "attn_k.weight", hp.n_head_kv * HD, E);
    L.wv = load_matrix(f, p + "attn_v.weight", hp.n_head_kv * HD, E);
    L.wo = load_matrix(f, p + "attn_output.weight", E, hp.n_head * HD);
    L.ffn_norm = load_vector(f, p + "ffn_norm.weight", E);
    L.w_gate = load_matrix(f, p + "ffn_gate.weight", hp.n_ff, E);
    L.w_up = load_matrix(f, p + "ffn_up.weight", hp.n_ff, E);
    L.w_down = load_matrix(f, p + "ffn_down.weight", E, hp.n_ff);
  }
  return m;
}

}  // namespace locks
