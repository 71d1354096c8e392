/* What the model subcommands (run, ppl, trace) share: their common options, loading the
 * model with a message on failure, reading files, progress lines, and sampling the next token. */
#include "cli.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef EKV_SOURCE_DIR
#define EKV_SOURCE_DIR "."
#endif
/* Set by CMakeLists.txt: the installed data directory, and the same relative to the bindir. */
#ifndef EKV_DATA_DIR
#define EKV_DATA_DIR "/usr/local/share/entmaxkv"
#endif
#ifndef EKV_BIN_TO_DATA
#define EKV_BIN_TO_DATA "../share/entmaxkv"
#endif
#define EKV_MODEL_FILE "entmaxkv-lm.safetensors"
#define EKV_MODEL_ENV  "ENTMAXKV_MODEL"

void model_opts_init(model_opts *o) {
    memset(o, 0, sizeof *o);
    o->model = NULL;
    o->method = EKV_SELECT_DENSE;
    o->budget = 1.0 / 16;
    o->threads = 0;
    o->page = 16;
    o->kv_dtype = EKV_DTYPE_F16;
    o->code_bits = CLI_CODE_BITS_DEFAULT;
    o->overlap_launches = -1; /* where the GPU supports it (ekv_model_params) */
    o->tau_cluster = -1;      /* likewise */
    o->superpage = ekv_model_default_params().superpage_pages;
}

void model_opts_help(FILE *f) {
    fprintf(f,
            "  --model FILE          model weights (default: $" EKV_MODEL_ENV
            ", else " EKV_MODEL_FILE "\n"
            "                        from ./models/, then BIN/" EKV_BIN_TO_DATA "/ with BIN the\n"
            "                        directory of this program, then " EKV_DATA_DIR "/,\n"
            "                        then the source tree's models/)\n"
            "  --method M            dense | topk | gaussian | certified | screened (default dense):\n"
            "                        how each attention step reads the KV cache (certified and\n"
            "                        screened are exact: they equal dense; oracle, an\n"
            "                        evaluation method, is for eval and bench)\n"
            "  --budget F            topk: fraction of the tokens each step reads; certified: sizes\n"
            "                        its first round (default 1/16; with --backend cuda and\n"
            "                        superpages, round 0's bound picks the first round instead)\n"
            "  --code-bits B         screened: 4 or 8 bits per key channel in the caches' key codes\n"
            "                        (default %d; the other methods' caches hold no codes)\n"
            "  --threads T           worker threads (default: all CPUs)\n"
            "  --page P              KV cache page size, 1..256 (default 16)\n"
            "  --superpage S         pages per superpage summary of the KV caches, 0..%d;\n"
            "                        certified decode skips the summaries of superpages below\n"
            "                        the tau of the recent pages (round 0); 0 = none: no round\n"
            "                        0 (default 16; with --backend cuda every append also\n"
            "                        rebuilds the boxes it touches, for every method)\n"
            "  --kv-dtype f16|f32|bf16  KV cache storage (default f16)\n"
            "  --backend cpu|cuda    where the model runs (default cpu). cuda: weights and KV\n"
            "                        caches on the GPU; a dense prefill runs on tensor cores\n"
            "                        (exact entmax per query row); a prefill with any other\n"
            "                        --method runs that method's decode stages for every\n"
            "                        prompt token, as the CPU does (exact, but O(N^2) reads: slow\n"
            "                        at long prompts; prefill with dense and --compare the\n"
            "                        methods in decode instead)\n"
            "  --prefill-chunk N     cuda: query tokens per dense prefill block (default: as\n"
            "                        many as fit in 60%% of the free GPU memory, up to 4096)\n"
            "  --prefill-kernel K    cuda dense prefill: fused (S and P stay on the chip),\n"
            "                        hist (fused, histogram tau scheme: exact-size lists),\n"
            "                        gemm (cuBLAS over S and P in device memory) or auto\n"
            "                        (default: hist for f16/bf16 caches and head dim 64/128,\n"
            "                        else gemm); the prefill stats line says which ran\n"
            "  --no-graphs           cuda: decode steps as eager launches, not a CUDA graph\n"
            "  --prefill-candidates N  cuda fused prefill: tau candidates kept per query row,\n"
            "                        1..%d (default 32768 with hist, fewer where its pool\n"
            "                        passes a quarter of the free GPU memory; 4096 with\n"
            "                        fused; fewer make rows overflow: retries and Newton passes)\n"
            "  --prefill-compact N   cuda fused prefill: the fill at which a row's list is\n"
            "                        compacted inside the sweep, 1..%d (default 1024)\n"
            "  --decode-candidates N  cuda decode stages: tau candidates listed per query head,\n"
            "                        1..%d (default 16384; fewer take the slow paths)\n"
            "  --fused-attend 0|1    cuda dense decode: tau and the values in one cooperative\n"
            "                        launch where it applies (default 0: separate launches)\n"
            "  --tau-cluster K       cuda entmax decode: a head listing more than 4096 tau\n"
            "                        candidates solved by a cluster of K\n"
            "                        blocks (2, 4 or 8; compute capability 9.0; 0: one block;\n"
            "                        default -1: 8 where the GPU supports clusters)\n"
            "  --overlap-launches -1|0|1  cuda: launch each kernel of a step while the one\n"
            "                        before it runs (programmatic dependent launch; same\n"
            "                        results; 1 needs compute capability 9.0; default -1: on\n"
            "                        where the GPU supports it)\n"
            "                        (these nine are options of --backend cuda: with cpu\n"
            "                        they are bad usage)\n",
            CLI_CODE_BITS_DEFAULT, EKV_MAX_SUPERPAGE_PAGES, EKV_MODEL_MAX_PREFILL_CANDIDATES,
            EKV_MODEL_MAX_PREFILL_CANDIDATES, EKV_MODEL_MAX_DECODE_CANDIDATES);
}

