// The integer Eq. 4 score pass (summary_score_kernels.h): query preparation, the portable kernel,
// the AVX2 kernel (maddubs/madd) and the AVX-512 VNNI kernel (dpbusd), chosen at run time.
#include "core/summary_score_kernels.h"

#include <fmt/format.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "core/summary_limits.h"
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

// The AVX2 kernel's page in registers: coefficient rows as floats with the token scales folded in,
// the basis column scales, and the centroid codes as floats.
template <int U>
struct PageFloats {
  __m256 cf[kB];
  __m256 vscale;
  __m256 mu[8 * U];
  float musc;
};

template <int U>
LOCKS_TARGET_AVX2 inline void load_page(const HeadRecords& rec, size_t p, PageFloats<U>& pf) {
  constexpr int d = 64 * U;
  alignas(32) float cs[kB];
  const auto* css = reinterpret_cast<const __m128i*>(rec.coef_scale + p * kB);
  _mm256_store_ps(cs, _mm256_cvtph_ps(_mm_loadu_si128(css)));
  _mm256_store_ps(cs + 8, _mm256_cvtph_ps(_mm_loadu_si128(css + 1)));
  const int8_t* coef = rec.coef + p * kB * kR;
  for (int i = 0; i < kB; ++i) {
    const __m256i c32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(coef + i * kR)));
    pf.cf[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(c32), _mm256_set1_ps(cs[i]));
  }
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
  mx = hmax8(_mm256_max_ps(lo, hi));
  const __m256 m8 = _mm256_set1_ps(mx);
  return hsum8(_mm256_add_ps(fast_exp8(_mm256_sub_ps(lo, m8)), fast_exp8(_mm256_sub_ps(hi, m8))));
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
// 2^x on sixteen finite lanes: n = round(x), r = x - n exactly, 2^r by a degree-6 polynomial interpolating
// at the Chebyshev nodes of [-1/2, 1/2] (2.5e-9 relative; float evaluation 1e-7), then scalef.
LOCKS_TARGET_VNNI inline __m512 fast_exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5461444696e-04f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3400428177e-03f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6180566785e-03f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5503272267e-02f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650922e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314720670e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0000000000e+00f));
  return _mm512_scalef_ps(p, n);
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
    float h = hmax8(hm);
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

// ---- AVX-512 VNNI ----------------------------------------------------------------------------------

// The page's basis as 4U registers, register t holding qword t (channels 16t..16t+15) of each of the
// 8 columns, column k in qword lane k: one dpbusd chain per register then accumulates every column
// in its own lane pair, with no horizontal sums.
template <int U>
LOCKS_TARGET_VNNI inline void gather_basis(const uint8_t* bas, __m512i* out) {
  if constexpr (U == 1) {  // register m: columns 2m (qwords 0-3), 2m + 1 (qwords 4-7)
    const __m512i z0 = _mm512_loadu_si512(bas), z1 = _mm512_loadu_si512(bas + 64);
    const __m512i z2 = _mm512_loadu_si512(bas + 128), z3 = _mm512_loadu_si512(bas + 192);
    for (int t = 0; t < 4; ++t) {
      const __m512i idx = _mm512_set_epi64(12 + t, 8 + t, 4 + t, t, 12 + t, 8 + t, 4 + t, t);
      out[t] =
          _mm512_mask_blend_epi64(0xF0, _mm512_permutex2var_epi64(z0, idx, z1), _mm512_permutex2var_epi64(z2, idx, z3));
    }
  } else {  // register k: column k; an 8 x 8 qword transpose
    __m512i a[8], b[8];
    for (int m = 0; m < 4; ++m) {
      const __m512i x = _mm512_loadu_si512(bas + 128 * m), y = _mm512_loadu_si512(bas + 128 * m + 64);
      a[2 * m] = _mm512_unpacklo_epi64(x, y);  // qwords 0,2,4,6 of columns 2m, 2m+1
      a[2 * m + 1] = _mm512_unpackhi_epi64(x, y);
    }
    const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int e = 0; e < 2; ++e)
      for (int h = 0; h < 2; ++h) {  // columns 4h..4h+3 of qwords {e, e+4} and {e+2, e+6}
        b[4 * h + 2 * e] = _mm512_permutex2var_epi64(a[4 * h + e], lo, a[4 * h + e + 2]);
        b[4 * h + 2 * e + 1] = _mm512_permutex2var_epi64(a[4 * h + e], hi, a[4 * h + e + 2]);
      }
    const __m512i first = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0),
                  second = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
    // b[2e + j] (j 0: qwords e, e+4; j 1: e+2, e+6) for columns 0-3, b[4 + ...] for columns 4-7.
    for (int e = 0; e < 2; ++e)
      for (int j = 0; j < 2; ++j) {
        out[e + 2 * j] = _mm512_permutex2var_epi64(b[2 * e + j], first, b[4 + 2 * e + j]);
        out[e + 2 * j + 4] = _mm512_permutex2var_epi64(b[2 * e + j], second, b[4 + 2 * e + j]);
      }
  }
}

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// Sums of the sixteen lanes of four vectors, in lanes 0-3.
LOCKS_TARGET_VNNI inline __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // a b c d
  const __m256 h =
      _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_castps512_ps256(_mm512_castpd_ps(_mm512_shuffle_f64x2(
                                                      _mm512_castps_pd(abcd), _mm512_castps_pd(abcd), 0xEE))));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// fast_log8 (above) on sixteen lanes of positive normal floats: x = 2^e m, m in [1, 2) by getexp and
