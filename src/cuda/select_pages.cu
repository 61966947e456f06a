// Alg. 2 lines 6-9 on the GPU: group-average shares (Eq. 5) and the selected set = sink page +
// recent page + top-(k-2) others by share, ties to the lower page index. CPU twin:
// select_top_pages(..., GroupRule::kShareAverage, ...).
//
// Exact top-k without sorting 65536 floats per group: shares are >= 0, so their float bits order
// like unsigned integers. Kernel 1 (many CTAs) writes each candidate's share bits and a 2048-bin
// histogram of bits 30..20 (exponent + 3 mantissa bits). Kernel 2 (one CTA of 1024 threads per
// GQA group) finds the threshold bin from the histogram, marks every page above it, builds a
// second 4096-bin histogram (bits 19..8) of the threshold bin while collecting its pages, narrows
// again, and resolves the last few exactly by rank of the 64-bit key (share bits << 32 | ~index), so
// equal shares go to the lower index (a radix select over the same key when many remain); the
// result is read out of a bitmap in ascending order. Where the decode plan finds room
// (SelectParams::cluster_pages), one kernel does both: select_cluster.cu.
#include "kernels_internal.h"
#include "select_common.cuh"

namespace locks::cuda {

namespace {

using namespace detail;

constexpr int kShareThreads = 256;

constexpr int kSharePages = 4;  // consecutive pages per thread (16-byte loads)
constexpr int kSharePagesPerCta = kShareThreads * kSharePages;
// A share CTA with more local candidates than this (near-equal shares) writes none: select then scans
// its keys, as it would without candidates.
constexpr int kCandSpill = 512;

static_assert(kHistBins % kSelectThreads == 0, "select threads load the histogram evenly");

// GT: the group size rounded up to 8 or 16, so that G <= 8 holds half the log-mass registers (48
// instead of 90 registers: 5 instead of 2 CTAs per SM, more loads in flight). MERGE: lse_total from
// the chunk statistics (p.chunk_stats), a separate instance because the merge costs registers (60
// at G <= 8, 4 CTAs per SM), which slows the batches that do not need it.
template <int GT, bool MERGE>
__global__ void __launch_bounds__(kShareThreads) share_hist_kernel(SelectParams p) {
  __shared__ uint32_t hist[kHistBins];
  __shared__ float lse2[kMaxGroup];
  __shared__ uint32_t loc_keys[kSharePagesPerCta];  // this CTA's keys, bit 31 set (0: no key)
  __shared__ int loc_bin, loc_count;
  __shared__ uint32_t loc_above;
  __shared__ typename cub::BlockScan<uint32_t, kShareThreads>::TempStorage scan_tmp;
  const int b = blockIdx.z, h = blockIdx.y;
  const size_t bh = size_t(b) * p.n_head_kv + h;
  const int n = page_count(p, b);
  const int j0 = blockIdx.x * kSharePagesPerCta;
  if (j0 >= n || n > p.log_mass_stride) return;  // (too many pages: bad input, see select_kernel)
  const int k = max(p.budget_pages, 2);
  const bool topk = n > k;
  const int j = j0 + threadIdx.x * kSharePages;  // pages j .. j+3 (the stride is a multiple of 8)
  // Eq. 5: m_bar_j = (1/G) sum_g exp(s_hat_j(q_g) - logsumexp_j' s_hat_j'(q_g)). The G log-mass loads
  // go out before the barrier that publishes lse_total, so both round trips overlap. Streaming loads
  // (read once; the score pass left them in the L2 with evict_last).
  float4 lm[GT];
  load_log_mass_rows(lm, p.log_mass + bh * p.group * p.log_mass_stride + j, 0, p.group, p.log_mass_stride, j < n);
  for (int i = threadIdx.x; i < kHistBins; i += kShareThreads) hist[i] = 0;
  if (threadIdx.x == 0) {
    loc_bin = 0;  // fewer keys here than the budget takes: every one is a candidate
    loc_count = 0;
  }
  if constexpr (MERGE) {
    // The normaliser from the score pass's chunk statistics, merged by every CTA: warp w merges head
    // rows w and w + 8, whose chunks lie contiguously ([row][chunk]), so the lanes' loads coalesce;
    // the first 128 chunks of a row are loaded at once, in the round trip of the log-mass loads. CTA 0
    // publishes the result as lse_total. (Staging them through shared memory from a [chunk][row]
    // layout, 8 bytes per copy, makes them arrive much later.)
    constexpr int kWarps = kShareThreads / 32;
    const int G = p.group;
    merge_chunk_stats<GT / kWarps>(reinterpret_cast<const float2*>(p.chunk_stats) + bh * 16 * p.n_chunks, p.n_chunks,
                                   p.n_chunks, G, int(threadIdx.x >> 5), kWarps, [&](int r, float v) {
                                     lse2[r] = v;
                                     if (blockIdx.x == 0) p.lse_total[bh * G + r] = v * kLn2;
                                   });
  } else if (threadIdx.x < p.group) {
    lse2[threadIdx.x] = p.lse_total[bh * p.group + threadIdx.x] * kLog2e;
  }
  __syncthreads();
  if (isnan(lse2[0])) return;  // bad input (score_pages): no histogram; select_kernel gives n_selected = -1
#pragma unroll
  for (int e = 0; e < kSharePages; ++e) loc_keys[threadIdx.x * kSharePages + e] = 0u;  // position 0, n - 1, >= n
  if (j < n) {
    float acc[kSharePages] = {0.0f, 0.0f, 0.0f, 0.0f};
    add_row_shares(acc, lm, lse2, 0, p.group);
#pragma unroll
    for (int e = 0; e < kSharePages; ++e) {
      const int jj = j + e;
      if (jj < n) {
        const float share = group_share(acc[e], p.group);
        if (p.shares) p.shares[bh * p.log_mass_stride + jj] = share;
        if (topk && jj >= 1 && jj <= n - 2) {
          const uint32_t key = __float_as_uint(share);
          p.keys[bh * p.log_mass_stride + jj] = key;
          atomicAdd(&hist[key >> 20], 1u);
          loc_keys[threadIdx.x * kSharePages + e] = key | 0x80000000u;  // shares are >= 0: bit 31 is free
        }
      }
    }
  }
  if (!topk) return;
  __syncthreads();
  uint32_t* gh = p.hist + bh * kHistBins;
  for (int i = threadIdx.x; i < kHistBins; i += kShareThreads)
    if (hist[i]) atomicAdd(gh + i, hist[i]);
  if (!p.candidates || k == 2) return;
  // This CTA's candidates: its keys in bins >= its own threshold bin for the k - 2 largest. A page
  // outside them has k - 2 larger keys in this CTA alone, so it is not among the k - 2 largest of the
  // sequence, and every key in the global threshold bin or above is a candidate of its CTA. Above
  // kCandSpill candidates (near-equal shares) the CTA writes none and select scans its keys instead.
  block_find_threshold<kShareThreads>(hist, kHistBins, uint32_t(k - 2), &loc_bin, &loc_above, scan_tmp);
  unsigned long long* out = p.candidates + bh * p.log_mass_stride + size_t(blockIdx.x) * kSharePagesPerCta;
  const uint32_t tb = uint32_t(loc_bin);
#pragma unroll
  for (int e = 0; e < kSharePages; ++e) {
    const uint32_t mk = loc_keys[threadIdx.x * kSharePages + e], key = mk & 0x7fffffffu;
    if ((mk & 0x80000000u) && (key >> 20) >= tb) {
      const int pos = atomicAdd(&loc_count, 1);
      if (pos < kCandSpill) out[pos] = ranked(key, j + e);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) p.n_candidates[bh * gridDim.x + blockIdx.x] = loc_count <= kCandSpill ? loc_count : -1;
}

__global__ void __launch_bounds__(kSelectThreads) select_kernel(SelectParams p) {
  // Dynamic: hist [kSubBins] (the first kHistBins hold the main histogram, then the second level),
  // cand [kCandCap] (u64), bitmap [ceil(log_mass_stride / 32)].
  extern __shared__ __align__(16) uint32_t dyn[];
  uint32_t* hist = dyn;
  unsigned long long* cand = reinterpret_cast<unsigned long long*>(dyn + kSubBins);
  uint32_t* bitmap = dyn + kSubBins + 2 * kCandCap;
  __shared__ uint32_t rhist[256];
  __shared__ int sh_bin;
  __shared__ uint32_t sh_above;
  __shared__ int sh_ncand;
  __shared__ unsigned long long sh_thr;
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ typename cub::BlockScan<uint32_t, kSelectThreads>::TempStorage uscan_tmp;

  const int b = blockIdx.y, h = blockIdx.x;
  const size_t bh = size_t(b) * p.n_head_kv + h;
  const int n = page_count(p, b);
  uint32_t* gh = p.hist + bh * kHistBins;
  // The histogram's loads go out with lse_total's (one round trip; unused when the budget covers the
  // sequence, whose histogram is empty).
  uint32_t hv[kHistBins / kSelectThreads];
#pragma unroll
  for (int e = 0; e < kHistBins / kSelectThreads; ++e) hv[e] = gh[threadIdx.x + e * kSelectThreads];
  const float lse0 = p.lse_total[bh * p.group];
  const int k = max(p.budget_pages, 2);
  int32_t* out = p.selected + bh * p.budget_pages;
  if (n < 0 || n > p.log_mass_stride || isnan(lse0)) {  // bad input (score_pages set the status)
    if (threadIdx.x == 0) p.n_selected[bh] = -1;
    return;
  }
  if (n <= k) {  // the budget covers the sequence: every page (equals dense)
    for (int j = threadIdx.x; j < n; j += kSelectThreads) out[j] = j;
    if (threadIdx.x == 0) p.n_selected[bh] = max(n, 0);
    return;
  }
  const uint32_t need = uint32_t(k - 2);
  const uint32_t* keys = p.keys + bh * p.log_mass_stride;

#pragma unroll
  for (int e = 0; e < kHistBins / kSelectThreads; ++e) hist[threadIdx.x + e * kSelectThreads] = hv[e];
  const int n_words = (n + 31) / 32;
  for (int i = threadIdx.x; i < n_words; i += kSelectThreads) bitmap[i] = 0;
  if (threadIdx.x == 0) sh_ncand = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < kHistBins; i += kSelectThreads) gh[i] = 0;  // clean for the next step
  if (need == 0) {                                                          // k == 2: the sink and the recent page only
    if (threadIdx.x == 0) {
      out[0] = 0;
      out[1] = n - 1;
      p.n_selected[bh] = 2;
    }
    return;
  }
  block_find_threshold<kSelectThreads>(hist, kHistBins, need, &sh_bin, &sh_above, uscan_tmp);
  const uint32_t tstar = uint32_t(sh_bin);
  const uint32_t need2 = need - sh_above;  // >= 1 pages still to take from the threshold bin
  for (int i = threadIdx.x; i < kSubBins; i += kSelectThreads) hist[i] = 0;
  __syncthreads();

  // Pages above the threshold bin are in; the threshold bin's pages are candidates.
  auto take_key = [&](uint32_t key, int j) {
    const uint32_t bin = key >> 20;
    if (bin > tstar) {
      atomicOr(&bitmap[j >> 5], 1u << (j & 31));
    } else if (bin == tstar) {
      atomicAdd(&hist[(key >> 8) & (kSubBins - 1)], 1u);
      const int pos = atomicAdd(&sh_ncand, 1);
      if (pos < kCandCap) cand[pos] = ranked(key, j);
    }
  };
  // Keys [lo, hi) read 4 at a time by `threads` threads (t = this one's index among them), 8 loads in
  // flight per thread (positions 0, n-1 and >= n are skipped).
  auto scan_keys = [&](int lo, int hi, int t, int threads) {
    const uint4* k4 = reinterpret_cast<const uint4*>(keys);
    const int n4 = (hi + 3) / 4;
    constexpr int U = 8;  // one round of loads covers 32K keys with 1024 threads: the scan is load-latency bound
    for (int base = lo / 4 + t; base < n4; base += threads * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i4 = base + u * threads;
        v[u] = i4 < n4 ? __ldcg(k4 + i4) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = (base + u * threads) * 4 + e;
          if (j < 1 || j > n - 2 || j >= hi) continue;
          take_key(w[e], j);
        }
      }
    }
  };
  if (p.candidates) {
    // The share kernel's per-CTA candidates (a superset of the pages in or above the threshold bin):
    // warp w takes the lists of share CTAs w, w + 32, ...; their lengths come in one round trip, the
    // entries 256 per list at a time. A list of -1 (too many near-equal shares) is that CTA's keys.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_lists = (n + kSharePagesPerCta - 1) / kSharePagesPerCta;
    const int stride_lists = (p.log_mass_stride + kSharePagesPerCta - 1) / kSharePagesPerCta;
    const int32_t* counts = p.n_candidates + bh * stride_lists;
    const unsigned long long* lists = p.candidates + bh * p.log_mass_stride;
    constexpr int kWarps = kSelectThreads / 32;
    for (int c0 = warp; c0 < n_lists; c0 += kWarps * 32) {
      const int my_list = c0 + kWarps * lane;
      const int my_count = my_list < n_lists ? __ldcg(counts + my_list) : 0;
      for (int r = 0; r < 32 && c0 + kWarps * r < n_lists; ++r) {
        const int c = c0 + kWarps * r;
        const int m = __shfl_sync(kFull, my_count, r);
        if (m < 0) {
          scan_keys(c * kSharePagesPerCta, min(n, (c + 1) * kSharePagesPerCta), lane, 32);
          continue;
        }
        const unsigned long long* list = lists + size_t(c) * kSharePagesPerCta;
        for (int b0 = 0; b0 < m; b0 += 256) {
          unsigned long long v[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const int e = b0 + lane + 32 * u;
            v[u] = e < m ? __ldcg(list + e) : 0ull;
          }
#pragma unroll
          for (int u = 0; u < 8; ++u)
            if (b0 + lane + 32 * u < m) take_key(uint32_t(v[u] >> 32), page_of(v[u]));
        }
      }
    }
  } else {
    scan_keys(0, n, int(threadIdx.x), kSelectThreads);
  }
  __syncthreads();
  const int n_cand = sh_ncand;
  if (n_cand <= kCandCap) {
    // Every candidate from the need2-th largest up is in (the 64-bit keys are distinct).
    const unsigned long long thr =
        threshold_key(cand, n_cand, need2, hist, uscan_tmp, rhist, &sh_bin, &sh_above, &sh_thr);
    for (int i = threadIdx.x; i < n_cand; i += kSelectThreads) {
      const unsigned long long v = cand[i];
      if (v >= thr) {
        const int j = page_of(v);
        atomicOr(&bitmap[j >> 5], 1u << (j & 31));
      }
    }
  } else {
    // Very many equal-looking shares (e.g. identical pages): the same select over global memory.
    auto src = [&](int i) -> unsigned long long {
      const uint32_t key = keys[i + 1];
      return (key >> 20) == tstar ? ranked(key, i + 1) : 0ull;
    };
    const unsigned long long thr = radix_select_desc(src, n - 2, need2, rhist, &sh_bin, &sh_above);
    for (int i = threadIdx.x; i < n - 2; i += kSelectThreads) {
      const unsigned long long v = src(i);
      if (v != 0ull && v >= thr) {
        const uint32_t j = uint32_t(i + 1);
        atomicOr(&bitmap[j >> 5], 1u << (j & 31));
      }
    }
  }
  if (threadIdx.x == 0) {
    atomicOr(&bitmap[0], 1u);                               // sink page
    atomicOr(&bitmap[(n - 1) >> 5], 1u << ((n - 1) & 31));  // recent page
  }
  __syncthreads();

