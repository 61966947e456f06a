// The whole LOCKS decode step through the plan (summary build, score, select, attention), eager and
// replayed from a CUDA graph, against the CPU selector and attention; bad page tables; real keys
// from the reference model.
#include <gtest/gtest.h>

#ifdef LOCKS_WITH_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_fixture.h"
#include "locks/model.h"
#include "locks/selector.h"
#include "locks/session.h"
#include "test_paths.h"

using namespace locks;
using namespace locks::test;

namespace {

const LlamaModel& reference_model() {
  static const LlamaModel m = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  return m;
}

/// Real KV: prefill of the reference model on the haystack text (keys of layer `il`).
const Session& real_session() {
  static std::unique_ptr<Session> s;
  if (!s) {
    const LlamaModel& m = reference_model();
    std::ifstream in(test::source_path("examples/haystack.txt"), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    std::vector<int32_t> ids = m.tokenizer.encode(ss.str(), true);
    ids.resize(std::min<size_t>(ids.size(), 1500 + 7));  // 94 pages, the last one partial
    SessionConfig sc;
    sc.n_ctx = 2048;
    s = std::make_unique<Session>(m, sc);
    s->prefill(ids);
  }
  return *s;
}

// The whole LOCKS step through the plan (GPU-built summaries), eager and from a CUDA graph.
// expect_defer: the plan must leave the lse_total merge to select_pages (>= 32 score chunks).
// cluster: leave the plan's sparse cluster merge and one-kernel select as they are (false: turn both off).
// select_pages_per_cta: run the one-kernel select, started per pair, with this many pages per CTA
// (more clusters than fit at once: the later ones wait for resources, not for each other).
void run_step_test(World& w, int budget_pages, const char* what, bool expect_defer = false, bool balance = true,
                   bool cluster = true, int select_pages_per_cta = 0) {
  const auto q = w.queries(77);
  // GPU summaries of every full page.
  const std::vector<int32_t> pages = w.full_pages();
  Dev<uint8_t> drec(size_t(w.H) * w.cfg.n_pages * lc::summary_record_bytes(w.d));
  Dev<int32_t> dpages(pages.empty() ? std::vector<int32_t>{0} : pages);
  ck(lc::summary_build(w.build_params(dpages, int(pages.size()), drec.p), nullptr), "summary_build");

  lc::DecodePlan plan = lc::make_decode_plan(w.decode_shape(budget_pages), -1, balance);
  if (!cluster) plan.sparse_cluster_merge = false, plan.select_cluster_pages = 0;
  if (select_pages_per_cta) {
    ASSERT_TRUE(lc::select_per_pair(plan)) << what;
    plan.select_cluster_pages = select_pages_per_cta;
  }
  EXPECT_EQ(plan.defer_lse_total, plan.score_equal_chunks >= 32);
  EXPECT_EQ(plan.score_balance, balance);
  EXPECT_EQ(plan.dense_balance, balance);
  if (balance) {
    EXPECT_GE(plan.score_chunks, plan.score_equal_chunks);  // balanced chunks: capacity
  } else {
    EXPECT_EQ(plan.score_chunks, plan.score_equal_chunks);
  }
  if (expect_defer) {
    ASSERT_TRUE(plan.defer_lse_total) << what << ": " << plan.score_equal_chunks << " score chunks";
  }
  Dev<uint8_t> ws(plan.workspace_bytes);
  ck(lc::init_decode_workspace(plan, ws.p, nullptr), "init workspace");
  Dev<float> dq(q), d_o(q.size()), dl(size_t(w.B()) * w.H * w.G);
  lc::DecodeStepParams sp;
  sp.q = dq.p;
  sp.kv = w.view();
  sp.summaries = drec.p;
  sp.n_pages_pool = w.cfg.n_pages;
  sp.scale = 1.0f / std::sqrt(float(w.d));
  sp.o = d_o.p;
  sp.lse = dl.p;
  sp.workspace = ws.p;
  ck(lc::locks_decode_step(plan, sp, nullptr), "locks_decode_step");
  dev_sync();
  const auto o1 = d_o.down();
  std::vector<float> glm(size_t(w.B()) * w.H * w.G * plan.log_mass_stride);
  ck(cudaMemcpy(glm.data(), lc::plan_log_mass(plan, ws.p), glm.size() * 4, cudaMemcpyDeviceToHost), "lm");
  std::vector<int32_t> sel(size_t(w.B()) * w.H * budget_pages), nsel(size_t(w.B()) * w.H);
  ck(cudaMemcpy(sel.data(), lc::plan_selected(plan, ws.p), sel.size() * 4, cudaMemcpyDeviceToHost), "sel");
  ck(cudaMemcpy(nsel.data(), lc::plan_n_selected(plan, ws.p), nsel.size() * 4, cudaMemcpyDeviceToHost), "nsel");

  // (1) The selected set vs the CPU LOCKS selector (CPU-built summaries): captured share mass.
  Summaries ref(w);
  const auto clm = cpu_log_mass(w, ref.store, q, plan.log_mass_stride);
  double worst_mass = 0.0;
  for (int b = 0; b < w.B(); ++b)
    for (int h = 0; h < w.H; ++h) {
      const int n = w.seqs[b].n_pages();
      const size_t bh = size_t(b) * w.H + h;
      std::vector<float> lmc(size_t(w.G) * n);
      for (int g = 0; g < w.G; ++g)
        for (int j = 0; j < n; ++j) lmc[size_t(g) * n + j] = clm[(bh * w.G + g) * plan.log_mass_stride + j];
      std::vector<int32_t> cpu_sel;
      std::vector<float> score;
      select_top_pages(lmc.data(), w.G, n, budget_pages, GroupRule::kShareAverage, cpu_sel, &score);
      ASSERT_EQ(nsel[bh], int(cpu_sel.size()));
      double mg = 0.0, mc = 0.0;
      for (int i = 0; i < nsel[bh]; ++i) mg += score[sel[bh * budget_pages + i]];
      for (int32_t j : cpu_sel) mc += score[j];
      worst_mass = std::max(worst_mass, mc - mg);
      EXPECT_GE(mg, mc - 2e-2) << what << ": GPU set captures less CPU share mass, b " << b << " h " << h;
    }
  // (2) The output equals exact attention over the GPU's selected pages.
  std::vector<std::vector<int32_t>> lists(size_t(w.B()) * w.H);
  for (size_t bh = 0; bh < lists.size(); ++bh)
    lists[bh].assign(sel.begin() + bh * budget_pages, sel.begin() + bh * budget_pages + nsel[bh]);
  const double rel = check_attention(w, q, {o1, dl.down()}, lists, what);
  std::printf(
      "[ step %s ] captured-mass shortfall vs CPU max %.2e, output rel err max %.2e, plan: score chunk %d, "
      "sparse %d x %d pages%s, select %s\n",
      what, worst_mass, rel, plan.score_chunk_pages, plan.sparse_splits, plan.sparse_pages_per_split,
      plan.sparse_cluster_merge ? " (one cluster each)" : "",
      plan.select_cluster_pages ? ("one kernel, " + std::to_string(plan.select_cluster_pages) + " pages per CTA" +
                                   (lc::select_per_pair(plan) ? ", per pair" : ""))
                                      .c_str()
                                : "two kernels");

  // (3) CUDA graph: capture once, replay with new queries; equals the eager step.
  cudaStream_t st;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ck(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "begin capture");
  ck(lc::locks_decode_step(plan, sp, st), "capture step");
  ck(cudaStreamEndCapture(st, &graph), "end capture");
  ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  const auto q2 = w.queries(78);
  for (int rep = 0; rep < 2; ++rep) {
    dq.up(rep == 0 ? q2 : q);
    ck(cudaGraphLaunch(exec, st), "graph launch");
    ck(cudaStreamSynchronize(st), "graph run");
  }
  const auto o2 = d_o.down();
  EXPECT_EQ(o1, o2) << what << ": graph replay must reproduce the eager step exactly";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);

  // (4) Dense step vs CPU dense.
  ck(lc::dense_decode_step(plan, sp, nullptr), "dense step");
  dev_sync();
  const double rel_d = check_attention(w, q, {d_o.down(), dl.down()}, dense_lists(w), "dense step");
  std::printf("[ step %s ] dense rel err max %.2e, plan: %d x %d pages\n", what, rel_d, plan.dense_splits,
              plan.dense_pages_per_split);
}

}  // namespace

