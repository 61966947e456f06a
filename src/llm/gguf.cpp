// GGUF reader. Every read goes through a bounds-checked cursor, and every count or size taken from
// the file is checked against the bytes that remain before anything is allocated, so hostile input
// ends in std::runtime_error rather than a crash or a huge allocation.
#include "locks/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <unordered_set>
#include <utility>

#include "gguf_dequant.h"
#include "locks/quant.h"

namespace locks {

namespace {

using VType = GgufValue::Type;
using gguf_detail::tensor_block;

// Nested arrays are legal but nobody needs deep ones; the cap bounds recursion on hostile input.
constexpr int kMaxArrayDepth = 8;
constexpr uint32_t kMaxDims = 4;

const char* value_type_name(VType t) {
  switch (t) {
    case VType::U8:
      return "U8";
    case VType::I8:
      return "I8";
    case VType::U16:
      return "U16";
    case VType::I16:
      return "I16";
    case VType::U32:
      return "U32";
    case VType::I32:
      return "I32";
    case VType::F32:
      return "F32";
    case VType::BOOL:
      return "BOOL";
    case VType::STRING:
      return "STRING";
    case VType::ARRAY:
      return "ARRAY";
    case VType::U64:
      return "U64";
    case VType::I64:
      return "I64";
    case VType::F64:
      return "F64";
  }
  return "?";
}

bool valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(VType::F64); }

bool is_integer(VType t) {
  switch (t) {
    case VType::U8:
    case VType::I8:
    case VType::U16:
    case VType::I16:
    case VType::U32:
    case VType::I32:
    case VType::U64:
    case VType::I64:
      return true;
    default:
      return false;
  }
}

// Smallest encoding of one value of type t: what an array count is checked against.
uint64_t min_value_size(VType t) {
  switch (t) {
    case VType::U8:
    case VType::I8:
    case VType::BOOL:
      return 1;
    case VType::U16:
    case VType::I16:
      return 2;
    case VType::U32:
    case VType::I32:
    case VType::F32:
      return 4;
    case VType::U64:
    case VType::I64:
    case VType::F64:
      return 8;
    case VType::STRING:
      return 8;  // length prefix
    case VType::ARRAY:
      return 12;  // element type + count
  }
  return 1;
}

std::string type_desc(const GgufValue& v) {
  if (v.type != VType::ARRAY) return value_type_name(v.type);
  return std::string("ARRAY of ") + value_type_name(v.array_type);
}

uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t load_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}
uint64_t load_u64(const uint8_t* p) {
  return static_cast<uint64_t>(load_u32(p)) | (static_cast<uint64_t>(load_u32(p + 4)) << 32);
}

