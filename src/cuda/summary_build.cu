// Alg. 1 (page summary build) on the GPU: one warp per (page, KV head): float64 centroid, float64
// Gram matrix on the FP64 tensor cores, a parallel-order cyclic Jacobi eigensolver in float32 in
// shared memory, eigenvalues refined in float64 (Rayleigh quotients), float64 basis and
// coefficients, quantized on the fly into the device record (record_layout.h). CPU twin:
// build_page_summary + PageSummaryStore::store (float64 throughout).
//
// Latency matters here: decoding builds one new page per sequence every 16 steps, a launch of a
// few warps. The Jacobi rounds run in float32 because float64 divisions and square roots on each
// round's critical path dominate an all-float64 build (docs/cuda-design.md, the summary build).
#include <cfloat>
#include <cmath>

#include "common.cuh"
#include "record_layout.h"

namespace locks::cuda {

namespace {

using namespace detail;
namespace L = layout;

constexpr int kWarps = 4;

template <int D>
struct BuildSmem {
  float keys[16][D + 4];  // padded: the Gram fragments' loads (rows g, columns 4k + t) hit 32 banks
  double mu[D];
  double gram[16][16];  // float64 Gram matrix (Rayleigh quotients)
  float a[16][17];      // its float32 copy, diagonalised in place (padded rows)
  float u[16][17];      // eigenvectors (columns)
  float rc[8], rs[8];   // this round's rotations
  int rp[8], rq[8];
  double w[16], unorm_inv[16];  // eigenvalues, 1 / |u_k|
  double ud[16][kSummaryRank];  // kept eigenvectors, float64, unit length, in descending order
  int order[16];
  double sigma[8], sigma_inv[8];
  uint16_t coef_scale[16], basis_scale[8], centroid_scale;
};

// Symmetric quantization with one f16 scale, as the CPU store (locks/quant.h): the scale of a group
// from its warp-reduced max |x|, then each lane's codes against it.
__device__ __forceinline__ float quant_scale(float amax, int qm, uint16_t& bits) {
  // The CPU throws where the scale overflows f16; keys from an f16 cache never get there.
  bits = f32_to_f16(fminf(quant::raw_scale(amax, qm), quant::kF16Max));
  return f16_to_f32(bits);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}
template <typename F>
__device__ __forceinline__ F warp_sum(F x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32) summary_build_kernel(SummaryBuildParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  BuildSmem<D>& s = reinterpret_cast<BuildSmem<D>*>(smem_raw)[warp];
  const long item = long(blockIdx.x) * kWarps + warp;  // (layer, page, KV head)
  const long per_layer = long(p.n_pages) * p.n_head_kv;
  if (item >= per_layer * p.n_layers) return;  // warp-uniform
  const long layer = item / per_layer;
  const int32_t page = p.pages[(item % per_layer) / p.n_head_kv];
  const int h = int(item % p.n_head_kv);
  if (page == -1) return;                   // no page: the engine's decode step lists one entry per sequence
  if (!page_id_ok(page, p.n_pages_pool)) {  // bad input: nothing read or written
    if (lane == 0) raise_status(p.status, kStatusBadPageId);
    return;
  }
  const bool bf16 = p.dtype == KvType::kBF16;

  // Keys of the page: [16][D] elements, 16-byte loads.
  {
    const uint16_t* src = static_cast<const uint16_t*>(p.k) + layer * p.k_layer_stride +
                          (size_t(page) * p.n_head_kv + h) * size_t(kPageSize) * D;
    constexpr int kChunks = 16 * D / 8;
#pragma unroll
    for (int c = lane; c < kChunks; c += 32) {
      const uint4 v = __ldcg(reinterpret_cast<const uint4*>(src) + c);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      const int i = (c * 8) / D, x0 = (c * 8) % D;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s.keys[i][x0 + 2 * e] = kv_to_float(uint16_t(w[e] & 0xffffu), bf16);
        s.keys[i][x0 + 2 * e + 1] = kv_to_float(uint16_t(w[e] >> 16), bf16);
      }
    }
  }
  __syncwarp();

  // Alg. 1 line 1: centroid in float64 (token order, as the CPU).
#pragma unroll
  for (int m = 0; m < D / 32; ++m) {
    const int c = lane + 32 * m;
    double acc = 0.0;
#pragma unroll
    for (int i = 0; i < 16; ++i) acc += double(s.keys[i][c]);
    s.mu[c] = acc / 16.0;
  }
  __syncwarp();

