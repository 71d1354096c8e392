/*
 * entmaxkv eval: quality of sparse decoding at matched budgets (docs/math.md §5.6; contract in
 * docs/cli.md).
 *
 * For every step (a fresh set of queries over the same cache) and every query head it
 * computes the dense reference of the method's own distribution (entmax for entmax
 * methods, softmax for softmax-topk), runs the method, and measures:
 *   delta   dropped mass = reference probability of the tokens outside the selection
 *           (softmax-topk: in its own softmax distribution, as the issue asks);
 *   recall  |support* within the selection| / |support*| (softmax: the whole sequence is its
 *           support, so recall = fraction of tokens kept);
 *   rel_err ||o - o*|| / ||o*||, cosine(o, o*), and kv_fraction = tokens read / tokens;
 *   bytes_fraction = bytes read (page statistics, key codes, K and V rows) / K+V bytes.
 * The screened rows (4- and 8-bit key codes) need a cache with codes of their width, and a
 * cache's codes have one width: the workload cache gets the codes of the first screened row
 * asked for, and a second cache, filled with the same keys and values (the same random
 * stream, or the same trace), the other width when both rows are asked for. Filling twice
 * costs a second cache only when both rows run, and every row reads the keys it would read
 * in a cache of its own.
 * Rows aggregate over steps and heads. --plot runs bench/plot_eval.py (matplotlib).
 */
#include "cli.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifndef EKV_SOURCE_DIR
#define EKV_SOURCE_DIR "."
#endif

typedef struct eval_state eval_state;
typedef struct eval_variant eval_variant;
/* What one run of a variant leaves for the metrics: the page lists it read (certified: every
 * page, as certified equals dense), the decode info and the page-statistics bytes. */
typedef struct {
    ekv_page_list list;
    ekv_decode_info info;
    int64_t bytes_summary;
} eval_run;
typedef int (*eval_stages)(eval_state *e, const eval_variant *v, ekv_select_params *sp,
                           eval_run *r);

/* The stages of a variant: list methods select pages and attend over them (eval needs the
 * lists); certified decodes through ekv_decode, which reports the pages of its two rounds. */
static int run_list(eval_state *e, const eval_variant *v, ekv_select_params *sp, eval_run *r);
static int run_exact(eval_state *e, const eval_variant *v, ekv_select_params *sp, eval_run *r);

/* A method of eval: a select method of the library, the stages that run it, and the options
 * eval gives it. */
struct eval_variant {
    const char *name;
    ekv_select_method method;
    eval_stages run;
    int softmax;    /* alpha = 1 (the softmax top-k baseline, measured in its own softmax) */
    int budgeted;   /* one row per budget; otherwise the method chooses its pages: one row */
    int gauss_hint; /* certified round 1 from the gaussian tau-hat (select tau_hint) */
    int delta_bar;  /* the certified bound on the dropped mass (needs the exact tau of a list) */
    int code_bits;  /* screened: the width of the key codes it screens with */
};
enum { V_COUNT = 8, MAX_BUDGETS = 32 };
static const eval_variant variants[V_COUNT] = {
        {"softmax-topk", EKV_SELECT_TOPK, run_list, 1, 1, 0, 0, 0},
        {"entmax-topk", EKV_SELECT_TOPK, run_list, 0, 1, 0, 1, 0},
        {"gaussian", EKV_SELECT_GAUSSIAN, run_list, 0, 0, 0, 1, 0},
        {"certified", EKV_SELECT_CERTIFIED, run_exact, 0, 1, 0, 0, 0},
        {"certified-gauss", EKV_SELECT_CERTIFIED, run_exact, 0, 0, 1, 0, 0},
        {"screened-4", EKV_SELECT_SCREENED, run_exact, 0, 0, 0, 0, 4},
        {"screened-8", EKV_SELECT_SCREENED, run_exact, 0, 0, 0, 0, 8},
        {"oracle", EKV_SELECT_ORACLE, run_list, 0, 0, 0, 0, 0},
};
static const char *tau_mode_names[] = {"exact", "fixed", "corrected"}; /* by ekv_tau_mode */

/* A JSON number of a row (cli_json_num: null when not finite), or null where it does not
 * apply (valid 0). */
static void json_num(char *buf, size_t n, double v, int valid) {
    if (valid)
        cli_json_num(buf, n, "%.8g", v);
    else
        snprintf(buf, n, "null");
}