// Bounds-checked little-endian cursor over the file image. `ctx` names what is being parsed so
// that truncation errors say where they happened.
class Reader {
 public:
  Reader(std::span<const uint8_t> bytes, const std::string& file) : b_(bytes), file_(file) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("GGUF '" + file_ + "': " + (ctx_.empty() ? "" : ctx_ + ": ") + what);
  }
  void set_context(std::string ctx) { ctx_ = std::move(ctx); }

  size_t pos() const { return pos_; }
  uint64_t remaining() const { return b_.size() - pos_; }

  const uint8_t* take(uint64_t n, const char* what) {
    if (n > remaining()) {
      fail(std::string("truncated reading ") + what + " at offset " + std::to_string(pos_) + " (need " +
           std::to_string(n) + " bytes, " + std::to_string(remaining()) + " left)");
    }
    const uint8_t* p = b_.data() + pos_;
    pos_ += static_cast<size_t>(n);
    return p;
  }
  uint8_t u8(const char* what) { return *take(1, what); }
  uint16_t u16(const char* what) { return load_u16(take(2, what)); }
  uint32_t u32(const char* what) { return load_u32(take(4, what)); }
  uint64_t u64(const char* what) { return load_u64(take(8, what)); }

  std::string str(const char* what) {
    const uint64_t n = u64(what);
    if (n > remaining()) {
      fail(std::string(what) + " length " + std::to_string(n) + " exceeds the " + std::to_string(remaining()) +
           " bytes left in the file (at offset " + std::to_string(pos_) + ")");
    }
    const uint8_t* p = take(n, what);
    return std::string(reinterpret_cast<const char*>(p), static_cast<size_t>(n));
  }

  GgufValue value(VType t, int depth) {
    GgufValue v;
    v.type = t;
    switch (t) {
      case VType::U8:
        v.value = uint64_t{u8("value")};
        break;
      case VType::I8:
        v.value = int64_t{static_cast<int8_t>(u8("value"))};
        break;
      case VType::U16:
        v.value = uint64_t{u16("value")};
        break;
      case VType::I16:
        v.value = int64_t{static_cast<int16_t>(u16("value"))};
        break;
      case VType::U32:
        v.value = uint64_t{u32("value")};
        break;
      case VType::I32:
        v.value = int64_t{static_cast<int32_t>(u32("value"))};
        break;
      case VType::U64:
        v.value = u64("value");
        break;
      case VType::I64:
        v.value = static_cast<int64_t>(u64("value"));
        break;
      case VType::F32:
        v.value = double{std::bit_cast<float>(u32("value"))};
        break;
      case VType::F64:
        v.value = std::bit_cast<double>(u64("value"));
        break;
      case VType::BOOL:
        v.value = uint64_t{u8("value") != 0};
        break;
      case VType::STRING:
        v.value = str("string value");
        break;
      case VType::ARRAY: {
        const uint32_t et = u32("array element type");
        if (!valid_value_type(et)) fail("unknown array element type " + std::to_string(et));
        v.array_type = static_cast<VType>(et);
        if (v.array_type == VType::ARRAY && depth + 1 >= kMaxArrayDepth) {
          fail("arrays nested deeper than " + std::to_string(kMaxArrayDepth) + " levels");
        }
        const uint64_t n = u64("array count");
        const uint64_t min_size = min_value_size(v.array_type);
        if (n > remaining() / min_size) {
          fail("array count " + std::to_string(n) + " of " + value_type_name(v.array_type) + " exceeds what the " +
               std::to_string(remaining()) + " bytes left can hold");
        }
        std::vector<GgufValue> items;
        items.reserve(static_cast<size_t>(n));
        for (uint64_t i = 0; i < n; ++i) items.push_back(value(v.array_type, depth + 1));
        v.value = std::move(items);
        break;
      }
    }
    return v;
  }

 private:
  std::span<const uint8_t> b_;
  const std::string& file_;
  std::string ctx_;
  size_t pos_ = 0;
};

// Checked a * b; false on uint64 overflow.
bool mul_ok(uint64_t a, uint64_t b, uint64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

std::string dims_str(const std::vector<uint64_t>& ne) {
  std::string s;
  for (size_t i = 0; i < ne.size(); ++i) {
    if (i) s += 'x';
    s += std::to_string(ne[i]);
  }
  return s;
}

// Element count and byte size of a tensor of `type` with dims `ne`; throws (via `fail`) when the
// type is unsupported, a dim is zero, the row is not whole blocks, or anything overflows.
template <class Fail>
void tensor_size(uint32_t type, const std::vector<uint64_t>& ne, uint64_t& n_elements, uint64_t& n_bytes, Fail&& fail) {
  uint64_t be = 0, bb = 0;
  if (!tensor_block(type, be, bb)) {
    fail("unsupported tensor type " + std::to_string(type) + " (" + ggml_type_name(type) +
         "); supported: F32, F16, BF16, Q8_0, Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K");
  }
  if (ne.empty() || ne.size() > kMaxDims) {
    fail("n_dims " + std::to_string(ne.size()) + " out of range 1.." + std::to_string(kMaxDims));
  }
  uint64_t n = 1;
  for (size_t i = 0; i < ne.size(); ++i) {
    if (ne[i] == 0) fail("dimension " + std::to_string(i) + " is zero (dims " + dims_str(ne) + ")");
    // ggml stores dims as int64; larger values are never legitimate.
    if (ne[i] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) || !mul_ok(n, ne[i], n)) {
      fail("element count overflows (dims " + dims_str(ne) + ")");
    }
  }
  if (ne[0] % be != 0) {
    fail("row length " + std::to_string(ne[0]) + " is not a multiple of the " + ggml_type_name(type) + " block size " +
         std::to_string(be));
  }
  if (!mul_ok(n / be, bb, n_bytes)) {
    fail("byte size overflows uint64 (dims " + dims_str(ne) + ", type " + ggml_type_name(type) + ")");
  }
  n_elements = n;
}

}  // namespace

