// Small dense symmetric eigensolver (cyclic Jacobi, float64) for the 16x16 page Gram matrix of
// Algorithm 1. Jacobi is used because it is branch-light, exact on diagonal input, and returns
// orthonormal eigenvectors even for repeated or zero eigenvalues (a page of identical keys gives
// the zero matrix: eigenvalues 0, eigenvectors the identity, never NaN).
#pragma once

namespace locks {

/// Eigen-decompose the symmetric n x n matrix `a` (row-major, n <= 32; only read, not modified).
/// Outputs eigenvalues `w` [n] in descending order and eigenvectors as the columns of `u`
/// ([n][n] row-major: u[i*n + k] is component i of eigenvector k). Non-finite input gives
/// non-finite output; callers reject NaN/Inf before. Converges to ~1e-15 relative off-diagonal norm.
void sym_eigen_jacobi(int n, const double* a, double* w, double* u);

}  // namespace locks
