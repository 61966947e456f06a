// Paged KV cache: page allocation, pool exhaustion, release, layout and f16/f32 storage.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "locks/kv_cache.h"
#include "test_util.h"

using namespace locks;

namespace {

using test::randn;

KvCacheConfig small_cfg(int n_pages, KvDtype dt = KvDtype::F16, int n_layer = 2, int n_head_kv = 3, int d = 64) {
  KvCacheConfig c;
  c.n_layer = n_layer;
  c.n_head_kv = n_head_kv;
  c.head_dim = d;
  c.page_size = 16;
  c.n_pages = n_pages;
  c.dtype = dt;
  return c;
}

}  // namespace

TEST(KvCache, AppendAllocatesPagesAsNeeded) {
  PagedKvCache cache(small_cfg(10));
  KvSequence s;
  EXPECT_EQ(cache.append_tokens(s, 1), 0);
  EXPECT_EQ(s.n_tokens, 1);
  EXPECT_EQ(s.n_pages(), 1);
  EXPECT_EQ(cache.append_tokens(s, 15), 1);
  EXPECT_EQ(s.n_pages(), 1);  // exactly one full page
  EXPECT_EQ(cache.append_tokens(s, 1), 16);
  EXPECT_EQ(s.n_pages(), 2);
  EXPECT_EQ(cache.append_tokens(s, 0), 17);
  EXPECT_EQ(s.n_pages(), 2);
  EXPECT_EQ(cache.append_tokens(s, 40), 17);
  EXPECT_EQ(s.n_tokens, 57);
  EXPECT_EQ(s.n_pages(), (57 + 15) / 16);
  EXPECT_EQ(cache.n_free_pages(), 10 - s.n_pages());
  const std::set<int32_t> ids(s.page_table.begin(), s.page_table.end());
  EXPECT_EQ(ids.size(), s.page_table.size()) << "a page id was handed out twice";
  for (int32_t p : s.page_table) EXPECT_TRUE(p >= 0 && p < 10);
  EXPECT_THROW(cache.append_tokens(s, -1), std::invalid_argument);
}

TEST(KvCache, PoolExhaustionThrowsAndLeavesSequenceUnchanged) {
  PagedKvCache cache(small_cfg(4));
  KvSequence a, b;
  cache.append_tokens(a, 40);  // 3 pages
  cache.append_tokens(b, 3);   // 1 page: pool full
  EXPECT_EQ(cache.n_free_pages(), 0);
  const KvSequence a_before = a, b_before = b;
  try {
    cache.append_tokens(a, 9);  // 49 tokens need a 4th page
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("exhausted"), std::string::npos) << msg;
    EXPECT_NE(msg.find('4'), std::string::npos) << "message should name the pool size: " << msg;
  }
  EXPECT_EQ(a.page_table, a_before.page_table);
  EXPECT_EQ(a.n_tokens, a_before.n_tokens);
  EXPECT_EQ(cache.n_free_pages(), 0);
  // Filling the partial pages still works.
  EXPECT_EQ(cache.append_tokens(a, 8), 40);
  EXPECT_EQ(cache.append_tokens(b, 13), 3);
  EXPECT_THROW(cache.append_tokens(b, 1), std::runtime_error);
  EXPECT_EQ(b.n_tokens, 16);
  EXPECT_EQ(b.page_table, b_before.page_table);
  // A large request on an empty pool fails atomically too.
  PagedKvCache c2(small_cfg(3));
  KvSequence s;
  EXPECT_THROW(c2.append_tokens(s, 49), std::runtime_error);
  EXPECT_EQ(s.n_tokens, 0);
  EXPECT_TRUE(s.page_table.empty());
  EXPECT_EQ(c2.n_free_pages(), 3);
  EXPECT_EQ(c2.append_tokens(s, 48), 0);
}