static void eval_help(FILE *f) {
    fprintf(f,
            "usage: entmaxkv eval [options]\n"
            "\n"
            "Quality of sparse decoding against dense attention at matched KV budgets.\n"
            "\n"
            "  --workload W          random | planted | heavy | alibi | trace:FILE[@PREFIX]\n"
            "                        (default planted; a trace sets the shapes and the length,\n"
            "                        layout in tools/workload.c)\n"
            "  --len N               tokens (default 32768)\n"
            "  --batch B --heads H --kv-heads HK --dim D --page P --dtype f32|f16|bf16\n"
            "                        shapes (defaults 1, 32, 8, 128, 16, f16)\n"
            "  --ranges f32|f16|bf16 the page ranges the bounds read (default: K's dtype when\n"
            "                        f16/bf16, exact and half the bytes of f32)\n"
            "  --alpha A             entmax alpha (default 1.5)\n"
            "  --methods LIST        comma list of softmax-topk, entmax-topk, gaussian, certified,\n"
            "                        certified-gauss, screened-4, screened-8, oracle (default all;\n"
            "                        certified's budget is its round 1; certified-gauss sizes\n"
            "                        round 1 from the gaussian tau-hat instead; screened-B screens\n"
            "                        with B-bit key codes)\n"
            "  --tau-mode M          gaussian: exact | fixed | corrected (default exact)\n"
            "  --auto-margin         gaussian: the reference's automatic margin rule (docs/math.md §4.5)\n"
            "  --budgets LIST        comma list of fractions of the tokens, e.g. 1/64,1/16,1/4\n"
            "                        (default 1/64,1/16,1/4)\n"
            "  --steps N             query sets to average over (default 4)\n"
            "  --threads T --seed S  (defaults: all CPUs, 1)\n"
            "  --json FILE           write the rows as a JSON array; FILE '-' = stdout, the table\n"
            "                        then goes to stderr\n"
            "  --plot FILE.png       plot delta and recall against kv_fraction (needs python3 with\n"
            "                        matplotlib; runs bench/plot_eval.py)\n"
            "  --help                this text\n");
}

typedef struct {
    double delta_sum, delta_max, recall_sum, recall_min, err_sum, err_max, cos_min, kvf_sum;
    double tau_err_sum, tau_err_absmax; /* gaussian: tau-hat - tau* (z-space) */
    double bar_max;                     /* entmax methods, exact tau: the certified delta_bar */
    int64_t bar_zero, bar_n;            /* samples with delta_bar = 0, samples with a delta_bar */
    double bytes_ratio_sum;             /* bytes read / bytes of dense entmax, per step */
    double bytes_frac_sum;              /* bytes read / K+V bytes, per step */
    double surv_sum;                    /* screened: survivors / (token, query head) pairs */
    int64_t frac_n;                     /* steps in bytes_frac_sum and surv_sum */
    int64_t bytes_n, round2_lists, lists;
    double loose_sum; /* certified: share of pages whose bound exceeds tau* */
    double super_sum; /* certified: share of 16-page superpages whose every page
                         bound is <= tau* (an upper limit on what superpages skip) */
    int64_t n;
} agg;

static void agg_add(agg *a, double delta, double recall, double err, double cosv, double kvf) {
    if (a->n == 0) {
        a->delta_max = delta;
        a->recall_min = recall;
        a->err_max = err;
        a->cos_min = cosv;
    }
    a->delta_sum += delta;
    a->recall_sum += recall;
    a->err_sum += err;
    a->kvf_sum += kvf;
    if (delta > a->delta_max) a->delta_max = delta;
    if (recall < a->recall_min) a->recall_min = recall;
    if (err > a->err_max) a->err_max = err;
    if (cosv < a->cos_min) a->cos_min = cosv;
    a->n++;
}

typedef struct {
    wl_opts w;
    const char *plot;
    int64_t len, steps;
    double alpha, budgets[MAX_BUDGETS];
    int nbudgets, use[V_COUNT], auto_margin;
    ekv_tau_mode tau_mode;
} eval_opts;

static const char *need(int argc, char **argv, int *i) { return cli_need("eval", argc, argv, i); }

static void parse_methods(const char *v, eval_opts *o) {
    char buf[256], *items[4 * V_COUNT];
    const int n = cli_split_list("eval", "--methods", v, buf, sizeof buf, items, 4 * V_COUNT);
    memset(o->use, 0, sizeof o->use);
    for (int k = 0; k < n; k++) {
        const char *t = items[k];
        int found = 0;
        for (int m = 0; m < V_COUNT; m++)
            if (!strcmp(t, variants[m].name)) {
                o->use[m] = 1;
                found = 1;
            }
        if (!found) {
            char names[256] = "";
            for (int m = 0; m < V_COUNT; m++)
                snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", m ? ", " : "",
                         variants[m].name);
            cli_usage_error("eval", "unknown method '%s' (%s)", t, names);
        }
    }
}

static void parse_budgets(const char *v, eval_opts *o) {
    char buf[512], *items[MAX_BUDGETS];
    o->nbudgets = cli_split_list("eval", "--budgets", v, buf, sizeof buf, items, MAX_BUDGETS);
    for (int k = 0; k < o->nbudgets; k++) {
        double *b = &o->budgets[k];
        if (cli_parse_fraction(items[k], b) || !(*b > 0 && *b <= 1))
            cli_usage_error("eval", "budget '%s': expected a fraction in (0, 1]", items[k]);
    }
}

