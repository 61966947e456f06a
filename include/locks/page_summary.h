// LOCKS page summaries — Algorithm 1 of the paper (arXiv 2607.24555, Sec. 3).
//
// For one finished page of B keys (post-RoPE) of one KV head:
//   mu = mean_i k_i,  delta_i = k_i - mu,  D = [delta_1 .. delta_B]^T in R^{B x d}
//   D D^T = U Sigma^2 U^T (B x B, eigenvalues descending)
//   V = D^T U_r Sigma_r^{-1} (d x r, orthonormal columns),  C = U_r Sigma_r (B x r),
//   tau_r = sum_{k > r} sigma_k^2 (spectral tail).
// Stored quantized: V int4 with one scale per column, C int8 with one scale per row, mu int8 with
// one scale (scales f16). The score of Eq. 4 is computed from the stored form.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "locks/quant.h"
#include "locks/zeroed_array.h"

namespace locks {

/// Storage precision of the summary parts. Bits: 32 = float32 (unquantized, the theory's setting),
/// 16 = bf16, 8/4/2 = symmetric integer codes in [-(2^(b-1)-1), 2^(b-1)-1] with f16 scales.
struct SummaryFormat {
  int rank = 8;           // r, 1 <= r <= page_size
  int basis_bits = 4;     // 32, 16 (bf16), 8, 4, 2; one scale per basis column
  int coef_bits = 8;      // 32 or 8; one scale per coefficient row (token)
  int centroid_bits = 8;  // 32 or 8; one scale per page

  static SummaryFormat unquantized(int r) { return {r, 32, 32, 32}; }
  /// Throws std::invalid_argument naming the bad field.
  void validate(int page_size, int head_dim) const;
  /// Bytes one (page, KV head) summary occupies and a score pass reads (tail tau excluded:
  /// diagnostics only). Includes the f16 scales.
  size_t bytes(int page_size, int head_dim) const;
  std::string describe() const;  // e.g. "r=8 basis=int4 coef=int8 centroid=int8"
};

/// A summary in float32, as Algorithm 1 produces it before quantization (or dequantized).
struct PageSummaryF32 {
  std::vector<float> centroid;  // mu: [d]
  std::vector<float> basis;     // V: [r][d]  (row k is basis column k)
  std::vector<float> coef;      // C: [B][r]  (row i is c_i)
  float tail = 0.0f;            // tau_{j,r} = sum_{k>r} sigma_k^2
  std::vector<float> sigma2;    // all B eigenvalues of D D^T, descending (diagnostics)
};

/// Algorithm 1 on one page. keys: [n_tok][d] float32, n_tok in [1, B] (callers summarise full
/// pages; shorter inputs are handled as a B-row page of n_tok rows). Singular values below
/// 1e-6 * sigma_max (or exactly zero) give a zero basis column and zero coefficients, so pages of
/// identical keys or rank < r are exact and never NaN. Throws std::invalid_argument on NaN/Inf keys,
/// null keys, n_tok outside [1, 32], d outside [1, 256] or rank outside [1, 32].
PageSummaryF32 build_page_summary(const float* keys, int n_tok, int d, int rank);

/// Eq. 4 on an unquantized summary: s_hat(q) = logsumexp_i (q.mu + (V^T q).c_i) * scale.
/// q: [d]; scale is usually 1/sqrt(d).
float summary_log_mass(const PageSummaryF32& s, const float* q, int d, float scale);

/// Exact page log-mass s_j(q) = logsumexp_i (q.k_i) * scale over n_tok keys [n_tok][d].
float exact_log_mass(const float* keys, int n_tok, const float* q, int d, float scale);

/// Implementations of the integer score pass (PageSummaryStore::score_pages): kAuto picks the best
/// one this CPU runs (checked at run time); kPortable is plain C++ and runs everywhere.
enum class ScoreKernel { kAuto, kPortable, kAvx2, kAvx512Vnni };
const char* score_kernel_name(ScoreKernel k);  // "auto", "portable", "avx2", "avx512-vnni"
bool score_kernel_supported(ScoreKernel k);    // whether this CPU runs it
ScoreKernel best_score_kernel();               // never kAuto

/// Structure-of-arrays store of quantized summaries for every (layer, KV head, page id), laid out
/// [layer][kv_head][page] per field so a score pass over one head's pages is a linear walk. Every
/// accessor throws std::out_of_range for a layer, KV head or page id outside the store; load and
/// score throw std::logic_error for a page with no stored summary (never stored, or cleared).
class PageSummaryStore {
 public:
  PageSummaryStore() = default;
  /// Throws std::invalid_argument for n_layer, n_head_kv or n_pages < 1, or a format that
  /// SummaryFormat::validate refuses for this page size and head_dim.
  PageSummaryStore(const SummaryFormat& fmt, int n_layer, int n_head_kv, int n_pages, int page_size, int head_dim);

