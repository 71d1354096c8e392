/* Helpers shared by the CLI's subcommands (not part of the library). */
#ifndef EKV_CLI_H
#define EKV_CLI_H
#include "entmaxkv.h"
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Exit codes: 0 ok, 1 runtime failure, 2 bad usage. */
#define CLI_USAGE 2

/* Prints "entmaxkv SUB: message" to stderr and exits with code 2. */
void cli_usage_error(const char *sub, const char *fmt, ...)
        __attribute__((format(printf, 2, 3), noreturn));
/* The value of option argv[*i] (advancing *i), or a usage error for subcommand sub. */
const char *cli_need(const char *sub, int argc, char **argv, int *i);
/* The same, parsed as an integer in [lo, hi]. */
int64_t cli_need_int(const char *sub, int argc, char **argv, int *i, int64_t lo, int64_t hi);
/* A subcommand's plain options as data: a string, an integer in [lo, hi] (int64_t field) or
 * a flag (int field set to 1), stored at `offset` in the options struct. */
typedef enum { CLI_OPT_STR, CLI_OPT_INT, CLI_OPT_FLAG } cli_opt_kind;
typedef struct {
    const char *name;
    cli_opt_kind kind;
    size_t offset;
    int64_t lo, hi;
} cli_opt;
#define CLI_STR(name, type, field)                                                                 \
    { name, CLI_OPT_STR, offsetof(type, field), 0, 0 }
#define CLI_INT(name, type, field, lo, hi)                                                         \
    { name, CLI_OPT_INT, offsetof(type, field), lo, hi }
#define CLI_FLAG(name, type, field)                                                                \
    { name, CLI_OPT_FLAG, offsetof(type, field), 0, 0 }
#define CLI_NOPTS(table) (sizeof(table) / sizeof((table)[0]))
/* Takes argv[*i] if the table names it (advancing *i past its value): 1, else 0. */
int cli_take(const char *sub, const cli_opt *table, size_t n, int argc, char **argv, int *i,
             void *opts);
/* The option loop of every subcommand: --help / -h prints help(stdout) and exits 0; take()
 * consumes each option it knows (returning 1); anything else is a usage error (exit 2). */
typedef int (*cli_take_fn)(const char *sub, int argc, char **argv, int *i, void *opts);
void cli_parse(const char *sub, int argc, char **argv, void (*help)(FILE *), cli_take_fn take,
               void *opts);
/* The value of option argv[*i] as a dtype name (f32, f16, bf16), or a usage error. */
ekv_dtype cli_need_dtype(const char *sub, int argc, char **argv, int *i);
/* A select method of the library by name, or a usage error that says which option (what)
 * and lists the library's method names. */
ekv_select_method cli_method(const char *sub, const char *what, const char *name);
/* The value of option argv[*i] as a method name (cli_method). */
ekv_select_method cli_need_method(const char *sub, int argc, char **argv, int *i);
/* Whether a method reads per-token key codes (screened): its cache needs --code-bits. */
int cli_method_codes(ekv_select_method m);
/* The default of --code-bits: 8. On the shipped model's attention the 8-bit codes' tighter bounds
 * keep nearly only the support where 4-bit ones keep ~10x more at its sharp layers (layer 7 of a
 * 32K trace: 36 survivors a head against 320, for a support of 31), and screened decode is faster
 * with them on both backends (H100: the 256K trace 8 % / 5 % faster at layers 0 / 7, the model's
 * decode 3 % at 512K and 15 % at 1M), for D bytes of codes a token and KV head instead of D / 2
 * (K and V take 4 D in f16). bench/RESULTS.md, sixteenth session. */
enum { CLI_CODE_BITS_DEFAULT = 8 };
/* The value of --code-bits: 4 or 8, or a usage error. */
int32_t cli_need_code_bits(const char *sub, int argc, char **argv, int *i);
/* Parses a non-negative integer with optional k/K (1024) or M (1048576) suffix. */
int cli_parse_i64(const char *s, int64_t *out);
/* A whole string as a double (NaN and infinities included: the callers' ranges refuse them);
 * a decimal below the smallest double rounds to the nearest (subnormal or 0), one beyond the
 * largest is refused. */
