/*
 * entmaxkv bench: times the decode step (dense, or top-k selection + attention over the
 * selected pages) on a synthetic workload and reports bytes read, GB/s, and the ratio to a
 * read-bandwidth probe run in the same process (docs/math.md §5.5, contract in docs/cli.md).
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
            "                        certified, screened (page lists on the GPU),\n"
            "                        workloads random, planted and trace:FILE, K/V on the device)\n"
            "  --shards N            cuda: also the sharded plan with N shards on one GPU (local\n"
            "                        transport), against the one-GPU step\n"
            "  --gpus N              cuda: also the sharded plan over GPUs 0..N-1 (NCCL)\n"
            "  --shard-pools         with --shards/--gpus: each shard's GPU allocates and fills\n"
            "                        only its pages (a context larger than one GPU); the one-GPU\n"
            "                        step runs only when the whole pool fits GPU 0 (the output\n"
            "                        says which); prints each shard's bytes read and roofline\n"
            "  --ragged MIN          cuda: sequence b of the batch gets a length spread evenly\n"
            "                        from MIN to --len (a ragged batch)\n"
            "  --len N[,N...]        tokens per sequence (repeatable; k/M suffixes; default 131072)\n"
            "  --batch B             sequences (default 1)\n"
            "  --heads H             query heads (default 32)\n"
            "  --kv-heads HK         KV heads, must divide H (default 8)\n"
            "  --dim D               head dim (default 128)\n"
            "  --page P              page size, 1..256 (default 16)\n"
            "  --superpage S         pages per superpage summary, 0 = none (default 16; used by\n"
            "                        certified decode, CPU and CUDA)\n"
            "  --dtype f32|f16|bf16  K/V storage (default f16)\n"
            "  --ranges f32|f16|bf16 the page ranges (kmin/kmax) the bounds and the screen read\n"
            "                        (default: K's dtype when f16/bf16, exact and half the\n"
            "                        bytes of f32; narrower ones are rounded outward)\n"
            "  --alpha A             1 = softmax, (1, 4] entmax (default 1.5)\n"
            "  --method M            dense | topk | gaussian | certified | screened: dense\n"
            "                        attention, page selection (top-k by box bound, or the\n"
            "                        Gaussian-aware selector in its exact tau mode) + attention\n"
            "                        over the pages, certified decode (exact; --budget sizes its\n"
            "                        round 1), or screened decode (exact; per-token key codes rule\n"
            "                        tokens out, docs/math.md §10);\n"
            "                        oracle (evaluation only, cpu backend): the dense support's pages\n"
            "  --budget F            top-k: fraction of the tokens to read (default 1/16)\n"
            "  --budget-tokens T     top-k: token budget (overrides --budget)\n"
            "  --code-bits B         screened: 4 or 8 bits per key channel in the cache's key codes\n"
            "                        (default %d; the other methods' caches hold no codes)\n"
            "  --tensor-cores 0|1    cuda: scores on tensor cores where they apply (f16/bf16 K,\n"
            "                        head dim 64 or 128, page size a multiple of 16; default 1),\n"
            "                        and screened's screen for groups of 5..16 heads (up to 4\n"
            "                        take the faster CUDA-core screen)\n"
            "  --fused-attend 0|1    cuda: dense entmax's tau and values in one cooperative launch\n"
            "                        where it applies (the plan's fused_attend; default 0)\n"
            "  --overlap-launches -1|0|1  cuda: each kernel launched while the one before it\n"
            "                        runs (the plan's overlap_launches; default -1: where the\n"
            "                        GPU supports it)\n"
            "  --select-part-pages N cuda topk/certified: pages of a list one block of the\n"
            "                        top-k select ranks; a list of 6 such parts or more is\n"
            "                        ranked by several blocks of one cooperative launch (the\n"
            "                        plan's select_part_pages; default 0 = 2048)\n"
            "  --tau-cluster K       cuda entmax: a head listing more candidates than\n"
            "                        --tau-spread-min solved by a cluster of K blocks\n"
            "                        (2, 4 or 8; 0: one block; the plan's tau_cluster; default\n"
            "                        -1: 8 where the GPU supports clusters)\n"
            "  --tau-spread-min N    cuda entmax with tau clusters: a head listing more tau\n"
            "                        candidates than N is solved by its cluster, fewer by one\n"
            "                        block (the plan's tau_spread_min; default 0 = 4096)\n"
            "  --workload W          random | planted | heavy | alibi | trace:FILE[@PREFIX]\n"
            "                        (default random; a trace sets the shapes and the length)\n"
            "  --threads T           worker threads (default: all CPUs)\n"
            "  --iters N             timed steps (default 30, cuda at least 50; median reported)\n"
            "  --warmup N            untimed steps first (default 3)\n"
            "  --isa auto|scalar|avx2|avx512  SIMD level (default auto)\n"
            "  --seed S              random seed (default 1)\n"
            "  --json FILE           write one JSON object per length (a JSON array); FILE '-' =\n"
            "                        stdout, the table then goes to stderr\n"
            "  --help                this text\n"
            "\n"
            "bytes_read = page statistics read by the bound (top-k) or the screen (page ranges\n"
            "and key codes) + K bytes of the attended tokens + V bytes actually read (entmax:\n"
            "support rows only);\n"
            "kv_fraction = bytes_read / (K + V bytes of the sequences).\n",
            CLI_CODE_BITS_DEFAULT);
}

static const char *need(int argc, char **argv, int *i) { return cli_need("bench", argc, argv, i); }

static void parse_defaults(bench_opts *o) {
    memset(o, 0, sizeof *o);
    wl_opts_init(&o->w, "random");
    o->backend = EKV_BACKEND_CPU;
    o->method = EKV_SELECT_DENSE;
    o->iters = 30;
    o->warmup = 3;
    o->superpage = 16;
    o->alpha = 1.5;
    o->isa = EKV_ISA_AUTO;
    o->budget = 1.0 / 16;
    o->code_bits = CLI_CODE_BITS_DEFAULT;
    o->tensor_cores = 1;
    o->overlap_launches = -1; /* the plan's default: where the GPU supports it */
    o->tau_cluster = -1;      /* likewise */
}

