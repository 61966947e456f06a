// Read-bandwidth ceilings for the score pass's access pattern: 832-byte page-summary records read
// once each, by different load paths. Standalone tuning tool (not part of the library build):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/cuda_read_patterns.cu -o read_patterns
//   ./read_patterns [read|write] [batch...]   (GB/s per pattern, median of 15 runs, L2 flushed before
//                                               each by a 256 MiB read (default) or write)
// Patterns (each reads batch x 262144 records = batch x 218 MB, the 1M-token, 4-KV-head point):
//   linear-ldg    grid-stride 16-byte loads (the plain read ceiling)
//   chunk-ldg     CTA c reads its own contiguous chunk; warps take octets (8 records) round-robin,
//                 16-byte loads into registers, one octet ahead
//   chunk-cpasync the score kernel's pipeline: octets copied into shared memory with cp.async,
//                 2 stages per warp, 4 warps x 4 CTAs per SM
//   chunk-tma     the same with one bulk copy (copy engine) per record, mbarrier completion
//   chunk-tma8    the same with one bulk copy per octet (6656 bytes)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../src/cuda/ptx.cuh"  // relative: the tool builds with a bare nvcc command line

using namespace locks::cuda::detail;

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

constexpr int REC = 832;
constexpr int CPR = REC / 16;
constexpr int kWarps = 4;

