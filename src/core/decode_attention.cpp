// Decode attention over a page list: one pass, online softmax (the CPU twin of the split-K GPU kernel).
#include <fmt/format.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "locks/attention.h"
#include "locks/math.h"

namespace locks {

namespace {

inline __m256 hsum8x8(const __m256* a) {  // eight vectors to their eight horizontal sums, in order
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// The same online softmax with the head_dim in NV registers of 8 floats (d = 8 NV): a page's K and
// V become float32 once, each head's logits come eight tokens at a time from one horizontal-sum
// tree, and each head's output stays in registers while a page's values are accumulated.
template <int NV>
void decode_pages_simd(const PagedKvCache& cache, int il, int kv_head, const KvSequence& seq,
                       std::span<const int32_t> pages, const float* q, int n_group, float scale, float* o,
                       SoftmaxState* st) {
  constexpr int d = 8 * NV, kMaxTok = 32;
  const int B = cache.page_size();
  alignas(32) float kbuf[kMaxTok * d];
  alignas(32) float vbuf[kMaxTok * d];
  alignas(32) float logits[kMaxTok];
  const __m256 s8 = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(kNegInf);
  for (const int32_t j : pages) {
    const int n_tok = page_tokens(seq, j, B), n_blk = (n_tok + 7) / 8;
    const int32_t page = seq.page_table[j];
    cache.k_page_f32(il, page, kv_head, kbuf);
    cache.v_page_f32(il, page, kv_head, vbuf);
    for (int g = 0; g < n_group; ++g) {
      __m256 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm256_loadu_ps(q + size_t(g) * d + 8 * v);
      __m256 mx8 = ninf;
      for (int b = 0; b < n_blk; ++b) {
        __m256 part[8];
        for (int t = 0; t < 8; ++t) {
          const int i = 8 * b + t;
          if (i >= n_tok) {
            part[t] = _mm256_setzero_ps();
            continue;
          }
          const float* kr = kbuf + size_t(i) * d;
          __m256 a0 = _mm256_mul_ps(qv[0], _mm256_load_ps(kr));
          __m256 a1 = _mm256_mul_ps(qv[1], _mm256_load_ps(kr + 8));
          for (int v = 2; v < NV; v += 2) {
            a0 = _mm256_fmadd_ps(qv[v], _mm256_load_ps(kr + 8 * v), a0);
            a1 = _mm256_fmadd_ps(qv[v + 1], _mm256_load_ps(kr + 8 * v + 8), a1);
          }
          part[t] = _mm256_add_ps(a0, a1);
        }
        __m256 lg = _mm256_mul_ps(hsum8x8(part), s8);
        if (n_tok < 8 * (b + 1)) {  // lanes past the page's tokens: -inf (exp gives 0)
          const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
          const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n_tok - 8 * b), lane));
          lg = _mm256_blendv_ps(ninf, lg, keep);
        }
        _mm256_store_ps(logits + 8 * b, lg);
        mx8 = _mm256_max_ps(mx8, lg);
      }
      // Rescale the running output to the new max, then accumulate this page's contribution.
      SoftmaxState& s = st[g];
      const float m_new = std::max(s.m, hmax8(mx8));
      const float corr = s.m == kNegInf ? 0.0f : fast_exp(s.m - m_new);
      const __m256 mn8 = _mm256_set1_ps(m_new);
      __m256 l8 = _mm256_setzero_ps();
      for (int b = 0; b < n_blk; ++b) {
        const __m256 p = fast_exp8(_mm256_sub_ps(_mm256_load_ps(logits + 8 * b), mn8));
        _mm256_store_ps(logits + 8 * b, p);
        l8 = _mm256_add_ps(l8, p);
      }
      float* og = o + size_t(g) * d;
      __m256 acc[NV];
      const __m256 c8 = _mm256_set1_ps(corr);
      for (int v = 0; v < NV; ++v) acc[v] = _mm256_mul_ps(_mm256_loadu_ps(og + 8 * v), c8);
      for (int i = 0; i < n_tok; ++i) {
        const __m256 p = _mm256_set1_ps(logits[i]);
        const float* vr = vbuf + size_t(i) * d;
        for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(p, _mm256_load_ps(vr + 8 * v), acc[v]);
      }
      for (int v = 0; v < NV; ++v) _mm256_storeu_ps(og + 8 * v, acc[v]);
      s.m = m_new;
      s.l = s.l * corr + hsum8(l8);
    }
  }
}

// Any head_dim (<= 256): the page's K and V as float32, loops the compiler vectorizes.
void decode_pages_generic(const PagedKvCache& cache, int il, int kv_head, const KvSequence& seq,
                          std::span<const int32_t> pages, const float* q, int n_group, float scale, float* o,
                          SoftmaxState* st) {
  const int d = cache.config().head_dim, B = cache.page_size();
  constexpr int kMaxPage = 32, kMaxPageElems = 32 * 256;
  alignas(64) float kbuf[kMaxPageElems];
  alignas(64) float vbuf[kMaxPageElems];
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
}

}  // namespace

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
  std::vector<SoftmaxState> st(n_group);
  std::fill(o, o + size_t(n_group) * d, 0.0f);
  if (d == 64) {
    decode_pages_simd<8>(cache, il, kv_head, seq, pages, q, n_group, scale, o, st.data());
  } else if (d == 128) {
    decode_pages_simd<16>(cache, il, kv_head, seq, pages, q, n_group, scale, o, st.data());
  } else {
    decode_pages_generic(cache, il, kv_head, seq, pages, q, n_group, scale, o, st.data());
  }
  for (int g = 0; g < n_group; ++g) {
    float* og = o + size_t(g) * d;
    const float inv = st[g].l > 0.0f ? 1.0f / st[g].l : 0.0f;
    for (int x = 0; x < d; ++x) og[x] *= inv;
    if (lse) lse[g] = st[g].lse();
  }
}

}  // namespace locks
