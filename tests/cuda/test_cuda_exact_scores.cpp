// The oracle on the GPU: exact page log-masses against a float64 reference from the same stored
// keys, and the oracle step's selection and output against the CPU's rule on those scores.
#include <gtest/gtest.h>

#ifdef LOCKS_WITH_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda_fixture.h"
#include "locks/selector.h"

using namespace locks;
using namespace locks::test;

namespace {

// Float64 exact log-mass [B][H][G][stride] of every page (the oracle selector's quantity).
std::vector<double> reference_log_mass(const World& w, const std::vector<float>& q, int stride, float scale) {
  std::vector<double> out(size_t(w.B()) * w.H * w.G * stride, 0.0);
  for (int b = 0; b < w.B(); ++b)
    for (int h = 0; h < w.H; ++h)
      for (int j = 0; j < w.seqs[b].n_pages(); ++j) {
        const std::vector<float> k = w.keys(w.seqs[b].page_table[j], h);
        const int n_tok = j == w.seqs[b].n_pages() - 1 ? w.last_len[b] : 16;
        for (int g = 0; g < w.G; ++g) {
          const float* qg = q.data() + ((size_t(b) * w.H + h) * w.G + g) * w.d;
          std::vector<double> s(n_tok);
          double m = -INFINITY;
          for (int t = 0; t < n_tok; ++t) {
            double dot = 0.0;
            for (int c = 0; c < w.d; ++c) dot += double(qg[c]) * k[size_t(t) * w.d + c];
            s[t] = dot * scale;
            m = std::max(m, s[t]);
          }
          double e = 0.0;
          for (double x : s) e += std::exp(x - m);
          out[((size_t(b) * w.H + h) * w.G + g) * stride + j] = m + std::log(e);
        }
      }
  return out;
}

// One oracle step through a plan over `w` (the status word read back and cleared).
struct OracleRun {
  lc::DecodePlan plan;
  Dev<uint8_t> ws;
  Dev<float> q, o, lse;
  uint32_t status = 0;
  OracleRun(const World& w, int budget_pages, const std::vector<float>& queries, float scale)
      : plan(lc::make_decode_plan(w.decode_shape(budget_pages))),
        ws(plan.workspace_bytes),
        q(queries),
        o(queries.size()),
        lse(size_t(w.B()) * w.H * w.G) {
    ck(lc::init_decode_workspace(plan, ws.p, nullptr), "init workspace");
    lc::DecodeStepParams sp;
    sp.q = q.p;
    sp.kv = w.view();
    sp.n_pages_pool = w.cfg.n_pages;
    sp.scale = scale;
    sp.o = o.p;
    sp.lse = lse.p;
    sp.workspace = ws.p;
    ck(lc::oracle_decode_step(plan, sp, nullptr), "oracle_decode_step");
    dev_sync();
    ck(lc::read_decode_status(plan, ws.p, &status, true, nullptr), "status");
  }
};

void check_oracle(World& w, int budget_pages, const char* what) {
  const auto q = w.queries(5);
  const float scale = 1.0f / std::sqrt(float(w.d));
  OracleRun run(w, budget_pages, q, scale);
  const lc::DecodePlan& plan = run.plan;
  Dev<uint8_t>& ws = run.ws;
  Dev<float>&d_o = run.o, &dl = run.lse;
  EXPECT_EQ(run.status, 0u) << what;
  const int stride = plan.log_mass_stride;
  std::vector<float> glm(size_t(w.B()) * w.H * w.G * stride), glt(size_t(w.B()) * w.H * w.G);
  ck(cudaMemcpy(glm.data(), lc::plan_log_mass(plan, ws.p), glm.size() * 4, cudaMemcpyDeviceToHost), "lm");
  ck(cudaMemcpy(glt.data(), lc::plan_lse_total(plan, ws.p), glt.size() * 4, cudaMemcpyDeviceToHost), "lse");
  std::vector<int32_t> sel(size_t(w.B()) * w.H * budget_pages), nsel(size_t(w.B()) * w.H);
  ck(cudaMemcpy(sel.data(), lc::plan_selected(plan, ws.p), sel.size() * 4, cudaMemcpyDeviceToHost), "sel");
  ck(cudaMemcpy(nsel.data(), lc::plan_n_selected(plan, ws.p), nsel.size() * 4, cudaMemcpyDeviceToHost), "nsel");
  const std::vector<double> ref = reference_log_mass(w, q, stride, scale);

  double worst = 0.0, worst_mass = 0.0;
  std::vector<std::vector<int32_t>> lists(size_t(w.B()) * w.H);
  for (int b = 0; b < w.B(); ++b)
    for (int h = 0; h < w.H; ++h) {
      const int n = w.seqs[b].n_pages();
      const size_t bh = size_t(b) * w.H + h;
      std::vector<float> lm(size_t(w.G) * n);
      for (int g = 0; g < w.G; ++g) {
        const size_t row = (bh * w.G + g) * stride;
        std::vector<float> r(n);
        for (int j = 0; j < n; ++j) {
          // float32 dot products of d terms: relative error ~ d * 2^-24 of sum |q_c k_c| scale, bounded here.
          const double err = std::abs(double(glm[row + j]) - ref[row + j]);
          worst = std::max(worst, err);
          EXPECT_LE(err, 2e-4 * (1.0 + std::abs(ref[row + j]))) << what << " b " << b << " h " << h << " page " << j;
          r[j] = float(ref[row + j]);
          lm[size_t(g) * n + j] = r[j];
        }
        EXPECT_NEAR(glt[bh * w.G + g], lse_of(r.data(), n), 2e-4 * (1.0 + std::abs(lse_of(r.data(), n)))) << what;
      }
      // The GPU's set captures the share mass of the CPU rule's set on the float64 scores (ties and
      // near-ties may pick different pages of equal share).
      std::vector<int32_t> cpu_sel;
      std::vector<float> share;
      select_top_pages(lm.data(), w.G, n, budget_pages, GroupRule::kShareAverage, cpu_sel, &share);
      ASSERT_EQ(nsel[bh], int(cpu_sel.size())) << what;
      double mg = 0.0, mc = 0.0;
      for (int i = 0; i < nsel[bh]; ++i) mg += share[sel[bh * budget_pages + i]];
      for (int32_t j : cpu_sel) mc += share[j];
      worst_mass = std::max(worst_mass, mc - mg);
      EXPECT_GE(mg, mc - 1e-4) << what << ": the oracle's set misses share mass, b " << b << " h " << h;
      lists[bh].assign(sel.begin() + bh * budget_pages, sel.begin() + bh * budget_pages + nsel[bh]);
    }
  const double rel = check_attention(w, q, {d_o.down(), dl.down()}, lists, what);
  std::printf("[ oracle %s ] max |log-mass gpu - f64| %.2e, share shortfall %.2e, output rel err %.2e\n", what, worst,
              worst_mass, rel);
}

TEST(CudaExactScores, OracleStepMatchesFloat64RandomPages) {
  SKIP_WITHOUT_CUDA();
  for (lc::KvType t : {lc::KvType::kF16, lc::KvType::kBF16}) {
    World w(128, 2, 4, {3000, 17, 1, 700}, t, 11);
    check_oracle(w, 16, t == lc::KvType::kF16 ? "d128 G4 f16" : "d128 G4 bf16");
  }
  World w64(64, 3, 7, {1200, 33}, lc::KvType::kBF16, 12);
  check_oracle(w64, 8, "d64 G7 bf16");
  World w16(128, 1, 16, {4096 + 5}, lc::KvType::kF16, 13);
  check_oracle(w16, 32, "d128 G16");
}

TEST(CudaExactScores, BadPageIdGivesNaNAndStatus) {
  SKIP_WITHOUT_CUDA();
  World w(128, 2, 4, {500, 300}, lc::KvType::kF16, 14);
  std::vector<int32_t> bad = w.indices;
  bad[w.indptr[1] + 2] = w.cfg.n_pages + 100;  // a page of sequence 1 outside the pool
  w.d_indices.up(bad);
  OracleRun run(w, 8, w.queries(3), 0.1f);
  EXPECT_TRUE(run.status & lc::kStatusBadPageId);
  const auto o = run.o.down();
  const size_t per_seq = size_t(w.H) * w.G * w.d;
  for (size_t i = 0; i < per_seq; ++i) ASSERT_TRUE(std::isfinite(o[i])) << "sequence 0 is unaffected";
  for (size_t i = per_seq; i < 2 * per_seq; ++i) ASSERT_TRUE(std::isnan(o[i])) << "sequence 1 gives NaN";
}

}  // namespace

#endif  // LOCKS_WITH_CUDA