/* Options whose value is a name or a list; 0 if a is none of them. */
static int parse_named(int argc, char **argv, int *i, eval_opts *o) {
    const char *a = argv[*i];
    if (!strcmp(a, "--methods"))
        parse_methods(need(argc, argv, i), o);
    else if (!strcmp(a, "--budgets"))
        parse_budgets(need(argc, argv, i), o);
    else if (!strcmp(a, "--tau-mode")) {
        const char *v = need(argc, argv, i);
        int k = 0;
        while (k < 3 && strcmp(v, tau_mode_names[k])) k++;
        if (k == 3) cli_usage_error("eval", "--tau-mode %s: expected exact, fixed or corrected", v);
        o->tau_mode = (ekv_tau_mode)k;
    } else if (!strcmp(a, "--alpha")) {
        const char *v = need(argc, argv, i);
        if (cli_parse_double(v, &o->alpha) || !(o->alpha > 1.0 && o->alpha <= 4.0))
            cli_usage_error("eval",
                            "--alpha %s: expected a number in (1, 4] (softmax-topk is a method)",
                            v);
    } else
        return 0;
    return 1;
}

static const cli_opt eval_table[] = {
        CLI_INT("--len", eval_opts, len, 2, INT32_MAX),
        CLI_INT("--steps", eval_opts, steps, 1, 100000),
        CLI_STR("--plot", eval_opts, plot),
        CLI_FLAG("--auto-margin", eval_opts, auto_margin),
};

static int eval_take(const char *sub, int argc, char **argv, int *i, void *vo) {
    eval_opts *o = vo;
    return parse_named(argc, argv, i, o) || wl_opt(sub, argc, argv, i, &o->w, 64) ||
           cli_take(sub, eval_table, CLI_NOPTS(eval_table), argc, argv, i, o);
}

static void parse(int argc, char **argv, eval_opts *o) {
    memset(o, 0, sizeof *o);
    wl_opts_init(&o->w, "planted");
    o->len = 32768;
    o->steps = 4;
    o->alpha = 1.5;
    o->nbudgets = 3;
    o->budgets[0] = 1.0 / 64;
    o->budgets[1] = 1.0 / 16;
    o->budgets[2] = 1.0 / 4;
    for (int m = 0; m < V_COUNT; m++) o->use[m] = 1;
    o->tau_mode = EKV_TAU_EXACT;
    cli_parse("eval", argc, argv, eval_help, eval_take, o);
    wl_opts_check("eval", &o->w);
    if (o->plot && !o->w.json)
        cli_usage_error("eval", "--plot needs --json FILE (the plot reads it)");
    if (o->plot && !strcmp(o->w.json, "-"))
        cli_usage_error("eval", "--plot needs --json FILE, not stdout");
}

/* Everything a run of eval holds: the cache, the dense references of the step, buffers. */
struct eval_state {
    ekv_context *ctx;
    eval_opts *o;
    wl_state wl;
    wl_setup s;
    wl_setup sc; /* the second width of key codes, when both screened rows run */
    cli_rng rng;
    ekv_decode_params dp[2]; /* 0: softmax, 1: entmax */
    float *q, *out, *oref[2], *pref[2], *bnd;
    double *tau_star, *tau_hat, *tau_c, *dbar;
    int32_t *r1, *r2;
    uint8_t *inlist;
    int64_t maxP, dense_bytes;
    int64_t tokens, kv_bytes; /* tokens of the sequences and their K+V bytes */
    agg res[V_COUNT][MAX_BUDGETS];
};

static int fail(eval_state *e, const char *what, ekv_status st) {
    fprintf(stderr, "entmaxkv eval: %s: %s: %s\n", what, ekv_status_string(st),
            ekv_last_error(e->ctx));
    return 1;
}

/* The cache a variant runs on: the one whose key codes have its width (same keys in both). */
static const wl_setup *eval_setup(const eval_state *e, const eval_variant *v) {
    return v->code_bits && e->s.stats.code_bits != v->code_bits ? &e->sc : &e->s;
}

static int run_list(eval_state *e, const eval_variant *v, ekv_select_params *sp, eval_run *r) {
    const ekv_decode_params *dp = &e->dp[!v->softmax];
    const wl_setup *s = eval_setup(e, v);
    ekv_status st = ekv_select_pages(e->ctx, dp, sp, &s->kv, &s->stats, &s->table, e->q, &r->list);
    if (!st) st = ekv_decode_pages(e->ctx, dp, &s->kv, &s->table, &r->list, e->q, e->out, &r->info);
    r->bytes_summary = r->list.bytes_summary;
    return st ? fail(e, v->name, st) : 0;
}

