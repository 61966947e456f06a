// Algorithm 1 (page summary build) and the Eq. 4 score from the stored summary.
#include "locks/page_summary.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "locks/math.h"
#include "locks/quant.h"
#include "locks/sym_eigen.h"

namespace locks {

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxPage = 32;
constexpr int kMaxGroup = 64;

bool valid_bits(int b, bool allow_low) {
  return b == 32 || b == 8 || (allow_low && (b == 16 || b == 4 || b == 2));
}

std::string bits_name(int b) { return b == 32 ? "f32" : b == 16 ? "bf16" : fmt::format("int{}", b); }

using quant::packed_bytes;

// Symmetric quantization of one group into the store's packed layout (quant.h); the f16 scale.
f16_t quantize_group(const float* x, size_t n, int bits, uint8_t* dst, const char* what) {
  f16_t scale = 0;
  float amax = 0.0f;
  if (!quant::quantize_packed(x, n, bits, dst, scale, amax))
    throw std::invalid_argument(fmt::format("page summary: {} magnitude {} overflows the f16 scale", what, amax));
  return scale;
}

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

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

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

void SummaryFormat::validate(int page_size, int head_dim) const {
  if (page_size < 1 || page_size > kMaxPage)
    throw std::invalid_argument(fmt::format("page size {} outside [1, {}]", page_size, kMaxPage));
  if (head_dim < 1 || head_dim > kMaxHeadDim || head_dim % 8 != 0)
    throw std::invalid_argument(fmt::format("head_dim {} must be a multiple of 8 in [8, {}]", head_dim, kMaxHeadDim));
  if (rank < 1 || rank > page_size)
    throw std::invalid_argument(fmt::format("summary rank {} outside [1, page size {}]", rank, page_size));
  if (!valid_bits(basis_bits, true))
    throw std::invalid_argument(fmt::format("basis precision {} bits: expected 32, 16, 8, 4 or 2", basis_bits));
  if (!valid_bits(coef_bits, false))
    throw std::invalid_argument(fmt::format("coefficient precision {} bits: expected 32 or 8", coef_bits));
  if (!valid_bits(centroid_bits, false))
    throw std::invalid_argument(fmt::format("centroid precision {} bits: expected 32 or 8", centroid_bits));
}

size_t SummaryFormat::bytes(int B, int d) const {
  const size_t r = rank;
  size_t n = packed_bytes(r * d, basis_bits) + (basis_bits <= 8 ? 2 * r : 0);
  n += packed_bytes(size_t(B) * r, coef_bits) + (coef_bits <= 8 ? 2 * size_t(B) : 0);
  n += packed_bytes(size_t(d), centroid_bits) + (centroid_bits <= 8 ? 2 : 0);
  return n;
}

std::string SummaryFormat::describe() const {
  return fmt::format("r={} basis={} coef={} centroid={}", rank, bits_name(basis_bits), bits_name(coef_bits),
                     bits_name(centroid_bits));
}

PageSummaryF32 build_page_summary(const float* keys, int n_tok, int d, int rank) {
  if (n_tok < 1 || n_tok > kMaxPage) throw std::invalid_argument(fmt::format("page summary: {} tokens", n_tok));
  if (d < 1 || d > kMaxHeadDim) throw std::invalid_argument(fmt::format("page summary: head_dim {}", d));
  if (rank < 1 || rank > kMaxPage)
    throw std::invalid_argument(fmt::format("page summary: rank {} outside [1, {}]", rank, kMaxPage));
  if (!keys) throw std::invalid_argument("page summary: null keys");
  if (const std::ptrdiff_t i = first_non_finite(keys, size_t(n_tok) * d); i >= 0)
    throw std::invalid_argument(fmt::format("page summary: non-finite key at token {}, dim {}", i / d, i % d));

  PageSummaryF32 s;
  // Alg. 1 line 1: centroid and centered keys (in float64: the Gram matrix squares magnitudes).
  std::vector<double> mu(d, 0.0), D(size_t(n_tok) * d);
  for (int i = 0; i < n_tok; ++i)
    for (int c = 0; c < d; ++c) mu[c] += keys[i * d + c];
  for (int c = 0; c < d; ++c) mu[c] /= n_tok;
  for (int i = 0; i < n_tok; ++i)
    for (int c = 0; c < d; ++c) D[size_t(i) * d + c] = double(keys[i * d + c]) - mu[c];
  s.centroid.assign(mu.begin(), mu.end());

  // Alg. 1 line 2: Gram matrix D D^T and its eigendecomposition U Sigma^2 U^T.
  const int n = n_tok;
  double gram[kMaxPage * kMaxPage], w[kMaxPage], U[kMaxPage * kMaxPage];
  for (int i = 0; i < n; ++i)
    for (int j = i; j < n; ++j) {
      double acc = 0.0;
      for (int c = 0; c < d; ++c) acc += D[size_t(i) * d + c] * D[size_t(j) * d + c];
      gram[i * n + j] = gram[j * n + i] = acc;
    }
  sym_eigen_jacobi(n, gram, w, U);
  s.sigma2.resize(n);
  for (int k = 0; k < n; ++k) s.sigma2[k] = float(std::max(w[k], 0.0));

  // Alg. 1 lines 3-4: rank-r basis V = D^T U_r Sigma_r^-1, coefficients C = U_r Sigma_r, tail.
  // Directions with sigma below a relative floor carry no energy we can resolve; they are dropped
  // (zero column) so rank-deficient pages stay exact and zero pages never divide by zero.
  const double smax2 = std::max(w[0], 0.0);
  const double floor2 = std::max(smax2 * 1e-12, 1e-30);
  s.basis.assign(size_t(rank) * d, 0.0f);
  s.coef.assign(size_t(n) * rank, 0.0f);
  double tail = 0.0;
  for (int k = 0; k < n; ++k) {
    const double l = std::max(w[k], 0.0);
    if (k >= rank) {
      tail += l;
      continue;
    }
    if (l <= floor2) {
      tail += l;  // dropped direction: its (negligible) energy belongs to the tail
      continue;
    }
    const double sigma = std::sqrt(l);
    for (int c = 0; c < d; ++c) {
      double acc = 0.0;
      for (int i = 0; i < n; ++i) acc += D[size_t(i) * d + c] * U[i * n + k];
      s.basis[size_t(k) * d + c] = float(acc / sigma);
    }
    for (int i = 0; i < n; ++i) s.coef[size_t(i) * rank + k] = float(U[i * n + k] * sigma);
  }
  s.tail = float(tail);
  return s;
}

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

void PageSummaryStore::index_error(int il, int kv_head, int32_t page) const {
  throw std::out_of_range(fmt::format("page summary store: (layer {}, KV head {}, page id {}) outside [0, {}) x [0, {}) x "
                                      "[0, {})",
                                      il, kv_head, page, n_layer_, n_head_kv_, n_pages_));
}

size_t PageSummaryStore::stored_index(int il, int kv_head, int32_t page) const {
  const size_t idx = index(il, kv_head, page);
  if (!valid_[idx])
    throw std::logic_error(
        fmt::format("page summary store: no summary stored for (layer {}, KV head {}, page id {})", il, kv_head, page));
  return idx;
}

PageSummaryStore::PageSummaryStore(const SummaryFormat& fmt, int n_layer, int n_head_kv, int n_pages, int page_size,
                                   int head_dim)
    : fmt_(fmt), n_layer_(n_layer), n_head_kv_(n_head_kv), n_pages_(n_pages), B_(page_size), d_(head_dim) {
  if (n_layer < 1 || n_head_kv < 1 || n_pages < 1)
    throw std::invalid_argument(fmt::format("page summary store: {} layers x {} KV heads x {} pages (each must be >= 1)",
                                            n_layer, n_head_kv, n_pages));
  fmt.validate(page_size, head_dim);
  const size_t r = fmt.rank;
  basis_stride_ = fmt.basis_bits == 32 ? r * d_ * 4 : packed_bytes(r * d_, fmt.basis_bits);
  coef_stride_ = fmt.coef_bits == 32 ? size_t(B_) * r * 4 : size_t(B_) * r;
  centroid_stride_ = fmt.centroid_bits == 32 ? size_t(d_) * 4 : size_t(d_);
  summary_bytes_ = fmt.bytes(B_, d_);
  fast_path_ = (fmt.basis_bits == 4 || fmt.basis_bits == 8) && fmt.coef_bits == 8 && fmt.centroid_bits == 8 &&
               B_ == 16 && d_ % 8 == 0 && (fmt.rank == 4 || fmt.rank == 8 || fmt.rank == 16);
  const size_t n = size_t(n_layer) * n_head_kv * n_pages;
  basis_ = ZeroedArray<uint8_t>(n * basis_stride_);
  basis_scale_ = ZeroedArray<f16_t>(n * r);
  coef_ = ZeroedArray<uint8_t>(n * coef_stride_);
  coef_scale_ = ZeroedArray<f16_t>(n * B_);
  centroid_ = ZeroedArray<uint8_t>(n * centroid_stride_);
  centroid_scale_ = ZeroedArray<f16_t>(n);
  tail_ = ZeroedArray<float>(n);
  valid_ = ZeroedArray<uint8_t>(n);
}

void PageSummaryStore::store(int il, int kv_head, int32_t page, const PageSummaryF32& s) {
  const size_t idx = index(il, kv_head, page);
  const int r = fmt_.rank, d = d_;
  const int n_rows = int(s.coef.size()) / r;
  if (int(s.basis.size()) != r * d || int(s.centroid.size()) != d || n_rows != B_)
    throw std::invalid_argument(fmt::format(
        "page summary store: expects a full page summary of {} rows, rank {}, head_dim {} (got {} rows)", B_, r, d,
        n_rows));

  uint8_t* bdst = basis_.data() + idx * basis_stride_;
  if (fmt_.basis_bits == 32) {
    std::memcpy(bdst, s.basis.data(), size_t(r) * d * 4);
  } else if (fmt_.basis_bits == 16) {
    auto* h = reinterpret_cast<uint16_t*>(bdst);
    for (int i = 0; i < r * d; ++i) h[i] = f32_to_bf16(s.basis[i]);
  } else {
    // One scale per basis column (= per row of our [r][d] layout); columns packed one after another.
    const size_t col_bytes = packed_bytes(size_t(d), fmt_.basis_bits);  // d % 8 == 0: byte aligned
    for (int k = 0; k < r; ++k)
      basis_scale_[idx * r + k] = quantize_group(&s.basis[size_t(k) * d], d, fmt_.basis_bits, bdst + k * col_bytes,
                                                 "basis column");
  }

  uint8_t* cdst = coef_.data() + idx * coef_stride_;
  std::memset(cdst, 0, coef_stride_);
  if (fmt_.coef_bits == 32) {
    std::memcpy(cdst, s.coef.data(), size_t(n_rows) * r * 4);
  } else {
    for (int i = 0; i < B_; ++i)
      coef_scale_[idx * B_ + i] =
          i < n_rows ? quantize_group(&s.coef[size_t(i) * r], r, 8, cdst + size_t(i) * r, "coefficient row") : 0;
  }

  uint8_t* mdst = centroid_.data() + idx * centroid_stride_;
  if (fmt_.centroid_bits == 32)
    std::memcpy(mdst, s.centroid.data(), size_t(d) * 4);
  else
    centroid_scale_[idx] = quantize_group(s.centroid.data(), d, 8, mdst, "centroid");
  tail_[idx] = s.tail;
  valid_[idx] = 1;
}

void PageSummaryStore::dequant_basis(size_t idx, float* out) const {
  const int r = fmt_.rank, d = d_;
  const uint8_t* src = basis_.data() + idx * basis_stride_;
  if (fmt_.basis_bits == 32) {
    std::memcpy(out, src, size_t(r) * d * 4);
  } else if (fmt_.basis_bits == 16) {
    const auto* h = reinterpret_cast<const uint16_t*>(src);
    for (int i = 0; i < r * d; ++i) out[i] = bf16_to_f32(h[i]);
  } else {
    const size_t col_bytes = packed_bytes(size_t(d), fmt_.basis_bits);
    for (int k = 0; k < r; ++k)
      quant::dequantize_packed(src + k * col_bytes, d, fmt_.basis_bits, f16_to_f32(basis_scale_[idx * r + k]),
                       out + size_t(k) * d);
  }
}

PageSummaryF32 PageSummaryStore::load(int il, int kv_head, int32_t page) const {
  const size_t idx = stored_index(il, kv_head, page);
  const int r = fmt_.rank, d = d_;
  PageSummaryF32 s;
  s.basis.resize(size_t(r) * d);
  dequant_basis(idx, s.basis.data());
  s.coef.resize(size_t(B_) * r);
  const uint8_t* c = coef_.data() + idx * coef_stride_;
  if (fmt_.coef_bits == 32)
    std::memcpy(s.coef.data(), c, size_t(B_) * r * 4);
  else
    for (int i = 0; i < B_; ++i) quant::dequantize_packed(c + size_t(i) * r, r, 8, f16_to_f32(coef_scale_[idx * B_ + i]), &s.coef[size_t(i) * r]);
  s.centroid.resize(d);
  const uint8_t* m = centroid_.data() + idx * centroid_stride_;
  if (fmt_.centroid_bits == 32)
    std::memcpy(s.centroid.data(), m, size_t(d) * 4);
  else
    quant::dequantize_packed(m, d, 8, f16_to_f32(centroid_scale_[idx]), s.centroid.data());
  s.tail = tail_[idx];
  return s;
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

}  // namespace locks
