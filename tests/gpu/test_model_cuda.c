/*
 * The model on the GPU against the CPU engine (docs/architecture.md, "The model on the GPU"):
 * the shipped model, the same text through both engines, for each method the GPU serves
 * (dense, topk, certified, screened): the logits after every prefill token and after each of
 * DECODE greedy decode steps agree within 1e-3 of the row's largest |logit| and have the same
 * argmax (a row whose CPU top two are within 1e-4 of each other is reported as a tie, not
 * failed: rounding may order them either way), then a block of MORE tokens that starts inside
 * a page. The tiny test model (head dim 8) takes the backend's other kernels. Dense prefill runs on
 * tensor cores in blocks of 256 query tokens (so several blocks, and key counts off the multiple of
 * 16) and with the automatic block; f32 and bf16 caches take the other part counts of the GEMMs'
 * split (docs/math.md §12). Also: a graph-replayed decode equals eager launches; reset then prefill
 * again gives the first run's logits; the host mirror of a layer cache and the last queries
 * match the CPU's; batched decode of sequences of different lengths (ekv_model_batch_step)
 * matches each sequence run alone on the CPU; batched steps replayed from CUDA graphs equal eager
 * launches bitwise as batch sizes, sequences and methods change (check_graph_replay); gaussian
 * runs (the ALiBi mixture on the GPU), oracle is refused; the fused dense
 * prefill against the GEMM path and the CPU (check_fused). Exit 77 when no CUDA device is
 * present.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include "core/internal.h" /* ekv_f16_to_f32 */
#include <cuda_runtime.h>  /* the small device of check_pool_on_small_device */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#ifndef EKV_SOURCE_DIR
#define EKV_SOURCE_DIR "."
#endif
#define MODEL EKV_SOURCE_DIR "/models/entmaxkv-lm.safetensors"
#define TINY  EKV_SOURCE_DIR "/tests/data/tiny_model.safetensors" /* head_dim 8: other kernels */
#define TEXT  EKV_SOURCE_DIR "/docs/architecture.md"

enum { PREFILL = 700, DECODE = 24, MORE = 40, V = 256 };

static int32_t argmax(const float *r) {
    int32_t b = 0;
    for (int i = 1; i < V; i++)
        if (r[i] > r[b]) b = i;
    return b;
}

/* rows of gpu against cpu; returns the worst relative difference */
/* Lossy methods (topk, gaussian) choose pages by bounds of keys the two engines round
 * differently, so a near-tied page can flip and move a row's logits: one row, or up to 2 % of
 * their rows, may exceed the tolerance (counted and reported); exact methods none. */
static int g_lossy = 0;

static double compare(const char *what, const float *gpu, const float *cpu, int64_t rows) {
    double worst = 0;
    int64_t ties = 0, over = 0;
    for (int64_t t = 0; t < rows; t++) {
        const float *a = gpu + t * V, *b = cpu + t * V;
        double mx = 0, diff = 0;
        for (int i = 0; i < V; i++) {
            mx = fmax(mx, fabs(b[i]));
            diff = fmax(diff, fabs((double)a[i] - b[i]));
        }
        const double rel = diff / (mx > 0 ? mx : 1);
        worst = fmax(worst, rel);
        if (g_lossy && rel > 1e-3) { /* a flipped page: the row is its own */
            over++;
            continue;
        }
        CHECK(rel <= 1e-3, "%s row %lld: max |gpu - cpu| = %.3g of max |logit| %.3g", what,
              (long long)t, rel, mx);
        const int32_t ga = argmax(a), ca = argmax(b);
        if (ga != ca) {
            const double gap = fabs((double)b[ga] - b[ca]) / (mx > 0 ? mx : 1);
            if (gap < 1e-4)
                ties++;
            else
                CHECK(ga == ca, "%s row %lld: argmax gpu %d, cpu %d (gap %.3g)", what, (long long)t,
                      ga, ca, gap);
        }
    }
    printf("  %-34s %4lld rows: worst relative difference %.2e%s\n", what, (long long)rows, worst,
           ties ? " (argmax ties reported)" : "");
    if (ties) printf("    %lld rows with argmax ties within 1e-4\n", (long long)ties);
    if (over) printf("    %lld rows over the tolerance (a lossy method's flipped page)\n", (long long)over);
    CHECK(over <= 1 || over * 50 <= rows, "%s: %lld of %lld rows over the tolerance", what,
          (long long)over, (long long)rows);
    return worst;
}

typedef struct {
    ekv_select_method method;
    ekv_dtype kv;
    int64_t chunk; /* gpu prefill_chunk, 0 = auto */
    int graphs;
    int64_t prefill;
    const char *path; /* NULL: the shipped model */
} mcase;

/* The overlap_launches of the CUDA models the checks load (main runs the method cases and the
 * batched steps again with it set: the same CPU references hold). */
static int32_t g_overlap = 0;

/* The params of a case on a backend: the case's fields over p, whose prefill kernel and list
 * sizes (prefill_candidates, prefill_compact, decode_candidates) are the caller's. */
static ekv_model_params case_params(const mcase *c, ekv_backend be, ekv_model_params p) {
    if (be == EKV_BACKEND_CUDA) p.overlap_launches = g_overlap;
    p.max_tokens = c->prefill + DECODE + MORE + 8;
    p.method = c->method;
    p.kv_dtype = c->kv;
    p.code_bits = 4;
    p.backend = be;
    p.prefill_chunk = c->chunk;
    p.cuda_graphs = c->graphs;
    return p;
}

/* The model of a case on a backend (case_params), its load checked. */
static ekv_model *load_params(ekv_context *ctx, const mcase *c, ekv_backend be,
                              ekv_model_params p) {
    p = case_params(c, be, p);
    ekv_model *m = NULL;
    ekv_status s = ekv_model_load(ctx, c->path ? c->path : MODEL, &p, &m);
    CHECK(s == EKV_OK, "load (%s, %s): %s", ekv_backend_name(be), ekv_method_name(c->method),
          ekv_last_error(ctx));
    return s ? NULL : m;
}

static ekv_model *load(ekv_context *ctx, const mcase *c, ekv_backend be) {
    return load_params(ctx, c, be, ekv_model_default_params());
}

/* The logits of a case on both engines: the prompt's rows and the decode steps'. */
typedef struct {
    float *lc, *lg, *dc, *dg;
} case_logits;

static int case_logits_alloc(case_logits *b, int64_t rows, int64_t steps) {
    b->lc = malloc(sizeof(float) * (size_t)(rows * V));
    b->lg = malloc(sizeof(float) * (size_t)(rows * V));
    b->dc = malloc(sizeof(float) * (size_t)(steps * V));
    b->dg = malloc(sizeof(float) * (size_t)(steps * V));
    return b->lc && b->lg && b->dc && b->dg;
}

static void case_logits_free(case_logits *b) {
    free(b->lc);
    free(b->lg);
    free(b->dc);
    free(b->dg);
}

