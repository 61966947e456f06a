// `second-moment`: mean + covariance Gaussian log-mass estimate. If the page's keys were Gaussian,
// k ~ N(mu_j, Sigma_j), then E exp(q.k / sqrt(d)) = exp(q.mu_j / sqrt(d) + q^T Sigma_j q / (2d)), and
// the page's B tokens give
//   s_hat_j(q) = log(B) + q.mu_j / sqrt(d) + (1/2) q^T Sigma_j q / d.
// Sigma_j = (1/B) D_j^T D_j (D_j: centered keys) is d x d (too many bytes at d = 128); we store its
// top-r eigendecomposition, which LOCKS's Alg. 1 already computes: D_j^T D_j = V diag(sigma^2) V^T,
// so Sigma_r = V_r diag(sigma_k^2 / B) V_r^T and q^T Sigma_r q = sum_{k<=r} (sigma_k^2 / B) (v_k.q)^2.
// Choice of bytes: the same r, basis precision and centroid precision as the LOCKS summary format,
// plus r standard deviations sigma_k / sqrt(B) (f16; f32 when the basis is f32), in place of LOCKS's
// B x r coefficients: comparable to (a little below) LOCKS's bytes, e.g. at the shipped format
// (r = 8, int4 basis, int8 centroid) (d + 2) + r (d/2 + 2) + 2r bytes = 354 at d = 64 (LOCKS: 498).
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "locks/math.h"
#include "locks/page_summary.h"
#include "selectors/qvec.h"
#include "selectors/selectors.h"

namespace locks {

namespace {
size_t sd_bytes(int basis_bits) { return basis_bits == 32 ? 4 : 2; }
}  // namespace

size_t SecondMomentSelector::page_bytes(const SummaryFormat& fmt, int head_dim) {
  const size_t r = fmt.rank;
  return qvec::bytes(size_t(head_dim), fmt.centroid_bits) + r * qvec::bytes(size_t(head_dim), fmt.basis_bits) +
         r * sd_bytes(fmt.basis_bits);
}

SecondMomentSelector::SecondMomentSelector(const KvCacheConfig& cfg, const SummaryFormat& fmt, GroupRule rule)
    : EstimatingSelector(rule), fmt_(fmt), d_(cfg.head_dim) {
  fmt.validate(cfg.page_size, cfg.head_dim);
  store_ = PageBlobStore(cfg, page_bytes(fmt, cfg.head_dim));
  dec_stride_ = size_t(d_) + size_t(fmt.rank) * (d_ + 1);
  dec_ = ZeroedArray<float>(store_.slots() * dec_stride_);
}

void SecondMomentSelector::do_on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) {
  const int B = cache.page_size(), d = d_, r = fmt_.rank;
  const size_t mu_bytes = qvec::bytes(size_t(d), fmt_.centroid_bits),
               col_bytes = qvec::bytes(size_t(d), fmt_.basis_bits);
  for_each_page_head(cache, il, page_ids, [&](const float* keys, int l, int h, int32_t page) {
    const PageSummaryF32 s = build_page_summary(keys, B, d, r);  // Alg. 1: mu, V_r, sigma^2
    uint8_t* blob = store_.blob(l, h, page);
    qvec::encode(s.centroid.data(), d, fmt_.centroid_bits, blob, "centroid");
    uint8_t* sd = blob + mu_bytes + size_t(r) * col_bytes;
    for (int k = 0; k < r; ++k) {
      bool zero_col = true;
      for (int c = 0; c < d; ++c) zero_col = zero_col && s.basis[size_t(k) * d + c] == 0.0f;
      const float sdk = zero_col || k >= int(s.sigma2.size()) ? 0.0f : std::sqrt(s.sigma2[k] / float(B));
      qvec::encode(&s.basis[size_t(k) * d], d, fmt_.basis_bits, blob + mu_bytes + size_t(k) * col_bytes, "direction");
      if (fmt_.basis_bits == 32) {
        std::memcpy(sd + 4 * size_t(k), &sdk, 4);
      } else {
        if (!(sdk <= 65504.0f))
          throw std::invalid_argument(fmt::format("second-moment: standard deviation {} overflows f16", sdk));
        const f16_t hk = f32_to_f16(sdk);
        std::memcpy(sd + 2 * size_t(k), &hk, 2);
      }
    }
    // The decoded copy that estimate() reads.
    float* dec = dec_.data() + store_.index(l, h, page) * dec_stride_;
    qvec::decode(blob, d, fmt_.centroid_bits, dec);
    for (int k = 0; k < r; ++k) {
      qvec::decode(blob + mu_bytes + size_t(k) * col_bytes, d, fmt_.basis_bits, dec + d + size_t(k) * d);
      float sk;
      if (fmt_.basis_bits == 32) {
        std::memcpy(&sk, sd + 4 * size_t(k), 4);
      } else {
        f16_t hk;
        std::memcpy(&hk, sd + 2 * size_t(k), 2);
        sk = f16_to_f32(hk);
      }
      dec[d + size_t(r) * d + k] = sk * sk;  // sigma_k^2 / B
    }
    store_.set_valid(l, h, page);
  });
}

size_t SecondMomentSelector::estimate(const PagedKvCache& cache, const SelectionRequest& req,
                                      std::vector<float>& log_mass) {
  const int d = d_, B = cache.page_size(), r = fmt_.rank, n_pages = req.seq->n_pages(), G = req.n_group;
  const float scale = 1.0f / std::sqrt(float(d)), log_b = std::log(float(B)), inv_2d = 0.5f / float(d);
  log_mass.assign(size_t(G) * n_pages, kNegInf);
  std::vector<float> keys;
  size_t bytes = 0;
  for (int j = 0; j < n_pages; ++j) {
    const int32_t page = req.seq->page_table[j];
    if (!store_.has(req.il, req.kv_head, page) || page_tokens(*req.seq, j, B) != B) {
      bytes += exact_page_estimate(cache, req, j, /*max_logit=*/false, keys, log_mass.data());
      continue;
    }
    const float* mu = dec_.data() + store_.index(req.il, req.kv_head, page) * dec_stride_;
    const float* V = mu + d;               // [r][d]
    const float* var = V + size_t(r) * d;  // sigma_k^2 / B
    bytes += store_.blob_bytes();
    for (int g = 0; g < G; ++g) {
      const float* q = req.q + size_t(g) * d;
      float a = 0.0f;
#pragma omp simd reduction(+ : a)
      for (int c = 0; c < d; ++c) a += q[c] * mu[c];
      float quad = 0.0f;  // q^T Sigma_r q
      for (int k = 0; k < r; ++k) {
        float w = 0.0f;
#pragma omp simd reduction(+ : w)
        for (int c = 0; c < d; ++c) w += q[c] * V[size_t(k) * d + c];
        quad += var[k] * w * w;
      }
      log_mass[size_t(g) * n_pages + j] = log_b + a * scale + quad * inv_2d;
    }
  }
  return bytes;
}

}  // namespace locks
