// The whole model on the GPU (Session with Device::kCuda) against external references and the CPU
// engine: llama2.c's 200 stories260K tokens, the reference model's greedy tokens and logits, and a
// decode graph captured at a short context replayed at 64K tokens. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "family_models.h"
#include "locks/generate.h"
#include "locks/gguf.h"
#include "locks/model.h"
#include "locks/session.h"
#include "synth_model.h"
#include "test_paths.h"
#include "test_util.h"

#ifdef LOCKS_WITH_CUDA
#include "cuda/cuda_fixture.h"
#endif

using namespace locks;

#ifdef LOCKS_WITH_CUDA
namespace {

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

SessionConfig gpu_config(const std::string& selector, CudaSessionOptions::Weights w) {
  SessionConfig sc;
  sc.device = Device::kCuda;
  sc.selector = selector;
  sc.cuda.weights = w;
  sc.cuda.kv_bf16 = false;  // f16 KV, as the CPU engine's default
  return sc;
}

// The default run's prompt (examples/needle-8k.txt, 8.5K tokens) as the model tokenizes it.
std::vector<int32_t> default_prompt_ids(const LlamaModel& model) {
  std::ifstream f(test::source_path("examples/needle-8k.txt"));
  const std::string text((std::istreambuf_iterator<char>(f)), {});
  return model.tokenizer.encode(text, model.tokenizer.add_bos());
}

std::vector<int32_t> greedy(Session& s, const std::vector<int32_t>& prompt, int n) {
  GenerateOptions go;
  go.max_tokens = n;
  go.stop_at_eos = false;
  return generate(s, prompt, go).generated_ids;
}

}  // namespace

// llama2.c's run.c output from BOS, token for token (float32 weights on the GPU: this model's
// smallest greedy margin is 0.019 logits at token 185, below what bf16 weights perturb).
TEST(CudaEngine, Stories260KGreedyMatchesLlama2c) {
  SKIP_WITHOUT_CUDA();
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  std::ifstream in(test::shared_path("models/stories260K.reference.json"));
  const auto ref = nlohmann::json::parse(in);
  const LlamaModel model = LlamaModel::load(test::shared_path("models/stories260K-f32.gguf"));
  const auto expected = ref["greedy_from_bos"]["generated_ids"].get<std::vector<int32_t>>();
  Session s(model, gpu_config("full", CudaSessionOptions::Weights::kAuto));
  EXPECT_EQ(greedy(s, {1}, int(expected.size())), expected);
}

// The reference model on the GPU, LOCKS at a 512-token budget as `locks run` runs it: the CPU
// engine's greedy tokens (float32 weights), and the last prompt position's logits within relative
// L2 1e-2 of the CPU's with bf16 weights (5e-3 with float32: the prefill attention rounds its
// probabilities to the KV type, 2^-11 with f16).
TEST(CudaEngine, LocksRefMatchesTheCpuEngine) {
  SKIP_WITHOUT_CUDA();
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  const std::vector<int32_t> ids = default_prompt_ids(model);
  ASSERT_GT(ids.size(), 8000u);
  SessionConfig cpu_cfg;
  cpu_cfg.selector = "locks";
  Session cpu(model, cpu_cfg);
  const std::vector<float> cpu_logits = cpu.prefill(ids);
  for (auto w : {CudaSessionOptions::Weights::kF32, CudaSessionOptions::Weights::kBF16}) {
    Session gpu(model, gpu_config("locks", w));
    const double err = rel_l2(gpu.prefill(ids), cpu_logits);
    std::printf("[ engine ] %s weights: last-logit relative L2 vs CPU %.2e\n",
                w == CudaSessionOptions::Weights::kF32 ? "f32" : "bf16", err);
    EXPECT_LT(err, w == CudaSessionOptions::Weights::kF32 ? 5e-3 : 1e-2) << "relative L2 of the last logits";
  }
  // The default run: the question's last 24 tokens through decode (selection runs), then 32 tokens.
  GenerateOptions go;
  go.max_tokens = 32;
  go.decode_tail = 24;
  Session c2(model, cpu_cfg);
  const auto want = generate(c2, ids, go).generated_ids;
  Session gpu(model, gpu_config("locks", CudaSessionOptions::Weights::kF32));
  const auto got = generate(gpu, ids, go);
  EXPECT_EQ(got.generated_ids, want);
  EXPECT_GT(got.decode.bytes_read, 0);
  EXPECT_LT(got.decode.bytes_read, 0.5 * got.decode.dense_bytes);  // LOCKS read less than dense
}

