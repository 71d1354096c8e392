/*
 * entmaxkv serve (docs/cli.md, "serve"): an OpenAI-compatible HTTP server over the model. Loads
 * the model as run does (--max-seqs sequences on cuda), starts the engine (a bounded queue:
 * tools/serve_engine.c; one worker thread owning the model, batching the requests over its
 * sequences: tools/serve_batch.c) and the HTTP server (libmicrohttpd: tools/serve_http.c), then
 * waits for SIGINT or SIGTERM: no new connection is taken, the requests in flight end and are
 * answered, and the process exits 0.
 */
#include "serve.h"
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void serve_help(FILE *f) {
    fprintf(f,
            "usage: entmaxkv serve [--host ADDR] [--port N] [--model FILE] [options]\n"
            "\n"
            "An OpenAI-compatible HTTP server over the entmaxkv language model:\n"
            "POST /v1/completions, POST /v1/chat/completions (stream: true sends server-sent\n"
            "events), GET /v1/models, GET /health, GET /metrics (Prometheus text). One worker\n"
            "owns the model: on cuda it decodes up to --max-seqs requests together, each joining\n"
            "and leaving the batched decode step between steps (continuous batching); on the cpu\n"
            "it serves them one after the other. A request may pick its methods with\n"
            "\"entmaxkv\": {\"method\": M, \"budget\": F, \"prefill_method\": P}. SIGINT or\n"
            "SIGTERM lets the requests in flight finish, then the server exits 0.\n"
            "\n"
            "  --host ADDR           IPv4 address to listen on (default 127.0.0.1)\n"
            "  --port N              TCP port; 0 = any free one (default 8080). The address is\n"
            "                        printed on stdout: 'entmaxkv serve: listening on URL'\n"
            "  --model-name NAME     the model's id in the API (default entmaxkv-lm)\n"
            "  --ctx N               tokens of one request, prompt + max_tokens (default 4096)\n"
            "  --max-prompt-bytes N  the longest prompt (default: --ctx)\n"
            "  --max-tokens-limit N  the largest max_tokens a request may ask (default: --ctx)\n"
            "  --queue N             requests queued or running at once; more get 503 (64)\n"
            "  --max-seqs N          cuda: requests decoded together, a model sequence each of\n"
            "                        --ctx tokens (default 8; at most 4096). The cpu model holds\n"
            "                        one sequence: 1 there\n"
            "  --max-body N          request body bytes; more get 413 (default 1M)\n"
            "  --max-connections N   connections at once (default 256)\n"
            "  --drain-timeout S     seconds SIGTERM waits for the requests in flight (600)\n"
            "  --prefill-tokens N    prompt tokens prefilled between two decode steps, in whole\n"
            "                        chunks of the prompt (default: one chunk, 4096 tokens on\n"
            "                        cuda): more fills the batch sooner after a burst of\n"
            "                        requests, less keeps the decoding requests' steps closer\n"
            "  --prefill-method M    every request's prompt's method (default dense: on cuda the\n"
            "                        tensor-core prefill; the exact methods select the same\n"
            "                        support); --method then serves its generated tokens\n");
    model_opts_help(f);
    fprintf(f, "  --help                this text\n"
               "\n"
               "--method, --budget, --prefill-method: the defaults of every request (--budget is\n"
               "both methods'). The caches hold --code-bits key codes, so any request may ask for\n"
               "screened. Requests of different methods decode in one step per method.\n");
}

static const cli_opt serve_table[] = {
        CLI_STR("--host", serve_opts, host),
        CLI_INT("--port", serve_opts, port, 0, 65535),
        CLI_STR("--model-name", serve_opts, name),
        CLI_INT("--ctx", serve_opts, ctx, 1, (int64_t)1 << 30),
        CLI_INT("--max-prompt-bytes", serve_opts, max_prompt, 1, (int64_t)1 << 30),
        CLI_INT("--max-tokens-limit", serve_opts, max_gen, 1, (int64_t)1 << 30),
        CLI_INT("--queue", serve_opts, queue, 1, 1 << 20),
        CLI_INT("--max-seqs", serve_opts, max_seqs, 1, 4096),
        CLI_INT("--max-body", serve_opts, max_body, 1, (int64_t)1 << 30),
        CLI_INT("--max-connections", serve_opts, connections, 1, 1 << 16),
        CLI_INT("--drain-timeout", serve_opts, drain_s, 0, 1 << 30),
        CLI_INT("--prefill-tokens", serve_opts, prefill_tokens, 1, (int64_t)1 << 30),
};

