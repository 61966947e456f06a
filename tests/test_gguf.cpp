// GGUF reader: the two real models, every value and tensor type on a file written here, and
// hostile files (each must throw a std::runtime_error naming the problem, never crash).
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include "gguf_writer.h"
#include "locks/gguf.h"
#include "locks/model.h"
#include "test_paths.h"

namespace locks {
namespace {

using ::testing::HasSubstr;

using Writer = test::GgufWriter;

constexpr uint32_t kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ8_0 = 8, kBF16 = 30;

// fp16 bits of a few exactly representable values.
constexpr uint16_t kHalfOne = 0x3c00, kHalfTwo = 0x4000, kHalfHalf = 0x3800, kHalfMinTwo = 0xc000;

// A small valid v3 file with every metadata type (nested array included) and every tensor type.
// The last tensor ends exactly at end of file, so every strict prefix is invalid.
std::vector<uint8_t> small_file(uint32_t version = 3, uint32_t alignment = 32) {
  using T = GgufValue::Type;
  Writer w;
  const bool custom_align = alignment != 32;
  w.header(5, 14 + (custom_align ? 1 : 0), version);
  w.key("u8", T::U8).u8(200);
  w.key("i8", T::I8).u8(0xfe);  // -2
  w.key("u16", T::U16).u16(60000);
  w.key("i16", T::I16).u16(0x8000);  // -32768
  w.kv_u32("u32", 4000000000u);
  w.key("i32", T::I32).u32(static_cast<uint32_t>(-7));
  w.key("f32", T::F32).f32(0.25f);
  w.key("bool", T::BOOL).u8(1);
  w.kv_str("general.architecture", "llama");
  w.key("u64", T::U64).u64(1ull << 40);
  w.key("i64", T::I64).u64(static_cast<uint64_t>(-5ll));
  w.key("f64", T::F64).f64(1e300);
  w.key("strings", T::ARRAY).u32(static_cast<uint32_t>(T::STRING)).u64(3).str("a").str("").str("\xE2\x96\x81x");
  // [[1, 2], [3]] as an array of I32 arrays.
  w.key("nested", T::ARRAY).u32(static_cast<uint32_t>(T::ARRAY)).u64(2);
  w.u32(static_cast<uint32_t>(T::I32)).u64(2).u32(1).u32(2);
  w.u32(static_cast<uint32_t>(T::I32)).u64(1).u32(3);
  if (custom_align) w.kv_u32("general.alignment", alignment);

  // Offsets: F32 [4,2] 32 bytes; F16 [8] 16; BF16 [3] 6; Q8_0 [32,2] 68; Q4_0 [32] 18.
  auto up = [&](uint64_t x) { return (x + alignment - 1) / alignment * alignment; };
  const uint64_t o_f32 = 0, o_f16 = up(o_f32 + 32), o_bf16 = up(o_f16 + 16), o_q8 = up(o_bf16 + 6),
                 o_q4 = up(o_q8 + 68);
  w.tensor("f32", {4, 2}, kF32, o_f32);
  w.tensor("f16", {8}, kF16, o_f16);
  w.tensor("bf16", {3}, kBF16, o_bf16);
  w.tensor("q8", {32, 2}, kQ8_0, o_q8);
  w.tensor("q4", {32}, kQ4_0, o_q4);
  w.pad_to(alignment);
  const size_t data = w.b.size();
  for (int i = 0; i < 8; ++i) w.f32(static_cast<float>(i) - 3.5f);
  w.pad_to(alignment);
  EXPECT_EQ(w.b.size() - data, o_f16);
  for (uint16_t h : {kHalfOne, kHalfTwo, kHalfHalf, kHalfMinTwo, uint16_t{0x0000}, uint16_t{0x8000},
                     uint16_t{0x0001} /* 2^-24 */, uint16_t{0x7c00} /* inf */}) {
    w.u16(h);
  }
  w.pad_to(alignment);
  w.u16(0x3f80).u16(0xc040).u16(0x4049);  // bf16 1, -3, 3.140625
  w.pad_to(alignment);
  for (int blk = 0; blk < 2; ++blk) {  // scales 0.5 and 2; q = j - 16
    w.u16(blk == 0 ? kHalfHalf : kHalfTwo);
    for (int j = 0; j < 32; ++j) w.u8(static_cast<uint8_t>(static_cast<int8_t>(j - 16)));
  }
  w.pad_to(alignment);
  w.u16(kHalfMinTwo);  // scale -2; byte j holds element j (low) and j + 16 (high)
  for (int j = 0; j < 16; ++j) w.u8(static_cast<uint8_t>((j & 0x0f) | ((15 - j) << 4)));
  EXPECT_EQ(w.b.size() - data, o_q4 + 18);
  return w.b;
}

// Runs the parser expecting failure; returns the message.
std::string parse_error(std::vector<uint8_t> bytes, std::string name = "hostile.gguf") {
  try {
    GgufFile::from_bytes(std::move(bytes), name);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "parse succeeded";
  return "";
}

TEST(Gguf, SmallFileAllValueTypes) {
  const GgufFile f = GgufFile::from_bytes(small_file(), "small");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.metadata().size(), 14u);
  EXPECT_EQ(std::get<uint64_t>(f.find("u8")->value), 200u);
  EXPECT_EQ(std::get<int64_t>(f.find("i8")->value), -2);
  EXPECT_EQ(std::get<uint64_t>(f.find("u16")->value), 60000u);
  EXPECT_EQ(std::get<int64_t>(f.find("i16")->value), -32768);
  EXPECT_EQ(f.get_u32("u32"), 4000000000u);
  EXPECT_EQ(std::get<int64_t>(f.find("i32")->value), -7);
  EXPECT_EQ(f.get_f32("f32"), 0.25f);
  EXPECT_TRUE(f.get_bool_or("bool", false));
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(std::get<uint64_t>(f.find("u64")->value), 1ull << 40);
  EXPECT_EQ(std::get<int64_t>(f.find("i64")->value), -5);
  EXPECT_EQ(std::get<double>(f.find("f64")->value), 1e300);
  EXPECT_EQ(f.get_string_array("strings"), (std::vector<std::string>{"a", "", "\xE2\x96\x81x"}));
  const GgufValue* nested = f.find("nested");
  ASSERT_NE(nested, nullptr);
  EXPECT_EQ(nested->type, GgufValue::Type::ARRAY);
  EXPECT_EQ(nested->array_type, GgufValue::Type::ARRAY);
  const auto& outer = std::get<std::vector<GgufValue>>(nested->value);
  ASSERT_EQ(outer.size(), 2u);
  EXPECT_EQ(outer[0].array_type, GgufValue::Type::I32);
  EXPECT_EQ(std::get<std::vector<GgufValue>>(outer[0].value).size(), 2u);
  EXPECT_EQ(std::get<int64_t>(std::get<std::vector<GgufValue>>(outer[1].value)[0].value), 3);

  // Typed getter conversions and their errors.
  EXPECT_EQ(f.get_u32("u8"), 200u);
  EXPECT_EQ(f.get_u32_or("missing", 9u), 9u);
  EXPECT_EQ(f.get_f32_or("missing", 1.5f), 1.5f);
  EXPECT_FALSE(f.has_key("missing"));
  EXPECT_EQ(f.find("missing"), nullptr);
  EXPECT_THAT(parse_error({}), HasSubstr("too short"));
  auto msg = [&](auto&& fn) {
    try {
      fn();
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  EXPECT_THAT(msg([&] { f.get_u32("missing"); }), HasSubstr("key 'missing': not found"));
  EXPECT_THAT(msg([&] { f.get_u32("i8"); }), HasSubstr("does not fit in u32"));
  EXPECT_THAT(msg([&] { f.get_u32("u64"); }), HasSubstr("does not fit in u32"));
  EXPECT_THAT(msg([&] { f.get_u32("general.architecture"); }), HasSubstr("has type STRING"));
  EXPECT_THAT(msg([&] { f.get_string("u32"); }), HasSubstr("expected STRING"));
  EXPECT_THAT(msg([&] { f.get_string_array("nested"); }), HasSubstr("ARRAY of ARRAY"));
  EXPECT_THAT(msg([&] { f.tensor("nope"); }), HasSubstr("tensor 'nope' not found"));
}

TEST(Gguf, SmallFileAllTensorTypes) {
  const GgufFile f = GgufFile::from_bytes(small_file(), "small");
  ASSERT_EQ(f.tensors().size(), 5u);
  const auto& t32 = f.tensor("f32");
  EXPECT_EQ(t32.ne, (std::vector<uint64_t>{4, 2}));
  EXPECT_EQ(t32.n_elements, 8u);
  EXPECT_EQ(t32.n_bytes, 32u);
  EXPECT_EQ(f.dequantize(t32), (std::vector<float>{-3.5f, -2.5f, -1.5f, -0.5f, 0.5f, 1.5f, 2.5f, 3.5f}));

  const auto f16 = f.dequantize(f.tensor("f16"));
  ASSERT_EQ(f16.size(), 8u);
  EXPECT_EQ(f16[0], 1.0f);
  EXPECT_EQ(f16[1], 2.0f);
  EXPECT_EQ(f16[2], 0.5f);
  EXPECT_EQ(f16[3], -2.0f);
  EXPECT_EQ(f16[4], 0.0f);
  EXPECT_TRUE(std::signbit(f16[5]) && f16[5] == 0.0f);
  EXPECT_EQ(f16[6], std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(f16[7]) && f16[7] > 0);

  EXPECT_EQ(f.dequantize(f.tensor("bf16")), (std::vector<float>{1.0f, -3.0f, 3.140625f}));

  const auto& tq8 = f.tensor("q8");
  EXPECT_EQ(tq8.type, static_cast<uint32_t>(GgmlType::Q8_0));
  EXPECT_EQ(tq8.n_bytes, 68u);
  const auto q8 = f.dequantize(tq8);
  ASSERT_EQ(q8.size(), 64u);
  for (int j = 0; j < 32; ++j) {
    EXPECT_EQ(q8[j], 0.5f * static_cast<float>(j - 16));
    EXPECT_EQ(q8[32 + j], 2.0f * static_cast<float>(j - 16));
  }

  const auto q4 = f.dequantize(f.tensor("q4"));
  ASSERT_EQ(q4.size(), 32u);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(q4[j], -2.0f * static_cast<float>(j - 8)) << j;
    EXPECT_EQ(q4[16 + j], -2.0f * static_cast<float>((15 - j) - 8)) << j;
  }
  EXPECT_EQ(ggml_type_name(8), "Q8_0");
  EXPECT_EQ(ggml_type_name(12), "Q4_K");
  EXPECT_EQ(ggml_type_name(6), "type#6");
}

TEST(Gguf, VersionTwoAndCustomAlignment) {
  const GgufFile v2 = GgufFile::from_bytes(small_file(2), "v2");
  EXPECT_EQ(v2.version(), 2u);
  const GgufFile a64 = GgufFile::from_bytes(small_file(3, 64), "a64");
  EXPECT_EQ(a64.alignment(), 64u);
  EXPECT_EQ(a64.tensor("q4").offset % 64, 0u);
  EXPECT_EQ(a64.dequantize(a64.tensor("q8")), v2.dequantize(v2.tensor("q8")));
}

TEST(Gguf, CopiesKeepTensorDataValid) {
  std::vector<float> expect;
  GgufFile copy = GgufFile::from_bytes(small_file(), "small");
  {
    const GgufFile f = GgufFile::from_bytes(small_file(), "small");
    expect = f.dequantize(f.tensor("q8"));
    copy = f;
  }
  EXPECT_EQ(copy.dequantize(copy.tensor("q8")), expect);
  // A tensor info that does not point into this file's image is refused.
  GgufTensorInfo forged = copy.tensor("q8");
  const std::vector<uint8_t> elsewhere(100);
  forged.data = elsewhere.data();
  EXPECT_THROW(copy.dequantize(forged), std::runtime_error);
}

TEST(Gguf, EveryTruncationThrows) {
  const std::vector<uint8_t> full = small_file();
  for (size_t n = 0; n < full.size(); ++n) {
    std::vector<uint8_t> cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(GgufFile::from_bytes(std::move(cut), "cut"), std::runtime_error) << "prefix " << n;
  }
  EXPECT_NO_THROW(GgufFile::from_bytes(full, "full"));
}

TEST(Gguf, MessagesNameFileAndPlace) {
  EXPECT_THAT(parse_error({'G', 'G', 'U', 'F', 3, 0}, "x.gguf"), HasSubstr("GGUF 'x.gguf': header: truncated"));
  EXPECT_THAT(parse_error({'G', 'G', 'M', 'L', 3, 0, 0, 0}), HasSubstr("bad magic"));
  EXPECT_THAT(parse_error(Writer().header(0, 0, 1).b), HasSubstr("version 1 is not supported"));
  EXPECT_THAT(parse_error(Writer().header(0, 0, 4).b), HasSubstr("unsupported version 4"));
  EXPECT_THAT(parse_error(Writer().header(0, 0, 0x03000000).b), HasSubstr("big-endian"));
}

TEST(Gguf, HostileCounts) {
  // String length far beyond the file.
  EXPECT_THAT(parse_error(Writer().header(0, 1).u64(1ull << 62).u64(0).u64(0).b),
              HasSubstr("key length 4611686018427387904 exceeds"));
  auto w = Writer().header(0, 1);
  w.key("s", GgufValue::Type::STRING).u64(~0ull);
  EXPECT_THAT(parse_error(w.b), HasSubstr("key 's': string value length"));
  // Array count far beyond the file (would be a 2^60-element allocation).
  w = Writer().header(0, 1);
  w.key("a", GgufValue::Type::ARRAY).u32(static_cast<uint32_t>(GgufValue::Type::U64)).u64(1ull << 60).u64(0);
  EXPECT_THAT(parse_error(w.b), HasSubstr("key 'a': array count 1152921504606846976 of U64 exceeds"));
  w = Writer().header(0, 1);
  w.key("a", GgufValue::Type::ARRAY).u32(99).u64(1);
  EXPECT_THAT(parse_error(w.b), HasSubstr("unknown array element type 99"));
  // Tensor and metadata counts.
  EXPECT_THAT(parse_error(Writer().header(1ull << 40, 0).u64(0).b), HasSubstr("tensor count 1099511627776 exceeds"));
  EXPECT_THAT(parse_error(Writer().header(0, ~0ull).u64(0).b), HasSubstr("metadata count"));
  // A metadata count of 0 in a file with metadata: its first key is read as a tensor info, and the
  // message says it was read right after the header.
  w = Writer().header(1, 0);
  w.kv_str("general.architecture", "llama").tensor("t", {4}, kF32, 0).pad_to(32);
  w.b.resize(w.b.size() + 16);
  EXPECT_THAT(parse_error(w.b), HasSubstr("tensor 'general.architecture': n_dims 8 out of range 1..4 (the first "
                                          "tensor info, read right after the header since the metadata count is 0"));
  // Unknown value type.
  w = Writer().header(0, 1);
  w.key("k", static_cast<GgufValue::Type>(13)).u64(0);
  EXPECT_THAT(parse_error(w.b), HasSubstr("key 'k': unknown value type 13"));
  // Deeply nested arrays are cut off instead of recursing without bound.
  w = Writer().header(0, 1);
  w.key("deep", GgufValue::Type::ARRAY);
  for (int i = 0; i < 64; ++i) w.u32(static_cast<uint32_t>(GgufValue::Type::ARRAY)).u64(1);
  EXPECT_THAT(parse_error(w.b), HasSubstr("nested deeper"));
}

TEST(Gguf, HostileKeysAndAlignment) {
  auto w = Writer().header(0, 2);
  w.kv_u32("dup", 1).kv_u32("dup", 2);
  EXPECT_THAT(parse_error(w.b), HasSubstr("key 'dup': duplicate key"));
  for (uint32_t bad : {0u, 48u, 3u}) {
    w = Writer().header(0, 1);
    w.kv_u32("general.alignment", bad);
    EXPECT_THAT(parse_error(w.b), HasSubstr("alignment must be a non-zero power of two (got " + std::to_string(bad)));
  }
  w = Writer().header(0, 1);
  w.kv_str("general.alignment", "32");
  EXPECT_THAT(parse_error(w.b), HasSubstr("expected an integer"));
  // Hostile names reach messages escaped and cut short.
  w = Writer().header(0, 1);
  w.key("\x01\n" + std::string(500, 'k'), static_cast<GgufValue::Type>(77)).u64(0);
  const std::string m = parse_error(w.b);
  EXPECT_THAT(m, HasSubstr("key '\\x01\\x0akkk"));
  EXPECT_THAT(m, HasSubstr("...(502 bytes)': unknown value type 77"));
  EXPECT_LT(m.size(), 250u);
}

// One tensor info with the given fields followed by `data_bytes` bytes of data.
std::vector<uint8_t> one_tensor(std::vector<uint64_t> ne, uint32_t type, uint64_t offset, size_t data_bytes,
                                std::string_view name = "blk.3.attn_k.weight") {
  Writer w;
  w.header(1, 0).tensor(name, std::move(ne), type, offset).pad_to(32);
  w.b.resize(w.b.size() + data_bytes);
  return w.b;
}

TEST(Gguf, HostileTensors) {
  EXPECT_NO_THROW(GgufFile::from_bytes(one_tensor({32, 2}, kQ8_0, 0, 68)));
  EXPECT_THAT(parse_error(one_tensor({32}, 6, 0, 22)),
              HasSubstr("tensor 'blk.3.attn_k.weight': unsupported tensor type 6 (type#6); supported: F32, F16, BF16, "
                        "Q8_0, Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"));
  EXPECT_THAT(parse_error(one_tensor({1ull << 32, 1ull << 32, 1ull << 32}, kF32, 0, 0)),
              HasSubstr("element count overflows"));
  EXPECT_THAT(parse_error(one_tensor({1ull << 62}, kF32, 0, 0)), HasSubstr("byte size overflows uint64"));
  EXPECT_THAT(parse_error(one_tensor({~0ull}, kF32, 0, 0)), HasSubstr("element count overflows"));
  EXPECT_THAT(parse_error(one_tensor({4, 0}, kF32, 0, 16)), HasSubstr("dimension 1 is zero"));
  EXPECT_THAT(parse_error(one_tensor({1, 1, 1, 1, 1}, kF32, 0, 4)), HasSubstr("n_dims 5 out of range"));
  EXPECT_THAT(parse_error(one_tensor({}, kF32, 0, 4)), HasSubstr("n_dims 0 out of range"));
  EXPECT_THAT(parse_error(one_tensor({33}, kQ8_0, 0, 68)),
              HasSubstr("row length 33 is not a multiple of the Q8_0 block size 32"));
  EXPECT_THAT(parse_error(one_tensor({16}, kF32, 16, 128)),
              HasSubstr("offset 16 is not a multiple of the alignment 32"));
  const std::string past = parse_error(one_tensor({32, 2}, kQ8_0, 0, 67), "m.gguf");
  EXPECT_THAT(past, HasSubstr("GGUF 'm.gguf': tensor 'blk.3.attn_k.weight': data runs past end of file (offset "));
  EXPECT_THAT(past, HasSubstr("size 68, file "));
  EXPECT_THAT(parse_error(one_tensor({8}, kF32, 1ull << 63, 32)), HasSubstr("data runs past end of file"));
  EXPECT_THAT(parse_error(one_tensor({8}, kF32, ~0ull & ~31ull, 32)), HasSubstr("data runs past end of file"));
  // Two tensors sharing bytes: 'b' starts inside 'a' (64 bytes at 0); back to back is fine.
  auto two = [](uint64_t offset_b) {
    Writer w;
    w.header(2, 0).tensor("a", {16}, kF32, 0).tensor("b", {8}, kF32, offset_b).pad_to(32);
    w.b.resize(w.b.size() + 128);
    return w.b;
  };
  EXPECT_NO_THROW(GgufFile::from_bytes(two(64)));
  EXPECT_THAT(parse_error(two(32)),
              HasSubstr("tensor 'b': data at offset 32 overlaps tensor 'a' (offset 0, 64 bytes)"));

  Writer w;
  w.header(2, 0).tensor("t", {8}, kF32, 0).tensor("t", {8}, kF32, 32).pad_to(32);
  w.b.resize(w.b.size() + 64);
  EXPECT_THAT(parse_error(w.b), HasSubstr("tensor 't': duplicate tensor name"));
}

// ---- the real models ----

class GgufModels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  }
};

// A llama.* size key of the real model set to 0 or to 0xFFFFFFFF (which an int would read as -1):
// the load fails with a message naming the key and its value.
TEST_F(GgufModels, HostileSizeKeysNameTheKey) {
  std::ifstream in(test::source_path("models/locks-ref-a-q8_0.gguf"), std::ios::binary);
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
  ASSERT_GT(bytes.size(), 1000u);
  // A GGUF key-value pair: key length (u64), key, value type (u32; 4 = UINT32), value.
  auto with_u32 = [&](const std::string& key, uint32_t v) {
    std::vector<uint8_t> b = bytes;
    const auto it = std::search(b.begin(), b.end(), key.begin(), key.end());
    EXPECT_NE(it, b.end()) << key;
    const size_t at = size_t(it - b.begin()) + key.size();
    uint32_t type = 0;
    std::memcpy(&type, &b[at], 4);
    EXPECT_EQ(type, 4u) << key << " is not a UINT32";
    std::memcpy(&b[at + 4], &v, 4);
    return b;
  };
  auto load_error = [&](const std::string& key, uint32_t v) {
    try {
      LlamaModel::from_gguf(GgufFile::from_bytes(with_u32(key, v), "m.gguf"));
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  EXPECT_EQ(load_error("llama.context_length", 0xFFFFFFFFu),
            "GGUF 'm.gguf': llama.context_length = 4294967295 is outside [1, 1073741824]");
  EXPECT_EQ(load_error("llama.embedding_length", 0), "GGUF 'm.gguf': llama.embedding_length = 0 is outside [1, 65536]");
  EXPECT_EQ(load_error("llama.attention.head_count_kv", 0xFFFFFFFFu),
            "GGUF 'm.gguf': llama.attention.head_count_kv = 4294967295 is outside [1, 1024]");
  // A block count below the file's 8 blocks would run a truncated model: the first extra block's
  // tensor is named.
  const std::string blocks = load_error("llama.block_count", 7);
  EXPECT_THAT(blocks, HasSubstr("GGUF 'm.gguf': tensor 'blk.7."));
  EXPECT_THAT(blocks, HasSubstr("' belongs to block 7, but llama.block_count is 7"));
  const uint32_t n_vocab = GgufFile::from_bytes(bytes, "m.gguf").get_u32("llama.vocab_size");
  EXPECT_EQ(load_error("llama.vocab_size", n_vocab + 1),
            fmt::format("GGUF 'm.gguf': llama.vocab_size = {} disagrees with the {} tokens of tokenizer.ggml.tokens",
                        n_vocab + 1, n_vocab));
}

// A hostile architecture string is named with its bytes escaped (a control byte in a terminal
// message would garble it).
TEST_F(GgufModels, UnsupportedArchitectureIsEscaped) {
  std::ifstream in(test::source_path("models/locks-ref-a-q8_0.gguf"), std::ios::binary);
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)), {});
  const std::string key = "general.architecture";
  const auto it = std::search(b.begin(), b.end(), key.begin(), key.end());
  ASSERT_NE(it, b.end());
  const size_t at = size_t(it - b.begin()) + key.size() + 4 + 8;  // type (u32), length (u64), bytes
  ASSERT_EQ(std::string(b.begin() + at, b.begin() + at + 5), "llama");
  b[at + 3] = 0x9f;
  try {
    LlamaModel::from_gguf(GgufFile::from_bytes(b, "m.gguf"));
    FAIL() << "loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "GGUF 'm.gguf': architecture 'lla\\x9fa' is not supported (supported: llama, qwen2, qwen3)");
  }
}

