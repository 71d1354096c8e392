/*
 * entmaxkv eval: quality of sparse decoding at matched budgets (DESIGN 4, SPEC 5.6).
 *
 * For every step (a fresh set of queries over the same cache) and every query head it
 * computes the dense reference of the method's own distribution (entmax for entmax
 * methods, softmax for softmax-topk), runs the method, and measures:
 *   delta   dropped mass = reference probability of the tokens outside the selection
 *           (softmax-topk: in its own softmax distribution, as the issue asks);
 *   recall  |support* within the selection| / |support*| (softmax: the whole sequence is its
 *           support, so recall = fraction of tokens kept);
 *   rel_err ||o - o*|| / ||o*||, cosine(o, o*), and kv_fraction = tokens read / tokens.
 * Rows aggregate over steps and heads. --plot runs bench/plot_eval.py (matplotlib).
 */
#include "cli.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifndef EKV_SOURCE_DIR
#define EKV_SOURCE_DIR "."
#endif

enum { M_SOFTMAX_TOPK, M_ENTMAX_TOPK, M_GAUSSIAN, M_CERTIFIED, M_CERTIFIED_G, M_ORACLE, M_COUNT };
static const char *method_names[M_COUNT] = {"softmax-topk", "entmax-topk", "gaussian", "certified", "certified-gauss",
                                            "oracle"};
/* methods that choose their own number of pages: one row, no budget */
static int budget_free(int m) { return m == M_GAUSSIAN || m == M_ORACLE || m == M_CERTIFIED_G; }
static int is_certified(int m) { return m == M_CERTIFIED || m == M_CERTIFIED_G; }

static void json_num(char *buf, size_t n, double v, int valid) {
    if (valid) snprintf(buf, n, "%.8g", v);
    else snprintf(buf, n, "null");
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
            "  --alpha A             entmax alpha (default 1.5)\n"
            "  --methods LIST        comma list of softmax-topk, entmax-topk, gaussian, certified,\n"
            "                        certified-gauss, oracle (default all; certified's budget is\n"
            "                        its round 1; certified-gauss sizes round 1 from the gaussian\n"
            "                        tau-hat instead)\n"
            "  --tau-mode M          gaussian: exact | fixed | corrected (default exact)\n"
            "  --auto-margin         gaussian: the reference's automatic margin rule (SPEC 4.5)\n"
            "  --budgets LIST        comma list of fractions of the tokens, e.g. 1/64,1/16,1/4\n"
            "                        (default 1/64,1/16,1/4)\n"
            "  --steps N             query sets to average over (default 4)\n"
            "  --threads T --seed S  (defaults: all CPUs, 1)\n"
            "  --json FILE           write the rows as a JSON array\n"
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
    int64_t bytes_n, round2_lists, lists;
    double loose_sum;                   /* certified: share of pages whose bound exceeds tau* */
    double super_sum;                   /* certified: share of 16-page superpages whose every page
                                           bound is <= tau* (an upper limit on what superpages skip) */
    int64_t n;
} agg;

