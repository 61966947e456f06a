// Eq. 4 on the GPU: the score of every page from its summary alone, for the whole GQA group from
// one read of each summary. CPU twin: PageSummaryStore::score (and exact_log_mass for the partial
// recent page, as LocksSelector::select does).
//
// Per page and query head g, with q'' = q * 127 / max|q| split into two int8 limbs
// (q'' = l0 + l1/254, |error| <= 1/508, i.e. 16 bits of max|q|) and kq = scale * log2(e) * max|q| / 127:
//   W[g][k] = kq * bs_k * sum_x q''_g[x] Vcode_k[x]     int8 tensor cores (m16n8k32, exact int32)
//   a[g]    = ms * sum_x q''_g[x] mucode[x]             int8 tensor cores, 8 pages per MMA
//   x[g][i] = cs_i * sum_k W[g][k] Ccode[i][k]          f16 tensor cores (m16n8k16: W hi | W lo in K)
//   s_hat   = kq * a[g] + log2 sum_i exp2(x[g][i])      (log2 units; stored times ln 2)
// x is the token's logit minus the page's centroid logit, so the sum needs no max shift unless a
// logit lies ~127 log2-units from its page mean (then that octet is redone with a shift).
// The basis codes are stored offset-binary (code + 8), so `w & 0x0f0f0f0f` and `(w >> 4) & 0x0f0f0f0f`
// are u8 MMA operands; the offset contributes 8 * sum_x l[x], subtracted exactly in int32.
// MMA rows are heads: G <= 8 puts limb 0 in rows 0..7 and limb 1 in rows 8..15 (one MMA per k-step);
// 8 < G <= 16 puts heads in rows and runs one MMA per limb. The two limbs' int32 sums combine exactly
// as 254 * sum(l0) + sum(l1) (|.| < 2^30), one conversion to float, with 1/254 folded into kq.
//
// K permutation (the d dimension): lane 4g+t owns dims [t*d/4, (t+1)*d/4); k-step kk covers
// t*d/4 + 8kk + {0,2,4,6} (K slots 4t..4t+3) and + {1,3,5,7} (K slots 16+4t..16+4t+3), which is the
// nibble order of one 32-bit word of basis codes and the stored order of the centroid codes.
//
// Memory pipeline: the CTA's warps walk octets (8 consecutive pages) of its chunk. G <= 8: the octets
// go through a ring of shared-memory slots, one bulk copy per record (pages past the sequence or with a
// bad id are not copied; their stale slot data is computed and dropped); G > 8: two private stages
// per warp filled with cp.async (16-byte pieces, zero fill past the sequence). The next octets are in
// flight while the current one is computed; page ids are loaded two of the warp's copies ahead.
#include <algorithm>
#include <cfloat>
#include <cmath>

#include "common.cuh"
#include "kernels_internal.h"
#include "record_layout.h"