TEST(KvCache, ReleaseReturnsPagesForReuse) {
  PagedKvCache cache(small_cfg(6));
  KvSequence a, b;
  cache.append_tokens(a, 50);  // 4 pages
  cache.append_tokens(b, 20);  // 2 pages
  EXPECT_EQ(cache.n_free_pages(), 0);
  const auto a_pages = a.page_table;
  cache.release(a);
  EXPECT_EQ(a.n_tokens, 0);
  EXPECT_TRUE(a.page_table.empty());
  EXPECT_EQ(cache.n_free_pages(), 4);
  KvSequence c;
  cache.append_tokens(c, 64);
  std::set<int32_t> got(c.page_table.begin(), c.page_table.end()), want(a_pages.begin(), a_pages.end());
  EXPECT_EQ(got, want) << "the released pages are the free ones";
  for (int32_t p : c.page_table)
    EXPECT_EQ(std::count(b.page_table.begin(), b.page_table.end(), p), 0) << "page shared with a live sequence";
  cache.release(b);
  cache.release(c);
  EXPECT_EQ(cache.n_free_pages(), 6);
  KvSequence d;
  cache.release(d);  // empty release is a no-op
  EXPECT_EQ(cache.n_free_pages(), 6);
}

TEST(KvCache, WriteReadRoundTripAndLayout) {
  std::mt19937 rng(301);
  for (KvDtype dt : {KvDtype::F32, KvDtype::F16}) {
    const auto cfg = small_cfg(12, dt);
    PagedKvCache cache(cfg);
    const int H = cfg.n_head_kv, d = cfg.head_dim, B = cfg.page_size;
    KvSequence a, b;
    // Interleaved growth: a's pages are not contiguous ids.
    for (int i = 0; i < 3; ++i) {
      cache.append_tokens(a, 16);
      cache.append_tokens(b, 10);
    }
    std::vector<std::vector<float>> Ka(cfg.n_layer), Va(cfg.n_layer);
    for (int il = 0; il < cfg.n_layer; ++il)
      for (int t = 0; t < a.n_tokens; ++t) {
        const auto k = randn(rng, size_t(H) * d, 3.0), v = randn(rng, size_t(H) * d, 3.0);
        cache.write(il, a, t, k.data(), v.data());
        Ka[il].insert(Ka[il].end(), k.begin(), k.end());
        Va[il].insert(Va[il].end(), v.begin(), v.end());
      }
    // Writes into b must not touch a.
    for (int il = 0; il < cfg.n_layer; ++il)
      for (int t = 0; t < b.n_tokens; ++t) {
        const auto junk = randn(rng, size_t(H) * d, 100.0);
        cache.write(il, b, t, junk.data(), junk.data());
      }
    std::vector<float> kp(size_t(B) * d), vp(size_t(B) * d);
    for (int il = 0; il < cfg.n_layer; ++il)
      for (int t = 0; t < a.n_tokens; ++t)
        for (int h = 0; h < H; ++h) {
          const int32_t page = a.page_table[t / B];
          cache.k_page_f32(il, page, h, kp.data());
          cache.v_page_f32(il, page, h, vp.data());
          for (int c = 0; c < d; ++c) {
            const float k = Ka[il][(size_t(t) * H + h) * d + c], v = Va[il][(size_t(t) * H + h) * d + c];
            // f16: round to nearest even, as the compiler's _Float16 conversion does.
            const float kw = dt == KvDtype::F16 ? float(static_cast<_Float16>(k)) : k;
            const float vw = dt == KvDtype::F16 ? float(static_cast<_Float16>(v)) : v;
            ASSERT_EQ(kp[size_t(t % B) * d + c], kw) << kv_dtype_name(dt) << " il=" << il << " t=" << t << " h=" << h;
            ASSERT_EQ(vp[size_t(t % B) * d + c], vw);
            if (dt == KvDtype::F16) {
              ASSERT_LE(std::abs(kw - k), std::ldexp(std::abs(k), -11) + 6e-8);
            }
          }
          // Raw block: [B][d] of the cache dtype, the same values.
          const void* raw = cache.k_page(il, page, h);
          float x;
          if (dt == KvDtype::F32) {
            std::memcpy(&x, static_cast<const float*>(raw) + size_t(t % B) * d, 4);
          } else {
            _Float16 hv;
            std::memcpy(&hv, static_cast<const uint16_t*>(raw) + size_t(t % B) * d, 2);
            x = float(hv);
          }
          ASSERT_EQ(x, kp[size_t(t % B) * d]);
        }
    EXPECT_EQ(cache.kv_bytes(10), size_t(2 * 10 * d) * kv_dtype_bytes(dt));
  }
}

