/* The server engine's state (docs/cli.md, "serve"), shared by serve_engine.c (the queue and the
 * requests' life: submit, wait, cancel, drain, stop) and serve_batch.c (the worker thread, which
 * alone runs the model). Fields under "mu" change under the engine's mutex; the slots' model
 * state (tokens, logits, sampler) belongs to the worker. */
#ifndef EKV_TOOLS_SERVE_ENGINE_H
#define EKV_TOOLS_SERVE_ENGINE_H
#include "serve.h"

/* A slot is one sequence of the model, held by one running request from its admission to its
 * end: first its prompt is prefilled a chunk at a time, then it takes one token per decode step. */
typedef struct {
    serve_req *r;  /* NULL: free */
    int64_t order; /* admission number: the earliest admitted prefills first */
    int32_t *tok;  /* the prompt's tokens while it is prefilled; NULL once decoding */
    int64_t fed;   /* prompt tokens run */
    float *logits; /* [V]: the prediction for its next token (a row of the engine's rows) */
    cli_rng rng;   /* seeded with the request's seed when decoding starts, as run seeds it */
    int32_t next;  /* the token sampled, which the next decode step runs */
    int64_t made;  /* tokens generated */
    int stopped;   /* a stop string completed */
    int done;      /* ends at this iteration's end (finished, failed or cancelled) */
} serve_slot;

struct serve_engine {
    serve_opts o;
    ekv_context *ctx;
    ekv_model *m;
    int64_t V, layers, chunk; /* vocabulary, layers, prompt tokens per prefill step */
    int64_t *base_free;       /* cpu: free pages of each layer's cache while it is empty */
    float *rows;              /* [nslots][V]: each slot's logits */
    float *chunk_logits;      /* [chunk][V]: a prefill chunk's logits */
    float *out;               /* [nslots][V]: a batched step's logits */
    int32_t *seqs, *toks;     /* [nslots]: a batched step's sequences and tokens */
    ekv_select_method method; /* the model's method now (method_set: since the first change) */
    double budget;
    int method_set;
    int broken;     /* a model step failed: the model is reset at this iteration's end */
    int32_t nslots; /* the model's sequences: --max-seqs on cuda, 1 on the cpu */
    pthread_t worker;
    serve_metrics metrics;
    pthread_mutex_t mu;
    pthread_cond_t wake, idle;
    serve_req **q; /* under mu: a ring of o.queue requests */
    int64_t qhead, qlen, next_id, admitted;
    serve_slot *slots; /* [nslots]; slot->r changes under mu */
    int32_t busy;      /* under mu: slots held by a request */
    int draining, stop;
};

/* serve_engine.c: drops a reference of r (under mu); frees it with the last. */
void serve_release_locked(serve_req *r);
/* serve_batch.c: the worker thread's body. */
void *serve_worker_main(void *arg);
#endif