namespace locks::cuda {

namespace {

using namespace detail;
namespace L = layout;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// Two octet pipelines, each the faster one for its groups (docs/cuda-design.md, the score pass):
//  - G <= 8 (memory-bound): a ring of octet slots shared by the CTA's warps, as many slots as fit
//    beside the static shared memory at MB CTAs per SM (228 KB per SM, 1 KB reserved per CTA), at
//    most 16; d = 128: 10 slots, so ~6 octets stay in flight while the 4 warps compute 4.
//  - G = 16 (twice the compute per record): two private stages per warp.
template <int GT>
__host__ __device__ constexpr bool use_ring() {
  return GT <= 8;
}
template <int D, int GT, int MB>
__host__ __device__ constexpr int ring_slots() {
  const int per_cta = 228 * 1024 / MB - 1024 - (GT * D * 4 + 2048);  // static: q, per-head state, barriers
  const int n = per_cta / (8 * int(L::record_bytes(D)));
  return !use_ring<GT>() ? 2 * kWarps : n > 16 ? 16 : n;
}
template <int D, int GT, int MB>
constexpr int score_smem_bytes() {
  return ring_slots<D, GT, MB>() * 8 * int(L::record_bytes(D));
}

// Balanced items (ScoreParams::balance_chunks). Sequence b gets a_b chunks per KV head, about in
// proportion to its pages: a_b = 1 + floor(n_b * (S - B) / sum n), capped at n_chunks and at one per
// 32 pages, where S = grid / n_head_kv; so sum a_b <= S (one item per CTA; S < B: a_b = 1) and one
// long sequence among short ones is spread over the whole grid instead of over its equal share of
// CTAs. With B > 1 a sequence with a bad page count counts as empty here (its one item reports the
// fault); one sequence alone takes min(n_chunks, S) chunks, a bad one reporting from each.
__device__ __forceinline__ int pages_for_balance(const ScoreParams& p, int b) {
  return balance_pages(p.kv.indptr[b + 1] - p.kv.indptr[b], p.log_mass_stride);
}
__device__ __forceinline__ int balanced_chunks(const ScoreParams& p, int n, long long total, int spare) {
  return proportional_slots(n, total, spare, min(p.n_chunks, max(1, (n + 31) / 32)));
}
// One sequence needs no page counts: a = 1 + spare (capped; chunks past its pages are empty items), so
// batch 1 starts without the page-table round trip.
__device__ __forceinline__ int single_sequence_chunks(const ScoreParams& p, int spare) {
  return min(p.n_chunks, max(1, 1 + spare));
}
// Called by every lane of a warp: (sum over sequences of n_b, sum of a_b * H items).
__device__ __forceinline__ void balance_totals(const ScoreParams& p, int spare_or_neg, long long* total, int* items) {
  const int B = p.kv.batch, H = p.kv.n_head_kv;
  if (B == 1) {
    *total = 0;  // unused
    *items = single_sequence_chunks(p, spare_or_neg) * H;
    return;
  }
  const long long t = batch_sum<long long>(B, [&](int b) { return (long long)pages_for_balance(p, b); });
  *total = t;
  *items = batch_sum<int>(B, [&](int b) { return balanced_chunks(p, pages_for_balance(p, b), t, spare_or_neg) * H; });
}
// The balanced item `item`: its sequence b, its first item `start` and its chunk count a (every lane).
__device__ __forceinline__ void balanced_item(const ScoreParams& p, int item, long long total, int spare, int* b_out,
                                              int* start_out, int* a_out) {
  const int H = p.kv.n_head_kv;
  if (p.kv.batch == 1) {
    *b_out = 0;
    *start_out = 0;
    *a_out = single_sequence_chunks(p, spare);
    return;
  }
  int width = 0;
  *b_out = -1;
  find_slot_range(
      item, p.kv.batch, [&](int b) { return balanced_chunks(p, pages_for_balance(p, b), total, spare) * H; }, b_out,
      start_out, &width);
  *a_out = width / H;
}

template <int D, int GT, int MB>
__global__ void __launch_bounds__(kThreads, MB) score_kernel(ScoreParams p) {
  constexpr int KS = D / 32;    // int8 k-steps (32 dims each)
  constexpr int ROWS = GT / 8;  // MMA rows per lane that are real heads (1 or 2)
  constexpr int REC = int(L::record_bytes(D));
  constexpr int CPR = REC / 16;  // 16-byte chunks per record

  constexpr bool kRing = use_ring<GT>();
  constexpr int R = ring_slots<D, GT, MB>();
  static_assert(R > kWarps, "the ring must hold more octets than the warps compute");
  extern __shared__ __align__(16) uint8_t ring[];  // [R][8][REC]; private stages: slot 2 warp + (k & 1)
  // Ring: a slot's phase completes with one arrival (the filling warp's lane 0, which arms it with the
  // octet's byte count) plus the bytes of its records' bulk copies, one per record; slot_use holds the
  // use last issued into the slot (published by the filling warp, awaited by the consumer).
  __shared__ __align__(8) uint64_t full[kRing ? R : 1];  // ring: slot barriers
  __shared__ uint32_t slot_use[kRing ? R : 1];           // ring: the use whose copy was issued last per slot
  __shared__ float q_s[GT][D];                           // the partial page's exact scores only
  __shared__ float ex_logit[GT][16];
  __shared__ float ex_s2[GT];
  __shared__ float warp_m[kWarps][GT], warp_l[kWarps][GT];
  __shared__ int last_flag;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int H = p.kv.n_head_kv, G = p.group;
  const int n_chunks = p.n_chunks;
  // Balanced: chunk counts per sequence from the page table (after the PDL wait, below).
  const int spare = int(gridDim.x) / H - p.kv.batch;
  long long bal_total = 0;
  int n_items = p.kv.batch * H * n_chunks;

  const uint32_t ring_s = uint32_t(__cvta_generic_to_shared(ring));
  const uint32_t full_s = uint32_t(__cvta_generic_to_shared(full));
  const uint32_t slot_use_s = uint32_t(__cvta_generic_to_shared(slot_use));
  if (kRing && threadIdx.x < R) {
    mbar_init(full_s + 8 * threadIdx.x, 1);
    slot_use[threadIdx.x] = ~0u;
    fence_mbarrier_init();  // the bulk copies complete bytes on these barriers through the async proxy
  }
  __syncthreads();
  uint32_t uses = 0;  // octets this CTA has put through the ring: octet i of an item is use uses + i

  // The records stream through once per step; the log-masses stay in the L2 for the share kernel.
  const uint64_t rec_policy = l2_evict_first(), lm_policy = l2_evict_last();
  pdl_wait();
  pdl_launch_dependents();

  // A fragments of q and per-row constants, rebuilt when the (sequence, KV head) changes.
  uint32_t aq[KS][4];                   // GT 8: rows g = limb 0, g+8 = limb 1; GT 16: limb 0 of rows g, g+8
  uint32_t aq2[ROWS == 2 ? KS : 1][4];  // GT 16: limb 1 of rows g, g+8
  int off0[ROWS], off1[ROWS];
  float kq[ROWS];
  long cur_bh = -1;

  if (p.balance_chunks) balance_totals(p, spare, &bal_total, &n_items);

  // Persistent CTAs walk the work items (sequence, KV head, chunk of pages) round-robin.
  for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
    __syncthreads();  // the previous item's shared-memory use is over
    // Items interleave (sequence, KV head) pairs: with a grid that is a multiple of batch * n_head_kv
    // a CTA's next item (about `grid` later) is usually the same pair, so q stays in registers.
    // Balanced: sequence b's items are a_b chunks of each head, heads interleaved likewise.
    int b, h, c, n_chunks_b = n_chunks;
    if (p.balance_chunks) {
      int start = 0;
      balanced_item(p, item, bal_total, spare, &b, &start, &n_chunks_b);
      h = (item - start) % H;
      c = (item - start) / H;
    } else {
      const int n_bh = p.kv.batch * H;
      b = (item % n_bh) / H;
      h = (item % n_bh) % H;
      c = item / n_bh;
    }
    const size_t bh = size_t(b) * H + h;
    const int pbeg = p.kv.indptr[b];
    const int n_pages = p.kv.indptr[b + 1] - pbeg;
    const int last_len = p.kv.last_page_len[b];
    const uint32_t fault = sequence_fault(
        n_pages, last_len, p.balance_chunks ? p.log_mass_stride : min(p.log_mass_stride, n_chunks * p.chunk_pages));
    // [b][h][row][chunk]: a warp of the merges below reads one head row's chunks contiguously.
    auto chunk_stat = [&](int r) -> float2& {
      return reinterpret_cast<float2*>(p.chunk_stats)[(bh * 16 + r) * n_chunks + c];
    };
    // Item 0 alone: the statistics of chunks [from, n_chunks), every head row, set to v.
    auto fill_chunk_stats = [&](int from, float2 v) {
      for (int e = threadIdx.x; e < (n_chunks - from) * G; e += kThreads)
        reinterpret_cast<float2*>(p.chunk_stats)[(bh * 16 + e % G) * n_chunks + from + e / G] = v;
    };
    // Balanced: the statistics of chunks this pass has no item for are empty (the merges read n_chunks;
    // with ready, item 0 writes them below, with those of the pair's idle items).
    if (p.balance_chunks && c == 0 && !p.ready) fill_chunk_stats(n_chunks_b, make_float2(-INFINITY, 0.0f));
    // ScoreParams::ready: a pair is published by its last active item, or, for bad input or an
    // empty sequence, by item 0, which then writes every chunk's statistics itself. Nothing of a pair
    // is written after it is published (the select that reads it need not wait for this grid, so a
    // late write could land in the next step): the other items leave those statistics alone.
    if (fault || n_pages == 0) {  // bad input: NaN; an empty sequence: no shares to normalise
      if (c == 0 && int(threadIdx.x) < G) p.lse_total[bh * G + threadIdx.x] = fault ? NAN : -INFINITY;
      if (c == 0 && threadIdx.x == 0 && fault) raise_status(p.status, fault);
      if (!p.ready && int(threadIdx.x) < G)
        chunk_stat(threadIdx.x) = fault ? make_float2(NAN, NAN) : make_float2(-INFINITY, 0.0f);
      if (p.ready && c == 0) {
        fill_chunk_stats(0, fault ? make_float2(NAN, NAN) : make_float2(-INFINITY, 0.0f));
        publish_ready(p.ready + bh);
      }
      continue;
    }
    const bool partial = last_len < kPageSize;
    const int n_scored = partial ? n_pages - 1 : n_pages;  // pages scored from summaries
    // Balanced: chunks of a multiple of 32 pages, n_chunks_b of them at most.
    const int chunk_pages =
        p.balance_chunks ? max(32, (n_scored + 32 * n_chunks_b - 1) / (32 * n_chunks_b) * 32) : p.chunk_pages;
    const int active = max(1, (n_scored + chunk_pages - 1) / chunk_pages);
    // Every item writes its chunk's statistics (an empty chunk: no mass), so that select_pages can
    // merge them after any pass. Deferred: lse_total is NaN until select_pages writes it, so that a
    // select without the statistics fails loudly (n_selected = -1) instead of using a stale value.
    if (p.defer_lse_total && c == 0 && int(threadIdx.x) < G) p.lse_total[bh * G + threadIdx.x] = NAN;
    // ScoreParams::ready: item 0 (always active) writes the empty chunks' statistics instead of their
    // own items, before the pair can be published.
    if (p.ready && c == 0) fill_chunk_stats(active, make_float2(-INFINITY, 0.0f));
    if (c >= active) {
      if (!p.ready && int(threadIdx.x) < G) chunk_stat(threadIdx.x) = make_float2(-INFINITY, 0.0f);
      continue;
    }

    // ---- Octet i (of this item) is computed by warp i % 4. Ring: it goes to slot (uses + i) % R and
    // the warp refills that slot with octet i + R once done, so about R - 4 octets are in flight
    // while the warps compute. Private stages: the warp copies its next octet into its other stage
    // before computing this one. Page ids are loaded two of the warp's copies ahead: one octet's
    // compute is shorter than an id load under the records' traffic (ncu: the copies stalled on them).
    const uint8_t* recs = p.summaries + size_t(h) * p.n_pages_pool * REC;
    const int32_t* idx = p.kv.indices + pbeg;
    const int oct_begin = c * (chunk_pages / 8);
    const int n_oct = min(oct_begin + chunk_pages / 8, (n_scored + 7) / 8) - oct_begin;
    // A page id outside the pool is never read (G <= 8: not copied; G > 8: a zero record) and makes the
    // sequence's lse_total NaN. It is checked where the copy is issued, long after its load (a check at
    // the load would stall every octet on it).
    bool bad_id = false;
    auto load_ids = [&](int i) -> int32_t {  // lane p < 8: page id of page p of octet i (0 past the end)
      const int pos = (oct_begin + i) * 8 + (lane & 7);
      return (i < n_oct && pos < n_scored) ? __ldcg(idx + pos) : 0;
    };
    auto issue = [&](int i, int32_t ids, uint32_t slot) {  // the warp copies octet i into a slot
      if (i < n_oct) {
        // Ring: publish the use number first (a consumer that sees it knows the slot's previous phase
        // is complete: a refill follows this warp's own wait for it, the fill follows the item's
        // __syncthreads), so its parity wait is valid. Before the copies, so that the release orders
        // none of them.
        if (kRing && lane == 0) publish_use(slot_use_s + 4 * slot, uses + uint32_t(i));
        const uint32_t dst0 = ring_s + slot * uint32_t(8 * REC);
        const bool in = (oct_begin + i) * 8 + (lane & 7) < n_scored;  // once per octet: lane p has page p
        const bool ok = in && page_id_ok(ids, p.n_pages_pool);
        bad_id |= in && !ok;
        if constexpr (kRing) {
          // Lane p < 8 copies page p's record; a page past the end or with a bad id is not copied.
          const unsigned copy = __ballot_sync(kFull, ok) & 0xffu;
          if (lane == 0) mbar_arrive_expect_tx(full_s + 8 * slot, uint32_t(__popc(copy)) * uint32_t(REC));
          __syncwarp();
          if (lane < 8 && ok)
            bulk_copy(dst0 + uint32_t(lane * REC), recs + size_t(ids) * REC, uint32_t(REC), full_s + 8 * slot,
                      rec_policy);
        } else {
          const int32_t ids_ok = ok ? ids : -1;
#pragma unroll
          for (int pp = 0; pp < 8; ++pp) {
            const int32_t id = __shfl_sync(kFull, ids_ok, pp);
            const uint8_t* src = recs + size_t(max(id, 0)) * REC;
#pragma unroll
            for (int ch = lane; ch < CPR; ch += 32)
              cp_async16(dst0 + uint32_t(pp * REC + ch * 16), src + ch * 16, id >= 0, rec_policy);
          }
        }
      }
      if constexpr (!kRing) cp_async_commit();  // empty past the end: wait_group<1> then still waits for this octet
    };
    // q's loads go out first, so that their latency overlaps the page ids' and the records'. Lane
    // 4g+t quantizes dims [t*D/4, (t+1)*D/4) of head rows g (and g+8): the dims of its own A fragments.
    const bool new_q = long(bh) != cur_bh;
    constexpr int QL = D / 4;  // dims per lane and row
    float4 qv[ROWS][QL / 4];
    if (new_q) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int row = g + 8 * r;
        const float4* src = reinterpret_cast<const float4*>(p.q + (bh * G + row) * D + t * QL);
#pragma unroll
        for (int i = 0; i < QL / 4; ++i) qv[r][i] = row < G ? src[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
    constexpr int kAhead = kRing ? R : kWarps;  // octet i's copy is issued with octet i - kAhead's compute
    if constexpr (kRing) {
      constexpr int F = (R + kWarps - 1) / kWarps;  // the initial fill: octets warp, warp + 4, ... < R
      int32_t fill[F];
#pragma unroll
      for (int f = 0; f < F; ++f) fill[f] = warp + kWarps * f < R ? load_ids(warp + kWarps * f) : 0;
#pragma unroll
      for (int f = 0; f < F; ++f)
        if (warp + kWarps * f < R) issue(warp + kWarps * f, fill[f], (uses + uint32_t(warp + kWarps * f)) % R);
    } else {
      issue(warp, load_ids(warp), 2 * warp);
    }
    int32_t ids_next = load_ids(warp + kAhead), ids_after = load_ids(warp + kWarps + kAhead);

    // The partial recent page: exact log-mass from its keys (CPU: exact_log_mass), by the CTA of the
    // last chunk, the shortest, so that no CTA with a full chunk waits for it.
    const bool do_exact = partial && c == active - 1;
    if (do_exact) {
      for (int e = threadIdx.x; e < GT * D; e += kThreads) q_s[e / D][e % D] = e / D < G ? p.q[bh * G * D + e] : 0.0f;
      __syncthreads();
      int32_t id = idx[n_pages - 1];
      if (!page_id_ok(id, p.n_pages_pool)) {
        bad_id = true;  // its keys are not read (page 0's are instead)
        id = 0;
      }
      const uint16_t* kp = static_cast<const uint16_t*>(p.kv.k) + (size_t(id) * H + h) * size_t(kPageSize) * D;
      const bool bf16 = p.kv.dtype == KvType::kBF16;
      for (int e = threadIdx.x; e < last_len * G; e += kThreads) {
        const int i = e / G, r = e % G;
        const uint4* row = reinterpret_cast<const uint4*>(kp + size_t(i) * D);
        float acc = 0.0f;
        uint4 kr[D / 8];  // the token's key, all loads in flight at once
#pragma unroll
        for (int x8 = 0; x8 < D / 8; ++x8) kr[x8] = __ldcg(row + x8);
#pragma unroll
        for (int x8 = 0; x8 < D / 8; ++x8) {
          const uint4 v = kr[x8];
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const uint32_t u = u4_word(v, w);
            acc = fmaf(q_s[r][x8 * 8 + 2 * w], kv_to_float(uint16_t(u & 0xffffu), bf16), acc);
            acc = fmaf(q_s[r][x8 * 8 + 2 * w + 1], kv_to_float(uint16_t(u >> 16), bf16), acc);
          }
        }
        ex_logit[r][i] = acc * p.scale * kLog2e;
      }
    }
    __syncthreads();
    if (do_exact && threadIdx.x < G) {
      const int r = threadIdx.x;
      float mx = -INFINITY;
      for (int i = 0; i < last_len; ++i) mx = fmaxf(mx, ex_logit[r][i]);
      float sum = 0.0f;
      for (int i = 0; i < last_len; ++i) sum += exp2f(ex_logit[r][i] - mx);
      const float s2 = mx + log2f(sum);
      ex_s2[r] = s2;
      p.log_mass[(bh * G + r) * p.log_mass_stride + (n_pages - 1)] = s2 * kLn2;
    }

    if (new_q) {
      cur_bh = long(bh);
      // ---- q of the group -> int8 limbs (A fragments) and per-row constants, all in registers: the
      // quad of lanes 4g..4g+3 holds row g whole (no shared-memory round trip, no barriers). ----
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < QL / 4; ++i)
          amax = fmaxf(fmaxf(amax, fmaxf(fabsf(qv[r][i].x), fabsf(qv[r][i].y))),
                       fmaxf(fabsf(qv[r][i].z), fabsf(qv[r][i].w)));
        amax = quad_max(amax);
        const float mul = amax > 0.0f ? 127.0f / amax : 0.0f;
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {  // dims t*QL + 8kk + j, j < 8
          int l[2][8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float4 v4 = qv[r][(8 * kk + j) / 4];
            const float v = ((j & 3) == 0 ? v4.x : (j & 3) == 1 ? v4.y : (j & 3) == 2 ? v4.z : v4.w) * mul;
            const float f0 = rintf(v);
            l[0][j] = int(f0);
            l[1][j] = int(rintf((v - f0) * 254.0f));
            s0 += l[0][j];
            s1 += l[1][j];
          }
          // Limb packs (A: dims +{0,2,4,6}, B: +{1,3,5,7}); G <= 8: rows 0..7 limb 0, rows 8..15
          // limb 1; G > 8: limb 0 in aq, limb 1 in aq2, rows g and g+8.
          const uint32_t a0 = pack_s8x4(l[0][0], l[0][2], l[0][4], l[0][6]);
          const uint32_t b0 = pack_s8x4(l[0][1], l[0][3], l[0][5], l[0][7]);
          const uint32_t a1 = pack_s8x4(l[1][0], l[1][2], l[1][4], l[1][6]);
          const uint32_t b1 = pack_s8x4(l[1][1], l[1][3], l[1][5], l[1][7]);
          if constexpr (ROWS == 1) {
            aq[kk][0] = a0;
            aq[kk][1] = a1;
            aq[kk][2] = b0;
            aq[kk][3] = b1;
          } else {
            aq[kk][r] = a0;
            aq[kk][2 + r] = b0;
            aq2[kk][r] = a1;
            aq2[kk][2 + r] = b1;
          }
        }
        // Offset corrections (8 * limb sums over the row, in the combined int forms) and the logit factor.
        s0 += __shfl_xor_sync(kFull, s0, 1);
        s1 += __shfl_xor_sync(kFull, s1, 1);
        s0 += __shfl_xor_sync(kFull, s0, 2);
        s1 += __shfl_xor_sync(kFull, s1, 2);
        off0[r] = 8 * s0;
        off1[r] = 8 * s1;
        kq[r] = mul > 0.0f ? p.scale * kLog2e / (254.0f * mul) : 0.0f;
      }
    }