TEST(KvCache, WriteRejectsNonFiniteAndLeavesCacheUnchanged) {
  std::mt19937 rng(302);
  const auto cfg = small_cfg(4, KvDtype::F32, 1, 2, 64);
  PagedKvCache cache(cfg);
  KvSequence s;
  cache.append_tokens(s, 20);
  const int H = cfg.n_head_kv, d = cfg.head_dim;
  const auto k0 = randn(rng, size_t(H) * d), v0 = randn(rng, size_t(H) * d);
  cache.write(0, s, 17, k0.data(), v0.data());
  const float bads[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()};
  for (float bad : bads) {
    for (int which = 0; which < 2; ++which) {
      for (int where : {0, d + 5, H * d - 1}) {
        auto k = randn(rng, size_t(H) * d), v = randn(rng, size_t(H) * d);
        (which == 0 ? k : v)[where] = bad;
        try {
          cache.write(0, s, 17, k.data(), v.data());
          FAIL() << "non-finite accepted";
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find(which == 0 ? "key" : "value"), std::string::npos) << e.what();
        }
      }
    }
  }
  std::vector<float> kp(size_t(16) * d), vp(size_t(16) * d);
  for (int h = 0; h < H; ++h) {
    cache.k_page_f32(0, s.page_table[1], h, kp.data());
    cache.v_page_f32(0, s.page_table[1], h, vp.data());
    for (int c = 0; c < d; ++c) {
      EXPECT_EQ(kp[size_t(1) * d + c], k0[size_t(h) * d + c]) << "rejected write modified the cache";
      EXPECT_EQ(vp[size_t(1) * d + c], v0[size_t(h) * d + c]);
    }
  }
  EXPECT_THROW(cache.write(0, s, 20, k0.data(), v0.data()), std::out_of_range);
  EXPECT_THROW(cache.write(0, s, -1, k0.data(), v0.data()), std::out_of_range);
  EXPECT_THROW(cache.write(0, s, 17, nullptr, v0.data()), std::invalid_argument);
  EXPECT_THROW(cache.write(0, s, 17, k0.data(), nullptr), std::invalid_argument);
}

TEST(KvCache, F16WriteNeverStoresInfinity) {
  // A finite value beyond the f16 range must not become +-inf in the cache (an infinite key poisons
  // every score and attention row that reads it): it is either rejected or stored finite.
  const auto cfg = small_cfg(2, KvDtype::F16, 1, 1, 64);
  PagedKvCache cache(cfg);
  KvSequence s;
  cache.append_tokens(s, 1);
  std::vector<float> k(64, 1.0f), v(64, 1.0f);
  k[3] = 7.0e4f;
  v[9] = -1.0e6f;
  bool thrown = false;
  try {
    cache.write(0, s, 0, k.data(), v.data());
  } catch (const std::invalid_argument&) {
    thrown = true;
  }
  std::vector<float> kp(16 * 64), vp(16 * 64);
  cache.k_page_f32(0, s.page_table[0], 0, kp.data());
  cache.v_page_f32(0, s.page_table[0], 0, vp.data());
  for (int c = 0; c < 64; ++c) {
    EXPECT_TRUE(std::isfinite(kp[c])) << "key dim " << c << " stored as " << kp[c] << (thrown ? " (after throw)" : "");
    EXPECT_TRUE(std::isfinite(vp[c])) << "value dim " << c << " stored as " << vp[c];
  }
}

