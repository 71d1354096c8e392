/*
 * The sharded CUDA plan (ekv_cuda_sharded_*, docs/math.md §11) against the one-GPU plan: for
 * dense, certified and screened entmax (alpha 1.25, 1.5, 2, 3) and dense softmax, on random and
 * planted keys, ragged batches (one sequence of exactly S pages at most, one whose last page is
 * full), GQA and MHA, f16/bf16/f32, head dims 64 and 128, 1 to 4 shards on one GPU (local
 * transport; adaptive rounds and a fixed count): every shard's output equals the one-GPU plan's
 * over the whole sequence (2e-5 relative per head), tau to 1e-9, the support exactly. topk and
 * gaussian (listed_case: budgets of 16 pages, every page, one page, shares 0.35 and 0.1; all
 * pages equal, so every bound ties; box and ball bounds; per-KV-head and per-query-head lists;
 * auto_margin): every shard's lists, read through its plan's report and joined in shard order,
 * equal the one-GPU lists page for page with the same head masks, and the outputs as above;
 * a one-page budget must leave some shard an empty list; a graph of the step replays. Then: a
 * graph of a fixed-round step replayed gives the eager output; an append through the last
 * shard is seen by the next step; the NCCL transport over 2 GPUs on every case when 2 devices
 * are present and the build has NCCL (otherwise a printed skip); invalid inputs give status
 * codes. Exit 77 when no CUDA device is present.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include "gpu/mirror.h"
#include <string.h>

typedef struct {
    int Hk, G, D;
    ekv_dtype dt;
    double alpha;
    int planted;
} scase;

static const scase CASES[] = {
        {2, 4, 128, EKV_DTYPE_F16, 1.5, 0},  {2, 4, 128, EKV_DTYPE_F16, 1.5, 1},
        {4, 1, 128, EKV_DTYPE_F16, 2.0, 1},  {4, 1, 64, EKV_DTYPE_F32, 1.25, 0},
        {1, 8, 128, EKV_DTYPE_BF16, 2.0, 0}, {2, 4, 128, EKV_DTYPE_F16, 3.0, 1},
        {8, 4, 128, EKV_DTYPE_F16, 1.5, 1},  {2, 2, 64, EKV_DTYPE_F16, 1.0, 0},
        {2, 4, 128, EKV_DTYPE_F32, 1.0, 1},
};
enum { NCASES = sizeof CASES / sizeof CASES[0], B = 3, PS = 16, MAXS = 4 };

/* One case's data: a CPU cache of three ragged sequences mirrored on a device, and queries. */
typedef struct {
    scase c;
    int H;
    ekv_cache *cache;
    int32_t seqs[B];
    int64_t max_pages, n_idx;
    float *q;
} workload;

/* ties: every page holds the same keys (its bounds equal bit for bit: top-k's ties) */
static void make_workload_ex(ekv_context *ctx, test_rng *r, const scase *c, int S, int ties,
                             workload *w) {
    memset(w, 0, sizeof *w);
    w->c = *c;
    w->H = c->Hk * c->G;
    const int64_t lens[B] = {test_range(r, 800, 4000), (int64_t)S * PS, test_range(r, 1500, 6000)};
    ekv_cache_params cp = ekv_cache_default_params();
    cp.page_size = PS;
    cp.num_kv_heads = c->Hk;
    cp.head_dim = c->D;
    cp.dtype = c->dt;
    cp.code_bits = 8;
    cp.num_pages = 1024;
    CHECK(ekv_cache_create(ctx, &cp, &w->cache) == EKV_OK, "cache: %s", ekv_last_error(ctx));
    float *dir = malloc(sizeof(float) * c->D);
    for (int d = 0; d < c->D; d++) dir[d] = (float)test_normal(r);
    const int64_t tok = (int64_t)c->Hk * c->D; /* elements per token */
    float *page_k = malloc(sizeof(float) * PS * tok);
    for (int64_t i = 0; i < PS * tok; i++) page_k[i] = (float)test_normal(r);
    for (int b = 0; b < B; b++) {
        const int64_t n = lens[b] * c->Hk * c->D;
        float *k = malloc(sizeof(float) * n), *v = malloc(sizeof(float) * n);
        for (int64_t i = 0; i < n; i++) {
            k[i] = (float)test_normal(r);
            v[i] = (float)test_normal(r);
            if (c->planted && (i / c->D) % 53 == 7) k[i] += 2.5f * dir[i % c->D];
            if (ties) k[i] = page_k[(i / tok) % PS * tok + i % tok];
        }
        ekv_cache_seq_new(w->cache, &w->seqs[b]);
        CHECK(ekv_cache_append(w->cache, w->seqs[b], lens[b], k, v, EKV_DTYPE_F32) == EKV_OK,
              "append: %s", ekv_last_error(ctx));
        free(k);
        free(v);
        const int64_t P = (lens[b] + PS - 1) / PS;
        w->max_pages = P + 2 > w->max_pages ? P + 2 : w->max_pages;
        w->n_idx += P + 1;
    }
    w->q = malloc(sizeof(float) * B * w->H * c->D);
    for (int i = 0; i < B * w->H * c->D; i++)
        w->q[i] = (float)test_normal(r) + (c->planted ? 0.5f * dir[i % c->D] : 0.f);
    free(dir);
    free(page_k);
}

static void make_workload(ekv_context *ctx, test_rng *r, const scase *c, int S, workload *w) {
    make_workload_ex(ctx, r, c, S, 0, w);
}

static void workload_free(workload *w) {
    ekv_cache_free(w->cache);
    free(w->q);
}

