// Alg. 2 lines 6-9 in one kernel (SelectParams::cluster_pages): the shares and the selection of
// select_pages.cu's two kernels, bit for bit, by a thread-block cluster of up to 16 CTAs per
// (sequence, KV head). What the two kernels pass through global memory (keys, the histogram, the
// candidate lists) stays in shared memory and crosses the cluster through distributed shared memory.
#include <cooperative_groups.h>

#include <cub/block/block_reduce.cuh>

#include "kernels_internal.h"
#include "select_common.cuh"

namespace locks::cuda {

namespace {

using namespace detail;

// One kernel for shares and selection (SelectParams::cluster_pages): a cluster of C CTAs per
// (sequence, KV head), CTA r holding pages [r * P, (r + 1) * P) (4 per thread and round of loads, up
// to 8 rounds). What the two
// kernels pass through global memory (keys, the histogram, candidate lists) stays in shared memory
// and crosses the cluster through DSMEM: every CTA sums the cluster's histograms and finds the
// threshold bin itself (barrier 1), sends its threshold-bin keys and its count of pages above the bin
// to the leader (CTA 0; barrier 2), which resolves the bin exactly and sends each CTA the threshold
// key and the offset of its positions (barrier 3).
constexpr int kFusedThreads = kSelectThreads;
constexpr int kMaxSelectCluster = kSelectClusterMaxCtas;
constexpr int kDirectGather = 2;                // clusters up to this size sum the histograms directly (below)
constexpr int kRankCandidates = 256;            // the leader ranks up to this many candidates directly
constexpr int kRoundPages = 4 * kFusedThreads;  // pages of one round of loads (4 per thread)
static_assert(kClusterSelectPages % kRoundPages == 0 && kClusterSelectPages / 32 <= kFusedThreads,
              "whole rounds; one bitmap word per thread");

// The dynamic shared memory: this header, then the CTA's keys[P] (bit 31 set: the page's key, for
// positions 1 .. n - 2 only) and bitmap[P / 32], so that a CTA holds only the pages it takes.
struct alignas(16) FusedSelectSmem {
  uint32_t hist[kHistBins];  // this CTA's histogram of share bits 30..20 (read by the cluster)
  // The cluster's histogram in [0, kHistBins) (above 2 CTAs, this CTA's slice of its sums in the
  // upper half first); after barrier 2 the leader's second level.
  uint32_t sub[kSubBins];
  unsigned long long cand[kCandCap];  // leader: the threshold bin's keys, ranked(key, page)
  int counts[kMaxSelectCluster];      // leader: each CTA's pages above the bin (+ sink / recent)
  int taken[kMaxSelectCluster];       // leader: each CTA's pages of the bin that are in
  int n_cand;                         // leader
  int offset;                         // from the leader: this CTA's first output position
  unsigned long long thr;             // from the leader: keys of the bin from thr up are in
};
constexpr size_t fused_smem_bytes(int pages_per_cta) {
  return sizeof(FusedSelectSmem) + size_t(pages_per_cta) * 4 + size_t(pages_per_cta) / 8;
}

// The kernel's start with SelectParams::score_ready: the page count (the score pass does not write
// the page table), then, instead of the PDL wait for the whole score grid, thread 0 waits for this
// (sequence, KV head)'s count to pass this CTA's ready_seen entry. Every CTA waits, bad input or not,
// so that each step advances every entry once.
__device__ __forceinline__ int wait_for_score(const SelectParams& p, int b, size_t bh, int r) {
  const int n = p.indptr[b + 1] - p.indptr[b];
  pdl_launch_dependents();
  if (threadIdx.x == 0) {
    // At the L2: the previous step's select (on any SM) wrote it, and no grid wait orders that.
    uint32_t* seen = p.ready_seen + bh * kMaxSelectCluster + r;
    const uint32_t want = __ldcg(seen) + 1u;
    wait_ready(p.score_ready + bh, want);
    __stcg(seen, want);
  }
  __syncthreads();
  return n;
}

template <int GT, bool MERGE>
__global__ void __launch_bounds__(kFusedThreads, 1) share_select_cluster_kernel(SelectParams p) {
  namespace cg = cooperative_groups;
  extern __shared__ __align__(16) unsigned char fused_smem[];
  FusedSelectSmem& s = *reinterpret_cast<FusedSelectSmem*>(fused_smem);
  uint32_t* const keys = reinterpret_cast<uint32_t*>(fused_smem + sizeof(FusedSelectSmem));
  uint32_t* const bitmap = keys + p.cluster_pages;
  __shared__ float lse2[kMaxGroup];
  __shared__ uint32_t rhist[256];
  __shared__ int sh_bin;
  __shared__ uint32_t sh_above;
  __shared__ unsigned long long sh_thr;
  __shared__ typename cub::BlockScan<uint32_t, kFusedThreads>::TempStorage uscan_tmp;
  __shared__ typename cub::BlockScan<int, kFusedThreads>::TempStorage scan_tmp;
  __shared__ typename cub::BlockReduce<int, kFusedThreads>::TempStorage reduce_tmp;
  const cg::cluster_group cluster = cg::this_cluster();
  const int r = int(cluster.block_rank()), C = int(cluster.num_blocks());
  const int b = blockIdx.z, h = blockIdx.y, t = int(threadIdx.x);
  const size_t bh = size_t(b) * p.n_head_kv + h;
  const int n = p.score_ready ? wait_for_score(p, b, bh, r) : page_count(p, b);
  const int P = p.cluster_pages, j0 = r * P;
  const int G = p.group;
  // Round q of a thread: the 4 pages at local index l(q) = q * kRoundPages + 4 t (coalesced rows).
  const int rounds = (P + kRoundPages - 1) / kRoundPages;
  auto local = [&](int q) { return q * kRoundPages + 4 * t; };
  // Uniform over the cluster (n, and below lse_total, are the same in every CTA): no CTA leaves
  // before a barrier that the others reach.
  const bool bad = n < 0 || n > p.log_mass_stride;
  auto mine = [&](int q) { return !bad && local(q) < P && j0 + local(q) < n; };
  const float* col = p.log_mass + bh * G * p.log_mass_stride + j0;
  float4 lm[8];  // 8 head rows at a time: 1024 threads leave 64 registers each
  load_log_mass_rows(lm, col + local(0), 0, G, p.log_mass_stride, mine(0));
  for (int i = t; i < kHistBins; i += kFusedThreads) s.hist[i] = 0;
  for (int q = 0; q < rounds; ++q)
    if (local(q) < P) *reinterpret_cast<uint4*>(&keys[local(q)]) = make_uint4(0u, 0u, 0u, 0u);
  for (int w = t; w < P / 32; w += kFusedThreads) bitmap[w] = 0;
  if (t == 0) s.n_cand = 0;
  if (bad) {
    if (r == 0 && t == 0) p.n_selected[bh] = -1;
    return;
  }
  if constexpr (MERGE) {
    merge_chunk_stats<1>(reinterpret_cast<const float2*>(p.chunk_stats) + bh * 16 * p.n_chunks, p.n_chunks, p.n_chunks,
                         G, t >> 5, kFusedThreads / 32, [&](int row, float v) {
                           lse2[row] = v;
                           if (r == 0 && n > 0) p.lse_total[bh * G + row] = v * kLn2;
                         });
  } else if (t < G) {
    lse2[t] = p.lse_total[bh * G + t] * kLog2e;
  }
  __syncthreads();
  if (isnan(lse2[0])) {  // bad input (score_pages)
    if (r == 0 && t == 0) p.n_selected[bh] = -1;
    return;
  }
  const int k = max(p.budget_pages, 2);
  const bool topk = n > k;
#pragma unroll 1
  for (int q = 0; q < rounds; ++q) {
    if (!mine(q)) continue;
    if (q > 0) load_log_mass_rows(lm, col + local(q), 0, G, p.log_mass_stride, true);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    add_row_shares(acc, lm, lse2, 0, G);
    if constexpr (GT > 8) {
      load_log_mass_rows(lm, col + local(q), 8, G, p.log_mass_stride, true);
      add_row_shares(acc, lm, lse2, 8, G);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int jj = j0 + local(q) + e;
      if (jj >= n) break;
      const float share = group_share(acc[e], G);
      if (p.shares) p.shares[bh * p.log_mass_stride + jj] = share;
      if (topk && jj >= 1 && jj <= n - 2) {
        const uint32_t key = __float_as_uint(share);
        atomicAdd(&s.hist[key >> 20], 1u);
        keys[local(q) + e] = key | 0x80000000u;  // shares are >= 0: bit 31 is free
      }
    }
  }
  int32_t* out = p.selected + bh * p.budget_pages;
  if (!topk) {  // the budget covers the sequence: every page (equals dense)
    for (int jj = j0 + t; jj < min(n, j0 + P); jj += kFusedThreads) out[jj] = jj;
    if (r == 0 && t == 0) p.n_selected[bh] = max(n, 0);
    return;
  }
  const uint32_t need = uint32_t(k - 2);
  if (need == 0) {  // k == 2: the sink and the recent page only
    if (r == 0 && t == 0) {
      out[0] = 0;
      out[1] = n - 1;
      p.n_selected[bh] = 2;
    }
    return;
  }
  cluster.sync();  // 1: every CTA's histogram is complete

  // The cluster's histogram in s.sub[0, kHistBins), then its threshold bin, in every CTA. Up to
  // kDirectGather CTAs: each CTA sums all of them itself. More: CTA r first sums its slice of the
  // bins over the cluster (into s.sub[kHistBins + bin]), and after a barrier every CTA reads the
  // slices (a direct gather of 16 x 2048 words is slow).
  constexpr int kPer = kHistBins / kFusedThreads;
  if (C <= kDirectGather) {
    uint32_t v[kPer][kDirectGather];
#pragma unroll
    for (int e = 0; e < kPer; ++e)
#pragma unroll
      for (int c = 0; c < kDirectGather; ++c)
        v[e][c] = c < C ? *cluster.map_shared_rank(&s.hist[t + e * kFusedThreads], c) : 0u;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      uint32_t sum = 0;
#pragma unroll
      for (int c = 0; c < kDirectGather; ++c) sum += v[e][c];
      s.sub[t + e * kFusedThreads] = sum;
    }
  } else {
    const int slice = (kHistBins + C - 1) / C, i = r * slice + t;  // slice <= kFusedThreads
    if (t < slice && i < kHistBins) {
      uint32_t v[kMaxSelectCluster];
#pragma unroll
      for (int c = 0; c < kMaxSelectCluster; ++c) v[c] = c < C ? *cluster.map_shared_rank(&s.hist[i], c) : 0u;
      uint32_t sum = 0;
#pragma unroll
      for (int c = 0; c < kMaxSelectCluster; ++c) sum += v[c];
      s.sub[kHistBins + i] = sum;
    }
    cluster.sync();  // 1b: every slice is summed
    uint32_t v[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int bin = t + e * kFusedThreads;
      v[e] = *cluster.map_shared_rank(&s.sub[kHistBins + bin], bin / slice);
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) s.sub[t + e * kFusedThreads] = v[e];
  }
  __syncthreads();
  block_find_threshold<kFusedThreads>(s.sub, kHistBins, need, &sh_bin, &sh_above, uscan_tmp);
  const uint32_t tstar = uint32_t(sh_bin);
  const uint32_t need2 = need - sh_above;  // >= 1 pages still to take from the threshold bin

