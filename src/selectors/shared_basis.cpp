// Shared key bases (sequence and global scope): PCA fit, offline calibration, matched-bytes rank,
// and the per-page half of a shared-basis summary scored with Eq. 4.
#include "locks/shared_basis.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "locks/math.h"
#include "locks/parallel_for.h"
#include "selectors/qvec.h"
#include "selectors/selectors.h"

namespace locks {

std::vector<float> pca_key_basis(const float* keys, size_t n_keys, int d, int rank) {
  if (d < 1) throw std::invalid_argument(fmt::format("key basis: head_dim {}", d));
  if (rank < 1 || rank > d)
    throw std::invalid_argument(fmt::format("key basis: rank {} outside [1, head_dim {}]", rank, d));
  if (n_keys == 0) throw std::invalid_argument("key basis: no keys to fit");
  Eigen::VectorXd mean = Eigen::VectorXd::Zero(d);
  for (size_t i = 0; i < n_keys; ++i)
    for (int c = 0; c < d; ++c) {
      const float x = keys[i * d + c];
      if (!std::isfinite(x))
        throw std::invalid_argument(fmt::format("key basis: non-finite key at row {}, dim {}", i, c));
      mean[c] += x;
    }
  mean /= double(n_keys);
  // Covariance (unnormalised) from centered keys, accumulated in float64 blocks of rows.
  Eigen::MatrixXd cov = Eigen::MatrixXd::Zero(d, d);
  constexpr size_t kBlock = 1024;
  Eigen::MatrixXd X(kBlock, d);
  for (size_t i0 = 0; i0 < n_keys; i0 += kBlock) {
    const size_t n = std::min(kBlock, n_keys - i0);
    for (size_t i = 0; i < n; ++i)
      for (int c = 0; c < d; ++c) X(Eigen::Index(i), c) = double(keys[(i0 + i) * d + c]) - mean[c];
    cov.selfadjointView<Eigen::Lower>().rankUpdate(X.topRows(Eigen::Index(n)).transpose());
  }
  cov = cov.selfadjointView<Eigen::Lower>();
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(cov);
  if (es.info() != Eigen::Success) throw std::runtime_error("key basis: eigensolver did not converge");
  // Eigenvalues ascending: the top `rank` directions are the last columns.
  std::vector<float> basis(size_t(rank) * d);
  for (int k = 0; k < rank; ++k) {
    const auto v = es.eigenvectors().col(d - 1 - k);
    int arg = 0;
    for (int c = 1; c < d; ++c)
      if (std::abs(v[c]) > std::abs(v[arg])) arg = c;
    const double sign = v[arg] < 0.0 ? -1.0 : 1.0;
    for (int c = 0; c < d; ++c) basis[size_t(k) * d + c] = float(sign * v[c]);
  }
  return basis;
}

GlobalBasis calibrate_global_basis(const PagedKvCache& cache, const KvSequence& seq, int rank) {
  const auto& cfg = cache.config();
  const int d = cfg.head_dim, B = cfg.page_size;
  if (seq.n_tokens <= 0) throw std::invalid_argument("global basis calibration: the calibration sequence is empty");
  if (rank < 1 || rank > d)
    throw std::invalid_argument(fmt::format("global basis calibration: rank {} outside [1, head_dim {}]", rank, d));
  GlobalBasis gb;
  gb.n_layer = cfg.n_layer;
  gb.n_head_kv = cfg.n_head_kv;
  gb.head_dim = d;
  gb.rank = rank;
  gb.basis.resize(size_t(cfg.n_layer) * cfg.n_head_kv);
  const int n = cfg.n_layer * cfg.n_head_kv;
  parallel_for(
      n,
      [&](int t) {
        const int il = t / cfg.n_head_kv, h = t % cfg.n_head_kv;
        std::vector<float> keys(size_t(seq.n_pages()) * B * d);
        for (int j = 0; j < seq.n_pages(); ++j) cache.k_page_f32(il, seq.page_table[j], h, &keys[size_t(j) * B * d]);
        gb.basis[t] = pca_key_basis(keys.data(), size_t(seq.n_tokens), d, rank);  // token t is row t
      },
      2, /*dynamic_chunk=*/1);
  return gb;
}

size_t shared_basis_page_bytes(const SummaryFormat& fmt, int page_size, int head_dim, int rho) {
  return qvec::bytes(size_t(head_dim), fmt.centroid_bits) + size_t(page_size) * qvec::bytes(size_t(rho), fmt.coef_bits);
}

int matched_bytes_rank(const SummaryFormat& fmt, int page_size, int head_dim) {
  const size_t target = fmt.bytes(page_size, head_dim);
  int rho = 1;
  while (rho < head_dim && shared_basis_page_bytes(fmt, page_size, head_dim, rho + 1) <= target) ++rho;
  return rho;
}

// ---------------------------------------------------------------------------------------------
// SharedBasisPages: blob = centroid (centroid_bits) | B coefficient rows of rho (coef_bits).
// ---------------------------------------------------------------------------------------------

SharedBasisPages::SharedBasisPages(const KvCacheConfig& cfg, int rho, int coef_bits, int centroid_bits)
    : rho_(rho), B_(cfg.page_size), d_(cfg.head_dim), coef_bits_(coef_bits), centroid_bits_(centroid_bits) {
  if (rho < 1 || rho > cfg.head_dim)
    throw std::invalid_argument(fmt::format("shared basis rank {} outside [1, head_dim {}]", rho, cfg.head_dim));
  if (coef_bits != 32 && coef_bits != 8)
    throw std::invalid_argument(fmt::format("coefficient precision {} bits: expected 32 or 8", coef_bits));
  if (centroid_bits != 32 && centroid_bits != 8)
    throw std::invalid_argument(fmt::format("centroid precision {} bits: expected 32 or 8", centroid_bits));
  SummaryFormat f;
  f.coef_bits = coef_bits;
  f.centroid_bits = centroid_bits;
  store_ = PageBlobStore(cfg, shared_basis_page_bytes(f, B_, d_, rho));
  dec_stride_ = size_t(d_) + size_t(rho_) * B_;
  dec_ = ZeroedArray<float>(store_.slots() * dec_stride_);
}

void SharedBasisPages::build(int il, int h, int32_t page, const float* keys, const float* basis) {
  const int B = B_, d = d_, rho = rho_;
  std::vector<double> mu(d, 0.0);
  for (int i = 0; i < B; ++i)
    for (int c = 0; c < d; ++c) mu[c] += keys[size_t(i) * d + c];
  for (int c = 0; c < d; ++c) mu[c] /= B;
  // c_i = V (k_i - mu_j): coordinates of the centered key in the shared basis, in float64. The
  // centered keys are transposed ([d][B]) so that the sum over channels (in channel order, as a
  // plain dot product) runs for all B tokens at once.
  std::vector<double> delta_t(size_t(d) * B), acc(B);
  for (int i = 0; i < B; ++i)
    for (int c = 0; c < d; ++c) delta_t[size_t(c) * B + i] = double(keys[size_t(i) * d + c]) - mu[c];
  std::vector<float> muf(mu.begin(), mu.end()), coef(size_t(B) * rho);
  for (int k = 0; k < rho; ++k) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int c = 0; c < d; ++c) {
      const double v = basis[size_t(k) * d + c];
      const double* dc = &delta_t[size_t(c) * B];
      for (int i = 0; i < B; ++i) acc[i] += v * dc[i];
    }
    for (int i = 0; i < B; ++i) coef[size_t(i) * rho + k] = float(acc[i]);
  }
  uint8_t* blob = store_.blob(il, h, page);
  qvec::encode(muf.data(), d, centroid_bits_, blob, "centroid");
  const size_t mu_bytes = qvec::bytes(size_t(d), centroid_bits_), row_bytes = qvec::bytes(size_t(rho), coef_bits_);
  for (int i = 0; i < B; ++i)
    qvec::encode(&coef[size_t(i) * rho], rho, coef_bits_, blob + mu_bytes + size_t(i) * row_bytes, "coefficient row");
  // The decoded copy: what load() returns, coefficients transposed.
  float* dec = dec_.data() + store_.index(il, h, page) * dec_stride_;
  qvec::decode(blob, d, centroid_bits_, dec);
  std::vector<float> row(rho);
  for (int i = 0; i < B; ++i) {
    qvec::decode(blob + mu_bytes + size_t(i) * row_bytes, rho, coef_bits_, row.data());
    for (int k = 0; k < rho; ++k) dec[d + size_t(k) * B + i] = row[k];
  }
  store_.set_valid(il, h, page);
}

