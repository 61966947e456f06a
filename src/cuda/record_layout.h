// Byte layout of one device summary record (rank 8, int4 basis, int8 coefficients and centroid),
// shared by the build kernel, the score kernel and the host packer. Sizes for head dim d:
//   [0, 4d)          basis codes: column k (k < 8) at k * d/2, dims in natural order, two per byte
//                    (low nibble = even dim), offset binary: nibble = code + 8 in [1, 15] (code in
//                    [-7, 7]), so `word & 0x0f0f0f0f` and `(word >> 4) & 0x0f0f0f0f` are the u8
//                    operands of an int8 MMA (the offset is subtracted exactly afterwards)
//   [4d, 4d+128)     coefficient codes, int8: token i = 8*hi + g, column k = 2*t + kk at byte
//                    (4*g + t) * 4 + 2*hi + kk, so lane 4g+t of a warp reads its 4 bytes with one load
//   [4d+128, 5d+128) centroid codes, int8: every 8 dims stored as (0,2,4,6,1,3,5,7), the order of the
//                    basis nibbles above, so the codes are int8 MMA operands as stored
//   [5d+128, 5d+192) scales, f16, four 16-byte chunks; chunk t holds
//                    coef scales of tokens 2t, 2t+1, 8+2t, 9+2t, basis scales of columns 2t, 2t+1,
//                    the centroid scale, and a zero
// d = 128: 832 bytes (818 of payload and scales, as the CPU SummaryFormat::bytes, + 14 padding).
#pragma once

#include <cstddef>

#include "locks/quant.h"  // LOCKS_HD; the codes' formats

namespace locks::cuda::layout {

constexpr int kRank = 8;
constexpr int kPage = 16;

LOCKS_HD constexpr size_t basis_offset(int /*d*/) { return 0; }
LOCKS_HD constexpr size_t coef_offset(int d) { return size_t(4) * d; }
LOCKS_HD constexpr size_t centroid_offset(int d) { return size_t(4) * d + 128; }
LOCKS_HD constexpr size_t scales_offset(int d) { return size_t(5) * d + 128; }
LOCKS_HD constexpr size_t record_bytes(int d) { return size_t(5) * d + 192; }

/// Byte offset (inside the coefficient block) of token i, column k.
LOCKS_HD constexpr int coef_byte(int i, int k) { return ((i % 8) * 4 + k / 2) * 4 + (i / 8) * 2 + (k % 2); }
/// Byte offset (inside the centroid block) of dim c.
LOCKS_HD constexpr int centroid_byte(int c) { return (c & ~7) + ((c & 1) ? 4 + ((c & 7) >> 1) : ((c & 7) >> 1)); }
/// f16 slot (inside the scales block, in f16 units) of the coefficient scale of token i.
LOCKS_HD constexpr int coef_scale_slot(int i) { return ((i % 8) / 2) * 8 + (i / 8) * 2 + (i % 2); }
/// f16 slot of the basis scale of column k.
LOCKS_HD constexpr int basis_scale_slot(int k) { return (k / 2) * 8 + 4 + (k % 2); }
/// f16 slot of the centroid scale copy in chunk t (t < 4).
LOCKS_HD constexpr int centroid_scale_slot(int t) { return t * 8 + 6; }

}  // namespace locks::cuda::layout