// getmant, halved above sqrt 2; log m = 2 atanh t, t = (m - 1) / (m + 1).
LOCKS_TARGET_VNNI inline __m512 fast_log16(__m512 x) {
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src), e = _mm512_getexp_ps(x);
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one)), t2 = _mm512_mul_ps(t, t);
  __m512 p = _mm512_fmadd_ps(t2, _mm512_set1_ps(0.11111111f), _mm512_set1_ps(0.14285715f));
  p = _mm512_fmadd_ps(t2, p, _mm512_set1_ps(0.2f));
  p = _mm512_fmadd_ps(t2, p, _mm512_set1_ps(0.33333334f));
  p = _mm512_fmadd_ps(t2, p, one);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.69314718f), _mm512_mul_ps(_mm512_add_ps(t, t), p));
}

// out[g][j] = mx[g][j] + log(out[g][j]) (out held the sums), and each head's max; sixteen at a time.
LOCKS_TARGET_VNNI void finish_lse16(const float* mx, int G, int n, float* out, size_t out_stride, float* head_max) {
  for (int g = 0; g < G; ++g) {
    float* o = out + size_t(g) * out_stride;
    const float* m = mx + size_t(g) * n;
    __m512 hm = _mm512_set1_ps(kNegInf);
    int j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 s = _mm512_add_ps(_mm512_loadu_ps(m + j), fast_log16(_mm512_loadu_ps(o + j)));
      _mm512_storeu_ps(o + j, s);
      hm = _mm512_max_ps(hm, s);
    }
    alignas(64) float h16[16];
    _mm512_store_ps(h16, hm);
    float h = *std::max_element(h16, h16 + 16);
    for (; j < n; ++j) {
      o[j] = m[j] + fast_log(o[j]);
      h = std::max(h, o[j]);
    }
    head_max[g] = std::max(head_max[g], h);
  }
}

// One rank's 16 int8 coefficients as floats.
LOCKS_TARGET_VNNI inline __m512 rank_row(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }

