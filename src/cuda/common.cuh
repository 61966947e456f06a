// Device helpers shared by the LOCKS kernels: f16/bf16 packing with hi/lo splitting, the
// bad-input checks, the batch balancing of grids, the last-CTA-done and ready-flag handoffs,
// log-sum-exp merges, and the host-side launch attributes. The PTX wrappers and operand unpacking
// live in ptx.cuh, the number formats in locks/quant.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "locks/cuda/kernels.h"
#include "locks/quant.h"
#include "ptx.cuh"

namespace locks::cuda::detail {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Packing two floats into a 16-bit pair (x in the low half). `hi` is the rounded pair, `lo` the
// rounded remainder: hi + lo carries ~22 (f16) or ~16 (bf16) significant bits.
template <typename T>
struct Pack;
template <>
struct Pack<__half> {
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ void split(float x, float y, uint32_t& hi, uint32_t& lo) {
    __half2 h = __floats2half2_rn(x, y);
    __half2 l = __floats2half2_rn(x - __low2float(h), y - __high2float(h));
    hi = *reinterpret_cast<uint32_t*>(&h);
    lo = *reinterpret_cast<uint32_t*>(&l);
  }
};
template <>
struct Pack<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ void split(float x, float y, uint32_t& hi, uint32_t& lo) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    __nv_bfloat162 l = __floats2bfloat162_rn(x - __low2float(h), y - __high2float(h));
    hi = *reinterpret_cast<uint32_t*>(&h);
    lo = *reinterpret_cast<uint32_t*>(&l);
  }
};

// One stored KV element (raw bits) to float, by runtime dtype.
__device__ __forceinline__ float kv_to_float(uint16_t bits, bool bf16) {
  return bf16 ? bf16_to_f32(bits) : f16_to_f32(bits);
}

// ---------------------------------------------------------------------------------------------
// Bad device-side input (kernels.h): the status word collects DecodeStatus bits.
__device__ __forceinline__ void raise_status(uint32_t* status, uint32_t bit) {
  if (status) atomicOr(status, bit);
}
// A page id the pool holds. n_pages_pool 0: not checked (any id >= 0 passes).
__device__ __forceinline__ bool page_id_ok(int32_t id, int n_pages_pool) {
  return n_pages_pool > 0 ? uint32_t(id) < uint32_t(n_pages_pool) : id >= 0;
}
// A sequence's page count and last page length, as every kernel checks them: 0 if valid, else the
// DecodeStatus bit. `capacity` is how many pages the launch covers.
__device__ __forceinline__ uint32_t sequence_fault(int n_pages, int last_len, int capacity) {
  if (n_pages < 0 || n_pages > capacity) return kStatusBadPageCount;
  if (n_pages > 0 && (last_len < 1 || last_len > kPageSize)) return kStatusBadLastPageLen;
  return 0u;
}
// ---------------------------------------------------------------------------------------------
// A grid's slots shared among the sequences of a batch in proportion to their pages (the score
// pass's balanced chunks, dense attention's balanced splits), so that one long sequence among short
// ones runs on most of the grid instead of its equal share. Sequence b takes width(b) consecutive
// slots, in order of b. Warp-collective: every lane calls and gets the result; one iteration per 32
// sequences.

// The sum of f(b) over b < B.
template <class T, class F>
__device__ __forceinline__ T batch_sum(int B, F f) {
  T t = 0;
  for (int b = int(threadIdx.x & 31); b < B; b += 32) t += f(b);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(kFull, t, o);
  return t;
}

// A page count as the balancing counts it: a bad one (negative, or above the `capacity` the launch
// covers) as empty, so that it takes one slot, whose item reports the fault.
__device__ __forceinline__ int balance_pages(int n, int capacity) { return n < 0 || n > capacity ? 0 : n; }

// A sequence's slot count: 1 + floor(n * spare / total), at most cap. With S slots for B sequences
// and spare = S - B >= 0, the counts of a batch sum to at most S (total = the batch's pages).
__device__ __forceinline__ int proportional_slots(int n, long long total, int spare, int cap) {
  const long long share = total > 0 && spare > 0 ? (long long)n * spare / total : 0;
  return int(min((long long)cap, 1 + share));
}