int cli_parse_double(const char *s, double *out);
/* A number or a ratio "a/b" with b > 0. */
int cli_parse_fraction(const char *s, double *out);
/* The entries of the comma list s (option opt), split in a copy in buf[cap]: items[] point
 * into buf; the count. A list too long for buf, an empty entry (",", "1,,2", "a,") or more
 * than max entries is a usage error: every list option is parsed here. */
int cli_split_list(const char *sub, const char *opt, const char *s, char *buf, size_t cap,
                   char **items, int max);
/* A comma list of non-negative integers (cli_parse_i64 each) into out[max]; the count. Any
 * bad entry is a usage error. */
int cli_parse_i64_list(const char *sub, const char *opt, const char *s, int64_t *out, int max);
double cli_now_seconds(void);
/* Ctrl-C as a request to stop: after cli_catch_interrupt, the first SIGINT only sets the flag
 * cli_interrupted() reads (long runs stop at their next chunk and report what they have); a
 * second one ends the process as usual. */
void cli_catch_interrupt(void);
int cli_interrupted(void);
/* The exit status of a run stopped by SIGINT (128 + 2, as the shell reports it). */
enum { CLI_EXIT_INTERRUPTED = 130 };

/* xoshiro256+ stream with Gaussian samples (fast fill of synthetic workloads). */
typedef struct {
    uint64_t s[4];
    int has_spare;
    double spare;
} cli_rng;
void cli_rng_seed(cli_rng *r, uint64_t seed);
double cli_rng_normal(cli_rng *r);
double cli_rng_uniform(cli_rng *r); /* in (0, 1) */
void cli_fill_normal(cli_rng *r, float *x, int64_t n);

/* Read bandwidth of this machine with `threads` threads over a buffer of `bytes`. GB/s. */
double cli_read_bandwidth_probe(int threads, int64_t bytes);

/* An output file written whole or not at all (docs/cli.md, "Common rules"). cli_file_open,
 * called before the work whose results the file will hold, checks the path by creating a
 * temporary file next to it (PATH.tmp-XXXXXX, with the mode PATH has or a new file would get):
 * a directory, a missing directory or one that takes no new file fails at once, not after the
 * work. cli_file_commit renames it over PATH once everything was written, so a failed write
 * leaves the file that was there before. A PATH that exists and is not a regular file
 * (/dev/stdout, a pipe) is written in place. Each prints why and returns 1 on failure. */
typedef struct {
    FILE *f;
    const char *name; /* the path as given, for messages */
    char *path;       /* the file replaced (a link's target: the link stays) */
    char *tmp;        /* the temporary file; NULL when written in place */
} cli_file;
int cli_file_open(cli_file *o, const char *sub, const char *path);
/* Flushes, syncs and closes the file, then renames it over the path. */
int cli_file_commit(cli_file *o, const char *sub);
/* Closes the file and removes the temporary one: the path keeps what it held. */
void cli_file_discard(cli_file *o);

/* --json FILE: the JSON goes to FILE (a cli_file), or to stdout when FILE is "-"; the
 * human-readable table goes to stdout, or to stderr when the JSON has stdout (so
 * `--json - | jq` works). */
typedef struct {
    FILE *json, *text;
    cli_file file;
} cli_out;
/* path NULL = no JSON (json stays NULL). Prints why not and returns 1 on failure. */
int cli_out_open(cli_out *o, const char *sub, const char *path);
/* Commits the JSON file (flushes stdout); prints why and returns 1 if writing it failed. */
int cli_out_close(cli_out *o, const char *sub);
/* Drops the JSON file unwritten (a run that failed): the path keeps what it held. */
void cli_out_discard(cli_out *o);
/* A JSON number: fmt (one double conversion, e.g. "%.9g") of the value, or null when it is NaN
 * or infinite, which JSON cannot hold. Returns buf. */