TEST(CudaDecodeStep, LocksStepMatchesCpuRandomPages) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128})
    for (int G : {4, 6, 16}) {
      World w(d, 2, G, {16 * 300 + 7, 16 * 90, 16 * 20 + 1}, lc::KvType::kF16, 500 + d + G);
      run_step_test(w, 32, "random");
      if (d == 128 && G != 6) run_step_test(w, 32, "random, no balancing", false, /*balance=*/false);
      if (G != 16 || d == 64) run_step_test(w, 32, "random, no clusters", false, true, /*cluster=*/false);
    }
  // A long sequence at batch 2: >= 32 score chunks, so the share kernel merges lse_total.
  for (int G : {4, 16}) {
    World w(128, 2, G, {16 * 1100 + 7, 16 * 40}, lc::KvType::kF16, 700 + G, false);
    run_step_test(w, 32, "random, deferred merge", /*expect_defer=*/true);
    run_step_test(w, 32, "random, deferred merge, no clusters", /*expect_defer=*/true, true, /*cluster=*/false);
  }
}

// The select started per (sequence, KV head) as the score pass completes it (select_per_pair(plan)),
// with 80 pairs of 3-CTA clusters of 1024 threads: more CTAs than SMs, so several
// waves of them. No cluster may wait on one that is not yet resident; the results must equal the CPU's.
// Sequence 3 is empty (its pairs are published by the score pass's item 0 alone).
TEST(CudaDecodeStep, PerPairSelectInSeveralWaves) {
  SKIP_WITHOUT_CUDA();
  std::vector<int> lens;
  for (int i = 0; i < 40; ++i) lens.push_back(i == 3 ? 0 : 16 * (30 + (i * 7) % 50) + i % 16);
  World w(128, 2, 4, lens, lc::KvType::kF16, 4242, false);
  run_step_test(w, 8, "per pair, several waves", false, true, true, /*select_pages_per_cta=*/32);
}

