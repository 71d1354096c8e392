/* What topk_delta.c and certified.c share (quickstart.c spells these steps out one by one):
 * synthetic keys with a few planted matches for the queries, a cache holding them, and the
 * KV view, page statistics and page table a decode step takes. */
#ifndef EKV_EXAMPLE_UTIL_H
#define EKV_EXAMPLE_UTIL_H
#include <entmaxkv.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { EX_N = 8192, EX_HK = 8, EX_H = 32, EX_D = 128 }; /* tokens, KV heads, query heads, dim */

typedef struct ex_setup {
    ekv_cache *cache;
    ekv_paged_kv kv;      /* the cache's K/V memory */
    ekv_page_stats stats; /* its per-page key statistics: what page selection bounds */
    int64_t indptr[2];
    int32_t last_page_len[1];
    int32_t *indices;
    ekv_page_table table; /* the one sequence, as a batch of 1 */
    float q[EX_H * EX_D]; /* one decode query per head */
} ex_setup;

static uint32_t ex_rand_state = 12345;
/* a pseudo-random value in [-1, 1) */
static float ex_rand(void) {
    ex_rand_state = ex_rand_state * 1664525u + 1013904223u;
    return (float)(ex_rand_state >> 8) / 8388608.0f - 1.0f;
}

/* Keys and values in [-1, 1); each KV head's query heads point along one direction u, and
 * the keys of a few tokens (page-aligned groups at spread-out positions) along u as well: a
 * sparse attention pattern like a retrieval head's, which entmax turns into exact zeros. */
static void ex_make_data(float *k, float *v, float *q) {
    float u[EX_HK][EX_D];
    for (int g = 0; g < EX_HK; g++)
        for (int d = 0; d < EX_D; d++) u[g][d] = ex_rand();
    for (int h = 0; h < EX_H; h++)
        for (int d = 0; d < EX_D; d++)
            q[h * EX_D + d] = u[h / (EX_H / EX_HK)][d] + 0.3f * ex_rand();
    for (int64_t i = 0; i < (int64_t)EX_N * EX_HK * EX_D; i++) {
        k[i] = ex_rand();
        v[i] = ex_rand();
    }
    static const int64_t planted[] = {100, 1000, 2500, 4000, 5100, 6000, 7100, 8000};
    for (size_t i = 0; i < sizeof planted / sizeof planted[0]; i++)
        for (int64_t t = planted[i]; t < planted[i] + 6;
             t++) /* strength rises with i, falls along a group */
            for (int g = 0; g < EX_HK; g++)
                for (int d = 0; d < EX_D; d++)
                    k[(t * EX_HK + g) * EX_D + d] =
                            (1.6f + 0.15f * (float)i - 0.1f * (float)(t - planted[i])) * u[g][d];
}

/* Fills s: a cache with one sequence of EX_N tokens, its view, statistics and page table. */
static ekv_status ex_setup_create(ekv_context *ctx, ex_setup *s) {
    memset(s, 0, sizeof *s);
    float *k = malloc(sizeof(float) * EX_N * EX_HK * EX_D),
          *v = malloc(sizeof(float) * EX_N * EX_HK * EX_D);
    ekv_status st = k && v ? EKV_OK : EKV_ERR_OUT_OF_MEMORY;
    int32_t seq = -1;
    int64_t needed = 0;
    if (!st) {
        ex_make_data(k, v, s->q);
        ekv_cache_params cp = ekv_cache_default_params(); /* 8 KV heads, D = 128, f16, page 16 */
        cp.num_pages = ekv_cache_pages_for(EX_N, 1, cp.page_size);
        st = ekv_cache_create(ctx, &cp, &s->cache);
    }
    if (!st) st = ekv_cache_seq_new(s->cache, &seq);
    if (!st) st = ekv_cache_append(s->cache, seq, EX_N, k, v, EKV_DTYPE_F32);
    if (!st)
        st = ekv_cache_page_table(s->cache, &seq, 1, s->indptr, NULL, 0, s->last_page_len, &needed);
    if (!st && !(s->indices = malloc(sizeof(int32_t) * (size_t)needed))) st = EKV_ERR_OUT_OF_MEMORY;
    if (!st)
        st = ekv_cache_page_table(s->cache, &seq, 1, s->indptr, s->indices, needed,
                                  s->last_page_len, NULL);
    if (!st) st = ekv_cache_kv_view(s->cache, &s->kv, &s->stats);
    s->table = (ekv_page_table){.batch = 1,
                                .indptr = s->indptr,
                                .indices = s->indices,
                                .last_page_len = s->last_page_len};
    free(k);
    free(v);
    return st;
}

static void ex_setup_free(ex_setup *s) {
    ekv_cache_free(s->cache);
    free(s->indices);
}

/* max over heads of ||a - b|| / ||b|| for outputs [EX_H][EX_D] */
static double ex_rel_error(const float *a, const float *b) {
    double worst = 0;
    for (int h = 0; h < EX_H; h++) {
        double e = 0, m = 0;
        for (int d = 0; d < EX_D; d++) {
            const double x = (double)a[h * EX_D + d] - b[h * EX_D + d];
            e += x * x;
            m += (double)b[h * EX_D + d] * b[h * EX_D + d];
        }
        worst = fmax(worst, sqrt(e / (m > 0 ? m : 1)));
    }
    return worst;
}
#endif