/* tok[0, n) as one block on both engines, then `steps` greedy steps (the CPU's argmax feeds
 * both), the GPU's rows compared with the CPU's under the two names. */
static void prefill_and_decode(ekv_context *ctx, ekv_model *cpu, ekv_model *gpu, const int32_t *tok,
                               int64_t n, int steps, const case_logits *b, const char *prefill_what,
                               const char *decode_what) {
    CHECK(!ekv_model_step(cpu, tok, n, b->lc), "cpu prefill: %s", ekv_last_error(ctx));
    CHECK(!ekv_model_step(gpu, tok, n, b->lg), "gpu prefill: %s", ekv_last_error(ctx));
    compare(prefill_what, b->lg, b->lc, n);
    int32_t next = argmax(b->lc + (n - 1) * V);
    for (int s = 0; s < steps; s++) {
        CHECK(!ekv_model_step(cpu, &next, 1, b->dc + s * V), "cpu step: %s", ekv_last_error(ctx));
        CHECK(!ekv_model_step(gpu, &next, 1, b->dg + s * V), "gpu step: %s", ekv_last_error(ctx));
        next = argmax(b->dc + s * V);
    }
    compare(decode_what, b->dg, b->dc, steps);
}

/* Prefill then greedy decode on both engines; the GPU's decode logits into dec_out when not
 * NULL. */
static void run_case(ekv_context *ctx, const mcase *c, const int32_t *tok, float *dec_out) {
    ekv_model *cpu = load(ctx, c, EKV_BACKEND_CPU), *gpu = load(ctx, c, EKV_BACKEND_CUDA);
    g_lossy = c->method == EKV_SELECT_TOPK || c->method == EKV_SELECT_GAUSSIAN;
    case_logits b;
    const int ok = case_logits_alloc(&b, c->prefill > MORE ? c->prefill : MORE, DECODE);
    float *lc = b.lc, *lg = b.lg, *dg = b.dg;
    char what[96], what_dec[96];
    if (cpu && gpu && ok) {
        snprintf(what, sizeof what, "%s%s %s chunk %lld prefill", c->path ? "tiny " : "",
                 ekv_method_name(c->method), ekv_dtype_name(c->kv), (long long)c->chunk);
        snprintf(what_dec, sizeof what_dec, "%s %s decode%s%s", ekv_method_name(c->method),
                 ekv_dtype_name(c->kv), c->graphs ? " (graph)" : " (eager)",
                 g_overlap ? ", overlapped" : "");
        prefill_and_decode(ctx, cpu, gpu, tok, c->prefill, DECODE, &b, what, what_dec);
        /* a second block after the decode steps: it starts inside a page */
        CHECK(!ekv_model_step(cpu, tok + 100, MORE, lc), "cpu block: %s", ekv_last_error(ctx));
        CHECK(!ekv_model_step(gpu, tok + 100, MORE, lg), "gpu block: %s", ekv_last_error(ctx));
        snprintf(what, sizeof what, "%s %s block at %lld", ekv_method_name(c->method),
                 ekv_dtype_name(c->kv), (long long)(c->prefill + DECODE));
        compare(what, lg, lc, MORE);
        CHECK(ekv_model_position(gpu) == c->prefill + DECODE + MORE, "gpu position %lld",
              (long long)ekv_model_position(gpu));
        if (dec_out) memcpy(dec_out, dg, sizeof(float) * DECODE * V);
    }
    ekv_model_free(cpu);
    ekv_model_free(gpu);
    case_logits_free(&b);
}

/* ekv_model_seq_truncate on the GPU: after a prefill and 8 decode steps, back to the prompt's
 * end and the same 8 tokens again (graph replays read the new position) give the same logits
 * (to the summation order and the f16 rounding of the re-decoded K/V), and back into the
 * prompt (mid-page) its rest as a block again gives the first prefill's rows (compare's
 * tolerance: other blocks). */
static void check_truncate(ekv_context *ctx, const int32_t *tok, ekv_select_method method) {
    const mcase c = {method, EKV_DTYPE_F16, 0, 1, 300, NULL};
    ekv_model *gpu = load(ctx, &c, EKV_BACKEND_CUDA);
    float *a = malloc(sizeof(float) * 300 * V), *d1 = malloc(sizeof(float) * 8 * V),
          *d2 = malloc(sizeof(float) * 8 * V);
    if (!gpu || !a || !d1 || !d2) goto done;
    CHECK(!ekv_model_step(gpu, tok, 300, a), "gpu prefill: %s", ekv_last_error(ctx));
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < 8; i++)
            CHECK(!ekv_model_step(gpu, tok + 300 + i, 1, (pass ? d2 : d1) + i * V),
                  "gpu decode: %s", ekv_last_error(ctx));
        CHECK(!ekv_model_seq_truncate(gpu, 0, 300) && ekv_model_position(gpu) == 300,
              "truncate to 300: %s", ekv_last_error(ctx));
    }
    char what[80];
    g_lossy = 0;
    /* Both passes see the prefill's cache, but not the same sums: the candidate lists' order
     * (atomic appends) reorders them in fp32, and from layer 1 on the decoded token's own K/V
     * (written in each pass) may round to another f16 ulp, which moves the logits ~1e-5, in
     * any method: top-k 9.3e-6 and 1.07e-5 in two of four H100 runs (bench/RESULTS.md
     * 2026-12-06; there a near-tie at the k-th page may also flip with the reordering),
     * certified 2.53e-6 and 2.58e-5 in two of seven (2026-12-07, fifteenth session), 1.5e-7
     * otherwise. The later tokens also see the re-decoded tokens' K/V. So 1e-4 for all eight: still
     * ten times tighter than the CPU comparison, and a wrong cache after the truncation is off by
     * far more. */
    const double again = 1e-4;
    snprintf(what, sizeof what, "%s: truncated, first token again", ekv_method_name(method));
    CHECK(compare(what, d2, d1, 1) <= again, "%s: more than %g from the first decode", what, again);
    snprintf(what, sizeof what, "%s: truncated, 7 more again", ekv_method_name(method));
    CHECK(compare(what, d2 + V, d1 + V, 7) <= again, "%s: more than %g from the first decode", what,
          again);
    CHECK(!ekv_model_seq_truncate(gpu, 0, 250) && ekv_model_position(gpu) == 250,
          "truncate to 250: %s", ekv_last_error(ctx));
    float *b = malloc(sizeof(float) * 50 * V);
    CHECK(b && !ekv_model_step(gpu, tok + 250, 50, b), "gpu rest of the prompt: %s",
          ekv_last_error(ctx));
    snprintf(what, sizeof what, "%s: truncated to 250, rest again", ekv_method_name(method));
    g_lossy = method == EKV_SELECT_TOPK || method == EKV_SELECT_GAUSSIAN;
    if (b) compare(what, b, a + 250 * V, 50);
    free(b);
done:
    ekv_model_free(gpu);
    free(a);
    free(d1);
    free(d2);
}

