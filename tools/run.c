/*
 * entmaxkv run: generates text with the model (docs/cli.md). The prompt is prefilled in blocks,
 * then tokens are generated one decode step at a time (greedy, or sampled with --temp), and a
 * stats line reports tokens/s of prefill and decode and the fraction of the KV bytes that
 * attention read. --compare decodes further tokens with other methods after the same prefill,
 * one stats line each: sparse against dense decode speed at one context length in one run;
 * with --rewind each of them starts again from the prompt's end (the caches truncated back to
 * it, ekv_model_seq_truncate): every method answers the same prompt after one prefill, and each
 * stats line after the first says whether it wrote the first method's tokens.
 */
#include "cli.h"
#include <stdlib.h>
#include <string.h>

static const char DEFAULT_PROMPT[] =
        "The Python Tutorial\n\nPython is an easy to learn, powerful programming language. It has efficient "
        "high-level data structures and a simple but effective approach to object-oriented programming.";

static void run_help(FILE *f) {
    fprintf(f,
            "usage: entmaxkv run [--model FILE] [--prompt TEXT | --prompt-file F] [-n TOKENS] [options]\n"
            "\n"
            "Generates text with the entmaxkv language model (a byte-level, 1.5-entmax transformer)\n"
            "and ends with a line of stats: prefill and decode tokens/s and the share of the KV\n"
            "cache bytes attention read.\n"
            "\n"
            "  --prompt TEXT         the prompt (default: a built-in one)\n"
            "  --prompt-file F       read the prompt from a file\n"
            "  --prompts-file F      every non-empty line of F is a prompt (up to 64; more than\n"
            "                        one needs --backend cuda); each is prefilled, then all are\n"
            "                        decoded together in batched steps (one batch over their\n"
            "                        page lists)\n"
            "  -n TOKENS             tokens to generate (default 200)\n");
    model_opts_help(f);
    fprintf(f,
            "  --temp T              sampling temperature; 0 = greedy (default 0)\n"
            "  --seed S              random seed for sampling (default 1)\n"
            "  --prefill-method M    the prompt's method (default: --method's); --method then\n"
            "                        serves the generated tokens (e.g. a dense tensor-core\n"
            "                        prefill on cuda, then a sparse decode)\n"
            "  --compare LIST        after decoding, decode -n more tokens with each method of the\n"
            "                        comma list in turn (same sequence; one stats line each;\n"
            "                        method:F gives topk or certified its own budget, e.g.\n"
            "                        topk:1/64; screened in the list gives the caches\n"
            "                        --code-bits codes)\n"
            "  --rewind              with --compare: each method starts again from the prompt's\n"
            "                        end (the caches truncated back to it, the same --seed), so\n"
            "                        every method continues the same prompt after one prefill\n"
            "  --quiet               do not print the prompt and the text (stats only)\n"
            "  --help                this text\n"
            "\n"
            "The prompt is echoed when it is under 4 KiB. Progress goes to stderr.\n");
}

typedef struct {
    double seconds;
    int64_t tokens;
    ekv_model_stats st;
    const int32_t *text; /* --rewind: the tokens it generated (NULL otherwise) */
} phase;

/* --rewind: whether a method wrote the first method's tokens (every method continued the same
 * prompt with the same sampler, so an exact method must: docs/cli.md, `run`), ending its stats
 * line. */
static void print_text_match(const phase *p, const phase *first, const char *first_label) {
    if (!p->text || !first->text || p == first) return;
    const int64_t n = p->tokens < first->tokens ? p->tokens : first->tokens;
    int64_t i = 0;
    while (i < n && p->text[i] == first->text[i]) i++;
    if (i == n && p->tokens == first->tokens)
        printf("; the same %lld tokens as %s", (long long)n, first_label);
    else
        printf("; differs from %s at token %lld", first_label, (long long)i);
}

/* One stats line, without its end of line. */
static void print_phase(const char *what, const char *label, const phase *p, ekv_backend be) {
    printf("[%s %s] %lld tokens in %.2f s: %.2f tokens/s", what, label, (long long)p->tokens,
           p->seconds, p->seconds > 0 ? (double)p->tokens / p->seconds : 0.0);
    if (be == EKV_BACKEND_CUDA) /* the CUDA stages do not count what they read */
        printf("; KV read not measured on cuda");
    else
        printf("; KV read %.4f of the K+V bytes",
               p->st.bytes_kv ? (double)p->st.bytes_read / (double)p->st.bytes_kv : 0.0);
    if (p->st.lists)
        printf("; round 2 in %.1f%% of lists",
               100.0 * (double)p->st.lists_round2 / (double)p->st.lists);
    model_print_prefill_kernel(&p->st);
    model_print_slow_paths(&p->st);
    model_print_graph_steps(&p->st);
}

