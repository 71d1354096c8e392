/* The server's engine (docs/cli.md, "serve"): one worker thread owns the model (its context is
 * single-threaded) and serves the queued requests in turn: prefill, then one decode step per
 * token, sampled as `entmaxkv run` samples (model_sample, the same seed), so an exact method
 * gives run's text. Each token is published to the request under the engine's mutex for its
 * HTTP thread; a request whose client went away stops at its next token. The sequence is
 * emptied after every request, so the pages in use return to zero between requests. Batching
 * requests into one decode step (--backend cuda) is not done yet: the GPU serves them in turn
 * too. */
#include "serve.h"
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct serve_engine {
    serve_opts o;
    ekv_context *ctx;
    ekv_model *m;
    int64_t V, layers;
    int64_t *base_free; /* cpu: free pages of each layer's cache while it is empty */
    pthread_mutex_t mu;
    pthread_cond_t wake, idle;
    serve_req **q; /* a ring of o.queue requests */
    int64_t qhead, qlen, next_id;
    serve_req *current;
    int draining, stop;
    pthread_t worker;
    serve_metrics metrics;
};

serve_req *serve_req_new(void) {
    serve_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    pthread_cond_init(&r->cond, NULL);
    r->refs = 1;
    return r;
}

static void release_locked(serve_req *r) {
    if (--r->refs) return;
    pthread_cond_destroy(&r->cond);
    serve_params_free(&r->p);
    sb_free(&r->out);
    free(r);
}

void serve_release(serve_engine *e, serve_req *r) {
    pthread_mutex_lock(&e->mu);
    release_locked(r);
    pthread_mutex_unlock(&e->mu);
}

/* KV pages the model's sequences hold, all layers: measured from the caches on the cpu; on
 * cuda (whose caches live on the device) counted from the sequence's length. */
static int64_t kv_pages(serve_engine *e) {
    int64_t n = 0;
    if (ekv_model_backend(e->m) == EKV_BACKEND_CUDA) {
        const int64_t pos = ekv_model_seq_position(e->m, 0), P = e->o.mo.page;
        return e->layers * ((pos + P - 1) / P);
    }
    for (int32_t l = 0; l < e->layers; l++) {
        const ekv_cache *c;
        int32_t seq;
        if (!ekv_model_layer_cache(e->m, l, &c, &seq))
            n += e->base_free[l] - ekv_cache_free_pages(c);
    }
    return n;
}

static void set_pages(serve_engine *e) {
    const int64_t n = kv_pages(e);
    pthread_mutex_lock(&e->metrics.mu);
    e->metrics.kv_pages = n;
    pthread_mutex_unlock(&e->metrics.mu);
}

static void fail_req(serve_engine *e, serve_req *r, int status, const char *what) {
    pthread_mutex_lock(&e->mu);
    r->err_status = status;
    snprintf(r->err_msg, sizeof r->err_msg, "%s", what);
    pthread_mutex_unlock(&e->mu);
}

static int cancelled(serve_engine *e, serve_req *r) {
    pthread_mutex_lock(&e->mu);
    const int c = r->cancelled;
    pthread_mutex_unlock(&e->mu);
    return c;
}

/* The prompt through the model (in run's chunks, so the logits are run's); 0 or 1. */
static int prefill(serve_engine *e, serve_req *r, float *logits) {
    const int64_t n = r->p.prompt_len;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n);
    if (!tok) {
        fail_req(e, r, 500, "out of memory");
        return 1;
    }
    ekv_model_tokenize(r->p.prompt, n, tok);
    model_last_row lr = {logits, n - 1, e->V};
    const double t0 = cli_now_seconds();
    const int rc = model_feed_seq("serve", "prefill", e->ctx, e->m, 0, tok, n, n - 1,
                                  model_keep_last_row, &lr, NULL);
    free(tok);
    if (rc) fail_req(e, r, 500, ekv_last_error(e->ctx));
    pthread_mutex_lock(&e->metrics.mu);
    e->metrics.prompt_tokens += rc ? 0 : n;
    e->metrics.prefill_s += cli_now_seconds() - t0;
    pthread_mutex_unlock(&e->metrics.mu);
    return rc;
}