namespace {
// Greedy decoding on the CPU and the GPU (float32 weights, full attention) from the same prompt: the
// same last-prompt logits within 5e-3 relative L2 and the same 16 greedy tokens.
void expect_gpu_matches_cpu(const LlamaModel& model, const std::vector<int32_t>& ids) {
  SessionConfig cpu_cfg;
  cpu_cfg.n_ctx = 1024;
  SessionConfig gpu_cfg = gpu_config("full", CudaSessionOptions::Weights::kF32);
  gpu_cfg.n_ctx = 1024;
  Session cpu(model, cpu_cfg), gpu(model, gpu_cfg);
  const std::vector<float>* lc = &cpu.prefill(ids);
  const std::vector<float>* lg = &gpu.prefill(ids);
  EXPECT_LT(rel_l2(*lg, *lc), 5e-3) << "relative L2 of the last logits";
  for (int t = 0; t < 16; ++t) {
    const int32_t want = int32_t(std::max_element(lc->begin(), lc->end()) - lc->begin());
    const int32_t got = int32_t(std::max_element(lg->begin(), lg->end()) - lg->begin());
    ASSERT_EQ(got, want) << "greedy token " << t;
    lc = &cpu.decode(want);
    lg = &gpu.decode(got);
  }
}
}  // namespace

// The family architectures on the GPU against the CPU engine: qwen3 (per-head q/k RMSNorm, NEOX RoPE,
// head_dim 32 != n_embd / n_head) written by the test, and the llama (Llama-3.1 RoPE scaling, tied
// output; Q4_K/Q6_K) and qwen2 (Q/K/V biases, NEOX RoPE; Q5_K/Q6_K) models of ../shared (their
// smallest CPU top-2 gap over these 16 tokens is 0.68 logits).
TEST(CudaEngine, FamilyModelsMatchTheCpuEngine) {
  SKIP_WITHOUT_CUDA();
  {
    SCOPED_TRACE("qwen3 (per-head q/k RMSNorm, NEOX RoPE), written by the test");
    const LlamaModel q3 = LlamaModel::from_gguf(GgufFile::from_bytes(test::synth_model(test::SynthSpec{}), "qwen3"),
                                                ModelLoadOptions{.tokenizer = false});
    std::vector<int32_t> ids(200);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 7 + 3) % size_t(q3.hp.n_vocab));
    expect_gpu_matches_cpu(q3, ids);
  }
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  for (const char* stem : test::kFamilyModels) {
    SCOPED_TRACE(stem);
    expect_gpu_matches_cpu(test::load_family_model(stem), test::family_prompt_ids(stem));
  }
}

// One CUDA graph per step shape, captured at 4K tokens, replayed at 64K: lengths, page tables and
// plans live on the device. Against the CPU engine making the same calls: a stale length or page
// table would give other logits altogether (relative L2 ~1). The two engines differ only where a
// step's LOCKS selection does: pages whose summary scores tie within the GPU build's float32
// eigenvectors (random tokens attend diffusely) change a step's logits by up to a few percent (H200:
// at most 0.040, 37 of 40 steps under 0.02), so each step must stay within 0.1 and half of them
// within 0.02.
TEST(CudaEngine, GraphCapturedAt4KStaysCorrectAt64K) {
  SKIP_WITHOUT_CUDA();
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  std::vector<int32_t> ids(65536 + 40);
  uint32_t x = 12345;
  for (auto& t : ids) t = int32_t(3 + (x = x * 1664525u + 1013904223u) % uint32_t(model.hp.n_vocab - 3));
  SessionConfig cpu_cfg;
  cpu_cfg.selector = "locks";
  cpu_cfg.n_ctx = 70000;
  SessionConfig gpu_cfg = gpu_config("locks", CudaSessionOptions::Weights::kF32);
  gpu_cfg.n_ctx = 70000;
  Session cpu(model, cpu_cfg), gpu(model, gpu_cfg);
  const std::span<const int32_t> all(ids);
  auto both = [&](auto&& f) {
    f(cpu);
    f(gpu);
  };
  both([&](Session& s) { s.prefill(all.subspan(0, 4096)); });
  std::vector<double> errs;
  auto step = [&](int32_t token, const char* where) {
    cpu.decode(token);
    errs.push_back(rel_l2(gpu.decode(token), cpu.logits()));
    EXPECT_LT(errs.back(), 0.1) << "step " << errs.size() << " at " << where;
  };
  for (int i = 0; i < 20; ++i) step(ids[4096 + i], "4K");  // captures the step graphs (a page fills on one)
  both([&](Session& s) { s.prefill(all.subspan(4116, 65536 - 4116)); });
  for (int i = 0; i < 20; ++i) step(ids[65536 + i], "64K");
  std::sort(errs.begin(), errs.end());
  EXPECT_LT(errs[errs.size() / 2], 2e-2) << "median relative L2 of the logits";
  EXPECT_EQ(gpu.n_tokens(), cpu.n_tokens());
}