std::string gguf_quoted(std::string_view s) {
  constexpr size_t kMax = 96;
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < kMax; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  if (s.size() > kMax) out += "...(" + std::to_string(s.size()) + " bytes)";
  return out + "'";
}

std::string ggml_type_name(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::F32:
      return "F32";
    case GgmlType::F16:
      return "F16";
    case GgmlType::Q4_0:
      return "Q4_0";
    case GgmlType::Q8_0:
      return "Q8_0";
    case GgmlType::BF16:
      return "BF16";
    case GgmlType::Q2_K:
      return "Q2_K";
    case GgmlType::Q3_K:
      return "Q3_K";
    case GgmlType::Q4_K:
      return "Q4_K";
    case GgmlType::Q5_K:
      return "Q5_K";
    case GgmlType::Q6_K:
      return "Q6_K";
  }
  return "type#" + std::to_string(type);
}

GgufFile GgufFile::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (the regular-file check below refuses it).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw std::runtime_error("GGUF '" + path + "': cannot open file (" + std::strerror(errno) + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {  // a device or pipe has no size (/dev/zero: "0 bytes")
    const bool dir = S_ISDIR(st.st_mode);
    ::close(fd);
    throw std::runtime_error("GGUF '" + path + (dir ? "': is a directory" : "': not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) {  // mmap refuses length 0; the parser names the empty file
    ::close(fd);
    return from_bytes({}, path);
  }
  // Read-only private mapping: the weights are paged in as dequantization reads them, and no copy of
  // the file is made (the mapping stays valid after the descriptor is closed).
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    throw std::runtime_error("GGUF '" + path + "': cannot map the file (" + std::strerror(map_errno) + ")");
  std::shared_ptr<const void> owner(p, [size](const void* q) { ::munmap(const_cast<void*>(q), size); });
  return parse(std::move(owner), {static_cast<const uint8_t*>(p), size}, path);
}

GgufFile GgufFile::from_bytes(std::vector<uint8_t> bytes, std::string name) {
  auto owned = std::make_shared<const std::vector<uint8_t>>(std::move(bytes));
  const std::span<const uint8_t> image(owned->data(), owned->size());
  return parse(std::move(owned), image, std::move(name));
}

GgufFile GgufFile::parse(std::shared_ptr<const void> owner, std::span<const uint8_t> b, std::string name) {
  GgufFile f;
  f.name_ = std::move(name);
  Reader r(b, f.name_);

  // --- header ---
  r.set_context("header");
  if (b.size() < 4) r.fail("file is " + std::to_string(b.size()) + " bytes, too short for the magic");
  const uint8_t* magic = r.take(4, "magic");
  if (std::memcmp(magic, "GGUF", 4) != 0) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "0x%08x", load_u32(magic));
    r.fail(std::string("bad magic ") + hex + ", expected \"GGUF\"");
  }
  const uint32_t version = r.u32("version");
  if (version == 1) {
    r.fail("version 1 is not supported (GGUF v1 used 32-bit counts; re-convert the model to v3)");
  }
  if (version != 2 && version != 3) {
    const bool swapped = version == 0x02000000u || version == 0x03000000u;
    r.fail("unsupported version " + std::to_string(version) +
           (swapped ? " (a big-endian file; only little-endian is supported)" : " (supported: 2, 3)"));
  }
  f.version_ = version;
  const uint64_t n_tensors = r.u64("tensor count");
  const uint64_t n_kv = r.u64("metadata count");
  // Cheapest possible encodings: tensor info = name length + 1 dim + n_dims + type + offset;
  // key/value = key length + type + 1-byte value.
  constexpr uint64_t kMinTensorInfo = 8 + 4 + 8 + 4 + 8, kMinKv = 8 + 4 + 1;
  if (n_tensors > r.remaining() / kMinTensorInfo) {
    r.fail("tensor count " + std::to_string(n_tensors) + " exceeds what the remaining " +
           std::to_string(r.remaining()) + " bytes can hold");
  }
  if (n_kv > r.remaining() / kMinKv || n_kv * kMinKv + n_tensors * kMinTensorInfo > r.remaining()) {
    r.fail("metadata count " + std::to_string(n_kv) + " exceeds what the remaining " + std::to_string(r.remaining()) +
           " bytes can hold");
  }

  // --- metadata ---
  for (uint64_t i = 0; i < n_kv; ++i) {
    r.set_context("metadata #" + std::to_string(i));
    std::string key = r.str("key");
    r.set_context("key " + gguf_quoted(key));
    if (f.kv_.count(key)) r.fail("duplicate key");
    const uint32_t t = r.u32("value type");
    if (!valid_value_type(t)) r.fail("unknown value type " + std::to_string(t));
    GgufValue v = r.value(static_cast<VType>(t), 0);
    f.kv_.emplace(std::move(key), std::move(v));
  }

  r.set_context("");
  if (const GgufValue* a = f.find("general.alignment")) {
    r.set_context("key 'general.alignment'");
    uint64_t al = 0;
    if (!is_integer(a->type)) r.fail("has type " + type_desc(*a) + ", expected an integer");
    if (const auto* s = std::get_if<int64_t>(&a->value)) {
      if (*s <= 0) r.fail("alignment must be a non-zero power of two (got " + std::to_string(*s) + ")");
      al = static_cast<uint64_t>(*s);
    } else {
      al = std::get<uint64_t>(a->value);
    }
    if (!std::has_single_bit(al)) {
      r.fail("alignment must be a non-zero power of two (got " + std::to_string(al) + ")");
    }
    f.alignment_ = al;
  }

  // --- tensor infos ---
  std::unordered_set<std::string> names;
  f.tensors_.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    r.set_context("tensor info #" + std::to_string(i));
    GgufTensorInfo t;
    t.name = r.str("tensor name");
    r.set_context("tensor " + gguf_quoted(t.name));
    if (!names.insert(t.name).second) r.fail("duplicate tensor name");
    const uint32_t n_dims = r.u32("n_dims");
    if (n_dims == 0 || n_dims > kMaxDims) {
      // A metadata count of 0 in a file with metadata reads the first key as a tensor: its value
      // type lands here. Say so rather than leave the count looking right.
      r.fail("n_dims " + std::to_string(n_dims) + " out of range 1.." + std::to_string(kMaxDims) +
             (i == 0 && n_kv == 0 ? " (the first tensor info, read right after the header since the metadata "
                                    "count is 0: is that count right?)"
                                  : ""));
    }
    t.ne.resize(n_dims);
    for (auto& d : t.ne) d = r.u64("dimension");
    t.type = r.u32("tensor type");
    t.offset = r.u64("data offset");
    tensor_size(t.type, t.ne, t.n_elements, t.n_bytes, [&](const std::string& m) { r.fail(m); });
    if (t.offset % f.alignment_ != 0) {
      r.fail("data offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
             std::to_string(f.alignment_));
    }
    f.tensors_.push_back(std::move(t));
  }

  // --- data section: starts at the first aligned offset after the header ---
  const uint64_t header_end = r.pos();
  const uint64_t pad = (f.alignment_ - header_end % f.alignment_) % f.alignment_;
  const bool data_in_file = pad <= b.size() - header_end;
  const uint64_t data_start = header_end + (data_in_file ? pad : 0);
  const uint64_t data_size = data_in_file ? b.size() - data_start : 0;
  for (auto& t : f.tensors_) {
    if (!data_in_file || t.offset > data_size || t.n_bytes > data_size - t.offset) {
      r.set_context("tensor " + gguf_quoted(t.name));
      const bool abs_ok = data_in_file && t.offset <= std::numeric_limits<uint64_t>::max() - data_start;
      r.fail("data runs past end of file (offset " +
             (abs_ok ? std::to_string(data_start + t.offset)
                     : std::to_string(t.offset) + " in a data section starting past the header") +
             ", size " + std::to_string(t.n_bytes) + ", file " + std::to_string(b.size()) + ")");
    }
    t.data = b.data() + data_start + t.offset;
  }
  // No two tensors share bytes (a changed type or offset would otherwise make one read the other's
  // data as its own; writers lay tensors out back to back, as ggml's reader requires).
  std::vector<const GgufTensorInfo*> by_offset;
  for (const auto& t : f.tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensorInfo* a, const GgufTensorInfo* c) { return a->offset < c->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensorInfo& a = *by_offset[i - 1];
    const GgufTensorInfo& c = *by_offset[i];
    if (a.n_bytes > 0 && c.n_bytes > 0 && a.offset + a.n_bytes > c.offset) {
      r.set_context("tensor " + gguf_quoted(c.name));
      r.fail("data at offset " + std::to_string(c.offset) + " overlaps tensor " + gguf_quoted(a.name) + " (offset " +
             std::to_string(a.offset) + ", " + std::to_string(a.n_bytes) + " bytes)");
    }
  }
  f.owner_ = std::move(owner);
  f.image_ = b;
  return f;
}

