/*
 * bench --backend cuda, --shard-pools (bench_cuda.cu): each shard's GPU holds only its pages
 * (issue 16: a context that does not fit one GPU; docs/architecture.md, "The sharded CUDA
 * plan").
 */
#include "bench_cuda.cuh"

/* Room the one-GPU reference leaves beside its pool for its two plans (eager, graph). */
static const int64_t REFERENCE_PLAN_ROOM = (int64_t)4 << 30;

/* The one-GPU step over the whole pool, run when its buffers and REFERENCE_PLAN_ROOM fit in
 * GPU 0's free memory (the line says which, and why): its table row and output (ref, empty
 * when skipped). It is freed before the shard pools are filled. */
static int shard_pools_reference(ekv_context *ctx, const bench_opts *o, const cudaDeviceProp &prop,
                                 double bw, int64_t len, int *json_rows, const cli_out *out,
                                 std::vector<float> *ref, double *ms1) {
    cuda_len c;
    cuda_result r;
    memset(&r, 0, sizeof r);
    BC(cudaSetDevice(0));
    if (cuda_len_geometry(&c, o, len)) return 1;
    const int64_t need = cuda_len_bytes(&c, o) + REFERENCE_PLAN_ROOM, fr = device_free_bytes();
    const int run = need <= fr;
    fprintf(out->text,
            "# shard-pools len=%lld: one-GPU reference %s: the whole pool and its plans need "
            "%.2f GB, GPU 0 has %.2f GB free\n",
            (long long)len, run ? "run" : "skipped (no ms_1gpu, no rel_err_vs_1gpu)", need / 1e9,
            fr / 1e9);
    fflush(out->text);
    if (!run) return 0;
    int rc = cuda_len_alloc(ctx, &c, o) || cuda_len_fill(&c, o) || cuda_time(ctx, o, &c, &r);
    if (!rc) {
        cuda_report_row(o, prop, bw, (*json_rows)++, &c, &r, out);
        ref->resize(o->w.batch * o->w.heads * o->w.dim);
        *ms1 = r.ms;
        if (cudaMemcpy(ref->data(), c.dout, ref->size() * sizeof(float), cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
            fprintf(stderr, "entmaxkv bench: copying the one-GPU output failed\n");
            rc = 1;
        }
    }
    cuda_len_free(&c);
    return rc;
}

/* Shard j's pool on its GPU: only its pages (shard_geometry), filled from their global
 * positions, summaries built by the shard's own plan. */
static int shard_pool_fill(ekv_context *ctx, const bench_opts *o, ekv_cuda_sharded_plan *sp, int j,
                           cuda_len *c) {
    BC(cudaSetDevice(c->device));
    float build_ms = 0;
    if (cuda_len_alloc(ctx, c, o) || cuda_len_fill(c, o) ||
        cuda_summaries(ctx, ekv_cuda_sharded_shard(sp, j), c, o, &build_ms))
        return 1;
    char who[64];
    cuda_len_name(c, who, sizeof who);
    fprintf(stderr, "entmaxkv bench: %s: summaries built in %.1f ms\n", who, build_ms);
    return 0;
}

/* Each shard's bytes read in the last step: its plan's report, cuda_bytes over its pool. Its
 * V rows are the plan's count: without the group-union values, the tau kernel counts the
 * support at the shard's own tau (src/cuda/stages/tau.cu), a lower bound of the agreed tau
 * (docs/math.md §11), so at least the rows the agreed step read. */
static int shard_pools_bytes(ekv_context *ctx, const bench_opts *o, ekv_cuda_sharded_plan *sp,
                             const std::vector<cuda_len> &pools, std::vector<int64_t> *bytes) {
    for (size_t j = 0; j < pools.size(); j++) {
        cuda_result r;
        memset(&r, 0, sizeof r);
        BC(cudaSetDevice(pools[j].device));
        if (cuda_read_bytes(ctx, ekv_cuda_sharded_shard(sp, (int32_t)j), o, &pools[j], &r))
            return 1;
        bytes->push_back(cuda_result_bytes(&r));
    }
    BC(cudaSetDevice(0));
    return 0;
}

/* The step's byte roofline: the GPUs of --gpus read their shards at once (the slowest one
 * counts), the one GPU of --shards reads them in turn (they add). */
static double step_roofline_ms(const bench_opts *o, const std::vector<int64_t> &bytes, double bw) {
    double roof = 0;
    for (int64_t b : bytes)
        roof = o->gpus ? std::max(roof, roofline_ms(b, bw)) : roof + roofline_ms(b, bw);
    return roof;
}

/* "# shard" lines: each shard's GPU, pages, tokens, K + V bytes held, bytes read, roofline. */
static void shard_lines(const cli_out *out, const bench_opts *o, const std::vector<cuda_len> &pools,
                        const std::vector<int64_t> &bytes, double bw) {
    for (size_t j = 0; j < pools.size(); j++)
        fprintf(out->text,
                "# shard %d gpu=%d pages=%lld tokens=%lld kv_bytes=%lld bytes_read=%lld "
                "roofline_ms=%.4f\n",
                (int)j, pools[j].device, (long long)pools[j].total_pages,
                (long long)pools[j].total_tokens, (long long)kv_bytes(o, &pools[j]),
                (long long)bytes[j], roofline_ms(bytes[j], bw));
    fflush(out->text);
}

static void shard_pools_free(std::vector<cuda_len> &pools) {
    for (cuda_len &c : pools) {
        cudaSetDevice(c.device);
        cuda_len_free(&c);
    }
    cudaSetDevice(0);
}

/* One length with --shard-pools: the reference if it fits, the shards' own pools (each GPU
 * allocating and filling only its pages), the timed sharded steps and their rooflines. */
int cuda_shard_pools(ekv_context *ctx, const bench_opts *o, const cudaDeviceProp &prop, double bw,
                     int64_t len, int *json_rows, const cli_out *out) {
    std::vector<float> ref, got;
    double ms1 = 0, ms = 0;
    int rc = shard_pools_reference(ctx, o, prop, bw, len, json_rows, out, &ref, &ms1);
    cuda_len whole;
    shard_args a;
    shard_args_init(o, &a);
    std::vector<cuda_len> pools(a.S);
    if (!rc) rc = cuda_len_geometry(&whole, o, len);
    ekv_cuda_plan_params pp = cuda_plan_params(o, &whole);
    pp.max_pages_per_seq = 0; /* each shard's plan: its own capacity */
    for (int j = 0; j < a.S && !rc; j++) {
        rc = shard_geometry(whole, o, a.S, j, &pools[j]);
        pools[j].device = a.dev[j];
        pp.max_pages_per_seq = std::max(pp.max_pages_per_seq, pools[j].maxP);
    }
    ekv_cuda_sharded_plan *sp = NULL;
    if (!rc) rc = sharded_plan_create(ctx, o, pp, a, &sp);
    for (int j = 0; j < a.S && !rc; j++) {
        rc = shard_pool_fill(ctx, o, sp, j, &pools[j]);
        a.tv.push_back(pools[j].tab);
        a.kv.push_back(pools[j].kv);
        a.st.push_back(pools[j].st);
        a.q.push_back((const float *)pools[j].dq);
        a.out.push_back((float *)pools[j].dout);
    }
    ekv_cuda_sharded_report sr;
    std::vector<int64_t> bytes;
    if (!rc) rc = sharded_steps(ctx, sp, o, a, len, &ms, &sr, &got);
    if (!rc) rc = shard_pools_bytes(ctx, o, sp, pools, &bytes);
    if (!rc) {
        const double roof = step_roofline_ms(o, bytes, bw);
        char extra[96];
        snprintf(extra, sizeof extra, " pools=shard roofline_ms=%.4f roofline_ratio=%.3f", roof,
                 ms / roof);
        sharded_line(out, o, a.S, len, ms, ms1, sr, got, ref, extra);
        shard_lines(out, o, pools, bytes, bw);
    }
    ekv_cuda_sharded_free(sp);
    shard_pools_free(pools);
    return rc;
}
