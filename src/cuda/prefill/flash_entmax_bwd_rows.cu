/*
 * The backward's rows pass (flash_entmax_backward.cuh, docs/math.md §13.3, "On tensor cores"):
 * per query row, S = sum p~ (the forward's normaliser, recomputed from tau), sum w~ and
 * sum w~ g (g_j = dout . v_j), written as 1 / S, S^(alpha - 2) and delta = sum w~ g / sum w~
 * (the scale of w cancels in delta) for the keys pass, then dq = sum_j ds_j k_j. A block owns
 * 64 rows of one KV head (16 per warp, their q and dout parts staged in shared memory once)
 * and sweeps the K and V tiles of their keys twice through two cp.async stages:
 *   1. S = Q K^T and G = dO V^T of each 16-key piece (the products of 16-bit parts are exact,
 *      fp32 sums: z within the forward's own rounding, docs/math.md §12), the sums;
 *   2. S and G again, ds = scale S^(alpha - 2) w~ (g - delta), dQ += dS K (dS as
 *      BWD_OPERAND_PARTS 16-bit parts, tile_pv) in registers.
 * dq is the block's alone: no atomics, and the same bits on every call (the keys pass owns dk
 * and dv the same way), at the price of recomputing S and G once more.
 */
#include "flash_entmax_backward.cuh"

namespace {

template <int D, int NP> constexpr size_t rows_smem_bytes() {
    return (size_t)2 * NP * BWD_ROW_BLOCK * D * 2 /* q and dout parts */ +
           (size_t)2 * 2 * BWD_KEYS * D * 2; /* two stages of K and V */
}

/* The lane's two query rows (k = 0: lane / 4 of the warp's 16, k = 1: lane / 4 + 8) and
 * their sums: sweep 1 accumulates sp, sw, swg; sweep 2 reads rinv... from them. */
struct rows_lane {
    int64_t r[2], pos[2];
    double tau[2], sp[2], sw[2], swg[2];
    float am[2], wscale[2], delta[2];
    bool on[2];
};

/* S and G of the warp's rows against 16-key piece q of a tile (tile_dot's layout: row
 * lane / 4 + 8 (i / 2), key 16 q + 8 nt + 2 (lane % 4) + i % 2). */
template <typename T, int D, int NP>
__device__ __forceinline__ void rows_piece(const unsigned char *qs, const unsigned char *gs,
                                           const unsigned char *kt, const unsigned char *vt, int q,
                                           float (*s)[4], float (*gv)[4]) {
    constexpr int PART = BWD_ROW_BLOCK * D * 2, SUB = bwd_tile16<D>();
    bwd_tile_dot_parts<T, D, NP>(qs, PART, kt + q * SUB, 0, s);
    bwd_tile_dot_parts<T, D, NP>(gs, PART, vt + q * SUB, 0, gv);
}

/* Each 16-key piece q of the tile from k0: rows_piece, each score's weights p~ and w~
 * (bwd_weights of its z) to each(nt, i, k, p, w, g) in tile_dot's layout (row k of the lane,
 * g its G entry), then done(q). */
template <typename T, int D, int NP, typename Each, typename Done>
__device__ __forceinline__ void rows_pieces(const bwd_args &A, const unsigned char *qs,
                                            const unsigned char *gs, const unsigned char *kt,
                                            const unsigned char *vt, int64_t k0, const rows_lane &L,
                                            const Each &each, const Done &done) {
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int q = 0; q < BWD_KEYS / 16; q++) {
        float s[2][4], gv[2][4];
        rows_piece<T, D, NP>(qs, gs, kt, vt, q, s, gv);
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int k = i >> 1;
                const int64_t j = k0 + 16 * q + 8 * nt + 2 * (lane & 3) + (i & 1);
                float p, w;
                bwd_weights(bwd_z(A, s[nt][i], L.am[k], L.pos[k], L.on[k], j), L.tau[k], A, &p, &w);
                each(nt, i, k, p, w, gv[nt][i]);
            }
        done(q);
    }
}

