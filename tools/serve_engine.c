/* The server's engine (docs/cli.md, "serve"): the bounded queue of requests and each request's
 * life between its HTTP thread and the worker (serve_batch.c, which runs the model): submit,
 * wait for its bytes, cancel, and at the end drain and stop. A request is shared by both sides
 * and freed when both have released it. */
#include "serve_engine.h"
#include <stdlib.h>
#include <string.h>
#include <time.h>

serve_req *serve_req_new(void) {
    serve_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    pthread_cond_init(&r->cond, NULL);
    r->refs = 1;
    return r;
}

void serve_release_locked(serve_req *r) {
    if (--r->refs) return;
    pthread_cond_destroy(&r->cond);
    serve_params_free(&r->p);
    sb_free(&r->out);
    free(r);
}

void serve_release(serve_engine *e, serve_req *r) {
    pthread_mutex_lock(&e->mu);
    serve_release_locked(r);
    pthread_mutex_unlock(&e->mu);
}

static void engine_free(serve_engine *e) {
    for (int32_t k = 0; e->slots && k < e->nslots; k++) free(e->slots[k].tok);
    free(e->slots);
    free(e->rows);
    free(e->chunk_logits);
    free(e->out);
    free(e->seqs);
    free(e->toks);
    free(e->base_free);
    free(e->q);
    free(e);
}

/* The worker's buffers, sized by the model's sequences (o->mo.max_seqs, as model_open loaded
 * it); 0 or 1 (out of memory). */
static int engine_alloc(serve_engine *e) {
    const size_t n = (size_t)e->nslots, V = (size_t)e->V;
    e->base_free = calloc((size_t)e->layers, sizeof *e->base_free);
    e->q = calloc((size_t)e->o.queue, sizeof *e->q);
    e->slots = calloc(n, sizeof *e->slots);
    e->rows = malloc(sizeof(float) * n * V);
    e->chunk_logits = malloc(sizeof(float) * (size_t)e->chunk * V);
    e->out = malloc(sizeof(float) * n * V);
    e->seqs = malloc(sizeof(int32_t) * n);
    e->toks = malloc(sizeof(int32_t) * n);
    if (!e->base_free || !e->q || !e->slots || !e->rows || !e->chunk_logits || !e->out ||
        !e->seqs || !e->toks)
        return 1;
    for (size_t k = 0; k < n; k++) e->slots[k].logits = e->rows + k * V;
    for (int32_t l = 0; l < e->layers; l++) {
        const ekv_cache *c;
        int32_t seq;
        if (ekv_model_backend(e->m) != EKV_BACKEND_CUDA &&
            !ekv_model_layer_cache(e->m, l, &c, &seq))
            e->base_free[l] = ekv_cache_free_pages(c);
    }
    return 0;
}

serve_engine *serve_engine_start(const serve_opts *o, ekv_context *ctx, ekv_model *m) {
    serve_engine *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->o = *o;
    e->ctx = ctx;
    e->m = m;
    e->V = ekv_model_get_config(m)->vocab;
    e->layers = ekv_model_get_config(m)->n_layers;
    e->chunk = model_feed_chunk(m);
    e->nslots = o->mo.max_seqs > 0 ? o->mo.max_seqs : 1;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->idle, NULL);
    serve_metrics_init(&e->metrics);
    if (engine_alloc(e) || pthread_create(&e->worker, NULL, serve_worker_main, e)) {
        pthread_cond_destroy(&e->wake);
        pthread_cond_destroy(&e->idle);
        pthread_mutex_destroy(&e->mu);
        engine_free(e);
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
    } else if (e->qlen + e->busy >= e->o.queue) {
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

/* Every queued and running request stops (under e->mu). */
static void cancel_all(serve_engine *e) {
    for (int64_t k = 0; k < e->qlen; k++) e->q[(e->qhead + k) % e->o.queue]->cancelled = 1;
    for (int32_t k = 0; k < e->nslots; k++)
        if (e->slots[k].r) e->slots[k].r->cancelled = 1;
}

int serve_engine_drain(serve_engine *e, double timeout_s) {
    const double end = cli_now_seconds() + timeout_s;
    pthread_mutex_lock(&e->mu);
    e->draining = 1;
    int late = 0;
    while ((e->qlen || e->busy) && !late) {
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
    engine_free(e);
}

serve_metrics *serve_engine_metrics(serve_engine *e) { return &e->metrics; }
const serve_opts *serve_engine_opts(const serve_engine *e) { return &e->o; }
