// Device KV cache: allocation sized from free memory, the host-side page allocator, and the step
// kernel that advances lengths and rebuilds the CSR page tables on the device.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda_check.h"
#include "device_kv_cache.h"

namespace locks::cuda {

namespace {

void check(cudaError_t e, const char* what) { throw_on_error(e, "CUDA KV cache", what); }

template <class T>
T* device_alloc(size_t n, const char* what) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(n * sizeof(T), 16)) != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(fmt::format("CUDA KV cache: no GPU memory for {} ({} bytes)", what, n * sizeof(T)));
  }
  return static_cast<T*>(p);
}

constexpr int kAdvanceThreads = 256;

// Bookkeeping of one step, one CTA: new lengths, indptr, last_page_len, row positions and the pages
// the step fills. seq < 0: decode (every sequence + 1 token); else prefill of n_new tokens of seq.
__global__ void advance_kernel(int32_t* lengths, int32_t* indptr, int32_t* last_page_len, const int32_t* page_list,
                               int page_stride, int n_seqs, int seq, int n_new, int32_t* row_seq, int32_t* row_pos,
                               int32_t* filled, bool write_rows) {
  __shared__ int32_t old_len[64];
  const int tid = threadIdx.x;
  for (int b = tid; b < n_seqs; b += blockDim.x) old_len[b] = lengths[b];
  __syncthreads();
  if (!write_rows) {
  } else if (seq < 0) {
    for (int b = tid; b < n_seqs; b += blockDim.x) {
      const int32_t pos = old_len[b];
      row_seq[b] = b;
      row_pos[b] = pos;
      filled[b] = pos % kPageSize == kPageSize - 1 ? page_list[size_t(b) * page_stride + pos / kPageSize] : -1;
    }
  } else {
    const int32_t pos0 = old_len[seq];
    for (int t = tid; t < n_new; t += blockDim.x) {
      row_seq[t] = seq;
      row_pos[t] = pos0 + t;
    }
    const int first_full = pos0 / kPageSize, end_full = (pos0 + n_new) / kPageSize;
    for (int j = first_full + tid; j < end_full; j += blockDim.x)
      filled[j - first_full] = page_list[size_t(seq) * page_stride + j];
  }
  __syncthreads();
  if (tid == 0) {
    int32_t acc = 0;
    for (int b = 0; b < n_seqs; ++b) {
      const int32_t len = old_len[b] + (seq < 0 || seq == b ? n_new : 0);
      lengths[b] = len;
      indptr[b] = acc;
      const int32_t pages = (len + kPageSize - 1) / kPageSize;
      last_page_len[b] = pages > 0 ? len - (pages - 1) * kPageSize : 0;
      acc += pages;
    }
    indptr[n_seqs] = acc;
  }
}

// indices[indptr[b] + j] = page_list[b][j] for the pages of every sequence (after advance_kernel).
__global__ void gather_indices_kernel(const int32_t* indptr, const int32_t* page_list, int page_stride, int n_seqs,
                                      int32_t* indices) {
  const int b = blockIdx.y;
  if (b >= n_seqs) return;
  const int32_t start = indptr[b], n = indptr[b + 1] - start;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x)
    indices[start + j] = page_list[size_t(b) * page_stride + j];
}

// Copies unit u of page pair i in layer l: src + l * src_layer + u * src_unit + src_id * bytes to the
// same place of dst (K/V pages: one unit of a whole page; records: one unit per KV head).
struct PageCopy {
  const uint8_t* src;
  uint8_t* dst;
  size_t src_layer, dst_layer, src_unit, dst_unit, bytes;
  int n_units;
};
__global__ void copy_pages_kernel(PageCopy c, const int32_t* src_ids, const int32_t* dst_ids) {
  const int i = blockIdx.x, l = blockIdx.y;
  for (int u = 0; u < c.n_units; ++u) {
    const uint4* s = reinterpret_cast<const uint4*>(c.src + l * c.src_layer + u * c.src_unit + src_ids[i] * c.bytes);
    uint4* d = reinterpret_cast<uint4*>(c.dst + l * c.dst_layer + u * c.dst_unit + dst_ids[i] * c.bytes);
    for (size_t k = threadIdx.x; k < c.bytes / 16; k += blockDim.x) d[k] = s[k];
  }
}

}  // namespace

size_t DeviceKvCache::page_bytes() const {
  const size_t kv = size_t(cfg_.n_layer) * cfg_.n_head_kv * kPageSize * cfg_.head_dim * 2 * 2;
  const size_t rec = cfg_.summaries ? size_t(cfg_.n_layer) * cfg_.n_head_kv * summary_record_bytes(cfg_.head_dim) : 0;
  return kv + rec;
}