/* Sweep 1, one 64-key tile from k0: the sums of the lane's rows over the tile's keys. */
template <typename T, int D, int NP>
__device__ __forceinline__ void rows_sums(const bwd_args &A, const unsigned char *qs,
                                          const unsigned char *gs, const unsigned char *kt,
                                          const unsigned char *vt, int64_t k0, rows_lane &L) {
    float tp[2] = {0.f, 0.f}, tw[2] = {0.f, 0.f}, twg[2] = {0.f, 0.f};
    rows_pieces<T, D, NP>(
            A, qs, gs, kt, vt, k0, L,
            [&](int, int, int k, float p, float w, float g) {
                tp[k] += p;
                if (w != 0.f) tw[k] += w, twg[k] = fmaf(w, g, twg[k]);
            },
            [](int) {});
    for (int k = 0; k < 2; k++) L.sp[k] += tp[k], L.sw[k] += tw[k], L.swg[k] += twg[k];
}

/* Sweep 2, one 64-key tile from k0: dq (16 rows x D, tile_pv's layout) += dS K. */
template <typename T, int D, int NP>
__device__ __forceinline__ void rows_dq(const bwd_args &A, const unsigned char *qs,
                                        const unsigned char *gs, const unsigned char *kt,
                                        const unsigned char *vt, int64_t k0, const rows_lane &L,
                                        float (*dq)[4]) {
    float ds[2][4];
    rows_pieces<T, D, NP>(
            A, qs, gs, kt, vt, k0, L,
            [&](int nt, int i, int k, float, float w, float g) {
                ds[nt][i] = w != 0.f ? A.scale * L.wscale[k] * w * (g - L.delta[k]) : 0.f;
            },
            [&](int q) { tile_pv<T, D, BWD_OPERAND_PARTS>(kt + q * bwd_tile16<D>(), ds, dq); });
}

/* The block's key tiles through two stages (K at st, V at st + KT), use(k0, kt, vt) on each
 * in every warp (block-uniform); the first commit group also holds copies issued before. */
template <typename T, int D, typename Use>
__device__ __forceinline__ void rows_sweep(const bwd_args &A, int64_t b, int64_t g, int64_t ntiles,
                                           unsigned char *stages, Use use) {
    constexpr int KT = BWD_KEYS * D * 2;
    auto issue = [&](int64_t jt) {
        unsigned char *st = stages + (jt & 1) * 2 * KT;
        bwd_load_keys<T, D>(A, A.k, b, g, jt * BWD_KEYS, st);
        bwd_load_keys<T, D>(A, A.v, b, g, jt * BWD_KEYS, st + KT);
    };
    cp_async_two_stages(ntiles, issue, [&](int64_t jt) {
        const unsigned char *st = stages + (jt & 1) * 2 * KT;
        use(jt * BWD_KEYS, st, st + KT);
    });
}

/* x as element i of a tensor of dtype dt (dq: q's dtype). */
__device__ __forceinline__ void store_as(void *p, int dt, int64_t i, float x) {
    if (dt == EKV_DTYPE_F16)
        static_cast<__half *>(p)[i] = __float2half_rn(x);
    else if (dt == EKV_DTYPE_BF16)
        static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(x);
    else
        static_cast<float *>(p)[i] = x;
}

