/*
 * The backward's rows pass (flash_entmax_backward.cuh, docs/math.md §13.3): per query row,
 * S = sum p~ (the forward's normaliser, recomputed from tau), sum w~ and sum w~ g (g_j =
 * dout . v_j), written as 1 / S, S^(alpha - 2) and delta = sum w~ g / sum w~ (the scale of w
 * cancels in delta). A block owns 64 rows of one KV head (16 per warp, their q and dout parts
 * staged in shared memory once) and streams the K and V tiles of their keys through two
 * cp.async stages; S = Q K^T and G = dO V^T of each 16-key piece on tensor cores (the products
 * of 16-bit parts are exact, fp32 sums: z within the forward's own rounding, docs/math.md §12).
 */
#include "flash_entmax_backward.cuh"

namespace {

template <int D, int NP> constexpr size_t rows_smem_bytes() {
    return (size_t)2 * NP * BWD_ROW_BLOCK * D * 2 /* q and dout parts */ +
           (size_t)2 * 2 * BWD_KEYS * D * 2; /* two stages of K and V */
}

/* One 64-key tile of the warp's 16 rows: the sums of the lane's two rows (k = 0: lane / 4,
 * k = 1: lane / 4 + 8) over the tile's keys, added to sp, sw, swg. */
template <typename T, int D, int NP>
__device__ __forceinline__ void rows_tile(const bwd_args &A, const unsigned char *qs,
                                          const unsigned char *gs, const unsigned char *kt,
                                          const unsigned char *vt, int64_t k0, const double *tau,
                                          const float *am, const int64_t *pos, const bool *on,
                                          double *sp, double *sw, double *swg) {
    constexpr int PART = BWD_ROW_BLOCK * D * 2, SUB = bwd_tile16<D>();
    const int lane = threadIdx.x & 31;
    float tp[2] = {0.f, 0.f}, tw[2] = {0.f, 0.f}, twg[2] = {0.f, 0.f};
#pragma unroll 1
    for (int q = 0; q < BWD_KEYS / 16; q++) {
        float s[2][4], gv[2][4];
        bwd_tile_dot_parts<T, D, NP>(qs, PART, kt + q * SUB, 0, s);
        bwd_tile_dot_parts<T, D, NP>(gs, PART, vt + q * SUB, 0, gv);
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int k = i >> 1;
                const int64_t j = k0 + 16 * q + 8 * nt + 2 * (lane & 3) + (i & 1);
                float p, w;
                bwd_weights(bwd_z(A, s[nt][i], am[k], pos[k], on[k], j), tau[k], A, &p, &w);
                tp[k] += p;
                if (w != 0.f) tw[k] += w, twg[k] = fmaf(w, gv[nt][i], twg[k]);
            }
    }
    for (int k = 0; k < 2; k++) sp[k] += tp[k], sw[k] += tw[k], swg[k] += twg[k];
}

