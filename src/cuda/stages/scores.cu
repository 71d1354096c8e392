/*
 * attend, step 1 on the GPU: the scores kernels (see attend_common.cuh for the pipeline).
 */
#include "../common/launch.cuh"
#include "../common/loads.cuh"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include "scores.cuh"
#include "scores_common.cuh"
#include "../common/sizes.cuh"
#include "../common/splits.cuh"
#include "../common/test_hooks.h" /* the read-backs defined here */
#include "../../core/geometry.h"
#include <math_constants.h>

namespace {

/* Pipeline shape of the scores kernel: each warp streams tiles of TR rows of one page (4 KB:
 * every lane copies 8 elements of U rows) through SCORE_STAGES shared-memory stages, so two
 * tiles are in flight while the third is reduced. A lane reads back only the bytes it copied,
 * so no barrier is needed between the copy and the use. */
enum { SCORE_STAGES = 3, SCORE_TILE_BYTES = 4096 };

/* The group's q' and the warps' maxima, in every scores kernel's shared memory. */
constexpr size_t group_smem_bytes(int G, int D) {
    return (size_t)(G * D + (EKV_CUDA_THREADS / 32) * G) * sizeof(float);
}
template <typename T> constexpr size_t score_smem_bytes(int G, int D) {
    return (size_t)(EKV_CUDA_THREADS / 32) * SCORE_STAGES * SCORE_TILE_BYTES +
           group_smem_bytes(G, D);
}

/* Slot t of a page: z = score + ALiBi (or -inf past the page's valid tokens, and for the heads
 * not in `heads`), kept in the score row of each head of the group, and the running maxima. */
template <int GM>
__device__ __forceinline__ void store_scores(const score_args &A, const float *acc,
                                             const float *slope, float jbase, int t, int valid,
                                             unsigned heads, float *sbase, float *runmax) {
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g < A.G) {
            const float z = score_z(acc[g], slope[g], jbase, t, t < valid && (heads >> g & 1u));
            sbase[(int64_t)g * A.cap_tokens + t] = z;
            runmax[g] = fmaxf(runmax[g], z);
        }
    }
}

/* <q'_g, k> for the group's heads from this lane's 8 elements k8 (q' from registers qr for
 * small groups, else from shared memory at qs + g D), summed over the row's LPR lanes. */
template <int LPR, int GM, int QR>
__device__ __forceinline__ void group_dot(const float *k8, const float (*qr)[8], const float *qs,
                                          int D, int G, float *acc) {
#pragma unroll
    for (int g = 0; g < GM; g++) {
        acc[g] = 0.f;
        if (g < G) {
            if constexpr (QR > 0) {
#pragma unroll
                for (int i = 0; i < 8; i++) acc[g] += qr[g][i] * k8[i];
            } else {
                const float4 qa = *reinterpret_cast<const float4 *>(qs + g * D);
                const float4 qb = *reinterpret_cast<const float4 *>(qs + g * D + 4);
                acc[g] = qa.x * k8[0] + qa.y * k8[1] + qa.z * k8[2] + qa.w * k8[3] + qb.x * k8[4] +
                         qb.y * k8[5] + qb.z * k8[6] + qb.w * k8[7];
            }
#pragma unroll
            for (int o = LPR / 2; o > 0; o >>= 1) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], o);
        }
    }
}

/* Small groups keep their q' chunk (this lane's 8 elements, from qs + g D) in registers. */
template <int QR>
__device__ __forceinline__ void load_qr(const float *qs, int D, int G, float (*qr)[8]) {
#pragma unroll
    for (int g = 0; g < QR; g++)
#pragma unroll
        for (int i = 0; i < 8; i++) qr[g][i] = g < G ? qs[g * D + i] : 0.f;
}

/* LPR lanes per key row (D = 8 LPR: 64, 128, 256); GM: compile-time bound of the group size
 * (register tiles), G <= GM at run time. */
