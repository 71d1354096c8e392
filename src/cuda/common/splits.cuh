/*
 * Sequence geometry and split-KV work partitioning (docs/architecture.md, CUDA split-KV): a
 * sequence's pages and tokens from the device page table, the splits of its rows, the split of
 * a block, and the splits of a step (the host's side, ekv_cuda_step_splits).
 */
#pragma once
#include "entmaxkv.h"
#include <stdint.h>
#include "../../core/geometry.h"

/* The splits of one step of `batch` sequences (plan/plan.cu, ekv_cuda_step_splits): the plan's
 * one-wave rule at the step's batch, not the plan's max_batch, so a step of one sequence in a
 * plan made for 64 still fills the GPU (docs/architecture.md, CUDA split-KV). */
struct ekv_step_splits {
    int32_t scores; /* per list row of a uniform batch (ekv_seq_splits' base), <= split_cap */
    int32_t values; /* per query head of the support values kernel                      */
    int32_t unions; /* per KV head of the group-union values kernel                     */
};
ekv_step_splits ekv_cuda_step_splits(const ekv_cuda_plan *pl, int batch);

/* Sequence geometry read from the device page table (lengths live in device memory). */
struct ekv_seq_geom {
    int64_t first; /* indptr[b] */
    int64_t P;     /* pages */
    int64_t N;     /* tokens */
};
__device__ __forceinline__ ekv_seq_geom ekv_seq(const ekv_page_table &t, int b, int ps) {
    ekv_seq_geom g;
    g.first = t.indptr[b];
    g.P = ekv_seq_pages(t.indptr, b);
    g.N = g.P > 0 ? ekv_seq_len(t.indptr, t.last_page_len, b, ps) : 0;
    return g;
}

/* ---- split-KV work partitioning (docs/architecture.md, CUDA split-KV): the splits of a
 * sequence's rows are proportional to its pages, `base` per row for a uniform batch (so B = 1
 * and uniform batches keep their count), ekv_split_count's rule (src/core/geometry.h: rounded
 * up; a floor left rows of just under two splits' worth one block, longer than the longest
 * block of equal splits). Every kernel that splits a row, and every reader of per-split
 * partials, takes the count from here, on the device from the page table (nothing is read
 * back: a step stays graph-safe). ---- */
__device__ __forceinline__ int ekv_seq_splits(const ekv_page_table &t, int b, int base, int cap) {
    return (int)ekv_split_count(base, t.batch, ekv_seq_pages(t.indptr, b),
                                t.indptr[t.batch] - t.indptr[0], cap);
}
/* A grid's x for splits by ekv_seq_splits: the flat splits of every sequence, in sequence order
 * (ekv_split_grid: enough for any lengths). */
static inline int ekv_cuda_split_grid(int base, int batch) { return (int)ekv_split_grid(base, batch); }
/* The split of flat block blockIdx.x: its sequence b (b < 0: none, the block returns at once),
 * its split s of the sequence's rows and their count n. Every warp finds it alone (32
 * sequences per pass, a prefix sum over the lanes), so no barrier is needed; warp-uniform
 * call with every lane of the warp. */
struct ekv_split {
    int b, s, n;
};
__device__ __forceinline__ ekv_split ekv_block_split(const ekv_page_table &t, int base, int cap) {
    const int lane = threadIdx.x & 31;
    const int64_t f = blockIdx.x;
    int64_t before = 0;
    for (int c = 0; c < t.batch; c += 32) {
        const int n = c + lane < t.batch ? ekv_seq_splits(t, c + lane, base, cap) : 0;
        int incl = n;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int x = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += x;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, n > 0 && before + incl > f);
        if (hit) {
            const int l = __ffs(hit) - 1, nl = __shfl_sync(0xffffffffu, n, l),
                      il = __shfl_sync(0xffffffffu, incl, l);
            return ekv_split{c + l, (int)(f - (before + il - nl)), nl};
        }
        before += __shfl_sync(0xffffffffu, incl, 31);
    }
    return ekv_split{-1, 0, 0};
}
/* Part sp.s of sp.n of the entries [begin, end): [*e0, *e1), empty (*e1 <= *e0) past the end. */
__device__ __forceinline__ void ekv_split_range(const ekv_split &sp, int64_t begin, int64_t end,
                                                int64_t *e0, int64_t *e1) {
    const int64_t per = (end - begin + sp.n - 1) / sp.n;
    *e0 = begin + (int64_t)sp.s * per;
    *e1 = *e0 + per < end ? *e0 + per : end;
}