    float run_m[ROWS], run_l[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      run_m[r] = -INFINITY;
      run_l[r] = 0.0f;
    }
    float* lm_row0 = p.log_mass + (bh * G + g) * p.log_mass_stride;
    float* lm_row1 = p.log_mass + (bh * G + (ROWS == 2 ? g + 8 : g)) * p.log_mass_stride;

    for (int i = warp, k = 0; i < n_oct; i += kWarps, ++k) {
      const int32_t ids_later = load_ids(i + 2 * kWarps + kAhead);
      uint32_t slot;
      if constexpr (kRing) {
        const uint32_t use = uses + uint32_t(i);
        slot = use % R;
        // The consumer of octet i + R is usually another warp than the one that computed octet i: it
        // must not test the parity of its phase while the phase before is still incomplete (an
        // mbarrier answers parity queries only for its current and previous phase), so it first
        // waits until the copy of this use has been issued.
        if (lane == 0)
          while (read_use(slot_use_s + 4 * slot) != use) __nanosleep(32);
        __syncwarp();  // orders the other lanes after lane 0's acquire
        mbar_wait(full_s + 8 * slot, (use / R) & 1u);
        __syncwarp();  // the lanes left their waits one by one; the MMAs below need the whole warp
      } else {
        slot = 2 * warp + (k & 1);
        issue(i + kWarps, ids_next, slot ^ 1u);
        cp_async_wait<1>();
        __syncwarp();
      }
      const uint8_t* st = ring + slot * size_t(8 * REC);
      const int p0 = (oct_begin + i) * 8;

      // cen[r][e] = q''_row . mucode of page 2t+e: pages are the MMA's columns, so lane 4g+t already
      // holds the pages whose totals it will own after the butterfly below.
      float cen[ROWS][2];
      {
        int acc1[4] = {0, 0, 0, 0}, acc2[4] = {0, 0, 0, 0};
        const uint4* cp = reinterpret_cast<const uint4*>(st + g * REC + L::centroid_offset(D) + t * (D / 4));
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
          const uint4 v = cp[kk / 2];
          const uint32_t b0 = u4_word(v, (kk % 2) * 2), b1 = u4_word(v, (kk % 2) * 2 + 1);
          mma_s8s8(acc1, aq[kk], b0, b1);
          if constexpr (ROWS == 2) mma_s8s8(acc2, aq2[kk], b0, b1);
        }
        if constexpr (ROWS == 1) {
          cen[0][0] = float(acc1[0] * 254 + acc1[2]);
          cen[0][1] = float(acc1[1] * 254 + acc1[3]);
        } else {
          cen[0][0] = float(acc1[0] * 254 + acc2[0]);
          cen[0][1] = float(acc1[1] * 254 + acc2[1]);
          cen[ROWS - 1][0] = float(acc1[2] * 254 + acc2[2]);
          cen[ROWS - 1][1] = float(acc1[3] * 254 + acc2[3]);
        }
      }

