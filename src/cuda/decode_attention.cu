// Exact decode attention of a GQA group over a list of its pages (sparse: the selected set; dense:
// every page). CPU twin: paged_decode_attention (src/core/decode_attention.cpp).
//
// One CTA per (split, KV head, sequence), 4 warps; each warp takes whole pages (16 tokens) of the
// split and keeps an online softmax for all G heads of the group: S = Q K^T and O += P V on tensor
// cores with the heads as MMA rows (G <= 8: rows 8..15 carry the low parts of the hi/lo split of q
// and of P, so f16/bf16 rounding costs no accuracy; G > 8: heads in rows, two MMAs hi + lo; or, with
// group_halves, two CTAs per split of <= 8 heads each). The warps' states are combined in shared
// memory, the splits by log-sum-exp in the last CTA (or merge_kernel above 16 splits; or, with
// cluster_merge, inside the thread-block cluster that the splits of a (sequence, KV head) form).
//
// Operands come straight from global memory into registers with 16-byte loads (no staging):
//   K: lane 4g+t loads 16-byte chunks c = 4i + t of tokens g and g+8; k-step 2i+hh of that lane
//      covers dims 8c + 4hh + {0,1} (K slots 2t, 2t+1) and 8c + 4hh + {2,3} (slots 2t+8, 2t+9).
//   V: lane 4g+t loads chunks g + 8u of tokens 2t, 2t+1, 2t+8, 2t+9; n-tile nt = 8u + e of the PV
//      product holds output dims 64u + 8n + e for MMA column n, so the column of B a lane holds is
//      its own chunk (g) and two rows pack into one register with a byte permute.
#include <cooperative_groups.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>

#include "common.cuh"
#include "kernels_internal.h"

