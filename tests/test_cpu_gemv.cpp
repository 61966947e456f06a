// The CPU decode GEMV on Q8_0 codes: every kernel against a float64 product of the dequantized
// weights, the loader's codes against the file's f32 values, and a decode step's logits against the
// float64 reference of locks-ref-a.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "llm/cpu_gemv.h"
#include "locks/model.h"
#include "locks/session.h"
#include "test_paths.h"

using namespace locks;

namespace {

Matrix random_q8(int rows, int cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> code(-128, 127);
  std::uniform_real_distribution<float> sc(1e-4f, 2e-2f);
  Matrix W{rows, cols, std::vector<float>(size_t(rows) * cols), std::vector<int8_t>(size_t(rows) * cols),
           std::vector<float>(size_t(rows) * cols / 32)};
  for (float& s : W.q8_scale) s = sc(rng);
  for (size_t i = 0; i < W.q8.size(); ++i) {
    W.q8[i] = int8_t(code(rng));
    W.data[i] = float(W.q8[i]) * W.q8_scale[i / 32];
  }
  return W;
}

}  // namespace

TEST(CpuGemv, EveryKernelMatchesFloat64) {
  for (const GemvKernel k : {GemvKernel::kAuto, GemvKernel::kAvx2, GemvKernel::kAvx512}) {
    if (!gemv_kernel_supported(k)) continue;
    for (const auto& [rows, cols] : {std::pair{1, 32}, {7, 96}, {37, 512}, {64, 1024}}) {
      const Matrix W = random_q8(rows, cols, uint32_t(rows * 131 + cols));
      std::mt19937 rng(5);
      std::normal_distribution<float> N(0.0f, 1.0f);
      std::vector<float> x(cols);
      for (float& v : x) v = N(rng);
      // A slice [r0, r1) as one thread would take it.
      const int r0 = rows / 3, r1 = rows;
      std::vector<float> y(r1 - r0, NAN);
      gemv_q8(W, x.data(), r0, r1, y.data(), k);
      for (int r = r0; r < r1; ++r) {
        double want = 0, mag = 0;
        for (int c = 0; c < cols; ++c) {
          const double t = double(W.q8[size_t(r) * cols + c]) * W.q8_scale[(size_t(r) * cols + c) / 32] * x[c];
          want += t, mag += std::abs(t);
        }
        EXPECT_NEAR(y[r - r0], want, 1e-6 * mag + 1e-30)
            << "kernel " << int(k) << " " << rows << "x" << cols << " row " << r;
      }
    }
  }
}

TEST(CpuGemv, LoaderKeepsTheFileQ8Codes) {
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  for (const Matrix* W : {&model.layers[0].wq, &model.layers[3].w_down, &model.output_matrix()}) {
    ASSERT_TRUE(W->has_q8());
    ASSERT_EQ(W->q8.size(), W->data.size());
    ASSERT_EQ(W->q8_scale.size() * 32, W->data.size());
    size_t mismatches = 0;
    for (size_t i = 0; i < W->data.size(); ++i) mismatches += float(W->q8[i]) * W->q8_scale[i / 32] != W->data[i];
    EXPECT_EQ(mismatches, 0u);
  }
  EXPECT_FALSE(model.layers[0].attn_norm.empty());  // F32 norms: no codes to keep (vectors)
}

// The decode path (GEMV on codes) gives the prompt's last logits as the float64 forward does.
TEST(CpuGemv, DecodeLogitsMatchFloat64) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  std::ifstream in(test::shared_path("models/locks-ref-a-q8_0.vectors.json"));
  const auto ref = nlohmann::json::parse(in);
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  for (const auto& c : ref["cases"]) {
    auto prompt = c["prompt_ids"].get<std::vector<int32_t>>();
    const auto want = c["last_logits"].get<std::vector<double>>();
    const int32_t last = prompt.back();
    prompt.pop_back();
    SessionConfig sc;
    sc.kv_dtype = KvDtype::F32;
    Session s(model, sc);
    s.prefill(prompt);
    const auto& logits = s.decode(last);
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i)
      num += (logits[i] - want[i]) * (logits[i] - want[i]), den += want[i] * want[i];
    EXPECT_LT(std::sqrt(num / den), 1e-4);
  }
}
