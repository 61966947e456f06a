// Causal prefill attention over the paged cache, blocked like FlashAttention: each task owns one
// (KV head, block of query tokens) with all G heads of the group stacked as rows, walks key blocks
// of whole pages, and keeps an online softmax. Scores of one block live in a small tile, so memory
// is O(block) for any context length.
#include <fmt/format.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "locks/attention.h"
#include "locks/math.h"

namespace locks {

namespace {
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
constexpr int kQueryBlock = 128;   // tokens per task (x G rows)
constexpr int kKeyBlockPages = 8;  // pages per key block (128 tokens at B = 16)
}  // namespace

void paged_prefill_attention(const PagedKvCache& cache, int il, const KvSequence& seq, int32_t pos0, int n_q,
                             const float* q, int n_head, float scale, float* out, int first_query) {
  const auto& cfg = cache.config();
  const int d = cfg.head_dim, B = cfg.page_size, H = cfg.n_head_kv;
  // Checked here, before the parallel region (an exception cannot leave an OpenMP region).
  cache.check_layer_head("paged_prefill_attention", il);
  cache.check_sequence("paged_prefill_attention", seq, /*ids=*/true);
  if (q == nullptr || out == nullptr)
    throw std::invalid_argument("paged_prefill_attention: q and out must not be null");
  if (n_head < H || n_head % H != 0)
    throw std::invalid_argument(
        fmt::format("paged_prefill_attention: n_head {} is not a multiple of n_head_kv {}", n_head, H));
  if (pos0 < 0 || n_q < 0 || int64_t(pos0) + n_q > seq.n_tokens)
    throw std::out_of_range(fmt::format("paged_prefill_attention: queries [{}, {}) outside the sequence's {} tokens",
                                        pos0, int64_t(pos0) + n_q, seq.n_tokens));
  if (!std::isfinite(scale)) throw std::invalid_argument(fmt::format("paged_prefill_attention: scale {}", scale));
  {  // the rows attention reads: every block that ends at or after first_query
    const int t0 = std::clamp(first_query, 0, n_q) / kQueryBlock * kQueryBlock;
    const size_t row = size_t(n_head) * cfg.head_dim;
    if (const std::ptrdiff_t i = first_non_finite(q + size_t(t0) * row, size_t(n_q - t0) * row); i >= 0)
      throw std::invalid_argument(fmt::format("paged_prefill_attention: non-finite query at token {}, head {}, dim {}",
                                              pos0 + t0 + i / std::ptrdiff_t(row), (i % row) / cfg.head_dim,
                                              i % cfg.head_dim));
  }
  const int G = n_head / H;
  const int n_qblocks = (n_q + kQueryBlock - 1) / kQueryBlock;
  const int n_tasks = H * n_qblocks;

#pragma omp parallel
  {
    RowMat Q, S, O, K(kKeyBlockPages * B, d), V(kKeyBlockPages * B, d);
    std::vector<float> m, l;
#pragma omp for schedule(dynamic, 1)
    for (int task = n_tasks - 1; task >= 0; --task) {  // late (long) blocks first for balance
      const int h = task % H, qb = task / H;
      const int t0 = qb * kQueryBlock, tq = std::min(kQueryBlock, n_q - t0);
      if (t0 + tq <= first_query) continue;  // no row of this block is wanted
      const int rows = tq * G;
      Q.resize(rows, d);
      for (int t = 0; t < tq; ++t)
        for (int g = 0; g < G; ++g) {
          const float* src = q + (size_t(t0 + t) * n_head + size_t(h) * G + g) * d;
          for (int x = 0; x < d; ++x) Q(t * G + g, x) = src[x] * scale;
        }
      O.setZero(rows, d);
      m.assign(rows, kNegInf);
      l.assign(rows, 0.0f);
      const int32_t last_pos = pos0 + t0 + tq - 1;  // keys beyond it are masked for every row
      const int n_key_pages = last_pos / B + 1;
      for (int p0 = 0; p0 < n_key_pages; p0 += kKeyBlockPages) {
        const int np = std::min(kKeyBlockPages, n_key_pages - p0);
        const int nk = np * B;
        for (int p = 0; p < np; ++p) {
          cache.k_page_f32(il, seq.page_table[p0 + p], h, K.data() + size_t(p) * B * d);
          cache.v_page_f32(il, seq.page_table[p0 + p], h, V.data() + size_t(p) * B * d);
        }
        S.noalias() = Q * K.topRows(nk).transpose();  // [rows][nk]
        const int32_t key0 = p0 * B;
        for (int rrow = 0; rrow < rows; ++rrow) {
          const int32_t qpos = pos0 + t0 + rrow / G;
          float* srow = S.row(rrow).data();
          const int valid = std::clamp(qpos - key0 + 1, 0, nk);  // causal mask: keys <= qpos
          const float mx = std::max(m[rrow], max_of(srow, valid));
          const float corr = m[rrow] == kNegInf ? 0.0f : fast_exp(m[rrow] - mx);
          const float sum = valid > 0 ? exp_shift_sum(srow, valid, mx) : 0.0f;
          for (int c = valid; c < nk; ++c) srow[c] = 0.0f;
          l[rrow] = l[rrow] * corr + sum;
          m[rrow] = mx;
          O.row(rrow) *= corr;
        }
        O.noalias() += S * V.topRows(nk);
      }
      for (int t = 0; t < tq; ++t)
        for (int g = 0; g < G; ++g) {
          const int rrow = t * G + g;
          const float inv = l[rrow] > 0.0f ? 1.0f / l[rrow] : 0.0f;
          float* dst = out + (size_t(t0 + t) * n_head + size_t(h) * G + g) * d;
          for (int x = 0; x < d; ++x) dst[x] = O(rrow, x) * inv;
        }
    }
  }
}

}  // namespace locks