template <typename T, int LPR, int GM>
__global__ void __launch_bounds__(EKV_CUDA_THREADS, 2) scores_kernel(score_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    constexpr int NW = EKV_CUDA_THREADS / 32;
    constexpr int RPW = 32 / LPR;                   /* rows per warp pass           */
    constexpr int EB = 8 * (int)sizeof(T);          /* bytes a lane copies per row  */
    constexpr int U = SCORE_TILE_BYTES / (32 * EB); /* passes per tile              */
    constexpr int TR = RPW * U;                     /* rows per tile                */
    ekv_split sp;
    int b, kvh, row;
    if (!score_block(A, &sp, &b, &kvh, &row)) return;
    const int G = A.G, D = A.D, ps = A.ps;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned char *stage = smem_raw + (size_t)warp * SCORE_STAGES * SCORE_TILE_BYTES;
    float *qs = reinterpret_cast<float *>(smem_raw + (size_t)NW * SCORE_STAGES * SCORE_TILE_BYTES);
    float *red = qs + G * D;
    zero_step_counters(A, sp, row, b, kvh);
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    int64_t e0, e1;
    split_entries(A, sp, sg, row, &e0, &e1);
    load_group_q(A, b, kvh, qs);
    __syncthreads();
    const int sub = lane / LPR, sl = lane % LPR;
    float runmax[GM], slope[GM];
    init_group<GM>(A, kvh, runmax, slope);
    constexpr int QR = GM <= 2 ? GM : 0;
    float qr[QR > 0 ? QR : 1][8];
    load_qr<QR>(qs + sl * 8, D, G, qr);
    const unsigned char *K = static_cast<const unsigned char *>(A.kv.k);
    const int tpp = (ps + TR - 1) / TR; /* tiles per page */
    const int64_t mine = e1 > e0 + warp ? (e1 - e0 - warp + NW - 1) / NW : 0;
    const int64_t ntiles = mine * tpp;
    float *srow = A.scores + ((int64_t)b * A.H + kvh * G) * A.cap_tokens; /* + g * cap_tokens */
    score_cursor ci = {e0 + warp, 0}, cc = {e0 + warp, 0};
    auto issue = [&](int64_t j) {
        const int64_t e = ci.e;
        const int r0 = ci.r0;
        advance<TR, NW>(ci, ps);
        int valid;
        const int64_t lp = entry_page(A, sg, row, e, &valid);
        const unsigned char *pbase = K + page_block(A, sg, lp, kvh) * (int64_t)sizeof(T);
        unsigned char *dst = stage + (size_t)(j % SCORE_STAGES) * SCORE_TILE_BYTES;
#pragma unroll
        for (int r = 0; r < U; r++) {
            const int t = r0 + r * RPW + sub;
            if (t < valid) {
                const unsigned char *src =
                        pbase + ((int64_t)t * A.kv.stride_token + sl * 8) * (int64_t)sizeof(T);
#pragma unroll
                for (int c = 0; c < EB / 16; c++)
                    cp_async16(dst + (r * 32 + lane) * EB + c * 16, src + c * 16);
            }
        }
    };
#pragma unroll
    for (int s = 0; s < SCORE_STAGES - 1; s++) {
        if (s < ntiles) issue(s);
        cp_async_commit();
    }
    for (int64_t j = 0; j < ntiles; j++) {
        if (j + SCORE_STAGES - 1 < ntiles) issue(j + SCORE_STAGES - 1);
        cp_async_commit();
        cp_async_wait<SCORE_STAGES - 1>(); /* tile j has landed (groups complete in order) */
        const int64_t e = cc.e;
        const int r0 = cc.r0;
        advance<TR, NW>(cc, ps);
        int valid;
        const int64_t lp = entry_page(A, sg, row, e, &valid);
        const float jbase = (float)(lp * ps - (sg.N - 1));
        const unsigned heads = entry_heads(A, row, e);
        float *sbase = srow + e * ps;
        const unsigned char *src = stage + (size_t)(j % SCORE_STAGES) * SCORE_TILE_BYTES;
#pragma unroll
        for (int r = 0; r < U; r++) {
            const int t = r0 + r * RPW + sub;
            float k8[8];
            if (t < valid)
                ekv_elem<T>::unpack8(reinterpret_cast<const T *>(src + (r * 32 + lane) * EB), k8);
            else {
#pragma unroll
                for (int i = 0; i < 8; i++) k8[i] = 0.f;
            }
            float acc[GM];
            group_dot<LPR, GM, QR>(k8, qr, qs + sl * 8, D, G, acc);
            if (t < ps && sl == 0)
                store_scores<GM>(A, acc, slope, jbase, t, valid, heads, sbase, runmax);
        }
    }
    cp_async_wait<0>();
    write_split_max<GM>(A, runmax, red, sp, b, kvh);
}

