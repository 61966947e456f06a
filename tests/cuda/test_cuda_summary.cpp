// summary_build (Algorithm 1 on the device) against build_page_summary + PageSummaryStore: the
// device record packs exactly the CPU store's quantization; random, degenerate, dominated and
// non-finite pages; several layers in one launch.
#include <gtest/gtest.h>

#ifdef LOCKS_WITH_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda_fixture.h"

using namespace locks;
using namespace locks::test;

namespace {

// summary_build's parameters for a bf16 K pool (one layer).
lc::SummaryBuildParams bf16_build_params(const uint16_t* k, int H, int d, int pool, const int32_t* pages, int n_pages) {
  lc::SummaryBuildParams p;
  p.k = k;
  p.dtype = lc::KvType::kBF16;
  p.n_head_kv = H;
  p.head_dim = d;
  p.n_pages_pool = pool;
  p.pages = pages;
  p.n_pages = n_pages;
  return p;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Host-only: the device record packs exactly the CPU store's quantization (runs without a GPU).
TEST(CudaPack, RecordRoundTripMatchesCpuStore) {
  std::mt19937 rng(5);
  std::normal_distribution<float> N(0.0f, 1.0f);
  for (int d : {64, 128}) {
    PageSummaryStore st(SummaryFormat{8, 4, 8, 8}, 1, 1, 4, 16, d);
    for (int page = 0; page < 4; ++page) {
      std::vector<float> keys(size_t(16) * d);
      for (auto& x : keys) x = page == 1 ? 0.0f : 3.0f * N(rng);
      const PageSummaryF32 f = build_page_summary(keys.data(), 16, d, 8);
      st.store(0, 0, page, f);
      std::vector<uint8_t> rec(lc::summary_record_bytes(d));
      lc::pack_summary_record(f.centroid.data(), f.basis.data(), f.coef.data(), d, rec.data());
      std::vector<float> mu(d), V(size_t(8) * d), C(16 * 8);
      lc::unpack_summary_record(rec.data(), d, mu.data(), V.data(), C.data());
      const PageSummaryF32 ref = st.load(0, 0, page);
      EXPECT_EQ(mu, ref.centroid) << "d " << d;
      EXPECT_EQ(V, ref.basis) << "d " << d;
      EXPECT_EQ(C, ref.coef) << "d " << d;
    }
  }
  EXPECT_EQ(lc::summary_record_bytes(128), 832u);
  EXPECT_EQ(lc::summary_record_bytes(64), 512u);
  EXPECT_EQ(lc::summary_record_bytes(96), 0u) << "no device format at head_dim 96";
  EXPECT_EQ(lc::describe_decode_status(lc::kStatusBadPageId | lc::kStatusBadLastPageLen),
            "last_page_len outside 1..16; page id outside [0, n_pages_pool)");
  EXPECT_EQ(lc::describe_decode_status(0u), "");
  EXPECT_EQ(lc::describe_decode_status(lc::kStatusBadPageCount | 0x40u),
            "page count out of range (indptr descending, or more pages than the plan covers: max_pages); unknown "
            "status bits 0x40");
}

// ------------------------------------------------------------------------------------------------
TEST(CudaSummary, BuildMatchesCpuOnRandomAndDegeneratePages) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128}) {
    World w(d, 2, 4, {16 * 60, 16 * 37 + 9}, lc::KvType::kF16, 11 + d);
    Summaries ref(w);
    std::vector<int32_t> pages;
    for (const auto& s : w.seqs)
      for (int j = 0; j < s.n_pages(); ++j)
        if (s.n_tokens - 16 * j >= 16) pages.push_back(s.page_table[j]);
    const size_t rb = lc::summary_record_bytes(d);
    Dev<uint8_t> drec(ref.records.size());
    Dev<float> dtail(ref.tails.size());
    Dev<int32_t> dpages(pages);
    drec.fill_bytes(0);
    lc::SummaryBuildParams p;
    p.k = w.dk.p;
    p.dtype = w.dtype;
    p.n_head_kv = w.H;
    p.head_dim = d;
    p.pages = dpages.p;
    p.n_pages = int(pages.size());
    p.n_pages_pool = w.cfg.n_pages;
    p.records = drec.p;
    p.tails = dtail.p;
    ck(lc::summary_build(p, nullptr), "summary_build");
    dev_sync();
    const auto rec = drec.down();
    const auto tails = dtail.down();
    double worst_rec = 0.0, sum_rec = 0.0;
    int n_items = 0;
    for (int32_t page : pages)
      for (int h = 0; h < w.H; ++h) {
        const size_t idx = size_t(h) * w.cfg.n_pages + page;
        std::vector<float> mu(d), V(size_t(8) * d), C(128), mu_r(d), V_r(size_t(8) * d), C_r(128);
        lc::unpack_summary_record(&rec[idx * rb], d, mu.data(), V.data(), C.data());
        lc::unpack_summary_record(&ref.records[idx * rb], d, mu_r.data(), V_r.data(), C_r.data());
        for (float x : V) ASSERT_TRUE(std::isfinite(x));
        for (float x : C) ASSERT_TRUE(std::isfinite(x));
        // Centroid: same codes up to one rounding step.
        float ms = 0.0f;
        for (float x : mu_r) ms = std::max(ms, std::abs(x));
        for (int c = 0; c < d; ++c) EXPECT_LE(std::abs(mu[c] - mu_r[c]), 1.01f * ms / 127.0f + 1e-7f);
        // Rank-8 reconstruction C V (invariant to eigenvector signs).
        double num = 0.0, den = 0.0;
        for (int i = 0; i < 16; ++i)
          for (int c = 0; c < d; ++c) {
            double a = 0.0, r = 0.0;
            for (int k = 0; k < 8; ++k) {
              a += double(C[i * 8 + k]) * V[size_t(k) * d + c];
              r += double(C_r[i * 8 + k]) * V_r[size_t(k) * d + c];
            }
            num += (a - r) * (a - r);
            den += r * r;
          }
        const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
        worst_rec = std::max(worst_rec, rel);
        sum_rec += rel;
        ++n_items;
        EXPECT_LT(rel, 0.05) << "page " << page << " h " << h;
        EXPECT_NEAR(tails[idx], ref.tails[idx], 1e-4 * std::max(1.0f, ref.tails[idx]) + 1e-3f) << "tail";
      }
    EXPECT_LT(sum_rec / n_items, 2e-3) << "mean reconstruction difference";
    std::printf("[ summary d=%d ] %d (page, head) items, reconstruction rel diff max %.2e mean %.2e\n", d, n_items,
                worst_rec, sum_rec / n_items);

    // The score from GPU-built summaries agrees with the CPU-built ones.
    const auto q = w.queries(3);
    const ScoreOut g = run_score(w, rec, q, 32);
    const ScoreOut c = run_score(w, ref.records, q, 32);
    double worst = 0.0;
    for (size_t i = 0; i < g.log_mass.size(); ++i)
      if (std::isfinite(c.log_mass[i]) && std::abs(c.log_mass[i]) < 1e30)
        worst = std::max(worst, double(std::abs(g.log_mass[i] - c.log_mass[i])));
    EXPECT_LT(worst, 0.25) << "score from GPU- vs CPU-built summaries";
    std::printf("[ summary d=%d ] max |score(GPU build) - score(CPU build)| = %.3e\n", d, worst);
  }
}

