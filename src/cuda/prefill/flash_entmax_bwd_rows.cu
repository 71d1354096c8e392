/*
 * The backward's rows pass (flash_entmax_backward.cuh, docs/math.md §13.3, "On tensor cores"):
 * per query row, delta = dout . o-hat from the forward's o-hat (before the sweep), then one sweep
 * for S = sum p~ (the forward's normaliser, recomputed from tau) and dq = sum_j ds_j k_j, with
 * ds = scale S^(alpha - 2) w~ (g - delta) (g_j = dout . v_j): the sweep sums
 * scale w~ (g - delta) k and the row's factor S^(alpha - 2) is applied at its end. 1 / S,
 * S^(alpha - 2) and delta are written for the keys pass. A block owns 64 rows of one KV head (16
 * per warp, their q and dout parts staged in shared memory once) and sweeps the K and V tiles of
 * their keys through two cp.async stages, computing S = Q K^T and G = dO V^T of each 16-key piece
 * (the products of 16-bit parts are exact, fp32 sums: z within the forward's own rounding,
 * docs/math.md §12) and dQ += dS K (dS as BWD_OPERAND_PARTS 16-bit parts, tile_pv).
 * dq is the block's alone: no atomics, and the same bits on every call (the keys pass owns dk
 * and dv the same way).
 */
#include "flash_entmax_backward.cuh"

namespace {

template <int D, int NP> constexpr size_t rows_smem_bytes() {
    return (size_t)2 * NP * BWD_ROW_BLOCK * D * 2 /* q and dout parts */ +
           (size_t)2 * 2 * BWD_KEYS * D * 2; /* two stages of K and V */
}

/* The lane's two query rows (k = 0: lane / 4 of the warp's 16, k = 1: lane / 4 + 8), their
 * delta and sum of p~ (sp), and per tile the keys they see (vis) and rel0 = k0 - pos as a float
 * (bwd_z). */
struct rows_lane {
    int64_t r[2], pos[2];
    bwd_tau tau[2];
    double sp[2];
    float am[2], delta[2], rel0[2];
    int vis[2];
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
 * g its G entry), then done(q). L.vis and L.rel0 are the tile's. */
template <typename T, int D, int NP, int W, typename Each, typename Done>
__device__ __forceinline__ void rows_pieces(const bwd_args &A, const unsigned char *qs,
                                            const unsigned char *gs, const unsigned char *kt,
                                            const unsigned char *vt, const rows_lane &L,
                                            const Each &each, const Done &done) {
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int q = 0; q < BWD_KEYS / 16; q++) {
        float s[2][4], gv[2][4];
        rows_piece<T, D, NP>(qs, gs, kt, vt, q, s, gv);
        const int j0 = 16 * q + 2 * (lane & 3); /* the lane's first key of the piece */
        const float j0f = (float)j0;
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int k = i >> 1, dj = 8 * nt + (i & 1);
                const float z = bwd_z(A, s[nt][i], L.am[k], L.rel0[k] + (j0f + (float)dj),
                                      j0 + dj < L.vis[k]);
                float p, w;
                bwd_weights<W>(A, z, L.tau[k], &p, &w);
                each(nt, i, k, p, w, gv[nt][i]);
            }
        done(q);
    }
}

/* One 64-key tile: sp += p~ of the lane's rows (fp32 over the tile, double across tiles), and
 * dq (16 rows x D, tile_pv's layout) += dS' K with ds' = scale w~ (g - delta): ds without its
 * row's factor S^(alpha - 2), which the sweep finds (rows_kernel applies it at the end). */
template <typename T, int D, int NP, int W>
__device__ __forceinline__ void rows_tile(const bwd_args &A, const unsigned char *qs,
                                          const unsigned char *gs, const unsigned char *kt,
                                          const unsigned char *vt, rows_lane &L, float (*dq)[4]) {
    float ds[2][4], sp[2] = {0.f, 0.f};
    rows_pieces<T, D, NP, W>(
            A, qs, gs, kt, vt, L,
            [&](int nt, int i, int k, float p, float w, float g) {
                sp[k] += p;
                ds[nt][i] = bwd_ds(A.scale, w, g, L.delta[k]);
            },
            [&](int q) { tile_pv<T, D, BWD_OPERAND_PARTS>(kt + q * bwd_tile16<D>(), ds, dq); });
    for (int k = 0; k < 2; k++) L.sp[k] += sp[k];
}

/* delta = dout . o-hat of the lane's row k (docs/math.md §13.3), in double over the 4 lanes of
 * the row (each a quarter of D; dout as the sum of its NP parts). Every lane of the warp calls
 * it; 0 for no row. */
template <typename T, int D, int NP>
__device__ __forceinline__ float rows_delta(const bwd_args &A, int64_t b, int64_t g,
                                            const rows_lane &L, int k) {
    const int lane = threadIdx.x & 31;
    const int64_t o = bwd_row_offset(A, b, g, L.on[k] ? L.r[k] : 0);
    const T *dout = static_cast<const T *>(A.g) + o;
    const float *oh = A.ohat + o;
    double x = 0;
    for (int d = (lane & 3) * (D / 4); d < ((lane & 3) + 1) * (D / 4); d++) {
        float gd = 0.f;
#pragma unroll
        for (int p = 0; p < NP; p++) gd += ekv_elem<T>::to(dout[p * A.part_stride + d]);
        x += (double)gd * (double)oh[d];
    }
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return L.on[k] ? (float)x : 0.f;
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

/* The lane's rows of the row block from r0: index, position, tau, slope; delta and sp 0. */
__device__ __forceinline__ void rows_lane_init(const bwd_args &A, int64_t b, int64_t g, int64_t r0,
                                               rows_lane &L) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        L.r[k] = r0 + 16 * warp + (lane >> 2) + 8 * k;
        L.on[k] = L.r[k] < A.R;
        const int64_t rr = L.on[k] ? L.r[k] : 0;
        L.tau[k] = bwd_tau_of(L.on[k] ? A.tau[bwd_row_index(A, b, g, rr)] : 0.0);
        L.am[k] = bwd_row_am(A, g, (int)(rr % A.G));
        L.pos[k] = A.pos0 + rr / A.G;
        L.sp[k] = 0.0;
        L.delta[k] = 0.f;
    }
}

