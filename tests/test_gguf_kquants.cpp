// K-quant tensors (Q2_K..Q6_K, QK_K = 256) against a float64 decoder written here from the block
// layouts of ggml's ggml-common.h, element by element (where element e's bits lie), on blocks of random
// bytes with chosen super-block scales; plus the sizes the reader checks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "gguf_writer.h"
#include "locks/gguf.h"

namespace locks {
namespace {

using ::testing::HasSubstr;

// f16 bits -> value, from the bit fields.
double f16(const uint8_t* p) {
  const unsigned h = p[0] | (p[1] << 8);
  const int e = (h >> 10) & 31, m = h & 1023;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1.0 + m / 1024.0, e - 15);
  return (h & 0x8000) ? -mag : mag;
}

// 6-bit (scale, min) pair g of the 12-byte Q4_K/Q5_K table: g < 4 in the low 6 bits of bytes g, g+4;
// g >= 4 split: low 4 bits in the nibbles of byte g+4, high 2 bits in the top bits of bytes g-4, g.
void k4_scale_min(const uint8_t* s, int g, int& sc, int& m) {
  if (g < 4) {
    sc = s[g] & 63, m = s[g + 4] & 63;
  } else {
    sc = (s[g + 4] & 15) + 16 * (s[g - 4] >> 6);
    m = (s[g + 4] >> 4) + 16 * (s[g] >> 6);
  }
}

// Element e of one block, in float64.
double ref_q2_k(const uint8_t* b, int e) {  // scales[16] qs[64] d dmin
  const int half = e / 128, r = e % 128, j = r / 32, l = r % 32;
  const int q = (b[16 + 32 * half + l] >> (2 * j)) & 3;
  const uint8_t sc = b[8 * half + 2 * j + l / 16];
  return f16(b + 80) * (sc & 15) * q - f16(b + 82) * (sc >> 4);
}
double ref_q3_k(const uint8_t* b, int e) {  // hmask[32] qs[64] scales[12] d
  const int half = e / 128, r = e % 128, j = r / 32, l = r % 32;
  const int lo2 = (b[32 + 32 * half + l] >> (2 * j)) & 3;
  const bool high = (b[l] >> (4 * half + j)) & 1;
  // The 16 6-bit scales as ggml unpacks them: four u32 words from the 12 bytes.
  uint32_t aux[4];
  std::memcpy(aux, b + 96, 12);
  const uint32_t tmp = aux[2], k1 = 0x03030303, k2 = 0x0f0f0f0f;
  aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
  aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
  aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
  aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
  uint8_t sc[16];
  std::memcpy(sc, aux, 16);
  return f16(b + 108) * (int(sc[8 * half + 2 * j + l / 16]) - 32) * (lo2 - (high ? 0 : 4));
}
double ref_q4_k(const uint8_t* b, int e) {  // d dmin scales[12] qs[128]
  const int g = e / 32, l = e % 32;
  const uint8_t byte = b[16 + 32 * (g / 2) + l];
  const int q = g % 2 ? byte >> 4 : byte & 15;
  int sc = 0, m = 0;
  k4_scale_min(b + 4, g, sc, m);
  return f16(b) * sc * q - f16(b + 2) * m;
}
double ref_q5_k(const uint8_t* b, int e) {  // d dmin scales[12] qh[32] qs[128]
  const int g = e / 32, l = e % 32;
  const uint8_t byte = b[48 + 32 * (g / 2) + l];
  const int q = (g % 2 ? byte >> 4 : byte & 15) + 16 * ((b[16 + l] >> g) & 1);
  int sc = 0, m = 0;
  k4_scale_min(b + 4, g, sc, m);
  return f16(b) * sc * q - f16(b + 2) * m;
}
double ref_q6_k(const uint8_t* b, int e) {  // ql[128] qh[64] scales[16] int8 d
  const int half = e / 128, r = e % 128, quarter = r / 32, l = r % 32;
  const uint8_t* ql = b + 64 * half;
  const uint8_t lowbyte = ql[l + (quarter % 2) * 32];
  const int low = quarter < 2 ? lowbyte & 15 : lowbyte >> 4;
  const int high = (b[128 + 32 * half + l] >> (2 * quarter)) & 3;
  const int8_t sc = static_cast<int8_t>(b[192 + 8 * half + l / 16 + 2 * quarter]);
  return f16(b + 208) * sc * ((low | (high << 4)) - 32);
}

struct KType {
  GgmlType type;
  const char* name;
  size_t block_bytes;
  double (*ref)(const uint8_t*, int);
  std::vector<size_t> f16_at;  // offsets of the super-block scales
};

const std::vector<KType>& ktypes() {
  static const std::vector<KType> k = {
      {GgmlType::Q2_K, "Q2_K", 84, ref_q2_k, {80, 82}}, {GgmlType::Q3_K, "Q3_K", 110, ref_q3_k, {108}},
      {GgmlType::Q4_K, "Q4_K", 144, ref_q4_k, {0, 2}},  {GgmlType::Q5_K, "Q5_K", 176, ref_q5_k, {0, 2}},
      {GgmlType::Q6_K, "Q6_K", 210, ref_q6_k, {208}},
  };
  return k;
}

// A file with one tensor [256 * n_blocks] of `type` holding `data`.
std::vector<uint8_t> one_tensor_file(GgmlType type, uint64_t n_elements, const std::vector<uint8_t>& data) {
  test::GgufWriter w;
  w.header(1, 0).tensor("w", {n_elements}, uint32_t(type), 0).pad_to(32);
  w.raw(data.data(), data.size());
  return w.b;
}

TEST(GgufKQuants, RandomBlocksMatchFloat64Decoder) {
  std::mt19937 rng(27);
  std::uniform_int_distribution<int> byte(0, 255);
  // Super-block scales: f16 values of both signs and several magnitudes (normal and subnormal).
  const uint16_t scales[] = {0x3c00, 0x2e66, 0x1a00, 0xa4cd, 0x0203, 0x5640};
  for (const KType& k : ktypes()) {
    constexpr int kBlocks = 24;
    std::vector<uint8_t> data(k.block_bytes * kBlocks);
    for (auto& x : data) x = uint8_t(byte(rng));
    for (int blk = 0; blk < kBlocks; ++blk)
      for (size_t i = 0; i < k.f16_at.size(); ++i) {
        const uint16_t h = scales[(blk + 3 * i) % std::size(scales)];
        data[blk * k.block_bytes + k.f16_at[i]] = uint8_t(h & 0xff);
        data[blk * k.block_bytes + k.f16_at[i] + 1] = uint8_t(h >> 8);
      }
    const GgufFile f = GgufFile::from_bytes(one_tensor_file(k.type, 256 * kBlocks, data), k.name);
    const GgufTensorInfo& t = f.tensor("w");
    EXPECT_EQ(t.n_bytes, k.block_bytes * kBlocks) << k.name;
    EXPECT_EQ(ggml_type_name(uint32_t(k.type)), k.name);
    const std::vector<float> got = f.dequantize(t);
    ASSERT_EQ(got.size(), 256u * kBlocks);
    double max_abs = 0.0;
    for (int blk = 0; blk < kBlocks; ++blk)
      for (int e = 0; e < 256; ++e) {
        const double want = k.ref(&data[blk * k.block_bytes], e);
        max_abs = std::max(max_abs, std::abs(want));
        // float32 products of exact small integers and an f16 scale: within a few float ulps.
        ASSERT_NEAR(got[size_t(blk) * 256 + e], want, 4e-7 * std::abs(want) + 1e-30)
            << k.name << " block " << blk << " element " << e;
      }
    EXPECT_GT(max_abs, 0.0) << k.name;
  }
}

// One Q4_K block built by hand: group 5's scale 37 and min 9 (split over bytes 1, 5 and 9), d = 0.5,
// dmin = 0.25; element 5*32 + 7 = 167 holds nibble 11 (the high nibble of qs[64 + 7]).
TEST(GgufKQuants, HandBuiltQ4KElement) {
  std::vector<uint8_t> b(144, 0);
  b[0] = 0x00, b[1] = 0x38;  // d = 0.5
  b[2] = 0x00, b[3] = 0x34;  // dmin = 0.25
  const int sc = 37, m = 9;  // 0b100101, 0b001001
  b[4 + 9] = uint8_t((sc & 15) | ((m & 15) << 4));
  b[4 + 1] = uint8_t((sc >> 4) << 6);
  b[4 + 5] = uint8_t((m >> 4) << 6);
  b[16 + 64 + 7] = 0xb0;
  const GgufFile f = GgufFile::from_bytes(one_tensor_file(GgmlType::Q4_K, 256, b), "q4k");
  const std::vector<float> v = f.dequantize(f.tensor("w"));
  EXPECT_EQ(v[167], 0.5f * 37 * 11 - 0.25f * 9);
  EXPECT_EQ(v[166], -0.25f * 9);  // nibble 0 of the same group: the min alone
}

// Sizes: a K-quant row must be whole super-blocks, and a tensor one byte short of its blocks is
// an error naming the tensor (never a read past the end).
TEST(GgufKQuants, SizesAreChecked) {
  for (const KType& k : ktypes()) {
    std::vector<uint8_t> data(k.block_bytes * 2, 0);
    std::vector<uint8_t> file = one_tensor_file(k.type, 512, data);
    EXPECT_NO_THROW(GgufFile::from_bytes(file, "ok")) << k.name;
    file.pop_back();
    try {
      GgufFile::from_bytes(file, "short");
      ADD_FAILURE() << k.name << ": parsed";
    } catch (const std::runtime_error& e) {
      EXPECT_THAT(e.what(), HasSubstr("tensor 'w': data runs past end of file")) << k.name;
    }
    try {
      GgufFile::from_bytes(one_tensor_file(k.type, 128, data), "row");
      ADD_FAILURE() << k.name << ": parsed";
    } catch (const std::runtime_error& e) {
      EXPECT_THAT(e.what(),
                  HasSubstr(std::string("row length 128 is not a multiple of the ") + k.name + " block size 256"));
    }
  }
}

}  // namespace
}  // namespace locks