/* reset, the host mirror of a layer cache and the last queries, against the CPU engine */
static void check_state(ekv_context *ctx, const int32_t *tok) {
    const mcase c = {EKV_SELECT_DENSE, EKV_DTYPE_F16, 128, 1, 300, NULL};
    ekv_model *cpu = load(ctx, &c, EKV_BACKEND_CPU), *gpu = load(ctx, &c, EKV_BACKEND_CUDA);
    float *a = malloc(sizeof(float) * 300 * V), *b = malloc(sizeof(float) * 300 * V);
    if (!cpu || !gpu || !a || !b) goto done;
    CHECK(!ekv_model_step(gpu, tok, 300, a), "gpu prefill: %s", ekv_last_error(ctx));
    CHECK(!ekv_model_reset(gpu), "reset: %s", ekv_last_error(ctx));
    CHECK(ekv_model_position(gpu) == 0, "position after reset");
    CHECK(!ekv_model_step(gpu, tok, 200, b), "gpu prefill after reset: %s", ekv_last_error(ctx));
    compare("after reset, same prefix", b, a, 200);
    CHECK(!ekv_model_step(cpu, tok, 200, a), "cpu prefill: %s", ekv_last_error(ctx));
    const ekv_model_config *cfg = ekv_model_get_config(gpu);
    const int64_t qn = (int64_t)cfg->n_heads * cfg->head_dim;
    const int32_t layers[2] = {0, cfg->n_layers - 1};
    for (int k = 0; k < 2; k++) {
        const int32_t l = layers[k];
        float qa[4096], qb[4096];
        CHECK(!ekv_model_last_query(gpu, l, qa) && !ekv_model_last_query(cpu, l, qb), "query");
        double mx = 0, diff = 0;
        for (int64_t i = 0; i < qn; i++) {
            mx = fmax(mx, fabs(qb[i]));
            diff = fmax(diff, fabs((double)qa[i] - qb[i]));
        }
        CHECK(diff <= 1e-3 * mx, "layer %d last query differs by %.3g of %.3g", l, diff, mx);
        const ekv_cache *cg, *cc;
        int32_t sg, sc;
        CHECK(!ekv_model_layer_cache(gpu, l, &cg, &sg), "gpu layer cache: %s", ekv_last_error(ctx));
        CHECK(!ekv_model_layer_cache(cpu, l, &cc, &sc), "cpu layer cache");
        ekv_paged_kv kg, kc;
        ekv_cache_kv_view(cg, &kg, NULL);
        ekv_cache_kv_view(cc, &kc, NULL);
        int32_t pg[64], pc[64], lg, lc;
        int64_t ig[2], ic[2];
        CHECK(!ekv_cache_page_table(cg, &sg, 1, ig, pg, 64, &lg, NULL) &&
                      !ekv_cache_page_table(cc, &sc, 1, ic, pc, 64, &lc, NULL) && lg == lc &&
                      ig[1] == ic[1],
              "page tables of the mirrors");
        double kmx = 0, kd = 0;
        for (int64_t t = 0; t < 200; t++)
            for (int64_t h = 0; h < kg.num_kv_heads; h++)
                for (int64_t d = 0; d < kg.head_dim; d++) {
                    const int64_t og = pg[t / 16] * kg.stride_page + h * kg.stride_head +
                                       (t % 16) * kg.stride_token + d,
                                  oc = pc[t / 16] * kc.stride_page + h * kc.stride_head +
                                       (t % 16) * kc.stride_token + d;
                    const float x = ekv_f16_to_f32(((const uint16_t *)kg.k)[og]),
                                y = ekv_f16_to_f32(((const uint16_t *)kc.k)[oc]);
                    kmx = fmax(kmx, fabs(y));
                    kd = fmax(kd, fabs((double)x - y));
                }
        CHECK(kd <= 1e-2 * kmx, "layer %d keys differ by %.3g of %.3g", l, kd, kmx);
    }
done:
    ekv_model_free(cpu);
    ekv_model_free(gpu);
    free(a);
    free(b);
}

/* Batched decode: NSEQ sequences of different lengths prefilled one by one (seq_step), then
 * BSTEPS steps of all of them in one ekv_model_batch_step (each its own greedy token), with a
 * single-sequence step of sequence 1 in between (its own graph); each sequence's logits
 * against the CPU engine running that sequence alone. */
enum { NSEQ = 3, BSTEPS = 12 };
static void check_batch(ekv_context *ctx, const int32_t *tok, ekv_select_method method) {
    static const int64_t len[NSEQ] = {300, 457, 129}, off[NSEQ] = {0, 100, 333};
    mcase c = {method, EKV_DTYPE_F16, 128, 1, 457, NULL};
    g_lossy = method == EKV_SELECT_TOPK || method == EKV_SELECT_GAUSSIAN;
    ekv_model_params p = ekv_model_default_params();
    p.max_tokens = 457 + BSTEPS + 8;
    p.method = method;
    p.code_bits = 4;
    p.backend = EKV_BACKEND_CUDA;
    p.prefill_chunk = 128;
    p.max_seqs = NSEQ;
    p.overlap_launches = g_overlap; /* as load_params */
    ekv_model *gpu = NULL;
    CHECK(!ekv_model_load(ctx, MODEL, &p, &gpu), "load max_seqs %d: %s", NSEQ, ekv_last_error(ctx));
    float *lg = malloc(sizeof(float) * (size_t)(457 * V)),
          *lc = malloc(sizeof(float) * (size_t)(457 * V));
    float gl[NSEQ][BSTEPS + 1][V], cl[BSTEPS + 1][V];
    int32_t next[NSEQ], seqs[NSEQ] = {0, 1, 2};
    char what[96];
    for (int32_t k = 0; gpu && k < NSEQ; k++) {
        CHECK(!ekv_model_seq_step(gpu, k, tok + off[k], len[k], lg), "seq_step %d: %s", k,
              ekv_last_error(ctx));
        memcpy(gl[k][0], lg + (len[k] - 1) * V, sizeof(float) * V);
        next[k] = argmax(gl[k][0]);
    }
    for (int s = 1; gpu && s <= BSTEPS; s++) {
        float out[NSEQ][V];
        if (s == BSTEPS / 2) { /* sequence 1 alone, then the batch without it */
            CHECK(!ekv_model_seq_step(gpu, 1, &next[1], 1, gl[1][s]), "seq 1 step");
            const int32_t two[2] = {0, 2}, t2[2] = {next[0], next[2]};
            CHECK(!ekv_model_batch_step(gpu, two, 2, t2, out[0]), "batch of 2: %s",
                  ekv_last_error(ctx));
            memcpy(gl[0][s], out[0], sizeof(float) * V);
            memcpy(gl[2][s], out[1], sizeof(float) * V);
        } else {
            CHECK(!ekv_model_batch_step(gpu, seqs, NSEQ, next, out[0]), "batch: %s",
                  ekv_last_error(ctx));
            for (int k = 0; k < NSEQ; k++) memcpy(gl[k][s], out[k], sizeof(float) * V);
        }
        for (int k = 0; k < NSEQ; k++) next[k] = argmax(gl[k][s]);
    }
    for (int32_t k = 0; gpu && k < NSEQ; k++) {
        CHECK(ekv_model_seq_position(gpu, k) == len[k] + BSTEPS, "seq %d position %lld", k,
              (long long)ekv_model_seq_position(gpu, k));
        ekv_model *cpu = load(ctx, &c, EKV_BACKEND_CPU);
        if (!cpu) break;
        CHECK(!ekv_model_step(cpu, tok + off[k], len[k], lc), "cpu prefill");
        memcpy(cl[0], lc + (len[k] - 1) * V, sizeof(float) * V);
        for (int s = 1; s <= BSTEPS; s++) {
            const int32_t t = argmax(gl[k][s - 1]); /* the token the GPU run fed */
            CHECK(!ekv_model_step(cpu, &t, 1, cl[s]), "cpu step");
        }
        snprintf(what, sizeof what, "%s batch: seq %d (%lld tokens)", ekv_method_name(method), k,
                 (long long)len[k]);
        compare(what, gl[k][0], cl[0], BSTEPS + 1);
        ekv_model_free(cpu);
    }
    if (gpu) {
        const int32_t dup[2] = {1, 1}, t2[2] = {65, 66};
        CHECK(ekv_model_batch_step(gpu, dup, 2, t2, NULL) == EKV_ERR_INVALID_ARGUMENT,
              "duplicate seq");
        CHECK(ekv_model_seq_position(gpu, 1) == len[1] + BSTEPS, "a refused batch moves nothing");
        CHECK(!ekv_model_seq_reset(gpu, 1) && ekv_model_seq_position(gpu, 1) == 0 &&
                      ekv_model_seq_position(gpu, 0) == len[0] + BSTEPS,
              "seq_reset empties one sequence");
    }
    ekv_model_free(gpu);
    free(lg);
    free(lc);
}