/* Block (row block + B blocks..., KV head): its 64 rows' sums, then their dq. */
template <typename T, int D, int NP>
__global__ void __launch_bounds__(BWD_THREADS) rows_kernel(bwd_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int PART = BWD_ROW_BLOCK * D * 2;
    unsigned char *qs = smem, *gs = smem + NP * PART, *stages = gs + NP * PART;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t nrb = (A.R + BWD_ROW_BLOCK - 1) / BWD_ROW_BLOCK;
    const int64_t b = blockIdx.x / nrb, r0 = blockIdx.x % nrb * BWD_ROW_BLOCK, g = blockIdx.y;
    const int64_t rlast = (r0 + BWD_ROW_BLOCK < A.R ? r0 + BWD_ROW_BLOCK : A.R) - 1;
    const int64_t nk = A.causal ? A.pos0 + rlast / A.G + 1 : A.N;
    const int64_t ntiles = (nk + BWD_KEYS - 1) / BWD_KEYS;
    bwd_load_rows<T, D, NP>(A, A.q, b, g, r0, BWD_ROW_BLOCK, qs);
    bwd_load_rows<T, D, NP>(A, A.g, b, g, r0, BWD_ROW_BLOCK, gs);
    rows_lane L;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        L.r[k] = r0 + 16 * warp + (lane >> 2) + 8 * k;
        L.on[k] = L.r[k] < A.R;
        const int64_t rr = L.on[k] ? L.r[k] : 0;
        L.tau[k] = L.on[k] ? A.tau[bwd_row_index(A, b, g, rr)] : 0.0;
        L.am[k] = bwd_row_am(A, g, rr);
        L.pos[k] = A.pos0 + rr / A.G;
        L.sp[k] = L.sw[k] = L.swg[k] = 0.0;
    }
    const unsigned char *wq = qs + warp * bwd_tile16<D>(), *wg = gs + warp * bwd_tile16<D>();
    const bool warp_on = r0 + 16 * warp < A.R;
    rows_sweep<T, D>(A, b, g, ntiles, stages,
                     [&](int64_t k0, const unsigned char *kt, const unsigned char *vt) {
                         if (warp_on) rows_sums<T, D, NP>(A, wq, wg, kt, vt, k0, L);
                     });
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const double S = ekv_quad_sum(L.sp[k]), SW = ekv_quad_sum(L.sw[k]),
                     SWG = ekv_quad_sum(L.swg[k]);
        L.wscale[k] = (float)pow(S, A.alpha - 2.0);
        L.delta[k] = (float)(SWG / SW);
        if ((lane & 3) || !L.on[k]) continue;
        const int64_t i = bwd_row_index(A, b, g, L.r[k]);
        A.rinv[i] = (float)(1.0 / S), A.wscale[i] = L.wscale[k], A.delta[i] = L.delta[k];
    }
    float dq[D / 8][4];
    mma_zero<D / 8>(dq);
    rows_sweep<T, D>(A, b, g, ntiles, stages,
                     [&](int64_t k0, const unsigned char *kt, const unsigned char *vt) {
                         if (warp_on) rows_dq<T, D, NP>(A, wq, wg, kt, vt, k0, L, dq);
                     });
    /* dq[n][i]: row lane / 4 + 8 (i / 2), dim 8 n + 2 (lane % 4) + i % 2 */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (!L.on[i >> 1]) continue;
        const int64_t o = bwd_row_offset(A, b, g, L.r[i >> 1]) + 2 * (lane & 3) + (i & 1);
#pragma unroll
        for (int n = 0; n < D / 8; n++) store_as(A.dq, A.dq_dtype, o + 8 * n, dq[n][i]);
    }
}

/* The rows pass's launch, for bwd_launch. */
struct rows_pass {
    template <typename T, int D, int NP>
    static cudaError_t launch(const bwd_args &A, cudaStream_t s) {
        constexpr auto kernel = rows_kernel<T, D, NP>;
        constexpr size_t bytes = rows_smem_bytes<D, NP>();
        const cudaError_t e = ekv_cuda_allow_smem<kernel>(bytes);
        if (e != cudaSuccess) return e;
        const int64_t nrb = (A.R + BWD_ROW_BLOCK - 1) / BWD_ROW_BLOCK;
        kernel<<<dim3((unsigned)(A.B * nrb), (unsigned)A.Hk), BWD_THREADS, bytes, s>>>(A);
        return cudaGetLastError();
    }
};

} // namespace

cudaError_t flash_bwd_rows(const bwd_args &A, ekv_dtype kv, int np, cudaStream_t s) {
    return bwd_launch<rows_pass>(A, kv, np, s);
}