/* Shard j's page table (host arrays, then device copies on the current device). */
static void shard_table(const mirror *m, int S, int j, ekv_page_table *dt) {
    int64_t indptr[B + 1];
    int32_t lpl[B], *idx = malloc(sizeof(int32_t) * (m->indptr[B] + 1));
    indptr[0] = 0;
    for (int b = 0; b < B; b++) {
        int64_t first = 0, count = 0;
        const int64_t P = m->indptr[b + 1] - m->indptr[b];
        CHECK(ekv_shard_pages(P, S, j, &first, &count) == EKV_OK, "shard pages");
        memcpy(idx + indptr[b], m->indices + m->indptr[b] + first, sizeof(int32_t) * count);
        indptr[b + 1] = indptr[b] + count;
        lpl[b] = j == S - 1 ? m->lpl[b] : PS; /* only the last shard holds a partial page */
    }
    dt->batch = B;
    dt->indptr = dev_copy(indptr, sizeof indptr);
    dt->indices = dev_copy(idx, sizeof(int32_t) * (indptr[B] + 1));
    dt->last_page_len = dev_copy(lpl, sizeof lpl);
    free(idx);
}
static void table_free(ekv_page_table *t) {
    cudaFree((void *)t->indptr);
    cudaFree((void *)t->indices);
    cudaFree((void *)t->last_page_len);
}

static ekv_cuda_plan_params plan_params(const workload *w) {
    ekv_cuda_plan_params pp = ekv_cuda_plan_default_params();
    pp.max_batch = B;
    pp.num_heads = w->H;
    pp.num_kv_heads = w->c.Hk;
    pp.head_dim = w->c.D;
    pp.page_size = PS;
    pp.max_pages_per_seq = w->max_pages;
    return pp;
}

/* The workload's decode parameters: its heads and alpha. */
static ekv_decode_params decode_params_of(const workload *w) {
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = w->H;
    dp.alpha = w->c.alpha;
    return dp;
}

static ekv_select_params select_of(int method) {
    ekv_select_params sp = ekv_select_default_params();
    sp.method = method;
    sp.budget_tokens = 256;
    return sp;
}

/* What a step gave: every shard's output on the host, tau and support per head. */
typedef struct {
    float out[MAXS][B * 32 * 128];
    double tau[B * 32];
    int64_t sup[B * 32];
} result;

/* The one-GPU step (its plan returned in *keep when keep is not NULL, for its lists). */
static void ref_step_sel(ekv_context *ctx, const workload *w, const mirror *m, const float *dq,
                         const ekv_select_params *sel, result *res, ekv_cuda_plan **keep) {
    ekv_cuda_plan_params pp = plan_params(w);
    ekv_cuda_plan *plan = NULL;
    CHECK(ekv_cuda_plan_create(ctx, &pp, &plan) == EKV_OK, "plan: %s", ekv_last_error(ctx));
    ekv_decode_params dp = decode_params_of(w);
    const int64_t n = (int64_t)B * w->H * w->c.D;
    float *dout = dev_copy(NULL, sizeof(float) * n);
    CHECK(ekv_cuda_decode(plan, &dp, sel, &m->dkv, &m->dst, &m->dtab, dq, dout) == EKV_OK,
          "one-GPU decode: %s", ekv_last_error(ctx));
    ekv_cuda_report rep;
    memset(&rep, 0, sizeof rep);
    rep.tau = res->tau;
    rep.support = res->sup;
    CHECK(ekv_cuda_read_report(plan, B, &rep) == EKV_OK, "report: %s", ekv_last_error(ctx));
    CU(cudaMemcpy(res->out[0], dout, sizeof(float) * n, cudaMemcpyDeviceToHost));
    cudaFree(dout);
    if (keep)
        *keep = plan;
    else
        ekv_cuda_plan_free(plan);
}

static void ref_step(ekv_context *ctx, const workload *w, const mirror *m, const float *dq,
                     int method, result *res) {
    const ekv_select_params sel = select_of(method);
    ref_step_sel(ctx, w, m, dq, &sel, res, NULL);
}

/* The shards' inputs: each one's pool, statistics, table, queries and output on its device. */
typedef struct {
    int S;
    ekv_paged_kv kv[MAXS];
    ekv_page_stats st[MAXS];
    ekv_page_table tab[MAXS];
    const float *q[MAXS];
    float *out[MAXS];
} shard_inputs;

static void inputs_make(shard_inputs *in, int S, mirror *const *m, float *const *dq,
                        const int32_t *dev, int64_t out_n) {
    in->S = S;
    for (int j = 0; j < S; j++) {
        CU(cudaSetDevice(dev[j]));
        in->kv[j] = m[j]->dkv;
        in->st[j] = m[j]->dst;
        shard_table(m[j], S, j, &in->tab[j]);
        in->q[j] = dq[j];
        in->out[j] = dev_copy(NULL, sizeof(float) * out_n);
    }
    CU(cudaSetDevice(dev[0]));
}
static void inputs_free(shard_inputs *in, const int32_t *dev) {
    for (int j = 0; j < in->S; j++) {
        CU(cudaSetDevice(dev[j]));
        table_free(&in->tab[j]);
        cudaFree(in->out[j]);
    }
    CU(cudaSetDevice(dev[0]));
}