/* Graph replay against eager launches (docs/architecture.md, "The model on the GPU"): two
 * models, cuda_graphs 1 and 0, make the same calls: NG sequences of different lengths, then
 * phases of decode steps whose batch size, sequences and method change between phases (a
 * sequence leaving, one emptied and prefilled again, one truncated, a lone sequence's step, more
 * keys than the model keeps graphs), each fed the same tokens. The graph model's graph_steps
 * must count exactly the steps whose key (batch size, method, budget) was among the
 * GRAPHS_KEPT most recently used (a key's first step runs eagerly); the eager model's none.
 * The logits: a replay runs the launches of the eager step with the same arguments, so a row
 * differs from eager only by the decode stages' own run-to-run noise: they fill their tau
 * candidate lists through atomics, so the order of the sums over a list varies between two
 * eager runs as well (check_truncate's "first token again" sees it), and the two models'
 * caches then drift by f16 roundings. The rows bitwise equal are counted; every row of the
 * exact methods must be within check_truncate's 1e-4 of its largest |logit| (a stale capture,
 * a wrong sequence, position or batch size gives another token's logits, far above it), those
 * of topk and gaussian, whose pages may flip, within compare's rules. */
enum { NG = 4, GRAPHS_KEPT = 8, GROWS = 256 };
enum { GP_STEPS, GP_REJOIN, GP_TRUNCATE }; /* before a phase: nothing, seq 1 anew, seq 0 - 7 */
typedef struct {
    ekv_select_method method;
    double budget;
    int32_t B, seqs[NG];
    int steps, before;
} gphase;

typedef struct {
    int32_t B;
    ekv_select_method method;
    double budget;
    int64_t used;
} gkey;

/* Whether a step of this key replays a graph: the key is among the kept ones (then it is the
 * most recent), else it takes the least recently used place and runs eagerly. */
static int graph_key_replays(gkey *kept, int64_t *clock, const gphase *p) {
    gkey *lru = &kept[0];
    for (int i = 0; i < GRAPHS_KEPT; i++) {
        if (kept[i].B == p->B && kept[i].method == p->method && kept[i].budget == p->budget) {
            kept[i].used = ++*clock;
            return 1;
        }
        if (kept[i].used < lru->used) lru = &kept[i];
    }
    *lru = (gkey){p->B, p->method, p->budget, ++*clock};
    return 0;
}

/* One step of the phase on model m: a lone sequence through ekv_model_seq_step (run's step),
 * else one batched step; the logits into out[B][V]. */
static ekv_status graph_phase_step(ekv_model *m, const gphase *p, const int32_t *next, float *out) {
    int32_t t[NG];
    for (int b = 0; b < p->B; b++) t[b] = next[p->seqs[b]];
    return p->B == 1 ? ekv_model_seq_step(m, p->seqs[0], t, 1, out)
                     : ekv_model_batch_step(m, p->seqs, p->B, t, out);
}

/* What comes before a phase, on both models (prefill logits into lg). */
static void graph_phase_before(ekv_context *ctx, ekv_model *const *m, const gphase *p,
                               const int32_t *tok, float *lg) {
    for (int k = 0; k < 2; k++) {
        if (p->before == GP_REJOIN)
            CHECK(!ekv_model_seq_reset(m[k], 1) && !ekv_model_seq_step(m[k], 1, tok + 50, 91, lg),
                  "seq 1 anew: %s", ekv_last_error(ctx));
        if (p->before == GP_TRUNCATE)
            CHECK(!ekv_model_seq_truncate(m[k], 0, ekv_model_seq_position(m[k], 0) - 7),
                  "truncate seq 0: %s", ekv_last_error(ctx));
        CHECK(!ekv_model_set_method(m[k], p->method, p->budget), "set_method %s: %s",
              ekv_method_name(p->method), ekv_last_error(ctx));
    }
}