/* Generic head dims (multiples of 8 other than 64/128/256): one row per warp pass, the lanes
 * stride over its 8-element chunks, loads straight into registers. */
template <typename T>
__global__ void __launch_bounds__(EKV_CUDA_THREADS) scores_generic_kernel(score_args A) {
    ekv_grid_begin();
    extern __shared__ float smem[]; /* q' [G][D], then red [nwarps][G] */
    constexpr int GM = EKV_CUDA_MAX_GROUP;
    float *qs = smem;
    float *red = smem + A.G * A.D;
    ekv_split sp;
    int b, kvh, row;
    if (!score_block(A, &sp, &b, &kvh, &row)) return;
    const int G = A.G, D = A.D, ps = A.ps;
    zero_step_counters(A, sp, row, b, kvh);
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    int64_t e0, e1;
    split_entries(A, sp, sg, row, &e0, &e1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    load_group_q(A, b, kvh, qs);
    __syncthreads();
    float runmax[GM], slope[GM];
    init_group<GM>(A, kvh, runmax, slope);
    const T *K = static_cast<const T *>(A.kv.k);
    float *srow = A.scores + ((int64_t)b * A.H + kvh * G) * A.cap_tokens;
    for (int64_t e = e0 + warp; e < e1; e += nw) {
        int valid;
        const int64_t lp = entry_page(A, sg, row, e, &valid);
        const T *pbase = K + page_block(A, sg, lp, kvh);
        const float jbase = (float)(lp * ps - (sg.N - 1));
        const unsigned heads = entry_heads(A, row, e);
        float *sbase = srow + e * ps;
        for (int t = 0; t < ps; t++) {
            float acc[GM];
#pragma unroll
            for (int g = 0; g < GM; g++) acc[g] = 0.f;
            if (t < valid) {
                const T *krow = pbase + (int64_t)t * A.kv.stride_token;
                for (int c = lane; c < D / 8; c += 32) {
                    float kk[8];
                    ekv_elem<T>::load8(krow + c * 8, kk);
#pragma unroll
                    for (int g = 0; g < GM; g++) {
                        if (g < G) {
                            const float4 qa = *reinterpret_cast<const float4 *>(qs + g * D + c * 8);
                            const float4 qb =
                                    *reinterpret_cast<const float4 *>(qs + g * D + c * 8 + 4);
                            acc[g] += qa.x * kk[0] + qa.y * kk[1] + qa.z * kk[2] + qa.w * kk[3] +
                                      qb.x * kk[4] + qb.y * kk[5] + qb.z * kk[6] + qb.w * kk[7];
                        }
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < GM; g++)
                if (g < G) acc[g] = ekv_warp_sum(acc[g]);
            if (lane == 0) store_scores<GM>(A, acc, slope, jbase, t, valid, heads, sbase, runmax);
        }
    }
    write_split_max<GM>(A, runmax, red, sp, b, kvh);
}
/* ---- screened decode's rows (screen/screen.cu, docs/math.md §10.3): the exact score of every row
 * of the KV head's row list for the group's heads, bit for bit the scores kernels' (the same
 * dot product and bias), into the score row at the row's slot; the split maxima; and on the way
 * the candidates z >= M' - 1, with M' the largest score any warp has seen (M' <= M, so they
 * hold every z >= M - 1: what tau needs, Claim 3), appended to the head's candidate list. ---- */
struct row_args : score_args {
    const int32_t *rows, *row_count;
    uint32_t *zkey; /* [B*H] ordered keys of the largest score seen */
    int64_t ccap;
    float *cand_z;
    int64_t *cand_slot;
};

/* Whether a row slot's score z (where on) is a candidate: z >= M' - 1 (M' = seen or this lane's
 * own max). */
__device__ __forceinline__ bool row_takes(bool on, float z, float Mp) {
    return on && z > -CUDART_INF_F && (double)z >= (double)Mp - 1.0;
}

/* Row slot e holding score z (where on) of head hrow: kept when row_takes. Warp-uniform call. */
__device__ __forceinline__ void row_candidate(const row_args &A, int64_t hrow, bool on, float z,
                                              float Mp, int64_t e) {
    const bool take = row_takes(on, z, Mp);
    const uint32_t at = ekv_warp_append(take, reinterpret_cast<uint32_t *>(A.cand_count) + hrow);
    if (take && at < A.ccap) {
        A.cand_z[hrow * A.ccap + at] = z;
        A.cand_slot[hrow * A.ccap + at] = e;
    }
}

/* A warp pass's candidates (m[r][g]: the ballot of row_takes for row r of the pass, slot
 * base + r RPW + sub of this lane, and head g < G; z: this lane's scores) appended to the heads'
 * lists in row order, each head's places taken by one atomic, the heads' atomics in flight
 * together: one round trip a row and head (row_candidate's) made the pass wait on U G of them.
 * Warp-uniform call. */
template <int U, int GM, int RPW>
__device__ __forceinline__ void append_pass(const row_args &A, int64_t h0, int G, int64_t base,
                                            int sub, const unsigned (&m)[U][GM],
                                            const float (&z)[U][GM]) {
    const int lane = threadIdx.x & 31;
    uint32_t first[GM];
    ekv_warp_reserve_ballots<U, GM>(reinterpret_cast<uint32_t *>(A.cand_count) + h0, G, m, first);
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= G) break;
        uint32_t at = first[g];
#pragma unroll
        for (int r = 0; r < U; r++) {
            const uint32_t pos = at + (uint32_t)ekv_lane_rank(m[r][g]);
            if (((m[r][g] >> lane) & 1u) && pos < A.ccap) {
                A.cand_z[(h0 + g) * A.ccap + pos] = z[r][g];
                A.cand_slot[(h0 + g) * A.ccap + pos] = base + r * RPW + sub;
            }
            at += (uint32_t)__popc(m[r][g]);
        }
    }
}

/* Where row slot e lives: its token's offset in the pool, slot in the page and page position. */
__device__ __forceinline__ int64_t row_place(const row_args &A, const ekv_seq_geom &sg, int kvh,
                                             int32_t tok, int *t, float *jbase) {
    const int64_t lp = tok / A.ps;
    *t = tok % A.ps;
    *jbase = (float)(lp * A.ps - (sg.N - 1));
    return (int64_t)A.t.indices[sg.first + lp] * A.kv.stride_page +
           (int64_t)kvh * A.kv.stride_head + (int64_t)*t * A.kv.stride_token;
}

/* The start of a row kernel's block: its sequence, its share [e0, e1) of its list row's token
 * rows, the group's q' in qs, and per head (GM >= G) the running max and the seen max (none yet)
 * and the ALiBi slope. Block-wide. */
template <int GM>
__device__ __forceinline__ ekv_seq_geom row_start(const row_args &A, const ekv_split &sp, int b,
                                                  int kvh, int row, float *qs, int64_t *e0,
                                                  int64_t *e1, float *runmax, float *slope,
                                                  float *seen) {
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    ekv_split_range(sp, 0, A.row_count[row], e0, e1);
    load_group_q(A, b, kvh, qs);
    __syncthreads();
    init_group<GM>(A, kvh, runmax, slope);
#pragma unroll
    for (int g = 0; g < GM; g++) seen[g] = -CUDART_INF_F;
    return sg;
}

template <typename T, int LPR, int GM>
__global__ void __launch_bounds__(EKV_CUDA_THREADS) row_scores_kernel(row_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(16) float rsm[]; /* q' [G][D], red [NW][G] */
    constexpr int NW = EKV_CUDA_THREADS / 32, RPW = 32 / LPR, U = 4;
    ekv_split sp;
    int b, kvh, row;
    if (!score_block(A, &sp, &b, &kvh, &row)) return;
    const int G = A.G, D = A.D;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / LPR, sl = lane % LPR;
    float *qs = rsm, *red = rsm + G * D;
    int64_t e0, e1;
    float runmax[GM], slope[GM], seen[GM];
    const ekv_seq_geom sg = row_start<GM>(A, sp, b, kvh, row, qs, &e0, &e1, runmax, slope, seen);
    constexpr int QR = GM <= 2 ? GM : 0;
    float qr[QR > 0 ? QR : 1][8];
    load_qr<QR>(qs + sl * 8, D, G, qr);
    const T *K = static_cast<const T *>(A.kv.k);
    const int32_t *rl = A.rows + (int64_t)row * A.cap_tokens;
    const int64_t h0 = (int64_t)b * A.H + kvh * G;
    float *srow = A.scores + h0 * A.cap_tokens;
    for (int64_t base = e0 + (int64_t)warp * RPW * U; base < e1; base += (int64_t)NW * RPW * U) {
        uint32_t pre[GM];
        ekv_peek_max<GM>(A.zkey + h0, G, pre);
        float k8[U][8], jb[U];
        int64_t off[U];
        int tk[U];
        int32_t tok[U]; /* the rows' tokens, then their pages: each stage's loads in flight */
#pragma unroll
        for (int r = 0; r < U; r++) {
            const int64_t e = base + r * RPW + sub;
            tok[r] = e < e1 ? rl[e] : 0;
        }
#pragma unroll
        for (int r = 0; r < U; r++) {
            const int64_t e = base + r * RPW + sub;
            off[r] = 0;
            tk[r] = 0;
            jb[r] = 0.f;
            if (e < e1) off[r] = row_place(A, sg, kvh, tok[r], &tk[r], &jb[r]);
        }
#pragma unroll
        for (int r = 0; r < U; r++) {
            if (base + r * RPW + sub < e1)
                ekv_elem<T>::load8(K + off[r] + sl * 8, k8[r]);
            else
#pragma unroll
                for (int i = 0; i < 8; i++) k8[r][i] = 0.f;
        }
        unsigned m[U][GM]; /* the candidates, appended after the pass's scores (append_pass) */
        float zk[U][GM];
#pragma unroll
        for (int r = 0; r < U; r++) {
            const int64_t e = base + r * RPW + sub;
            const bool on = e < e1 && sl == 0;
            float acc[GM];
            group_dot<LPR, GM, QR>(k8[r], qr, qs + sl * 8, D, G, acc);
#pragma unroll
            for (int g = 0; g < GM; g++) {
                m[r][g] = 0u;
                zk[r][g] = 0.f;
                if (g >= G) continue;
                const float z = score_z(acc[g], slope[g], jb[r], tk[r], on);
                if (on) srow[(int64_t)g * A.cap_tokens + e] = z;
                runmax[g] = fmaxf(runmax[g], z);
                zk[r][g] = z;
                m[r][g] = __ballot_sync(0xffffffffu, row_takes(on, z, fmaxf(runmax[g], seen[g])));
            }
        }
        append_pass<U, GM, RPW>(A, h0, G, base, sub, m, zk);
        ekv_share_max<GM>(runmax, seen, A.zkey + h0, G, pre);
    }
    write_split_max<GM>(A, runmax, red, sp, b, kvh);
}

/* Generic head dims: one row per warp pass, as scores_generic_kernel. */
template <typename T>
__global__ void __launch_bounds__(EKV_CUDA_THREADS) row_scores_generic_kernel(row_args A) {
    ekv_grid_begin();
    extern __shared__ float rsm[]; /* q' [G][D], then red [nwarps][G] */
    constexpr int GM = EKV_CUDA_MAX_GROUP;
    float *qs = rsm, *red = rsm + A.G * A.D;
    ekv_split sp;
    int b, kvh, row;
    if (!score_block(A, &sp, &b, &kvh, &row)) return;
    const int G = A.G, D = A.D;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int64_t e0, e1;
    float runmax[GM], slope[GM], seen[GM];
    const ekv_seq_geom sg = row_start<GM>(A, sp, b, kvh, row, qs, &e0, &e1, runmax, slope, seen);
    const T *K = static_cast<const T *>(A.kv.k);
    const int32_t *rl = A.rows + (int64_t)row * A.cap_tokens;
    const int64_t h0 = (int64_t)b * A.H + kvh * G;
    float *srow = A.scores + h0 * A.cap_tokens;
    for (int64_t e = e0 + warp; e < e1; e += nw) {
        uint32_t pre[GM];
        ekv_peek_max<GM>(A.zkey + h0, G, pre);
        int t;
        float jbase;
        const int64_t off = row_place(A, sg, kvh, rl[e], &t, &jbase);
        float acc[GM];
#pragma unroll
        for (int g = 0; g < GM; g++) acc[g] = 0.f;
        for (int c = lane; c < D / 8; c += 32) {
            float kk[8];
            ekv_elem<T>::load8(K + off + c * 8, kk);
#pragma unroll
            for (int g = 0; g < GM; g++) {
                if (g < G) {
                    const float4 qa = *reinterpret_cast<const float4 *>(qs + g * D + c * 8);
                    const float4 qb = *reinterpret_cast<const float4 *>(qs + g * D + c * 8 + 4);
                    acc[g] += qa.x * kk[0] + qa.y * kk[1] + qa.z * kk[2] + qa.w * kk[3] +
                              qb.x * kk[4] + qb.y * kk[5] + qb.z * kk[6] + qb.w * kk[7];
                }
            }
        }
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g >= G) break;
            acc[g] = ekv_warp_sum(acc[g]);
            const float z = score_z(acc[g], slope[g], jbase, t, true);
            if (lane == 0) srow[(int64_t)g * A.cap_tokens + e] = z;
            runmax[g] = fmaxf(runmax[g], z);
            row_candidate(A, h0 + g, lane == 0, z, fmaxf(runmax[g], seen[g]), e);
        }
        ekv_share_max<GM>(runmax, seen, A.zkey + h0, G, pre);
    }
    write_split_max<GM>(A, runmax, red, sp, b, kvh);
}

