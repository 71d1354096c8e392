/* Helpers shared by the CLI's subcommands (not part of the library). */
#ifndef EKV_CLI_H
#define EKV_CLI_H
#include "entmaxkv.h"
#include <stdint.h>
#include <stdio.h>

/* Exit codes: 0 ok, 1 runtime failure, 2 bad usage. */
#define CLI_USAGE 2

/* Prints "entmaxkv SUB: message" to stderr and exits with code 2. */
void cli_usage_error(const char *sub, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));
/* The value of option argv[*i] (advancing *i), or a usage error for subcommand sub. */
const char *cli_need(const char *sub, int argc, char **argv, int *i);
/* The same, parsed as an integer in [lo, hi]. */
int64_t cli_need_int(const char *sub, int argc, char **argv, int *i, int64_t lo, int64_t hi);
/* Parses a non-negative integer with optional k/K (1024) or M (1048576) suffix. */
int cli_parse_i64(const char *s, int64_t *out);
int cli_parse_double(const char *s, double *out);
/* A number or a ratio "a/b". */
int cli_parse_fraction(const char *s, double *out);
/* Parses a comma-separated list of integers into out[max]; returns count or -1. */
int cli_parse_i64_list(const char *s, int64_t *out, int max);
double cli_now_seconds(void);

/* xoshiro256+ stream with Gaussian samples (fast fill of synthetic workloads). */
typedef struct { uint64_t s[4]; int has_spare; double spare; } cli_rng;
void cli_rng_seed(cli_rng *r, uint64_t seed);
double cli_rng_normal(cli_rng *r);
double cli_rng_uniform(cli_rng *r); /* in (0, 1) */
void cli_fill_normal(cli_rng *r, float *x, int64_t n);

/* Read bandwidth of this machine with `threads` threads over a buffer of `bytes`. GB/s. */
double cli_read_bandwidth_probe(int threads, int64_t bytes);

/* Synthetic workloads (tools/workload.c). */
typedef enum { WL_RANDOM = 0, WL_PLANTED = 1, WL_HEAVY = 2, WL_ALIBI = 3, WL_TRACE = 4 } wl_kind;
typedef struct {
    wl_kind kind;
    int64_t heads, kv_heads, dim;
    float *dirs;     /* [kv_heads][dim] unit directions (planted, alibi) */
    float *slopes;   /* [heads] NAPE slopes (alibi), or the trace's alibi_slopes */
    int32_t *outlier;/* [kv_heads][4] outlier channels (heavy) */
    /* trace:FILE */
    ekv_safetensors *trace;
    ekv_tensor_info tq, tk, tv;
    int64_t trace_len, trace_steps, next_step;
    int has_slopes;
} wl_state;
/* Opens trace:FILE[@prefix] (see tools/workload.c for the layout) into w, setting its shapes.
 * Returns 0, or -1 with a message in err. */
int wl_trace_open(wl_state *w, ekv_context *ctx, const char *spec, char *err, size_t errlen);
int wl_parse(const char *name, wl_kind *out);
const char *wl_name(wl_kind k);
int wl_init(wl_state *w, wl_kind kind, int64_t heads, int64_t kv_heads, int64_t dim, uint64_t seed);
void wl_free(wl_state *w);
const float *wl_slopes(const wl_state *w);
/* Appends len tokens of the workload to each sequence (progress on stderr). 0 = ok. */
int wl_fill(ekv_context *ctx, ekv_cache *cache, const int32_t *seqs, int64_t batch, int64_t len, const wl_state *w,
            cli_rng *r, const char *who);
/* Queries [batch][heads][dim] of the workload. */
void wl_queries(wl_state *w, cli_rng *r, float *q, int64_t batch);

int cmd_bench(int argc, char **argv);

/* bench --backend cuda (tools/bench_cuda.cu; tools/bench_cuda_stub.c without -DEKV_CUDA=ON) */
typedef struct {
    const char *method, *json, *workload;
    int64_t lens[64];
    int nlens;
    int64_t batch, heads, kv_heads, dim, page, iters, warmup, seed, budget_tokens, ragged_min;
    double budget, alpha;
    ekv_dtype dtype;
} cuda_bench_opts;
int cli_bench_cuda(const cuda_bench_opts *o);
int cmd_eval(int argc, char **argv);

/* The model subcommands (tools/run.c, tools/ppl.c, tools/trace.c) and what they share
 * (tools/model_cli.c). */
typedef struct {
    const char *model; /* NULL = the shipped model */
    ekv_attn_method method;
    double budget;
    int64_t threads;
    int32_t page;
    ekv_dtype kv_dtype;
} model_opts;
void model_opts_init(model_opts *o);
void model_opts_help(FILE *f);
/* Parses argv[*i] if it is a common model option (advancing *i); returns 1 if it was. */
int model_opt(const char *sub, int argc, char **argv, int *i, model_opts *o);
/* Creates the context and loads the model for max_tokens tokens; prints why not and returns 1. */
int model_open(const char *sub, const model_opts *o, int64_t max_tokens, ekv_context **ctx, ekv_model **m);
/* Runs n tokens through the model in chunks, with progress; fn (if not NULL) gets the logits
 * [c][vocab] of every chunk that reaches position logits_from (first position: start). */
typedef void (*model_logits_fn)(void *arg, int64_t start, int64_t c, const float *logits);
int model_feed(const char *sub, const char *what, ekv_context *ctx, ekv_model *m, const int32_t *tokens, int64_t n,
               int64_t logits_from, model_logits_fn fn, void *arg);
/* The whole file, NUL-terminated (*len excludes the NUL), or NULL. */
char *cli_read_file(const char *path, int64_t *len);
int cmd_run(int argc, char **argv);
int cmd_ppl(int argc, char **argv);
int cmd_trace(int argc, char **argv);
#endif