// Forks of a GPU sequence (what `locks eval --device cuda` runs): a fork of a dense prefill into
// LOCKS (summaries built for every full page at the fork) or the oracle decodes exactly as a session
// that ran that selector from the start (same kernels on the same keys: the same tokens and logits),
// leaves its source untouched, and the oracle's greedy tokens are the CPU oracle's.
TEST(CudaEngine, ForksDecodeAsSessionsThatRanTheSelectorFromTheStart) {
  SKIP_WITHOUT_CUDA();
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  const std::vector<int32_t> ids = default_prompt_ids(model);
  SessionConfig base_cfg = gpu_config("full", CudaSessionOptions::Weights::kF32);
  base_cfg.n_ctx = int(ids.size()) + 64;
  Session base(model, base_cfg);
  base.prefill(ids);
  const std::vector<float> base_logits = base.logits();
  for (const auto& [sel, budget] : {std::pair<std::string, int>{"locks", 512}, {"oracle", 256}, {"full", 512}}) {
    SessionConfig fc;
    fc.selector = sel;
    fc.budget_tokens = budget;
    Session fork = base.fork(fc);
    EXPECT_EQ(fork.device(), Device::kCuda);
    EXPECT_EQ(fork.n_tokens(), base.n_tokens());
    SessionConfig fresh_cfg = base_cfg;
    fresh_cfg.selector = sel;
    fresh_cfg.budget_tokens = budget;
    Session fresh(model, fresh_cfg);
    fresh.prefill(ids);
    std::vector<int32_t> a, b;
    int32_t ta = int32_t(std::max_element(fork.logits().begin(), fork.logits().end()) - fork.logits().begin());
    int32_t tb = int32_t(std::max_element(fresh.logits().begin(), fresh.logits().end()) - fresh.logits().begin());
    for (int i = 0; i < 24; ++i) {  // crosses a page boundary: the fork's own summaries of new pages too
      a.push_back(ta);
      b.push_back(tb);
      const auto& la = fork.decode(ta);
      const auto& lb = fresh.decode(tb);
      EXPECT_LT(rel_l2(la, lb), 1e-6) << sel << " step " << i;
      ta = int32_t(std::max_element(la.begin(), la.end()) - la.begin());
      tb = int32_t(std::max_element(lb.begin(), lb.end()) - lb.begin());
    }
    EXPECT_EQ(a, b) << sel;
    if (sel == "oracle") {
      SessionConfig cpu_cfg;
      cpu_cfg.selector = "oracle";
      cpu_cfg.budget_tokens = budget;
      Session cpu(model, cpu_cfg);
      cpu.prefill(ids);
      std::vector<int32_t> c;
      int32_t tc = int32_t(std::max_element(cpu.logits().begin(), cpu.logits().end()) - cpu.logits().begin());
      for (int i = 0; i < 24; ++i) {
        c.push_back(tc);
        const auto& lc = cpu.decode(tc);
        tc = int32_t(std::max_element(lc.begin(), lc.end()) - lc.begin());
      }
      EXPECT_EQ(a, c) << "the GPU oracle's greedy tokens vs the CPU oracle's";
    }
  }
  EXPECT_EQ(base.logits(), base_logits) << "forks leave their source as it was";
  EXPECT_EQ(base.n_tokens(), int32_t(ids.size()));
  SessionConfig rule;
  rule.selector = "oracle";
  rule.selector_opts.group_rule = GroupRule::kMax;
  const std::string why = test::error_of<std::invalid_argument>([&] { (void)base.fork(rule); });
  EXPECT_NE(why.find("share-average"), std::string::npos) << why;
}

// What the GPU engine refuses, in words: selectors it does not run, and the CPU-only accessors.
TEST(CudaEngine, RefusesWhatItDoesNotRun) {
  SKIP_WITHOUT_CUDA();
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  const std::string quest = test::error_of<std::invalid_argument>(
      [&] { Session s(model, gpu_config("quest", CudaSessionOptions::Weights::kAuto)); });
  EXPECT_NE(quest.find("selector 'quest' runs on the CPU only"), std::string::npos) << quest;
  SessionConfig r4 = gpu_config("locks", CudaSessionOptions::Weights::kAuto);
  r4.selector_opts.summary.rank = 4;
  const std::string rank = test::error_of<std::invalid_argument>([&] { Session s(model, r4); });
  EXPECT_NE(rank.find("--device cuda runs LOCKS with its shipped summary"), std::string::npos) << rank;
  Session s(model, gpu_config("full", CudaSessionOptions::Weights::kAuto));
  const std::string cache = test::error_of<std::logic_error>([&] { (void)s.cache(); });
  EXPECT_NE(cache.find("the sequence is on the GPU"), std::string::npos) << cache;
}

#else
TEST(CudaEngine, NotBuiltWithCuda) {
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  SessionConfig sc;
  sc.device = Device::kCuda;
  EXPECT_THROW(Session(model, sc), std::runtime_error);
}
#endif