typedef struct {
    model_opts mo;
    const char *prompt, *prompt_file, *prompts_file;
    int64_t n, seed;
    double temp;
    int quiet, rewind;
    model_phases ph; /* --method, then the --compare list; --prefill-method: the prompt's */
} run_opts;

static const cli_opt run_table[] = {
        CLI_STR("--prompt", run_opts, prompt),
        CLI_STR("--prompt-file", run_opts, prompt_file),
        CLI_STR("--prompts-file", run_opts, prompts_file),
        CLI_INT("-n", run_opts, n, 0, (int64_t)1 << 30),
        CLI_INT("--seed", run_opts, seed, 0, INT64_MAX),
        CLI_FLAG("--quiet", run_opts, quiet),
        CLI_FLAG("--rewind", run_opts, rewind),
};

/* The options that need code: --temp (a number in a range), --compare (a method list) and
 * --prefill-method (a method), as ppl takes them (model_phases_opt). */
static int run_extra(const char *sub, int argc, char **argv, int *i, void *vo) {
    run_opts *o = vo;
    if (!strcmp(argv[*i], "--temp")) {
        const char *v = cli_need(sub, argc, argv, i);
        if (cli_parse_double(v, &o->temp) || !(o->temp >= 0 && o->temp <= 100))
            cli_usage_error(sub, "--temp %s: expected a number in [0, 100]", v);
        return 1;
    }
    return model_phases_opt(sub, argc, argv, i, &o->ph);
}

static void parse(int argc, char **argv, run_opts *o) {
    memset(o, 0, sizeof *o);
    model_opts_init(&o->mo);
    model_phases_init(&o->ph);
    o->n = 200;
    o->seed = 1;
    model_parse("run", argc, argv, run_help, &o->mo, run_table, CLI_NOPTS(run_table), run_extra, o);
    model_phases_finish(&o->ph, &o->mo); /* o->mo.method: the prompt's from here on */
    if (o->prompt && o->prompt_file)
        cli_usage_error("run", "give --prompt or --prompt-file, not both");
    if (o->prompts_file && (o->prompt || o->prompt_file))
        cli_usage_error("run", "--prompts-file takes no --prompt or --prompt-file");
    if (o->rewind && (o->ph.n < 2 || o->prompts_file))
        cli_usage_error("run", "--rewind needs --compare (and one prompt)");
}

/* The prompt's bytes (NUL-terminated), or NULL with a message. */
static char *read_prompt(const run_opts *o, int64_t *plen) {
    char *text;
    if (o->prompt_file) {
        text = cli_read_file(o->prompt_file, plen);
        if (!text) fprintf(stderr, "entmaxkv run: cannot read '%s'\n", o->prompt_file);
        return text;
    }
    text = strdup(o->prompt ? o->prompt : DEFAULT_PROMPT);
    if (!text) fprintf(stderr, "entmaxkv run: out of memory\n");
    *plen = text ? (int64_t)strlen(text) : 0;
    return text;
}

/* --rewind: back to the prompt's end (plen tokens), its logits and the first sampler state. */
static int rewind_to_prompt(const run_opts *o, ekv_context *ctx, ekv_model *m, int64_t plen,
                            const float *prompt_logits, float *logits, cli_rng *rng) {
    if (ekv_model_seq_truncate(m, 0, plen)) {
        fprintf(stderr, "entmaxkv run: --rewind: %s\n", ekv_last_error(ctx));
        return 1;
    }
    memcpy(logits, prompt_logits, sizeof(float) * (size_t)ekv_model_get_config(m)->vocab);
    cli_rng_seed(rng, (uint64_t)o->seed);
    return 0;
}

/* Decodes o->n tokens with method ph, from the logits of the previous token (into text where
 * given). */
static int decode_phase(const run_opts *o, int ph, ekv_context *ctx, ekv_model *m, float *logits,
                        cli_rng *rng, int32_t *text, phase *p) {
    const int64_t V = ekv_model_get_config(m)->vocab;
    if (model_set_phase("run", ctx, m, o->ph.list[ph])) return 1;
    if (ph > 0 && !o->quiet) {
        char lab[64];
        model_method_label(lab, sizeof lab, o->ph.list[ph].method, o->ph.list[ph].budget);
        printf(o->rewind ? "\n--- from the prompt with %s ---\n" : "\n--- continuing with %s ---\n",
               lab);
    }
    ekv_model_reset_stats(m);
    memset(p, 0, sizeof *p);
    const double t1 = cli_now_seconds();
    int rc = 0;
    for (int64_t i = 0; i < o->n && !rc; i++) {
        int32_t next = model_sample(logits, V, o->temp, rng);
        if (!o->quiet) {
            putchar(next);
            fflush(stdout);
        }
        if (text) text[i] = next;
        ekv_status st = ekv_model_step(m, &next, 1, logits);
        if (st) {
            fprintf(stderr, "\nentmaxkv run: %s: %s\n", ekv_status_string(st), ekv_last_error(ctx));
            rc = 1;
        } else
            p->tokens++;
    }
    p->seconds = cli_now_seconds() - t1;
    ekv_model_get_stats(m, -1, &p->st);
    return rc;
}

