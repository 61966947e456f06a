// The locality finding: within-page key energy captured at rank r by page-local, sequence-scope and
// global-scope bases (see locks/locality.h).
#include "locks/locality.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "locks/parallel_for.h"

namespace locks {

namespace {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Captured energy of the centered rows D [N][d] by the first r rows of `basis` ([rows][d]), for
// every r in 1..rows: out[r - 1] = sum_i ||V_r^T V_r delta_i||^2 = sum_{k < r} ||D v_k||^2.
std::vector<double> captured_by_basis(const MatD& D, const float* basis, int rows, int d) {
  MatD V(rows, d);
  for (int k = 0; k < rows; ++k)
    for (int c = 0; c < d; ++c) V(k, c) = double(basis[size_t(k) * d + c]);
  const MatD C = D * V.transpose();  // [N][rows]: coordinates of each centered key
  std::vector<double> cum(rows);
  double acc = 0.0;
  for (int k = 0; k < rows; ++k) {
    acc += C.col(k).squaredNorm();
    cum[k] = acc;
  }
  return cum;
}

}  // namespace

LocalityResult measure_locality(const PagedKvCache& cache, const KvSequence& seq, const std::vector<int>& ranks,
                                const GlobalBasis* global) {
  const auto& cfg = cache.config();
  const int L = cfg.n_layer, H = cfg.n_head_kv, d = cfg.head_dim, B = cfg.page_size;
  if (ranks.empty()) throw std::invalid_argument("locality: no ranks to measure");
  for (int r : ranks)
    if (r < 1 || r > d) throw std::invalid_argument(fmt::format("locality: rank {} outside [1, head_dim {}]", r, d));
  const int n_full = seq.n_tokens / B;
  if (n_full < 1)
    throw std::invalid_argument(
        fmt::format("locality: the sequence has {} tokens, not one full page of {}", seq.n_tokens, B));
  const int n_used = (seq.n_tokens + B - 1) / B;
  if (seq.n_pages() < n_used)
    throw std::invalid_argument(
        fmt::format("locality: {} tokens need {} pages, the page table holds {}", seq.n_tokens, n_used, seq.n_pages()));
  if (global && (global->n_layer != L || global->n_head_kv != H || global->head_dim != d || global->rank < 1 ||
                 global->basis.size() != size_t(L) * H))
    throw std::invalid_argument(fmt::format(
        "locality: global basis shape (layers {}, KV heads {}, head_dim {}, rank {}) does not match the cache "
        "(layers {}, KV heads {}, head_dim {})",
        global->n_layer, global->n_head_kv, global->head_dim, global->rank, L, H, d));

  const int n_ranks = int(ranks.size());
  const int r_max = *std::max_element(ranks.begin(), ranks.end());
  const int r_glob = global ? std::min(r_max, global->rank) : 0;

  // Per (layer, head) task: [energy, page_local[n_ranks], sequence[n_ranks], global[n_ranks]],
  // summed afterwards in task order so the result does not depend on the thread count.
  const int n_tasks = L * H;
  const size_t stride = 1 + 3 * size_t(n_ranks);
  std::vector<double> acc(size_t(n_tasks) * stride, 0.0);
  parallel_for(
      n_tasks,
      [&](int t) {
        const int il = t / H, h = t % H;
        double* out = &acc[size_t(t) * stride];
        double* pl = out + 1;
        double* sq = pl + n_ranks;
        double* gl = sq + n_ranks;
        std::vector<float> keys(size_t(n_used) * B * d);
        for (int j = 0; j < n_used; ++j) cache.k_page_f32(il, seq.page_table[j], h, &keys[size_t(j) * B * d]);

        // Full pages centered by their own mean; page energy and the page-local spectrum.
        MatD D(Eigen::Index(n_full) * B, d);
        std::vector<double> mu(d), sigma2(B);
        Eigen::MatrixXd gram(B, B);
        Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(B);
        for (int j = 0; j < n_full; ++j) {
          const float* kp = &keys[size_t(j) * B * d];
          std::fill(mu.begin(), mu.end(), 0.0);
          for (int i = 0; i < B; ++i)
            for (int c = 0; c < d; ++c) mu[c] += double(kp[size_t(i) * d + c]);
          for (int c = 0; c < d; ++c) mu[c] /= B;
          double e = 0.0;
          for (int i = 0; i < B; ++i)
            for (int c = 0; c < d; ++c) {
              const double x = double(kp[size_t(i) * d + c]) - mu[c];
              D(Eigen::Index(j) * B + i, c) = x;
              e += x * x;
            }
          out[0] += e;
          // Page-local: Algorithm 1's spectrum, the eigenvalues of the centered page Gram D D^T
          // (float64; eigenvalues only, ~5x faster than build_page_summary's Jacobi with vectors).
          const auto Dp = D.middleRows(Eigen::Index(j) * B, B);
          gram.noalias() = Dp * Dp.transpose();
          es.compute(gram, Eigen::EigenvaluesOnly);
          if (es.info() != Eigen::Success) throw std::runtime_error("locality: page eigensolver did not converge");
          for (int k = 0; k < B; ++k) sigma2[k] = std::max(es.eigenvalues()[B - 1 - k], 0.0);  // descending
          for (int q = 0; q < n_ranks; ++q) {
            const int r = ranks[q];
            if (r >= B) {
              pl[q] += e;  // every direction of the page kept
              continue;
            }
            double c = 0.0;
            for (int k = 0; k < r; ++k) c += sigma2[k];
            pl[q] += std::min(c, e);
          }
        }

        // Sequence scope: PCA of all the sequence's keys of this (layer, head), fit once at r_max.
        const std::vector<float> seq_basis = pca_key_basis(keys.data(), size_t(seq.n_tokens), d, r_max);
        const std::vector<double> cs = captured_by_basis(D, seq_basis.data(), r_max, d);
        for (int q = 0; q < n_ranks; ++q) sq[q] = cs[ranks[q] - 1];

        if (global) {
          const std::vector<double> cg = captured_by_basis(D, global->of(il, h), r_glob, d);
          for (int q = 0; q < n_ranks; ++q)
            gl[q] = ranks[q] <= r_glob ? cg[ranks[q] - 1] : std::numeric_limits<double>::quiet_NaN();
        }
      },
      2, /*dynamic_chunk=*/1);

  LocalityResult res;
  res.ranks = ranks;
  res.n_pages = int64_t(n_full) * n_tasks;
  std::vector<double> pl(n_ranks, 0.0), sq(n_ranks, 0.0), gl(n_ranks, 0.0);
  for (int t = 0; t < n_tasks; ++t) {
    const double* out = &acc[size_t(t) * stride];
    res.energy += out[0];
    for (int q = 0; q < n_ranks; ++q) {
      pl[q] += out[1 + q];
      sq[q] += out[1 + n_ranks + q];
      gl[q] += out[1 + 2 * n_ranks + q];
    }
  }
  // Fractions, clamped to [0, 1] against float rounding of orthonormal bases and eigenvalues.
  auto frac = [&](double captured) {
    if (std::isnan(captured)) return captured;
    return res.energy > 0.0 ? std::clamp(captured / res.energy, 0.0, 1.0) : 1.0;
  };
  for (int q = 0; q < n_ranks; ++q) {
    res.page_local.push_back(frac(pl[q]));
    res.sequence.push_back(frac(sq[q]));
    if (global) res.global.push_back(frac(gl[q]));
  }
  return res;
}

LocalityMean mean_locality(const std::vector<LocalityResult>& results, size_t k) {
  LocalityMean m{0, 0, 0};
  for (const auto& r : results) {
    m.page_local += r.page_local[k];
    m.sequence += r.sequence[k];
    m.global += r.global.empty() ? std::numeric_limits<double>::quiet_NaN() : r.global[k];
  }
  const double n = double(results.size());
  return {m.page_local / n, m.sequence / n, m.global / n};
}

}  // namespace locks