  const SummaryFormat& format() const { return fmt_; }
  size_t summary_bytes() const { return summary_bytes_; }

  /// Quantize and store a float summary (Algorithm 1 output) for (il, kv_head, page). With `keys`
  /// (the page's [B][d] float32 keys it was built from) it also records the largest reconstruction
  /// residual max_i ||k_i - k_hat_i|| of the stored form, which tightens log_mass_error_bounds.
  /// `rank` in [1, format().rank] keeps only the first `rank` basis columns and coefficients (the
  /// page's own rank, recorded: page_rank, page_bytes); 0 keeps format().rank. Throws
  /// std::invalid_argument when a scale would overflow f16 (|key| beyond ~1e6) or for a rank outside
  /// [0, format().rank].
  void store(int il, int kv_head, int32_t page, const PageSummaryF32& s, const float* keys = nullptr, int rank = 0);
  /// The rank a stored page was kept at, and the bytes its summary occupies at that rank
  /// (SummaryFormat::bytes of the format with that rank).
  int page_rank(int il, int kv_head, int32_t page) const { return rank_[stored_index(il, kv_head, page)]; }
  size_t page_bytes(int il, int kv_head, int32_t page) const {
    return bytes_at_rank_[rank_[stored_index(il, kv_head, page)]];
  }
  /// SummaryFormat::bytes of this store's format at `rank` in [0, format().rank].
  size_t bytes_at_rank(int rank) const { return bytes_at_rank_.at(size_t(rank)); }
  bool has(int il, int kv_head, int32_t page) const { return valid_[index(il, kv_head, page)] != 0; }
  /// How many of `pages`, from the first, have a summary for (il, kv_head): one pass for a whole
  /// page table. Throws std::out_of_range as index() does for a page id outside the pool.
  size_t stored_prefix(int il, int kv_head, std::span<const int32_t> pages) const;
  void clear(int il, int kv_head, int32_t page) { valid_[index(il, kv_head, page)] = 0; }
  /// Dequantized copy (for tests and diagnostics).
  PageSummaryF32 load(int il, int kv_head, int32_t page) const;

  /// Eq. 4 for a whole GQA group from the stored (quantized) summary, reading it once:
  /// out[g] = s_hat_j(q_g) for g < n_group (any n_group >= 1). q: [n_group][d] float32; scale usually
  /// 1/sqrt(d).
  void score(int il, int kv_head, int32_t page, const float* q, int n_group, float scale, float* out) const;

  /// Eq. 4 for a GQA group over a list of pages of one (layer, KV head), streaming each summary once:
  /// out[g * out_stride + j] = s_hat_{pages[j]}(q_g), and head_max[g] = max_j of it when head_max is
  /// not null. q: [n_group][d] float32. The shipped format (B = 16, r = 8, int4 basis, int8
  /// coefficients and centroid, d a multiple of 64) is scored by the integer kernel `kernel`: for the
  /// basis product q is rounded to 21-bit codes per head (|error| <= max|q_g| / 2^21 per element),
  /// everything else is exact integer or float32 arithmetic; other formats go through score(). Throws
  /// std::invalid_argument for n_group < 1, out_stride < pages.size(), a non-finite q or a kernel this
  /// CPU does not run, std::out_of_range / std::logic_error as score() for a bad or unstored page.
  void score_pages(int il, int kv_head, std::span<const int32_t> pages, const float* q, int n_group, float scale,
                   float* out, size_t out_stride, float* head_max = nullptr,
                   ScoreKernel kernel = ScoreKernel::kAuto) const;
  /// A certified bound on |s_j(q) - s_hat_j(q)|: how far Eq. 4 on the stored summary of (il, kv_head,
  /// page) may be from the exact log-mass of the keys it was built from, for q [d] float32 and logits
  /// scaled by `scale`. From what the summary stores only: Eq. 7's spectral term ||q_perp|| sqrt(tau)
  /// (q_perp against the page's own basis, widened by the basis rounding), plus the rounding of the
  /// stored basis (half a step of each column's scale, or bf16's relative 2^-9), coefficients and
  /// centroid (half a step of their int8 scales), each met with |q| (LSE is 1-Lipschitz in the
  /// token logits), plus 1e-5 of the logits' magnitude for float rounding. Throws as load() does.
  float log_mass_error_bound(int il, int kv_head, int32_t page, const float* q, float scale) const;
  /// A certified bound on |s_j(q) - s_hat_j(q)| for a GQA group over a list of pages of one (layer,
  /// KV head), from per-page terms precomputed at store(). For a page stored with its keys:
  /// scale ||q|| max_i ||k_i - k_hat_i|| (Cauchy-Schwarz on the stored form's own residual, which
  /// holds quantization and the spectral tail together: on the reference model's pages ~3.5x tighter
  /// than Eq. 7's form) plus log_mass_error_bound's float-rounding allowance, reading bound_bytes()
  /// per page and no basis. For one stored without keys: log_mass_error_bound's Eq. 7 form, widened
  /// by splitting its token maximum into page maxima (reads the basis). out[g * out_stride + j]; q:
  /// [n_group][d] float32. Throws std::invalid_argument for n_group < 1 or out_stride <
  /// pages.size(), and as load() for a bad or unstored page.
  void log_mass_error_bounds(int il, int kv_head, std::span<const int32_t> pages, const float* q, int n_group,
                             float scale, float* out, size_t out_stride) const;
  /// Bytes of per-page terms log_mass_error_bounds reads for a page stored with its keys (the
  /// residual maximum, ||V_hat||_F, ||mu_hat||, max_i ||c_hat_i||, tau: float32).
  static constexpr size_t bound_bytes() { return 5 * sizeof(float); }
  /// Whether score_pages uses the integer kernels for this store's format and head_dim.
  bool integer_scoring() const { return int_path_; }

