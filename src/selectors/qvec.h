// Quantized vectors for the baselines' per-page metadata (internal). One vector of n floats is
// stored as a fixed-size blob at a precision of `bits`:
//   32: float32 (4n bytes)          16: bf16 (2n bytes, no scale)
//   8 / 4 / 2: symmetric codes in [-(2^(b-1)-1), 2^(b-1)-1], packed low bits first, followed by one
//              f16 scale: ceil(n b / 8) + 2 bytes.
// Same conventions as the LOCKS summary store (page_summary.cpp): the scale is rounded to f16 first
// and the codes are computed against the rounded scale, so decoding reproduces what was chosen and
// the byte counts equal SummaryFormat::bytes() for the same fields.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "locks/fp16.h"

namespace locks::qvec {

inline bool valid_bits(int bits) { return bits == 32 || bits == 16 || bits == 8 || bits == 4 || bits == 2; }

/// Bytes of one stored vector of n values.
inline size_t bytes(size_t n, int bits) {
  if (bits == 32) return 4 * n;
  if (bits == 16) return 2 * n;
  return (n * size_t(bits) + 7) / 8 + 2;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  x += 0x7FFFu + ((x >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(x >> 16);
}
inline float bf16_to_f32(uint16_t h) {
  uint32_t x = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

/// Store x[0..n) into dst (bytes(n, bits) bytes). Throws std::invalid_argument naming `what` when
/// the scale would overflow f16.
inline void encode(const float* x, size_t n, int bits, uint8_t* dst, const char* what) {
  if (bits == 32) {
    std::memcpy(dst, x, 4 * n);
    return;
  }
  if (bits == 16) {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t h = f32_to_bf16(x[i]);
      std::memcpy(dst + 2 * i, &h, 2);
    }
    return;
  }
  float amax = 0.0f;
  for (size_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(x[i]));
  const int qm = (1 << (bits - 1)) - 1;
  const float scale_f = amax / float(qm);
  if (!(scale_f <= 65504.0f))
    throw std::invalid_argument(fmt::format("selector metadata: {} magnitude {} overflows the f16 scale", what, amax));
  const f16_t scale_h = f32_to_f16(scale_f);
  const float scale = f16_to_f32(scale_h);
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  const size_t code_bytes = (n * size_t(bits) + 7) / 8;
  std::memset(dst, 0, code_bytes);
  const int per_byte = 8 / bits;
  for (size_t i = 0; i < n; ++i) {
    const int code = std::clamp(static_cast<int>(std::nearbyint(x[i] * inv)), -qm, qm);
    const uint8_t u = static_cast<uint8_t>(code) & uint8_t((1u << bits) - 1u);
    dst[i / per_byte] |= static_cast<uint8_t>(u << ((i % per_byte) * bits));
  }
  std::memcpy(dst + code_bytes, &scale_h, 2);
}

/// Decode a stored vector of n values into out[0..n).
inline void decode(const uint8_t* src, size_t n, int bits, float* out) {
  if (bits == 32) {
    std::memcpy(out, src, 4 * n);
    return;
  }
  if (bits == 16) {
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      out[i] = bf16_to_f32(h);
    }
    return;
  }
  const size_t code_bytes = (n * size_t(bits) + 7) / 8;
  f16_t scale_h;
  std::memcpy(&scale_h, src + code_bytes, 2);
  const float scale = f16_to_f32(scale_h);
  if (bits == 8) {
    const int8_t* s = reinterpret_cast<const int8_t*>(src);
    for (size_t i = 0; i < n; ++i) out[i] = float(s[i]) * scale;
    return;
  }
  const int per_byte = 8 / bits, shift_up = 8 - bits;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t u = static_cast<uint8_t>(src[i / per_byte] >> ((i % per_byte) * bits));
    const int8_t code = static_cast<int8_t>(static_cast<uint8_t>(u << shift_up)) >> shift_up;  // sign-extend
    out[i] = float(code) * scale;
  }
}

/// f16 rounding toward +inf / -inf (Quest's bounds must stay bounds after rounding). Finite x with
/// |x| <= 65504 only.
inline f16_t f16_round_up(float x) {
  f16_t h = f32_to_f16(x);
  if (f16_to_f32(h) < x) {
    if (h == 0x0000 || h == 0x8000) h = 0x0001;  // +-0 -> smallest positive subnormal
    else if (h & 0x8000) h = f16_t(h - 1);       // negative: smaller magnitude
    else h = f16_t(h + 1);
  }
  return h;
}
inline f16_t f16_round_down(float x) { return f16_t(f16_round_up(-x) ^ 0x8000u); }

}  // namespace locks::qvec