/* Decodes up to max_tokens tokens, publishing each; 0 or 1 (an error, set in r). */
static int decode(serve_engine *e, serve_req *r, float *logits) {
    cli_rng rng;
    cli_rng_seed(&rng, r->p.seed);
    const double t0 = cli_now_seconds();
    int rc = 0, stop = 0;
    int64_t made = 0;
    for (int64_t i = 0; i < r->p.max_tokens && !stop && !rc; i++) {
        if (cancelled(e, r)) break;
        int32_t next = model_sample(logits, e->V, r->p.temp, &rng);
        pthread_mutex_lock(&e->mu);
        stop = serve_text_push(r, next);
        r->tokens++;
        pthread_cond_broadcast(&r->cond);
        pthread_mutex_unlock(&e->mu);
        made++;
        if (i + 1 < r->p.max_tokens && !stop) { /* the logits of the next token */
            const ekv_status st = ekv_model_step(e->m, &next, 1, logits);
            if (st) {
                fail_req(e, r, 500, ekv_last_error(e->ctx));
                rc = 1;
            }
            set_pages(e);
        }
    }
    pthread_mutex_lock(&e->mu);
    if (!rc) r->finish = stop ? "stop" : "length";
    r->visible = (int64_t)r->out.len; /* no stop string can begin there any more */
    pthread_mutex_unlock(&e->mu);
    pthread_mutex_lock(&e->metrics.mu);
    e->metrics.gen_tokens += made;
    e->metrics.decode_s += cli_now_seconds() - t0;
    pthread_mutex_unlock(&e->metrics.mu);
    return rc;
}

static void run_request(serve_engine *e, serve_req *r) {
    float *logits = malloc(sizeof(float) * (size_t)e->V);
    if (!logits) {
        fail_req(e, r, 500, "out of memory");
        return;
    }
    if (ekv_model_set_method(e->m, r->p.method, r->p.budget))
        fail_req(e, r, 400, ekv_last_error(e->ctx));
    else if (!prefill(e, r, logits)) {
        set_pages(e);
        decode(e, r, logits);
    }
    free(logits);
    /* the sequence's pages go back to the pool (after an error the whole model is reset, as
     * ekv_model_step asks) */
    if (r->err_status || ekv_model_seq_reset(e->m, 0)) ekv_model_reset(e->m);
    set_pages(e);
}

static void *worker_main(void *arg) {
    serve_engine *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->qlen && !e->stop) pthread_cond_wait(&e->wake, &e->mu);
        if (!e->qlen) break;
        serve_req *r = e->q[e->qhead];
        e->qhead = (e->qhead + 1) % e->o.queue;
        e->qlen--;
        e->current = r;
        const int skip = r->cancelled;
        r->state = REQ_RUNNING;
        pthread_mutex_lock(&e->metrics.mu);
        e->metrics.queued--;
        e->metrics.running++;
        pthread_mutex_unlock(&e->metrics.mu);
        pthread_mutex_unlock(&e->mu);
        if (!skip) run_request(e, r);
        pthread_mutex_lock(&e->mu);
        pthread_mutex_lock(&e->metrics.mu);
        e->metrics.running--;
        e->metrics.cancelled += r->cancelled;
        pthread_mutex_unlock(&e->metrics.mu);
        r->state = REQ_DONE;
        e->current = NULL;
        pthread_cond_broadcast(&r->cond);
        pthread_cond_broadcast(&e->idle);
        release_locked(r);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

