/*
 * Hopper's warpgroup MMA (wgmma.mma_async, PTX ISA "Asynchronous Warpgroup Level Matrix
 * Multiply-Accumulate"): the scores of the fused prefill's sweeps where the code is sm_90a and
 * the head dim 64 (prefill/prefill_fused.cuh, pf_wgmma). tests/gpu/test_wgmma.cu
 * checks it against tile_scores_q (mma.cuh) and a double reference.
 *
 * What it computes: the scores of 64 query rows (a warpgroup: 4 warps of 16 rows, each warp's A
 * fragments the same registers load_q_frags gives mma.sync; q' in 1-3 parts) against a 64-key
 * tile of head dim 64
 * in shared memory, laid out as tile_copy lays it (rows of 128 bytes, 16-byte chunk c of row r at
 * c ^ (r % 8)): that is wgmma's 128-byte swizzle of a K-major operand when the tile starts on a
 * 1024-byte boundary (the swizzle is a function of the address bits). The accumulators come back
 * in tile_z's layout: d[n8][i] = row 16 warp + lane / 4 + 8 (i / 2), key 8 n8 + 2 (lane % 4) +
 * i % 2, summed over the parts' 4 k-steps of 16 dims in the tensor core's fp32 accumulator.
 *
 * wgmma exists only in code compiled for sm_90a (CUDA_ARCHITECTURES 90a: EKV_HAVE_WGMMA), whose
 * cubin runs on compute capability 9.0 only; elsewhere the functions are not defined.
 */
#pragma once
#include "mma.cuh"
#include <stdint.h>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EKV_HAVE_WGMMA 1

/* The shared-memory matrix descriptor of a K-major operand with the 128-byte swizzle: start
 * address / 16 (bits 0-13), leading byte offset / 16 (16-29; unused by this swizzle, 1 by
 * convention), stride byte offset / 16 (32-45: 8 rows of 128 bytes apart), base offset 0 (the
 * tile on a 1024-byte boundary), swizzle mode 1 (62-63: 128 bytes). */
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void *smem) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

/* Shared memory written through the generic proxy (stores, cp.async) made visible to the async
 * proxy that wgmma reads it through: each writing thread after its writes (cp.async: after its
 * wait), before the barrier that the wgmma follow. */
__device__ __forceinline__ void wgmma_fence_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/* Orders the accumulator and A registers' earlier accesses before the wgmma that follow. */
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
/* The 32 accumulators pinned here for the compiler: no access to them is moved across (between
 * wgmma_fence and the wgmma, or above the wait, an access is undefined). */
__device__ __forceinline__ void wgmma_hold(float (*d)[4]) {
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) asm volatile("" : "+f"(d[n][i])::"memory");
}
/* Waits until at most N committed groups are pending. */
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* d (+)= A B for the warpgroup: A 64x16 from each warp's a[4] (its 16 rows), B 16x64 K-major in
 * shared memory at desc; acc 0 starts d from zero. Every thread of the 4 warps calls it. */
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16(float (*d)[4], const uint32_t *a, uint64_t desc,
                                                int acc) {
#define EKV_WGMMA_D                                                                                \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),      \
            "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]),             \
            "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),             \
            "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),             \
            "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]),             \
            "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]),             \
            "+f"(d[7][3])
#define EKV_WGMMA_REGS                                                                             \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, "  \
    "1, 1, 0;\n}\n"
    if constexpr (std::is_same<T, __half>::value)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " EKV_WGMMA_REGS
:EKV_WGMMA_D
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " EKV_WGMMA_REGS
:EKV_WGMMA_D
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
#undef EKV_WGMMA_D
#undef EKV_WGMMA_REGS
}

/* The warpgroup's 64 rows against the 64-key tile kt (head dim 64, tile_copy's layout, on a
 * 1024-byte boundary, written before the caller's barrier): d[n8][i] as the file's comment says,
 * from zero. NP query parts (qa[part][16-dim step], load_q_frags' registers) in one chain of the
 * accumulator, the smallest part first (as tile_pv chains P's parts: the small products are
 * summed before the large ones join; docs/math.md §12); waits for the result. Every thread of
 * the 4 warps calls it. */
template <typename T, int NP>
__device__ __forceinline__ void wgmma_tile_scores64(const unsigned char *kt,
                                                    const uint32_t (*qa)[4][4], float (*d)[4]) {
    const uint64_t desc = wgmma_desc_sw128(kt);
    mma_zero<8>(d); /* not read (the first step starts from zero), but defined for the asm */
    wgmma_hold(d);
    wgmma_fence();
#pragma unroll
    for (int part = NP - 1; part >= 0; part--)
#pragma unroll
        for (int kk = 0; kk < 4; kk++) /* 16 dims = 32 bytes further along each 128-byte row */
            wgmma_m64n64k16<T>(d, qa[part][kk], desc + (uint64_t)(kk * 32 >> 4),
                               part < NP - 1 || kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(d);
}

#endif
