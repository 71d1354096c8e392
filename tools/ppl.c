/*
 * entmaxkv ppl: perplexity of the model on a text with a given decode method (docs/cli.md).
 * The text is cut into consecutive windows of --ctx tokens; each window starts from an empty
 * cache, every token attends with the method, and the log-loss of predicting each next token
 * is summed (only over the last --score-last positions of a window when asked: long-context
 * perplexity after a long prefill). Bits per byte = mean log-loss / ln 2 (tokens are bytes).
 * With --score-last a window splits at its first scored prediction: --prefill-method runs the
 * unscored prefix, and --compare scores the same tail with several methods after that one
 * prefix (the caches truncated back to it between them), as run --compare --rewind does for
 * generation: a non-dense prefill of 1M tokens would cost O(N^2) reads on the GPU.
 */
#include "cli.h"
#include <math.h>
#include <stddef.h>
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
            "  --prefill-method M    with --score-last: the unscored prefix of each window (its\n"
            "                        first ctx-1-K tokens) runs with M, then --method runs and\n"
            "                        scores the rest (e.g. a dense tensor-core prefill on cuda)\n"
            "  --compare LIST        with --score-last: after --method, score the same tail with\n"
            "                        each method of the comma list in turn, after one prefix per\n"
            "                        window (the caches truncated back to it); method:F gives\n"
            "                        topk or certified its own budget, e.g. topk:1/64; one ppl\n"
            "                        line each, and a \"compare\" array in the JSON (tokens/s:\n"
            "                        the tail's)\n"
            "  --json FILE           write {ppl, bits_per_byte, tokens, method, budget, kv_fraction, ...};\n"
            "                        FILE '-' = stdout, the report then goes to stderr (the path\n"
            "                        is checked before the run; the file is replaced only once\n"
            "                        it is written whole)\n"
            "  --help                this text\n"
            "\n"
            "kv_fraction = bytes attention read (K, V rows and page statistics) / K+V bytes of the\n"
            "attended tokens, over every token and layer. A perplexity beyond a double (logits\n"
            "far out of range) prints as inf, is null in the JSON and exits 1.\n"
            "\n"
            "Long-context perplexity on the GPU: one dense prefill of 1M tokens per window, then\n"
            "the last 512 predictions scored with each method:\n"
            "  entmaxkv ppl --backend cuda --text data/train.txt --ctx 1048576 --windows 1 \\\n"
            "      --score-last 512 --prefill-method dense --method dense \\\n"
            "      --compare certified,screened,topk:1/16\n");
}

/* model_feed callback: log-loss of the next token at the scored positions [first, end) of the
 * window (the logits after token i predict token i + 1); base: the window position of the
 * first token fed (a tail starts at the prefix's end). */
typedef struct {
    const int32_t *tok;
    int64_t V, first, end, base;
    double nll;
    int64_t scored;
} nll_acc;
static void add_nll(void *arg, int64_t start, int64_t c, const float *logits) {
    nll_acc *a = arg;
    const int64_t s = a->base + start; /* the chunk's first window position */
    for (int64_t i = s > a->first ? s : a->first; i < s + c && i < a->end; i++) {
        const float *z = logits + (i - s) * a->V;
        double mx = z[0], sum = 0;
        for (int64_t v = 1; v < a->V; v++) mx = z[v] > mx ? z[v] : mx;
        for (int64_t v = 0; v < a->V; v++) sum += exp((double)z[v] - mx);
        a->nll += mx + log(sum) - (double)z[a->tok[i + 1]];
        a->scored++;
    }
}

