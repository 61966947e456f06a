// Causal attention over the paged KV cache on the GPU (src/cuda/causal_attention.h) against a
// float64 softmax attention on the dequantized pool, both paths (tensor cores for prefill chunks,
// generic CUDA cores for any rows), against each other, and against the engine's CPU twin
// paged_prefill_attention. Pools are random with scrambled page tables (ids not in order), unused
// pages and the rows past each sequence's length poisoned (K NaN, V inf) so that any stray read
// shows. Every device test skips when no usable CUDA device is present.
//
// Tolerances, as max |gpu - reference| over all outputs, relative to max |v| of the pool:
//  - generic path: 1e-4. Float32 logits and sums against float64 (~1e-6 seen in the analysis: the
//    logits carry float32's 24 bits, exp2f is within 2 ulp); the margin covers long sums.
//  - tensor-core path: 2u + 1e-5 with u the unit roundoff of the KV type (bf16 2^-8, f16 2^-11):
//    q enters the MMA as hi + lo parts (logit error ~2^-16 relative for bf16), so the rounding of
//    the probabilities P to the KV type for the P V product dominates. With O = sum_k p_k (1 + d_k)
//    v_k / sum_k p_k and |d_k| <= u, |O - O_exact| <= u max|v|; 2u leaves room for the logit
//    error and float32 accumulation.
#include <gtest/gtest.h>

#ifdef LOCKS_WITH_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/causal_attention.h"
#include "cuda/cuda_fixture.h"
#include "locks/attention.h"
#include "locks/cuda/kernels.h"
#include "locks/kv_cache.h"
#include "locks/quant.h"

namespace lc = locks::cuda;

namespace {

using locks::test::bf16_bits;
using locks::test::ck;
using locks::test::Dev;
using locks::test::round_bf16;

double unit_roundoff(lc::KvType t) { return t == lc::KvType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11); }
// See the top of the file.
double tc_tolerance(lc::KvType t) { return 2.0 * unit_roundoff(t) + 1e-5; }
constexpr double kGenericTolerance = 1e-4;

/// A layer's KV pool on host and device with a CSR page table.
/// Scrambled (default): every sequence gets its own pages, ids a random permutation of the pool,
/// unused pages and the rows past each sequence's length poisoned. Shared (pool_pages > 0): page
/// ids drawn at random from a small pool, repeats allowed (long sequences at little memory).
struct Pool {
  int H = 1, D = 64;
  lc::KvType dtype = lc::KvType::kF16;
  int n_pages_pool = 0;
  std::vector<int> lengths;
  std::vector<std::vector<int32_t>> tables;
  std::vector<uint16_t> kbits, vbits;  // [pool][H][16][D]
  std::vector<float> kf, vf;           // dequantized (poison included)
  std::vector<int32_t> indptr, indices, last_len;
  double max_abs_v = 0.0;
  Dev<uint16_t> dk, dv;
  Dev<int32_t> d_indptr, d_indices, d_last;

  Pool(int H_, int D_, lc::KvType t, std::vector<int> lens, uint32_t seed, int pool_pages = 0)
      : H(H_), D(D_), dtype(t), lengths(std::move(lens)) {
    std::mt19937 rng{seed};
    int total = 0;
    for (int L : lengths) total += (L + 15) / 16;
    const bool shared = pool_pages > 0;
    n_pages_pool = shared ? pool_pages : total + 3;
    std::vector<int32_t> perm(n_pages_pool);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    int next = 0;
    for (int L : lengths) {
      std::vector<int32_t> tab((L + 15) / 16);
      for (auto& id : tab) id = shared ? int32_t(rng() % uint32_t(n_pages_pool)) : perm[next++];
      tables.push_back(std::move(tab));
    }
    const size_t elems = size_t(n_pages_pool) * H * 16 * D;
    kbits.resize(elems);
    vbits.resize(elems);
    kf.resize(elems);
    vf.resize(elems);
    std::normal_distribution<float> N(0.0f, 1.0f);
    for (size_t i = 0; i < elems; ++i) {
      set(kbits, kf, i, N(rng));
      set(vbits, vf, i, N(rng));
      max_abs_v = std::max(max_abs_v, double(std::fabs(vf[i])));
    }
    if (!shared) {  // poison what no row may read: unused pages, rows past each sequence's length
      std::vector<char> used(n_pages_pool, 0);
      for (const auto& tab : tables)
        for (int32_t id : tab) used[id] = 1;
      for (int pg = 0; pg < n_pages_pool; ++pg)
        if (!used[pg]) poison(pg, 0);
      for (size_t b = 0; b < lengths.size(); ++b)
        if (lengths[b] % 16) poison(tables[b].back(), lengths[b] % 16);
    }
    indptr = {0};
    for (size_t b = 0; b < tables.size(); ++b) {
      indices.insert(indices.end(), tables[b].begin(), tables[b].end());
      indptr.push_back(int32_t(indices.size()));
      last_len.push_back(lengths[b] > 0 ? lengths[b] - 16 * (int(tables[b].size()) - 1) : 16);
    }
    upload();
  }

