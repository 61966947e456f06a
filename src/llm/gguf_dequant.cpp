// ggml tensor blocks -> float32. Layouts (ggml-common.h, QK_K = 256, all little-endian):
//   Q8_0  {d f16; qs[32] int8}                                 34 bytes / 32
//   Q4_0  {d f16; qs[16] nibbles, offset 8}                    18 bytes / 32
//   Q2_K  {scales[16] (lo nibble scale, hi nibble min); qs[64] 2-bit; d, dmin f16}      84 / 256
//   Q3_K  {hmask[32]; qs[64] 2-bit; scales[12] 16 x 6-bit, offset 32; d f16}           110 / 256
//   Q4_K  {d, dmin f16; scales[12] 8 x (6-bit scale, 6-bit min); qs[128] nibbles}      144 / 256
//   Q5_K  {d, dmin f16; scales[12] as Q4_K; qh[32] 5th bits; qs[128] nibbles}          176 / 256
//   Q6_K  {ql[128] low nibbles; qh[64] 2 high bits; scales[16] int8; d f16}            210 / 256
// Every product is computed as ggml computes it in float32 (scale products first), so the values
// equal llama.cpp's dequantization.
#include "gguf_dequant.h"

#include <bit>

#include "locks/gguf.h"
#include "locks/quant.h"

namespace locks::gguf_detail {

namespace {

constexpr int kQK = 256;  // QK_K

uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t load_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}
float half(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

// The j-th (scale, min) pair of the 12-byte Q4_K/Q5_K table: pairs 0-3 are the low 6 bits of bytes
// j and j + 4; pairs 4-7 take their low 4 bits from byte j + 4's nibbles and their top 2 bits from
// the top bits of bytes j - 4 (scale) and j (min).
void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void q2_k(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = half(b + 80), dmin = half(b + 82);
  int is = 0;
  for (int n = 0; n < kQK; n += 128, q += 32) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half16 = 0; half16 < 2; ++half16, ++is) {  // two groups of 16 per shift
        const float dl = d * float(scales[is] & 0xf), ml = dmin * float(scales[is] >> 4);
        for (int l = 0; l < 16; ++l) *y++ = dl * float((q[16 * half16 + l] >> shift) & 3) - ml;
      }
    }
  }
}

void q3_k(const uint8_t* b, float* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const uint8_t* sc = b + 96;
  const float d = half(b + 108);
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < kQK; n += 128, q += 32) {
    for (int shift = 0; shift < 8; shift += 2, m = uint8_t(m << 1)) {
      for (int half16 = 0; half16 < 2; ++half16, ++is) {
        // 6-bit scale `is`: low 4 bits from a nibble of bytes 0-7, top 2 bits from bytes 8-11.
        const int lo = is < 8 ? sc[is] & 0xf : sc[is - 8] >> 4;
        const int hi = (sc[8 + is % 4] >> (2 * (is / 4))) & 3;
        const float dl = d * float((lo | (hi << 4)) - 32);
        for (int l = 16 * half16; l < 16 * half16 + 16; ++l)
          *y++ = dl * float(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
      }
    }
  }
}

void q4_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0, is = 0; j < kQK; j += 64, q += 32, is += 2) {
    int sc = 0, m = 0;
    scale_min_k4(is, scales, sc, m);
    const float d1 = d * float(sc), m1 = dmin * float(m);
    scale_min_k4(is + 1, scales, sc, m);
    const float d2 = d * float(sc), m2 = dmin * float(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * float(q[l] & 0xf) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * float(q[l] >> 4) - m2;
  }
}

void q5_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0, is = 0; j < kQK; j += 64, ql += 32, is += 2, u1 = uint8_t(u1 << 2), u2 = uint8_t(u2 << 2)) {
    int sc = 0, m = 0;
    scale_min_k4(is, scales, sc, m);
    const float d1 = d * float(sc), m1 = dmin * float(m);
    scale_min_k4(is + 1, scales, sc, m);
    const float d2 = d * float(sc), m2 = dmin * float(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * float((ql[l] & 0xf) + ((qh[l] & u1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * float((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
  }
}

void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int n = 0; n < kQK; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * float(sc[is]) * float(q1);
      y[l + 32] = d * float(sc[is + 2]) * float(q2);
      y[l + 64] = d * float(sc[is + 4]) * float(q3);
      y[l + 96] = d * float(sc[is + 6]) * float(q4);
    }
  }
}

}  // namespace

bool tensor_block(uint32_t type, uint64_t& block_elems, uint64_t& block_bytes) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::F32:
      block_elems = 1, block_bytes = 4;
      return true;
    case GgmlType::F16:
    case GgmlType::BF16:
      block_elems = 1, block_bytes = 2;
      return true;
    case GgmlType::Q8_0:
      block_elems = 32, block_bytes = 34;
      return true;
    case GgmlType::Q4_0:
      block_elems = 32, block_bytes = 18;
      return true;
    case GgmlType::Q2_K:
      block_elems = kQK, block_bytes = 84;
      return true;
    case GgmlType::Q3_K:
      block_elems = kQK, block_bytes = 110;
      return true;
    case GgmlType::Q4_K:
      block_elems = kQK, block_bytes = 144;
      return true;
    case GgmlType::Q5_K:
      block_elems = kQK, block_bytes = 176;
      return true;
    case GgmlType::Q6_K:
      block_elems = kQK, block_bytes = 210;
      return true;
  }
  return false;
}

void dequantize_blocks(uint32_t type, const uint8_t* src, uint64_t n_blocks, float* dst) {
  uint64_t be = 0, bb = 0;
  if (!tensor_block(type, be, bb)) return;
  for (uint64_t i = 0; i < n_blocks; ++i, src += bb, dst += be) {
    switch (static_cast<GgmlType>(type)) {
      case GgmlType::F32:
        *dst = std::bit_cast<float>(load_u32(src));
        break;
      case GgmlType::F16:
        *dst = f16_to_f32(load_u16(src));
        break;
      case GgmlType::BF16:
        *dst = bf16_to_f32(load_u16(src));
        break;
      case GgmlType::Q8_0: {
        const float d = half(src);
        for (int j = 0; j < 32; ++j) dst[j] = float(static_cast<int8_t>(src[2 + j])) * d;
        break;
      }
      case GgmlType::Q4_0: {
        // Low nibbles hold elements 0-15 of the block, high nibbles 16-31; stored offset by 8.
        const float d = half(src);
        for (int j = 0; j < 16; ++j) {
          dst[j] = float((src[2 + j] & 0x0f) - 8) * d;
          dst[j + 16] = float((src[2 + j] >> 4) - 8) * d;
        }
        break;
      }
      case GgmlType::Q2_K:
        q2_k(src, dst);
        break;
      case GgmlType::Q3_K:
        q3_k(src, dst);
        break;
      case GgmlType::Q4_K:
        q4_k(src, dst);
        break;
      case GgmlType::Q5_K:
        q5_k(src, dst);
        break;
      case GgmlType::Q6_K:
        q6_k(src, dst);
        break;
    }
  }
}

}  // namespace locks::gguf_detail
