// The integer Eq. 4 score pass (summary_score_kernels.h): query preparation, the portable kernel,
// the AVX2 kernel (maddubs/madd) and the AVX-512 VNNI kernel (dpbusd), chosen at run time.
#include "core/summary_score_kernels.h"

#include <fmt/format.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "locks/math.h"

#define LOCKS_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LOCKS_TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))

namespace locks {

const char* score_kernel_name(ScoreKernel k) {
  switch (k) {
    case ScoreKernel::kAuto:
      return "auto";
    case ScoreKernel::kPortable:
      return "portable";
    case ScoreKernel::kAvx2:
      return "avx2";
    case ScoreKernel::kAvx512Vnni:
      return "avx512-vnni";
  }
  return "?";
}

bool score_kernel_supported(ScoreKernel k) {
  switch (k) {
    case ScoreKernel::kAuto:
    case ScoreKernel::kPortable:
      return true;
    case ScoreKernel::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case ScoreKernel::kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             __builtin_cpu_supports("avx512vbmi");
  }
  return false;
}

ScoreKernel best_score_kernel() {
  static const ScoreKernel best = score_kernel_supported(ScoreKernel::kAvx512Vnni) ? ScoreKernel::kAvx512Vnni
                                  : score_kernel_supported(ScoreKernel::kAvx2)     ? ScoreKernel::kAvx2
                                                                                   : ScoreKernel::kPortable;
  return best;
}

namespace score_kernels {

namespace {

constexpr int kR = 8, kB = 16;

void update_max(float* head_max, int g, float v) { head_max[g] = std::max(head_max[g], v); }

// ---- portable ----------------------------------------------------------------------------------

void score_pages_portable(const PreparedQueries& pq, const HeadRecords& rec, const int32_t* pages, int n_pages,
                          float scale, float* out, size_t out_stride, float* head_max) {
  const int d = pq.d, G = pq.n_group;
  const size_t bstride = size_t(kR) * d / 2;
  for (int j = 0; j < n_pages; ++j) {
    const size_t p = size_t(pages[j]);
    const uint8_t* bas = rec.basis + p * bstride;
    const int8_t* mu = rec.centroid + p * d;
    const int8_t* coef = rec.coef + p * kB * kR;
    float cf[kB][kR];
    for (int i = 0; i < kB; ++i) {
      const float cs = f16_to_f32(rec.coef_scale[p * kB + i]);
      for (int k = 0; k < kR; ++k) cf[i][k] = float(coef[i * kR + k]) * cs;
    }
    const float musc = f16_to_f32(rec.centroid_scale[p]);
    for (int g = 0; g < G; ++g) {
      const int32_t* q = &pq.code[size_t(g) * d];
      const float* qf = &pq.q[size_t(g) * d];
      float a = 0.0f;
      for (int c = 0; c < d; ++c) a += qf[c] * float(mu[c]);
      float w[kR];
      for (int k = 0; k < kR; ++k) {
        int64_t dot = 0;
        for (int c = 0; c < d; c += 2) {
          const uint8_t b = bas[(size_t(k) * d + c) / 2];
          dot += int64_t(quant::sign_extend(b & 0xfu, 4)) * q[c] + int64_t(quant::sign_extend(b >> 4, 4)) * q[c + 1];
        }
        w[k] = float(dot) * f16_to_f32(rec.basis_scale[p * kR + k]) * pq.qscale[g];
      }
      const float af = a * musc;
      float logits[kB], mx = kNegInf;
      for (int i = 0; i < kB; ++i) {
        float acc = 0.0f;
        for (int k = 0; k < kR; ++k) acc += cf[i][k] * w[k];
        logits[i] = (af + acc) * scale;
        mx = std::max(mx, logits[i]);
      }
      float l = 0.0f;
      for (int i = 0; i < kB; ++i) l += fast_exp(logits[i] - mx);
      const float s = mx + fast_log(l);
      out[size_t(g) * out_stride + j] = s;
      update_max(head_max, g, s);
    }
  }
}

// ---- AVX2 ----------------------------------------------------------------------------------------

// Eight int32 vectors to their eight horizontal sums, in order.
LOCKS_TARGET_AVX2 inline __m256i hsum8x8_epi32(const __m256i* a) {
  const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

LOCKS_TARGET_AVX2 inline __m256 hsum8x8_ps(const __m256* a) {
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

LOCKS_TARGET_AVX2 inline float hsum8f(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

LOCKS_TARGET_AVX2 inline float hmax8f(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// What both SIMD kernels share per page: coefficient rows as floats with the token scales folded in,
// the basis column scales, and the centroid codes as floats.
template <int U>
struct PageFloats {
  __m256 cf[kB];
  __m256 vscale;
  __m256 mu[8 * U];
  float musc;
};

template <int U>
LOCKS_TARGET_AVX2 inline void load_rows(const HeadRecords& rec, size_t p, PageFloats<U>& pf) {
  alignas(32) float cs[kB];
  const auto* css = reinterpret_cast<const __m128i*>(rec.coef_scale + p * kB);
  _mm256_store_ps(cs, _mm256_cvtph_ps(_mm_loadu_si128(css)));
  _mm256_store_ps(cs + 8, _mm256_cvtph_ps(_mm_loadu_si128(css + 1)));
  const int8_t* coef = rec.coef + p * kB * kR;
  for (int i = 0; i < kB; ++i) {
    const __m256i c32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(coef + i * kR)));
    pf.cf[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(c32), _mm256_set1_ps(cs[i]));
  }
}

template <int U, bool kRows = true>
LOCKS_TARGET_AVX2 inline void load_page(const HeadRecords& rec, size_t p, PageFloats<U>& pf) {
  constexpr int d = 64 * U;
  if constexpr (kRows) load_rows(rec, p, pf);
  pf.vscale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec.basis_scale + p * kR)));
  const int8_t* mu = rec.centroid + p * d;
  for (int c = 0; c < 8 * U; ++c)
    pf.mu[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mu + 8 * c))));
  pf.musc = f16_to_f32(rec.centroid_scale[p]);
}