const char *cli_json_num(char *buf, size_t n, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

/* Synthetic workloads (tools/workload.c). */
typedef enum { WL_RANDOM = 0, WL_PLANTED = 1, WL_HEAVY = 2, WL_ALIBI = 3, WL_TRACE = 4 } wl_kind;
typedef struct {
    wl_kind kind;
    int64_t heads, kv_heads, dim;
    float *dirs;      /* [kv_heads][dim] unit directions (planted, alibi) */
    float *slopes;    /* [heads] NAPE slopes (alibi), or the trace's alibi_slopes */
    int32_t *outlier; /* [kv_heads][4] outlier channels (heavy) */
    /* trace:FILE */
    ekv_safetensors *trace;
    ekv_tensor_info tq, tk, tv;
    int64_t trace_len, trace_steps, next_step;
    int has_slopes;
} wl_state;
/* The kind of a --workload value: a synthetic name, or WL_TRACE for "trace:FILE[@PREFIX]".
 * Returns -1 for anything else. */
int wl_parse(const char *spec, wl_kind *out);
const char *wl_name(wl_kind k);
/* Opens the workload of --workload spec: a trace (which fixes the shapes: read them from w)
 * or a synthetic one of the given shapes. Returns 0, or 1 with a message on stderr. */
int wl_open(wl_state *w, ekv_context *ctx, const char *spec, int64_t heads, int64_t kv_heads,
            int64_t dim, uint64_t seed, const char *who);
void wl_free(wl_state *w);
const float *wl_slopes(const wl_state *w);
/* Queries [batch][heads][dim] of the workload. */
void wl_queries(wl_state *w, cli_rng *r, float *q, int64_t batch);

/* The options bench and eval share (same names, same ranges): the workload, the cache
 * shape, threads, seed and the JSON file. */
typedef struct {
    const char *workload, *json;
    wl_kind wl;
    int64_t batch, heads, kv_heads, dim, page, threads, seed;
    ekv_dtype dtype;
    int ranges; /* --ranges: the page ranges' dtype, or -1 for the K dtype's compact ranges */
} wl_opts;
/* The range dtype of --ranges for K stored as dtype (-1: ekv_cache_compact_ranges). */
ekv_dtype wl_range_dtype(const wl_opts *o);
void wl_opts_init(wl_opts *o, const char *workload);
/* Parses argv[*i] if it is one of them (advancing *i); 1 if it was. max_batch: the largest
 * --batch of subcommand sub. */
int wl_opt(const char *sub, int argc, char **argv, int *i, wl_opts *o, int64_t max_batch);
/* The checks between them, after parsing (usage errors). */
void wl_opts_check(const char *sub, wl_opts *o);

/* The context of bench and eval: threads (0 = all CPUs) and SIMD level. Returns 0, 1, or
 * CLI_USAGE when the ISA is not supported here (message on stderr). */
int cli_context(const char *who, int64_t threads, ekv_isa isa, ekv_context **ctx);

/* What bench and eval decode over (tools/workload.c): a cache of `batch` sequences of `len`
 * tokens filled with the workload, its CSR page table and views, and a buffer of page lists
 * (one list per sequence and KV head). */
typedef struct {
    int64_t batch, len, page, superpage; /* superpage < 0: the library's default */
    ekv_dtype dtype;
    int32_t code_bits;     /* key codes of the cache: 0 = none, 4 or 8 (screened) */
    ekv_dtype range_dtype; /* the page ranges the bounds read (docs/math.md §1.2) */
} wl_geometry;
typedef struct {
    ekv_cache *cache;
    int32_t *seqs;
    int64_t batch, len;
    int64_t *indptr;
    int32_t *indices, *last_page_len;
    ekv_page_table table;
    ekv_paged_kv kv;
    ekv_page_stats stats;
    int64_t *list_indptr;
    int32_t *list_pages;
    int64_t list_capacity;
} wl_setup;
/* Creates the cache for g and w's shapes and fills it (progress on stderr, random numbers
 * from r). Returns 0, or 1 with a message on stderr; wl_setup_free is safe either way. */
int wl_setup_create(wl_setup *s, ekv_context *ctx, const wl_state *w, const wl_geometry *g,
                    cli_rng *r, const char *who);
void wl_setup_free(wl_setup *s);
/* An empty page list over the setup's buffer. */
ekv_page_list wl_setup_list(const wl_setup *s);
/* Tokens of sequence b. */
int64_t wl_setup_seq_len(const wl_setup *s, int64_t b);

/* bench: the options of every backend (tools/bench.c; --backend cuda runs cli_bench_cuda,
 * tools/bench_cuda/, or tools/bench_cuda_stub.c without -DEKV_CUDA=ON). */
typedef struct {
    wl_opts w;
    ekv_backend backend;
    ekv_select_method method;
    double budget, alpha;
    int64_t budget_tokens;
    int64_t lens[64];
    int nlens;
    int64_t iters, warmup, superpage, ragged_min;
    int64_t shards, gpus; /* --shards N (local transport) / --gpus N (nccl), cuda; 0 = none */
    int shard_pools;      /* --shard-pools: each shard's GPU holds only its pages (issue 16) */
    ekv_isa isa;
    int32_t code_bits; /* --code-bits (CLI_CODE_BITS_DEFAULT): the cache's key codes when the method
                          reads them (cli_method_codes), else the cache has none */
    int32_t tensor_cores; /* --tensor-cores 0|1 (cuda; default 1): the plan's tensor_cores */
    int32_t fused_attend; /* --fused-attend 0|1 (cuda; default 0): the plan's fused_attend */
    int32_t overlap_launches; /* --overlap-launches -1|0|1 (cuda; default -1): the plan's field */
    int64_t select_part_pages; /* --select-part-pages N (cuda; default 0): the plan's field */
    int32_t tau_cluster;       /* --tau-cluster -1|0|2|4|8 (cuda; default -1): the plan's   */
    int64_t tau_spread_min;    /* --tau-spread-min N (cuda; default 0): the plan's field     */
} bench_opts;
/* The token budget of a step over len tokens: --budget-tokens, else --budget x len (>= 1). */
int64_t bench_budget_tokens(const bench_opts *o, int64_t len);
int cmd_bench(int argc, char **argv);
int cli_bench_cuda(const bench_opts *o);
int cmd_eval(int argc, char **argv);

/* The model subcommands (tools/run.c, tools/ppl.c, tools/trace.c) and what they share
 * (tools/model_cli.c). */
typedef struct {
    const char *model; /* NULL = the shipped model */
    ekv_select_method method;
    double budget;
    int64_t threads;
    int32_t page;
    ekv_dtype kv_dtype;
    int32_t code_bits; /* --code-bits (CLI_CODE_BITS_DEFAULT): the caches' key codes when a method
                          the subcommand runs reads them (cli_method_codes), else none */
    int codes; /* set when the subcommand switches to such a method later (model_phases) */
    ekv_backend backend;               /* --backend cpu|cuda (default cpu) */
    int64_t prefill_chunk;             /* --prefill-chunk (cuda dense prefill; 0 = auto) */
    int no_graphs;                     /* --no-graphs: cuda decode steps as eager launches */
    int32_t max_seqs;                  /* sequences the model holds (run --prompts-file); 0 = 1 */
    ekv_prefill_kernel prefill_kernel; /* --prefill-kernel auto|fused|hist|gemm (cuda) */
    int prefill_kernel_set;            /* --prefill-kernel given (cuda only, as --prefill-chunk
                                          and --no-graphs: model_parse) */
    int64_t prefill_candidates;        /* --prefill-candidates, --prefill-compact,  */
    int64_t prefill_compact;           /* --decode-candidates: the cuda list sizes  */
    int64_t decode_candidates;         /* (ekv_model_params; 0 = the default)       */
    int64_t fused_attend;              /* --fused-attend 0|1 (ekv_model_params)     */
    int64_t tau_cluster;               /* --tau-cluster K (ekv_model_params)        */
    int64_t overlap_launches;          /* --overlap-launches -1|0|1 (ekv_model_params) */
    int64_t superpage;                 /* --superpage S (ekv_model_params.superpage_pages) */
} model_opts;
void model_opts_init(model_opts *o);
void model_opts_help(FILE *f);
/* A method of the model subcommands (option `what` of `sub`): the library's (cli_method) but
 * oracle, which needs the dense pass it is measured against (eval, and bench on the cpu;
 * docs/cli.md); a usage error otherwise. */
ekv_select_method model_method(const char *sub, const char *what, const char *name);
/* Parses argv[*i] if it is a common model option (advancing *i); returns 1 if it was. */
int model_opt(const char *sub, int argc, char **argv, int *i, model_opts *o);
/* The option loop of a model subcommand (cli_parse): the shared model options into mo, the
 * subcommand's table into opts, then extra (may be NULL) for the options that need code. */
void model_parse(const char *sub, int argc, char **argv, void (*help)(FILE *), model_opts *mo,
                 const cli_opt *table, size_t n, cli_take_fn extra, void *opts);
/* The caches' key-code width: --code-bits when a method the subcommand runs reads codes
 * (o->method, or o->codes for one it switches to later), else 0. */
int32_t model_code_bits(const model_opts *o);
/* One phase of a method comparison (run --compare, ppl --compare): a method and its budget
 * (--method and --budget, or a --compare entry "method" or "method:budget"). */
typedef struct {
    ekv_select_method method;
    double budget;
} model_phase;
enum { MODEL_MAX_PHASES = 9 }; /* --method and at most 8 --compare entries */
/* The methods of run and ppl (docs/cli.md): the phases, and the method before them
 * (--prefill-method: run's prompt, ppl's unscored prefix of each window). */
typedef struct {
    model_phase list[MODEL_MAX_PHASES]; /* [0] --method, then --compare's in order */
    int n;                              /* phases in list (1 = no --compare) */
    int prefill_set;                    /* --prefill-method given */
    ekv_select_method prefill;
} model_phases;
void model_phases_init(model_phases *p);
/* Takes --compare LIST or --prefill-method M (advancing *i); 1 if argv[*i] was one. A bad
 * entry, a budget outside (0, 1] or more than 8 entries is a usage error. */
int model_phases_opt(const char *sub, int argc, char **argv, int *i, model_phases *p);
/* After parsing: list[0] = --method and --budget, --budget for the entries without a budget
 * of their own, mo->codes when any method needs key codes (the caches are made at load), and
 * mo->method = the --prefill-method (the model loads with the method it runs first). */
void model_phases_finish(model_phases *p, model_opts *mo);
/* Switches the model to phase ph's method and budget (ekv_model_set_method); prints why not
 * and returns 1. */
int model_set_phase(const char *sub, ekv_context *ctx, ekv_model *m, model_phase ph);
/* Whether the loaded model takes every phase's method (ekv_model_set_method refuses e.g.
 * oracle on cuda), asked before the first token so that a refusal does not come after a long
 * prefill; leaves the model with mo->method, the one it loaded with. Prints why not and
 * returns 1. */
int model_check_phases(const char *sub, ekv_context *ctx, ekv_model *m, const model_phase *list,
                       int n, const model_opts *mo);
/* Whether the method reads --budget (topk: its token share; certified: its round 1). */
int model_uses_budget(ekv_select_method m);
/* "; prefill kernel fused (rows retried R, by Newton passes N)" when the stats hold cuda
 * dense prefill steps (which kernel ran: nothing falls back silently), else nothing. */
void model_print_prefill_kernel(const ekv_model_stats *st);
/* "; tau lists compacted C, over the whole row W" when the CUDA decode stages' tau took either
 * path (ekv_model_stats.tau_compacted_rows, tau_whole_rows), "; screen lists retried R, every
 * token kept A" when the screen did (screen_retry_rows, screen_all_rows); else nothing */
void model_print_slow_paths(const ekv_model_stats *st);
/* "; N% of the steps replayed from CUDA graphs" when any were (ekv_model_stats.graph_steps of
 * its steps), else nothing */
void model_print_graph_steps(const ekv_model_stats *st);
/* The next token from logits[V]: greedy (temp 0) or sampled at temperature temp (run and
 * run --prompts-file). */
int32_t model_sample(const float *logits, int64_t V, double temp, cli_rng *r);
/* "topk 0.0625", "dense": the method as the reports name it. */
void model_method_label(char *buf, size_t n, ekv_select_method m, double budget);
/* What a model subcommand over a text holds: the text, the context and the model. */
typedef struct {
    char *text; /* NUL-terminated, len bytes */
    int64_t len;
    ekv_context *ctx;
    ekv_model *m;
} model_session;
/* The text of --text FILE with at least `need` bytes after `offset` (the subcommand's --ctx),
 * then the context and the model for `need` tokens; prints why not, frees what it took and
 * returns 1. */
int model_open_text(const char *sub, const model_opts *mo, const char *path, int64_t offset,
                    int64_t need, model_session *s);
void model_close(model_session *s);
/* Creates the context and loads the model for max_tokens tokens; prints why not and returns 1. */
int model_open(const char *sub, const model_opts *o, int64_t max_tokens, ekv_context **ctx,
               ekv_model **m);
/* Runs n tokens through the model in chunks, with progress (tokens/s, ETA); fn (if not NULL)
 * gets the logits [c][vocab] of every chunk that reaches position logits_from (first position:
 * start). Returns 0, 1 on an error (printed), or 2 when interrupted (cli_interrupted) between
 * chunks, fn having seen every chunk that ran; *fed (if not NULL): the tokens that ran. */
typedef void (*model_logits_fn)(void *arg, int64_t start, int64_t c, const float *logits);
int model_feed(const char *sub, const char *what, ekv_context *ctx, ekv_model *m,
               const int32_t *tokens, int64_t n, int64_t logits_from, model_logits_fn fn, void *arg,
               int64_t *fed);
/* The tokens model_feed runs in one ekv_model_seq_step: a prompt fed in these chunks (as the
 * server's prefill is, one chunk between decode steps) runs the same blocks as run's. */
int64_t model_feed_chunk(const ekv_model *m);
/* The same for sequence seq of the model (ekv_model_seq_step; model_feed is sequence 0). */
int model_feed_seq(const char *sub, const char *what, ekv_context *ctx, ekv_model *m, int32_t seq,
                   const int32_t *tokens, int64_t n, int64_t logits_from, model_logits_fn fn,
                   void *arg, int64_t *fed);
/* A model_logits_fn (arg: a model_last_row) that copies the logits of position pos out of its
 * chunk into out: what a prefill needs to sample the first new token. */
typedef struct {
    float *out;
    int64_t pos, V;
} model_last_row;
void model_keep_last_row(void *arg, int64_t start, int64_t c, const float *logits);
/* The whole file, NUL-terminated (*len excludes the NUL), or NULL. */
char *cli_read_file(const char *path, int64_t *len);
int cmd_run(int argc, char **argv);
/* run --prompts-file (tools/run_batch.c): every line a sequence, decoded in batched steps. */
int run_batch(model_opts *mo, const char *path, int64_t n, double temp, int64_t seed, int quiet,
              const model_phase *phases, int nphases);
int cmd_ppl(int argc, char **argv);
int cmd_trace(int argc, char **argv);
/* entmaxkv serve (tools/serve.c; tools/serve_stub.c in a build without libmicrohttpd). */
int cmd_serve(int argc, char **argv);
#endif