/* Options whose value is a name or a number with its own range; 0 if a is none of them. */
static int parse_named(int argc, char **argv, int *i, bench_opts *o) {
    const char *a = argv[*i];
    if (!strcmp(a, "--backend")) {
        const char *v = need(argc, argv, i);
        if (ekv_backend_from_name(v, &o->backend))
            cli_usage_error("bench", "--backend %s: expected cpu, ref or cuda", v);
    } else if (!strcmp(a, "--method"))
        o->method = cli_need_method("bench", argc, argv, i);
    else if (!strcmp(a, "--code-bits"))
        o->code_bits = cli_need_code_bits("bench", argc, argv, i);
    else if (!strcmp(a, "--tensor-cores"))
        o->tensor_cores = (int32_t)cli_need_int("bench", argc, argv, i, 0, 1);
    else if (!strcmp(a, "--fused-attend"))
        o->fused_attend = (int32_t)cli_need_int("bench", argc, argv, i, 0, 1);
    else if (!strcmp(a, "--overlap-launches"))
        o->overlap_launches = (int32_t)cli_need_int("bench", argc, argv, i, -1, 1);
    else if (!strcmp(a, "--select-part-pages"))
        o->select_part_pages = cli_need_int("bench", argc, argv, i, 0, INT64_MAX);
    else if (!strcmp(a, "--tau-cluster")) /* -1, 0, 2, 4 or 8: the plan says which are refused */
        o->tau_cluster = (int32_t)cli_need_int("bench", argc, argv, i, -1, 8);
    else if (!strcmp(a, "--tau-spread-min"))
        o->tau_spread_min = cli_need_int("bench", argc, argv, i, 0, INT64_MAX);
    else if (!strcmp(a, "--len")) {
        const char *v = need(argc, argv, i);
        if (o->nlens == 64) cli_usage_error("bench", "--len: at most 64 lengths in all");
        const int n = cli_parse_i64_list("bench", "--len", v, o->lens + o->nlens, 64 - o->nlens);
        for (int k = 0; k < n; k++)
            if (o->lens[o->nlens + k] < 1) cli_usage_error("bench", "--len must be >= 1");
        o->nlens += n;
    } else if (!strcmp(a, "--budget")) {
        const char *v = need(argc, argv, i);
        if (cli_parse_fraction(v, &o->budget) || !(o->budget > 0 && o->budget <= 1))
            cli_usage_error("bench",
                            "--budget %s: expected a fraction in (0, 1], e.g. 0.0625 or 1/16", v);
    } else if (!strcmp(a, "--alpha")) {
        const char *v = need(argc, argv, i);
        if (cli_parse_double(v, &o->alpha) || !(o->alpha >= 1.0 && o->alpha <= 4.0))
            cli_usage_error("bench", "--alpha %s: expected a number in [1, 4]", v);
    } else if (!strcmp(a, "--isa")) {
        static const char *isas[] = {"auto", "scalar", "avx2", "avx512"};
        const char *v = need(argc, argv, i);
        int k = 0;
        while (k < 4 && strcmp(v, isas[k])) k++;
        if (k == 4) cli_usage_error("bench", "--isa %s: expected auto, scalar, avx2 or avx512", v);
        o->isa = (ekv_isa)k; /* the order of ekv_isa */
    } else
        return 0;
    return 1;
}