bool GgufFile::has_key(std::string_view key) const { return kv_.find(key) != kv_.end(); }

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

namespace {

[[noreturn]] void key_error(const std::string& file, std::string_view key, const std::string& what) {
  throw std::runtime_error("GGUF '" + file + "': key " + gguf_quoted(key) + ": " + what);
}

// Integer value as a signed 128-bit-free pair: fits when it lies in [lo, hi].
bool int_fits(const GgufValue& v, int64_t lo, uint64_t hi) {
  if (const auto* u = std::get_if<uint64_t>(&v.value)) return *u <= hi;
  if (const auto* s = std::get_if<int64_t>(&v.value)) {
    return *s >= lo && (*s < 0 || static_cast<uint64_t>(*s) <= hi);
  }
  return false;
}

int64_t int_value(const GgufValue& v) {
  if (const auto* u = std::get_if<uint64_t>(&v.value)) return static_cast<int64_t>(*u);
  return std::get<int64_t>(v.value);
}

double float_value(const GgufValue& v) {
  if (const auto* d = std::get_if<double>(&v.value)) return *d;
  if (const auto* u = std::get_if<uint64_t>(&v.value)) return static_cast<double>(*u);
  return static_cast<double>(std::get<int64_t>(v.value));
}

bool is_number(VType t) { return is_integer(t) || t == VType::F32 || t == VType::F64; }

}  // namespace

