/*
 * entmaxkv — the command-line tool (docs/cli.md). Subcommands:
 *   entmax   exact alpha-entmax of vectors read from stdin
 *   bench    time the decode step (tools/bench.c)
 *   eval     quality at matched budgets (tools/eval.c)
 *   run      generate text with the model (tools/run.c)
 *   ppl      perplexity of the model with a decode method (tools/ppl.c)
 *   trace    dump a model run's per-layer Q/K/V for eval (tools/trace.c)
 *   serve    an OpenAI-compatible HTTP server over the model (tools/serve.c)
 * Exit codes: 0 ok, 1 runtime failure, 2 bad usage.
 */
#include "cli.h"
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static void main_help(FILE *f) {
    fprintf(f,
            "usage: entmaxkv SUBCOMMAND [options]\n"
            "\n"
            "subcommands:\n"
            "  entmax   exact alpha-entmax of vectors read from stdin, one per line\n"
            "  bench    time one decode step over a paged KV cache\n"
            "  eval     quality of sparse decoding (dropped mass, support recall) at matched budgets\n"
            "  run      generate text with the entmaxkv language model, any decode method\n"
            "  ppl      perplexity of the model on a text, any decode method\n"
            "  trace    dump the per-layer queries, keys and values of a model run (for eval)\n"
            "  serve    an OpenAI-compatible HTTP server over the model (completions, chat)\n"
            "\n"
            "'entmaxkv SUBCOMMAND --help' describes each one.\n");
}

static void entmax_help(FILE *f) {
    fprintf(f,
            "usage: entmaxkv entmax [--alpha A] [--json]\n"
            "\n"
            "Reads vectors from stdin, one per line, as whitespace-separated numbers ('-inf'\n"
            "masks an entry). For each line prints the alpha-entmax probabilities (%%.9g).\n"
            "\n"
            "  --alpha A   1 = softmax, 1.5 = entmax15 (default), 2 = sparsemax, any A in [1, 4]\n"
            "  --json      print {\"p\":[...],\"tau\":t,\"support\":k} per line; tau is in z-space:\n"
            "              p_j = [(A-1)*x_j - tau]_+^(1/(A-1)); for A = 1, tau = log-sum-exp\n"
            "  --help      this text\n");
}

/* The first token of s (at most 24 bytes) with bytes outside printable ASCII written as \xNN,
 * so an error message never echoes raw input bytes to the terminal. */
static void escape_token(const char *s, char *out, size_t cap) {
    size_t k = strcspn(s, " \t\r\n"), o = 0;
    for (size_t i = 0; i < k && i < 24 && o + 5 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        o += (size_t)(c >= 0x20 && c < 0x7f && c != '\\'
                              ? snprintf(out + o, cap - o, "%c", c)
                              : snprintf(out + o, cap - o, "\\x%02x", c));
    }
    out[o] = 0;
}