namespace locks::cuda {

namespace {

using namespace detail;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxSplits = 128;        // merge weights staged in shared memory
constexpr int kMaxClusterSplits = 16;  // AttentionParams::cluster_merge: the largest (non-portable) cluster

// CTAs per split: 2 when the <= 8-row kernel (GT = 8) runs a group of more than 8 heads (group
// halves), else 1. The kernel and its launch both size the grid by it.
template <int GT>
__host__ __device__ constexpr int ctas_per_split(int group) {
  return (GT == 8 && group > 8) ? 2 : 1;
}

// The length of a sequence's page list, or -1 for bad input (kernels.h; its o and lse become NaN):
// the page count or last page length is out of range, or the selected list is longer than its
// buffer or than the launch's splits cover (*fault names it), or select_pages saw bad input
// (n_selected < 0; it is already in the status word).
__device__ __forceinline__ int list_length(const AttentionParams& p, bool sparse, size_t bh, int n_pages, int last_len,
                                           uint32_t* fault) {
  *fault = sequence_fault(n_pages, last_len, sparse ? INT_MAX : p.n_splits * p.pages_per_split);
  if (*fault) return -1;
  if (n_pages == 0 || !sparse) return n_pages;
  const int n = p.n_selected[bh];
  if (n > p.selected_stride || n > p.n_splits * p.pages_per_split) {  // (a split past the grid, a CTA
    *fault = kStatusBadPageCount;                                     // past the cluster: never read)
    return -1;
  }
  return n;
}

// Balanced dense splits (AttentionParams::balance_splits): sequence b's split count a_b and where its
// splits' partials live. Warp-collective (every lane of every warp calls it; B loads of the page
// table). A sequence with a bad page count counts as empty: its one CTA reports the fault.
struct SplitRange {
  int b = 0;      // the sequence
  int start = 0;  // its first slot among the S = n_splits * batch of its KV head
  int a = 1;      // its splits
  int n = 0;      // its pages as balanced (0 for a bad page count)
  // Batch <= 32: the sequence's page-table entries, from the one round trip of loads (else read again).
  bool have_table = false;
  int pbeg = 0, n_pages = 0, last_len = 0;
};
// A sequence's split count from its balanced page count.
__device__ __forceinline__ int splits_of(const AttentionParams& p, int n, long long total) {
  return proportional_slots(n, total, p.n_splits * p.kv.batch - p.kv.batch, min(kMaxSplits, max(1, (n + 3) / 4)));
}
__device__ __forceinline__ int pages_for_balance(const AttentionParams& p, int b) {
  return balance_pages(p.kv.indptr[b + 1] - p.kv.indptr[b], p.n_splits * p.pages_per_split);
}
__device__ __forceinline__ long long balance_total(const AttentionParams& p) {
  return batch_sum<long long>(p.kv.batch, [&](int b) { return (long long)pages_for_balance(p, b); });
}
__device__ __forceinline__ int balanced_splits(const AttentionParams& p, int b, long long total) {
  return splits_of(p, pages_for_balance(p, b), total);
}
// Batch <= 32: lane b's page-table entries and split count, from one round trip of loads; the
// arithmetic then runs in registers (larger batches read the table again where they need it).
struct LaneSplits {
  int lo = 0, hi = 0, last_len = 0, n = 0, w = 0;
};
__device__ __forceinline__ LaneSplits lane_splits(const AttentionParams& p) {
  const int lane = threadIdx.x & 31, B = p.kv.batch;
  LaneSplits l;
  if (lane < B) {
    l.lo = p.kv.indptr[lane];
    l.hi = p.kv.indptr[lane + 1];
    l.last_len = p.kv.last_page_len[lane];
    l.n = balance_pages(l.hi - l.lo, p.n_splits * p.pages_per_split);
  }
  const long long total = batch_sum<long long>(B, [&](int) { return (long long)l.n; });  // (lane b: b's pages)
  if (lane < B) l.w = splits_of(p, l.n, total);
  return l;
}
// The range of the CTA in slot `slot` (false: an idle slot past every range).
__device__ __forceinline__ bool split_range_of_slot(const AttentionParams& p, int slot, SplitRange* r) {
  if (p.kv.batch <= 32) {
    const LaneSplits l = lane_splits(p);
    // (one pass of the search: lane b is asked for sequence b's width, its own)
    if (!find_slot_range(
            slot, p.kv.batch, [&](int) { return l.w; }, &r->b, &r->start, &r->a))
      return false;
    r->n = __shfl_sync(kFull, l.n, r->b);
    r->pbeg = __shfl_sync(kFull, l.lo, r->b);
    r->n_pages = __shfl_sync(kFull, l.hi, r->b) - r->pbeg;
    r->last_len = __shfl_sync(kFull, l.last_len, r->b);
    r->have_table = true;
    return true;
  }
  const long long total = balance_total(p);
  if (!find_slot_range(
          slot, p.kv.batch, [&](int b) { return balanced_splits(p, b, total); }, &r->b, &r->start, &r->a))
    return false;
  r->n = pages_for_balance(p, r->b);
  return true;
}
// Sequence b's range.
__device__ __forceinline__ SplitRange split_range_of_sequence(const AttentionParams& p, int b) {
  SplitRange r;
  r.b = b;
  if (p.kv.batch <= 32) {
    const LaneSplits l = lane_splits(p);
    r.start = __shfl_sync(kFull, warp_inclusive_sum(l.w) - l.w, b);
    r.a = __shfl_sync(kFull, l.w, b);
    r.n = __shfl_sync(kFull, l.n, b);
    return r;
  }
  const long long total = balance_total(p);
  r.start = batch_sum<int>(p.kv.batch, [&](int bb) { return bb < b ? balanced_splits(p, bb, total) : 0; });
  r.a = balanced_splits(p, b, total);
  r.n = pages_for_balance(p, b);
  return r;
}

// Which pages a launch attends: an instance per kind, so that dense instances carry no sparse-list
// code and the unbalanced ones keep their split and sequence as launch indices (G = 16 runs at its
// 255-register limit, where one instance for both split kinds slows the page loop).
enum ListKind : int {
  kSelectedPages = 0,    // sparse: the selected list
  kAllPages = 1,         // dense, n_splits per sequence
  kAllBalanced = 2,      // dense, AttentionParams::balance_splits with batch > 1
  kSelectedCluster = 3,  // sparse, AttentionParams::cluster_merge: the splits merge through DSMEM
};
__host__ __device__ constexpr int list_kind(bool sparse, bool balanced, bool cluster) {
  return sparse ? (cluster ? kSelectedCluster : kSelectedPages) : balanced ? kAllBalanced : kAllPages;
}

template <int D, int GT, typename T, int LIST>
__global__ void __launch_bounds__(kThreads) attention_kernel(AttentionParams p) {
  constexpr bool BAL = LIST == kAllBalanced;
  constexpr bool CLU = LIST == kSelectedCluster;  // one cluster per (sequence, KV head): CTA rank = split
  constexpr int KS = D / 16;                      // k-steps of Q K^T
  constexpr int NKC = D / 32;                     // K chunks per token row per lane
  constexpr int NVC = D / 64;                     // V chunks per token row per lane
  constexpr int NT = D / 8;                       // n-tiles of P V
  constexpr int ROWS = GT / 8;
  static_assert(kWarps * GT * D >= kMaxSplits * 16, "the last CTA stages the merge weights in warp_o");

  __shared__ __align__(16) float q_s[GT][D];
  __shared__ __align__(16) float warp_o[kWarps][GT][D];  // reused for merge weights
  __shared__ float warp_m[kWarps][GT], warp_l[kWarps][GT];
  __shared__ int last_flag;
  // CLU: this split's normalised output (in q_s, unused after the fragments are built) and
  // log2-sum-exp, read by the cluster's merge.
  float(*clu_o)[D] = q_s;
  __shared__ float clu_l[CLU ? GT : 1];
  // BAL: this CTA's (sequence, KV head), split and first partial slot, for after the page loop: from
  // shared memory there, so that the loop does not hold them in registers.
  __shared__ size_t cta_bh, cta_part0;
  __shared__ int cta_s;

  // Group halves (GT = 8, G > 8): CTAs 2s and 2s + 1 run heads [0, 8) and [8, G) of split s.
  const int nh = ctas_per_split<GT>(p.group);
  int s = blockIdx.x / nh, b = blockIdx.z;
  const int half = blockIdx.x % nh, h = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int H = p.kv.n_head_kv, G = p.group;
  const int row0 = 8 * half, GL = nh == 1 ? G : min(8, G - row0);  // this CTA's head rows
  constexpr bool sparse = LIST == kSelectedPages || CLU;

  const bool early = p.pdl_early_reads;
  if (!early) pdl_wait();
  pdl_launch_dependents();
  // Balanced: this CTA's slot among the KV head's n_splits * batch picks its sequence and split.
  int pps = p.pages_per_split;
  size_t part0 = (size_t(b) * H + h) * p.n_splits;  // the sequence's first partial slot
  SplitRange range;
  if constexpr (BAL) {
    if (!split_range_of_slot(p, int(blockIdx.z) * p.n_splits + s, &range)) return;
    b = range.b;
    s -= range.start - int(blockIdx.z) * p.n_splits;
    part0 = size_t(h) * p.n_splits * p.kv.batch + range.start;
    pps = max(1, (range.n + range.a - 1) / range.a);
  }
  const size_t bh = size_t(b) * H + h;
  const bool have = BAL && range.have_table;
  const int pbeg = have ? range.pbeg : p.kv.indptr[b];
  const int n_pages = have ? range.n_pages : p.kv.indptr[b + 1] - pbeg;
  const int last_len = have ? range.last_len : p.kv.last_page_len[b];
  float* o_out = p.o + bh * G * D;
  if (BAL && threadIdx.x == 0) {  // read after the page loop's barriers
    cta_bh = bh;
    cta_part0 = part0;
    cta_s = s;
  }

  // q * scale * log2(e) -> A fragments (hi/lo); with early reads this overlaps the previous kernel.
  const float qmul = p.scale * kLog2e;
  const float* qg = p.q + (bh * G + row0) * D;
  for (int e = threadIdx.x; e < GT * D; e += kThreads) q_s[e / D][e % D] = (e / D) < GL ? qg[e] * qmul : 0.0f;
  __syncthreads();
  uint32_t aq[KS][4];
  uint32_t aq_lo[ROWS == 2 ? KS : 1][4];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const int c = 4 * (kk >> 1) + t, d0 = 8 * c + 4 * (kk & 1);
    uint32_t h01, l01, h23, l23;
    Pack<T>::split(q_s[g][d0], q_s[g][d0 + 1], h01, l01);
    Pack<T>::split(q_s[g][d0 + 2], q_s[g][d0 + 3], h23, l23);
    if constexpr (ROWS == 1) {
      aq[kk][0] = h01;
      aq[kk][1] = l01;
      aq[kk][2] = h23;
      aq[kk][3] = l23;
    } else {
      uint32_t h01b, l01b, h23b, l23b;
      Pack<T>::split(q_s[g + 8][d0], q_s[g + 8][d0 + 1], h01b, l01b);
      Pack<T>::split(q_s[g + 8][d0 + 2], q_s[g + 8][d0 + 3], h23b, l23b);
      aq[kk][0] = h01;
      aq[kk][1] = h01b;
      aq[kk][2] = h23;
      aq[kk][3] = h23b;
      aq_lo[kk][0] = l01;
      aq_lo[kk][1] = l01b;
      aq_lo[kk][2] = l23;
      aq_lo[kk][3] = l23b;
    }
  }