  // Alg. 1 line 2: Gram matrix G = D D^T of the centred keys (rows = tokens), float64 on the tensor
  // cores: tiles (0, 0), (0, 1), (1, 1) of 8x8, D / 4 k-steps each; the A and B fragments of a
  // k-step are the same two centred values per lane (G is symmetric), rows g and 8 + g.
  {
    const int g = lane >> 2, t = lane & 3;
    double c00[2] = {0.0, 0.0}, c01[2] = {0.0, 0.0}, c11[2] = {0.0, 0.0};
#pragma unroll 4
    for (int ks = 0; ks < D / 4; ++ks) {
      const int col = 4 * ks + t;
      const double mc = s.mu[col];
      const double x0 = double(s.keys[g][col]) - mc, x1 = double(s.keys[8 + g][col]) - mc;
      dmma_884(c00, x0, x0);
      dmma_884(c01, x0, x1);
      dmma_884(c11, x1, x1);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int j = 2 * t + e;
      s.gram[g][j] = c00[e];
      s.gram[g][8 + j] = s.gram[8 + j][g] = c01[e];
      s.gram[8 + g][8 + j] = c11[e];
      s.a[g][j] = float(c00[e]);
      s.a[g][8 + j] = s.a[8 + j][g] = float(c01[e]);
      s.a[8 + g][8 + j] = float(c11[e]);
    }
  }
  for (int e = lane; e < 256; e += 32) s.u[e / 16][e % 16] = (e / 16 == e % 16) ? 1.0f : 0.0f;
  __syncwarp();

