// Host packing of a float summary into the device record (record_layout.h), quantized exactly as
// the CPU PageSummaryStore::store does, and the inverse (dequantization) for tests.
#include <cstring>
#include <stdexcept>
#include <string>

#include "locks/cuda/kernels.h"
#include "locks/quant.h"
#include "record_layout.h"

namespace locks::cuda {

namespace {

namespace L = layout;

// The CPU store's quantization (quant.h) into int codes; its error message, word for word.
uint16_t quantize(const float* x, int n, int qm, int* codes, const char* what) {
  f16_t scale = 0;
  float amax = 0.0f;
  if (!quant::quantize(x, size_t(n), qm, scale, amax, [&](size_t i, int c) { codes[i] = c; }))
    throw std::invalid_argument(std::string("page summary: ") + what + " magnitude " + std::to_string(amax) +
                                " overflows the f16 scale");
  return scale;
}

void check_dim(int d) {
  if (d != 64 && d != 128)
    throw std::invalid_argument("device summary record: head_dim " + std::to_string(d) + " (supported: 64, 128)");
}

}  // namespace

void pack_summary_record(const float* centroid, const float* basis, const float* coef, int d, uint8_t* out) {
  check_dim(d);
  std::memset(out, 0, L::record_bytes(d));
  uint16_t scales[32] = {};
  int codes[128];
  for (int k = 0; k < L::kRank; ++k) {
    const uint16_t s = quantize(basis + size_t(k) * d, d, quant::qmax(4), codes, "basis column");
    scales[L::basis_scale_slot(k)] = s;
    uint8_t* col = out + L::basis_offset(d) + size_t(k) * (d / 2);
    for (int c = 0; c < d; c += 2) col[c / 2] = quant::offset_nibbles(codes[c], codes[c + 1]);
  }
  for (int i = 0; i < L::kPage; ++i) {
    scales[L::coef_scale_slot(i)] =
        quantize(coef + size_t(i) * L::kRank, L::kRank, quant::qmax(8), codes, "coefficient row");
    for (int k = 0; k < L::kRank; ++k)
      out[L::coef_offset(d) + L::coef_byte(i, k)] = uint8_t(static_cast<int8_t>(codes[k]));
  }
  const uint16_t ms = quantize(centroid, d, quant::qmax(8), codes, "centroid");
  for (int c = 0; c < d; ++c) out[L::centroid_offset(d) + L::centroid_byte(c)] = uint8_t(static_cast<int8_t>(codes[c]));
  for (int t = 0; t < 4; ++t) scales[L::centroid_scale_slot(t)] = ms;
  std::memcpy(out + L::scales_offset(d), scales, sizeof scales);
}

void unpack_summary_record(const uint8_t* rec, int d, float* centroid, float* basis, float* coef) {
  check_dim(d);
  uint16_t scales[32];
  std::memcpy(scales, rec + L::scales_offset(d), sizeof scales);
  for (int k = 0; k < L::kRank; ++k) {
    const float s = f16_to_f32(scales[L::basis_scale_slot(k)]);
    const uint8_t* col = rec + L::basis_offset(d) + size_t(k) * (d / 2);
    for (int c = 0; c < d; ++c) basis[size_t(k) * d + c] = float(quant::offset_nibble_code(col[c / 2], c % 2)) * s;
  }
  for (int i = 0; i < L::kPage; ++i) {
    const float s = f16_to_f32(scales[L::coef_scale_slot(i)]);
    for (int k = 0; k < L::kRank; ++k)
      coef[i * L::kRank + k] = float(static_cast<int8_t>(rec[L::coef_offset(d) + L::coef_byte(i, k)])) * s;
  }
  const float ms = f16_to_f32(scales[L::centroid_scale_slot(0)]);
  for (int c = 0; c < d; ++c)
    centroid[c] = float(static_cast<int8_t>(rec[L::centroid_offset(d) + L::centroid_byte(c)])) * ms;
}

}  // namespace locks::cuda