  if (early) pdl_wait();
  // This warp takes list entries li0, li0 + 4, ... of its split; its m-th entry is li0 + 4 m.
  // Sparse: its first 32 entries are read together with the list length (one round trip instead of
  // two; they are in bounds of the list buffer and only used where the list reaches them).
  const int32_t* sel = sparse ? p.selected + bh * p.selected_stride : nullptr;
  const int li0 = s * pps + warp;
  int32_t j_pre = 0;
  if (sparse) {
    const int li = li0 + 4 * lane;
    if (li < min((s + 1) * pps, p.selected_stride)) j_pre = __ldcg(sel + li);
  }
  uint32_t fault = 0;
  const int n_list = list_length(p, sparse, bh, n_pages, last_len, &fault);
  const int active = (n_list + pps - 1) / pps;
  if (n_list <= 0) {  // empty sequence or list: o = 0, lse = -inf; bad input: NaN
    if (s == 0 && half == 0) {
      const float o_val = n_list < 0 ? NAN : 0.0f, lse_val = n_list < 0 ? NAN : -INFINITY;
      for (int e = threadIdx.x; e < G * D; e += kThreads) o_out[e] = o_val;
      if (p.lse && threadIdx.x < G) p.lse[bh * G + threadIdx.x] = lse_val;
      if (threadIdx.x == 0 && fault) raise_status(p.status, fault);
    }
    return;
  }
  // (CLU: an idle split still takes part in the cluster's merge, with no pages: empty state.)
  if (!CLU && s >= active) return;

