// The small per-token kernels of a Llama-family forward pass on the GPU (the matrix products are
// cuBLAS's): token embedding, RMSNorm, RoPE, bias, K/V append to the paged cache, SwiGLU, the
// f32 -> bf16 cast, and the two token pickers (argmax, temperature + top-p sampling).
// CPU twins: src/llm/session.cpp (rmsnorm, rope, SwiGLU, embedding), src/core/kv_cache.cpp
// (PagedKvCache::write), src/llm/sampler.cpp (argmax, Sampler::sample).
//
// Activations (all pointers are device memory; rows are tokens: consecutive tokens of one sequence
// in prefill, one token per sequence in decode):
//   residual stream x      [n_rows][n_embd] float32
//   GEMM inputs            bf16 (raw bits, round-to-nearest-even from float32)
//   q / k / v              [n_rows][n_heads][head_dim] float32 (GEMM outputs), optional row strides
//                          so that one fused QKV or gate/up GEMM output is read in place
//   logits                 [n_rows][logits_stride] float32
//   positions, tokens      [n_rows] int32, read on the device: one captured CUDA graph replays at
//                          every step with new values
//
// Launch contract (as kernels.h): every wrapper only enqueues work (no allocation, no host
// synchronisation: capturable in a CUDA graph) and returns the launch error (cudaGetLastError), or
// cudaErrorInvalidValue for host-side shapes or pointers it does not support (nothing is launched
// then). n_rows == 0 launches nothing and returns cudaSuccess. Bad device-side input (a token, a
// position, a page id, a logit) is never read or written out of bounds: its result is NaN, -1 or not
// written, and a bit of the optional status word is set (ModelStatus; uint32_t, atomicOr). The bits
// are disjoint from DecodeStatus, so one word can collect both.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "locks/cuda/kernels.h"

