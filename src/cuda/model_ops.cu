// The per-token model kernels of the forward pass (model_ops.h): embedding, RMSNorm, RoPE, bias,
// K/V append, SwiGLU, the bf16 cast, argmax and top-p sampling. Each is a few loads and stores per
// element next to the matrix products around it, so they stay simple: one CTA per row where a row
// needs a reduction, a (column block, row) grid for elementwise work, 16-byte accesses where the
// shapes and pointers allow and a scalar path elsewhere.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdio>

#include "common.cuh"
#include "model_ops.h"

namespace locks::cuda {

namespace {

using namespace detail;

constexpr int kRowThreads = 256;  // elementwise kernels and RMSNorm
constexpr int kMaxGridX = 1024;   // column blocks of the elementwise kernels (they loop beyond)
constexpr int kMaxGridY = 65535;  // rows of the elementwise kernels (they loop beyond)

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
int div_up(long long a, long long b) { return int((a + b - 1) / b); }

// (column blocks, rows) for n_vec vectors per row.
dim3 rowwise_grid(int n_rows, int n_vec) {
  return dim3(unsigned(std::clamp(div_up(n_vec, kRowThreads), 1, kMaxGridX)), unsigned(std::min(n_rows, kMaxGridY)));
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint16_t bf16_bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
__device__ __forceinline__ uint32_t pack_bf16(float x, float y) { return Pack<__nv_bfloat16>::pack(x, y); }

// ---------------------------------------------------------------------------------------------
// Embedding. VEC 8: one 16-byte load of 8 bf16 and two float4 stores per thread and step.
template <int VEC>
__global__ void __launch_bounds__(kRowThreads) embed_kernel(EmbedParams p) {
  const int n_vec = p.n_embd / VEC;
  for (int r = blockIdx.y; r < p.n_rows; r += gridDim.y) {
    const int32_t tok = p.tokens[r];
    const bool ok = tok >= 0 && tok < p.n_vocab;
    if (!ok && blockIdx.x == 0 && threadIdx.x == 0) raise_status(p.status, kStatusBadToken);
    const uint16_t* tr = static_cast<const uint16_t*>(p.table) + size_t(ok ? tok : 0) * p.n_embd;
    float* xr = p.x + size_t(r) * p.n_embd;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < n_vec; c += gridDim.x * blockDim.x) {
      if constexpr (VEC == 8) {
        float4 a = make_float4(NAN, NAN, NAN, NAN), b = a;
        if (ok) {
          const uint4 w = *reinterpret_cast<const uint4*>(tr + size_t(c) * 8);
          a = make_float4(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y));
          b = make_float4(bf16_lo(w.z), bf16_hi(w.z), bf16_lo(w.w), bf16_hi(w.w));
        }
        reinterpret_cast<float4*>(xr)[2 * c] = a;
        reinterpret_cast<float4*>(xr)[2 * c + 1] = b;
      } else if (p.f32) {
        xr[c] = ok ? static_cast<const float*>(p.table)[size_t(tok) * p.n_embd + c] : NAN;
      } else {
        xr[c] = ok ? bf16_lo(tr[c]) : NAN;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm, one CTA per row: the float64 sum of squares (each square exact in float64), then
// out = (x * inv) * w in float32 as the CPU. x may alias out: each element is read and written by the
// same thread, after the sum.
template <int VEC, bool F32>
__global__ void __launch_bounds__(kRowThreads) rmsnorm_kernel(RmsNormParams p) {
  pdl_wait();  // launched with PDL (launch_pdl): the inputs are the previous kernel's
  pdl_launch_dependents();
  __shared__ double warp_ss[kRowThreads / 32];
  __shared__ float inv_s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Start of this row in x and out (group_stride already defaulted by the launcher).
  const size_t row0 = size_t(blockIdx.x / p.group) * size_t(p.group_stride) + size_t(blockIdx.x % p.group) * p.n;
  const float* xr = p.x + row0;
  const int n_vec = p.n / VEC;
  double ss = 0.0;
  for (int c = threadIdx.x; c < n_vec; c += kRowThreads) {
    if constexpr (VEC == 4) {
      const float4 v = reinterpret_cast<const float4*>(xr)[c];
      ss += double(v.x) * v.x;
      ss += double(v.y) * v.y;
      ss += double(v.z) * v.z;
      ss += double(v.w) * v.w;
    } else {
      const float v = xr[c];
      ss += double(v) * v;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(kFull, ss, o);
  if (lane == 0) warp_ss[warp] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int w = 0; w < kRowThreads / 32; ++w) t += warp_ss[w];
    inv_s = float(1.0 / sqrt(t / p.n + double(p.eps)));
  }
  __syncthreads();
  const float inv = inv_s;
  for (int c = threadIdx.x; c < n_vec; c += kRowThreads) {
    if constexpr (VEC == 4) {
      const float4 v = reinterpret_cast<const float4*>(xr)[c];
      const float4 w = reinterpret_cast<const float4*>(p.weight)[c];
      const float4 o = make_float4(__fmul_rn(__fmul_rn(v.x, inv), w.x), __fmul_rn(__fmul_rn(v.y, inv), w.y),
                                   __fmul_rn(__fmul_rn(v.z, inv), w.z), __fmul_rn(__fmul_rn(v.w, inv), w.w));
      if constexpr (F32)
        reinterpret_cast<float4*>(p.out)[row0 / 4 + c] = o;
      else
        reinterpret_cast<uint2*>(p.out)[row0 / 4 + c] = make_uint2(pack_bf16(o.x, o.y), pack_bf16(o.z, o.w));
    } else {
      const float o = __fmul_rn(__fmul_rn(xr[c], inv), p.weight[c]);
      if constexpr (F32)
        static_cast<float*>(p.out)[row0 + c] = o;
      else
        static_cast<uint16_t*>(p.out)[row0 + c] = bf16_bits(o);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RoPE: one thread per (row, pair), its angle and sin/cos once in float64, then that pair of every
// q and k head.
constexpr int kRopeThreads = 128;

__device__ __forceinline__ void rotate_heads(float* base, int n_heads, int head_dim, int i0, int i1, float c, float s) {
  for (int h = 0; h < n_heads; ++h) {
    float* v = base + size_t(h) * head_dim;
    const float a = v[i0], b = v[i1];
    v[i0] = a * c - b * s;
    v[i1] = a * s + b * c;
  }
}

__global__ void __launch_bounds__(kRopeThreads) rope_kernel(RopeParams p, int q_stride, int k_stride) {
  pdl_wait();  // launched with PDL (launch_pdl): the inputs are the previous kernel's
  pdl_launch_dependents();
  const int half = p.n_rot / 2;
  const long long t = (long long)blockIdx.x * kRopeThreads + threadIdx.x;
  if (t >= (long long)p.n_rows * half) return;
  const int r = int(t / half), i = int(t % half);
  const double angle = double(p.positions[r]) * p.inv_freq[i];
  double sd, cd;
  sincos(angle, &sd, &cd);
  const float c = float(cd), s = float(sd);
  const bool neox = p.mode == RopeMode::kNeox;
  const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
  if (p.n_head_q > 0) rotate_heads(p.q + size_t(r) * q_stride, p.n_head_q, p.head_dim, i0, i1, c, s);
  if (p.n_head_k > 0) rotate_heads(p.k + size_t(r) * k_stride, p.n_head_k, p.head_dim, i0, i1, c, s);
}

// ---------------------------------------------------------------------------------------------
// Bias.
template <int VEC>
__global__ void __launch_bounds__(kRowThreads) add_bias_kernel(AddBiasParams p, int y_stride) {
  const int n_vec = p.n / VEC;
  for (int r = blockIdx.y; r < p.n_rows; r += gridDim.y) {
    float* yr = p.y + size_t(r) * y_stride;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < n_vec; c += gridDim.x * blockDim.x) {
      if constexpr (VEC == 4) {
        float4 y = reinterpret_cast<float4*>(yr)[c];
        const float4 b = reinterpret_cast<const float4*>(p.b)[c];
        y.x += b.x;
        y.y += b.y;
        y.z += b.z;
        y.w += b.w;
        reinterpret_cast<float4*>(yr)[c] = y;
      } else {
        yr[c] += p.b[c];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// K/V append, one CTA per row. VEC 4: float4 loads, 8-byte stores; VEC 2: scalar loads, 4-byte stores.
constexpr int kAppendThreads = 128;

template <bool BF16>
__device__ __forceinline__ uint32_t pack_kv(float x, float y, bool& bad) {
  if constexpr (BF16) {
    const uint32_t w = Pack<__nv_bfloat16>::pack(x, y);
    bad |= (w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u;  // Inf/NaN stored (overflow too)
    return w;
  } else {
    bad |= !(fabsf(x) <= 65504.0f) || !(fabsf(y) <= 65504.0f);  // the CPU cache's f16 limit
    return Pack<__half>::pack(x, y);
  }
}

template <int VEC, bool BF16>
__global__ void __launch_bounds__(kAppendThreads) append_kv_kernel(AppendKvParams p, int k_stride, int v_stride) {
  pdl_wait();  // launched with PDL (launch_pdl): the inputs are the previous kernel's
  pdl_launch_dependents();
  const int r = blockIdx.x;
  const int s = p.row_seq ? p.row_seq[r] : 0;
  const int pos = p.row_pos[r];
  uint32_t fault = 0;
  int page = 0;
  if (s < 0 || s >= p.batch || pos < 0) {
    fault = kStatusKvSlotOutOfRange;
  } else {
    const long long beg = p.indptr[s], end = p.indptr[s + 1], total = p.indptr[p.batch];
    const long long e = beg + pos / kPageSize;  // entry of the page table
    if (beg < 0 || e >= end || e >= total) {
      fault = kStatusKvSlotOutOfRange;
    } else {
      page = p.indices[e];
      if (page < 0 || page >= p.n_pages_pool) fault = kStatusKvPageIdOutOfRange;
    }
  }
  if (fault) {  // uniform over the CTA
    if (threadIdx.x == 0) raise_status(p.status, fault);
    return;
  }
  const int slot = pos % kPageSize;
  const float* kr = p.k + size_t(r) * k_stride;
  const float* vr = p.v + size_t(r) * v_stride;
  const int n_vec = p.n_head_kv * p.head_dim / VEC;
  bool bad = false;
  for (int c = threadIdx.x; c < n_vec; c += kAppendThreads) {
    const int e0 = c * VEC, h = e0 / p.head_dim, x = e0 - h * p.head_dim;
    const size_t dst = ((size_t(page) * p.n_head_kv + h) * kPageSize + slot) * p.head_dim + x;  // elements
    if constexpr (VEC == 4) {
      const float4 k4 = reinterpret_cast<const float4*>(kr)[c], v4 = reinterpret_cast<const float4*>(vr)[c];
      const uint2 kw = make_uint2(pack_kv<BF16>(k4.x, k4.y, bad), pack_kv<BF16>(k4.z, k4.w, bad));
      const uint2 vw = make_uint2(pack_kv<BF16>(v4.x, v4.y, bad), pack_kv<BF16>(v4.z, v4.w, bad));
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.k_pool) + dst) = kw;
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.v_pool) + dst) = vw;
    } else {
      const uint32_t kw = pack_kv<BF16>(kr[e0], kr[e0 + 1], bad), vw = pack_kv<BF16>(vr[e0], vr[e0 + 1], bad);
      *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.k_pool) + dst) = kw;
      *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.v_pool) + dst) = vw;
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) raise_status(p.status, kStatusKvNotFinite);
}

// ---------------------------------------------------------------------------------------------
// SwiGLU and the bf16 cast.
__device__ __forceinline__ float silu_mul(float g, float u) { return __fmul_rn(__fdiv_rn(g, 1.0f + expf(-g)), u); }

template <int VEC>
__global__ void __launch_bounds__(kRowThreads) swiglu_kernel(SwigluParams p, int gate_stride, int up_stride) {
  pdl_wait();  // launched with PDL (launch_pdl): the inputs are the previous kernel's
  pdl_launch_dependents();
  const int n_vec = p.n_ff / VEC;
  for (int r = blockIdx.y; r < p.n_rows; r += gridDim.y) {
    const float* gr = p.gate + size_t(r) * gate_stride;
    const float* ur = p.up + size_t(r) * up_stride;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < n_vec; c += gridDim.x * blockDim.x) {
      if constexpr (VEC == 4) {
        const float4 g = reinterpret_cast<const float4*>(gr)[c], u = reinterpret_cast<const float4*>(ur)[c];
        reinterpret_cast<uint2*>(p.out)[size_t(r) * n_vec + c] = make_uint2(
            pack_bf16(silu_mul(g.x, u.x), silu_mul(g.y, u.y)), pack_bf16(silu_mul(g.z, u.z), silu_mul(g.w, u.w)));
      } else if (p.out_f32) {
        static_cast<float*>(p.out)[size_t(r) * p.n_ff + c] = silu_mul(gr[c], ur[c]);
      } else {
        static_cast<uint16_t*>(p.out)[size_t(r) * p.n_ff + c] = bf16_bits(silu_mul(gr[c], ur[c]));
      }
    }
  }
}

template <int VEC>
__global__ void __launch_bounds__(kRowThreads) f32_to_bf16_kernel(const float* in, void* out, size_t n) {
  pdl_wait();  // launched with PDL (launch_pdl): the inputs are the previous kernel's
  pdl_launch_dependents();
  const size_t n_vec = n / VEC;
  const size_t step = size_t(gridDim.x) * kRowThreads;
  for (size_t c = size_t(blockIdx.x) * kRowThreads + threadIdx.x; c < n_vec; c += step) {
    if constexpr (VEC == 4) {
      const float4 v = reinterpret_cast<const float4*>(in)[c];
      reinterpret_cast<uint2*>(out)[c] = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
    } else {
      static_cast<uint16_t*>(out)[c] = bf16_bits(in[c]);
    }
  }
  if constexpr (VEC == 4) {  // the tail of n % 4 elements
    const size_t i = n_vec * 4 + threadIdx.x;
    if (blockIdx.x == 0 && i < n) static_cast<uint16_t*>(out)[i] = bf16_bits(in[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Token pickers: one CTA of kPickThreads per row. The row is read in rounds of kRoundChunks chunks of 4
// logits (indices 4c .. 4c + 3): in a round each thread loads kPickU chunks at once (to keep enough
// loads in flight for one SM), interleaved across the threads (coalesced) where the order does not
// matter, or contiguous per thread (thread order = index order) for the draw. VEC: float4 loads; else
// 4 scalar loads with -inf past n (-inf has no mass and never wins a tie against a real index, so the
// padding needs no checks).
constexpr int kPickThreads = 512;
constexpr int kPickWarps = kPickThreads / 32;
constexpr int kPickU = 8;
constexpr int kRoundChunks = kPickThreads * kPickU;  // 16384 logits
constexpr int kMaxSlots = 256;                       // per-round mass totals kept in shared memory
constexpr int kMaxDraws = 64;                        // rejection rounds of the nucleus draw (see sample_kernel)

template <bool VEC>
__device__ __forceinline__ float4 load4(const float* row, int c, int n) {
  if constexpr (VEC) {
    return reinterpret_cast<const float4*>(row)[c];
  } else {
    const int i = 4 * c;
    return make_float4(i < n ? row[i] : -INFINITY, i + 1 < n ? row[i + 1] : -INFINITY,
                       i + 2 < n ? row[i + 2] : -INFINITY, i + 3 < n ? row[i + 3] : -INFINITY);
  }
}

// Chunk j of this thread in round `round`.
template <bool CONTIG>
__device__ __forceinline__ int round_chunk(int round, int j) {
  return round * kRoundChunks + (CONTIG ? int(threadIdx.x) * kPickU + j : j * kPickThreads + int(threadIdx.x));
}

template <bool VEC, bool CONTIG>
__device__ __forceinline__ void load_round(const float* row, int n, int round, float4 (&v)[kPickU]) {
  const int n_chunks = (n + 3) / 4;
#pragma unroll
  for (int j = 0; j < kPickU; ++j) {
    const int c = round_chunk<CONTIG>(round, j);
    v[j] = c < n_chunks ? load4<VEC>(row, c, n) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
  }
}

__device__ __forceinline__ float elem(const float4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

struct StatsSmem {
  float best[kPickWarps];
  int arg[kPickWarps];
  int n_inf[kPickWarps];
};

// A row's largest logit and its lowest index, its count of +inf and whether it holds a NaN.
struct RowStats {
  float max;
  int arg;
  int n_inf;
  bool nan;
};

// (x, i) beats (best, bi): larger, or equal at a lower index (a NaN never wins).
__device__ __forceinline__ void argmax_update(float& best, int& bi, float x, int i) {
  if (x > best || (x == best && i < bi)) {
    best = x;
    bi = i;
  }
}

template <bool VEC>
__device__ RowStats row_stats(const float* row, int n, StatsSmem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_rounds = ((n + 3) / 4 + kRoundChunks - 1) / kRoundChunks;
  float best = -INFINITY;
  int bi = INT_MAX, n_inf = 0;
  bool nan = false;
  for (int round = 0; round < n_rounds; ++round) {
    float4 v[kPickU];
    load_round<VEC, false>(row, n, round, v);
#pragma unroll
    for (int j = 0; j < kPickU; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = elem(v[j], e);
        nan |= isnan(x);
        n_inf += x == INFINITY;
        argmax_update(best, bi, x, 4 * round_chunk<false>(round, j) + e);
      }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float b2 = __shfl_xor_sync(kFull, best, o);
    const int i2 = __shfl_xor_sync(kFull, bi, o);
    argmax_update(best, bi, b2, i2);
    n_inf += __shfl_xor_sync(kFull, n_inf, o);
  }
  if (lane == 0) {
    sm.best[warp] = best;
    sm.arg[warp] = bi;
    sm.n_inf[warp] = n_inf;
  }
  const bool any_nan = __syncthreads_or(nan) != 0;  // also the barrier for the per-warp results
  RowStats st{-INFINITY, INT_MAX, 0, any_nan};
  for (int w = 0; w < kPickWarps; ++w) {
    argmax_update(st.max, st.arg, sm.best[w], sm.arg[w]);
    st.n_inf += sm.n_inf[w];
  }
  return st;
}

template <bool VEC>
__global__ void __launch_bounds__(kPickThreads) argmax_kernel(ArgmaxParams p, int stride) {
  __shared__ StatsSmem sm;
  const RowStats st = row_stats<VEC>(p.logits + size_t(blockIdx.x) * stride, p.n_vocab, sm);
  if (threadIdx.x == 0) {
    p.ids[blockIdx.x] = st.nan ? -1 : st.arg;
    if (st.nan) raise_status(p.status, kStatusNanLogits);
  }
}

// ---- sampling ----

struct SampleSmem {
  unsigned long long slot_mass[kMaxSlots];  // mass of the current set per slot of rounds
  unsigned long long warp_sums[kPickWarps];
  unsigned long long total;
  unsigned long long step;
  StatsSmem stats;
  int found;
};

// Exclusive prefix sum of x over the CTA's threads in thread order; *total: the sum of all.
// Contains two barriers (every thread must call it).
__device__ __forceinline__ unsigned long long block_exclusive_scan(unsigned long long x, unsigned long long* warp_sums,
                                                                   unsigned long long* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long v = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  unsigned long long base = 0, tot = 0;
#pragma unroll
  for (int w = 0; w < kPickWarps; ++w) {
    const unsigned long long s = warp_sums[w];
    base += w < warp ? s : 0ull;
    tot += s;
  }
  __syncthreads();  // warp_sums is reused by the next call
  *total = tot;
  return base + incl - x;
}

// Rounds of the row and how many share one slot of SampleSmem::slot_mass (1 up to 4M logits).
struct RoundPlan {
  int n_rounds, per_slot, n_slots;
};
__device__ __forceinline__ RoundPlan round_plan(int n) {
  RoundPlan r;
  r.n_rounds = ((n + 3) / 4 + kRoundChunks - 1) / kRoundChunks;
  r.per_slot = (r.n_rounds + kMaxSlots - 1) / kMaxSlots;
  r.n_slots = (r.n_rounds + r.per_slot - 1) / r.per_slot;
  return r;
}

// One pass: slot_mass[s] = the weight of the slot's rounds (integers: exact, any order), returns the
// row's total (every thread).
template <bool VEC, class Weight>
__device__ unsigned long long mass_pass(const float* row, int n, const RoundPlan& rp, Weight weight, SampleSmem& sm) {
  const int lane = threadIdx.x & 31;
  for (int s = threadIdx.x; s < kMaxSlots; s += kPickThreads) sm.slot_mass[s] = 0;
  __syncthreads();
  for (int round = 0; round < rp.n_rounds; ++round) {
    float4 v[kPickU];
    load_round<VEC, false>(row, n, round, v);
    unsigned long long s = 0;
#pragma unroll
    for (int j = 0; j < kPickU; ++j) s += weight(v[j].x) + weight(v[j].y) + weight(v[j].z) + weight(v[j].w);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
    if (lane == 0 && s != 0) atomicAdd(&sm.slot_mass[round / rp.per_slot], s);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    unsigned long long t = 0;
    for (int s = lane; s < rp.n_slots; s += 32) t += sm.slot_mass[s];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(kFull, t, o);
    if (lane == 0) sm.total = t;
  }
  __syncthreads();
  return sm.total;
}

// Inverse-CDF draw in index order over the weights of the last mass_pass (same `weight`): the index
// where the running sum first exceeds u (u < the total). Finds the slot from slot_mass, then reads
// its rounds again, each thread owning kPickU consecutive chunks, with a block prefix sum per round.
template <bool VEC, class Weight>
__device__ int draw_index(const float* row, int n, const RoundPlan& rp, Weight weight, unsigned long long u,
                          int fallback, SampleSmem& sm) {
  int slot = 0;
  unsigned long long base = 0;
  while (slot < rp.n_slots - 1 && u >= base + sm.slot_mass[slot]) base += sm.slot_mass[slot++];
  if (threadIdx.x == 0) sm.found = -1;  // the scan's barriers order this before the write below
  const int end = min(rp.n_rounds, (slot + 1) * rp.per_slot);
  for (int round = slot * rp.per_slot; round < end; ++round) {
    float4 v[kPickU];
    load_round<VEC, true>(row, n, round, v);
    unsigned long long s = 0;
#pragma unroll
    for (int j = 0; j < kPickU; ++j) s += weight(v[j].x) + weight(v[j].y) + weight(v[j].z) + weight(v[j].w);
    unsigned long long tile;
    const unsigned long long lo = base + block_exclusive_scan(s, sm.warp_sums, &tile);
    if (u >= lo && u - lo < s) {  // this thread's chunks hold the draw (one thread of the CTA)
      unsigned long long acc = lo;
      int found = -1;
#pragma unroll
      for (int j = 0; j < kPickU; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const unsigned long long w = weight(elem(v[j], e));
          if (found < 0 && u - acc < w) found = 4 * round_chunk<true>(round, j) + e;
          acc += w;
        }
      sm.found = found;
    }
    base += tile;
    if (u < base) break;  // uniform
  }
  __syncthreads();
  const int f = sm.found;
  return f >= 0 && f < n ? f : fallback;
}

// Philox-4x32-10 (Salmon et al., SC'11; Random123's constants and round order).
__host__ __device__ __forceinline__ void philox_4x32_10(const uint32_t in[4], const uint32_t key_in[2],
                                                        uint32_t out[4]) {
  uint32_t c0 = in[0], c1 = in[1], c2 = in[2], c3 = in[3], k0 = key_in[0], k1 = key_in[1];
  for (int i = 0; i < 10; ++i) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0), hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// A token's probability in log2 units below the max, d = (max - l) * log2(e) / T >= 0 (+inf for a
// -inf logit), and its mass 2^-d as an integer with the max at 2^40: sums exact and order-free.
constexpr float kMassScale = 1099511627776.0f;  // 2^40
struct TokenMass {
  float m, dscale;
  __device__ __forceinline__ float d(float l) const { return (m - l) * dscale; }
  __device__ __forceinline__ unsigned long long mass(float dl) const { return __float2ull_rn(exp2f(-dl) * kMassScale); }
};

template <bool VEC>
__global__ void __launch_bounds__(kPickThreads) sample_kernel(SampleParams p, int stride) {
  __shared__ SampleSmem sm;
  const int r = blockIdx.x;
  const float* row = p.logits + size_t(r) * stride;
  const int n = p.n_vocab;
  if (threadIdx.x == 0) {  // read and advance the row's step before anything can return
    const unsigned long long s = p.counters ? p.counters[r] : 0ull;
    if (p.counters) p.counters[r] = s + 1;
    sm.step = s;
  }
  const float T = p.temperatures ? p.temperatures[r] : p.temperature;
  const float top_p = p.top_ps ? p.top_ps[r] : p.top_p;
  auto finish = [&](int id, uint32_t fault) {
    if (threadIdx.x == 0) {
      p.ids[r] = id;
      if (fault) raise_status(p.status, fault);
    }
  };
  if (!(T >= 0.0f && T <= FLT_MAX) || !(top_p > 0.0f && top_p <= 1.0f)) return finish(-1, kStatusBadSamplerParams);
  const RowStats st = row_stats<VEC>(row, n, sm.stats);  // (its barrier also publishes sm.step)
  if (st.nan) return finish(-1, kStatusNanLogits);
  if (st.max == -INFINITY) return finish(-1, kStatusNoMass);
  if (T == 0.0f) return finish(st.arg, 0);

  const uint64_t step = sm.step, seed = p.seeds ? p.seeds[r] : p.seed;
  const uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
  auto random64 = [&](uint32_t k) {  // draw k of this row and step
    const uint32_t ctr[4] = {uint32_t(step), uint32_t(step >> 32), p.seeds ? 0u : uint32_t(r), k};
    uint32_t out[4];
    philox_4x32_10(ctr, key, out);
    return (uint64_t(out[0]) << 32) | out[1];
  };
  const RoundPlan rp = round_plan(n);

  if (st.n_inf > 0) {  // the softmax's limit: the +inf logits share all the mass
    auto w = [](float l) { return l == INFINITY ? 1ull : 0ull; };
    const unsigned long long z = mass_pass<VEC>(row, n, rp, w, sm);
    return finish(draw_index<VEC>(row, n, rp, w, __umul64hi(random64(0), z), st.arg, sm), 0);
  }

  // The nucleus N: the tokens whose strictly more probable tokens hold less than top_p of the mass
  // (a tie group at the boundary is kept whole). Rejection: draw x from the set S (first: every
  // token) in proportion to its mass; the mass of the tokens strictly more probable than x (one
  // pass, which also gives the per-slot masses of that set) decides: below top_p, x is in N and is
  // the token; else S becomes that set (it still holds N) and the next draw is from it. Every draw
  // from S that lands in N is distributed as N's renormalised masses, so the result is exact;
  // each rejection drops at least x and in expectation half of S's mass.
  const TokenMass tm{st.max, fminf(__fdiv_rn(kLog2e, T), FLT_MAX)};
  float piv = INFINITY;  // S = {d < piv}
  auto w = [&](float l) {
    const float dl = tm.d(l);
    return dl < piv ? tm.mass(dl) : 0ull;
  };
  unsigned long long zs = mass_pass<VEC>(row, n, rp, w, sm);
  const double want = ceil(double(top_p) * double(zs));
  const unsigned long long target = want >= double(zs) ? zs : want < 1.0 ? 1ull : (unsigned long long)want;
  int id = st.arg;  // after kMaxDraws rejections (never seen): the most probable token, which is in N
  for (int k = 0; k < kMaxDraws; ++k) {
    const int x = draw_index<VEC>(row, n, rp, w, __umul64hi(random64(uint32_t(k)), zs), st.arg, sm);
    if (top_p >= 1.0f) {  // N is every token with mass
      id = x;
      break;
    }
    piv = tm.d(row[x]);
    zs = mass_pass<VEC>(row, n, rp, w, sm);  // the mass strictly more probable than x
    if (zs < target) {
      id = x;
      break;
    }
  }
  finish(id, 0);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Wrappers.

std::string describe_model_status(uint32_t status) {
  std::string out;
  auto add = [&](uint32_t bit, const char* what) {
    if (!(status & bit)) return;
    if (!out.empty()) out += "; ";
    out += what;
  };
  add(kStatusBadToken, "token id outside the vocabulary (embedding row NaN)");
  add(kStatusKvSlotOutOfRange, "K/V append: sequence or position outside the page table (not written)");
  add(kStatusKvPageIdOutOfRange, "K/V append: page id outside [0, n_pages_pool) (not written)");
  add(kStatusKvNotFinite, "NaN/Inf in keys or values (or beyond the f16 range of the KV cache)");
  add(kStatusNanLogits, "NaN in the logits");
  add(kStatusNoMass, "every logit is -inf (no token has any probability)");
  add(kStatusBadSamplerParams, "a per-row temperature (finite, >= 0) or top-p (in (0, 1]) out of range");
  const uint32_t known = kStatusBadToken | kStatusKvSlotOutOfRange | kStatusKvPageIdOutOfRange | kStatusKvNotFinite |
                         kStatusNanLogits | kStatusNoMass | kStatusBadSamplerParams;
  if (const uint32_t other = status & ~known) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "other status bits 0x%x", other);
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out;
}

cudaError_t embed_rows(const EmbedParams& p, cudaStream_t stream) {
  if (p.n_rows < 0 || p.n_embd <= 0 || p.n_vocab <= 0) return cudaErrorInvalidValue;
  if (p.n_rows == 0) return cudaSuccess;
  if (!p.tokens || !p.table || !p.x) return cudaErrorInvalidValue;
  if (!p.f32 && p.n_embd % 8 == 0 && aligned(p.table, 16) && aligned(p.x, 16))
    embed_kernel<8><<<rowwise_grid(p.n_rows, p.n_embd / 8), kRowThreads, 0, stream>>>(p);
  else
    embed_kernel<1><<<rowwise_grid(p.n_rows, p.n_embd), kRowThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t rmsnorm_rows(const RmsNormParams& p_in, cudaStream_t stream) {
  RmsNormParams p = p_in;
  if (p.n_rows < 0 || p.n <= 0 || !(p.eps >= 0.0f) || p.group < 1 || p.group_stride < 0) return cudaErrorInvalidValue;
  if (p.group_stride == 0) p.group_stride = p.group * p.n;
  if ((long long)p.group_stride < (long long)p.group * p.n) return cudaErrorInvalidValue;
  if (p.n_rows == 0) return cudaSuccess;
  if (!p.x || !p.weight || !p.out) return cudaErrorInvalidValue;
  const bool vec = p.n % 4 == 0 && p.group_stride % 4 == 0 && aligned(p.x, 16) && aligned(p.weight, 16) &&
                   aligned(p.out, p.out_f32 ? 16 : 8);
  const dim3 grid(unsigned(p.n_rows));
  if (vec && p.out_f32)
    return launch_pdl(rmsnorm_kernel<4, true>, grid, kRowThreads, stream, p);
  else if (vec)
    return launch_pdl(rmsnorm_kernel<4, false>, grid, kRowThreads, stream, p);
  else if (p.out_f32)
    return launch_pdl(rmsnorm_kernel<1, true>, grid, kRowThreads, stream, p);
  else
    return launch_pdl(rmsnorm_kernel<1, false>, grid, kRowThreads, stream, p);
  return cudaGetLastError();
}

cudaError_t rope_rows(const RopeParams& p, cudaStream_t stream) {
  if (p.n_rows < 0 || p.n_head_q < 0 || p.n_head_k < 0 || p.head_dim <= 0 || p.head_dim % 2 != 0 || p.n_rot <= 0 ||
      p.n_rot % 2 != 0 || p.n_rot > p.head_dim || (p.mode != RopeMode::kNormal && p.mode != RopeMode::kNeox))
    return cudaErrorInvalidValue;
  const int q_stride = p.q_stride != 0 ? p.q_stride : p.n_head_q * p.head_dim;
  const int k_stride = p.k_stride != 0 ? p.k_stride : p.n_head_k * p.head_dim;
  if ((p.n_head_q > 0 && (!p.q || q_stride < p.n_head_q * p.head_dim)) ||
      (p.n_head_k > 0 && (!p.k || k_stride < p.n_head_k * p.head_dim)))
    return cudaErrorInvalidValue;
  if (p.n_rows == 0 || (p.n_head_q == 0 && p.n_head_k == 0)) return cudaSuccess;
  if (!p.positions || !p.inv_freq) return cudaErrorInvalidValue;
  const long long threads = (long long)p.n_rows * (p.n_rot / 2);
  if (threads > (long long)INT_MAX * kRopeThreads) return cudaErrorInvalidValue;
  return launch_pdl(rope_kernel, dim3(unsigned(div_up(threads, kRopeThreads))), kRopeThreads, stream, p, q_stride,
                    k_stride);
}

cudaError_t add_bias_rows(const AddBiasParams& p, cudaStream_t stream) {
  const int y_stride = p.y_stride != 0 ? p.y_stride : p.n;
  if (p.n_rows < 0 || p.n <= 0 || y_stride < p.n) return cudaErrorInvalidValue;
  if (p.n_rows == 0) return cudaSuccess;
  if (!p.y || !p.b) return cudaErrorInvalidValue;
  if (p.n % 4 == 0 && y_stride % 4 == 0 && aligned(p.y, 16) && aligned(p.b, 16))
    add_bias_kernel<4><<<rowwise_grid(p.n_rows, p.n / 4), kRowThreads, 0, stream>>>(p, y_stride);
  else
    add_bias_kernel<1><<<rowwise_grid(p.n_rows, p.n), kRowThreads, 0, stream>>>(p, y_stride);
  return cudaGetLastError();
}

cudaError_t append_kv(const AppendKvParams& p, cudaStream_t stream) {
  if (p.n_rows < 0 || p.n_head_kv <= 0 || p.head_dim <= 0 || p.head_dim % 2 != 0 || p.batch <= 0 ||
      p.n_pages_pool <= 0 || (p.dtype != KvType::kF16 && p.dtype != KvType::kBF16))
    return cudaErrorInvalidValue;
  const int width = p.n_head_kv * p.head_dim;
  const int k_stride = p.k_stride != 0 ? p.k_stride : width, v_stride = p.v_stride != 0 ? p.v_stride : width;
  if (k_stride < width || v_stride < width) return cudaErrorInvalidValue;
  if (p.n_rows == 0) return cudaSuccess;
  if (!p.k || !p.v || !p.row_pos || !p.indptr || !p.indices || !p.k_pool || !p.v_pool || !aligned(p.k_pool, 4) ||
      !aligned(p.v_pool, 4))
    return cudaErrorInvalidValue;
  const bool vec = p.head_dim % 4 == 0 && k_stride % 4 == 0 && v_stride % 4 == 0 && aligned(p.k, 16) &&
                   aligned(p.v, 16) && aligned(p.k_pool, 8) && aligned(p.v_pool, 8);
  const bool bf16 = p.dtype == KvType::kBF16;
  const dim3 grid(unsigned(p.n_rows));
  if (vec && bf16)
    return launch_pdl(append_kv_kernel<4, true>, grid, kAppendThreads, stream, p, k_stride, v_stride);
  else if (vec)
    return launch_pdl(append_kv_kernel<4, false>, grid, kAppendThreads, stream, p, k_stride, v_stride);
  else if (bf16)
    return launch_pdl(append_kv_kernel<2, true>, grid, kAppendThreads, stream, p, k_stride, v_stride);
  else
    return launch_pdl(append_kv_kernel<2, false>, grid, kAppendThreads, stream, p, k_stride, v_stride);
  return cudaGetLastError();
}

cudaError_t swiglu_rows(const SwigluParams& p, cudaStream_t stream) {
  const int gate_stride = p.gate_stride != 0 ? p.gate_stride : p.n_ff;
  const int up_stride = p.up_stride != 0 ? p.up_stride : p.n_ff;
  if (p.n_rows < 0 || p.n_ff <= 0 || gate_stride < p.n_ff || up_stride < p.n_ff) return cudaErrorInvalidValue;
  if (p.n_rows == 0) return cudaSuccess;
  if (!p.gate || !p.up || !p.out) return cudaErrorInvalidValue;
  if (!p.out_f32 && p.n_ff % 4 == 0 && gate_stride % 4 == 0 && up_stride % 4 == 0 && aligned(p.gate, 16) &&
      aligned(p.up, 16) && aligned(p.out, 8))
    return launch_pdl(swiglu_kernel<4>, rowwise_grid(p.n_rows, p.n_ff / 4), kRowThreads, stream, p, gate_stride,
                      up_stride);
  else
    return launch_pdl(swiglu_kernel<1>, rowwise_grid(p.n_rows, p.n_ff), kRowThreads, stream, p, gate_stride, up_stride);
  return cudaGetLastError();
}

cudaError_t f32_to_bf16(const float* in, void* out, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (!in || !out) return cudaErrorInvalidValue;
  const bool vec = aligned(in, 16) && aligned(out, 8);
  const size_t n_vec = vec ? n / 4 : n;
  const unsigned grid = unsigned(std::clamp<size_t>((n_vec + kRowThreads - 1) / kRowThreads, 1, 4096));
  if (vec)
    return launch_pdl(f32_to_bf16_kernel<4>, dim3(grid), kRowThreads, stream, in, out, n);
  else
    return launch_pdl(f32_to_bf16_kernel<1>, dim3(grid), kRowThreads, stream, in, out, n);
  return cudaGetLastError();
}

cudaError_t argmax_rows(const ArgmaxParams& p, cudaStream_t stream) {
  const int stride = p.logits_stride != 0 ? p.logits_stride : p.n_vocab;
  if (p.n_rows < 0 || p.n_vocab <= 0 || stride < p.n_vocab) return cudaErrorInvalidValue;
  if (p.n_rows == 0) return cudaSuccess;
  if (!p.logits || !p.ids) return cudaErrorInvalidValue;
  if (p.n_vocab % 4 == 0 && stride % 4 == 0 && aligned(p.logits, 16))
    argmax_kernel<true><<<unsigned(p.n_rows), kPickThreads, 0, stream>>>(p, stride);
  else
    argmax_kernel<false><<<unsigned(p.n_rows), kPickThreads, 0, stream>>>(p, stride);
  return cudaGetLastError();
}

cudaError_t sample_rows(const SampleParams& p, cudaStream_t stream) {
  const int stride = p.logits_stride != 0 ? p.logits_stride : p.n_vocab;
  if (p.n_rows < 0 || p.n_vocab <= 0 || stride < p.n_vocab) return cudaErrorInvalidValue;
  if (!p.temperatures && !(p.temperature >= 0.0f && p.temperature <= FLT_MAX)) return cudaErrorInvalidValue;
  if (!p.top_ps && !(p.top_p > 0.0f && p.top_p <= 1.0f)) return cudaErrorInvalidValue;
  if (p.n_rows == 0) return cudaSuccess;
  if (!p.logits || !p.ids) return cudaErrorInvalidValue;
  if (p.n_vocab % 4 == 0 && stride % 4 == 0 && aligned(p.logits, 16))
    sample_kernel<true><<<unsigned(p.n_rows), kPickThreads, 0, stream>>>(p, stride);
  else
    sample_kernel<false><<<unsigned(p.n_rows), kPickThreads, 0, stream>>>(p, stride);
  return cudaGetLastError();
}

void philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
  philox_4x32_10(counter, key, out);
}

namespace {

__device__ __forceinline__ uint32_t mix32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}

__global__ void fill_uniform_bf16_kernel(__nv_bfloat16* dst, size_t n, float amp, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = float(mix32(seed * 0x9e3779b97f4a7c15ull + i) >> 8) * (1.0f / 16777216.0f);  // [0, 1)
    dst[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * amp);
  }
}
__global__ void fill_f32_kernel(float* dst, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) dst[i] = v;
}

}  // namespace

cudaError_t fill_uniform_bf16(void* dst, size_t n, float amp, uint64_t seed, cudaStream_t stream) {
  if (!dst) return cudaErrorInvalidValue;
  fill_uniform_bf16_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), n, amp, seed);
  return cudaGetLastError();
}
cudaError_t fill_f32(float* dst, size_t n, float v, cudaStream_t stream) {
  if (!dst) return cudaErrorInvalidValue;
  fill_f32_kernel<<<64, 256, 0, stream>>>(dst, n, v);
  return cudaGetLastError();
}

}  // namespace locks::cuda