// Optional keys the file lacks take llama.cpp's defaults and are named in defaults_used (the CLI
// warns): a key renamed by one byte is missing to the loader.
TEST_F(GgufModels, MissingOptionalKeysAreNoted) {
  std::ifstream in(test::source_path("models/locks-ref-a-q8_0.gguf"), std::ios::binary);
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
  const LlamaModel full = LlamaModel::from_gguf(GgufFile::from_bytes(bytes, "m.gguf"));
  EXPECT_TRUE(full.defaults_used.empty());
  EXPECT_NE(full.hp.rope_freq_base, 10000.0f);
  auto renamed = [&](const std::string& key) {
    std::vector<uint8_t> b = bytes;
    const auto it = std::search(b.begin(), b.end(), key.begin(), key.end());
    EXPECT_NE(it, b.end()) << key;
    *(it + std::ptrdiff_t(key.size()) - 1) ^= 0x01;  // last character changed
    return LlamaModel::from_gguf(GgufFile::from_bytes(b, "m.gguf"));
  };
  const LlamaModel no_base = renamed("llama.rope.freq_base");
  EXPECT_EQ(no_base.hp.rope_freq_base, 10000.0f);
  ASSERT_EQ(no_base.defaults_used.size(), 1u);
  EXPECT_EQ(no_base.defaults_used[0], "llama.rope.freq_base is missing: 10000 (llama.cpp's default)");
  const LlamaModel no_scores = renamed("tokenizer.ggml.scores");
  ASSERT_EQ(no_scores.defaults_used.size(), 1u);
  EXPECT_THAT(no_scores.defaults_used[0], HasSubstr("tokenizer.ggml.scores is missing: every piece scored 0"));
}