// q.mu (in centroid codes) for up to eight heads from g0 (heads past G give 0).
template <int U>
LOCKS_TARGET_AVX2 inline __m256 centroid_dots(const PreparedQueries& pq, const PageFloats<U>& pf, int g0) {
  constexpr int d = 64 * U;
  __m256 acc[8];
  for (int gg = 0; gg < 8; ++gg) {
    acc[gg] = _mm256_setzero_ps();
    if (g0 + gg >= pq.n_group) continue;
    const float* q = &pq.q[size_t(g0 + gg) * d];
    for (int c = 0; c < 8 * U; ++c) acc[gg] = _mm256_fmadd_ps(pf.mu[c], _mm256_loadu_ps(q + 8 * c), acc[gg]);
  }
  return hsum8x8_ps(acc);
}

// Eq. 4's float part for one head: logits (af + W.cf_i) * scale over the 16 tokens; returns their
// max and l = sum exp(logit - max), the log-sum-exp being max + log l (taken later, eight at a time).
template <int U>
LOCKS_TARGET_AVX2 inline float page_sum_exp(const PageFloats<U>& pf, __m256 w, float af, float scale, float& mx) {
  __m256 p[8];
  for (int i = 0; i < 8; ++i) p[i] = _mm256_mul_ps(pf.cf[i], w);
  const __m256 l0 = hsum8x8_ps(p);
  for (int i = 0; i < 8; ++i) p[i] = _mm256_mul_ps(pf.cf[8 + i], w);
  const __m256 l1 = hsum8x8_ps(p);
  const __m256 a8 = _mm256_set1_ps(af), s8 = _mm256_set1_ps(scale);
  const __m256 lo = _mm256_mul_ps(_mm256_add_ps(l0, a8), s8), hi = _mm256_mul_ps(_mm256_add_ps(l1, a8), s8);
  mx = hmax8f(_mm256_max_ps(lo, hi));
  const __m256 m8 = _mm256_set1_ps(mx);
  return hsum8f(_mm256_add_ps(fast_exp8(_mm256_sub_ps(lo, m8)), fast_exp8(_mm256_sub_ps(hi, m8))));
}

// fast_log (locks/math.h) on eight lanes, the same steps: exponent split, atanh series on the mantissa.
LOCKS_TARGET_AVX2 inline __m256 fast_log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i e =
      _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xff)), _mm256_set1_epi32(127));
  __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  e = _mm256_sub_epi32(e, _mm256_castps_si256(big));  // mask lanes are -1: e + 1
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one)), t2 = _mm256_mul_ps(t, t);
  __m256 p = _mm256_fmadd_ps(t2, _mm256_set1_ps(0.11111111f), _mm256_set1_ps(0.14285715f));
  p = _mm256_fmadd_ps(t2, p, _mm256_set1_ps(0.2f));
  p = _mm256_fmadd_ps(t2, p, _mm256_set1_ps(0.33333334f));
  p = _mm256_fmadd_ps(t2, p, one);
  p = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(2.0f), t), p);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), _mm256_set1_ps(0.69314718f), p);
}

