/*
 * The page selection of context-parallel decode (docs/math.md §11), written once for the CPU
 * simulation (src/cpu/sharded/sharded_select.c) and the CUDA sharded plan
 * (src/cuda/sharded/sharded_select.cu): the agreement on a global top-k by page bound, and nothing
 * else. Every shard holds the bounds of its own pages; the k-th largest key T over all shards
 * is found digit by digit (8 bits a level, most significant first) from histograms that are
 * sums over pages (one allreduce-sum of 256 counts per list and level), every shard applying
 * the same update to the same reduced histogram. Ties at T are taken in page order: shards
 * hold contiguous page ranges in order, so an allreduce of each shard's tie count (one slot
 * per shard) gives every shard the ties before its own. C and CUDA (host and device).
 */
#ifndef EKV_SHARD_SELECT_H
#define EKV_SHARD_SELECT_H
#include <stdint.h>
#include <string.h>

#include "hd.h"

enum { EKV_TOPK_BINS = 256, EKV_TOPK_LEVELS = 4 };

/* The agreement's phase for one list. RUNNING: levels remain; ALL: every key matching the
 * prefix is taken (the bucket held exactly what was still needed); TIES: the prefix is all 32
 * bits of T and `need` of the keys equal to T are taken, the lowest pages first; NONE: no page
 * is ranked in (k <= 0). */
enum { EKV_TOPK_RUNNING = 0, EKV_TOPK_ALL = 1, EKV_TOPK_TIES = 2, EKV_TOPK_NONE = 3 };

typedef struct ekv_topk_agree {
    uint32_t prefix; /* the top `bits` bits of T                                  */
    int32_t bits;    /* 0, 8, 16, 24 or 32                                        */
    int64_t need;    /* keys still to take among those matching the prefix        */
    int32_t phase;   /* EKV_TOPK_*                                                */
} ekv_topk_agree;

/* The order of the bounds as unsigned integers: key(a) > key(b) iff a > b, and key(a) ==
 * key(b) iff a == b, for all non-NaN floats (-0 is mapped to +0, which compares equal to it:
 * the CPU select's tie rule, src/cpu/select/select.c). */
EKV_HD uint32_t ekv_bound_key(float u) {
    if (u == 0.0f) u = 0.0f;
#ifdef __CUDA_ARCH__
    const uint32_t b = __float_as_uint(u);
#else
    uint32_t b;
    memcpy(&b, &u, sizeof b);
#endif
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* k of the `ranked` keys are to be taken. */
EKV_HD void ekv_topk_agree_start(ekv_topk_agree *s, int64_t ranked, int64_t k) {
    s->prefix = 0;
    s->bits = 0;
    s->need = k;
    s->phase = k <= 0 ? EKV_TOPK_NONE : k >= ranked ? EKV_TOPK_ALL : EKV_TOPK_RUNNING;
}

/* The top `bits` bits of a key (0 for bits 0). */
EKV_HD uint32_t ekv_topk_top(uint32_t key, int32_t bits) {
    return bits == 0 ? 0u : bits == 32 ? key : key >> (32 - bits);
}

/* The bin of a key in this level's histogram, or -1 when it is not counted (it does not match
 * the prefix, or the list has agreed). */
EKV_HD int ekv_topk_bin(const ekv_topk_agree *s, uint32_t key) {
    if (s->phase != EKV_TOPK_RUNNING || ekv_topk_top(key, s->bits) != s->prefix) return -1;
    return (int)((key >> (24 - s->bits)) & 0xFFu);
}

/* One level from the histogram summed over the shards (counts as doubles: exact below 2^53):
 * the digit of the need-th largest matching key, scanning from the top. */
EKV_HD void ekv_topk_agree_step(ekv_topk_agree *s, const double *hist) {
    if (s->phase != EKV_TOPK_RUNNING) return;
    double above = 0;
    int d = EKV_TOPK_BINS - 1;
    for (; d > 0 && above + hist[d] < (double)s->need; d--) above += hist[d];
    s->need -= (int64_t)above;
    s->prefix = (s->prefix << 8) | (uint32_t)d;
    s->bits += 8;
    if (hist[d] == (double)s->need)
        s->phase = EKV_TOPK_ALL;
    else if (s->bits == 32)
        s->phase = EKV_TOPK_TIES;
}

/* A key once the list agreed: 1 taken, 0 not, -1 a tie at T (taken when fewer than `need`
 * ties lie on earlier pages, ekv_topk_tie_taken). */
EKV_HD int ekv_topk_take(const ekv_topk_agree *s, uint32_t key) {
    if (s->phase == EKV_TOPK_NONE) return 0;
    const uint32_t top = ekv_topk_top(key, s->bits);
    if (top != s->prefix) return top > s->prefix;
    return s->phase == EKV_TOPK_TIES ? -1 : 1;
}

/* A tie with `before` ties on earlier pages (the earlier shards' and its own shard's) */
EKV_HD int ekv_topk_tie_taken(const ekv_topk_agree *s, int64_t before) { return before < s->need; }

/* The pages a top-k list ranks in, from the sequence's budget in tokens and its `ranked` pages
 * (every page but the last): the budget's whole pages, at least one when the budget is a token
 * or more, at most every ranked page (the CUDA select's rule, src/cuda/select/select.cu). */
EKV_HD int64_t ekv_topk_page_count(int64_t budget, int64_t page_size, int64_t ranked) {
    int64_t k = budget / page_size;
    if (k < 1 && budget >= 1 && ranked >= 1) k = 1;
    return k > ranked ? ranked : k;
}

/* Where a page table stands in its sequence (docs/math.md §11): the whole sequence (one
 * device, or one shard), the last of several shards (its last page is the sequence's), or a
 * shard before it (its last page is an ordinary page: ranked, and not forced into lists). */
enum { EKV_SHARD_WHOLE = 0, EKV_SHARD_LAST = 1, EKV_SHARD_INNER = 2 };

/* The pages of a table of P pages that a selector ranks (top-k bounds, the gaussian rule). */
EKV_HD int64_t ekv_shard_ranked_pages(int64_t P, int pos) {
    if (pos == EKV_SHARD_INNER) return P;
    return P > 1 ? P - 1 : 0;
}

/* The pages whose moments enter the gaussian's global sums (docs/math.md §4.3): every page but
 * the sequence's last, or the only page of a one-page sequence (only a whole table has one). */
EKV_HD int64_t ekv_shard_stats_pages(int64_t P, int pos) {
    if (pos == EKV_SHARD_WHOLE) return P > 1 ? P - 1 : 1;
    return ekv_shard_ranked_pages(P, pos);
}

#endif /* EKV_SHARD_SELECT_H */
