/*
 * entmaxkv trace: runs the model over a text and dumps each layer's attention inputs in the
 * layout `eval --workload trace:FILE@lL.` and `bench --workload trace:...` read
 * (tools/workload.c): per layer L, tensors lL.k and lL.v [N, Hk, D] (the KV cache's rows, in
 * its storage dtype), lL.q [S, H, D] F32 (queries before the 1/sqrt(D) scale) and
 * lL.alibi_slopes [H] F32 (NAPE).
 *
 * The first N - S tokens are prefilled, then the last S are run one step at a time and each
 * step's queries are kept: row s is the query of position N - S + s. eval attends every row
 * over all N keys as the newest position, so rows before the last also see the up to S - 1
 * keys that follow them; --queries 1 keeps only the exact last-step distribution.
 */
#include "cli.h"
#include <stdlib.h>
#include <string.h>

static void trace_help(FILE *f) {
    fprintf(f,
            "usage: entmaxkv trace --text FILE --out FILE.safetensors [--model FILE] [options]\n"
            "\n"
            "Runs the model over the first --ctx tokens of a text and writes each layer's keys, values\n"
            "and last queries, for 'entmaxkv eval --workload trace:FILE.safetensors@l3.' (layer 3).\n"
            "\n"
            "  --text FILE           the text (bytes are tokens)\n"
            "  --out FILE            the safetensors file to write (the path is checked before\n"
            "                        the run; the file is replaced only once written whole)\n"
            "  --ctx N               tokens to run (default 8192)\n"
            "  --offset B            start at byte B of the text (default 0)\n"
            "  --queries S           query rows per layer: the queries of the last S positions\n"
            "                        (default 16; 1 = only the exact last step, see below)\n"
            "  --layers LIST         comma list of layers to dump, each at most once (default\n"
            "                        all)\n");
    model_opts_help(f);
    fprintf(f,
            "  --help                this text\n"
            "\n"
            "Tensors per layer L: lL.k, lL.v [N, Hk, D] (the cache dtype), lL.q [S, H, D] F32 and\n"
            "lL.alibi_slopes [H] F32. eval attends every query row over all N keys as the newest\n"
            "position, so row s < S-1 (position N-S+s) also sees the S-1-s keys after it.\n");
}

static const char *st_dtype(ekv_dtype d) {
    return d == EKV_DTYPE_F16 ? "F16" : d == EKV_DTYPE_BF16 ? "BF16" : "F32";
}

/* Copies the sequence's K or V rows [N][Hk][D] out of the paged cache, in its dtype. */
static void gather_rows(const ekv_paged_kv *kv, const void *base, const int32_t *pages, int64_t N,
                        char *dst) {
    const int64_t es = ekv_dtype_size(kv->dtype), D = kv->head_dim, ps = kv->page_size;
    for (int64_t t = 0; t < N; t++)
        for (int64_t h = 0; h < kv->num_kv_heads; h++) {
            const int64_t off = (int64_t)pages[t / ps] * kv->stride_page + h * kv->stride_head +
                                (t % ps) * kv->stride_token;
            memcpy(dst + (t * kv->num_kv_heads + h) * D * es, (const char *)base + off * es,
                   (size_t)(D * es));
        }
}

/* The parsed command line; nlayers -1 means every layer of the model, resolved once the model
 * is open (a model has at most EKV_MODEL_MAX_LAYERS: each fits). */
typedef struct {
    model_opts mo;
    const char *text_path, *out, *layers_arg;
    int64_t N, S, offset;
    int64_t layer_ids[EKV_MODEL_MAX_LAYERS];
    int nlayers;
} trace_opts;

/* Buffers of one run: the tokens, each dumped layer's S query rows [S, H, D], the slopes, one
 * layer's K or V rows [N, Hk, D] and the sequence's page list. */
typedef struct {
    int32_t *tok, *pages;
    float *q, *slopes;
    char *rows;
} trace_bufs;

/* --layers: a comma list without repeats (one tensor name per layer: a repeat would write
 * it twice). */
static void parse_layers(const char *arg, trace_opts *o) {
    o->nlayers = cli_parse_i64_list("trace", "--layers", arg, o->layer_ids, EKV_MODEL_MAX_LAYERS);
    for (int l = 1; l < o->nlayers; l++)
        for (int k = 0; k < l; k++)
            if (o->layer_ids[k] == o->layer_ids[l])
                cli_usage_error("trace", "--layers %s: layer %lld is listed twice", arg,
                                (long long)o->layer_ids[l]);
}

static const cli_opt trace_table[] = {
        CLI_STR("--text", trace_opts, text_path),
        CLI_STR("--out", trace_opts, out),
        CLI_INT("--ctx", trace_opts, N, 2, (int64_t)1 << 30),
        CLI_INT("--offset", trace_opts, offset, 0, INT64_MAX),
        CLI_INT("--queries", trace_opts, S, 1, 4096),
        CLI_STR("--layers", trace_opts, layers_arg),
};