  float o[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float run_m[ROWS], run_l[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    run_m[r] = -INFINITY;
    run_l[r] = 0.0f;
  }

  const uint16_t* kpool = static_cast<const uint16_t*>(p.kv.k);
  const uint16_t* vpool = static_cast<const uint16_t*>(p.kv.v);
  const int32_t* idx = p.kv.indices + pbeg;
  const int list1 = min((s + 1) * pps, n_list);
  const int n_mine = max(0, (list1 - li0 + kWarps - 1) / kWarps);  // this warp's entries

  // Page ids come 32 entries at a time, one per lane, a chunk ahead of their use, so the loop's only
  // dependent loads are K and V (not list entry -> page id -> K). Bit 31 marks the sequence's last page.
  // kBadEntry: a list entry outside the page table, or a page id outside [0, n_pages_pool).
  constexpr int32_t kBadEntry = INT32_MAX;
  auto ids_of = [&](int r) -> int32_t {  // lane's entry of chunk r
    const int m = 32 * r + lane;
    if (m >= n_mine) return 0;
    const int j = !sparse ? li0 + kWarps * m : r == 0 ? j_pre : __ldcg(sel + li0 + kWarps * m);
    if (j < 0 || j >= n_pages) return kBadEntry;
    const int32_t id = __ldcg(idx + j);
    if (!page_id_ok(id, p.kv.n_pages_pool)) return kBadEntry;
    return id | (j == n_pages - 1 ? INT32_MIN : 0);
  };
  bool bad_page = false;  // the warp met a kBadEntry: its state becomes NaN, so the group's o does
  int32_t ids_cur = ids_of(0), ids_nxt = n_mine > 32 ? ids_of(1) : 0;
  // The warp's m-th entry (called for m = 0, 1, 2, ... in order): its K/V offset and token count.
  auto page_of = [&](int m, size_t& off, int& len) {
    if (m > 0 && (m & 31) == 0) {
      ids_cur = ids_nxt;
      ids_nxt = ids_of((m >> 5) + 1);
    }
    const int32_t e = __shfl_sync(kFull, ids_cur, m & 31);
    if (e == kBadEntry) {  // its page is not read
      bad_page = true;
      off = 0;  // page 0 instead (see load_k)
      len = kPageSize;
      return;
    }
    len = e < 0 ? last_len : kPageSize;
    off = (size_t(e & 0x7fffffff) * H + h) * size_t(kPageSize) * D;
  };
  // The loads take one pointer per page plus offsets fixed per lane (K row g chunk t, V row 2t chunk
  // g, in uint4 units), with no per-register predicates: per-load 64-bit address arithmetic and zero
  // fills were a large part of the page loop. K reads every row, also past a partial page's length
  // (those rows are in the pool, stale, and their scores are masked before the softmax); V's rows
  // past it read the page's last row (their P is 0, and a stale row could hold a non-finite value:
  // 0 * inf is NaN). A bad entry reads page 0 (page_of), and its warp's state becomes NaN.
  uint4 kr[2][NKC], vr[4][NVC];
  const int k_lane = g * (D / 8) + t, v_lane = 2 * t * (D / 8) + g;
  auto load_k = [&](size_t off) {
    const uint4* src = reinterpret_cast<const uint4*>(kpool + off) + k_lane;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < NKC; ++i) kr[r][i] = __ldcs(src + r * D + 4 * i);  // row g + 8r, chunk 4i + t
  };
  auto load_v = [&](size_t off, int len) {
    const uint4* src = reinterpret_cast<const uint4*>(vpool + off) + v_lane;
    const int lim = len - 1 - 2 * t;  // the last row, relative to row 2t
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int rel = min((r & 1) + 8 * (r >> 1), lim);  // row 2t, 2t+1, 2t+8 or 2t+9, at most len - 1
#pragma unroll
      for (int u = 0; u < NVC; ++u) vr[r][u] = __ldcs(src + rel * (D / 8) + 8 * u);
    }
  };