/* The tile from k0 as the lane's rows see it (L.vis, L.rel0). */
__device__ __forceinline__ void rows_lane_tile(const bwd_args &A, int64_t k0, rows_lane &L) {
#pragma unroll
    for (int k = 0; k < 2; k++) {
        L.vis[k] = bwd_visible(A, L.pos[k], L.on[k], k0);
        L.rel0[k] = (float)(k0 - L.pos[k]);
    }
}

/* After the sweep: each row's S^(alpha - 2) into wscale[k], and 1 / S, S^(alpha - 2) and delta
 * into the keys pass's arrays (a lane per row). */
__device__ __forceinline__ void rows_finish(const bwd_args &A, int64_t b, int64_t g,
                                            const rows_lane &L, float *wscale) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const double S = ekv_quad_sum(L.sp[k]);
        wscale[k] = (float)pow(S, A.alpha - 2.0);
        if ((lane & 3) || !L.on[k]) continue;
        const int64_t i = bwd_row_index(A, b, g, L.r[k]);
        A.rinv[i] = (float)(1.0 / S), A.wscale[i] = wscale[k], A.delta[i] = L.delta[k];
    }
}

/* Block (reversed row block, sequence, KV head): its 64 rows' delta, sums and dq. */
template <typename T, int D, int NP, int W>
__global__ void __launch_bounds__(BWD_THREADS) rows_kernel(bwd_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int PART = BWD_ROW_BLOCK * D * 2;
    unsigned char *qs = smem, *gs = smem + NP * PART, *stages = gs + NP * PART;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t nrb = bwd_row_blocks(A.R);
    /* x = (reversed row block, sequence, KV head), the longest rows first (causal: the last
     * row blocks see the most keys), so the grid's last wave holds the short ones */
    const int64_t g = blockIdx.x % A.Hk, rest = blockIdx.x / A.Hk, b = rest % A.B;
    const int64_t r0 = (nrb - 1 - rest / A.B) * BWD_ROW_BLOCK;
    const int64_t rlast = (r0 + BWD_ROW_BLOCK < A.R ? r0 + BWD_ROW_BLOCK : A.R) - 1;
    const int64_t nk = A.causal ? A.pos0 + rlast / A.G + 1 : A.N;
    const int64_t ntiles = bwd_key_tiles(nk);
    bwd_load_rows<T, D, NP>(A, A.q, b, g, r0, BWD_ROW_BLOCK, qs);
    bwd_load_rows<T, D, NP>(A, A.g, b, g, r0, BWD_ROW_BLOCK, gs);
    rows_lane L;
    rows_lane_init(A, b, g, r0, L);
    for (int k = 0; k < 2; k++) L.delta[k] = rows_delta<T, D, NP>(A, b, g, L, k);
    const unsigned char *wq = qs + warp * bwd_tile16<D>(), *wg = gs + warp * bwd_tile16<D>();
    const bool warp_on = r0 + 16 * warp < A.R;
    float dq[D / 8][4], wscale[2];
    mma_zero<D / 8>(dq);
    rows_sweep<T, D>(A, b, g, ntiles, stages,
                     [&](int64_t k0, const unsigned char *kt, const unsigned char *vt) {
                         rows_lane_tile(A, k0, L);
                         if (warp_on) rows_tile<T, D, NP, W>(A, wq, wg, kt, vt, L, dq);
                     });
    rows_finish(A, b, g, L, wscale);
    /* dq[n][i]: row lane / 4 + 8 (i / 2), dim 8 n + 2 (lane % 4) + i % 2; times S^(alpha - 2) */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (!L.on[i >> 1]) continue;
        const int64_t o = bwd_row_offset(A, b, g, L.r[i >> 1]) + 2 * (lane & 3) + (i & 1);
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            store_as(A.dq, A.dq_dtype, o + 8 * n, wscale[i >> 1] * dq[n][i]);
    }
}

/* The rows pass's launch, for bwd_launch. */
struct rows_pass {
    template <typename T, int D, int NP, int W>
    static cudaError_t launch(const bwd_args &A, cudaStream_t s) {
        constexpr auto kernel = rows_kernel<T, D, NP, W>;
        constexpr size_t bytes = rows_smem_bytes<D, NP>();
        const cudaError_t e = ekv_cuda_allow_smem<kernel>(bytes);
        if (e != cudaSuccess) return e;
        kernel<<<(unsigned)bwd_rows_grid(A.B, A.R, A.Hk), BWD_THREADS, bytes, s>>>(A);
        return cudaGetLastError();
    }
};

} // namespace

cudaError_t flash_bwd_rows(const bwd_args &A, ekv_dtype kv, int np, cudaStream_t s) {
    return bwd_launch<rows_pass>(A, kv, np, s);
}