/* The exact methods (certified, screened) through the decode entry point, which is what reads
 * K rows rather than whole pages for screened; their metrics are against every page. */
static int run_exact(eval_state *e, const eval_variant *v, ekv_select_params *sp, eval_run *r) {
    const ekv_decode_params *dp = &e->dp[!v->softmax];
    const wl_setup *s = eval_setup(e, v);
    ekv_status st = EKV_OK;
    int64_t extra_summary = 0;
    if (v->gauss_hint) { /* round 1 from the gaussian tau-hat */
        ekv_select_params gs = ekv_select_default_params();
        gs.method = EKV_SELECT_GAUSSIAN;
        st = ekv_select_pages(e->ctx, dp, &gs, &s->kv, &s->stats, &s->table, e->q, &r->list);
        extra_summary = r->list.bytes_summary;
        sp->tau_hint = e->tau_hat;
    }
    r->info.pages_round1 = e->r1;
    r->info.pages_round2 = e->r2;
    if (!st) st = ekv_decode(e->ctx, dp, sp, &s->kv, &s->stats, &s->table, e->q, e->out, &r->info);
    r->bytes_summary = r->info.bytes_summary + extra_summary;
    if (!st) { /* the exact methods equal dense: per-token metrics against every page */
        ekv_select_params all = *sp;
        all.method = EKV_SELECT_DENSE;
        st = ekv_select_pages(e->ctx, dp, &all, &s->kv, &s->stats, &s->table, e->q, &r->list);
    }
    r->list.survivors = r->info.survivors;
    return st ? fail(e, v->name, st) : 0;
}

/* The metrics of query head bh of a run, into a. */
static void eval_head(eval_state *e, const eval_variant *v, agg *a, int64_t bh, int64_t N,
                      int64_t kept) {
    const int64_t D = e->o->w.dim, len = e->s.len;
    const float *p = e->pref[!v->softmax] + bh * len, *y = e->oref[!v->softmax] + bh * D,
                *x = e->out + bh * D;
    double dropped = 0, sup = 0, sup_in = 0, e2 = 0, r2 = 0, dot = 0, o2 = 0;
    for (int64_t t = 0; t < N; t++) {
        if (!e->inlist[t]) dropped += p[t];
        if (p[t] > 0) {
            sup++;
            sup_in += e->inlist[t];
        }
    }
    for (int64_t d = 0; d < D; d++) {
        e2 += ((double)x[d] - y[d]) * ((double)x[d] - y[d]);
        r2 += (double)y[d] * y[d];
        o2 += (double)x[d] * x[d];
        dot += (double)x[d] * y[d];
    }
    /* softmax: the whole sequence is its support, so recall = the fraction of tokens kept */
    double recall = v->softmax ? (double)kept / (double)N : sup > 0 ? sup_in / sup : 1.0;
    double err = sqrt(e2 / (r2 > 0 ? r2 : 1)),
           cosv = dot / sqrt((o2 > 0 ? o2 : 1) * (r2 > 0 ? r2 : 1));
    agg_add(a, dropped, recall, err, cosv, (double)kept / (double)N);
    if (v->method == EKV_SELECT_GAUSSIAN) {
        double te = e->tau_hat[bh] - e->tau_star[bh];
        a->tau_err_sum += te;
        if (fabs(te) > a->tau_err_absmax) a->tau_err_absmax = fabs(te);
    }
}

/* Certified: proven exact, and how tight the page bounds are at the true tau*. */
static void eval_bounds(eval_state *e, agg *a, int64_t b, int64_t bh) {
    const float *bnd = e->bnd + bh * e->maxP;
    const int64_t Pb = e->s.indptr[b + 1] - e->s.indptr[b];
    int64_t loose = 0, sp_all = 0, sp_skip = 0;
    a->bar_zero++;
    a->bar_n++;
    /* pages no bound-based method can rule out */
    for (int64_t p = 0; p + 1 < Pb; p++) loose += (double)bnd[p] > e->tau_star[bh];
    a->loose_sum += Pb > 1 ? (double)loose / (double)(Pb - 1) : 0.0;
    for (int64_t s0 = 0; s0 + 16 <= Pb - 1; s0 += 16) { /* 16-page superpages */
        int skip = 1;
        for (int64_t p = s0; p < s0 + 16 && skip; p++) skip = (double)bnd[p] <= e->tau_star[bh];
        sp_all++;
        sp_skip += skip;
    }
    a->super_sum += sp_all ? (double)sp_skip / (double)sp_all : 0.0;
}

