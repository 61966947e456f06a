// The integer Eq. 4 score pass (internal to src/core): a GQA group's queries prepared once per step,
// then every listed page of one (layer, KV head) scored from its stored codes in one stream. The
// int4 basis meets 21-bit query codes as integers (AVX2 maddubs/madd, AVX-512 VNNI dpbusd, or plain
// C++), so only the query's rounding (half a code step, 2^-21 of its largest element) separates
// V^T q from Eq. 4 on the stored summary; the centroid term, the 16 token logits and their
// log-sum-exp are float32 as in PageSummaryStore::score. The VNNI kernel scores four heads per page
// together, keeps each basis column in its own lanes (no horizontal sums), and sums the tokens'
// powers of two without a max shift unless the sum leaves the normal range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "locks/page_summary.h"
#include "locks/quant.h"

namespace locks::score_kernels {

/// Query codes of a GQA group: q_g ~= qscale[g] * code[g][c] with |code| <= kQMax, split as
/// 2^14 hi + 2^7 mid + lo (hi in [-64, 63], mid and lo in [0, 127]: int8 operands) in the int4
/// basis's nibble order. Every per-head array is padded with zero queries to a multiple of 4 heads.
struct PreparedQueries {
  static constexpr int kQMax = (1 << 20) - 1;
  static constexpr int kParts = 6;  // hi, mid, lo of the even and the odd channels
  int n_group = 0, d = 0;
  std::vector<float> q;        // [G][d] the queries as given (the centroid term)
  std::vector<int32_t> code;   // [G][d]
  std::vector<int8_t> split;   // [G][d / 64][kParts][32]: hi, mid, lo, each of the even then the odd channels
  std::vector<int32_t> qsum;   // [G] sum_c code (the offset-binary nibbles' correction)
  std::vector<float> qscale;   // [G]
  std::vector<int64_t> bcast;  // [G][d / 16][3 levels][even, odd]: 8 bytes of parts (see prepare_queries)
};

/// q: [n_group][d] float32, finite; d a multiple of 64.
void prepare_queries(const float* q, int n_group, int d, PreparedQueries& out);

/// One (layer, KV head)'s stored summaries in the shipped format (B = 16, r = 8, int4 basis with a
/// scale per column, int8 coefficients with a scale per token, int8 centroid), indexed by page id.
struct HeadRecords {
  const uint8_t* basis;         // [page][r * d / 2] two's-complement nibbles, low nibble first
  const f16_t* basis_scale;     // [page][r]
  const int8_t* coef;           // [page][16][r]
  const f16_t* coef_scale;      // [page][16]
  const int8_t* centroid;       // [page][d]
  const f16_t* centroid_scale;  // [page]
};

/// out[g * out_stride + j] = s_hat_{pages[j]}(q_g) (Eq. 4), head_max[g] = max_j of it.
using ScorePagesFn = void (*)(const PreparedQueries& pq, const HeadRecords& rec, const int32_t* pages, int n_pages,
                              float scale, float* out, size_t out_stride, float* head_max);

/// The kernel for `k` (which must be supported: score_kernel_supported), for d in {64, 128} on the
/// SIMD kernels and any multiple of 64 on the portable one.
ScorePagesFn kernel_for(ScoreKernel k, int d);

}  // namespace locks::score_kernels