DeviceKvCache::DeviceKvCache(const DeviceKvConfig& cfg) : cfg_(cfg) {
  if (cfg.n_layer < 1 || cfg.n_head_kv < 1 || cfg.head_dim < 1 || cfg.max_seqs < 1 || cfg.max_pages_per_seq < 1 ||
      cfg.max_rows < 1 || cfg.n_pages_pool < 0)
    throw std::invalid_argument("CUDA KV cache: sizes must be positive");
  if (cfg.max_seqs > 64) throw std::invalid_argument("CUDA KV cache: at most 64 sequences in a batch");
  if (cfg.summaries && summary_record_bytes(cfg.head_dim) == 0)
    throw std::invalid_argument(
        fmt::format("CUDA KV cache: LOCKS summaries need head_dim 64 or 128, not {}", cfg.head_dim));
  const size_t want = size_t(cfg.max_seqs) * cfg.max_pages_per_seq;
  size_t n_pool = cfg.n_pages_pool > 0 ? size_t(cfg.n_pages_pool) : want;
  if (cfg.n_pages_pool == 0) {
    size_t free_b = 0, total_b = 0;
    check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    const size_t usable = free_b > cfg.reserve_bytes ? free_b - cfg.reserve_bytes : 0;
    n_pool = std::min(want, usable / page_bytes());
    if (n_pool < size_t(cfg.max_pages_per_seq))
      throw std::runtime_error(fmt::format(
          "CUDA KV cache: a context of {} tokens needs {:.2f} GiB of GPU memory for its pages; {:.2f} GiB are free "
          "after the weights (lower -c)",
          size_t(cfg.max_pages_per_seq) * kPageSize, double(cfg.max_pages_per_seq) * page_bytes() / (1 << 30),
          double(usable) / (1 << 30)));
  }
  if (n_pool > size_t(INT32_MAX / kPageSize)) n_pool = INT32_MAX / kPageSize;
  n_pages_pool_ = int(n_pool);

  const size_t elems_per_layer = size_t(n_pages_pool_) * cfg.n_head_kv * kPageSize * cfg.head_dim;
  k_stride_ = elems_per_layer;
  k_ = device_alloc<uint16_t>(elems_per_layer * cfg.n_layer, "K pages");
  v_ = device_alloc<uint16_t>(elems_per_layer * cfg.n_layer, "V pages");
  bytes_ = elems_per_layer * cfg.n_layer * 4;
  if (cfg.summaries) {
    records_stride_ = size_t(cfg.n_head_kv) * n_pages_pool_ * summary_record_bytes(cfg.head_dim);
    records_ = device_alloc<uint8_t>(records_stride_ * cfg.n_layer, "page summaries");
    bytes_ += records_stride_ * cfg.n_layer;
  }
  const int S = cfg.max_seqs;
  indptr_ = device_alloc<int32_t>(S + 1, "page tables");
  page_list_ = device_alloc<int32_t>(size_t(S) * cfg.max_pages_per_seq, "page tables");
  indices_ = S == 1 ? page_list_ : device_alloc<int32_t>(size_t(S) * cfg.max_pages_per_seq, "page tables");
  last_page_len_ = device_alloc<int32_t>(S, "page tables");
  lengths_ = device_alloc<int32_t>(S, "page tables");
  row_seq_ = device_alloc<int32_t>(cfg.max_rows, "row positions");
  row_pos_ = device_alloc<int32_t>(cfg.max_rows, "row positions");
  filled_ = device_alloc<int32_t>(size_t(cfg.max_rows) / kPageSize + S + 1, "page lists");
  pinned_cap_ = size_t(S) * cfg.max_pages_per_seq;
  check(cudaMallocHost(reinterpret_cast<void**>(&pinned_), pinned_cap_ * sizeof(int32_t)), "pinned page lists");
  lengths_h_.assign(S, 0);
  pages_h_.assign(S, {});
  free_pages_.resize(n_pages_pool_);
  for (int i = 0; i < n_pages_pool_; ++i) free_pages_[i] = n_pages_pool_ - 1 - i;  // pop_back gives 0, 1, ...
  check(cudaMemset(lengths_, 0, S * sizeof(int32_t)), "init");
  check(cudaMemset(indptr_, 0, (S + 1) * sizeof(int32_t)), "init");
  check(cudaMemset(last_page_len_, 0, S * sizeof(int32_t)), "init");
}