static int cmd_entmax(int argc, char **argv) {
    double alpha = 1.5;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            entmax_help(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--alpha")) {
            if (i + 1 >= argc || cli_parse_double(argv[++i], &alpha))
                cli_usage_error("entmax", "--alpha needs a number");
            if (!(alpha >= 1.0 && alpha <= 4.0))
                cli_usage_error("entmax", "--alpha %s is outside [1, 4]", argv[i]);
        } else
            cli_usage_error("entmax", "unknown option '%s'", argv[i]);
    }
    ekv_context *ctx;
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = 1;
    if (ekv_context_create(&cp, &ctx)) {
        fprintf(stderr, "entmaxkv entmax: cannot create a context\n");
        return 1;
    }
    size_t cap = 0;
    char *line = NULL;
    ssize_t got;
    int64_t lineno = 0, xcap = 0;
    float *x = NULL, *p = NULL;
    int rc = 0;
    while ((got = getline(&line, &cap, stdin)) >= 0) {
        lineno++;
        if ((size_t)got != strlen(line)) { /* strtod would stop at the NUL and drop the rest */
            fprintf(stderr, "entmaxkv entmax: line %lld: contains a NUL byte\n", (long long)lineno);
            rc = 1;
            goto done;
        }
        int64_t n = 0;
        char *s = line, *end;
        for (;;) {
            while (*s == ' ' || *s == '\t' || *s == '\r' || *s == '\n') s++;
            if (!*s) break;
            errno = 0;
            double v = strtod(s, &end);
            /* a finite number f32 cannot hold is refused as such: as a float it would become
             * an infinity, which reads as a masked entry (-inf) or a non-finite one (+inf).
             * One below f32's smallest rounds to the nearest float, as any decimal does. */
            if (end != s && ((errno == ERANGE && isinf(v)) || (isfinite(v) && isinf((float)v)))) {
                char tok[128];
                escape_token(s, tok, sizeof tok);
                fprintf(stderr,
                        "entmaxkv entmax: line %lld: '%s' is outside the range of f32 (largest "
                        "magnitude %.9g; -inf masks an entry)\n",
                        (long long)lineno, tok, (double)FLT_MAX);
                rc = 1;
                goto done;
            }
            if (end == s) {
                char tok[128];
                escape_token(s, tok, sizeof tok);
                fprintf(stderr, "entmaxkv entmax: line %lld: '%s' is not a number\n",
                        (long long)lineno, tok);
                rc = 1;
                goto done;
            }
            if (n == xcap) {
                xcap = xcap ? 2 * xcap : 64;
                float *nx = realloc(x, (size_t)xcap * sizeof *x),
                      *np = realloc(p, (size_t)xcap * sizeof *p);
                if (nx) x = nx;
                if (np) p = np;
                if (!nx || !np) {
                    fprintf(stderr, "entmaxkv entmax: out of memory\n");
                    rc = 1;
                    goto done;
                }
            }
            x[n++] = (float)v;
            s = end;
        }
        if (n == 0) continue; /* blank line */
        double tau;
        int64_t sup;
        ekv_status st = ekv_entmax(ctx, x, n, alpha, p, &tau, &sup);
        if (st) {
            fprintf(stderr, "entmaxkv entmax: line %lld: %s: %s\n", (long long)lineno,
                    ekv_status_string(st), ekv_last_error(ctx));
            rc = 1;
            goto done;
        }
        if (json) {
            printf("{\"p\":[");
            for (int64_t i = 0; i < n; i++) printf("%s%.9g", i ? "," : "", (double)p[i]);
            char ts[40];
            printf("],\"tau\":%s,\"support\":%lld}\n", cli_json_num(ts, sizeof ts, "%.17g", tau),
                   (long long)sup);
        } else {
            for (int64_t i = 0; i < n; i++) printf("%s%.9g", i ? " " : "", (double)p[i]);
            printf("\n");
        }
    }
    if (ferror(stdin)) { /* e.g. a directory on stdin (EISDIR): not an empty input */
        fprintf(stderr, "entmaxkv entmax: cannot read stdin: %s\n", strerror(errno));
        rc = 1;
    }
done:
    free(line);
    free(x);
    free(p);
    ekv_context_free(ctx);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        main_help(stderr);
        return CLI_USAGE;
    }
    const char *sub = argv[1];
    if (!strcmp(sub, "--help") || !strcmp(sub, "-h") || !strcmp(sub, "help")) {
        main_help(stdout);
        return 0;
    }
    if (!strcmp(sub, "--version")) {
        printf("entmaxkv %d.%d.%d\n", EKV_VERSION_MAJOR, EKV_VERSION_MINOR, EKV_VERSION_PATCH);
        return 0;
    }
    if (!strcmp(sub, "entmax")) return cmd_entmax(argc - 1, argv + 1);
    if (!strcmp(sub, "bench")) return cmd_bench(argc - 1, argv + 1);
    if (!strcmp(sub, "eval")) return cmd_eval(argc - 1, argv + 1);
    if (!strcmp(sub, "run")) return cmd_run(argc - 1, argv + 1);
    if (!strcmp(sub, "ppl")) return cmd_ppl(argc - 1, argv + 1);
    if (!strcmp(sub, "trace")) return cmd_trace(argc - 1, argv + 1);
    if (!strcmp(sub, "serve")) return cmd_serve(argc - 1, argv + 1);
    fprintf(stderr, "entmaxkv: unknown subcommand '%s' (see 'entmaxkv --help')\n", sub);
    return CLI_USAGE;
}
