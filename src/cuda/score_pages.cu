// Eq. 4 on the GPU: the score of every page from its summary alone, for the whole GQA group from
// one read of each summary. CPU twin: PageSummaryStore::score (and exact_log_mass for the partial
// recent page, as LocksSelector::select does).
//
// Per page and query head g (q' = q * 2^-e_g, a power-of-two prescale so f16 is safe):
//   W[g][k]  = bs_k * sum_x q'_g[x] Vcode_k[x]          (tensor cores, m16n8k16, q' split hi + lo)
//   a[g]     = ms   * sum_x q'_g[x] mucode[x]           (tensor cores, 8 pages per MMA)
//   z[g][i]  = a[g] + cs_i * sum_k W[g][k] Ccode[i][k]  (tensor cores, m16n8k8, W split hi + lo)
//   s_hat    = logsumexp_i z[g][i] * scale / 2^-e_g     (exp2 on the quad of lanes holding row g)
// Rows of the MMAs are the G query heads: G <= 8 puts the hi parts of q in rows 0..7 and the lo parts
// in rows 8..15 (one MMA), 8 < G <= 16 uses rows for heads and two MMAs (hi, lo).
//
// K permutation (the d dimension of Q x basis): lane 4g+t reads the 16 (d 128) or 8 (d 64) bytes
// [t*d/8, (t+1)*d/8) of basis column g; k-step 2w+hh of that lane covers dims
// t*d/4 + 8w + {2hh, 4+2hh} (K slots 2t, 2t+1) and + {1+2hh, 5+2hh} (K slots 2t+8, 2t+9), which is
// exactly the order unpack_int4x8 produces. The q fragments are built in the same order.
#include <cfloat>
#include <cmath>

#include "common.cuh"
#include "record_layout.h"