/* --prefill-method: a method as --method's (model_method). */
static int serve_extra(const char *sub, int argc, char **argv, int *i, void *vo) {
    if (strcmp(argv[*i], "--prefill-method")) return 0;
    ((serve_opts *)vo)->prefill =
            model_method(sub, "--prefill-method", cli_need(sub, argc, argv, i));
    return 1;
}

static void parse(int argc, char **argv, serve_opts *o) {
    memset(o, 0, sizeof *o);
    model_opts_init(&o->mo);
    o->host = "127.0.0.1";
    o->port = 8080;
    o->name = "entmaxkv-lm";
    o->ctx = 4096;
    o->queue = 64;
    o->max_body = 1 << 20;
    o->connections = 256;
    o->drain_s = 600;
    o->prefill = EKV_SELECT_DENSE; /* docs/cli.md, "serve": prefill dense, decode sparse */
    model_parse("serve", argc, argv, serve_help, &o->mo, serve_table, CLI_NOPTS(serve_table),
                serve_extra, o);
    if (!o->max_prompt) o->max_prompt = o->ctx;
    if (!o->max_gen) o->max_gen = o->ctx;
    if (!*o->name) cli_usage_error("serve", "--model-name is empty");
    const int cuda = o->mo.backend == EKV_BACKEND_CUDA;
    if (o->max_seqs > 1 && !cuda)
        cli_usage_error("serve",
                        "--max-seqs %lld: the cpu model holds one sequence, so it serves requests "
                        "in turn; decoding several together needs --backend cuda",
                        (long long)o->max_seqs);
    if (!o->max_seqs) o->max_seqs = cuda ? 8 : 1;
    o->mo.max_seqs = (int32_t)o->max_seqs;
    o->mo.codes = 1; /* key codes in the caches: a request may choose screened */
}

/* After SIGINT/SIGTERM: no new connection, the engine finishes its queue, the responses are
 * sent, then everything stops. 0, or 1 when --drain-timeout passed first. */
static int drain(serve_http *h, serve_engine *e, const serve_opts *o) {
    const double end = cli_now_seconds() + (double)o->drain_s;
    serve_http_quiesce(h);
    int late = serve_engine_drain(e, (double)o->drain_s);
    while (!late && serve_http_active(h) > 0) {
        const struct timespec t = {0, 20 * 1000 * 1000};
        nanosleep(&t, NULL);
        late = cli_now_seconds() > end;
    }
    if (late) fprintf(stderr, "entmaxkv serve: --drain-timeout passed; stopping the rest\n");
    serve_http_stop(h);   /* after a late drain the engine cancelled what was left */
    serve_engine_stop(e); /* no HTTP thread holds a request any more */
    return late;
}

int cmd_serve(int argc, char **argv) {
    serve_opts o;
    parse(argc, argv, &o);
    /* Signals are blocked before any thread starts (the library's pool too), so every thread
     * inherits the mask and only sigwait below takes them. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    ekv_context *ctx;
    ekv_model *m;
    if (model_open("serve", &o.mo, o.ctx, &ctx, &m)) return 1;
    /* both default methods are taken by this model (leaving it with --method), so a request
     * without its own fails on nothing the server could have refused at the start */
    const model_phase pre = {o.prefill, o.mo.budget};
    int rc = model_check_phases("serve", ctx, m, &pre, 1, &o.mo);
    serve_engine *e = rc ? NULL : serve_engine_start(&o, ctx, m);
    if (!rc && !e) fprintf(stderr, "entmaxkv serve: cannot start the worker thread\n");
    serve_http *h = e ? serve_http_start(e, serve_engine_opts(e)) : NULL;
    rc = h ? 0 : 1;
    if (h) {
        char lab[64], plab[64];
        model_method_label(lab, sizeof lab, o.mo.method, o.mo.budget);
        model_method_label(plab, sizeof plab, o.prefill, o.mo.budget);
        char how[64] = "requests in turn";
        if (o.max_seqs > 1)
            snprintf(how, sizeof how, "continuous batching over %lld sequences",
                     (long long)o.max_seqs);
        fprintf(stderr,
                "entmaxkv serve: model '%s', method %s, prefill method %s, %s backend, context "
                "%lld tokens, %s\n",
                o.name, lab, plab, ekv_backend_name(o.mo.backend), (long long)o.ctx, how);
        int sig = 0;
        sigwait(&set, &sig);
        fprintf(stderr, "entmaxkv serve: %s: finishing the requests in flight\n",
                sig == SIGINT ? "SIGINT" : "SIGTERM");
        rc = drain(h, e, &o);
    } else if (e)
        serve_engine_stop(e);
    ekv_model_free(m);
    ekv_context_free(ctx);
    return rc;
}