static void check_graph_replay(ekv_context *ctx, const int32_t *tok) {
    static const int64_t len[NG] = {200, 333, 77, 150}, off[NG] = {0, 210, 400, 90};
    const double b0 = 1.0 / 16, b1 = 0.125;
    static const ekv_select_method D = EKV_SELECT_DENSE, C = EKV_SELECT_CERTIFIED,
                                   S = EKV_SELECT_SCREENED, K = EKV_SELECT_TOPK,
                                   G = EKV_SELECT_GAUSSIAN;
    const gphase ph[] = {
            {D, b0, 4, {0, 1, 2, 3}, 5, GP_STEPS}, {C, b0, 1, {1}, 3, GP_STEPS},
            {C, b0, 3, {0, 2, 3}, 4, GP_STEPS},    {D, b0, 4, {3, 1, 0, 2}, 4, GP_REJOIN},
            {S, b0, 2, {2, 0}, 3, GP_STEPS},       {D, b0, 4, {0, 1, 2, 3}, 3, GP_TRUNCATE},
            {K, b0, 2, {1, 2}, 3, GP_STEPS},       {C, b1, 3, {0, 1, 2}, 3, GP_STEPS},
            {D, b0, 1, {2}, 2, GP_STEPS},          {D, b0, 2, {0, 3}, 2, GP_STEPS},
            {D, b0, 3, {1, 2, 3}, 2, GP_STEPS},    {G, b0, 4, {0, 1, 2, 3}, 2, GP_STEPS},
            {S, b0, 4, {3, 2, 1, 0}, 2, GP_STEPS}, {D, b0, 4, {0, 1, 2, 3}, 3, GP_STEPS},
            {C, b0, 3, {0, 2, 3}, 2, GP_STEPS},    {C, b0, 1, {3}, 2, GP_STEPS},
    };
    const int nph = (int)(sizeof ph / sizeof ph[0]);
    ekv_model_params p = ekv_model_default_params();
    p.max_tokens = 512;
    p.code_bits = 4;
    p.backend = EKV_BACKEND_CUDA;
    p.prefill_chunk = 128;
    p.max_seqs = NG;
    ekv_model *m[2] = {NULL, NULL}; /* graphs, eager */
    for (int k = 0; k < 2; k++) {
        p.cuda_graphs = k == 0;
        CHECK(!ekv_model_load(ctx, MODEL, &p, &m[k]), "load (graphs %d): %s", p.cuda_graphs,
              ekv_last_error(ctx));
    }
    float *lg = malloc(sizeof(float) * 333 * V), out[2][NG][V];
    /* [lossy][graphs, eager]: the rows of the exact methods and those of topk and gaussian */
    float *rows[2][2];
    int64_t nrows[2] = {0, 0}, bitwise = 0, clock = 0, want = 0;
    for (int l = 0; l < 2; l++)
        for (int k = 0; k < 2; k++) rows[l][k] = malloc(sizeof(float) * GROWS * V);
    int32_t next[NG];
    gkey kept[GRAPHS_KEPT];
    memset(kept, 0, sizeof kept);
    const int ok = m[0] && m[1] && lg && rows[0][0] && rows[0][1] && rows[1][0] && rows[1][1];
    for (int32_t s = 0; ok && s < NG; s++) {
        for (int k = 0; k < 2; k++)
            CHECK(!ekv_model_seq_step(m[k], s, tok + off[s], len[s], lg), "prefill seq %d: %s", s,
                  ekv_last_error(ctx));
        next[s] = argmax(lg + (len[s] - 1) * V);
    }
    for (int i = 0; ok && i < nph; i++) {
        const gphase *q = &ph[i];
        const int l = q->method == EKV_SELECT_TOPK || q->method == EKV_SELECT_GAUSSIAN;
        graph_phase_before(ctx, m, q, tok, lg);
        if (q->before == GP_REJOIN) next[1] = argmax(lg + 90 * V);
        for (int st = 0; st < q->steps; st++) {
            for (int k = 0; k < 2; k++)
                CHECK(!graph_phase_step(m[k], q, next, out[k][0]), "phase %d step %d (%s): %s", i,
                      st, k ? "eager" : "graphs", ekv_last_error(ctx));
            want += graph_key_replays(kept, &clock, q) ? q->B : 0;
            for (int b = 0; b < q->B && nrows[l] < GROWS; b++, nrows[l]++) {
                bitwise += !memcmp(out[0][b], out[1][b], sizeof out[0][b]);
                for (int k = 0; k < 2; k++)
                    memcpy(rows[l][k] + nrows[l] * V, out[k][b], sizeof out[k][b]);
                next[q->seqs[b]] = argmax(out[0][b]);
            }
        }
    }
    ekv_model_stats sg, se;
    if (ok) {
        ekv_model_get_stats(m[0], -1, &sg);
        ekv_model_get_stats(m[1], -1, &se);
        const int64_t nl = ekv_model_get_config(m[0])->n_layers;
        printf("  graph replay against eager: %lld of %lld decode rows bitwise equal; %lld of %lld "
               "(token, layer) steps replayed\n",
               (long long)bitwise, (long long)(nrows[0] + nrows[1]), (long long)sg.graph_steps,
               (long long)sg.steps);
        g_lossy = 0;
        const double w =
                compare("graph against eager, exact methods", rows[0][0], rows[0][1], nrows[0]);
        CHECK(w <= 1e-4, "graph replay: exact methods' rows %.3g from eager launches", w);
        g_lossy = 1;
        compare("graph against eager, topk and gaussian", rows[1][0], rows[1][1], nrows[1]);
        g_lossy = 0;
        CHECK(sg.graph_steps == want * nl,
              "graph_steps %lld, expected %lld replayed rows x %lld layers",
              (long long)sg.graph_steps, (long long)want, (long long)nl);
        CHECK(want > 0 && se.graph_steps == 0, "eager model: graph_steps %lld",
              (long long)se.graph_steps);
        CHECK(sg.steps == se.steps, "steps %lld and %lld", (long long)sg.steps,
              (long long)se.steps);
    }
    for (int l = 0; l < 2; l++)
        for (int k = 0; k < 2; k++) free(rows[l][k]);
    ekv_model_free(m[0]);
    ekv_model_free(m[1]);
    free(lg);
}

/* The fused dense prefill (docs/math.md §12, "The fused kernel") against the GEMM path and the
 * CPU engine at every position: f16 and bf16 caches, lengths and blocks off the kernel's
 * 64-row tiles (a block of 100 tokens is 300 rows per KV head), and rows whose candidate buffer
 * overflows: with prefill_candidates = 4 nearly every row keeps too few (the model's keys cannot
 * be planted through the API, so the buffer is shrunk instead), so lists are compacted inside
 * the sweep, rows are retried and solved by Newton passes, and must still give the same logits. The
 * stats say which kernel ran. The fused kernel's histogram scheme (EKV_PREFILL_FUSED_HIST,
 * docs/math.md §12.1) runs each case too, against the CPU and the candidate scheme: no row
 * retried; with prefill_candidates = 4 (its lists' cap) nearly every row by Newton passes. */
typedef struct {
    ekv_dtype kv;
    int64_t n, chunk;
    int32_t cands;   /* ekv_model_params.prefill_candidates, 0 = the default */
    int32_t compact; /* prefill_compact (the fill that compacts a list), 0 = the default */
} fcase;

/* The histogram scheme's model (hist) of a case against the CPU's logits lc and the candidate
 * scheme's lf; lh: room for its logits. */