TEST_F(GgufModels, LocksRefMetadataAndShapes) {
  const GgufFile f = GgufFile::open(test::shared_path("models/locks-ref-a-q8_0.gguf"));
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_u32("llama.block_count"), 8u);
  EXPECT_EQ(f.get_u32("llama.embedding_length"), 512u);
  EXPECT_EQ(f.get_u32("llama.feed_forward_length"), 1024u);
  EXPECT_EQ(f.get_u32("llama.attention.head_count"), 8u);
  EXPECT_EQ(f.get_u32("llama.attention.head_count_kv"), 2u);
  EXPECT_EQ(f.get_u32("llama.context_length"), 16384u);
  EXPECT_EQ(f.get_f32("llama.rope.freq_base"), 500000.0f);
  EXPECT_FLOAT_EQ(f.get_f32("llama.attention.layer_norm_rms_epsilon"), 1e-5f);
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "llama");
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 4096u);
  EXPECT_EQ(f.get_f32_array("tokenizer.ggml.scores").size(), 4096u);
  EXPECT_EQ(f.get_i32_array("tokenizer.ggml.token_type").size(), 4096u);
  EXPECT_TRUE(f.get_bool_or("tokenizer.ggml.add_space_prefix", false));

  EXPECT_EQ(f.tensors().size(), 74u);
  const auto& emb = f.tensor("token_embd.weight");
  EXPECT_EQ(emb.ne, (std::vector<uint64_t>{512, 4096}));
  EXPECT_EQ(emb.type, static_cast<uint32_t>(GgmlType::Q8_0));
  EXPECT_EQ(f.tensor("blk.0.attn_k.weight").ne, (std::vector<uint64_t>{512, 128}));
  EXPECT_EQ(f.tensor("blk.7.ffn_down.weight").ne, (std::vector<uint64_t>{1024, 512}));
  EXPECT_EQ(f.tensor("blk.0.attn_norm.weight").type, static_cast<uint32_t>(GgmlType::F32));
  EXPECT_EQ(f.find_tensor("output.weight"), nullptr);  // tied embeddings
}