  // Parallel cyclic Jacobi in float32 (round-robin ordering: 15 rounds of 8 disjoint rotations per
  // sweep). Rotations of one round touch disjoint row/column pairs, so applying them together equals
  // applying them one after the other; angles as the CPU (Golub & Van Loan 8.4.1). float32: the
  // eigenvectors come out to float32 precision relative to the largest eigenvalue, finer than the
  // int4 basis and int8 coefficients resolve, and the eigenvalues are refined in float64 below. Stops
  // when the off-diagonal mass is below 1e-17 of the total, in float64 sums (5-6 sweeps on random
  // pages in a host simulation of these rounds, float32 rounding letting it go on to ~1e-19; 1e-12
  // stopped pages dominated by one or two directions after one sweep, their small directions
  // unresolved). Non-finite keys (NaN total; also a Gram matrix beyond float32, keys of |k| ~ 1e18)
  // stop at once: kStatusBadKeys, a NaN centroid scale and tail.
  double total = 0.0;
  for (int e = lane; e < 256; e += 32) total += double(s.a[e / 16][e % 16]) * s.a[e / 16][e % 16];
  total = warp_sum(total);
  const bool bad_keys = !isfinite(total);
  if (bad_keys && lane == 0) raise_status(p.status, kStatusBadKeys);
  for (int sweep = 0; sweep < 20; ++sweep) {
    double off = 0.0;
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      const int r = it * 2 + (lane >> 4), c = lane & 15;
      if (r < c) off += double(s.a[r][c]) * s.a[r][c];
    }
    off = warp_sum(off);
    if (!(off > 1e-17 * total)) break;
    for (int round = 0; round < 15; ++round) {
      if (lane < 8) {
        // Round-robin pairs: lane 0 (round, 15), lane l (round + l, round - l) mod 15.
        int pp = lane == 0 ? round : round + lane, qq = lane == 0 ? 15 : round - lane;
        if (pp >= 15) pp -= 15;
        if (qq < 0) qq += 15;
        if (pp > qq) {
          const int t = pp;
          pp = qq;
          qq = t;
        }
        const float apq = s.a[pp][qq];
        float c = 1.0f, sn = 0.0f;
        if (apq != 0.0f) {
          // theta = (a_qq - a_pp) / (2 a_pq), t = sign(theta) / (|theta| + sqrt(theta^2 + 1)) =
          // sign(theta) r / (|theta| r + 1) with r = 1 / sqrt(theta^2 + 1), c = 1 / sqrt(t^2 + 1), s = t c,
          // by the SFU's approximate reciprocal and reciprocal square root (~2 ulp: c^2 + s^2 = 1 to
          // ~1e-7; U's columns stay orthogonal to ~3e-6 and their lengths drift, which the
          // normalisation below removes). |theta| is
          // clamped at 1e18, where t ~ 5e-19 is no rotation, so that theta^2 stays finite.
          const float theta = fminf(fmaxf(__fdividef(s.a[qq][qq] - s.a[pp][pp], 2.0f * apq), -1e18f), 1e18f);
          const float r = rsqrtf(fmaf(theta, theta, 1.0f));
          const float t = (theta >= 0.0f ? 1.0f : -1.0f) * __fdividef(r, fmaf(fabsf(theta), r, 1.0f));
          c = rsqrtf(fmaf(t, t, 1.0f));
          sn = t * c;
        }
        s.rc[lane] = c;
        s.rs[lane] = sn;
        s.rp[lane] = pp;
        s.rq[lane] = qq;
      }
      __syncwarp();
      // A <- J^T A J and U <- U J in one pass: the round's 8 pairs partition the 16 indices, so A
      // splits into 64 2x2 blocks (rows of pair i, columns of pair j) that transform independently,
      // each as two passes over the whole matrix would (columns with pair j, then rows with pair i).
      // Lane: blocks (lane / 8, lane % 8) and (lane / 8 + 4, lane % 8) of A, and entries (k, p_m),
      // (k, q_m) of U for k = lane % 16, m = lane / 16 + 2 it. Every load of the round goes out before
      // the first store (they touch disjoint entries, which the compiler cannot know).
      {
        struct Rot {
          int p, q;
          float c, sn;
        };
        auto rot = [&](int m) { return Rot{s.rp[m], s.rq[m], s.rc[m], s.rs[m]}; };
        const int bj = lane & 7, k = lane & 15;
        const Rot rj = rot(bj);
        Rot ri[2], rm[4];
        float x[2][4], y[4][2];
#pragma unroll
        for (int it = 0; it < 2; ++it) ri[it] = rot((lane >> 3) + 4 * it);
#pragma unroll
        for (int it = 0; it < 4; ++it) rm[it] = rot((lane >> 4) + 2 * it);
#pragma unroll
        for (int it = 0; it < 2; ++it) {
          x[it][0] = s.a[ri[it].p][rj.p];
          x[it][1] = s.a[ri[it].p][rj.q];
          x[it][2] = s.a[ri[it].q][rj.p];
          x[it][3] = s.a[ri[it].q][rj.q];
        }
#pragma unroll
        for (int it = 0; it < 4; ++it) {
          y[it][0] = s.u[k][rm[it].p];
          y[it][1] = s.u[k][rm[it].q];
        }
#pragma unroll
        for (int it = 0; it < 2; ++it) {
          const float cj = rj.c, sj = rj.sn, ci = ri[it].c, si = ri[it].sn;
          const float y_pp = cj * x[it][0] - sj * x[it][1], y_pq = sj * x[it][0] + cj * x[it][1];  // row p_i
          const float y_qp = cj * x[it][2] - sj * x[it][3], y_qq = sj * x[it][2] + cj * x[it][3];  // row q_i
          const bool diag = (lane >> 3) + 4 * it == bj;  // the pair's own block: its off-diagonal is annihilated
          s.a[ri[it].p][rj.p] = ci * y_pp - si * y_qp;
          s.a[ri[it].q][rj.p] = diag ? 0.0f : si * y_pp + ci * y_qp;
          s.a[ri[it].p][rj.q] = diag ? 0.0f : ci * y_pq - si * y_qq;
          s.a[ri[it].q][rj.q] = si * y_pq + ci * y_qq;
        }
#pragma unroll
        for (int it = 0; it < 4; ++it) {
          s.u[k][rm[it].p] = rm[it].c * y[it][0] - rm[it].sn * y[it][1];
          s.u[k][rm[it].q] = rm[it].sn * y[it][0] + rm[it].c * y[it][1];
        }
      }
      __syncwarp();
    }
  }

  // Eigenvalues: Rayleigh quotients u_k^T G u_k / u_k^T u_k of the float64 Gram matrix, whose error is
  // quadratic in the eigenvectors' (~1e-12 relative; the CPU twin's float64 Jacobi agrees to that).
  // Lanes k and k + 16 take rows 0..7 and 8..15 of eigenvector k.
  {
    const int k = lane & 15, i0 = (lane >> 4) * 8;
    double uk[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) uk[j] = s.u[j][k];
    double num = 0.0, nrm = 0.0;
#pragma unroll
    for (int ii = 0; ii < 8; ++ii) {
      const int i = i0 + ii;
      double gi = 0.0;
#pragma unroll
      for (int j = 0; j < 16; ++j) gi = fma(s.gram[i][j], uk[j], gi);
      const double ui = s.u[i][k];
      num = fma(ui, gi, num);
      nrm = fma(ui, ui, nrm);
    }
    num += __shfl_xor_sync(kFull, num, 16);
    nrm += __shfl_xor_sync(kFull, nrm, 16);
    if (lane < 16) {
      s.w[lane] = nrm > 0.0 ? num / nrm : 0.0;
      s.unorm_inv[lane] = nrm > 0.0 ? rsqrt(nrm) : 0.0;
    }
  }
  __syncwarp();

