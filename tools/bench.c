/*
 * entmaxkv bench: times the decode step (dense, or top-k selection + attention over the
 * selected pages) on a synthetic workload and reports bytes read, GB/s, and the ratio to a
 * read-bandwidth probe run in the same process (BENCH.md).
 */
#include "cli.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static void bench_help(FILE *f) {
    fprintf(f,
            "usage: entmaxkv bench [options]\n"
            "\n"
            "Times one decode step (B sequences x H query heads) over a paged KV cache filled\n"
            "with a synthetic workload, and compares the achieved read bandwidth with a probe\n"
            "run in the same process.\n"
            "\n"
            "  --backend cpu|ref|cuda  backend (default cpu; ref = long-double reference, slow;\n"
            "                        cuda = the GPU backend: methods dense, topk, gaussian,\n"
            "                        certified,\n"
            "                        workloads random and planted, K/V filled on the device)\n"
            "  --ragged MIN          cuda: sequence b of the batch gets a length spread evenly\n"
            "                        from MIN to --len (a ragged batch)\n"
            "  --len N[,N...]        tokens per sequence (repeatable; k/M suffixes; default 131072)\n"
            "  --batch B             sequences (default 1)\n"
            "  --heads H             query heads (default 32)\n"
            "  --kv-heads HK         KV heads, must divide H (default 8)\n"
            "  --dim D               head dim (default 128)\n"
            "  --page P              page size, 1..256 (default 16)\n"
            "  --superpage S         pages per superpage summary, 0 = none (default 16; used by\n"
            "                        certified decode)\n"
            "  --dtype f32|f16|bf16  K/V storage (default f16)\n"
            "  --alpha A             1 = softmax, (1, 4] entmax (default 1.5)\n"
            "  --method M            dense | topk | gaussian | certified: dense attention, page\n"
            "                        selection (top-k by box bound, or the Gaussian-aware selector\n"
            "                        in its exact tau mode) + attention over the pages, or\n"
            "                        certified decode (exact; --budget sizes its round 1)\n"
            "  --budget F            top-k: fraction of the tokens to read (default 1/16)\n"
            "  --budget-tokens T     top-k: token budget (overrides --budget)\n"
            "  --workload W          random | planted | heavy | alibi | trace:FILE[@PREFIX]\n"
            "                        (default random; a trace sets the shapes and the length)\n"
            "  --threads T           worker threads (default: all CPUs)\n"
            "  --iters N             timed steps (default 30, cuda at least 50; median reported)\n"
            "  --warmup N            untimed steps first (default 3)\n"
            "  --isa auto|scalar|avx2|avx512  SIMD level (default auto)\n"
            "  --seed S              random seed (default 1)\n"
            "  --json FILE           write one JSON object per length (a JSON array)\n"
            "  --help                this text\n"
            "\n"
            "bytes_read = page statistics read by the bound (top-k) + K bytes of the attended\n"
            "tokens + V bytes actually read (entmax: support rows only);\n"
            "kv_fraction = bytes_read / (K + V bytes of the sequences).\n");
}

typedef struct {
    const char *backend, *method, *workload, *json;
    wl_kind wl;
    double budget;
    int64_t budget_tokens;
    int64_t lens[64];
    int nlens;
    int64_t batch, heads, kv_heads, dim, page, threads, iters, warmup, seed, superpage, ragged_min;
    ekv_dtype dtype;
    ekv_isa isa;
    double alpha;
} bench_opts;

static const char *need(int argc, char **argv, int *i) { return cli_need("bench", argc, argv, i); }

static int64_t need_int(int argc, char **argv, int *i, int64_t lo, int64_t hi) {
    return cli_need_int("bench", argc, argv, i, lo, hi);
}