DeviceKvCache::~DeviceKvCache() {
  for (void* p : {k_, v_, static_cast<void*>(records_), static_cast<void*>(indptr_), static_cast<void*>(last_page_len_),
                  static_cast<void*>(lengths_), static_cast<void*>(page_list_), static_cast<void*>(row_seq_),
                  static_cast<void*>(row_pos_), static_cast<void*>(filled_)})
    if (p) cudaFree(p);
  if (indices_ && indices_ != page_list_) cudaFree(indices_);
  if (pinned_) cudaFreeHost(pinned_);
}

PagedKvView DeviceKvCache::view(int il) const {
  PagedKvView v;
  v.k = static_cast<const uint16_t*>(k_) + size_t(il) * k_stride_;
  v.v = static_cast<const uint16_t*>(v_) + size_t(il) * k_stride_;
  v.dtype = cfg_.dtype;
  v.n_head_kv = cfg_.n_head_kv;
  v.head_dim = cfg_.head_dim;
  v.batch = cfg_.max_seqs;
  v.indptr = indptr_;
  v.indices = indices_;
  v.last_page_len = last_page_len_;
  v.n_pages_pool = n_pages_pool_;
  return v;
}

uint8_t* DeviceKvCache::records(int il) const { return records_ ? records_ + size_t(il) * records_stride_ : nullptr; }

