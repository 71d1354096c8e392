/* The server's worker (docs/cli.md, "serve"): the one thread that runs the model (its context
 * is single-threaded), batching the requests continuously over the model's sequences, a slot
 * each (--max-seqs on cuda; the cpu model holds one sequence, so there the requests are served
 * in turn). Each iteration of its loop:
 *   1. queued requests join the free slots; a cancelled request is marked to leave;
 *   2. prefill chunks (model_feed_chunk tokens, run's chunks, so the logits are run's) of the
 *      earliest admitted requests still prefilling, with their prefill method (dense by
 *      default), until --prefill-tokens are fed (default one chunk): a long prompt is
 *      interleaved with the others' decode steps instead of stalling them;
 *   3. every decoding request samples its next token from its logits (model_sample with its own
 *      temperature and a generator seeded with its seed, as run samples, so an exact method gives
 *      run's text) and publishes it; those that go on take one decode step together: one
 *      ekv_model_batch_step per method among them (the model runs one method at a time, so it
 *      is set before each step and each chunk), a lone request ekv_model_seq_step (run's step:
 *      on cuda a replayed graph);
 *   4. the requests that finished, failed or were cancelled leave: their sequence is emptied
 *      (ekv_model_seq_reset), so its pages return to the pool and the slot to the next request.
 */
#include "serve_engine.h"
#include <stdlib.h>
#include <string.h>

/* KV pages the model's sequences hold, all layers: measured from the caches on the cpu; on
 * cuda (whose caches live on the device) counted from each sequence's length. */
