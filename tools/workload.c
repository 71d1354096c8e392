/*
 * Synthetic workloads for `bench` and `eval` (docs/cli.md):
 *   random   iid N(0,1) keys, values and queries;
 *   planted  noise keys plus, per sequence and KV head, 16 keys aligned with a direction the
 *            queries share, at uniform random positions (old pages included): a retrieval
 *            pattern with a small support far from the end;
 *   heavy    heavy-tailed keys (Student t, 3 degrees of freedom) with 4 outlier channels per
 *            KV head (x8 scale, +4 offset), the shape of real attention keys;
 *   alibi    the planted data with NAPE slopes (docs/math.md §1.6): half the query heads ALiBi with
 *            m_h = 2^(-8(h+1)/(H/2)), half without position.
 *   trace:FILE[@PREFIX]  real attention from a safetensors file holding (names PREFIX + ...)
 *            k [N, Hk, D] and v [N, Hk, D] (F32, F16 or BF16), q [S, H, D] (S decode queries,
 *            each attending over all N keys as the newest position) and optionally
 *            alibi_slopes [H] (F32). Step s of eval/bench uses query row s mod S.
 */
#include "cli.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { PLANTED_PER_HEAD = 16, OUTLIER_CHANNELS = 4 };

static float
f16_to_f32(uint16_t h) { /* IEEE half to float (the CLI does not use library internals) */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        float f = (float)m * 5.9604644775390625e-8f; /* subnormal: m * 2^-24 */
        return sign ? -f : f;
    }
    bits = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Appends to buf the prefixes P of the file for which Pq, Pk and Pv all exist ("l0.", "l3."
 * for a file of `entmaxkv trace`), so a wrong @PREFIX says what to write instead. */
static void trace_prefixes(const ekv_safetensors *st, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "trace prefixes in the file:");
    int found = 0;
    for (int64_t i = 0; i < ekv_safetensors_count(st) && n < cap; i++) {
        ekv_tensor_info t;
        char nm[300];
        if (ekv_safetensors_at(st, i, &t)) continue;
        const size_t len = strlen(t.name);
        if (len == 0 || len >= sizeof nm || t.name[len - 1] != 'q') continue;
        memcpy(nm, t.name, len + 1);
        nm[len - 1] = 'k';
        ekv_tensor_info o;
        int ok = !ekv_safetensors_find(st, nm, &o);
        nm[len - 1] = 'v';
        ok = ok && !ekv_safetensors_find(st, nm, &o);
        if (!ok) continue;
        n += (size_t)snprintf(buf + n, cap - n, "%s \"%.*s\"", found ? "," : "", (int)(len - 1),
                              t.name);
        found = 1;
    }
    if (!found && n < cap)
        snprintf(buf + n, cap - n, " none (no q, k and v tensors of one prefix)");
}

