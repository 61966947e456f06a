// GGUF reader: versions 2 and 3, every metadata value type, tensor types F32/F16/BF16/Q8_0/Q4_0 and the
// K-quants Q2_K..Q6_K.
// Spec: ggml docs/gguf.md. Dimensions are innermost first (ne[0] is the row length).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace locks {

/// ggml tensor type ids as stored in GGUF (ggml.h `enum ggml_type`).
enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q8_0 = 8,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  BF16 = 30
};

/// Name of a ggml type id ("F32", "Q8_0", ...); "type#N" for ids we do not decode.
std::string ggml_type_name(uint32_t type);

/// A string from a GGUF file (key, tensor name, metadata value) for an error message: in single
/// quotes, non-printable bytes and backslashes as \xNN, cut at 96 bytes (hostile files put arbitrary
/// bytes of any length there).
std::string gguf_quoted(std::string_view s);

/// One GGUF metadata value. Arrays hold a homogeneous vector of one scalar type or strings.
struct GgufValue {
  enum class Type : uint32_t {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    BOOL = 7,
    STRING = 8,
    ARRAY = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12
  };
  Type type = Type::U8;
  Type array_type = Type::U8;  // element type when type == ARRAY
  // Scalars widened: integers (and bool) in i64/u64, floats in f64.
  std::variant<uint64_t, int64_t, double, std::string, std::vector<GgufValue>> value;
};

/// One tensor's header plus a pointer to its bytes inside the file image.
struct GgufTensorInfo {
  std::string name;
  std::vector<uint64_t> ne;  // dims, innermost first
  uint32_t type = 0;         // GgmlType id
  uint64_t offset = 0;       // from the start of the data section, bytes
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;
  const uint8_t* data = nullptr;  // points into GgufFile's image
};

/// A parsed GGUF file: open() maps the file read-only (mmap, MAP_PRIVATE; pages are read on first
/// touch and shared with the page cache; the file must not shrink while mapped), from_bytes() owns an
/// in-memory image. Every accessor that can fail throws
/// std::runtime_error with a message naming the file and the key / tensor / offset at fault. Parsing never reads out of
/// bounds, on any input.
class GgufFile {
 public:
  /// Map and parse a file. Throws std::runtime_error ("GGUF 'path': ...") on I/O or format errors:
  /// bad magic, unsupported version, truncation, counts/sizes that overflow, unknown value or tensor
  /// types, misaligned or out-of-range tensor data, duplicate names.
  static GgufFile open(const std::string& path);
  /// Parse an in-memory image (used by the fuzzer and tests); `name` is used in error messages.
  static GgufFile from_bytes(std::vector<uint8_t> bytes, std::string name = "<memory>");

  uint32_t version() const { return version_; }
  const std::string& name() const { return name_; }
  uint64_t alignment() const { return alignment_; }

  bool has_key(std::string_view key) const;
  const GgufValue* find(std::string_view key) const;  // nullptr when absent
  const std::map<std::string, GgufValue, std::less<>>& metadata() const { return kv_; }

  // Typed getters. The no-default forms throw when the key is missing or has the wrong type
  // (any integer type converts to another when the value fits).
  uint32_t get_u32(std::string_view key) const;
  uint32_t get_u32_or(std::string_view key, uint32_t fallback) const;
  float get_f32(std::string_view key) const;
  float get_f32_or(std::string_view key, float fallback) const;
  bool get_bool_or(std::string_view key, bool fallback) const;
  std::string get_string(std::string_view key) const;
  std::vector<std::string> get_string_array(std::string_view key) const;
  std::vector<float> get_f32_array(std::string_view key) const;
  std::vector<int32_t> get_i32_array(std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;  // nullptr when absent
  const GgufTensorInfo& tensor(std::string_view name) const;       // throws when absent

  /// Dequantize a tensor to float32, elements in file order (ne[0] fastest).
  /// Throws for tensor types other than F32, F16, BF16, Q8_0, Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and
  /// when the tensor's bytes do not lie inside this file's image.
  std::vector<float> dequantize(const GgufTensorInfo& t) const;

 private:
  std::string name_;
  static GgufFile parse(std::shared_ptr<const void> owner, std::span<const uint8_t> image, std::string name);
  // The image (a mapping or a vector) is shared so that copies of a GgufFile keep every
  // GgufTensorInfo::data pointer valid; `owner_` releases it with the last copy.
  std::shared_ptr<const void> owner_;
  std::span<const uint8_t> image_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue, std::less<>> kv_;
  std::vector<GgufTensorInfo> tensors_;
};

}  // namespace locks