static void parse(int argc, char **argv, bench_opts *o) {
    memset(o, 0, sizeof *o);
    o->backend = "cpu"; o->method = "dense"; o->workload = "random";
    o->batch = 1; o->heads = 32; o->kv_heads = 8; o->dim = 128; o->page = 16;
    o->threads = 0; o->iters = 30; o->warmup = 3; o->seed = 1; o->superpage = 16;
    o->dtype = EKV_DTYPE_F16; o->alpha = 1.5; o->isa = EKV_ISA_AUTO;
    o->budget = 1.0 / 16; o->budget_tokens = 0; o->wl = WL_RANDOM;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { bench_help(stdout); exit(0); }
        else if (!strcmp(a, "--backend")) o->backend = need(argc, argv, &i);
        else if (!strcmp(a, "--len")) {
            const char *v = need(argc, argv, &i);
            int n = cli_parse_i64_list(v, o->lens + o->nlens, 64 - o->nlens);
            if (n <= 0) cli_usage_error("bench", "--len %s: expected a comma list of positive integers", v);
            for (int k = 0; k < n; k++)
                if (o->lens[o->nlens + k] < 1) cli_usage_error("bench", "--len must be >= 1");
            o->nlens += n;
        }
        else if (!strcmp(a, "--ragged")) o->ragged_min = need_int(argc, argv, &i, 1, INT64_MAX);
        else if (!strcmp(a, "--batch")) o->batch = need_int(argc, argv, &i, 1, 4096);
        else if (!strcmp(a, "--heads")) o->heads = need_int(argc, argv, &i, 1, 4096);
        else if (!strcmp(a, "--kv-heads")) o->kv_heads = need_int(argc, argv, &i, 1, 4096);
        else if (!strcmp(a, "--dim")) o->dim = need_int(argc, argv, &i, 1, 65536);
        else if (!strcmp(a, "--page")) o->page = need_int(argc, argv, &i, 1, 256);
        else if (!strcmp(a, "--superpage")) o->superpage = need_int(argc, argv, &i, 0, 4096);
        else if (!strcmp(a, "--threads")) o->threads = need_int(argc, argv, &i, 0, 1024);
        else if (!strcmp(a, "--iters")) o->iters = need_int(argc, argv, &i, 1, 1000000);
        else if (!strcmp(a, "--warmup")) o->warmup = need_int(argc, argv, &i, 0, 1000000);
        else if (!strcmp(a, "--seed")) o->seed = need_int(argc, argv, &i, 0, INT64_MAX);
        else if (!strcmp(a, "--json")) o->json = need(argc, argv, &i);
        else if (!strcmp(a, "--method")) o->method = need(argc, argv, &i);
        else if (!strcmp(a, "--budget")) {
            const char *v = need(argc, argv, &i);
            if (cli_parse_fraction(v, &o->budget) || !(o->budget > 0 && o->budget <= 1))
                cli_usage_error("bench", "--budget %s: expected a fraction in (0, 1], e.g. 0.0625 or 1/16", v);
        } else if (!strcmp(a, "--budget-tokens")) o->budget_tokens = need_int(argc, argv, &i, 1, INT64_MAX);
        else if (!strcmp(a, "--workload")) o->workload = need(argc, argv, &i);
        else if (!strcmp(a, "--dtype")) {
            const char *v = need(argc, argv, &i);
            if (ekv_dtype_from_name(v, &o->dtype)) cli_usage_error("bench", "--dtype %s: expected f32, f16 or bf16", v);
        } else if (!strcmp(a, "--alpha")) {
            const char *v = need(argc, argv, &i);
            if (cli_parse_double(v, &o->alpha) || !(o->alpha >= 1.0 && o->alpha <= 4.0))
                cli_usage_error("bench", "--alpha %s: expected a number in [1, 4]", v);
        } else if (!strcmp(a, "--isa")) {
            const char *v = need(argc, argv, &i);
            if (!strcmp(v, "auto")) o->isa = EKV_ISA_AUTO;
            else if (!strcmp(v, "scalar")) o->isa = EKV_ISA_SCALAR;
            else if (!strcmp(v, "avx2")) o->isa = EKV_ISA_AVX2;
            else if (!strcmp(v, "avx512")) o->isa = EKV_ISA_AVX512;
            else cli_usage_error("bench", "--isa %s: expected auto, scalar, avx2 or avx512", v);
        } else cli_usage_error("bench", "unknown option '%s'", a);
    }
    if (!o->nlens) { o->lens[0] = 131072; o->nlens = 1; }
    if (strcmp(o->backend, "cpu") && strcmp(o->backend, "ref") && strcmp(o->backend, "cuda"))
        cli_usage_error("bench", "--backend %s: expected cpu, ref or cuda", o->backend);
    if (!strcmp(o->backend, "cuda")) {
        if (strcmp(o->workload, "random") && strcmp(o->workload, "planted"))
            cli_usage_error("bench", "--backend cuda: --workload %s: expected random or planted", o->workload);
    } else if (o->ragged_min)
        cli_usage_error("bench", "--ragged is for --backend cuda");
    if (strcmp(o->method, "dense") && strcmp(o->method, "topk") && strcmp(o->method, "gaussian") &&
        strcmp(o->method, "certified")) {
        cli_usage_error("bench", "--method %s: expected dense|topk|gaussian|certified", o->method);
    }
    if (!strncmp(o->workload, "trace:", 6)) {
        o->wl = WL_TRACE;
        if (o->batch != 1) cli_usage_error("bench", "traces hold one sequence: --batch must be 1");
    } else if (wl_parse(o->workload, &o->wl)) {
        cli_usage_error("bench", "--workload %s: expected random|planted|heavy|alibi|trace:FILE", o->workload);
    }
    if (o->heads % o->kv_heads)
        cli_usage_error("bench", "--heads %lld is not a multiple of --kv-heads %lld", (long long)o->heads, (long long)o->kv_heads);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int cmd_bench(int argc, char **argv) {
    bench_opts o;
    parse(argc, argv, &o);
    if (!strcmp(o.backend, "cuda")) {
        cuda_bench_opts co;
        memset(&co, 0, sizeof co);
        co.method = o.method; co.json = o.json; co.workload = o.workload;
        memcpy(co.lens, o.lens, sizeof co.lens);
        co.nlens = o.nlens;
        co.batch = o.batch; co.heads = o.heads; co.kv_heads = o.kv_heads; co.dim = o.dim; co.page = o.page;
        co.iters = o.iters < 50 ? 50 : o.iters; /* GPU protocol: median of >= 50 steps */
        co.warmup = o.warmup < 5 ? 5 : o.warmup;
        co.seed = o.seed; co.budget_tokens = o.budget_tokens; co.ragged_min = o.ragged_min;
        co.budget = o.budget; co.alpha = o.alpha; co.dtype = o.dtype;
        return cli_bench_cuda(&co);
    }
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = (int32_t)o.threads;
    cp.isa = o.isa;
    ekv_context *ctx;
    ekv_status st = ekv_context_create(&cp, &ctx);
    if (st == EKV_ERR_UNSUPPORTED) {
        fprintf(stderr, "entmaxkv bench: --isa %s is not supported by this CPU\n", ekv_isa_name(o.isa));
        return CLI_USAGE;
    }
    if (st) { fprintf(stderr, "entmaxkv bench: cannot create a context: %s\n", ekv_status_string(st)); return 1; }
    wl_state trace_wl; /* a trace is opened once: it fixes the shapes and the length */
    memset(&trace_wl, 0, sizeof trace_wl);
    if (o.wl == WL_TRACE) {
        char err[512];
        if (wl_trace_open(&trace_wl, ctx, o.workload + 6, err, sizeof err)) {
            fprintf(stderr, "entmaxkv bench: %s\n", err);
            wl_free(&trace_wl);
            ekv_context_free(ctx);
            return 1;
        }
        o.heads = trace_wl.heads; o.kv_heads = trace_wl.kv_heads; o.dim = trace_wl.dim;
        o.lens[0] = trace_wl.trace_len;
        o.nlens = 1;
    }
    const int threads = ekv_context_threads(ctx);
    FILE *jf = NULL;
    if (o.json) {
        jf = fopen(o.json, "w");
        if (!jf) { fprintf(stderr, "entmaxkv bench: cannot write %s\n", o.json); ekv_context_free(ctx); return 1; }
        fprintf(jf, "[\n");
    }
    printf("# backend=%s isa=%s threads=%d method=%s alpha=%g dtype=%s B=%lld H=%lld Hk=%lld D=%lld page=%lld workload=%s\n",
           o.backend, ekv_isa_name(ekv_context_isa(ctx)), threads, o.method, o.alpha, ekv_dtype_name(o.dtype),
           (long long)o.batch, (long long)o.heads, (long long)o.kv_heads, (long long)o.dim, (long long)o.page, o.workload);
    printf("%10s %10s %10s %12s %9s %10s %9s %11s %9s\n", "len", "ms_median", "ms_min", "bytes_read",
           "GB/s", "probe_GB/s", "bw_ratio", "kv_fraction", "support");
    int rc = 0;
    for (int li = 0; li < o.nlens && !rc; li++) {
        const int64_t len = o.lens[li];
        ekv_cache_params pp = ekv_cache_default_params();
        pp.page_size = (int32_t)o.page;
        pp.num_kv_heads = (int32_t)o.kv_heads;
        pp.head_dim = (int32_t)o.dim;
        pp.dtype = o.dtype;
        pp.max_seqs = (int32_t)o.batch;
        pp.superpage_pages = (int32_t)o.superpage;
        pp.num_pages = ekv_cache_pages_for(len, o.batch, pp.page_size);
        ekv_cache *cache;
        st = ekv_cache_create(ctx, &pp, &cache);
        if (st) { fprintf(stderr, "entmaxkv bench: %s: %s\n", ekv_status_string(st), ekv_last_error(ctx)); rc = 1; break; }
        int32_t *seqs = malloc(sizeof(int32_t) * (size_t)o.batch);
        for (int64_t b = 0; b < o.batch; b++) ekv_cache_seq_new(cache, &seqs[b]);
        cli_rng rng;
        cli_rng_seed(&rng, (uint64_t)o.seed * 7919 + (uint64_t)len);
        wl_state wl;
        if (o.wl == WL_TRACE) {
            wl = trace_wl;
            trace_wl.trace = NULL; /* ownership moves to wl (freed with it) */
            trace_wl.slopes = NULL;
        } else if (wl_init(&wl, o.wl, o.heads, o.kv_heads, o.dim, (uint64_t)o.seed)) { rc = 1; wl_free(&wl); goto next; }
        if (wl_fill(ctx, cache, seqs, o.batch, len, &wl, &rng, "bench")) { rc = 1; wl_free(&wl); goto next; }
        {
            ekv_paged_kv kv;
            ekv_cache_kv_view(cache, &kv, NULL);
            int64_t needed;
            ekv_cache_page_table(cache, seqs, (int32_t)o.batch, NULL, NULL, 0, NULL, &needed);
            int64_t *indptr = malloc(sizeof(int64_t) * (size_t)(o.batch + 1));
            int32_t *indices = malloc(sizeof(int32_t) * (size_t)needed), *lpl = malloc(sizeof(int32_t) * (size_t)o.batch);
            ekv_cache_page_table(cache, seqs, (int32_t)o.batch, indptr, indices, needed, lpl, NULL);
            ekv_page_table tab = {(int32_t)o.batch, indptr, indices, lpl};
            enum { NQ = 8 }; /* rotate queries so no step repeats the previous one */
            const int64_t qn = o.batch * o.heads * o.dim;
            float *q = malloc(sizeof(float) * (size_t)(qn * NQ)), *out = malloc(sizeof(float) * (size_t)qn);
            int64_t *sup = malloc(sizeof(int64_t) * (size_t)(o.batch * o.heads));
            double *times = malloc(sizeof(double) * (size_t)o.iters);
            for (int i = 0; i < NQ; i++) wl_queries(&wl, &rng, q + i * qn, o.batch);
            ekv_decode_params dp = ekv_decode_default_params();
            dp.num_heads = (int32_t)o.heads;
            dp.alpha = o.alpha;
            dp.alibi_slopes = wl_slopes(&wl);
            ekv_decode_info info = {NULL, sup, 0, 0};
            double bytes_sum = 0, sup_sum = 0, summary_bytes = 0;
            int64_t round2 = 0;
            double *tsel = malloc(sizeof(double) * (size_t)o.iters);
            int is_ref = !strcmp(o.backend, "ref"), sparse = strcmp(o.method, "dense") != 0; /* topk, gaussian or certified */
            ekv_page_stats pst;
            ekv_cache_kv_view(cache, NULL, &pst);
            ekv_select_params sp = ekv_select_default_params();
            sp.method = !strcmp(o.method, "gaussian") ? EKV_SELECT_GAUSSIAN : EKV_SELECT_TOPK;
            sp.budget_tokens = o.budget_tokens ? o.budget_tokens : (int64_t)(o.budget * (double)len);
            if (sp.budget_tokens < 1) sp.budget_tokens = 1;
            int64_t lcap = ekv_page_list_capacity(&tab, (int32_t)o.kv_heads);
            int64_t *lip = malloc(sizeof(int64_t) * (size_t)(o.batch * o.kv_heads + 1));
            int32_t *lpg = malloc(sizeof(int32_t) * (size_t)lcap);
            ekv_page_list list = {.indptr = lip, .pages = lpg, .capacity = lcap};
            if (sparse && is_ref) {
                fprintf(stderr, "entmaxkv bench: --backend ref times dense decode only\n");
                rc = CLI_USAGE;
            }
            for (int64_t it = 0; !rc && it < o.warmup + o.iters; it++) {
                const float *qi = q + (it % NQ) * qn;
                double t0 = cli_now_seconds();
                double ts = 0;
                if (!strcmp(o.method, "certified")) {
                    ekv_certified_info ci = {NULL, NULL, 0, 0, 0};
                    st = ekv_decode_certified(ctx, &dp, &sp, &kv, &pst, &tab, qi, out, &info, &ci);
                    list.bytes_summary = ci.bytes_summary;
                    round2 += ci.lists_round2;
                } else if (sparse) {
                    st = ekv_select_pages(ctx, &dp, &sp, &kv, &pst, &tab, qi, &list);
                    ts = cli_now_seconds() - t0;
                    if (!st) st = ekv_decode_pages(ctx, &dp, &kv, &tab, &list, qi, out, &info);
                } else {
                    list.bytes_summary = 0;
                    st = is_ref ? ekv_decode_dense_ref(ctx, &dp, &kv, &tab, qi, out, &info)
                                : ekv_decode_dense(ctx, &dp, &kv, &tab, qi, out, &info);
                }
                double dt = cli_now_seconds() - t0;
                if (st) {
                    fprintf(stderr, "entmaxkv bench: decode failed: %s: %s\n", ekv_status_string(st), ekv_last_error(ctx));
                    rc = 1;
                    break;
                }
                if (it >= o.warmup) {
                    times[it - o.warmup] = dt;
                    tsel[it - o.warmup] = ts;
                    summary_bytes = (double)list.bytes_summary;
                    bytes_sum += (double)(info.bytes_k + info.bytes_v + list.bytes_summary);
                    for (int64_t i = 0; i < o.batch * o.heads; i++) sup_sum += (double)sup[i];
                }
            }
            if (!rc) {
                qsort(times, (size_t)o.iters, sizeof(double), cmp_double);
                double med = times[o.iters / 2], mn = times[0];
                if (o.iters % 2 == 0) med = 0.5 * (times[o.iters / 2 - 1] + times[o.iters / 2]);
                double bytes = bytes_sum / (double)o.iters;
                double kv_total = 2.0 * (double)(len * o.batch * o.kv_heads * o.dim * ekv_dtype_size(o.dtype));
                double gbps = bytes / med / 1e9;
                /* probe over at least 256 MiB (beyond the last-level cache) */
                int64_t probe_bytes = (int64_t)(bytes > 268435456.0 ? bytes : 268435456.0);
                double probe = cli_read_bandwidth_probe(threads, probe_bytes);
                double ratio = probe > 0 ? gbps / probe : 0;
                /* the bound stage against its byte roofline: summary bytes / probe bandwidth */
                qsort(tsel, (size_t)o.iters, sizeof(double), cmp_double);
                double sel_med = tsel[o.iters / 2];
                double sel_roof = probe > 0 && summary_bytes > 0 ? sel_med / (summary_bytes / (probe * 1e9)) : 0;
                double sup_mean = sup_sum / (double)(o.iters * o.batch * o.heads);
                printf("%10lld %10.3f %10.3f %12.0f %9.2f %10.2f %9.3f %11.4f %9.1f\n", (long long)len, med * 1e3,
                       mn * 1e3, bytes, gbps, probe, ratio, bytes / kv_total, sup_mean);
                fflush(stdout);
                if (jf)
                    fprintf(jf,
                            "%s  {\"backend\":\"%s\",\"method\":\"%s\",\"alpha\":%g,\"len\":%lld,\"batch\":%lld,"
                            "\"heads\":%lld,\"kv_heads\":%lld,\"dim\":%lld,\"page\":%lld,\"dtype\":\"%s\","
                            "\"ms_median\":%.6f,\"ms_min\":%.6f,\"bytes_read\":%.0f,\"gbps\":%.4f,"
                            "\"kv_fraction\":%.6f,\"bw_probe_gbps\":%.4f,\"bw_ratio\":%.4f,\"threads\":%d,"
                            "\"isa\":\"%s\",\"workload\":\"%s\",\"support_mean\":%.3f,\"iters\":%lld,"
                            "\"budget_tokens\":%lld,\"ms_select_median\":%.6f,\"bytes_summary\":%.0f,"
                            "\"select_roofline_ratio\":%.4f}",
                            li ? ",\n" : "", o.backend, o.method, o.alpha, (long long)len, (long long)o.batch,
                            (long long)o.heads, (long long)o.kv_heads, (long long)o.dim, (long long)o.page,
                            ekv_dtype_name(o.dtype), med * 1e3, mn * 1e3, bytes, gbps, bytes / kv_total, probe,
                            ratio, threads, ekv_isa_name(ekv_context_isa(ctx)), o.workload, sup_mean,
                            (long long)o.iters, (long long)(sparse ? sp.budget_tokens : len), sel_med * 1e3,
                            summary_bytes, sel_roof);
                if (!strcmp(o.method, "certified"))
                    printf("%10s certified: round 2 needed by %.1f%% of lists (%lld of %lld, warm-up included)\n", "",
                           100.0 * (double)round2 / (double)((o.warmup + o.iters) * o.batch * o.kv_heads), (long long)round2,
                           (long long)((o.warmup + o.iters) * o.batch * o.kv_heads));
                else if (sparse)
                    printf("%10s select (bound + selection): %.3f ms median, %.0f summary bytes, %.2fx its byte roofline\n",
                           "", sel_med * 1e3, summary_bytes, sel_roof);
            }
            free(indptr); free(indices); free(lpl); free(q); free(out); free(sup); free(times); free(lip); free(lpg); free(tsel);
        }
        wl_free(&wl);
    next:
        free(seqs);
        ekv_cache_free(cache);
    }
    if (jf) { fprintf(jf, "\n]\n"); fclose(jf); }
    wl_free(&trace_wl);
    ekv_context_free(ctx);
    return rc;
}