  // Pages above the bin are in; the bin's keys go to the leader (one atomic per warp and ballot).
  FusedSelectSmem& leader = *cluster.map_shared_rank(&s, 0);
  const int lane = t & 31;
  for (int q = 0; q < rounds; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int l = local(q) + e;
      const uint32_t mk = l < P ? keys[l] : 0u, key = mk & 0x7fffffffu;
      const bool has = mk & 0x80000000u;
      if (has && (key >> 20) > tstar) atomicOr(&bitmap[l >> 5], 1u << (l & 31));
      const bool in_bin = has && (key >> 20) == tstar;
      const unsigned ballot = __ballot_sync(kFull, in_bin);
      if (!ballot) continue;
      int base = 0;
      if (lane == 0) base = atomicAdd(&leader.n_cand, __popc(ballot));
      base = __shfl_sync(kFull, base, 0) + __popc(ballot & ((1u << lane) - 1u));
      if (in_bin && base < kCandCap) leader.cand[base] = ranked(key, j0 + l);
    }
  if (t == 0) {
    if (r == 0) atomicOr(&bitmap[0], 1u);  // sink page
    const int last = n - 1 - j0;           // recent page
    if (last >= 0 && last < P) atomicOr(&bitmap[last >> 5], 1u << (last & 31));
  }
  __syncthreads();
  {
    int mine_above = 0;
    for (int w = t; w < P / 32; w += kFusedThreads) mine_above += __popc(bitmap[w]);
    const int above = cub::BlockReduce<int, kFusedThreads>(reduce_tmp).Sum(mine_above);
    if (t == 0) leader.counts[r] = above;
  }
  cluster.sync();  // 2: the bin's keys and every CTA's count are with the leader