static const cli_opt model_table[] = {
        CLI_STR("--model", model_opts, model),
        CLI_INT("--threads", model_opts, threads, 0, 1024),
        CLI_INT("--prefill-chunk", model_opts, prefill_chunk, 1, 1 << 20),
        CLI_FLAG("--no-graphs", model_opts, no_graphs),
        CLI_INT("--prefill-candidates", model_opts, prefill_candidates, 1,
                EKV_MODEL_MAX_PREFILL_CANDIDATES),
        CLI_INT("--prefill-compact", model_opts, prefill_compact, 1,
                EKV_MODEL_MAX_PREFILL_CANDIDATES),
        CLI_INT("--decode-candidates", model_opts, decode_candidates, 1,
                EKV_MODEL_MAX_DECODE_CANDIDATES),
        CLI_INT("--fused-attend", model_opts, fused_attend, 0, 1),
        CLI_INT("--tau-cluster", model_opts, tau_cluster, -1, 8),
        CLI_INT("--overlap-launches", model_opts, overlap_launches, -1, 1),
        CLI_INT("--superpage", model_opts, superpage, 0, EKV_MAX_SUPERPAGE_PAGES),
};

ekv_select_method model_method(const char *sub, const char *what, const char *name) {
    const ekv_select_method m = cli_method(sub, what, name);
    if (m == EKV_SELECT_ORACLE)
        cli_usage_error(sub,
                        "%s oracle: oracle is an evaluation method (eval, and bench on the cpu); "
                        "%s takes dense, topk, gaussian, certified or screened",
                        what, sub);
    return m;
}

int model_opt(const char *sub, int argc, char **argv, int *i, model_opts *o) {
    const char *a = argv[*i];
    if (cli_take(sub, model_table, CLI_NOPTS(model_table), argc, argv, i, o))
        return 1;
    else if (!strcmp(a, "--method"))
        o->method = model_method(sub, a, cli_need(sub, argc, argv, i));
    else if (!strcmp(a, "--code-bits"))
        o->code_bits = cli_need_code_bits(sub, argc, argv, i);
    else if (!strcmp(a, "--budget")) {
        const char *v = cli_need(sub, argc, argv, i);
        if (cli_parse_fraction(v, &o->budget) || !(o->budget > 0 && o->budget <= 1))
            cli_usage_error(sub, "--budget %s: expected a fraction in (0, 1], e.g. 1/16", v);
    } else if (!strcmp(a, "--page"))
        o->page = (int32_t)cli_need_int(sub, argc, argv, i, 1, 256);
    else if (!strcmp(a, "--prefill-kernel")) {
        const char *v = cli_need(sub, argc, argv, i);
        if (!strcmp(v, "auto"))
            o->prefill_kernel = EKV_PREFILL_AUTO;
        else if (!strcmp(v, "fused"))
            o->prefill_kernel = EKV_PREFILL_FUSED;
        else if (!strcmp(v, "gemm"))
            o->prefill_kernel = EKV_PREFILL_GEMM;
        else if (!strcmp(v, "hist"))
            o->prefill_kernel = EKV_PREFILL_FUSED_HIST;
        else
            cli_usage_error(sub, "--prefill-kernel %s: expected auto, fused, hist or gemm", v);
        o->prefill_kernel_set = 1;
    } else if (!strcmp(a, "--kv-dtype"))
        o->kv_dtype = cli_need_dtype(sub, argc, argv, i);
    else if (!strcmp(a, "--backend")) {
        const char *v = cli_need(sub, argc, argv, i);
        if (ekv_backend_from_name(v, &o->backend) || o->backend == EKV_BACKEND_REF)
            cli_usage_error(sub, "--backend %s: expected cpu or cuda", v);
    } else
        return 0;
    return 1;
}

