#include "locks/kv_cache.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace locks {

std::string kv_dtype_name(KvDtype t) { return t == KvDtype::F16 ? "f16" : "f32"; }

KvDtype parse_kv_dtype(const std::string& s) {
  if (s == "f16") return KvDtype::F16;
  if (s == "f32") return KvDtype::F32;
  throw std::invalid_argument(fmt::format("unknown KV cache dtype '{}' (expected f16 or f32)", s));
}

namespace {
// Memory this process can still commit, in bytes: Linux's MemAvailable, capped by a cgroup v2
// limit when one is set; the physical memory where neither is readable; 0 if unknown.
size_t available_memory() {
  size_t avail = 0;
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char key[64];
    unsigned long long kb = 0;
    while (std::fscanf(f, "%63s %llu kB", key, &kb) == 2)
      if (std::strcmp(key, "MemAvailable:") == 0) {
        avail = size_t(kb) * 1024;
        break;
      }
    std::fclose(f);
  }
  if (avail == 0) {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0) avail = size_t(pages) * size_t(page);
  }
  unsigned long long max = 0, cur = 0;
  std::FILE* fm = std::fopen("/sys/fs/cgroup/memory.max", "r");  // "max" (no limit) fails the scan
  std::FILE* fc = std::fopen("/sys/fs/cgroup/memory.current", "r");
  if (fm && fc && std::fscanf(fm, "%llu", &max) == 1 && std::fscanf(fc, "%llu", &cur) == 1)
    avail = std::min<size_t>(avail, max > cur ? size_t(max - cur) : 0);
  if (fm) std::fclose(fm);
  if (fc) std::fclose(fc);
  return avail;
}
}  // namespace

PagedKvCache::PagedKvCache(const KvCacheConfig& cfg) : cfg_(cfg) {
  if (cfg.n_layer <= 0 || cfg.n_head_kv <= 0 || cfg.head_dim <= 0 || cfg.page_size <= 0 || cfg.n_pages <= 0)
    throw std::invalid_argument(fmt::format(
        "KV cache config: n_layer={}, n_head_kv={}, head_dim={}, page_size={}, n_pages={} must all be positive",
        cfg.n_layer, cfg.n_head_kv, cfg.head_dim, cfg.page_size, cfg.n_pages));
  if (cfg.page_size > 32)
    throw std::invalid_argument(
        fmt::format("KV cache config: page_size {} > 32 (the CPU kernels' limit)", cfg.page_size));
  const double bytes =
      2.0 * cfg.n_layer * cfg.n_pages * cfg.n_head_kv * double(block_elems()) * double(kv_dtype_bytes(cfg.dtype));
  if (bytes > 0.5 * double(std::numeric_limits<size_t>::max()))
    throw std::invalid_argument("KV cache config: pool size overflows");
  const size_t n = static_cast<size_t>(bytes / 2);
  try {
    k_ = ZeroedArray<uint8_t>(n);
    v_ = ZeroedArray<uint8_t>(n);
  } catch (const std::bad_alloc&) {
    // The pool is committed only as pages fill, but the system can still refuse the address space.
    throw std::runtime_error(
        fmt::format("KV cache: the system refuses to reserve {:.1f} GiB of address space for {} pages of K and V "
                    "({} tokens of context, committed only as pages fill); use less context",
                    bytes / double(1 << 30), cfg.n_pages, int64_t(cfg.n_pages) * cfg.page_size));
  }
  free_.resize(cfg.n_pages);
  for (int i = 0; i < cfg.n_pages; ++i) free_[i] = cfg.n_pages - 1 - i;
  in_use_.assign(size_t(cfg.n_pages), 0);
}