__global__ void linear_ldg(const uint4* p, size_t n16, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Chunk c of `chunk` records per CTA; warp w takes octets w, w + 4, ...; each lane loads 26 of the
// octet's 416 16-byte pieces (the octet's bytes), the next octet's loads issued before using these.
__global__ void __launch_bounds__(128) chunk_ldg(const uint8_t* recs, int chunk, int n_rec, uint32_t* sink) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = blockIdx.x * chunk, r1 = min(r0 + chunk, n_rec);
  uint32_t acc = 0;
  constexpr int PER = 8 * CPR / 32;  // 13 pieces per lane per octet
  uint4 cur[PER], nxt[PER];
  auto load = [&](int o, uint4(&v)[PER]) {
    const uint4* base = reinterpret_cast<const uint4*>(recs + size_t(o) * 8 * REC);
#pragma unroll
    for (int j = 0; j < PER; ++j) v[j] = (o * 8 < r1) ? __ldcs(base + j * 32 + lane) : make_uint4(0, 0, 0, 0);
  };
  int o = r0 / 8 + warp;
  load(o, cur);
  for (; o * 8 < r1; o += kWarps) {
    load(o + kWarps, nxt);
#pragma unroll
    for (int j = 0; j < PER; ++j) acc ^= cur[j].x ^ cur[j].y ^ cur[j].z ^ cur[j].w;
#pragma unroll
    for (int j = 0; j < PER; ++j) cur[j] = nxt[j];
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// MODE 0: cp.async 16 B pieces; 1: one bulk copy per record; 2: one bulk copy per octet.
template <int MODE, int STAGES>
__global__ void __launch_bounds__(128) chunk_smem(const uint8_t* recs, int chunk, int n_rec, uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t st[];  // [kWarps][STAGES][8 * REC]
  __shared__ __align__(8) uint64_t bars[kWarps][STAGES];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = blockIdx.x * chunk, r1 = min(r0 + chunk, n_rec);
  uint8_t* mine = st + size_t(warp) * STAGES * 8 * REC;
  const uint32_t mine_s = uint32_t(__cvta_generic_to_shared(mine));
  if (lane == 0)
    for (int s = 0; s < STAGES; ++s) mbar_init(uint32_t(__cvta_generic_to_shared(&bars[warp][s])), 1);
  fence_mbarrier_init();
  __syncwarp();
  uint32_t phase = 0, acc = 0;
  auto issue = [&](int o, int s) {
    if (o * 8 >= r1) return;
    const uint8_t* src = recs + size_t(o) * 8 * REC;
    const uint32_t dst = mine_s + uint32_t(s * 8 * REC);
    const uint32_t bar = uint32_t(__cvta_generic_to_shared(&bars[warp][s]));
    if constexpr (MODE == 0) {
      for (int j = lane; j < 8 * CPR; j += 32) cp_async16(dst + j * 16, src + j * 16);
      cp_async_commit();
    } else if constexpr (MODE == 1) {
      if (lane == 0) mbar_arrive_expect_tx(bar, 8 * REC);
      __syncwarp();
      if (lane < 8) bulk_copy(dst + lane * REC, src + lane * REC, REC, bar);
    } else {
      if (lane == 0) {
        mbar_arrive_expect_tx(bar, 8 * REC);
        bulk_copy(dst, src, 8 * REC, bar);
      }
    }
  };
  int o = r0 / 8 + warp;
  for (int s = 0; s < STAGES - 1; ++s) issue(o + s * kWarps, s);
  for (int it = 0; o * 8 < r1; o += kWarps, ++it) {
    const int s = it % STAGES;
    issue(o + (STAGES - 1) * kWarps, (it + STAGES - 1) % STAGES);
    if constexpr (MODE == 0) {
      cp_async_wait<STAGES - 1>();
    } else {
      mbar_wait(uint32_t(__cvta_generic_to_shared(&bars[warp][s])), (phase >> s) & 1u);
      phase ^= 1u << s;
    }
    __syncwarp();
    const uint4* v = reinterpret_cast<const uint4*>(mine + s * 8 * REC);
    for (int j = lane; j < 8 * CPR; j += 32) {
      const uint4 x = v[j];
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    __syncwarp();
  }
  if constexpr (MODE == 0) cp_async_wait<0>();
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// The L2 flush before each timed run: a 256 MiB read by linear_ldg (the kernel `locks bench --device
// cuda` flushes with; scripts/bench_sdpa.py also reads) or a 256 MiB write, which leaves the L2 full
// of dirty lines that the timed read must first write back.
__global__ void flush_write(uint4* p, size_t n16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16; i += size_t(gridDim.x) * blockDim.x)
    p[i] = make_uint4(uint32_t(i), 0, 0, 0);
}

struct Flush {
  uint4* buf;
  size_t n16;
  uint32_t* sink;
  bool write;
  int n_sm;
  void run() const {
    if (write)
      flush_write<<<1024, 256>>>(buf, n16);
    else
      linear_ldg<<<n_sm * 8, 512>>>(buf, n16, sink + 1);
  }
};

template <class F>
float time_median(F&& launch, const Flush& fl) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int r = 0; r < 18; ++r) {
    fl.run();
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 3) ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// Usage: read_patterns [read|write] [batch...]   (defaults: read 1; batch b reads b * 262144 records)
int main(int argc, char** argv) {
  const bool write_flush = argc > 1 && std::string(argv[1]) == "write";
  std::vector<int> batches;
  for (int a = 2; a < argc; ++a) batches.push_back(std::atoi(argv[a]));
  if (batches.empty()) batches.push_back(1);
  int n_sm = 0;
  CK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
  const size_t fl_bytes = size_t(256) << 20;
  Flush fl{nullptr, fl_bytes / 16, nullptr, write_flush, n_sm};
  CK(cudaMalloc(&fl.buf, fl_bytes));
  CK(cudaMemset(fl.buf, 1, fl_bytes));
  uint32_t* sink;
  CK(cudaMalloc(&sink, 64));
  fl.sink = sink;
  std::printf("L2 flush before each run: 256 MiB %s\n", write_flush ? "write" : "read");
  for (int batch : batches) {
    const int n_rec = 262144 * batch;
    const size_t bytes = size_t(n_rec) * REC;
    uint8_t* recs;
    CK(cudaMalloc(&recs, bytes));
    CK(cudaMemset(recs, 0x5a, bytes));
    auto report = [&](const char* name, float ms) {
      std::printf("b%d %-30s %8.1f us %8.0f GB/s\n", batch, name, ms * 1e3f, double(bytes) / (ms * 1e-3) / 1e9);
    };
    report("linear-ldg",
           time_median([&] { linear_ldg<<<n_sm * 8, 256>>>(reinterpret_cast<const uint4*>(recs), bytes / 16, sink); },
                       fl));
    for (int ctas_per_sm : {3, 4}) {
      const int grid = n_sm * ctas_per_sm;
      const int chunk = (n_rec + grid - 1) / grid / 32 * 32 + 32;
      const int g = (n_rec + chunk - 1) / chunk;
      char name[64];
      std::snprintf(name, sizeof name, "chunk-ldg (%d CTAs)", g);
      report(name, time_median([&] { chunk_ldg<<<g, 128>>>(recs, chunk, n_rec, sink); }, fl));
      auto run_smem = [&](auto kern, int stages, const char* what) {
        const int smem = kWarps * stages * 8 * REC;
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        int occ = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, 128, smem));
        std::snprintf(name, sizeof name, "%s s%d (%d CTAs, %d/SM)", what, stages, g, occ);
        report(name, time_median([&] { kern<<<g, 128, smem>>>(recs, chunk, n_rec, sink); }, fl));
      };
      run_smem(chunk_smem<0, 2>, 2, "chunk-cpasync");
      run_smem(chunk_smem<0, 3>, 3, "chunk-cpasync");
      run_smem(chunk_smem<2, 2>, 2, "chunk-tma8");
    }
    CK(cudaFree(recs));
  }
  return 0;
}
