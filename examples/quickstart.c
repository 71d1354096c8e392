/* The README's "Library" example in full: a context, a paged KV cache with one sequence,
 * an append, the page table and the KV view, one dense entmax decode step, error handling,
 * and the frees. Build it against an installed entmaxkv:
 *   cc quickstart.c $(pkg-config --cflags --libs entmaxkv) -o quickstart */
#include <entmaxkv.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { N = 4096, HK = 8, H = 32, D = 128 }; /* tokens, KV heads, query heads, head dim */

/* n pseudo-random values in [-1, 1): stand-ins for the keys, values and queries of a model */
static void fill_random(float *x, int64_t n, uint32_t seed) {
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = (float)(seed >> 8) / 8388608.0f - 1.0f;
    }
}

/* One decode step for the query q over a sequence of the cache: the page table (asking how
 * many page ids it needs first), the view of the cache's memory, then dense entmax. */
static ekv_status decode_step(ekv_context *ctx, const ekv_cache *cache, int32_t seq, const float *q,
                              float *out, int64_t *support) {
    int64_t indptr[2], needed = 0;
    int32_t last_page_len[1];
    ekv_status st = ekv_cache_page_table(cache, &seq, 1, indptr, NULL, 0, last_page_len, &needed);
    if (st) return st;
    int32_t *indices = malloc(sizeof(int32_t) * (size_t)needed);
    if (!indices) return EKV_ERR_OUT_OF_MEMORY;
    st = ekv_cache_page_table(cache, &seq, 1, indptr, indices, needed, last_page_len, NULL);
    ekv_page_table table = {
            .batch = 1, .indptr = indptr, .indices = indices, .last_page_len = last_page_len};
    ekv_paged_kv kv;
    if (!st) st = ekv_cache_kv_view(cache, &kv, NULL);
    ekv_decode_params dp = ekv_decode_default_params(); /* 32 query heads, alpha 1.5 */
    ekv_decode_info info = {.support = support};        /* tokens with p > 0, per head */
    if (!st) st = ekv_decode_dense(ctx, &dp, &kv, &table, q, out, &info);
    free(indices);
    return st;
}

static float k[N * HK * D], v[N * HK * D], q[H * D], out[H * D];

int main(void) {
    fill_random(k, N * HK * D, 1);
    fill_random(v, N * HK * D, 2);
    fill_random(q, H * D, 3);
    ekv_context *ctx = NULL;
    ekv_status st = ekv_context_create(NULL, &ctx); /* threads = CPUs, best SIMD level */
    if (st) {
        fprintf(stderr, "quickstart: %s\n", ekv_status_string(st)); /* no context: no message */
        return 1;
    }
    ekv_cache_params cp = ekv_cache_default_params(); /* 8 KV heads, D = 128, f16, page 16 */
    cp.num_pages = ekv_cache_pages_for(N, 1, cp.page_size);
    ekv_cache *cache = NULL;
    int32_t seq = -1;
    int64_t support[H];
    st = ekv_cache_create(ctx, &cp, &cache);
    if (!st) st = ekv_cache_seq_new(cache, &seq);
    if (!st) st = ekv_cache_append(cache, seq, N, k, v, EKV_DTYPE_F32); /* k, v: [N][8][128] */
    if (!st) st = decode_step(ctx, cache, seq, q, out, support);
    if (st) /* every call returns a status (negative = error); the context says what was wrong */
        fprintf(stderr, "quickstart: %s: %s\n", ekv_status_string(st), ekv_last_error(ctx));
    else
        printf("decoded %d heads over %d tokens: head 0 attends %lld tokens, out[0][0..2] = %.5f %.5f %.5f\n",
               H, N, (long long)support[0], out[0], out[1], out[2]);
    ekv_cache_free(cache);
    ekv_context_free(ctx);
    return st ? 1 : 0;
}