void SharedBasisPages::load(int il, int h, int32_t page, std::vector<float>& mu, std::vector<float>& coef) const {
  const uint8_t* blob = store_.blob(il, h, page);
  const size_t mu_bytes = qvec::bytes(size_t(d_), centroid_bits_), row_bytes = qvec::bytes(size_t(rho_), coef_bits_);
  mu.resize(d_);
  coef.resize(size_t(B_) * rho_);
  qvec::decode(blob, d_, centroid_bits_, mu.data());
  for (int i = 0; i < B_; ++i)
    qvec::decode(blob + mu_bytes + size_t(i) * row_bytes, rho_, coef_bits_, &coef[size_t(i) * rho_]);
}

bool SharedBasisPages::reconstruct(int il, int h, int32_t page, const float* basis, float* out) const {
  if (!basis || !store_.has(il, h, page)) return false;
  const int B = B_, d = d_, rho = rho_;
  const float* mu = decoded(il, h, page);
  const float* coef_t = mu + d;  // [rho][B]
  // k_i = mu + sum_k c_ik V_k, accumulated in k order, vectorized over channels.
  for (int i = 0; i < B; ++i) {
    float* row = out + size_t(i) * d;
    std::copy_n(mu, d, row);
    for (int k = 0; k < rho; ++k) {
      const float cik = coef_t[size_t(k) * B + i];
      const float* vk = basis + size_t(k) * d;
#pragma omp simd
      for (int c = 0; c < d; ++c) row[c] += cik * vk[c];
    }
  }
  return true;
}

