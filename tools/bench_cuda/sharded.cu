/*
 * bench --backend cuda, --shards N / --gpus N (bench_cuda.cu): the sharded plan
 * (docs/architecture.md, "The sharded CUDA plan") over the pool of one length, every GPU holding
 * a copy of the whole pool, beside the one-GPU step.
 */
#include "bench_cuda.cuh"

/* The shards and GPUs of the options: --gpus N puts shard j on GPU j, --shards N all on 0. */
void shard_args_init(const bench_opts *o, shard_args *a) {
    a->S = (int)(o->gpus ? o->gpus : o->shards);
    a->ngpu = o->gpus ? a->S : 1;
    for (int j = 0; j < a->S; j++) a->dev.push_back(o->gpus ? j : 0);
}

/* Shard j's page table over the whole pool c (shard_geometry's pages, indices into c). */
struct shard_table {
    int64_t *indptr = NULL;
    int32_t *indices = NULL, *lpl = NULL;
    ekv_page_table t;
};
static int shard_table_make(const cuda_len *c, const bench_opts *o, int S, int j, shard_table *st) {
    cuda_len g;
    if (shard_geometry(*c, o, S, j, &g)) return 1;
    const int64_t B = (int64_t)g.lens.size();
    std::vector<int32_t> idx;
    for (int64_t b = 0; b < B; b++)
        for (int64_t p = 0; p < g.indptr[b + 1] - g.indptr[b]; p++)
            idx.push_back((int32_t)(g.gpage[b] + p));
    BC(cudaMalloc((void **)&st->indptr, (B + 1) * sizeof(int64_t)));
    BC(cudaMalloc((void **)&st->indices, idx.size() * sizeof(int32_t)));
    BC(cudaMalloc((void **)&st->lpl, B * sizeof(int32_t)));
    BC(cudaMemcpy(st->indptr, g.indptr.data(), (B + 1) * sizeof(int64_t), cudaMemcpyHostToDevice));
    BC(cudaMemcpy(st->indices, idx.data(), idx.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    BC(cudaMemcpy(st->lpl, g.lpl.data(), B * sizeof(int32_t), cudaMemcpyHostToDevice));
    st->t = ekv_page_table{(int32_t)B, st->indptr, st->indices, st->lpl};
    return 0;
}

/* What the whole-pool sharded bench holds: every GPU's filled pool (nccl: the same seed on
 * each, shard j reading its range of GPU j's copy; local: c itself) and the shards' inputs. */
struct sharded_run {
    shard_args a;
    std::vector<cuda_len> pools; /* GPUs 1 .. ngpu - 1 (GPU 0's is the caller's) */
    std::vector<shard_table> tabs;
};

static void sharded_run_free(sharded_run *r) {
    for (size_t j = 0; j < r->a.out.size(); j++) {
        cudaSetDevice(r->a.dev[j]);
        cudaFree(r->tabs[j].indptr);
        cudaFree(r->tabs[j].indices);
        cudaFree(r->tabs[j].lpl);
        cudaFree(r->a.out[j]);
    }
    for (size_t g = 0; g < r->pools.size(); g++) {
        cudaSetDevice((int)g + 1);
        cuda_len_free(&r->pools[g]);
    }
    cudaSetDevice(0);
}

/* GPU g's copy of the pool (g >= 1): the same geometry and seed, summaries by a plan there. */
static int pool_on(ekv_context *ctx, const bench_opts *o, const ekv_cuda_plan_params &pp, int g,
                   cuda_len *c, int64_t len) {
    BC(cudaSetDevice(g));
    ekv_cuda_plan_params gp = pp;
    gp.device = g;
    c->device = g;
    ekv_cuda_plan *plan = NULL;
    float build_ms = 0;
    int rc = cuda_len_geometry(c, o, len) || cuda_len_alloc(ctx, c, o) || cuda_len_fill(c, o);
    if (!rc && ekv_cuda_plan_create(ctx, &gp, &plan)) {
        fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx));
        rc = 1;
    }
    if (!rc) rc = cuda_summaries(ctx, plan, c, o, &build_ms);
    ekv_cuda_plan_free(plan);
    return rc;
}