static int trace_open(wl_state *w, ekv_context *ctx, const char *spec, char *err, size_t errlen) {
    memset(w, 0, sizeof *w);
    w->kind = WL_TRACE;
    char path[1024], prefix[256] = "";
    const char *at = strrchr(spec, '@');
    size_t plen = at ? (size_t)(at - spec) : strlen(spec);
    if (plen >= sizeof path || (at && strlen(at + 1) >= sizeof prefix)) {
        snprintf(err, errlen, "trace path too long");
        return -1;
    }
    memcpy(path, spec, plen);
    path[plen] = 0;
    if (at) strcpy(prefix, at + 1);
    ekv_status st = ekv_safetensors_open(ctx, path, &w->trace);
    if (st) {
        snprintf(err, errlen, "%s", ekv_last_error(ctx));
        return -1;
    }
    const char *names[3] = {"q", "k", "v"};
    ekv_tensor_info *ts[3] = {&w->tq, &w->tk, &w->tv};
    for (int i = 0; i < 3; i++) {
        char nm[300];
        snprintf(nm, sizeof nm, "%s%s", prefix, names[i]);
        if (ekv_safetensors_find(w->trace, nm, ts[i])) {
            int n = snprintf(err, errlen, "%s: no tensor '%s'; ", path, nm);
            trace_prefixes(w->trace, err + n, errlen - (size_t)n);
            return -1;
        }
        if (ts[i]->dtype < 0 || ts[i]->ndim != 3) {
            snprintf(err, errlen,
                     "%s: '%s' must be a 3-d F32/F16/BF16 tensor (it is %s with %d dims)", path, nm,
                     ts[i]->dtype_name, ts[i]->ndim);
            return -1;
        }
    }
    if (memcmp(w->tk.shape, w->tv.shape, sizeof w->tk.shape) || w->tk.dtype != w->tv.dtype ||
        w->tq.shape[2] != w->tk.shape[2] || w->tk.shape[0] < 1 || w->tq.shape[0] < 1 ||
        w->tk.shape[1] < 1 || w->tq.shape[1] % w->tk.shape[1] != 0) {
        snprintf(err, errlen,
                 "%s: need k, v [N, Hk, D] of one dtype and q [S, H, D] with Hk dividing H", path);
        return -1;
    }
    w->trace_len = w->tk.shape[0];
    w->kv_heads = w->tk.shape[1];
    w->dim = w->tk.shape[2];
    w->trace_steps = w->tq.shape[0];
    w->heads = w->tq.shape[1];
    ekv_tensor_info ts_s;
    char nm[300];
    snprintf(nm, sizeof nm, "%salibi_slopes", prefix);
    if (!ekv_safetensors_find(w->trace, nm, &ts_s)) {
        if (ts_s.dtype != EKV_DTYPE_F32 || ts_s.ndim != 1 || ts_s.shape[0] != w->heads) {
            snprintf(err, errlen, "%s: '%s' must be F32 [H]", path, nm);
            return -1;
        }
        w->slopes = malloc(sizeof(float) * (size_t)w->heads);
        if (!w->slopes) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        memcpy(w->slopes, ts_s.data, sizeof(float) * (size_t)w->heads);
        w->has_slopes = 1;
    }
    return 0;
}

int wl_parse(const char *spec, wl_kind *out) {
    static const char *names[] = {"random", "planted", "heavy", "alibi"};
    if (!strncmp(spec, "trace:", 6)) {
        *out = WL_TRACE;
        return 0;
    }
    for (int i = 0; i < 4; i++)
        if (!strcmp(spec, names[i])) {
            *out = (wl_kind)i;
            return 0;
        }
    return -1;
}

const char *wl_name(wl_kind k) {
    static const char *names[] = {"random", "planted", "heavy", "alibi", "trace"};
    return names[k];
}

static int synthetic_init(wl_state *w, wl_kind kind, int64_t heads, int64_t kv_heads, int64_t dim,
                          uint64_t seed) {
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
        for (int64_t d = 0; d < dim; d++) {
            u[d] = (float)cli_rng_normal(&r);
            n += (double)u[d] * u[d];
        }
        for (int64_t d = 0; d < dim; d++) u[d] = (float)(u[d] / sqrt(n));
        for (int c = 0; c < OUTLIER_CHANNELS; c++)
            w->outlier[h * OUTLIER_CHANNELS + c] =
                    (int32_t)((uint64_t)(cli_rng_normal(&r) * 1e6 + 1e9) % (uint64_t)dim);
    }
    int64_t h0 = heads / 2 > 0 ? heads / 2 : 1;
    for (int64_t h = 0; h < heads; h++)
        w->slopes[h] = h < heads / 2 ? (float)pow(2.0, -8.0 * (double)(h + 1) / (double)h0) : 0.f;
    return 0;
}

void wl_free(wl_state *w) {
    ekv_safetensors_free(w->trace);
    free(w->dirs);
    free(w->slopes);
    free(w->outlier);
}

const float *wl_slopes(const wl_state *w) {
    return w->kind == WL_ALIBI || (w->kind == WL_TRACE && w->has_slopes) ? w->slopes : NULL;
}