  if (r == 0) {
    // The need2-th largest key of the bin, and how many of the bin's pages each CTA takes.
    const int n_cand = s.n_cand;
    if (t < kMaxSelectCluster) s.taken[t] = 0;
    __syncthreads();
    unsigned long long thr;
    if (n_cand <= kRankCandidates) {
      // Few: each candidate's rank among all of them, in one pass.
      if (t < n_cand) {
        const unsigned long long v = s.cand[t];
        uint32_t rank = 0;
        for (int i = 0; i < n_cand; ++i) rank += s.cand[i] > v;
        if (rank < need2) atomicAdd(&s.taken[page_of(v) / P], 1);
        if (rank == need2 - 1) sh_thr = v;
      }
      __syncthreads();
      thr = sh_thr;
    } else if (n_cand <= kCandCap) {
      for (int i = t; i < kSubBins; i += kFusedThreads) s.sub[i] = 0;
      __syncthreads();
      for (int i = t; i < n_cand; i += kFusedThreads) atomicAdd(&s.sub[sub_bin(s.cand[i])], 1u);
      __syncthreads();
      thr = threshold_key(s.cand, n_cand, need2, s.sub, uscan_tmp, rhist, &sh_bin, &sh_above, &sh_thr);
      for (int i = t; i < n_cand; i += kFusedThreads)
        if (s.cand[i] >= thr) atomicAdd(&s.taken[page_of(s.cand[i]) / P], 1);
    } else {
      // Very many equal-looking shares (e.g. identical pages): the same select over the cluster's keys.
      auto src = [&](int i) -> unsigned long long {
        const int c = i / P, e = i - c * P;
        const uint32_t mk = *cluster.map_shared_rank(keys + e, c), key = mk & 0x7fffffffu;
        return (mk & 0x80000000u) && (key >> 20) == tstar ? ranked(key, c * P + e) : 0ull;
      };
      const int span = min(C * P, n);  // pages past the sequence hold no key
      thr = radix_select_desc(src, span, need2, rhist, &sh_bin, &sh_above);
      for (int i = t; i < span; i += kFusedThreads) {
        const unsigned long long v = src(i);
        if (v != 0ull && v >= thr) atomicAdd(&s.taken[i / P], 1);
      }
    }
    __syncthreads();
    if (t < C) {  // CTA t's first position: the pages of CTAs before it
      int off = 0;
      for (int c = 0; c < t; ++c) off += s.counts[c] + s.taken[c];
      FusedSelectSmem& dst = *cluster.map_shared_rank(&s, t);
      dst.offset = off;
      dst.thr = thr;
    }
  }
  cluster.sync();  // 3: every CTA has its threshold key and offset (no DSMEM access after this)