static void sharded_step_sel(ekv_context *ctx, ekv_cuda_sharded_plan *sp, const workload *w,
                             shard_inputs *in, const ekv_select_params *sel, result *res,
                             ekv_cuda_sharded_report *sr) {
    ekv_decode_params dp = decode_params_of(w);
    CHECK(ekv_cuda_sharded_decode(sp, &dp, sel, in->kv, in->st, in->tab, in->q, in->out) == EKV_OK,
          "sharded decode: %s", ekv_last_error(ctx));
    ekv_cuda_report rep;
    memset(&rep, 0, sizeof rep);
    rep.tau = res->tau;
    rep.support = res->sup;
    CHECK(ekv_cuda_sharded_read_report(sp, B, &rep, sr) == EKV_OK, "report: %s",
          ekv_last_error(ctx));
    const int64_t n = (int64_t)B * w->H * w->c.D;
    for (int j = 0; j < in->S; j++) {
        CU(cudaSetDevice(ekv_cuda_sharded_device(sp, j)));
        CU(cudaMemcpy(res->out[j], in->out[j], sizeof(float) * n, cudaMemcpyDeviceToHost));
    }
    CU(cudaSetDevice(ekv_cuda_sharded_device(sp, 0)));
}

static void sharded_step(ekv_context *ctx, ekv_cuda_sharded_plan *sp, const workload *w,
                         shard_inputs *in, int method, result *res, ekv_cuda_sharded_report *sr) {
    const ekv_select_params sel = select_of(method);
    sharded_step_sel(ctx, sp, w, in, &sel, res, sr);
}

static const char *method_name(int m) {
    return m == EKV_SELECT_DENSE       ? "dense"
           : m == EKV_SELECT_CERTIFIED ? "certified"
           : m == EKV_SELECT_TOPK      ? "topk"
           : m == EKV_SELECT_GAUSSIAN  ? "gaussian"
                                       : "screened";
}

/* Every shard's output, tau and support against the one-GPU step's. */
static double compare(const workload *w, int S, const result *got, const result *ref,
                      const char *what, int ci, int method) {
    const int64_t heads = (int64_t)B * w->H;
    double worst = 0;
    for (int j = 0; j < S; j++) {
        const double e = test_head_rel_err(got->out[j], ref->out[0], heads, w->c.D, 1e-6);
        worst = e > worst ? e : worst;
        CHECK(e <= 2e-5, "%s case %d %s, %d shards, shard %d: rel err %.3g", what, ci,
              method_name(method), S, j, e);
    }
    const double tol = w->c.alpha == 1.0 ? 1e-6 : 1e-9;
    int bad = 0;
    for (int64_t i = 0; i < heads && bad < 3; i++) {
        const int ok_tau = fabs(got->tau[i] - ref->tau[i]) <= tol * (1 + fabs(ref->tau[i]));
        const int ok_sup = got->sup[i] == ref->sup[i];
        bad += !ok_tau || !ok_sup;
        CHECK(ok_tau && ok_sup,
              "%s case %d %s, %d shards, head %lld: tau %.17g vs %.17g, "
              "support %lld vs %lld",
              what, ci, method_name(method), S, (long long)i, got->tau[i], ref->tau[i],
              (long long)got->sup[i], (long long)ref->sup[i]);
    }
    return worst;
}

static ekv_cuda_sharded_params sharded_params(const workload *w, int S, int transport, int rounds) {
    ekv_cuda_sharded_params p = ekv_cuda_sharded_default_params();
    p.plan = plan_params(w);
    p.num_shards = S;
    p.transport = transport;
    p.tau_rounds = rounds;
    return p;
}

/* A local-transport plan of S shards (rounds: fixed tau rounds, 0 until converged) and its
 * inputs over the shards' mirrors; NULL (a failed check) when the plan is refused. */
static ekv_cuda_sharded_plan *local_open(ekv_context *ctx, const workload *w, int S, int rounds,
                                         mirror *const *ms, float *const *dqs,
                                         const int32_t *dev, int64_t B, shard_inputs *in) {
    ekv_cuda_sharded_params p = sharded_params(w, S, EKV_TRANSPORT_LOCAL, rounds);
    ekv_cuda_sharded_plan *sp = NULL;
    CHECK(ekv_cuda_sharded_create(ctx, &p, &sp) == EKV_OK, "sharded plan: %s",
          ekv_last_error(ctx));
    if (sp) inputs_make(in, S, ms, dqs, dev, B * w->H * w->c.D);
    return sp;
}

/* A captured fixed-round step replays to the eager output (local transport, its own stream). */
static void graph_check_sel(ekv_context *ctx, const workload *w, shard_inputs *in,
                            const ekv_select_params *sel, const result *eager) {
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    ekv_cuda_sharded_params p = sharded_params(w, in->S, EKV_TRANSPORT_LOCAL, 32);
    p.plan.stream = st;
    ekv_cuda_sharded_plan *sp = NULL;
    CHECK(ekv_cuda_sharded_create(ctx, &p, &sp) == EKV_OK, "graph plan: %s", ekv_last_error(ctx));
    ekv_decode_params dp = decode_params_of(w);
    const int method = sel->method;
    const int64_t n = (int64_t)B * w->H * w->c.D;
    for (int j = 0; j < in->S; j++) CU(cudaMemset(in->out[j], 0, sizeof(float) * n));
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    const ekv_status s =
            ekv_cuda_sharded_decode(sp, &dp, sel, in->kv, in->st, in->tab, in->q, in->out);
    CU(cudaStreamEndCapture(st, &g));
    CHECK(s == EKV_OK, "captured sharded decode: %s", ekv_last_error(ctx));
    if (s == EKV_OK) {
        CU(cudaGraphInstantiate(&ge, g, 0));
        CU(cudaGraphLaunch(ge, st));
        CU(cudaGraphLaunch(ge, st));
        CU(cudaStreamSynchronize(st));
        float *h = malloc(sizeof(float) * n);
        CU(cudaMemcpy(h, in->out[in->S - 1], sizeof(float) * n, cudaMemcpyDeviceToHost));
        const double e = test_head_rel_err(h, eager->out[0], (int64_t)B * w->H, w->c.D, 1e-6);
        CHECK(e <= 2e-5, "graph replay %s, %d shards: rel err %.3g", method_name(method), in->S, e);
        free(h);
        cudaGraphExecDestroy(ge);
    }
    if (g) cudaGraphDestroy(g);
    ekv_cuda_sharded_free(sp);
    cudaStreamDestroy(st);
}