static void trace_parse(int argc, char **argv, trace_opts *o) {
    memset(o, 0, sizeof *o);
    model_opts_init(&o->mo);
    o->N = 8192;
    o->S = 16;
    o->nlayers = -1;
    model_parse("trace", argc, argv, trace_help, &o->mo, trace_table, CLI_NOPTS(trace_table), NULL,
                o);
    if (!o->text_path || !o->out)
        cli_usage_error("trace", "--text FILE and --out FILE are required");
    if (o->S >= o->N) cli_usage_error("trace", "--queries must be below --ctx");
    if (o->layers_arg) parse_layers(o->layers_arg, o);
}

/* Resolves "all layers" and checks the listed ones exist: CLI_USAGE if one does not. */
static int trace_layers(trace_opts *o, const ekv_model_config *c) {
    if (o->nlayers < 0) {
        o->nlayers = c->n_layers;
        for (int l = 0; l < o->nlayers; l++) o->layer_ids[l] = l;
    }
    for (int l = 0; l < o->nlayers; l++)
        if (o->layer_ids[l] >= c->n_layers) {
            fprintf(stderr,
                    "entmaxkv trace: --layers: layer %lld does not exist (the model has %d)\n",
                    (long long)o->layer_ids[l], c->n_layers);
            return CLI_USAGE;
        }
    return 0;
}

static void trace_bufs_free(trace_bufs *b) {
    free(b->tok);
    free(b->q);
    free(b->slopes);
    free(b->rows);
    free(b->pages);
}

static int trace_alloc(const trace_opts *o, const ekv_model_config *c, trace_bufs *b) {
    const int64_t H = c->n_heads, Hk = c->n_kv_heads, D = c->head_dim,
                  es = ekv_dtype_size(o->mo.kv_dtype);
    b->tok = malloc(sizeof(int32_t) * (size_t)o->N);
    b->q = malloc(sizeof(float) * (size_t)(o->nlayers * o->S * H * D));
    b->slopes = malloc(sizeof(float) * (size_t)H);
    b->rows = malloc((size_t)(o->N * Hk * D * es));
    b->pages = malloc(sizeof(int32_t) * (size_t)(o->N / o->mo.page + 2));
    if (b->tok && b->q && b->slopes && b->rows && b->pages) return 0;
    fprintf(stderr, "entmaxkv trace: out of memory\n");
    return 1;
}

/* Prefills the first N - S tokens, then steps through the last S keeping each dumped
 * layer's query of every step (row s of layer l at b->q[(l * S + s) * H * D]). */
static int trace_run(const trace_opts *o, ekv_context *ctx, ekv_model *m, const char *text,
                     trace_bufs *b) {
    const ekv_model_config *c = ekv_model_get_config(m);
    const int64_t N = o->N, S = o->S, HD = (int64_t)c->n_heads * c->head_dim;
    ekv_model_tokenize(text + o->offset, N, b->tok);
    ekv_model_alibi_slopes(m, b->slopes);
    if (model_feed("trace", "prefill", ctx, m, b->tok, N - S, 0, NULL, NULL, NULL)) return 1;
    for (int64_t s = 0; s < S; s++) {
        if (ekv_model_step(m, b->tok + N - S + s, 1, NULL)) {
            fprintf(stderr, "entmaxkv trace: %s\n", ekv_last_error(ctx));
            return 1;
        }
        for (int l = 0; l < o->nlayers; l++)
            ekv_model_last_query(m, (int32_t)o->layer_ids[l], b->q + ((int64_t)l * S + s) * HD);
    }
    return 0;
}

/* The safetensors JSON header, padded with spaces to a multiple of 8 bytes; the data follow
 * in the same order (per layer: k, v, q, alibi_slopes). NULL when out of memory. */
static char *trace_header(const trace_opts *o, const ekv_model_config *c, size_t *len) {
    const int64_t N = o->N, S = o->S, H = c->n_heads, Hk = c->n_kv_heads, D = c->head_dim;
    const int64_t kvb = N * Hk * D * ekv_dtype_size(o->mo.kv_dtype), qb = S * H * D * 4, sb = H * 4;
    const char *dt = st_dtype(o->mo.kv_dtype);
    size_t cap = 4096 + (size_t)o->nlayers * 1024, hl = 0; /* a layer's 4 entries: < 700 bytes */
    char *hdr = malloc(cap);
    if (!hdr) return NULL;
    hl += (size_t)snprintf(
            hdr + hl, cap - hl,
            "{\"__metadata__\":{\"format\":\"entmaxkv-trace\",\"ctx\":\"%lld\",\"queries\":\"%lld\","
            "\"method\":\"%s\",\"offset\":\"%lld\"}",
            (long long)N, (long long)S, ekv_method_name(o->mo.method), (long long)o->offset);
    int64_t off = 0;
    for (int l = 0; l < o->nlayers; l++) {
        const long long L = (long long)o->layer_ids[l], o0 = (long long)off;
        hl += (size_t)snprintf(
                hdr + hl, cap - hl,
                ",\"l%lld.k\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld,%lld],\"data_offsets\":[%lld,%lld]}"
                ",\"l%lld.v\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld,%lld],\"data_offsets\":[%lld,%lld]}"
                ",\"l%lld.q\":{\"dtype\":\"F32\",\"shape\":[%lld,%lld,%lld],\"data_offsets\":[%lld,%lld]}"
                ",\"l%lld.alibi_slopes\":{\"dtype\":\"F32\",\"shape\":[%lld],\"data_offsets\":[%lld,%lld]}",
                L, dt, (long long)N, (long long)Hk, (long long)D, o0, o0 + kvb, L, dt, (long long)N,
                (long long)Hk, (long long)D, o0 + kvb, o0 + 2 * kvb, L, (long long)S, (long long)H,
                (long long)D, o0 + 2 * kvb, o0 + 2 * kvb + qb, L, (long long)H, o0 + 2 * kvb + qb,
                o0 + 2 * kvb + qb + sb);
        off += 2 * kvb + qb + sb;
    }
    hl += (size_t)snprintf(hdr + hl, cap - hl, "}");
    while (hl % 8) hdr[hl++] = ' ';
    *len = hl;
    return hdr;
}