// Dequantize Q8_0 independently: locate the tensor in a separate read of the file (the data
// section ends at end of file) and decode the fp16 scale from its bit fields.
TEST_F(GgufModels, LocksRefQ8DequantMatchesRawBytes) {
  const std::string path = test::shared_path("models/locks-ref-a-q8_0.gguf");
  const GgufFile f = GgufFile::open(path);
  std::ifstream in(path, std::ios::binary);
  const std::vector<uint8_t> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t data_end = 0;
  for (const auto& t : f.tensors()) data_end = std::max(data_end, t.offset + t.n_bytes);
  const uint64_t data_start = raw.size() - data_end;
  EXPECT_EQ(data_start % 32, 0u);

  const auto& t = f.tensor("blk.3.attn_k.weight");
  ASSERT_EQ(t.n_bytes, 512u * 128 / 32 * 34);
  const uint8_t* p = raw.data() + data_start + t.offset;
  ASSERT_EQ(std::memcmp(p, t.data, t.n_bytes), 0);
  const auto got = f.dequantize(t);
  ASSERT_EQ(got.size(), 512u * 128);
  double sumsq = 0;
  for (size_t blk = 0; blk < got.size() / 32; ++blk, p += 34) {
    const unsigned h = p[0] | (p[1] << 8);
    const int e = (h >> 10) & 31, m = h & 1023;
    ASSERT_NE(e, 31);
    const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1.0 + m / 1024.0, e - 15);
    const float scale = static_cast<float>((h & 0x8000) ? -mag : mag);
    for (size_t j = 0; j < 32; ++j) {
      const float expect = static_cast<float>(static_cast<int8_t>(p[2 + j])) * scale;
      ASSERT_EQ(got[blk * 32 + j], expect) << "element " << blk * 32 + j;
      sumsq += double(expect) * expect;
    }
  }
  EXPECT_GT(sumsq, 0.0);
}

