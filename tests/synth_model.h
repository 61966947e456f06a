// Models of the llama / qwen2 / qwen3 architectures written as GGUF in memory (F32 weights from a
// seeded normal distribution), for tests of the loader and of the engines on architectures that
// ../shared has no file of (qwen3).
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gguf_writer.h"
#include "test_util.h"

namespace locks::test {

struct SynthSpec {
  std::string arch = "qwen3";
  int n_vocab = 50, n_embd = 64, n_head = 4, n_head_kv = 2, head_dim = 32, n_ff = 96, n_layer = 2;
  std::vector<std::string> skip_keys, skip_tensors;
};

// A model of `spec.arch` with F32 weights drawn from a seeded normal distribution (norm weights
// around 1); tensor names and shapes as llama.cpp writes them (ne innermost first).
inline std::vector<uint8_t> synth_model(const SynthSpec& sp) {
  std::mt19937 rng(3);
  const int E = sp.n_embd, HD = sp.head_dim, NH = sp.n_head, NKV = sp.n_head_kv, F = sp.n_ff;
  std::vector<std::pair<std::string, std::vector<uint64_t>>> shapes;
  std::map<std::string, std::vector<float>> data;
  auto add = [&](const std::string& name, std::vector<uint64_t> ne, bool norm) {
    for (const auto& s : sp.skip_tensors)
      if (s == name) return;
    uint64_t n = 1;
    for (uint64_t d : ne) n *= d;
    std::vector<float> v = randn(rng, n, norm ? 0.1 : 1.0 / std::sqrt(double(ne[0])));
    if (norm)
      for (float& x : v) x += 1.0f;
    shapes.emplace_back(name, ne);
    data[name] = std::move(v);
  };
  add("token_embd.weight", {uint64_t(E), uint64_t(sp.n_vocab)}, false);
  add("output_norm.weight", {uint64_t(E)}, true);
  for (int il = 0; il < sp.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    add(p + "attn_norm.weight", {uint64_t(E)}, true);
    add(p + "attn_q.weight", {uint64_t(E), uint64_t(NH * HD)}, false);
    add(p + "attn_k.weight", {uint64_t(E), uint64_t(NKV * HD)}, false);
    add(p + "attn_v.weight", {uint64_t(E), uint64_t(NKV * HD)}, false);
    add(p + "attn_output.weight", {uint64_t(NH * HD), uint64_t(E)}, false);
    if (sp.arch == "qwen3") {
      add(p + "attn_q_norm.weight", {uint64_t(HD)}, true);
      add(p + "attn_k_norm.weight", {uint64_t(HD)}, true);
    }
    if (sp.arch == "qwen2") {
      add(p + "attn_q.bias", {uint64_t(NH * HD)}, true);
      add(p + "attn_k.bias", {uint64_t(NKV * HD)}, true);
      add(p + "attn_v.bias", {uint64_t(NKV * HD)}, true);
    }
    add(p + "ffn_norm.weight", {uint64_t(E)}, true);
    add(p + "ffn_gate.weight", {uint64_t(E), uint64_t(F)}, false);
    add(p + "ffn_up.weight", {uint64_t(E), uint64_t(F)}, false);
    add(p + "ffn_down.weight", {uint64_t(F), uint64_t(E)}, false);
  }
  const std::string a = sp.arch;
  std::vector<std::pair<std::string, uint32_t>> u32 = {{a + ".context_length", 256},
                                                       {a + ".embedding_length", uint32_t(E)},
                                                       {a + ".block_count", uint32_t(sp.n_layer)},
                                                       {a + ".feed_forward_length", uint32_t(F)},
                                                       {a + ".attention.head_count", uint32_t(NH)},
                                                       {a + ".attention.head_count_kv", uint32_t(NKV)},
                                                       {a + ".attention.key_length", uint32_t(HD)},
                                                       {a + ".attention.value_length", uint32_t(HD)},
                                                       {a + ".vocab_size", uint32_t(sp.n_vocab)}};
  std::vector<std::pair<std::string, float>> f32 = {{a + ".rope.freq_base", 1000.0f},
                                                    {a + ".attention.layer_norm_rms_epsilon", 1e-6f}};
  auto skipped = [&](const std::string& k) {
    for (const auto& s : sp.skip_keys)
      if (s == k) return true;
    return false;
  };
  size_t n_kv = 1;
  for (const auto& [k, v] : u32) n_kv += !skipped(k);
  for (const auto& [k, v] : f32) n_kv += !skipped(k);
  test::GgufWriter w;
  w.header(shapes.size(), n_kv).kv_str("general.architecture", a);
  for (const auto& [k, v] : u32)
    if (!skipped(k)) w.kv_u32(k, v);
  for (const auto& [k, v] : f32)
    if (!skipped(k)) w.kv_f32(k, v);
  uint64_t off = 0;
  for (const auto& [name, ne] : shapes) {
    w.tensor(name, ne, 0, off);
    off += (data[name].size() * 4 + 31) / 32 * 32;
  }
  w.pad_to(32);
  for (const auto& [name, ne] : shapes) {
    for (float x : data[name]) w.f32(x);
    w.pad_to(32);
  }
  return w.b;
}

}  // namespace locks::test