  const unsigned long long thr = s.thr;
#pragma unroll
  for (int q = 0; q < rounds; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int l = local(q) + e;
      const uint32_t mk = l < P ? keys[l] : 0u, key = mk & 0x7fffffffu;
      if ((mk & 0x80000000u) && (key >> 20) == tstar && ranked(key, j0 + l) >= thr)
        atomicOr(&bitmap[l >> 5], 1u << (l & 31));
    }
  __syncthreads();
  // Bitmap -> ascending positions (one word per thread: P / 32 <= kFusedThreads).
  const uint32_t word = t < P / 32 ? bitmap[t] : 0u;
  int offset = 0;
  cub::BlockScan<int, kFusedThreads>(scan_tmp).ExclusiveSum(__popc(word), offset);
  offset += s.offset;
  for (uint32_t bits = word; bits; bits &= bits - 1) {
    if (offset < k) out[offset] = j0 + 32 * t + __ffs(int(bits)) - 1;
    ++offset;
  }
  if (r == 0 && t == 0) p.n_selected[bh] = k;
}

auto cluster_select_kernel_for(int group, bool merge) {
  return group <= 8
             ? (merge ? share_select_cluster_kernel<8, true> : share_select_cluster_kernel<8, false>)
             : (merge ? share_select_cluster_kernel<kMaxGroup, true> : share_select_cluster_kernel<kMaxGroup, false>);
}

// The one-kernel select's attributes (dynamic shared memory, clusters above 8) raised on the
// current device.
template <auto Kernel>
cudaError_t prepare_cluster_select() {
  cudaError_t e = allow_dynamic_smem<Kernel>(fused_smem_bytes(kClusterSelectPages));
  if (e == cudaSuccess) e = allow_large_clusters<Kernel>();
  return e;
}
cudaError_t prepare_cluster_select(int group, bool merge) {
  if (group <= 8)
    return merge ? prepare_cluster_select<share_select_cluster_kernel<8, true>>()
                 : prepare_cluster_select<share_select_cluster_kernel<8, false>>();
  return merge ? prepare_cluster_select<share_select_cluster_kernel<kMaxGroup, true>>()
               : prepare_cluster_select<share_select_cluster_kernel<kMaxGroup, false>>();
}

}  // namespace

