/*
 * The backward's rows pass (flash_entmax_backward.cuh, docs/math.md §13.3, "On tensor cores"):
 * per query row, S = sum p~ (the forward's normaliser, recomputed from tau), sum w~ and
 * sum w~ (g - r) (g_j = dout . v_j, r a shift of the row), written as 1 / S, S^(alpha - 2) and
 * delta = r + sum w~ (g - r) / sum w~ (the scale of w cancels) for the keys pass, and
 * dq = sum_j ds_j k_j. A block owns 64 rows of one KV head (16 per warp, their q and dout parts
 * staged in shared memory once) and sweeps the K and V tiles of their keys through two cp.async
 * stages, computing S = Q K^T and G = dO V^T of each 16-key piece (the products of 16-bit parts
 * are exact, fp32 sums: z within the forward's own rounding, docs/math.md §12):
 *   - head dim 64, q and dout in K's dtype (rows_one_sweep): one sweep, with r = g of the row's
 *     own key, for the sums and A = scale sum w~ (g - r) k, B = scale sum w~ k (their terms as
 *     BWD_OPERAND_PARTS 16-bit parts, tile_pv2); then dq = S^(alpha - 2) (A - (delta - r) B)
 *     (§13.3, "One sweep for dq");
 *   - else (the registers of two D-wide sums would not fit) two sweeps, r = 0: the sums, then S
 *     and G again, ds = scale S^(alpha - 2) w~ (g - delta), dQ += dS K.
 * dq is the block's alone: no atomics, and the same bits on every call (the keys pass owns dk
 * and dv the same way).
 */
#include "flash_entmax_backward.cuh"