  void set(std::vector<uint16_t>& bits, std::vector<float>& f, size_t i, float x) {
    if (dtype == lc::KvType::kBF16) {
      f[i] = round_bf16(x);
      bits[i] = bf16_bits(f[i]);
    } else {
      bits[i] = locks::f32_to_f16(x);
      f[i] = locks::f16_to_f32(bits[i]);
    }
  }
  // K NaN, V +inf in rows [row0, 16) of page pg, every head.
  void poison(int pg, int row0) {
    const uint16_t nan_bits = dtype == lc::KvType::kF16 ? 0x7e00 : 0x7fc0;
    const uint16_t inf_bits = dtype == lc::KvType::kF16 ? 0x7c00 : 0x7f80;
    for (int h = 0; h < H; ++h)
      for (int row = row0; row < 16; ++row)
        for (int x = 0; x < D; ++x) {
          const size_t i = ((size_t(pg) * H + h) * 16 + row) * D + x;
          kbits[i] = nan_bits;
          vbits[i] = inf_bits;
          kf[i] = NAN;
          vf[i] = INFINITY;
        }
  }
  void upload() {
    dk = Dev<uint16_t>(kbits);
    dv = Dev<uint16_t>(vbits);
    d_indptr = Dev<int32_t>(indptr);
    d_indices = Dev<int32_t>(indices.empty() ? std::vector<int32_t>{0} : indices);
    d_last = Dev<int32_t>(last_len);
  }
  lc::PagedKvView view() const {
    lc::PagedKvView v;
    v.k = dk.p;
    v.v = dv.p;
    v.dtype = dtype;
    v.n_head_kv = H;
    v.head_dim = D;
    v.batch = int(lengths.size());
    v.indptr = d_indptr.p;
    v.indices = d_indices.p;
    v.last_page_len = d_last.p;
    v.n_pages_pool = n_pages_pool;
    return v;
  }
  const float* key(int s, int pos, int h) const {
    return &kf[((size_t(tables[s][pos / 16]) * H + h) * 16 + pos % 16) * D];
  }
  const float* value(int s, int pos, int h) const {
    return &vf[((size_t(tables[s][pos / 16]) * H + h) * 16 + pos % 16) * D];
  }
};

/// The rows of a call: (sequence, position) each.
struct Rows {
  std::vector<int32_t> seq, pos;
  int n() const { return int(pos.size()); }
  static Rows chunk(int s, int pos0, int n) {
    Rows r;
    for (int i = 0; i < n; ++i) {
      r.seq.push_back(s);
      r.pos.push_back(pos0 + i);
    }
    return r;
  }
};

/// Queries [rows][H * G][D]: half of the heads aligned with a random earlier key (a peaked softmax,
/// ~8 nats above the rest), half random (logits of std ~2 nats at scale 1/sqrt(D)).
std::vector<float> make_queries(const Pool& P, int G, const Rows& rows, uint32_t seed) {
  std::mt19937 rng{seed};
  std::normal_distribution<float> N(0.0f, 1.0f);
  const int D = P.D, nh = P.H * G;
  std::vector<float> q(size_t(rows.n()) * nh * D);
  const float align = 8.0f / std::sqrt(float(D));
  for (int r = 0; r < rows.n(); ++r)
    for (int n = 0; n < nh; ++n) {
      float* qq = &q[(size_t(r) * nh + n) * D];
      const int s = rows.seq[r], pos = rows.pos[r];
      const bool aligned = (n + r) % 2 == 0 && s >= 0 && s < int(P.lengths.size()) && pos >= 0 && pos < P.lengths[s];
      if (aligned) {
        const int j = int(rng() % uint32_t(pos + 1));
        const float* k = P.key(s, j, n / G);
        for (int x = 0; x < D; ++x) qq[x] = align * k[x] + 0.3f * N(rng);
      } else {
        for (int x = 0; x < D; ++x) qq[x] = 2.0f * N(rng);
      }
    }
  return q;
}

