/* A small persistent thread pool: the caller runs tasks too, workers pick tasks from an
 * atomic counter. One job at a time (the pool belongs to one context).
 * Waking a thread blocked on a condition variable costs tens of microseconds, which is the
 * whole of a small job (a decode step of the model runs one job per layer and stage). So
 * workers spin for a short while on the job counter before they block, and the caller spins
 * on the busy count before it waits: back-to-back jobs never sleep. The spin is bounded
 * (EKV_POOL_SPIN pauses, about 50 us), so an idle pool costs no CPU. */
#include "internal.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

enum { EKV_POOL_SPIN = 1 << 14 };

struct ekv_pool {
    int n_threads; /* including the calling thread */
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t start_cv, done_cv;
    atomic_uint_fast64_t generation; /* bumped for every job (after fn/arg/n_tasks are set) */
    atomic_int quit;
    atomic_int busy_workers; /* workers still inside the current job */
    ekv_task_fn fn;
    void *arg;
    int64_t n_tasks;
    atomic_llong next;
};

typedef struct {
    ekv_pool *pool;
    int worker;
} worker_arg;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void run_tasks(ekv_pool *p, int worker) {
    for (;;) {
        int64_t t = atomic_fetch_add(&p->next, 1);
        if (t >= p->n_tasks) break;
        p->fn(p->arg, t, worker);
    }
}

static void *worker_main(void *vp) {
    worker_arg wa = *(worker_arg *)vp;
    free(vp);
    ekv_pool *p = wa.pool;
    uint64_t seen = 0;
    for (;;) {
        for (int i = 0;
             i < EKV_POOL_SPIN && atomic_load(&p->generation) == seen && !atomic_load(&p->quit);
             i++)
            cpu_relax();
        pthread_mutex_lock(&p->mu);
        while (!atomic_load(&p->quit) && atomic_load(&p->generation) == seen)
            pthread_cond_wait(&p->start_cv, &p->mu);
        if (atomic_load(&p->quit)) {
            pthread_mutex_unlock(&p->mu);
            break;
        }
        seen = atomic_load(&p->generation);
        pthread_mutex_unlock(&p->mu);
        run_tasks(p, wa.worker);
        pthread_mutex_lock(&p->mu);
        if (atomic_fetch_sub(&p->busy_workers, 1) == 1) pthread_cond_signal(&p->done_cv);
        pthread_mutex_unlock(&p->mu);
    }
    return NULL;
}

ekv_pool *ekv_pool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    ekv_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = n_threads;
    atomic_init(&p->generation, 0);
    atomic_init(&p->quit, 0);
    atomic_init(&p->busy_workers, 0);
    atomic_init(&p->next, 0);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->start_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        if (!p->threads) {
            free(p);
            return NULL;
        }
        for (int i = 1; i < n_threads; i++) {
            worker_arg *wa = malloc(sizeof *wa);
            if (wa) {
                wa->pool = p;
                wa->worker = i;
            }
            if (!wa || pthread_create(&p->threads[i - 1], NULL, worker_main, wa) != 0) {
                free(wa);
                p->n_threads = i; /* run with the workers we got */
                break;
            }
        }
    }
    return p;
}

void ekv_pool_run(ekv_pool *p, int64_t n_tasks, ekv_task_fn fn, void *arg) {
    if (n_tasks <= 0) return;
    if (p->n_threads == 1 || n_tasks == 1) {
        for (int64_t t = 0; t < n_tasks; t++) fn(arg, t, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    atomic_store(&p->busy_workers, p->n_threads - 1);
    atomic_fetch_add(&p->generation, 1); /* publishes the job to spinning workers */
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    run_tasks(p, 0);
    for (int i = 0; i < EKV_POOL_SPIN && atomic_load(&p->busy_workers) > 0; i++) cpu_relax();
    if (atomic_load(&p->busy_workers) > 0) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->busy_workers) > 0) pthread_cond_wait(&p->done_cv, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}

void ekv_pool_free(ekv_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->quit, 1);
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->threads[i - 1], NULL);
    free(p->threads);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->start_cv);
    pthread_cond_destroy(&p->done_cv);
    free(p);
}

int ekv_pool_threads(const ekv_pool *p) { return p->n_threads; }