/* The per-token metrics of a run: every list (sequence, KV head) and its query heads. */
static void eval_lists(eval_state *e, const eval_variant *v, agg *a, const eval_run *r,
                       int has_bar) {
    const wl_setup *s = &e->s;
    const int64_t Hk = e->o->w.kv_heads, G = e->o->w.heads / Hk, page = e->o->w.page;
    for (int64_t b = 0; b < s->batch; b++) {
        const int64_t N = wl_setup_seq_len(s, b);
        for (int64_t kh = 0; kh < Hk; kh++) {
            const int64_t l = b * Hk + kh;
            int64_t kept = 0;
            memset(e->inlist, 0, (size_t)N);
            for (int64_t i = r->list.indptr[l]; i < r->list.indptr[l + 1]; i++)
                for (int64_t t = r->list.pages[i] * page;
                     t < (r->list.pages[i] + 1) * page && t < N; t++) {
                    e->inlist[t] = 1;
                    kept++;
                }
            if (v->method ==
                EKV_SELECT_CERTIFIED) /* tokens of its two rounds (the last page is partial) */
                kept = (int64_t)(e->r1[l] + e->r2[l]) * page - (page - s->last_page_len[b]);
            for (int64_t g = 0; g < G; g++) {
                const int64_t bh = b * e->o->w.heads + kh * G + g;
                eval_head(e, v, a, bh, N, kept);
                if (has_bar) {
                    a->bar_max = fmax(a->bar_max, e->dbar[bh]);
                    a->bar_zero += e->dbar[bh] == 0;
                    a->bar_n++;
                }
                if (v->method == EKV_SELECT_CERTIFIED) eval_bounds(e, a, b, bh);
            }
        }
    }
}

/* One row of one step: run variant v at budget bi, then measure. */
static int eval_variant_run(eval_state *e, int m, int bi) {
    const eval_variant *v = &variants[m];
    const eval_opts *o = e->o;
    ekv_select_params sp = ekv_select_default_params();
    sp.method = v->method;
    sp.tau_mode = o->tau_mode;
    sp.auto_margin = o->auto_margin;
    sp.budget_tokens = (int64_t)(o->budgets[bi] * (double)e->s.len);
    if (sp.budget_tokens < 1) sp.budget_tokens = 1;
    eval_run r;
    memset(&r, 0, sizeof r);
    r.list = wl_setup_list(&e->s);
    r.list.tau = e->tau_hat;
    r.info.tau = e->tau_c;
    if (v->run(e, v, &sp, &r)) return 1;
    agg *a = &e->res[m][bi];
    const double bytes = (double)(r.info.bytes_k + r.info.bytes_v + r.bytes_summary);
    if (!v->softmax) { /* bytes read against dense entmax's */
        a->bytes_ratio_sum += bytes / (double)e->dense_bytes;
        a->bytes_n++;
    }
    a->bytes_frac_sum += bytes / (double)e->kv_bytes;
    a->surv_sum += (double)r.list.survivors / (double)(e->tokens * o->w.heads);
    a->frac_n++;
    if (v->method == EKV_SELECT_CERTIFIED) {
        a->round2_lists += r.info.lists_round2;
        a->lists += e->s.batch * o->w.kv_heads;
    }
    /* delta_bar needs the exact tau over the list (the selector says which tau the list used) */
    const int has_bar = v->delta_bar && r.list.tau_mode == EKV_TAU_EXACT;
    if (has_bar) {
        r.list.bounds = e->bnd;
        r.list.bounds_stride = e->maxP;
        ekv_status st = ekv_delta_bound(e->ctx, &e->dp[!v->softmax], &e->s.kv, &e->s.table, &r.list,
                                        e->tau_c, e->dbar);
        if (st) return fail(e, "delta_bar", st);
    }
    eval_lists(e, v, a, &r, has_bar);
    return 0;
}

/* The references of a step: the certified page bounds (for delta_bar of every list), and the
 * dense output and distribution of softmax and of entmax. */
static int eval_references(eval_state *e) {
    const wl_setup *s = &e->s;
    ekv_select_params bs = ekv_select_default_params();
    bs.budget_tokens = 1;
    ekv_page_list bl = wl_setup_list(s);
    bl.bounds = e->bnd;
    bl.bounds_stride = e->maxP;
    ekv_status st =
            ekv_select_pages(e->ctx, &e->dp[1], &bs, &s->kv, &s->stats, &s->table, e->q, &bl);
    if (st) return fail(e, "bounds", st);
    for (int k = 0; k < 2; k++) {
        ekv_decode_info di = {.tau = k == 1 ? e->tau_star : NULL};
        if ((st = ekv_decode_dense(e->ctx, &e->dp[k], &s->kv, &s->table, e->q, e->oref[k], &di)) ||
            (st = ekv_dense_probs(e->ctx, &e->dp[k], &s->kv, &s->table, e->q, s->len, e->pref[k],
                                  NULL)))
            return fail(e, "dense reference", st);
        if (k == 1) e->dense_bytes = di.bytes_k + di.bytes_v;
    }
    return 0;
}