typedef struct {
    model_opts mo; /* after parsing, mo.method is the prefix's (model_phases_finish) */
    model_phases ph;
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

/* --compare and --prefill-method, parsed as run parses them (model_phases_opt). */
static int ppl_extra(const char *sub, int argc, char **argv, int *i, void *vo) {
    return model_phases_opt(sub, argc, argv, i, &((ppl_opts *)vo)->ph);
}

static void parse(int argc, char **argv, ppl_opts *o) {
    model_opts_init(&o->mo);
    model_phases_init(&o->ph);
    o->text_path = o->json = NULL;
    o->ctxlen = 2048;
    o->windows = INT64_MAX;
    o->offset = 0;
    o->score_last = 0;
    model_parse("ppl", argc, argv, ppl_help, &o->mo, ppl_table, CLI_NOPTS(ppl_table), ppl_extra, o);
    if (!o->text_path) cli_usage_error("ppl", "--text FILE is required");
    if (o->score_last >= o->ctxlen) cli_usage_error("ppl", "--score-last must be below --ctx");
    /* the prefix the phases share is the unscored part of a window: without --score-last
     * every prediction is scored and there is none */
    if (o->ph.n > 1 && !o->score_last) cli_usage_error("ppl", "--compare needs --score-last");
    if (o->ph.prefill_set && !o->score_last)
        cli_usage_error("ppl", "--prefill-method needs --score-last");
    model_phases_finish(&o->ph, &o->mo);
}

/* What one phase measured: the summed log-loss of its predictions, the tail tokens it fed
 * and their seconds, and its per-layer statistics. Phase 0's statistics also hold the
 * windows' prefixes (fed once, before it), so without --compare they are the whole run's. */
typedef struct {
    double nll, secs;
    int64_t scored, fed;
    ekv_model_stats *lay;
} ppl_phase;

typedef struct {
    ppl_phase ph[MODEL_MAX_PHASES];
    double secs;                       /* the whole run */
    int64_t pre_fed;                   /* the prefixes' tokens (split windows) */
    int64_t nwin, done, layers, heads; /* done: windows finished (every phase) */
    int interrupted;                   /* Ctrl-C: a partial result */
} ppl_result;

/* Adds the model's per-layer statistics since the last reset to phase p's, then zeroes them
 * so that the next feed counts for its own phase. */
static void take_layer_stats(ekv_model *m, int64_t layers, ppl_phase *p) {
    for (int64_t l = 0; l < layers; l++) {
        ekv_model_stats s;
        ekv_model_get_stats(m, (int32_t)l, &s);
        p->lay[l].bytes_read += s.bytes_read;
        p->lay[l].bytes_kv += s.bytes_kv;
        p->lay[l].lists += s.lists;
        p->lay[l].lists_round2 += s.lists_round2;
        p->lay[l].steps += s.steps;
        p->lay[l].survivors += s.survivors;
        p->lay[l].tau_compacted_rows += s.tau_compacted_rows;
        p->lay[l].tau_whole_rows += s.tau_whole_rows;
        p->lay[l].screen_retry_rows += s.screen_retry_rows;
        p->lay[l].screen_all_rows += s.screen_all_rows;
    }
    ekv_model_reset_stats(m);
}

/* Every few seconds between windows: the perplexity so far and the run's ETA. */
static void window_progress(const ppl_result *r, double t0, double *last) {
    const double now = cli_now_seconds();
    if (now - *last < 5.0 || r->done >= r->nwin || !r->ph[0].scored) return;
    const double per = (now - t0) / (double)r->done;
    fprintf(stderr, "  ppl: %lld / %lld windows, ppl %.4f so far, ETA %.0f s\n", (long long)r->done,
            (long long)r->nwin, exp(r->ph[0].nll / (double)r->ph[0].scored),
            per * (double)(r->nwin - r->done));
    *last = now;
}

/* What one window feeds: its tokens, where its scored predictions start (first), whether it
 * is split (--prefill-method or --compare: a prefix, then a tail per phase, each with its
 * method set) and pre, the prefix fed once before the phases (first when split, else 0). */
typedef struct {
    const int32_t *tok;
    int64_t w, first, pre;
    int split;
    ekv_context *ctx;
    ekv_model *m;
} ppl_window_in;

/* The window's prefix [0, pre) with the prefix's method (mo.method), unscored; its tokens and
 * statistics count for phase 0. Returns model_feed's 0, 1 or 2. */
static int feed_prefix(const ppl_opts *o, const ppl_window_in *in, ppl_result *r) {
    char what[96];
    snprintf(what, sizeof what, "window %lld/%lld prefix", (long long)(in->w + 1),
             (long long)r->nwin);
    if (model_set_phase("ppl", in->ctx, in->m, (model_phase){o->mo.method, o->mo.budget}))
        return 1;
    int64_t ran = 0;
    const int fed =
            model_feed("ppl", what, in->ctx, in->m, in->tok, in->pre, in->pre, NULL, NULL, &ran);
    r->pre_fed += ran; /* its seconds: ppl_report */
    take_layer_stats(in->m, r->layers, &r->ph[0]);
    return fed;
}

/* Phase p over the window's tail [pre, ctx): its method, then the tokens fed with logits and
 * the predictions from first on scored. Returns model_feed's 0, 1 or 2; what an interrupted
 * tail scored still counts. */
static int feed_tail(const ppl_opts *o, const ppl_window_in *in, int p, ppl_result *r) {
    const model_phase *mp = &o->ph.list[p];
    ppl_phase *ph = &r->ph[p];
    char what[160], lab[64];
    model_method_label(lab, sizeof lab, mp->method, mp->budget);
    snprintf(what, sizeof what, "window %lld/%lld%s%s", (long long)(in->w + 1), (long long)r->nwin,
             in->split ? " " : "", in->split ? lab : "");
    if (in->split && model_set_phase("ppl", in->ctx, in->m, *mp)) return 1;
    nll_acc acc = {
            in->tok, ekv_model_get_config(in->m)->vocab, in->first, o->ctxlen - 1, in->pre, 0, 0};
    const double t0 = cli_now_seconds();
    int64_t ran = 0;
    const int fed = model_feed("ppl", what, in->ctx, in->m, in->tok + in->pre, o->ctxlen - in->pre,
                               in->first - in->pre, add_nll, &acc, &ran);
    ph->secs += cli_now_seconds() - t0;
    ph->fed += ran;
    ph->nll += acc.nll;
    ph->scored += acc.scored;
    take_layer_stats(in->m, r->layers, ph);
    return fed;
}

/* One window (docs/cli.md): the prefix once, then each phase's tail, the caches truncated
 * back to the prefix between phases (ekv_model_seq_truncate), so every method scores the
 * same predictions after the same prefill. Without --prefill-method and --compare nothing is
 * split: phase 0 feeds the whole window, as ppl always did. Returns 0, 1 on an error or 2
 * when interrupted (the phases that ran are counted). */
static int ppl_window(const ppl_opts *o, const ppl_window_in *in, ppl_result *r) {
    if (ekv_model_reset(in->m)) {
        fprintf(stderr, "entmaxkv ppl: %s\n", ekv_last_error(in->ctx));
        return 1;
    }
    int rc = in->split ? feed_prefix(o, in, r) : 0;
    for (int p = 0; p < o->ph.n && !rc; p++) {
        if (p > 0 && ekv_model_seq_truncate(in->m, 0, in->pre)) {
            fprintf(stderr, "entmaxkv ppl: back to the prefix: %s\n", ekv_last_error(in->ctx));
            return 1;
        }
        rc = feed_tail(o, in, p, r);
        /* Ctrl-C in a tail's last chunk: the phase finished, the next ones do not start */
        if (!rc && p + 1 < o->ph.n && cli_interrupted()) rc = 2;
    }
    return rc;
}

static int ppl_windows(const ppl_opts *o, const char *text, ekv_context *ctx, ekv_model *m,
                       ppl_result *r) {
    const int64_t ctxlen = o->ctxlen;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)ctxlen);
    int rc = 0;
    if (!tok) {
        fprintf(stderr, "entmaxkv ppl: out of memory\n");
        rc = 1;
    }
    const int64_t first = o->score_last ? ctxlen - 1 - o->score_last : 0;
    const int split = o->ph.prefill_set || o->ph.n > 1;
    const double t0 = cli_now_seconds();
    double last = t0;
    for (int64_t w = 0; w < r->nwin && !rc; w++) {
        ekv_model_tokenize(text + o->offset + w * ctxlen, ctxlen, tok);
        const ppl_window_in in = {tok, w, first, split ? first : 0, split, ctx, m};
        const int fed = ppl_window(o, &in, r);
        if (fed == 1) {
            rc = 1;
            break;
        }
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

/* A phase's statistics summed over the layers. */
typedef struct {
    double rd, kv, r2, nl, steps, surv;
} ppl_sums;
static ppl_sums sum_layers(const ppl_phase *p, int64_t layers) {
    ppl_sums t = {0, 0, 0, 0, 0, 0};
    for (int64_t l = 0; l < layers; l++) {
        t.steps += (double)p->lay[l].steps;
        t.surv += (double)p->lay[l].survivors;
        t.rd += (double)p->lay[l].bytes_read;
        t.kv += (double)p->lay[l].bytes_kv;
        t.r2 += (double)p->lay[l].lists_round2;
        t.nl += (double)p->lay[l].lists;
    }
    return t;
}

/* kv_fraction as text ("n/a") or JSON ("null") where it is not measured: the CUDA stages do
 * not count what they read (ekv_model_backend). */
static void kvf_string(char *buf, size_t n, const ppl_sums *t, const model_opts *mo, int json) {
    if (mo->backend == EKV_BACKEND_CUDA)
        snprintf(buf, n, json ? "null" : "n/a");
    else if (json)
        cli_json_num(buf, n, "%.9g", t->kv > 0 ? t->rd / t->kv : 0);
    else
        snprintf(buf, n, "%.4f", t->kv > 0 ? t->rd / t->kv : 0);
}

static double rate(int64_t tokens, double secs) { return secs > 0 ? (double)tokens / secs : 0; }

/* The `ppl ...` line of a phase (docs/cli.md; scripts and tests read phase 0's). */
static void print_ppl_line(FILE *f, const ppl_opts *o, const ppl_result *r, const ppl_phase *p,
                           const model_phase *mp, double tokens_per_s) {
    char lab[64], kvs[32], pps[32] = "n/a", bps[32] = "n/a";
    const ppl_sums t = sum_layers(p, r->layers);
    model_method_label(lab, sizeof lab, mp->method, mp->budget);
    kvf_string(kvs, sizeof kvs, &t, &o->mo, 0);
    if (p->scored) { /* a compare phase that Ctrl-C stopped before it scored has none */
        const double mean = p->nll / (double)p->scored;
        snprintf(pps, sizeof pps, "%.6f", exp(mean));
        snprintf(bps, sizeof bps, "%.6f", mean / log(2.0));
    }
    fprintf(f,
            "ppl %s  bits/byte %s  tokens %lld  windows %lld x %lld  method %s  kv_fraction %s  %.1f tokens/s\n",
            pps, bps, (long long)p->scored, (long long)r->nwin, (long long)o->ctxlen, lab, kvs,
            tokens_per_s);
}

/* Phase 0's rate, the top-level tokens_per_s: every token it fed (the prefixes and its tails)
 * over the run's seconds less the compare phases' tails, i.e. what the same run without
 * --compare measures (without --compare: the run's tokens over its seconds, as always). */
static double phase0_rate(const ppl_opts *o, const ppl_result *r) {
    double secs = r->secs;
    for (int p = 1; p < o->ph.n; p++) secs -= r->ph[p].secs;
    return rate(r->pre_fed + r->ph[0].fed, secs);
}

/* One per-layer line of a phase's slow-path counter (read by field), when any layer has one. */
static void report_layers(FILE *f, const ppl_result *r, const ppl_phase *ph, const char *lab,
                          const char *what, size_t field) {
    int64_t any = 0;
    for (int64_t l = 0; l < r->layers; l++)
        any += *(const int64_t *)((const char *)&ph->lay[l] + field);
    if (!any) return;
    fprintf(f, "%s per layer, %s:", lab, what);
    for (int64_t l = 0; l < r->layers; l++)
        fprintf(f, " %lld", (long long)*(const int64_t *)((const char *)&ph->lay[l] + field));
    fprintf(f, "\n");
}

/* Per phase, the CUDA decode stages' slow paths per layer (ekv_model_stats.tau_compacted_rows,
 * tau_whole_rows, screen_retry_rows, screen_all_rows) that happened. */
static void report_slow_paths(FILE *f, const ppl_opts *o, const ppl_result *r) {
    for (int p = 0; p < o->ph.n; p++) {
        char lab[64];
        model_method_label(lab, sizeof lab, o->ph.list[p].method, o->ph.list[p].budget);
        report_layers(f, r, &r->ph[p], lab, "tau lists compacted",
                      offsetof(ekv_model_stats, tau_compacted_rows));
        report_layers(f, r, &r->ph[p], lab, "tau lists over the whole row",
                      offsetof(ekv_model_stats, tau_whole_rows));
        report_layers(f, r, &r->ph[p], lab, "screen lists retried",
                      offsetof(ekv_model_stats, screen_retry_rows));
        report_layers(f, r, &r->ph[p], lab, "screen lists keeping every token",
                      offsetof(ekv_model_stats, screen_all_rows));
    }
}

/* The text report: phase 0 as ppl always printed it, then with a split window the tail's
 * rate and a `ppl ...` line per compare phase (its tokens/s: its tails only). */
static void report_text(FILE *f, const ppl_opts *o, const ppl_result *r, int codes) {
    const model_opts *mo = &o->mo;
    const ppl_sums t = sum_layers(&r->ph[0], r->layers);
    print_ppl_line(f, o, r, &r->ph[0], &o->ph.list[0], phase0_rate(o, r));
    if (mo->backend != EKV_BACKEND_CUDA) {
        fprintf(f, "kv_fraction per layer:");
        for (int64_t l = 0; l < r->layers; l++) fprintf(f, " %.4f", layer_kvf(&r->ph[0].lay[l]));
        fprintf(f, "\n");
    } else {
        fprintf(f, "kv_fraction: not measured on the cuda backend\n");
        report_slow_paths(f, o, r);
    }
    if (t.nl > 0) fprintf(f, "certified: round 2 in %.2f%% of page lists\n", 100.0 * t.r2 / t.nl);
    if (codes)
        fprintf(f, "screened: %d-bit key codes, %.1f tokens per head survive the screen\n",
                mo->code_bits, t.steps > 0 ? t.surv / (t.steps * (double)r->heads) : 0);
    if (!o->ph.prefill_set && o->ph.n == 1) return;
    char pre[64], lab[64];
    model_method_label(pre, sizeof pre, mo->method, mo->budget);
    model_method_label(lab, sizeof lab, o->ph.list[0].method, o->ph.list[0].budget);
    fprintf(f, "prefix %lld tokens per window with %s; tail %lld tokens: %.1f tokens/s with %s\n",
            (long long)(o->ctxlen - 1 - o->score_last), pre, (long long)(o->score_last + 1),
            rate(r->ph[0].fed, r->ph[0].secs), lab);
    for (int p = 1; p < o->ph.n; p++)
        print_ppl_line(f, o, r, &r->ph[p], &o->ph.list[p], rate(r->ph[p].fed, r->ph[p].secs));
}
/* One object per compare phase (docs/cli.md): its tails' ppl and tokens/s. */
static void report_compare_json(FILE *f, const ppl_opts *o, const ppl_result *r) {
    fprintf(f, ",\"compare\":[");
    for (int p = 1; p < o->ph.n; p++) {
        const ppl_phase *ph = &r->ph[p];
        const model_phase *mp = &o->ph.list[p];
        const ppl_sums t = sum_layers(ph, r->layers);
        const double mean = ph->scored ? ph->nll / (double)ph->scored : 0;
        char pps[32] = "null", bps[32] = "null", kvs[32], nls[32];
        if (ph->scored) {
            cli_json_num(pps, sizeof pps, "%.9g", exp(mean));
            cli_json_num(bps, sizeof bps, "%.9g", mean / log(2.0));
        }
        kvf_string(kvs, sizeof kvs, &t, &o->mo, 1);
        fprintf(f,
                "%s{\"method\":\"%s\",\"budget\":%.9g,\"ppl\":%s,\"bits_per_byte\":%s,\"nll_sum\":%s,"
                "\"tokens\":%lld,\"tokens_per_s\":%.3f,\"seconds\":%.3f,\"kv_fraction\":%s}",
                p > 1 ? "," : "", ekv_method_name(mp->method),
                model_uses_budget(mp->method) ? mp->budget : 1.0, pps, bps,
                cli_json_num(nls, sizeof nls, "%.9g", ph->nll), (long long)ph->scored,
                rate(ph->fed, ph->secs), ph->secs, kvs);
    }
    fprintf(f, "]");
}

/* The JSON object: phase 0's fields as ppl always wrote them (seconds: the whole run;
 * tokens_per_s: phase0_rate), then with a split window the prefix's method and the tail's
 * rate, and with --compare the "compare" array. */
static void report_json(FILE *f, const ppl_opts *o, const ppl_result *r, int codes) {
    const model_opts *mo = &o->mo;
    const model_phase *m0 = &o->ph.list[0];
    const ppl_sums t = sum_layers(&r->ph[0], r->layers);
    const double mean = r->ph[0].nll / (double)r->ph[0].scored;
    char kvs[32], r2s[32] = "null", svs[32] = "null", pps[32], bps[32], nls[32];
    kvf_string(kvs, sizeof kvs, &t, mo, 1);
    if (t.nl > 0) cli_json_num(r2s, sizeof r2s, "%.9g", t.r2 / t.nl);
    /* survivors per attention step and query head */
    if (codes)
        cli_json_num(svs, sizeof svs, "%.9g",
                     t.steps > 0 ? t.surv / (t.steps * (double)r->heads) : 0);
    fprintf(f,
            "{\"ppl\":%s,\"bits_per_byte\":%s,\"nll_sum\":%s,\"tokens\":%lld,\"method\":\"%s\",\"budget\":%.9g,"
            "\"kv_fraction\":%s,\"backend\":\"%s\",\"ctx\":%lld,\"windows\":%lld,\"offset\":%lld,\"score_last\":%lld,"
            "\"kv_dtype\":\"%s\",\"page\":%d,\"seconds\":%.3f,\"tokens_per_s\":%.3f,\"round2_fraction\":%s,"
            "\"code_bits\":%d,\"survivors_mean\":%s,\"interrupted\":%s,\"windows_done\":%lld,\"kv_fraction_layers\":[",
            cli_json_num(pps, sizeof pps, "%.9g", exp(mean)),
            cli_json_num(bps, sizeof bps, "%.9g", mean / log(2.0)),
            cli_json_num(nls, sizeof nls, "%.9g", r->ph[0].nll), (long long)r->ph[0].scored,
            ekv_method_name(m0->method), model_uses_budget(m0->method) ? m0->budget : 1.0, kvs,
            ekv_backend_name(mo->backend), (long long)o->ctxlen, (long long)r->nwin,
            (long long)o->offset, (long long)o->score_last, ekv_dtype_name(mo->kv_dtype), mo->page,
            r->secs, phase0_rate(o, r), r2s, model_code_bits(mo), svs,
            r->interrupted ? "true" : "false", (long long)r->done);
    for (int64_t l = 0; l < r->layers && mo->backend != EKV_BACKEND_CUDA; l++)
        fprintf(f, "%s%s", l ? "," : "",
                cli_json_num(kvs, sizeof kvs, "%.9g", layer_kvf(&r->ph[0].lay[l])));
    fprintf(f, "]");
    if (o->ph.prefill_set || o->ph.n > 1)
        fprintf(f, ",\"prefill_method\":\"%s\",\"tail_tokens_per_s\":%.3f",
                ekv_method_name(mo->method), rate(r->ph[0].fed, r->ph[0].secs));
    if (o->ph.n > 1) report_compare_json(f, o, r);
    fprintf(f, "}\n");
}

/* The report: the text, then the JSON into out (opened before the run, so that a bad path
 * fails before it; a JSON that cannot be written still leaves the text report, exit 1). A
 * perplexity beyond a double (a mean log-loss above ~709 nats: the model's logits are far out
 * of range) prints as inf, is null in the JSON and fails the run. */
static int ppl_report(const ppl_opts *o, const ppl_result *r, cli_out *out) {
    if (r->interrupted)
        fprintf(stderr,
                "entmaxkv ppl: interrupted: the result below covers the %lld predictions "
                "scored in %lld of %lld windows%s\n",
                (long long)r->ph[0].scored, (long long)r->done, (long long)r->nwin,
                o->ph.n > 1 ? " (each compare line: the tokens it scored)" : "");
    if (!r->ph[0].scored) {
        fprintf(stderr, "entmaxkv ppl: no prediction was scored\n");
        cli_out_discard(out);
        return 1;
    }
    /* phase 0's statistics hold screened steps: its own or its prefixes' */
    const int codes = cli_method_codes(o->ph.list[0].method) || cli_method_codes(o->mo.method);
    report_text(out->text, o, r, codes);
    if (out->json) report_json(out->json, o, r, codes);
    int rc = cli_out_close(out, "ppl");
    for (int p = 0; p < o->ph.n; p++) {
        const double mean = r->ph[p].scored ? r->ph[p].nll / (double)r->ph[p].scored : 0;
        if (isfinite(exp(mean))) continue;
        char lab[64];
        model_method_label(lab, sizeof lab, o->ph.list[p].method, o->ph.list[p].budget);
        fprintf(stderr,
                "entmaxkv ppl: %s: the mean log-loss is %.6g nats per token, so the perplexity "
                "overflows a double: the model's logits are out of any sensible range\n",
                lab, mean);
        rc = 1;
    }
    return rc;
}

int cmd_ppl(int argc, char **argv) {
    ppl_opts o;
    parse(argc, argv, &o);
    cli_out out; /* before the run: a bad --json path fails now, not after it */
    if (cli_out_open(&out, "ppl", o.json)) return 1;
    model_session s;
    if (model_open_text("ppl", &o.mo, o.text_path, o.offset, o.ctxlen, &s)) {
        cli_out_discard(&out);
        return 1;
    }
    ppl_result r;
    memset(&r, 0, sizeof r);
    r.layers = ekv_model_get_config(s.m)->n_layers;
    r.heads = ekv_model_get_config(s.m)->n_heads;
    r.nwin = (s.len - o.offset) / o.ctxlen;
    if (r.nwin > o.windows) r.nwin = o.windows;
    ekv_model_stats *lay = calloc((size_t)(r.layers * o.ph.n), sizeof *lay);
    for (int p = 0; p < o.ph.n && lay; p++) r.ph[p].lay = lay + p * r.layers;
    cli_catch_interrupt(); /* Ctrl-C: report what was scored (a second one quits) */
    int rc = lay ? model_check_phases("ppl", s.ctx, s.m, o.ph.list, o.ph.n, &o.mo) : 1;
    if (!lay) fprintf(stderr, "entmaxkv ppl: out of memory\n");
    if (!rc) rc = ppl_windows(&o, s.text, s.ctx, s.m, &r);
    if (!rc)
        rc = ppl_report(&o, &r, &out);
    else
        cli_out_discard(&out);
    if (!rc && r.interrupted) rc = CLI_EXIT_INTERRUPTED;
    free(lay);
    model_close(&s);
    return rc;
}