namespace locks::cuda {

/// Bits of the status word of the model kernels (disjoint from DecodeStatus).
enum ModelStatus : uint32_t {
  kStatusBadToken = 1u << 8,             // embed_rows: a token id outside [0, n_vocab) (its row is NaN)
  kStatusKvSlotOutOfRange = 1u << 9,     // append_kv: sequence or position outside the page table (not written)
  kStatusKvPageIdOutOfRange = 1u << 10,  // append_kv: a page id outside [0, n_pages_pool) (not written)
  kStatusKvNotFinite = 1u << 11,         // append_kv: a NaN/Inf key or value, or one beyond +-65504 in an
                                         // f16 pool (written as the conversion gives it)
  kStatusNanLogits = 1u << 12,           // argmax_rows / sample_rows: a NaN logit in a row (id -1)
  kStatusNoMass = 1u << 13,              // sample_rows: every logit of a row is -inf (id -1)
  kStatusBadSamplerParams = 1u << 14,    // sample_rows: a per-row temperature or top_p out of range (id -1)
};
/// "token id outside the vocabulary (embedding row NaN); ..." (empty for 0; bits that are not
/// ModelStatus are listed as "other status bits 0x..", for describe_decode_status).
std::string describe_model_status(uint32_t status);

// ----------------------------------------------------------------------------------------------
/// Token embedding: x[r] = float(table[tokens[r]]) (bf16, or float32 with f32). A token outside [0, n_vocab) gives a
/// row of NaN and kStatusBadToken (the table is not read). Launch contract: grid (column blocks, min(n_rows, 65535)) x
/// 256 threads; 16-byte loads where n_embd % 8 == 0 and table and x are 16-byte aligned.
struct EmbedParams {
  const int32_t* tokens = nullptr;  // [n_rows]
  const void* table = nullptr;      // [n_vocab][n_embd] bf16 (float32 with f32), row-major
  bool f32 = false;
  int n_vocab = 0;
  int n_embd = 0;
  int n_rows = 0;
  float* x = nullptr;          // out [n_rows][n_embd]
  uint32_t* status = nullptr;  // nullable
};
cudaError_t embed_rows(const EmbedParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// RMSNorm: out[r][i] = (x[r][i] * inv_r) * weight[i], inv_r = float(1 / sqrt(ss_r / n + eps)) with
/// the sum of squares ss_r and the square root in float64, the two products in float32: the CPU's
/// rmsnorm operation for operation (only the order of the float64 sum differs), then rounded to bf16
/// (or stored as float32 with out_f32, e.g. for the final norm).
/// Rows may come in groups (Qwen3's per-head q/k norm: a row per (token, head), the heads of a token
/// back to back, tokens group_stride elements apart, e.g. the K half of a K|V row): row r starts at
/// (r / group) * group_stride + (r % group) * n in x and in out.
/// Launch contract: one CTA of 256 threads per row (grid n_rows); 16-byte loads where n % 4 == 0,
/// group_stride % 4 == 0 and x, weight and out are aligned for them.
struct RmsNormParams {
  const float* x = nullptr;       // [n_rows / group][group_stride], row r as above
  const float* weight = nullptr;  // [n]
  int n_rows = 0;
  int n = 0;
  float eps = 1e-5f;    // >= 0
  void* out = nullptr;  // out, laid out as x: bf16, or float32 with out_f32 (may alias x then)
  bool out_f32 = false;
  int group = 1;         // rows per group, >= 1
  int group_stride = 0;  // elements between groups, >= group * n; 0: group * n (every row back to back)
};
cudaError_t rmsnorm_rows(const RmsNormParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// RoPE in place on q and k of the same rows. For pair i < n_rot / 2 of every head of row r:
/// angle = double(positions[r]) * inv_freq[i]; c = float(cos(angle)), s = float(sin(angle)) (float64
/// sin/cos, as the CPU: positions up to 2^26 keep their precision); (a, b) -> (a c - b s, a s + b c)
/// in float32 where a, b are dims (2i, 2i + 1) (kNormal, llama.cpp LLAMA) or (i, i + n_rot / 2)
/// (kNeox). Dims >= n_rot are unchanged.
/// inv_freq[i] = base^(-2i / n_rot), divided by the rope_freqs factor where the model has one
/// (Llama 3.1), computed on the host.
/// Launch contract: one thread per (row, pair) computes the angle once and rotates that pair in every
/// head of q and k; 128 threads per CTA.
enum class RopeMode : int { kNormal = 0, kNeox = 2 };  // llama.cpp's values
struct RopeParams {
  float* q = nullptr;  // [n_rows][q_stride], heads at [h * head_dim]; nullable with n_head_q 0
  int n_head_q = 0;
  int q_stride = 0;    // elements between rows; 0: n_head_q * head_dim
  float* k = nullptr;  // [n_rows][k_stride]; nullable with n_head_k 0
  int n_head_k = 0;
  int k_stride = 0;  // 0: n_head_k * head_dim
  int n_rows = 0;
  int head_dim = 0;  // even
  int n_rot = 0;     // even, 0 < n_rot <= head_dim
  RopeMode mode = RopeMode::kNormal;
  const int32_t* positions = nullptr;  // [n_rows]
  const double* inv_freq = nullptr;    // [n_rot / 2]
};
cudaError_t rope_rows(const RopeParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// y[r][i] += b[i] (Qwen2's Q/K/V biases; a fused QKV output takes its fused bias in one call).
/// Launch contract: grid (column blocks, min(n_rows, 65535)) x 256 threads.
struct AddBiasParams {
  float* y = nullptr;        // [n_rows][y_stride]
  const float* b = nullptr;  // [n]
  int n_rows = 0;
  int n = 0;
  int y_stride = 0;  // 0: n
};
cudaError_t add_bias_rows(const AddBiasParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// K/V append: row r's keys and values go to position pos = row_pos[r] of sequence
/// s = row_seq[r] (0 when row_seq is null) in one layer's paged pool, page id
/// indices[indptr[s] + pos / 16], slot pos % 16: element (h, x) at ((page * n_head_kv + h) * 16 + slot)
/// * head_dim + x of k_pool / v_pool, rounded to nearest even (f16 or bf16, PagedKvView's layout).
/// Bad input, not written: s outside [0, batch), pos < 0, pos / 16 >= the sequence's page count or
/// an entry outside indices[0, indptr[batch]) (kStatusKvSlotOutOfRange), a page id outside
/// [0, n_pages_pool) (kStatusKvPageIdOutOfRange). A key or value that is NaN/Inf, or beyond the f16
/// range in an f16 pool (the CPU cache refuses both), is written as the conversion gives it (the
/// decode kernels carry NaN through) and sets kStatusKvNotFinite.
/// Two rows writing one slot write it in an unspecified order.
/// Launch contract: one CTA of 128 threads per row (grid n_rows); 16-byte loads where head_dim,
/// the strides and the pointers allow.
struct AppendKvParams {
  const float* k = nullptr;  // [n_rows][k_stride], head h at [h * head_dim]
  const float* v = nullptr;  // [n_rows][v_stride]
  int k_stride = 0;          // 0: n_head_kv * head_dim
  int v_stride = 0;
  int n_rows = 0;
  int n_head_kv = 0;
  int head_dim = 0;                  // even
  const int32_t* row_seq = nullptr;  // [n_rows] sequence of each row, nullable (all rows sequence 0)
  const int32_t* row_pos = nullptr;  // [n_rows] token position in its sequence
  int batch = 1;                     // sequences in the page table
  const int32_t* indptr = nullptr;   // [batch + 1]
  const int32_t* indices = nullptr;  // [indptr[batch]] page ids
  int n_pages_pool = 0;              // >= 1
  void* k_pool = nullptr;            // [n_pages_pool][n_head_kv][16][head_dim] of this layer
  void* v_pool = nullptr;
  KvType dtype = KvType::kF16;
  uint32_t* status = nullptr;  // nullable
};
cudaError_t append_kv(const AppendKvParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// SwiGLU: out[r][i] = bf16(g / (1 + expf(-g)) * up[r][i]) (float32 with out_f32) with g = gate[r][i], in float32 as
/// the CPU computes it (expf and an IEEE division). gate and up may be the two halves of one fused [n_rows][2 n_ff]
/// GEMM output (gate = base, up = base + n_ff, both strides 2 n_ff). Launch contract: grid (column blocks, min(n_rows,
/// 65535)) x 256 threads.
struct SwigluParams {
  const float* gate = nullptr;  // [n_rows][gate_stride]
  const float* up = nullptr;    // [n_rows][up_stride]
  int gate_stride = 0;          // 0: n_ff
  int up_stride = 0;            // 0: n_ff
  int n_rows = 0;
  int n_ff = 0;
  void* out = nullptr;  // out [n_rows][n_ff] bf16 (float32 with out_f32)
  bool out_f32 = false;
};
cudaError_t swiglu_rows(const SwigluParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// out[i] = bf16(in[i]), round to nearest even (NaN stays NaN, overflow gives +-inf), n elements.
/// Launch contract: a grid-stride loop, at most 4096 CTAs of 256 threads.
cudaError_t f32_to_bf16(const float* in, void* out, size_t n, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// Greedy pick: ids[r] = the index of row r's largest logit, ties to the lower index (the CPU's
/// argmax; the first +inf if any; a row of -inf gives 0). A NaN anywhere in the row gives -1 and
/// kStatusNanLogits.
/// Launch contract: one CTA of 512 threads per row (grid n_rows). H200: 10 us for rows of 128256.
struct ArgmaxParams {
  const float* logits = nullptr;  // [n_rows][logits_stride]
  int n_rows = 0;
  int n_vocab = 0;
  int logits_stride = 0;   // 0: n_vocab
  int32_t* ids = nullptr;  // out [n_rows]
  uint32_t* status = nullptr;
};
cudaError_t argmax_rows(const ArgmaxParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// Temperature + top-p (nucleus) sampling, one token per row, Sampler::sample's semantics:
///   - a NaN logit: -1, kStatusNanLogits; every logit -inf: -1, kStatusNoMass;
///   - temperature 0: argmax_rows' pick;
///   - any +inf logit: uniform among the +inf logits (the softmax's limit);
///   - else p_i ~ exp((l_i - max) / T); the nucleus = the tokens whose strictly more probable
///     tokens hold less than top_p of the mass (the smallest set of most probable tokens reaching
///     top_p, where tokens of equal probability at the boundary are kept as a group: the CPU keeps
///     the lower ids of the group first), and the token is drawn from the nucleus in proportion to p_i.
/// Masses are integers: d_i = (max - l_i) * log2(e) / T in float32 and p_i = 2^-d_i scaled to 2^40 at
/// the max and rounded (~1e-7 relative of the CPU's float64 p_i): sums are exact and independent of
/// the order, so the result is deterministic. A token less than ~1e-12 as probable as the top one is
/// never drawn, and the nucleus boundary can differ from the CPU's where the cumulative mass comes
/// within ~1e-7 of top_p.
/// Randomness: Philox-4x32-10 keyed by the seed (seeds[r], else seed), counter (step, row, draw)
/// with step = counters[r] (row 0 in place of r with per-row seeds, so that a sequence's stream does
/// not depend on its slot in the batch); the kernel adds 1 to counters[r] at every launch (NaN rows,
/// greedy rows included), so graph replays draw new numbers and a (seed, step) pair always gives
/// the same token. counters null: step 0 at every launch.
/// Method (no sort, no threshold search; FlashInfer's rejection form of top-p): a pass for the max,
/// NaN, +inf count and argmax; a pass for the total mass (and per-slot masses of 16384 logits); then
/// draw x from the current set S (first: every token) by inverse CDF in index order (the slot from
/// the slot masses, then one re-read of it with block prefix sums), and one pass for the mass of the
/// tokens strictly more probable than x: below top_p of the total, x is in the nucleus and is the
/// token; else S becomes those tokens (a superset of the nucleus) and x is drawn again from S. The
/// accepted x is distributed exactly as the renormalised nucleus. Typically 3 reads of the row (2 with
/// top_p = 1); more rounds where most of the mass lies outside the nucleus (each rejection removes in
/// expectation half of S's tokens: about log2(V) rounds for a flat distribution and a tiny top_p);
/// after 64 rejections (odds below 2^-40 even then) the argmax, which is always in the nucleus.
/// Launch contract: one CTA of 512 threads per row (grid n_rows), ~2.4 KB of static shared memory.
/// H200, 128256 logits a row, 1 / 64 rows: 28 / 29 us at top_p 1, 40 / 62 us at top_p 0.9 (one SM
/// reads a row; a radix select of the threshold with shared-memory histograms took 1.3 ms).
struct SampleParams {
  const float* logits = nullptr;  // [n_rows][logits_stride]
  int n_rows = 0;
  int n_vocab = 0;
  int logits_stride = 0;                // 0: n_vocab
  float temperature = 1.0f;             // finite, >= 0 (host-checked)
  float top_p = 1.0f;                   // (0, 1] (host-checked)
  const float* temperatures = nullptr;  // [n_rows] per-row temperature in place of `temperature`, nullable
  const float* top_ps = nullptr;        // [n_rows] per-row top_p, nullable
  uint64_t seed = 0;
  const uint64_t* seeds = nullptr;  // [n_rows] per-row seeds in place of `seed`, nullable
  uint64_t* counters = nullptr;     // [n_rows] steps, read and incremented; nullable
  int32_t* ids = nullptr;           // out [n_rows]
  uint32_t* status = nullptr;       // nullable
};
cudaError_t sample_rows(const SampleParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// Benchmark weights: dst[i] = bf16((2u - 1) * amp), u uniform in [0, 1) from a hash of (seed, i);
/// fill_f32: dst[i] = v. Grid-stride loops.
cudaError_t fill_uniform_bf16(void* dst, size_t n, float amp, uint64_t seed, cudaStream_t stream);
cudaError_t fill_f32(float* dst, size_t n, float v, cudaStream_t stream);

/// The generator of sample_rows, on the host (tests check it against Random123's known answers):
/// Philox-4x32-10 of counter words c[0..3] under key k[0..1].
void philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

}  // namespace locks::cuda