// Keys that are not finite (an f16 overflow in the cache, a NaN) are bad input: the page's record
// is NaN, the status word says so, and no other page's record changes (memcheck: no access out of
// bounds, which NaN eigenvalues out of order could cause). Pages: NaN key, Inf key, finite keys.
TEST(CudaSummary, NonFiniteKeysGiveANaNRecordAndTheStatusBit) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128}) {
    const int H = 1, pool = 3;
    std::mt19937 rng(5 + d);
    std::normal_distribution<float> N(0.0f, 1.0f);
    std::vector<uint16_t> k(size_t(pool) * H * 16 * d);
    for (auto& x : k) x = bf16_bits(round_bf16(N(rng)));
    k[7 * d + 3] = 0x7fc0;                    // page 0: a NaN
    k[size_t(16) * d + 11 * d + 5] = 0x7f80;  // page 1: +Inf
    const size_t rb = lc::summary_record_bytes(d);
    Dev<uint16_t> dk(k);
    Dev<int32_t> dpages(std::vector<int32_t>{0, 1, 2}), dgood(std::vector<int32_t>{2});
    Dev<uint8_t> drec(size_t(pool) * rb), dref(size_t(pool) * rb);
    Dev<uint32_t> dstatus(1), dstatus_ref(1);
    drec.fill_bytes(0);
    dref.fill_bytes(0);
    dstatus.fill_bytes(0);
    dstatus_ref.fill_bytes(0);
    lc::SummaryBuildParams p = bf16_build_params(dk.p, H, d, pool, dpages.p, 3);
    p.records = drec.p;
    p.status = dstatus.p;
    ck(lc::summary_build(p, nullptr), "summary_build");
    p.pages = dgood.p;
    p.n_pages = 1;
    p.records = dref.p;
    p.status = dstatus_ref.p;
    ck(lc::summary_build(p, nullptr), "summary_build (finite page alone)");
    dev_sync();
    EXPECT_EQ(dstatus.down()[0], uint32_t(lc::kStatusBadKeys)) << lc::describe_decode_status(dstatus.down()[0]);
    EXPECT_EQ(dstatus_ref.down()[0], 0u);
    const auto rec = drec.down(), ref = dref.down();
    for (int page : {0, 1}) {
      std::vector<float> mu(d), V(size_t(8) * d), C(128);
      lc::unpack_summary_record(&rec[page * rb], d, mu.data(), V.data(), C.data());
      bool any_nan = false;
      for (float x : mu) any_nan |= std::isnan(x);
      EXPECT_TRUE(any_nan) << "d " << d << " page " << page << ": a NaN centroid";
    }
    EXPECT_TRUE(std::equal(rec.begin() + 2 * rb, rec.begin() + 3 * rb, ref.begin() + 2 * rb))
        << "d " << d << ": the finite page's record does not depend on its neighbours";
  }
}