// out[g][j] = mx[g][j] + log(out[g][j]) (out held l), and each head's max.
// fast_exp8 on sixteen lanes (same polynomial and clamping).
LOCKS_TARGET_VNNI inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i ni = _mm512_cvtps_epi32(n);
  const __m512i n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
  const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, _mm512_set1_epi32(127)), 23));
  const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, _mm512_set1_epi32(127)), 23));
  return _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
}

LOCKS_TARGET_AVX2 void finish_lse(const float* mx, int G, int n, float* out, size_t out_stride, float* head_max) {
  for (int g = 0; g < G; ++g) {
    float* o = out + size_t(g) * out_stride;
    const float* m = mx + size_t(g) * n;
    __m256 hm = _mm256_set1_ps(kNegInf);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 s = _mm256_add_ps(_mm256_loadu_ps(m + j), fast_log8(_mm256_loadu_ps(o + j)));
      _mm256_storeu_ps(o + j, s);
      hm = _mm256_max_ps(hm, s);
    }
    float h = hmax8f(hm);
    for (; j < n; ++j) {
      o[j] = m[j] + fast_log(o[j]);
      h = std::max(h, o[j]);
    }
    head_max[g] = std::max(head_max[g], h);
  }
}

// W_k = (V_k^T code as integers) * column scale * query scale, from the offset-binary column dots.
LOCKS_TARGET_AVX2 inline __m256 basis_weights(__m256i dots, int32_t qsum, __m256 vscale, float qscale) {
  dots = _mm256_sub_epi32(dots, _mm256_set1_epi32(8 * qsum));  // nibbles were code + 8
  return _mm256_mul_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(vscale, _mm256_set1_ps(qscale)));
}

template <int U>
LOCKS_TARGET_AVX2 void score_pages_avx2(const PreparedQueries& pq, const HeadRecords& rec, const int32_t* pages,
                                        int n_pages, float scale, float* out, size_t out_stride, float* head_max) {
  constexpr int d = 64 * U, n_chunks = kR * U;
  const int G = pq.n_group;
  const __m256i low4 = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(0x08);
  const __m256i w_hi = _mm256_set1_epi16(1 << 14), w_mid = _mm256_set1_epi16(1 << 7), w_lo = _mm256_set1_epi16(1);
  thread_local std::vector<float> mx_buf;  // [G][n_pages] each logit set's max
  mx_buf.resize(size_t(G) * n_pages);
  float* mx = mx_buf.data();
  PageFloats<U> pf;
  for (int j = 0; j < n_pages; ++j) {
    const size_t p = size_t(pages[j]);
    const uint8_t* bas = rec.basis + p * (kR * d / 2);
    __m256i lo[n_chunks], hi[n_chunks];  // u8 code + 8 of even / odd channels, 32 per chunk
    for (int c = 0; c < n_chunks; ++c) {
      const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bas + 32 * c));
      lo[c] = _mm256_xor_si256(_mm256_and_si256(z, low4), eight);
      hi[c] = _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(z, 4), low4), eight);
    }
    load_page<U>(rec, p, pf);
    for (int g0 = 0; g0 < G; g0 += 8) {
      alignas(32) float a[8];
      _mm256_store_ps(a, centroid_dots<U>(pq, pf, g0));
      for (int g = g0; g < std::min(G, g0 + 8); ++g) {
        const int8_t* s = &pq.split[size_t(g) * U * 32 * PreparedQueries::kParts];
        __m256i acc[kR];
        for (int k = 0; k < kR; ++k) {
          acc[k] = _mm256_setzero_si256();
          for (int u = 0; u < U; ++u) {
            const int c = k * U + u;
            const auto* qs = reinterpret_cast<const __m256i*>(s + u * 32 * PreparedQueries::kParts);
            // Pairs of u8 x s8 products in int16 (at most 2 * 15 * 128 each, no saturation), then int32.
            __m256i t[3];
            for (int level = 0; level < 3; ++level)
              t[level] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], _mm256_loadu_si256(qs + 2 * level)),
                                          _mm256_maddubs_epi16(hi[c], _mm256_loadu_si256(qs + 2 * level + 1)));
            acc[k] = _mm256_add_epi32(acc[k], _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(t[0], w_hi),
                                                                                _mm256_madd_epi16(t[1], w_mid)),
                                                               _mm256_madd_epi16(t[2], w_lo)));
          }
        }
        const __m256 w = basis_weights(hsum8x8_epi32(acc), pq.qsum[g], pf.vscale, pq.qscale[g]);
        out[size_t(g) * out_stride + j] =
            page_sum_exp<U>(pf, w, a[g - g0] * pf.musc, scale, mx[size_t(g) * n_pages + j]);
      }
    }
  }
  finish_lse(mx, G, n_pages, out, out_stride, head_max);
}