 private:
  size_t index(int il, int kv_head, int32_t page) const {
    if (il < 0 || il >= n_layer_ || kv_head < 0 || kv_head >= n_head_kv_ || page < 0 || page >= n_pages_)
      index_error(il, kv_head, page);
    return (static_cast<size_t>(il) * n_head_kv_ + kv_head) * n_pages_ + page;
  }
  [[noreturn]] void index_error(int il, int kv_head, int32_t page) const;
  size_t stored_index(int il, int kv_head, int32_t page) const;  // index(), and the summary must be stored
  void dequant_basis(size_t idx, float* out) const;              // [r][d]
  PageSummaryF32 load_at(size_t idx) const;                      // load() of a stored index
  void store_bound_terms(size_t idx, const float* keys);         // bound_terms_ from the stored summary

  // Per page, what log_mass_error_bounds needs besides the basis: e_mu + max_i sum_k (|c_ik| +
  // e_c,i) e_k, max_i e_c,i, sum_k e_k^2, tau, ||mu||, max_i ||c_i|| (e: half a rounding step),
  // max_i ||k_i - k_hat_i|| (+inf when stored without keys) and ||V_hat||_F.
  static constexpr int kBoundTerms = 8;

  SummaryFormat fmt_;
  int n_layer_ = 0, n_head_kv_ = 0, n_pages_ = 0, B_ = 16, d_ = 0;
  size_t basis_stride_ = 0, coef_stride_ = 0, centroid_stride_ = 0, summary_bytes_ = 0;
  bool fast_path_ = false;  // shipped-like format handled by the AVX2 score kernel
  bool int_path_ = false;   // the shipped format at d % 64 == 0: the integer score pass
  // Committed as pages are stored (ZeroedArray), not for the whole pool up front.
  ZeroedArray<uint8_t> basis_;         // [L][H][P][basis_stride_] packed codes / bf16 / f32
  ZeroedArray<f16_t> basis_scale_;     // [L][H][P][r]
  ZeroedArray<uint8_t> coef_;          // [L][H][P][coef_stride_] int8 codes or f32
  ZeroedArray<f16_t> coef_scale_;      // [L][H][P][B]
  ZeroedArray<uint8_t> centroid_;      // [L][H][P][centroid_stride_] int8 codes or f32
  ZeroedArray<f16_t> centroid_scale_;  // [L][H][P]
  ZeroedArray<float> tail_;            // [L][H][P]
  ZeroedArray<float> bound_terms_;     // [L][H][P][kBoundTerms]
  ZeroedArray<uint8_t> valid_;         // [L][H][P]
  ZeroedArray<uint8_t> rank_;          // [L][H][P]: the page's own rank (<= fmt_.rank; the rest stored as zeros)
  std::vector<size_t> bytes_at_rank_;  // [fmt_.rank + 1]: SummaryFormat::bytes at each rank
};

}  // namespace locks
