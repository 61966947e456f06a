// The quantized summary store (PageSummaryStore): the storage format, store (quantization through
// locks/quant.h) and load. Its Eq. 4 kernels are in summary_score.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/summary_limits.h"
#include "locks/page_summary.h"
#include "locks/quant.h"

namespace locks {

namespace {

using summary_detail::kMaxHeadDim;
using summary_detail::kMaxPage;

bool valid_bits(int b, bool allow_low) { return b == 32 || b == 8 || (allow_low && (b == 16 || b == 4 || b == 2)); }

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

}  // namespace

void SummaryFormat::validate(int page_size, int head_dim) const {
  if (page_size < 1 || page_size > kMaxPage)
    throw std::invalid_argument(fmt::format("page size {} outside [1, {}]", page_size, kMaxPage));
  if (head_dim < 1 || head_dim > kMaxHeadDim || head_dim % 8 != 0)
    throw std::invalid_argument(fmt::format("head_dim {} must be a multiple of 8 in [8, {}]", head_dim, kMaxHeadDim));
  if (rank < 1 || rank > page_size)
    throw std::invalid_argument(fmt::format("summary rank {} outside [1, page size {}]", rank, page_size));
  if (rank > head_dim)  // a page's keys span at most head_dim directions
    throw std::invalid_argument(fmt::format("summary rank {} above head_dim {}", rank, head_dim));
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

void PageSummaryStore::index_error(int il, int kv_head, int32_t page) const {
  throw std::out_of_range(
      fmt::format("page summary store: (layer {}, KV head {}, page id {}) outside [0, {}) x [0, {}) x "
                  "[0, {})",
                  il, kv_head, page, n_layer_, n_head_kv_, n_pages_));
}

size_t PageSummaryStore::stored_prefix(int il, int kv_head, std::span<const int32_t> pages) const {
  if (pages.empty()) return 0;
  const uint8_t* valid = &valid_[index(il, kv_head, 0)];
  for (size_t j = 0; j < pages.size(); ++j) {
    if (pages[j] < 0 || pages[j] >= n_pages_) index_error(il, kv_head, pages[j]);
    if (!valid[pages[j]]) return j;
  }
  return pages.size();
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
    throw std::invalid_argument(fmt::format(
        "page summary store: {} layers x {} KV heads x {} pages (each must be >= 1)", n_layer, n_head_kv, n_pages));
  fmt.validate(page_size, head_dim);
  const size_t r = fmt.rank;
  basis_stride_ = fmt.basis_bits == 32 ? r * d_ * 4 : packed_bytes(r * d_, fmt.basis_bits);
  coef_stride_ = fmt.coef_bits == 32 ? size_t(B_) * r * 4 : size_t(B_) * r;
  centroid_stride_ = fmt.centroid_bits == 32 ? size_t(d_) * 4 : size_t(d_);
  summary_bytes_ = fmt.bytes(B_, d_);
  fast_path_ = (fmt.basis_bits == 4 || fmt.basis_bits == 8) && fmt.coef_bits == 8 && fmt.centroid_bits == 8 &&
               B_ == 16 && d_ % 8 == 0 && (fmt.rank == 4 || fmt.rank == 8 || fmt.rank == 16);
  int_path_ =
      fmt.basis_bits == 4 && fmt.coef_bits == 8 && fmt.centroid_bits == 8 && fmt.rank == 8 && B_ == 16 && d_ % 64 == 0;
  const size_t n = size_t(n_layer) * n_head_kv * n_pages;
  basis_ = ZeroedArray<uint8_t>(n * basis_stride_);
  basis_scale_ = ZeroedArray<f16_t>(n * r);
  coef_ = ZeroedArray<uint8_t>(n * coef_stride_);
  coef_scale_ = ZeroedArray<f16_t>(n * B_);
  centroid_ = ZeroedArray<uint8_t>(n * centroid_stride_);
  centroid_scale_ = ZeroedArray<f16_t>(n);
  tail_ = ZeroedArray<float>(n);
  bound_terms_ = ZeroedArray<float>(n * kBoundTerms);
  valid_ = ZeroedArray<uint8_t>(n);
  rank_ = ZeroedArray<uint8_t>(n);
  for (int k = 0; k <= fmt.rank; ++k) {
    SummaryFormat at = fmt;
    at.rank = k;
    bytes_at_rank_.push_back(at.bytes(B_, d_));
  }
}

// Algorithm 1's output in the stored form (page_summary.h): V int4 per column, C int8 per row, mu int8.
void PageSummaryStore::store(int il, int kv_head, int32_t page, const PageSummaryF32& full, const float* keys,
                             int rank) {
  const size_t idx = index(il, kv_head, page);
  const int r = fmt_.rank, d = d_;
  const int n_rows = int(full.coef.size()) / r;
  if (int(full.basis.size()) != r * d || int(full.centroid.size()) != d || n_rows != B_)
    throw std::invalid_argument(
        fmt::format("page summary store: expects a full page summary of {} rows, rank {}, head_dim {} (got {} rows)",
                    B_, r, d, n_rows));
  if (rank < 0 || rank > r)
    throw std::invalid_argument(fmt::format("page summary store: page rank {} outside [0, {}]", rank, r));
  // A page kept at a lower rank: its last basis columns and coefficients are zeros (an exact rank-k
  // summary in the rank-r layout: zero codes, zero scales).
  PageSummaryF32 low;
  if (rank > 0 && rank < r) {
    low = full;
    std::fill(low.basis.begin() + size_t(rank) * d, low.basis.end(), 0.0f);
    for (int i = 0; i < n_rows; ++i) std::fill_n(&low.coef[size_t(i) * r + rank], r - rank, 0.0f);
    low.tail = full.tail;
    for (int k = rank; k < r; ++k)  // directions Alg. 1 kept (a dropped one is in the tail already)
      if (full.sigma2.size() > size_t(k) &&
          std::any_of(&full.basis[size_t(k) * d], &full.basis[size_t(k + 1) * d], [](float v) { return v != 0.0f; }))
        low.tail += full.sigma2[size_t(k)];
  }
  const PageSummaryF32& s = rank > 0 && rank < r ? low : full;
  rank_[idx] = uint8_t(rank == 0 ? r : rank);

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
      basis_scale_[idx * r + k] =
          quantize_group(&s.basis[size_t(k) * d], d, fmt_.basis_bits, bdst + k * col_bytes, "basis column");
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
  store_bound_terms(idx, keys);
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
  return load_at(stored_index(il, kv_head, page));
}

PageSummaryF32 PageSummaryStore::load_at(size_t idx) const {
  const int r = fmt_.rank, d = d_;
  PageSummaryF32 s;
  s.basis.resize(size_t(r) * d);
  dequant_basis(idx, s.basis.data());
  s.coef.resize(size_t(B_) * r);
  const uint8_t* c = coef_.data() + idx * coef_stride_;
  if (fmt_.coef_bits == 32)
    std::memcpy(s.coef.data(), c, size_t(B_) * r * 4);
  else
    for (int i = 0; i < B_; ++i)
      quant::dequantize_packed(c + size_t(i) * r, r, 8, f16_to_f32(coef_scale_[idx * B_ + i]), &s.coef[size_t(i) * r]);
  s.centroid.resize(d);
  const uint8_t* m = centroid_.data() + idx * centroid_stride_;
  if (fmt_.centroid_bits == 32)
    std::memcpy(s.centroid.data(), m, size_t(d) * 4);
  else
    quant::dequantize_packed(m, d, 8, f16_to_f32(centroid_scale_[idx]), s.centroid.data());
  s.tail = tail_[idx];
  return s;
}

}  // namespace locks