// ---- AVX-512 VNNI --------------------------------------------------------------------------------

// One rank's 16 int8 coefficients as floats times their token scales (a lambda would not inherit the
// function's target attribute where the build's baseline lacks AVX-512).
LOCKS_TARGET_VNNI inline __m512 rank_row(__m128i b, __m512 cs) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), cs);
}

template <int U>
LOCKS_TARGET_VNNI void score_pages_vnni(const PreparedQueries& pq, const HeadRecords& rec, const int32_t* pages,
                                        int n_pages, float scale, float* out, size_t out_stride, float* head_max) {
  constexpr int d = 64 * U, n_z = kR * U / 2;  // 64-byte blocks of the basis
  const int G = pq.n_group;
  // Query blocks matching each basis block: U = 1 puts two columns in a block (query chunk twice),
  // U = 2 one column (its two chunks).
  constexpr int P = PreparedQueries::kParts;
  thread_local std::vector<int8_t> qz;  // [G][P][64 bytes]
  qz.resize(size_t(G) * P * 64);
  for (int g = 0; g < G; ++g) {
    const int8_t* s = &pq.split[size_t(g) * U * 32 * P];
    for (int t = 0; t < P; ++t) {
      int8_t* z = &qz[(size_t(g) * P + t) * 64];
      std::copy_n(s + 32 * t, 32, z);
      std::copy_n(s + (U - 1) * 32 * P + 32 * t, 32, z + 32);
    }
  }
  const __m512i low4 = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(0x08);
  // Byte permutes of the [16 tokens][8 ranks] coefficients to [rank][token], ranks 0-3 and 4-7.
  alignas(64) uint8_t tr[2][64];
  for (int k = 0; k < 4; ++k)
    for (int t = 0; t < 16; ++t) {
      tr[0][k * 16 + t] = uint8_t(t * kR + k);
      tr[1][k * 16 + t] = uint8_t(t * kR + k + 4);
    }
  const __m512i tr0 = _mm512_load_si512(tr[0]), tr1 = _mm512_load_si512(tr[1]);
  thread_local std::vector<float> mx_buf;  // [G][n_pages] each logit set's max
  mx_buf.resize(size_t(G) * n_pages);
  float* mx = mx_buf.data();
  PageFloats<U> pf;
  for (int j = 0; j < n_pages; ++j) {
    const size_t p = size_t(pages[j]);
    const uint8_t* bas = rec.basis + p * (kR * d / 2);
    __m512i lo[n_z], hi[n_z];
    for (int m = 0; m < n_z; ++m) {
      const __m512i z = _mm512_loadu_si512(bas + 64 * m);
      lo[m] = _mm512_xor_si512(_mm512_and_si512(z, low4), eight);
      hi[m] = _mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi16(z, 4), low4), eight);
    }
    load_page<U, false>(rec, p, pf);
    // Coefficients as [rank][16 tokens] floats, token scales folded in: one byte permute per 4 ranks.
    const int8_t* coef = rec.coef + p * kB * kR;
    const __m512i ca = _mm512_loadu_si512(coef), cb = _mm512_loadu_si512(coef + 64);
    const __m512i t0 = _mm512_permutex2var_epi8(ca, tr0, cb), t1 = _mm512_permutex2var_epi8(ca, tr1, cb);
    const __m512 cs = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec.coef_scale + p * kB)));
    const __m512 ct[kR] = {
        rank_row(_mm512_castsi512_si128(t0), cs),       rank_row(_mm512_extracti32x4_epi32(t0, 1), cs),
        rank_row(_mm512_extracti32x4_epi32(t0, 2), cs), rank_row(_mm512_extracti32x4_epi32(t0, 3), cs),
        rank_row(_mm512_castsi512_si128(t1), cs),       rank_row(_mm512_extracti32x4_epi32(t1, 1), cs),
        rank_row(_mm512_extracti32x4_epi32(t1, 2), cs), rank_row(_mm512_extracti32x4_epi32(t1, 3), cs)};
    for (int g0 = 0; g0 < G; g0 += 8) {
      alignas(32) float a[8];
      _mm256_store_ps(a, centroid_dots<U>(pq, pf, g0));
      for (int g = g0; g < std::min(G, g0 + 8); ++g) {
        const int8_t* qg = &qz[size_t(g) * P * 64];
        __m512i q[P];
        for (int t = 0; t < P; ++t) q[t] = _mm512_loadu_si512(qg + 64 * t);
        __m256i col[kR];
        for (int m = 0; m < n_z; ++m) {
          const __m512i zero = _mm512_setzero_si512();
          const __m512i ah = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo[m], q[0]), hi[m], q[1]);
          const __m512i am = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo[m], q[2]), hi[m], q[3]);
          const __m512i al = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo[m], q[4]), hi[m], q[5]);
          const __m512i acc =
              _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(ah, 14), _mm512_slli_epi32(am, 7)), al);
          const __m256i h0 = _mm512_castsi512_si256(acc), h1 = _mm512_extracti64x4_epi64(acc, 1);
          if constexpr (U == 1) {
            col[2 * m] = h0;
            col[2 * m + 1] = h1;
          } else {
            col[m] = _mm256_add_epi32(h0, h1);
          }
        }
        alignas(32) float w[kR];
        _mm256_store_ps(w, _mm256_mul_ps(basis_weights(hsum8x8_epi32(col), pq.qsum[g], pf.vscale, pq.qscale[g]),
                                         _mm256_set1_ps(scale)));
        __m512 lg = _mm512_set1_ps(a[g - g0] * pf.musc * scale);  // 16 token logits
        for (int k = 0; k < kR; ++k) lg = _mm512_fmadd_ps(_mm512_set1_ps(w[k]), ct[k], lg);
        const float m = _mm512_reduce_max_ps(lg);
        mx[size_t(g) * n_pages + j] = m;
        out[size_t(g) * out_stride + j] = _mm512_reduce_add_ps(fast_exp16(_mm512_sub_ps(lg, _mm512_set1_ps(m))));
      }
    }
  }
  finish_lse(mx, G, n_pages, out, out_stride, head_max);
}

}  // namespace

