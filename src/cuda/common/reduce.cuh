/*
 * Device-side reductions of the CUDA backend: warp and block sums, maxima and minima, running
 * maxima shared through device memory as ordered keys, a warp-aggregated append and a block
 * scan.
 */
#pragma once
#include <stdint.h>

template <typename T> __device__ __forceinline__ T ekv_warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
/* op folded over the 4 lanes of a quad (the lanes that hold one row of an mma fragment,
 * mma.cuh), in every lane of it: lane ^ 1, then lane ^ 2. */
template <typename T, typename Op> __device__ __forceinline__ T ekv_quad_fold(T v, Op op) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return op(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
template <typename T> __device__ __forceinline__ T ekv_quad_sum(T v) {
    return ekv_quad_fold(v, [](T a, T b) { return a + b; });
}
template <typename T> __device__ __forceinline__ T ekv_warp_max(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        T w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}
template <typename T> __device__ __forceinline__ T ekv_warp_min(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        T w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}
/* Block-wide reductions (sum, max); every thread gets the result. scratch: >= 32
 * elements of shared memory; identity: the value of an empty warp slot. */
template <typename T, typename WarpOp>
__device__ __forceinline__ T ekv_block_reduce(T v, T *scratch, T identity, WarpOp warp_op) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_op(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_op(lane < nw ? scratch[lane] : identity);
}
template <typename T> __device__ __forceinline__ T ekv_block_sum(T v, T *scratch) {
    return ekv_block_reduce(v, scratch, T(0), [](T x) { return ekv_warp_sum(x); });
}
template <typename T> __device__ __forceinline__ T ekv_block_max(T v, T *scratch, T lowest) {
    return ekv_block_reduce(v, scratch, lowest, [](T x) { return ekv_warp_max(x); });
}

/* Running maxima shared through device memory as ordered keys: atomicMax on the key orders
 * like the float; key 0 (what a memset gives) is below every float ("none yet"). */
__device__ __forceinline__ uint32_t ekv_float_key(float x) {
    const uint32_t b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float ekv_key_float(uint32_t k) {
    if (k == 0) return -__int_as_float(0x7f800000);
    return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

/* *p as a relaxed load at GPU scope: some value of *p's atomics (every writer is a kernel on this
 * GPU), read from L2. A volatile load is a relaxed load at system scope (LDG.E.STRONG.SYS), which
 * the screen's warps waited on longer; the 256K trace's screened step was 2.3 % / 2.7 % faster at
 * layers 0 / 7 with this one (H100, bench/RESULTS.md, sixteenth session). */
__device__ __forceinline__ uint32_t ekv_load_relaxed_gpu(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/* The largest values published to keys[g] so far, read early by lane 0 (pre[g]) so that the
 * load's latency hides behind the warp's work until ekv_share_max uses it. Any value read is
 * a max some warp held, so a stale one only keeps more candidates (docs/math.md §10.3). */
template <int GM>
__device__ __forceinline__ void ekv_peek_max(const uint32_t *keys, int G, uint32_t *pre) {
#pragma unroll
    for (int g = 0; g < GM; g++)
        pre[g] = (threadIdx.x & 31) == 0 && g < G ? ekv_load_relaxed_gpu(keys + g) : 0u;
}

/* The warp's maxima mine[g] (any lanes) published to keys[g] (atomicMax where they beat what
 * the warp knows), and seen[g] (every lane) raised to the largest value known: the peeked
 * keys pre[g] (ekv_peek_max) and the warp's own. Only ever a max of values some warp holds.
 * Warp-uniform call. */
template <int GM>
__device__ __forceinline__ void ekv_share_max(const float *mine, float *seen, uint32_t *keys, int G,
                                              const uint32_t *pre) {
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= G) break;
        const float m = ekv_warp_max(mine[g]);
        const float s = fmaxf(seen[g], ekv_key_float(__shfl_sync(0xffffffffu, pre[g], 0)));
        if (m > s && (threadIdx.x & 31) == 0) atomicMax(keys + g, ekv_float_key(m));
        seen[g] = fmaxf(s, m);
    }
}

/* Warp-aggregated appends to a list whose length is *count: ekv_warp_reserve takes n places for
 * the whole warp with one atomic (lane 0's) and returns the first to every lane; a lane's place
 * among the lanes of a ballot m is ekv_lane_rank(m) after it. Warp-uniform calls. */
template <typename C> __device__ __forceinline__ C ekv_warp_reserve(C *count, C n) {
    C at = 0;
    if ((threadIdx.x & 31) == 0 && n) at = atomicAdd(count, n);
    return __shfl_sync(0xffffffffu, at, 0);
}
__device__ __forceinline__ int ekv_lane_rank(unsigned m) {
    return __popc(m & ((1u << (threadIdx.x & 31)) - 1));
}
/* ekv_warp_reserve for the lists g < G of lengths counts[g] at once: at[g] the first of n[g]
 * places (0 where n[g] = 0), every list's atomic in flight before any is waited on (one round
 * trip for all, not one a list). GM >= G. */
template <int GM>
__device__ __forceinline__ void
ekv_warp_reserve_lists(uint32_t *counts, int G, const uint32_t (&n)[GM], uint32_t (&at)[GM]) {
    uint32_t got[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) {
        got[g] = 0;
        if ((threadIdx.x & 31) == 0 && g < G && n[g]) got[g] = atomicAdd(counts + g, n[g]);
    }
#pragma unroll
    for (int g = 0; g < GM; g++) at[g] = __shfl_sync(0xffffffffu, got[g], 0);
}
/* ekv_warp_reserve_lists for the lanes set in ballots: list g takes as many places as the bits
 * of m[0..N)[g], at[g] the first of them (a lane's place in ballot i is at[g] plus the bits of
 * the ballots before it plus ekv_lane_rank(m[i][g])). GM >= G. */
template <int N, int GM>
__device__ __forceinline__ void ekv_warp_reserve_ballots(uint32_t *counts, int G,
                                                         const unsigned (&m)[N][GM],
                                                         uint32_t (&at)[GM]) {
    uint32_t n[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) {
        n[g] = 0;
#pragma unroll
        for (int i = 0; i < N; i++) n[g] += (uint32_t)__popc(m[i][g]);
    }
    ekv_warp_reserve_lists<GM>(counts, G, n, at);
}
/* One value a lane: the lanes with take get consecutive slots; returns the lane's slot. */
__device__ __forceinline__ uint32_t ekv_warp_append(bool take, uint32_t *count) {
    const unsigned m = __ballot_sync(0xffffffffu, take);
    if (!m) return 0;
    return ekv_warp_reserve(count, (uint32_t)__popc(m)) + (uint32_t)ekv_lane_rank(m);
}

/* hist[bin] += 1 for every lane whose bin >= 0, one shared atomic per distinct bin of the warp
 * (its lanes matched by __match_any_sync): keys whose top digits are equal do not serialise 32
 * atomics on one bin. Warp-uniform calls. */
__device__ __forceinline__ void ekv_warp_count_bin(int *hist, int bin) {
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    if (bin >= 0 && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(hist + bin, __popc(peers));
}

/* Exclusive block scan of per-thread counts: returns the sum over lower threads, *total the
 * block's sum. wsum: 32 T of shared memory. */
template <typename T>
__device__ __forceinline__ T ekv_block_exclusive_scan(T v, T *wsum, T *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    T incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        const T x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
    }
    __syncthreads();
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    T before = 0, all = 0;
    for (int w = 0; w < nw; w++) {
        const T c = wsum[w];
        before += w < warp ? c : 0;
        all += c;
    }
    *total = all;
    return before + incl - v;
}
