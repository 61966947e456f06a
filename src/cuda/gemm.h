// Matrix products of the GPU engine through cuBLAS, loaded at run time: a CUDA build of locks starts
// (and runs on the CPU) where cuBLAS is absent; `--device cuda` then names the missing library.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

namespace locks::cuda {

/// One cuBLAS handle bound to a stream, with its own workspace (so that products can be captured in
/// a CUDA graph: cuBLAS allocates nothing while capturing).
class Gemm {
 public:
  /// Loads libcublas.so.13 (or libcublas.so) on first use. Throws std::runtime_error naming the
  /// library when it cannot be loaded, and the cuBLAS status when a handle cannot be made.
  explicit Gemm(cudaStream_t stream);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  /// y[rows][n_out] = x[rows][n_in] * w[n_out][n_in]^T (+ y when accumulate): x and w row-major,
  /// bf16 (or float32 with f32: full-precision SGEMM, no TF32), y float32, float32 accumulation.
  /// Enqueued on the handle's stream; returns false and sets error() on a cuBLAS failure.
  bool run(const void* x, const void* w, bool f32, float* y, int rows, int n_out, int n_in, bool accumulate);
  const std::string& error() const { return error_; }

 private:
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
  std::string error_;
};

/// Whether cuBLAS can be loaded here; `why` names the library and the loader's message otherwise.
bool cublas_available(std::string* why = nullptr);

}  // namespace locks::cuda