namespace {

template <int D, int NP> constexpr size_t rows_smem_bytes() {
    return (size_t)2 * NP * BWD_ROW_BLOCK * D * 2 /* q and dout parts */ +
           (size_t)2 * 2 * BWD_KEYS * D * 2; /* two stages of K and V */
}

/* One sweep for dq (rows_one_sweep) at this head dim and these parts: the registers of two
 * D-wide sums fit at D 64 with one part. */
template <int D, int NP> __host__ __device__ constexpr bool rows_one_sweep() {
    return D == 64 && NP == 1;
}

/* The lane's two query rows (k = 0: lane / 4 of the warp's 16, k = 1: lane / 4 + 8), their
 * sums (sp, sw, swg: sum w~ (g - shift)), and per tile the keys they see (vis) and rel0 =
 * k0 - pos as a float (bwd_z). */
struct rows_lane {
    int64_t r[2], pos[2];
    bwd_tau tau[2];
    double sp[2], sw[2], swg[2];
    float am[2], shift[2], wscale[2], delta[2], rel0[2];
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

/* The sums of one tile's keys into the lane's (sw, swg and sp: fp32 over the tile, double
 * across tiles). */
struct rows_tile_sums {
    float p[2] = {0.f, 0.f}, w[2] = {0.f, 0.f}, wg[2] = {0.f, 0.f};
    __device__ void add_to(rows_lane &L) const {
        for (int k = 0; k < 2; k++) L.sp[k] += p[k], L.sw[k] += w[k], L.swg[k] += wg[k];
    }
};

/* Two sweeps, sweep 1, one 64-key tile: the sums of the lane's rows over the tile's keys. */
template <typename T, int D, int NP, int W>
__device__ __forceinline__ void rows_sums(const bwd_args &A, const unsigned char *qs,
                                          const unsigned char *gs, const unsigned char *kt,
                                          const unsigned char *vt, rows_lane &L) {
    rows_tile_sums t;
    rows_pieces<T, D, NP, W>(
            A, qs, gs, kt, vt, L,
            [&](int, int, int k, float p, float w, float g) {
                t.p[k] += p;
                if (w != 0.f) t.w[k] += w, t.wg[k] = fmaf(w, g - L.shift[k], t.wg[k]);
            },
            [](int) {});
    t.add_to(L);
}

/* Two sweeps, sweep 2, one 64-key tile: dq (16 rows x D, tile_pv's layout) += dS K. */
template <typename T, int D, int NP, int W>
__device__ __forceinline__ void
rows_dq(const bwd_args &A, const unsigned char *qs, const unsigned char *gs,
        const unsigned char *kt, const unsigned char *vt, const rows_lane &L, float (*dq)[4]) {
    float ds[2][4];
    rows_pieces<T, D, NP, W>(
            A, qs, gs, kt, vt, L,
            [&](int nt, int i, int k, float, float w, float g) {
                ds[nt][i] = bwd_ds(A.scale * L.wscale[k], w, g, L.delta[k]);
            },
            [&](int q) { tile_pv<T, D, BWD_OPERAND_PARTS>(kt + q * bwd_tile16<D>(), ds, dq); });
}

/* One sweep, one 64-key tile: the sums, and sa += c w~ (g - shift) K, sb += c w~ K with
 * c = A.scale (as ds carries it: the 16-bit parts of these operands keep ds's range, which
 * matters in f16, docs/math.md §13.3; the sums of w~ take c too, and their ratio drops it). */
template <typename T, int D, int NP, int W>
__device__ __forceinline__ void rows_sums_dq(const bwd_args &A, const unsigned char *qs,
                                             const unsigned char *gs, const unsigned char *kt,
                                             const unsigned char *vt, rows_lane &L, float (*sa)[4],
                                             float (*sb)[4]) {
    rows_tile_sums t;
    float wg[2][4], w1[2][4];
    rows_pieces<T, D, NP, W>(
            A, qs, gs, kt, vt, L,
            [&](int nt, int i, int k, float p, float w, float g) {
                t.p[k] += p;
                w1[nt][i] = A.scale * w;
                wg[nt][i] = w != 0.f ? w1[nt][i] * (g - L.shift[k]) : 0.f;
                t.w[k] += w1[nt][i], t.wg[k] += wg[nt][i];
            },
            [&](int q) {
                tile_pv2<T, D, BWD_OPERAND_PARTS>(kt + q * bwd_tile16<D>(), wg, sa, w1, sb);
            });
    t.add_to(L);
}

/* The shift of the lane's row k for one sweep: g of its own key (the one at its position,
 * clamped to [0, N)), dout . v in fp32 over the 4 lanes of the row. Any r is exact in
 * arithmetic; this one keeps A and (delta - r) B small where the g of a row's support are
 * close (docs/math.md §13.3, "One sweep for dq"). Every lane of the warp calls it. */
template <typename T, int D>
__device__ __forceinline__ float rows_shift(const bwd_args &A, int64_t b, int64_t g,
                                            const rows_lane &L, int k) {
    const int lane = threadIdx.x & 31;
    const int64_t j = L.pos[k] < 0 ? 0 : L.pos[k] >= A.N ? A.N - 1 : L.pos[k];
    const T *dout = static_cast<const T *>(A.g) + bwd_row_offset(A, b, g, L.on[k] ? L.r[k] : 0);
    const T *v = static_cast<const T *>(A.v) + ((b * A.N + j) * A.Hk + g) * A.D;
    float x = 0.f;
    for (int d = (lane & 3) * (D / 4); d < ((lane & 3) + 1) * (D / 4); d++)
        x = fmaf(ekv_elem<T>::to(dout[d]), ekv_elem<T>::to(v[d]), x);
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return L.on[k] ? x : 0.f;
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

/* The lane's rows of the row block from r0: index, position, tau, slope, shift (0 here). */
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
        L.sp[k] = L.sw[k] = L.swg[k] = 0.0;
        L.shift[k] = 0.f;
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

/* After the sums: S^(alpha - 2) and delta into L, and 1 / S, S^(alpha - 2), delta into the
 * keys pass's arrays (a lane per row); dr[k] = delta - shift of the lane's row k. */
__device__ __forceinline__ void rows_finish(const bwd_args &A, int64_t b, int64_t g, rows_lane &L,
                                            float *dr) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const double S = ekv_quad_sum(L.sp[k]), SW = ekv_quad_sum(L.sw[k]),
                     SWG = ekv_quad_sum(L.swg[k]);
        L.wscale[k] = (float)pow(S, A.alpha - 2.0);
        L.delta[k] = (float)((double)L.shift[k] + SWG / SW);
        dr[k] = (float)(SWG / SW);
        if ((lane & 3) || !L.on[k]) continue;
        const int64_t i = bwd_row_index(A, b, g, L.r[k]);
        A.rinv[i] = (float)(1.0 / S), A.wscale[i] = L.wscale[k], A.delta[i] = L.delta[k];
    }
}

/* Block (reversed row block, sequence, KV head): its 64 rows' sums and dq. */
template <typename T, int D, int NP, int W>
__global__ void __launch_bounds__(BWD_THREADS) rows_kernel(bwd_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int PART = BWD_ROW_BLOCK * D * 2;
    constexpr bool ONE = rows_one_sweep<D, NP>();
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
    if (ONE)
        for (int k = 0; k < 2; k++) L.shift[k] = rows_shift<T, D>(A, b, g, L, k);
    const unsigned char *wq = qs + warp * bwd_tile16<D>(), *wg = gs + warp * bwd_tile16<D>();
    const bool warp_on = r0 + 16 * warp < A.R;
    float dq[D / 8][4], dqb[D / 8][4], dr[2];
    mma_zero<D / 8>(dq);
    if (ONE) mma_zero<D / 8>(dqb);
    rows_sweep<T, D>(A, b, g, ntiles, stages,
                     [&](int64_t k0, const unsigned char *kt, const unsigned char *vt) {
                         rows_lane_tile(A, k0, L);
                         if (!warp_on) return;
                         if (ONE)
                             rows_sums_dq<T, D, NP, W>(A, wq, wg, kt, vt, L, dq, dqb);
                         else
                             rows_sums<T, D, NP, W>(A, wq, wg, kt, vt, L);
                     });
    rows_finish(A, b, g, L, dr);
    if (ONE) { /* dq = S^(alpha - 2) (A - (delta - shift) B), scale inside A and B */
#pragma unroll
        for (int n = 0; n < D / 8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int k = i >> 1;
                dq[n][i] = L.wscale[k] * fmaf(-dr[k], dqb[n][i], dq[n][i]);
            }
    } else {
        rows_sweep<T, D>(A, b, g, ntiles, stages,
                         [&](int64_t k0, const unsigned char *kt, const unsigned char *vt) {
                             rows_lane_tile(A, k0, L);
                             if (warp_on) rows_dq<T, D, NP, W>(A, wq, wg, kt, vt, L, dq);
                         });
    }
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