/* The row kernel for T, the head dim's lanes and the group's tile, or the generic one. */
template <typename T>
cudaError_t launch_rows_t(const row_args &A, dim3 grid, const ekv_launch_stream &st) {
    const size_t sm = group_smem_bytes(A.G, A.D);
    ekv_cuda_with_lanes(
            A.D,
            [&](auto lpr) {
                ekv_cuda_with_group(A.G, [&](auto tg) {
                    ekv_launch(st, row_scores_kernel<T, decltype(lpr)::value, decltype(tg)::value>,
                               grid, EKV_CUDA_THREADS, sm, A);
                });
            },
            [&] { ekv_launch(st, row_scores_generic_kernel<T>, grid, EKV_CUDA_THREADS, sm, A); });
    return cudaGetLastError();
}

/* The page kernel for T, the head dim's lanes and the group's tile, or the generic one. */
template <typename T>
cudaError_t launch_scores_t(const score_args &A, dim3 grid, const ekv_launch_stream &st) {
    const size_t sm = score_smem_bytes<T>(A.G, A.D);
    ekv_cuda_with_lanes(
            A.D,
            [&](auto lpr) {
                ekv_cuda_with_group(A.G, [&](auto tg) {
                    constexpr auto kernel =
                            scores_kernel<T, decltype(lpr)::value, decltype(tg)::value>;
                    if (ekv_cuda_allow_smem<kernel>(sm) == cudaSuccess)
                        ekv_launch(st, kernel, grid, EKV_CUDA_THREADS, sm, A);
                });
            },
            [&] {
                ekv_launch(st, scores_generic_kernel<T>, grid, EKV_CUDA_THREADS,
                           group_smem_bytes(A.G, A.D), A);
            });
    return cudaGetLastError();
}

