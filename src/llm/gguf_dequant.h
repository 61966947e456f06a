// Block geometry and float32 decoding of the ggml tensor types the GGUF reader supports (ggml's
// ggml-common.h block structs, dequantize_row_* semantics; QK_K = 256 for the K-quants).
#pragma once

#include <cstdint>

namespace locks::gguf_detail {

/// Elements and bytes of one block of ggml type `type` (1 element for F32/F16/BF16); false for a
/// type the reader does not decode.
bool tensor_block(uint32_t type, uint64_t& block_elems, uint64_t& block_bytes);

/// Decodes `n_blocks` consecutive blocks of `type` at `src` into dst[n_blocks * block_elems] float32,
/// elements in file order. `type` must be one tensor_block accepts; the caller has bounds-checked
/// the bytes (n_blocks * block_bytes at src).
void dequantize_blocks(uint32_t type, const uint8_t* src, uint64_t n_blocks, float* dst);

}  // namespace locks::gguf_detail
