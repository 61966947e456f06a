// Alg. 1 (page summary build) on the GPU: one warp per (page, KV head), float64 Gram matrix and a
// parallel-order cyclic Jacobi eigensolver in shared memory, quantized on the fly into the device
// record (record_layout.h). CPU twin: build_page_summary + PageSummaryStore::store.
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
  float keys[16][D + 1];  // padded: Gram lanes read 16 different rows at one column
  double mu[D];
  double a[16][16];     // Gram matrix, diagonalised in place
  double u[16][16];     // eigenvectors (columns)
  double rc[8], rs[8];  // this round's rotations
  int rp[8], rq[8];
  double w[16];
  int order[16];
  double sigma[8];
  uint16_t coef_scale[16], basis_scale[8], centroid_scale;
};

__device__ __forceinline__ uint16_t f16_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }

// Symmetric quantization with one f16 scale, as the CPU quantize_group: scale rounded to f16
// first, codes against the rounded scale, round-half-even, clamped to [-qm, qm].
__device__ __forceinline__ float quant_scale(float amax, int qm, uint16_t& bits) {
  float scale_f = __fdiv_rn(amax, float(qm));
  scale_f = fminf(scale_f, 65504.0f);  // the CPU throws here; keys from an f16 cache never get there
  bits = f16_bits(scale_f);
  return __half2float(__ushort_as_half(bits));
}
__device__ __forceinline__ int quant_code(float x, float inv, int qm) {
  const int c = __float2int_rn(__fmul_rn(x, inv));
  return max(-qm, min(qm, c));
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}
__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32) summary_build_kernel(SummaryBuildParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  BuildSmem<D>& s = reinterpret_cast<BuildSmem<D>*>(smem_raw)[warp];
  const long item = long(blockIdx.x) * kWarps + warp;
  if (item >= long(p.n_pages) * p.n_head_kv) return;  // warp-uniform
  const int32_t page = p.pages[item / p.n_head_kv];
  const int h = int(item % p.n_head_kv);
  if (!page_id_ok(page, p.n_pages_pool)) {  // bad input: nothing read or written
    if (lane == 0) raise_status(p.status, kStatusBadPageId);
    return;
  }
  const bool bf16 = p.dtype == KvType::kBF16;

  // Keys of the page: [16][D] elements, 16-byte loads.
  {
    const uint16_t* src = static_cast<const uint16_t*>(p.k) + (size_t(page) * p.n_head_kv + h) * size_t(kPageSize) * D;
    constexpr int kChunks = 16 * D / 8;
#pragma unroll
    for (int c = lane; c < kChunks; c += 32) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(src) + c);
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

  // Alg. 1 line 2: Gram matrix of the centred keys, 136 distinct entries over the warp.
  for (int e = lane; e < 136; e += 32) {
    // e -> (i, j), i <= j, row-major over the upper triangle.
    int i = 0, rem = e;
    while (rem >= 16 - i) {
      rem -= 16 - i;
      ++i;
    }
    const int j = i + rem;
    double acc = 0.0;
    for (int c = 0; c < D; ++c) {
      const double mc = s.mu[c];
      acc = fma(double(s.keys[i][c]) - mc, double(s.keys[j][c]) - mc, acc);
    }
    s.a[i][j] = acc;
    s.a[j][i] = acc;
  }
  for (int e = lane; e < 256; e += 32) s.u[e / 16][e % 16] = (e / 16 == e % 16) ? 1.0 : 0.0;
  __syncwarp();

  // Parallel cyclic Jacobi (round-robin ordering: 15 rounds of 8 disjoint rotations per sweep).
  // Rotations of one round touch disjoint row/column pairs, so applying them together equals
  // applying them one after the other; angles as the CPU (Golub & Van Loan 8.4.1).
  double total = 0.0;
  for (int e = lane; e < 256; e += 32) total += s.a[e / 16][e % 16] * s.a[e / 16][e % 16];
  total = warp_sum(total);
  for (int sweep = 0; sweep < 30; ++sweep) {
    double off = 0.0;
    for (int e = lane; e < 256; e += 32) {
      const int r = e / 16, c = e % 16;
      if (r < c) off += s.a[r][c] * s.a[r][c];
    }
    off = warp_sum(off);
    // Off-diagonal mass below 1e-24 of the total (entries ~1e-12 relative) is far below what the
    // f32 / int4 / int8 summary resolves; the CPU twin iterates to 1e-30, which rounding noise in
    // float64 rarely reaches (it then runs all 30 sweeps). Results agree to ~1e-12.
    if (off <= 1e-24 * total || off == 0.0) break;
    for (int round = 0; round < 15; ++round) {
      if (lane < 8) {
        int pp, qq;
        if (lane == 0) {
          pp = round;
          qq = 15;
        } else {
          pp = (round + lane) % 15;
          qq = (round - lane + 15) % 15;
        }
        if (pp > qq) {
          const int t = pp;
          pp = qq;
          qq = t;
        }
        const double apq = s.a[pp][qq];
        double c = 1.0, sn = 0.0;
        if (fabs(apq) > 1e-300) {
          const double theta = (s.a[qq][qq] - s.a[pp][pp]) / (2.0 * apq);
          const double t = (theta >= 0 ? 1.0 : -1.0) / (fabs(theta) + sqrt(theta * theta + 1.0));
          c = 1.0 / sqrt(t * t + 1.0);
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
      for (int e = lane; e < 64; e += 32) {
        const int bi = e / 8, bj = e % 8;
        const int pi = s.rp[bi], qi = s.rq[bi], pj = s.rp[bj], qj = s.rq[bj];
        const double ci = s.rc[bi], si = s.rs[bi], cj = s.rc[bj], sj = s.rs[bj];
        const double x_pp = s.a[pi][pj], x_pq = s.a[pi][qj], x_qp = s.a[qi][pj], x_qq = s.a[qi][qj];
        const double y_pp = cj * x_pp - sj * x_pq, y_pq = sj * x_pp + cj * x_pq;  // row pi, columns rotated
        const double y_qp = cj * x_qp - sj * x_qq, y_qq = sj * x_qp + cj * x_qq;  // row qi
        const bool diag = bi == bj;  // the pair's own block: its off-diagonal is annihilated
        s.a[pi][pj] = ci * y_pp - si * y_qp;
        s.a[qi][pj] = diag ? 0.0 : si * y_pp + ci * y_qp;
        s.a[pi][qj] = diag ? 0.0 : ci * y_pq - si * y_qq;
        s.a[qi][qj] = si * y_pq + ci * y_qq;
      }
      for (int e = lane; e < 128; e += 32) {
        const int m = e / 16, k = e % 16;
        const double c = s.rc[m], sn = s.rs[m];
        const int pp = s.rp[m], qq = s.rq[m];
        const double xp = s.u[k][pp], xq = s.u[k][qq];
        s.u[k][pp] = c * xp - sn * xq;
        s.u[k][qq] = sn * xp + c * xq;
      }
      __syncwarp();
    }
  }

  // Eigenvalues descending (stable for ties, as std::stable_sort on the CPU).
  if (lane < 16) s.w[lane] = s.a[lane][lane];
  __syncwarp();
  if (lane < 16) {
    const double wi = s.w[lane];
    int rank = 0;
    for (int j = 0; j < 16; ++j) rank += (s.w[j] > wi) || (s.w[j] == wi && j < lane);
    s.order[rank] = lane;
  }
  __syncwarp();

  // Alg. 1 lines 3-4: keep the top 8 directions above the relative floor; the rest is the tail.
  const double smax2 = fmax(s.w[s.order[0]], 0.0);
  const double floor2 = fmax(smax2 * 1e-12, 1e-30);
  if (lane == 0) {
    double tail = 0.0;
    for (int k = 0; k < 16; ++k) {
      const double l = fmax(s.w[s.order[k]], 0.0);
      if (k >= kSummaryRank || l <= floor2) tail += l;
      if (k < kSummaryRank) s.sigma[k] = l <= floor2 ? 0.0 : sqrt(l);
    }
    if (p.tails) p.tails[size_t(h) * p.n_pages_pool + page] = float(tail);
  }
  __syncwarp();

  uint8_t* rec = p.records + (size_t(h) * p.n_pages_pool + page) * L::record_bytes(D);

  // Basis V = D^T U_r Sigma_r^-1, one column at a time, quantized to int4 with one scale per column.
#pragma unroll 1
  for (int k = 0; k < kSummaryRank; ++k) {
    const double sg = s.sigma[k];
    const int col = s.order[k];
    float v[D / 32];
    float amax = 0.0f;
#pragma unroll
    for (int m = 0; m < D / 32; ++m) {
      const int c = lane + 32 * m;
      float x = 0.0f;
      if (sg > 0.0) {
        const double mc = s.mu[c];
        double acc = 0.0;
#pragma unroll
        for (int i = 0; i < 16; ++i) acc = fma(double(s.keys[i][c]) - mc, s.u[i][col], acc);
        x = float(acc / sg);
      }
      v[m] = x;
      amax = fmaxf(amax, fabsf(x));
    }
    amax = warp_max(amax);
    uint16_t sbits;
    const float scale = quant_scale(amax, 7, sbits);
    const float inv = scale > 0.0f ? __frcp_rn(scale) : 0.0f;
#pragma unroll
    for (int m = 0; m < D / 32; ++m) {
      const int c = lane + 32 * m;
      const int code = quant_code(v[m], inv, 7);
      const int code_next = __shfl_down_sync(kFull, code, 1);
      if ((lane & 1) == 0)
        rec[L::basis_offset(D) + size_t(k) * (D / 2) + c / 2] = uint8_t((code + 8) | ((code_next + 8) << 4));
    }
    if (lane == 0) s.basis_scale[k] = sbits;
  }

  // Coefficients C = U_r Sigma_r: one token row per lane (lanes 0..15), int8 with one scale per row.
  if (lane < 16) {
    const int i = lane;
    float c8[kSummaryRank];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < kSummaryRank; ++k) {
      const double sg = s.sigma[k];
      c8[k] = sg > 0.0 ? float(s.u[i][s.order[k]] * sg) : 0.0f;
      amax = fmaxf(amax, fabsf(c8[k]));
    }
    uint16_t sbits;
    const float scale = quant_scale(amax, 127, sbits);
    const float inv = scale > 0.0f ? __frcp_rn(scale) : 0.0f;
#pragma unroll
    for (int k = 0; k < kSummaryRank; ++k)
      rec[L::coef_offset(D) + L::coef_byte(i, k)] = uint8_t(int8_t(quant_code(c8[k], inv, 127)));
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
    const float inv = scale > 0.0f ? __frcp_rn(scale) : 0.0f;
#pragma unroll
    for (int m = 0; m < D / 32; ++m) {
      const int c = lane + 32 * m;
      rec[L::centroid_offset(D) + L::centroid_byte(c)] = uint8_t(int8_t(quant_code(mv[m], inv, 127)));
    }
    if (lane == 0) s.centroid_scale = sbits;
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
  static bool attr_set = false;  // one-time, outside any capture (build is not part of a step)
  if (!attr_set) {
    const cudaError_t e =
        cudaFuncSetAttribute(summary_build_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
    attr_set = true;
  }
  const long items = long(p.n_pages) * p.n_head_kv;
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
  if (!p.k || !p.pages || !p.records || p.n_pages_pool <= 0) return cudaErrorInvalidValue;
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