// Pages the float32 Jacobi finds hardest: one direction dominating the keys (the rest at 1e-3 of
// it), and one token 300x the others. The GPU record's rank-8 reconstruction of the centred keys must
// be as close to them as the CPU's float64 build is (int4/int8 quantization dominates both).
TEST(CudaSummary, DominatedPagesReconstructAsWellAsTheCpuBuild) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128})
    for (int kind = 0; kind < 3; ++kind) {
      std::mt19937 rng(900 + 10 * d + kind);
      std::normal_distribution<float> N(0.0f, 1.0f);
      std::vector<float> u(d), mean(d), keys(size_t(16) * d);
      for (int c = 0; c < d; ++c) {
        u[c] = N(rng);
        mean[c] = 2.0f * N(rng);
      }
      for (int i = 0; i < 16; ++i) {
        const float a = 4.0f * N(rng);
        for (int c = 0; c < d; ++c) {
          float x = kind == 0   ? mean[c] + a * u[c] + 1e-3f * N(rng)                    // one direction
                    : kind == 1 ? mean[c] + a * u[c] + 0.2f * a * N(rng) * (c % 3 == 0)  // two, skewed
                                : N(rng) * (i == 5 ? 300.0f : 1.0f);                     // an outlier token
          keys[size_t(i) * d + c] = round_bf16(x);
        }
      }
      std::vector<uint16_t> kb(keys.size());
      for (size_t e = 0; e < keys.size(); ++e) kb[e] = bf16_bits(keys[e]);
      const size_t rb = lc::summary_record_bytes(d);
      std::vector<uint8_t> cpu_rec(rb);
      const PageSummaryF32 f = build_page_summary(keys.data(), 16, d, 8);
      lc::pack_summary_record(f.centroid.data(), f.basis.data(), f.coef.data(), d, cpu_rec.data());
      Dev<uint16_t> dk(kb);
      Dev<int32_t> dpage(std::vector<int32_t>{0});
      Dev<uint8_t> drec(rb);
      lc::SummaryBuildParams p = bf16_build_params(dk.p, 1, d, 1, dpage.p, 1);
      p.records = drec.p;
      ck(lc::summary_build(p, nullptr), "summary_build");
      dev_sync();
      const auto gpu_rec = drec.down();
      // || centroid + C V - keys ||_F / || keys - mean ||_F for a record.
      auto rel_err = [&](const uint8_t* rec) {
        std::vector<float> mu(d), V(size_t(8) * d), C(128);
        lc::unpack_summary_record(rec, d, mu.data(), V.data(), C.data());
        std::vector<double> m(d, 0.0);
        for (int i = 0; i < 16; ++i)
          for (int c = 0; c < d; ++c) m[c] += keys[size_t(i) * d + c] / 16.0;
        double num = 0.0, den = 0.0;
        for (int i = 0; i < 16; ++i)
          for (int c = 0; c < d; ++c) {
            double r = mu[c];
            for (int k = 0; k < 8; ++k) r += double(C[i * 8 + k]) * V[size_t(k) * d + c];
            const double x = keys[size_t(i) * d + c];
            num += (r - x) * (r - x);
            den += (x - m[c]) * (x - m[c]);
          }
        return std::sqrt(num / den);
      };
      const double eg = rel_err(gpu_rec.data()), ec = rel_err(cpu_rec.data());
      std::printf("[ summary dominated d=%d kind=%d ] reconstruction error GPU %.3e, CPU %.3e\n", d, kind, eg, ec);
      EXPECT_LE(eg, 1.02 * ec + 1e-4) << "d " << d << " kind " << kind;  // H200: equal to 4 digits
    }
}

