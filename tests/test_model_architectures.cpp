// The architectures of the loader (model.h) on GGUFs written here: qwen3 (per-head q/k RMSNorm,
// NEOX RoPE, head_dim from key_length unequal to n_embd / n_head, tied output) against the float64
// forward (ref_forward.h), prefill and decode; unsupported architectures and missing keys or tensors
// named in one error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <random>

#include "gguf_writer.h"
#include "locks/gguf.h"
#include "locks/model.h"
#include "locks/session.h"
#include "ref_forward.h"
#include "synth_model.h"
#include "test_util.h"

namespace locks {
namespace {

using test::synth_model;
using test::SynthSpec;
using ::testing::HasSubstr;

double rel_l2(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) num += (got[i] - want[i]) * (got[i] - want[i]), den += want[i] * want[i];
  return std::sqrt(num / den);
}

TEST(ModelArchitectures, Qwen3MatchesFloat64Forward) {
  const SynthSpec sp;
  const LlamaModel m =
      LlamaModel::from_gguf(GgufFile::from_bytes(synth_model(sp), "qwen3.gguf"), ModelLoadOptions{.tokenizer = false});
  EXPECT_EQ(m.hp.arch, "qwen3");
  EXPECT_EQ(m.hp.head_dim, 32);  // key_length, not n_embd / n_head = 16
  EXPECT_EQ(m.hp.n_rot, 32);
  EXPECT_EQ(m.hp.rope_style, RopeStyle::kNeox);
  EXPECT_TRUE(m.hp.attn_qk_norm);
  EXPECT_FALSE(m.hp.attn_bias);
  EXPECT_EQ(m.hp.n_vocab, 50);
  EXPECT_TRUE(m.output.data.empty());  // tied
  EXPECT_EQ(m.layers[1].attn_k_norm.size(), 32u);

  std::mt19937 rng(9);
  std::uniform_int_distribution<int32_t> tok(0, sp.n_vocab - 1);
  std::vector<int32_t> ids(40);
  for (auto& t : ids) t = tok(rng);
  SessionConfig sc;
  sc.kv_dtype = KvDtype::F32;
  sc.prefill_chunk = 16;  // three chunks: positions continue across prefill calls
  Session s(m, sc);
  const std::vector<float> got = s.prefill(std::span<const int32_t>(ids.data(), 36));
  const double err = rel_l2(got, test::ref_forward_last_logits(m, std::vector<int32_t>(ids.begin(), ids.begin() + 36)));
  std::printf("qwen3 (synthetic, F32): prefill last-logit relative L2 vs float64 %.2e\n", err);
  RecordProperty("prefill_rel_l2_vs_float64", std::to_string(err));
  EXPECT_LT(err, 1e-5);
  for (size_t n = 37; n <= ids.size(); ++n) {
    const std::vector<float> d = s.decode(ids[n - 1]);
    EXPECT_LT(rel_l2(d, test::ref_forward_last_logits(m, std::vector<int32_t>(ids.begin(), ids.begin() + n))), 1e-5)
        << "decode at position " << n - 1;
  }
  // The q/k norms matter: without them the float64 logits move far beyond the tolerance above.
  LlamaModel off = m;
  off.hp.attn_qk_norm = false;
  EXPECT_GT(rel_l2(got, test::ref_forward_last_logits(off, std::vector<int32_t>(ids.begin(), ids.begin() + 36))), 1e-2);
}

std::string load_error(const SynthSpec& sp) {
  return test::error_of<std::runtime_error>([&] {
    (void)LlamaModel::from_gguf(GgufFile::from_bytes(synth_model(sp), "m.gguf"), ModelLoadOptions{.tokenizer = false});
  });
}

TEST(ModelArchitectures, UnsupportedArchitectureAndMissingKeysAreNamed) {
  SynthSpec gemma;
  gemma.arch = "gemma";
  EXPECT_EQ(load_error(gemma), "GGUF 'm.gguf': architecture 'gemma' is not supported (supported: llama, qwen2, qwen3)");
  SynthSpec keys;
  keys.skip_keys = {"qwen3.block_count", "qwen3.feed_forward_length"};
  EXPECT_EQ(load_error(keys),
            "GGUF 'm.gguf': architecture qwen3 needs keys qwen3.block_count, qwen3.feed_forward_length, missing from "
            "the file");
  SynthSpec bias;
  bias.arch = "qwen2";
  bias.head_dim = 16;
  bias.skip_tensors = {"blk.1.attn_v.bias"};
  EXPECT_EQ(load_error(bias), "GGUF 'm.gguf': tensor 'blk.1.attn_v.bias' not found");
  SynthSpec norm;
  norm.skip_tensors = {"blk.0.attn_q_norm.weight"};
  EXPECT_EQ(load_error(norm), "GGUF 'm.gguf': tensor 'blk.0.attn_q_norm.weight' not found");
  // Without key_length the head size is n_embd / n_head, and the q projection then has the wrong shape.
  SynthSpec no_kl;
  no_kl.skip_keys = {"qwen3.attention.key_length", "qwen3.attention.value_length"};
  EXPECT_THAT(load_error(no_kl), HasSubstr("tensor 'blk.0.attn_q.weight' has shape [64, 128], expected [64, 64]"));
}

// A qwen2 file (biases, NEOX RoPE) and a llama file of the same sizes: each the float64 forward.
TEST(ModelArchitectures, Qwen2AndLlamaMatchFloat64Forward) {
  for (const char* arch : {"qwen2", "llama"}) {
    SynthSpec sp;
    sp.arch = arch;
    sp.head_dim = 16;
    const LlamaModel m =
        LlamaModel::from_gguf(GgufFile::from_bytes(synth_model(sp), "m.gguf"), ModelLoadOptions{.tokenizer = false});
    EXPECT_EQ(m.hp.attn_bias, std::string(arch) == "qwen2");
    std::vector<int32_t> ids;
    for (int i = 0; i < 30; ++i) ids.push_back((i * 7 + 3) % sp.n_vocab);
    SessionConfig sc;
    sc.kv_dtype = KvDtype::F32;
    Session s(m, sc);
    EXPECT_LT(rel_l2(s.prefill(ids), test::ref_forward_last_logits(m, ids)), 1e-5) << arch;
  }
}

}  // namespace
}  // namespace locks