// The inclusive prefix sum of x over the lanes of a warp.
__device__ __forceinline__ int warp_inclusive_sum(int x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += v;
  }
  return x;
}

// The sequence whose range holds `slot`: false when the slot lies past every range, else its
// sequence, the range's first slot and its width.
template <class Width>
__device__ __forceinline__ bool find_slot_range(int slot, int B, Width width, int* b_out, int* start_out,
                                                int* width_out) {
  const int lane = threadIdx.x & 31;
  int base = 0;
  for (int b0 = 0; b0 < B; b0 += 32) {
    const int b = b0 + lane;
    const int w = b < B ? width(b) : 0;
    const int incl = warp_inclusive_sum(w);
    const int excl = base + incl - w;
    const unsigned hit = __ballot_sync(kFull, b < B && slot >= excl && slot < base + incl);
    if (hit) {
      const int src = __ffs(int(hit)) - 1;
      *b_out = b0 + src;
      *start_out = __shfl_sync(kFull, excl, src);
      *width_out = __shfl_sync(kFull, w, src);
      return true;
    }
    base += __shfl_sync(kFull, incl, 31);
  }
  return false;
}

/// Last-CTA-done: every CTA of a group calls this once after writing its results (all threads).
/// Returns true in exactly one CTA, the last to arrive, which then sees all the group's writes; that
/// CTA also resets the counter to 0 so the next launch (or graph replay) starts clean.
__device__ __forceinline__ bool last_cta_done(uint32_t* counter, uint32_t n_ctas, int* smem_flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t prev = atomicAdd(counter, 1u);
    const bool last = prev == n_ctas - 1;
    if (last) atomicExch(counter, 0u);
    *smem_flag = last ? 1 : 0;
  }
  __syncthreads();
  const bool last = *smem_flag != 0;
  if (last) __threadfence();
  return last;
}

// A kernel's results handed to a kernel that runs beside it (ScoreParams::ready): every thread of
// the CTA calls publish_ready after its writes, and *flag goes up by one once they are visible at
// the GPU; the reader waits in wait_ready for the count it expects (ld.acquire), so that its loads
// after it see those writes. A count that does not come within kReadyTimeoutNs (a reader launched
// without its writer: a misuse of the API) stops the kernel with a message instead of hanging.
__device__ __forceinline__ void publish_ready(uint32_t* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(flag, 1u);
  }
}
constexpr unsigned long long kReadyTimeoutNs = 10'000'000'000ull;
__device__ __forceinline__ void wait_ready(const uint32_t* flag, uint32_t want) {
  const unsigned long long t0 = global_timer_ns();
  for (;;) {
    const uint32_t v = ld_acquire_gpu(flag);
    if (int(v - want) >= 0) return;
    if (global_timer_ns() - t0 > kReadyTimeoutNs) {
      printf(
          "locks: a kernel waited 10 s for results published by the previous one (its ready counter %u, "
          "expected %u): it was launched without its writer (ScoreParams::ready / SelectParams::score_ready "
          "must come in pairs; after a failed step run init_decode_workspace)\n",
          v, want);
      __trap();
    }
    __nanosleep(32);
  }
}

// Combine two (max, sum-of-exp2) pairs; -inf maxima carry no mass.
__device__ __forceinline__ void lse2_merge(float& m, float& l, float m2, float l2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;
  l = (m == -INFINITY ? 0.0f : l * exp2f(m - mn)) + (m2 == -INFINITY ? 0.0f : l2 * exp2f(m2 - mn));
  m = mn;
}

// The log2-sum-exp over a warp's (max, sum) pairs (all lanes call it): NaN when any lane saw bad
// input, -inf when no lane has mass.
__device__ __forceinline__ float warp_lse2(float m, float l, bool bad) {
  bad = __any_sync(kFull, bad);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(kFull, m, o), l2 = __shfl_xor_sync(kFull, l, o);
    lse2_merge(m, l, m2, l2);
  }
  return bad ? NAN : m == -INFINITY ? -INFINITY : m + log2f(l);
}

