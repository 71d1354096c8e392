/*
 * The scores stage's pieces shared by its two kernel families (docs/math.md §3.1): the
 * CUDA-core kernels (scores.cu) and the tensor-core kernel (scores_mma.cu).
 * Both read the same arguments, write the same score rows and split maxima, and zero the same
 * per-step counters, so the later stages cannot tell which one ran.
 */
#pragma once
#include "attend_common.cuh"
#include "../common/loads.cuh"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include "../common/splits.cuh"
#include <math_constants.h>

struct score_args : ekv_cuda_shape {
    ekv_paged_kv kv;
    const float *q;
    const float *slopes; /* device, [H] or NULL */
    double qscale;       /* a * scale */
    float a;
    int nsplit, split_cap; /* ekv_seq_splits' base and cap */
    const int32_t *list_pages, *list_count; /* NULL: dense */
    const uint16_t *list_heads; /* per entry, the group's heads that attend it; NULL: all */
    int round;                              /* 1 or 2 */
    float *scores, *split_max;
    int32_t *cand_count; /* [B*H], zeroed here for the candidates kernel */
    int64_t *v_rows;     /* [B*Hk], zeroed here */
    int32_t *ucount;     /* [B*Hk] the group's union list (union_mark), zeroed here */
};

/* This block's split (ekv_block_split over grid (split, KV head)): false when it has none (the
 * block returns at once, block-uniform); else its sequence, KV head and list row. */
__device__ __forceinline__ bool score_block(const score_args &A, ekv_split *sp, int *b, int *kvh,
                                            int *row) {
    *sp = ekv_block_split(A.t, A.nsplit, A.split_cap);
    *b = sp->b;
    *kvh = blockIdx.y;
    *row = sp->b * A.Hk + (int)blockIdx.y;
    return sp->b >= 0;
}

/* The per-step counters the later kernels add into (split 0 of the row). */
__device__ __forceinline__ void zero_step_counters(const score_args &A, const ekv_split &sp,
                                                   int row, int b, int kvh) {
    if (sp.s != 0) return;
    if (threadIdx.x < A.G) A.cand_count[(int64_t)b * A.H + kvh * A.G + threadIdx.x] = 0;
    if (threadIdx.x == 0) A.v_rows[row] = 0;
    if (threadIdx.x == 0) A.ucount[row] = 0;
}

/* The entries [e0, e1) of this block's split of the list row's round. */
__device__ __forceinline__ void split_entries(const score_args &A, const ekv_split &sp,
                                              const ekv_seq_geom &sg, int row, int64_t *e0,
                                              int64_t *e1) {
    int64_t begin, end;
    entry_range(A.list_count, sg.P, row, A.round, &begin, &end);
    ekv_split_range(sp, begin, end, e0, e1);
}

/* q' = a scale q of the group's heads into shared memory ([G][D]) */
__device__ __forceinline__ void load_group_q(const score_args &A, int b, int kvh, float *qs) {
    ekv_group_query(A.q + ((int64_t)b * A.H + kvh * A.G) * A.D, A.qscale, A.G * A.D, qs);
}

/* The block's max per query head from every warp's maxima red[warp][g], written as this
 * split's max (the second half of a row's split maxima in round 2). */
__device__ __forceinline__ void publish_split_max(const score_args &A, const float *red,
                                                  const ekv_split &sp, int b, int kvh) {
    const int nw = blockDim.x >> 5, half = A.round == 2 ? A.split_cap : 0;
    __syncthreads();
    if (threadIdx.x < A.G) {
        float m = -CUDART_INF_F;
        for (int w = 0; w < nw; w++) m = fmaxf(m, red[w * A.G + threadIdx.x]);
        split_max_row(A.split_max, (int64_t)b * A.H + kvh * A.G + threadIdx.x,
                      A.split_cap)[half + sp.s] = m;
    }
}

/* Block max of every warp's running maxima, written as this split's max per query head. */
template <int GM>
__device__ __forceinline__ void write_split_max(const score_args &A, const float *runmax,
                                                float *red, const ekv_split &sp, int b, int kvh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g < A.G) {
            float m = ekv_warp_max(runmax[g]);
            if (lane == 0) red[warp * A.G + g] = m;
        }
    }
    publish_split_max(A, red, sp, b, kvh);
}

/* The group's running maxima (none yet) and ALiBi slopes in z-space. */
template <int GM>
__device__ __forceinline__ void init_group(const score_args &A, int kvh, float *runmax,
                                           float *slope) {
#pragma unroll
    for (int g = 0; g < GM; g++) {
        runmax[g] = -CUDART_INF_F;
        slope[g] = (g < A.G && A.slopes) ? A.a * A.slopes[kvh * A.G + g] : 0.f;
    }
}

/* A score in z-space: the dot product plus the ALiBi bias of token t of a page starting at
 * position jbase relative to the query, or -inf for a slot that holds no token (in = false).
 * Every scores kernel forms it with this one expression (the row scores must equal the page
 * scores bit for bit). */
__device__ __forceinline__ float score_z(float dot, float slope, float jbase, int t, bool in) {
    return in ? dot + slope * (jbase + (float)t) : -CUDART_INF_F;
}

/* A warp's place in its tiles: the page-list entry and the first row of the tile. Tile j of
 * a warp is entry e0 + warp + (j / tpp) NW, rows from (j % tpp) TR; two cursors (the tile
 * being issued, the tile being reduced) walk them without 64-bit divisions. */
struct score_cursor {
    int64_t e;
    int r0;
};
template <int TR, int NW> __device__ __forceinline__ void advance(score_cursor &c, int ps) {
    c.r0 += TR;
    if (c.r0 >= ps) {
        c.r0 = 0;
        c.e += NW;
    }
}

/* Entry e of list row `row` (page e of the sequence without a list): its logical page, and in
 * *valid the tokens it holds. */
__device__ __forceinline__ int64_t entry_page(const score_args &A, const ekv_seq_geom &sg, int row,
                                              int64_t e, int *valid) {
    const int64_t lp = A.list_pages ? A.list_pages[(int64_t)row * A.cap_pages + e] : e;
    *valid = lp == sg.P - 1 ? (int)(sg.N - lp * A.ps) : A.ps;
    return lp;
}
/* The group's heads that attend entry e of list row `row` (bit g: head g; per_query_head lists
 * mask a head to its own pages, whose other scores are -inf), every head without masks. */
__device__ __forceinline__ unsigned entry_heads(const score_args &A, int row, int64_t e) {
    return A.list_heads ? A.list_heads[(int64_t)row * A.cap_pages + e] : 0xFFFFu;
}
/* Element offset of KV head kvh's block of logical page lp in the K (or V) pool. */
__device__ __forceinline__ int64_t page_block(const score_args &A, const ekv_seq_geom &sg,
                                              int64_t lp, int kvh) {
    return (int64_t)A.t.indices[sg.first + lp] * A.kv.stride_page + (int64_t)kvh * A.kv.stride_head;
}

/* The tensor-core scores kernel (scores_mma.cu): whether it serves this shape (16-bit K,
 * head dim 64 or 128, page size a multiple of 16, group <= 16), and its launch. */
bool ekv_cuda_scores_mma_applies(int dtype, int head_dim, int page_size, int group);
cudaError_t ekv_cuda_scores_mma(const score_args &A, int dtype, dim3 grid,
                                const ekv_launch_stream &st);