      // x[r][i]: log2-domain logit of this lane's tokens (2t, 2t+1, 8+2t, 9+2t) of page pi for head
      // row g + 8r, minus the page's centroid logit: kq * cs_i * sum_k W[k] Ccode[i][k], with kq folded
      // into W. The int4 offset enters as the accumulators' initial value (exact in int32).
      auto page_x = [&](int pi, float(&x)[ROWS][4]) {
        const uint8_t* rec = st + pi * REC;
        int acc1[4], acc2[4];
        if constexpr (ROWS == 1) {
          acc1[0] = acc1[1] = -off0[0];
          acc1[2] = acc1[3] = -off1[0];
        } else {
          acc1[0] = acc1[1] = -off0[0];
          acc1[2] = acc1[3] = -off0[ROWS - 1];
          acc2[0] = acc2[1] = -off1[0];
          acc2[2] = acc2[3] = -off1[ROWS - 1];
        }
        uint32_t bw[KS];
        if constexpr (D == 128) {
          const uint4 v = *reinterpret_cast<const uint4*>(rec + L::basis_offset(D) + g * (D / 2) + t * (D / 8));
          bw[0] = v.x;
          bw[1] = v.y;
          bw[KS > 2 ? 2 : 0] = v.z;
          bw[KS > 3 ? 3 : 0] = v.w;
        } else {
          const uint2 v = *reinterpret_cast<const uint2*>(rec + L::basis_offset(D) + g * (D / 2) + t * (D / 8));
          bw[0] = v.x;
          bw[KS > 1 ? 1 : 0] = v.y;
        }
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
          uint32_t lo, hi;
          unpack_u4x8(bw[kk], lo, hi);
          mma_s8u8(acc1, aq[kk], lo, hi);
          if constexpr (ROWS == 2) mma_s8u8(acc2, aq2[kk], lo, hi);
        }
        const uint4 sc = *reinterpret_cast<const uint4*>(rec + L::scales_offset(D) + t * 16);
        const float bs0 = h2f_lo(sc.z), bs1 = h2f_hi(sc.z);
        const float cs[4] = {h2f_lo(sc.x), h2f_hi(sc.x), h2f_lo(sc.y), h2f_hi(sc.y)};
        uint32_t cb0, cb1;  // coefficient codes: tokens g (tile 0) and g+8 (tile 1), columns 2t, 2t+1
        unpack_int8x4(*reinterpret_cast<const uint32_t*>(rec + L::coef_offset(D) + lane * 4), cb0, cb1);
        // A of an m16n8k16 f16 MMA: K slots 0..7 = W hi, 8..15 = W lo; B repeats the codes in both
        // halves, so the tensor core adds hi + lo.
        uint32_t a[4];
        if constexpr (ROWS == 1) {
          const float w0 = float(acc1[0] * 254 + acc1[2]) * (bs0 * kq[0]);
          const float w1 = float(acc1[1] * 254 + acc1[3]) * (bs1 * kq[0]);
          Pack<__half>::split(w0, w1, a[0], a[2]);
          a[1] = a[3] = 0u;
        } else {
          const float w0 = float(acc1[0] * 254 + acc2[0]) * (bs0 * kq[0]);
          const float w1 = float(acc1[1] * 254 + acc2[1]) * (bs1 * kq[0]);
          const float w2 = float(acc1[2] * 254 + acc2[2]) * (bs0 * kq[ROWS - 1]);
          const float w3 = float(acc1[3] * 254 + acc2[3]) * (bs1 * kq[ROWS - 1]);
          Pack<__half>::split(w0, w1, a[0], a[2]);
          Pack<__half>::split(w2, w3, a[1], a[3]);
        }
        float o0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, o1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_16816(o0, a, cb0, cb0, __half());
        mma_16816(o1, a, cb1, cb1, __half());
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          x[r][0] = cs[0] * o0[2 * r];
          x[r][1] = cs[1] * o0[2 * r + 1];
          x[r][2] = cs[2] * o1[2 * r];
          x[r][3] = cs[3] * o1[2 * r + 1];
        }
      };

      // Fast path: per-lane partial sums of exp2(x) for all 8 pages, no max shift (x is relative to
      // the centroid logit, the mean of the page's logits, so the sum is >= ~1 and overflows only past
      // 2^127), then a quad butterfly: lane t ends with pages 2t and 2t+1 (6 shuffles per octet
      // instead of 4 per page).
      float lg[ROWS][2];
      {
        float S[ROWS][8];
#pragma unroll
        for (int pi = 0; pi < 8; ++pi) {
          float x[ROWS][4];
          page_x(pi, x);
#pragma unroll
          for (int r = 0; r < ROWS; ++r) S[r][pi] = (ex2(x[r][0]) + ex2(x[r][1])) + (ex2(x[r][2]) + ex2(x[r][3]));
        }
        const bool up2 = (t & 2) != 0, up1 = (t & 1) != 0;
        bool bad = false;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          float T[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float send = up2 ? S[r][j] : S[r][4 + j];
            const float keep = up2 ? S[r][4 + j] : S[r][j];
            T[j] = keep + __shfl_xor_sync(kFull, send, 2);
          }
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float send = up1 ? T[j] : T[2 + j];
            const float keep = up1 ? T[2 + j] : T[j];
            lg[r][j] = keep + __shfl_xor_sync(kFull, send, 1);
            bad |= p0 + 2 * t + j < n_scored && !(lg[r][j] > 0.0f && lg[r][j] < INFINITY);
          }
        }
        if (__any_sync(kFull, bad)) {
          // Some page's logits lie ~127 (log2 units) or more from its centroid logit, or are not
          // finite: redo the octet with the usual max shift, page by page.
#pragma unroll 1
          for (int pi = 0; pi < 8; ++pi) {
            float x[ROWS][4];
            page_x(pi, x);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
              const float mx = quad_max(fmaxf(fmaxf(x[r][0], x[r][1]), fmaxf(x[r][2], x[r][3])));
              float sum = 0.0f;
#pragma unroll
              for (int i = 0; i < 4; ++i) sum += ex2(x[r][i] - mx);
              sum = quad_sum(sum);
              if ((pi >> 1) == t) {  // (no run-time index into a register array)
                const float v = mx + __log2f(sum);
                lg[r][0] = (pi & 1) ? lg[r][0] : v;
                lg[r][1] = (pi & 1) ? v : lg[r][1];
              }
            }
          }
        } else {
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            lg[r][0] = __log2f(lg[r][0]);
            lg[r][1] = __log2f(lg[r][1]);
          }
        }
      }
      // Centroid scales of this lane's pages 2t, 2t+1 (every scale chunk holds a copy).
      float ms[2];
