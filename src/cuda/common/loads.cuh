/*
 * Device-side loads of the CUDA backend: 8 consecutive K or V elements of any storage type as
 * fp32, and cp.async (sm_80+), global to shared memory without registers.
 */
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

/* ---- element loads: 8 consecutive elements as fp32 (16-byte aligned for 16-bit types).
 * load8 reads global memory through the read-only path; unpack8 converts 8 elements already
 * loaded (e.g. staged in shared memory by cp.async). ---- */
template <typename T> struct ekv_elem;

/* The two 16-bit storage types convert by pairs: __half2 and __nv_bfloat162 to float2. */
__device__ __forceinline__ float2 ekv_pair_f32(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ float2 ekv_pair_f32(__nv_bfloat162 h) { return __bfloat1622float2(h); }
template <typename T> struct ekv_pair_of;
template <> struct ekv_pair_of<__half> { typedef __half2 type; };
template <> struct ekv_pair_of<__nv_bfloat16> { typedef __nv_bfloat162 type; };

/* 2 N2 16-bit elements of type T held in the registers r (a uint2 or uint4), as fp32. */
template <typename T, int N2, typename R>
__device__ __forceinline__ void ekv_unpack_pairs(const R &r, float *o) {
    typedef typename ekv_pair_of<T>::type P;
    const P *h = reinterpret_cast<const P *>(&r);
#pragma unroll
    for (int i = 0; i < N2; i++) {
        const float2 f = ekv_pair_f32(h[i]);
        o[2 * i] = f.x;
        o[2 * i + 1] = f.y;
    }
}

/* unpack8 / load8 of the 16-bit types (16-byte aligned). */
template <typename T> struct ekv_elem16 {
    static __device__ __forceinline__ void unpack8(const T *p, float *o) {
        ekv_unpack_pairs<T, 4>(*reinterpret_cast<const uint4 *>(p), o);
    }
    static __device__ __forceinline__ void load8(const T *p, float *o) {
        ekv_unpack_pairs<T, 4>(__ldg(reinterpret_cast<const uint4 *>(p)), o);
    }
};
template <> struct ekv_elem<__half> : ekv_elem16<__half> {
    static __device__ __forceinline__ __half from(float x) { return __float2half_rn(x); }
    static __device__ __forceinline__ float to(__half x) { return __half2float(x); }
};
template <> struct ekv_elem<__nv_bfloat16> : ekv_elem16<__nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ float to(__nv_bfloat16 x) { return __bfloat162float(x); }
};
template <> struct ekv_elem<float> {
    static __device__ __forceinline__ void unpack8(const float *p, float *o) {
        const float4 a = *reinterpret_cast<const float4 *>(p),
                     b = *(reinterpret_cast<const float4 *>(p) + 1);
        o[0] = a.x;
        o[1] = a.y;
        o[2] = a.z;
        o[3] = a.w;
        o[4] = b.x;
        o[5] = b.y;
        o[6] = b.z;
        o[7] = b.w;
    }
    static __device__ __forceinline__ void load8(const float *p, float *o) {
        const float4 r[2] = {__ldg(reinterpret_cast<const float4 *>(p)),
                             __ldg(reinterpret_cast<const float4 *>(p) + 1)};
        unpack8(reinterpret_cast<const float *>(r), o);
    }
    static __device__ __forceinline__ float from(float x) { return x; }
    static __device__ __forceinline__ float to(float x) { return x; }
};

/* ---- shared-memory reductions ---- */
/* v added to the counter at shared address s (a reduction: no result), unpredicated: ptxas wraps
 * even a predicated red.shared in a branch region (its warp-aggregated increment), so a caller
 * that would skip a lane adds elsewhere or adds 0 instead. The address, not a pointer: a caller
 * that forms it with integer operations spends no conversion a call. */
__device__ __forceinline__ void red_shared_add(uint32_t s, unsigned v) {
    asm volatile("red.shared.add.u32 [%0], %1;\n" ::"r"(s), "r"(v) : "memory");
}

/* ---- cp.async (sm_80+): global -> shared without registers ---- */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
/* Which tiles a two-stage loop runs: all of them (cp_async_all), or until no thread of the block
 * wants another (cp_async_until: more() after each tile, ORed over the block at the barrier the
 * loop meets anyway). */
struct cp_async_all {
    static constexpr bool stops = false;
    __device__ __forceinline__ bool operator()() const { return true; }
};
template <typename F> struct cp_async_until {
    static constexpr bool stops = true;
    F more;
    __device__ __forceinline__ bool operator()() const { return more(); }
};
template <typename F> __device__ __forceinline__ cp_async_until<F> cp_async_until_of(F f) {
    return cp_async_until<F>{f};
}

/* ntiles tiles through two shared-memory stages, tile j in stage j % 2: issue(j) starts tile j's
 * cp.async copies (tile j + 1's overlap use(j)), use(j) runs once every thread's copies of tile j
 * have landed. Block-uniform call; copies issued before it join tile 0's commit group. landed()
 * runs in each thread after its copies of a tile landed, before the barrier (a proxy fence when
 * use reads the tile through the async proxy: wgmma). more (cp_async_all or cp_async_until) ends
 * the loop early: a tile already issued is waited for, not used. */
template <typename Issue, typename Use, typename Landed, typename More = cp_async_all>
__device__ __forceinline__ void cp_async_two_stages(int64_t ntiles, const Issue &issue,
                                                    const Use &use, const Landed &landed,
                                                    const More &more = More()) {
    issue(0);
    cp_async_commit();
    for (int64_t j = 0; j < ntiles; j++) {
        if (j + 1 < ntiles) issue(j + 1);
        cp_async_commit();
        cp_async_wait<1>(); /* this thread's copies of tile j have landed ... */
        landed();
        __syncthreads(); /* ... and everyone's */
        use(j);
        if constexpr (More::stops) { /* the stage is free for tile j + 2, if one is wanted */
            if (!__syncthreads_or(more())) break;
        } else {
            __syncthreads(); /* the stage is free for tile j + 2 */
        }
    }
    cp_async_wait<0>();
}
template <typename Issue, typename Use>
__device__ __forceinline__ void cp_async_two_stages(int64_t ntiles, const Issue &issue,
                                                    const Use &use) {
    cp_async_two_stages(ntiles, issue, use, [] {});
}

/* q' = qscale q of a GQA group's heads (their n = G D contiguous query elements from qg) into
 * shared memory, as every stage that scores, bounds or screens keys forms it: the bounds of the
 * bound stage, the screen and round 0 are of the scores kernel's own scores only if their q' is
 * that kernel's bit for bit (docs/math.md §9.5). Block-strided; no barrier. */
__device__ __forceinline__ void ekv_group_query(const float *qg, double qscale, int n, float *qs) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) qs[i] = (float)(qscale * qg[i]);
}