static double student_t3(cli_rng *r) { /* t with 3 dof, scaled to unit variance */
    double z = cli_rng_normal(r), c = 0;
    for (int i = 0; i < 3; i++) {
        double x = cli_rng_normal(r);
        c += x * x;
    }
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

static int fill(ekv_context *ctx, ekv_cache *cache, const int32_t *seqs, int64_t batch, int64_t len,
                const wl_state *w, cli_rng *r, const char *who) {
    if (w->kind == WL_TRACE) { /* the trace's keys and values, as stored (the cache converts) */
        const int64_t row = w->kv_heads * w->dim, es = ekv_dtype_size((ekv_dtype)w->tk.dtype),
                      chunk = 4096;
        for (int64_t b = 0; b < batch; b++)
            for (int64_t p0 = 0; p0 < len; p0 += chunk) {
                int64_t n = len - p0 < chunk ? len - p0 : chunk;
                ekv_status st = ekv_cache_append(
                        cache, seqs[b], n, (const char *)w->tk.data + p0 * row * es,
                        (const char *)w->tv.data + p0 * row * es, (ekv_dtype)w->tk.dtype);
                if (st) {
                    fprintf(stderr, "entmaxkv %s: append failed: %s: %s\n", who,
                            ekv_status_string(st), ekv_last_error(ctx));
                    return 1;
                }
            }
        return 0;
    }
    const int64_t chunk = 2048, row = w->kv_heads * w->dim, D = w->dim;
    float *k = malloc(sizeof(float) * (size_t)(chunk * row)),
          *v = malloc(sizeof(float) * (size_t)(chunk * row));
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(w->kv_heads * PLANTED_PER_HEAD));
    if (!k || !v || !pos) {
        free(k);
        free(v);
        free(pos);
        fprintf(stderr, "entmaxkv %s: out of memory\n", who);
        return 1;
    }
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
                    for (int64_t d = 0; d < D; d++)
                        kr[d] = (float)(c * w->dirs[h * D + d] + cli_rng_normal(r));
                }
            ekv_status st = ekv_cache_append(cache, seqs[b], n, k, v, EKV_DTYPE_F32);
            if (st) {
                fprintf(stderr, "entmaxkv %s: append failed: %s: %s\n", who, ekv_status_string(st),
                        ekv_last_error(ctx));
                free(k);
                free(v);
                free(pos);
                return 1;
            }
            done += n;
            double now = cli_now_seconds();
            if (now - last > 2.0) {
                fprintf(stderr, "  filling the cache (%s): %lld / %lld tokens (%.0f%%)\n",
                        wl_name(w->kind), (long long)done, (long long)total,
                        100.0 * (double)done / (double)total);
                last = now;
            }
        }
    }
    free(k);
    free(v);
    free(pos);
    return 0;
}

void wl_queries(wl_state *w, cli_rng *r, float *q, int64_t batch) {
    const int64_t D = w->dim, G = w->heads / w->kv_heads;
    if (w->kind == WL_TRACE) { /* query row s mod S, for every sequence */
        const int64_t n = w->heads * D, s = w->next_step++ % w->trace_steps;
        for (int64_t b = 0; b < batch; b++)
            for (int64_t i = 0; i < n; i++) {
                const int64_t e = s * n + i;
                switch (w->tq.dtype) {
                case EKV_DTYPE_F16: {
                    uint16_t h;
                    memcpy(&h, (const char *)w->tq.data + 2 * e, 2);
                    q[b * n + i] = f16_to_f32(h);
                    break;
                }
                case EKV_DTYPE_BF16: {
                    uint16_t h;
                    memcpy(&h, (const char *)w->tq.data + 2 * e, 2);
                    uint32_t u = (uint32_t)h << 16;
                    float f;
                    memcpy(&f, &u, 4);
                    q[b * n + i] = f;
                    break;
                }
                default: memcpy(&q[b * n + i], (const char *)w->tq.data + 4 * e, 4);
                }
            }
        return;
    }
    cli_fill_normal(r, q, batch * w->heads * D);
    if (w->kind == WL_PLANTED || w->kind == WL_ALIBI)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t h = 0; h < w->heads; h++) /* share the KV head's direction: g = 8 */
                for (int64_t d = 0; d < D; d++)
                    q[(b * w->heads + h) * D + d] += 8.0f * w->dirs[(h / G) * D + d];
}