static void graph_check(ekv_context *ctx, const workload *w, shard_inputs *in, int method,
                        const result *eager) {
    const ekv_select_params sel = select_of(method);
    graph_check_sel(ctx, w, in, &sel, eager);
}

/* The methods of a case: entmax all three, softmax dense only. */
static int methods_of(const scase *c, int *m) {
    m[0] = EKV_SELECT_DENSE;
    if (c->alpha == 1.0) return 1;
    m[1] = EKV_SELECT_CERTIFIED;
    m[2] = EKV_SELECT_SCREENED;
    return 3;
}

static result g_ref, g_got;

/* Case ci on the local transport, 1..4 shards, adaptive and fixed rounds. */
static void local_case(ekv_context *ctx, test_rng *r, int ci, double *worst, int *rounds_max) {
    workload w;
    make_workload(ctx, r, &CASES[ci], MAXS, &w);
    mirror m;
    mirror_build(&m, w.cache, w.seqs, B, w.n_idx, 0);
    float *dq = dev_copy(w.q, sizeof(float) * B * w.H * w.c.D);
    int methods[3];
    const int nm = methods_of(&w.c, methods);
    const int32_t dev[MAXS] = {0, 0, 0, 0};
    mirror *ms[MAXS] = {&m, &m, &m, &m};
    float *dqs[MAXS] = {dq, dq, dq, dq};
    for (int mi = 0; mi < nm; mi++) {
        ref_step(ctx, &w, &m, dq, methods[mi], &g_ref);
        for (int S = 1; S <= MAXS; S++) {
            shard_inputs in;
            ekv_cuda_sharded_plan *sp =
                    local_open(ctx, &w, S, (ci + S) % 3 == 0 ? 32 : 0, ms, dqs, dev, B, &in);
            if (!sp) continue;
            ekv_cuda_sharded_report sr;
            sharded_step(ctx, sp, &w, &in, methods[mi], &g_got, &sr);
            const double e = compare(&w, S, &g_got, &g_ref, "local", ci, methods[mi]);
            *worst = e > *worst ? e : *worst;
            *rounds_max = sr.rounds > *rounds_max ? sr.rounds : *rounds_max;
            CHECK(sr.unconverged == 0, "case %d: %lld heads unconverged", ci,
                  (long long)sr.unconverged);
            CHECK(sr.bytes > 0 && sr.allreduces >= 2, "case %d: %d allreduces, %lld bytes", ci,
                  sr.allreduces, (long long)sr.bytes);
            if (ci < 3 && S == 3) graph_check(ctx, &w, &in, methods[mi], &g_ref);
            inputs_free(&in, dev);
            ekv_cuda_sharded_free(sp);
        }
    }
    cudaFree(dq);
    mirror_free(&m);
    workload_free(&w);
}

/* Two GPUs for case ci: each device its own copy of the pool and of the queries, and the NCCL
 * plan over them (tau_rounds rounds); *sp NULL when the build has no NCCL (returns 1). */
typedef struct {
    workload w;
    mirror m[2];
    float *dq[2];
    ekv_cuda_sharded_plan *sp;
} nccl_run;
static const int32_t NCCL_DEV[2] = {0, 1};

static int nccl_open(ekv_context *ctx, test_rng *r, int ci, int32_t tau_rounds, nccl_run *n) {
    make_workload(ctx, r, &CASES[ci], 2, &n->w);
    for (int j = 0; j < 2; j++) {
        CU(cudaSetDevice(NCCL_DEV[j]));
        mirror_build(&n->m[j], n->w.cache, n->w.seqs, B, n->w.n_idx, 0);
        n->dq[j] = dev_copy(n->w.q, sizeof(float) * B * n->w.H * n->w.c.D);
    }
    CU(cudaSetDevice(0));
    ekv_cuda_sharded_params p = sharded_params(&n->w, 2, EKV_TRANSPORT_NCCL, tau_rounds);
    p.devices = NCCL_DEV;
    n->sp = NULL;
    const ekv_status s = ekv_cuda_sharded_create(ctx, &p, &n->sp);
    if (s == EKV_ERR_UNSUPPORTED) return 1;
    CHECK(s == EKV_OK, "nccl plan: %s", ekv_last_error(ctx));
    return 0;
}

static void nccl_close(nccl_run *n) {
    ekv_cuda_sharded_free(n->sp);
    for (int j = 0; j < 2; j++) {
        CU(cudaSetDevice(NCCL_DEV[j]));
        cudaFree(n->dq[j]);
        mirror_free(&n->m[j]);
    }
    CU(cudaSetDevice(0));
    workload_free(&n->w);
}

/* Case ci over 2 GPUs through NCCL: each device its own copy of the pool. 0: ran, 1: no NCCL */
static int nccl_case(ekv_context *ctx, test_rng *r, int ci) {
    nccl_run n;
    const int skipped = nccl_open(ctx, r, ci, ci % 2 ? 32 : 0, &n);
    int methods[3];
    const int nm = methods_of(&n.w.c, methods);
    mirror *ms[2] = {&n.m[0], &n.m[1]};
    for (int mi = 0; mi < nm && n.sp; mi++) {
        ref_step(ctx, &n.w, &n.m[0], n.dq[0], methods[mi], &g_ref);
        shard_inputs in;
        inputs_make(&in, 2, ms, n.dq, NCCL_DEV, (int64_t)B * n.w.H * n.w.c.D);
        ekv_cuda_sharded_report sr;
        sharded_step(ctx, n.sp, &n.w, &in, methods[mi], &g_got, &sr);
        compare(&n.w, 2, &g_got, &g_ref, "nccl", ci, methods[mi]);
        inputs_free(&in, NCCL_DEV);
    }
    nccl_close(&n);
    return skipped;
}