  // Eigenvalues descending (stable for ties, as std::stable_sort on the CPU). NaN (non-finite keys)
  // ranks as -inf, so that the order stays a permutation.
  if (lane < 16) {
    auto val = [&](int j) { return isnan(s.w[j]) ? -INFINITY : s.w[j]; };
    const double wi = val(lane);
    int rank = 0;
    for (int j = 0; j < 16; ++j) rank += (val(j) > wi) || (val(j) == wi && j < lane);
    s.order[rank] = lane;
  }
  __syncwarp();

  // Alg. 1 lines 3-4: keep the top 8 directions above the relative floor; the rest is the tail
  // (lane k < 16: the k-th largest eigenvalue).
  {
    const double smax2 = fmax(s.w[s.order[0]], 0.0);
    const double floor2 = fmax(smax2 * 1e-12, 1e-30);
    const double l = lane < 16 ? fmax(s.w[s.order[lane]], 0.0) : 0.0;
    const bool kept = lane < kSummaryRank && l > floor2;
    double tail = kept ? 0.0 : l;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) tail += __shfl_xor_sync(kFull, tail, o);  // over lanes 0..15 (lane 0's sum)
    if (lane < kSummaryRank) {
      s.sigma[lane] = kept ? sqrt(l) : 0.0;
      s.sigma_inv[lane] = kept ? 1.0 / sqrt(l) : 0.0;
    }
    if (lane == 0 && p.tails)
      p.tails[layer * p.tails_layer_stride + size_t(h) * p.n_pages_pool + page] = bad_keys ? NAN : float(tail);
  }
  __syncwarp();

  // The kept eigenvectors in float64, unit length, in descending order of their eigenvalues.
  for (int e = lane; e < 16 * kSummaryRank; e += 32) {
    const int i = e / kSummaryRank, k = e % kSummaryRank, col = s.order[k];
    s.ud[i][k] = double(s.u[i][col]) * s.unorm_inv[col];
  }
  __syncwarp();

  uint8_t* rec = p.records + layer * p.records_layer_stride + (size_t(h) * p.n_pages_pool + page) * L::record_bytes(D);

  // Basis V = D^T U_r Sigma_r^-1 in float64: lane's dims lane + 32 m, all 8 columns at once (32
  // independent sums), then int4 with one scale per column.
  {
    constexpr int M = D / 32;
    double vs[M][kSummaryRank];
    double md[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      md[m] = s.mu[lane + 32 * m];
#pragma unroll
      for (int k = 0; k < kSummaryRank; ++k) vs[m][k] = 0.0;
    }
#pragma unroll 2
    for (int i = 0; i < 16; ++i) {
      double dl[M];
#pragma unroll
      for (int m = 0; m < M; ++m) dl[m] = double(s.keys[i][lane + 32 * m]) - md[m];
#pragma unroll
      for (int k = 0; k < kSummaryRank; ++k) {
        const double uik = s.ud[i][k];
#pragma unroll
        for (int m = 0; m < M; ++m) vs[m][k] = fma(dl[m], uik, vs[m][k]);
      }
    }
    float v[M][kSummaryRank], amax[kSummaryRank];
#pragma unroll
    for (int k = 0; k < kSummaryRank; ++k) {
      const double si = s.sigma_inv[k];
      amax[k] = 0.0f;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        v[m][k] = si > 0.0 ? float(vs[m][k] * si) : 0.0f;
        amax[k] = fmaxf(amax[k], fabsf(v[m][k]));
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int k = 0; k < kSummaryRank; ++k) amax[k] = fmaxf(amax[k], __shfl_xor_sync(kFull, amax[k], o));
#pragma unroll
    for (int k = 0; k < kSummaryRank; ++k) {
      uint16_t sbits;
      const float scale = quant_scale(amax[k], 7, sbits);
      const float inv = quant::inv_scale(scale);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int c = lane + 32 * m;
        const int code = quant::code(v[m][k], inv, 7);
        const int code_next = __shfl_down_sync(kFull, code, 1);
        if ((lane & 1) == 0)
          rec[L::basis_offset(D) + size_t(k) * (D / 2) + c / 2] = quant::offset_nibbles(code, code_next);
      }
      if (lane == 0) s.basis_scale[k] = sbits;
    }
  }

  // Coefficients C = U_r Sigma_r: one token row per lane (lanes 0..15), int8 with one scale per row.
  if (lane < 16) {
    const int i = lane;
    float c8[kSummaryRank];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < kSummaryRank; ++k) {
      const double sg = s.sigma[k];
      c8[k] = sg > 0.0 ? float(s.ud[i][k] * sg) : 0.0f;
      amax = fmaxf(amax, fabsf(c8[k]));
    }
    uint16_t sbits;
    const float scale = quant_scale(amax, 127, sbits);
    const float inv = quant::inv_scale(scale);
