// Device helpers of the two select paths (select_pages.cu: a share kernel and a select kernel;
// select_cluster.cu: one kernel, a thread-block cluster per GQA group): the exact top-k's rank key,
// histogram thresholds, the radix select, Eq. 5's shares, and the launch with PDL / cluster
// attributes. The algorithm is described at the top of select_pages.cu.
#pragma once

#include <cub/block/block_scan.cuh>

#include "common.cuh"

namespace locks::cuda::detail {

constexpr int kSelectThreads = 1024;  // the select CTA (and the one-kernel path's CTAs)
constexpr int kCandCap = 4096;        // threshold-bin keys held in shared memory

// A page's 64-bit rank key: share bits above, ~index below, so that keys are distinct and equal
// shares order the lower index first. page_of inverts it.
__device__ __forceinline__ unsigned long long ranked(uint32_t key, int j) {
  return (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - uint32_t(j));
}
__device__ __forceinline__ int page_of(unsigned long long v) { return int(0xffffffffu - uint32_t(v & 0xffffffffu)); }

// Within warp 0: given per-lane counts of 32 consecutive bin groups (lane L owns bins
// [L * per, (L + 1) * per) of `bins`), find the highest bin b with count(bins >= b) >= need.
// Returns (bin, count strictly above bin) on lane 0 via the out pointers.
__device__ inline void find_threshold(const uint32_t* bins, int per, uint32_t need, int* out_bin, uint32_t* out_above) {
  const int lane = threadIdx.x & 31;
  uint32_t local = 0;
  for (int e = 0; e < per; ++e) local += bins[lane * per + e];
  uint32_t S = local;  // inclusive suffix sum over lanes
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t v = __shfl_down_sync(kFull, S, o);
    if (lane + o < 32) S += v;
  }
  const unsigned ballot = __ballot_sync(kFull, S >= need);
  const int lstar = 31 - __clz(int(ballot));
  if (lane == lstar) {
    uint32_t above = S - local;
    int bin = lane * per;
    for (int e = per - 1; e >= 0; --e) {
      const uint32_t cnt = bins[lane * per + e];
      if (above + cnt >= need) {
        bin = lane * per + e;
        break;
      }
      above += cnt;
    }
    *out_bin = bin;
    *out_above = above;
  }
}

// Block-wide version for large histograms: every thread sums `per` bins from the top
// (thread 0 owns the highest bins), a block scan gives the counts above, and the thread whose
// range crosses `need` walks its bins. Results in *out_bin / *out_above (all threads after a sync).
template <int kThreads>
__device__ void block_find_threshold(const uint32_t* bins, int n_bins, uint32_t need, int* out_bin, uint32_t* out_above,
                                     typename cub::BlockScan<uint32_t, kThreads>::TempStorage& tmp) {
  const int per = n_bins / kThreads;
  const int hi = n_bins - int(threadIdx.x) * per;  // this thread owns bins [hi - per, hi)
  uint32_t local = 0;
  for (int e = 1; e <= per; ++e) local += bins[hi - e];
  uint32_t before = 0;  // bins above this thread's range
  cub::BlockScan<uint32_t, kThreads>(tmp).ExclusiveSum(local, before);
  if (before < need && before + local >= need) {
    uint32_t above = before;
    for (int e = 1; e <= per; ++e) {
      const uint32_t c = bins[hi - e];
      if (above + c >= need) {
        *out_bin = hi - e;
        *out_above = above;
        break;
      }
      above += c;
    }
  }
  __syncthreads();
}

// A kernel's start: pages of sequence b, then the PDL wait for the previous kernel. With
// pdl_early_reads the page-table load goes out before the wait (the score pass does not write it),
// so that its round trip overlaps the previous kernel's tail instead of following it.
__device__ __forceinline__ int page_count(const SelectParams& p, int b) {
  int n = 0;
  if (p.pdl_early_reads) n = p.indptr[b + 1] - p.indptr[b];
  pdl_wait();
  pdl_launch_dependents();
  if (!p.pdl_early_reads) n = p.indptr[b + 1] - p.indptr[b];
  return n;
}

// Eq. 5 for the 4 consecutive pages at `col` (a thread's float4 of log-masses per head row): rows
// [g0, g0 + R) loaded (rows >= G, or a thread without pages: zeros, never used)...
template <int R>
__device__ __forceinline__ void load_log_mass_rows(float4 (&lm)[R], const float* col, int g0, int G, int stride,
                                                   bool valid) {
#pragma unroll
  for (int g = 0; g < R; ++g)
    lm[g] = valid && g0 + g < G ? __ldcs(reinterpret_cast<const float4*>(col + size_t(g0 + g) * stride))
                                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}