static int eval_steps(eval_state *e) {
    const eval_opts *o = e->o;
    double last = cli_now_seconds();
    for (int64_t step = 0; step < o->steps; step++) {
        wl_queries(&e->wl, &e->rng, e->q, e->s.batch);
        if (eval_references(e)) return 1;
        for (int m = 0; m < V_COUNT; m++)
            for (int bi = 0; o->use[m] && bi < (variants[m].budgeted ? o->nbudgets : 1); bi++)
                if (eval_variant_run(e, m, bi)) return 1;
        double now = cli_now_seconds();
        if (now - last > 2.0) {
            fprintf(stderr, "  eval: step %lld / %lld\n", (long long)(step + 1),
                    (long long)o->steps);
            last = now;
        }
    }
    return 0;
}

/* The extra lines under a variant's table row. */
static void report_notes(const eval_state *e, const eval_variant *v, const agg *a, FILE *f) {
    const double n = (double)a->n, bytes = a->bytes_n ? a->bytes_ratio_sum / (double)a->bytes_n : 0;
    if (v->code_bits)
        fprintf(f,
                "%-15s exact (equals dense entmax); %d-bit key codes: %.3f%% of (token, head) pairs survive the screen; bytes %.3f of dense entmax\n",
                "", v->code_bits, a->frac_n ? 100.0 * a->surv_sum / (double)a->frac_n : 0, bytes);
    else if (v->method == EKV_SELECT_CERTIFIED)
        fprintf(f,
                "%-15s proven exact in every step; round 2 needed by %.1f%% of lists; bytes %.3f of dense entmax;\n"
                "%-15s %.1f%% of pages have a bound above tau* (no bound-based method can skip them);\n"
                "%-15s at most %.1f%% of 16-page superpages could be skipped (every page bound <= tau*)\n",
                "", a->lists ? 100.0 * (double)a->round2_lists / (double)a->lists : 0, bytes, "",
                100.0 * a->loose_sum / n, "", 100.0 * a->super_sum / n);
    else if (a->bar_n)
        fprintf(f,
                "%-15s delta_bar: max %.3e, proven exact (delta_bar = 0) in %.1f%% of head-steps; bytes %.3f of dense entmax\n",
                "", a->bar_max, 100.0 * (double)a->bar_zero / (double)a->bar_n, bytes);
    if (v->method == EKV_SELECT_GAUSSIAN)
        fprintf(f, "%-15s tau-hat - tau*: mean %.4f, max |.| %.4f (z-space; tau mode %s)\n", "",
                a->tau_err_sum / n, a->tau_err_absmax, tau_mode_names[e->o->tau_mode]);
}

static void report_json(const eval_state *e, const eval_variant *v, const agg *a, const char *bud,
                        int first, FILE *f) {
    const eval_opts *o = e->o;
    const double n = (double)a->n;
    const int cert = v->method == EKV_SELECT_CERTIFIED, gauss = v->method == EKV_SELECT_GAUSSIAN;
    char jb[8][32], mb[11][32]; /* mb: the fields of every row; jb: those that may not apply */
    const double metric[11] = {a->kvf_sum / n,
                               a->delta_sum / n,
                               a->delta_max,
                               a->recall_sum / n,
                               a->recall_min,
                               a->err_sum / n,
                               a->err_max,
                               a->cos_min,
                               gauss ? a->tau_err_sum / n : 0.0,
                               gauss ? a->tau_err_absmax : 0.0,
                               o->alpha};
    for (int k = 0; k < 11; k++) json_num(mb[k], 32, metric[k], 1);
    json_num(jb[0], 32, cert ? 0.0 : a->bar_max, a->bar_n > 0);
    json_num(jb[1], 32, a->bar_n ? (double)a->bar_zero / (double)a->bar_n : 0, a->bar_n > 0);
    json_num(jb[2], 32, a->bytes_n ? a->bytes_ratio_sum / (double)a->bytes_n : 0, a->bytes_n > 0);
    json_num(jb[3], 32, a->lists ? (double)a->round2_lists / (double)a->lists : 0, cert);
    json_num(jb[4], 32, a->loose_sum / n, cert);
    json_num(jb[5], 32, a->super_sum / n, cert);
    json_num(jb[6], 32, a->frac_n ? a->bytes_frac_sum / (double)a->frac_n : 0, a->frac_n > 0);
    json_num(jb[7], 32, a->frac_n ? a->surv_sum / (double)a->frac_n : 0, v->code_bits > 0);
    fprintf(f,
            "%s  {\"method\":\"%s\",\"budget\":%s,\"kv_fraction\":%s,\"delta_mean\":%s,"
            "\"delta_max\":%s,\"recall_mean\":%s,\"recall_min\":%s,\"rel_err_mean\":%s,"
            "\"rel_err_max\":%s,\"cosine_min\":%s,\"workload\":\"%s\",\"len\":%lld,\"alpha\":%s,"
            "\"heads\":%lld,\"kv_heads\":%lld,\"dim\":%lld,\"page\":%lld,\"dtype\":\"%s\",\"steps\":%lld,"
            "\"samples\":%lld,\"tau_err_mean\":%s,\"tau_err_absmax\":%s,\"tau_mode\":\"%s\","
            "\"delta_bound_max\":%s,\"certified_fraction\":%s,\"bytes_vs_dense_entmax\":%s,"
            "\"round2_fraction\":%s,\"pages_bound_above_tau\":%s,\"superpages_skippable_max\":%s,"
            "\"bytes_fraction\":%s,\"code_bits\":%d,\"survivors_fraction\":%s}",
            first ? "" : ",\n", v->name, bud, mb[0], mb[1], mb[2], mb[3], mb[4], mb[5], mb[6],
            mb[7], wl_name(o->w.wl), (long long)e->s.len, mb[10], (long long)o->w.heads,
            (long long)o->w.kv_heads, (long long)o->w.dim, (long long)o->w.page,
            ekv_dtype_name(o->w.dtype), (long long)o->steps, (long long)a->n, mb[8], mb[9],
            tau_mode_names[gauss ? o->tau_mode : EKV_TAU_EXACT], jb[0], jb[1], jb[2], jb[3], jb[4],
            jb[5], jb[6], v->code_bits, jb[7]);
}

