// Causal attention over the paged KV cache (causal_attention.h): a FlashAttention-2 style
// tensor-core kernel for prefill chunks and a generic CUDA-core kernel for any rows. CPU twin:
// paged_prefill_attention (src/core/prefill_attention.cpp).
//
// Tensor-core kernel, one CTA per (tile of 64 MMA rows, KV head), 4 warps of 16 rows:
//   rows:    tile row r is flat row f = 64 * tile + r = t * G + g (chunk position t, head g of the
//            KV head's group), so the group's K/V are read once for all its heads and no row is
//            padding except in the last tile.
//   keys:    blocks of 64 keys (4 pages) up to the tile's last position, staged by cp.async into two
//            shared-memory stages [stage][K|V][64 keys][head_dim], 16-byte chunk c of key row k
//            stored at chunk c ^ (k & 7) (ldmatrix reads 8 rows of one chunk: 8 distinct banks).
//            Keys past the tile's last position and pages with a bad id are zero-filled, never read.
//   S = Q K^T: A = q * scale * log2(e) as hi + lo pairs of the KV type (converted once into shared
//            memory [hi|lo][64 rows][head_dim], same swizzle, read by ldmatrix), B = K by ldmatrix
//            (key rows are the MMA's columns).
//   softmax: online, log2 units, per row (lane 4g+t holds rows g and g+8 of its warp, keys 2t, 2t+1
//            of each 8-key n-tile); keys past the row's position are -inf.
//   O += P V: A = P packed from the S accumulators, B = V by ldmatrix.trans.
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>

#include "causal_attention.h"
#include "common.cuh"