uint32_t GgufFile::get_u32(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) key_error(name_, key, "not found");
  if (!is_integer(v->type)) key_error(name_, key, "has type " + type_desc(*v) + ", expected an integer");
  if (!int_fits(*v, 0, std::numeric_limits<uint32_t>::max())) {
    key_error(name_, key, "value " + std::to_string(int_value(*v)) + " does not fit in u32");
  }
  return static_cast<uint32_t>(int_value(*v));
}

uint32_t GgufFile::get_u32_or(std::string_view key, uint32_t fallback) const {
  return has_key(key) ? get_u32(key) : fallback;
}

float GgufFile::get_f32(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) key_error(name_, key, "not found");
  if (!is_number(v->type)) key_error(name_, key, "has type " + type_desc(*v) + ", expected a number");
  return static_cast<float>(float_value(*v));
}

float GgufFile::get_f32_or(std::string_view key, float fallback) const {
  return has_key(key) ? get_f32(key) : fallback;
}

bool GgufFile::get_bool_or(std::string_view key, bool fallback) const {
  const GgufValue* v = find(key);
  if (!v) return fallback;
  if (v->type != VType::BOOL && !is_integer(v->type)) {
    key_error(name_, key, "has type " + type_desc(*v) + ", expected BOOL");
  }
  return int_value(*v) != 0;
}