serve_engine *serve_engine_start(const serve_opts *o, ekv_context *ctx, ekv_model *m) {
    serve_engine *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->o = *o;
    e->ctx = ctx;
    e->m = m;
    e->V = ekv_model_get_config(m)->vocab;
    e->layers = ekv_model_get_config(m)->n_layers;
    e->base_free = calloc((size_t)e->layers, sizeof *e->base_free);
    e->q = calloc((size_t)o->queue, sizeof *e->q);
    for (int32_t l = 0; e->base_free && l < e->layers; l++) {
        const ekv_cache *c;
        int32_t seq;
        if (ekv_model_backend(m) != EKV_BACKEND_CUDA && !ekv_model_layer_cache(m, l, &c, &seq))
            e->base_free[l] = ekv_cache_free_pages(c);
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->idle, NULL);
    serve_metrics_init(&e->metrics);
    if (!e->base_free || !e->q || pthread_create(&e->worker, NULL, worker_main, e)) {
        free(e->base_free);
        free(e->q);
        free(e);
        return NULL;
    }
    return e;
}

int serve_submit(serve_engine *e, serve_req *r) {
    int status = 0;
    pthread_mutex_lock(&e->mu);
    if (e->draining) {
        status = 503;
        snprintf(r->err_msg, sizeof r->err_msg, "the server is shutting down");
    } else if (e->qlen + (e->current != NULL) >= e->o.queue) {
        status = 503;
        snprintf(r->err_msg, sizeof r->err_msg,
                 "the server is busy: %lld requests are queued or running (--queue); retry later",
                 (long long)e->o.queue);
    } else {
        snprintf(r->id, sizeof r->id, "%s-%lld", r->p.chat ? "chatcmpl" : "cmpl",
                 (long long)++e->next_id);
        r->created = (int64_t)time(NULL);
        r->refs++;
        e->q[(e->qhead + e->qlen++) % e->o.queue] = r;
        pthread_mutex_lock(&e->metrics.mu);
        e->metrics.queued++;
        pthread_mutex_unlock(&e->metrics.mu);
        pthread_cond_signal(&e->wake);
    }
    pthread_mutex_unlock(&e->mu);
    return status;
}

int serve_wait(serve_engine *e, serve_req *r, int64_t *have, int timeout_ms, sbuf *got) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&e->mu);
    while (r->visible <= *have && r->state != REQ_DONE)
        if (pthread_cond_timedwait(&r->cond, &e->mu, &until)) break;
    if (r->visible > *have) sb_put(got, r->out.p + *have, (size_t)(r->visible - *have));
    *have = r->visible;
    const int done = r->state == REQ_DONE;
    pthread_mutex_unlock(&e->mu);
    return done;
}

void serve_cancel(serve_engine *e, serve_req *r) {
    pthread_mutex_lock(&e->mu);
    r->cancelled = 1;
    pthread_mutex_unlock(&e->mu);
}

/* Every queued request and the running one stop (under e->mu). */
static void cancel_all(serve_engine *e) {
    for (int64_t k = 0; k < e->qlen; k++) e->q[(e->qhead + k) % e->o.queue]->cancelled = 1;
    if (e->current) e->current->cancelled = 1;
}

int serve_engine_drain(serve_engine *e, double timeout_s) {
    const double end = cli_now_seconds() + timeout_s;
    pthread_mutex_lock(&e->mu);
    e->draining = 1;
    int late = 0;
    while ((e->qlen || e->current) && !late) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_sec += 1;
        pthread_cond_timedwait(&e->idle, &e->mu, &t);
        late = cli_now_seconds() > end;
    }
    if (late) cancel_all(e);
    pthread_mutex_unlock(&e->mu);
    return late;
}

void serve_engine_stop(serve_engine *e) {
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    cancel_all(e);
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->worker, NULL);
    pthread_cond_destroy(&e->wake);
    pthread_cond_destroy(&e->idle);
    pthread_mutex_destroy(&e->mu);
    free(e->base_free);
    free(e->q);
    free(e);
}

serve_metrics *serve_engine_metrics(serve_engine *e) { return &e->metrics; }
const serve_opts *serve_engine_opts(const serve_engine *e) { return &e->o; }