  size_t off = 0;
  int len = 0;
  if (n_mine > 0) {
    page_of(0, off, len);
    load_k(off);
    load_v(off, len);
  }
  for (int m = 0; m < n_mine; ++m) {
    const int cur_len = len;
    const bool more = m + 1 < n_mine;
    size_t noff = 0;
    int nlen = 0;
    if (more) page_of(m + 1, noff, nlen);

    // S = Q K^T (log2 units), two n-tiles of 8 tokens. G > 8: the low halves of q accumulate apart
    // (four chains of KS MMAs instead of two of 2 KS: the chain's latency is the page's critical path).
    float sc0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sc1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float sl0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sl1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const int i = kk >> 1, hh = kk & 1;
      mma_16816(sc0, aq[kk], u4_word(kr[0][i], 2 * hh), u4_word(kr[0][i], 2 * hh + 1), T());
      mma_16816(sc1, aq[kk], u4_word(kr[1][i], 2 * hh), u4_word(kr[1][i], 2 * hh + 1), T());
      if constexpr (ROWS == 2) {
        mma_16816(sl0, aq_lo[kk], u4_word(kr[0][i], 2 * hh), u4_word(kr[0][i], 2 * hh + 1), T());
        mma_16816(sl1, aq_lo[kk], u4_word(kr[1][i], 2 * hh), u4_word(kr[1][i], 2 * hh + 1), T());
      }
    }
    if constexpr (ROWS == 2) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc0[e] += sl0[e];
        sc1[e] += sl1[e];
      }
    }
    if (more) load_k(noff);  // next page's K while this one finishes

    // Online softmax per head row; this lane holds tokens 2t, 2t+1, 8+2t, 9+2t.
    const bool valid[4] = {2 * t < cur_len, 2 * t + 1 < cur_len, 8 + 2 * t < cur_len, 9 + 2 * t < cur_len};
    float pr[ROWS][4];
    float corr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float sv[4];
      if constexpr (ROWS == 1) {
        sv[0] = sc0[0] + sc0[2];
        sv[1] = sc0[1] + sc0[3];
        sv[2] = sc1[0] + sc1[2];
        sv[3] = sc1[1] + sc1[3];
      } else {
        sv[0] = sc0[2 * r];
        sv[1] = sc0[2 * r + 1];
        sv[2] = sc1[2 * r];
        sv[3] = sc1[2 * r + 1];
      }
      float mx = -INFINITY;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (!valid[e]) sv[e] = -INFINITY;
        mx = fmaxf(mx, sv[e]);
      }
      mx = quad_max(mx);
      const float m_new = fmaxf(run_m[r], mx);  // finite: token 0 of every page is valid
      corr[r] = exp2f(run_m[r] - m_new);        // 0 on the first page (run_m = -inf)
      float sum = 0.0f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pr[r][e] = exp2f(sv[e] - m_new);
        sum += pr[r][e];
      }
      run_l[r] = run_l[r] * corr[r] + sum;
      run_m[r] = m_new;
    }
    uint32_t ap[4], ap_lo[4];
    if constexpr (ROWS == 1) {
      Pack<T>::split(pr[0][0], pr[0][1], ap[0], ap[1]);
      Pack<T>::split(pr[0][2], pr[0][3], ap[2], ap[3]);
    } else {
      Pack<T>::split(pr[0][0], pr[0][1], ap[0], ap_lo[0]);
      Pack<T>::split(pr[ROWS - 1][0], pr[ROWS - 1][1], ap[1], ap_lo[1]);
      Pack<T>::split(pr[0][2], pr[0][3], ap[2], ap_lo[2]);
      Pack<T>::split(pr[ROWS - 1][2], pr[ROWS - 1][3], ap[3], ap_lo[3]);
    }

    // O = O * corr + P V.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int u = nt >> 3, e = nt & 7;
      const uint32_t sel_bytes = (e & 1) ? 0x7632u : 0x5410u;
      const uint32_t b0 = __byte_perm(u4_word(vr[0][u], e >> 1), u4_word(vr[1][u], e >> 1), sel_bytes);
      const uint32_t b1 = __byte_perm(u4_word(vr[2][u], e >> 1), u4_word(vr[3][u], e >> 1), sel_bytes);
      o[nt][0] *= corr[0];
      o[nt][1] *= corr[0];
      o[nt][2] *= corr[ROWS - 1];
      o[nt][3] *= corr[ROWS - 1];
      mma_16816(o[nt], ap, b0, b1, T());
      if constexpr (ROWS == 2) mma_16816(o[nt], ap_lo, b0, b1, T());
    }
    if (more) load_v(noff, nlen);
    len = nlen;
  }

  if (bad_page) {
    if (lane == 0) raise_status(p.status, kStatusBadPageId);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) run_l[r] = NAN;
  }
  // Warp state -> shared memory (rows < GT, natural dim order). NaN (bad input) propagates through
  // every combine below: the tests are `!= 0`, not `> 0`.
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float l = quad_sum(run_l[r]);
    if (t == 0) {
      warp_m[warp][g + 8 * r] = run_m[r];
      warp_l[warp][g + 8 * r] = l;
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int u = nt >> 3, e = nt & 7;
    const int x0 = 64 * u + 8 * (2 * t) + e, x1 = x0 + 8;
    if constexpr (ROWS == 1) {
      warp_o[warp][g][x0] = o[nt][0] + o[nt][2];
      warp_o[warp][g][x1] = o[nt][1] + o[nt][3];
    } else {
      warp_o[warp][g][x0] = o[nt][0];
      warp_o[warp][g][x1] = o[nt][1];
      warp_o[warp][g + 8][x0] = o[nt][2];
      warp_o[warp][g + 8][x1] = o[nt][3];
    }
  }
  __syncthreads();

  // Combine the warps: this split's normalised output and log2-sum-exp per head.
  const bool single = active == 1;
  const size_t bh_c = BAL ? cta_bh : bh, part0_c = BAL ? cta_part0 : part0;
  const int s_c = BAL ? cta_s : s;
  float* o_fin = p.o + bh_c * G * D;
  float* po = p.partial_o + ((part0_c + s_c) * 16 + row0) * D;
  float* pl = p.partial_lse + (part0_c + s_c) * 16 + row0;
  for (int e = threadIdx.x; e < GL * D; e += kThreads) {
    const int row = e / D, x = e % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, warp_m[w][row]);
    float lsum = 0.0f, osum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = warp_m[w][row];
      const float wt = mw == -INFINITY ? 0.0f : exp2f(mw - M);
      lsum += wt * warp_l[w][row];
      osum += wt * warp_o[w][row][x];
    }
    const float ov = lsum != 0.0f ? osum / lsum : 0.0f;
    const float l2 = lsum != 0.0f ? M + log2f(lsum) : -INFINITY;
    if (single) {
      if (CLU && s != 0) break;
      o_fin[(row0 + row) * D + x] = ov;
      if (p.lse && x == 0) p.lse[bh_c * G + row0 + row] = l2 * kLn2;
    } else if (CLU) {
      clu_o[row][x] = ov;
      if (x == 0) clu_l[row] = l2;
    } else {
      po[row * D + x] = ov;
      if (x == 0) pl[row] = l2;
    }
  }
  if constexpr (CLU) {
    // The splits of this (sequence, KV head) are the CTAs of one cluster (launch_list): merge through
    // distributed shared memory, CTA s taking elements s * 128 + tid, ... (no partials in global
    // memory, no counter: two cluster barriers instead of the store, fence, atomic and reload).
    if (single) return;  // (uniform across the cluster)
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every split's state is in its shared memory
    for (int e = s * kThreads + int(threadIdx.x); e < GL * D; e += p.n_splits * kThreads) {
      const int row = e / D, x = e % D;
      float lv[kMaxClusterSplits], ov[kMaxClusterSplits];
#pragma unroll
      for (int c = 0; c < kMaxClusterSplits; ++c) {  // every load issued before any is used
        lv[c] = c < active ? *cluster.map_shared_rank(&clu_l[row], c) : -INFINITY;
        ov[c] = c < active ? *cluster.map_shared_rank(&clu_o[row][x], c) : 0.0f;
      }
      float M = -INFINITY;
#pragma unroll
      for (int c = 0; c < kMaxClusterSplits; ++c)
        if (c < active) M = fmaxf(M, lv[c]);
      float lsum = 0.0f, acc = 0.0f;
#pragma unroll
      for (int c = 0; c < kMaxClusterSplits; ++c) {
        if (c < active) {
          const float wt = lv[c] == -INFINITY ? 0.0f : exp2f(lv[c] - M);
          lsum += wt;
          acc += wt * ov[c];
        }
      }
      const float inv = lsum != 0.0f ? 1.0f / lsum : 0.0f;
      o_fin[row * D + x] = acc * inv;
      if (x == 0 && p.lse) p.lse[bh * G + row] = lsum != 0.0f ? (M + log2f(lsum)) * kLn2 : -INFINITY;
    }
    cluster.sync();  // no CTA leaves while another reads its shared memory
    return;
  }
  if (single || p.n_splits > p.merge_kernel_above) return;  // many splits: merge_kernel does it
  if (!last_cta_done(p.counters + bh_c, uint32_t(active * nh), &last_flag)) return;

  // Last CTA: log-sum-exp merge of the splits. Weights staged in shared memory.
  float* wts = &warp_o[0][0][0];  // [active][16]
  const float* pl0 = p.partial_lse + part0_c * 16;
  const float* po0 = p.partial_o + part0_c * 16 * D;
  for (int e = threadIdx.x; e < active * 16; e += kThreads) wts[e] = (e % 16) < G ? __ldcg(pl0 + e) : -INFINITY;
  __syncthreads();
  if (threadIdx.x < G) {
    const int row = threadIdx.x;
    float M = -INFINITY;
    for (int ss = 0; ss < active; ++ss) M = fmaxf(M, wts[ss * 16 + row]);
    float lsum = 0.0f;
    for (int ss = 0; ss < active; ++ss) {
      const float lv = wts[ss * 16 + row];
      const float wt = lv == -INFINITY ? 0.0f : exp2f(lv - M);
      wts[ss * 16 + row] = wt;
      lsum += wt;
    }
    warp_m[0][row] = lsum != 0.0f ? 1.0f / lsum : 0.0f;
    if (p.lse) p.lse[bh_c * G + row] = lsum != 0.0f ? (M + log2f(lsum)) * kLn2 : -INFINITY;
  }
  __syncthreads();
  // Each thread: float4 elements (row, x4); all splits' loads of an element issued 16 at a time.
  for (int e = threadIdx.x; e < G * (D / 4); e += kThreads) {
    const int row = e / (D / 4), x4 = e % (D / 4);
    const float4* src = reinterpret_cast<const float4*>(po0 + row * D) + x4;
    constexpr int kBatch = 16;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s0 = 0; s0 < active; s0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        v[u] = s0 + u < active ? __ldcg(src + size_t(s0 + u) * 16 * (D / 4)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const float wt = s0 + u < active ? wts[(s0 + u) * 16 + row] : 0.0f;
        acc.x += wt * v[u].x;
        acc.y += wt * v[u].y;
        acc.z += wt * v[u].z;
        acc.w += wt * v[u].w;
      }
    }
    const float inv = warp_m[0][row];
    reinterpret_cast<float4*>(o_fin + row * D)[x4] = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  }
}

