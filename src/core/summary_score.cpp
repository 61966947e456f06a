// Eq. 4 (arXiv 2607.24555): the log-mass estimate of a page from its summary, for the float summary
// (summary_log_mass), the stored one (PageSummaryStore::score, with an AVX2 kernel for the shipped
// format; score_pages streams a page list through the integer kernels), and the exact log-mass from the keys
// (exact_log_mass).
#include <fmt/format.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "core/summary_limits.h"
#include "core/summary_score_kernels.h"
#include "locks/math.h"
#include "locks/page_summary.h"
#include "locks/quant.h"

namespace locks {

namespace {

using summary_detail::kMaxHeadDim;
using summary_detail::kMaxPage;
constexpr int kMaxGroup = 64;  // heads per call on the stack; larger groups are scored in slices

// Sign-extended nibble pairs: byte b -> {code(low nibble), code(high nibble)} as floats, so the
// int4 basis unpacks with one 8-byte copy per byte instead of shifts per element.
const std::array<float, 512> kNibbleLut = [] {
  std::array<float, 512> t{};
  for (uint32_t b = 0; b < 256; ++b) {
    t[2 * b] = float(quant::sign_extend(b & 0xfu, 4));
    t[2 * b + 1] = float(quant::sign_extend(b >> 4, 4));
  }
  return t;
}();

// Eq. 4 for a GQA group over one page in the shipped format (int4/int8 basis codes, int8
// coefficients and centroid, B = 16): codes become floats once per page, scales are applied after
// the dot products, and the 16 token logits of a head are two AVX registers.
template <int R>
void score_page_avx2(const float* q, int n_group, int d, float scale, const float* mu, const float* Vc,
                     const float* vscale, const float* Ct, float* out) {
  for (int g = 0; g < n_group; ++g) {
    const float* qg = q + size_t(g) * d;
    __m256 am = _mm256_setzero_ps();
    __m256 acc[R];
    for (int k = 0; k < R; ++k) acc[k] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
      const __m256 q8 = _mm256_loadu_ps(qg + c);
      am = _mm256_fmadd_ps(q8, _mm256_loadu_ps(mu + c), am);
      for (int k = 0; k < R; ++k) acc[k] = _mm256_fmadd_ps(q8, _mm256_loadu_ps(Vc + size_t(k) * d + c), acc[k]);
    }
    const __m256 a8 = _mm256_set1_ps(hsum8(am));
    __m256 lo = a8, hi = a8;
    for (int k = 0; k < R; ++k) {
      const __m256 w = _mm256_set1_ps(hsum8(acc[k]) * vscale[k]);  // (V^T q)_k
      lo = _mm256_fmadd_ps(w, _mm256_loadu_ps(Ct + k * 16), lo);
      hi = _mm256_fmadd_ps(w, _mm256_loadu_ps(Ct + k * 16 + 8), hi);
    }
    const __m256 s8 = _mm256_set1_ps(scale);
    lo = _mm256_mul_ps(lo, s8);
    hi = _mm256_mul_ps(hi, s8);
    const float mx = hmax8(_mm256_max_ps(lo, hi));
    const __m256 m8 = _mm256_set1_ps(mx);
    const float l = hsum8(_mm256_add_ps(fast_exp8(_mm256_sub_ps(lo, m8)), fast_exp8(_mm256_sub_ps(hi, m8))));
    out[g] = mx + fast_log(l);  // l in [1, 16]
  }
}
}  // namespace

float summary_log_mass(const PageSummaryF32& s, const float* q, int d, float scale) {
  const int r = int(s.basis.size()) / d;
  const int n = int(s.coef.size()) / std::max(r, 1);
  double a = 0.0;
  for (int c = 0; c < d; ++c) a += double(q[c]) * s.centroid[c];
  double wq[kMaxPage];
  for (int k = 0; k < r; ++k) {
    double acc = 0.0;
    for (int c = 0; c < d; ++c) acc += double(q[c]) * s.basis[size_t(k) * d + c];
    wq[k] = acc;
  }
  double logits[kMaxPage], m = -INFINITY;
  for (int i = 0; i < n; ++i) {
    double acc = a;
    for (int k = 0; k < r; ++k) acc += wq[k] * s.coef[size_t(i) * r + k];
    logits[i] = acc * scale;
    m = std::max(m, logits[i]);
  }
  double l = 0.0;
  for (int i = 0; i < n; ++i) l += std::exp(logits[i] - m);
  return float(m + std::log(l));
}