  // Bitmap -> ascending positions.
  const int per = (n_words + kSelectThreads - 1) / kSelectThreads;
  const int w0 = threadIdx.x * per, w1 = min(n_words, w0 + per);
  int cnt = 0;
  for (int w = w0; w < w1; ++w) cnt += __popc(bitmap[w]);
  int offset = 0;
  Scan(scan_tmp).ExclusiveSum(cnt, offset);
  for (int w = w0; w < w1; ++w) {
    uint32_t bits = bitmap[w];
    while (bits) {
      const int e = __ffs(int(bits)) - 1;
      bits &= bits - 1;
      if (offset < k) out[offset] = w * 32 + e;
      ++offset;
    }
  }
  if (threadIdx.x == 0) p.n_selected[bh] = k;
}

// The share kernel's instance for a group size, with or without the lse_total merge.
auto share_kernel_for(int group, bool merge) {
  return group <= 8 ? (merge ? share_hist_kernel<8, true> : share_hist_kernel<8, false>)
                    : (merge ? share_hist_kernel<kMaxGroup, true> : share_hist_kernel<kMaxGroup, false>);
}

}  // namespace

size_t select_dynamic_smem(int log_mass_stride) {
  return sizeof(uint32_t) * (kSubBins + 2 * size_t(kCandCap) + size_t((log_mass_stride + 31) / 32));
}

