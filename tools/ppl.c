/*
 * entmaxkv ppl: perplexity of the model on a text with a given decode method (DESIGN 4).
 * The text is cut into consecutive windows of --ctx tokens; each window starts from an empty
 * cache, every token attends with the method, and the log-loss of predicting each next token
 * is summed (only over the last --score-last positions of a window when asked: long-context
 * perplexity after a long prefill). Bits per byte = mean log-loss / ln 2 (tokens are bytes).
 */
#include "cli.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static void ppl_help(FILE *f) {
    fprintf(f,
            "usage: entmaxkv ppl --text FILE [--model FILE] [--ctx N] [--method M] [--budget F] [--json FILE]\n"
            "\n"
            "Perplexity of the model on a text, every attention step using the given method.\n"
            "\n"
            "  --text FILE           the text (bytes are tokens)\n"
            "  --ctx N               tokens per window; each window starts from an empty cache\n"
            "                        (default 2048)\n"
            "  --windows W           at most W windows (default: as many as the text holds)\n"
            "  --offset B            start at byte B of the text (default 0)\n"
            "  --score-last K        score only the last K predictions of each window (default: all)\n");
    model_opts_help(f);
    fprintf(f,
            "  --json FILE           write {ppl, bits_per_byte, tokens, method, budget, kv_fraction, ...}\n"
            "  --help                this text\n"
            "\n"
            "kv_fraction = bytes attention read (K, V rows and page statistics) / K+V bytes of the\n"
            "attended tokens, over every token and layer.\n");
}

/* model_feed callback: log-loss of the next token at the scored positions [first, end) of a chunk
 * (the logits after token i predict token i + 1). */
typedef struct { const int32_t *tok; int64_t V, first, end; double nll; int64_t scored; } nll_acc;
static void add_nll(void *arg, int64_t start, int64_t c, const float *logits) {
    nll_acc *a = arg;
    for (int64_t i = start > a->first ? start : a->first; i < start + c && i < a->end; i++) {
        const float *z = logits + (i - start) * a->V;
        double mx = z[0], s = 0;
        for (int64_t v = 1; v < a->V; v++) mx = z[v] > mx ? z[v] : mx;
        for (int64_t v = 0; v < a->V; v++) s += exp((double)z[v] - mx);
        a->nll += mx + log(s) - (double)z[a->tok[i + 1]];
        a->scored++;
    }
}

