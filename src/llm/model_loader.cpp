// GGUF -> LlamaModel: the architecture from `general.architecture`, hyper-parameters from its
// `<arch>.*` keys, weights dequantized to float32 (model.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

#include "locks/model.h"
#include "locks/quant.h"

namespace locks {

namespace {

Matrix load_matrix(const GgufFile& f, const std::string& name, int rows, int cols) {
  const GgufTensorInfo& t = f.tensor(name);
  if (t.ne.size() != 2 || t.ne[0] != uint64_t(cols) || t.ne[1] != uint64_t(rows))
    throw std::runtime_error(fmt::format("GGUF '{}': tensor '{}' has shape [{}], expected [{}, {}]", f.name(), name,
                                         fmt::join(t.ne, ", "), cols, rows));
  Matrix m{rows, cols, f.dequantize(t), {}, {}};
  if (t.type == uint32_t(GgmlType::Q8_0)) {  // {f16 d, int8 qs[32]} per block, rows whole blocks (ggml)
    const size_t n_blocks = size_t(rows) * (cols / 32);
    m.q8.resize(size_t(rows) * cols);
    m.q8_scale.resize(n_blocks);
    for (size_t b = 0; b < n_blocks; ++b) {
      const uint8_t* src = t.data + b * 34;
      m.q8_scale[b] = f16_to_f32(uint16_t(src[0] | (src[1] << 8)));
      std::memcpy(&m.q8[b * 32], src + 2, 32);
    }
  }
  return m;
}

std::vector<float> load_vector(const GgufFile& f, const std::string& name, int n) {
  const GgufTensorInfo& t = f.tensor(name);
  if (t.n_elements != uint64_t(n))
    throw std::runtime_error(
        fmt::format("GGUF '{}': tensor '{}' has {} elements, expected {}", f.name(), name, t.n_elements, n));
  return f.dequantize(t);
}

// What an architecture adds to the llama graph (model.h).
struct ArchSpec {
  const char* name;
  RopeStyle rope_style;
  bool attn_bias, attn_qk_norm;
};
constexpr ArchSpec kArchs[] = {
    {"llama", RopeStyle::kNormal, false, false},
    {"qwen2", RopeStyle::kNeox, true, false},
    {"qwen3", RopeStyle::kNeox, false, true},
};

// MemAvailable of /proc/meminfo in bytes; 0 when it cannot be read (the check is then skipped).
uint64_t mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

}  // namespace

uint64_t LlamaModel::weight_bytes(const GgufFile& f) {
  uint64_t n = 0;
  for (const GgufTensorInfo& t : f.tensors()) {
    uint64_t b = 0;  // saturates: a hostile header must not wrap to a small size
    // Q8_0 tensors keep their codes too: a byte per weight and a float per 32 beside the f32 copy.
    const uint64_t per_weight = t.type == uint32_t(GgmlType::Q8_0) ? sizeof(float) + 2 : sizeof(float);
    if (__builtin_mul_overflow(t.n_elements, per_weight, &b) || __builtin_add_overflow(n, b, &n)) return UINT64_MAX;
  }
  return n;
}

LlamaModel LlamaModel::load(const std::string& path, const ModelLoadOptions& opts) {
  try {
    return from_gguf(GgufFile::open(path), opts);
  } catch (const std::bad_alloc&) {  // (the caller's "use less context" advice would not apply)
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    throw std::runtime_error(
        fmt::format("GGUF '{}': out of memory loading the model ({:.1f} GB file; its weights are held as f32)", path,
                    ec ? 0.0 : double(size) / 1e9));
  }
}

LlamaModel LlamaModel::from_gguf(const GgufFile& f, const ModelLoadOptions& opts) {
  const std::string arch = f.get_string("general.architecture");
  const ArchSpec* spec = nullptr;
  for (const ArchSpec& a : kArchs)
    if (arch == a.name) spec = &a;
  if (!spec)
    throw std::runtime_error(fmt::format("GGUF '{}': architecture {} is not supported (supported: llama, qwen2, qwen3)",
                                         f.name(), gguf_quoted(arch)));
  auto bad = [&](const std::string& what) { return std::runtime_error(fmt::format("GGUF '{}': {}", f.name(), what)); };
  // Before anything is allocated: the weights are held as f32, which may be several times the file.
  const uint64_t need = weight_bytes(f), avail = mem_available_bytes();
  if (avail > 0 && need > avail)
    throw bad(
        fmt::format("the model needs {:.1f} GB of memory for its weights as f32, but only {:.1f} GB is available "
                    "(MemAvailable in /proc/meminfo)",
                    double(need) / 1e9, double(avail) / 1e9));
  // Every key is <arch>.<name>; the required ones are checked together so one message names all.
  auto key = [&](const char* k) { return arch + "." + k; };
  {
    std::vector<std::string> missing;
    for (const char* k :
         {"context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count"})
      if (!f.has_key(key(k))) missing.push_back(key(k));
    if (!missing.empty())
      throw bad(fmt::format("architecture {} needs {} {}, missing from the file", arch,
                            missing.size() == 1 ? "key" : "keys", fmt::join(missing, ", ")));
  }
  LlamaModel m;
  m.name = f.has_key("general.name") ? f.get_string("general.name") : f.name();
  LlamaHparams& hp = m.hp;
  hp.arch = arch;
  hp.rope_style = spec->rope_style;
  hp.attn_bias = spec->attn_bias;
  hp.attn_qk_norm = spec->attn_qk_norm;
  // A size key read as u32 and checked before it becomes an int (0xFFFFFFFF must not wrap to -1).
  auto size_key = [&](const char* k, uint32_t max) {
    const uint32_t v = f.get_u32(key(k));
    if (v == 0 || v > max) throw bad(fmt::format("{} = {} is outside [1, {}]", key(k), v, max));
    return int(v);
  };
  hp.n_ctx_train = size_key("context_length", 1u << 30);
  hp.n_embd = size_key("embedding_length", 65536);
  hp.n_layer = size_key("block_count", 1024);
  hp.n_ff = size_key("feed_forward_length", 1u << 20);
  hp.n_head = size_key("attention.head_count", 1024);
  hp.n_head_kv = f.has_key(key("attention.head_count_kv")) ? size_key("attention.head_count_kv", 1024) : hp.n_head;
  // Optional keys: llama.cpp's defaults, noted (a silently different rope base or tokenizer changes
  // the output). head_count_kv, key_length and rope.dimension_count are left out of the notes: their
  // absence is how a multi-head model with full rotary dimensions is written.
  auto note_missing = [&](const std::string& k, const std::string& what) {
    if (!f.has_key(k)) m.defaults_used.push_back(fmt::format("{} is missing: {} (llama.cpp's default)", k, what));
  };
  auto f32_or_noted = [&](const char* k, float fallback) {
    note_missing(key(k), fmt::format("{}", fallback));
    return f.get_f32_or(key(k), fallback);
  };
  hp.rope_freq_base = f32_or_noted("rope.freq_base", 10000.0f);
  hp.rms_eps = f32_or_noted("attention.layer_norm_rms_epsilon", 1e-5f);
  // Scores and types matter to the SentencePiece vocabulary; byte-level BPE (gpt2) merges by rank.
  const GgufValue* vocab_model = f.find("tokenizer.ggml.model");
  const bool spm = !vocab_model || vocab_model->type != GgufValue::Type::STRING ||
                   std::get<std::string>(vocab_model->value) == "llama";
  if (opts.tokenizer && spm) {
    note_missing("tokenizer.ggml.scores", "every piece scored 0 (merges by piece order only)");
    note_missing("tokenizer.ggml.token_type", "every piece a normal token");
  }
  if (hp.n_head % hp.n_head_kv != 0)
    throw bad(fmt::format("n_head {} not divisible by n_head_kv {}", hp.n_head, hp.n_head_kv));
  if (f.has_key(key("attention.key_length"))) {
    hp.head_dim = size_key("attention.key_length", 4096);
    if (f.has_key(key("attention.value_length")) && size_key("attention.value_length", 4096) != hp.head_dim)
      throw bad(fmt::format("{} = {} differs from {} = {} (only equal key and value heads are supported)",
                            key("attention.value_length"), f.get_u32(key("attention.value_length")),
                            key("attention.key_length"), hp.head_dim));
  } else {
    if (hp.n_embd % hp.n_head != 0)
      throw bad(fmt::format("n_embd {} not divisible by n_head {}", hp.n_embd, hp.n_head));
    hp.head_dim = hp.n_embd / hp.n_head;
  }
  const uint32_t n_rot = f.get_u32_or(key("rope.dimension_count"), uint32_t(hp.head_dim));
  if (n_rot == 0 || n_rot > uint32_t(hp.head_dim) || n_rot % 2 != 0)
    throw bad(fmt::format("{} {} invalid for head_dim {}", key("rope.dimension_count"), n_rot, hp.head_dim));
  hp.n_rot = int(n_rot);
  if (!(hp.rope_freq_base > 0.0f) || !(hp.rms_eps > 0.0f) || !std::isfinite(hp.rope_freq_base) ||
      !std::isfinite(hp.rms_eps))
    throw bad(
        fmt::format("rope freq_base {} and RMSNorm eps {} must be finite and positive", hp.rope_freq_base, hp.rms_eps));

  if (opts.tokenizer) {
    m.tokenizer = Tokenizer::from_gguf(f);
    hp.n_vocab = m.tokenizer.n_vocab();
  } else if (f.has_key("tokenizer.ggml.tokens")) {
    hp.n_vocab = int(f.get_string_array("tokenizer.ggml.tokens").size());
  } else if (f.has_key(key("vocab_size"))) {
    hp.n_vocab = size_key("vocab_size", 1u << 24);
  } else {
    const GgufTensorInfo& emb = f.tensor("token_embd.weight");
    if (emb.ne.size() != 2 || emb.ne[1] > (1u << 24))
      throw bad(fmt::format("tensor 'token_embd.weight' has shape [{}], expected [n_embd, n_vocab <= 2^24]",
                            fmt::join(emb.ne, ", ")));
    hp.n_vocab = int(emb.ne[1]);
  }
  if (hp.n_vocab <= 0) throw bad("the vocabulary is empty");
  // Optional, but when present it must agree with the token list the embedding rows are sized by.
  if (f.has_key(key("vocab_size")) && f.get_u32(key("vocab_size")) != uint32_t(hp.n_vocab))
    throw bad(fmt::format("{} = {} disagrees with the {} tokens of tokenizer.ggml.tokens", key("vocab_size"),
                          f.get_u32(key("vocab_size")), hp.n_vocab));
  const int E = hp.n_embd, HD = hp.head_dim;
  m.tok_embd = load_matrix(f, "token_embd.weight", hp.n_vocab, E);
  m.output_norm = load_vector(f, "output_norm.weight", E);
  if (f.find_tensor("output.weight")) m.output = load_matrix(f, "output.weight", hp.n_vocab, E);
  if (f.find_tensor("rope_freqs.weight")) {
    m.rope_freqs = load_vector(f, "rope_freqs.weight", hp.n_rot / 2);
    for (size_t i = 0; i < m.rope_freqs.size(); ++i)
      if (!(m.rope_freqs[i] > 0.0f) || !std::isfinite(m.rope_freqs[i]))
        throw bad(fmt::format("tensor 'rope_freqs.weight' element {} is {}, expected a finite positive divisor", i,
                              m.rope_freqs[i]));
  }
  // A block count below the file's blocks would silently run a truncated model.
  for (const GgufTensorInfo& t : f.tensors()) {
    if (t.name.rfind("blk.", 0) != 0) continue;
    const size_t end = t.name.find_first_not_of("0123456789", 4);
    if (end == 4 || end == std::string::npos || t.name[end] != '.') continue;  // not "blk.<digits>."
    const std::string_view digits(t.name.data() + 4, end - 4);
    if (digits.size() > 9 || std::stoi(std::string(digits)) >= hp.n_layer)
      throw bad(fmt::format("tensor {} belongs to block {}, but {} is {}", gguf_quoted(t.name), digits,
                            key("block_count"), hp.n_layer));
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
    if (hp.attn_bias) {
      L.bq = load_vector(f, p + "attn_q.bias", hp.n_head * HD);
      L.bk = load_vector(f, p + "attn_k.bias", hp.n_head_kv * HD);
      L.bv = load_vector(f, p + "attn_v.bias", hp.n_head_kv * HD);
    }
    if (hp.attn_qk_norm) {
      L.attn_q_norm = load_vector(f, p + "attn_q_norm.weight", HD);
      L.attn_k_norm = load_vector(f, p + "attn_k_norm.weight", HD);
    }
    L.ffn_norm = load_vector(f, p + "ffn_norm.weight", E);
    L.w_gate = load_matrix(f, p + "ffn_gate.weight", hp.n_ff, E);
    L.w_up = load_matrix(f, p + "ffn_up.weight", hp.n_ff, E);
    L.w_down = load_matrix(f, p + "ffn_down.weight", E, hp.n_ff);
  }
  return m;
}

}  // namespace locks