/* Prefill (only the last token's logits are kept), then a decode phase per method. */
static int generate(const run_opts *o, const char *text, int64_t plen, ekv_context *ctx,
                    ekv_model *m) {
    const int64_t V = ekv_model_get_config(m)->vocab;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)plen);
    float *logits = malloc(sizeof(float) * (size_t)V), *prompt_logits = NULL;
    if (o->rewind) prompt_logits = malloc(sizeof(float) * (size_t)V);
    phase pre = {0}, dec[MODEL_MAX_PHASES] = {{0}};
    int32_t *texts = o->rewind ? malloc(sizeof(int32_t) * (size_t)(o->n * o->ph.n + 1)) : NULL;
    int rc = tok && logits && (prompt_logits || !o->rewind) && (texts || !o->rewind) ? 0 : 1,
        ran = 0;
    if (rc) fprintf(stderr, "entmaxkv run: out of memory\n");
    if (!rc) {
        ekv_model_tokenize(text, plen, tok);
        if (!o->quiet && plen < 4096) {
            fwrite(text, 1, (size_t)plen, stdout);
            fflush(stdout);
        } else if (!o->quiet)
            fprintf(stderr, "  [a %lld-byte prompt]\n", (long long)plen);
        const double t0 = cli_now_seconds();
        model_last_row lr = {logits, plen - 1, V};
        rc = model_feed("run", "prefill", ctx, m, tok, plen, plen - 1, model_keep_last_row, &lr,
                        NULL);
        pre.seconds = cli_now_seconds() - t0;
        pre.tokens = plen;
        ekv_model_get_stats(m, -1, &pre.st);
    }
    cli_rng rng;
    cli_rng_seed(&rng, (uint64_t)o->seed);
    if (!rc && o->rewind) memcpy(prompt_logits, logits, sizeof(float) * (size_t)V);
    for (int ph = 0; ph < o->ph.n && !rc; ph++) {
        if (ph > 0 && o->rewind)
            rc = rewind_to_prompt(o, ctx, m, plen, prompt_logits, logits, &rng);
        int32_t *text = texts ? texts + ph * o->n : NULL;
        if (!rc) rc = decode_phase(o, ph, ctx, m, logits, &rng, text, &dec[ph]);
        dec[ph].text = text;
        ran = ph + 1;
    }
    if (!o->quiet) printf("\n");
    char lab[64], what[64];
    char first[64]; /* the method the others' tokens are checked against */
    model_method_label(lab, sizeof lab, o->mo.method, o->mo.budget);
    model_method_label(first, sizeof first, o->ph.list[0].method, o->ph.list[0].budget);
    printf("\n");
    print_phase("prefill", lab, &pre, o->mo.backend);
    printf("\n");
    for (int ph = 0; ph < ran; ph++) {
        model_method_label(lab, sizeof lab, o->ph.list[ph].method, o->ph.list[ph].budget);
        snprintf(what, sizeof what, "decode @%lld",
                 (long long)(plen + (o->rewind ? 0 : ph) * o->n));
        print_phase(what, lab, &dec[ph], o->mo.backend);
        print_text_match(&dec[ph], &dec[0], first);
        printf("\n");
    }
    free(texts);
    free(tok);
    free(logits);
    free(prompt_logits);
    return rc;
}

int cmd_run(int argc, char **argv) {
    run_opts o;
    parse(argc, argv, &o);
    if (o.prompts_file)
        return run_batch(&o.mo, o.prompts_file, o.n, o.temp, o.seed, o.quiet, o.ph.list, o.ph.n);
    int64_t plen = 0;
    char *text = read_prompt(&o, &plen);
    if (!text) return 1;
    if (plen == 0) {
        free(text);
        cli_usage_error("run", "the prompt is empty");
    }
    ekv_context *ctx;
    ekv_model *m;
    if (model_open("run", &o.mo, plen + o.n * o.ph.n, &ctx, &m)) {
        free(text);
        return 1;
    }
    int rc = model_check_phases("run", ctx, m, o.ph.list, o.ph.n, &o.mo);
    if (!rc) rc = generate(&o, text, plen, ctx, m);
    free(text);
    ekv_model_free(m);
    ekv_context_free(ctx);
    return rc;
}