static void check_hist_case(ekv_context *ctx, const fcase *f, ekv_model *hist, const int32_t *tok,
                            const float *lc, const float *lf, float *lh, int64_t steps) {
    char what[96];
    CHECK(!ekv_model_step(hist, tok, f->n, lh), "hist prefill: %s", ekv_last_error(ctx));
    snprintf(what, sizeof what, "hist %s %lld chunk %lld cands %d vs cpu", ekv_dtype_name(f->kv),
             (long long)f->n, (long long)f->chunk, f->cands);
    compare(what, lh, lc, f->n);
    snprintf(what, sizeof what, "hist %s %lld chunk %lld vs fused", ekv_dtype_name(f->kv),
             (long long)f->n, (long long)f->chunk);
    compare(what, lh, lf, f->n);
    ekv_model_stats sh;
    ekv_model_get_stats(hist, -1, &sh);
    CHECK(sh.prefill_fused == steps && sh.prefill_gemm == 0, "hist stats %lld / %lld of %lld",
          (long long)sh.prefill_fused, (long long)sh.prefill_gemm, (long long)steps);
    printf("    hist: rows retried %lld, solved by Newton passes %lld, compacted %lld, tiles "
           "skipped %lld, unreached %lld\n",
           (long long)sh.prefill_retry_rows, (long long)sh.prefill_newton_rows,
           (long long)sh.prefill_compacted_rows, (long long)sh.prefill_tiles_skipped,
           (long long)sh.prefill_tiles_unreached);
    CHECK(sh.prefill_retry_rows == 0 && sh.prefill_compacted_rows == 0,
          "hist: %lld rows retried, %lld compacted (its lists are sized, never retried)",
          (long long)sh.prefill_retry_rows, (long long)sh.prefill_compacted_rows);
    if (f->cands && f->cands <= 4) /* most rows' lists exceed 4 keys */
        CHECK(sh.prefill_newton_rows > 0, "hist cands %d: no row by Newton passes", f->cands);
    if (!f->cands && f->n <= 1024) /* every list fits 1024: a Newton row means P1 and P2 differed */
        CHECK(sh.prefill_newton_rows == 0,
              "hist: %lld rows by Newton passes, lists of <= %lld keys",
              (long long)sh.prefill_newton_rows, (long long)f->n);
}

static void check_fused_case(ekv_context *ctx, const fcase *f, const int32_t *tok) {
    const mcase c = {EKV_SELECT_DENSE, f->kv, f->chunk, 1, f->n, NULL};
    ekv_model_params t = ekv_model_default_params();
    t.prefill_candidates = f->cands;
    t.prefill_compact = f->compact;
    ekv_model *cpu = load_params(ctx, &c, EKV_BACKEND_CPU, t);
    t.prefill_kernel = EKV_PREFILL_FUSED;
    ekv_model *fused = load_params(ctx, &c, EKV_BACKEND_CUDA, t);
    t.prefill_kernel = EKV_PREFILL_GEMM;
    ekv_model *gemm = load_params(ctx, &c, EKV_BACKEND_CUDA, t);
    t.prefill_kernel = EKV_PREFILL_FUSED_HIST;
    ekv_model *hist = load_params(ctx, &c, EKV_BACKEND_CUDA, t);
    float *lc = malloc(sizeof(float) * (size_t)(f->n * V)),
          *lf = malloc(sizeof(float) * (size_t)(f->n * V)),
          *lg = malloc(sizeof(float) * (size_t)(f->n * V));
    char what[96];
    if (cpu && fused && gemm && hist && lc && lf && lg) {
        CHECK(!ekv_model_step(cpu, tok, f->n, lc), "cpu prefill: %s", ekv_last_error(ctx));
        CHECK(!ekv_model_step(fused, tok, f->n, lf), "fused prefill: %s", ekv_last_error(ctx));
        CHECK(!ekv_model_step(gemm, tok, f->n, lg), "gemm prefill: %s", ekv_last_error(ctx));
        snprintf(what, sizeof what, "fused %s %lld chunk %lld cands %d compact %d vs cpu",
                 ekv_dtype_name(f->kv), (long long)f->n, (long long)f->chunk, f->cands, f->compact);
        compare(what, lf, lc, f->n);
        snprintf(what, sizeof what, "fused %s %lld chunk %lld vs gemm", ekv_dtype_name(f->kv),
                 (long long)f->n, (long long)f->chunk);
        compare(what, lf, lg, f->n);
        ekv_model_stats sf, sg;
        ekv_model_get_stats(fused, -1, &sf);
        ekv_model_get_stats(gemm, -1, &sg);
        const int64_t steps = f->n * ekv_model_get_config(fused)->n_layers;
        CHECK(sf.prefill_fused == steps && sf.prefill_gemm == 0, "fused stats %lld / %lld of %lld",
              (long long)sf.prefill_fused, (long long)sf.prefill_gemm, (long long)steps);
        CHECK(sg.prefill_gemm == steps && sg.prefill_fused == 0, "gemm stats %lld / %lld of %lld",
              (long long)sg.prefill_gemm, (long long)sg.prefill_fused, (long long)steps);
        printf("    fused: rows retried %lld, solved by Newton passes %lld, compacted %lld\n",
               (long long)sf.prefill_retry_rows, (long long)sf.prefill_newton_rows,
               (long long)sf.prefill_compacted_rows);
        if (f->cands) /* a small buffer fills inside the sweep: its compaction must have run */
            CHECK(sf.prefill_compacted_rows > 0, "cands %d: no list compacted", f->cands);
        if (f->cands && f->cands <= 4)
            CHECK(sf.prefill_retry_rows > 0 && sf.prefill_newton_rows > 0,
                  "cands %d: no row overflowed (retried %lld, Newton %lld)", f->cands,
                  (long long)sf.prefill_retry_rows, (long long)sf.prefill_newton_rows);
        check_hist_case(ctx, f, hist, tok, lc, lf, lg, steps);
    }
    ekv_model_free(cpu);
    ekv_model_free(fused);
    ekv_model_free(gemm);
    ekv_model_free(hist);
    free(lc);
    free(lf);
    free(lg);
}

/* The histogram scheme's default pool (ekv_model_params.prefill_candidates = 0,
 * include/entmaxkv/model.h): 32768 candidates a row, halved down to 4096 while the prefill's
 * scratch passes a quarter of the free device memory. With POOL_FREE bytes left free (this test
 * holds the rest), the shipped model's 32768 pool (blocks of 4096 tokens x 6 heads = 24576 rows
 * of 12 bytes a candidate: ~9.7 GB) cannot be allocated, as an explicit prefill_candidates =
 * 32768 shows; the default must halve (to 4096: ~1.2 GB) and load, and its prefill give the
 * CPU's logits. A device with less free memory skips the check. */