int32_t PagedKvCache::append_tokens(KvSequence& seq, int32_t n) {
  if (n < 0) throw std::invalid_argument("append_tokens: negative token count");
  check_sequence("append_tokens", seq, /*ids=*/false);
  const int64_t B = cfg_.page_size;
  const int64_t new_len = int64_t(seq.n_tokens) + n;
  if (new_len > std::numeric_limits<int32_t>::max())
    throw std::invalid_argument(
        fmt::format("append_tokens: {} more tokens would take the sequence's {} tokens past "
                    "the 2^31 - 1 a sequence can count",
                    n, seq.n_tokens));
  const int64_t need_pages = (new_len + B - 1) / B;
  const int64_t extra = need_pages - seq.n_pages();
  if (extra > static_cast<int64_t>(free_.size()))
    throw std::runtime_error(
        fmt::format("KV page pool exhausted: {} more tokens need {} new pages but only {} of {} pages are free "
                    "(pool holds {} tokens)",
                    n, extra, free_.size(), cfg_.n_pages, int64_t(cfg_.n_pages) * B));
  // Pages are committed as they are written: refuse what this machine cannot hold now, rather than
  // be killed by the kernel's OOM killer halfway through a prefill. The new pages count with a
  // quarter on top for the selectors' per-page data (LOCKS summaries: ~10% of K+V). Read when
  // pages are added (every B decode steps), so the figure is current.
  if (extra > 0) {
    const size_t need = size_t(extra) * page_bytes() * 5 / 4;
    if (const size_t avail = available_memory(); avail > 0 && need > avail)
      throw std::runtime_error(fmt::format(
          "KV cache: {} more tokens need {:.1f} GiB of K/V and selector data, but only {:.1f} GiB of memory is "
          "available (in use: {:.1f} GiB of K/V)",
          n, double(need) / (1 << 30), double(avail) / (1 << 30), double(bytes_in_use()) / (1 << 30)));
  }
  for (int64_t i = 0; i < extra; ++i) {
    seq.page_table.push_back(free_.back());
    in_use_[size_t(free_.back())] = 1;
    free_.pop_back();
  }
  const int32_t pos = seq.n_tokens;
  seq.n_tokens = static_cast<int32_t>(new_len);
  return pos;
}

void PagedKvCache::release(KvSequence& seq) {
  check_sequence("release", seq, /*ids=*/true);
  std::vector<uint8_t> seen(size_t(cfg_.n_pages), 0);  // a page listed twice would be freed twice
  for (int32_t id : seq.page_table)
    if (seen[size_t(id)]++)
      throw std::out_of_range(fmt::format("release: page id {} appears twice in the page table", id));
  for (auto it = seq.page_table.rbegin(); it != seq.page_table.rend(); ++it) {
    in_use_[size_t(*it)] = 0;
    free_.push_back(*it);
  }
  seq.page_table.clear();
  seq.n_tokens = 0;
}

void PagedKvCache::check_sequence(const char* what, const KvSequence& seq, bool ids) const {
  const int64_t B = cfg_.page_size, n = seq.n_pages();
  if (seq.n_tokens < 0 || (n == 0 ? seq.n_tokens != 0 : seq.n_tokens <= (n - 1) * B || seq.n_tokens > n * B))
    throw std::invalid_argument(
        fmt::format("{}: a sequence of {} tokens cannot have {} pages of {} tokens", what, seq.n_tokens, n, B));
  if (!ids) return;
  for (int32_t id : seq.page_table) check_page_in_use(what, id);
}

void PagedKvCache::check_page_in_use(const char* what, int32_t page) const {
  check_page_id(what, page);
  if (!in_use_[size_t(page)])
    throw std::out_of_range(fmt::format("{}: page id {} is not in use (released, or not from this pool)", what, page));
}

void PagedKvCache::page_error(int il, int32_t page, int kv_head) const {
  throw std::out_of_range(
      fmt::format("KV cache: (layer {}, page id {}, KV head {}) outside [0, {}) x [0, {}) x [0, {})", il, page, kv_head,
                  cfg_.n_layer, cfg_.n_pages, cfg_.n_head_kv));
}

void PagedKvCache::check_layer_head(const char* what, int il, int kv_head) const {
  if (il < 0 || il >= cfg_.n_layer)
    throw std::out_of_range(fmt::format("{}: layer {} outside [0, {})", what, il, cfg_.n_layer));
  if (kv_head < 0 || kv_head >= cfg_.n_head_kv)
    throw std::out_of_range(fmt::format("{}: KV head {} outside [0, {})", what, kv_head, cfg_.n_head_kv));
}