/* Writes the length-prefixed header, then each layer's K and V rows gathered from the paged
 * cache, its queries and the slopes. Nonzero if any write fails. */
static int trace_write_data(const trace_opts *o, ekv_model *m, trace_bufs *b, FILE *f,
                            const char *hdr, size_t hl) {
    const ekv_model_config *c = ekv_model_get_config(m);
    const int64_t N = o->N, qn = o->S * c->n_heads * c->head_dim,
                  kvb = N * c->n_kv_heads * c->head_dim * ekv_dtype_size(o->mo.kv_dtype),
                  qb = qn * 4, sb = (int64_t)c->n_heads * 4;
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    int rc = fwrite(len8, 1, 8, f) != 8 || fwrite(hdr, 1, hl, f) != hl;
    for (int l = 0; l < o->nlayers && !rc; l++) {
        const ekv_cache *cache;
        int32_t seq, lpl;
        ekv_paged_kv kv;
        int64_t ip[2];
        ekv_model_layer_cache(m, (int32_t)o->layer_ids[l], &cache, &seq);
        ekv_cache_kv_view(cache, &kv, NULL);
        ekv_cache_page_table(cache, &seq, 1, ip, b->pages, N / o->mo.page + 2, &lpl, NULL);
        gather_rows(&kv, kv.k, b->pages, N, b->rows);
        rc |= fwrite(b->rows, 1, (size_t)kvb, f) != (size_t)kvb;
        gather_rows(&kv, kv.v, b->pages, N, b->rows);
        rc |= fwrite(b->rows, 1, (size_t)kvb, f) != (size_t)kvb;
        rc |= fwrite(b->q + (int64_t)l * qn, 1, (size_t)qb, f) != (size_t)qb;
        rc |= fwrite(b->slopes, 1, (size_t)sb, f) != (size_t)sb;
    }
    return rc;
}

/* Writes the trace into out (opened before the run: cli_file), renames it over --out and
 * reports it on stdout; a failed write leaves whatever file --out named before. */
static int trace_report(const trace_opts *o, ekv_model *m, trace_bufs *b, cli_file *out) {
    size_t hl = 0;
    char *hdr = trace_header(o, ekv_model_get_config(m), &hl);
    if (!hdr) {
        fprintf(stderr, "entmaxkv trace: out of memory\n");
        cli_file_discard(out);
        return 1;
    }
    int rc = trace_write_data(o, m, b, out->f, hdr, hl);
    free(hdr);
    rc = cli_file_commit(out, "trace") || rc; /* a failed fwrite fails the commit too */
    if (!rc)
        printf("wrote %s: %d layers, %lld tokens, %lld queries per layer (%s K/V)\n", o->out,
               o->nlayers, (long long)o->N, (long long)o->S, ekv_dtype_name(o->mo.kv_dtype));
    return rc;
}

int cmd_trace(int argc, char **argv) {
    trace_opts o;
    trace_parse(argc, argv, &o);
    cli_file out; /* before the run: a bad --out path fails now, not after it */
    if (cli_file_open(&out, "trace", o.out)) return 1;
    model_session s;
    if (model_open_text("trace", &o.mo, o.text_path, o.offset, o.N, &s)) {
        cli_file_discard(&out);
        return 1;
    }
    trace_bufs b;
    memset(&b, 0, sizeof b);
    int rc = trace_layers(&o, ekv_model_get_config(s.m));
    if (!rc) rc = trace_alloc(&o, ekv_model_get_config(s.m), &b);
    if (!rc) rc = trace_run(&o, s.ctx, s.m, s.text, &b);
    if (!rc)
        rc = trace_report(&o, s.m, &b, &out);
    else
        cli_file_discard(&out);
    trace_bufs_free(&b);
    model_close(&s);
    return rc;
}
