/*
 * entmaxkv ppl: perplexity of the model on a text with a given decode method (docs/cli.md).
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
            "  --json FILE           write {ppl, bits_per_byte, tokens, method, budget, kv_fraction, ...};\n"
            "                        FILE '-' = stdout, the report then goes to stderr\n"
            "  --help                this text\n"
            "\n"
            "kv_fraction = bytes attention read (K, V rows and page statistics) / K+V bytes of the\n"
            "attended tokens, over every token and layer.\n");
}

/* model_feed callback: log-loss of the next token at the scored positions [first, end) of a chunk
 * (the logits after token i predict token i + 1). */
typedef struct {
    const int32_t *tok;
    int64_t V, first, end;
    double nll;
    int64_t scored;
} nll_acc;
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

typedef struct {
    model_opts mo;
    const char *text_path, *json;
    int64_t ctxlen, windows, offset, score_last;
} ppl_opts;

static const cli_opt ppl_table[] = {
        CLI_STR("--text", ppl_opts, text_path),
        CLI_STR("--json", ppl_opts, json),
        CLI_INT("--ctx", ppl_opts, ctxlen, 2, (int64_t)1 << 30),
        CLI_INT("--windows", ppl_opts, windows, 1, INT64_MAX),
        CLI_INT("--offset", ppl_opts, offset, 0, INT64_MAX),
        CLI_INT("--score-last", ppl_opts, score_last, 1, (int64_t)1 << 30),
};

static void parse(int argc, char **argv, ppl_opts *o) {
    model_opts_init(&o->mo);
    o->text_path = o->json = NULL;
    o->ctxlen = 2048;
    o->windows = INT64_MAX;
    o->offset = 0;
    o->score_last = 0;
    model_parse("ppl", argc, argv, ppl_help, &o->mo, ppl_table, CLI_NOPTS(ppl_table), NULL, o);
    if (!o->text_path) cli_usage_error("ppl", "--text FILE is required");
    if (o->score_last >= o->ctxlen) cli_usage_error("ppl", "--score-last must be below --ctx");
}

/* What the windows measured: the summed log-loss and the per-layer bytes. */
typedef struct {
    double nll, secs;
    int64_t scored, fed, nwin, done, layers, heads; /* done: windows finished */
    int interrupted;                                /* Ctrl-C: a partial result */
    ekv_model_stats *lay;
} ppl_result;

/* Adds the model's per-layer statistics of the last window to the run's. */
static void add_layer_stats(ekv_model *m, ppl_result *r) {
    for (int64_t l = 0; l < r->layers; l++) {
        ekv_model_stats s;
        ekv_model_get_stats(m, (int32_t)l, &s);
        r->lay[l].bytes_read += s.bytes_read;
        r->lay[l].bytes_kv += s.bytes_kv;
        r->lay[l].lists += s.lists;
        r->lay[l].lists_round2 += s.lists_round2;
        r->lay[l].steps += s.steps;
        r->lay[l].survivors += s.survivors;
    }
}

/* Every few seconds between windows: the perplexity so far and the run's ETA. */
static void window_progress(const ppl_result *r, double t0, double *last) {
    const double now = cli_now_seconds();
    if (now - *last < 5.0 || r->done >= r->nwin || !r->scored) return;
    const double per = (now - t0) / (double)r->done;
    fprintf(stderr, "  ppl: %lld / %lld windows, ppl %.4f so far, ETA %.0f s\n", (long long)r->done,
            (long long)r->nwin, exp(r->nll / (double)r->scored), per * (double)(r->nwin - r->done));
    *last = now;
}

static int ppl_windows(const ppl_opts *o, const char *text, ekv_context *ctx, ekv_model *m,
                       ppl_result *r) {
    const int64_t V = ekv_model_get_config(m)->vocab, ctxlen = o->ctxlen;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)ctxlen);
    int rc = 0;
    if (!tok) {
        fprintf(stderr, "entmaxkv ppl: out of memory\n");
        rc = 1;
    }
    const double t0 = cli_now_seconds();
    double last = t0;
    for (int64_t w = 0; w < r->nwin && !rc; w++) {
        ekv_model_tokenize(text + o->offset + w * ctxlen, ctxlen, tok);
        ekv_model_reset(m);
        char what[64];
        snprintf(what, sizeof what, "window %lld/%lld", (long long)(w + 1), (long long)r->nwin);
        nll_acc acc = {tok, V, o->score_last ? ctxlen - 1 - o->score_last : 0, ctxlen - 1, 0, 0};
        int64_t ran = 0;
        const int fed =
                model_feed("ppl", what, ctx, m, tok, ctxlen, acc.first, add_nll, &acc, &ran);
        if (fed == 1) {
            rc = 1;
            break;
        }
        /* a window cut short by Ctrl-C still scored its predictions so far: they count */
        r->nll += acc.nll;
        r->scored += acc.scored;
        add_layer_stats(m, r);
        r->fed += ran;
        r->done += fed == 0; /* a whole window */
        if (fed == 2 || cli_interrupted()) {
            r->interrupted = 1;
            break;
        }
        window_progress(r, t0, &last);
    }
    r->secs = cli_now_seconds() - t0;
    free(tok);
    return rc;
}

static double layer_kvf(const ekv_model_stats *s) {
    return s->bytes_kv ? (double)s->bytes_read / (double)s->bytes_kv : 0.0;
}