__device__ __forceinline__ double quad_sum_d(double v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* Block (row block + B blocks..., KV head): the sums of its 64 rows over every key they see. */
template <typename T, int D, int NP>
__global__ void __launch_bounds__(BWD_THREADS) rows_kernel(bwd_args A) {
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int PART = BWD_ROW_BLOCK * D * 2, KT = BWD_KEYS * D * 2;
    unsigned char *qs = smem, *gs = smem + NP * PART, *stages = gs + NP * PART;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t nrb = (A.R + BWD_ROW_BLOCK - 1) / BWD_ROW_BLOCK;
    const int64_t b = blockIdx.x / nrb, r0 = blockIdx.x % nrb * BWD_ROW_BLOCK, g = blockIdx.y;
    const int64_t rlast = (r0 + BWD_ROW_BLOCK < A.R ? r0 + BWD_ROW_BLOCK : A.R) - 1;
    const int64_t nk = A.causal ? A.pos0 + rlast / A.G + 1 : A.N;
    const int64_t ntiles = (nk + BWD_KEYS - 1) / BWD_KEYS;
    bwd_load_rows<T, D, NP>(A, A.q, b, g, r0, BWD_ROW_BLOCK, qs);
    bwd_load_rows<T, D, NP>(A, A.g, b, g, r0, BWD_ROW_BLOCK, gs);
    auto issue = [&](int64_t jt) {
        unsigned char *st = stages + (jt & 1) * 2 * KT;
        bwd_load_keys<T, D>(A, A.k, b, g, jt * BWD_KEYS, st);
        bwd_load_keys<T, D>(A, A.v, b, g, jt * BWD_KEYS, st + KT);
    };
    issue(0);
    cp_async_commit();
    /* the lane's two rows */
    double tau[2], sp[2] = {0, 0}, sw[2] = {0, 0}, swg[2] = {0, 0};
    float am[2];
    int64_t pos[2], r[2];
    bool on[2];
    for (int k = 0; k < 2; k++) {
        r[k] = r0 + 16 * warp + (lane >> 2) + 8 * k;
        on[k] = r[k] < A.R;
        const int64_t rr = on[k] ? r[k] : 0;
        tau[k] = on[k] ? A.tau[bwd_row_index(A, b, g, rr)] : 0.0;
        am[k] = bwd_row_am(A, g, rr);
        pos[k] = A.pos0 + rr / A.G;
    }
    const unsigned char *wq = qs + warp * bwd_tile16<D>(), *wg = gs + warp * bwd_tile16<D>();
    const bool warp_on = r0 + 16 * warp < A.R;
    for (int64_t jt = 0; jt < ntiles; jt++) {
        if (jt + 1 < ntiles) issue(jt + 1);
        cp_async_commit();
        cp_async_wait<1>(); /* this thread's copies of tile jt (and the rows) have landed ... */
        __syncthreads();    /* ... and everyone's */
        const unsigned char *st = stages + (jt & 1) * 2 * KT;
        if (warp_on)
            rows_tile<T, D, NP>(A, wq, wg, st, st + KT, jt * BWD_KEYS, tau, am, pos, on, sp, sw,
                                swg);
        __syncthreads(); /* the stage is free for tile jt + 2 */
    }
    cp_async_wait<0>();
    for (int k = 0; k < 2; k++) {
        const double S = quad_sum_d(sp[k]), SW = quad_sum_d(sw[k]), SWG = quad_sum_d(swg[k]);
        if ((lane & 3) || !on[k]) continue;
        const int64_t i = bwd_row_index(A, b, g, r[k]);
        A.rinv[i] = (float)(1.0 / S);
        A.wscale[i] = (float)pow(S, A.alpha - 2.0);
        A.delta[i] = (float)(SWG / SW);
    }
}

template <typename T, int D, int NP> cudaError_t launch_rows(const bwd_args &A, cudaStream_t s) {
    constexpr auto kernel = rows_kernel<T, D, NP>;
    constexpr size_t bytes = rows_smem_bytes<D, NP>();
    const cudaError_t e = ekv_cuda_allow_smem<kernel>(bytes);
    if (e != cudaSuccess) return e;
    const int64_t nrb = (A.R + BWD_ROW_BLOCK - 1) / BWD_ROW_BLOCK;
    kernel<<<dim3((unsigned)(A.B * nrb), (unsigned)A.Hk), BWD_THREADS, bytes, s>>>(A);
    return cudaGetLastError();
}

template <typename T> cudaError_t launch_rows_t(const bwd_args &A, int np, cudaStream_t s) {
    if (A.D == 64)
        return np == 1 ? launch_rows<T, 64, 1>(A, s) : launch_rows<T, 64, BWD_SPLIT_PARTS>(A, s);
    return np == 1 ? launch_rows<T, 128, 1>(A, s) : launch_rows<T, 128, BWD_SPLIT_PARTS>(A, s);
}

} // namespace

cudaError_t flash_bwd_rows(const bwd_args &A, ekv_dtype kv, int np, cudaStream_t s) {
    return kv == EKV_DTYPE_F16 ? launch_rows_t<__half>(A, np, s)
                               : launch_rows_t<__nv_bfloat16>(A, np, s);
}