/* An append through the last shard (the newest page's owner) is what the next step reads:
 * one token into sequence 0's last page, then the sharded step equals the one-GPU step. */
static void append_check(ekv_context *ctx, test_rng *r) {
    workload w;
    make_workload(ctx, r, &CASES[0], 2, &w);
    mirror m;
    mirror_build(&m, w.cache, w.seqs, B, w.n_idx, 0);
    if (m.lpl[0] == PS) m.lpl[0]--; /* room in the last page: the token goes in its last slot */
    const int32_t last_page = m.indices[m.indptr[1] - 1];
    const int64_t kvn = (int64_t)w.c.Hk * w.c.D;
    float *kv_new = malloc(sizeof(float) * kvn);
    for (int64_t i = 0; i < kvn; i++) kv_new[i] = (float)test_normal(r) * 3.f;
    float *dk = dev_copy(kv_new, sizeof(float) * kvn);
    const ekv_cuda_append_item item = {last_page, m.lpl[0], 1, 0, 0};
    ekv_cuda_append_item *ditem = dev_copy(&item, sizeof item);
    ekv_cuda_sharded_params p = sharded_params(&w, 2, EKV_TRANSPORT_LOCAL, 0);
    ekv_cuda_sharded_plan *sp = NULL;
    CHECK(ekv_cuda_sharded_create(ctx, &p, &sp) == EKV_OK, "append plan: %s", ekv_last_error(ctx));
    ekv_paged_kv kvs[2] = {m.dkv, m.dkv};
    ekv_page_stats sts[2] = {m.dst, m.dst};
    CHECK(ekv_cuda_sharded_append(sp, kvs, sts, ditem, 1, dk, dk) == EKV_OK, "sharded append: %s",
          ekv_last_error(ctx));
    m.lpl[0]++;
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy((void *)m.dtab.last_page_len, m.lpl, sizeof(int32_t) * B,
                  cudaMemcpyHostToDevice));
    float *dq = dev_copy(w.q, sizeof(float) * B * w.H * w.c.D);
    ref_step(ctx, &w, &m, dq, EKV_SELECT_DENSE, &g_ref);
    const int32_t dev[2] = {0, 0};
    mirror *ms[2] = {&m, &m};
    float *dqs[2] = {dq, dq};
    shard_inputs in;
    inputs_make(&in, 2, ms, dqs, dev, (int64_t)B * w.H * w.c.D);
    ekv_cuda_sharded_report sr;
    sharded_step(ctx, sp, &w, &in, EKV_SELECT_DENSE, &g_got, &sr);
    compare(&w, 2, &g_got, &g_ref, "after append", 0, EKV_SELECT_DENSE);
    inputs_free(&in, dev);
    ekv_cuda_sharded_free(sp);
    cudaFree(dq);
    cudaFree(dk);
    cudaFree(ditem);
    free(kv_new);
    mirror_free(&m);
    workload_free(&w);
}