// Several layers in one launch (SummaryBuildParams::n_layers) write exactly what one launch per
// layer writes, with K per layer and with one K pool read by every layer (k_layer_stride 0);
// overlapping layer strides are refused.
TEST(CudaSummary, LayersInOneLaunchEqualOneLaunchPerLayer) {
  SKIP_WITHOUT_CUDA();
  for (int d : {64, 128}) {
    const int H = 2, pool = 5, L = 3;
    const size_t layer_elems = size_t(pool) * H * 16 * d, rb = lc::summary_record_bytes(d);
    const size_t rec_layer = size_t(H) * pool * rb, tail_layer = size_t(H) * pool;
    std::mt19937 rng(77 + d);
    std::normal_distribution<float> N(0.0f, 1.0f);
    std::vector<uint16_t> k(layer_elems * L);
    for (auto& x : k) x = bf16_bits(round_bf16(1.5f * N(rng)));
    Dev<uint16_t> dk(k);
    Dev<int32_t> dpages(std::vector<int32_t>{4, 1, 2});
    for (bool shared_k : {false, true}) {
      Dev<uint8_t> one(rec_layer * L), each(rec_layer * L);
      Dev<float> tone(tail_layer * L), teach(tail_layer * L);
      one.fill_bytes(0);
      each.fill_bytes(0);
      tone.fill_bytes(0);
      teach.fill_bytes(0);
      lc::SummaryBuildParams p = bf16_build_params(dk.p, H, d, pool, dpages.p, 3);
      for (int l = 0; l < L; ++l) {
        lc::SummaryBuildParams q = p;
        q.k = dk.p + (shared_k ? 0 : l * layer_elems);
        q.records = each.p + l * rec_layer;
        q.tails = teach.p + l * tail_layer;
        ck(lc::summary_build(q, nullptr), "summary_build (one layer)");
      }
      p.records = one.p;
      p.tails = tone.p;
      p.n_layers = L;
      p.k_layer_stride = shared_k ? 0 : layer_elems;
      p.records_layer_stride = rec_layer;
      p.tails_layer_stride = tail_layer;
      ck(lc::summary_build(p, nullptr), "summary_build (layers)");
      dev_sync();
      EXPECT_EQ(one.down(), each.down()) << "d " << d << (shared_k ? " one K pool" : " K per layer");
      EXPECT_EQ(tone.down(), teach.down()) << "d " << d;
      p.records_layer_stride = rec_layer - 1;  // layers would overlap
      EXPECT_EQ(lc::summary_build(p, nullptr), cudaErrorInvalidValue);
      p.records_layer_stride = rec_layer;
      p.k_layer_stride = layer_elems - 1;
      EXPECT_EQ(lc::summary_build(p, nullptr), cudaErrorInvalidValue);
      p.k_layer_stride = layer_elems + 1;  // apart, but K's 16-byte loads would be misaligned
      EXPECT_EQ(lc::summary_build(p, nullptr), cudaErrorInvalidValue);
      p.k_layer_stride = layer_elems;
      p.records_layer_stride = rec_layer + 8;  // records' 16-byte stores misaligned
      EXPECT_EQ(lc::summary_build(p, nullptr), cudaErrorInvalidValue);
    }
  }
}

#endif  // LOCKS_WITH_CUDA