static int64_t kv_pages(serve_engine *e) {
    int64_t n = 0;
    if (ekv_model_backend(e->m) == EKV_BACKEND_CUDA) {
        const int64_t P = e->o.mo.page;
        for (int32_t k = 0; k < e->nslots; k++)
            n += e->layers * ((ekv_model_seq_position(e->m, k) + P - 1) / P);
        return n;
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

/* The slot's request fails with an HTTP status and leaves at this iteration's end. */
static void fail_slot(serve_engine *e, serve_slot *s, int status, const char *what) {
    pthread_mutex_lock(&e->mu);
    s->r->err_status = status;
    snprintf(s->r->err_msg, sizeof s->r->err_msg, "%s", what);
    pthread_mutex_unlock(&e->mu);
    s->done = 1;
}

static int same_method(ekv_select_method a, double a_budget, ekv_select_method b, double b_budget) {
    return a == b && (!model_uses_budget(a) || a_budget == b_budget);
}

/* The model's method for the next step (a request's prefill chunk or decode step): set when it
 * differs (on cuda a change drops the captured decode graph, so it is not set again for
 * nothing). */
static ekv_status use_method(serve_engine *e, ekv_select_method method, double budget) {
    if (e->method_set && same_method(method, budget, e->method, e->budget)) return EKV_OK;
    const ekv_status st = ekv_model_set_method(e->m, method, budget);
    if (!st) e->method = method, e->budget = budget, e->method_set = 1;
    return st;
}

/* Under mu: r ends (answered by its HTTP thread, which waits on r->cond). */
static void end_locked(serve_engine *e, serve_req *r) {
    r->state = REQ_DONE;
    pthread_mutex_lock(&e->metrics.mu);
    e->metrics.cancelled += r->cancelled;
    pthread_mutex_unlock(&e->metrics.mu);
    pthread_cond_broadcast(&r->cond);
    pthread_cond_broadcast(&e->idle);
    serve_release_locked(r);
}

/* Under mu: r takes a free slot, its prompt tokenized there. */
static void take_slot(serve_engine *e, serve_req *r) {
    serve_slot *s = e->slots;
    while (s->r) s++; /* the caller saw busy < nslots */
    float *logits = s->logits;
    memset(s, 0, sizeof *s);
    s->logits = logits;
    s->r = r;
    s->order = e->admitted++;
    r->state = REQ_RUNNING;
    e->busy++;
    s->tok = malloc(sizeof(int32_t) * (size_t)r->p.prompt_len);
    if (s->tok)
        ekv_model_tokenize(r->p.prompt, r->p.prompt_len, s->tok);
    else {
        r->err_status = 500;
        snprintf(r->err_msg, sizeof r->err_msg, "out of memory");
        s->done = 1;
    }
}

/* Under mu: the running requests whose client went away are marked to leave, and the queued
 * requests join the free slots (one cancelled while queued ends without running). */
static void admit_locked(serve_engine *e) {
    for (int32_t k = 0; k < e->nslots; k++)
        if (e->slots[k].r && e->slots[k].r->cancelled) e->slots[k].done = 1;
    while (e->qlen && e->busy < e->nslots) {
        serve_req *r = e->q[e->qhead];
        e->qhead = (e->qhead + 1) % e->o.queue;
        e->qlen--;
        pthread_mutex_lock(&e->metrics.mu);
        e->metrics.queued--;
        e->metrics.running += !r->cancelled;
        pthread_mutex_unlock(&e->metrics.mu);
        if (r->cancelled)
            end_locked(e, r);
        else
            take_slot(e, r);
    }
}

/* One prefill chunk of the earliest admitted request still prefilling, with its prefill method
 * (run --prefill-method: by default dense, on cuda the tensor-core prefill; docs/cli.md,
 * "serve"); after its last chunk the request decodes, its generator seeded as run seeds it.
 * Returns the tokens fed (0: none to feed, or the step failed). */
static int64_t prefill_step(serve_engine *e) {
    serve_slot *s = NULL;
    for (int32_t k = 0; k < e->nslots; k++) {
        serve_slot *t = &e->slots[k];
        if (t->r && t->tok && !t->done && (!s || t->order < s->order)) s = t;
    }
    if (!s) return 0;
    const serve_params *p = &s->r->p;
    if (use_method(e, p->prefill_method, p->budget)) {
        fail_slot(e, s, 400, ekv_last_error(e->ctx));
        return 0;
    }
    const int64_t left = p->prompt_len - s->fed, c = left < e->chunk ? left : e->chunk;
    const int last = c == left; /* the chunk of the prompt's last token: its logits are kept */
    const double t0 = cli_now_seconds();
    const ekv_status st = ekv_model_seq_step(e->m, (int32_t)(s - e->slots), s->tok + s->fed, c,
                                             last ? e->chunk_logits : NULL);
    pthread_mutex_lock(&e->metrics.mu);
    e->metrics.prompt_tokens += st ? 0 : c;
    e->metrics.prefill_s += cli_now_seconds() - t0;
    pthread_mutex_unlock(&e->metrics.mu);
    if (st) {
        fail_slot(e, s, 500, ekv_last_error(e->ctx));
        e->broken = 1;
        return 0;
    }
    s->fed += c;
    if (!last) return c;
    memcpy(s->logits, e->chunk_logits + (c - 1) * e->V, sizeof(float) * (size_t)e->V);
    free(s->tok);
    s->tok = NULL;
    cli_rng_seed(&s->rng, p->seed);
    return c;
}

/* Prefill chunks until --prefill-tokens are fed (at least one chunk), nothing is left to
 * prefill or a step failed. */
static void prefill_steps(serve_engine *e) {
    const int64_t want = e->o.prefill_tokens > 0 ? e->o.prefill_tokens : 1;
    for (int64_t fed = 0; fed < want && !e->broken;) {
        const int64_t c = prefill_step(e);
        if (c <= 0) break;
        fed += c;
    }
}

/* Every decoding request's next token, sampled and published (one lock for all); those that go
 * on are listed in e->seqs and e->toks for the decode step. Returns how many. A request's first
 * token comes from its prefill's logits, each next one from a decode step's. */
static int32_t sample_all(serve_engine *e) {
    for (int32_t k = 0; k < e->nslots; k++) {
        serve_slot *s = &e->slots[k];
        if (s->r && !s->tok && !s->done)
            s->next = model_sample(s->logits, e->V, s->r->p.temp, &s->rng);
    }
    int32_t n = 0;
    int64_t made = 0;
    pthread_mutex_lock(&e->mu);
    for (int32_t k = 0; k < e->nslots; k++) {
        serve_slot *s = &e->slots[k];
        if (!s->r || s->tok || s->done) continue;
        s->stopped = serve_text_push(s->r, s->next);
        s->r->tokens++;
        pthread_cond_broadcast(&s->r->cond);
        made++;
        if (s->stopped || ++s->made == s->r->p.max_tokens)
            s->done = 1;
        else
            e->seqs[n] = k, e->toks[n++] = s->next;
    }
    pthread_mutex_unlock(&e->mu);
    pthread_mutex_lock(&e->metrics.mu);
    e->metrics.gen_tokens += made;
    pthread_mutex_unlock(&e->metrics.mu);
    return n;
}

/* One decode step of the n sequences seqs (all of one method), each one's logits into its slot;
 * the metrics count the step, its n tokens (the next token of each) and its seconds, the
 * method's change included (docs/cli.md, "serve": the decode-step rate). */
static void step_group(serve_engine *e, const int32_t *seqs, const int32_t *toks, int32_t n) {
    const double t0 = cli_now_seconds();
    const serve_params *p = &e->slots[seqs[0]].r->p;
    ekv_model_stats before, after; /* graph_steps: (token, layer) steps replayed */
    ekv_model_get_stats(e->m, -1, &before);
    ekv_status st = use_method(e, p->method, p->budget);
    if (!st)
        st = n == 1 ? ekv_model_seq_step(e->m, seqs[0], toks, 1, e->out)
                    : ekv_model_batch_step(e->m, seqs, n, toks, e->out);
    e->broken |= st != EKV_OK;
    if (!st) {
        ekv_model_get_stats(e->m, -1, &after);
        pthread_mutex_lock(&e->metrics.mu);
        e->metrics.decode_steps++;
        e->metrics.decode_tokens += n;
        e->metrics.decode_graph_tokens += (after.graph_steps - before.graph_steps) / e->layers;
        e->metrics.decode_s += cli_now_seconds() - t0;
        pthread_mutex_unlock(&e->metrics.mu);
    }
    for (int32_t b = 0; b < n; b++) {
        serve_slot *s = &e->slots[seqs[b]];
        if (st)
            fail_slot(e, s, 500, ekv_last_error(e->ctx));
        else
            memcpy(s->logits, e->out + b * e->V, sizeof(float) * (size_t)e->V);
    }
}

/* Samples, publishes, then runs the decode step: the listed sequences gathered by method (the
 * model has one method at a time), a step per method. */
static void decode_step(serve_engine *e) {
    const int32_t n = sample_all(e);
    for (int32_t i = 0; i < n;) {
        const serve_params *p = &e->slots[e->seqs[i]].r->p;
        int32_t g = i + 1;
        for (int32_t j = i + 1; j < n; j++) {
            const serve_params *q = &e->slots[e->seqs[j]].r->p;
            if (!same_method(q->method, q->budget, p->method, p->budget)) continue;
            const int32_t sq = e->seqs[j], tk = e->toks[j];
            e->seqs[j] = e->seqs[g], e->toks[j] = e->toks[g];
            e->seqs[g] = sq, e->toks[g++] = tk;
        }
        step_group(e, e->seqs + i, e->toks + i, g - i);
        i = g;
    }
}

/* A model step failed: the model is reset, as ekv_model_step asks, which empties every
 * sequence, so every running request fails. */
static void reset_model(serve_engine *e) {
    ekv_model_reset(e->m);
    e->broken = 0;
    for (int32_t k = 0; k < e->nslots; k++) {
        serve_slot *s = &e->slots[k];
        if (s->r && !s->done)
            fail_slot(e, s, 500,
                      "the model was reset after a failed step of a request served with this one");
    }
}

/* The requests marked done leave: each sequence emptied (its pages back to the pool), each
 * request answered, its slot free. */
static void finish_all(serve_engine *e) {
    for (int32_t k = 0; k < e->nslots && !e->broken; k++)
        if (e->slots[k].r && e->slots[k].done && ekv_model_seq_reset(e->m, k)) e->broken = 1;
    if (e->broken) reset_model(e);
    pthread_mutex_lock(&e->mu);
    for (int32_t k = 0; k < e->nslots; k++) {
        serve_slot *s = &e->slots[k];
        if (!s->r || !s->done) continue;
        if (!s->r->err_status) s->r->finish = s->stopped ? "stop" : "length";
        s->r->visible = (int64_t)s->r->out.len; /* no stop string can begin there any more */
        free(s->tok);
        s->tok = NULL;
        pthread_mutex_lock(&e->metrics.mu);
        e->metrics.running--;
        pthread_mutex_unlock(&e->metrics.mu);
        end_locked(e, s->r);
        s->r = NULL;
        e->busy--;
    }
    pthread_mutex_unlock(&e->mu);
}

void *serve_worker_main(void *arg) {
    serve_engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->qlen && !e->busy && !e->stop) pthread_cond_wait(&e->wake, &e->mu);
        const int idle = !e->qlen && !e->busy; /* and stopping */
        if (!idle) admit_locked(e);
        pthread_mutex_unlock(&e->mu);
        if (idle) break;
        prefill_steps(e);
        decode_step(e);
        finish_all(e);
        set_pages(e);
    }
    return NULL;
}