/* Checks between options; what a backend can run is the library's answer (bench_supported). */
static void parse_check(bench_opts *o) {
    if (!o->nlens) {
        o->lens[0] = 131072;
        o->nlens = 1;
    }
    if (o->backend == EKV_BACKEND_CUDA) {
        if (strcmp(o->w.workload, "random") && strcmp(o->w.workload, "planted") &&
            strncmp(o->w.workload, "trace:", 6))
            cli_usage_error("bench",
                            "--backend cuda: --workload %s: expected random, planted or trace:FILE",
                            o->w.workload);
        if ((o->shards || o->gpus) && !strncmp(o->w.workload, "trace:", 6))
            cli_usage_error("bench", "--shards/--gpus/--shard-pools: a synthetic workload "
                                     "(random, planted), which every GPU fills from the tokens' "
                                     "positions (a trace is one sequence on the host)");
        if (o->shards && o->gpus) cli_usage_error("bench", "--shards and --gpus: one of them");
        if (o->shard_pools && !o->shards && !o->gpus)
            cli_usage_error("bench", "--shard-pools: with --shards N or --gpus N");
    } else if (o->ragged_min || o->shards || o->gpus || o->shard_pools)
        cli_usage_error("bench",
                        "--ragged, --shards, --gpus and --shard-pools are for --backend cuda");
    wl_opts_check("bench", &o->w);
}

static const cli_opt bench_table[] = {
        CLI_INT("--ragged", bench_opts, ragged_min, 1, INT64_MAX),
        CLI_INT("--shards", bench_opts, shards, 1, 64),
        CLI_INT("--gpus", bench_opts, gpus, 1, 64),
        CLI_FLAG("--shard-pools", bench_opts, shard_pools),
        CLI_INT("--superpage", bench_opts, superpage, 0, EKV_MAX_SUPERPAGE_PAGES),
        CLI_INT("--iters", bench_opts, iters, 1, 1000000),
        CLI_INT("--warmup", bench_opts, warmup, 0, 1000000),
        CLI_INT("--budget-tokens", bench_opts, budget_tokens, 1, INT64_MAX),
};

static int bench_take(const char *sub, int argc, char **argv, int *i, void *vo) {
    bench_opts *o = vo;
    return parse_named(argc, argv, i, o) || wl_opt(sub, argc, argv, i, &o->w, 4096) ||
           cli_take(sub, bench_table, CLI_NOPTS(bench_table), argc, argv, i, o);
}

