// The engine against external references: llama2.c's own stories260K output (200 greedy tokens)
// and float64 logits / greedy tokens of locks-ref-a computed on the dequantized weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>

#include "locks/generate.h"
#include "locks/gguf.h"
#include "locks/model.h"
#include "locks/session.h"
#include "test_paths.h"
#include "test_util.h"

using namespace locks;

namespace {
nlohmann::json load_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}
}  // namespace

TEST(ModelReference, Stories260KGreedyMatchesLlama2c) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  const auto ref = load_json(test::shared_path("models/stories260K.reference.json"));
  const LlamaModel model = LlamaModel::load(test::shared_path("models/stories260K-f32.gguf"));
  const auto expected = ref["greedy_from_bos"]["generated_ids"].get<std::vector<int32_t>>();
  SessionConfig sc;
  sc.kv_dtype = KvDtype::F32;
  Session s(model, sc);
  const std::vector<float>* logits = &s.prefill(std::vector<int32_t>{1});
  // Top-5 logits at positions 0..2 as printed by run.c.
  for (const auto& pos : ref["top5_logits"]) {
    const int p = pos["position"].get<int>();
    if (p > 0) logits = &s.decode(pos["input_id"].get<int32_t>());
    for (const auto& pair : pos["top"]) {
      const int id = pair[0].get<int>();
      EXPECT_NEAR((*logits)[id], pair[1].get<float>(), 1e-3) << "position " << p << " token " << id;
    }
  }
  Session g(model, sc);
  GenerateOptions go;
  go.max_tokens = int(expected.size());
  go.stop_at_eos = false;
  const auto r = generate(g, {1}, go);
  ASSERT_EQ(r.generated_ids.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) ASSERT_EQ(r.generated_ids[i], expected[i]) << "token " << i;
}

TEST(ModelReference, LocksRefLogitsAndGreedyMatchFloat64) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  const auto ref = load_json(test::shared_path("models/locks-ref-a-q8_0.vectors.json"));
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  for (const auto kv : {KvDtype::F32, KvDtype::F16}) {
    for (const auto& c : ref["cases"]) {
      const auto prompt = c["prompt_ids"].get<std::vector<int32_t>>();
      const auto want = c["last_logits"].get<std::vector<double>>();
      const auto greedy = c["greedy_ids"].get<std::vector<int32_t>>();
      SessionConfig sc;
      sc.kv_dtype = kv;
      Session s(model, sc);
      const auto& logits = s.prefill(prompt);
      double num = 0, den = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        num += (logits[i] - want[i]) * (logits[i] - want[i]);
        den += want[i] * want[i];
      }
      const double rel = std::sqrt(num / den);
      EXPECT_LT(rel, kv == KvDtype::F32 ? 1e-4 : 1e-3) << "relative L2 error of last logits, kv " << kv_dtype_name(kv);
      Session g(model, sc);
      GenerateOptions go;
      go.max_tokens = int(greedy.size());
      go.stop_at_eos = false;
      const auto r = generate(g, prompt, go);
      EXPECT_EQ(r.generated_ids, greedy) << "kv " << kv_dtype_name(kv);
    }
  }
}

// The reference model with `value` (value_bytes) written every `stride` bytes of tensor `name`'s data,
// which must be of `type`.
LlamaModel ref_model_patched(const char* name, GgmlType type, uint64_t stride, const void* value, size_t value_bytes) {
  std::ifstream in(test::source_path("models/locks-ref-a-q8_0.gguf"), std::ios::binary);
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)), {});
  {
    const GgufFile f = GgufFile::from_bytes(b, "m.gguf");
    const GgufTensorInfo* t = f.find_tensor(name);
    if (!t || t->type != uint32_t(type)) throw std::logic_error(std::string("test model: no tensor ") + name);
    const auto at = std::search(b.begin(), b.end(), t->data, t->data + t->n_bytes);
    if (at == b.end()) throw std::logic_error(std::string("test model: data of ") + name + " not found");
    for (uint64_t i = 0; i < t->n_bytes; i += stride) std::memcpy(&*(at + i), value, value_bytes);
  }
  return LlamaModel::from_gguf(GgufFile::from_bytes(b, "m.gguf"));
}

