// A fixed-size array of zero-initialised trivially copyable T whose memory the OS commits page by
// page on first write (calloc of a large block maps fresh zero pages). Per-page storage sized for a
// long context (the KV pool, selector metadata) then costs memory only for the pages in use.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>

namespace locks {

template <class T>
class ZeroedArray {
  static_assert(std::is_trivially_copyable_v<T>, "ZeroedArray holds plain data");

 public:
  ZeroedArray() = default;
  /// n zero elements. Throws std::bad_alloc when the system refuses even the address space.
  explicit ZeroedArray(size_t n) : n_(n) {
    if (n > std::numeric_limits<size_t>::max() / sizeof(T)) throw std::bad_alloc();
    p_.reset(static_cast<T*>(std::calloc(n > 0 ? n : 1, sizeof(T))));
    if (!p_) throw std::bad_alloc();
  }
  /// Copies the source's non-zero 4 KiB blocks only, so a copy commits no more memory than the
  /// source has written (the destination is already zero).
  ZeroedArray(const ZeroedArray& o) : ZeroedArray(o.n_) {
    const auto* src = reinterpret_cast<const unsigned char*>(o.p_.get());
    auto* dst = reinterpret_cast<unsigned char*>(p_.get());
    constexpr size_t kBlock = 4096;
    static const unsigned char zeros[kBlock] = {};
    for (size_t off = 0, total = n_ * sizeof(T); off < total; off += kBlock) {
      const size_t len = total - off < kBlock ? total - off : kBlock;
      if (std::memcmp(src + off, zeros, len) != 0) std::memcpy(dst + off, src + off, len);
    }
  }
  ZeroedArray& operator=(const ZeroedArray& o) {
    if (this != &o) *this = ZeroedArray(o);
    return *this;
  }
  ZeroedArray(ZeroedArray&&) noexcept = default;
  ZeroedArray& operator=(ZeroedArray&&) noexcept = default;

  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return p_.get()[i]; }
  const T& operator[](size_t i) const { return p_.get()[i]; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> p_;
  size_t n_ = 0;
};

}  // namespace locks
