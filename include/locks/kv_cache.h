// Paged KV cache: a pool of pages of B tokens, per layer and KV head, and one page table per sequence.
// Page ids follow vLLM/FlashInfer conventions: a page id names the same B token slots in every layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "locks/quant.h"
#include "locks/zeroed_array.h"

namespace locks {

enum class KvDtype { F16, F32 };

/// Bytes of one stored K or V element.
inline size_t kv_dtype_bytes(KvDtype t) { return t == KvDtype::F16 ? 2 : 4; }
/// "f16" / "f32"; parse throws std::invalid_argument on anything else.
std::string kv_dtype_name(KvDtype t);
KvDtype parse_kv_dtype(const std::string& s);

struct KvCacheConfig {
  int n_layer = 1;
  int n_head_kv = 1;
  int head_dim = 64;
  int page_size = 16;  // B, tokens per page
  int n_pages = 0;     // pool size (pages shared by all sequences)
  KvDtype dtype = KvDtype::F16;
};

/// One sequence's view of the pool: its ordered page ids (the page table) and its length.
/// Token t lives in page_table[t / B] at slot t % B; only the last page may be partial.
struct KvSequence {
  std::vector<int32_t> page_table;  // [n_pages_used] page ids
  int32_t n_tokens = 0;
  int32_t n_pages() const { return static_cast<int32_t>(page_table.size()); }
};

/// Valid tokens in page-table position j of seq: B except for a partial last page.
inline int page_tokens(const KvSequence& seq, int j, int page_size) {
  return j == seq.n_pages() - 1 ? seq.n_tokens - j * page_size : page_size;
}

/// The page pool. Storage per (layer, page): K as [n_head_kv][B][head_dim] (HND inside the page,
/// so one KV head's page is a contiguous [B][head_dim] block), V the same. Memory is taken as pages
/// are written, not for the whole pool up front.
class PagedKvCache {
 public:
  /// Throws std::invalid_argument on non-positive sizes or a pool whose byte size overflows, and
  /// std::runtime_error naming the size when the system refuses even the pool's address space.
  explicit PagedKvCache(const KvCacheConfig& cfg);

  const KvCacheConfig& config() const { return cfg_; }
  /// Throws std::out_of_range naming `what` unless 0 <= il < n_layer and 0 <= kv_head < n_head_kv
  /// (the checks of the public entry points: write, attention, selectors).
  void check_layer_head(const char* what, int il, int kv_head = 0) const;
  /// Throws std::out_of_range naming `what` unless position j of seq's page table exists and holds a
  /// page id of this pool.
  void check_page_position(const char* what, const KvSequence& seq, int32_t j) const;
  /// Throws std::out_of_range naming `what` unless 0 <= page < n_pages.
  void check_page_id(const char* what, int32_t page) const;
  /// check_page_id, and std::out_of_range unless a sequence holds the page.
  void check_page_in_use(const char* what, int32_t page) const;
  /// Throws std::invalid_argument naming `what` unless seq's length fits its page table (only the last
  /// page partial, none empty) and, with `ids`, std::out_of_range unless every page id is one of this
  /// pool's pages in use. O(1), or O(pages) with `ids`.
  void check_sequence(const char* what, const KvSequence& seq, bool ids) const;
  int page_size() const { return cfg_.page_size; }
  int n_free_pages() const { return static_cast<int>(free_.size()); }

  /// Make room for `n` more tokens at the end of `seq` (allocating pages as needed) and return the
  /// position of the first new token. Throws std::runtime_error naming the pool size when the pool
  /// cannot hold them, or naming the bytes when the new pages (plus a quarter for the selectors'
  /// per-page data) would not fit in the memory available now (nothing is allocated in either case).
  int32_t append_tokens(KvSequence& seq, int32_t n);
  /// Return all pages of `seq` to the pool and clear it. Throws (leaving everything as it was) when
  /// the page table holds an id outside the pool, one not in use (released twice) or one twice.
  void release(KvSequence& seq);

  /// Store k, v ([n_head_kv][head_dim] float32 each) of token `pos` of `seq` in layer `il`.
  /// Throws std::out_of_range for a layer, position or page id outside the cache or sequence, and
  /// std::invalid_argument when k or v is null or holds NaN/Inf, or (f16 cache) a value beyond +-65504
  /// that would be stored as inf: a NaN or inf key would poison every score.
  void write(int il, const KvSequence& seq, int32_t pos, const float* k, const float* v);

  /// Raw page block of one KV head: [B][head_dim] elements of the cache dtype. These accessors throw
  /// std::out_of_range for a layer, page id or KV head outside the cache.
  const void* k_page(int il, int32_t page, int kv_head) const { return ptr(k_, il, page, kv_head); }
  const void* v_page(int il, int32_t page, int kv_head) const { return ptr(v_, il, page, kv_head); }
  /// Copy one KV head's K (or V) page to float32 rows: out [B][head_dim].
  void k_page_f32(int il, int32_t page, int kv_head, float* out) const;
  void v_page_f32(int il, int32_t page, int kv_head, float* out) const;

  /// Bytes of the pages in use (K+V, every layer and KV head).
  size_t bytes_in_use() const { return size_t(cfg_.n_pages - n_free_pages()) * page_bytes(); }

  /// Bytes of one page's K+V for one KV head and `n_tokens` tokens.
  size_t kv_bytes(int32_t n_tokens) const {
    return 2 * static_cast<size_t>(n_tokens) * cfg_.head_dim * kv_dtype_bytes(cfg_.dtype);
  }

 private:
  size_t block_elems() const { return static_cast<size_t>(cfg_.page_size) * cfg_.head_dim; }
  size_t page_bytes() const {  // K+V of one page id, every layer and KV head
    return 2 * size_t(cfg_.n_layer) * cfg_.n_head_kv * block_elems() * kv_dtype_bytes(cfg_.dtype);
  }
  size_t offset(int il, int32_t page, int kv_head) const {
    return ((static_cast<size_t>(il) * cfg_.n_pages + page) * cfg_.n_head_kv + kv_head) * block_elems() *
           kv_dtype_bytes(cfg_.dtype);
  }
  const void* ptr(const ZeroedArray<uint8_t>& buf, int il, int32_t page, int kv_head) const {
    if (il < 0 || il >= cfg_.n_layer || page < 0 || page >= cfg_.n_pages || kv_head < 0 || kv_head >= cfg_.n_head_kv)
      page_error(il, page, kv_head);
    return buf.data() + offset(il, page, kv_head);
  }
  [[noreturn]] void page_error(int il, int32_t page, int kv_head) const;
  void to_f32(const ZeroedArray<uint8_t>& buf, int il, int32_t page, int kv_head, float* out) const;

  KvCacheConfig cfg_;
  ZeroedArray<uint8_t> k_, v_;   // [n_layer][n_pages][n_head_kv][B][head_dim], committed as written
  std::vector<int32_t> free_;    // free page ids, popped from the back (lowest id first)
  std::vector<uint8_t> in_use_;  // [n_pages]: 1 while a sequence holds the page
};

}  // namespace locks