template <int U>
LOCKS_TARGET_VNNI void score_pages_vnni(const PreparedQueries& pq, const HeadRecords& rec, const int32_t* pages,
                                        int n_pages, float scale, float* out, size_t out_stride, float* head_max) {
  constexpr int d = 64 * U, n_t = 4 * U;  // basis registers
  const int G = pq.n_group;
  const __m512i low4 = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(0x08);
  // Byte permutes of the [16 tokens][8 ranks] coefficients to [rank][token], ranks 0-3 and 4-7.
  alignas(64) uint8_t tr[2][64];
  for (int k = 0; k < 4; ++k)
    for (int t = 0; t < 16; ++t) {
      tr[0][k * 16 + t] = uint8_t(t * kR + k);
      tr[1][k * 16 + t] = uint8_t(t * kR + k + 4);
    }
  const __m512i tr0 = _mm512_load_si512(tr[0]), tr1 = _mm512_load_si512(tr[1]);
  thread_local std::vector<float> mx_buf;
  mx_buf.resize(size_t(G) * n_pages);  // [G][n_pages] each head's log-sum-exp offset
  float* mx = mx_buf.data();
  // Per pair of heads (lanes 0-7, 8-15): 8 * qsum (the nibbles are code + 8) and qscale * scale * log2(e).
  constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;
  const int n_pairs = (G + 3) / 4 * 2;
  thread_local std::vector<int32_t> head_off;
  thread_local std::vector<float> head_mul;
  head_off.resize(size_t(n_pairs) * 16);
  head_mul.resize(size_t(n_pairs) * 16);
  for (int g = 0; g < 2 * n_pairs; ++g)
    for (int k = 0; k < kR; ++k) {
      head_off[size_t(g) * kR + k] = 8 * pq.qsum[g];
      head_mul[size_t(g) * kR + k] = pq.qscale[g] * scale * kLog2e;  // logits in log2 units
    }
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  // Pages in blocks, two passes per block (the basis projections, then the token logits and their
  // exponentials): each pass's chains are short enough for consecutive pages to overlap.
  constexpr int kBlock = 8, kAhead = 16;
  const int G4 = 2 * n_pairs;
  thread_local std::vector<float> w_buf, af_buf;  // [kBlock][G4][r], [kBlock][G4]
  w_buf.resize(size_t(kBlock) * G4 * kR);
  af_buf.resize(size_t(kBlock) * G4);
  for (int j0 = 0; j0 < n_pages; j0 += kBlock) {
    const int nb = std::min(kBlock, n_pages - j0);
    for (int jb = 0; jb < nb; ++jb) {
      const size_t p = size_t(pages[j0 + jb]);
      if (j0 + jb + kAhead < n_pages) {  // a later page's records: in a decode step they are cold
        const size_t pn = size_t(pages[j0 + jb + kAhead]);
        for (int off = 0; off < kR * d / 2; off += 64) prefetch(rec.basis + pn * (kR * d / 2) + off);
        prefetch(rec.coef + pn * kB * kR);
        prefetch(rec.coef + pn * kB * kR + 64);
        for (int off = 0; off < d; off += 64) prefetch(rec.centroid + pn * d + off);
        prefetch(rec.coef_scale + pn * kB);
        prefetch(rec.basis_scale + pn * kR);
      }
      __m512i lo[n_t], hi[n_t];  // u8 code + 8 of the even / odd channels
      gather_basis<U>(rec.basis + p * (kR * d / 2), lo);
      for (int t = 0; t < n_t; ++t) {
        hi[t] = _mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi16(lo[t], 4), low4), eight);
        lo[t] = _mm512_xor_si512(_mm512_and_si512(lo[t], low4), eight);
      }
      // The column scales in both halves.
      const __m512 vscale2 = _mm512_cvtph_ps(
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec.basis_scale + p * kR))));
      __m512 mu[U * 4];  // the centroid codes as floats
      for (int c = 0; c < 4 * U; ++c)
        mu[c] = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec.centroid + p * d + 16 * c))));
      const float musc = f16_to_f32(rec.centroid_scale[p]) * scale;
      // Four heads at a time (zero queries pad the group), so that their chains interleave.
      for (int g0 = 0; g0 < G; g0 += 4) {
        // V^T code: three levels of 7 bits, each the sum over registers and parities of u8 x s8.
        __m512i acc[4][3];
        for (int gg = 0; gg < 4; ++gg)
          for (int level = 0; level < 3; ++level) acc[gg][level] = _mm512_setzero_si512();
        const int64_t* qb = &pq.bcast[size_t(g0) * n_t * 6];
        for (int t = 0; t < n_t; ++t)
          for (int level = 0; level < 3; ++level)
            for (int gg = 0; gg < 4; ++gg) {
              const int64_t* b = qb + ((gg * n_t + t) * 3 + level) * 2;
              acc[gg][level] = _mm512_dpbusd_epi32(acc[gg][level], lo[t], _mm512_set1_epi64(b[0]));
              acc[gg][level] = _mm512_dpbusd_epi32(acc[gg][level], hi[t], _mm512_set1_epi64(b[1]));
            }
        // Two heads per register: each column's two dword halves summed, the offset-binary
        // correction subtracted, then scaled to float (lanes 0-7 head 2x, 8-15 head 2x + 1).
        float* w = &w_buf[(size_t(jb) * G4 + g0) * kR];
        for (int x = 0; x < 2; ++x) {
          __m512i c[2];
          for (int y = 0; y < 2; ++y) {
            const auto& a = acc[2 * x + y];
            c[y] = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(a[0], 14), _mm512_slli_epi32(a[1], 7)), a[2]);
          }
          const __m512i dots = _mm512_sub_epi32(
              _mm512_add_epi32(_mm512_permutex2var_epi32(c[0], even, c[1]), _mm512_permutex2var_epi32(c[0], odd, c[1])),
              _mm512_loadu_si512(&head_off[size_t(g0 / 2 + x) * 16]));
          _mm512_storeu_ps(w + 16 * x,
                           _mm512_mul_ps(_mm512_cvtepi32_ps(dots),
                                         _mm512_mul_ps(vscale2, _mm512_loadu_ps(&head_mul[size_t(g0 / 2 + x) * 16]))));
        }
        __m512 cen[4];
        for (int gg = 0; gg < 4; ++gg) cen[gg] = _mm512_setzero_ps();
        for (int c = 0; c < 4 * U; ++c)
          for (int gg = 0; gg < 4; ++gg)
            cen[gg] = _mm512_fmadd_ps(mu[c], _mm512_loadu_ps(&pq.q[size_t(g0 + gg) * d + 16 * c]), cen[gg]);
        _mm_storeu_ps(&af_buf[size_t(jb) * G4 + g0],
                      _mm_mul_ps(hsum4x16(cen[0], cen[1], cen[2], cen[3]), _mm_set1_ps(musc)));
      }
    }
    for (int jb = 0; jb < nb; ++jb) {
      const int j = j0 + jb;
      const size_t p = size_t(pages[j]);
      // Coefficients as [rank][16 tokens] floats; the token scales are applied to the logits.
      const int8_t* coef = rec.coef + p * kB * kR;
      const __m512i ca = _mm512_loadu_si512(coef), cb = _mm512_loadu_si512(coef + 64);
      // Through memory: a sign-extending load per rank instead of a lane extract and an extension.
      alignas(64) int8_t rows[kR * kB];
      _mm512_store_si512(rows, _mm512_permutex2var_epi8(ca, tr0, cb));
      _mm512_store_si512(rows + 64, _mm512_permutex2var_epi8(ca, tr1, cb));
      const __m512 cs = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec.coef_scale + p * kB)));
      __m512 ct[kR];
      for (int k = 0; k < kR; ++k) ct[k] = rank_row(_mm_load_si128(reinterpret_cast<const __m128i*>(rows + kB * k)));
      for (int g0 = 0; g0 < G; g0 += 4) {
        const float* wp = &w_buf[(size_t(jb) * G4 + g0) * kR];  // each weight broadcast from memory
        __m512 lg[4], e[4];
        for (int gg = 0; gg < 4; ++gg) lg[gg] = _mm512_mul_ps(_mm512_set1_ps(wp[gg * kR]), ct[0]);
        for (int k = 1; k < kR; ++k)
          for (int gg = 0; gg < 4; ++gg) lg[gg] = _mm512_fmadd_ps(_mm512_set1_ps(wp[gg * kR + k]), ct[k], lg[gg]);
        // No max shift: the logits of a page's centered coefficients straddle 0, so their sum of
        // powers of two is a normal float unless one logit passes ~127 or all fall below ~-126; a
        // head whose sum is not is redone shifted by its max.
        alignas(16) float m[4] = {0.0f, 0.0f, 0.0f, 0.0f}, l[4];
        for (int gg = 0; gg < 4; ++gg) {
          lg[gg] = _mm512_mul_ps(lg[gg], cs);  // token logits less the centroid term, in log2 units
          e[gg] = fast_exp2_16(lg[gg]);
        }
        const __m128 sum = hsum4x16(e[0], e[1], e[2], e[3]);
        _mm_store_ps(l, sum);
        const int normal = _mm_movemask_ps(_mm_and_ps(_mm_cmp_ps(sum, _mm_set1_ps(0x1p-100f), _CMP_GT_OQ),
                                                      _mm_cmp_ps(sum, _mm_set1_ps(0x1p100f), _CMP_LT_OQ)));
        if (normal != 0xf)
          for (int gg = 0; gg < 4; ++gg)
            if (!(normal >> gg & 1)) {
              m[gg] = _mm512_reduce_max_ps(lg[gg]);
              l[gg] = _mm512_reduce_add_ps(fast_exp2_16(_mm512_sub_ps(lg[gg], _mm512_set1_ps(m[gg]))));
            }
        for (int gg = 0; gg < std::min(4, G - g0); ++gg) {
          mx[size_t(g0 + gg) * n_pages + j] = m[gg] * kLn2 + af_buf[size_t(jb) * G4 + g0 + gg];
          out[size_t(g0 + gg) * out_stride + j] = l[gg];
        }
      }
    }
  }
  finish_lse16(mx, G, n_pages, out, out_stride, head_max);
}