TEST(KvCache, ConfigValidationAndDtypeNames) {
  EXPECT_THROW(PagedKvCache(small_cfg(0)), std::invalid_argument);
  EXPECT_THROW(PagedKvCache(small_cfg(4, KvDtype::F16, 0)), std::invalid_argument);
  EXPECT_THROW(PagedKvCache(small_cfg(4, KvDtype::F16, 1, -1)), std::invalid_argument);
  EXPECT_THROW(PagedKvCache(small_cfg(4, KvDtype::F16, 1, 1, 0)), std::invalid_argument);
  EXPECT_EQ(parse_kv_dtype("f16"), KvDtype::F16);
  EXPECT_EQ(parse_kv_dtype("f32"), KvDtype::F32);
  EXPECT_EQ(parse_kv_dtype(kv_dtype_name(KvDtype::F16)), KvDtype::F16);
  EXPECT_THROW(parse_kv_dtype("bf16"), std::invalid_argument);
  EXPECT_EQ(kv_dtype_bytes(KvDtype::F16), 2u);
  EXPECT_EQ(kv_dtype_bytes(KvDtype::F32), 4u);
}

// A copy (Session::fork) holds the same K/V in every page and the same free list.
TEST(KvCache, CopyKeepsPagesAndFreeList) {
  PagedKvCache cache(small_cfg(12, KvDtype::F32));
  KvSequence a, b;
  cache.append_tokens(a, 40);
  cache.append_tokens(b, 20);
  const int d = 64, H = 3;
  std::mt19937 rng(3);
  for (KvSequence* s : {&a, &b})
    for (int il = 0; il < 2; ++il)
      for (int t = 0; t < s->n_tokens; ++t) {
        const auto k = randn(rng, size_t(H) * d), v = randn(rng, size_t(H) * d);
        cache.write(il, *s, t, k.data(), v.data());
      }
  cache.release(b);
  const PagedKvCache copy(cache);
  EXPECT_EQ(copy.n_free_pages(), cache.n_free_pages());
  std::vector<float> x(size_t(16) * d), y(x.size());
  for (int il = 0; il < 2; ++il)
    for (int32_t p = 0; p < 12; ++p)
      for (int h = 0; h < H; ++h) {
        copy.k_page_f32(il, p, h, x.data());
        cache.k_page_f32(il, p, h, y.data());
        EXPECT_EQ(x, y) << "layer " << il << " page " << p << " head " << h;
        copy.v_page_f32(il, p, h, x.data());
        cache.v_page_f32(il, p, h, y.data());
        EXPECT_EQ(x, y);
      }
  // The copy hands out the same pages next, as the original would.
  PagedKvCache c2(copy);
  KvSequence s1, s2;
  cache.append_tokens(s1, 33);
  c2.append_tokens(s2, 33);
  EXPECT_EQ(s1.page_table, s2.page_table);
}

namespace {
// Resident set size of this process in bytes (Linux /proc), or -1.
long long rss_bytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return -1;
  long long pages = 0, resident = 0;
  const int got = std::fscanf(f, "%lld %lld", &pages, &resident);
  std::fclose(f);
  return got == 2 ? resident * sysconf(_SC_PAGE_SIZE) : -1;
}
}  // namespace

// Memory is committed as pages are written: a pool for 2^18 tokens (8 GiB of f16 K+V at 8 layers x
// 8 KV heads x d 128) and a copy of it leave the resident set nearly unchanged until used;
// bytes_in_use counts the pages handed out.
TEST(KvCache, LargePoolIsCheapUntilUsed) {
  const long long before = rss_bytes();
  PagedKvCache cache(small_cfg(1 << 14, KvDtype::F16, 8, 8, 128));
  const PagedKvCache copy(cache);  // a fork copies what was written: nothing yet
  const long long after = rss_bytes();
  if (before >= 0 && after >= 0) {
    EXPECT_LT(after - before, 64ll << 20) << "the pool (or its copy) was committed up front";
  }
  EXPECT_EQ(cache.bytes_in_use(), 0u);
  KvSequence s;
  cache.append_tokens(s, 17);
  EXPECT_EQ(cache.bytes_in_use(), size_t(2) * 2 * 8 * 8 * 16 * 128 * 2);  // 2 pages, K+V, 8 layers, 8 heads
}

