// The per-token model kernels (src/cuda/model_ops.h) against float64 CPU references of the math of
// src/llm/session.cpp, src/core/kv_cache.cpp and src/llm/sampler.cpp (test-backend-ops style), each
// with its tolerance stated where it is checked: exact (embedding, bias, casts, K/V append, argmax),
// one bf16 rounding (RMSNorm, SwiGLU), 1e-6 of the pair's norm (RoPE at positions up to 5e7), and
// 5 sigma of the nucleus probabilities over 20,000 draws (sampling). Odd sizes (1, 3, 17 rows; 8, 64,
// 4097 columns), both the 16-byte and the scalar code paths, bad device-side input (token out of
// range, position beyond the page table, NaN logits) and a CUDA graph replay. The device tests skip
// when no usable CUDA device is present; the host-side checks (Philox known answers, shape checks,
// status text) run everywhere.
#include <gtest/gtest.h>

#ifdef LOCKS_WITH_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/cuda_fixture.h"
#include "cuda/model_ops.h"

namespace lc = locks::cuda;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

using locks::test::ck;
using locks::test::Dev;
using locks::test::dev_sync;

uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float bits_f32(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
// float -> bf16, round to nearest even (NaN: a quiet NaN of the same sign).
uint16_t to_bf16(float x) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t b) { return bits_f32(uint32_t(b) << 16); }
// float -> f16, round to nearest even, overflow to inf, subnormals rounded.
uint16_t to_f16(float x) {
  const uint32_t u = f32_bits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 (65504 + half an ulp): inf
  if (a < 0x38800000u) {                        // below 2^-14: subnormal steps of 2^-24, exact in double
    return sign | uint16_t(std::nearbyint(double(bits_f32(a)) * 16777216.0));  // (1024 is the smallest normal)
  }
  uint32_t h = ((((a >> 23) - 127 + 15) << 10) | ((a & 0x7fffffu) >> 13));
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return uint16_t(sign | h);
}
// Half an ulp of bf16 at |ref| (bf16 has 8 significant bits).
double half_ulp_bf16(double ref) {
  if (ref == 0.0) return 0.0;
  return std::ldexp(1.0, std::ilogb(ref) - 8);
}

uint32_t read_status(const Dev<uint32_t>& s) { return s.down()[0]; }

// ------------------------------------------------------------------------------------------------
// Host-side checks (no device needed).

TEST(CudaModelOps, PhiloxKnownAnswers) {
  // Random123's kat_vectors for philox4x32 10 rounds.
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    uint32_t out[4];
    lc::philox4x32_10(k.ctr, k.key, out);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], k.out[i]) << "word " << i;
  }
}

TEST(CudaModelOps, DescribeStatus) {
  EXPECT_EQ(lc::describe_model_status(0), "");
  EXPECT_EQ(lc::describe_model_status(lc::kStatusBadToken), "token id outside the vocabulary (embedding row NaN)");
  const std::string s = lc::describe_model_status(lc::kStatusNanLogits | lc::kStatusKvSlotOutOfRange | 1u);
  EXPECT_NE(s.find("NaN in the logits"), std::string::npos) << s;
  EXPECT_NE(s.find("outside the page table"), std::string::npos) << s;
  EXPECT_NE(s.find("other status bits 0x1"), std::string::npos) << s;
}

