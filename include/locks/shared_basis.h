// Shared key bases for the `sequence-basis` (ShadowKV's scope) and `global-basis` (Loki's scope)
// baselines: one rank-rho PCA basis of post-RoPE keys per (layer, KV head), fit on the prefill keys
// of the sequence or calibrated once on other text. Pages then store only their centroid and the
// coefficients of their centered keys in that basis, and are scored with Eq. 4 like LOCKS.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "locks/kv_cache.h"
#include "locks/page_summary.h"

namespace locks {

/// PCA of keys: the mean m = (1/n) sum_i k_i, the covariance sum_i (k_i - m)(k_i - m)^T (float64),
/// and its top-`rank` eigenvectors. Returns the basis [rank][d] float32, rows orthonormal, ordered
/// by decreasing eigenvalue, each row's largest-magnitude component positive (deterministic sign).
/// keys: [n_keys][d]. Rank-deficient input still gives `rank` orthonormal rows (the extra ones span
/// directions of zero variance). Throws std::invalid_argument for rank outside [1, d], n_keys == 0
/// or non-finite keys.
std::vector<float> pca_key_basis(const float* keys, size_t n_keys, int d, int rank);

/// One rank-rho basis per (layer, KV head), calibrated offline on a calibration sequence.
struct GlobalBasis {
  int n_layer = 0;
  int n_head_kv = 0;
  int head_dim = 0;
  int rank = 0;                           // rho: rows of each basis
  std::vector<std::vector<float>> basis;  // [il * n_head_kv + h] -> [rank][head_dim], orthonormal rows

  const float* of(int il, int h) const { return basis[size_t(il) * n_head_kv + h].data(); }
};

/// Loki-style calibration: for every (layer, KV head), pca_key_basis of all n_tokens keys of `seq`
/// (partial last page included). Throws std::invalid_argument for an empty sequence or rank
/// outside [1, head_dim].
GlobalBasis calibrate_global_basis(const PagedKvCache& cache, const KvSequence& seq, int rank);

/// Bytes one page of one KV head stores (and a score pass reads) in a shared-basis summary:
/// centroid [d] + B coefficient rows [rho], at the precisions of `fmt` (centroid_bits, coef_bits):
///   centroid: 8 bits -> d + 2 (int8 codes + f16 scale), 32 bits -> 4d
///   coefficients: 8 bits -> B * (rho + 2) (int8 codes + one f16 scale per row), 32 bits -> 4 B rho
/// The basis itself (rho * d float32 per layer and KV head) is read once per step, not per page.
size_t shared_basis_page_bytes(const SummaryFormat& fmt, int page_size, int head_dim, int rho);

/// Matched bytes: the largest rho in [1, head_dim] with
///   shared_basis_page_bytes(fmt, B, d, rho) <= fmt.bytes(B, d)  (a LOCKS summary of the same format),
/// 1 if even rho = 1 does not fit. Shipped format (r = 8, int4 basis, int8 coefficients and centroid,
/// B = 16): LOCKS = (r d / 2 + 2r) + (B r + 2B) + (d + 2) bytes, shared = (d + 2) + B (rho + 2), so
/// rho = floor((r d / 2 + 2r + B r) / B) = 25 at d = 64 and 41 at d = 128.
int matched_bytes_rank(const SummaryFormat& fmt, int page_size, int head_dim);

}  // namespace locks