// LSE merge of many splits: one CTA per (head row, KV head, sequence); thread (group q, lane x4)
// sums the float4 x4 of the splits s = q (mod groups). Everything it reads (the list length, the
// splits' LSE and partial outputs) is requested at once, so the merge costs one round trip instead
// of a chain of four; entries of splits past the active ones are stale and never used.
template <int D, int LIST>
__global__ void __launch_bounds__(kThreads) merge_kernel(AttentionParams p) {
  constexpr bool BAL = LIST == kAllBalanced;
  constexpr int kLanes = D / 4, kGroups = kThreads / kLanes, kPer = kMaxSplits / kGroups;
  static_assert(kMaxSplits <= kThreads, "one split LSE per thread");
  __shared__ float wts[kMaxSplits];
  __shared__ float red_m[kWarps], red_l[kWarps];
  __shared__ float4 part[kGroups][kLanes];
  pdl_wait();
  pdl_launch_dependents();
  const int row = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int H = p.kv.n_head_kv, G = p.group;
  const size_t bh = size_t(b) * H + h;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q = threadIdx.x / kLanes, x4 = threadIdx.x % kLanes;
  // The sequence's partials: n_splits slots from (b, h), or, balanced, its range (one more round trip).
  int ns = p.n_splits, pps = p.pages_per_split;
  size_t part0 = bh * ns;
  if constexpr (BAL) {
    const SplitRange r = split_range_of_sequence(p, b);
    ns = r.a;
    part0 = size_t(h) * p.n_splits * p.kv.batch + r.start;
    pps = max(1, (r.n + r.a - 1) / r.a);
  }
  const float lv_all = int(threadIdx.x) < ns ? __ldcg(p.partial_lse + (part0 + threadIdx.x) * 16 + row) : -INFINITY;
  const float4* po = reinterpret_cast<const float4*>(p.partial_o + (part0 * 16 + row) * D) + x4;
  float4 v[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int s = q + u * kGroups;
    v[u] = s < ns ? __ldcg(po + size_t(s) * 16 * kLanes) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  const int n_pages = p.kv.indptr[b + 1] - p.kv.indptr[b];
  uint32_t fault = 0;
  const int n_list = list_length(p, LIST == kSelectedPages, bh, n_pages, p.kv.last_page_len[b], &fault);
  const int active = (n_list + pps - 1) / pps;
  if (active <= 1) return;  // written by the attention kernel (NaN for bad input)

  const float lv = int(threadIdx.x) < active ? lv_all : -INFINITY;
  float m = lv;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
  if (lane == 0) red_m[warp] = m;
  __syncthreads();
  float M = red_m[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) M = fmaxf(M, red_m[w]);
  const float wt = lv == -INFINITY ? 0.0f : exp2f(lv - M);
  if (int(threadIdx.x) < kMaxSplits) wts[threadIdx.x] = wt;
  float l = wt;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(kFull, l, o);
  if (lane == 0) red_l[warp] = l;
  __syncthreads();
  float L = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) L += red_l[w];

  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int s = q + u * kGroups;
    if (s < active) {  // not a multiply by 0: a stale entry may hold anything
      const float w = wts[s];
      acc.x += w * v[u].x;
      acc.y += w * v[u].y;
      acc.z += w * v[u].z;
      acc.w += w * v[u].w;
    }
  }
  part[q][x4] = acc;
  __syncthreads();
  if (q == 0) {
    float4 sum = part[0][x4];
    for (int g2 = 1; g2 < kGroups; ++g2) {
      sum.x += part[g2][x4].x;
      sum.y += part[g2][x4].y;
      sum.z += part[g2][x4].z;
      sum.w += part[g2][x4].w;
    }
    const float inv = L != 0.0f ? 1.0f / L : 0.0f;
    reinterpret_cast<float4*>(p.o + (bh * G + row) * D)[x4] =
        make_float4(sum.x * inv, sum.y * inv, sum.z * inv, sum.w * inv);
    if (x4 == 0 && p.lse) p.lse[bh * G + row] = L != 0.0f ? (M + log2f(L)) * kLn2 : -INFINITY;
  }
}