/// float64 causal softmax attention of every row over keys 0..pos of its sequence.
std::vector<double> reference(const Pool& P, int G, const std::vector<float>& q, float scale, const Rows& rows) {
  const int D = P.D, nh = P.H * G;
  std::vector<double> out(size_t(rows.n()) * nh * D, 0.0);
  std::vector<double> logit, acc(D);
  for (int r = 0; r < rows.n(); ++r) {
    const int s = rows.seq[r], pos = rows.pos[r];
    for (int n = 0; n < nh; ++n) {
      const int h = n / G;
      const float* qq = &q[(size_t(r) * nh + n) * D];
      logit.assign(size_t(pos) + 1, 0.0);
      double mx = -INFINITY;
      for (int j = 0; j <= pos; ++j) {
        const float* k = P.key(s, j, h);
        double dot = 0.0;
        for (int x = 0; x < D; ++x) dot += double(qq[x]) * double(k[x]);
        logit[j] = dot * scale;
        mx = std::max(mx, logit[j]);
      }
      double sum = 0.0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int j = 0; j <= pos; ++j) {
        const double w = std::exp(logit[j] - mx);
        sum += w;
        const float* v = P.value(s, j, h);
        for (int x = 0; x < D; ++x) acc[x] += w * double(v[x]);
      }
      double* dst = &out[(size_t(r) * nh + n) * D];
      for (int x = 0; x < D; ++x) dst[x] = acc[x] / sum;
    }
  }
  return out;
}

struct Call {
  int G = 1;
  bool contiguous = false;
  int pos0 = 0, seq = 0;
  lc::CausalPath path = lc::CausalPath::kAuto;
  bool null_row_seq = false;
  bool pool_unchecked = false;  // kv.n_pages_pool = 0 (page ids checked for >= 0 only)
};
struct Result {
  std::vector<float> o;
  uint32_t status = 0;
};

Result run(const Pool& P, const Call& c, const std::vector<float>& q, float scale, const Rows& rows) {
  const int nh = P.H * c.G;
  Dev<float> dq(q), dout(size_t(rows.n()) * nh * P.D);
  Dev<int32_t> dseq(rows.seq), dpos(rows.pos);
  Dev<uint32_t> dstatus(std::vector<uint32_t>{0u});
  // Poison the output: every element must be written.
  ck(cudaMemset(dout.p, 0xff, dout.n * sizeof(float)), "memset");
  lc::CausalAttentionParams p;
  p.q = dq.p;
  p.kv = P.view();
  if (c.pool_unchecked) p.kv.n_pages_pool = 0;
  p.row_seq = c.contiguous || c.null_row_seq ? nullptr : dseq.p;
  p.row_pos = c.contiguous ? nullptr : dpos.p;
  p.n_rows = rows.n();
  p.group = c.G;
  p.scale = scale;
  p.o = dout.p;
  p.status = dstatus.p;
  p.contiguous = c.contiguous;
  p.pos0 = c.pos0;
  p.seq = c.seq;
  p.path = c.path;
  ck(lc::causal_attention(p, nullptr), "causal_attention");
  ck(cudaDeviceSynchronize(), "causal_attention kernel");
  return {dout.down(), dstatus.down()[0]};
}

/// max |got - want| / max|v| over the rows not listed in `nan_rows`; those must be NaN in every
/// output. Fails the test (with `what`) on a non-finite output where a value is expected.
double check(const Pool& P, int G, const std::vector<float>& got, const std::vector<double>& want, int n_rows,
             const std::vector<char>& nan_rows, const std::string& what) {
  const size_t per_row = size_t(P.H) * G * P.D;
  double worst = 0.0;
  int bad_reported = 0;
  for (int r = 0; r < n_rows; ++r) {
    const bool expect_nan = !nan_rows.empty() && nan_rows[r];
    for (size_t e = 0; e < per_row; ++e) {
      const float x = got[r * per_row + e];
      if (expect_nan) {
        if (!std::isnan(x) && bad_reported++ < 5) ADD_FAILURE() << what << ": row " << r << " should be NaN, got " << x;
        continue;
      }
      if (!std::isfinite(x)) {
        if (bad_reported++ < 5) ADD_FAILURE() << what << ": row " << r << " element " << e << " is " << x;
        continue;
      }
      worst = std::max(worst, std::fabs(double(x) - want[r * per_row + e]) / P.max_abs_v);
    }
  }
  return worst;
}

/// Run `c` on `rows` and compare with the float64 reference at `tol`.
void expect_matches(const Pool& P, const Call& c, const Rows& rows, uint32_t seed, double tol,
                    const std::string& what) {
  const float scale = 1.0f / std::sqrt(float(P.D));
  const auto q = make_queries(P, c.G, rows, seed);
  const auto want = reference(P, c.G, q, scale, rows);
  const Result got = run(P, c, q, scale, rows);
  EXPECT_EQ(got.status, 0u) << what;
  const double err = check(P, c.G, got.o, want, rows.n(), {}, what);
  EXPECT_LE(err, tol) << what;
  std::printf("[ %s ] max |err| / max|v| = %.2e (tolerance %.1e)\n", what.c_str(), err, tol);
}