int wl_open(wl_state *w, ekv_context *ctx, const char *spec, int64_t heads, int64_t kv_heads,
            int64_t dim, uint64_t seed, const char *who) {
    wl_kind k;
    memset(w, 0, sizeof *w);
    if (wl_parse(spec, &k)) {
        fprintf(stderr, "entmaxkv %s: unknown workload '%s'\n", who, spec);
        return 1;
    }
    char err[2048] = "out of memory"; /* a path, a tensor name and the prefixes of the file */
    int bad = k == WL_TRACE ? trace_open(w, ctx, spec + 6, err, sizeof err)
                            : synthetic_init(w, k, heads, kv_heads, dim, seed);
    if (!bad) return 0;
    fprintf(stderr, "entmaxkv %s: %s\n", who, err);
    wl_free(w);
    memset(w, 0, sizeof *w);
    return 1;
}

int cli_context(const char *who, int64_t threads, ekv_isa isa, ekv_context **ctx) {
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = (int32_t)threads;
    cp.isa = isa;
    ekv_status st = ekv_context_create(&cp, ctx);
    if (st == EKV_ERR_UNSUPPORTED) {
        fprintf(stderr, "entmaxkv %s: --isa %s is not supported by this CPU\n", who,
                ekv_isa_name(isa));
        return CLI_USAGE;
    }
    if (st) {
        fprintf(stderr, "entmaxkv %s: cannot create a context: %s\n", who, ekv_status_string(st));
        return 1;
    }
    return 0;
}

/* The CSR page table of the filled sequences, the views and the page-list buffer. */
static int setup_tables(wl_setup *s, const char *who) {
    int64_t needed = 0;
    ekv_cache_kv_view(s->cache, &s->kv, &s->stats);
    ekv_cache_page_table(s->cache, s->seqs, (int32_t)s->batch, NULL, NULL, 0, NULL, &needed);
    s->indptr = malloc(sizeof(int64_t) * (size_t)(s->batch + 1));
    s->indices = malloc(sizeof(int32_t) * (size_t)(needed > 0 ? needed : 1));
    s->last_page_len = malloc(sizeof(int32_t) * (size_t)s->batch);
    if (!s->indptr || !s->indices || !s->last_page_len) {
        fprintf(stderr, "entmaxkv %s: out of memory\n", who);
        return 1;
    }
    ekv_cache_page_table(s->cache, s->seqs, (int32_t)s->batch, s->indptr, s->indices, needed,
                         s->last_page_len, NULL);
    s->table = (ekv_page_table){(int32_t)s->batch, s->indptr, s->indices, s->last_page_len};
    s->list_capacity = ekv_page_list_capacity(&s->table, s->kv.num_kv_heads);
    s->list_indptr = malloc(sizeof(int64_t) * (size_t)(s->batch * s->kv.num_kv_heads + 1));
    s->list_pages = malloc(sizeof(int32_t) * (size_t)(s->list_capacity > 0 ? s->list_capacity : 1));
    if (!s->list_indptr || !s->list_pages) {
        fprintf(stderr, "entmaxkv %s: out of memory\n", who);
        return 1;
    }
    return 0;
}