TEST_F(GgufModels, Stories260KMetadataAndF32) {
  const std::string path = test::shared_path("models/stories260K-f32.gguf");
  const GgufFile f = GgufFile::open(path);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_u32("llama.attention.head_count"), 8u);
  EXPECT_EQ(f.get_u32("llama.attention.head_count_kv"), 4u);
  EXPECT_EQ(f.get_u32("llama.block_count"), 5u);
  EXPECT_EQ(f.get_f32("llama.rope.freq_base"), 10000.0f);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 512u);
  EXPECT_EQ(f.get_f32_array("tokenizer.ggml.scores").size(), 512u);
  EXPECT_EQ(f.tensors().size(), 47u);
  const auto& emb = f.tensor("token_embd.weight");
  EXPECT_EQ(emb.ne, (std::vector<uint64_t>{64, 512}));
  EXPECT_EQ(f.tensor("blk.4.ffn_gate.weight").ne, (std::vector<uint64_t>{64, 172}));
  const auto v = f.dequantize(emb);
  ASSERT_EQ(v.size(), 64u * 512);
  for (size_t i = 0; i < v.size(); i += 97) {
    float expect;
    std::memcpy(&expect, emb.data + 4 * i, 4);
    EXPECT_EQ(v[i], expect);
  }
}