static void parse(int argc, char **argv, bench_opts *o) {
    parse_defaults(o);
    cli_parse("bench", argc, argv, bench_help, bench_take, o);
    parse_check(o);
}

int64_t bench_budget_tokens(const bench_opts *o, int64_t len) {
    int64_t t = o->budget_tokens ? o->budget_tokens : (int64_t)(o->budget * (double)len);
    return t < 1 ? 1 : t;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median_sorted(double *t, int64_t n) {
    qsort(t, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

/* What the timed steps of one length measured. */
typedef struct {
    double med, mn;        /* seconds per step */
    double bytes;          /* mean bytes read per step (K, V, page statistics) */
    double summary_bytes;  /* page statistics read by the bound stage (last step) */
    double sup_mean;       /* mean support per query head */
    double sel_med;        /* the bound + select stage alone, seconds (0 = not timed) */
    double surv_mean;      /* screened: mean survivors per query head and step */
    double pages_frac;     /* screened (cpu): pages touched / (pages x lists), mean per step */
    int64_t round2, steps; /* certified: lists that needed round 2, over every step */
} bench_result;

typedef struct {
    ekv_decode_params dp;
    ekv_select_params sp;
    float *q, *out;
    int64_t *sup;
    double *times;
} bench_bufs;

enum { NQ = 8 }; /* queries rotate so that no step repeats the previous one */

/* One decode step on the CPU backends: the library picks the method's stages (ekv_decode);
 * ref is the long-double dense reference (bench_supported admits dense only there). */
static ekv_status bench_step(ekv_context *ctx, const bench_opts *o, const bench_bufs *bb,
                             const wl_setup *s, const float *q, ekv_decode_info *info) {
    info->bytes_summary = 0;
    info->lists_round2 = 0;
    if (o->backend == EKV_BACKEND_REF)
        return ekv_decode_dense_ref(ctx, &bb->dp, &s->kv, &s->table, q, bb->out, info);
    return ekv_decode(ctx, &bb->dp, &bb->sp, &s->kv, &s->stats, &s->table, q, bb->out, info);
}

/* The decode and select parameters of the run (the budget is set per length). */
static void bench_params(const bench_opts *o, const wl_state *wl, ekv_decode_params *dp,
                         ekv_select_params *sp) {
    *dp = ekv_decode_default_params();
    dp->num_heads = (int32_t)o->w.heads;
    dp->alpha = o->alpha;
    dp->alibi_slopes = wl_slopes(wl);
    *sp = ekv_select_default_params();
    sp->method = o->method;
    sp->budget_tokens = 1;
}

/* Whether the backend runs this method with these parameters: the library's own check, so a
 * refusal is bad usage (exit 2) before any cache is filled. */
static int bench_supported(ekv_context *ctx, const bench_opts *o, const wl_state *wl) {
    ekv_decode_params dp;
    ekv_select_params sp;
    bench_params(o, wl, &dp, &sp);
    if (ekv_decode_supported(ctx, o->backend, &dp, &sp) == EKV_OK) return 0;
    fprintf(stderr, "entmaxkv bench: --backend %s --method %s: %s\n", ekv_backend_name(o->backend),
            ekv_method_name(o->method), ekv_last_error(ctx));
    return CLI_USAGE;
}

/* The bound + select stage alone, when the method has one that reads page statistics
 * (ekv_select_pages answers which): its median time, against its byte roofline. */
static int bench_select(ekv_context *ctx, const bench_opts *o, bench_bufs *bb, const wl_setup *s,
                        bench_result *r) {
    ekv_page_list list = wl_setup_list(s);
    if (ekv_select_pages(ctx, &bb->dp, &bb->sp, &s->kv, &s->stats, &s->table, bb->q, &list) ||
        !list.bytes_summary)
        return 0;
    for (int64_t it = 0; it < o->iters; it++) {
        const double t0 = cli_now_seconds();
        ekv_status st =
                ekv_select_pages(ctx, &bb->dp, &bb->sp, &s->kv, &s->stats, &s->table,
                                 bb->q + (it % NQ) * s->batch * o->w.heads * o->w.dim, &list);
        bb->times[it] = cli_now_seconds() - t0;
        if (st) {
            fprintf(stderr, "entmaxkv bench: select failed: %s: %s\n", ekv_status_string(st),
                    ekv_last_error(ctx));
            return 1;
        }
    }
    r->sel_med = median_sorted(bb->times, o->iters);
    return 0;
}

/* Warm-up and timed steps of one length. */
static int bench_time(ekv_context *ctx, const bench_opts *o, bench_bufs *bb, const wl_setup *s,
                      bench_result *r) {
    const int64_t nh = s->batch * o->w.heads, qn = nh * o->w.dim;
    ekv_decode_info info = {.support = bb->sup};
    double bytes_sum = 0, sup_sum = 0, surv_sum = 0, touched = 0;
    memset(r, 0, sizeof *r);
    for (int64_t it = 0; it < o->warmup + o->iters; it++) {
        const double t0 = cli_now_seconds();
        ekv_status st = bench_step(ctx, o, bb, s, bb->q + (it % NQ) * qn, &info);
        const double dt = cli_now_seconds() - t0;
        if (st) {
            fprintf(stderr, "entmaxkv bench: decode failed: %s: %s\n", ekv_status_string(st),
                    ekv_last_error(ctx));
            return 1;
        }
        r->round2 += info.lists_round2;
        if (it < o->warmup) continue;
        bb->times[it - o->warmup] = dt;
        r->summary_bytes = (double)info.bytes_summary;
        bytes_sum += (double)(info.bytes_k + info.bytes_v + info.bytes_summary);
        surv_sum += (double)info.survivors;
        touched += (double)info.pages_touched;
        for (int64_t i = 0; i < nh; i++) sup_sum += (double)bb->sup[i];
    }
    r->steps = o->warmup + o->iters;
    r->mn = bb->times[0];
    for (int64_t i = 1; i < o->iters; i++) r->mn = bb->times[i] < r->mn ? bb->times[i] : r->mn;
    r->med = median_sorted(bb->times, o->iters);
    r->bytes = bytes_sum / (double)o->iters;
    r->sup_mean = sup_sum / (double)(o->iters * nh);
    r->surv_mean = surv_sum / (double)(o->iters * nh);
    r->pages_frac = touched /
                    ((double)o->iters * (double)o->w.kv_heads * (double)s->table.indptr[s->batch]);
    return bench_select(ctx, o, bb, s, r);
}

/* The table row (and the JSON object) of one length; the probe runs here, after the steps. */
static void bench_report(ekv_context *ctx, const bench_opts *o, int li, int64_t len,
                         const bench_result *r, const cli_out *out) {
    const int threads = ekv_context_threads(ctx);
    const double kv_total = 2.0 * (double)(len * o->w.batch * o->w.kv_heads * o->w.dim *
                                           ekv_dtype_size(o->w.dtype));
    const double gbps = r->bytes / r->med / 1e9;
    /* probe over at least 256 MiB (beyond the last-level cache) */
    const double probe = cli_read_bandwidth_probe(
            threads, (int64_t)(r->bytes > 268435456.0 ? r->bytes : 268435456.0));
    const double ratio = probe > 0 ? gbps / probe : 0;
    /* the bound stage against its byte roofline: summary bytes / probe bandwidth */
    const double sel_roof = probe > 0 && r->summary_bytes > 0 && r->sel_med > 0
                                    ? r->sel_med / (r->summary_bytes / (probe * 1e9))
                                    : 0;
    const int codes = cli_method_codes(o->method);
    char surv[32] = "null", jn[9][32]; /* JSON numbers: null where not finite (cli_json_num) */
    if (codes) cli_json_num(surv, sizeof surv, "%.3f", r->surv_mean);
    fprintf(out->text, "%10lld %10.3f %10.3f %12.0f %9.2f %10.2f %9.3f %11.4f %9.1f\n",
            (long long)len, r->med * 1e3, r->mn * 1e3, r->bytes, gbps, probe, ratio,
            r->bytes / kv_total, r->sup_mean);
    if (o->method == EKV_SELECT_CERTIFIED) {
        const int64_t lists = r->steps * o->w.batch * o->w.kv_heads;
        fprintf(out->text,
                "%10s certified: round 2 needed by %.1f%% of lists (%lld of %lld, warm-up included)\n",
                "", 100.0 * (double)r->round2 / (double)lists, (long long)r->round2,
                (long long)lists);
    }
    if (codes)
        fprintf(out->text,
                "%10s screened: %d-bit key codes; %.1f tokens per query head survive the screen "
                "(%.3f%%); K rows read from %.2f%% of the (page, KV head) pairs\n",
                "", o->code_bits, r->surv_mean, 100.0 * r->surv_mean / (double)len,
                100.0 * r->pages_frac);
    if (o->method != EKV_SELECT_CERTIFIED && r->sel_med > 0)
        fprintf(out->text,
                "%10s select (bound + selection): %.3f ms median, %.0f summary bytes, %.2fx its byte roofline\n",
                "", r->sel_med * 1e3, r->summary_bytes, sel_roof);
    fflush(out->text);
    if (!out->json) return;
    fprintf(out->json,
            "%s  {\"backend\":\"%s\",\"method\":\"%s\",\"alpha\":%g,\"len\":%lld,\"batch\":%lld,"
            "\"heads\":%lld,\"kv_heads\":%lld,\"dim\":%lld,\"page\":%lld,\"dtype\":\"%s\","
            "\"ms_median\":%s,\"ms_min\":%s,\"bytes_read\":%.0f,\"gbps\":%s,"
            "\"kv_fraction\":%s,\"bw_probe_gbps\":%s,\"bw_ratio\":%s,\"threads\":%d,"
            "\"isa\":\"%s\",\"workload\":\"%s\",\"support_mean\":%s,\"iters\":%lld,"
            "\"budget_tokens\":%lld,\"ms_select_median\":%s,\"bytes_summary\":%.0f,"
            "\"select_roofline_ratio\":%s,\"code_bits\":%d,\"survivors_mean\":%s,"
            "\"ranges\":\"%s\"}",
            li ? ",\n" : "", ekv_backend_name(o->backend), ekv_method_name(o->method), o->alpha,
            (long long)len, (long long)o->w.batch, (long long)o->w.heads, (long long)o->w.kv_heads,
            (long long)o->w.dim, (long long)o->w.page, ekv_dtype_name(o->w.dtype),
            cli_json_num(jn[0], 32, "%.6f", r->med * 1e3),
            cli_json_num(jn[1], 32, "%.6f", r->mn * 1e3), r->bytes,
            cli_json_num(jn[2], 32, "%.4f", gbps),
            cli_json_num(jn[3], 32, "%.6f", r->bytes / kv_total),
            cli_json_num(jn[4], 32, "%.4f", probe), cli_json_num(jn[5], 32, "%.4f", ratio), threads,
            ekv_isa_name(ekv_context_isa(ctx)), o->w.workload,
            cli_json_num(jn[6], 32, "%.3f", r->sup_mean), (long long)o->iters,
            (long long)(o->method == EKV_SELECT_DENSE ? len : bench_budget_tokens(o, len)),
            cli_json_num(jn[7], 32, "%.6f", r->sel_med * 1e3), r->summary_bytes,
            cli_json_num(jn[8], 32, "%.4f", sel_roof), codes ? o->code_bits : 0, surv,
            ekv_dtype_name(wl_range_dtype(&o->w)));
}

/* One length: a fresh cache filled with the workload, the timed steps, the report. */
static int bench_length(ekv_context *ctx, const bench_opts *o, wl_state *wl, int li,
                        const cli_out *out) {
    const int64_t len = o->lens[li], qn = o->w.batch * o->w.heads * o->w.dim;
    cli_rng rng;
    cli_rng_seed(&rng, (uint64_t)o->w.seed * 7919 + (uint64_t)len);
    const wl_geometry g = {
            o->w.batch,           len,        o->w.page,
            o->superpage,         o->w.dtype, cli_method_codes(o->method) ? o->code_bits : 0,
            wl_range_dtype(&o->w)};
    wl_setup s;
    int rc = wl_setup_create(&s, ctx, wl, &g, &rng, "bench");
    bench_bufs bb;
    bench_params(o, wl, &bb.dp, &bb.sp);
    bb.sp.budget_tokens = bench_budget_tokens(o, len);
    bb.q = malloc(sizeof(float) * (size_t)(qn * NQ));
    bb.out = malloc(sizeof(float) * (size_t)qn);
    bb.sup = malloc(sizeof(int64_t) * (size_t)(o->w.batch * o->w.heads));
    bb.times = malloc(sizeof(double) * (size_t)o->iters);
    if (!rc && (!bb.q || !bb.out || !bb.sup || !bb.times)) {
        fprintf(stderr, "entmaxkv bench: out of memory\n");
        rc = 1;
    }
    bench_result r;
    if (!rc) {
        for (int i = 0; i < NQ; i++) wl_queries(wl, &rng, bb.q + i * qn, o->w.batch);
        rc = bench_time(ctx, o, &bb, &s, &r);
    }
    if (!rc) bench_report(ctx, o, li, len, &r, out);
    free(bb.q);
    free(bb.out);
    free(bb.sup);
    free(bb.times);
    wl_setup_free(&s);
    return rc;
}

static int bench_cpu(bench_opts *o) {
    ekv_context *ctx = NULL;
    wl_state wl;
    memset(&wl, 0, sizeof wl);
    int rc = cli_context("bench", o->w.threads, o->isa, &ctx);
    if (!rc)
        rc = wl_open(&wl, ctx, o->w.workload, o->w.heads, o->w.kv_heads, o->w.dim,
                     (uint64_t)o->w.seed, "bench");
    if (!rc && wl.kind == WL_TRACE) { /* the trace fixes the shapes and the length */
        o->w.heads = wl.heads;
        o->w.kv_heads = wl.kv_heads;
        o->w.dim = wl.dim;
        o->lens[0] = wl.trace_len;
        o->nlens = 1;
    }
    if (!rc) rc = bench_supported(ctx, o, &wl);
    cli_out out;
    if (!rc) rc = cli_out_open(&out, "bench", o->w.json);
    if (!rc) {
        fprintf(out.text,
                "# backend=%s isa=%s threads=%d method=%s alpha=%g dtype=%s B=%lld H=%lld Hk=%lld D=%lld page=%lld workload=%s\n",
                ekv_backend_name(o->backend), ekv_isa_name(ekv_context_isa(ctx)),
                ekv_context_threads(ctx), ekv_method_name(o->method), o->alpha,
                ekv_dtype_name(o->w.dtype), (long long)o->w.batch, (long long)o->w.heads,
                (long long)o->w.kv_heads, (long long)o->w.dim, (long long)o->w.page, o->w.workload);
        fprintf(out.text, "%10s %10s %10s %12s %9s %10s %9s %11s %9s\n", "len", "ms_median",
                "ms_min", "bytes_read", "GB/s", "probe_GB/s", "bw_ratio", "kv_fraction", "support");
        if (out.json) fprintf(out.json, "[\n");
        for (int li = 0; li < o->nlens && !rc; li++) rc = bench_length(ctx, o, &wl, li, &out);
        if (out.json) fprintf(out.json, "\n]\n");
        if (cli_out_close(&out, "bench") && !rc) rc = 1;
    }
    wl_free(&wl);
    ekv_context_free(ctx);
    return rc;
}

int cmd_bench(int argc, char **argv) {
    bench_opts o;
    parse(argc, argv, &o);
    return o.backend == EKV_BACKEND_CUDA ? cli_bench_cuda(&o) : bench_cpu(&o);
}
