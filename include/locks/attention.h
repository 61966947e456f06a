// Exact attention over pages of the paged KV cache (CPU). f16/f32 KV, float32 accumulation.
#pragma once

#include <cstdint>
#include <span>

#include "locks/kv_cache.h"

namespace locks {

/// Decode attention of one GQA group over a list of pages (the sparse step of Alg. 2, or dense when
/// `pages` lists every page). Exact softmax restricted to the listed pages, online log-sum-exp.
///   q:     [n_group][head_dim] float32 (post-RoPE)
///   pages: positions in seq.page_table (any order, each at most once: a repeated position is
///          attended twice; the last page may be partial)
///   o:     [n_group][head_dim] float32 output
///   lse:   [n_group] log-sum-exp of the scaled logits over the listed tokens (nullable)
/// An empty page list gives o = 0 and lse = -inf (never NaN). Throws std::invalid_argument when
/// page_size > 32 or page_size * head_dim > 8192 (the kernel's per-page buffers), n_group < 1, a null
/// q or o, a non-finite q or scale, or a sequence whose length does not fit its page table, and
/// std::out_of_range for a layer, KV head or page position outside the cache or sequence.
void paged_decode_attention(const PagedKvCache& cache, int il, int kv_head, const KvSequence& seq,
                            std::span<const int32_t> pages, const float* q, int n_group, float scale, float* o,
                            float* lse);

/// Causal prefill attention for `n_q` new tokens at positions [pos0, pos0 + n_q) of `seq`, whose
/// K/V are already in the cache. Blocked (flash-style online softmax over key blocks): memory is
/// O(block), never O(T^2). Parallel over (KV head, query block).
///   q:   [n_q][n_head][head_dim] float32 (post-RoPE); n_head = n_head_kv * G
///   out: [n_q][n_head][head_dim] float32
///   first_query: rows of query blocks that end before it may be skipped (their `out` rows are
///   left as they were); the blocks are the same for any value, so computed rows do not change.
/// Throws std::out_of_range for a layer, query range or page outside the cache or sequence, and
/// std::invalid_argument when n_head is not a multiple of n_head_kv, q or out is null, the scale or a
/// query row it reads is not finite (NaN/Inf, named by token, head and dim), or the sequence's length
/// does not fit its page table.
void paged_prefill_attention(const PagedKvCache& cache, int il, const KvSequence& seq, int32_t pos0, int n_q,
                             const float* q, int n_head, float scale, float* out, int first_query = 0);

}  // namespace locks