template <int D, int GT, typename T, int LIST>
cudaError_t launch_list(const AttentionParams& p, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  const unsigned nh = unsigned(ctas_per_split<GT>(p.group));
  cfg.gridDim = dim3(unsigned(p.n_splits) * nh, unsigned(p.kv.n_head_kv), unsigned(p.kv.batch));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n_attr = 0;
  if (p.pdl) {
    attr[n_attr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n_attr++].val.programmaticStreamSerializationAllowed = 1;
  }
  if constexpr (LIST == kSelectedCluster) {  // the splits of a (sequence, KV head) as one cluster
    if (p.n_splits > 8)                      // non-portable size
      if (const cudaError_t e = allow_large_clusters<attention_kernel<D, GT, T, LIST>>(); e != cudaSuccess) return e;
    attr[n_attr++] = cluster_dim_attr(p.n_splits);
  }
  cfg.attrs = attr;
  cfg.numAttrs = n_attr;
  cudaError_t e = cudaLaunchKernelEx(&cfg, attention_kernel<D, GT, T, LIST>, p);
  if constexpr (LIST == kSelectedCluster) {
    return e;  // merged inside the clusters
  } else {
    if (e != cudaSuccess || p.n_splits <= p.merge_kernel_above) return e;
    cfg.gridDim = dim3(unsigned(p.group), unsigned(p.kv.n_head_kv), unsigned(p.kv.batch));
    return cudaLaunchKernelEx(&cfg, merge_kernel<D, LIST>, p);
  }
}