namespace locks::cuda {

namespace {

using namespace detail;

// ---------------------------------------------------------------------------------------------
// Shared helpers.

// Row r's (sequence, position).
struct RowRef {
  int seq;
  int pos;
};
__device__ __forceinline__ RowRef row_ref(const CausalAttentionParams& p, int r) {
  if (p.contiguous) return {p.seq, p.pos0 + r};
  return {p.row_seq ? p.row_seq[r] : 0, p.row_pos[r]};
}

// A sequence's page range and its fault bit: pages [pbeg, pbeg + n_pages) of indices; fault is
// kStatusBadLastPageLen for a last_page_len outside 1..16 (when given). The page count is checked
// against each row's position by the caller.
struct SeqRef {
  int pbeg = 0;
  int n_pages = 0;
  uint32_t fault = 0;
};
__device__ __forceinline__ SeqRef seq_ref(const CausalAttentionParams& p, int s) {
  SeqRef r;
  if (s < 0 || s >= p.kv.batch) {
    r.fault = kStatusBadPageCount;
    return r;
  }
  r.pbeg = p.kv.indptr[s];
  r.n_pages = p.kv.indptr[s + 1] - r.pbeg;
  if (p.kv.last_page_len && r.n_pages > 0) {
    const int last = p.kv.last_page_len[s];
    if (last < 1 || last > kPageSize) r.fault = kStatusBadLastPageLen;
  }
  return r;
}

// The highest key a row at `pos` may read given n_pages pages: pos itself, or less when the pages
// stop earlier (then the row is bad). -1 when nothing is readable.
__device__ __forceinline__ int readable_limit(int pos, int n_pages) {
  const long long top = (long long)n_pages * kPageSize - 1;  // n_pages may be negative (bad indptr)
  return int(max(-1LL, min((long long)pos, top)));
}

// ---------------------------------------------------------------------------------------------
// Tensor-core kernel.

constexpr int kTcWarps = 4;
constexpr int kTcThreads = kTcWarps * 32;
constexpr int kTileRows = 16 * kTcWarps;  // MMA rows per CTA
constexpr int kKeyBlock = 64;             // keys per stage
constexpr int kBlockPages = kKeyBlock / kPageSize;

template <int D>
constexpr size_t tc_smem_bytes() {
  return size_t(6) * kKeyBlock * D * sizeof(uint16_t);  // [stage][K|V][key][D], then Q hi, Q lo [row][D]
}

__device__ __forceinline__ void cp_async16_zfill(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// Byte offset of (key row, 16-byte chunk) in one [64][D] stage array (swizzled, see the top).
template <int D>
__device__ __forceinline__ uint32_t swz(int key, int chunk) {
  return uint32_t(key * D * 2 + ((chunk ^ (key & 7)) << 4));
}

// Stage the K and V of key block kb (keys [64 kb, 64 kb + 64)) into shared memory at k_s / v_s.
// Every thread reads the block's 4 page ids itself (so all threads agree on them without a barrier)
// and copies its share of the 16-byte chunks. Keys past key_limit and pages with a bad id are
// zero-filled from the pool's base (in bounds, nothing read). Returns the first key of the first bad
// page of the block, or INT_MAX.
template <int D>
__device__ __forceinline__ int stage_block(const CausalAttentionParams& p, int h, const int32_t* table, int kb,
                                           int key_limit, uint32_t k_s, uint32_t v_s) {
  constexpr int kChunksPerRow = D / 8;
  constexpr int kChunks = kKeyBlock * kChunksPerRow;
  static_assert(kChunks % kTcThreads == 0, "whole chunks per thread");
  const uint16_t* kpool = static_cast<const uint16_t*>(p.kv.k);
  const uint16_t* vpool = static_cast<const uint16_t*>(p.kv.v);
  const int H = p.kv.n_head_kv;
  size_t page_off[kBlockPages];
  bool page_ok[kBlockPages];
  int bad_key = INT_MAX;
#pragma unroll
  for (int i = 0; i < kBlockPages; ++i) {
    const int j = kb * kBlockPages + i;  // page position in the sequence
    const int first = j * kPageSize;
    page_ok[i] = false;
    page_off[i] = 0;
    if (first <= key_limit) {  // the page is attended (and in the table: key_limit < 16 n_pages)
      const int32_t id = table[j];
      if (page_id_ok(id, p.kv.n_pages_pool)) {
        page_ok[i] = true;
        page_off[i] = (size_t(id) * H + h) * kPageSize * D;
      } else if (bad_key == INT_MAX) {
        bad_key = first;
      }
    }
  }
  static_assert((kPageSize * kChunksPerRow) % kTcThreads == 0, "a pass of the threads stays inside one page");
#pragma unroll
  for (int it = 0; it < kChunks / kTcThreads; ++it) {
    const int c = it * kTcThreads + int(threadIdx.x);
    const int key = c / kChunksPerRow, ch = c % kChunksPerRow;
    constexpr int kPassesPerPage = kPageSize * kChunksPerRow / kTcThreads;
    const int pi = it / kPassesPerPage;  // = key / 16, known at compile time (the arrays stay in registers)
    const bool valid = page_ok[pi] && kb * kKeyBlock + key <= key_limit;
    const size_t src = valid ? page_off[pi] + size_t(key % kPageSize) * D + ch * 8 : 0;
    cp_async16_zfill(k_s + swz<D>(key, ch), kpool + src, valid);
    cp_async16_zfill(v_s + swz<D>(key, ch), vpool + src, valid);
  }
  return bad_key;
}

template <int D, typename T>
__global__ void __launch_bounds__(kTcThreads) causal_tc_kernel(CausalAttentionParams p) {
  constexpr int KS = D / 16;         // k-steps of Q K^T
  constexpr int NT = D / 8;          // n-tiles of P V
  constexpr int SN = kKeyBlock / 8;  // n-tiles of S
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem_base = uint32_t(__cvta_generic_to_shared(smem));
  constexpr uint32_t kArrayBytes = kKeyBlock * D * 2;  // one [64][D] array

  const int G = p.group, H = p.kv.n_head_kv, n_head = H * G;
  const int n_flat = p.n_rows * G;
  const int n_tiles = (n_flat + kTileRows - 1) / kTileRows;
  const int tile = n_tiles - 1 - int(blockIdx.x);  // the longest tiles first
  const int h = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

  // The tile's sequence (one for the whole chunk) and key range.
  const SeqRef sq = seq_ref(p, p.seq);
  const int f_last = min(tile * kTileRows + kTileRows - 1, n_flat - 1);
  const int pos_last = p.pos0 + f_last / G;
  const int key_limit = sq.fault ? -1 : readable_limit(pos_last, sq.n_pages);
  const int32_t* table = p.kv.indices + sq.pbeg;

  // This lane's two rows (g and g + 8 of the warp): flat index, position, and the position used for
  // masking (padding rows past n_flat and rows past the readable keys take key_limit).
  int frow[2], rpos[2], mpos[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    frow[i] = tile * kTileRows + 16 * warp + g + 8 * i;
    rpos[i] = frow[i] < n_flat ? p.pos0 + frow[i] / G : key_limit;
    mpos[i] = min(rpos[i], key_limit);
  }

  // The first key of the first bad page the tile attends (INT_MAX: none); the same in every thread.
  const int n_kb = key_limit < 0 ? 0 : key_limit / kKeyBlock + 1;
  int bad_key = INT_MAX;
  if (n_kb > 0)  // the first block in flight while q is loaded
    bad_key = stage_block<D>(p, h, table, 0, key_limit, smem_base, smem_base + kArrayBytes);
  cp_async_commit_group();

  // q * scale * log2(e) as hi and lo parts of the KV type -> shared memory (swizzled as K; each warp
  // writes and reads only its own 16 rows), read back as A fragments by ldmatrix at every key block:
  // held in registers they pushed the kernel past 255 at head_dim 128.
  const uint32_t qhi_s = smem_base + 4 * kArrayBytes, qlo_s = qhi_s + kArrayBytes;
  {
    const float qmul = p.scale * kLog2e;
    const float* qrow[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int tt = frow[i] / G, gg = frow[i] % G;
      qrow[i] = frow[i] < n_flat ? p.q + (size_t(tt) * n_head + size_t(h) * G + gg) * D : nullptr;
    }
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // cols 16 kk + 2t (+1) and 16 kk + 8 + 2t (+1)
        const int col = 16 * kk + 8 * half + 2 * t;
#pragma unroll
        for (int i = 0; i < 2; ++i) {  // rows g, g + 8
          float2 v = make_float2(0.0f, 0.0f);
          if (qrow[i]) v = *reinterpret_cast<const float2*>(qrow[i] + col);
          uint32_t hi, lo;
          Pack<T>::split(v.x * qmul, v.y * qmul, hi, lo);
          const uint32_t off = swz<D>(16 * warp + g + 8 * i, 2 * kk + half) + 4 * t;
          asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(qhi_s + off), "r"(hi) : "memory");
          asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(qlo_s + off), "r"(lo) : "memory");
        }
      }
    }
  }
  __syncwarp();

  float o[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float run_m[2] = {-INFINITY, -INFINITY}, run_l[2] = {0.0f, 0.0f};  // run_l: this lane's part

  // ldmatrix lane addresses (relative to a stage array): K, matrix i = lane >> 3 is chunk 4 kk2 + i of
  // key rows 8j .. 8j + 7; V (trans), matrix i is keys 16 kk + 8 (i & 1) .. + 7 of chunk nt + (i >> 1).
  const int lrow = lane & 7, lmat = lane >> 3;

  for (int kb = 0; kb < n_kb; ++kb) {
    const int stage = kb & 1;
    const uint32_t k_s = smem_base + uint32_t(stage) * 2 * kArrayBytes, v_s = k_s + kArrayBytes;
    if (kb + 1 < n_kb) {
      const uint32_t nk = smem_base + uint32_t(stage ^ 1) * 2 * kArrayBytes;
      bad_key = min(bad_key, stage_block<D>(p, h, table, kb + 1, key_limit, nk, nk + kArrayBytes));
    }
    cp_async_commit_group();
    cp_async_wait_group<1>();  // block kb has landed (block kb + 1 may still be in flight)
    __syncthreads();

    // S = Q K^T for 64 keys (log2 units).
    // Q fragments of k-step kk: matrix i = lane >> 3 is rows 8 (i & 1) .. + 7 of chunk 2 kk + (i >> 1).
    float s[SN][4];
#pragma unroll
    for (int j = 0; j < SN; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk2 = 0; kk2 < KS / 2; ++kk2) {
      uint32_t aq[2][4], aq_lo[2][4];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const uint32_t off = swz<D>(16 * warp + 8 * (lmat & 1) + lrow, 2 * (2 * kk2 + u) + (lmat >> 1));
        ldsm_x4(aq[u], qhi_s + off);
        ldsm_x4(aq_lo[u], qlo_s + off);
      }
#pragma unroll
      for (int j = 0; j < SN; ++j) {
        uint32_t b[4];
        ldsm_x4(b, k_s + swz<D>(8 * j + lrow, 4 * kk2 + lmat));
        mma_16816(s[j], aq[0], b[0], b[1], T());
        mma_16816(s[j], aq_lo[0], b[0], b[1], T());
        mma_16816(s[j], aq[1], b[2], b[3], T());
        mma_16816(s[j], aq_lo[1], b[2], b[3], T());
      }
    }

    // Causal mask and online softmax; rows g (i = 0: c[0], c[1]) and g + 8 (i = 1: c[2], c[3]).
    const int key0 = kb * kKeyBlock + 2 * t;
    float corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < SN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[j][2 * i + e];
          if (key0 + 8 * j + e > mpos[i]) x = -INFINITY;
          mx = fmaxf(mx, x);
        }
      }
      mx = quad_max(mx);
      const float m_new = fmaxf(run_m[i], mx);  // finite: key 0 (block 0) is valid for every row
      corr[i] = exp2f(run_m[i] - m_new);        // 0 on the first block (run_m = -inf)
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < SN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[j][2 * i + e];
          x = exp2f(x - m_new);
          sum += x;
        }
      }
      run_l[i] = run_l[i] * corr[i] + sum;
      run_m[i] = m_new;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      o[nt][0] *= corr[0];
      o[nt][1] *= corr[0];
      o[nt][2] *= corr[1];
      o[nt][3] *= corr[1];
    }

    // O += P V: k-step kk covers keys 16 kk .. 16 kk + 15 (S n-tiles 2 kk, 2 kk + 1).