typedef struct {
    model_opts *mo;
    const cli_opt *table;
    size_t n;
    cli_take_fn extra;
    void *opts;
} model_parse_args;

static int model_take(const char *sub, int argc, char **argv, int *i, void *va) {
    model_parse_args *a = va;
    return model_opt(sub, argc, argv, i, a->mo) ||
           cli_take(sub, a->table, a->n, argc, argv, i, a->opts) ||
           (a->extra && a->extra(sub, argc, argv, i, a->opts));
}

void model_parse(const char *sub, int argc, char **argv, void (*help)(FILE *), model_opts *mo,
                 const cli_opt *table, size_t n, cli_take_fn extra, void *opts) {
    model_parse_args a = {mo, table, n, extra, opts};
    cli_parse(sub, argc, argv, help, model_take, &a);
    /* the cpu backend has no such settings: no option is taken and then ignored */
    const char *cuda_only = mo->prefill_kernel_set      ? "--prefill-kernel"
                            : mo->prefill_chunk         ? "--prefill-chunk"
                            : mo->no_graphs             ? "--no-graphs"
                            : mo->prefill_candidates    ? "--prefill-candidates"
                            : mo->prefill_compact       ? "--prefill-compact"
                            : mo->decode_candidates     ? "--decode-candidates"
                            : mo->fused_attend          ? "--fused-attend"
                            : mo->tau_cluster >= 0      ? "--tau-cluster"
                            : mo->overlap_launches >= 0 ? "--overlap-launches"
                                                        : NULL;
    if (cuda_only && mo->backend != EKV_BACKEND_CUDA)
        cli_usage_error(sub, "%s is an option of --backend cuda (this run is on the %s backend)",
                        cuda_only, ekv_backend_name(mo->backend));
}

static int file_exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

enum { MODEL_PLACES = 4, MODEL_PATH_MAX = 4096 };

/* Where the shipped model is looked for when neither --model nor $ENTMAXKV_MODEL names one, in
 * order: the working directory (a source checkout), the install prefix this executable runs
 * from (so a prefix installed or moved anywhere works), the configured install prefix, the
 * source tree this binary was built from. Returns the number of places written. */
