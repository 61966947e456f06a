// The paged KV cache of the GPU engine: per layer a pool of 16-token pages (K and V, bf16 or f16, the
// layout of include/locks/cuda/kernels.h), the LOCKS summary records beside them, and the page
// tables (FlashInfer's CSR: indptr, indices, last_page_len) rebuilt on the device at every step from
// the sequences' lengths, so a captured decode graph stays correct as the sequences grow.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "locks/cuda/kernels.h"

namespace locks::cuda {

struct DeviceKvConfig {
  int n_layer = 1;
  int n_head_kv = 1;
  int head_dim = 128;
  KvType dtype = KvType::kBF16;
  int max_seqs = 1;           // sequences of a decode batch
  int max_pages_per_seq = 1;  // ceil(n_ctx / 16)
  int max_rows = 1;           // rows of one forward call (prefill chunk, or max_seqs)
  bool summaries = false;     // LOCKS records (head_dim 64 or 128)
  /// Pages in the pool, 0: as many as the GPU's free memory holds, up to max_seqs * max_pages_per_seq,
  /// keeping `reserve_bytes` free for the rest of the engine.
  int n_pages_pool = 0;
  size_t reserve_bytes = 0;
};

class DeviceKvCache {
 public:
  /// Throws std::invalid_argument for non-positive sizes and std::runtime_error naming the bytes
  /// when the GPU cannot hold even one sequence's worth of pages for the context.
  explicit DeviceKvCache(const DeviceKvConfig& cfg);
  ~DeviceKvCache();
  DeviceKvCache(const DeviceKvCache&) = delete;
  DeviceKvCache& operator=(const DeviceKvCache&) = delete;

  const DeviceKvConfig& config() const { return cfg_; }
  int n_pages_pool() const { return n_pages_pool_; }
  /// Bytes of one page in every layer: K + V + summary records.
  size_t page_bytes() const;
  size_t bytes() const { return bytes_; }

  /// One layer's pool with the CSR page table of every sequence (batch = max_seqs).
  PagedKvView view(int il) const;
  uint8_t* records(int il) const;  // [n_head_kv][n_pages_pool][record_bytes], or null without summaries
  size_t records_layer_stride() const { return records_stride_; }
  size_t k_layer_stride() const { return k_stride_; }  // elements
  void* k_pool() const { return k_; }                  // [n_layer][n_pages_pool][n_head_kv][16][head_dim]
  void* v_pool() const { return v_; }

  // Step arrays on the device, written by advance().
  const int32_t* row_seq() const { return row_seq_; }  // [max_rows]
  const int32_t* row_pos() const { return row_pos_; }  // [max_rows]
  const int32_t* filled() const { return filled_; }    // [max filled per step] page ids, -1: none

  /// Host view of the lengths (what advance() has enqueued so far).
  int32_t length(int seq) const { return lengths_h_[seq]; }
  /// Pages (as ids) of sequence `seq` in order, host side.
  const std::vector<int32_t>& page_list(int seq) const { return pages_h_[seq]; }

  /// Gives `seq` pages for `n_new` more tokens (async copies of the new ids to the device). Throws
  /// std::length_error when the sequence would pass max_pages_per_seq * 16 tokens and
  /// std::runtime_error when the pool is out of pages ("KV cache: the page pool of N pages (X GiB)
  /// is full ..."). Call before advance().
  void reserve(int seq, int n_new, cudaStream_t stream);
  /// Enqueues the step's bookkeeping: decode (seq < 0): every sequence gains one token, row b is
  /// sequence b at its old length; prefill: sequence `seq` gains n_new tokens, row t at old + t.
  /// Rebuilds indptr / indices / last_page_len, writes row_seq / row_pos and the pages the step
  /// fills (filled, `n_filled()` entries; decode: one per sequence, -1 where none fills). Updates
  /// the host lengths. Capturable.
  void advance(int seq, int n_new, cudaStream_t stream);
  /// Lengthens `seq` by n_new tokens whose K/V the caller writes itself (benchmarks fill the pools
  /// directly): reserve + the page-table bookkeeping, no rows.
  void extend(int seq, int n_new, cudaStream_t stream);
  /// The host side of advance() alone, for a replayed graph that holds the step's advance kernel.
  void advance_host(int seq, int n_new);
  /// Entries of filled() the last advance() wrote (decode: max_seqs; prefill: the pages it filled).
  int n_filled() const { return n_filled_; }
  /// Whether a decode step from the current lengths fills a page of some sequence.
  bool decode_fills_page() const;
  /// Copies every sequence of `src` (lengths, K/V pages, and the summary records where both caches keep
  /// them) into this empty cache, on `stream` (synchronised before return). Throws
  /// std::invalid_argument when the shapes differ (layers, KV heads, head_dim, dtype, batch), and what
  /// reserve() throws when the pages do not fit. Returns whether the records were copied.
  bool copy_from(const DeviceKvCache& src, cudaStream_t stream);
  /// Drops every sequence's pages (lengths 0).
  void clear(cudaStream_t stream);

 private:
  // The step kernel (lengths, CSR tables; rows and filled pages when write_rows) and the gather.
  void enqueue_tables(int seq, int n_new, bool write_rows, cudaStream_t stream);

  DeviceKvConfig cfg_;
  int n_pages_pool_ = 0;
  size_t bytes_ = 0, k_stride_ = 0, records_stride_ = 0;
  void* k_ = nullptr;
  void* v_ = nullptr;
  uint8_t* records_ = nullptr;
  int32_t* indptr_ = nullptr;
  int32_t* indices_ = nullptr;
  int32_t* last_page_len_ = nullptr;
  int32_t* lengths_ = nullptr;
  int32_t* page_list_ = nullptr;  // [max_seqs][max_pages_per_seq]
  int32_t* row_seq_ = nullptr;
  int32_t* row_pos_ = nullptr;
  int32_t* filled_ = nullptr;
  int32_t* pinned_ = nullptr;  // staging of new page ids
  size_t pinned_cap_ = 0;
  std::vector<int32_t> lengths_h_;
  std::vector<std::vector<int32_t>> pages_h_;
  std::vector<int32_t> free_pages_;
  int n_filled_ = 0;
};

}  // namespace locks::cuda
