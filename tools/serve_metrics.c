/* The server's counters and GET /metrics in the Prometheus text format (docs/cli.md, "serve"). */
#include "serve.h"
#include <string.h>

void serve_metrics_init(serve_metrics *m) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
}

void serve_metrics_status(serve_metrics *m, int status) {
    pthread_mutex_lock(&m->mu);
    if (status >= 100 && status < 600) m->by_status[status]++;
    pthread_mutex_unlock(&m->mu);
}

void serve_metrics_render(serve_metrics *m, sbuf *b) {
    pthread_mutex_lock(&m->mu);
    const serve_metrics c = *m; /* a consistent copy; its mutex is not used */
    pthread_mutex_unlock(&m->mu);
    sb_puts(b, "# HELP entmaxkv_requests_total HTTP requests answered, by status code.\n"
               "# TYPE entmaxkv_requests_total counter\n");
    for (int s = 100; s < 600; s++)
        if (c.by_status[s])
            sb_printf(b, "entmaxkv_requests_total{status=\"%d\"} %lld\n", s,
                      (long long)c.by_status[s]);
    sb_printf(b,
              "# HELP entmaxkv_prompt_tokens_total Prompt tokens prefilled.\n"
              "# TYPE entmaxkv_prompt_tokens_total counter\n"
              "entmaxkv_prompt_tokens_total %lld\n"
              "# HELP entmaxkv_generated_tokens_total Tokens generated.\n"
              "# TYPE entmaxkv_generated_tokens_total counter\n"
              "entmaxkv_generated_tokens_total %lld\n",
              (long long)c.prompt_tokens, (long long)c.gen_tokens);
    sb_printf(b,
              "# HELP entmaxkv_requests_cancelled_total Requests stopped because their client "
              "went away.\n"
              "# TYPE entmaxkv_requests_cancelled_total counter\n"
              "entmaxkv_requests_cancelled_total %lld\n"
              "# HELP entmaxkv_queue_depth Requests waiting for the model.\n"
              "# TYPE entmaxkv_queue_depth gauge\n"
              "entmaxkv_queue_depth %lld\n"
              "# HELP entmaxkv_requests_running Requests the model is serving.\n"
              "# TYPE entmaxkv_requests_running gauge\n"
              "entmaxkv_requests_running %lld\n",
              (long long)c.cancelled, (long long)c.queued, (long long)c.running);
    sb_printf(b,
              "# HELP entmaxkv_decode_steps_total Decode steps run (a batched step of one "
              "method, or a lone request's step).\n"
              "# TYPE entmaxkv_decode_steps_total counter\n"
              "entmaxkv_decode_steps_total %lld\n"
              "# HELP entmaxkv_decode_tokens_total Tokens the decode steps made, one per "
              "sequence of a step (a request's first token comes from its prefill).\n"
              "# TYPE entmaxkv_decode_tokens_total counter\n"
              "entmaxkv_decode_tokens_total %lld\n"
              "# HELP entmaxkv_decode_graph_tokens_total Tokens of the decode steps replayed "
              "from captured CUDA graphs (cuda without --no-graphs).\n"
              "# TYPE entmaxkv_decode_graph_tokens_total counter\n"
              "entmaxkv_decode_graph_tokens_total %lld\n"
              "# HELP entmaxkv_decode_seconds_total Seconds inside decode steps.\n"
              "# TYPE entmaxkv_decode_seconds_total counter\n"
              "entmaxkv_decode_seconds_total %.9g\n"
              "# HELP entmaxkv_prefill_seconds_total Seconds inside prefill chunks.\n"
              "# TYPE entmaxkv_prefill_seconds_total counter\n"
              "entmaxkv_prefill_seconds_total %.9g\n",
              (long long)c.decode_steps, (long long)c.decode_tokens,
              (long long)c.decode_graph_tokens, c.decode_s, c.prefill_s);
    sb_printf(b,
              "# HELP entmaxkv_decode_tokens_per_second Decode steps' tokens / seconds inside "
              "decode steps, since the start.\n"
              "# TYPE entmaxkv_decode_tokens_per_second gauge\n"
              "entmaxkv_decode_tokens_per_second %.6g\n"
              "# HELP entmaxkv_prefill_tokens_per_second Prompt tokens / seconds inside "
              "prefill chunks, since the start.\n"
              "# TYPE entmaxkv_prefill_tokens_per_second gauge\n"
              "entmaxkv_prefill_tokens_per_second %.6g\n",
              c.decode_s > 0 ? (double)c.decode_tokens / c.decode_s : 0.0,
              c.prefill_s > 0 ? (double)c.prompt_tokens / c.prefill_s : 0.0);
    sb_printf(b,
              "# HELP entmaxkv_kv_pages_in_use KV cache pages held by sequences, all layers.\n"
              "# TYPE entmaxkv_kv_pages_in_use gauge\n"
              "entmaxkv_kv_pages_in_use %lld\n",
              (long long)c.kv_pages);
}