#pragma unroll
      for (int e = 0; e < 2; ++e)
        ms[e] = __half2float(
            reinterpret_cast<const __half*>(st + (2 * t + e) * REC + L::scales_offset(D))[L::centroid_scale_slot(0)]);
      __syncwarp();  // every lane is done with the slot
      if constexpr (kRing) issue(i + R, ids_next, slot);
      ids_next = ids_after;
      ids_after = ids_later;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int pos = p0 + 2 * t + e;
        if (pos < n_scored) {
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            const int row = g + 8 * r;
            if (row < G) {
              const float s2 = fmaf(kq[r] * ms[e], cen[r][e], lg[r][e]);
              st_with_policy((r == 0 ? lm_row0 : lm_row1) + pos, s2 * kLn2, lm_policy);
              lse2_merge(run_m[r], run_l[r], s2, 1.0f);
            }
          }
        }
      }
    }
    if constexpr (!kRing) cp_async_wait<0>();
    uses += uint32_t(max(n_oct, 0));

    // Chunk statistics: quad -> warp -> CTA, plus the exact page in the last chunk's CTA.
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float m = run_m[r], l = run_l[r];
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        const float m2 = __shfl_xor_sync(kFull, m, o), l2 = __shfl_xor_sync(kFull, l, o);
        lse2_merge(m, l, m2, l2);
      }
      if (t == 0) {
        warp_m[warp][g + 8 * r] = m;
        warp_l[warp][g + 8 * r] = l;
      }
    }
    const bool chunk_bad = __syncthreads_or(bad_id);
    if (chunk_bad && threadIdx.x == 0) raise_status(p.status, kStatusBadPageId);
    if (threadIdx.x < G) {
      const int r = threadIdx.x;
      float m = -INFINITY, l = 0.0f;
      for (int w = 0; w < kWarps; ++w) lse2_merge(m, l, warp_m[w][r], warp_l[w][r]);
      if (do_exact) lse2_merge(m, l, ex_s2[r], 1.0f);
      chunk_stat(r) = chunk_bad ? make_float2(NAN, NAN) : make_float2(m, l);
    }
    if (p.defer_lse_total || !last_cta_done(p.counters + bh, uint32_t(active), &last_flag)) continue;

    // Last CTA of (b, h): lse_total[g] = logsumexp over every page (the share normaliser, Eq. 5).
    // The statistics of all heads and (up to 128) chunks are loaded at once: this is the kernel's tail,
    // where each further round trip adds to the step. Then the pair is complete (ScoreParams::ready).
    merge_chunk_stats<(GT + kWarps - 1) / kWarps>(reinterpret_cast<const float2*>(p.chunk_stats) + bh * 16 * n_chunks,
                                                  n_chunks, active, G, warp, kWarps,
                                                  [&](int r, float v) { p.lse_total[bh * G + r] = v * kLn2; });
    if (p.ready) publish_ready(p.ready + bh);
  }
}

