// Shared by the GPU benchmarks (bench_cuda.cu, bench_e2e.cu): device buffers, timing, synthetic KV.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace locks::cuda::bench {

inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA bench: ") + what + ": " + cudaGetErrorString(e));
}

struct DevMem {
  void* p = nullptr;
  explicit DevMem(size_t bytes) { ck(cudaMalloc(&p, std::max<size_t>(bytes, 16)), "cudaMalloc"); }
  ~DevMem() { cudaFree(p); }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    ck(cudaEventCreate(&a), "event");
    ck(cudaEventCreate(&b), "event");
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  double elapsed_us() const {
    float ms = 0.0f;
    ck(cudaEventElapsedTime(&ms, a, b), "elapsed");
    return 1000.0 * ms;
  }
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

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

// Keys: per (page, head) a direction (scale 2) plus noise 0.5 (the spectra of real pages: a few
// dominant directions); values: noise.
__global__ void fill_kv_kernel(uint16_t* k, uint16_t* v, size_t n_elems, int head_dim, int page_elems_per_head,
                               bool bf16, uint32_t seed);

// One thread waiting `ns` nanoseconds of the device clock: the host enqueues the timed work before
// the device reaches it, so the time is the device's alone.
__global__ void spin_kernel(uint64_t ns);

// Plain read: every byte once with 16-byte loads; a data-dependent store keeps it alive.
__global__ void read_kernel(const uint4* src, size_t n, uint32_t* sink);

}  // namespace locks::cuda::bench