// A model too large for memory is refused before anything is allocated, with what it needs: a
// sparse file whose one tensor holds 2^38 f32 elements (1 TiB), read through the mapping.
TEST(Gguf, ModelTooLargeForMemorySaysWhatItNeeds) {
  const std::string path = (std::filesystem::temp_directory_path() / "locks_test_huge.gguf").string();
  Writer w;
  w.header(1, 1).kv_str("general.architecture", "qwen2");
  w.tensor("token_embd.weight", {1ull << 16, 1ull << 22}, kF32, 0).pad_to(32);
  {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(w.b.data()), std::streamsize(w.b.size()));
  }
  std::error_code ec;
  std::filesystem::resize_file(path, w.b.size() + (uintmax_t(1) << 40), ec);
  if (ec) {
    std::filesystem::remove(path);
    GTEST_SKIP() << "no 1 TiB sparse file here: " << ec.message();
  }
  std::string msg;
  try {
    LlamaModel::load(path);
  } catch (const std::runtime_error& e) {
    msg = e.what();
  }
  std::filesystem::remove(path);
  EXPECT_THAT(msg,
              HasSubstr("GGUF '" + path + "': the model needs 1099.5 GB of memory for its weights as f32, but only "));
  EXPECT_THAT(msg, HasSubstr(" GB is available (MemAvailable in /proc/meminfo)"));
}

TEST(Gguf, OpenMissingFileNamesPath) {
  try {
    GgufFile::open("/nonexistent/model.gguf");
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("GGUF '/nonexistent/model.gguf': cannot open"));
  }
  // A device has no size to read (/dev/zero would otherwise read as an empty file).
  try {
    GgufFile::open("/dev/zero");
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "GGUF '/dev/zero': not a regular file");
  }
}

}  // namespace
}  // namespace locks