// Part `level` of a query code v = 2^14 hi + 2^7 mid + lo exactly (hi in [-64, 63], mid, lo in [0, 127]).
int8_t split_part(int32_t v, int level) {
  const int32_t rem = v & ((1 << 14) - 1), hi = (v - rem) / (1 << 14);
  return int8_t(level == 0 ? hi : level == 1 ? rem >> 7 : rem & 127);
}

}  // namespace

void prepare_queries(const float* q, int n_group, int d, PreparedQueries& out) {
  constexpr int kMaxDim = summary_detail::kMaxHeadDim;
  if (d % 64 != 0 || d > kMaxDim)
    throw std::invalid_argument(
        fmt::format("integer score pass: head_dim {} is not a multiple of 64 up to {}", d, kMaxDim));
  constexpr int P = PreparedQueries::kParts;
  out.n_group = n_group;
  out.d = d;
  const int padded = (n_group + 3) / 4 * 4;  // the VNNI kernel scores heads four at a time
  out.q.assign(size_t(padded) * d, 0.0f);
  std::copy_n(q, size_t(n_group) * d, out.q.begin());
  out.code.resize(size_t(n_group) * d);
  out.split.resize(size_t(n_group) * (d / 64) * 32 * P);
  out.qsum.assign(padded, 0);
  out.qscale.assign(padded, 0.0f);
  out.bcast.assign(size_t(padded) * (d / 16) * 6, 0);
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
    const double inv = 1.0 / double(qs);
    int8_t dig[3][kMaxDim];  // each channel's three parts, computed once
    for (int c = 0; c < d; ++c) {
      const long v = std::lrint(double(qg[c]) * inv);
      code[c] = int32_t(std::clamp<long>(v, -PreparedQueries::kQMax, PreparedQueries::kQMax));
      sum += code[c];
      for (int level = 0; level < 3; ++level) dig[level][c] = split_part(code[c], level);
    }
    out.qsum[g] = sum;
    // Broadcast operands: for channels 16t..16t+15, dword h of the qword holds the level's parts of
    // channels 16t + 8h + {0, 2, 4, 6} (+1 for the odd parity), as the basis's nibble bytes do.
    int64_t* bc = &out.bcast[size_t(g) * (d / 16) * 6];
    for (int t = 0; t < d / 16; ++t)
      for (int level = 0; level < 3; ++level)
        for (int odd = 0; odd < 2; ++odd) {
          int8_t bytes[8];
          for (int h = 0; h < 2; ++h)
            for (int b = 0; b < 4; ++b) bytes[4 * h + b] = dig[level][16 * t + 8 * h + 2 * b + odd];
          std::memcpy(&bc[(t * 3 + level) * 2 + odd], bytes, 8);
        }
    int8_t* s = &out.split[size_t(g) * (d / 64) * 32 * P];
    for (int u = 0; u < d / 64; ++u)
      for (int level = 0; level < 3; ++level)
        for (int odd = 0; odd < 2; ++odd)
          for (int t = 0; t < 32; ++t) s[(u * P + 2 * level + odd) * 32 + t] = dig[level][64 * u + 2 * t + odd];
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