void DeviceKvCache::reserve(int seq, int n_new, cudaStream_t stream) {
  if (seq < 0 || seq >= cfg_.max_seqs) throw std::out_of_range(fmt::format("CUDA KV cache: no sequence {}", seq));
  const int64_t len = int64_t(lengths_h_[seq]) + n_new;
  if (len > int64_t(cfg_.max_pages_per_seq) * kPageSize)
    throw std::length_error(fmt::format("CUDA KV cache: sequence {} would hold {} tokens, more than its context of {}",
                                        seq, len, int64_t(cfg_.max_pages_per_seq) * kPageSize));
  auto& pages = pages_h_[seq];
  const size_t need = size_t((len + kPageSize - 1) / kPageSize);
  if (need <= pages.size()) return;
  if (need - pages.size() > free_pages_.size())
    throw std::runtime_error(fmt::format(
        "CUDA KV cache: the page pool of {} pages ({:.2f} GiB) is full: sequence {} needs {} more for {} tokens "
        "(lower the context or the batch)",
        n_pages_pool_, double(n_pages_pool_) * page_bytes() / (1 << 30), seq, need - pages.size(), len));
  const size_t first = pages.size();
  int32_t* stage = pinned_ + size_t(seq) * cfg_.max_pages_per_seq;
  while (pages.size() < need) {
    stage[pages.size()] = free_pages_.back();
    pages.push_back(free_pages_.back());
    free_pages_.pop_back();
  }
  // Each pinned entry is written once per page allocation, so an earlier copy never sees it change.
  check(cudaMemcpyAsync(page_list_ + size_t(seq) * cfg_.max_pages_per_seq + first, stage + first,
                        (need - first) * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
        "page list copy");
}

void DeviceKvCache::advance(int seq, int n_new, cudaStream_t stream) {
  const int S = cfg_.max_seqs;
  if (seq >= S || n_new < 1 || (seq < 0 && n_new != 1) || (seq >= 0 && n_new > cfg_.max_rows) ||
      (seq < 0 && S > cfg_.max_rows))
    throw std::invalid_argument("CUDA KV cache: advance: bad step");
  for (int b = 0; b < S; ++b)
    if ((seq < 0 || b == seq) && (size_t(lengths_h_[b]) + n_new + kPageSize - 1) / kPageSize > pages_h_[b].size())
      throw std::logic_error("CUDA KV cache: advance before reserve");
  enqueue_tables(seq, n_new, true, stream);
  advance_host(seq, n_new);
}

void DeviceKvCache::enqueue_tables(int seq, int n_new, bool write_rows, cudaStream_t stream) {
  const int S = cfg_.max_seqs;
  advance_kernel<<<1, kAdvanceThreads, 0, stream>>>(lengths_, indptr_, last_page_len_, page_list_,
                                                    cfg_.max_pages_per_seq, S, seq, n_new, row_seq_, row_pos_, filled_,
                                                    write_rows);
  if (indices_ != page_list_) {
    const dim3 grid(std::max(1, std::min(32, cfg_.max_pages_per_seq / 1024)), S);
    gather_indices_kernel<<<grid, 256, 0, stream>>>(indptr_, page_list_, cfg_.max_pages_per_seq, S, indices_);
  }
  check(cudaGetLastError(), "page tables");
}

void DeviceKvCache::extend(int seq, int n_new, cudaStream_t stream) {
  reserve(seq, n_new, stream);
  enqueue_tables(seq, n_new, false, stream);
  advance_host(seq, n_new);
  n_filled_ = 0;
}

void DeviceKvCache::advance_host(int seq, int n_new) {
  const int S = cfg_.max_seqs;
  if (seq < 0) {
    n_filled_ = S;
  } else {
    const int32_t pos0 = lengths_h_[seq];
    n_filled_ = (pos0 + n_new) / kPageSize - pos0 / kPageSize;
  }
  for (int b = 0; b < S; ++b)
    if (seq < 0 || b == seq) lengths_h_[b] += n_new;
}

bool DeviceKvCache::decode_fills_page() const {
  for (int32_t len : lengths_h_)
    if (len % kPageSize == kPageSize - 1) return true;
  return false;
}

bool DeviceKvCache::copy_from(const DeviceKvCache& src, cudaStream_t stream) {
  const DeviceKvConfig& o = src.cfg_;
  if (o.n_layer != cfg_.n_layer || o.n_head_kv != cfg_.n_head_kv || o.head_dim != cfg_.head_dim ||
      o.dtype != cfg_.dtype || o.max_seqs != cfg_.max_seqs)
    throw std::invalid_argument("CUDA KV cache: copy between caches of different shapes");
  for (int32_t len : lengths_h_)
    if (len != 0) throw std::logic_error("CUDA KV cache: copy into a cache that holds tokens");
  std::vector<int32_t> ids;  // source page ids, then destination page ids
  std::vector<int32_t> dst;
  for (int b = 0; b < cfg_.max_seqs; ++b) {
    if (src.length(b) == 0) continue;
    extend(b, src.length(b), stream);
    ids.insert(ids.end(), src.page_list(b).begin(), src.page_list(b).end());
    dst.insert(dst.end(), pages_h_[b].begin(), pages_h_[b].end());
  }
  const bool records = records_ && src.records_;
  const int n = int(ids.size());
  if (n == 0) return records;
  ids.insert(ids.end(), dst.begin(), dst.end());
  int32_t* d_ids = device_alloc<int32_t>(ids.size(), "page copy");
  const cudaError_t e0 = cudaMemcpyAsync(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, stream);
  const size_t page = size_t(cfg_.n_head_kv) * kPageSize * cfg_.head_dim * 2;
  const dim3 grid(n, cfg_.n_layer);
  for (const auto& [from, to] : {std::pair{src.k_, k_}, std::pair{src.v_, v_}}) {
    const PageCopy c{
        static_cast<const uint8_t*>(from), static_cast<uint8_t*>(to), src.k_stride_ * 2, k_stride_ * 2, 0, 0, page, 1};
    copy_pages_kernel<<<grid, 256, 0, stream>>>(c, d_ids, d_ids + n);
  }
  if (records) {
    const size_t rec = summary_record_bytes(cfg_.head_dim);
    const PageCopy c{src.records_,
                     records_,
                     src.records_stride_,
                     records_stride_,
                     size_t(src.n_pages_pool_) * rec,
                     size_t(n_pages_pool_) * rec,
                     rec,
                     cfg_.n_head_kv};
    copy_pages_kernel<<<grid, 256, 0, stream>>>(c, d_ids, d_ids + n);
  }
  const cudaError_t e1 = cudaGetLastError();
  const cudaError_t e2 = cudaStreamSynchronize(stream);
  cudaFree(d_ids);
  check(e0 != cudaSuccess ? e0 : e1 != cudaSuccess ? e1 : e2, "page copy");
  return records;
}

void DeviceKvCache::clear(cudaStream_t stream) {
  check(cudaStreamSynchronize(stream), "clear");
  for (auto& pages : pages_h_) {
    free_pages_.insert(free_pages_.end(), pages.rbegin(), pages.rend());
    pages.clear();
  }
  std::fill(lengths_h_.begin(), lengths_h_.end(), 0);
  const int S = cfg_.max_seqs;
  check(cudaMemsetAsync(lengths_, 0, S * sizeof(int32_t), stream), "clear");
  check(cudaMemsetAsync(indptr_, 0, (S + 1) * sizeof(int32_t), stream), "clear");
  check(cudaMemsetAsync(last_page_len_, 0, S * sizeof(int32_t), stream), "clear");
}

}  // namespace locks::cuda
