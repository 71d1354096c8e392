/*
 * Synthetic workloads for `bench` and `eval` (DESIGN 4):
 *   random   iid N(0,1) keys, values and queries;
 *   planted  noise keys plus, per sequence and KV head, 16 keys aligned with a direction the
 *            queries share, at uniform random positions (old pages included): a retrieval
 *            pattern with a small support far from the end;
 *   heavy    heavy-tailed keys (Student t, 3 degrees of freedom) with 4 outlier channels per
 *            KV head (x8 scale, +4 offset), the shape of real attention keys;
 *   alibi    the planted data with NAPE slopes (SPEC 1.6): half the query heads ALiBi with
 *            m_h = 2^(-8(h+1)/(H/2)), half without position.
 */
#include "cli.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { PLANTED_PER_HEAD = 16, OUTLIER_CHANNELS = 4 };

int wl_parse(const char *name, wl_kind *out) {
    static const char *names[] = {"random", "planted", "heavy", "alibi"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(name, names[i])) { *out = (wl_kind)i; return 0; }
    return -1;
}

const char *wl_name(wl_kind k) {
    static const char *names[] = {"random", "planted", "heavy", "alibi"};
    return names[k];
}

int wl_init(wl_state *w, wl_kind kind, int64_t heads, int64_t kv_heads, int64_t dim, uint64_t seed) {
    memset(w, 0, sizeof *w);
    w->kind = kind;
    w->heads = heads;
    w->kv_heads = kv_heads;
    w->dim = dim;
    cli_rng r;
    cli_rng_seed(&r, seed ^ 0xabcdef12345ull);
    w->dirs = malloc(sizeof(float) * (size_t)(kv_heads * dim));
    w->slopes = malloc(sizeof(float) * (size_t)heads);
    w->outlier = malloc(sizeof(int32_t) * (size_t)(kv_heads * OUTLIER_CHANNELS));
    if (!w->dirs || !w->slopes || !w->outlier) return -1;
    for (int64_t h = 0; h < kv_heads; h++) { /* unit directions shared by keys and queries */
        double n = 0;
        float *u = w->dirs + h * dim;
        for (int64_t d = 0; d < dim; d++) { u[d] = (float)cli_rng_normal(&r); n += (double)u[d] * u[d]; }
        for (int64_t d = 0; d < dim; d++) u[d] = (float)(u[d] / sqrt(n));
        for (int c = 0; c < OUTLIER_CHANNELS; c++)
            w->outlier[h * OUTLIER_CHANNELS + c] = (int32_t)((uint64_t)(cli_rng_normal(&r) * 1e6 + 1e9) % (uint64_t)dim);
    }
    int64_t h0 = heads / 2 > 0 ? heads / 2 : 1;
    for (int64_t h = 0; h < heads; h++)
        w->slopes[h] = h < heads / 2 ? (float)pow(2.0, -8.0 * (double)(h + 1) / (double)h0) : 0.f;
    return 0;
}

void wl_free(wl_state *w) {
    free(w->dirs);
    free(w->slopes);
    free(w->outlier);
}

const float *wl_slopes(const wl_state *w) { return w->kind == WL_ALIBI ? w->slopes : NULL; }

static double student_t3(cli_rng *r) { /* t with 3 dof, scaled to unit variance */
    double z = cli_rng_normal(r), c = 0;
    for (int i = 0; i < 3; i++) { double x = cli_rng_normal(r); c += x * x; }
    return z / sqrt(c / 3.0) / sqrt(3.0);
}

/* One chunk of rows [n][Hk][D] of keys for positions pos0.. of a sequence. */
static void key_rows(const wl_state *w, cli_rng *r, float *k, int64_t n) {
    const int64_t row = w->kv_heads * w->dim;
    if (w->kind == WL_HEAVY) {
        for (int64_t i = 0; i < n * row; i++) k[i] = (float)student_t3(r);
        for (int64_t t = 0; t < n; t++)
            for (int64_t h = 0; h < w->kv_heads; h++)
                for (int c = 0; c < OUTLIER_CHANNELS; c++) {
                    float *x = k + t * row + h * w->dim + w->outlier[h * OUTLIER_CHANNELS + c];
                    *x = 8.0f * *x + 4.0f;
                }
    } else {
        cli_fill_normal(r, k, n * row);
    }
}

int wl_fill(ekv_context *ctx, ekv_cache *cache, const int32_t *seqs, int64_t batch, int64_t len, const wl_state *w,
            cli_rng *r, const char *who) {
    const int64_t chunk = 2048, row = w->kv_heads * w->dim, D = w->dim;
    float *k = malloc(sizeof(float) * (size_t)(chunk * row)), *v = malloc(sizeof(float) * (size_t)(chunk * row));
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(w->kv_heads * PLANTED_PER_HEAD));
    if (!k || !v || !pos) { free(k); free(v); free(pos); fprintf(stderr, "entmaxkv %s: out of memory\n", who); return 1; }
    const int planted = w->kind == WL_PLANTED || w->kind == WL_ALIBI;
    double t0 = cli_now_seconds(), last = t0;
    int64_t total = len * batch, done = 0;
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t i = 0; i < w->kv_heads * PLANTED_PER_HEAD; i++) /* uniform over the sequence */
            pos[i] = (int64_t)(cli_rng_uniform(r) * (double)len) % len;
        for (int64_t p0 = 0; p0 < len; p0 += chunk) {
            int64_t n = len - p0 < chunk ? len - p0 : chunk;
            key_rows(w, r, k, n);
            cli_fill_normal(r, v, n * row);
            if (planted)
                for (int64_t i = 0; i < w->kv_heads * PLANTED_PER_HEAD; i++) {
                    int64_t p = pos[i], h = i / PLANTED_PER_HEAD;
                    if (p < p0 || p >= p0 + n) continue;
                    /* aligned key: strength c in [6, 12] along u_h, plus unit noise */
                    double c = 6.0 + 6.0 * (double)(i % PLANTED_PER_HEAD) / (PLANTED_PER_HEAD - 1);
                    float *kr = k + (p - p0) * row + h * D;
                    for (int64_t d = 0; d < D; d++) kr[d] = (float)(c * w->dirs[h * D + d] + cli_rng_normal(r));
                }
            ekv_status st = ekv_cache_append(cache, seqs[b], n, k, v, EKV_DTYPE_F32);
            if (st) {
                fprintf(stderr, "entmaxkv %s: append failed: %s: %s\n", who, ekv_status_string(st), ekv_last_error(ctx));
                free(k); free(v); free(pos);
                return 1;
            }
            done += n;
            double now = cli_now_seconds();
            if (now - last > 2.0) {
                fprintf(stderr, "  filling the cache (%s): %lld / %lld tokens (%.0f%%)\n", wl_name(w->kind),
                        (long long)done, (long long)total, 100.0 * (double)done / (double)total);
                last = now;
            }
        }
    }
    free(k); free(v); free(pos);
    return 0;
}

void wl_queries(const wl_state *w, cli_rng *r, float *q, int64_t batch) {
    const int64_t D = w->dim, G = w->heads / w->kv_heads;
    cli_fill_normal(r, q, batch * w->heads * D);
    if (w->kind == WL_PLANTED || w->kind == WL_ALIBI)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t h = 0; h < w->heads; h++) /* share the KV head's direction: g = 8 */
                for (int64_t d = 0; d < D; d++) q[(b * w->heads + h) * D + d] += 8.0f * w->dirs[(h / G) * D + d];
}