#pragma unroll
    for (int k = 0; k < kSummaryRank; ++k)
      rec[L::coef_offset(D) + L::coef_byte(i, k)] = uint8_t(int8_t(quant::code(c8[k], inv, 127)));
    s.coef_scale[i] = sbits;
  }

  // Centroid: int8 with one scale.
  {
    float mv[D / 32];
    float amax = 0.0f;
#pragma unroll
    for (int m = 0; m < D / 32; ++m) {
      mv[m] = float(s.mu[lane + 32 * m]);
      amax = fmaxf(amax, fabsf(mv[m]));
    }
    amax = warp_max(amax);
    uint16_t sbits;
    const float scale = quant_scale(amax, 127, sbits);
    const float inv = quant::inv_scale(scale);
#pragma unroll
    for (int m = 0; m < D / 32; ++m) {
      const int c = lane + 32 * m;
      rec[L::centroid_offset(D) + L::centroid_byte(c)] = uint8_t(int8_t(quant::code(mv[m], inv, 127)));
    }
    if (lane == 0) s.centroid_scale = bad_keys ? uint16_t(0x7e00) : sbits;  // f16 NaN: every score NaN
  }
  __syncwarp();

  // Scales block: four 16-byte chunks.
  if (lane < 4) {
    const int t = lane;
    uint16_t h8[8];
    h8[0] = s.coef_scale[2 * t];
    h8[1] = s.coef_scale[2 * t + 1];
    h8[2] = s.coef_scale[8 + 2 * t];
    h8[3] = s.coef_scale[9 + 2 * t];
    h8[4] = s.basis_scale[2 * t];
    h8[5] = s.basis_scale[2 * t + 1];
    h8[6] = s.centroid_scale;
    h8[7] = 0;
    uint4 v;
    v.x = uint32_t(h8[0]) | (uint32_t(h8[1]) << 16);
    v.y = uint32_t(h8[2]) | (uint32_t(h8[3]) << 16);
    v.z = uint32_t(h8[4]) | (uint32_t(h8[5]) << 16);
    v.w = uint32_t(h8[6]) | (uint32_t(h8[7]) << 16);
    reinterpret_cast<uint4*>(rec + L::scales_offset(D))[t] = v;
  }
}

template <int D>
cudaError_t launch_build(const SummaryBuildParams& p, cudaStream_t stream) {
  const size_t smem = sizeof(BuildSmem<D>) * kWarps;
  const cudaError_t e = allow_dynamic_smem<summary_build_kernel<D>>(smem);
  if (e != cudaSuccess) return e;
  const long items = long(p.n_pages) * p.n_head_kv * p.n_layers;
  const unsigned grid = unsigned((items + kWarps - 1) / kWarps);
  summary_build_kernel<D><<<grid, kWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

size_t summary_record_bytes(int head_dim) {
  return head_dim == 64 || head_dim == 128 ? layout::record_bytes(head_dim) : 0;
}

cudaError_t summary_build(const SummaryBuildParams& p, cudaStream_t stream) {
  if (p.n_pages <= 0 || p.n_head_kv <= 0) return cudaSuccess;
  if (!p.k || !p.pages || !p.records || p.n_pages_pool <= 0 || p.n_layers < 1) return cudaErrorInvalidValue;
  if (p.n_layers > 1) {  // the layers must not overlap (K may be one pool for all)
    const size_t per_head = size_t(p.n_pages_pool) * p.n_head_kv;
    if ((p.k_layer_stride != 0 && p.k_layer_stride < per_head * kPageSize * size_t(p.head_dim)) ||
        p.records_layer_stride < per_head * summary_record_bytes(p.head_dim) ||
        (p.tails && p.tails_layer_stride < per_head))
      return cudaErrorInvalidValue;
    if (p.k_layer_stride % 8 != 0 || p.records_layer_stride % 16 != 0)  // 16-byte loads and stores
      return cudaErrorInvalidValue;
  }
  switch (p.head_dim) {
    case 64:
      return launch_build<64>(p, stream);
    case 128:
      return launch_build<128>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace locks::cuda