// Bad host-side shapes are refused before any launch (so without a device too); zero rows is a no-op.
TEST(CudaModelOps, HostShapeChecks) {
  float f = 0.0f;
  int32_t i32 = 0;
  double d = 1.0;
  uint16_t h = 0;
  {
    lc::EmbedParams p;
    p.tokens = &i32, p.table = &h, p.x = &f, p.n_vocab = 4, p.n_embd = 0, p.n_rows = 1;
    EXPECT_EQ(lc::embed_rows(p, nullptr), cudaErrorInvalidValue);
    p.n_embd = 8, p.n_rows = 0;
    EXPECT_EQ(lc::embed_rows(p, nullptr), cudaSuccess);
    p.n_rows = 1, p.table = nullptr;
    EXPECT_EQ(lc::embed_rows(p, nullptr), cudaErrorInvalidValue);
  }
  {
    lc::RmsNormParams p;
    p.x = &f, p.weight = &f, p.out = &f, p.n_rows = 1, p.n = 8, p.eps = -1.0f;
    EXPECT_EQ(lc::rmsnorm_rows(p, nullptr), cudaErrorInvalidValue);
    p.eps = kNaN;
    EXPECT_EQ(lc::rmsnorm_rows(p, nullptr), cudaErrorInvalidValue);
  }
  {
    lc::RopeParams p;
    p.q = &f, p.n_head_q = 1, p.n_rows = 1, p.head_dim = 8, p.positions = &i32, p.inv_freq = &d;
    for (int n_rot : {0, 3, 10, -2}) {
      p.n_rot = n_rot;
      EXPECT_EQ(lc::rope_rows(p, nullptr), cudaErrorInvalidValue) << "n_rot " << n_rot;
    }
    p.n_rot = 8, p.head_dim = 7;
    EXPECT_EQ(lc::rope_rows(p, nullptr), cudaErrorInvalidValue);
    p.head_dim = 8, p.q_stride = 4;
    EXPECT_EQ(lc::rope_rows(p, nullptr), cudaErrorInvalidValue);
    p.q_stride = 0, p.mode = static_cast<lc::RopeMode>(1);
    EXPECT_EQ(lc::rope_rows(p, nullptr), cudaErrorInvalidValue);
  }
  {
    lc::AppendKvParams p;
    p.k = p.v = &f, p.row_pos = &i32, p.indptr = p.indices = &i32, p.k_pool = p.v_pool = &h;
    p.n_rows = 1, p.n_head_kv = 1, p.head_dim = 7, p.n_pages_pool = 1;
    EXPECT_EQ(lc::append_kv(p, nullptr), cudaErrorInvalidValue);  // odd head_dim
    p.head_dim = 8, p.n_pages_pool = 0;
    EXPECT_EQ(lc::append_kv(p, nullptr), cudaErrorInvalidValue);
    p.n_pages_pool = 1, p.k_stride = 4;
    EXPECT_EQ(lc::append_kv(p, nullptr), cudaErrorInvalidValue);
  }
  {
    lc::SwigluParams p;
    p.gate = p.up = &f, p.out = &h, p.n_rows = 1, p.n_ff = 8, p.up_stride = 7;
    EXPECT_EQ(lc::swiglu_rows(p, nullptr), cudaErrorInvalidValue);
  }
  EXPECT_EQ(lc::f32_to_bf16(nullptr, nullptr, 0, nullptr), cudaSuccess);
  EXPECT_EQ(lc::f32_to_bf16(nullptr, &h, 4, nullptr), cudaErrorInvalidValue);
  {
    lc::ArgmaxParams p;
    p.logits = &f, p.ids = &i32, p.n_rows = 1, p.n_vocab = 8, p.logits_stride = 7;
    EXPECT_EQ(lc::argmax_rows(p, nullptr), cudaErrorInvalidValue);
  }
  {
    lc::SampleParams p;
    p.logits = &f, p.ids = &i32, p.n_rows = 1, p.n_vocab = 8;
    for (float t : {-1.0f, kNaN, kInf}) {
      p.temperature = t;
      EXPECT_EQ(lc::sample_rows(p, nullptr), cudaErrorInvalidValue) << "temperature " << t;
    }
    p.temperature = 1.0f;
    for (float tp : {0.0f, -0.5f, 1.5f, kNaN}) {
      p.top_p = tp;
      EXPECT_EQ(lc::sample_rows(p, nullptr), cudaErrorInvalidValue) << "top_p " << tp;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Embedding: exact (a bf16 -> float conversion); bad tokens give NaN rows and a status bit.

TEST(CudaModelOps, EmbedRowsExact) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(1);
  std::normal_distribution<float> N(0.0f, 1.0f);
  const int V = 37;
  for (int E : {8, 64, 4096, 4097}) {
    for (int T : {1, 3, 17}) {
      for (bool offset : {false, true}) {  // offset: x not 16-byte aligned (the scalar path)
        std::vector<uint16_t> table(size_t(V) * E);
        for (auto& b : table) b = to_bf16(N(rng) * 0.1f);
        std::vector<int32_t> tokens(T);
        for (auto& t : tokens) t = int32_t(rng() % V);
        tokens[0] = V - 1;
        Dev<uint16_t> dt(table);
        Dev<int32_t> dtok(tokens);
        Dev<float> dx(size_t(T) * E + 1);
        Dev<uint32_t> st(1);
        st.fill_bytes(0);
        lc::EmbedParams p;
        p.tokens = dtok.p, p.table = dt.p, p.n_vocab = V, p.n_embd = E, p.n_rows = T;
        p.x = dx.p + (offset ? 1 : 0), p.status = st.p;
        ck(lc::embed_rows(p, nullptr), "embed_rows");
        dev_sync();
        const auto x = dx.down();
        for (int r = 0; r < T; ++r)
          for (int i = 0; i < E; ++i)
            ASSERT_EQ(f32_bits(x[size_t(r) * E + i + (offset ? 1 : 0)]),
                      f32_bits(from_bf16(table[size_t(tokens[r]) * E + i])))
                << "E " << E << " T " << T << " row " << r << " col " << i;
        EXPECT_EQ(read_status(st), 0u);
      }
    }
  }
}

TEST(CudaModelOps, EmbedRowsBadToken) {
  SKIP_WITHOUT_CUDA();
  const int V = 11, E = 64;
  std::vector<uint16_t> table(size_t(V) * E);
  for (size_t i = 0; i < table.size(); ++i) table[i] = to_bf16(float(i % 97) * 0.25f);
  const std::vector<int32_t> tokens = {
      3, -1, V, 0, std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(), V - 1};
  const int T = int(tokens.size());
  Dev<uint16_t> dt(table);
  Dev<int32_t> dtok(tokens);
  Dev<float> dx(size_t(T) * E);
  Dev<uint32_t> st(1);
  st.fill_bytes(0);
  lc::EmbedParams p;
  p.tokens = dtok.p, p.table = dt.p, p.n_vocab = V, p.n_embd = E, p.n_rows = T, p.x = dx.p, p.status = st.p;
  ck(lc::embed_rows(p, nullptr), "embed_rows");
  dev_sync();
  const auto x = dx.down();
  for (int r = 0; r < T; ++r) {
    const bool bad = tokens[r] < 0 || tokens[r] >= V;
    for (int i = 0; i < E; ++i) {
      const float got = x[size_t(r) * E + i];
      if (bad) {
        ASSERT_TRUE(std::isnan(got)) << "row " << r;
      } else {
        ASSERT_EQ(got, from_bf16(table[size_t(tokens[r]) * E + i])) << "row " << r;
      }
    }
  }
  EXPECT_EQ(read_status(st), uint32_t(lc::kStatusBadToken));
}

// ------------------------------------------------------------------------------------------------
// RMSNorm: within one bf16 rounding of the float64 reference (half an ulp of bf16 at the reference,
// plus 1e-6 relative for the float32 products before the rounding); bit-identical to the CPU's
// float operations (float64 sum, float inv, (x * inv) * w), then rounded.

TEST(CudaModelOps, RmsNormRows) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(2);
  std::normal_distribution<float> N(0.0f, 1.0f);
  for (int n : {8, 64, 4097, 8192}) {
    for (int T : {1, 3, 17}) {
      for (bool f32 : {false, true}) {
        const float eps = n == 64 ? 1e-6f : 1e-5f;
        std::vector<float> x(size_t(T) * n), w(n);
        for (int r = 0; r < T; ++r) {
          const float scale = std::pow(10.0f, float(r % 7) - 3.0f);  // 1e-3 .. 1e3: eps matters at the low end
          for (int i = 0; i < n; ++i) x[size_t(r) * n + i] = N(rng) * scale;
        }
        for (auto& v : w) v = 1.0f + 0.3f * N(rng);
        Dev<float> dx(x), dw(w);
        Dev<float> dof(size_t(T) * n);
        Dev<uint16_t> dob(size_t(T) * n);
        lc::RmsNormParams p;
        p.x = dx.p, p.weight = dw.p, p.n_rows = T, p.n = n, p.eps = eps, p.out_f32 = f32;
        p.out = f32 ? static_cast<void*>(dof.p) : static_cast<void*>(dob.p);
        ck(lc::rmsnorm_rows(p, nullptr), "rmsnorm_rows");
        dev_sync();
        const auto of = dof.down();
        const auto ob = dob.down();
        int cpu_mismatch = 0;
        for (int r = 0; r < T; ++r) {
          const float* xr = &x[size_t(r) * n];
          double ss = 0.0;
          for (int i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
          const double inv64 = 1.0 / std::sqrt(ss / n + double(eps));
          const float inv = float(1.0 / std::sqrt(ss / n + eps));  // the CPU's rmsnorm
          for (int i = 0; i < n; ++i) {
            const double ref = double(xr[i]) * inv64 * w[i];
            const float cpu = xr[i] * inv * w[i];
            const size_t at = size_t(r) * n + i;
            if (f32) {
              ASSERT_LE(std::abs(of[at] - ref), 1e-6 * std::abs(ref) + 1e-30)
                  << "n " << n << " row " << r << " i " << i;
              cpu_mismatch += of[at] != cpu;
            } else {
              const double got = from_bf16(ob[at]);
              ASSERT_LE(std::abs(got - ref), half_ulp_bf16(ref) + 1e-6 * std::abs(ref) + 1e-30)
                  << "n " << n << " row " << r << " i " << i << " got " << got << " ref " << ref;
              cpu_mismatch += ob[at] != to_bf16(cpu);
            }
          }
        }
        // Only the order of the float64 sum differs from the CPU: inv can differ in its last bit
        // only when the float64 value lies within ~1e-16 of a float rounding boundary.
        EXPECT_EQ(cpu_mismatch, 0) << "n " << n << " T " << T << (f32 ? " f32" : " bf16");
      }
    }
  }
}

TEST(CudaModelOps, RmsNormInPlaceAndUnaligned) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(3);
  std::normal_distribution<float> N(0.0f, 1.0f);
  const int T = 3, n = 64;
  std::vector<float> x(size_t(T) * n + 1), w(n + 1);
  for (auto& v : x) v = N(rng);
  for (auto& v : w) v = 1.0f + 0.1f * N(rng);
  for (bool offset : {false, true}) {  // offset: x, w and out not 16-byte aligned (the scalar path)
    Dev<float> dx(x), dw(w);
    const int o = offset ? 1 : 0;
    lc::RmsNormParams p;
    p.x = dx.p + o, p.weight = dw.p + o, p.n_rows = T, p.n = n, p.eps = 1e-5f, p.out_f32 = true;
    p.out = dx.p + o;  // in place
    ck(lc::rmsnorm_rows(p, nullptr), "rmsnorm_rows");
    dev_sync();
    const auto got = dx.down();
    for (int r = 0; r < T; ++r) {
      const float* xr = &x[size_t(r) * n + o];
      double ss = 0.0;
      for (int i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
      const float inv = float(1.0 / std::sqrt(ss / n + 1e-5f));
      for (int i = 0; i < n; ++i)
        ASSERT_EQ(got[size_t(r) * n + i + o], xr[i] * inv * w[i + o]) << "offset " << o << " row " << r << " i " << i;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Grouped rows (Qwen3's per-head q/k norm): the K half of K|V rows, one norm per (token, head), in
// place; the V half and the gaps untouched. Float64 reference per head.

TEST(CudaModelOps, RmsNormGroupedHeadsInPlace) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(5);
  std::normal_distribution<float> N(0.0f, 1.0f);
  for (int hd : {64, 30}) {  // vector and scalar paths
    const int T = 5, NKV = 3, stride = 2 * NKV * hd;
    std::vector<float> kv(size_t(T) * stride), w(hd);
    for (auto& v : kv) v = N(rng) * 3.0f;
    for (auto& v : w) v = 1.0f + 0.3f * N(rng);
    Dev<float> dkv(kv), dw(w);
    lc::RmsNormParams p;
    p.x = dkv.p, p.weight = dw.p, p.n_rows = T * NKV, p.n = hd, p.eps = 1e-6f, p.out = dkv.p, p.out_f32 = true;
    p.group = NKV, p.group_stride = stride;
    ck(lc::rmsnorm_rows(p, nullptr), "rmsnorm_rows grouped");
    dev_sync();
    const auto got = dkv.down();
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < 2 * NKV; ++h) {
        const float* x = &kv[size_t(t) * stride + size_t(h) * hd];
        double ss = 0.0;
        for (int i = 0; i < hd; ++i) ss += double(x[i]) * x[i];
        const double inv = 1.0 / std::sqrt(ss / hd + 1e-6);
        for (int i = 0; i < hd; ++i) {
          const size_t at = size_t(t) * stride + size_t(h) * hd + i;
          if (h >= NKV)
            ASSERT_EQ(got[at], kv[at]) << "V element changed: t " << t << " h " << h;
          else
            ASSERT_NEAR(got[at], double(x[i]) * inv * w[i], 1e-6 * std::abs(double(x[i]) * inv * w[i]) + 1e-30)
                << "hd " << hd << " t " << t << " h " << h << " i " << i;
        }
      }
  }
  lc::RmsNormParams bad;
  bad.x = bad.weight = reinterpret_cast<const float*>(16);
  bad.out = reinterpret_cast<void*>(16);
  bad.n_rows = 4, bad.n = 8, bad.group = 2, bad.group_stride = 15;  // below group * n
  EXPECT_EQ(lc::rmsnorm_rows(bad, nullptr), cudaErrorInvalidValue);
  bad.group_stride = 0, bad.group = 0;
  EXPECT_EQ(lc::rmsnorm_rows(bad, nullptr), cudaErrorInvalidValue);
}

// ------------------------------------------------------------------------------------------------
// RoPE: float64 reference (float64 angle and sin/cos, float64 rotation); tolerance 1e-6 of the pair's
// norm at every position, including 1,000,000, 50,000,000 and 2^26 - 1 (a float32 angle would be off
// by radians there); dims >= n_rot and the bytes between the strided heads bit-identical.

std::vector<double> inv_freqs(int n_rot, double base, bool llama31_factors) {
  std::vector<double> f(n_rot / 2);
  for (int i = 0; i < n_rot / 2; ++i) {
    f[i] = std::pow(base, -2.0 * i / n_rot);
    if (llama31_factors) f[i] /= 1.0 + 7.0 * i / std::max(1, n_rot / 2 - 1);  // any per-pair factor
  }
  return f;
}

void rope_reference(float* v, int n_heads, int head_dim, int n_rot, bool neox, int32_t pos,
                    const std::vector<double>& inv_freq, std::vector<double>& out) {
  out.assign(v, v + size_t(n_heads) * head_dim);
  const int half = n_rot / 2;
  for (int h = 0; h < n_heads; ++h)
    for (int i = 0; i < half; ++i) {
      const double a = double(pos) * inv_freq[i];
      const double c = std::cos(a), s = std::sin(a);
      const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
      const double x0 = v[size_t(h) * head_dim + i0], x1 = v[size_t(h) * head_dim + i1];
      out[size_t(h) * head_dim + i0] = x0 * c - x1 * s;
      out[size_t(h) * head_dim + i1] = x0 * s + x1 * c;
    }
}

TEST(CudaModelOps, RopeRows) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(4);
  std::normal_distribution<float> N(0.0f, 1.0f);
  struct Case {
    int head_dim, n_rot, n_head_q, n_head_k;
    bool neox, factors, fused;
    double base;
  };
  const Case cases[] = {
      {8, 8, 4, 2, false, false, false, 10000.0},     {64, 64, 8, 2, false, false, true, 10000.0},
      {128, 128, 4, 1, false, true, false, 500000.0}, {128, 128, 6, 2, true, false, true, 1000000.0},
      {64, 32, 3, 3, false, false, false, 10000.0},   {128, 64, 2, 2, true, false, false, 10000.0},
      {256, 256, 2, 1, true, false, false, 10000.0},  {6, 4, 5, 0, false, false, false, 10000.0},
  };
  const std::vector<int32_t> special = {0, 1, 15, 1000000, 50000000, (1 << 26) - 1};
  for (const Case& c : cases) {
    for (int T : {1, 3, 17}) {
      const int wq = c.n_head_q * c.head_dim, wk = c.n_head_k * c.head_dim;
      // fused: one [T][q | k | v] buffer as a fused QKV GEMM writes it (v untouched); else q and k apart.
      const int q_stride = c.fused ? wq + 2 * wk : wq, k_stride = c.fused ? wq + 2 * wk : wk;
      std::vector<float> qbuf(size_t(T) * q_stride), kbuf(c.fused ? 0 : size_t(T) * k_stride);
      for (auto& v : qbuf) v = N(rng);
      for (auto& v : kbuf) v = N(rng);
      std::vector<int32_t> pos(T);
      for (int r = 0; r < T; ++r)
        pos[r] = r < int(special.size()) ? special[(r + T) % special.size()] : int32_t(rng() % (1u << 26));
      if (T == 1) pos[0] = 50000000;
      const auto inv = inv_freqs(c.n_rot, c.base, c.factors);
      Dev<float> dq(qbuf), dk(std::max<size_t>(1, kbuf.size()));
      if (!kbuf.empty()) dk.up(kbuf);
      Dev<int32_t> dpos(pos);
      Dev<double> dinv(inv);
      lc::RopeParams p;
      p.q = dq.p, p.n_head_q = c.n_head_q, p.q_stride = c.fused ? q_stride : 0;
      p.k = c.fused ? dq.p + wq : dk.p, p.n_head_k = c.n_head_k, p.k_stride = c.fused ? k_stride : 0;
      p.n_rows = T, p.head_dim = c.head_dim, p.n_rot = c.n_rot;
      p.mode = c.neox ? lc::RopeMode::kNeox : lc::RopeMode::kNormal;
      p.positions = dpos.p, p.inv_freq = dinv.p;
      ck(lc::rope_rows(p, nullptr), "rope_rows");
      dev_sync();
      const auto gq = dq.down();
      const auto gk = kbuf.empty() ? std::vector<float>() : dk.down();
      std::vector<double> ref;
      double worst = 0.0;
      auto check = [&](std::vector<float>& src, const std::vector<float>& got, size_t off, int n_heads, int r) {
        rope_reference(&src[off], n_heads, c.head_dim, c.n_rot, c.neox, pos[r], inv, ref);
        const int half = c.n_rot / 2;
        for (int h = 0; h < n_heads; ++h) {
          const size_t hb = off + size_t(h) * c.head_dim;
          for (int i = 0; i < half; ++i) {
            const int i0 = c.neox ? i : 2 * i, i1 = c.neox ? i + half : 2 * i + 1;
            const double norm = std::hypot(double(src[hb + i0]), double(src[hb + i1]));
            for (int j : {i0, i1}) {
              const double err = std::abs(got[hb + j] - ref[size_t(h) * c.head_dim + j]);
              worst = std::max(worst, err / norm);
              ASSERT_LE(err, 1e-6 * norm + 1e-30)
                  << "head_dim " << c.head_dim << " n_rot " << c.n_rot << (c.neox ? " neox" : " normal") << " pos "
                  << pos[r] << " head " << h << " dim " << j;
            }
          }
          for (int j = c.n_rot; j < c.head_dim; ++j)
            ASSERT_EQ(f32_bits(got[hb + j]), f32_bits(src[hb + j])) << "dim " << j;
        }
      };
      for (int r = 0; r < T; ++r) {
        check(qbuf, gq, size_t(r) * q_stride, c.n_head_q, r);
        if (c.fused) {
          check(qbuf, gq, size_t(r) * q_stride + wq, c.n_head_k, r);
          for (int j = wq + wk; j < q_stride; ++j)  // v untouched
            ASSERT_EQ(f32_bits(gq[size_t(r) * q_stride + j]), f32_bits(qbuf[size_t(r) * q_stride + j]));
        } else if (c.n_head_k > 0) {
          check(kbuf, gk, size_t(r) * k_stride, c.n_head_k, r);
        }
      }
      EXPECT_LE(worst, 1e-6);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Bias: exact (one float add).

TEST(CudaModelOps, AddBiasRows) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(5);
  std::normal_distribution<float> N(0.0f, 1.0f);
  for (int n : {8, 4097, 6144}) {
    for (int T : {1, 3, 17}) {
      for (int pad : {0, 4, 3}) {  // y_stride = n + pad (3: the scalar path)
        const int stride = n + pad;
        std::vector<float> y(size_t(T) * stride), b(n);
        for (auto& v : y) v = N(rng);
        for (auto& v : b) v = N(rng);
        Dev<float> dy(y), db(b);
        lc::AddBiasParams p;
        p.y = dy.p, p.b = db.p, p.n_rows = T, p.n = n, p.y_stride = pad ? stride : 0;
        ck(lc::add_bias_rows(p, nullptr), "add_bias_rows");
        dev_sync();
        const auto g = dy.down();
        for (int r = 0; r < T; ++r)
          for (int i = 0; i < stride; ++i) {
            const float want = i < n ? y[size_t(r) * stride + i] + b[i] : y[size_t(r) * stride + i];
            ASSERT_EQ(f32_bits(g[size_t(r) * stride + i]), f32_bits(want)) << "n " << n << " row " << r << " i " << i;
          }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// K/V append: bit-exact round-to-nearest-even into the right (page, head, slot), every other byte of
// the pool untouched; bad rows not written, with their status bits.

struct KvCase {
  int n_head_kv, head_dim;
  lc::KvType dtype;
  int stride_pad;  // k/v rows of width + pad floats (a fused QKV buffer)
};

struct PagedTable {
  int n_pages_pool = 0;
  std::vector<int32_t> indptr, indices;
};

// Sequences of the given page counts, page ids drawn without replacement from a pool of n_pages_pool.
PagedTable make_table(const std::vector<int>& pages, int n_pages_pool, std::mt19937_64& rng) {
  PagedTable t;
  t.n_pages_pool = n_pages_pool;
  std::vector<int32_t> ids(n_pages_pool);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  t.indptr.push_back(0);
  int next = 0;
  for (int n : pages) {
    for (int j = 0; j < n; ++j) t.indices.push_back(ids[next++]);
    t.indptr.push_back(int32_t(t.indices.size()));
  }
  return t;
}

struct AppendRun {
  std::vector<uint16_t> k_pool, v_pool;
  uint32_t status = 0;
};

AppendRun run_append(const KvCase& c, const PagedTable& t, const std::vector<int32_t>& row_seq,
                     const std::vector<int32_t>& row_pos, const std::vector<float>& k, const std::vector<float>& v) {
  const int T = int(row_pos.size());
  const int width = c.n_head_kv * c.head_dim, stride = width + c.stride_pad;
  const size_t pool = size_t(t.n_pages_pool) * c.n_head_kv * 16 * c.head_dim;
  Dev<float> dk(k), dv(v);
  Dev<int32_t> dseq(std::max<size_t>(1, row_seq.size())), dpos(row_pos), dptr(t.indptr), dind(t.indices);
  if (!row_seq.empty()) dseq.up(row_seq);
  Dev<uint16_t> kp(pool), vp(pool);
  kp.fill_bytes(0xab);
  vp.fill_bytes(0xab);
  Dev<uint32_t> st(1);
  st.fill_bytes(0);
  lc::AppendKvParams p;
  p.k = dk.p, p.v = dv.p, p.k_stride = c.stride_pad ? stride : 0, p.v_stride = c.stride_pad ? stride : 0;
  p.n_rows = T, p.n_head_kv = c.n_head_kv, p.head_dim = c.head_dim;
  p.row_seq = row_seq.empty() ? nullptr : dseq.p, p.row_pos = dpos.p;
  p.batch = int(t.indptr.size()) - 1, p.indptr = dptr.p, p.indices = dind.p, p.n_pages_pool = t.n_pages_pool;
  p.k_pool = kp.p, p.v_pool = vp.p, p.dtype = c.dtype, p.status = st.p;
  ck(lc::append_kv(p, nullptr), "append_kv");
  dev_sync();
  return {kp.down(), vp.down(), read_status(st)};
}

// The pools as the rows should leave them: rows whose (sequence, position, page id) is valid written.
void expect_pools(const KvCase& c, const PagedTable& t, const std::vector<int32_t>& row_seq,
                  const std::vector<int32_t>& row_pos, const std::vector<float>& k, const std::vector<float>& v,
                  const AppendRun& got, const char* what) {
  const int width = c.n_head_kv * c.head_dim, stride = width + c.stride_pad;
  const size_t pool = size_t(t.n_pages_pool) * c.n_head_kv * 16 * c.head_dim;
  std::vector<uint16_t> wk(pool, 0xabab), wv(pool, 0xabab);
  const int batch = int(t.indptr.size()) - 1;
  for (size_t r = 0; r < row_pos.size(); ++r) {
    const int s = row_seq.empty() ? 0 : row_seq[r], pos = row_pos[r];
    if (s < 0 || s >= batch || pos < 0 || pos / 16 >= t.indptr[s + 1] - t.indptr[s]) continue;
    const int page = t.indices[t.indptr[s] + pos / 16];
    if (page < 0 || page >= t.n_pages_pool) continue;
    for (int h = 0; h < c.n_head_kv; ++h)
      for (int x = 0; x < c.head_dim; ++x) {
        const size_t dst = ((size_t(page) * c.n_head_kv + h) * 16 + pos % 16) * c.head_dim + x;
        const float kx = k[r * stride + h * c.head_dim + x], vx = v[r * stride + h * c.head_dim + x];
        wk[dst] = c.dtype == lc::KvType::kF16 ? to_f16(kx) : to_bf16(kx);
        wv[dst] = c.dtype == lc::KvType::kF16 ? to_f16(vx) : to_bf16(vx);
      }
  }
  auto is_nan = [&](uint16_t b) {
    return c.dtype == lc::KvType::kF16 ? (b & 0x7c00u) == 0x7c00u && (b & 0x3ffu)
                                       : (b & 0x7f80u) == 0x7f80u && (b & 0x7fu);
  };
  for (size_t i = 0; i < pool; ++i) {
    if (is_nan(wk[i])) {
      ASSERT_TRUE(is_nan(got.k_pool[i])) << what << " K element " << i;
    } else {
      ASSERT_EQ(got.k_pool[i], wk[i]) << what << " K element " << i << " (head_dim " << c.head_dim << ")";
    }
    if (is_nan(wv[i])) {
      ASSERT_TRUE(is_nan(got.v_pool[i])) << what << " V element " << i;
    } else {
      ASSERT_EQ(got.v_pool[i], wv[i]) << what << " V element " << i << " (head_dim " << c.head_dim << ")";
    }
  }
}

TEST(CudaModelOps, AppendKvPrefillAndDecode) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(6);
  std::normal_distribution<float> N(0.0f, 1.0f);
  const KvCase cases[] = {
      {2, 8, lc::KvType::kF16, 0},    {2, 8, lc::KvType::kBF16, 0},   {4, 64, lc::KvType::kF16, 0},
      {2, 128, lc::KvType::kBF16, 0}, {2, 128, lc::KvType::kF16, 12}, {3, 6, lc::KvType::kF16, 0},
      {3, 6, lc::KvType::kBF16, 2},   {1, 256, lc::KvType::kBF16, 1},
  };
  for (const KvCase& c : cases) {
    const int stride = c.n_head_kv * c.head_dim + c.stride_pad;
    auto values = [&](int T) {
      std::vector<float> a(size_t(T) * stride);
      for (auto& x : a) x = N(rng) * 4.0f;
      a[0] = 1.0f + 1.0f / 2048.0f;      // a tie in f16 (rounds to even: 1.0)
      if (a.size() > 1) a[1] = 3.0e-7f;  // an f16 subnormal
      return a;
    };
    {  // prefill: one sequence, 37 tokens from position 5 (a partial first and last page), row_seq null
      const PagedTable t = make_table({3}, 9, rng);
      std::vector<int32_t> pos(37);
      std::iota(pos.begin(), pos.end(), 5);
      const auto k = values(37), v = values(37);
      const AppendRun g = run_append(c, t, {}, pos, k, v);
      expect_pools(c, t, {}, pos, k, v, g, "prefill");
      EXPECT_EQ(g.status, 0u);
    }
    for (int T : {1, 3}) {  // decode: one token per sequence, sequences of 1, 2 and 4 pages
      const PagedTable t = make_table({1, 2, 4}, 12, rng);
      const std::vector<int32_t> seq = T == 1 ? std::vector<int32_t>{2} : std::vector<int32_t>{0, 2, 1};
      const std::vector<int32_t> pos = T == 1 ? std::vector<int32_t>{63} : std::vector<int32_t>{0, 50, 31};
      const auto k = values(T), v = values(T);
      const AppendRun g = run_append(c, t, seq, pos, k, v);
      expect_pools(c, t, seq, pos, k, v, g, "decode");
      EXPECT_EQ(g.status, 0u);
    }
  }
}

TEST(CudaModelOps, AppendKvBadInput) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(7);
  std::normal_distribution<float> N(0.0f, 1.0f);
  for (lc::KvType dtype : {lc::KvType::kF16, lc::KvType::kBF16}) {
    const KvCase c{2, 64, dtype, 0};
    const int width = c.n_head_kv * c.head_dim;
    PagedTable t = make_table({2, 1, 3}, 8, rng);
    t.indices[t.indptr[2] + 1] = 8;   // sequence 2, page 1: an id outside the pool
    t.indices[t.indptr[2] + 2] = -3;  // sequence 2, page 2: negative
    {  // slots outside the table: not written, kStatusKvSlotOutOfRange; the good rows are
      const std::vector<int32_t> seq = {0, -1, 3, 1, 1, 0, 2, 0};
      const std::vector<int32_t> pos = {17, 0, 0, -1, 16, 32, 5, std::numeric_limits<int32_t>::max()};
      std::vector<float> k(seq.size() * width), v(seq.size() * width);
      for (auto& x : k) x = N(rng);
      for (auto& x : v) x = N(rng);
      const AppendRun g = run_append(c, t, seq, pos, k, v);
      expect_pools(c, t, seq, pos, k, v, g, "slots");
      EXPECT_EQ(g.status, uint32_t(lc::kStatusKvSlotOutOfRange));
    }
    {  // page ids outside the pool
      const std::vector<int32_t> seq = {2, 2, 2};
      const std::vector<int32_t> pos = {3, 20, 40};
      std::vector<float> k(seq.size() * width), v(seq.size() * width);
      for (auto& x : k) x = N(rng);
      for (auto& x : v) x = N(rng);
      const AppendRun g = run_append(c, t, seq, pos, k, v);
      expect_pools(c, t, seq, pos, k, v, g, "page ids");
      EXPECT_EQ(g.status, uint32_t(lc::kStatusKvPageIdOutOfRange));
    }
    {  // indptr descending for sequence 1: its page count is negative
      PagedTable bad = t;
      bad.indptr = {0, 2, 1, 6};
      bad.indices.resize(6);
      const std::vector<int32_t> seq = {1};
      const std::vector<int32_t> pos = {0};
      std::vector<float> k(width, 1.0f), v(width, 2.0f);
      const AppendRun g = run_append(c, bad, seq, pos, k, v);
      for (uint16_t b : g.k_pool) ASSERT_EQ(b, 0xabab);
      EXPECT_EQ(g.status, uint32_t(lc::kStatusKvSlotOutOfRange));
    }
    {  // non-finite values: written as converted, kStatusKvNotFinite
      for (float bad_value : {kNaN, -kInf, 70000.0f, 3.4e38f}) {
        const std::vector<int32_t> seq = {0, 1};
        const std::vector<int32_t> pos = {1, 2};
        std::vector<float> k(seq.size() * width), v(seq.size() * width);
        for (auto& x : k) x = N(rng);
        for (auto& x : v) x = N(rng);
        v[width + 7] = bad_value;
        const AppendRun g = run_append(c, t, seq, pos, k, v);
        expect_pools(c, t, seq, pos, k, v, g, "non-finite");
        // 70000 is beyond the f16 range only; 3.4e38 rounds to inf in both.
        const bool flagged = !(bad_value == 70000.0f && dtype == lc::KvType::kBF16);
        EXPECT_EQ(g.status, flagged ? uint32_t(lc::kStatusKvNotFinite) : 0u) << "value " << bad_value;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// SwiGLU: within one bf16 rounding of the float64 reference (+1e-6 relative for the float32 math
// before the rounding, and 1e-35 absolute where the float32 exp overflows and the result is -0).

TEST(CudaModelOps, SwigluRows) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(8);
  std::normal_distribution<float> N(0.0f, 1.0f);
  for (int n_ff : {8, 64, 4097, 28672}) {
    for (int T : {1, 3, 17}) {
      for (bool fused : {false, true}) {  // fused: [T][gate | up] as one GEMM output
        const int stride = fused ? 2 * n_ff : n_ff;
        std::vector<float> g(size_t(T) * stride), u(fused ? 0 : size_t(T) * n_ff);
        for (auto& x : g) x = N(rng) * 4.0f;
        for (auto& x : u) x = N(rng);
        const float extremes[] = {0.0f, -0.0f, 80.0f, -80.0f, 100.0f, -100.0f, 1e-30f, -20.0f};
        for (int i = 0; i < 8 && i < n_ff; ++i) g[i] = extremes[i];
        Dev<float> dg(g), du(std::max<size_t>(1, u.size()));
        if (!u.empty()) du.up(u);
        Dev<uint16_t> dout(size_t(T) * n_ff);
        lc::SwigluParams p;
        p.gate = dg.p, p.up = fused ? dg.p + n_ff : du.p;
        p.gate_stride = fused ? stride : 0, p.up_stride = fused ? stride : 0;
        p.n_rows = T, p.n_ff = n_ff, p.out = dout.p;
        ck(lc::swiglu_rows(p, nullptr), "swiglu_rows");
        dev_sync();
        const auto out = dout.down();
        for (int r = 0; r < T; ++r)
          for (int i = 0; i < n_ff; ++i) {
            const double gv = g[size_t(r) * stride + i];
            const double uv = fused ? g[size_t(r) * stride + n_ff + i] : u[size_t(r) * n_ff + i];
            const double ref = gv / (1.0 + std::exp(-gv)) * uv;
            const double got = from_bf16(out[size_t(r) * n_ff + i]);
            ASSERT_LE(std::abs(got - ref), half_ulp_bf16(ref) + 1e-6 * std::abs(ref) + 1e-35)
                << "n_ff " << n_ff << " row " << r << " i " << i << " gate " << gv << " up " << uv;
          }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The bf16 cast: bit-exact round-to-nearest-even, specials included.

TEST(CudaModelOps, F32ToBf16Exact) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(9);
  for (size_t n : {size_t(1), size_t(3), size_t(17), size_t(4097), size_t(1000003)}) {
    std::vector<float> x(n + 1);
    for (auto& v : x) v = bits_f32(uint32_t(rng()));  // every bit pattern, NaNs and denormals included
    const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x3f808000u,
                                 0x3f818000u, 0x7f7fffffu, 0x00000001u, 0x807fffffu, 0x3f80ffffu, 0x4b7fff80u};
    for (size_t i = 0; i < std::size(specials) && i < x.size(); ++i) x[i] = bits_f32(specials[i]);
    for (bool offset : {false, true}) {  // offset: unaligned input (the scalar path)
      Dev<float> din(x);
      Dev<uint16_t> dout(n + 1);
      ck(lc::f32_to_bf16(din.p + (offset ? 1 : 0), dout.p, n, nullptr), "f32_to_bf16");
      dev_sync();
      const auto out = dout.down();
      for (size_t i = 0; i < n; ++i) {
        const float v = x[i + (offset ? 1 : 0)];
        if (std::isnan(v)) {
          ASSERT_TRUE(std::isnan(from_bf16(out[i]))) << "n " << n << " i " << i;
        } else {
          ASSERT_EQ(out[i], to_bf16(v)) << "n " << n << " i " << i << " bits " << std::hex << f32_bits(v);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// argmax: exact against the CPU's loop (strictly greater wins: ties to the lower index).

int32_t cpu_argmax(const float* l, int n) {
  int32_t best = 0;
  for (int i = 1; i < n; ++i)
    if (l[i] > l[best]) best = i;
  return best;
}

TEST(CudaModelOps, ArgmaxRows) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(10);
  std::normal_distribution<float> N(0.0f, 3.0f);
  for (int V : {1, 7, 4097, 128256, 160000}) {
    for (int T : {1, 3, 17}) {
      for (int pad : {0, 4}) {
        const int stride = V + pad;
        std::vector<float> l(size_t(T) * stride, kNaN);  // padding NaN: never read
        for (int r = 0; r < T; ++r) {
          float* row = &l[size_t(r) * stride];
          for (int i = 0; i < V; ++i) row[i] = N(rng);
          if (V > 1) {
            switch (r % 5) {
              case 1: {  // a tie for the max: the lower index wins
                const int a = int(rng() % V), b = int(rng() % V);
                row[a] = row[b] = 100.0f;
                break;
              }
              case 2:  // two +inf
                row[V - 1] = kInf;
                row[V / 2] = kInf;
                break;
              case 3:  // every logit -inf: index 0
                std::fill(row, row + V, -kInf);
                break;
              case 4:  // the max at the last index
                row[V - 1] = 1000.0f;
                break;
              default:
                break;
            }
          }
        }
        Dev<float> dl(l);
        Dev<int32_t> ids(T);
        Dev<uint32_t> st(1);
        st.fill_bytes(0);
        lc::ArgmaxParams p;
        p.logits = dl.p, p.n_rows = T, p.n_vocab = V, p.logits_stride = pad ? stride : 0, p.ids = ids.p,
        p.status = st.p;
        ck(lc::argmax_rows(p, nullptr), "argmax_rows");
        dev_sync();
        const auto got = ids.down();
        for (int r = 0; r < T; ++r)
          ASSERT_EQ(got[r], cpu_argmax(&l[size_t(r) * stride], V)) << "V " << V << " row " << r;
        EXPECT_EQ(read_status(st), 0u);
      }
    }
  }
}

TEST(CudaModelOps, ArgmaxNaN) {
  SKIP_WITHOUT_CUDA();
  const int V = 4097, T = 3;
  std::vector<float> l(size_t(T) * V);
  for (size_t i = 0; i < l.size(); ++i) l[i] = float(i % 1000) * 0.01f;
  l[size_t(1) * V + 4096] = kNaN;  // row 1: a NaN in the last (scalar tail) position
  l[size_t(2) * V + 0] = kNaN;     // row 2: a NaN first
  Dev<float> dl(l);
  Dev<int32_t> ids(T);
  Dev<uint32_t> st(1);
  st.fill_bytes(0);
  lc::ArgmaxParams p;
  p.logits = dl.p, p.n_rows = T, p.n_vocab = V, p.ids = ids.p, p.status = st.p;
  ck(lc::argmax_rows(p, nullptr), "argmax_rows");
  dev_sync();
  const auto got = ids.down();
  EXPECT_EQ(got[0], cpu_argmax(&l[0], V));
  EXPECT_EQ(got[1], -1);
  EXPECT_EQ(got[2], -1);
  EXPECT_EQ(read_status(st), uint32_t(lc::kStatusNanLogits));
}

// ------------------------------------------------------------------------------------------------
// Sampling.

// The nucleus of Sampler::sample in float64 (tokens sorted by logit; the tie group at the boundary
// kept whole, as sample_rows documents) and each kept token's probability renormalised over it.
struct Nucleus {
  std::vector<double> prob;  // [V], 0 outside the nucleus
  int size = 0;
  std::vector<double> cum;  // cumulative mass of the sorted tokens (for choosing top_p between steps)
};
Nucleus reference_nucleus(const float* l, int V, double T, double top_p) {
  const float mx = *std::max_element(l, l + V);
  std::vector<double> p(V);
  double z = 0.0;
  for (int i = 0; i < V; ++i) z += p[i] = std::exp(double(l[i] - mx) / T);
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
  Nucleus nu;
  nu.prob.assign(V, 0.0);
  double cum = 0.0;
  int keep = 0;
  for (; keep < V;) {
    cum += p[order[keep++]] / z;
    nu.cum.push_back(cum);
    if (cum >= top_p) break;
  }
  while (keep < V && l[order[keep]] == l[order[keep - 1]]) ++keep;  // the boundary's tie group
  double kept = 0.0;
  for (int j = 0; j < keep; ++j) kept += p[order[j]];
  for (int j = 0; j < keep; ++j) nu.prob[order[j]] = p[order[j]] / kept;
  nu.size = keep;
  return nu;
}
// top_p halfway between the cumulative masses of the k and k + 1 most probable tokens: a nucleus of
// exactly k + 1 tokens, 1/2 a step away from either boundary (float32 masses move it ~1e-7).
double top_p_for(const float* l, int V, double T, int k) {
  const Nucleus all = reference_nucleus(l, V, T, 1.0);
  const double below = k > 0 ? all.cum[k - 1] : 0.0;
  return 0.5 * (below + all.cum[k]);
}

struct SampleRun {
  std::vector<int32_t> ids;
  std::vector<uint64_t> counters;
  uint32_t status = 0;
};

// `rows` copies of the logits row l (or the rows of l when it holds rows * V values), one launch.
SampleRun run_sample(const std::vector<float>& l, int V, int rows, float T, float top_p, uint64_t seed,
                     std::vector<uint64_t> counters = {}, const std::vector<float>& temps = {},
                     const std::vector<float>& top_ps = {}) {
  std::vector<float> all;
  if (l.size() == size_t(V)) {
    all.resize(size_t(rows) * V);
    for (int r = 0; r < rows; ++r) std::copy(l.begin(), l.end(), all.begin() + size_t(r) * V);
  } else {
    all = l;
  }
  if (counters.empty()) counters.assign(rows, 0);
  Dev<float> dl(all);
  Dev<uint64_t> dc(counters);
  Dev<int32_t> ids(rows);
  Dev<float> dt(std::max<size_t>(1, temps.size())), dp(std::max<size_t>(1, top_ps.size()));
  if (!temps.empty()) dt.up(temps);
  if (!top_ps.empty()) dp.up(top_ps);
  Dev<uint32_t> st(1);
  st.fill_bytes(0);
  lc::SampleParams p;
  p.logits = dl.p, p.n_rows = rows, p.n_vocab = V, p.temperature = T, p.top_p = top_p, p.seed = seed;
  p.temperatures = temps.empty() ? nullptr : dt.p, p.top_ps = top_ps.empty() ? nullptr : dp.p;
  p.counters = dc.p, p.ids = ids.p, p.status = st.p;
  ck(lc::sample_rows(p, nullptr), "sample_rows");
  dev_sync();
  return {ids.down(), dc.down(), read_status(st)};
}

// Every draw inside the nucleus; each kept token's count within 5 sigma (+1 for the integer count) of
// N p_i, sigma = sqrt(N p_i (1 - p_i)).
void expect_distribution(const std::vector<int32_t>& ids, const Nucleus& nu, const std::string& what) {
  const int V = int(nu.prob.size());
  const double n = double(ids.size());
  std::vector<int> count(V, 0);
  for (int32_t id : ids) {
    ASSERT_GE(id, 0) << what;
    ASSERT_LT(id, V) << what;
    ASSERT_GT(nu.prob[id], 0.0) << what << ": token " << id << " is outside the nucleus";
    ++count[id];
  }
  for (int i = 0; i < V; ++i) {
    if (nu.prob[i] == 0.0) continue;
    const double mean = n * nu.prob[i], sigma = std::sqrt(n * nu.prob[i] * (1.0 - nu.prob[i]));
    EXPECT_LE(std::abs(count[i] - mean), 5.0 * sigma + 1.0)
        << what << ": token " << i << " drawn " << count[i] << " times, expected " << mean << " (p " << nu.prob[i]
        << ")";
  }
}

TEST(CudaModelOps, SampleRowsDistribution) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(11);
  std::normal_distribution<float> N(0.0f, 1.5f);
  const int kDraws = 20000;
  for (int V : {51, 64}) {  // 51: the scalar path; 64: float4 loads
    std::vector<float> l(V);
    for (auto& x : l) x = N(rng);
    for (float T : {0.7f, 1.0f, 1.6f}) {
      for (int k : {0, 1, 4, 11, V / 2}) {  // nuclei of 1, 2, 5, 12 and V/2 + 1 tokens
        const double top_p = top_p_for(l.data(), V, T, k);
        const Nucleus nu = reference_nucleus(l.data(), V, T, top_p);
        ASSERT_EQ(nu.size, k + 1);
        const SampleRun g = run_sample(l, V, kDraws, T, float(top_p), 1234 + k);
        expect_distribution(g.ids, nu,
                            "V " + std::to_string(V) + " T " + std::to_string(T) + " nucleus " + std::to_string(k + 1));
        EXPECT_EQ(g.status, 0u);
        for (uint64_t c : g.counters) ASSERT_EQ(c, 1u);
      }
      // top_p = 1: the whole softmax.
      const SampleRun g = run_sample(l, V, kDraws, T, 1.0f, 99);
      expect_distribution(g.ids, reference_nucleus(l.data(), V, T, 1.0), "top_p 1, V " + std::to_string(V));
    }
  }
}

TEST(CudaModelOps, SampleRowsEdgeCases) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(12);
  std::normal_distribution<float> N(0.0f, 2.0f);
  const int V = 1000, rows = 4000;
  std::vector<float> l(V);
  for (auto& x : l) x = N(rng);
  const int32_t top = cpu_argmax(l.data(), V);
  {  // tiny top_p and temperature 0: always the argmax
    for (const auto& g : {run_sample(l, V, rows, 1.0f, 1e-9f, 5), run_sample(l, V, rows, 0.0f, 0.5f, 5)})
      for (int32_t id : g.ids) ASSERT_EQ(id, top);
  }
  {  // same seed and steps: the same tokens; the next step: new draws
    std::vector<uint64_t> steps(rows);
    for (int r = 0; r < rows; ++r) steps[r] = uint64_t(r) * 7919u + (uint64_t(1) << 40);
    const SampleRun a = run_sample(l, V, rows, 1.0f, 0.95f, 42, steps);
    const SampleRun b = run_sample(l, V, rows, 1.0f, 0.95f, 42, steps);
    EXPECT_EQ(a.ids, b.ids);
    for (int r = 0; r < rows; ++r) ASSERT_EQ(a.counters[r], steps[r] + 1);
    const SampleRun c = run_sample(l, V, rows, 1.0f, 0.95f, 42, a.counters);
    const SampleRun d = run_sample(l, V, rows, 1.0f, 0.95f, 43, steps);
    int same_c = 0, same_d = 0;
    for (int r = 0; r < rows; ++r) {
      same_c += a.ids[r] == c.ids[r];
      same_d += a.ids[r] == d.ids[r];
    }
    // Independent draws agree with probability sum p_i^2 (< 0.2 here); the same stream would agree always.
    EXPECT_LT(same_c, rows / 2);
    EXPECT_LT(same_d, rows / 2);
  }
  {  // equal logits at the boundary: the tie group is kept whole (3 tokens of ~1/3 each)
    std::vector<float> t(V, -30.0f);
    t[10] = t[500] = t[999] = 5.0f;
    t[20] = 4.0f;
    const Nucleus nu = reference_nucleus(t.data(), V, 1.0, 0.2);
    ASSERT_EQ(nu.size, 3);
    expect_distribution(run_sample(t, V, 20000, 1.0f, 0.2f, 7).ids, nu, "tie group");
  }
  {  // +inf logits share all the mass
    std::vector<float> t = l;
    t[3] = t[700] = kInf;
    const SampleRun g = run_sample(t, V, 20000, 0.8f, 0.9f, 8);
    Nucleus nu;
    nu.prob.assign(V, 0.0);
    nu.prob[3] = nu.prob[700] = 0.5;
    expect_distribution(g.ids, nu, "+inf");
    // temperature 0: the first +inf
    for (int32_t id : run_sample(t, V, 16, 0.0f, 1.0f, 8).ids) ASSERT_EQ(id, 3);
  }
  {  // bad rows: NaN, all -inf, a bad per-row temperature or top_p; the other rows unaffected
    const int R = 6;
    std::vector<float> t(size_t(R) * V);
    for (int r = 0; r < R; ++r) std::copy(l.begin(), l.end(), t.begin() + size_t(r) * V);
    t[size_t(1) * V + 999] = kNaN;
    std::fill(t.begin() + size_t(2) * V, t.begin() + size_t(3) * V, -kInf);
    const std::vector<float> temps = {0.0f, 1.0f, 1.0f, -1.0f, kNaN, 0.0f};
    const std::vector<float> top_ps = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 2.0f};
    const SampleRun g = run_sample(t, V, R, 1.0f, 1.0f, 9, {}, temps, top_ps);
    EXPECT_EQ(g.ids[0], top);
    EXPECT_EQ(g.ids[1], -1);
    EXPECT_EQ(g.ids[2], -1);
    EXPECT_EQ(g.ids[3], -1);
    EXPECT_EQ(g.ids[4], -1);
    EXPECT_EQ(g.ids[5], -1);
    EXPECT_EQ(g.status, uint32_t(lc::kStatusNanLogits | lc::kStatusNoMass | lc::kStatusBadSamplerParams));
    for (uint64_t c : g.counters) EXPECT_EQ(c, 1u);  // every row advances its step
  }
  {  // per-row temperature and top_p: greedy rows and sampled rows in one launch
    const int R = 64;
    std::vector<float> temps(R), top_ps(R);
    for (int r = 0; r < R; ++r) {
      temps[r] = r % 2 ? 0.0f : 1.0f;
      top_ps[r] = r % 4 == 0 ? 1e-9f : 1.0f;
    }
    const SampleRun g = run_sample(l, V, R, 1.0f, 1.0f, 10, {}, temps, top_ps);
    for (int r = 0; r < R; ++r)
      if (r % 2 || r % 4 == 0) {
        ASSERT_EQ(g.ids[r], top) << "row " << r;
      }
  }
}

// Most of the mass outside a tiny nucleus (a near-flat distribution): many rejection rounds, every
// draw still inside the nucleus.
TEST(CudaModelOps, SampleRowsFlatTinyNucleus) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(15);
  std::normal_distribution<float> N(0.0f, 1e-3f);
  const int V = 100000, R = 64;
  std::vector<float> l(V);
  for (auto& x : l) x = N(rng);
  const float top_p = float(top_p_for(l.data(), V, 1.0, 2));  // the 3 most probable of ~1e-5 each
  const Nucleus nu = reference_nucleus(l.data(), V, 1.0, top_p);
  ASSERT_EQ(nu.size, 3);
  std::vector<uint64_t> steps(R, 0);
  std::vector<int> count(V, 0);
  for (int step = 0; step < 8; ++step) {
    const SampleRun g = run_sample(l, V, R, 1.0f, top_p, 21, steps);
    for (int32_t id : g.ids) {
      ASSERT_GE(id, 0);
      ASSERT_GT(nu.prob[id], 0.0) << "token " << id << " outside the nucleus";
      ++count[id];
    }
    steps = g.counters;
  }
  for (int i = 0; i < V; ++i) {  // 512 draws over 3 tokens of ~1/3 each: each far from 0
    if (nu.prob[i] > 0.0) {
      EXPECT_GT(count[i], 100) << "token " << i;
    }
  }
}

// Real-sized vocabularies: every draw inside the float64 nucleus, over many steps.
TEST(CudaModelOps, SampleRowsLargeVocabulary) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(13);
  for (int V : {128256, 151937, 160000}) {
    const int R = 8;
    std::vector<float> l(size_t(R) * V);
    std::vector<Nucleus> nu(R);
    std::vector<float> tp(R);
    std::normal_distribution<float> N(0.0f, 1.0f);
    for (int r = 0; r < R; ++r) {
      float* row = &l[size_t(r) * V];
      const float spread = 1.0f + 2.0f * float(r);  // flat to peaked
      for (int i = 0; i < V; ++i) row[i] = N(rng) * spread;
      const int k = r % 2 ? int(rng() % 50) : int(rng() % 5000);
      tp[r] = float(top_p_for(row, V, 1.0, k));
      nu[r] = reference_nucleus(row, V, 1.0, tp[r]);
    }
    std::vector<uint64_t> steps(R, 0);
    for (int step = 0; step < 40; ++step) {
      const SampleRun g = run_sample(l, V, R, 1.0f, 1.0f, 77, steps, {}, tp);
      for (int r = 0; r < R; ++r) {
        ASSERT_GE(g.ids[r], 0);
        ASSERT_LT(g.ids[r], V);
        ASSERT_GT(nu[r].prob[g.ids[r]], 0.0) << "V " << V << " row " << r << " step " << step << ": token " << g.ids[r]
                                             << " outside the nucleus of " << nu[r].size;
      }
      steps = g.counters;
    }
  }
}

// One captured graph replays with new device-side tokens, positions and steps each time, as direct
// launches do.
TEST(CudaModelOps, GraphReplay) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(14);
  std::normal_distribution<float> N(0.0f, 1.0f);
  const int V = 300, E = 64, T = 3, HD = 16;  // the embedded rows double as logits [T][E]... of E tokens
  std::vector<uint16_t> table(size_t(V) * E);
  for (auto& b : table) b = to_bf16(N(rng));
  std::vector<float> w(E);
  for (auto& x : w) x = 1.0f + 0.1f * N(rng);
  const auto inv = inv_freqs(HD, 10000.0, false);
  Dev<uint16_t> dt(table);
  Dev<float> dw(w), dx(size_t(T) * E), dn(size_t(T) * E);
  Dev<double> dinv(inv);
  Dev<int32_t> dtok(T), dpos(T), ids_g(T), ids_s(T);
  Dev<uint64_t> steps(T);
  Dev<uint32_t> st(1);
  st.fill_bytes(0);
  steps.fill_bytes(0);
  auto enqueue = [&](cudaStream_t s) {
    lc::EmbedParams e;
    e.tokens = dtok.p, e.table = dt.p, e.n_vocab = V, e.n_embd = E, e.n_rows = T, e.x = dx.p, e.status = st.p;
    ck(lc::embed_rows(e, s), "embed_rows");
    lc::RopeParams r;
    r.q = dx.p, r.n_head_q = E / HD, r.n_rows = T, r.head_dim = HD, r.n_rot = HD, r.positions = dpos.p,
    r.inv_freq = dinv.p;
    ck(lc::rope_rows(r, s), "rope_rows");
    lc::RmsNormParams n;
    n.x = dx.p, n.weight = dw.p, n.n_rows = T, n.n = E, n.out = dn.p, n.out_f32 = true;
    ck(lc::rmsnorm_rows(n, s), "rmsnorm_rows");
    lc::ArgmaxParams a;
    a.logits = dn.p, a.n_rows = T, a.n_vocab = E, a.ids = ids_g.p, a.status = st.p;
    ck(lc::argmax_rows(a, s), "argmax_rows");
    lc::SampleParams sp;
    sp.logits = dn.p, sp.n_rows = T, sp.n_vocab = E, sp.temperature = 0.5f, sp.top_p = 0.9f, sp.seed = 5;
    sp.counters = steps.p, sp.ids = ids_s.p, sp.status = st.p;
    ck(lc::sample_rows(sp, s), "sample_rows");
  };
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ck(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  enqueue(stream);
  ck(cudaStreamEndCapture(stream, &graph), "end capture");
  ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  std::vector<std::vector<int32_t>> replay_g, replay_s, replay_x;
  const int kSteps = 4;
  auto set_inputs = [&](int step) {
    std::vector<int32_t> tok(T), pos(T);
    for (int r = 0; r < T; ++r) {
      tok[r] = int32_t((step * 31 + r * 7) % V);
      pos[r] = step * 1000003 + r;
    }
    dtok.up(tok);
    dpos.up(pos);
    dev_sync();  // a pageable copy may still be in flight when cudaMemcpy returns; the stream is non-blocking
  };
  for (int step = 0; step < kSteps; ++step) {
    set_inputs(step);
    ck(cudaGraphLaunch(exec, stream), "graph launch");
    ck(cudaStreamSynchronize(stream), "graph sync");
    replay_g.push_back(ids_g.down());
    replay_s.push_back(ids_s.down());
  }
  const auto replay_steps = steps.down();
  steps.fill_bytes(0);
  for (int step = 0; step < kSteps; ++step) {
    set_inputs(step);
    enqueue(stream);
    ck(cudaStreamSynchronize(stream), "direct sync");
    EXPECT_EQ(ids_g.down(), replay_g[step]) << "step " << step;
    EXPECT_EQ(ids_s.down(), replay_s[step]) << "step " << step;
  }
  for (uint64_t c : replay_steps) EXPECT_EQ(c, uint64_t(kSteps));
  for (uint64_t c : steps.down()) EXPECT_EQ(c, uint64_t(kSteps));
  EXPECT_EQ(read_status(st), 0u);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace

#else  // !LOCKS_WITH_CUDA

TEST(CudaModelOps, NotBuiltWithCuda) {
  GTEST_SKIP() << "built without CUDA (no CUDA compiler found at configure time)";
}

#endif