/* The table, and the JSON rows into out (opened before the run, so that a bad path fails
 * before it). */
static int eval_report(const eval_state *e, cli_out *out) {
    const eval_opts *o = e->o;
    fprintf(out->text,
            "# eval workload=%s len=%lld B=%lld H=%lld Hk=%lld D=%lld page=%lld dtype=%s alpha=%g steps=%lld\n",
            wl_name(o->w.wl), (long long)e->s.len, (long long)e->s.batch, (long long)o->w.heads,
            (long long)o->w.kv_heads, (long long)o->w.dim, (long long)o->w.page,
            ekv_dtype_name(o->w.dtype), o->alpha, (long long)o->steps);
    fprintf(out->text, "%-15s %8s %11s %11s %10s %11s %10s %12s %11s %10s %14s\n", "method",
            "budget", "kv_fraction", "delta_mean", "delta_max", "recall_mean", "recall_min",
            "rel_err_mean", "rel_err_max", "cosine_min", "bytes_fraction");
    if (out->json) fprintf(out->json, "[\n");
    int first = 1;
    for (int m = 0; m < V_COUNT; m++) {
        const eval_variant *v = &variants[m];
        for (int bi = 0; o->use[m] && bi < (v->budgeted ? o->nbudgets : 1); bi++) {
            const agg *a = &e->res[m][bi];
            const double n = (double)a->n;
            char bud[32] = "null";
            if (v->budgeted) snprintf(bud, sizeof bud, "%.8g", o->budgets[bi]);
            fprintf(out->text,
                    "%-15s %8s %11.5f %11.3e %10.3e %11.4f %10.4f %12.3e %11.3e %10.6f %14.5f\n",
                    v->name, v->budgeted ? bud : "-", a->kvf_sum / n, a->delta_sum / n,
                    a->delta_max, a->recall_sum / n, a->recall_min, a->err_sum / n, a->err_max,
                    a->cos_min, a->frac_n ? a->bytes_frac_sum / (double)a->frac_n : 0);
            if (out->json) report_json(e, v, a, bud, first, out->json);
            report_notes(e, v, a, out->text);
            first = 0;
        }
    }
    if (out->json) fprintf(out->json, "\n]\n");
    return cli_out_close(out, "eval");
}

static int eval_plot(const eval_opts *o) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "python3 '%s/bench/plot_eval.py' '%s' '%s'", EKV_SOURCE_DIR,
             o->w.json, o->plot);
    if (system(cmd) == 0) return 0;
    fprintf(stderr,
            "entmaxkv eval: plotting failed (needs python3 with matplotlib: pip install matplotlib)\n");
    return 1;
}

/* The workload cache, with the key codes of the first screened row that runs, and a second
 * one filled from the same random stream with the other width when both run (see the top of
 * this file); the tokens and K+V bytes of the sequences. */
static int eval_caches(eval_state *e) {
    const eval_opts *o = e->o;
    int32_t bits[2] = {0, 0};
    for (int m = 0, n = 0; m < V_COUNT; m++)
        if (o->use[m] && variants[m].code_bits) bits[n++] = variants[m].code_bits;
    const cli_rng r0 = e->rng;
    const wl_geometry g = {o->w.batch,           o->len, o->w.page, -1, o->w.dtype, bits[0],
                           wl_range_dtype(&o->w)};
    if (wl_setup_create(&e->s, e->ctx, &e->wl, &g, &e->rng, "eval")) return 1;
    if (bits[1]) {
        cli_rng r1 = r0;
        const wl_geometry g1 = {o->w.batch,           o->len, o->w.page, -1, o->w.dtype, bits[1],
                                wl_range_dtype(&o->w)};
        if (wl_setup_create(&e->sc, e->ctx, &e->wl, &g1, &r1, "eval")) return 1;
    }
    e->tokens = 0;
    for (int64_t b = 0; b < e->s.batch; b++) e->tokens += wl_setup_seq_len(&e->s, b);
    e->kv_bytes = 2 * e->tokens * o->w.kv_heads * o->w.dim * ekv_dtype_size(o->w.dtype);
    return 0;
}