static void agg_add(agg *a, double delta, double recall, double err, double cosv, double kvf) {
    if (a->n == 0) { a->delta_max = delta; a->recall_min = recall; a->err_max = err; a->cos_min = cosv; }
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

static const char *need(int argc, char **argv, int *i) { return cli_need("eval", argc, argv, i); }

static int64_t need_int(int argc, char **argv, int *i, int64_t lo, int64_t hi) {
    return cli_need_int("eval", argc, argv, i, lo, hi);
}

int cmd_eval(int argc, char **argv) {
    const char *workload = "planted", *json = NULL, *plot = NULL;
    int64_t len = 32768, batch = 1, heads = 32, kv_heads = 8, dim = 128, page = 16, steps = 4, threads = 0, seed = 1;
    double alpha = 1.5, budgets[32] = {1.0 / 64, 1.0 / 16, 1.0 / 4};
    int nbudgets = 3, use[M_COUNT] = {1, 1, 1, 1, 1, 1}, auto_margin = 0;
    ekv_tau_mode tau_mode = EKV_TAU_EXACT;
    ekv_dtype dtype = EKV_DTYPE_F16;
    wl_kind wk = WL_PLANTED;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { eval_help(stdout); return 0; }
        else if (!strcmp(a, "--workload")) workload = need(argc, argv, &i);
        else if (!strcmp(a, "--len")) len = need_int(argc, argv, &i, 2, INT32_MAX);
        else if (!strcmp(a, "--batch")) batch = need_int(argc, argv, &i, 1, 64);
        else if (!strcmp(a, "--heads")) heads = need_int(argc, argv, &i, 1, 4096);
        else if (!strcmp(a, "--kv-heads")) kv_heads = need_int(argc, argv, &i, 1, 4096);
        else if (!strcmp(a, "--dim")) dim = need_int(argc, argv, &i, 1, 65536);
        else if (!strcmp(a, "--page")) page = need_int(argc, argv, &i, 1, 256);
        else if (!strcmp(a, "--steps")) steps = need_int(argc, argv, &i, 1, 100000);
        else if (!strcmp(a, "--threads")) threads = need_int(argc, argv, &i, 0, 1024);
        else if (!strcmp(a, "--seed")) seed = need_int(argc, argv, &i, 0, INT64_MAX);
        else if (!strcmp(a, "--json")) json = need(argc, argv, &i);
        else if (!strcmp(a, "--plot")) plot = need(argc, argv, &i);
        else if (!strcmp(a, "--auto-margin")) auto_margin = 1;
        else if (!strcmp(a, "--tau-mode")) {
            const char *v = need(argc, argv, &i);
            if (!strcmp(v, "exact")) tau_mode = EKV_TAU_EXACT;
            else if (!strcmp(v, "fixed")) tau_mode = EKV_TAU_FIXED;
            else if (!strcmp(v, "corrected")) tau_mode = EKV_TAU_CORRECTED;
            else cli_usage_error("eval", "--tau-mode %s: expected exact, fixed or corrected", v);
        }
        else if (!strcmp(a, "--dtype")) {
            const char *v = need(argc, argv, &i);
            if (ekv_dtype_from_name(v, &dtype)) cli_usage_error("eval", "--dtype %s: expected f32, f16 or bf16", v);
        } else if (!strcmp(a, "--alpha")) {
            const char *v = need(argc, argv, &i);
            if (cli_parse_double(v, &alpha) || !(alpha > 1.0 && alpha <= 4.0))
                cli_usage_error("eval", "--alpha %s: expected a number in (1, 4] (softmax-topk is a method)", v);
        } else if (!strcmp(a, "--methods")) {
            char buf[256];
            const char *v = need(argc, argv, &i);
            if (strlen(v) >= sizeof buf) cli_usage_error("eval", "--methods is too long");
            strcpy(buf, v);
            memset(use, 0, sizeof use);
            for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
                int found = 0;
                for (int m = 0; m < M_COUNT; m++)
                    if (!strcmp(t, method_names[m])) { use[m] = 1; found = 1; }
                if (!found)
                    cli_usage_error("eval", "unknown method '%s' (softmax-topk, entmax-topk, gaussian, certified, certified-gauss, oracle)", t);
            }
        } else if (!strcmp(a, "--budgets")) {
            char buf[512];
            const char *v = need(argc, argv, &i);
            if (strlen(v) >= sizeof buf) cli_usage_error("eval", "--budgets is too long");
            strcpy(buf, v);
            nbudgets = 0;
            for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
                if (nbudgets == 32) cli_usage_error("eval", "at most 32 budgets");
                if (cli_parse_fraction(t, &budgets[nbudgets]) || !(budgets[nbudgets] > 0 && budgets[nbudgets] <= 1))
                    cli_usage_error("eval", "budget '%s': expected a fraction in (0, 1]", t);
                nbudgets++;
            }
            if (!nbudgets) cli_usage_error("eval", "--budgets is empty");
        } else cli_usage_error("eval", "unknown option '%s'", a);
    }
    const int is_trace = !strncmp(workload, "trace:", 6);
    if (!is_trace && wl_parse(workload, &wk))
        cli_usage_error("eval", "--workload %s: expected random|planted|heavy|alibi|trace:FILE", workload);
    if (heads % kv_heads) cli_usage_error("eval", "--heads %lld is not a multiple of --kv-heads %lld", (long long)heads, (long long)kv_heads);

    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = (int32_t)threads;
    ekv_context *ctx;
    if (ekv_context_create(&cp, &ctx)) { fprintf(stderr, "entmaxkv eval: cannot create a context\n"); return 1; }
    wl_state wl;
    memset(&wl, 0, sizeof wl);
    if (is_trace) { /* the trace fixes the shapes */
        char err[512];
        if (wl_trace_open(&wl, ctx, workload + 6, err, sizeof err)) {
            fprintf(stderr, "entmaxkv eval: %s\n", err);
            wl_free(&wl);
            ekv_context_free(ctx);
            return 1;
        }
        if (batch != 1) cli_usage_error("eval", "traces hold one sequence: --batch must be 1");
        wk = WL_TRACE;
        heads = wl.heads; kv_heads = wl.kv_heads; dim = wl.dim; len = wl.trace_len;
        if (len < 2) cli_usage_error("eval", "the trace has fewer than 2 tokens");
    }
    ekv_cache_params pp = ekv_cache_default_params();
    pp.page_size = (int32_t)page; pp.num_kv_heads = (int32_t)kv_heads; pp.head_dim = (int32_t)dim;
    pp.dtype = dtype; pp.max_seqs = (int32_t)batch;
    pp.num_pages = ekv_cache_pages_for(len, batch, pp.page_size);
    ekv_cache *cache;
    ekv_status st = ekv_cache_create(ctx, &pp, &cache);
    if (st) { fprintf(stderr, "entmaxkv eval: %s: %s\n", ekv_status_string(st), ekv_last_error(ctx)); wl_free(&wl); ekv_context_free(ctx); return 1; }
    int32_t seqs[64];
    for (int64_t b = 0; b < batch; b++) ekv_cache_seq_new(cache, &seqs[b]);
    cli_rng rng;
    cli_rng_seed(&rng, (uint64_t)seed * 104729 + (uint64_t)len);
    int rc = 0;
    if ((!is_trace && wl_init(&wl, wk, heads, kv_heads, dim, (uint64_t)seed)) || wl_fill(ctx, cache, seqs, batch, len, &wl, &rng, "eval")) {
        rc = 1;
        goto out;
    }
    {
        ekv_paged_kv kv;
        ekv_page_stats pst;
        ekv_cache_kv_view(cache, &kv, &pst);
        int64_t need_ids, indptr[65];
        int32_t lpl[64];
        ekv_cache_page_table(cache, seqs, (int32_t)batch, NULL, NULL, 0, NULL, &need_ids);
        int32_t *indices = malloc(sizeof(int32_t) * (size_t)need_ids);
        ekv_cache_page_table(cache, seqs, (int32_t)batch, indptr, indices, need_ids, lpl, NULL);
        ekv_page_table tab = {(int32_t)batch, indptr, indices, lpl};
        const int64_t nh = batch * heads, qn = nh * dim;
        float *q = malloc(sizeof(float) * (size_t)qn), *o = malloc(sizeof(float) * (size_t)qn);
        float *oref[2] = {malloc(sizeof(float) * (size_t)qn), malloc(sizeof(float) * (size_t)qn)};
        float *pref[2] = {malloc(sizeof(float) * (size_t)(nh * len)), malloc(sizeof(float) * (size_t)(nh * len))};
        double *tau_star = malloc(sizeof(double) * (size_t)nh), *tau_hat = malloc(sizeof(double) * (size_t)nh);
        double *tau_c = malloc(sizeof(double) * (size_t)nh), *dbar = malloc(sizeof(double) * (size_t)nh);
        const int64_t maxP = (len + page - 1) / page;
        float *bnd = malloc(sizeof(float) * (size_t)(nh * maxP));
        int32_t *r1 = malloc(sizeof(int32_t) * (size_t)(batch * heads)), *r2 = malloc(sizeof(int32_t) * (size_t)(batch * heads));
        int64_t dense_bytes = 0;
        int64_t lcap = ekv_page_list_capacity(&tab, (int32_t)kv_heads);
        int64_t *lip = malloc(sizeof(int64_t) * (size_t)(batch * kv_heads + 1));
        int32_t *lpg = malloc(sizeof(int32_t) * (size_t)lcap);
        uint8_t *inlist = malloc((size_t)len);
        agg res[M_COUNT][32];
        memset(res, 0, sizeof res);
        ekv_decode_params dp[2];
        for (int s = 0; s < 2; s++) {
            dp[s] = ekv_decode_default_params();
            dp[s].num_heads = (int32_t)heads;
            dp[s].alpha = s == 0 ? 1.0 : alpha; /* 0: softmax, 1: entmax */
            dp[s].alibi_slopes = wl_slopes(&wl);
        }
        double t0 = cli_now_seconds(), last = t0;
        for (int64_t step = 0; step < steps && !rc; step++) {
            wl_queries(&wl, &rng, q, batch);
            {   /* the certified page bounds of this step (for delta_bar of every list) */
                ekv_select_params bs = ekv_select_default_params();
                bs.budget_tokens = 1;
                ekv_page_list bl = {.indptr = lip, .pages = lpg, .capacity = lcap, .bounds = bnd, .bounds_stride = maxP};
                if ((st = ekv_select_pages(ctx, &dp[1], &bs, &kv, &pst, &tab, q, &bl))) {
                    fprintf(stderr, "entmaxkv eval: bounds: %s\n", ekv_last_error(ctx));
                    rc = 1;
                    break;
                }
            }
            for (int s = 0; s < 2; s++) {
                ekv_decode_info di = {s == 1 ? tau_star : NULL, NULL, 0, 0};
                if (s == 1) di.bytes_k = 0;
                if ((st = ekv_decode_dense(ctx, &dp[s], &kv, &tab, q, oref[s], &di)) ||
                    (st = ekv_dense_probs(ctx, &dp[s], &kv, &tab, q, len, pref[s], NULL))) {
                    fprintf(stderr, "entmaxkv eval: dense reference: %s: %s\n", ekv_status_string(st), ekv_last_error(ctx));
                    rc = 1;
                    break;
                }
                if (s == 1) dense_bytes = di.bytes_k + di.bytes_v;
            }
            for (int m = 0; m < M_COUNT && !rc; m++) {
                if (!use[m]) continue;
                const int s = m == M_SOFTMAX_TOPK ? 0 : 1;
                for (int bi = 0; bi < nbudgets && !rc; bi++) {
                    if (budget_free(m) && bi > 0) break; /* no budget: one row */
                    ekv_select_params sp = ekv_select_default_params();
                    sp.method = m == M_ORACLE ? EKV_SELECT_ORACLE : m == M_GAUSSIAN ? EKV_SELECT_GAUSSIAN : EKV_SELECT_TOPK;
                    sp.tau_mode = tau_mode;
                    sp.auto_margin = auto_margin;
                    sp.budget_tokens = (int64_t)(budgets[bi] * (double)len);
                    if (sp.budget_tokens < 1) sp.budget_tokens = 1;
                    ekv_page_list list = {.indptr = lip, .pages = lpg, .capacity = lcap, .tau = tau_hat};
                    ekv_decode_info oi = {tau_c, NULL, 0, 0};
                    ekv_certified_info ci = {r1, r2, 0, 0, 0};
                    if (is_certified(m)) {
                        int64_t extra_summary = 0;
                        if (m == M_CERTIFIED_G) { /* round 1 from the gaussian tau-hat */
                            ekv_select_params gs = ekv_select_default_params();
                            gs.method = EKV_SELECT_GAUSSIAN;
                            st = ekv_select_pages(ctx, &dp[s], &gs, &kv, &pst, &tab, q, &list);
                            extra_summary = list.bytes_summary;
                            sp.tau_hint = tau_hat;
                        }
                        if (!st) st = ekv_decode_certified(ctx, &dp[s], &sp, &kv, &pst, &tab, q, o, &oi, &ci);
                        ci.bytes_summary += extra_summary;
                        if (!st) { /* rebuild the lists read, for the per-token metrics */
                            sp.method = EKV_SELECT_DENSE; /* certified equals dense: every metric is vs dense */
                            st = ekv_select_pages(ctx, &dp[s], &sp, &kv, &pst, &tab, q, &list);
                        }
                    } else {
                        st = ekv_select_pages(ctx, &dp[s], &sp, &kv, &pst, &tab, q, &list);
                        if (!st) st = ekv_decode_pages(ctx, &dp[s], &kv, &tab, &list, q, o, &oi);
                    }
                    if (st) {
                        fprintf(stderr, "entmaxkv eval: %s: %s: %s\n", method_names[m], ekv_status_string(st),
                                ekv_last_error(ctx));
                        rc = 1;
                        break;
                    }
                    agg *ag = &res[m][bi];
                    if (m != M_SOFTMAX_TOPK) { /* bytes read against dense entmax's */
                        double bytes = (double)(oi.bytes_k + oi.bytes_v + (is_certified(m) ? ci.bytes_summary : list.bytes_summary));
                        ag->bytes_ratio_sum += bytes / (double)dense_bytes;
                        ag->bytes_n++;
                    }
                    if (is_certified(m)) {
                        ag->round2_lists += ci.lists_round2;
                        ag->lists += batch * kv_heads;
                    }
                    /* delta_bar needs the exact tau over the list: entmax methods in exact mode */
                    const int has_bar = m == M_ENTMAX_TOPK || (m == M_GAUSSIAN && tau_mode == EKV_TAU_EXACT);
                    if (has_bar) {
                        list.bounds = bnd;
                        list.bounds_stride = maxP;
                        if ((st = ekv_delta_bound(ctx, &dp[s], &kv, &tab, &list, tau_c, dbar))) {
                            fprintf(stderr, "entmaxkv eval: delta_bar: %s\n", ekv_last_error(ctx));
                            rc = 1;
                            break;
                        }
                    }
                    for (int64_t b = 0; b < batch; b++) {
                        const int64_t N = (indptr[b + 1] - indptr[b] - 1) * page + lpl[b];
                        for (int64_t kh = 0; kh < kv_heads; kh++) {
                            memset(inlist, 0, (size_t)N);
                            int64_t kept = 0;
                            for (int64_t r = lip[b * kv_heads + kh]; r < lip[b * kv_heads + kh + 1]; r++)
                                for (int64_t t = lpg[r] * page; t < (lpg[r] + 1) * page && t < N; t++) {
                                    inlist[t] = 1;
                                    kept++;
                                }
                            if (is_certified(m)) { /* tokens of its two rounds (the last page is partial) */
                                const int64_t l = b * kv_heads + kh;
                                kept = (int64_t)(r1[l] + r2[l]) * page - (page - lpl[b]);
                            }
                            for (int64_t g = 0; g < heads / kv_heads; g++) {
                                const int64_t h = kh * (heads / kv_heads) + g, bh = b * heads + h;
                                const float *p = pref[s] + bh * len;
                                double dropped = 0, sup = 0, sup_in = 0, e2 = 0, r2 = 0, dot = 0, o2 = 0;
                                for (int64_t t = 0; t < N; t++) {
                                    if (!inlist[t]) dropped += p[t];
                                    if (p[t] > 0) { sup++; sup_in += inlist[t]; }
                                }
                                for (int64_t d = 0; d < dim; d++) {
                                    double x = o[bh * dim + d], y = oref[s][bh * dim + d];
                                    e2 += (x - y) * (x - y);
                                    r2 += y * y;
                                    o2 += x * x;
                                    dot += x * y;
                                }
                                double recall = s == 0 ? (double)kept / (double)N : sup > 0 ? sup_in / sup : 1.0;
                                double err = sqrt(e2 / (r2 > 0 ? r2 : 1)), cosv = dot / sqrt((o2 > 0 ? o2 : 1) * (r2 > 0 ? r2 : 1));
                                agg_add(&res[m][bi], dropped, recall, err, cosv, (double)kept / (double)N);
                                if (has_bar) {
                                    res[m][bi].bar_max = fmax(res[m][bi].bar_max, dbar[bh]);
                                    res[m][bi].bar_zero += dbar[bh] == 0;
                                    res[m][bi].bar_n++;
                                }
                                if (is_certified(m)) {
                                    res[m][bi].bar_zero++; /* proven exact */
                                    res[m][bi].bar_n++;
                                    /* bound tightness: pages no bound can rule out, at the true tau* */
                                    int64_t loose = 0, Pb = indptr[b + 1] - indptr[b];
                                    for (int64_t p = 0; p + 1 < Pb; p++) loose += (double)bnd[bh * maxP + p] > tau_star[bh];
                                    res[m][bi].loose_sum += Pb > 1 ? (double)loose / (double)(Pb - 1) : 0.0;
                                    int64_t sp_all = 0, sp_skip = 0;
                                    for (int64_t s0 = 0; s0 + 16 <= Pb - 1; s0 += 16) {
                                        int skip = 1;
                                        for (int64_t p = s0; p < s0 + 16 && skip; p++) skip = (double)bnd[bh * maxP + p] <= tau_star[bh];
                                        sp_all++;
                                        sp_skip += skip;
                                    }
                                    res[m][bi].super_sum += sp_all ? (double)sp_skip / (double)sp_all : 0.0;
                                }
                                if (m == M_GAUSSIAN) {
                                    double te = tau_hat[bh] - tau_star[bh];
                                    res[m][bi].tau_err_sum += te;
                                    if (fabs(te) > res[m][bi].tau_err_absmax) res[m][bi].tau_err_absmax = fabs(te);
                                }
                            }
                        }
                    }
                }
            }
            double now = cli_now_seconds();
            if (now - last > 2.0) {
                fprintf(stderr, "  eval: step %lld / %lld\n", (long long)(step + 1), (long long)steps);
                last = now;
            }
        }
        if (!rc) {
            printf("# eval workload=%s len=%lld B=%lld H=%lld Hk=%lld D=%lld page=%lld dtype=%s alpha=%g steps=%lld\n",
                   wl_name(wk), (long long)len, (long long)batch, (long long)heads, (long long)kv_heads, (long long)dim,
                   (long long)page, ekv_dtype_name(dtype), alpha, (long long)steps);
            printf("%-15s %8s %11s %11s %10s %11s %10s %12s %11s %10s\n", "method", "budget", "kv_fraction", "delta_mean",
                   "delta_max", "recall_mean", "recall_min", "rel_err_mean", "rel_err_max", "cosine_min");
            FILE *jf = json ? fopen(json, "w") : NULL;
            if (json && !jf) { fprintf(stderr, "entmaxkv eval: cannot write %s\n", json); rc = 1; }
            if (jf) fprintf(jf, "[\n");
            int first = 1;
            for (int m = 0; m < M_COUNT; m++) {
                if (!use[m]) continue;
                for (int bi = 0; bi < (budget_free(m) ? 1 : nbudgets); bi++) {
                    agg *a = &res[m][bi];
                    double n = (double)a->n;
                    char bud[32], jb[6][32];
                    json_num(jb[4], 32, a->loose_sum / n, is_certified(m));
                    json_num(jb[5], 32, a->super_sum / n, is_certified(m));
                    json_num(jb[0], 32, is_certified(m) ? 0.0 : a->bar_max, a->bar_n > 0);
                    json_num(jb[1], 32, a->bar_n ? (double)a->bar_zero / (double)a->bar_n : 0, a->bar_n > 0);
                    json_num(jb[2], 32, a->bytes_n ? a->bytes_ratio_sum / (double)a->bytes_n : 0, a->bytes_n > 0);
                    json_num(jb[3], 32, a->lists ? (double)a->round2_lists / (double)a->lists : 0, is_certified(m));
                    if (budget_free(m)) snprintf(bud, sizeof bud, "null");
                    else snprintf(bud, sizeof bud, "%.8g", budgets[bi]);
                    printf("%-15s %8s %11.5f %11.3e %10.3e %11.4f %10.4f %12.3e %11.3e %10.6f\n", method_names[m],
                           budget_free(m) ? "-" : bud, a->kvf_sum / n, a->delta_sum / n, a->delta_max, a->recall_sum / n, a->recall_min,
                           a->err_sum / n, a->err_max, a->cos_min);
                    if (jf)
                        fprintf(jf,
                                "%s  {\"method\":\"%s\",\"budget\":%s,\"kv_fraction\":%.8g,\"delta_mean\":%.8g,"
                                "\"delta_max\":%.8g,\"recall_mean\":%.8g,\"recall_min\":%.8g,\"rel_err_mean\":%.8g,"
                                "\"rel_err_max\":%.8g,\"cosine_min\":%.8g,\"workload\":\"%s\",\"len\":%lld,\"alpha\":%g,"
                                "\"heads\":%lld,\"kv_heads\":%lld,\"dim\":%lld,\"page\":%lld,\"dtype\":\"%s\",\"steps\":%lld,"
                                "\"samples\":%lld,\"tau_err_mean\":%.8g,\"tau_err_absmax\":%.8g,\"tau_mode\":\"%s\","
                                "\"delta_bound_max\":%s,\"certified_fraction\":%s,\"bytes_vs_dense_entmax\":%s,"
                                "\"round2_fraction\":%s,\"pages_bound_above_tau\":%s,\"superpages_skippable_max\":%s}",
                                first ? "" : ",\n", method_names[m], bud, a->kvf_sum / n, a->delta_sum / n,
                                a->delta_max, a->recall_sum / n, a->recall_min, a->err_sum / n, a->err_max, a->cos_min,
                                wl_name(wk), (long long)len, alpha, (long long)heads, (long long)kv_heads, (long long)dim,
                                (long long)page, ekv_dtype_name(dtype), (long long)steps, (long long)a->n,
                                m == M_GAUSSIAN ? a->tau_err_sum / n : 0.0, m == M_GAUSSIAN ? a->tau_err_absmax : 0.0,
                                m == M_GAUSSIAN ? (tau_mode == EKV_TAU_EXACT ? "exact" : tau_mode == EKV_TAU_FIXED ? "fixed" : "corrected") : "exact",
                                jb[0], jb[1], jb[2], jb[3], jb[4], jb[5]);
                    if (a->bar_n && !is_certified(m))
                        printf("%-15s delta_bar: max %.3e, proven exact (delta_bar = 0) in %.1f%% of head-steps; bytes %.3f of dense entmax\n",
                               "", a->bar_max, 100.0 * (double)a->bar_zero / (double)a->bar_n,
                               a->bytes_n ? a->bytes_ratio_sum / (double)a->bytes_n : 0);
                    if (is_certified(m))
                        printf("%-15s proven exact in every step; round 2 needed by %.1f%% of lists; bytes %.3f of dense entmax;\n"
                               "%-15s %.1f%% of pages have a bound above tau* (no bound-based method can skip them);\n"
                               "%-15s at most %.1f%% of 16-page superpages could be skipped (every page bound <= tau*)\n",
                               "", a->lists ? 100.0 * (double)a->round2_lists / (double)a->lists : 0,
                               a->bytes_n ? a->bytes_ratio_sum / (double)a->bytes_n : 0, "", 100.0 * a->loose_sum / n, "",
                               100.0 * a->super_sum / n);
                    if (m == M_GAUSSIAN)
                        printf("%-15s tau-hat - tau*: mean %.4f, max |.| %.4f (z-space; tau mode %s)\n", "", a->tau_err_sum / n,
                               a->tau_err_absmax, tau_mode == EKV_TAU_EXACT ? "exact" : tau_mode == EKV_TAU_FIXED ? "fixed" : "corrected");
                    first = 0;
                }
            }
            if (jf) { fprintf(jf, "\n]\n"); fclose(jf); }
            if (!rc && plot) {
                if (!json) { fprintf(stderr, "entmaxkv eval: --plot needs --json FILE (the plot reads it)\n"); rc = CLI_USAGE; }
                else {
                    char cmd[4096];
                    snprintf(cmd, sizeof cmd, "python3 '%s/bench/plot_eval.py' '%s' '%s'", EKV_SOURCE_DIR, json, plot);
                    int prc = system(cmd);
                    if (prc != 0) {
                        fprintf(stderr, "entmaxkv eval: plotting failed (needs python3 with matplotlib: pip install matplotlib)\n");
                        rc = 1;
                    }
                }
            }
        }
        free(indices); free(q); free(o); free(oref[0]); free(oref[1]); free(pref[0]); free(pref[1]);
        free(lip); free(lpg); free(inlist); free(tau_star); free(tau_hat); free(tau_c); free(dbar); free(bnd); free(r1);
        free(r2);
    }
out:
    wl_free(&wl);
    ekv_cache_free(cache);
    ekv_context_free(ctx);
    return rc;
}