// The share normaliser from the score pass's chunk statistics (ScoreParams::chunk_stats: (max, sum)
// pairs in log2 units, [row][stride] for one (sequence, KV head)): the calling warp merges head rows
// warp, warp + n_warps, ... (HPW of them; rows >= G are skipped) over their first n chunks, loading
// the first 128 chunks of every row at once (one round trip, lanes coalesced along the row), and
// calls emit(row, log2-sum-exp) on lane 0; NaN when a chunk saw bad input, -inf without mass.
template <int HPW, class Emit>
__device__ __forceinline__ void merge_chunk_stats(const float2* stats, int stride, int n, int G, int warp, int n_warps,
                                                  Emit emit) {
  const int lane = threadIdx.x & 31;
  float2 st[HPW][4];
#pragma unroll
  for (int hr = 0; hr < HPW; ++hr)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = warp + n_warps * hr, c = lane + 32 * q;
      st[hr][q] = r < G && c < n ? __ldcg(stats + size_t(r) * stride + c) : make_float2(-INFINITY, 0.0f);
    }
#pragma unroll
  for (int hr = 0; hr < HPW; ++hr) {
    const int r = warp + n_warps * hr;
    if (r >= G) break;
    float m = -INFINITY, l = 0.0f;
    bool bad = false;  // a chunk saw bad input
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      bad |= isnan(st[hr][q].y);
      lse2_merge(m, l, st[hr][q].x, st[hr][q].y);
    }
    for (int c = lane + 128; c < n; c += 32) {
      const float2 v = __ldcg(stats + size_t(r) * stride + c);
      bad |= isnan(v.y);
      lse2_merge(m, l, v.x, v.y);
    }
    const float v = warp_lse2(m, l, bad);
    if (lane == 0) emit(r, v);
  }
}

// Warp reductions over the 4 lanes of a quad (lanes 4g .. 4g+3).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFull, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFull, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFull, x, 1);
  return x + __shfl_xor_sync(kFull, x, 2);
}

// Raise a function attribute of Kernel to at least `value` on the current device, once per (kernel,
// attribute, device): the attribute belongs to a device, so a process that drives several GPUs raises
// it on each. A host call, not a stream operation.
template <auto Kernel, cudaFuncAttribute Attr>
cudaError_t raise_func_attribute(int value) {
  constexpr int kDevices = 64;
  static std::atomic<int> granted[kDevices];  // static storage: zero
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool tracked = dev >= 0 && dev < kDevices;
  if (tracked && granted[dev].load() >= value) return cudaSuccess;
  e = cudaFuncSetAttribute(Kernel, Attr, value);
  if (e == cudaSuccess && tracked) {
    int cur = granted[dev].load();
    while (cur < value && !granted[dev].compare_exchange_weak(cur, value)) {
    }
  }
  return e;
}

// Kernel's dynamic shared-memory limit, raised to `bytes`.
template <auto Kernel>
cudaError_t allow_dynamic_smem(size_t bytes) {
  return raise_func_attribute<Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize>(int(bytes));
}

// The launch attribute of clusters of `size` CTAs along x (sparse attention's cluster merge, the
// one-kernel select).
inline cudaLaunchAttribute cluster_dim_attr(int size) {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = unsigned(size);
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}

// Kernel allowed clusters of more than 8 CTAs (up to 16 on the H100/H200).
template <auto Kernel>
cudaError_t allow_large_clusters() {
  return raise_func_attribute<Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed>(1);
}

// ---------------------------------------------------------------------------------------------
// Launches `kernel` with programmatic dependent launch: its CTAs may be scheduled while the previous
// kernel of the stream finishes (a decode step is hundreds of short kernels, and this hides most of
// each launch gap). The kernel must pdl_wait() before it reads what earlier kernels wrote or writes
// what they read.
template <class... KernelArgs, class... Args>
inline cudaError_t launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace locks::cuda::detail