static int sharded_inputs(ekv_context *ctx, const bench_opts *o, const ekv_cuda_plan_params &pp,
                          cuda_len *c0, sharded_run *r) {
    shard_args *a = &r->a;
    shard_args_init(o, a);
    r->pools.resize(a->ngpu - 1);
    r->tabs.resize(a->S);
    const int64_t n = o->w.batch * o->w.heads * o->w.dim;
    for (int g = 1; g < a->ngpu; g++)
        if (pool_on(ctx, o, pp, g, &r->pools[g - 1], c0->len)) return 1;
    for (int j = 0; j < a->S; j++) {
        const int g = a->dev[j];
        cuda_len *c = g ? &r->pools[g - 1] : c0;
        BC(cudaSetDevice(g));
        float *out = NULL;
        BC(cudaMalloc((void **)&out, n * sizeof(float)));
        a->out.push_back(out);
        if (shard_table_make(c, o, a->S, j, &r->tabs[j])) return 1;
        a->tv.push_back(r->tabs[j].t);
        a->kv.push_back(c->kv);
        a->st.push_back(c->st);
        a->q.push_back((const float *)c->dq);
    }
    BC(cudaSetDevice(0));
    return 0;
}

/* The sharded plan of a: the local transport for --shards, NCCL over a's GPUs for --gpus. */
int sharded_plan_create(ekv_context *ctx, const bench_opts *o, const ekv_cuda_plan_params &pp,
                        const shard_args &a, ekv_cuda_sharded_plan **sp) {
    ekv_cuda_sharded_params p = ekv_cuda_sharded_default_params();
    p.plan = pp;
    p.num_shards = a.S;
    p.transport = o->gpus ? EKV_TRANSPORT_NCCL : EKV_TRANSPORT_LOCAL;
    p.devices = o->gpus ? a.dev.data() : NULL;
    if (!ekv_cuda_sharded_create(ctx, &p, sp)) return 0;
    fprintf(stderr, "entmaxkv bench: sharded plan: %s\n", ekv_last_error(ctx));
    return 1;
}

/* Wall clock of sharded steps, every device drained before and after each (ms). */
static int sharded_time(ekv_context *ctx, ekv_cuda_sharded_plan *sp, const cuda_step &step,
                        const shard_args &a, int64_t iters, std::vector<double> &ts) {
    for (int64_t i = 0; i < iters; i++) {
        for (int g = 0; g < a.ngpu; g++) cudaSetDevice(g), cudaDeviceSynchronize();
        const double t0 = cli_now_seconds();
        if (ekv_cuda_sharded_decode(sp, &step.prm, &step.sp, a.kv.data(), a.st.data(), a.tv.data(),
                                    a.q.data(), a.out.data())) {
            fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx));
            return 1;
        }
        for (int g = 0; g < a.ngpu; g++) cudaSetDevice(g), cudaDeviceSynchronize();
        ts.push_back((cli_now_seconds() - t0) * 1e3);
    }
    cudaSetDevice(0);
    return 0;
}

/* The sharded steps at len (the GPU protocol: the median of at least 50 after at least 5),
 * their report, and shard 0's copy of the output. */
int sharded_steps(ekv_context *ctx, ekv_cuda_sharded_plan *sp, const bench_opts *o,
                  const shard_args &a, int64_t len, double *ms, ekv_cuda_sharded_report *sr,
                  std::vector<float> *got) {
    cuda_step step;
    cuda_params(o, &step.prm, &step.sp);
    step.sp.budget_tokens = bench_budget_tokens(o, len);
    std::vector<double> warm, ts;
    memset(sr, 0, sizeof *sr);
    if (sharded_time(ctx, sp, step, a, std::max<int64_t>(o->warmup, 5), warm) ||
        sharded_time(ctx, sp, step, a, std::max<int64_t>(o->iters, 50), ts))
        return 1;
    if (ekv_cuda_sharded_read_report(sp, (int32_t)o->w.batch, NULL, sr)) {
        fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx));
        return 1;
    }
    *ms = median(ts);
    got->resize(o->w.batch * o->w.heads * o->w.dim);
    BC(cudaSetDevice(a.dev[0]));
    BC(cudaMemcpy(got->data(), a.out[0], got->size() * sizeof(float), cudaMemcpyDeviceToHost));
    BC(cudaSetDevice(0));
    return 0;
}