namespace {

float dot_f32(const float* x, const float* y, int n) {
  float a = 0.0f;
#pragma omp simd reduction(+ : a)
  for (int c = 0; c < n; ++c) a += x[c] * y[c];
  return a;
}

// Eq. 4 for one page of 16 tokens and ng <= 4 heads: logits_gi = (a_g + sum_k w_gk c_ik) * scale
// (k in order, fused multiply-add, as the generic loop compiles), then max + log(sum exp) with the
// summation order of exp_shift_sum. coef_t [rho][16], w [ng][rho]; out[g * out_stride].
void eq4_logsumexp16(const float* coef_t, int rho, const float* w, int ng, const float* a, float scale, float* out,
                     size_t out_stride) {
  __m256 lo[4], hi[4];
  for (int g = 0; g < ng; ++g) lo[g] = hi[g] = _mm256_set1_ps(a[g]);
  for (int k = 0; k < rho; ++k) {
    const __m256 c0 = _mm256_loadu_ps(coef_t + size_t(k) * 16), c1 = _mm256_loadu_ps(coef_t + size_t(k) * 16 + 8);
    for (int g = 0; g < ng; ++g) {
      const __m256 wk = _mm256_set1_ps(w[size_t(g) * rho + k]);
      lo[g] = _mm256_fmadd_ps(wk, c0, lo[g]);
      hi[g] = _mm256_fmadd_ps(wk, c1, hi[g]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int g = 0; g < ng; ++g) {
    alignas(32) float lg[16];
    _mm256_store_ps(lg, _mm256_mul_ps(lo[g], sc));
    _mm256_store_ps(lg + 8, _mm256_mul_ps(hi[g], sc));
    const float mx = max_of(lg, 16);
    out[size_t(g) * out_stride] = mx + std::log(exp_shift_sum(lg, 16, mx));
  }
}

}  // namespace

size_t SharedBasisPages::estimate(const float* basis, const PagedKvCache& cache, const SelectionRequest& req,
                                  std::vector<float>& log_mass) const {
  const int d = d_, B = B_, rho = rho_, n_pages = req.seq->n_pages(), G = req.n_group;
  const float scale = 1.0f / std::sqrt(float(d));
  log_mass.assign(size_t(G) * n_pages, kNegInf);
  // Eq. 4 with a shared basis: (V q_g) is computed once per step for all pages. Without a basis
  // (sequence-basis before any full page existed) every page is scored from its keys.
  std::vector<float> wq(size_t(G) * rho, 0.0f);
  for (int g = 0; g < G && basis; ++g)
    for (int k = 0; k < rho; ++k) {
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int c = 0; c < d; ++c) acc += req.q[size_t(g) * d + c] * basis[size_t(k) * d + c];
      wq[size_t(g) * rho + k] = acc;
    }
  size_t bytes = 0;
  bool used_basis = false;
  std::vector<float> keys, logits(B);
  for (int j = 0; j < n_pages; ++j) {
    const int32_t page = req.seq->page_table[j];
    if (!basis || !store_.has(req.il, req.kv_head, page) || page_tokens(*req.seq, j, B) != B) {
      bytes += exact_page_estimate(cache, req, j, /*max_logit=*/false, keys, log_mass.data());
      continue;
    }
    const float* mu = decoded(req.il, req.kv_head, page);
    const float* coef_t = mu + d;  // [rho][B]
    bytes += store_.blob_bytes();
    used_basis = true;
    if (B == 16) {  // the shipped page size: all G heads per pass over the coefficients
      for (int g0 = 0; g0 < G; g0 += 4) {
        const int ng = std::min(4, G - g0);
        float a[4];
        for (int t = 0; t < ng; ++t) a[t] = dot_f32(req.q + size_t(g0 + t) * d, mu, d);
        eq4_logsumexp16(coef_t, rho, &wq[size_t(g0) * rho], ng, a, scale, &log_mass[size_t(g0) * n_pages + j],
                        size_t(n_pages));
      }
      continue;
    }
    for (int g = 0; g < G; ++g) {
      const float* q = req.q + size_t(g) * d;
      const float* w = &wq[size_t(g) * rho];
      const float a = dot_f32(q, mu, d);
      // logits_i = (q.mu + sum_k w_k c_ik) / sqrt(d), accumulated in k order for all B tokens.
      float* lg = logits.data();
      for (int i = 0; i < B; ++i) lg[i] = a;
      for (int k = 0; k < rho; ++k) {
        const float wk = w[k];
        const float* ck = coef_t + size_t(k) * B;
#pragma omp simd
        for (int i = 0; i < B; ++i) lg[i] += wk * ck[i];
      }
      for (int i = 0; i < B; ++i) lg[i] *= scale;
      const float mx = max_of(lg, B);
      log_mass[size_t(g) * n_pages + j] = mx + std::log(exp_shift_sum(lg, B, mx));
    }
  }
  if (used_basis) bytes += size_t(rho) * d * 4;  // the shared basis, float32, once per step
  return bytes;
}

}  // namespace locks
