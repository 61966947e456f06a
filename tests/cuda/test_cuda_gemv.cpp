// The decode GEMV (src/cuda/gemv.h) against a float64 product of the same bf16 values: every batch
// size it takes, lengths that are not multiples of its 32-wide chunks or 16-row tiles, accumulation,
// and outputs split between two buffers.
#include <gtest/gtest.h>

#ifdef LOCKS_WITH_CUDA

#include <cmath>
#include <random>
#include <vector>

#include "cuda/gemv.h"
#include "cuda_fixture.h"

using namespace locks;
using namespace locks::test;

namespace {

struct Case {
  int rows, n_out, n_in;
};

void check_gemv(const Case& c, bool accumulate, int split, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(c.rows) * c.n_in), w(size_t(c.n_out) * c.n_in), y0(size_t(c.rows) * c.n_out);
  for (auto& v : x) v = round_bf16(nd(rng));
  for (auto& v : w) v = round_bf16(nd(rng) * 0.05f);
  for (auto& v : y0) v = nd(rng);
  std::vector<uint16_t> xb(x.size()), wb(w.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = bf16_bits(x[i]);
  for (size_t i = 0; i < w.size(); ++i) wb[i] = bf16_bits(w[i]);
  const int n1 = split, n2 = c.n_out - split;
  std::vector<float> h1(size_t(c.rows) * n1), h2(size_t(c.rows) * std::max(n2, 0));
  for (int r = 0; r < c.rows; ++r)
    for (int n = 0; n < c.n_out; ++n)
      (n < n1 ? h1[size_t(r) * n1 + n] : h2[size_t(r) * n2 + n - n1]) = y0[size_t(r) * c.n_out + n];
  Dev<uint16_t> dx(xb), dw(wb);
  Dev<float> d1(h1), d2(h2.empty() ? std::vector<float>{0.0f} : h2);
  lc::GemvParams p;
  p.x = dx.p;
  p.w = dw.p;
  p.rows = c.rows;
  p.n_out = c.n_out;
  p.n_in = c.n_in;
  p.y = d1.p;
  p.ldy = n1;
  p.y2 = d2.p;
  p.ldy2 = n2;
  p.split = split;
  p.accumulate = accumulate;
  ck(lc::gemv_bf16(p, nullptr), "gemv_bf16");
  dev_sync();
  const auto g1 = d1.down(), g2 = d2.down();
  for (int r = 0; r < c.rows; ++r)
    for (int n = 0; n < c.n_out; ++n) {
      double ref = accumulate ? y0[size_t(r) * c.n_out + n] : 0.0, mag = std::abs(ref);
      for (int k = 0; k < c.n_in; ++k) {
        const double t = double(x[size_t(r) * c.n_in + k]) * w[size_t(n) * c.n_in + k];
        ref += t;
        mag += std::abs(t);
      }
      const float got = n < n1 ? g1[size_t(r) * n1 + n] : g2[size_t(r) * n2 + n - n1];
      // Float32 accumulation of exact bf16 products: |error| <= n_in * 2^-24 * sum |terms| (loose bound).
      ASSERT_NEAR(got, ref, 1e-6 + c.n_in * 6e-8 * mag)
          << "rows " << c.rows << " n_out " << c.n_out << " n_in " << c.n_in << " at (" << r << ", " << n << ")";
    }
}

TEST(CudaGemv, MatchesFloat64) {
  SKIP_WITHOUT_CUDA();
  uint32_t seed = 1;
  for (int rows = 1; rows <= lc::kGemvMaxRows; ++rows)
    for (const Case c : {Case{rows, 16, 32}, Case{rows, 37, 72}, Case{rows, 1000, 4096 + 8}, Case{rows, 33, 13696}})
      check_gemv(c, /*accumulate=*/rows % 2 == 0, c.n_out, seed++);
}

TEST(CudaGemv, SplitOutputsAndRefusals) {
  SKIP_WITHOUT_CUDA();
  check_gemv(Case{1, 5120, 4096}, false, 4096, 7);  // Q | K V of one product
  check_gemv(Case{3, 50, 64}, true, 17, 8);
  EXPECT_FALSE(lc::gemv_applies(9, 16, 64));
  EXPECT_FALSE(lc::gemv_applies(1, 16, 60));
  lc::GemvParams p;
  p.rows = 1;
  p.n_out = 16;
  p.n_in = 64;
  EXPECT_EQ(lc::gemv_bf16(p, nullptr), cudaErrorInvalidValue);  // null pointers
}

}  // namespace

#endif  // LOCKS_WITH_CUDA