/* The largest per-head relative difference of got from ref (heads of D values). */
static double max_rel_err(const std::vector<float> &got, const std::vector<float> &ref, int64_t D) {
    double err = 0;
    for (size_t h = 0; h < ref.size() / D; h++) {
        double e = 0, nb = 0;
        for (int64_t d = 0; d < D; d++) {
            const double x = (double)got[h * D + d] - ref[h * D + d];
            e += x * x;
            nb += (double)ref[h * D + d] * ref[h * D + d];
        }
        err = std::max(err, sqrt(e) / (sqrt(nb) + 1e-12));
    }
    return err;
}

/* FNV-1a of the output's bits: two runs (whole pool, shard pools) printing the same value
 * computed the same output bit for bit. */
static uint64_t out_fnv(const std::vector<float> &x) {
    uint64_t h = 0xcbf29ce484222325ull;
    const unsigned char *p = (const unsigned char *)x.data();
    for (size_t i = 0; i < x.size() * sizeof(float); i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/* The "# sharded" line: the step beside the one-GPU step (ms1 and ref empty: not run, "none"),
 * the agreement's collectives, the output's hash, then `extra`. */
void sharded_line(const cli_out *out, const bench_opts *o, int S, int64_t len, double ms,
                  double ms1, const ekv_cuda_sharded_report &sr, const std::vector<float> &got,
                  const std::vector<float> &ref, const char *extra) {
    char one[32] = "none", ratio[32] = "none", err[32] = "none";
    if (!ref.empty()) {
        snprintf(one, sizeof one, "%.4f", ms1);
        snprintf(ratio, sizeof ratio, "%.3f", ms / ms1);
        snprintf(err, sizeof err, "%.2g", max_rel_err(got, ref, o->w.dim));
    }
    fprintf(out->text,
            "# sharded %s S=%d len=%lld ms_median=%.4f ms_1gpu=%s ratio=%s rounds=%d "
            "allreduces=%d comm_bytes=%lld unconverged=%lld rel_err_vs_1gpu=%s out_fnv=%016llx%s\n",
            o->gpus ? "nccl" : "local", S, (long long)len, ms, one, ratio, sr.rounds, sr.allreduces,
            (long long)sr.bytes, (long long)sr.unconverged, err, (unsigned long long)out_fnv(got),
            extra);
    fflush(out->text);
}

/* The sharded plan's steps at c's length beside the one-GPU step `one` (its output still in
 * c->dout), every GPU holding the whole pool. */
int cuda_sharded(ekv_context *ctx, const bench_opts *o, cuda_len *c, const cuda_result *one,
                 const cli_out *out) {
    std::vector<float> ref(o->w.batch * o->w.heads * o->w.dim), got;
    BC(cudaMemcpy(ref.data(), c->dout, ref.size() * sizeof(float), cudaMemcpyDeviceToHost));
    const ekv_cuda_plan_params pp = cuda_plan_params(o, c);
    sharded_run r;
    ekv_cuda_sharded_plan *sp = NULL;
    ekv_cuda_sharded_report sr;
    double ms = 0;
    int rc = sharded_inputs(ctx, o, pp, c, &r);
    if (!rc) rc = sharded_plan_create(ctx, o, pp, r.a, &sp);
    if (!rc) rc = sharded_steps(ctx, sp, o, r.a, c->len, &ms, &sr, &got);
    if (!rc) sharded_line(out, o, r.a.S, c->len, ms, one->ms, sr, got, ref, " pools=whole");
    ekv_cuda_sharded_free(sp);
    sharded_run_free(&r);
    return rc;
}