// A pool whose address space the system refuses gets an error naming its size, not std::bad_alloc.
// 2^31 - 1 pages of 8 layers x 8 heads x 16 x 128 f16, K and V: 1 PiB. Linux's default heuristic
// overcommit (vm.overcommit_memory = 0) refuses a single mapping beyond RAM + swap (and ASan, in the
// sanitizer build, refuses it by its own limit: cmake/asan_options.cpp lets it return null).
TEST(KvCache, UnreservablePoolNamesItsSize) {
  int mode = -1;
  if (std::FILE* f = std::fopen("/proc/sys/vm/overcommit_memory", "r")) {
    if (std::fscanf(f, "%d", &mode) != 1) mode = -1;
    std::fclose(f);
  }
  if (mode != 0 && mode != 2) GTEST_SKIP() << "vm.overcommit_memory is " << mode << ": the mapping may be granted";
  try {
    PagedKvCache cache(small_cfg(std::numeric_limits<int>::max(), KvDtype::F16, 8, 8, 128));
    FAIL() << "a 1 PiB pool was reserved";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("address space"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1048576.0 GiB"), std::string::npos) << msg;  // 2 * (2^31 - 1) * 8 * 8 * 16 * 128 * 2 bytes
  }
}

// Indices outside the cache are refused with the index and its range, before anything is written.
TEST(KvCache, IndicesOutsideTheCacheThrowNamingThem) {
  PagedKvCache cache(small_cfg(4, KvDtype::F16, 1, 2, 8));
  KvSequence s;
  cache.append_tokens(s, 20);  // 2 pages
  std::vector<float> k(16, 1.0f), v(16, 1.0f);
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { cache.write(5, s, 0, k.data(), v.data()); }),
            "KV write: layer 5 outside [0, 1)");
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { cache.write(-1, s, 0, k.data(), v.data()); }),
            "KV write: layer -1 outside [0, 1)");
  KvSequence bad = s;
  bad.page_table[1] = 4;  // not a page of the 4-page pool
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { cache.write(0, bad, 17, k.data(), v.data()); }),
            "KV write: page id 4 outside the pool [0, 4)");
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { cache.check_layer_head("x", 0, 2); }),
            "x: KV head 2 outside [0, 2)");
  std::vector<float> buf(16 * 8);
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { cache.k_page_f32(0, 1000000, 0, buf.data()); }),
            "KV cache: (layer 0, page id 1000000, KV head 0) outside [0, 1) x [0, 4) x [0, 2)");
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { cache.v_page(-1, 0, 0); }),
            "KV cache: (layer -1, page id 0, KV head 0) outside [0, 1) x [0, 4) x [0, 2)");
  KvSequence long_seq = s;
  long_seq.n_tokens = 4000;  // 2 pages cannot hold it
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { cache.write(0, long_seq, 0, k.data(), v.data()); }),
            "KV write: a sequence of 4000 tokens cannot have 2 pages of 16 tokens");
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { cache.append_tokens(long_seq, 1); }),
            "append_tokens: a sequence of 4000 tokens cannot have 2 pages of 16 tokens");
}

// A page table that does not hold this pool's pages in use is refused by release, with nothing
// changed: a second release of the same pages used to put them on the free list twice.
TEST(KvCache, ReleaseRefusesPagesNotInUse) {
  PagedKvCache cache(small_cfg(8, KvDtype::F16, 1, 1, 8));
  KvSequence a;
  cache.append_tokens(a, 40);  // 3 pages
  const KvSequence copy = a;
  cache.release(a);
  EXPECT_EQ(cache.n_free_pages(), 8);
  KvSequence again = copy;
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { cache.release(again); }),
            fmt::format("release: page id {} is not in use (released, or not from this pool)", copy.page_table[0]));
  EXPECT_EQ(cache.n_free_pages(), 8);
  EXPECT_EQ(again.n_pages(), 3) << "a refused release leaves the sequence as it was";
  KvSequence b;
  cache.append_tokens(b, 40);
  KvSequence twice = b;
  twice.page_table[2] = twice.page_table[0];
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { cache.release(twice); }),
            fmt::format("release: page id {} appears twice in the page table", b.page_table[0]));
  KvSequence foreign = b;
  foreign.page_table[1] = 999;
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { cache.release(foreign); }),
            "release: page id 999 outside the pool [0, 8)");
  cache.release(b);
  EXPECT_EQ(cache.n_free_pages(), 8);
}