// Bad device-side page tables (kernels.h): the bad sequence (the last) gets NaN outputs and a status
// bit, nothing is read or written out of bounds (memcheck runs this test), and the other sequences'
// outputs are bit-identical to a run on the clean table (dense with a bad page count: equal up to
// summation order, since balanced splits follow the batch's page counts).
TEST(CudaDecodeStep, BadPageTablesGiveNaNAndStatusOthersUnaffected) {
  SKIP_WITHOUT_CUDA();
  // The second table has a 1040-page sequence: on the H200 that makes 33 score chunks per (sequence,
  // KV head) for G 4 and 16, so the plan leaves the lse_total merge to the share kernel, and bad
  // input must reach the output through it (the log line says which path ran).
  for (int first_len : {16 * 40 + 5, 16 * 1040 + 5})
    for (int G : {4, 16}) {
      World w(128, 2, G, {first_len, 16 * 30, 16 * 50 + 3, 16 * 20 + 9}, lc::KvType::kBF16, 900 + G, first_len < 1000);
      const int B = w.B(), last = B - 1, pool = w.cfg.n_pages;
      const auto q = w.queries(5);
      Dev<uint8_t> drec(size_t(w.H) * pool * lc::summary_record_bytes(w.d));
      Dev<uint32_t> dstatus(1);
      dstatus.fill_bytes(0);
      {  // summary_build skips page ids outside the pool and says so; the other records are built
        std::vector<int32_t> with_bad = w.full_pages();
        with_bad.insert(with_bad.begin() + 3, pool + 5);
        with_bad.push_back(-2);
        Dev<int32_t> dpages(with_bad);
        lc::SummaryBuildParams bp = w.build_params(dpages, int(with_bad.size()), drec.p);
        bp.status = dstatus.p;
        ck(lc::summary_build(bp, nullptr), "summary_build");
        dev_sync();
        EXPECT_EQ(dstatus.down()[0], uint32_t(lc::kStatusBadPageId));
      }

      // Balanced grids (the default) and a plan without run-time balancing (batch-invariant: the other
      // sequences stay bit-identical in every case, bad page counts included).
      // Budget 8 pages: one sparse split; 32 (balanced only, LOCKS only): four, merged inside a
      // cluster where the plan uses one (G 4 on the H200).
      for (auto [budget, balance] : {std::pair{8, true}, {8, false}, {32, true}}) {
        const lc::DecodePlan plan = lc::make_decode_plan(w.decode_shape(budget), -1, balance);
        ASSERT_EQ(plan.defer_lse_total, plan.score_equal_chunks >= 32) << plan.score_equal_chunks << " score chunks";
        Dev<uint8_t> ws(plan.workspace_bytes);
        ck(lc::init_decode_workspace(plan, ws.p, nullptr), "init workspace");
        Dev<float> dq(q), d_o(q.size()), dl(size_t(B) * w.H * w.G);
        const size_t per_seq_o = size_t(w.H) * w.G * w.d, per_seq_l = size_t(w.H) * w.G;

        // Runs the LOCKS step (or the dense step) on a page table; returns (o, lse, status).
        auto step = [&](const std::vector<int32_t>& indptr, const std::vector<int32_t>& indices,
                        const std::vector<int32_t>& last_len, bool dense) {
          Dev<int32_t> di(indptr), dx(indices), dlast(last_len);
          lc::DecodeStepParams sp;
          sp.q = dq.p;
          sp.kv = w.view();
          sp.kv.indptr = di.p;
          sp.kv.indices = dx.p;
          sp.kv.last_page_len = dlast.p;
          sp.summaries = drec.p;
          sp.n_pages_pool = pool;
          sp.scale = 1.0f / std::sqrt(float(w.d));
          sp.o = d_o.p;
          sp.lse = dl.p;
          sp.workspace = ws.p;
          d_o.fill_bytes(0x7f);  // stale garbage where a kernel fails to write
          ck(dense ? lc::dense_decode_step(plan, sp, nullptr) : lc::locks_decode_step(plan, sp, nullptr), "step");
          uint32_t status = 0;
          ck(lc::read_decode_status(plan, ws.p, &status, /*clear=*/true, nullptr), "status");
          return std::make_tuple(d_o.down(), dl.down(), status);
        };
        for (bool dense : {false, true}) {
          if (budget != 8 && dense) continue;  // (the dense step does not depend on the budget)
          const auto [o_ref, l_ref, st_ref] = step(w.indptr, w.indices, w.last_len, dense);
          ASSERT_EQ(st_ref, 0u) << "clean table";
          for (float x : o_ref) ASSERT_TRUE(std::isfinite(x));

          struct Case {
            const char* what;
            uint32_t bit;
            std::vector<int32_t> indptr, indices, last_len;
          };
          std::vector<Case> cases;
          const int beg = w.indptr[last], n_last = w.indptr[last + 1] - beg;
          {  // more pages than the launch covers (beyond max_pages and its rounding; the extra ids are valid)
            Case c{"too many pages", lc::kStatusBadPageCount, w.indptr, w.indices, w.last_len};
            for (int e = 0; e < 2 * w.max_pages + 8 - n_last; ++e) c.indices.push_back(w.indices[beg + e % n_last]);
            c.indptr[last + 1] = int32_t(c.indices.size());
            cases.push_back(c);
          }
          {
            Case c{"descending indptr", lc::kStatusBadPageCount, w.indptr, w.indices, w.last_len};
            c.indptr[last + 1] = c.indptr[last] - 1;
            cases.push_back(c);
          }
          for (int len : {0, 17, -3}) {
            Case c{"last_page_len out of range", lc::kStatusBadLastPageLen, w.indptr, w.indices, w.last_len};
            c.last_len[last] = len;
            cases.push_back(c);
          }
          for (int pos : {0, n_last / 2, n_last - 1})  // sink, middle, the partial recent page
            for (int32_t id : {pool, pool + 1000, -1, INT32_MIN}) {
              Case c{"page id outside the pool", lc::kStatusBadPageId, w.indptr, w.indices, w.last_len};
              c.indices[beg + pos] = id;
              cases.push_back(c);
            }
          for (const Case& c : cases) {
            const auto [o, l, st] = step(c.indptr, c.indices, c.last_len, dense);
            const std::string what = std::string(dense ? "dense: " : "locks: ") + c.what;
            EXPECT_EQ(st, c.bit) << what << " -> " << lc::describe_decode_status(st);
            // Balanced dense splits follow the batch's page counts, so a bad count moves the others'
            // split boundaries: the same values up to summation order. Otherwise bit-identical.
            const bool regrouped = dense && plan.dense_balance && c.bit == lc::kStatusBadPageCount;
            auto same = [&](float x, float ref) {
              return regrouped ? std::fabs(x - ref) <= 1e-5f * (1.0f + std::fabs(ref)) : std::memcmp(&x, &ref, 4) == 0;
            };
            for (size_t i = 0; i < size_t(last) * per_seq_o; ++i)
              ASSERT_TRUE(same(o[i], o_ref[i])) << what << ": another sequence's output changed at " << i;
            for (size_t i = 0; i < size_t(last) * per_seq_l; ++i)
              ASSERT_TRUE(same(l[i], l_ref[i])) << what << ": another sequence's lse changed at " << i;
            for (size_t i = size_t(last) * per_seq_o; i < o.size(); ++i)
              ASSERT_TRUE(std::isnan(o[i]))
                  << what << ": the bad sequence's o must be NaN, at " << i << " it is " << o[i];
            for (size_t i = size_t(last) * per_seq_l; i < l.size(); ++i)
              ASSERT_TRUE(std::isnan(l[i])) << what << ": the bad sequence's lse must be NaN";
          }
          // A clean step after the bad ones: the self-cleaning counters and histograms are intact.
          const auto [o2, l2, st2] = step(w.indptr, w.indices, w.last_len, dense);
          EXPECT_EQ(st2, 0u);
          EXPECT_EQ(std::memcmp(o2.data(), o_ref.data(), o2.size() * 4), 0) << "a clean step after bad ones";
          std::printf("[ bad input G=%d %s%s%s%s ] %zu cases: NaN for the bad sequence, others unaffected\n", G,
                      dense ? "dense" : "locks", plan.defer_lse_total ? " deferred merge" : "",
                      balance ? "" : ", no balancing", !dense && plan.sparse_cluster_merge ? ", cluster merge" : "",
                      cases.size());
        }
      }
    }
}

TEST(CudaDecodeStep, LocksStepMatchesCpuOnRealModelKeys) {
  SKIP_WITHOUT_CUDA();
  const Session& s = real_session();
  const int G = reference_model().hp.n_group();
  for (int il : {0, 3, 7}) {
    World w(s.cache(), s.sequence(), il, G);
    // Summaries and scores on real keys.
    Summaries ref(w);
    const auto q = w.queries(il);
    const ScoreOut g = run_score(w, ref.records, q, 32);
    const auto clm = cpu_log_mass(w, ref.store, q, g.stride);
    const double worst = check_scores(w, g, clm, "real keys score");
    std::printf("[ real keys layer %d ] %d pages, max |score gpu - cpu| = %.2e\n", il, w.max_pages, worst);
    run_step_test(w, 16, "real keys");
  }
}

#endif  // LOCKS_WITH_CUDA