static int ppl_report(const ppl_opts *o, const ppl_result *r) {
    const model_opts *mo = &o->mo;
    double rd = 0, kv = 0, r2 = 0, nl = 0, steps = 0, surv = 0;
    for (int64_t l = 0; l < r->layers; l++) {
        steps += (double)r->lay[l].steps;
        surv += (double)r->lay[l].survivors;
        rd += (double)r->lay[l].bytes_read;
        kv += (double)r->lay[l].bytes_kv;
        r2 += (double)r->lay[l].lists_round2;
        nl += (double)r->lay[l].lists;
    }
    if (r->interrupted)
        fprintf(stderr,
                "entmaxkv ppl: interrupted: the result below covers the %lld predictions "
                "scored in %lld of %lld windows\n",
                (long long)r->scored, (long long)r->done, (long long)r->nwin);
    if (!r->scored) {
        fprintf(stderr, "entmaxkv ppl: no prediction was scored\n");
        return 1;
    }
    const double mean = r->nll / (double)r->scored, ppl = exp(mean), bpb = mean / log(2.0),
                 kvf = kv > 0 ? rd / kv : 0;
    cli_out out;
    if (cli_out_open(&out, "ppl", o->json)) return 1;
    char lab[64], r2s[32] = "null", svs[32] = "null";
    const int codes = cli_method_codes(mo->method);
    /* survivors per attention step and query head */
    const double sv = steps > 0 ? surv / (steps * (double)r->heads) : 0;
    model_method_label(lab, sizeof lab, mo->method, mo->budget);
    /* the CUDA stages do not count what they read (ekv_model_backend) */
    const int measured = mo->backend != EKV_BACKEND_CUDA;
    char kvs[32] = "n/a";
    if (measured) snprintf(kvs, sizeof kvs, "%.4f", kvf);
    fprintf(out.text,
            "ppl %.6f  bits/byte %.6f  tokens %lld  windows %lld x %lld  method %s  kv_fraction %s  %.1f tokens/s\n",
            ppl, bpb, (long long)r->scored, (long long)r->nwin, (long long)o->ctxlen, lab, kvs,
            (double)r->fed / r->secs);
    if (measured) {
        fprintf(out.text, "kv_fraction per layer:");
        for (int64_t l = 0; l < r->layers; l++) fprintf(out.text, " %.4f", layer_kvf(&r->lay[l]));
        fprintf(out.text, "\n");
    } else
        fprintf(out.text, "kv_fraction: not measured on the cuda backend\n");
    if (nl > 0) fprintf(out.text, "certified: round 2 in %.2f%% of page lists\n", 100.0 * r2 / nl);
    if (codes)
        fprintf(out.text, "screened: %d-bit key codes, %.1f tokens per head survive the screen\n",
                mo->code_bits, sv);
    if (!out.json) return 0;
    if (nl > 0) snprintf(r2s, sizeof r2s, "%.9g", r2 / nl);
    if (measured)
        snprintf(kvs, sizeof kvs, "%.9g", kvf);
    else
        snprintf(kvs, sizeof kvs, "null");
    if (codes) snprintf(svs, sizeof svs, "%.9g", sv);
    fprintf(out.json,
            "{\"ppl\":%.9g,\"bits_per_byte\":%.9g,\"nll_sum\":%.9g,\"tokens\":%lld,\"method\":\"%s\",\"budget\":%.9g,"
            "\"kv_fraction\":%s,\"backend\":\"%s\",\"ctx\":%lld,\"windows\":%lld,\"offset\":%lld,\"score_last\":%lld,"
            "\"kv_dtype\":\"%s\",\"page\":%d,\"seconds\":%.3f,\"tokens_per_s\":%.3f,\"round2_fraction\":%s,"
            "\"code_bits\":%d,\"survivors_mean\":%s,\"interrupted\":%s,\"windows_done\":%lld,\"kv_fraction_layers\":[",
            ppl, bpb, r->nll, (long long)r->scored, ekv_method_name(mo->method),
            model_uses_budget(mo->method) ? mo->budget : 1.0, kvs, ekv_backend_name(mo->backend),
            (long long)o->ctxlen, (long long)r->nwin, (long long)o->offset,
            (long long)o->score_last, ekv_dtype_name(mo->kv_dtype), mo->page, r->secs,
            (double)r->fed / r->secs, r2s, codes ? mo->code_bits : 0, svs,
            r->interrupted ? "true" : "false", (long long)r->done);
    for (int64_t l = 0; l < r->layers && measured; l++)
        fprintf(out.json, "%s%.9g", l ? "," : "", layer_kvf(&r->lay[l]));
    fprintf(out.json, "]}\n");
    return cli_out_close(&out, "ppl");
}

int cmd_ppl(int argc, char **argv) {
    ppl_opts o;
    parse(argc, argv, &o);
    model_session s;
    if (model_open_text("ppl", &o.mo, o.text_path, o.offset, o.ctxlen, &s)) return 1;
    ppl_result r;
    memset(&r, 0, sizeof r);
    r.layers = ekv_model_get_config(s.m)->n_layers;
    r.heads = ekv_model_get_config(s.m)->n_heads;
    r.nwin = (s.len - o.offset) / o.ctxlen;
    if (r.nwin > o.windows) r.nwin = o.windows;
    r.lay = calloc((size_t)r.layers, sizeof *r.lay);
    cli_catch_interrupt(); /* Ctrl-C: report what was scored (a second one quits) */
    int rc = r.lay ? ppl_windows(&o, s.text, s.ctx, s.m, &r) : 1;
    if (!r.lay) fprintf(stderr, "entmaxkv ppl: out of memory\n");
    if (!rc) rc = ppl_report(&o, &r);
    if (!rc && r.interrupted) rc = CLI_EXIT_INTERRUPTED;
    free(r.lay);
    model_close(&s);
    return rc;
}
