// The attention input of one step on the GPU, fused: the Q/K/V product's rows (+ bias), RoPE on q
// and k at each row's position, q written for attention, k and v appended to the paged cache.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "locks/cuda/kernels.h"

namespace locks::cuda {

enum class RopeMode : int {
  kNormal = 0,  // llama.cpp LLAMA: pairs (2i, 2i + 1)
  kNeox = 1,    // pairs (i, i + n_rot / 2)
};

/// Launch contract: one CTA of 128 threads per row. For row r at position row_pos[r] of sequence
/// row_seq[r]: q = qkv[r][0, n_head * head_dim), k = the next n_head_kv * head_dim, v = the rest
/// (plus bias[...] when given); the first n_rot dims of each q and k head rotate by
/// pos * inv_freq[i] (the angle and its sine and cosine in float64, so positions up to 2^26 keep
/// float32 accuracy, as the CPU engine's RoPE); k and v are stored at slot pos % 16 of page
/// page_list[row_seq * page_stride + pos / 16] (f16 or bf16, round to nearest even).
/// Bad input (a position past the sequence's reserved pages, a page id outside the pool): nothing
/// stored, kStatusBadPageId. A non-finite k or v: stored, kStatusBadKeys.
struct RopeAppendParams {
  const float* qkv = nullptr;  // [n_rows][(n_head + 2 n_head_kv) head_dim]
  const float* bias = nullptr; // nullable, [(n_head + 2 n_head_kv) head_dim]
  float* q = nullptr;          // out [n_rows][n_head][head_dim]
  void* k_pool = nullptr;      // one layer's K pool [n_pages_pool][n_head_kv][16][head_dim]
  void* v_pool = nullptr;
  KvType dtype = KvType::kBF16;
  const int32_t* row_seq = nullptr;    // [n_rows]
  const int32_t* row_pos = nullptr;    // [n_rows]
  const int32_t* page_list = nullptr;  // [n_seqs][page_stride] page ids by page position
  const int32_t* n_reserved = nullptr; // nullable [n_seqs]: pages reserved (positions beyond: bad input)
  int page_stride = 0;
  int n_pages_pool = 0;
  int n_rows = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_rot = 0;
  RopeMode mode = RopeMode::kNormal;
  const double* inv_freq = nullptr;  // [n_rot / 2]
  uint32_t* status = nullptr;        // nullable
};
cudaError_t rope_append(const RopeAppendParams& p, cudaStream_t stream);

}  // namespace locks::cuda
