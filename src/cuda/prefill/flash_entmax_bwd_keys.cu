/*
 * The backward's keys pass (flash_entmax_backward.cuh, docs/math.md §13.3, "On tensor cores"),
 * FA2's shape: a block per (64-key tile, KV head) with the tile's K and V rows in shared
 * memory, each warp owning 16 of its keys, loops over the 16-row blocks of the KV head's rows
 * (r = t G + j: every head of the group) that see the tile, their q and dout parts staged
 * through two cp.async stages. Per row block, on tensor cores (mma.cuh):
 *   S^T = K Q^T and G^T = V dO^T of the warp's keys (exact products of 16-bit parts, fp32 sums);
 *   p = p~ / S and ds = scale S^(alpha - 2) w~ (g - delta) from the rows pass's sums;
 *   dV += P^T dO and dK += dS^T Q in registers (P and dS as BWD_OPERAND_PARTS 16-bit parts).
 * The block writes dK and dV of its keys once (dq is the rows pass's).
 */
#include "flash_entmax_backward.cuh"

namespace {

/* A row of the current row block against the block's tile, as the lanes read it. */
struct bwd_row_info {
    bwd_tau tau;
    float am, rel; /* rel: k0 - the row's position, as a float (bwd_z) */
    float pmul;    /* p = p~ pmul: pscale / S (P's scale before its split, bwd_pscale) */
    float dsmul;   /* ds = w~ (g - delta) dsmul: scale S^(alpha - 2) */
    float delta;
    int vis; /* the tile's keys the row sees (bwd_visible) */
};

/* Shared memory: the tile's K and V, then two stages of SR query rows (q and dout parts and
 * the rows' info). SR is 64 rows (four 16-row blocks between two barriers) where the parts are
 * one, 16 where they are BWD_SPLIT_PARTS (a 64-row stage would not fit beside the others). */
template <int D, int NP> struct keys_layout {
    static constexpr int SR = NP == 1 ? 64 : BWD_ROWS, SUB = SR / BWD_ROWS;
    static constexpr int PART = SR * D * 2; /* bytes of a part of SR rows */
    static constexpr int KT = BWD_KEYS * D * 2, STAGE = 2 * NP * PART;
    static constexpr int K = 0, V = KT, STAGES = 2 * KT, INFO = STAGES + 2 * STAGE;
    static constexpr int BYTES = INFO + 2 * SR * (int)sizeof(bwd_row_info);
};

/* The thread's rows in the stages of a block: its first row to copy (bwd_load_rows) and its
 * info row (threads below SR), both stepped by SR rows from a stage to the next. */
struct keys_rows {
    bwd_rowpos load, info;
    bwd_rowstep load_step, stage_step;
};
template <int D, int NP>
__device__ __forceinline__ keys_rows keys_rows_at(const bwd_args &A, int64_t r0) {
    return {bwd_rowpos_of(A, r0 + bwd_load_first<D>()), bwd_rowpos_of(A, r0 + threadIdx.x),
            bwd_rowstep_of(A, bwd_load_stride<D>()), bwd_rowstep_of(A, keys_layout<D, NP>::SR)};
}
__device__ __forceinline__ void keys_rows_next(const bwd_args &A, keys_rows &c) {
    bwd_rowpos_add(A, c.load, c.stage_step);
    bwd_rowpos_add(A, c.info, c.stage_step);
}

/* Rows [r0, r0 + SR) (the thread's at c) into stage st: q and dout parts by cp.async, the rows'
 * info against the tile from k0 by threads 0 to SR - 1 (seen after the barrier that precedes
 * their use). */
template <typename T, int D, int NP>
__device__ __forceinline__ void keys_issue(const bwd_args &A, int64_t b, int64_t g, int64_t r0,
                                           int64_t k0, const keys_rows &c, unsigned char *stage,
                                           bwd_row_info *info) {
    typedef keys_layout<D, NP> L;
    bwd_load_rows<T, D, NP>(A, A.q, b, g, r0, L::SR, c.load, c.load_step, stage);
    bwd_load_rows<T, D, NP>(A, A.g, b, g, r0, L::SR, c.load, c.load_step, stage + NP * L::PART);
    if (threadIdx.x < L::SR) {
        bwd_row_info x = {};
        if (r0 + threadIdx.x < A.R) {
            const int64_t i = bwd_rowpos_index(A, b, g, c.info), pos = A.pos0 + c.info.t;
            x.tau = bwd_tau_of(A.tau[i]);
            x.pmul = A.rinv[i] * bwd_pscale<T>(), x.dsmul = A.scale * A.wscale[i];
            x.delta = A.delta[i];
            x.am = bwd_row_am(A, g, c.info.j);
            x.rel = (float)(k0 - pos);
            x.vis = bwd_visible(A, pos, true, k0);
        }
        info[threadIdx.x] = x;
    }
}

/* The warp's p (times bwd_pscale) and ds (element [nt][i]: key warp 16 + lane / 4 + 8 (i / 2) of
 * the tile, row nt 8 + 2 (lane % 4) + i % 2 of the 16-row block) from its S^T and G^T. */
template <int W>
__device__ __forceinline__ void keys_weights(const bwd_args &A, const bwd_row_info *info,
                                             const float (*s)[4], const float (*gv)[4],
                                             float (*p)[4], float (*ds)[4]) {
    const int lane = threadIdx.x & 31, key = 16 * (threadIdx.x >> 5) + (lane >> 2);
    const float keyf = (float)key;
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int k = 0; k < 2; k++) { /* row nt 8 + 2 (lane % 4) + k */
            const bwd_row_info ri = info[8 * nt + 2 * (lane & 3) + k];
#pragma unroll
            for (int h = 0; h < 2; h++) { /* key + 8 h */
                const int i = 2 * h + k, j = key + 8 * h;
                float pt, w;
                bwd_weights<W>(A, bwd_z(A, s[nt][i], ri.am, ri.rel + (keyf + 8.f * h), j < ri.vis),
                               ri.tau, &pt, &w);
                p[nt][i] = pt * ri.pmul;
                ds[nt][i] = bwd_ds(ri.dsmul, w, gv[nt][i], ri.delta);
            }
        }
}

