/*
 * Dropped mass of entmax top-k per query head on one layer of a model trace (written by
 * `entmaxkv trace`): for every query row, the dense entmax probabilities (ekv_dense_probs)
 * and the top-k page lists of ekv_select_pages, four ways (box bound or min(box, ball); one
 * list per KV head or per query head); delta = probability outside the list, averaged over
 * the rows. `eval` reports the same delta averaged over heads; this splits it by head.
 *
 *   gcc -O2 -std=c11 -D_POSIX_C_SOURCE=200809L -Iinclude bench/trace_topk_heads.c \
 *       build/libentmaxkv.a -lm -lpthread -o build/trace_topk_heads
 *   build/trace_topk_heads TRACE.safetensors LAYER PAGE_SIZE BUDGET_FRACTION
 */
#include "entmaxkv.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int find(ekv_safetensors *st, int layer, const char *what, ekv_tensor_info *t) {
    char name[64];
    snprintf(name, sizeof name, "l%d.%s", layer, what);
    if (ekv_safetensors_find(st, name, t)) {
        fprintf(stderr, "no tensor %s\n", name);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s TRACE LAYER PAGE_SIZE BUDGET_FRACTION\n", argv[0]);
        return 2;
    }
    const int layer = atoi(argv[2]), page = atoi(argv[3]);
    const double frac = atof(argv[4]);
    ekv_context *ctx;
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = 1;
    if (ekv_context_create(&cp, &ctx)) return 1;
    ekv_safetensors *st;
    if (ekv_safetensors_open(ctx, argv[1], &st)) {
        fprintf(stderr, "%s\n", ekv_last_error(ctx));
        return 1;
    }
    ekv_tensor_info tk, tv, tq, ts;
    if (find(st, layer, "k", &tk) || find(st, layer, "v", &tv) || find(st, layer, "q", &tq) ||
        find(st, layer, "alibi_slopes", &ts) || tk.dtype != EKV_DTYPE_F16 ||
        tq.dtype != EKV_DTYPE_F32)
        return 1;
    const int64_t N = tk.shape[0], Hk = tk.shape[1], D = tk.shape[2], S = tq.shape[0],
                  H = tq.shape[1];
    ekv_cache_params pp = ekv_cache_default_params();
    pp.page_size = page;
    pp.num_kv_heads = (int32_t)Hk;
    pp.head_dim = (int32_t)D;
    pp.max_seqs = 1;
    pp.num_pages = ekv_cache_pages_for(N, 1, page);
    ekv_cache *c;
    int32_t seq;
    if (ekv_cache_create(ctx, &pp, &c) || ekv_cache_seq_new(c, &seq) ||
        ekv_cache_append(c, seq, N, tk.data, tv.data, EKV_DTYPE_F16)) {
        fprintf(stderr, "%s\n", ekv_last_error(ctx));
        return 1;
    }
    ekv_paged_kv kv;
    ekv_page_stats ps;
    ekv_cache_kv_view(c, &kv, &ps);
    int64_t ip[2];
    int32_t lpl, *idx = malloc(sizeof(int32_t) * (size_t)(N / page + 2));
    ekv_cache_page_table(c, &seq, 1, ip, idx, N / page + 2, &lpl, NULL);
    ekv_page_table tab = {1, ip, idx, &lpl};
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = (int32_t)H;
    dp.alpha = 1.5;
    dp.alibi_slopes = (const float *)ts.data;
    const int64_t P = ip[1], cap = ekv_page_list_capacity(&tab, (int32_t)H);
    float *q = malloc(sizeof(float) * (size_t)(H * D)),
          *p = malloc(sizeof(float) * (size_t)(H * N));
    int64_t *lip = malloc(sizeof(int64_t) * (size_t)(H + 1));
    int32_t *lpg = malloc(sizeof(int32_t) * (size_t)cap);
    char *in = malloc((size_t)P);
    double *delta = calloc((size_t)H, sizeof(double));
    for (int var = 0; var < 4; var++) {
        const int ball = var & 1, per_head = var >> 1;
        memset(delta, 0, sizeof(double) * (size_t)H);
        for (int64_t s = 0; s < S; s++) {
            memcpy(q, (const float *)tq.data + s * H * D, sizeof(float) * (size_t)(H * D));
            ekv_select_params sp = ekv_select_default_params();
            sp.budget_tokens = (int64_t)(frac * (double)N);
            sp.use_ball = ball;
            sp.per_query_head = per_head;
            ekv_page_list l = {.indptr = lip, .pages = lpg, .capacity = cap};
            if (ekv_dense_probs(ctx, &dp, &kv, &tab, q, N, p, NULL) ||
                ekv_select_pages(ctx, &dp, &sp, &kv, &ps, &tab, q, &l)) {
                fprintf(stderr, "%s\n", ekv_last_error(ctx));
                return 1;
            }
            for (int64_t h = 0; h < H; h++) {
                const int64_t li = per_head ? h : h / (H / Hk);
                memset(in, 0, (size_t)P);
                for (int64_t r = lip[li]; r < lip[li + 1]; r++) in[lpg[r]] = 1;
                for (int64_t t = 0; t < N; t++)
                    if (!in[t / page]) delta[h] += p[h * N + t] / (double)S;
            }
        }
        printf("layer %d page %d budget %.4f %s, lists per %s: delta per head", layer, page, frac,
               ball ? "min(box, ball)" : "box", per_head ? "query head" : "KV head");
        for (int64_t h = 0; h < H; h++) printf(" %.3f", delta[h]);
        printf("\n");
    }
    free(q);
    free(p);
    free(lip);
    free(lpg);
    free(in);
    free(delta);
    free(idx);
    ekv_cache_free(c);
    ekv_safetensors_free(st);
    ekv_context_free(ctx);
    return 0;
}
