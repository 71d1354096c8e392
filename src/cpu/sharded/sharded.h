/*
 * The CPU simulation of context-parallel decode (docs/math.md §11): its collectives, explicit
 * functions that count their rounds and the payload each shard sends, shared by the agreement
 * on tau and the merge (sharded.c) and the agreement on the page lists (sharded_select.c).
 */
#ifndef EKV_CPU_SHARDED_H
#define EKV_CPU_SHARDED_H
#include "../../core/internal.h"
#include "../../math/shard_agree.h"

enum { EKV_SHARD_MAX = 64 };

typedef struct ekv_shard_comm {
    int32_t rounds; /* allreduce calls */
    int64_t bytes;  /* payload bytes each shard sends, summed over the calls */
} ekv_shard_comm;

/* Every shard j holds vals[j * n .. + n) (doubles: counts are exact below 2^53); all get the
 * reduction in out[0 .. n), summed in shard order. */
static inline void ekv_shard_allreduce_sum(const double *vals, int S, int64_t n, double *out,
                                           ekv_shard_comm *c) {
    for (int64_t i = 0; i < n; i++) {
        out[i] = 0;
        for (int j = 0; j < S; j++) out[i] += vals[j * n + i];
    }
    c->rounds++;
    c->bytes += 8 * n;
}
static inline void ekv_shard_allreduce_max(const double *vals, int S, int64_t n, double *out,
                                           ekv_shard_comm *c) {
    for (int64_t i = 0; i < n; i++) {
        out[i] = -INFINITY;
        for (int j = 0; j < S; j++) out[i] = vals[j * n + i] > out[i] ? vals[j * n + i] : out[i];
    }
    c->rounds++;
    c->bytes += 8 * n;
}

/*
 * The page lists of a topk or gaussian step, agreed across S shards (sharded_select.c): list
 * l = b * heads + h as ekv_select_pages sets it (the same pages; here in ascending order, the
 * last page last), each shard having chosen its own pages from its own bounds or moments and
 * the reduced statistics. tau (gaussian fixed/corrected modes, else NULL): tau-hat per query
 * head. rounds[B*H]: each head's allreduce rounds (the batched ones count for every head);
 * *bytes += the payload one shard sent. Arguments validated (ekv_validate_select).
 */
ekv_status ekv_shard_select(ekv_context *ctx, const ekv_decode_params *prm,
                            const ekv_select_params *sel, const ekv_paged_kv *kv,
                            const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                            int S, ekv_page_list *list, double *tau, int32_t *rounds,
                            int64_t *bytes);
#endif
