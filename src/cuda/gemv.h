// The decode step's weight products at small batch (one token per sequence): a bf16 GEMV on tensor
// cores that streams each weight once, launched with PDL so that its first loads overlap the previous
// kernel. At batch 1 it reads the weights 5% faster than cuBLAS (H200); the engine uses it there and
// cuBLAS (gemm.h) for everything else.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace locks::cuda {

constexpr int kGemvMaxRows = 8;

struct GemvParams {
  const uint16_t* x = nullptr;  // [rows][n_in] bf16 bits, row-major, 16-byte aligned
  const uint16_t* w = nullptr;  // [n_out][n_in] bf16 bits, row-major, 16-byte aligned
  int rows = 1;                 // 1..kGemvMaxRows
  int n_out = 0;
  int n_in = 0;  // a multiple of 8
  /// Output n of row r: y[r * ldy + n] for n < split, else y2[r * ldy2 + n - split] (a product whose
  /// outputs go to two buffers, e.g. Q and K|V, in one launch). split = n_out: y only.
  float* y = nullptr;
  int ldy = 0;
  float* y2 = nullptr;
  int ldy2 = 0;
  int split = 0;
  bool accumulate = false;  // y += x W^T instead of y = x W^T
};

/// Whether gemv_bf16 takes this product (rows 1..8, n_in a positive multiple of 8, n_out > 0).
bool gemv_applies(int rows, int n_out, int n_in);

/// y = x W^T (+ y): float32 accumulation of bf16 products on tensor cores (mma m16n8k16: 16 weight rows
/// x the batch rows padded to 8), 16 outputs per CTA of 8 warps that split n_in and add their partial
/// sums in shared memory. Each output is written by one thread (no atomics): deterministic, and
/// capturable in a CUDA graph. cudaErrorInvalidValue when !gemv_applies or a pointer is null.
cudaError_t gemv_bf16(const GemvParams& p, cudaStream_t stream);

}  // namespace locks::cuda
