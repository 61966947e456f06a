// Number formats of the stored data, one definition for host and device code: IEEE binary16 (f16)
// and bfloat16 (bf16) conversion, symmetric group quantization with an f16 scale, and the packing
// of its codes. The KV cache, the summary store (page_summary.h), the baselines' metadata
// (src/selectors/qvec.h), the GGUF reader and the CUDA summary build and packer all round through
// these, so a summary built on the GPU is bit-identical to the CPU store's (docs/design.md).
//
// Host: F16C intrinsics where the target has them (-march=x86-64-v3 or native), else the portable
// integer code below; device (nvcc's device pass): the cuda_fp16 conversions. All round to nearest
// even. Arithmetic on the values is float32 everywhere.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define LOCKS_HD __host__ __device__
#else
#define LOCKS_HD
#endif

#if !defined(__CUDA_ARCH__) && defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define LOCKS_QUANT_F16C 1
#endif

namespace locks {

using f16_t = uint16_t;   // raw IEEE binary16 bits
using bf16_t = uint16_t;  // raw bfloat16 bits (the high half of a float32)

namespace quant_detail {

LOCKS_HD inline uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
#endif
}
LOCKS_HD inline float bits_f32(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(x);
#else
  float f;
  std::memcpy(&f, &x, 4);
  return f;
#endif
}

// Portable f16 -> f32, as F16C's VCVTPH2PS: exact, a NaN comes back quiet with its payload.
inline float f16_to_f32_soft(f16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));  // inf, NaN
  return bits_f32(sign | ((exp + (127 - 15)) << 23) | (mant << 13));  // normal: rebias 15 -> 127
}

// Portable f32 -> f16, round to nearest even, as F16C's VCVTPS2PH: beyond the f16 range to +-inf,
// NaN stays NaN (quiet, payload truncated).
inline f16_t f32_to_f16_soft(float f) {
  const uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u)  // inf, NaN
    return static_cast<f16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
  if (ax >= 0x477ff000u) return static_cast<f16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                                            // below 2^-14: an f16 subnormal or zero
    if (ax < 0x33000000u) return static_cast<f16_t>(sign);           // <= 2^-25 (a tie with 0 included)
    const uint32_t shift = 126u - (ax >> 23);                        // 14 .. 24
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<f16_t>(sign | h);
  }
  uint32_t h = (ax >> 13) - ((127u - 15u) << 10);  // rebias; the mantissa's top 10 bits
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
  return static_cast<f16_t>(sign | h);
}

}  // namespace quant_detail

/// f16 bits -> float (exact).
LOCKS_HD inline float f16_to_f32(f16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#elif defined(LOCKS_QUANT_F16C)
  return _cvtsh_ss(h);
#else
  return quant_detail::f16_to_f32_soft(h);
#endif
}

/// float -> f16 bits, round to nearest even; beyond +-65504 the result is +-inf (callers clamp or
/// check first).
LOCKS_HD inline f16_t f32_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#elif defined(LOCKS_QUANT_F16C)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  return quant_detail::f32_to_f16_soft(f);
#endif
}

/// bf16 bits -> float (exact).
LOCKS_HD inline float bf16_to_f32(bf16_t h) { return quant_detail::bits_f32(uint32_t(h) << 16); }

/// float -> bf16 bits, round to nearest even (host: on the bits, no special case for NaN; device:
/// the hardware conversion, the same for every non-NaN value).
LOCKS_HD inline bf16_t f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  uint32_t x = quant_detail::f32_bits(f);
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<bf16_t>(x >> 16);
#endif
}

