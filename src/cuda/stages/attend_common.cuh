/*
 * attend stage on the GPU, shared pieces (mirrors src/cpu/stages/attend_pages.c and decode_dense.c;
 * docs/math.md §9.7, docs/architecture.md, "Backends"). Per step, entmax (alpha > 1) runs four
 * kernels: scores:     grid (split, KV head), a sequence's splits by its length (ekv_seq_splits).
 *               Reads K of the listed pages once for the whole GQA group (a cp.async
 *               pipeline of 3 tiles per warp for head dims
 *               64/128/256), writes z = a (scale <q,k> + m_h (j - i)) of every listed token
 *               into the score rows and the split's max per query head. Entmax has no
 *               (max, sum) merge, so the splits keep their scores instead of partial outputs.
 *   candidates: grid (split, query head). The global max M comes from the split
 *               maxima; every support token has z > M - 1, so the tokens with z >= M - 1 are
 *               appended (score, score slot) to the head's candidate list.
 *   tau:        one block per query head solves tau exactly over the candidates (shared memory,
 *               up to 128 KB of them) and writes the support list (p, V row offset), or with the union
 *               values marks the support slots in the KV head's bitmap.
 *   values:     grid (split, query head), or (split, KV head) reading each row of the group's
 *               support union once. Reads V only for the support rows and adds the partial
 *               outputs atomically (tau is global, so they simply sum).
 * When a head has more than cand_cap candidates (flat attention), every split lists again the
 * scores above a lower bound of tau from the candidates' histogram (the refine pass of
 * cand_kernel in tau.cu; ekv_cuda_report .compacted_rows counts them); when those
 * overflow too, the tau kernel's block tries the kept list's bound (compact_list), and only then
 * are tau and the support taken from the whole score row (ekv_cuda_report.slow_rows counts them). If the support itself
 * exceeds the cap, the values kernel scans the score row (slow, but exact).
 * Softmax (alpha = 1) keeps every token: scores -> log-sum-exp over the row -> values over
 * every row (tau_softmax_kernel, values_dense_kernel).
 * Lists: with use_list, entry e of list r is logical page list_pages[r*cap + e]; round 1 is
 * entries [0, list_count[2r]), round 2 [list_count[2r], list_count[2r+1]). Without a list the
 * entries are the sequence's pages. Score slot of entry e, token t: e*page_size + t.
 */
#pragma once
#include "entmaxkv.h"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include <math_constants.h>

/* A thread's accumulators of N groups of M values set to zero (the values kernels' rows). */
template <int N, int M> __device__ __forceinline__ void zero_acc(float (&acc)[N][M]) {
#pragma unroll
    for (int c = 0; c < N; c++)
#pragma unroll
        for (int i = 0; i < M; i++) acc[c][i] = 0.f;
}

__device__ __forceinline__ void entry_range(const int32_t *list_count, int64_t P, int row,
                                            int round, int64_t *begin, int64_t *end) {
    if (!list_count) {
        *begin = 0;
        *end = P;
        return;
    }
    const int64_t c1 = list_count[2 * row], c2 = list_count[2 * row + 1];
    if (round == 1) {
        *begin = 0;
        *end = c1;
    } else if (round == 2) {
        *begin = c1;
        *end = c2;
    } else {
        *begin = 0;
        *end = c2;
    } /* round 3: everything listed */
}

/* The split maxima of query head row `row`: round 1's cap entries, then round 2's (a row pitch
 * of 2 cap; the scores kernel writes them, head_max and the fused attend read them). */
template <typename F> __device__ __forceinline__ F *split_max_row(F *split_max, int64_t row, int cap) {
    return split_max + row * 2 * cap;
}

/* The global max of a head's scores from the n split maxima of each of its `halves` rounds
 * (block-wide; the row's split count n from ekv_seq_splits, a row pitch of 2 cap: the slots
 * past n hold an earlier step's maxima). */
__device__ __forceinline__ float head_max(const float *split_max, int64_t row, int n, int cap,
                                          int halves, float *fscratch) {
    float m = -CUDART_INF_F;
    for (int i = threadIdx.x; i < halves * n; i += blockDim.x)
        m = fmaxf(m, split_max_row(split_max, row, cap)[(i / n) * cap + i % n]);
    return ekv_block_max(m, fscratch, -CUDART_INF_F);
}