/* Bad parameters and steps give status codes. */
static void invalid_check(ekv_context *ctx, test_rng *r) {
    workload w;
    make_workload(ctx, r, &CASES[0], 2, &w);
    ekv_cuda_sharded_plan *sp = NULL;
    ekv_cuda_sharded_params p = sharded_params(&w, 0, EKV_TRANSPORT_LOCAL, 0);
    CHECK(ekv_cuda_sharded_create(ctx, &p, &sp) == EKV_ERR_INVALID_SIZE && !sp, "0 shards");
    p.num_shards = 65;
    CHECK(ekv_cuda_sharded_create(ctx, &p, &sp) == EKV_ERR_INVALID_SIZE, "65 shards");
    p.num_shards = 2;
    p.transport = 7;
    CHECK(ekv_cuda_sharded_create(ctx, &p, &sp) == EKV_ERR_INVALID_ARGUMENT, "transport 7");
    p.transport = EKV_TRANSPORT_LOCAL;
    p.tau_rounds = -1;
    CHECK(ekv_cuda_sharded_create(ctx, &p, &sp) == EKV_ERR_INVALID_SIZE, "tau_rounds -1");
    p.tau_rounds = 0;
    const int32_t same[2] = {0, 0};
    p.transport = EKV_TRANSPORT_NCCL;
    p.devices = same;
    CHECK(ekv_cuda_sharded_create(ctx, &p, &sp) == EKV_ERR_INVALID_ARGUMENT, "nccl, one device");
    p.transport = EKV_TRANSPORT_LOCAL;
    p.devices = NULL;
    p.plan.max_pages_per_seq = 0;
    CHECK(ekv_cuda_sharded_create(ctx, &p, &sp) == EKV_ERR_INVALID_SIZE, "no page capacity");
    CHECK(ekv_cuda_sharded_create(ctx, NULL, &sp) == EKV_ERR_NULL_POINTER, "NULL params");
    p = sharded_params(&w, 2, EKV_TRANSPORT_LOCAL, 0);
    CHECK(ekv_cuda_sharded_create(ctx, &p, &sp) == EKV_OK, "plan: %s", ekv_last_error(ctx));
    mirror m;
    mirror_build(&m, w.cache, w.seqs, B, w.n_idx, 0);
    float *dq = dev_copy(w.q, sizeof(float) * B * w.H * w.c.D);
    const int32_t dev[2] = {0, 0};
    mirror *ms[2] = {&m, &m};
    float *dqs[2] = {dq, dq};
    shard_inputs in;
    inputs_make(&in, 2, ms, dqs, dev, (int64_t)B * w.H * w.c.D);
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = w.H;
    dp.alpha = 1.5;
    ekv_select_params sel = select_of(EKV_SELECT_TOPK);
    dp.alpha = 1.0;
    CHECK(ekv_cuda_sharded_decode(sp, &dp, &sel, in.kv, in.st, in.tab, in.q, in.out) ==
                  EKV_ERR_UNSUPPORTED,
          "topk softmax accepted");
    dp.alpha = 1.5;
    sel = select_of(EKV_SELECT_GAUSSIAN);
    sel.tau_mode = EKV_TAU_FIXED;
    CHECK(ekv_cuda_sharded_decode(sp, &dp, &sel, in.kv, in.st, in.tab, in.q, in.out) ==
                  EKV_ERR_UNSUPPORTED,
          "gaussian fixed tau mode accepted");
    sel = select_of(EKV_SELECT_GAUSSIAN);
    float gslopes[32] = {0};
    dp.alibi_slopes = gslopes;
    CHECK(ekv_cuda_sharded_decode(sp, &dp, &sel, in.kv, in.st, in.tab, in.q, in.out) ==
                  EKV_ERR_UNSUPPORTED,
          "gaussian ALiBi accepted");
    dp.alibi_slopes = NULL;
    sel = select_of(EKV_SELECT_DENSE);
    float slopes[32] = {0};
    dp.alibi_slopes = slopes;
    CHECK(ekv_cuda_sharded_decode(sp, &dp, &sel, in.kv, in.st, in.tab, in.q, in.out) ==
                  EKV_ERR_UNSUPPORTED,
          "ALiBi accepted");
    dp.alibi_slopes = NULL;
    sel = select_of(EKV_SELECT_CERTIFIED);
    double *lb = dev_copy(NULL, sizeof(double) * B * w.H);
    sel.tau_lb = lb;
    CHECK(ekv_cuda_sharded_decode(sp, &dp, &sel, in.kv, in.st, in.tab, in.q, in.out) ==
                  EKV_ERR_UNSUPPORTED,
          "tau_lb accepted");
    sel.tau_lb = NULL;
    sel.tau_hint = lb;
    CHECK(ekv_cuda_sharded_decode(sp, &dp, &sel, in.kv, in.st, in.tab, in.q, in.out) ==
                  EKV_ERR_UNSUPPORTED,
          "tau_hint accepted");
    cudaFree(lb);
    sel = select_of(EKV_SELECT_DENSE);
    CHECK(ekv_cuda_sharded_decode(sp, &dp, &sel, in.kv, in.st, in.tab, NULL, in.out) ==
                  EKV_ERR_NULL_POINTER,
          "NULL q accepted");
    in.tab[1].batch = 2;
    CHECK(ekv_cuda_sharded_decode(sp, &dp, &sel, in.kv, in.st, in.tab, in.q, in.out) ==
                  EKV_ERR_INVALID_SIZE,
          "batch mismatch accepted");
    in.tab[1].batch = B;
    dp.num_heads = w.H + 1;
    CHECK(ekv_cuda_sharded_decode(sp, &dp, &sel, in.kv, in.st, in.tab, in.q, in.out) != EKV_OK,
          "wrong head count accepted");
    CHECK(ekv_cuda_sharded_decode(NULL, &dp, &sel, in.kv, in.st, in.tab, in.q, in.out) ==
                  EKV_ERR_NULL_POINTER,
          "NULL plan accepted");
    CHECK(ekv_cuda_sharded_read_report(sp, 0, NULL, NULL) == EKV_ERR_INVALID_SIZE, "batch 0");
    CHECK(ekv_cuda_sharded_shard(sp, 2) == NULL && ekv_cuda_sharded_device(sp, -1) == -1,
          "shard out of range");
    int64_t f, c;
    CHECK(ekv_shard_pages(10, 0, 0, &f, &c) == EKV_ERR_INVALID_SIZE &&
                  ekv_shard_pages(10, 2, 2, &f, &c) == EKV_ERR_INVALID_SIZE &&
                  ekv_shard_pages(10, 3, 2, &f, &c) == EKV_OK && f == 6 && c == 4,
          "ekv_shard_pages");
    inputs_free(&in, dev);
    ekv_cuda_sharded_free(sp);
    cudaFree(dq);
    mirror_free(&m);
    workload_free(&w);
}

/* ---- topk and gaussian: the page lists agreed across the shards (docs/math.md §11) ---- */
typedef struct {
    scase c;
    int method;
    int64_t budget_tokens; /* topk (budget_fraction 0) */
    double fraction;       /* topk: > 0 the sequence's share (1: every ranked page)          */
    int per_head, ball, ties, auto_margin;
} lcase;

