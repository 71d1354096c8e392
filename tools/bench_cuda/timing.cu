/*
 * bench --backend cuda, timing (bench_cuda.cu): one length's plan, its steps timed eagerly
 * (wall clock, launches included) and as a replayed CUDA graph, then one more step measured.
 */
#include "bench_cuda.cuh"

/* Eager steps: wall clock from a drained device to the step's end, launches included (ms). */
static int time_eager(ekv_context *ctx, ekv_cuda_plan *plan, const cuda_step &step, int64_t iters,
                      std::vector<double> &ts) {
    for (int64_t i = 0; i < iters; i++) {
        BC(cudaDeviceSynchronize());
        const double t0 = cli_now_seconds();
        if (step.run(plan)) {
            fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx));
            return 1;
        }
        BC(cudaDeviceSynchronize());
        ts.push_back((cli_now_seconds() - t0) * 1e3);
    }
    return 0;
}

/* The step captured as a CUDA graph on a stream and plan of its own, replayed: median ms
 * (0 when capture is not possible). */
static int time_graph(ekv_context *ctx, const ekv_cuda_plan_params &pp, const cuda_step &step,
                      int64_t iters, double *g_ms) {
    std::vector<double> tg;
    cudaStream_t gs;
    BC(cudaStreamCreateWithFlags(&gs, cudaStreamNonBlocking));
    ekv_cuda_plan_params gp = pp;
    gp.stream = gs;
    ekv_cuda_plan *gplan = NULL;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    if (ekv_cuda_plan_create(ctx, &gp, &gplan) == EKV_OK) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        BC(cudaStreamBeginCapture(gs, cudaStreamCaptureModeThreadLocal));
        ekv_status ss = step.run(gplan);
        BC(cudaStreamEndCapture(gs, &g));
        if (!ss && cudaGraphInstantiate(&ge, g, 0) == cudaSuccess) {
            for (int i = 0; i < 5; i++) cudaGraphLaunch(ge, gs);
            BC(cudaStreamSynchronize(gs));
            for (int64_t i = 0; i < iters; i++) {
                BC(cudaEventRecord(e0, gs));
                BC(cudaGraphLaunch(ge, gs));
                BC(cudaEventRecord(e1, gs));
                BC(cudaEventSynchronize(e1));
                float ms = 0;
                cudaEventElapsedTime(&ms, e0, e1);
                tg.push_back(ms);
            }
            cudaGraphExecDestroy(ge);
        }
        cudaGraphDestroy(g);
        ekv_cuda_plan_free(gplan);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(gs);
    *g_ms = median(tg);
    return 0;
}

/* One more step, then its report and bytes. */
static int cuda_measure(ekv_context *ctx, ekv_cuda_plan *plan, const cuda_step &step,
                        const bench_opts *o, const cuda_len *c, cuda_result *r) {
    if (step.run(plan)) {
        fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx));
        return 1;
    }
    return cuda_read_bytes(ctx, plan, o, c, r);
}

/* The decode parameters of a run (the budget is set per length). */
void cuda_params(const bench_opts *o, ekv_decode_params *prm, ekv_select_params *sp) {
    *prm = ekv_decode_default_params();
    prm->num_heads = (int32_t)o->w.heads;
    prm->alpha = o->alpha;
    *sp = ekv_select_default_params();
    sp->method = o->method;
    sp->budget_tokens = 1;
}

/* The plan of a run: the options' shapes, c's longest sequence. */
ekv_cuda_plan_params cuda_plan_params(const bench_opts *o, const cuda_len *c) {
    ekv_cuda_plan_params pp = ekv_cuda_plan_default_params();
    pp.max_batch = (int32_t)o->w.batch;
    pp.num_heads = (int32_t)o->w.heads;
    pp.num_kv_heads = (int32_t)o->w.kv_heads;
    pp.head_dim = (int32_t)o->w.dim;
    pp.page_size = (int32_t)o->w.page;
    pp.max_pages_per_seq = c->maxP;
    pp.tensor_cores = o->tensor_cores;
    pp.fused_attend = o->fused_attend;
    pp.overlap_launches = o->overlap_launches;
    pp.select_part_pages = o->select_part_pages;
    pp.tau_cluster = o->tau_cluster;
    pp.tau_spread_min = o->tau_spread_min;
    return pp;
}

/* The timed steps of one length on a filled device cache. */
int cuda_time(ekv_context *ctx, const bench_opts *o, cuda_len *c, cuda_result *r) {
    const ekv_cuda_plan_params pp = cuda_plan_params(o, c);
    ekv_cuda_plan *plan = NULL;
    if (ekv_cuda_plan_create(ctx, &pp, &plan)) {
        fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx));
        return 1;
    }
    cuda_step step;
    cuda_params(o, &step.prm, &step.sp);
    step.prm.alibi_slopes = c->dslopes; /* a trace's, or none */
    step.c = c;
    r->budget = o->budget_tokens ? o->budget_tokens : (int64_t)floor(o->budget * (double)c->len);
    step.sp.budget_tokens = r->budget;
    if (o->method == EKV_SELECT_DENSE) r->budget = 0; /* the JSON's "no budget" */
    /* the GPU protocol: the median of at least 50 steps after at least 5 */
    const int64_t iters = std::max<int64_t>(o->iters, 50), warmup = std::max<int64_t>(o->warmup, 5);
    r->iters = iters;
    std::vector<double> ts;
    ekv_cuda_report clear;
    memset(&clear, 0, sizeof clear);
    int rc = cuda_summaries(ctx, plan, c, o, &r->build_ms);
    for (int64_t i = 0; !rc && i < warmup; i++)
        if (step.run(plan)) {
            fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx));
            rc = 1;
        }
    if (!rc)
        rc = ekv_cuda_read_report(plan, (int32_t)o->w.batch, &clear) ? 1
                                                                     : 0; /* counters from here */
    if (!rc) rc = time_eager(ctx, plan, step, iters, ts);
    if (!rc) rc = time_graph(ctx, pp, step, iters, &r->g_ms);
    if (!rc) rc = cuda_measure(ctx, plan, step, o, c, r);
    if (!rc) {
        r->ms = median(ts);
        r->msmin = *std::min_element(ts.begin(), ts.end());
    }
    ekv_cuda_plan_free(plan);
    return rc;
}