// One-time setup (outside any capture): raise the dynamic shared-memory limit (before any
// occupancy query, which otherwise reports 0 for > 48 KB) and count the resident CTAs.
template <int D, int GT, int MB>
int score_resident_ctas(int* per_sm_out = nullptr) {
  static int per_sm = -1, n_sm = 0;
  if (per_sm < 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev);
    int n = 0;
    if (allow_dynamic_smem<score_kernel<D, GT, MB>>(score_smem_bytes<D, GT, MB>()) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, score_kernel<D, GT, MB>, kThreads,
                                                      score_smem_bytes<D, GT, MB>()) != cudaSuccess)
      cudaGetLastError();
    per_sm = std::max(n, 1);
  }
  if (per_sm_out) *per_sm_out = per_sm;
  return std::max(1, n_sm * per_sm);
}

template <int D, int GT, int MB>
cudaError_t launch_score(const ScoreParams& p, cudaStream_t stream) {
  const int resident = score_resident_ctas<D, GT, MB>();
  // (The occupancy is counted once per process, on the first device; the limit is raised on each.)
  if (const cudaError_t e = allow_dynamic_smem<score_kernel<D, GT, MB>>(score_smem_bytes<D, GT, MB>());
      e != cudaSuccess)
    return e;
  cudaLaunchConfig_t cfg = {};
  const long items = long(p.kv.batch) * p.kv.n_head_kv * p.n_chunks;
  const int grid = int(std::min<long>(items, p.grid > 0 ? p.grid : resident));
  cfg.gridDim = dim3(unsigned(std::max(grid, 1)));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = score_smem_bytes<D, GT, MB>();
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, score_kernel<D, GT, MB>, p);
}