std::string GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) key_error(name_, key, "not found");
  if (v->type != VType::STRING) key_error(name_, key, "has type " + type_desc(*v) + ", expected STRING");
  return std::get<std::string>(v->value);
}

std::vector<std::string> GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) key_error(name_, key, "not found");
  if (v->type != VType::ARRAY || v->array_type != VType::STRING) {
    key_error(name_, key, "has type " + type_desc(*v) + ", expected ARRAY of STRING");
  }
  std::vector<std::string> out;
  for (const auto& e : std::get<std::vector<GgufValue>>(v->value)) out.push_back(std::get<std::string>(e.value));
  return out;
}

std::vector<float> GgufFile::get_f32_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) key_error(name_, key, "not found");
  if (v->type != VType::ARRAY || !is_number(v->array_type)) {
    key_error(name_, key, "has type " + type_desc(*v) + ", expected ARRAY of F32");
  }
  std::vector<float> out;
  for (const auto& e : std::get<std::vector<GgufValue>>(v->value)) out.push_back(static_cast<float>(float_value(e)));
  return out;
}

std::vector<int32_t> GgufFile::get_i32_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) key_error(name_, key, "not found");
  if (v->type != VType::ARRAY || !is_integer(v->array_type)) {
    key_error(name_, key, "has type " + type_desc(*v) + ", expected ARRAY of I32");
  }
  const auto& items = std::get<std::vector<GgufValue>>(v->value);
  std::vector<int32_t> out;
  out.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    if (!int_fits(items[i], std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max())) {
      key_error(name_, key, "element " + std::to_string(i) + " does not fit in i32");
    }
    out.push_back(static_cast<int32_t>(int_value(items[i])));
  }
  return out;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  for (const auto& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const GgufTensorInfo& GgufFile::tensor(std::string_view name) const {
  if (const GgufTensorInfo* t = find_tensor(name)) return *t;
  throw std::runtime_error("GGUF '" + name_ + "': tensor " + gguf_quoted(name) + " not found");
}

std::vector<float> GgufFile::dequantize(const GgufTensorInfo& t) const {
  auto fail = [&](const std::string& m) -> void {
    throw std::runtime_error("GGUF '" + name_ + "': tensor " + gguf_quoted(t.name) + ": " + m);
  };
  // Re-derive the size instead of trusting the (public, mutable) info, and insist that the bytes
  // lie inside this file's image.
  uint64_t n_elements = 0, n_bytes = 0;
  tensor_size(t.type, t.ne, n_elements, n_bytes, fail);
  const uint8_t* lo = image_.data();
  const uint64_t size = image_.size();
  const auto p = reinterpret_cast<uintptr_t>(t.data), base = reinterpret_cast<uintptr_t>(lo);
  if (!t.data || !lo || p < base || p - base > size || n_bytes > size - (p - base)) {
    fail("data pointer does not lie inside this file's image");
  }

  uint64_t block_elems = 0, block_bytes = 0;
  tensor_block(t.type, block_elems, block_bytes);
  std::vector<float> out(static_cast<size_t>(n_elements));
  gguf_detail::dequantize_blocks(t.type, t.data, n_elements / block_elems, out.data());
  return out;
}

}  // namespace locks
