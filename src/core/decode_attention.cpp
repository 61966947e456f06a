// Decode attention over a page list: one pass, online softmax (the CPU twin of the split-K GPU kernel).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "locks/attention.h"
#include "locks/math.h"

namespace locks {

void paged_decode_attention(const PagedKvCache& cache, int il, int kv_head, const KvSequence& seq,
                            std::span<const int32_t> pages, const float* q, int n_group, float scale, float* o,
                            float* lse) {
  const auto& cfg = cache.config();
  const int d = cfg.head_dim, B = cfg.page_size;
  constexpr int kMaxPage = 32, kMaxPageElems = 32 * 256;  // fixed stack buffers below
  if (B > kMaxPage || size_t(B) * d > size_t(kMaxPageElems))
    throw std::invalid_argument(
        fmt::format("paged_decode_attention: page_size {} x head_dim {} exceeds the kernel's limits (page_size <= {}, "
                    "page_size * head_dim <= {})",
                    B, d, kMaxPage, kMaxPageElems));
  cache.check_layer_head("paged_decode_attention", il, kv_head);
  cache.check_sequence("paged_decode_attention", seq, /*ids=*/false);
  if (n_group < 1) throw std::invalid_argument(fmt::format("paged_decode_attention: n_group {} < 1", n_group));
  if (q == nullptr || o == nullptr) throw std::invalid_argument("paged_decode_attention: q and o must not be null");
  if (!std::isfinite(scale)) throw std::invalid_argument(fmt::format("paged_decode_attention: scale {}", scale));
  if (const std::ptrdiff_t i = first_non_finite(q, size_t(n_group) * d); i >= 0)
    throw std::invalid_argument(
        fmt::format("paged_decode_attention: non-finite query at head {}, dim {}", i / d, i % d));
  for (int32_t j : pages) cache.check_page_position("paged_decode_attention", seq, j);
  alignas(64) float kbuf[kMaxPageElems];
  alignas(64) float vbuf[kMaxPageElems];
  std::vector<SoftmaxState> st(n_group);
  std::fill(o, o + size_t(n_group) * d, 0.0f);
  float logits[kMaxPage];
  for (const int32_t j : pages) {
    const int n_tok = page_tokens(seq, j, B);
    const int32_t page = seq.page_table[j];
    cache.k_page_f32(il, page, kv_head, kbuf);
    cache.v_page_f32(il, page, kv_head, vbuf);
    for (int g = 0; g < n_group; ++g) {
      const float* qg = q + size_t(g) * d;
      float mx = kNegInf;
      for (int i = 0; i < n_tok; ++i) {
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int x = 0; x < d; ++x) acc += qg[x] * kbuf[i * d + x];
        logits[i] = acc * scale;
        mx = std::max(mx, logits[i]);
      }
      // Rescale the running output to the new max, then accumulate this page's contribution.
      SoftmaxState& s = st[g];
      const float m_new = std::max(s.m, mx);
      const float corr = s.m == kNegInf ? 0.0f : fast_exp(s.m - m_new);
      float* og = o + size_t(g) * d;
      for (int x = 0; x < d; ++x) og[x] *= corr;
      float l = s.l * corr;
      for (int i = 0; i < n_tok; ++i) {
        const float p = fast_exp(logits[i] - m_new);
        l += p;
        for (int x = 0; x < d; ++x) og[x] += p * vbuf[i * d + x];
      }
      s.m = m_new;
      s.l = l;
    }
  }
  for (int g = 0; g < n_group; ++g) {
    float* og = o + size_t(g) * d;
    const float inv = st[g].l > 0.0f ? 1.0f / st[g].l : 0.0f;
    for (int x = 0; x < d; ++x) og[x] *= inv;
    if (lse) lse[g] = st[g].lse();
  }
}

}  // namespace locks