// G <= 8 runs 3 CTAs per SM (at most 168 registers; 159 at d = 128, no spills), faster than 4 CTAs
// capped at 128 registers, which spill. G > 8 needs ~242 (2 CTAs per SM).
template <int D>
int ctas_per_sm_for(int group) {
  int n = 1;
  if (group > 8)
    score_resident_ctas<D, 16, 2>(&n);
  else
    score_resident_ctas<D, 8, 3>(&n);
  return n;
}
template <int D>
cudaError_t launch_for(const ScoreParams& p, cudaStream_t stream) {
  return p.group > 8 ? launch_score<D, 16, 2>(p, stream) : launch_score<D, 8, 3>(p, stream);
}

}  // namespace

int score_ctas_per_sm(int head_dim, int group) {
  return head_dim == 64 ? ctas_per_sm_for<64>(group) : ctas_per_sm_for<128>(group);
}

cudaError_t score_pages(const ScoreParams& p, cudaStream_t stream) {
  if (p.kv.batch <= 0 || p.kv.n_head_kv <= 0) return cudaSuccess;
  if (p.group < 1 || p.group > kMaxGroup || p.chunk_pages <= 0 || p.chunk_pages % 32 != 0 || p.n_chunks <= 0 ||
      p.log_mass_stride <= 0 || p.n_pages_pool <= 0 || !p.q || !p.summaries || !p.log_mass || !p.lse_total ||
      !p.chunk_stats || !p.counters || !p.kv.indptr || !p.kv.indices || !p.kv.last_page_len || !p.kv.k ||
      reinterpret_cast<uintptr_t>(p.q) % 16 != 0 ||  // q is read as float4
      (p.ready && p.defer_lse_total))                // ready: the pass merges lse_total itself
    return cudaErrorInvalidValue;
  switch (p.kv.head_dim) {
    case 64:
      return launch_for<64>(p, stream);
    case 128:
      return launch_for<128>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace locks::cuda