int select_max_active_clusters(int group, bool merge, int size, int pages_per_cta) {
  if (size < 1 || size > kMaxSelectCluster || pages_per_cta < 1 || pages_per_cta > kClusterSelectPages) return 0;
  if (prepare_cluster_select(group, merge) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(size));
  cfg.blockDim = dim3(kFusedThreads);
  cfg.dynamicSmemBytes = fused_smem_bytes(pages_per_cta);
  cudaLaunchAttribute attr[1] = {cluster_dim_attr(size)};
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, cluster_select_kernel_for(group, merge), &cfg) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

cudaError_t select_pages_in_clusters(const SelectParams& p, cudaStream_t stream) {
  if (p.cluster_pages < 32 || p.cluster_pages % 32 != 0 || p.cluster_pages > kClusterSelectPages)
    return cudaErrorInvalidValue;
  const long long clusters = (static_cast<long long>(p.log_mass_stride) + p.cluster_pages - 1) / p.cluster_pages;
  if (clusters < 1 || clusters > kMaxSelectCluster || !p.score_ready != !p.ready_seen) return cudaErrorInvalidValue;
  const bool merge = p.chunk_stats != nullptr;
  if (const cudaError_t e = prepare_cluster_select(p.group, merge); e != cudaSuccess) return e;
  return launch(cluster_select_kernel_for(p.group, merge),
                dim3(unsigned(clusters), unsigned(p.n_head_kv), unsigned(p.batch)), dim3(kFusedThreads),
                fused_smem_bytes(p.cluster_pages), p.pdl, stream, p, int(clusters));
}

}  // namespace locks::cuda