namespace locks::cuda {

namespace {

using namespace detail;
namespace L = layout;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

template <int D>
struct BasisWords;
template <>
struct BasisWords<128> {
  uint4 v;
  __device__ __forceinline__ void load(const uint8_t* p) { v = __ldcs(reinterpret_cast<const uint4*>(p)); }
  __device__ __forceinline__ void zero() { v = make_uint4(0u, 0u, 0u, 0u); }
  __device__ __forceinline__ uint32_t word(int w) const { return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w; }
};
template <>
struct BasisWords<64> {
  uint2 v;
  __device__ __forceinline__ void load(const uint8_t* p) { v = __ldcs(reinterpret_cast<const uint2*>(p)); }
  __device__ __forceinline__ void zero() { v = make_uint2(0u, 0u); }
  __device__ __forceinline__ uint32_t word(int w) const { return w == 0 ? v.x : v.y; }
};

__device__ __forceinline__ uint32_t u4_word(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// Combine two (max, sum-of-exp2) pairs; -inf maxima carry no mass.
__device__ __forceinline__ void lse2_merge(float& m, float& l, float m2, float l2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;
  l = (m == -INFINITY ? 0.0f : l * exp2f(m - mn)) + (m2 == -INFINITY ? 0.0f : l2 * exp2f(m2 - mn));
  m = mn;
}

template <int D, int GT>
__global__ void __launch_bounds__(kThreads) score_kernel(ScoreParams p) {
  constexpr int KS = D / 16;     // k-steps of the Q x basis product
  constexpr int ROWS = GT / 8;   // MMA rows per lane that are real heads (1 or 2)
  constexpr size_t REC = L::record_bytes(D);

  __shared__ float q_s[GT][D];
  __shared__ float q_scale[GT];
  __shared__ float ex_logit[GT][16];
  __shared__ float ex_s2[GT];
  __shared__ float warp_m[kWarps][GT], warp_l[kWarps][GT];
  __shared__ int last_flag;

  const int b = blockIdx.z, h = blockIdx.y, c = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int H = p.kv.n_head_kv, G = p.group;

  pdl_wait();
  pdl_launch_dependents();
  const int pbeg = p.kv.indptr[b];
  const int n_pages = p.kv.indptr[b + 1] - pbeg;
  if (n_pages <= 0) return;
  const int last_len = p.kv.last_page_len[b];
  const bool partial = last_len < kPageSize;
  const int n_scored = partial ? n_pages - 1 : n_pages;  // pages scored from summaries
  const int active = max(1, (n_scored + p.chunk_pages - 1) / p.chunk_pages);
  if (c >= active) return;
  const size_t bh = size_t(b) * H + h;

  // q of the group -> shared memory; power-of-two prescale per head (max |q'| in [0.5, 1)).
  const float* qg = p.q + bh * G * D;
  for (int e = threadIdx.x; e < GT * D; e += kThreads) q_s[e / D][e % D] = (e / D) < G ? qg[e] : 0.0f;
  __syncthreads();
  for (int r = warp; r < GT; r += kWarps) {
    float amax = 0.0f;
    for (int x = lane; x < D; x += 32) amax = fmaxf(amax, fabsf(q_s[r][x]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
    if (lane == 0) {
      int e = 0;
      if (amax > 0.0f && amax < INFINITY) frexpf(amax, &e);
      q_scale[r] = ldexpf(1.0f, -e);
    }
  }

  // The partial recent page: exact log-mass from its keys (CPU: exact_log_mass), CTA 0 only.
  const bool do_exact = partial && c == 0;
  if (do_exact) {
    const int32_t id = p.kv.indices[pbeg + n_pages - 1];
    const uint16_t* kp = static_cast<const uint16_t*>(p.kv.k) + (size_t(id) * H + h) * size_t(kPageSize) * D;
    const bool bf16 = p.kv.dtype == KvType::kBF16;
    for (int e = threadIdx.x; e < last_len * G; e += kThreads) {
      const int i = e / G, r = e % G;
      const uint4* row = reinterpret_cast<const uint4*>(kp + size_t(i) * D);
      float acc = 0.0f;
#pragma unroll 4
      for (int x8 = 0; x8 < D / 8; ++x8) {
        const uint4 v = __ldg(row + x8);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const uint32_t u = u4_word(v, w);
          acc = fmaf(q_s[r][x8 * 8 + 2 * w], kv_to_float(uint16_t(u & 0xffffu), bf16), acc);
          acc = fmaf(q_s[r][x8 * 8 + 2 * w + 1], kv_to_float(uint16_t(u >> 16), bf16), acc);
        }
      }
      ex_logit[r][i] = acc * p.scale * kLog2e;
    }
  }
  __syncthreads();
  if (do_exact && threadIdx.x < G) {
    const int r = threadIdx.x;
    float mx = -INFINITY;
    for (int i = 0; i < last_len; ++i) mx = fmaxf(mx, ex_logit[r][i]);
    float sum = 0.0f;
    for (int i = 0; i < last_len; ++i) sum += exp2f(ex_logit[r][i] - mx);
    const float s2 = mx + log2f(sum);
    ex_s2[r] = s2;
    p.log_mass[(bh * G + r) * p.log_mass_stride + (n_pages - 1)] = s2 * kLn2;
  }

  // A fragments of q' (hi/lo), in the K permutation described at the top of the file.
  uint32_t aq[KS][4];
  uint32_t aq_lo[ROWS == 2 ? KS : 1][4];
  float kq[ROWS];  // logits scale per row: scale * log2(e) / 2^-e
  {
    const int base = t * (D / 4);
    const float s0 = q_scale[g];
    const float s1 = q_scale[ROWS == 2 ? g + 8 : g];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const int w = kk >> 1, hh = kk & 1;
      const int d0 = base + 8 * w + 2 * hh, d1 = d0 + 4, d2 = d0 + 1, d3 = d0 + 5;
      uint32_t h01, l01, h23, l23;
      Pack<__half>::split(q_s[g][d0] * s0, q_s[g][d1] * s0, h01, l01);
      Pack<__half>::split(q_s[g][d2] * s0, q_s[g][d3] * s0, h23, l23);
      if constexpr (ROWS == 1) {
        aq[kk][0] = h01;
        aq[kk][1] = l01;
        aq[kk][2] = h23;
        aq[kk][3] = l23;
      } else {
        uint32_t h01b, l01b, h23b, l23b;
        Pack<__half>::split(q_s[g + 8][d0] * s1, q_s[g + 8][d1] * s1, h01b, l01b);
        Pack<__half>::split(q_s[g + 8][d2] * s1, q_s[g + 8][d3] * s1, h23b, l23b);
        aq[kk][0] = h01;
        aq[kk][1] = h01b;
        aq[kk][2] = h23;
        aq[kk][3] = h23b;
        aq_lo[kk][0] = l01;
        aq_lo[kk][1] = l01b;
        aq_lo[kk][2] = l23;
        aq_lo[kk][3] = l23b;
      }
    }
    kq[0] = p.scale * kLog2e / s0;
    if constexpr (ROWS == 2) kq[ROWS - 1] = p.scale * kLog2e / s1;
  }

  float run_m[ROWS], run_l[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    run_m[r] = -INFINITY;
    run_l[r] = 0.0f;
  }

  const uint8_t* recs = p.summaries + size_t(h) * p.n_pages_pool * REC;
  const int oct_per_chunk = p.chunk_pages / 8;
  const int oct_end = min((c + 1) * oct_per_chunk, (n_scored + 7) / 8);
  float* lm_row0 = p.log_mass + (bh * G + g) * p.log_mass_stride;
  float* lm_row1 = p.log_mass + (bh * G + (ROWS == 2 ? g + 8 : g)) * p.log_mass_stride;

  for (int o = c * oct_per_chunk + warp; o < oct_end; o += kWarps) {
    const int p0 = o * 8;
    // Loads for the 8 pages of the octet: basis column g (lane chunk t), the coefficient word of
    // this lane, the scales chunk t; the centroid of page g (lane chunk t).
    BasisWords<D> bw[8];
    uint32_t cw[8];
    uint4 sc[8];
#pragma unroll
    for (int pi = 0; pi < 8; ++pi) {
      const int pos = p0 + pi;
      if (pos < n_scored) {
        const uint8_t* rec = recs + size_t(__ldg(p.kv.indices + pbeg + pos)) * REC;
        bw[pi].load(rec + L::basis_offset(D) + g * (D / 2) + t * (D / 8));
        cw[pi] = __ldcs(reinterpret_cast<const uint32_t*>(rec + L::coef_offset(D)) + lane);
        sc[pi] = __ldcs(reinterpret_cast<const uint4*>(rec + L::scales_offset(D)) + t);
      } else {
        bw[pi].zero();
        cw[pi] = 0u;
        sc[pi] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    uint4 cen[D / 64];
    {
      const int pos = p0 + g;
      if (pos < n_scored) {
        const uint8_t* rec = recs + size_t(__ldg(p.kv.indices + pbeg + pos)) * REC;
        const uint4* src = reinterpret_cast<const uint4*>(rec + L::centroid_offset(D) + t * (D / 4));
#pragma unroll
        for (int x = 0; x < D / 64; ++x) cen[x] = __ldcs(src + x);
      } else {
#pragma unroll
        for (int x = 0; x < D / 64; ++x) cen[x] = make_uint4(0u, 0u, 0u, 0u);
      }
    }

    // a[g][page] = q'_g . mucode for the 8 pages (pages are the MMA's columns).
    float acc_c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int w = 0; w < D / 32; ++w) {
      uint32_t b0, b1, b2, b3;
      unpack_int8x4(u4_word(cen[w / 2], (w % 2) * 2), b0, b1);
      unpack_int8x4(u4_word(cen[w / 2], (w % 2) * 2 + 1), b2, b3);
      mma_16816(acc_c, aq[2 * w], b0, b1, __half());
      mma_16816(acc_c, aq[2 * w + 1], b2, b3, __half());
      if constexpr (ROWS == 2) {
        mma_16816(acc_c, aq_lo[2 * w], b0, b1, __half());
        mma_16816(acc_c, aq_lo[2 * w + 1], b2, b3, __half());
      }
    }
    float cen_even[ROWS], cen_odd[ROWS];  // page 2t, 2t+1 of this lane's column pair
    if constexpr (ROWS == 1) {
      cen_even[0] = acc_c[0] + acc_c[2];
      cen_odd[0] = acc_c[1] + acc_c[3];
    } else {
      cen_even[0] = acc_c[0];
      cen_odd[0] = acc_c[1];
      cen_even[ROWS - 1] = acc_c[2];
      cen_odd[ROWS - 1] = acc_c[3];
    }

    float keep[ROWS][2] = {};
#pragma unroll
    for (int pi = 0; pi < 8; ++pi) {
      // W = q' x basis codes (rows: heads, columns: basis columns k).
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int w = 0; w < D / 32; ++w) {
        uint32_t bb[4];
        unpack_int4x8(bw[pi].word(w), bb);
        mma_16816(acc, aq[2 * w], bb[0], bb[1], __half());
        mma_16816(acc, aq[2 * w + 1], bb[2], bb[3], __half());
        if constexpr (ROWS == 2) {
          mma_16816(acc, aq_lo[2 * w], bb[0], bb[1], __half());
          mma_16816(acc, aq_lo[2 * w + 1], bb[2], bb[3], __half());
        }
      }
      const float bs0 = h2f_lo(sc[pi].z), bs1 = h2f_hi(sc[pi].z), ms = h2f_lo(sc[pi].w);
      const float cs[4] = {h2f_lo(sc[pi].x), h2f_hi(sc[pi].x), h2f_lo(sc[pi].y), h2f_hi(sc[pi].y)};
      uint32_t cb0, cb1;  // coefficient codes: tokens g (tile 0) and g+8 (tile 1), columns 2t, 2t+1
      unpack_int8x4(cw[pi], cb0, cb1);
      float o0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, o1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if constexpr (ROWS == 1) {
        uint32_t whi, wlo;
        Pack<__half>::split((acc[0] + acc[2]) * bs0, (acc[1] + acc[3]) * bs1, whi, wlo);
        mma_1688_f16(o0, whi, wlo, cb0);
        mma_1688_f16(o1, whi, wlo, cb1);
      } else {
        uint32_t h0, l0, h1, l1;
        Pack<__half>::split(acc[0] * bs0, acc[1] * bs1, h0, l0);
        Pack<__half>::split(acc[2] * bs0, acc[3] * bs1, h1, l1);
        mma_1688_f16(o0, h0, h1, cb0);
        mma_1688_f16(o0, l0, l1, cb0);
        mma_1688_f16(o1, h0, h1, cb1);
        mma_1688_f16(o1, l0, l1, cb1);
      }
      const int src = (lane & ~3) | (pi >> 1);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float a = __shfl_sync(kFull, (pi & 1) ? cen_odd[r] : cen_even[r], src);
        float z[4];
        if constexpr (ROWS == 1) {
          z[0] = o0[0] + o0[2];
          z[1] = o0[1] + o0[3];
          z[2] = o1[0] + o1[2];
          z[3] = o1[1] + o1[3];
        } else {
          z[0] = o0[2 * r];
          z[1] = o0[2 * r + 1];
          z[2] = o1[2 * r];
          z[3] = o1[2 * r + 1];
        }
        const float base = a * ms;
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          z[i] = fmaf(cs[i], z[i], base) * kq[r];
          mx = fmaxf(mx, z[i]);
        }
        mx = quad_max(mx);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) sum += exp2f(z[i] - mx);
        sum = quad_sum(sum);
        const float s2 = mx + __log2f(sum);
        if ((pi >> 1) == t) keep[r][pi & 1] = s2;
      }
    }
    // Lane t owns pages p0 + 2t, p0 + 2t + 1.
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int pos = p0 + 2 * t + e;
      if (pos < n_scored) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const int row = g + 8 * r;
          if (row < G) {
            (r == 0 ? lm_row0 : lm_row1)[pos] = keep[r][e] * kLn2;
            lse2_merge(run_m[r], run_l[r], keep[r][e], 1.0f);
          }
        }
      }
    }
  }

  // Chunk statistics: quad -> warp -> CTA, plus the exact page in CTA 0.
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float m = run_m[r], l = run_l[r];
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      const float m2 = __shfl_xor_sync(kFull, m, o), l2 = __shfl_xor_sync(kFull, l, o);
      lse2_merge(m, l, m2, l2);
    }
    if (t == 0) {
      warp_m[warp][g + 8 * r] = m;
      warp_l[warp][g + 8 * r] = l;
    }
  }
  __syncthreads();
  const int n_chunks = p.n_chunks;
  if (threadIdx.x < G) {
    const int r = threadIdx.x;
    float m = -INFINITY, l = 0.0f;
    for (int w = 0; w < kWarps; ++w) lse2_merge(m, l, warp_m[w][r], warp_l[w][r]);
    if (do_exact) lse2_merge(m, l, ex_s2[r], 1.0f);
    reinterpret_cast<float2*>(p.chunk_stats)[(bh * n_chunks + c) * 16 + r] = make_float2(m, l);
  }
  if (!last_cta_done(p.counters + bh, uint32_t(active), &last_flag)) return;

  // Last CTA of (b, h): lse_total[g] = logsumexp over every page (the share normaliser, Eq. 5).
  const float2* cs2 = reinterpret_cast<const float2*>(p.chunk_stats) + bh * n_chunks * 16;
  for (int r = warp; r < G; r += kWarps) {
    float m = -INFINITY, l = 0.0f;
    for (int cc = lane; cc < active; cc += 32) {
      const float2 v = __ldcg(cs2 + size_t(cc) * 16 + r);
      lse2_merge(m, l, v.x, v.y);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(kFull, m, o), l2 = __shfl_xor_sync(kFull, l, o);
      lse2_merge(m, l, m2, l2);
    }
    if (lane == 0) p.lse_total[bh * G + r] = m == -INFINITY ? -INFINITY : (m + log2f(l)) * kLn2;
  }
}

template <int D, int GT>
cudaError_t launch_score(const ScoreParams& p, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(p.n_chunks), unsigned(p.kv.n_head_kv), unsigned(p.kv.batch));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, score_kernel<D, GT>, p);
}

}  // namespace

cudaError_t score_pages(const ScoreParams& p, cudaStream_t stream) {
  if (p.kv.batch <= 0 || p.kv.n_head_kv <= 0) return cudaSuccess;
  if (p.group < 1 || p.group > kMaxGroup || p.chunk_pages <= 0 || p.chunk_pages % 32 != 0 || p.n_chunks <= 0 ||
      p.log_mass_stride <= 0 || !p.q || !p.summaries || !p.log_mass || !p.lse_total || !p.chunk_stats ||
      !p.counters || !p.kv.indptr || !p.kv.indices || !p.kv.last_page_len || !p.kv.k)
    return cudaErrorInvalidValue;
  const bool wide = p.group > 8;
  switch (p.kv.head_dim) {
    case 64: return wide ? launch_score<64, 16>(p, stream) : launch_score<64, 8>(p, stream);
    case 128: return wide ? launch_score<128, 16>(p, stream) : launch_score<128, 8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace locks::cuda
