// Shared by the GPU benchmarks (bench_cuda.cu, bench_e2e.cpp): device buffers, timing, synthetic KV.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
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

/// The CSV a benchmark writes, opened before any measurement (an unwritable path must not cost a
/// whole run and then be dropped); nullptr for an empty path. Throws std::runtime_error naming it.
std::FILE* open_csv(const std::string& path);

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Keys: per (page, head) a direction (scale 2) plus noise 0.5 (the spectra of real pages: a few
// dominant directions); values: noise. n_elems of k and of v, f16 or bf16.
void fill_kv(void* k, void* v, size_t n_elems, int head_dim, bool bf16, uint32_t seed, cudaStream_t stream);
// q[i]: approximately standard normal values from a hash of (i, seed).
void fill_normal(float* q, size_t n, uint32_t seed, cudaStream_t stream);
// One thread waiting `ns` nanoseconds of the device clock: the host enqueues the timed work before
// the device reaches it, so the time is the device's alone.
void spin(uint64_t ns, cudaStream_t stream);
// Plain read of `bytes` (a multiple of 16) with 16-byte loads; `sink` keeps it alive.
void read_all(const void* src, size_t bytes, uint32_t* sink, int grid, cudaStream_t stream);

}  // namespace locks::cuda::bench