/* One 16-row block (at qt: NP parts PART bytes apart, then dout's) against the warp's 16 keys:
 * S^T, G^T, p, ds, dV, dK. */
template <typename T, int D, int NP, int W>
__device__ __forceinline__ void keys_block(const bwd_args &A, const unsigned char *smem,
                                           const unsigned char *qt, const bwd_row_info *info,
                                           float (*dk)[4], float (*dv)[4]) {
    typedef keys_layout<D, NP> L;
    constexpr int TB = bwd_tile16<D>();
    const int warp = threadIdx.x >> 5;
    const unsigned char *gt = qt + NP * L::PART;
    float s[2][4], gv[2][4], p[2][4], ds[2][4];
    bwd_tile_dot_parts<T, D, NP>(smem + L::K + warp * TB, 0, qt, L::PART, s);
    bwd_tile_dot_parts<T, D, NP>(smem + L::V + warp * TB, 0, gt, L::PART, gv);
    keys_weights<W>(A, info, s, gv, p, ds);
#pragma unroll 1 /* fp32 q and dout (NP 3): the parts one at a time, fewer live registers */
    for (int part = 0; part < NP; part++) {
        tile_pv<T, D, BWD_OPERAND_PARTS>(gt + part * L::PART, p, dv);
        tile_pv<T, D, BWD_OPERAND_PARTS>(qt + part * L::PART, ds, dk);
    }
}

/* The warp's dK and dV (dk[n][i], dv[n][i]: key warp 16 + lane / 4 + 8 (i / 2) of the tile,
 * dim 8 n + 2 (lane % 4) + i % 2; dv times pscale) as T into dk and dv, or with splits as fp32
 * into the split's partial sums (keys_sum_kernel adds them up). */
template <typename T, int D>
__device__ __forceinline__ void keys_store(const bwd_args &A, int64_t b, int64_t g, int64_t k0,
                                           const float (*dk)[4], const float (*dv)[4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t part = (int64_t)(blockIdx.x % A.key_splits) * A.B * A.N * A.Hk * A.D;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int64_t key = k0 + 16 * warp + (lane >> 2) + 8 * (i >> 1);
        if (key >= A.N) continue;
        const int64_t o = ((b * A.N + key) * A.Hk + g) * A.D + 2 * (lane & 3) + (i & 1);
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            const float x = dk[n][i], y = dv[n][i] * (1.f / bwd_pscale<T>());
            if (A.dk_part) {
                A.dk_part[part + o + 8 * n] = x;
                A.dv_part[part + o + 8 * n] = y;
            } else {
                static_cast<T *>(A.dk)[o + 8 * n] = ekv_elem<T>::from(x);
                static_cast<T *>(A.dv)[o + 8 * n] = ekv_elem<T>::from(y);
            }
        }
    }
}

/* Block (key tile, sequence, KV head, split): dK and dV of the tile's keys over the split's
 * share of the row blocks that see the tile (A.key_splits splits: a causal prefix's first tiles
 * see every row, so one block per tile would leave the last ones idle). */
