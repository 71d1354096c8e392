/* What the model subcommands (run, ppl, trace) share: their common options, loading the
 * model with a message on failure, reading files, and progress lines. */
#include "cli.h"
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#ifndef EKV_SOURCE_DIR
#define EKV_SOURCE_DIR "."
#endif

void model_opts_init(model_opts *o) {
    memset(o, 0, sizeof *o);
    o->model = NULL;
    o->method = EKV_ATTN_DENSE;
    o->budget = 1.0 / 16;
    o->threads = 0;
    o->page = 16;
    o->kv_dtype = EKV_DTYPE_F16;
}

void model_opts_help(FILE *f) {
    fprintf(f,
            "  --model FILE          model weights (default models/entmaxkv-lm.safetensors, looked up\n"
            "                        in the current directory, then in the source tree)\n"
            "  --method M            dense | topk | gaussian | certified (default dense): how each\n"
            "                        attention step reads the KV cache\n"
            "  --budget F            topk: fraction of the tokens each step reads; certified: sizes\n"
            "                        its first round (default 1/16)\n"
            "  --threads T           worker threads (default: all CPUs)\n"
            "  --page P              KV cache page size, 1..256 (default 16)\n"
            "  --kv-dtype f16|f32|bf16  KV cache storage (default f16)\n");
}

int model_opt(const char *sub, int argc, char **argv, int *i, model_opts *o) {
    const char *a = argv[*i];
    if (!strcmp(a, "--model")) o->model = cli_need(sub, argc, argv, i);
    else if (!strcmp(a, "--method")) {
        const char *v = cli_need(sub, argc, argv, i);
        if (ekv_attn_method_from_name(v, &o->method))
            cli_usage_error(sub, "--method %s: expected dense, topk, gaussian or certified", v);
    } else if (!strcmp(a, "--budget")) {
        const char *v = cli_need(sub, argc, argv, i);
        if (cli_parse_fraction(v, &o->budget) || !(o->budget > 0 && o->budget <= 1))
            cli_usage_error(sub, "--budget %s: expected a fraction in (0, 1], e.g. 1/16", v);
    } else if (!strcmp(a, "--threads")) o->threads = cli_need_int(sub, argc, argv, i, 0, 1024);
    else if (!strcmp(a, "--page")) o->page = (int32_t)cli_need_int(sub, argc, argv, i, 1, 256);
    else if (!strcmp(a, "--kv-dtype")) {
        const char *v = cli_need(sub, argc, argv, i);
        if (ekv_dtype_from_name(v, &o->kv_dtype)) cli_usage_error(sub, "--kv-dtype %s: expected f16, f32 or bf16", v);
    } else return 0;
    return 1;
}

static int file_exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

int model_open(const char *sub, const model_opts *o, int64_t max_tokens, ekv_context **ctx, ekv_model **m) {
    static char fallback[4096];
    const char *path = o->model;
    if (!path) { /* the shipped model: from here, else from the source tree */
        path = "models/entmaxkv-lm.safetensors";
        snprintf(fallback, sizeof fallback, "%s/models/entmaxkv-lm.safetensors", EKV_SOURCE_DIR);
        if (!file_exists(path) && file_exists(fallback)) path = fallback;
    }
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = (int32_t)o->threads;
    *m = NULL;
    if (ekv_context_create(&cp, ctx)) { fprintf(stderr, "entmaxkv %s: cannot create a context\n", sub); return 1; }
    ekv_model_params mp = ekv_model_default_params();
    mp.max_tokens = max_tokens > 0 ? max_tokens : 1;
    mp.page_size = o->page;
    mp.kv_dtype = o->kv_dtype;
    mp.method = o->method;
    mp.budget = o->budget;
    ekv_status st = ekv_model_load(*ctx, path, &mp, m);
    if (st) {
        fprintf(stderr, "entmaxkv %s: %s: %s: %s\n", sub, path, ekv_status_string(st), ekv_last_error(*ctx));
        ekv_context_free(*ctx);
        *ctx = NULL;
        return 1;
    }
    return 0;
}

char *cli_read_file(const char *path, int64_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *b = malloc(cap + 1);
    for (;;) {
        if (!b) break;
        size_t got = fread(b + n, 1, cap - n, f);
        n += got;
        if (n < cap) break;
        char *nb = realloc(b, 2 * cap + 1);
        if (!nb) { free(b); b = NULL; break; }
        b = nb;
        cap *= 2;
    }
    int err = ferror(f);
    fclose(f);
    if (!b || err) { free(b); return NULL; }
    b[n] = 0;
    *len = (int64_t)n;
    return b;
}

/* Runs tokens[0..n) through the model in chunks of 256, with progress on stderr when it takes
 * more than 2 s. For every chunk that reaches position logits_from, fn receives the chunk's
 * logits [c][vocab] (positions start .. start+c-1), so no caller holds n x vocab floats. */
int model_feed(const char *sub, const char *what, ekv_context *ctx, ekv_model *m, const int32_t *tokens, int64_t n,
               int64_t logits_from, model_logits_fn fn, void *arg) {
    enum { CHUNK = 256 };
    const int64_t V = ekv_model_get_config(m)->vocab;
    float *logits = fn ? malloc(sizeof(float) * (size_t)(CHUNK * V)) : NULL;
    if (fn && !logits) { fprintf(stderr, "entmaxkv %s: out of memory\n", sub); return 1; }
    double t0 = cli_now_seconds(), last = t0;
    int rc = 0;
    for (int64_t i = 0; i < n && !rc; i += CHUNK) {
        const int64_t c = n - i < CHUNK ? n - i : CHUNK;
        const int want = fn && i + c > logits_from;
        ekv_status st = ekv_model_step(m, tokens + i, c, want ? logits : NULL);
        if (st) {
            fprintf(stderr, "entmaxkv %s: %s: %s\n", sub, ekv_status_string(st), ekv_last_error(ctx));
            rc = 1;
            break;
        }
        if (want) fn(arg, i, c, logits);
        double now = cli_now_seconds();
        if (now - last > 2.0) {
            fprintf(stderr, "  %s: %lld / %lld tokens (%.0f%%), %.0f tokens/s\n", what, (long long)(i + c), (long long)n,
                    100.0 * (double)(i + c) / (double)n, (double)(i + c) / (now - t0));
            last = now;
        }
    }
    free(logits);
    return rc;
}