int wl_setup_create(wl_setup *s, ekv_context *ctx, const wl_state *w, const wl_geometry *g,
                    cli_rng *r, const char *who) {
    memset(s, 0, sizeof *s);
    s->batch = g->batch;
    s->len = g->len;
    ekv_cache_params pp = ekv_cache_default_params();
    pp.page_size = (int32_t)g->page;
    pp.num_kv_heads = (int32_t)w->kv_heads;
    pp.head_dim = (int32_t)w->dim;
    pp.dtype = g->dtype;
    pp.max_seqs = (int32_t)g->batch;
    if (g->superpage >= 0) pp.superpage_pages = (int32_t)g->superpage;
    pp.code_bits = g->code_bits;
    pp.range_dtype = g->range_dtype;
    pp.num_pages = ekv_cache_pages_for(g->len, g->batch, pp.page_size);
    ekv_status st = ekv_cache_create(ctx, &pp, &s->cache);
    s->seqs = st ? NULL : malloc(sizeof(int32_t) * (size_t)g->batch);
    for (int64_t b = 0; !st && s->seqs && b < g->batch; b++)
        st = ekv_cache_seq_new(s->cache, &s->seqs[b]);
    if (st) {
        fprintf(stderr, "entmaxkv %s: %s: %s\n", who, ekv_status_string(st), ekv_last_error(ctx));
        return 1;
    }
    if (!s->seqs) {
        fprintf(stderr, "entmaxkv %s: out of memory\n", who);
        return 1;
    }
    if (fill(ctx, s->cache, s->seqs, g->batch, g->len, w, r, who)) return 1;
    return setup_tables(s, who);
}

void wl_setup_free(wl_setup *s) {
    free(s->seqs);
    free(s->indptr);
    free(s->indices);
    free(s->last_page_len);
    free(s->list_indptr);
    free(s->list_pages);
    ekv_cache_free(s->cache);
    memset(s, 0, sizeof *s);
}

ekv_page_list wl_setup_list(const wl_setup *s) {
    return (ekv_page_list){
            .indptr = s->list_indptr, .pages = s->list_pages, .capacity = s->list_capacity};
}

int64_t wl_setup_seq_len(const wl_setup *s, int64_t b) {
    return (s->indptr[b + 1] - s->indptr[b] - 1) * s->kv.page_size + s->last_page_len[b];
}

void wl_opts_init(wl_opts *o, const char *workload) {
    memset(o, 0, sizeof *o);
    o->workload = workload;
    o->batch = 1;
    o->heads = 32;
    o->kv_heads = 8;
    o->dim = 128;
    o->page = 16;
    o->seed = 1;
    o->dtype = EKV_DTYPE_F16;
    o->ranges = -1;
}

ekv_dtype wl_range_dtype(const wl_opts *o) {
    return o->ranges < 0 ? ekv_cache_compact_ranges(o->dtype) : (ekv_dtype)o->ranges;
}

static const cli_opt wl_table[] = {
        CLI_STR("--workload", wl_opts, workload),
        CLI_STR("--json", wl_opts, json),
        CLI_INT("--heads", wl_opts, heads, 1, 4096),
        CLI_INT("--kv-heads", wl_opts, kv_heads, 1, 4096),
        CLI_INT("--dim", wl_opts, dim, 1, 65536),
        CLI_INT("--page", wl_opts, page, 1, 256),
        CLI_INT("--threads", wl_opts, threads, 0, 1024),
        CLI_INT("--seed", wl_opts, seed, 0, INT64_MAX),
};

int wl_opt(const char *sub, int argc, char **argv, int *i, wl_opts *o, int64_t max_batch) {
    if (!strcmp(argv[*i], "--batch")) /* the one range that depends on the subcommand */
        o->batch = cli_need_int(sub, argc, argv, i, 1, max_batch);
    else if (!strcmp(argv[*i], "--dtype"))
        o->dtype = cli_need_dtype(sub, argc, argv, i);
    else if (!strcmp(argv[*i], "--ranges"))
        o->ranges = (int)cli_need_dtype(sub, argc, argv, i);
    else
        return cli_take(sub, wl_table, CLI_NOPTS(wl_table), argc, argv, i, o);
    return 1;
}

void wl_opts_check(const char *sub, wl_opts *o) {
    if (wl_parse(o->workload, &o->wl))
        cli_usage_error(sub, "--workload %s: expected random|planted|heavy|alibi|trace:FILE",
                        o->workload);
    if (o->wl == WL_TRACE && o->batch != 1)
        cli_usage_error(sub, "traces hold one sequence: --batch must be 1");
    if (o->heads % o->kv_heads)
        cli_usage_error(sub, "--heads %lld is not a multiple of --kv-heads %lld",
                        (long long)o->heads, (long long)o->kv_heads);
}