template <typename T, int D, int NP, int W>
/* D 64: 3 blocks an SM (168 registers, 16 bytes spilled, against 196 and 2 blocks unbounded) */
__global__ void __launch_bounds__(BWD_THREADS, D == 64 ? 3 : 1) keys_kernel(bwd_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(128) unsigned char smem[];
    typedef keys_layout<D, NP> L;
    /* x = (key tile, sequence, KV head, split), the tiles in order: causal, the first see the
     * most rows, so the grid's last wave holds the short ones */
    const int64_t split = blockIdx.x % A.key_splits, rest = blockIdx.x / A.key_splits;
    const int64_t g = rest % A.Hk, b = rest / A.Hk % A.B, k0 = rest / A.Hk / A.B * BWD_KEYS;
    /* causal: the rows at positions >= k0, t >= k0 - pos0 (from a whole row block) */
    const int64_t first = A.causal && k0 > A.pos0 ? (k0 - A.pos0) * A.G : 0;
    const int64_t all =
            first < A.R ? (A.R - first / BWD_ROWS * BWD_ROWS + BWD_ROWS - 1) / BWD_ROWS : 0;
    const int64_t per = (all + A.key_splits - 1) / A.key_splits, ib0 = per * split;
    const int64_t rb0 = first / BWD_ROWS * BWD_ROWS + ib0 * BWD_ROWS;
    const int64_t nrb = all - ib0 < per ? (all > ib0 ? all - ib0 : 0) : per;
    const int64_t nch = (nrb + L::SUB - 1) / L::SUB; /* stages of SR rows */
    bwd_row_info *info = reinterpret_cast<bwd_row_info *>(smem + L::INFO);
    bwd_load_keys<T, D>(A, A.k, b, g, k0, smem + L::K);
    bwd_load_keys<T, D>(A, A.v, b, g, k0, smem + L::V);
    keys_rows rows = keys_rows_at<D, NP>(A, rb0);
    if (nch > 0) keys_issue<T, D, NP>(A, b, g, rb0, k0, rows, smem + L::STAGES, info);
    cp_async_commit();
    float dk[D / 8][4], dv[D / 8][4];
    mma_zero<D / 8>(dk);
    mma_zero<D / 8>(dv);
    for (int64_t ic = 0; ic < nch; ic++) {
        const int st = (int)(ic & 1);
        if (ic + 1 < nch) {
            keys_rows_next(A, rows);
            keys_issue<T, D, NP>(A, b, g, rb0 + (ic + 1) * L::SR, k0, rows,
                                 smem + L::STAGES + (st ^ 1) * L::STAGE, info + (st ^ 1) * L::SR);
        }
        cp_async_commit();
        cp_async_wait<1>(); /* this thread's copies of stage ic (and the tiles) have landed ... */
        __syncthreads();    /* ... and everyone's, and the info */
        /* the split's own row blocks of the stage (its last may hold rows of the next split) */
        const int64_t left = nrb - ic * L::SUB;
        const int nsub = left < L::SUB ? (int)left : L::SUB;
        const unsigned char *stage = smem + L::STAGES + st * L::STAGE;
#pragma unroll 1
        for (int sb = 0; sb < nsub; sb++)
            keys_block<T, D, NP, W>(A, smem, stage + sb * bwd_tile16<D>(),
                                    info + st * L::SR + sb * BWD_ROWS, dk, dv);
        __syncthreads(); /* the stage and the info are free for stage ic + 2 */
    }
    cp_async_wait<0>();
    keys_store<T, D>(A, b, g, k0, dk, dv);
}

/* dk and dv (K's dtype T) = the sums of the splits' fp32 parts, in split order. */
template <typename T>
__global__ void keys_sum_kernel(const float *dk_part, const float *dv_part, T *dk, T *dv,
                                int splits, int64_t n) {
    ekv_grid_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float x = 0.f, y = 0.f;
        for (int s = 0; s < splits; s++) x += dk_part[s * n + i], y += dv_part[s * n + i];
        dk[i] = ekv_elem<T>::from(x);
        dv[i] = ekv_elem<T>::from(y);
    }
}

/* The keys pass's launch, for bwd_launch. */
struct keys_pass {
    template <typename T, int D, int NP, int W>
    static cudaError_t launch(const bwd_args &A, cudaStream_t s) {
        constexpr auto kernel = keys_kernel<T, D, NP, W>;
        constexpr size_t bytes = keys_layout<D, NP>::BYTES;
        const cudaError_t e = ekv_cuda_allow_smem<kernel>(bytes);
        if (e != cudaSuccess) return e;
        kernel<<<(unsigned)bwd_keys_grid(A.B, A.N, A.Hk, A.key_splits), BWD_THREADS, bytes, s>>>(A);
        if (A.key_splits > 1) {
            const int64_t n = A.B * A.N * A.Hk * A.D, blocks = (n + 255) / 256;
            keys_sum_kernel<T><<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, s>>>(
                    A.dk_part, A.dv_part, static_cast<T *>(A.dk), static_cast<T *>(A.dv),
                    A.key_splits, n);
        }
        return cudaGetLastError();
    }
};

} // namespace

cudaError_t flash_bwd_keys(const bwd_args &A, ekv_dtype kv, int np, cudaStream_t s) {
    return bwd_launch<keys_pass>(A, kv, np, s);
}
