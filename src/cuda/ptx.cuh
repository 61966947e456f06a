// PTX wrappers of the LOCKS kernels (inline asm, sm_90a): warp-level tensor-core MMAs, cp.async and
// bulk copies with L2 cache hints, mbarriers, shared-memory release/acquire, PDL, the global timer;
// and the register-level operand (un)packing the MMAs take: int4/int8 codes, f16 pairs, uint4 words.
// Self-contained (CUDA headers only), so bench/cuda_read_patterns.cu builds on it standalone.
//
// Fragment conventions (PTX ISA, mma.m16n8k16 with .row.col), for lane = 4 * g + t:
//   A (16 x 16): a[0] = (row g,   cols 2t, 2t+1)   a[1] = (row g+8, cols 2t, 2t+1)
//                a[2] = (row g,   cols 2t+8, 2t+9) a[3] = (row g+8, cols 2t+8, 2t+9)
//   B (16 x 8):  b[0] = (rows 2t, 2t+1, col g)     b[1] = (rows 2t+8, 2t+9, col g)
//   C (16 x 8):  c[0], c[1] = (row g, cols 2t, 2t+1)   c[2], c[3] = (row g+8, cols 2t, 2t+1)
// Within a 32-bit register the lower-indexed element is the low half. m16n8k32 (int8) has the same
// layout with four 8-bit elements per register.
//
// The K dimension of a product is a sum, so any permutation of it applied to both A and B gives the
// same result. The kernels use that freedom to let every lane read its operands with 16-byte loads
// straight from memory (no shared-memory staging): see the per-kernel "K permutation" comments and
// docs/cuda-design.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace locks::cuda::detail {

// ---------------------------------------------------------------------------------------------
// Tensor-core MMAs.

// C (16x8, f32) += A (16x16) B (16x8), f16 or bf16 operands (the tag's type).
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, __half) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          __nv_bfloat16) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// C (16x8, s32) += A (16x32, s8) B (32x8, u8 or s8): exact integer dot products.
__device__ __forceinline__ void mma_s8u8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_s8s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D (8x8) += A (8x4) B (4x8) in float64 on the tensor cores: a = A[lane / 4][lane % 4],
// b = B[lane % 4][lane / 4], d[e] = D[lane / 4][2 (lane % 4) + e] (PTX ISA, mma m8n8k4 .f64).
__device__ __forceinline__ void dmma_884(double (&d)[2], double a, double b) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+d"(d[0]), "+d"(d[1])
               : "d"(a), "d"(b));
}

// 2^x, the SFU's approximation (flushes subnormals).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------
// Memory: L2 cache policies, asynchronous copies into shared memory, mbarriers.

// L2 policies for data read once (evict_first) and data a following kernel reads (evict_last).
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint64_t l2_evict_last() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void st_with_policy(float* gmem, float v, uint64_t pol) {
  asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;\n" ::"l"(gmem), "f"(v), "l"(pol) : "memory");
}

// 16 bytes global -> shared, bypassing L1; !valid fills zeros (the source is not read).
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem, bool valid, uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 16 : 0), "l"(pol));
}
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Makes mbarrier initialisation visible to the async proxy (the bulk copies complete on it).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also arms the phase with the bytes the bulk copies will complete.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Spins until the phase of the given parity completes.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n @!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// One bulk copy (the TMA unit) global -> shared, completing `bytes` on the mbarrier `bar`.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar, uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(pol)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// A shared-memory word written with release and read with acquire (CTA scope). Atomics rather than
// st.release / ld.acquire, which order the same way, so that compute-sanitizer's racecheck sees
// synchronisation rather than a racing plain store and load.
__device__ __forceinline__ void publish_use(uint32_t addr, uint32_t v) {
  asm volatile("atom.release.cta.shared::cta.exch.b32 _, [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t read_use(uint32_t addr) {
  uint32_t v;
  asm volatile("atom.acquire.cta.shared::cta.or.b32 %0, [%1], 0;\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// A global word read with acquire (GPU scope).
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch: wait for the previous kernel in the stream before reading its
// results (no-op when the kernel was launched without the PDL attribute). Data that a previous
// kernel may write (the selection, the page table, K of fresh pages) is never read through the
// non-coherent path (__ldg): such loads count as reads of memory that no one writes while the kernel
// runs, so the compiler may hoist them above the wait. __ldcg reads at the L2 instead.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The device's nanosecond clock.
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// ---------------------------------------------------------------------------------------------
// Operand (un)packing (exact: every int8 code is an integer that f16 represents exactly).

// Word w (0..3) of a 16-byte load.
__device__ __forceinline__ uint32_t u4_word(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// Eight offset-binary int4 codes (record_layout.h: nibble = code + 8) as two u8x4 MMA operands:
// lo = the low nibbles of the four bytes, hi = the high ones; the offset is subtracted afterwards.
__device__ __forceinline__ void unpack_u4x8(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = w & 0x0f0f0f0fu;
  hi = (w >> 4) & 0x0f0f0f0fu;
}

// Four signed codes in [-128, 127] as one s8x4 MMA operand (a in the low byte).
__device__ __forceinline__ uint32_t pack_s8x4(int a, int b, int c, int d) {
  return (uint32_t(a) & 0xffu) | ((uint32_t(b) & 0xffu) << 8) | ((uint32_t(c) & 0xffu) << 16) | (uint32_t(d) << 24);
}

__device__ __forceinline__ uint32_t hsub2_bits(uint32_t a, uint32_t b) {
  __half2 r = __hsub2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

/// Four signed int8 codes (bytes b0..b3) to two f16 pairs: lo = (b0, b1), hi = (b2, b3).
__device__ __forceinline__ void unpack_int8x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t u = w ^ 0x80808080u;  // c -> c + 128
  const uint32_t k1152 = 0x64806480u;  // (1152, 1152) = 1024 + 128
  lo = hsub2_bits(__byte_perm(u, 0x64646464u, 0x4140u), k1152);
  hi = hsub2_bits(__byte_perm(u, 0x64646464u, 0x4342u), k1152);
}

// The low / high f16 of a 32-bit pair, as float.
__device__ __forceinline__ float h2f_lo(uint32_t w) { return __half2float(__ushort_as_half(uint16_t(w & 0xffffu))); }
__device__ __forceinline__ float h2f_hi(uint32_t w) { return __half2float(__ushort_as_half(uint16_t(w >> 16))); }

}  // namespace locks::cuda::detail