void PagedKvCache::check_page_id(const char* what, int32_t page) const {
  if (page < 0 || page >= cfg_.n_pages)
    throw std::out_of_range(fmt::format("{}: page id {} outside the pool [0, {})", what, page, cfg_.n_pages));
}

void PagedKvCache::check_page_position(const char* what, const KvSequence& seq, int32_t j) const {
  if (j < 0 || j >= seq.n_pages())
    throw std::out_of_range(
        fmt::format("{}: page position {} outside the sequence's {} pages", what, j, seq.n_pages()));
  check_page_id(what, seq.page_table[j]);
}

void PagedKvCache::write(int il, const KvSequence& seq, int32_t pos, const float* k, const float* v) {
  check_layer_head("KV write", il);
  check_sequence("KV write", seq, /*ids=*/false);
  if (pos < 0 || pos >= seq.n_tokens)
    throw std::out_of_range(fmt::format("KV write: position {} outside sequence of {} tokens", pos, seq.n_tokens));
  check_page_position("KV write", seq, pos / cfg_.page_size);
  if (!k || !v)
    throw std::invalid_argument(fmt::format("KV write: null {} at layer {}, position {}", k ? "v" : "k", il, pos));
  const int d = cfg_.head_dim;
  for (int i = 0; i < cfg_.n_head_kv * d; ++i)
    if (!std::isfinite(k[i]) || !std::isfinite(v[i]))
      throw std::invalid_argument(fmt::format("KV write: non-finite {} at layer {}, position {}, KV head {}, dim {}",
                                              std::isfinite(k[i]) ? "value" : "key", il, pos, i / d, i % d));
  // A finite value beyond the f16 range would be stored as +-inf: the same poison as a NaN input.
  if (cfg_.dtype == KvDtype::F16) {
    constexpr float kF16Max = 65504.0f;
    for (int i = 0; i < cfg_.n_head_kv * d; ++i)
      if (std::abs(k[i]) > kF16Max || std::abs(v[i]) > kF16Max)
        throw std::invalid_argument(fmt::format(
            "KV write: {} {} at layer {}, position {}, KV head {}, dim {} overflows the f16 KV cache (max 65504); "
            "use an f32 KV cache",
            std::abs(k[i]) > kF16Max ? "key" : "value", std::abs(k[i]) > kF16Max ? k[i] : v[i], il, pos, i / d, i % d));
  }
  const int32_t page = seq.page_table[pos / cfg_.page_size];
  const int slot = pos % cfg_.page_size;
  const size_t eb = kv_dtype_bytes(cfg_.dtype);
  for (int h = 0; h < cfg_.n_head_kv; ++h) {
    uint8_t* kd = k_.data() + offset(il, page, h) + size_t(slot) * d * eb;
    uint8_t* vd = v_.data() + offset(il, page, h) + size_t(slot) * d * eb;
    if (cfg_.dtype == KvDtype::F16) {
      f32_to_f16_row(k + h * d, reinterpret_cast<f16_t*>(kd), d);
      f32_to_f16_row(v + h * d, reinterpret_cast<f16_t*>(vd), d);
    } else {
      std::memcpy(kd, k + h * d, d * 4);
      std::memcpy(vd, v + h * d, d * 4);
    }
  }
}

void PagedKvCache::to_f32(const ZeroedArray<uint8_t>& buf, int il, int32_t page, int kv_head, float* out) const {
  const void* p = ptr(buf, il, page, kv_head);
  if (cfg_.dtype == KvDtype::F16)
    f16_to_f32_row(static_cast<const f16_t*>(p), out, block_elems());
  else
    std::memcpy(out, p, block_elems() * 4);
}

void PagedKvCache::k_page_f32(int il, int32_t page, int kv_head, float* out) const {
  to_f32(k_, il, page, kv_head, out);
}
void PagedKvCache::v_page_f32(int il, int32_t page, int kv_head, float* out) const {
  to_f32(v_, il, page, kv_head, out);
}

}  // namespace locks
