// Kernels shared by the GPU benchmarks (bench_util.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cerrno>
#include <cstring>

#include "bench_util.h"

namespace locks::cuda::bench {

namespace {

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
// Approximately standard normal (sum of 4 uniforms, variance-corrected).
__device__ __forceinline__ float hnormal(uint32_t seed) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) s += float(hash32(seed * 4u + uint32_t(i)) >> 8) * (1.0f / 16777216.0f);
  return (s - 2.0f) * 1.7320508f;
}

__global__ void fill_kv_kernel(uint16_t* k, uint16_t* v, size_t n_elems, int head_dim, int page_elems_per_head,
                               bool bf16, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n_elems; i += size_t(gridDim.x) * blockDim.x) {
    const size_t ph = i / page_elems_per_head;  // (page, head) block
    const int x = int(i % head_dim);
    const float base = 2.0f * hnormal(uint32_t(ph * 1315423911u) ^ uint32_t(x * 2654435761u) ^ seed);
    const float kx = base + 0.5f * hnormal(uint32_t(i) * 3u + seed + 1u);
    const float vx = hnormal(uint32_t(i) * 5u + seed + 7u);
    if (bf16) {
      k[i] = __bfloat16_as_ushort(__float2bfloat16_rn(kx));
      v[i] = __bfloat16_as_ushort(__float2bfloat16_rn(vx));
    } else {
      k[i] = __half_as_ushort(__float2half_rn(kx));
      v[i] = __half_as_ushort(__float2half_rn(vx));
    }
  }
}

__global__ void fill_normal_kernel(float* q, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    q[i] = hnormal(uint32_t(i) * 11u + seed);
}

__global__ void spin_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

__global__ void read_kernel(const uint4* src, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

}  // namespace

std::FILE* open_csv(const std::string& path) {
  std::FILE* f = nullptr;
  if (!path.empty() && !(f = std::fopen(path.c_str(), "w")))
    throw std::runtime_error("--csv: cannot write '" + path + "': " + std::strerror(errno));
  return f;
}

void fill_kv(void* k, void* v, size_t n_elems, int head_dim, bool bf16, uint32_t seed, cudaStream_t stream) {
  fill_kv_kernel<<<2048, 256, 0, stream>>>(static_cast<uint16_t*>(k), static_cast<uint16_t*>(v), n_elems, head_dim,
                                           16 * head_dim, bf16, seed);
  ck(cudaGetLastError(), "fill KV");
}
void fill_normal(float* q, size_t n, uint32_t seed, cudaStream_t stream) {
  fill_normal_kernel<<<64, 256, 0, stream>>>(q, n, seed);
  ck(cudaGetLastError(), "fill q");
}
void spin(uint64_t ns, cudaStream_t stream) { spin_kernel<<<1, 1, 0, stream>>>(ns); }
void read_all(const void* src, size_t bytes, uint32_t* sink, int grid, cudaStream_t stream) {
  read_kernel<<<grid, 512, 0, stream>>>(static_cast<const uint4*>(src), bytes / 16, sink);
}

}  // namespace locks::cuda::bench