static const lcase LCASES[] = {
        {{2, 4, 128, EKV_DTYPE_F16, 1.5, 0}, EKV_SELECT_TOPK, 256, 0, 0, 0, 0, 0},
        {{2, 4, 128, EKV_DTYPE_F16, 1.5, 1}, EKV_SELECT_TOPK, 0, 1.0, 1, 1, 0, 0},
        {{4, 1, 64, EKV_DTYPE_F32, 2.0, 0}, EKV_SELECT_TOPK, 1, 0, 0, 0, 0, 0}, /* one page */
        {{2, 2, 128, EKV_DTYPE_F16, 1.5, 0}, EKV_SELECT_TOPK, 5 * PS, 0, 0, 1, 1, 0},
        {{1, 8, 128, EKV_DTYPE_BF16, 1.25, 0}, EKV_SELECT_TOPK, 0, 0.35, 1, 0, 1, 0},
        {{8, 4, 128, EKV_DTYPE_F16, 3.0, 1}, EKV_SELECT_TOPK, 0, 0.1, 0, 1, 0, 0},
        {{2, 4, 128, EKV_DTYPE_F16, 1.5, 0}, EKV_SELECT_GAUSSIAN, 0, 0, 0, 0, 0, 0},
        {{2, 4, 128, EKV_DTYPE_F16, 2.0, 1}, EKV_SELECT_GAUSSIAN, 0, 0, 1, 0, 0, 0},
        {{4, 1, 64, EKV_DTYPE_F32, 1.5, 1}, EKV_SELECT_GAUSSIAN, 0, 0, 0, 0, 0, 1},
        {{1, 8, 128, EKV_DTYPE_BF16, 4.0 / 3.0, 0}, EKV_SELECT_GAUSSIAN, 0, 0, 1, 0, 0, 1},
};
enum { NLCASES = sizeof LCASES / sizeof LCASES[0] };

static ekv_select_params lselect_of(const lcase *lc) {
    ekv_select_params sp = ekv_select_default_params();
    sp.method = lc->method;
    sp.budget_tokens = lc->budget_tokens;
    sp.budget_fraction = lc->fraction;
    sp.per_query_head = lc->per_head;
    sp.use_ball = lc->ball;
    sp.auto_margin = lc->auto_margin;
    return sp;
}

/* A plan's page lists as its report gives them: per KV head the union's logical pages, their
 * count and each entry's head mask. */
typedef struct {
    int32_t *pages, *count;
    uint16_t *heads;
    int64_t cap;
} lists;

static void lists_read(ekv_context *ctx, ekv_cuda_plan *plan, const workload *w, int64_t cap,
                       lists *l) {
    const int64_t nl = (int64_t)B * w->c.Hk;
    l->cap = cap;
    l->pages = malloc(sizeof(int32_t) * nl * cap);
    l->count = malloc(sizeof(int32_t) * nl);
    l->heads = malloc(sizeof(uint16_t) * nl * cap);
    ekv_cuda_report rep;
    memset(&rep, 0, sizeof rep);
    rep.list_pages = l->pages;
    rep.pages_round1 = l->count;
    rep.list_heads = l->heads;
    CHECK(ekv_cuda_read_report(plan, B, &rep) == EKV_OK, "lists: %s", ekv_last_error(ctx));
}
static void lists_free(lists *l) {
    free(l->pages);
    free(l->count);
    free(l->heads);
}

/* The shards' lists, joined in shard order with each shard's pages moved to their place in
 * the sequence, equal the one-GPU lists page for page and head mask for head mask. Returns the
 * (shard, list) pairs that held no page (a shard before the last may have none). */
static int64_t compare_lists(ekv_context *ctx, ekv_cuda_sharded_plan *sp, const workload *w,
                             const mirror *m, int S, const lists *ref, int lci, int method) {
    const int64_t nl = (int64_t)B * w->c.Hk;
    int64_t empty = 0;
    int bad = 0;
    int32_t *joined = malloc(sizeof(int32_t) * ref->cap);
    uint16_t *jheads = malloc(sizeof(uint16_t) * ref->cap);
    lists got[MAXS];
    for (int j = 0; j < S; j++) { /* each shard's plan on its device */
        CU(cudaSetDevice(ekv_cuda_sharded_device(sp, j)));
        lists_read(ctx, ekv_cuda_sharded_shard(sp, j), w, w->max_pages, &got[j]);
    }
    CU(cudaSetDevice(ekv_cuda_sharded_device(sp, 0)));
    for (int64_t l = 0; l < nl && bad < 3; l++) {
        const int64_t b = l / w->c.Hk, P = m->indptr[b + 1] - m->indptr[b];
        int64_t n = 0;
        for (int j = 0; j < S; j++) {
            int64_t first = 0, count = 0;
            ekv_shard_pages(P, S, j, &first, &count);
            const int32_t c = got[j].count[l];
            empty += c == 0;
            CHECK(c >= 0 && c <= count && n + c <= ref->cap,
                  "case %d, %d shards, list %lld: shard %d lists %d of its %lld pages", lci, S,
                  (long long)l, j, c, (long long)count);
            for (int32_t e = 0; e < c && e <= count && n < ref->cap; e++, n++) {
                joined[n] = (int32_t)first + got[j].pages[l * got[j].cap + e];
                jheads[n] = got[j].heads[l * got[j].cap + e];
            }
        }
        int same = n == ref->count[l];
        for (int64_t e = 0; same && e < n; e++)
            same = joined[e] == ref->pages[l * ref->cap + e] &&
                   jheads[e] == ref->heads[l * ref->cap + e];
        bad += !same;
        CHECK(same, "case %d (%s), %d shards, list %lld: %lld pages joined vs %d on one GPU", lci,
              method_name(method), S, (long long)l, (long long)n, ref->count[l]);
    }
    for (int j = 0; j < S; j++) lists_free(&got[j]);
    free(joined);
    free(jheads);
    return empty;
}

/* Listed case lci on the local transport, 1..4 shards: the joined lists equal the one-GPU
 * plan's, the outputs, tau and supports too; a graph of the step replays to the eager output. */
