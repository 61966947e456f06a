// The CPU Q8_0 decode GEMV (cpu_gemv.h): AVX2 (the build's baseline) or AVX-512, chosen at run time.
#include "cpu_gemv.h"

#include <immintrin.h>

#include "locks/math.h"

#define LOCKS_TARGET_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl")))

namespace locks {

namespace {

constexpr int kBlock = 32;

// Two accumulators (even and odd blocks) hide the FMA latency; x stays in L1 across rows.
__attribute__((target("avx2,fma"))) float row_avx2(const int8_t* q, const float* s, const float* x, int n_blocks) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int b = 0; b < n_blocks; ++b) {
    const int8_t* qb = q + size_t(b) * kBlock;
    const float* xb = x + size_t(b) * kBlock;
    __m256 p = _mm256_setzero_ps();
    for (int i = 0; i < kBlock; i += 8) {
      const __m256 w =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + i))));
      p = _mm256_fmadd_ps(w, _mm256_loadu_ps(xb + i), p);
    }
    acc[b & 1] = _mm256_fmadd_ps(p, _mm256_set1_ps(s[b]), acc[b & 1]);
  }
  return hsum8(_mm256_add_ps(acc[0], acc[1]));
}

LOCKS_TARGET_AVX512 float row_avx512(const int8_t* q, const float* s, const float* x, int n_blocks) {
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int b = 0; b < n_blocks; ++b) {
    const int8_t* qb = q + size_t(b) * kBlock;
    const float* xb = x + size_t(b) * kBlock;
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb))));
    const __m512 w1 =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16))));
    const __m512 p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
    acc[b & 1] = _mm512_fmadd_ps(p, _mm512_set1_ps(s[b]), acc[b & 1]);
  }
  // Through memory, once per row: the 512-bit reduce intrinsics trip GCC 12's -Wuninitialized in
  // a function whose target attribute adds AVX-512 to an AVX2 build.
  alignas(64) float t[16];
  _mm512_store_ps(t, _mm512_add_ps(acc[0], acc[1]));
  return hsum8(_mm256_add_ps(_mm256_load_ps(t), _mm256_load_ps(t + 8)));
}

}  // namespace

bool gemv_kernel_supported(GemvKernel k) {
  switch (k) {
    case GemvKernel::kAuto:
      return true;
    case GemvKernel::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case GemvKernel::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
  return false;
}

void gemv_q8(const Matrix& W, const float* x, int r0, int r1, float* y, GemvKernel kernel) {
  static const bool has512 = gemv_kernel_supported(GemvKernel::kAvx512);
  const bool use512 = kernel == GemvKernel::kAvx512 || (kernel == GemvKernel::kAuto && has512);
  const int n_blocks = W.cols / kBlock;
  for (int r = r0; r < r1; ++r) {
    const int8_t* q = W.q8.data() + size_t(r) * W.cols;
    const float* s = W.q8_scale.data() + size_t(r) * n_blocks;
    y[r - r0] = use512 ? row_avx512(q, s, x, n_blocks) : row_avx2(q, s, x, n_blocks);
  }
}

}  // namespace locks