static const double POOL_FREE = 4e9;
static void check_pool_on_small_device(ekv_context *ctx, const int32_t *tok) {
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess || (double)fr < POOL_FREE + 1e9) {
        printf("  default prefill pool on a small device: %.1f GB free, skipped\n", fr / 1e9);
        return;
    }
    const mcase c = {EKV_SELECT_DENSE, EKV_DTYPE_F16, 0, 0, 32768, NULL}; /* its lists' cap */
    ekv_model *cpu = load(ctx, &c, EKV_BACKEND_CPU);
    void *hold = NULL;
    CHECK(cudaMalloc(&hold, fr - (size_t)POOL_FREE) == cudaSuccess, "holding %.1f GB",
          (fr - POOL_FREE) / 1e9);
    ekv_model_params t = ekv_model_default_params();
    t.prefill_kernel = EKV_PREFILL_FUSED_HIST;
    t.prefill_candidates = 32768; /* asked for, it does not fit: refused, nothing held */
    const ekv_model_params big_params = case_params(&c, EKV_BACKEND_CUDA, t);
    ekv_model *big = NULL;
    CHECK(ekv_model_load(ctx, MODEL, &big_params, &big) == EKV_ERR_OUT_OF_MEMORY && !big,
          "a 32768 pool loaded with %.1f GB free: the check below proves nothing", POOL_FREE / 1e9);
    ekv_model_free(big);
    t.prefill_candidates = 0; /* the same params less the pool asked for */
    ekv_model *gpu = load_params(ctx, &c, EKV_BACKEND_CUDA, t);
    float *lc = malloc(sizeof(float) * PREFILL * V), *lg = malloc(sizeof(float) * PREFILL * V);
    if (cpu && gpu && lc && lg) {
        char what[64];
        snprintf(what, sizeof what, "default pool, %.1f GB free, vs cpu", POOL_FREE / 1e9);
        CHECK(!ekv_model_step(cpu, tok, PREFILL, lc), "cpu prefill: %s", ekv_last_error(ctx));
        CHECK(!ekv_model_step(gpu, tok, PREFILL, lg), "gpu prefill: %s", ekv_last_error(ctx));
        compare(what, lg, lc, PREFILL);
    }
    free(lc);
    free(lg);
    ekv_model_free(gpu);
    ekv_model_free(cpu);
    cudaFree(hold);
}

/* A model's slow-path counters (ekv_model_stats), by name, for check_slow_paths. */
static const struct {
    const char *name;
    size_t at;
} g_slow[] = {{"tau compacted", offsetof(ekv_model_stats, tau_compacted_rows)},
              {"tau whole row", offsetof(ekv_model_stats, tau_whole_rows)},
              {"screen retried", offsetof(ekv_model_stats, screen_retry_rows)},
              {"screen every token", offsetof(ekv_model_stats, screen_all_rows)}};
static int64_t slow_count(const ekv_model_stats *s, int k) {
    return *(const int64_t *)((const char *)s + g_slow[k].at);
}

/* The decode stages' slow paths (docs/architecture.md, "The model on the GPU"): with
 * decode_candidates = 4 the plan lists 4 candidates per query head (and screened keeps 4 per
 * screen list), so tau lists are compacted or solved over the whole row and screen lists
 * retried or keep every token, and the logits must still be the CPU's; the stats count them
 * per layer, at most one of each per (token through the decode stages, query head), and the
 * layers' counts add up to the model's. */
static void check_slow_paths(ekv_context *ctx, const int32_t *tok, ekv_select_method method) {
    enum { N = 300, STEPS = 8 };
    const mcase c = {method, EKV_DTYPE_F16, 0, 1, N, NULL};
    ekv_model_params t = ekv_model_default_params();
    t.decode_candidates = 4;
    ekv_model *cpu = load_params(ctx, &c, EKV_BACKEND_CPU, t),
              *gpu = load_params(ctx, &c, EKV_BACKEND_CUDA, t);
    case_logits b;
    const int ok = case_logits_alloc(&b, N, STEPS);
    char what[96], what_dec[96];
    const char *mn = ekv_method_name(method);
    if (cpu && gpu && ok) {
        g_lossy = 0;
        snprintf(what, sizeof what, "%s, 4 tau candidates: prefill", mn);
        snprintf(what_dec, sizeof what_dec, "%s, 4 tau candidates: decode", mn);
        prefill_and_decode(ctx, cpu, gpu, tok, N, STEPS, &b, what, what_dec);
        const ekv_model_config *cfg = ekv_model_get_config(gpu);
        /* a dense prefill is the tensor-core kernel, the others run the decode stages */
        const int64_t rows =
                (int64_t)(method == EKV_SELECT_DENSE ? STEPS : N + STEPS) * cfg->n_heads;
        ekv_model_stats all, one;
        ekv_model_get_stats(gpu, -1, &all);
        int64_t sum[4] = {0, 0, 0, 0};
        for (int32_t l = 0; l < cfg->n_layers; l++) {
            ekv_model_get_stats(gpu, l, &one);
            for (int k = 0; k < 4; k++) {
                const int64_t v = slow_count(&one, k);
                CHECK(v >= 0 && v <= rows, "%s layer %d: %lld rows %s of %lld", mn, l, (long long)v,
                      g_slow[k].name, (long long)rows);
                sum[k] += v;
            }
        }
        printf("    %s, 4 candidates: tau compacted %lld, whole row %lld; screen retried %lld, "
               "every token %lld\n",
               mn, (long long)sum[0], (long long)sum[1], (long long)sum[2], (long long)sum[3]);
        for (int k = 0; k < 4; k++)
            CHECK(sum[k] == slow_count(&all, k), "%s: the layers' %s %lld, the model's %lld", mn,
                  g_slow[k].name, (long long)sum[k], (long long)slow_count(&all, k));
        CHECK(sum[0] + sum[1] > 0, "%s: no tau list overflowed with 4 candidates", mn);
        if (method == EKV_SELECT_SCREENED)
            CHECK(sum[2] + sum[3] > 0, "screened: no screen list overflowed with 4 entries");
        else
            CHECK(sum[2] + sum[3] == 0, "%s: screen counts without a screen", mn);
    }
    ekv_model_free(cpu);
    ekv_model_free(gpu);
    case_logits_free(&b);
}

/* The fused dense attend through the model (ekv_model_params.fused_attend; docs/architecture.md,
 * "The fused dense attend"): one sequence's dense decode, graph-replayed, gives the CPU's
 * logits, and with 4 tau candidates no row takes a list's slow path (it keeps no list). */
static void check_fused_attend(ekv_context *ctx, const int32_t *tok) {
    enum { N = 300, STEPS = 8 };
    const mcase c = {EKV_SELECT_DENSE, EKV_DTYPE_F16, 0, 1, N, NULL};
    ekv_model_params t = ekv_model_default_params();
    t.decode_candidates = 4;
    t.fused_attend = 1;
    ekv_model *cpu = load_params(ctx, &c, EKV_BACKEND_CPU, t),
              *gpu = load_params(ctx, &c, EKV_BACKEND_CUDA, t);
    case_logits b;
    const int ok = case_logits_alloc(&b, N, STEPS);
    if (cpu && gpu && ok) {
        g_lossy = 0;
        prefill_and_decode(ctx, cpu, gpu, tok, N, STEPS, &b, "dense, fused attend: prefill",
                           "dense, fused attend: decode");
        ekv_model_stats all;
        ekv_model_get_stats(gpu, -1, &all);
        CHECK(all.tau_compacted_rows + all.tau_whole_rows == 0,
              "dense, fused attend: %lld tau rows took a list's slow path",
              (long long)(all.tau_compacted_rows + all.tau_whole_rows));
    }
    ekv_model_free(cpu);
    ekv_model_free(gpu);
    case_logits_free(&b);
}