static void listed_case(ekv_context *ctx, test_rng *r, int lci, double *worst, int64_t *empty_seen,
                        int *lists_checked) {
    const lcase *lc = &LCASES[lci];
    workload w;
    make_workload_ex(ctx, r, &lc->c, MAXS, lc->ties, &w);
    mirror m;
    mirror_build(&m, w.cache, w.seqs, B, w.n_idx, 0);
    float *dq = dev_copy(w.q, sizeof(float) * B * w.H * w.c.D);
    const int32_t dev[MAXS] = {0, 0, 0, 0};
    mirror *ms[MAXS] = {&m, &m, &m, &m};
    float *dqs[MAXS] = {dq, dq, dq, dq};
    const ekv_select_params sel = lselect_of(lc);
    ekv_cuda_plan *one = NULL;
    ref_step_sel(ctx, &w, &m, dq, &sel, &g_ref, &one);
    lists ref;
    lists_read(ctx, one, &w, w.max_pages, &ref);
    ekv_cuda_plan_free(one);
    for (int S = 1; S <= MAXS; S++) {
        shard_inputs in;
        ekv_cuda_sharded_plan *sp =
                local_open(ctx, &w, S, (lci + S) % 2 == 0 ? 32 : 0, ms, dqs, dev, B, &in);
        if (!sp) continue;
        ekv_cuda_sharded_report sr;
        sharded_step_sel(ctx, sp, &w, &in, &sel, &g_got, &sr);
        const int64_t empty = compare_lists(ctx, sp, &w, &m, S, &ref, lci, lc->method);
        (*lists_checked)++;
        if (lc->budget_tokens == 1 && S >= 3)
            CHECK(empty > 0, "case %d, %d shards: a one-page budget left every shard a page", lci,
                  S);
        *empty_seen += empty;
        const double e = compare(&w, S, &g_got, &g_ref, "listed", lci, lc->method);
        *worst = e > *worst ? e : *worst;
        CHECK(sr.unconverged == 0, "listed case %d: %lld heads unconverged", lci,
              (long long)sr.unconverged);
        if (S >= 2 && (lci % 3 == 0 || S == 4)) graph_check_sel(ctx, &w, &in, &sel, &g_ref);
        inputs_free(&in, dev);
        ekv_cuda_sharded_free(sp);
    }
    lists_free(&ref);
    cudaFree(dq);
    mirror_free(&m);
    workload_free(&w);
}

/* Listed steps through NCCL over 2 GPUs (case ci's workload): topk and gaussian lists joined
 * equal the one-GPU lists, and the outputs as above. 0: ran, 1: no NCCL. */
static int nccl_listed(ekv_context *ctx, test_rng *r, int ci) {
    nccl_run n;
    const int skipped = nccl_open(ctx, r, ci, 32, &n);
    mirror *ms[2] = {&n.m[0], &n.m[1]};
    for (int k = 0; k < 2 && n.sp; k++) {
        lcase lc = LCASES[k == 0 ? 0 : 7]; /* a topk and a gaussian case's select */
        lc.per_head = ci % 2;
        const ekv_select_params sel = lselect_of(&lc);
        ekv_cuda_plan *one = NULL;
        ref_step_sel(ctx, &n.w, &n.m[0], n.dq[0], &sel, &g_ref, &one);
        lists ref;
        lists_read(ctx, one, &n.w, n.w.max_pages, &ref);
        ekv_cuda_plan_free(one);
        shard_inputs in;
        inputs_make(&in, 2, ms, n.dq, NCCL_DEV, (int64_t)B * n.w.H * n.w.c.D);
        ekv_cuda_sharded_report sr;
        sharded_step_sel(ctx, n.sp, &n.w, &in, &sel, &g_got, &sr);
        compare_lists(ctx, n.sp, &n.w, &n.m[0], 2, &ref, ci, lc.method);
        compare(&n.w, 2, &g_got, &g_ref, "nccl listed", ci, lc.method);
        inputs_free(&in, NCCL_DEV);
        lists_free(&ref);
    }
    nccl_close(&n);
    return skipped;
}

int main(void) {
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("test_cuda_sharded: no CUDA device, skipped\n");
        return 77;
    }
    ekv_context *ctx;
    if (ekv_context_create(NULL, &ctx)) return 1;
    test_rng r = {0x5ba4d};
    double worst = 0;
    int rounds_max = 0;
    for (int ci = 0; ci < NCASES; ci++) local_case(ctx, &r, ci, &worst, &rounds_max);
    printf("local transport: %d cases x methods x 1..4 shards, worst rel err %.3g, at most %d "
           "agreement rounds\n",
           NCASES, worst, rounds_max);
    double lworst = 0;
    int64_t empty = 0;
    int nlists = 0;
    for (int lci = 0; lci < NLCASES; lci++) listed_case(ctx, &r, lci, &lworst, &empty, &nlists);
    printf("topk/gaussian lists: %d cases x 1..4 shards, %d joined list sets compared with the "
           "one-GPU lists, %lld empty shard lists, worst rel err %.3g\n",
           NLCASES, nlists, (long long)empty, lworst);
    append_check(ctx, &r);
    invalid_check(ctx, &r);
    if (ndev < 2) {
        printf("nccl over 2 GPUs: skipped (%d CUDA device)\n", ndev);
    } else {
        int skipped = 0;
        for (int ci = 0; ci < NCASES && !skipped; ci++) skipped = nccl_case(ctx, &r, ci);
        for (int ci = 0; ci < 2 && !skipped; ci++) skipped = nccl_listed(ctx, &r, ci);
        printf(skipped ? "nccl over 2 GPUs: skipped (the build has no NCCL: -DEKV_NCCL=ON)\n"
                       : "nccl over 2 GPUs: every case ran, topk and gaussian lists too\n");
    }
    ekv_context_free(ctx);
    return test_finish("test_cuda_sharded");
}
