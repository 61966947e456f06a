// Quantized vectors for the baselines' per-page metadata (internal). One vector of n floats is
// stored as a fixed-size blob at a precision of `bits`:
//   32: float32 (4n bytes)          16: bf16 (2n bytes, no scale)
//   8 / 4 / 2: symmetric codes in [-(2^(b-1)-1), 2^(b-1)-1], packed low bits first, followed by one
//              f16 scale: ceil(n b / 8) + 2 bytes.
// The quantization is the LOCKS summary store's (locks/quant.h: the scale is rounded to f16 first and
// the codes are computed against the rounded scale), so decoding reproduces what was chosen and the
// byte counts equal SummaryFormat::bytes() for the same fields.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "locks/quant.h"

namespace locks::qvec {

inline bool valid_bits(int bits) { return bits == 32 || bits == 16 || bits == 8 || bits == 4 || bits == 2; }

/// Bytes of one stored vector of n values.
inline size_t bytes(size_t n, int bits) {
  if (bits == 32) return 4 * n;
  if (bits == 16) return 2 * n;
  return quant::packed_bytes(n, bits) + 2;
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
  f16_t scale = 0;
  float amax = 0.0f;
  if (!quant::quantize_packed(x, n, bits, dst, scale, amax))
    throw std::invalid_argument(fmt::format("selector metadata: {} magnitude {} overflows the f16 scale", what, amax));
  std::memcpy(dst + quant::packed_bytes(n, bits), &scale, 2);
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
  f16_t scale;
  std::memcpy(&scale, src + quant::packed_bytes(n, bits), 2);
  quant::dequantize_packed(src, n, bits, f16_to_f32(scale), out);
}

}  // namespace locks::qvec
