// cuBLAS through dlopen: the few entry points the engine uses, resolved once.
#include "gemm.h"

#include <cublas_api.h>
#include <dlfcn.h>

#include <mutex>
#include <stdexcept>
#include <type_traits>

namespace locks::cuda {

namespace {

struct Cublas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  std::string error;  // empty when loaded
};

const Cublas& cublas() {
  static Cublas lib;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = nullptr;
    std::string tried;
    for (const char* name : {"libcublas.so.13", "libcublas.so"}) {
      if ((h = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
      tried += std::string(tried.empty() ? "" : "; ") + dlerror();
    }
    if (!h) {
      lib.error = "cuBLAS is not loadable (" + tried +
                  "): install the CUDA toolkit's cuBLAS or add its lib64 folder to LD_LIBRARY_PATH";
      return;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn && lib.error.empty()) lib.error = std::string("cuBLAS lacks ") + name;
    };
    sym(lib.create, "cublasCreate_v2");
    sym(lib.destroy, "cublasDestroy_v2");
    sym(lib.set_stream, "cublasSetStream_v2");
    sym(lib.set_workspace, "cublasSetWorkspace_v2");
    sym(lib.set_math_mode, "cublasSetMathMode");
    sym(lib.gemm_ex, "cublasGemmEx");
    sym(lib.status_string, "cublasGetStatusString");
  });
  return lib;
}

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper

}  // namespace

bool cublas_available(std::string* why) {
  const Cublas& lib = cublas();
  if (why) *why = lib.error;
  return lib.error.empty();
}

Gemm::Gemm(cudaStream_t stream) {
  const Cublas& lib = cublas();
  if (!lib.error.empty()) throw std::runtime_error(lib.error);
  cublasHandle_t h = nullptr;
  if (const cublasStatus_t s = lib.create(&h); s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLAS: cannot create a handle: ") + lib.status_string(s));
  handle_ = h;
  if (cudaMalloc(&workspace_, kWorkspaceBytes) != cudaSuccess) {
    cudaGetLastError();
    lib.destroy(h);
    throw std::runtime_error("cuBLAS: no device memory for its 32 MiB workspace");
  }
  lib.set_stream(h, stream);
  lib.set_workspace(h, workspace_, kWorkspaceBytes);
  lib.set_math_mode(h, CUBLAS_DEFAULT_MATH);
}

Gemm::~Gemm() {
  if (handle_) cublas().destroy(static_cast<cublasHandle_t>(handle_));
  if (workspace_) cudaFree(workspace_);
}

bool Gemm::run(const void* x, const void* w, bool f32, float* y, int rows, int n_out, int n_in, bool accumulate) {
  // Column-major view: y^T [n_out x rows] = w [n_out x n_in] (stored as w^T, ld n_in) * x^T.
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const cudaDataType in = f32 ? CUDA_R_32F : CUDA_R_16BF;
  const Cublas& lib = cublas();
  const cublasStatus_t s = lib.gemm_ex(static_cast<cublasHandle_t>(handle_), CUBLAS_OP_T, CUBLAS_OP_N, n_out, rows,
                                       n_in, &alpha, w, in, n_in, x, in, n_in, &beta, y, CUDA_R_32F, n_out,
                                       f32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s == CUBLAS_STATUS_SUCCESS) return true;
  error_ = std::string("cuBLAS GEMM ") + std::to_string(rows) + "x" + std::to_string(n_out) + "x" +
           std::to_string(n_in) + ": " + lib.status_string(s);
  return false;
}

}  // namespace locks::cuda