/// dst[i] = float(src[i]) for i < n (host).
inline void f16_to_f32_row(const f16_t* src, float* dst, size_t n) {
  size_t i = 0;
#if defined(LOCKS_QUANT_F16C)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

/// dst[i] = f16(src[i]) for i < n, round to nearest even (host).
inline void f32_to_f16_row(const float* src, f16_t* dst, size_t n) {
  size_t i = 0;
#if defined(LOCKS_QUANT_F16C)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

/// The f16 value nearest x at or above it (toward +inf). Finite x with |x| <= 65504 only.
inline f16_t f16_round_up(float x) {
  f16_t h = f32_to_f16(x);
  if (f16_to_f32(h) < x) {
    if (h == 0x0000 || h == 0x8000)
      h = 0x0001;  // +-0 -> smallest positive subnormal
    else if (h & 0x8000)
      h = f16_t(h - 1);  // negative: smaller magnitude
    else
      h = f16_t(h + 1);
  }
  return h;
}
/// The f16 value nearest x at or below it (toward -inf). Finite x with |x| <= 65504 only.
inline f16_t f16_round_down(float x) { return f16_t(f16_round_up(-x) ^ 0x8000u); }

// Symmetric group quantization: n values x_i of a group share one f16 scale s, and are stored as
// codes c_i in [-qm, qm], qm = 2^(b-1) - 1, with x_i ~ c_i * s. The scale is max|x_i| / qm rounded
// to f16 first, and the codes are computed against the rounded scale (c_i = round-half-even(x_i /
// s), clamped), so that dequantization gives back exactly what was chosen. An all-zero group has
// scale 0 and codes 0. A scale beyond the f16 range does not fit: the host callers throw, naming the
// group; the device build clamps it (its keys come from an f16 cache and never get there).
namespace quant {

constexpr float kF16Max = 65504.0f;

/// Largest code of b-bit symmetric quantization: 127 (int8), 7 (int4), 1 (int2).
LOCKS_HD constexpr int qmax(int bits) { return (1 << (bits - 1)) - 1; }

/// Bytes of n b-bit codes packed low bits first (b in {2, 4, 8}).
LOCKS_HD constexpr size_t packed_bytes(size_t n, int bits) { return (n * size_t(bits) + 7) / 8; }

/// max_i |x_i| (NaN values are passed over).
LOCKS_HD inline float abs_max(const float* x, size_t n) {
  float amax = 0.0f;
  for (size_t i = 0; i < n; ++i) amax = amax < fabsf(x[i]) ? fabsf(x[i]) : amax;
  return amax;
}

/// The unrounded scale amax / qm; it fits an f16 scale when <= kF16Max.
LOCKS_HD inline float raw_scale(float amax, int qm) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(amax, float(qm));
#else
  return amax / float(qm);
#endif
}

/// 1 / scale, or 0 for a zero scale (every code 0).
LOCKS_HD inline float inv_scale(float scale) {
#if defined(__CUDA_ARCH__)
  return scale > 0.0f ? __frcp_rn(scale) : 0.0f;
#else
  return scale > 0.0f ? 1.0f / scale : 0.0f;
#endif
}

/// The code of x: round-half-even of x * inv, clamped to [-qm, qm].
LOCKS_HD inline int code(float x, float inv, int qm) {
#if defined(__CUDA_ARCH__)
  return max(-qm, min(qm, __float2int_rn(__fmul_rn(x, inv))));
#else
  const int c = static_cast<int>(std::nearbyint(x * inv));
  return c < -qm ? -qm : c > qm ? qm : c;
#endif
}

/// Quantizes x[0..n) with qm levels each side (host): scale_out = the f16 scale, then emit(i, code_i)
/// for i = 0, 1, ..., n - 1. Returns false, emitting nothing, when the scale does not fit f16;
/// amax_out = max|x_i| either way (for the caller's error message). The device build reduces max|x_i|
/// over a warp and uses raw_scale / inv_scale / code directly.
template <class Emit>
inline bool quantize(const float* x, size_t n, int qm, f16_t& scale_out, float& amax_out, Emit&& emit) {
  amax_out = abs_max(x, n);
  const float scale_f = raw_scale(amax_out, qm);
  if (scale_f > kF16Max) return false;
  scale_out = f32_to_f16(scale_f);
  const float inv = inv_scale(f16_to_f32(scale_out));
  for (size_t i = 0; i < n; ++i) emit(i, code(x[i], inv, qm));
  return true;
}

/// Sign-extends the low `bits` bits of u (a two's-complement code).
LOCKS_HD inline int sign_extend(uint32_t u, int bits) {
  const int up = 32 - bits;
  return static_cast<int>(u << up) >> up;
}

/// quantize() into b-bit two's-complement codes packed low bits first (packed_bytes(n, bits) bytes
/// at dst, b in {2, 4, 8}); the summary store's and the selectors' layout.
inline bool quantize_packed(const float* x, size_t n, int bits, uint8_t* dst, f16_t& scale_out, float& amax_out) {
  const size_t per_byte = size_t(8 / bits);
  const uint32_t mask = (1u << bits) - 1u;
  return quantize(x, n, qmax(bits), scale_out, amax_out, [&](size_t i, int c) {
    if (i == 0) std::memset(dst, 0, packed_bytes(n, bits));
    dst[i / per_byte] |= static_cast<uint8_t>((static_cast<uint32_t>(c) & mask) << ((i % per_byte) * bits));
  });
}

/// The i-th b-bit two's-complement code of a packed_bytes() layout.
LOCKS_HD inline int packed_code(const uint8_t* src, size_t i, int bits) {
  const size_t per_byte = size_t(8 / bits);
  return sign_extend(uint32_t(src[i / per_byte] >> ((i % per_byte) * bits)) & ((1u << bits) - 1u), bits);
}

/// out[i] = code_i * scale for n codes of a packed_bytes() layout.
inline void dequantize_packed(const uint8_t* src, size_t n, int bits, float scale, float* out) {
  if (bits == 8) {
    const int8_t* s = reinterpret_cast<const int8_t*>(src);
    for (size_t i = 0; i < n; ++i) out[i] = float(s[i]) * scale;
    return;
  }
  if (bits == 4) {  // two nibbles per byte, low nibble first
    for (size_t b = 0; b < n / 2; ++b) {
      out[2 * b] = float(sign_extend(src[b] & 0xfu, 4)) * scale;
      out[2 * b + 1] = float(sign_extend(src[b] >> 4, 4)) * scale;
    }
    if (n % 2) out[n - 1] = float(sign_extend(src[n / 2] & 0xfu, 4)) * scale;
    return;
  }
  for (size_t i = 0; i < n; ++i) out[i] = float(packed_code(src, i, bits)) * scale;
}

/// Two int4 codes in [-7, 7] as one offset-binary byte (code + 8 per nibble, lo in the low nibble):
/// the device record's basis layout, whose nibbles are u8 MMA operands as stored.
LOCKS_HD inline uint8_t offset_nibbles(int lo, int hi) { return uint8_t((lo + 8) | ((hi + 8) << 4)); }
/// The code of nibble `which` (0 low, 1 high) of an offset-binary byte.
LOCKS_HD inline int offset_nibble_code(uint8_t byte, int which) { return ((byte >> (4 * which)) & 0xf) - 8; }

}  // namespace quant

}  // namespace locks
