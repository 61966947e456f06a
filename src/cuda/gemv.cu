// bf16 GEMV on tensor cores (gemv.h).
//
// K permutation (ptx.cuh): per 32-wide chunk of n_in, lane (g, t) loads 16 bytes at k0 + 8t of
// weight rows g and g + 8 and of batch row g, and feeds them to two m16n8k16 MMAs as if they were
// logical columns {2t, 2t+1, 2t+8, 2t+9}: the same permutation on A and B, so the sum is unchanged.
#include "common.cuh"
#include "gemv.h"

namespace locks::cuda {

namespace {

using namespace detail;

constexpr int kWarps = 8;   // warps per CTA, each a strided share of the 32-wide chunks of n_in
constexpr int kUnroll = 4;  // chunks in flight per warp (8 weight loads of 16 bytes per lane)

__device__ __forceinline__ uint4 ld_weights(const uint16_t* p) {  // read once: keep it out of L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__global__ void __launch_bounds__(32 * kWarps) gemv_bf16_kernel(GemvParams p) {
  __shared__ float partial[kWarps][32][4];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int o0 = blockIdx.x * 16;
  const int r_lo = o0 + g, r_hi = o0 + g + 8;
  const bool lo_ok = r_lo < p.n_out, hi_ok = r_hi < p.n_out, x_ok = g < p.rows;
  const uint16_t* w_lo = p.w + size_t(lo_ok ? r_lo : 0) * p.n_in + 8 * t;
  const uint16_t* w_hi = p.w + size_t(hi_ok ? r_hi : 0) * p.n_in + 8 * t;
  const uint16_t* xr = p.x + size_t(x_ok ? g : 0) * p.n_in + 8 * t;
  const int n_chunks = (p.n_in + 31) / 32;
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 a[kUnroll], b[kUnroll], xv[kUnroll];
  auto load_weights = [&](int base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int chunk = base + u * kWarps;
      const bool in = chunk < n_chunks && chunk * 32 + 8 * t < p.n_in;
      a[u] = in && lo_ok ? ld_weights(w_lo + size_t(chunk) * 32) : zero;
      b[u] = in && hi_ok ? ld_weights(w_hi + size_t(chunk) * 32) : zero;
    }
  };
  // The weights do not depend on the previous kernel: their first loads go out before the PDL wait,
  // while that kernel finishes; x is its output (read at the L2, never through the non-coherent path).
  load_weights(warp);
  pdl_wait();
  for (int base = warp; base < n_chunks; base += kWarps * kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int chunk = base + u * kWarps;
      const bool in = chunk < n_chunks && chunk * 32 + 8 * t < p.n_in;
      xv[u] = in && x_ok ? __ldcg(reinterpret_cast<const uint4*>(xr + size_t(chunk) * 32)) : zero;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t f0[4] = {a[u].x, b[u].x, a[u].y, b[u].y};
      const uint32_t f1[4] = {a[u].z, b[u].z, a[u].w, b[u].w};
      mma_16816(c, f0, xv[u].x, xv[u].y, __nv_bfloat16{});
      mma_16816(c, f1, xv[u].z, xv[u].w, __nv_bfloat16{});
    }
    if (base + kWarps * kUnroll < n_chunks) load_weights(base + kWarps * kUnroll);
  }
  pdl_launch_dependents();
#pragma unroll
  for (int i = 0; i < 4; ++i) partial[warp][lane][i] = c[i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += partial[w][lane][i];
    const int n = i < 2 ? r_lo : r_hi, row = 2 * t + (i & 1);  // C: (weight row, batch row)
    if (n >= p.n_out || row >= p.rows) continue;
    float* y = n < p.split ? p.y + size_t(row) * p.ldy + n : p.y2 + size_t(row) * p.ldy2 + (n - p.split);
    *y = p.accumulate ? *y + s : s;
  }
}

}  // namespace

bool gemv_applies(int rows, int n_out, int n_in) {
  return rows >= 1 && rows <= kGemvMaxRows && n_out > 0 && n_in > 0 && n_in % 8 == 0;
}

cudaError_t gemv_bf16(const GemvParams& p, cudaStream_t stream) {
  if (!gemv_applies(p.rows, p.n_out, p.n_in) || !p.x || !p.w || !p.y || p.split < 0 || p.split > p.n_out ||
      (p.split < p.n_out && !p.y2))
    return cudaErrorInvalidValue;
  const unsigned grid = unsigned((p.n_out + 15) / 16);
  return launch_pdl(gemv_bf16_kernel, dim3(grid), dim3(32 * kWarps), stream, p);
}

}  // namespace locks::cuda