#pragma unroll
    for (int kk = 0; kk < kKeyBlock / 16; ++kk) {
      uint32_t ap[4];
      ap[0] = Pack<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      ap[1] = Pack<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      ap[2] = Pack<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      ap[3] = Pack<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        uint32_t b[4];
        ldsm_x4_trans(b, v_s + swz<D>(16 * kk + 8 * (lmat & 1) + lrow, nt + (lmat >> 1)));
        mma_16816(o[nt], ap, b[0], b[1], T());
        mma_16816(o[nt + 1], ap, b[2], b[3], T());
      }
    }
    __syncthreads();  // the stage is refilled by the next iteration
  }
  cp_async_wait_group<0>();

  // Rows and their faults: the sequence's last_page_len, positions past its pages, bad page ids at or
  // below the row's position (bad_key is the same in every thread: all read the same ids).
  if (threadIdx.x == 0) {
    uint32_t bits = sq.fault;
    if (!sq.fault && key_limit < pos_last) bits |= kStatusBadPageCount;
    if (bad_key != INT_MAX) bits |= kStatusBadPageId;
    if (bits) raise_status(p.status, bits);
  }
  const float l_row[2] = {quad_sum(run_l[0]), quad_sum(run_l[1])};  // (every lane, before any branch)
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (frow[i] >= n_flat) continue;
    const bool bad = sq.fault != 0 || rpos[i] > key_limit || rpos[i] >= bad_key;
    const float inv = bad ? NAN : 1.0f / l_row[i];
    const int tt = frow[i] / G, gg = frow[i] % G;
    float* dst = p.o + (size_t(tt) * n_head + size_t(h) * G + gg) * D + 2 * t;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      *reinterpret_cast<float2*>(dst + 8 * nt) = make_float2(o[nt][2 * i] * inv, o[nt][2 * i + 1] * inv);
  }
}

