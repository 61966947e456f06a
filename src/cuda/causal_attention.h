// Causal attention over the paged KV cache on the GPU: the prefill attention of the whole-model
// engine (a chunk of consecutive positions of one sequence, tensor cores) and a generic CUDA-core
// fallback for any rows (decode rows of a batch, head dims other than 64/128). CPU twin:
// paged_prefill_attention (src/core/prefill_attention.cpp) for the chunk case.
//
// Layouts and conventions as include/locks/cuda/kernels.h: one layer's KV pool
// K, V [n_pages_pool][n_head_kv][16][head_dim] f16 or bf16, CSR page table (indptr, indices,
// last_page_len), queries and outputs [row][n_head_kv * group][head_dim] float32 with query head n
// using KV head n / group. The K/V of every attended position must already be in the pool (the
// engine appends a chunk's K/V before attending to it).
//
// The wrapper only enqueues work (no allocation, no host synchronisation): it can be captured in a
// CUDA graph. The tensor-core kernel needs more than 48 KB of dynamic shared memory at head_dim 128;
// the wrapper raises the kernel's limit once per device (a host call, not a stream operation, as
// paged_decode_attention does for its clusters), so call it once outside capture before capturing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "locks/cuda/kernels.h"

namespace locks::cuda {

/// Which kernel causal_attention runs.
enum class CausalPath : int {
  kAuto = 0,        // tensor cores where they apply (contiguous rows, head_dim 64 or 128), else generic
  kGeneric = 1,     // CUDA cores, float32 (any supported shape)
  kTensorCore = 2,  // mma.sync; cudaErrorInvalidValue where it does not apply
};

/// out[r][n] = softmax_j(scale * q[r][n] . k_j) . v_j over the keys j = 0 .. pos(r) (inclusive) of
/// row r's sequence, KV head n / group: exact causal softmax attention, float32 accumulation.
///
/// Rows: with `contiguous`, row r is position pos0 + r of sequence `seq` (a prefill chunk; row_seq and
/// row_pos are not read and may be null); else row r is position row_pos[r] of sequence row_seq[r]
/// (any rows in any order: decode rows of a batch, one per sequence at its last position, or
/// several chunks of different sequences).
///
/// Paths (CausalPath; kAuto picks):
///  - tensor cores (contiguous rows, head_dim 64 or 128, q and o 8-byte aligned, K/V 16-byte
///    aligned): FlashAttention-2 style. One CTA of 4 warps per (tile of 64 rows, KV head); the rows
///    of a tile are the (position, head) pairs of the KV head's group, flattened position-major
///    (row f = t * group + g: 64 / group positions, the group's K/V read once for all its heads, no
///    row wasted for any group). The CTA walks key blocks of 4 pages (64 keys) up to its last
///    row's position, staged in shared memory by cp.async, two stages; S = Q K^T and O += P V by
///    mma.m16n8k16 with f32 accumulation, online softmax in log2 units. q * scale * log2(e)
///    enters the MMA as a hi + lo pair of the KV type (two MMAs), so the logits carry ~16 (bf16) /
///    ~22 (f16) significant bits and the only rounding of note is P's to the KV type:
///    |error| <= ~u * max|v| per output (u = 2^-8 bf16, 2^-11 f16). |q * scale * log2(e)| must
///    stay below 65504 with f16 KV (else inf logits: NaN output). H200, a 4096-token first chunk,
///    8 KV heads, group 4: 0.44 ms at head_dim 64, 0.66 ms at 128 (155 and 205 TFLOP/s of causal
///    attention, the hi/lo MMAs not counted); the generic path takes 28 and 78 ms.
///  - generic: one warp per (row, query head), a page (16 keys) per step: lanes (key, half of the
///    dims) form the 16 logits, lanes own output dims for P V; float32 throughout (error ~1e-6 of
///    max|v| at 1K keys, ~5e-5 at 1M). head_dim even, 2..256; q and o 4-byte aligned, K/V 4-byte
///    aligned.
/// The K/V of every position up to a row's position must be written (finite): the tensor-core path
/// reads keys up to its tile's last position for every row of the tile and masks them, and a
/// non-finite V there would still give NaN (0 * inf) to the tile's earlier rows.
///
/// Bad input (checked on the device; never read or written out of bounds; other rows unaffected):
///  - a row whose sequence has fewer than pos / 16 + 1 pages (indptr descending included), a negative
///    position, or (not contiguous) row_seq outside [0, kv.batch): kStatusBadPageCount;
///  - its sequence's last_page_len outside 1..16 (checked when kv.last_page_len is not null; it is
///    otherwise unused, since keys past the row's position are masked): kStatusBadLastPageLen;
///  - a page id outside [0, kv.n_pages_pool) (kv.n_pages_pool 0: a negative id) among the pages the
///    row attends: kStatusBadPageId (the page is not read).
/// Such a row's output is NaN and the bit is set in *status. Non-finite q or scale are not checked
/// (NaN outputs).
///
/// Launch contract: tensor cores: grid (ceil(n_rows * group / 64), n_head_kv) x 128 threads, dynamic
/// shared memory 6 * 64 * head_dim * 2 bytes (two K/V stages and q as hi/lo: 48 KB at head_dim 64,
/// 96 KB at 128; 2 CTAs per SM at 128 by registers); tiles are launched longest (last) first.
/// Generic: grid ceil(n_rows * n_head_kv * group / 4) x 128 threads, 4 KB of static shared memory.
/// Returns the launch error, or cudaErrorInvalidValue for an unsupported shape (group outside 1..16,
/// head_dim odd or outside 2..256, n_head_kv < 1, kv.batch < 1, null pointers, misalignment,
/// contiguous with seq outside [0, kv.batch) or pos0 < 0 or pos0 + n_rows - 1 > INT_MAX, a path
/// forced where it does not apply). n_rows 0 enqueues nothing.
struct CausalAttentionParams {
  const float* q = nullptr;          // [n_rows][n_head_kv * group][head_dim] float32, post-RoPE
  PagedKvView kv;                    // one layer's pool + page table; kv.head_dim any even 2..256 here
  const int32_t* row_seq = nullptr;  // [n_rows] sequence of each row; nullable: every row is sequence 0
  const int32_t* row_pos = nullptr;  // [n_rows] position of each row (required unless contiguous)
  int n_rows = 0;
  int group = 1;               // G, 1..16
  float scale = 0.0f;          // softmax scale, usually 1 / sqrt(head_dim)
  float* o = nullptr;          // out [n_rows][n_head_kv * group][head_dim] float32
  uint32_t* status = nullptr;  // nullable: DecodeStatus bits for bad input
  // A prefill chunk: row r is position pos0 + r of sequence seq (row_seq, row_pos unused).
  bool contiguous = false;
  int32_t pos0 = 0;
  int32_t seq = 0;
  CausalPath path = CausalPath::kAuto;
};
cudaError_t causal_attention(const CausalAttentionParams& p, cudaStream_t stream);

/// Whether kAuto takes the tensor-core path for these parameters (host-side, no device call).
bool causal_attention_uses_tensor_cores(const CausalAttentionParams& p);

}  // namespace locks::cuda