/* The cache filled with the workload, the decode parameters and the buffers of a run. */
static int eval_open(eval_state *e) {
    eval_opts *o = e->o;
    int rc = cli_context("eval", o->w.threads, EKV_ISA_AUTO, &e->ctx);
    if (!rc)
        rc = wl_open(&e->wl, e->ctx, o->w.workload, o->w.heads, o->w.kv_heads, o->w.dim,
                     (uint64_t)o->w.seed, "eval");
    if (rc) return rc;
    if (o->w.wl == WL_TRACE) { /* the trace fixes the shapes */
        o->w.heads = e->wl.heads;
        o->w.kv_heads = e->wl.kv_heads;
        o->w.dim = e->wl.dim;
        o->len = e->wl.trace_len;
        if (o->len < 2) {
            fprintf(stderr, "entmaxkv eval: the trace has fewer than 2 tokens\n");
            return CLI_USAGE;
        }
    }
    cli_rng_seed(&e->rng, (uint64_t)o->w.seed * 104729 + (uint64_t)o->len);
    if (eval_caches(e)) return 1;
    for (int k = 0; k < 2; k++) {
        e->dp[k] = ekv_decode_default_params();
        e->dp[k].num_heads = (int32_t)o->w.heads;
        e->dp[k].alpha = k == 0 ? 1.0 : o->alpha;
        e->dp[k].alibi_slopes = wl_slopes(&e->wl);
    }
    const size_t nh = (size_t)(o->w.batch * o->w.heads), qn = nh * (size_t)o->w.dim;
    e->maxP = (o->len + o->w.page - 1) / o->w.page;
    e->q = malloc(sizeof(float) * qn);
    e->out = malloc(sizeof(float) * qn);
    e->oref[0] = malloc(sizeof(float) * qn);
    e->oref[1] = malloc(sizeof(float) * qn);
    e->pref[0] = malloc(sizeof(float) * nh * (size_t)o->len);
    e->pref[1] = malloc(sizeof(float) * nh * (size_t)o->len);
    e->tau_star = malloc(sizeof(double) * nh);
    e->tau_hat = malloc(sizeof(double) * nh);
    e->tau_c = malloc(sizeof(double) * nh);
    e->dbar = malloc(sizeof(double) * nh);
    e->bnd = malloc(sizeof(float) * nh * (size_t)e->maxP);
    e->r1 = malloc(sizeof(int32_t) * nh);
    e->r2 = malloc(sizeof(int32_t) * nh);
    e->inlist = malloc((size_t)o->len);
    if (e->q && e->out && e->oref[0] && e->oref[1] && e->pref[0] && e->pref[1] && e->tau_star &&
        e->tau_hat && e->tau_c && e->dbar && e->bnd && e->r1 && e->r2 && e->inlist)
        return 0;
    fprintf(stderr, "entmaxkv eval: out of memory\n");
    return 1;
}

static void eval_close(eval_state *e) {
    free(e->q);
    free(e->out);
    free(e->oref[0]);
    free(e->oref[1]);
    free(e->pref[0]);
    free(e->pref[1]);
    free(e->tau_star);
    free(e->tau_hat);
    free(e->tau_c);
    free(e->dbar);
    free(e->bnd);
    free(e->r1);
    free(e->r2);
    free(e->inlist);
    wl_setup_free(&e->s);
    wl_setup_free(&e->sc);
    wl_free(&e->wl);
    ekv_context_free(e->ctx);
}

int cmd_eval(int argc, char **argv) {
    eval_opts o;
    parse(argc, argv, &o);
    eval_state *e = calloc(1, sizeof *e); /* zeroed: the aggregates start empty */
    if (!e) {
        fprintf(stderr, "entmaxkv eval: out of memory\n");
        return 1;
    }
    e->o = &o;
    cli_out out; /* before the run: a bad --json path fails now, not after it */
    int rc = cli_out_open(&out, "eval", o.w.json);
    if (!rc) rc = eval_open(e);
    if (!rc) rc = eval_steps(e);
    if (!rc)
        rc = eval_report(e, &out);
    else
        cli_out_discard(&out);
    if (!rc && o.plot) rc = eval_plot(&o);
    eval_close(e);
    free(e);
    return rc;
}