int cmd_ppl(int argc, char **argv) {
    model_opts mo;
    model_opts_init(&mo);
    const char *text_path = NULL, *json = NULL;
    int64_t ctxlen = 2048, windows = INT64_MAX, offset = 0, score_last = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { ppl_help(stdout); return 0; }
        else if (model_opt("ppl", argc, argv, &i, &mo)) continue;
        else if (!strcmp(a, "--text")) text_path = cli_need("ppl", argc, argv, &i);
        else if (!strcmp(a, "--json")) json = cli_need("ppl", argc, argv, &i);
        else if (!strcmp(a, "--ctx")) ctxlen = cli_need_int("ppl", argc, argv, &i, 2, (int64_t)1 << 30);
        else if (!strcmp(a, "--windows")) windows = cli_need_int("ppl", argc, argv, &i, 1, INT64_MAX);
        else if (!strcmp(a, "--offset")) offset = cli_need_int("ppl", argc, argv, &i, 0, INT64_MAX);
        else if (!strcmp(a, "--score-last")) score_last = cli_need_int("ppl", argc, argv, &i, 1, (int64_t)1 << 30);
        else cli_usage_error("ppl", "unknown option '%s'", a);
    }
    if (!text_path) cli_usage_error("ppl", "--text FILE is required");
    if (score_last >= ctxlen) cli_usage_error("ppl", "--score-last must be below --ctx");
    int64_t len;
    char *text = cli_read_file(text_path, &len);
    if (!text) { fprintf(stderr, "entmaxkv ppl: cannot read '%s'\n", text_path); return 1; }
    if (offset >= len || len - offset < ctxlen) {
        fprintf(stderr, "entmaxkv ppl: '%s' has %lld bytes after offset %lld, fewer than --ctx %lld\n", text_path,
                (long long)(len - offset < 0 ? 0 : len - offset), (long long)offset, (long long)ctxlen);
        free(text);
        return 1;
    }
    ekv_context *ctx;
    ekv_model *m;
    if (model_open("ppl", &mo, ctxlen, &ctx, &m)) { free(text); return 1; }
    const ekv_model_config *cfg = ekv_model_get_config(m);
    const int64_t V = cfg->vocab, L = cfg->n_layers;
    int64_t nwin = (len - offset) / ctxlen;
    if (nwin > windows) nwin = windows;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)ctxlen);
    ekv_model_stats *lay = calloc((size_t)L, sizeof *lay);
    double nll = 0, t0 = cli_now_seconds();
    int64_t scored = 0, fed = 0;
    int rc = 0;
    if (!tok || !lay) { fprintf(stderr, "entmaxkv ppl: out of memory\n"); rc = 1; }
    for (int64_t w = 0; w < nwin && !rc; w++) {
        ekv_model_tokenize(text + offset + w * ctxlen, ctxlen, tok);
        ekv_model_reset(m);
        char what[64];
        snprintf(what, sizeof what, "window %lld/%lld", (long long)(w + 1), (long long)nwin);
        nll_acc acc = {tok, V, score_last ? ctxlen - 1 - score_last : 0, ctxlen - 1, 0, 0};
        if (model_feed("ppl", what, ctx, m, tok, ctxlen, acc.first, add_nll, &acc)) { rc = 1; break; }
        nll += acc.nll;
        scored += acc.scored;
        fed += ctxlen;
        for (int64_t l = 0; l < L; l++) {
            ekv_model_stats s;
            ekv_model_get_stats(m, (int32_t)l, &s);
            lay[l].bytes_read += s.bytes_read;
            lay[l].bytes_kv += s.bytes_kv;
            lay[l].lists += s.lists;
            lay[l].lists_round2 += s.lists_round2;
        }
    }
    const double secs = cli_now_seconds() - t0;
    if (!rc) {
        double rd = 0, kv = 0, r2 = 0, nl = 0;
        for (int64_t l = 0; l < L; l++) {
            rd += (double)lay[l].bytes_read;
            kv += (double)lay[l].bytes_kv;
            r2 += (double)lay[l].lists_round2;
            nl += (double)lay[l].lists;
        }
        const double mean = nll / (double)scored, ppl = exp(mean), bpb = mean / log(2.0), kvf = kv > 0 ? rd / kv : 0;
        char lab[64];
        if (mo.method == EKV_ATTN_TOPK || mo.method == EKV_ATTN_CERTIFIED)
            snprintf(lab, sizeof lab, "%s %g", ekv_attn_method_name(mo.method), mo.budget);
        else snprintf(lab, sizeof lab, "%s", ekv_attn_method_name(mo.method));
        printf("ppl %.6f  bits/byte %.6f  tokens %lld  windows %lld x %lld  method %s  kv_fraction %.4f  %.1f tokens/s\n",
               ppl, bpb, (long long)scored, (long long)nwin, (long long)ctxlen, lab, kvf, (double)fed / secs);
        printf("kv_fraction per layer:");
        for (int64_t l = 0; l < L; l++)
            printf(" %.4f", lay[l].bytes_kv ? (double)lay[l].bytes_read / (double)lay[l].bytes_kv : 0.0);
        printf("\n");
        if (nl > 0) printf("certified: round 2 in %.2f%% of page lists\n", 100.0 * r2 / nl);
        if (json) {
            FILE *jf = fopen(json, "w");
            char r2s[32];
            if (nl > 0) snprintf(r2s, sizeof r2s, "%.9g", r2 / nl);
            else snprintf(r2s, sizeof r2s, "null");
            if (!jf) { fprintf(stderr, "entmaxkv ppl: cannot write %s\n", json); rc = 1; }
            else {
                fprintf(jf,
                        "{\"ppl\":%.9g,\"bits_per_byte\":%.9g,\"nll_sum\":%.9g,\"tokens\":%lld,\"method\":\"%s\",\"budget\":%.9g,"
                        "\"kv_fraction\":%.9g,\"ctx\":%lld,\"windows\":%lld,\"offset\":%lld,\"score_last\":%lld,"
                        "\"kv_dtype\":\"%s\",\"page\":%d,\"seconds\":%.3f,\"tokens_per_s\":%.3f,\"round2_fraction\":%s,"
                        "\"kv_fraction_layers\":[",
                        ppl, bpb, nll, (long long)scored, ekv_attn_method_name(mo.method),
                        mo.method == EKV_ATTN_TOPK || mo.method == EKV_ATTN_CERTIFIED ? mo.budget : 1.0, kvf,
                        (long long)ctxlen, (long long)nwin, (long long)offset, (long long)score_last,
                        ekv_dtype_name(mo.kv_dtype), mo.page, secs, (double)fed / secs, r2s);
                for (int64_t l = 0; l < L; l++)
                    fprintf(jf, "%s%.9g", l ? "," : "",
                            lay[l].bytes_kv ? (double)lay[l].bytes_read / (double)lay[l].bytes_kv : 0.0);
                fprintf(jf, "]}\n");
                fclose(jf);
            }
        }
    }
    free(tok); free(lay); free(text);
    ekv_model_free(m);
    ekv_context_free(ctx);
    return rc;
}