float exact_log_mass(const float* keys, int n_tok, const float* q, int d, float scale) {
  if (n_tok <= 0) return kNegInf;
  if (n_tok > kMaxPage) throw std::invalid_argument(fmt::format("exact_log_mass: {} tokens > {}", n_tok, kMaxPage));
  // float32 throughout (vectorized): the oracle calls this for every page of every head each step.
  float logits[kMaxPage];
  float m = kNegInf;
  for (int i = 0; i < n_tok; ++i) {
    const float* k = keys + size_t(i) * d;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int c = 0; c < d; ++c) acc += q[c] * k[c];
    logits[i] = acc * scale;
    m = std::max(m, logits[i]);
  }
  return m + std::log(exp_shift_sum(logits, n_tok, m));
}

void PageSummaryStore::score(int il, int kv_head, int32_t page, const float* q, int n_group, float scale,
                             float* out) const {
  const size_t idx = stored_index(il, kv_head, page);
  const int r = fmt_.rank, d = d_;
  if (n_group > kMaxGroup) {  // larger groups than the stack buffers hold: in slices of kMaxGroup heads
    for (int g0 = 0; g0 < n_group; g0 += kMaxGroup)
      score(il, kv_head, page, q + size_t(g0) * d, std::min(kMaxGroup, n_group - g0), scale, out + g0);
    return;
  }
  alignas(64) float mu[kMaxHeadDim];
  alignas(64) float V[kMaxPage * kMaxHeadDim];
  alignas(64) float coef[kMaxPage * kMaxPage];
  float a[kMaxGroup], wq[kMaxGroup * kMaxPage];

  const uint8_t* m = centroid_.data() + idx * centroid_stride_;
  if (fmt_.centroid_bits == 32)
    std::memcpy(mu, m, size_t(d) * 4);
  else
    quant::dequantize_packed(m, d, 8, f16_to_f32(centroid_scale_[idx]), mu);

  if (fast_path_) {
    // Shipped format: raw codes -> floats, column scales folded in after the dot products.
    const uint8_t* src = basis_.data() + idx * basis_stride_;
    float vscale[kMaxPage];
    for (int k = 0; k < r; ++k) vscale[k] = f16_to_f32(basis_scale_[idx * r + k]);
    if (fmt_.basis_bits == 4) {
      for (int b = 0; b < r * d / 2; ++b) std::memcpy(V + 2 * b, &kNibbleLut[2 * size_t(src[b])], 8);
    } else {
      const int8_t* s8 = reinterpret_cast<const int8_t*>(src);
      for (int i = 0; i < r * d; ++i) V[i] = float(s8[i]);
    }
    alignas(64) float Ct[kMaxPage * 16];  // coefficients transposed: [r][16 tokens]
    const int8_t* ci = reinterpret_cast<const int8_t*>(coef_.data() + idx * coef_stride_);
    for (int i = 0; i < 16; ++i) {
      const float sc = f16_to_f32(coef_scale_[idx * 16 + i]);
      for (int k = 0; k < r; ++k) Ct[k * 16 + i] = float(ci[i * r + k]) * sc;
    }
    if (r == 8)
      score_page_avx2<8>(q, n_group, d, scale, mu, V, vscale, Ct, out);
    else if (r == 4)
      score_page_avx2<4>(q, n_group, d, scale, mu, V, vscale, Ct, out);
    else
      score_page_avx2<16>(q, n_group, d, scale, mu, V, vscale, Ct, out);  // fast_path_ implies r in {4, 8, 16}
    return;
  }
  dequant_basis(idx, V);
  const uint8_t* c = coef_.data() + idx * coef_stride_;
  if (fmt_.coef_bits == 32) {
    std::memcpy(coef, c, size_t(B_) * r * 4);
  } else {
    const int8_t* ci = reinterpret_cast<const int8_t*>(c);
    for (int i = 0; i < B_; ++i) {
      const float sc = f16_to_f32(coef_scale_[idx * B_ + i]);
      for (int k = 0; k < r; ++k) coef[i * r + k] = float(ci[i * r + k]) * sc;
    }
  }
  // Eq. 4: q.mu + (V^T q).c_i, computed once per head of the group from one read of the summary.
  for (int g = 0; g < n_group; ++g) {
    const float* qg = q + size_t(g) * d;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int x = 0; x < d; ++x) acc += qg[x] * mu[x];
    a[g] = acc;
    for (int k = 0; k < r; ++k) {
      float w = 0.0f;
#pragma omp simd reduction(+ : w)
      for (int x = 0; x < d; ++x) w += qg[x] * V[k * d + x];
      wq[g * r + k] = w;
    }
  }
  for (int g = 0; g < n_group; ++g) {
    float logits[kMaxPage], mx = kNegInf;
    for (int i = 0; i < B_; ++i) {
      float acc = a[g];
      for (int k = 0; k < r; ++k) acc += wq[g * r + k] * coef[i * r + k];
      logits[i] = acc * scale;
      mx = std::max(mx, logits[i]);
    }
    float l = 0.0f;
    for (int i = 0; i < B_; ++i) l += fast_exp(logits[i] - mx);
    out[g] = mx + std::log(l);
  }
}