// ---------------------------------------------------------------------------------------------
// Generic kernel: one warp per (row, query head), 4 warps per CTA (consecutive heads: the group's
// warps share K/V through L1).

constexpr int kGenWarps = 4;
constexpr int kGenThreads = kGenWarps * 32;
constexpr int kGenMaxDim = 256;

template <bool BF16>
__device__ __forceinline__ float2 kv_pair(uint32_t w) {
  if constexpr (BF16) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
}

template <bool BF16>
__global__ void __launch_bounds__(kGenThreads) causal_generic_kernel(CausalAttentionParams p) {
  __shared__ float q_s[kGenWarps][kGenMaxDim];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int D = p.kv.head_dim, H = p.kv.n_head_kv, G = p.group, n_head = H * G;
  const long long item = (long long)blockIdx.x * kGenWarps + warp;
  if (item >= (long long)p.n_rows * n_head) return;  // (whole warps; no CTA barrier below)
  const int r = int(item / n_head), n = int(item % n_head), h = n / G;
  float* out = p.o + (size_t(r) * n_head + n) * D;

  const RowRef rr = row_ref(p, r);
  SeqRef sq = seq_ref(p, rr.seq);
  uint32_t fault = sq.fault;
  if (!fault && (rr.pos < 0 || rr.pos / kPageSize >= sq.n_pages)) fault = kStatusBadPageCount;
  if (fault) {
    for (int x = lane; x < D; x += 32) out[x] = NAN;
    if (lane == 0) raise_status(p.status, fault);
    return;
  }

  const float qmul = p.scale * kLog2e;
  const float* qg = p.q + (size_t(r) * n_head + n) * D;
  for (int x = lane; x < D; x += 32) q_s[warp][x] = qg[x] * qmul;
  __syncwarp();

  const uint32_t* kpool = static_cast<const uint32_t*>(p.kv.k);  // element pairs (D even)
  const uint32_t* vpool = static_cast<const uint32_t*>(p.kv.v);
  const int npairs = D / 2;
  // Logits: lane = 16 * half + key; half 0 sums pairs [0, hp), half 1 pairs [hp, npairs).
  const int key = lane & 15, half = lane >> 4, hp = (npairs + 1) / 2;
  const int pp0 = half * hp, pp1 = min(npairs, pp0 + hp);
  // Output: lane owns pairs lane + 32 i.
  constexpr int kPairsPerLane = kGenMaxDim / 64;
  float acc[kPairsPerLane][2];
#pragma unroll
  for (int i = 0; i < kPairsPerLane; ++i) acc[i][0] = acc[i][1] = 0.0f;
  float run_m = -INFINITY, run_l = 0.0f;
  bool bad_page = false;

  const int n_attend = rr.pos / kPageSize + 1;
  const int32_t* table = p.kv.indices + sq.pbeg;
  for (int j = 0; j < n_attend; ++j) {
    const int32_t id = table[j];
    if (!page_id_ok(id, p.kv.n_pages_pool)) {  // not read; the row becomes NaN
      bad_page = true;
      break;
    }
    const int valid = min(kPageSize, rr.pos - j * kPageSize + 1);   // >= 1
    const size_t base = (size_t(id) * H + h) * kPageSize * npairs;  // in pairs
    float part = 0.0f;
    if (key < valid) {
      const uint32_t* krow = kpool + base + size_t(key) * npairs;
      float a0 = 0.0f, a1 = 0.0f;
      for (int pp = pp0; pp < pp1; ++pp) {
        const float2 kv = kv_pair<BF16>(krow[pp]);
        a0 = fmaf(q_s[warp][2 * pp], kv.x, a0);
        a1 = fmaf(q_s[warp][2 * pp + 1], kv.y, a1);
      }
      part = a0 + a1;
    }
    float sc = part + __shfl_xor_sync(kFull, part, 16);
    if (key >= valid) sc = -INFINITY;
    float mx = sc;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    const float m_new = fmaxf(run_m, mx);  // finite: key 0 of every attended page is valid
    const float corr = exp2f(run_m - m_new);
    const float pk = exp2f(sc - m_new);  // 0 past `valid`
    float sum = pk;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(kFull, sum, o);
    run_l = run_l * corr + sum;
    run_m = m_new;
    // The page's P V apart, then one rescaled add: a long context makes one rounding into the
    // running sum per page instead of per key (~8x less accumulated float32 error at 1M keys).
    float pacc[kPairsPerLane][2];
#pragma unroll
    for (int i = 0; i < kPairsPerLane; ++i) pacc[i][0] = pacc[i][1] = 0.0f;
    for (int k = 0; k < valid; ++k) {  // rows past `valid` are never read
      const float w = __shfl_sync(kFull, pk, k);
      const uint32_t* vrow = vpool + base + size_t(k) * npairs;
#pragma unroll
      for (int i = 0; i < kPairsPerLane; ++i) {
        const int pp = lane + 32 * i;
        if (pp < npairs) {
          const float2 vv = kv_pair<BF16>(vrow[pp]);
          pacc[i][0] = fmaf(w, vv.x, pacc[i][0]);
          pacc[i][1] = fmaf(w, vv.y, pacc[i][1]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kPairsPerLane; ++i) {
      acc[i][0] = fmaf(acc[i][0], corr, pacc[i][0]);
      acc[i][1] = fmaf(acc[i][1], corr, pacc[i][1]);
    }
  }

  if (bad_page && lane == 0) raise_status(p.status, kStatusBadPageId);
  const float inv = bad_page ? NAN : 1.0f / run_l;
#pragma unroll
  for (int i = 0; i < kPairsPerLane; ++i) {
    const int pp = lane + 32 * i;
    if (pp < npairs) {
      out[2 * pp] = acc[i][0] * inv;
      out[2 * pp + 1] = acc[i][1] * inv;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

bool aligned(const void* ptr, size_t a) { return reinterpret_cast<uintptr_t>(ptr) % a == 0; }

bool tc_applies(const CausalAttentionParams& p) {
  return p.contiguous && (p.kv.head_dim == 64 || p.kv.head_dim == 128) && aligned(p.q, 8) && aligned(p.o, 8) &&
         aligned(p.kv.k, 16) && aligned(p.kv.v, 16);
}

template <int D, typename T>
cudaError_t launch_tc(const CausalAttentionParams& p, cudaStream_t stream) {
  constexpr size_t smem = tc_smem_bytes<D>();
  if constexpr (smem > 48 * 1024) {
    if (const cudaError_t e = allow_dynamic_smem<causal_tc_kernel<D, T>>(smem); e != cudaSuccess) return e;
  }
  const long long n_flat = (long long)p.n_rows * p.group;
  const unsigned n_tiles = unsigned((n_flat + kTileRows - 1) / kTileRows);
  causal_tc_kernel<D, T><<<dim3(n_tiles, unsigned(p.kv.n_head_kv)), kTcThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_generic(const CausalAttentionParams& p, cudaStream_t stream) {
  const long long items = (long long)p.n_rows * p.kv.n_head_kv * p.group;
  const unsigned grid = unsigned((items + kGenWarps - 1) / kGenWarps);
  if (p.kv.dtype == KvType::kBF16)
    causal_generic_kernel<true><<<grid, kGenThreads, 0, stream>>>(p);
  else
    causal_generic_kernel<false><<<grid, kGenThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool causal_attention_uses_tensor_cores(const CausalAttentionParams& p) {
  return p.path == CausalPath::kTensorCore || (p.path == CausalPath::kAuto && tc_applies(p));
}

cudaError_t causal_attention(const CausalAttentionParams& p, cudaStream_t stream) {
  const int D = p.kv.head_dim;
  if (p.n_rows < 0 || p.group < 1 || p.group > kMaxGroup || p.kv.n_head_kv < 1 || p.kv.n_head_kv > 65535 ||
      p.kv.batch < 1 || D < 2 || D > kGenMaxDim || D % 2 != 0 || p.kv.n_pages_pool < 0)
    return cudaErrorInvalidValue;
  if (p.n_rows == 0) return cudaSuccess;
  if (!p.q || !p.o || !p.kv.k || !p.kv.v || !p.kv.indptr || !p.kv.indices || (!p.contiguous && !p.row_pos))
    return cudaErrorInvalidValue;
  if (!aligned(p.q, 4) || !aligned(p.o, 4) || !aligned(p.kv.k, 4) || !aligned(p.kv.v, 4)) return cudaErrorInvalidValue;
  // Flat rows (n_rows * group) and work items (n_rows * n_head) are indexed in int / long long.
  if ((long long)p.n_rows * p.group > INT_MAX) return cudaErrorInvalidValue;
  if (p.contiguous && (p.seq < 0 || p.seq >= p.kv.batch || p.pos0 < 0 || (long long)p.pos0 + p.n_rows - 1 > INT_MAX))
    return cudaErrorInvalidValue;
  const bool tc = causal_attention_uses_tensor_cores(p);
  if (p.path == CausalPath::kTensorCore && !tc_applies(p)) return cudaErrorInvalidValue;
  if (!tc) return launch_generic(p, stream);
  const bool bf = p.kv.dtype == KvType::kBF16;
  if (D == 64) return bf ? launch_tc<64, __nv_bfloat16>(p, stream) : launch_tc<64, __half>(p, stream);
  return bf ? launch_tc<128, __nv_bfloat16>(p, stream) : launch_tc<128, __half>(p, stream);
}

}  // namespace locks::cuda