// ... and added to the pages' sums of exp(log_mass - lse_total) (lse2: log2 units; a row with no mass
// adds nothing). The rows' order is the sum's order, so both select paths give the same bits.
template <int R>
__device__ __forceinline__ void add_row_shares(float (&acc)[4], const float4 (&lm)[R], const float* lse2, int g0,
                                               int G) {
#pragma unroll
  for (int g = 0; g < R; ++g) {
    const float lt = g0 + g < G ? lse2[g0 + g] : -INFINITY;
    if (lt != -INFINITY) {
      acc[0] += exp2f(fmaf(lm[g].x, kLog2e, -lt));
      acc[1] += exp2f(fmaf(lm[g].y, kLog2e, -lt));
      acc[2] += exp2f(fmaf(lm[g].z, kLog2e, -lt));
      acc[3] += exp2f(fmaf(lm[g].w, kLog2e, -lt));
    }
  }
}
// The group average of a page's sum; NaN (bad log-masses) becomes 0, never selected ahead of a real page.
__device__ __forceinline__ float group_share(float acc, int G) {
  const float share = acc * (1.0f / float(G));
  return share >= 0.0f ? share : 0.0f;
}

// The need-th largest (1-based) of src(i), i < count, by 8-bit radix passes from the top.
template <class Src>
__device__ unsigned long long radix_select_desc(Src src, int count, uint32_t need, uint32_t* rhist, int* sh_bin,
                                                uint32_t* sh_above) {
  unsigned long long prefix = 0, mask = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) rhist[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      const unsigned long long v = src(i);
      if ((v & mask) == prefix) atomicAdd(&rhist[(v >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x < 32) find_threshold(rhist, 8, need, sh_bin, sh_above);
    __syncthreads();
    need -= *sh_above;
    prefix |= static_cast<unsigned long long>(*sh_bin) << shift;
    mask |= 0xffull << shift;
    __syncthreads();
  }
  return prefix;
}

constexpr int kSubBins = 4096;  // second-level histogram over share bits 19..8
__device__ __forceinline__ uint32_t sub_bin(unsigned long long v) { return uint32_t(v >> 40) & (kSubBins - 1); }

// The need-th largest (1-based, need <= n) of the distinct keys cand[0, n) of one threshold bin
// (n <= kCandCap), whose second-level histogram over share bits 19..8 is `sub`. Block-wide (all
// kSelectThreads threads call it). Up to one key per thread: the sub-bin that holds it, then its rank
// among that sub-bin's keys; more: a radix select over cand.
__device__ inline unsigned long long threshold_key(const unsigned long long* cand, int n, uint32_t need,
                                                   const uint32_t* sub,
                                                   typename cub::BlockScan<uint32_t, kSelectThreads>::TempStorage& tmp,
                                                   uint32_t* rhist, int* sh_bin, uint32_t* sh_above,
                                                   unsigned long long* sh_thr) {
  if (n > kSelectThreads) return radix_select_desc([&](int i) { return cand[i]; }, n, need, rhist, sh_bin, sh_above);
  block_find_threshold<kSelectThreads>(sub, kSubBins, need, sh_bin, sh_above, tmp);
  const uint32_t t2 = uint32_t(*sh_bin), need3 = need - *sh_above;  // >= 1 to take from sub-bin t2
  if (int(threadIdx.x) < n) {
    const unsigned long long v = cand[threadIdx.x];
    if (sub_bin(v) == t2) {
      uint32_t rank = 0;  // keys of t2 above v
      for (int i = 0; i < n; ++i) rank += sub_bin(cand[i]) == t2 && cand[i] > v;
      if (rank == need3 - 1) *sh_thr = v;
    }
  }
  __syncthreads();
  return *sh_thr;
}

// cluster > 0: clusters of that many CTAs along x.
template <class Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, bool pdl, cudaStream_t stream,
                   const SelectParams& p, int cluster = 0) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n_attr = 0;
  if (pdl) {
    attr[n_attr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n_attr++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 0) attr[n_attr++] = cluster_dim_attr(cluster);
  cfg.attrs = attr;
  cfg.numAttrs = unsigned(n_attr);
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

}  // namespace locks::cuda::detail