cudaError_t prepare_select(int log_mass_stride) {
  return allow_dynamic_smem<select_kernel>(select_dynamic_smem(log_mass_stride));
}

int share_ctas_per_sm(int group, bool merge) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, share_kernel_for(group, merge), kShareThreads, 0) !=
      cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  return n > 0 ? n : 1;
}

int share_pages_per_cta() { return kSharePagesPerCta; }

cudaError_t select_pages(const SelectParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.n_head_kv <= 0) return cudaSuccess;
  const bool one_kernel = p.cluster_pages != 0;
  if (p.group < 1 || p.group > kMaxGroup || p.budget_pages < 2 || p.log_mass_stride <= 0 || !p.indptr || !p.log_mass ||
      !p.lse_total || (!one_kernel && (!p.keys || !p.hist)) || !p.selected || !p.n_selected ||
      (p.chunk_stats && p.n_chunks < 1) || (!p.candidates != !p.n_candidates) ||
      (!one_kernel && (p.score_ready || p.ready_seen)))
    return cudaErrorInvalidValue;
  if (one_kernel) return select_pages_in_clusters(p, stream);
  const size_t dyn = select_dynamic_smem(p.log_mass_stride);
  cudaError_t e = allow_dynamic_smem<select_kernel>(dyn);
  if (e != cudaSuccess) return e;
  const dim3 g1(unsigned((p.log_mass_stride + kSharePagesPerCta - 1) / kSharePagesPerCta), unsigned(p.n_head_kv),
                unsigned(p.batch));
  e = launch(share_kernel_for(p.group, p.chunk_stats != nullptr), g1, dim3(kShareThreads), 0, p.pdl, stream, p);
  if (e != cudaSuccess) return e;
  return launch(select_kernel, dim3(unsigned(p.n_head_kv), unsigned(p.batch)), dim3(kSelectThreads), dyn, p.pdl, stream,
                p);
}

}  // namespace locks::cuda