std::string dtype_name(lc::KvType t) { return t == lc::KvType::kBF16 ? "bf16" : "f16"; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host-side argument checks (no device needed: the wrapper refuses before any CUDA call).

TEST(CudaCausalAttention, RefusesUnsupportedShapesBeforeAnyLaunch) {
  lc::CausalAttentionParams p;
  float dummy[4] = {};
  int32_t ids[2] = {};
  p.q = dummy;
  p.o = dummy;
  p.kv.k = dummy;
  p.kv.v = dummy;
  p.kv.indptr = ids;
  p.kv.indices = ids;
  p.kv.n_head_kv = 1;
  p.kv.head_dim = 64;
  p.kv.batch = 1;
  p.n_rows = 0;
  EXPECT_EQ(lc::causal_attention(p, nullptr), cudaSuccess) << "no rows: nothing to enqueue";
  p.n_rows = 1;
  p.row_pos = ids;
  auto refused = [&](lc::CausalAttentionParams bad, const char* what) {
    EXPECT_EQ(lc::causal_attention(bad, nullptr), cudaErrorInvalidValue) << what;
  };
  {
    auto b = p;
    b.group = 17;
    refused(b, "group 17");
  }
  {
    auto b = p;
    b.group = 0;
    refused(b, "group 0");
  }
  {
    auto b = p;
    b.kv.head_dim = 258;
    refused(b, "head_dim 258");
  }
  {
    auto b = p;
    b.kv.head_dim = 81;
    refused(b, "odd head_dim");
  }
  {
    auto b = p;
    b.row_pos = nullptr;
    refused(b, "rows without positions");
  }
  {
    auto b = p;
    b.contiguous = true;
    b.seq = 1;
    refused(b, "chunk of a sequence outside the batch");
  }
  {
    auto b = p;
    b.contiguous = true;
    b.pos0 = INT_MAX;
    b.n_rows = 2;
    refused(b, "chunk positions past INT_MAX");
  }
  {
    auto b = p;
    b.kv.head_dim = 80;
    b.contiguous = true;
    b.path = lc::CausalPath::kTensorCore;
    refused(b, "tensor cores at head_dim 80");
  }
  {
    auto b = p;
    b.path = lc::CausalPath::kTensorCore;
    refused(b, "tensor cores for rows that are not a chunk");
  }
  {
    auto b = p;
    b.contiguous = true;
    EXPECT_TRUE(lc::causal_attention_uses_tensor_cores(b));
    b.kv.head_dim = 80;
    EXPECT_FALSE(lc::causal_attention_uses_tensor_cores(b));
    b.kv.head_dim = 128;
    b.q = reinterpret_cast<const float*>(reinterpret_cast<const char*>(dummy) + 4);
    EXPECT_FALSE(lc::causal_attention_uses_tensor_cores(b)) << "q not 8-byte aligned";
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core path: prefill chunks.

TEST(CudaCausalAttention, TensorCoreChunksMatchFloat64Reference) {
  SKIP_WITHOUT_CUDA();
  struct Chunk {
    int pos0, n, tail;  // the sequence holds pos0 + n + tail tokens
  };
  // One token; a first chunk not a multiple of 16 or of the tile; a later chunk at position 1000
  // (K/V of earlier chunks attended, keys past the chunk present but never attended); a chunk that
  // starts inside a page; a chunk long enough for several tiles of every group size.
  const std::vector<Chunk> chunks = {{0, 1, 0}, {0, 93, 0}, {1000, 45, 21}, {37, 130, 0}, {1000, 1, 0}};
  uint32_t seed = 1;
  for (lc::KvType t : {lc::KvType::kF16, lc::KvType::kBF16})
    for (int D : {64, 128})
      for (int G : {1, 4, 6, 8, 12, 16}) {
        const int H = G >= 12 ? 1 : 2;
        for (const Chunk& ch : chunks) {
          // The chunk's sequence is the second of three (its pages interleave with the others' ids).
          const int len = ch.pos0 + ch.n + ch.tail;
          Pool P(H, D, t, {77, len, 300}, seed++);
          Call c;
          c.G = G;
          c.contiguous = true;
          c.pos0 = ch.pos0;
          c.seq = 1;
          c.path = lc::CausalPath::kTensorCore;
          const std::string what = "tc " + dtype_name(t) + " d" + std::to_string(D) + " G" + std::to_string(G) + " H" +
                                   std::to_string(H) + " pos0 " + std::to_string(ch.pos0) + " n " +
                                   std::to_string(ch.n);
          expect_matches(P, c, Rows::chunk(1, ch.pos0, ch.n), seed++, tc_tolerance(t), what);
        }
      }
}

TEST(CudaCausalAttention, AutoPathTakesTensorCoresForChunks) {
  SKIP_WITHOUT_CUDA();
  Pool P(2, 128, lc::KvType::kBF16, {200}, 7);
  Call c;
  c.G = 4;
  c.contiguous = true;
  c.pos0 = 50;
  expect_matches(P, c, Rows::chunk(0, 50, 150), 8, tc_tolerance(P.dtype), "auto chunk bf16 d128 G4");
}

// ---------------------------------------------------------------------------------------------
// Generic path: any rows.

TEST(CudaCausalAttention, GenericDecodeRowsMatchFloat64Reference) {
  SKIP_WITHOUT_CUDA();
  // A batch of sequences of different lengths (1 token, page boundaries +-1, longer), one decode row
  // per sequence at its last position, plus rows at arbitrary earlier positions, in mixed order.
  const std::vector<int> lens = {1, 15, 16, 17, 100, 333, 1029};
  uint32_t seed = 100;
  for (lc::KvType t : {lc::KvType::kF16, lc::KvType::kBF16})
    for (int D : {8, 64, 80, 128, 256})
      for (int G : {1, 4, 6, 8, 16}) {
        if (D == 256 && G > 6) continue;  // (reference time)
        const int H = G >= 8 ? 1 : 2;
        Pool P(H, D, t, lens, seed++);
        Rows rows;
        for (int s = int(lens.size()) - 1; s >= 0; --s) {  // decode rows
          rows.seq.push_back(s);
          rows.pos.push_back(lens[s] - 1);
        }
        std::mt19937 rng{seed++};
        for (int i = 0; i < 6; ++i) {  // earlier positions
          const int s = int(rng() % lens.size());
          rows.seq.push_back(s);
          rows.pos.push_back(int(rng() % uint32_t(lens[s])));
        }
        Call c;
        c.G = G;
        c.path = lc::CausalPath::kGeneric;
        const std::string what = "generic rows " + dtype_name(t) + " d" + std::to_string(D) + " G" + std::to_string(G);
        expect_matches(P, c, rows, seed++, kGenericTolerance, what);
      }
}

TEST(CudaCausalAttention, GenericChunksAndNullRowSeqMatchFloat64Reference) {
  SKIP_WITHOUT_CUDA();
  uint32_t seed = 300;
  for (int D : {8, 80, 128}) {
    Pool P(2, D, lc::KvType::kF16, {1100}, seed++);
    Call c;
    c.G = 6;
    c.contiguous = true;
    c.pos0 = 1000;
    c.path = lc::CausalPath::kGeneric;
    expect_matches(P, c, Rows::chunk(0, 1000, 70), seed++, kGenericTolerance, "generic chunk d" + std::to_string(D));
    // Rows given by position alone: every row is sequence 0.
    Call n;
    n.G = 6;
    n.null_row_seq = true;
    Rows rows = Rows::chunk(0, 0, 40);
    for (int& pos : rows.pos) pos = (pos * 37) % 1100;
    expect_matches(P, n, rows, seed++, kGenericTolerance, "generic null row_seq d" + std::to_string(D));
  }
}

// ---------------------------------------------------------------------------------------------
// Both paths agree; positions near 1,000,000.

TEST(CudaCausalAttention, TensorCoreAndGenericPathsAgree) {
  SKIP_WITHOUT_CUDA();
  uint32_t seed = 500;
  for (lc::KvType t : {lc::KvType::kF16, lc::KvType::kBF16})
    for (int D : {64, 128})
      for (int G : {1, 5, 7, 16}) {
        Pool P(2, D, t, {40, 700}, seed++);
        const Rows rows = Rows::chunk(1, 411, 289);
        const float scale = 1.0f / std::sqrt(float(D));
        const auto q = make_queries(P, G, rows, seed++);
        Call c;
        c.G = G;
        c.contiguous = true;
        c.pos0 = 411;
        c.seq = 1;
        c.path = lc::CausalPath::kTensorCore;
        const Result a = run(P, c, q, scale, rows);
        c.path = lc::CausalPath::kGeneric;
        const Result b = run(P, c, q, scale, rows);
        EXPECT_EQ(a.status, 0u);
        EXPECT_EQ(b.status, 0u);
        std::vector<double> bd(b.o.begin(), b.o.end());
        const double err = check(P, G, a.o, bd, rows.n(), {}, "paths agree");
        const double tol = tc_tolerance(t) + kGenericTolerance;
        EXPECT_LE(err, tol) << dtype_name(t) << " d" << D << " G" << G;
        std::printf("[ tc vs generic %s d%d G%d ] max |diff| / max|v| = %.2e (tolerance %.1e)\n", dtype_name(t).c_str(),
                    D, G, err, tol);
      }
}

TEST(CudaCausalAttention, PositionsNearOneMillion) {
  SKIP_WITHOUT_CUDA();
  // 1,000,002 tokens over a page table of random ids from a 97-page pool (repeats: the kernels do
  // not care, and the reference reads the same table). Rows 999,999 .. 1,000,001 cross the page
  // boundary at 1,000,000 (page 62,500).
  const int len = 1000002, pos0 = 999999, G = 2;
  const Rows rows = Rows::chunk(0, pos0, 3);
  for (lc::KvType t : {lc::KvType::kF16, lc::KvType::kBF16}) {
    Pool P(1, 64, t, {len}, t == lc::KvType::kF16 ? 11u : 12u, /*pool_pages=*/97);
    const float scale = 1.0f / std::sqrt(64.0f);
    const auto q = make_queries(P, G, rows, 13);
    const auto want = reference(P, G, q, scale, rows);
    Call c;
    c.G = G;
    c.contiguous = true;
    c.pos0 = pos0;
    c.path = lc::CausalPath::kTensorCore;
    const Result a = run(P, c, q, scale, rows);
    c.path = lc::CausalPath::kGeneric;
    const Result b = run(P, c, q, scale, rows);
    EXPECT_EQ(a.status, 0u);
    EXPECT_EQ(b.status, 0u);
    const double ea = check(P, G, a.o, want, rows.n(), {}, "tc 1M");
    const double eb = check(P, G, b.o, want, rows.n(), {}, "generic 1M");
    // Both paths add one float32 partial per page (generic) or per 16 keys (tensor cores: one MMA
    // k-step) into their running sums: 62,500 roundings of up to 2^-24 each, relative to sums that
    // the normalisation divides out, so at most ~2 * 62,500 * 2^-24 = 7.5e-3 on top of the short-
    // context tolerances (seen on the H200: tc 4.4e-4, generic 4.6e-5).
    const double acc = 2.0 * (len / 16 + 1) * std::ldexp(1.0, -24);
    EXPECT_LE(ea, tc_tolerance(t) + acc) << dtype_name(t);
    EXPECT_LE(eb, kGenericTolerance + acc) << dtype_name(t);
    std::printf("[ 1M %s ] max |err| / max|v|: tc %.2e, generic %.2e (tolerances %.1e, %.1e)\n", dtype_name(t).c_str(),
                ea, eb, tc_tolerance(t) + acc, kGenericTolerance + acc);
  }
}

// ---------------------------------------------------------------------------------------------
// Bad input: NaN rows and status bits, other rows unaffected.

TEST(CudaCausalAttention, BadPageTablesGiveNaNRowsAndStatusOthersUnaffected) {
  SKIP_WITHOUT_CUDA();
  for (lc::CausalPath path : {lc::CausalPath::kTensorCore, lc::CausalPath::kGeneric}) {
    const bool tc = path == lc::CausalPath::kTensorCore;
    const std::string pname = tc ? "tc" : "generic";
    const int D = 64, G = 4;
    const float scale = 1.0f / std::sqrt(float(D));
    // Sequence 0: 300 tokens; its page 9 (keys 144..159) gets an id outside the pool.
    {
      Pool P(2, D, lc::KvType::kF16, {300, 50}, 21);
      const Rows rows = Rows::chunk(0, 100, 200);  // positions 100..299
      const auto q = make_queries(P, G, rows, 22);
      const auto want = reference(P, G, q, scale, rows);
      P.indices[P.indptr[0] + 9] = P.n_pages_pool;
      P.upload();
      Call c;
      c.G = G;
      c.contiguous = tc;
      c.pos0 = 100;
      c.path = path;
      const Result got = run(P, c, q, scale, rows);
      EXPECT_EQ(got.status, uint32_t(lc::kStatusBadPageId)) << pname;
      std::vector<char> nan_rows(rows.n());
      for (int r = 0; r < rows.n(); ++r) nan_rows[r] = rows.pos[r] >= 144;
      const double err = check(P, G, got.o, want, rows.n(), nan_rows, pname + " bad page id");
      EXPECT_LE(err, tc ? tc_tolerance(P.dtype) : kGenericTolerance) << pname << " rows before the bad page";
      // A negative id: the same, also where the pool size is not given (kv.n_pages_pool 0).
      P.indices[P.indptr[0] + 9] = -5;
      P.upload();
      for (bool unchecked : {false, true}) {
        c.pool_unchecked = unchecked;
        const Result neg = run(P, c, q, scale, rows);
        EXPECT_EQ(neg.status, uint32_t(lc::kStatusBadPageId)) << pname << " negative id";
        EXPECT_LE(check(P, G, neg.o, want, rows.n(), nan_rows, pname + " negative page id"),
                  tc ? tc_tolerance(P.dtype) : kGenericTolerance);
      }
    }
    // A chunk past the sequence's pages: sequence 0 holds 208 tokens (13 pages), the chunk runs to
    // position 229; rows from 208 on are bad, earlier rows exact (also those sharing a tile with bad
    // rows).
    {
      Pool P(2, D, lc::KvType::kBF16, {208, 64}, 23);
      const Rows rows = Rows::chunk(0, 150, 80);
      const auto q = make_queries(P, G, rows, 24);
      const int n_known = 58;  // positions 150..207
      std::vector<float> qk(q.begin(), q.begin() + size_t(n_known) * P.H * G * D);
      auto want = reference(P, G, qk, scale, Rows::chunk(0, 150, n_known));
      want.resize(size_t(rows.n()) * P.H * G * D, 0.0);
      Call c;
      c.G = G;
      c.contiguous = tc;
      c.pos0 = 150;
      c.path = path;
      const Result got = run(P, c, q, scale, rows);
      EXPECT_EQ(got.status, uint32_t(lc::kStatusBadPageCount)) << pname;
      std::vector<char> nan_rows(rows.n());
      for (int r = 0; r < rows.n(); ++r) nan_rows[r] = rows.pos[r] >= 208;
      const double err = check(P, G, got.o, want, rows.n(), nan_rows, pname + " chunk past the pages");
      EXPECT_LE(err, tc ? tc_tolerance(P.dtype) : kGenericTolerance) << pname;
    }
    // last_page_len outside 1..16: every row of that sequence is bad; sequence 1 unaffected.
    {
      Pool P(1, D, lc::KvType::kF16, {90, 90}, 25);
      P.last_len[0] = 0;
      P.upload();
      Call c;
      c.G = G;
      c.contiguous = tc;
      c.pos0 = 10;
      c.path = path;
      const Rows rows = Rows::chunk(0, 10, 30);
      const auto q = make_queries(P, G, rows, 26);
      const Result got = run(P, c, q, scale, rows);
      EXPECT_EQ(got.status, uint32_t(lc::kStatusBadLastPageLen)) << pname;
      check(P, G, got.o, {}, rows.n(), std::vector<char>(rows.n(), 1), pname + " bad last_page_len");
      c.seq = 1;
      Rows rows1 = Rows::chunk(1, 10, 30);
      const auto want = reference(P, G, q, scale, rows1);
      const Result ok = run(P, c, q, scale, rows1);
      EXPECT_EQ(ok.status, 0u) << pname << " the other sequence";
      EXPECT_LE(check(P, G, ok.o, want, rows1.n(), {}, pname + " other sequence"),
                tc ? tc_tolerance(P.dtype) : kGenericTolerance);
    }
  }
}

TEST(CudaCausalAttention, GenericBadRowsGiveNaNOthersUnaffected) {
  SKIP_WITHOUT_CUDA();
  const int D = 80, G = 3;
  const float scale = 1.0f / std::sqrt(float(D));
  Pool P(2, D, lc::KvType::kBF16, {40, 70, 33}, 31);
  // Descending indptr for sequence 2 (its page count negative).
  P.indptr[3] = P.indptr[2] - 1;
  P.upload();
  Rows rows;
  std::vector<char> nan_rows;
  auto add = [&](int s, int pos, bool bad) {
    rows.seq.push_back(s);
    rows.pos.push_back(pos);
    nan_rows.push_back(bad);
  };
  add(1, 69, false);
  add(5, 3, true);  // sequence outside the batch
  add(0, 39, false);
  add(-1, 3, true);  // negative sequence
  add(0, -1, true);  // negative position
  add(0, 48, true);  // past sequence 0's 3 pages
  add(2, 0, true);   // indptr descending
  add(1, 0, false);
  const auto q = make_queries(P, G, rows, 32);
  // Reference for the good rows (bad rows get a dummy row 0 of sequence 0).
  Rows safe = rows;
  for (int r = 0; r < rows.n(); ++r)
    if (nan_rows[r]) {
      safe.seq[r] = 0;
      safe.pos[r] = 0;
    }
  const auto want = reference(P, G, q, scale, safe);
  Call c;
  c.G = G;
  c.path = lc::CausalPath::kGeneric;
  const Result got = run(P, c, q, scale, rows);
  EXPECT_EQ(got.status, uint32_t(lc::kStatusBadPageCount));
  EXPECT_LE(check(P, G, got.o, want, rows.n(), nan_rows, "generic bad rows"), kGenericTolerance);
}

// ---------------------------------------------------------------------------------------------
// The engine's CPU twin.

TEST(CudaCausalAttention, MatchesCpuPagedPrefillAttention) {
  SKIP_WITHOUT_CUDA();
  for (int D : {64, 128}) {
    const int H = 2, G = 4, n_head = H * G;
    locks::KvCacheConfig cfg;
    cfg.n_layer = 1;
    cfg.n_head_kv = H;
    cfg.head_dim = D;
    cfg.page_size = 16;
    cfg.n_pages = 64;
    cfg.dtype = locks::KvDtype::F16;
    locks::PagedKvCache cache(cfg);
    // Two sequences appended in turns, so sequence 1's page ids are not a contiguous run.
    locks::KvSequence seqs[2];
    std::mt19937 rng{uint32_t(40 + D)};
    std::normal_distribution<float> N(0.0f, 1.0f);
    std::vector<float> k(size_t(H) * D), v(size_t(H) * D);
    const int lens[2] = {150, 430};
    for (int step = 0; step < 30; ++step)
      for (int b = 0; b < 2; ++b) {
        const int n = std::min(16, lens[b] - seqs[b].n_tokens);
        if (n <= 0) continue;
        const int32_t p0 = cache.append_tokens(seqs[b], n);
        for (int pos = p0; pos < p0 + n; ++pos) {
          for (auto& x : k) x = N(rng);
          for (auto& x : v) x = N(rng);
          cache.write(0, seqs[b], pos, k.data(), v.data());
        }
      }
    ASSERT_EQ(seqs[1].n_tokens, lens[1]);
    // The second prefill chunk of sequence 1: positions 300..429.
    const int pos0 = 300, n_q = 130;
    std::vector<float> q(size_t(n_q) * n_head * D);
    for (auto& x : q) x = 1.5f * N(rng);
    const float scale = 1.0f / std::sqrt(float(D));
    std::vector<float> cpu(q.size());
    locks::paged_prefill_attention(cache, 0, seqs[1], pos0, n_q, q.data(), n_head, scale, cpu.data());

    const size_t elems = size_t(cfg.n_pages) * H * 16 * D;
    std::vector<uint16_t> kb(elems), vb(elems);
    std::memcpy(kb.data(), cache.k_page(0, 0, 0), elems * 2);
    std::memcpy(vb.data(), cache.v_page(0, 0, 0), elems * 2);
    Dev<uint16_t> dk(kb), dv(vb);
    std::vector<int32_t> indptr = {0, int32_t(seqs[0].n_pages())};
    indptr.push_back(indptr[1] + seqs[1].n_pages());
    std::vector<int32_t> indices(seqs[0].page_table.begin(), seqs[0].page_table.end());
    indices.insert(indices.end(), seqs[1].page_table.begin(), seqs[1].page_table.end());
    std::vector<int32_t> last = {lens[0] - 16 * (seqs[0].n_pages() - 1), lens[1] - 16 * (seqs[1].n_pages() - 1)};
    Dev<int32_t> d_indptr(indptr), d_indices(indices), d_last(last);
    Dev<float> dq(q), dout(q.size());
    lc::CausalAttentionParams p;
    p.q = dq.p;
    p.kv.k = dk.p;
    p.kv.v = dv.p;
    p.kv.dtype = lc::KvType::kF16;
    p.kv.n_head_kv = H;
    p.kv.head_dim = D;
    p.kv.batch = 2;
    p.kv.indptr = d_indptr.p;
    p.kv.indices = d_indices.p;
    p.kv.last_page_len = d_last.p;
    p.kv.n_pages_pool = cfg.n_pages;
    p.n_rows = n_q;
    p.group = G;
    p.scale = scale;
    p.o = dout.p;
    p.contiguous = true;
    p.pos0 = pos0;
    p.seq = 1;
    ASSERT_TRUE(lc::causal_attention_uses_tensor_cores(p));
    ck(lc::causal_attention(p, nullptr), "causal_attention");
    const auto gpu = dout.down();
    double max_v = 0.0, worst = 0.0;
    for (uint16_t b : vb) max_v = std::max(max_v, double(std::fabs(locks::f16_to_f32(b))));
    for (size_t i = 0; i < gpu.size(); ++i) worst = std::max(worst, std::fabs(double(gpu[i]) - cpu[i]) / max_v);
    // The CPU twin is float32 (error ~1e-6); the GPU's bound is that of the tensor-core path.
    const double tol = tc_tolerance(lc::KvType::kF16) + 1e-4;
    EXPECT_LE(worst, tol) << "d" << D;
    std::printf("[ vs paged_prefill_attention d%d ] max |gpu - cpu| / max|v| = %.2e (tolerance %.1e)\n", D, worst, tol);
  }
}

#else  // !LOCKS_WITH_CUDA

TEST(CudaCausalAttention, NotBuiltWithCuda) {
  GTEST_SKIP() << "built without CUDA (no CUDA compiler found at configure time)";
}

#endif