// NaN weights (layer 0's attention norm) surface as an error naming the model and the layer, not
// only the KV cache that refuses the key.
TEST(ModelReference, NanWeightsNameTheModel) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const LlamaModel model = ref_model_patched("blk.0.attn_norm.weight", GgmlType::F32, 4, &nan, 4);
  Session s(model, SessionConfig{});
  const std::string err = test::error_of<std::runtime_error>([&] { s.prefill(std::vector<int32_t>{1, 2, 3}); });
  EXPECT_NE(err.find("the forward pass gave token 0 of layer 0 a key or value the KV cache cannot store (NaN/Inf in "
                     "the weights?): KV write: non-finite key at layer 0"),
            std::string::npos)
      << err;
}

// NaN query weights (layer 1's attn_q: every Q8_0 block's f16 scale) make the queries NaN: the
// prefill's attention names them (before, the NaN reached the logits silently; a decode step's
// attention refused them from inside an OpenMP loop, which ended the process: see ParallelFor).
TEST(ModelReference, NanQueryWeightsAreAnErrorNotACrash) {
  const uint16_t f16_nan = 0x7e00;
  const LlamaModel model = ref_model_patched("blk.1.attn_q.weight", GgmlType::Q8_0, 34, &f16_nan, 2);
  Session s(model, SessionConfig{});
  const std::string err = test::error_of<std::invalid_argument>([&] { s.prefill(std::vector<int32_t>{1, 2, 3}); });
  EXPECT_NE(err.find("paged_prefill_attention: non-finite query at token 0, head 0, dim 0"), std::string::npos) << err;
}

// A model whose context length is beyond what a session reserves is refused with the way out
// (a context size), and runs with one.
TEST(ModelReference, HugeModelContextAsksForAContextSize) {
  LlamaModel model = LlamaModel::from_gguf(GgufFile::open(test::source_path("models/locks-ref-a-q8_0.gguf")));
  model.hp.n_ctx_train = 1 << 30;
  const std::string err = test::error_of<std::invalid_argument>([&] { Session s(model, SessionConfig{}); });
  EXPECT_NE(err.find("the model's context length 1073741824 is outside [1, 2^26] tokens: set a context size"),
            std::string::npos)
      << err;
  SessionConfig sc;
  sc.n_ctx = 256;
  Session s(model, sc);
  EXPECT_EQ(s.n_ctx(), 256);
}

// Session entry points refuse what they would otherwise silently reinterpret: a negative context
// size (0 means the model's), a prepared selector other than the one the fork config names (or made
// with other options), and generate() on a session that already holds tokens.
TEST(ModelReference, SessionRefusesMisusedEntryPoints) {
  const LlamaModel model = LlamaModel::from_gguf(GgufFile::open(test::source_path("models/locks-ref-a-q8_0.gguf")));
  SessionConfig neg;
  neg.n_ctx = -1;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { Session s(model, neg); }),
            "context size -1 outside [1, 2^26] tokens");
  SessionConfig sc;
  sc.n_ctx = 512;
  Session s(model, sc);
  s.prefill(std::vector<int32_t>{1, 5, 6, 7, 8});
  SessionConfig quest = sc;
  quest.selector = "quest";
  const std::unique_ptr<Selector> prepared = s.prepare_selector(quest);
  SessionConfig locks_cfg = sc;
  locks_cfg.selector = "locks";
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { (void)s.fork(locks_cfg, *prepared); }),
            "fork: the prepared selector is 'quest', the config names 'locks'");
  EXPECT_NO_THROW((void)s.fork(quest, *prepared));
  // The same name with other options (a rank-2 LOCKS config, a rank-8 prepared selector).
  locks_cfg.selector_opts.summary.rank = 8;
  const std::unique_ptr<Selector> rank8 = s.prepare_selector(locks_cfg);
  SessionConfig rank2 = locks_cfg;
  rank2.selector_opts.summary.rank = 2;
  EXPECT_NE(test::error_of<std::invalid_argument>([&] {
              (void)s.fork(rank2, *rank8);
            }).find("fork: the prepared selector was made as 'locks r=8 basis=int4"),
            std::string::npos);
  EXPECT_NO_THROW((void)s.fork(locks_cfg, *rank8));
  GenerateOptions go;
  go.max_tokens = 2;
  EXPECT_EQ(test::error_of<std::logic_error>([&] {
              (void)generate(s, {1, 2}, go);
            }),
            "generate: the session already holds 5 tokens (generate starts a fresh one)");
}
