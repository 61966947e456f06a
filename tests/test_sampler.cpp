// Samplers against independent expectations: argmax, nucleus truncation, softmax frequencies.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "locks/sampler.h"
#include "test_util.h"

using namespace locks;

TEST(Sampler, GreedyIsArgmaxWithTiesToLowerId) {
  Sampler s({0.0f, 1.0f, 1});
  EXPECT_EQ(s.sample(std::vector<float>{0.1f, 3.0f, -2.0f, 3.0f}), 1);
  EXPECT_EQ(argmax(std::vector<float>{-1.0f, -1.0f}), 0);
}

TEST(Sampler, SameSeedSameTokens) {
  const std::vector<float> logits = {1.0f, 0.5f, 0.2f, 2.0f, -1.0f};
  Sampler a({0.8f, 0.95f, 42}), b({0.8f, 0.95f, 42});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.sample(logits), b.sample(logits));
}

TEST(Sampler, FrequenciesFollowTemperedSoftmax) {
  const std::vector<float> logits = {1.0f, 0.0f, -0.5f, 0.7f};
  const float T = 0.7f;
  double z = 0;
  std::vector<double> p(logits.size());
  for (size_t i = 0; i < p.size(); ++i) z += p[i] = std::exp(logits[i] / T);
  Sampler s({T, 1.0f, 7});
  const int n = 40000;
  std::vector<int> count(logits.size(), 0);
  for (int i = 0; i < n; ++i) count[s.sample(logits)]++;
  for (size_t i = 0; i < p.size(); ++i) {
    const double expect = p[i] / z, sd = std::sqrt(expect * (1 - expect) / n);
    EXPECT_NEAR(double(count[i]) / n, expect, 5 * sd) << "token " << i;
  }
}

TEST(Sampler, TopPKeepsTheSmallestNucleus) {
  // Probabilities at T = 1: sorted 0.5, 0.3, 0.2 (log-space logits). top_p = 0.75 keeps {0, 1}.
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  Sampler s({1.0f, 0.75f, 3});
  std::map<int, int> seen;
  for (int i = 0; i < 5000; ++i) seen[s.sample(logits)]++;
  EXPECT_EQ(seen.count(2), 0u);
  EXPECT_NEAR(double(seen[0]) / 5000, 0.5 / 0.8, 0.03);
  Sampler tiny({1.0f, 1e-6f, 3});
  for (int i = 0; i < 50; ++i) EXPECT_EQ(tiny.sample(logits), 0);
}

TEST(Sampler, RejectsBadInput) {
  EXPECT_THROW(Sampler({-1.0f, 1.0f, 0}), std::invalid_argument);
  EXPECT_THROW(Sampler({1.0f, 0.0f, 0}), std::invalid_argument);
  EXPECT_THROW(Sampler({1.0f, 1.5f, 0}), std::invalid_argument);
  Sampler s({1.0f, 1.0f, 0});
  EXPECT_THROW(s.sample(std::vector<float>{0.0f, NAN}), std::runtime_error);
  EXPECT_THROW(s.sample(std::vector<float>{}), std::runtime_error);
  // Every logit -inf: no token has any probability.
  EXPECT_THROW(s.sample(std::vector<float>{-INFINITY, -INFINITY}), std::runtime_error);
  EXPECT_THROW(Sampler({0.0f, 1.0f, 0}).sample(std::vector<float>{-INFINITY, -INFINITY}), std::runtime_error);
  EXPECT_EQ(test::error_of<std::invalid_argument>([] { (void)argmax(std::vector<float>{}); }), "argmax: no logits");
}

// +inf logits: the limit of the tempered softmax puts all the mass on them, in equal shares.
TEST(Sampler, InfiniteLogitsTakeAllTheMass) {
  for (const float temp : {0.0f, 0.8f, 2.0f}) {
    Sampler s({temp, 0.9f, 7});
    for (int i = 0; i < 50; ++i) EXPECT_EQ(s.sample(std::vector<float>{0.0f, 1.0f, INFINITY, 2.0f, 0.0f}), 2);
  }
  Sampler s({1.0f, 1.0f, 11});
  std::map<int32_t, int> hits;
  const int n = 4000;
  for (int i = 0; i < n; ++i) ++hits[s.sample(std::vector<float>{INFINITY, 5.0f, -INFINITY, INFINITY})];
  ASSERT_EQ(hits.size(), 2u);  // only tokens 0 and 3
  EXPECT_NEAR(double(hits[0]) / n, 0.5, 0.04);
  EXPECT_NEAR(double(hits[3]) / n, 0.5, 0.04);
}