/* The arguments every scores kernel reads (the page kernels', on CUDA or tensor cores, and the
 * row kernels'): the query side, the splits, the entries of round `round` of the step's lists
 * (use_list) or the sequences' pages, the score rows, and the counters they zero. */
void set_score_args(score_args &A, ekv_cuda_plan *pl, const ekv_decode_params *prm,
                    const ekv_paged_kv *kv, const ekv_page_table *t, const float *q, int batch,
                    int use_list, int round, int masked) {
    ekv_cuda_set_shape(A, pl, t);
    A.kv = *kv;
    ekv_cuda_set_query(A, prm, kv->head_dim, q);
    A.nsplit = pl->last_score_splits = ekv_cuda_step_splits(pl, batch).scores;
    A.split_cap = pl->split_cap;
    A.list_pages = use_list ? pl->list_pages : NULL;
    A.list_count = use_list ? pl->list_count : NULL;
    A.list_heads = use_list && masked ? pl->list_heads : NULL;
    A.round = round;
    A.scores = pl->scores;
    A.split_max = pl->split_max;
    A.cand_count = pl->cand_count;
    A.v_rows = pl->v_rows;
    A.ucount = pl->ucount;
}

/* A scores kernel's launch as the step's status. */
ekv_status scores_launched(ekv_cuda_plan *pl, cudaError_t e, const char *what) {
    if (e != cudaSuccess)
        return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "%s kernel: %s", what, cudaGetErrorString(e));
    pl->launches++;
    return EKV_OK;
}

} // namespace

