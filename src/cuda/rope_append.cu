// Fused attention input of a step (rope_append.h).
#include "rope_append.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace locks::cuda {

namespace {

__device__ __forceinline__ uint16_t to_kv(float x, bool bf16) {
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}

__global__ void rope_append_kernel(RopeAppendParams p) {
  const int r = blockIdx.x;
  const int HD = p.head_dim, NH = p.n_head, NKV = p.n_head_kv, half = p.n_rot / 2;
  const int width = (NH + 2 * NKV) * HD;
  const float* row = p.qkv + size_t(r) * width;
  const int32_t pos = p.row_pos[r];
  const int32_t seq = p.row_seq ? p.row_seq[r] : 0;
  const int j = pos >= 0 ? pos / kPageSize : -1;
  int32_t page = -1;
  if (j >= 0 && j < p.page_stride && (!p.n_reserved || j < p.n_reserved[seq]))
    page = p.page_list[size_t(seq) * p.page_stride + j];
  const bool store = page >= 0 && page < p.n_pages_pool;
  if (!store && threadIdx.x == 0 && p.status) atomicOr(p.status, kStatusBadPageId);
  const int slot = pos % kPageSize;
  const bool bf16 = p.dtype == KvType::kBF16;
  bool bad_kv = false;

  // q and k heads: each thread takes rotation pairs (and the unrotated dims) of heads in turn.
  const int pairs_per_head = HD / 2;
  for (int e = threadIdx.x; e < (NH + NKV) * pairs_per_head; e += blockDim.x) {
    const int h = e / pairs_per_head, i = e % pairs_per_head;
    const float* src = row + size_t(h) * HD;
    // Rotated pairs first; dims past n_rot pass through two at a time.
    const bool neox = p.mode == RopeMode::kNeox && i < half;
    const int d0 = neox ? i : 2 * i, d1 = neox ? i + half : 2 * i + 1;
    float x0 = src[d0], x1 = src[d1];
    if (p.bias) {
      x0 += p.bias[h * HD + d0];
      x1 += p.bias[h * HD + d1];
    }
    if (i < half) {
      double s, c;
      sincos(double(pos) * p.inv_freq[i], &s, &c);
      const float cf = float(c), sf = float(s);
      const float y0 = x0 * cf - x1 * sf, y1 = x0 * sf + x1 * cf;
      x0 = y0;
      x1 = y1;
    }
    if (h < NH) {
      float* dst = p.q + (size_t(r) * NH + h) * HD;
      dst[d0] = x0;
      dst[d1] = x1;
    } else if (store) {
      const int hk = h - NH;
      uint16_t* dst = static_cast<uint16_t*>(p.k_pool) + ((size_t(page) * NKV + hk) * kPageSize + slot) * HD;
      dst[d0] = to_kv(x0, bf16);
      dst[d1] = to_kv(x1, bf16);
      bad_kv |= !isfinite(x0) || !isfinite(x1);
    }
  }
  if (store) {  // v: copied (+ bias)
    for (int e = threadIdx.x; e < NKV * HD; e += blockDim.x) {
      const int hv = e / HD, x = e % HD;
      float val = row[size_t(NH + NKV) * HD + e];
      if (p.bias) val += p.bias[(NH + NKV) * HD + e];
      static_cast<uint16_t*>(p.v_pool)[((size_t(page) * NKV + hv) * kPageSize + slot) * HD + x] = to_kv(val, bf16);
      bad_kv |= !isfinite(val);
    }
  }
  if (bad_kv && p.status) atomicOr(p.status, kStatusBadKeys);
}

}  // namespace

cudaError_t rope_append(const RopeAppendParams& p, cudaStream_t stream) {
  if (p.n_rows < 0 || p.n_head < 1 || p.n_head_kv < 1 || p.head_dim < 2 || p.head_dim % 2 || p.n_rot < 0 ||
      p.n_rot > p.head_dim || p.n_rot % 2 || !p.qkv || !p.q || !p.k_pool || !p.v_pool || !p.row_pos || !p.page_list ||
      (p.n_rot > 0 && !p.inv_freq))
    return cudaErrorInvalidValue;
  if (p.n_rows == 0) return cudaSuccess;
  rope_append_kernel<<<p.n_rows, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace locks::cuda
