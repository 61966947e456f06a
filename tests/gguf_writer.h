// Minimal GGUF writer for building test files byte by byte (little-endian; ggml docs/gguf.md).
#pragma once

#include <bit>
#include <cstdint>
#include <string_view>
#include <vector>

#include "locks/gguf.h"

namespace locks::test {

struct GgufWriter {
  std::vector<uint8_t> b;

  GgufWriter& raw(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    b.insert(b.end(), c, c + n);
    return *this;
  }
  GgufWriter& u8(uint8_t v) { return raw(&v, 1); }
  GgufWriter& u16(uint16_t v) { return u8(v & 0xff).u8(v >> 8); }
  GgufWriter& u32(uint32_t v) { return u16(v & 0xffff).u16(v >> 16); }
  GgufWriter& u64(uint64_t v) { return u32(static_cast<uint32_t>(v)).u32(static_cast<uint32_t>(v >> 32)); }
  GgufWriter& f32(float v) { return u32(std::bit_cast<uint32_t>(v)); }
  GgufWriter& f64(double v) { return u64(std::bit_cast<uint64_t>(v)); }
  GgufWriter& str(std::string_view s) { return u64(s.size()).raw(s.data(), s.size()); }

  GgufWriter& header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    return raw("GGUF", 4).u32(version).u64(n_tensors).u64(n_kv);
  }
  GgufWriter& key(std::string_view k, GgufValue::Type t) { return str(k).u32(static_cast<uint32_t>(t)); }
  GgufWriter& kv_u32(std::string_view k, uint32_t v) { return key(k, GgufValue::Type::U32).u32(v); }
  GgufWriter& kv_f32(std::string_view k, float v) { return key(k, GgufValue::Type::F32).f32(v); }
  GgufWriter& kv_str(std::string_view k, std::string_view v) { return key(k, GgufValue::Type::STRING).str(v); }
  GgufWriter& tensor(std::string_view name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
    str(name).u32(static_cast<uint32_t>(ne.size()));
    for (uint64_t d : ne) u64(d);
    return u32(type).u64(offset);
  }
  GgufWriter& pad_to(size_t alignment) {
    while (b.size() % alignment) u8(0);
    return *this;
  }
};

}  // namespace locks::test