/* element offset of score slot s (entry s / ps, token s % ps) of a list row in the K/V pool */
__device__ __forceinline__ int64_t slot_offset(const ekv_page_table &t, const ekv_paged_kv &kv,
                                               const int32_t *list_pages, int64_t cap_pages,
                                               int lrow, int64_t first, int kvh, int ps,
                                               int64_t s) {
    const int64_t e = s / ps, tk = s % ps;
    const int64_t lp = list_pages ? list_pages[(int64_t)lrow * cap_pages + e] : e;
    return (int64_t)t.indices[first + lp] * kv.stride_page + (int64_t)kvh * kv.stride_head +
           tk * kv.stride_token;
}

/* Screened decode's row lists (screen.cu): slot s of list row lrow is token rows[lrow cap + s]
 * of the sequence; its element offset in the K/V pool. */
__device__ __forceinline__ int64_t row_offset(const ekv_page_table &t, const ekv_paged_kv &kv,
                                              const int32_t *rows, int64_t cap_tokens, int lrow,
                                              int64_t first, int kvh, int ps, int64_t s) {
    const int32_t tok = rows[(int64_t)lrow * cap_tokens + s];
    return (int64_t)t.indices[first + tok / ps] * kv.stride_page + (int64_t)kvh * kv.stride_head +
           (int64_t)(tok % ps) * kv.stride_token;
}

/* Marks the score slots slot[k] (where in[k]) in their KV head's support bitmap `bits` and
 * appends each slot no head of the group marked before to the KV head's union list (list,
 * count): the group-union values kernel takes equal shares of that list per block (a split of
 * the bitmap's words left one block most of a support that sits in one stretch of the row).
 * The U atomicOr of a lane are in flight together and the warp takes its places in the list
 * with one atomic: one round trip per 32 slots left a support of 10K tokens ~20 serial round
 * trips per warp. A row's slots are distinct. Warp-collective: every lane of the warp calls it. */
template <int U>
__device__ __forceinline__ void union_mark(uint32_t *bits, int32_t *list, int32_t *count,
                                           const int64_t (&slot)[U], const bool (&in)[U]) {
    uint32_t old[U];
#pragma unroll
    for (int k = 0; k < U; k++)
        old[k] = in[k] ? atomicOr(bits + (slot[k] >> 5), 1u << (slot[k] & 31)) : 0u;
    unsigned m[U];
    int tot = 0;
#pragma unroll
    for (int k = 0; k < U; k++) {
        m[k] = __ballot_sync(0xffffffffu, in[k] && !((old[k] >> (slot[k] & 31)) & 1u));
        tot += __popc(m[k]);
    }
    if (!tot) return;
    int at = ekv_warp_reserve(count, tot);
#pragma unroll
    for (int k = 0; k < U; k++) {
        if ((m[k] >> (threadIdx.x & 31)) & 1u) list[at + ekv_lane_rank(m[k])] = (int32_t)slot[k];
        at += __popc(m[k]);
    }
}
/* One slot per lane. */
__device__ __forceinline__ void union_mark(uint32_t *bits, int32_t *list, int32_t *count,
                                           int64_t slot, bool in) {
    const int64_t s[1] = {slot};
    const bool i[1] = {in};
    union_mark<1>(bits, list, count, s, i);
}

/* What the tau and values kernels (and the sharded plan's agreement) read and write of the
 * plan, set on the host: the entries (the step's lists with use_list, else the sequences'
 * pages; screened's token rows with rows), the score rows, tau as (m, t), the support lists, and
 * the group's support union (its bitmap only where `unions`: the union values kernel's). */
template <typename Args>
inline void ekv_cuda_set_support(Args &A, const ekv_cuda_plan *pl, int use_list, int rows,
                                 bool unions) {
    A.list_pages = use_list ? pl->list_pages : NULL;
    A.list_count = use_list ? pl->list_count : NULL;
    A.rows = rows ? pl->rows : NULL;
    A.row_count = rows ? pl->row_count : NULL;
    A.scores = pl->scores;
    A.tau_m = pl->tau_m;
    A.tau_t = pl->tau_t;
    A.sup_p = pl->sup_p;
    A.sup_off = pl->sup_off;
    A.sup_count = pl->sup_count;
    A.ubits = unions ? pl->ubits : NULL;
    A.cap_words = pl->cap_words;
    A.ulist = pl->ulist;
    A.ucount = pl->ucount;
}
