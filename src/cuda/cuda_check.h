// One way the engine's host code turns a CUDA error into an exception naming the part and the step.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace locks::cuda {

/// Throws std::runtime_error("<part>: <what>: <CUDA's message>") unless e is cudaSuccess (and clears
/// the sticky error of a failed launch, so the next check reports its own).
inline void throw_on_error(cudaError_t e, const char* part, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  throw std::runtime_error(std::string(part) + ": " + what + ": " + cudaGetErrorString(e));
}

}  // namespace locks::cuda