void prepare_queries(const float* q, int n_group, int d, PreparedQueries& out) {
  if (d % 64 != 0)
    throw std::invalid_argument(fmt::format("integer score pass: head_dim {} is not a multiple of 64", d));
  constexpr int P = PreparedQueries::kParts;
  out.n_group = n_group;
  out.d = d;
  out.q.assign(q, q + size_t(n_group) * d);
  out.code.resize(size_t(n_group) * d);
  out.split.resize(size_t(n_group) * (d / 64) * 32 * P);
  out.qsum.resize(n_group);
  out.qscale.resize(n_group);
  for (int g = 0; g < n_group; ++g) {
    const float* qg = q + size_t(g) * d;
    float amax = 0.0f;
    for (int c = 0; c < d; ++c) amax = std::max(amax, std::abs(qg[c]));
    if (!std::isfinite(amax))
      throw std::invalid_argument(fmt::format("integer score pass: non-finite query at head {}", g));
    const float qs = amax > 0.0f ? amax / float(PreparedQueries::kQMax) : 1.0f;
    out.qscale[g] = qs;
    int32_t* code = &out.code[size_t(g) * d];
    int32_t sum = 0;
    for (int c = 0; c < d; ++c) {
      const long v = std::lrint(double(qg[c]) / qs);
      code[c] = int32_t(std::clamp<long>(v, -PreparedQueries::kQMax, PreparedQueries::kQMax));
      sum += code[c];
    }
    out.qsum[g] = sum;
    int8_t* s = &out.split[size_t(g) * (d / 64) * 32 * P];
    for (int u = 0; u < d / 64; ++u)
      for (int t = 0; t < 32; ++t)
        for (int odd = 0; odd < 2; ++odd) {
          const int32_t v = code[64 * u + 2 * t + odd];
          const int32_t rem = v & ((1 << 14) - 1), hi = (v - rem) / (1 << 14);  // v = 2^14 hi + rem exactly
          const int8_t parts[3] = {int8_t(hi), int8_t(rem >> 7), int8_t(rem & 127)};
          for (int level = 0; level < 3; ++level) s[(u * P + 2 * level + odd) * 32 + t] = parts[level];
        }
  }
}

ScorePagesFn kernel_for(ScoreKernel k, int d) {
  if (k == ScoreKernel::kAvx512Vnni && d == 64) return score_pages_vnni<1>;
  if (k == ScoreKernel::kAvx512Vnni && d == 128) return score_pages_vnni<2>;
  if (k == ScoreKernel::kAvx2 && d == 64) return score_pages_avx2<1>;
  if (k == ScoreKernel::kAvx2 && d == 128) return score_pages_avx2<2>;
  return score_pages_portable;
}

}  // namespace score_kernels
}  // namespace locks
