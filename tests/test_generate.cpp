// The generation loop's reported log-probabilities: top_logprobs against a float64 log-softmax of the
// logits an independent second run computes over the same tokens, and on hand-made logits.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "locks/generate.h"
#include "locks/model.h"
#include "locks/session.h"
#include "test_paths.h"

using namespace locks;

TEST(Generate, TopLogprobsOfHandMadeLogits) {
  // softmax of {0, ln 2, ln 2, -inf}: 1/5, 2/5, 2/5, 0; ties to the lower id.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> logits = {0.0f, float(std::log(2.0)), float(std::log(2.0)), -inf};
  const auto t = top_logprobs(logits, 10);  // clamped to the vocabulary
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[0].id, 1);
  EXPECT_EQ(t[1].id, 2);
  EXPECT_EQ(t[2].id, 0);
  EXPECT_EQ(t[3].id, 3);
  EXPECT_NEAR(t[0].logprob, std::log(0.4), 1e-7);
  EXPECT_NEAR(t[2].logprob, std::log(0.2), 1e-7);
  EXPECT_EQ(t[3].logprob, -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(top_logprobs(logits, 0).empty());
  EXPECT_THROW(top_logprobs({1.0f, std::nanf("")}, 1), std::invalid_argument);
}

TEST(Generate, TopLogprobsAreEachStepsLogSoftmax) {
  const LlamaModel model = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  const std::vector<int32_t> prompt = model.tokenizer.encode("Once upon a time there was a little", true);
  SessionConfig sc;
  sc.selector = "full";
  GenerateOptions go;
  go.max_tokens = 5;
  go.stop_at_eos = false;
  go.top_logprobs = 4;
  Session s(model, sc);
  const GenerateResult r = generate(s, prompt, go);
  ASSERT_EQ(r.top_logprobs.size(), r.generated_ids.size());
  Session ref(model, sc);
  const std::vector<float>* logits = &ref.prefill(prompt);
  for (size_t i = 0; i < r.generated_ids.size(); ++i) {
    double m = -std::numeric_limits<double>::infinity(), z = 0;
    for (float x : *logits) m = std::max(m, double(x));
    for (float x : *logits) z += std::exp(double(x) - m);
    const auto& got = r.top_logprobs[i];
    ASSERT_EQ(got.size(), 4u);
    EXPECT_EQ(got[0].id, r.generated_ids[i]) << "greedy picks the most likely token";
    for (size_t k = 0; k < got.size(); ++k) {
      const double want = double((*logits)[size_t(got[k].id)]) - m - std::log(z);
      EXPECT_NEAR(got[k].logprob, want, 1e-9) << "position " << i << " rank " << k;
      if (k > 0) {
        EXPECT_GE(got[k - 1].logprob, got[k].logprob);
      }
      // No token outside the list is more likely than the last one in it.
      if (k + 1 == got.size()) {
        for (size_t v = 0; v < logits->size(); ++v) {
          bool listed = false;
          for (const auto& t : got) listed |= size_t(t.id) == v;
          if (!listed) {
            EXPECT_LE((*logits)[v], (*logits)[size_t(got[k].id)]);
          }
        }
      }
    }
    logits = &ref.decode(r.generated_ids[i]);
  }
}