static void check_fused(ekv_context *ctx, const int32_t *tok) {
    static const fcase cases[] = {
            {EKV_DTYPE_F16, PREFILL, 0, 0, 0},   /* one block */
            {EKV_DTYPE_F16, PREFILL, 100, 0, 0}, /* blocks of 300 rows: tiles cut mid-token */
            {EKV_DTYPE_F16, 129, 0, 0, 0},
            {EKV_DTYPE_BF16, 457, 0, 0, 0},
            {EKV_DTYPE_BF16, 333, 77, 0, 0},
            {EKV_DTYPE_F16, PREFILL, 256, 4, 0}, /* overflows: retries and Newton passes */
            {EKV_DTYPE_BF16, 457, 128, 2, 0},
            {EKV_DTYPE_F16, 457, 0, 24, 0}, /* some rows overflow round 0 only */
            /* compactions below the list's size: rows settle, then fill the list */
            {EKV_DTYPE_F16, 457, 0, 96, 16},
            {EKV_DTYPE_BF16, 333, 77, 64, 8},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check_fused_case(ctx, &cases[i], tok);
    /* fused where it does not apply is refused, not replaced */
    const mcase c = {EKV_SELECT_DENSE, EKV_DTYPE_F32, 0, 1, 100, NULL};
    ekv_model_params p = ekv_model_default_params();
    p.backend = EKV_BACKEND_CUDA;
    p.kv_dtype = c.kv;
    p.prefill_kernel = EKV_PREFILL_FUSED;
    ekv_model *m = NULL;
    CHECK(ekv_model_load(ctx, MODEL, &p, &m) == EKV_ERR_UNSUPPORTED && !m,
          "fused prefill on an f32 cache: %s", ekv_last_error(ctx));
    ekv_model_free(m);
    p.prefill_kernel = EKV_PREFILL_FUSED_HIST;
    m = NULL;
    CHECK(ekv_model_load(ctx, MODEL, &p, &m) == EKV_ERR_UNSUPPORTED && !m,
          "hist prefill on an f32 cache: %s", ekv_last_error(ctx));
    ekv_model_free(m);
}

/* A method the CUDA backend does not serve is refused at set_method (the paper's fixed tau mode
 * has no model switch, so an invalid budget stands in); a bad token moves nothing. */
static void check_refusals(ekv_context *ctx) {
    ekv_model_params p = ekv_model_default_params();
    p.backend = EKV_BACKEND_CUDA;
    ekv_model *m = NULL;
    ekv_status s;
    CHECK(!ekv_model_load(ctx, MODEL, &p, &m), "load: %s", ekv_last_error(ctx));
    if (m) {
        s = ekv_model_set_method(m, EKV_SELECT_GAUSSIAN, 0.1); /* the mixture on the GPU */
        CHECK(s == EKV_OK, "set_method gaussian on cuda: %d (%s)", (int)s, ekv_last_error(ctx));
        s = ekv_model_set_method(m, EKV_SELECT_ORACLE, 0.1);
        CHECK(s == EKV_ERR_UNSUPPORTED, "set_method oracle on cuda: %d", (int)s);
        const int32_t bad = 300;
        CHECK(ekv_model_step(m, &bad, 1, NULL) == EKV_ERR_INVALID_ARGUMENT, "token 300");
        CHECK(ekv_model_position(m) == 0, "a refused step moves nothing");
    }
    ekv_model_free(m);
}

int main(void) {
    int32_t ndev = 0;
    ekv_cuda_device_count(NULL, &ndev);
    if (ndev == 0) {
        printf("test_model_cuda: no CUDA device, skipped\n");
        return 77;
    }
    ekv_context *ctx = NULL;
    if (ekv_context_create(NULL, &ctx)) return 1;
    FILE *f = fopen(TEXT, "rb");
    char text[PREFILL];
    const size_t got = f ? fread(text, 1, PREFILL, f) : 0;
    if (f) fclose(f);
    CHECK(got == PREFILL, "cannot read %d bytes of %s", (int)PREFILL, TEXT);
    int32_t tok[PREFILL];
    ekv_model_tokenize(text, PREFILL, tok);
    const mcase cases[] = {
            {EKV_SELECT_DENSE, EKV_DTYPE_F16, 256, 1, PREFILL, NULL},
            {EKV_SELECT_DENSE, EKV_DTYPE_F16, 0, 0, PREFILL, NULL},
            {EKV_SELECT_DENSE, EKV_DTYPE_F32, 256, 1, 400, NULL},
            {EKV_SELECT_DENSE, EKV_DTYPE_BF16, 256, 1, 400, NULL},
            {EKV_SELECT_TOPK, EKV_DTYPE_F16, 0, 1, PREFILL, NULL},
            {EKV_SELECT_CERTIFIED, EKV_DTYPE_F16, 0, 1, PREFILL, NULL},
            {EKV_SELECT_SCREENED, EKV_DTYPE_F16, 0, 1, PREFILL, NULL},
            {EKV_SELECT_GAUSSIAN, EKV_DTYPE_F16, 0, 1, PREFILL, NULL}, /* ALiBi: the mixture */
            {EKV_SELECT_DENSE, EKV_DTYPE_F16, 64, 1, 400, TINY},
            {EKV_SELECT_CERTIFIED, EKV_DTYPE_F32, 0, 1, 400, TINY},
    };
    float *graph = malloc(sizeof(float) * DECODE * V), *eager = malloc(sizeof(float) * DECODE * V);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(ctx, &cases[i], tok, i == 0 ? graph : i == 1 ? eager : NULL);
    g_lossy = 0;
    compare("dense decode: graph against eager", graph, eager, DECODE);
    check_state(ctx, tok);
    check_batch(ctx, tok, EKV_SELECT_DENSE);
    check_batch(ctx, tok, EKV_SELECT_TOPK);
    check_batch(ctx, tok, EKV_SELECT_SCREENED);
    check_graph_replay(ctx, tok);
    check_refusals(ctx);
    check_truncate(ctx, tok, EKV_SELECT_DENSE);
    check_truncate(ctx, tok, EKV_SELECT_SCREENED);
    check_truncate(ctx, tok, EKV_SELECT_TOPK);
    check_truncate(ctx, tok, EKV_SELECT_CERTIFIED); /* stale superpage boxes after the truncate */
    check_fused(ctx, tok);
    check_pool_on_small_device(ctx, tok);
    check_slow_paths(ctx, tok, EKV_SELECT_DENSE);
    check_slow_paths(ctx, tok, EKV_SELECT_CERTIFIED);
    check_slow_paths(ctx, tok, EKV_SELECT_SCREENED);
    check_fused_attend(ctx, tok);
    /* overlapped launches (ekv_model_params.overlap_launches): every GPU method's case and the
     * batched steps again, against the same CPU references */
    g_overlap = 1;
    printf("-- overlapped launches\n");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (i == 0 || (cases[i].method != EKV_SELECT_DENSE && cases[i].path == NULL))
            run_case(ctx, &cases[i], tok, NULL);
    check_batch(ctx, tok, EKV_SELECT_DENSE);
    check_batch(ctx, tok, EKV_SELECT_TOPK);
    check_fused_attend(ctx, tok);
    g_overlap = 0;
    free(graph);
    free(eager);
    ekv_context_free(ctx);
    return test_finish("test_model_cuda");
}
