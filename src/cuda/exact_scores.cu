// The oracle's page scores on the GPU: every page's exact log-mass from its keys (the CPU's
// exact_log_mass, src/core/summary_score.cpp), the share normaliser, and the oracle decode step that
// selects from them by the LOCKS rule (select_pages) and attends to the chosen pages.
#include <cmath>

#include "common.cuh"

namespace locks::cuda {

namespace {

using namespace detail;

constexpr int kWarps = 4;  // pages per CTA of the log-mass kernel (one warp each)

// One warp per (sequence b, KV head h, page j): lane l holds token l % 16 and half l / 16 of the
// head dimensions; the G dot products of the group are summed over the halves, then the page's
// logsumexp over its tokens (the partial last page masked) is written for every query head.
__global__ void __launch_bounds__(32 * kWarps) exact_log_mass_kernel(ExactScoreParams p) {
  const int b = blockIdx.z, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j = blockIdx.x * kWarps + warp;
  const int G = p.group, d = p.kv.head_dim, NKV = p.kv.n_head_kv;
  const int n = p.kv.indptr[b + 1] - p.kv.indptr[b];
  const int last = n > 0 ? p.kv.last_page_len[b] : 0;
  const uint32_t fault = sequence_fault(n, last, p.log_mass_stride);
  float* out = p.log_mass + (size_t(b) * NKV + h) * G * p.log_mass_stride;
  if (fault) {  // the whole sequence's scores become NaN (one writer per (b, h) row set)
    if (blockIdx.x == 0 && threadIdx.x == 0) raise_status(p.status, fault);
    if (j < p.log_mass_stride && lane < G) out[size_t(lane) * p.log_mass_stride + j] = NAN;
    return;
  }
  if (j >= n) return;
  const int32_t id = p.kv.indices[p.kv.indptr[b] + j];
  if (!page_id_ok(id, p.kv.n_pages_pool)) {
    if (lane == 0) raise_status(p.status, kStatusBadPageId);
    if (lane < G) out[size_t(lane) * p.log_mass_stride + j] = NAN;
    return;
  }
  const int t = lane % kPageSize, half = lane / kPageSize, n_tok = j == n - 1 ? last : kPageSize;
  const bool bf16 = p.kv.dtype == KvType::kBF16;
  const uint16_t* k =
      static_cast<const uint16_t*>(p.kv.k) + ((size_t(id) * NKV + h) * kPageSize + t) * d + size_t(half) * (d / 2);
  const float* q = p.q + (size_t(b) * NKV * G + size_t(h) * G) * d + size_t(half) * (d / 2);
  float acc[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) acc[g] = 0.0f;
  for (int c = 0; c < d / 2; c += 8) {  // 8 elements (16 bytes) of the key at a time
    const uint4 raw = *reinterpret_cast<const uint4*>(k + c);
    const uint16_t* e = reinterpret_cast<const uint16_t*>(&raw);
    float kf[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) kf[i] = kv_to_float(e[i], bf16);
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g)
      if (g < G) {
        const float4 q0 = *reinterpret_cast<const float4*>(q + size_t(g) * d + c);
        const float4 q1 = *reinterpret_cast<const float4*>(q + size_t(g) * d + c + 4);
        acc[g] += q0.x * kf[0] + q0.y * kf[1] + q0.z * kf[2] + q0.w * kf[3] + q1.x * kf[4] + q1.y * kf[5] +
                  q1.z * kf[6] + q1.w * kf[7];
      }
  }
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= G) break;
    float s = acc[g] + __shfl_xor_sync(kFull, acc[g], kPageSize);
    s = t < n_tok ? s * p.scale : -INFINITY;
    float m = s;
#pragma unroll
    for (int o = kPageSize / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    float e = s == -INFINITY ? 0.0f : expf(s - m);
#pragma unroll
    for (int o = kPageSize / 2; o > 0; o >>= 1) e += __shfl_xor_sync(kFull, e, o);
    if (lane == 0) out[size_t(g) * p.log_mass_stride + j] = m + logf(e);
  }
}

// One warp per (sequence, KV head, query head g): lse_total = logsumexp_j log_mass[g][j], -inf for a
// sequence without pages, NaN when a page's score is NaN (bad input).
__global__ void __launch_bounds__(32) exact_lse_total_kernel(ExactScoreParams p) {
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z, lane = threadIdx.x;
  const int G = p.group, NKV = p.kv.n_head_kv;
  int n = p.kv.indptr[b + 1] - p.kv.indptr[b];
  const bool bad_count = n < 0 || n > p.log_mass_stride;
  if (bad_count) n = 0;
  const float* row = p.log_mass + ((size_t(b) * NKV + h) * G + g) * p.log_mass_stride;
  float m = -INFINITY, l = 0.0f;
  bool bad = bad_count;
  for (int j = lane; j < n; j += 32) {
    const float x = row[j] * float(M_LOG2E);  // log2 units for lse2_merge
    if (isnan(x))
      bad = true;
    else
      lse2_merge(m, l, x, 1.0f);
  }
  const float lse2 = warp_lse2(m, l, bad);
  if (lane == 0) p.lse_total[(size_t(b) * NKV + h) * G + g] = lse2 * float(M_LN2);
}

}  // namespace

cudaError_t exact_page_scores(const ExactScoreParams& p, cudaStream_t stream) {
  const int d = p.kv.head_dim;
  if (p.batch < 1 || p.kv.n_head_kv < 1 || p.group < 1 || p.group > kMaxGroup || d < 16 || d % 16 != 0 || d > 256 ||
      p.log_mass_stride < 1 || !p.q || !p.kv.k || !p.log_mass || !p.lse_total || !p.kv.indptr || !p.kv.indices ||
      !p.kv.last_page_len)
    return cudaErrorInvalidValue;
  const dim3 grid((p.log_mass_stride + kWarps - 1) / kWarps, p.kv.n_head_kv, p.batch);
  exact_log_mass_kernel<<<grid, 32 * kWarps, 0, stream>>>(p);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  exact_lse_total_kernel<<<dim3(p.group, p.kv.n_head_kv, p.batch), 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace locks::cuda
