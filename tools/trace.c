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
            "  --out FILE            the safetensors file to write\n"
            "  --ctx N               tokens to run (default 8192)\n"
            "  --offset B            start at byte B of the text (default 0)\n"
            "  --queries S           query rows per layer: the queries of the last S positions\n"
            "                        (default 16; 1 = only the exact last step, see below)\n"
            "  --layers LIST         comma list of layers to dump (default all)\n");
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

int cmd_trace(int argc, char **argv) {
    model_opts mo;
    model_opts_init(&mo);
    const char *text_path = NULL, *out = NULL, *layers_arg = NULL;
    int64_t N = 8192, S = 16, offset = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            trace_help(stdout);
            return 0;
        } else if (model_opt("trace", argc, argv, &i, &mo))
            continue;
        else if (!strcmp(a, "--text"))
            text_path = cli_need("trace", argc, argv, &i);
        else if (!strcmp(a, "--out"))
            out = cli_need("trace", argc, argv, &i);
        else if (!strcmp(a, "--ctx"))
            N = cli_need_int("trace", argc, argv, &i, 2, (int64_t)1 << 30);
        else if (!strcmp(a, "--offset"))
            offset = cli_need_int("trace", argc, argv, &i, 0, INT64_MAX);
        else if (!strcmp(a, "--queries"))
            S = cli_need_int("trace", argc, argv, &i, 1, 4096);
        else if (!strcmp(a, "--layers"))
            layers_arg = cli_need("trace", argc, argv, &i);
        else
            cli_usage_error("trace", "unknown option '%s'", a);
    }
    if (!text_path || !out) cli_usage_error("trace", "--text FILE and --out FILE are required");
    if (S >= N) cli_usage_error("trace", "--queries must be below --ctx");
    int64_t layer_ids[256];
    int nlayers = -1;
    if (layers_arg && (nlayers = cli_parse_i64_list(layers_arg, layer_ids, 256)) <= 0)
        cli_usage_error("trace", "--layers %s: expected a comma list of layer numbers", layers_arg);
    for (int l = 1; l < nlayers; l++) /* one tensor name per layer: a repeat would write it twice */
        for (int k = 0; k < l; k++)
            if (layer_ids[k] == layer_ids[l])
                cli_usage_error("trace", "--layers %s: layer %lld is listed twice", layers_arg,
                                (long long)layer_ids[l]);
    int64_t len;
    char *text = cli_read_file(text_path, &len);
    if (!text) {
        fprintf(stderr, "entmaxkv trace: cannot read '%s'\n", text_path);
        return 1;
    }
    if (offset >= len || len - offset < N) {
        fprintf(stderr, "entmaxkv trace: '%s' has fewer than %lld bytes after offset %lld\n",
                text_path, (long long)N, (long long)offset);
        free(text);
        return 1;
    }
    ekv_context *ctx;
    ekv_model *m;
    if (model_open("trace", &mo, N, &ctx, &m)) {
        free(text);
        return 1;
    }
    const ekv_model_config *c = ekv_model_get_config(m);
    if (nlayers < 0) {
        nlayers = c->n_layers < 256 ? c->n_layers : 256;
        for (int l = 0; l < nlayers; l++) layer_ids[l] = l;
    }
    for (int l = 0; l < nlayers; l++)
        if (layer_ids[l] >= c->n_layers) {
            fprintf(stderr,
                    "entmaxkv trace: --layers: layer %lld does not exist (the model has %d)\n",
                    (long long)layer_ids[l], c->n_layers);
            ekv_model_free(m);
            ekv_context_free(ctx);
            free(text);
            return CLI_USAGE;
        }
    const int64_t H = c->n_heads, Hk = c->n_kv_heads, D = c->head_dim,
                  es = ekv_dtype_size(mo.kv_dtype);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)N);
    float *q = malloc(sizeof(float) * (size_t)(nlayers * S * H * D)),
          *slopes = malloc(sizeof(float) * (size_t)H);
    char *rows = malloc((size_t)(N * Hk * D * es));
    int32_t *pages = malloc(sizeof(int32_t) * (size_t)(N / mo.page + 2));
    int rc = 0;
    FILE *f = NULL;
    ekv_model_tokenize(text + offset, N, tok);
    ekv_model_alibi_slopes(m, slopes);
    if (model_feed("trace", "prefill", ctx, m, tok, N - S, 0, NULL, NULL)) rc = 1;
    for (int64_t s = 0; s < S && !rc; s++) {
        ekv_status st = ekv_model_step(m, tok + N - S + s, 1, NULL);
        if (st) {
            fprintf(stderr, "entmaxkv trace: %s\n", ekv_last_error(ctx));
            rc = 1;
            break;
        }
        for (int l = 0; l < nlayers; l++)
            ekv_model_last_query(m, (int32_t)layer_ids[l], q + ((int64_t)l * S + s) * H * D);
    }
    if (!rc) { /* header, then the data in the same order */
        const int64_t kvb = N * Hk * D * es, qb = S * H * D * 4, sb = H * 4;
        size_t cap = 4096 + (size_t)nlayers * 512, hl = 0;
        char *hdr = malloc(cap);
        hl += (size_t)snprintf(
                hdr + hl, cap - hl,
                "{\"__metadata__\":{\"format\":\"entmaxkv-trace\",\"ctx\":\"%lld\",\"queries\":\"%lld\","
                "\"method\":\"%s\",\"offset\":\"%lld\"}",
                (long long)N, (long long)S, ekv_method_name(mo.method), (long long)offset);
        int64_t o = 0;
        for (int l = 0; l < nlayers; l++) {
            const long long L = (long long)layer_ids[l];
            hl += (size_t)snprintf(
                    hdr + hl, cap - hl,
                    ",\"l%lld.k\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld,%lld],\"data_offsets\":[%lld,%lld]}"
                    ",\"l%lld.v\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld,%lld],\"data_offsets\":[%lld,%lld]}"
                    ",\"l%lld.q\":{\"dtype\":\"F32\",\"shape\":[%lld,%lld,%lld],\"data_offsets\":[%lld,%lld]}"
                    ",\"l%lld.alibi_slopes\":{\"dtype\":\"F32\",\"shape\":[%lld],\"data_offsets\":[%lld,%lld]}",
                    L, st_dtype(mo.kv_dtype), (long long)N, (long long)Hk, (long long)D,
                    (long long)o, (long long)(o + kvb), L, st_dtype(mo.kv_dtype), (long long)N,
                    (long long)Hk, (long long)D, (long long)(o + kvb), (long long)(o + 2 * kvb), L,
                    (long long)S, (long long)H, (long long)D, (long long)(o + 2 * kvb),
                    (long long)(o + 2 * kvb + qb), L, (long long)H, (long long)(o + 2 * kvb + qb),
                    (long long)(o + 2 * kvb + qb + sb));
            o += 2 * kvb + qb + sb;
        }
        hl += (size_t)snprintf(hdr + hl, cap - hl, "}");
        while (hl % 8) hdr[hl++] = ' ';
        f = fopen(out, "wb");
        if (!f) {
            fprintf(stderr, "entmaxkv trace: cannot write %s\n", out);
            rc = 1;
        }
        unsigned char len8[8];
        for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hl >> (8 * i));
        if (f && (fwrite(len8, 1, 8, f) != 8 || fwrite(hdr, 1, hl, f) != hl)) rc = 1;
        free(hdr);
        for (int l = 0; l < nlayers && f && !rc; l++) {
            const ekv_cache *cache;
            int32_t seq;
            ekv_paged_kv kv;
            int64_t ip[2];
            int32_t lpl;
            ekv_model_layer_cache(m, (int32_t)layer_ids[l], &cache, &seq);
            ekv_cache_kv_view(cache, &kv, NULL);
            ekv_cache_page_table(cache, &seq, 1, ip, pages, N / mo.page + 2, &lpl, NULL);
            gather_rows(&kv, kv.k, pages, N, rows);
            rc |= fwrite(rows, 1, (size_t)kvb, f) != (size_t)kvb;
            gather_rows(&kv, kv.v, pages, N, rows);
            rc |= fwrite(rows, 1, (size_t)kvb, f) != (size_t)kvb;
            rc |= fwrite(q + (int64_t)l * S * H * D, 1, (size_t)qb, f) != (size_t)qb;
            rc |= fwrite(slopes, 1, (size_t)sb, f) != (size_t)sb;
        }
        if (f && fclose(f)) rc = 1;
        if (rc)
            fprintf(stderr, "entmaxkv trace: writing %s failed\n", out);
        else
            printf("wrote %s: %d layers, %lld tokens, %lld queries per layer (%s K/V)\n", out,
                   nlayers, (long long)N, (long long)S, ekv_dtype_name(mo.kv_dtype));
    }
    free(tok);
    free(q);
    free(slopes);
    free(rows);
    free(pages);
    free(text);
    ekv_model_free(m);
    ekv_context_free(ctx);
    return rc;
}