template <int D, int GT, typename T>
cudaError_t launch_attention(const AttentionParams& p, cudaStream_t stream) {
  switch (list_kind(p.selected != nullptr, p.balance_splits && p.kv.batch > 1, p.cluster_merge)) {
    case kSelectedPages:
      return launch_list<D, GT, T, kSelectedPages>(p, stream);
    case kSelectedCluster:
      return launch_list<D, GT, T, kSelectedCluster>(p, stream);
    case kAllBalanced:
      return launch_list<D, GT, T, kAllBalanced>(p, stream);
    default:
      return launch_list<D, GT, T, kAllPages>(p, stream);
  }
}

template <int D>
cudaError_t dispatch_attention(const AttentionParams& p, cudaStream_t stream) {
  const bool wide = p.group > 8 && !p.group_halves;
  if (p.kv.dtype == KvType::kBF16)
    return wide ? launch_attention<D, 16, __nv_bfloat16>(p, stream) : launch_attention<D, 8, __nv_bfloat16>(p, stream);
  return wide ? launch_attention<D, 16, __half>(p, stream) : launch_attention<D, 8, __half>(p, stream);
}

}  // namespace

int attention_max_splits() { return kMaxSplits; }

// How many clusters of `size` sparse-attention CTAs (G <= 8) can be resident at once (0: none, or
// the query failed). The cluster's CTAs must fit in one GPC, so this is below SMs * CTAs per SM / size.
template <int D, typename T>
int max_active_clusters_of(int size) {
  constexpr auto kernel = attention_kernel<D, 8, T, kSelectedCluster>;
  if (allow_large_clusters<kernel>() != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(size));
  cfg.blockDim = dim3(kThreads);
  cudaLaunchAttribute attr[1] = {cluster_dim_attr(size)};
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}
int attention_max_active_clusters(int head_dim, KvType dtype, int size) {
  if (size < 1 || size > kMaxClusterSplits) return 0;
  const bool bf = dtype == KvType::kBF16;
  if (head_dim == 64)
    return bf ? max_active_clusters_of<64, __nv_bfloat16>(size) : max_active_clusters_of<64, __half>(size);
  return bf ? max_active_clusters_of<128, __nv_bfloat16>(size) : max_active_clusters_of<128, __half>(size);
}

template <int D, int GT, typename T, int LIST>
int occupancy_of() {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, attention_kernel<D, GT, T, LIST>, kThreads, 0) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  return std::max(n, 1);
}

// The plan's sparse attention runs groups of more than 8 heads as group halves (GT 8), dense as one
// CTA per group (GT 16 above 8 heads); balanced dense splits use the same registers (ptxas) as plain.
template <int D, typename T>
int occupancy_for(int group, bool sparse) {
  if (sparse) return occupancy_of<D, 8, T, kSelectedPages>();
  return group > 8 ? occupancy_of<D, 16, T, kAllPages>() : occupancy_of<D, 8, T, kAllPages>();
}

int attention_ctas_per_sm(int head_dim, int group, KvType dtype, bool sparse) {
  const bool bf = dtype == KvType::kBF16;
  if (head_dim == 64)
    return bf ? occupancy_for<64, __nv_bfloat16>(group, sparse) : occupancy_for<64, __half>(group, sparse);
  return bf ? occupancy_for<128, __nv_bfloat16>(group, sparse) : occupancy_for<128, __half>(group, sparse);
}

cudaError_t paged_decode_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.kv.batch <= 0 || p.kv.n_head_kv <= 0) return cudaSuccess;
  if (p.group < 1 || p.group > kMaxGroup || p.pages_per_split < 1 || p.n_splits < 1 || p.n_splits > kMaxSplits ||
      (long long)p.n_splits * p.pages_per_split > INT_MAX || !p.q || !p.o || !p.kv.k || !p.kv.v || !p.kv.indptr ||
      !p.kv.indices || !p.kv.last_page_len ||
      (p.n_splits > 1 && !p.cluster_merge && (!p.partial_o || !p.partial_lse || !p.counters)) ||
      (p.selected && !p.n_selected) ||
      (p.cluster_merge && (!p.selected || p.n_splits > kMaxClusterSplits || (p.group_halves && p.group > 8))))
    return cudaErrorInvalidValue;
  switch (p.kv.head_dim) {
    case 64:
      return dispatch_attention<64>(p, stream);
    case 128:
      return dispatch_attention<128>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace locks::cuda
