/*
 * Dense prefill attention (docs/math.md §12), what its two kernels share: the block's arguments
 * and the split of the queries into parts of K's dtype. prefill.cu holds the entry
 * (ekv_cuda_prefill_attention) and the GEMM path (S and P in global memory, cuBLAS);
 * prefill_fused.cu the fused kernel (S and P never leave the chip).
 */
#pragma once
#include "prefill.cuh"
#include "../common/loads.cuh"
#include "../common/reduce.cuh"

/* One block's shape and buffers (the fused kernel extends it, prefill_fused.cu) */
struct prefill_args {
    int64_t pos0, T, R, G, Hk, H, D, ld, nk;
    int np;       /* parts of P (and of q' unless nq says otherwise) */
    int nq;       /* parts of q': np, or 1 with q_in_kv_dtype (docs/math.md §12) */
    float qf;     /* (a * scale) rounded as the CPU rounds it */
    float pscale; /* p is split as p * pscale (f16: 2^14, so that its parts stay normal) */
    double a, alpha;
    /* [T][H][D] of q_dtype (ekv_cuda_prefill_block.q), read by split_queries_kernel */
    const void *q;
    ekv_dtype q_dtype;
    const float *slopes;
    float *scores, *qshift, *rinv, *obuf, *att;
    float *ohat; /* [T][H][D] or NULL (ekv_cuda_prefill_block.ohat) */
    void *qparts, *pparts;
    int32_t *bad;
    /* ALiBi's reach (docs/math.md §12.1), or NULL: |k| bounds per KV head (key_bound_kernel),
     * then each row's bound on |s 2^-s| (split_queries_kernel) */
    float *kbound, *qbound;
};

namespace {

/* x = sum of np parts of T (each the rounding of what the earlier parts left, docs/math.md §12;
 * the conversions are the backend's, ekv_elem) */
template <typename T>
__device__ __forceinline__ void split(float x, int np, T *dst, int64_t part_stride) {
    for (int p = 0; p < np; p++) {
        const T h = ekv_elem<T>::from(x);
        dst[p * part_stride] = h;
        x -= ekv_elem<T>::to(h);
    }
}

/* Element i of q as fp32 by the backend's conversions (ekv_elem: exact, each dtype's values
 * are fp32 values); the dtype is launch-uniform. */
__device__ __forceinline__ float query_value(const prefill_args &A, int64_t i) {
    if (A.q_dtype == EKV_DTYPE_F16)
        return ekv_elem<__half>::to(static_cast<const __half *>(A.q)[i]);
    if (A.q_dtype == EKV_DTYPE_BF16)
        return ekv_elem<__nv_bfloat16>::to(static_cast<const __nv_bfloat16 *>(A.q)[i]);
    return static_cast<const float *>(A.q)[i];
}

/* A row's D values of q in fp32 as the split reads them: the lane's elements d = lane + 32 j. */
struct query_row {
    const prefill_args &A;
    int64_t at;
    __device__ __forceinline__ float operator[](int64_t d) const { return query_value(A, at + d); }
};

/* warp (t, h) (ekv_prefill_warp_row), rows t H + h in order: q'[t][h] split into nq parts,
 * shifted by 2^s for f16 (docs/math.md §12); or, with nq 1 (q exact in K's dtype), q itself and
 * a * scale as the row's factor. q is read in its own dtype (query_value). */
template <typename T> __global__ void split_queries_kernel(prefill_args A) {
    ekv_grid_begin();
    const int lane = threadIdx.x & 31;
    const int64_t id = ekv_prefill_warp_row();
    if (id >= A.T * A.H) return; /* warp-uniform */
    const int64_t t = id / A.H, h = id % A.H, g = h / A.G, r = t * A.G + h % A.G;
    const query_row q{A, id * A.D};
    const int64_t row = g * A.R + r, pstride = A.Hk * A.R * A.D;
    T *dst = (T *)A.qparts + row * A.D;
    if (A.qbound) { /* ALiBi's reach: |s 2^-s| <= |q'| max |k| (docs/math.md §12.1) */
        float ss = 0.f;
        for (int64_t d = lane; d < A.D; d += 32) ss = fmaf(q[d] * A.qf, q[d] * A.qf, ss);
        ss = ekv_warp_sum(ss);
        if (lane == 0) A.qbound[row] = __fmul_ru(__fmul_ru(__fsqrt_ru(ss), A.kbound[g]), 1.001f);
    }
    if (A.nq == 1) { /* warp-uniform */
        for (int64_t d = lane; d < A.D; d += 32) dst[d] = ekv_elem<T>::from(q[d]);
        if (lane == 0) A.qshift[row] = A.qf;
        return;
    }
    float mx = 0.f;
    for (int64_t d = lane; d < A.D; d += 32) mx = fmaxf(mx, fabsf(q[d] * A.qf));
    mx = ekv_warp_max(mx);
    /* f16: 2^s lifts the largest into [2^14, 2^15), as split_group_q does (docs/math.md §3.1) */
    int s = 0;
    if (std::is_same<T, __half>::value && mx > 0.f && isfinite(mx)) {
        s = 14 - ilogbf(mx);
        s = s > 126 ? 126 : s;
    }
    for (int64_t d = lane; d < A.D; d += 32)
        split<T>(ldexpf(q[d] * A.qf, s), A.nq, dst + d, pstride);
    if (lane == 0) A.qshift[row] = ldexpf(1.f, -s);
}

enum { KEY_BOUND_THREADS = 256, KEY_BOUND_KEYS = 16 /* a warp's */ };
/* kbound[g] = the largest |k| of KV head g (blockIdx.y) over the keys [0, nkeys), rounded up, or
 * +inf where one is not finite (no reach then: docs/math.md §12.1); kbound zeroed before. A warp
 * a key at a time; the block's largest by one atomic on the float's bits (non-negative floats
 * order as their bits, so reduce.cuh's ekv_float_key, which orders negative ones too, is not
 * needed and kbound stays a float the split reads directly). */
template <typename T>
__global__ void __launch_bounds__(KEY_BOUND_THREADS)
        key_bound_kernel(const T *k, int64_t kstride, int64_t D, int64_t nkeys, float *kbound) {
    ekv_grid_begin();
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31;
    const int64_t g = blockIdx.y,
                  j0 = ((int64_t)blockIdx.x * (KEY_BOUND_THREADS / 32) + (threadIdx.x >> 5)) *
                       KEY_BOUND_KEYS;
    float mx = 0.f;
    for (int64_t j = j0; j < j0 + KEY_BOUND_KEYS && j < nkeys; j++) {
        float ss = 0.f;
        for (int64_t d = lane; d < D; d += 32) {
            const float x = ekv_elem<T>::to(k[j * kstride + g * D + d]);
            ss = fmaf(x, x, ss);
        }
        ss = ekv_warp_sum(ss);
        mx = isfinite(ss) ? fmaxf(mx, __fsqrt_ru(ss)) : __int_as_float(0x7f800000); /* inf */
    }
    mx = ekv_block_max(mx, scratch, 0.f);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int *>(kbound + g), __float_as_int(mx));
}

} // namespace

/* prefill_fused.cu: the fused kernel's passes over the block whose queries are split
 * (A.qparts, A.qshift). */
ekv_status ekv_cuda_prefill_fused(const ekv_cuda_prefill *pf, const ekv_cuda_prefill_block *b,
                                  const prefill_args &A);