void PageSummaryStore::score_pages(int il, int kv_head, std::span<const int32_t> pages, const float* q, int n_group,
                                   float scale, float* out, size_t out_stride, float* head_max,
                                   ScoreKernel kernel) const {
  if (n_group < 1) throw std::invalid_argument(fmt::format("score_pages: GQA group of {} heads", n_group));
  if (out_stride < pages.size())
    throw std::invalid_argument(fmt::format("score_pages: output stride {} < {} pages", out_stride, pages.size()));
  if (!score_kernel_supported(kernel))
    throw std::invalid_argument(
        fmt::format("score_pages: this CPU does not run the {} kernel", score_kernel_name(kernel)));
  if (const std::ptrdiff_t i = first_non_finite(q, size_t(n_group) * d_); i >= 0)
    throw std::invalid_argument(fmt::format("score_pages: non-finite query at head {}, dim {}", i / d_, i % d_));
  if (head_max) std::fill(head_max, head_max + n_group, kNegInf);
  if (const size_t n = stored_prefix(il, kv_head, pages); n < pages.size())
    (void)stored_index(il, kv_head, pages[n]);  // throws, naming the first page without a summary
  if (!int_path_) {                             // other formats: page by page through score()
    float tmp[kMaxGroup];
    for (size_t j = 0; j < pages.size(); ++j)
      for (int g0 = 0; g0 < n_group; g0 += kMaxGroup) {
        const int n = std::min(kMaxGroup, n_group - g0);
        score(il, kv_head, pages[j], q + size_t(g0) * d_, n, scale, tmp);
        for (int g = 0; g < n; ++g) {
          out[size_t(g0 + g) * out_stride + j] = tmp[g];
          if (head_max) head_max[g0 + g] = std::max(head_max[g0 + g], tmp[g]);
        }
      }
    return;
  }
  // Queries once per call, then one stream over the head's records.
  thread_local score_kernels::PreparedQueries pq;
  score_kernels::prepare_queries(q, n_group, d_, pq);
  const size_t base = index(il, kv_head, 0);
  const score_kernels::HeadRecords rec{basis_.data() + base * basis_stride_,
                                       basis_scale_.data() + base * fmt_.rank,
                                       reinterpret_cast<const int8_t*>(coef_.data() + base * coef_stride_),
                                       coef_scale_.data() + base * B_,
                                       reinterpret_cast<const int8_t*>(centroid_.data() + base * centroid_stride_),
                                       centroid_scale_.data() + base};
  std::vector<float> local_max;
  if (!head_max) {
    local_max.assign(n_group, kNegInf);
    head_max = local_max.data();
  }
  const ScoreKernel k = kernel == ScoreKernel::kAuto ? best_score_kernel() : kernel;
  score_kernels::kernel_for(k, d_)(pq, rec, pages.data(), int(pages.size()), scale, out, out_stride, head_max);
}

}  // namespace locks