static int model_places(char places[MODEL_PLACES][MODEL_PATH_MAX]) {
    int n = 0;
    snprintf(places[n++], MODEL_PATH_MAX, "models/%s", EKV_MODEL_FILE);
    char exe[MODEL_PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    char *slash = NULL;
    if (len > 0) {
        exe[len] = 0;
        slash = strrchr(exe, '/');
    }
    if (slash) {
        *slash = 0;
        int w = snprintf(places[n], MODEL_PATH_MAX, "%s/%s/%s", exe, EKV_BIN_TO_DATA,
                         EKV_MODEL_FILE);
        if (w > 0 && w < MODEL_PATH_MAX) n++;
    }
    snprintf(places[n++], MODEL_PATH_MAX, "%s/%s", EKV_DATA_DIR, EKV_MODEL_FILE);
    snprintf(places[n++], MODEL_PATH_MAX, "%s/models/%s", EKV_SOURCE_DIR, EKV_MODEL_FILE);
    return n;
}

/* The model file to load: --model, else $ENTMAXKV_MODEL (both used as given, so a wrong one
 * fails loudly), else the first of model_places that exists. NULL, after saying where it
 * looked, when there is none. */
static const char *model_path(const char *sub, const model_opts *o) {
    static char places[MODEL_PLACES][MODEL_PATH_MAX];
    if (o->model) return o->model;
    const char *env = getenv(EKV_MODEL_ENV);
    if (env && *env) return env;
    const int n = model_places(places);
    for (int i = 0; i < n; i++)
        if (file_exists(places[i])) return places[i];
    fprintf(stderr,
            "entmaxkv %s: no model: give --model FILE or set %s; looked for the shipped model at:\n",
            sub, EKV_MODEL_ENV);
    for (int i = 0; i < n; i++) fprintf(stderr, "  %s\n", places[i]);
    return NULL;
}

int model_open(const char *sub, const model_opts *o, int64_t max_tokens, ekv_context **ctx,
               ekv_model **m) {
    const char *path = model_path(sub, o);
    *m = NULL;
    *ctx = NULL;
    if (!path) return 1;
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = (int32_t)o->threads;
    if (ekv_context_create(&cp, ctx)) {
        fprintf(stderr, "entmaxkv %s: cannot create a context\n", sub);
        return 1;
    }
    ekv_model_params mp = ekv_model_default_params();
    mp.max_tokens = max_tokens > 0 ? max_tokens : 1;
    mp.page_size = o->page;
    mp.kv_dtype = o->kv_dtype;
    mp.method = o->method;
    mp.budget = o->budget;
    mp.code_bits = model_code_bits(o);
    mp.backend = o->backend;
    mp.prefill_chunk = o->prefill_chunk;
    mp.cuda_graphs = !o->no_graphs;
    mp.prefill_kernel = o->prefill_kernel;
    mp.prefill_candidates = (int32_t)o->prefill_candidates;
    mp.prefill_compact = (int32_t)o->prefill_compact;
    mp.decode_candidates = (int32_t)o->decode_candidates;
    mp.fused_attend = (int32_t)o->fused_attend;
    mp.tau_cluster = (int32_t)o->tau_cluster;
    mp.overlap_launches = (int32_t)o->overlap_launches;
    mp.superpage_pages = (int32_t)o->superpage;
    mp.max_seqs = o->max_seqs > 0 ? o->max_seqs : 1;
    ekv_status st = ekv_model_load(*ctx, path, &mp, m);
    if (st) {
        fprintf(stderr, "entmaxkv %s: %s: %s: %s\n", sub, path, ekv_status_string(st),
                ekv_last_error(*ctx));
        ekv_context_free(*ctx);
        *ctx = NULL;
        return 1;
    }
    return 0;
}

int model_open_text(const char *sub, const model_opts *mo, const char *path, int64_t offset,
                    int64_t need, model_session *s) {
    memset(s, 0, sizeof *s);
    s->text = cli_read_file(path, &s->len);
    if (!s->text) {
        fprintf(stderr, "entmaxkv %s: cannot read '%s'\n", sub, path);
        return 1;
    }
    const int64_t left = s->len - offset;
    if (offset >= s->len || left < need)
        fprintf(stderr,
                "entmaxkv %s: '%s' has %lld bytes after offset %lld, fewer than --ctx %lld\n", sub,
                path, (long long)(left < 0 ? 0 : left), (long long)offset, (long long)need);
    else if (!model_open(sub, mo, need, &s->ctx, &s->m))
        return 0;
    model_close(s);
    return 1;
}

void model_close(model_session *s) {
    free(s->text);
    ekv_model_free(s->m);
    ekv_context_free(s->ctx);
    memset(s, 0, sizeof *s);
}

/* Texts are read whole, and a device such as /dev/zero never ends: reading stops (with a
 * message) at 1 GiB, already 2^30 tokens, the most any subcommand's --ctx takes. */
enum { CLI_MAX_FILE_LOG2 = 30 };

char *cli_read_file(const char *path, int64_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    struct stat sb;
    if (fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode)) {
        fprintf(stderr, "entmaxkv: '%s' is a directory, not a file\n", path);
        fclose(f);
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *b = malloc(cap + 1);
    for (;;) {
        if (!b) break;
        size_t got = fread(b + n, 1, cap - n, f);
        n += got;
        if (n < cap) break;
        if (cap >= (size_t)1 << CLI_MAX_FILE_LOG2) {
            fprintf(stderr, "entmaxkv: '%s' is larger than %d MiB, the limit for a text\n", path,
                    1 << (CLI_MAX_FILE_LOG2 - 20));
            free(b);
            b = NULL;
            break;
        }
        char *nb = realloc(b, 2 * cap + 1);
        if (!nb) {
            free(b);
            b = NULL;
            break;
        }
        b = nb;
        cap *= 2;
    }
    int err = ferror(f);
    fclose(f);
    if (!b || err) {
        free(b);
        return NULL;
    }
    b[n] = 0;
    *len = (int64_t)n;
    return b;
}

/* Runs tokens[0..n) through the model in chunks of 256, with progress on stderr when it takes
 * more than 2 s. For every chunk that reaches position logits_from, fn receives the chunk's
 * logits [c][vocab] (positions start .. start+c-1), so no caller holds n x vocab floats. */
int model_feed(const char *sub, const char *what, ekv_context *ctx, ekv_model *m,
               const int32_t *tokens, int64_t n, int64_t logits_from, model_logits_fn fn, void *arg,
               int64_t *fed) {
    return model_feed_seq(sub, what, ctx, m, 0, tokens, n, logits_from, fn, arg, fed);
}

int64_t model_feed_chunk(const ekv_model *m) {
    /* the CPU runs 64-token blocks, so 256 keeps the progress lines frequent; the GPU's dense
     * prefill wants thousands of query rows per block (its own chunking splits further) */
    return ekv_model_backend(m) == EKV_BACKEND_CUDA ? 4096 : 256;
}

int model_feed_seq(const char *sub, const char *what, ekv_context *ctx, ekv_model *m, int32_t seq,
                   const int32_t *tokens, int64_t n, int64_t logits_from, model_logits_fn fn,
                   void *arg, int64_t *fed) {
    const int64_t CHUNK = model_feed_chunk(m);
    const int64_t V = ekv_model_get_config(m)->vocab;
    float *logits = fn ? malloc(sizeof(float) * (size_t)(CHUNK * V)) : NULL;
    if (fn && !logits) {
        fprintf(stderr, "entmaxkv %s: out of memory\n", sub);
        return 1;
    }
    double t0 = cli_now_seconds(), last = t0;
    int rc = 0;
    if (fed) *fed = 0;
    for (int64_t i = 0; i < n && !rc; i += CHUNK) {
        const int64_t c = n - i < CHUNK ? n - i : CHUNK;
        const int want = fn && i + c > logits_from;
        ekv_status st = ekv_model_seq_step(m, seq, tokens + i, c, want ? logits : NULL);
        if (st) {
            fprintf(stderr, "entmaxkv %s: %s: %s\n", sub, ekv_status_string(st),
                    ekv_last_error(ctx));
            rc = 1;
            break;
        }
        if (want) fn(arg, i, c, logits);
        if (fed) *fed = i + c;
        double now = cli_now_seconds();
        if (now - last > 2.0) {
            const double rate = (double)(i + c) / (now - t0);
            fprintf(stderr, "  %s: %lld / %lld tokens (%.0f%%), %.0f tokens/s, ETA %.0f s\n", what,
                    (long long)(i + c), (long long)n, 100.0 * (double)(i + c) / (double)n, rate,
                    (double)(n - i - c) / rate);
            last = now;
        }
        if (i + c < n && cli_interrupted()) rc = 2;
    }
    free(logits);
    return rc;
}

int32_t model_sample(const float *logits, int64_t V, double temp, cli_rng *r) {
    int32_t best = 0;
    for (int64_t i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = (int32_t)i;
    if (temp <= 0) return best;
    double sum = 0, *p = malloc(sizeof(double) * (size_t)V);
    if (!p) return best;
    for (int64_t i = 0; i < V; i++) sum += p[i] = exp(((double)logits[i] - logits[best]) / temp);
    double u = cli_rng_uniform(r) * sum;
    int32_t pick = (int32_t)(V - 1);
    for (int64_t i = 0; i < V; i++) {
        u -= p[i];
        if (u <= 0) {
            pick = (int32_t)i;
            break;
        }
    }
    free(p);
    return pick;
}

int32_t model_code_bits(const model_opts *o) {
    return o->codes || cli_method_codes(o->method) ? o->code_bits : 0;
}

void model_phases_init(model_phases *p) {
    memset(p, 0, sizeof *p);
    p->n = 1; /* list[0] is --method, set by model_phases_finish */
}

/* --compare LIST: "method" or "method:budget" entries (budget -1: --budget's, filled in by
 * model_phases_finish, as --budget may come later on the command line). */
static void parse_compare(const char *sub, const char *v, model_phases *p) {
    char buf[256], *items[MODEL_MAX_PHASES];
    if (p->n == MODEL_MAX_PHASES)
        cli_usage_error(sub, "--compare takes at most %d methods", MODEL_MAX_PHASES - 1);
    const int n =
            cli_split_list(sub, "--compare", v, buf, sizeof buf, items, MODEL_MAX_PHASES - p->n);
    for (int k = 0; k < n; k++) {
        char *t = items[k];
        model_phase ph = {EKV_SELECT_DENSE, -1.0};
        char *colon = strchr(t, ':');
        if (colon) *colon = 0;
        ph.method = model_method(sub, "--compare", t);
        if (colon && !model_uses_budget(ph.method)) /* a budget it would not read */
            cli_usage_error(sub, "--compare %s:%s: %s takes no budget (topk and certified do)", t,
                            colon + 1, t);
        if (colon &&
            (cli_parse_fraction(colon + 1, &ph.budget) || !(ph.budget > 0 && ph.budget <= 1)))
            cli_usage_error(sub, "--compare %s:%s: expected a budget in (0, 1], e.g. 1/16", t,
                            colon + 1);
        p->list[p->n++] = ph;
    }
}

int model_phases_opt(const char *sub, int argc, char **argv, int *i, model_phases *p) {
    if (!strcmp(argv[*i], "--compare"))
        parse_compare(sub, cli_need(sub, argc, argv, i), p);
    else if (!strcmp(argv[*i], "--prefill-method")) {
        p->prefill = model_method(sub, "--prefill-method", cli_need(sub, argc, argv, i));
        p->prefill_set = 1;
    } else
        return 0;
    return 1;
}

void model_phases_finish(model_phases *p, model_opts *mo) {
    p->list[0] = (model_phase){mo->method, mo->budget};
    for (int k = 0; k < p->n; k++) {
        if (p->list[k].budget < 0) p->list[k].budget = mo->budget;
        mo->codes |= cli_method_codes(p->list[k].method);
    }
    if (p->prefill_set) mo->method = p->prefill; /* its codes: model_code_bits */
}

int model_set_phase(const char *sub, ekv_context *ctx, ekv_model *m, model_phase ph) {
    if (!ekv_model_set_method(m, ph.method, ph.budget)) return 0;
    fprintf(stderr, "entmaxkv %s: %s\n", sub, ekv_last_error(ctx));
    return 1;
}

int model_check_phases(const char *sub, ekv_context *ctx, ekv_model *m, const model_phase *list,
                       int n, const model_opts *mo) {
    for (int k = 0; k <= n; k++) /* k = n: back to the method the model loaded with */
        if (model_set_phase(sub, ctx, m, k < n ? list[k] : (model_phase){mo->method, mo->budget}))
            return 1;
    return 0;
}

int model_uses_budget(ekv_select_method m) {
    return m == EKV_SELECT_TOPK || m == EKV_SELECT_CERTIFIED;
}

void model_print_prefill_kernel(const ekv_model_stats *st) {
    if (!st->prefill_fused && !st->prefill_gemm) return;
    printf("; prefill kernel %s", st->prefill_fused && st->prefill_gemm ? "fused+gemm"
                                  : st->prefill_fused                   ? "fused"
                                                                        : "gemm");
    if (st->prefill_fused)
        printf(" (rows retried %lld, by Newton passes %lld, lists compacted %lld, tiles skipped "
               "%lld, unreached %lld)",
               (long long)st->prefill_retry_rows, (long long)st->prefill_newton_rows,
               (long long)st->prefill_compacted_rows, (long long)st->prefill_tiles_skipped,
               (long long)st->prefill_tiles_unreached);
}

void model_print_graph_steps(const ekv_model_stats *st) {
    if (st->graph_steps && st->steps)
        printf("; %.1f%% of the steps replayed from CUDA graphs",
               100.0 * (double)st->graph_steps / (double)st->steps);
}

void model_print_slow_paths(const ekv_model_stats *st) {
    if (st->tau_compacted_rows || st->tau_whole_rows)
        printf("; tau lists compacted %lld, over the whole row %lld",
               (long long)st->tau_compacted_rows, (long long)st->tau_whole_rows);
    if (st->screen_retry_rows || st->screen_all_rows)
        printf("; screen lists retried %lld, every token kept %lld",
               (long long)st->screen_retry_rows, (long long)st->screen_all_rows);
}

void model_method_label(char *buf, size_t n, ekv_select_method m, double budget) {
    if (model_uses_budget(m))
        snprintf(buf, n, "%s %g", ekv_method_name(m), budget);
    else
        snprintf(buf, n, "%s", ekv_method_name(m));
}

void model_keep_last_row(void *arg, int64_t start, int64_t c, const float *logits) {
    model_last_row *r = arg;
    if (r->pos >= start && r->pos < start + c)
        memcpy(r->out, logits + (r->pos - start) * r->V, sizeof(float) * (size_t)r->V);
}