ekv_status ekv_cuda_launch_scores(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                  const ekv_paged_kv *kv, const ekv_page_table *t, const float *q,
                                  int batch, int use_list, int round, int masked) {
    score_args A;
    set_score_args(A, pl, prm, kv, t, q, batch, use_list, round, masked);
    const dim3 grid(ekv_cuda_split_grid(A.nsplit, batch), A.Hk);
    if (pl->p.tensor_cores && ekv_cuda_scores_mma_applies(kv->dtype, A.D, A.ps, A.G))
        return scores_launched(pl, ekv_cuda_scores_mma(A, kv->dtype, grid, ekv_plan_stream(pl)),
                               "scores");
    const cudaError_t e = ekv_cuda_with_dtype(kv->dtype, [&](auto ty) {
        return launch_scores_t<typename decltype(ty)::type>(A, grid, ekv_plan_stream(pl));
    });
    return scores_launched(pl, e, "scores");
}

ekv_status ekv_cuda_launch_row_scores(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                      const ekv_paged_kv *kv, const ekv_page_table *t,
                                      const float *q, int batch) {
    row_args A;
    set_score_args(A, pl, prm, kv, t, q, batch, 0, 1, 0); /* entmax only: screened */
    A.rows = pl->rows;
    A.row_count = pl->row_count;
    A.zkey = ekv_scr_row(pl, EKV_SCR_ZKEY);
    A.ccap = pl->cand_cap;
    A.cand_z = pl->cand_z;
    A.cand_slot = pl->cand_slot;
    const dim3 grid(ekv_cuda_split_grid(A.nsplit, batch), A.Hk);
    const cudaError_t e = ekv_cuda_with_dtype(kv->dtype, [&](auto ty) {
        return launch_rows_t<typename decltype(ty)::type>(A, grid, ekv_plan_stream(pl));
    });
    return scores_launched(pl, e, "row scores");
}

/* The score rows of the plan's last step ([batch * num_heads][cap_tokens], z-space; slot e ps + t
 * of a row is entry e's token t), copied to the host. Internal, for the GPU tests' precision
 * check against the long-double dot products; synchronises the plan's stream. */
extern "C" EKV_API ekv_status ekv_cuda_score_rows(ekv_cuda_plan *pl, int32_t batch, float *out) {
    return ekv_cuda_read_head_rows(pl, batch, out, pl ? pl->scores : NULL,
                                   pl ? pl->cap_tokens * (int64_t)sizeof(float) : 0);
}
