// The CPU decode GEMV on Q8_0 weights (internal to src/llm): y = W x for one token, reading the
// weights as the file stores them (int8 codes, one scale per 32) instead of their float32 copy, so a
// decode step moves 1.06 bytes per weight instead of 4. The GPU twin is src/cuda/gemv.cu.
#pragma once

#include "locks/model.h"

namespace locks {

enum class GemvKernel { kAuto, kAvx2, kAvx512 };
bool gemv_kernel_supported(GemvKernel k);  // whether this CPU runs it (kAuto: always)

/// y[r - r0] = sum_c W.q8[r][c] * W.q8_scale[r][c / 32] * x[c] for rows r in [r0, r1) (float32,
/// summed per 32-block then scaled: the value of the GGUF Q8_0 block, ggml's `block_q8_0`, times x).
/// W must hold Q8_0 codes (W.has_q8()); x has W.cols floats.
void gemv_q8(const Matrix& W, const float* x, int r0, int r1, float* y, GemvKernel kernel = GemvKernel::kAuto);

}  // namespace locks
