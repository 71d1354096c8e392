/*
 * entmaxkv bench --backend cuda: times the CUDA decode step on device-resident K/V filled
 * with N(0,1) values (workload random; planted adds a few keys aligned with the query), and
 * reports bytes read, the achieved bandwidth, the device-to-device copy bandwidth measured in
 * the same process (read + write, as bench/peer_gpu.py measures it) and the byte-roofline
 * ratio ms / (bytes_read / copy bandwidth). Steps are timed eagerly with CUDA events and
 * also as a replayed CUDA graph.
 */
extern "C" {
#include "cli.h"
}
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include <algorithm>

#define BC(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "entmaxkv bench: %s: %s\n", #x, cudaGetErrorString(e_));              \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

static __device__ __forceinline__ float hash_normal(uint64_t i, uint64_t seed) {
    uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
    x ^= x >> 31; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 27; x *= 0x94D049BB133111EBull; x ^= x >> 31;
    const float u1 = ((x >> 40) + 1) * (1.0f / 16777217.0f), u2 = ((x >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
    return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

template <typename T> __device__ T from_f(float x);
template <> __device__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ float from_f<float>(float x) { return x; }

/* x[i] = N(0,1) (+ 3 dir[d] on planted tokens: 1 in 500, K only) */
template <typename T>
__global__ void fill_kernel(T *x, int64_t n, uint64_t seed, const float *dir, int D, int64_t row_elems) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = hash_normal((uint64_t)i, seed);
        if (dir) {
            const int64_t row = i / row_elems; /* one token of one KV head */
            if (((uint64_t)row * 0x9E3779B97F4A7C15ull >> 33) % 500 == 0) v += 3.f * dir[i % D];
        }
        x[i] = from_f<T>(v);
    }
}
__global__ void fill_f32(float *x, int64_t n, uint64_t seed) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = hash_normal((uint64_t)i, seed);
}

static int fill(void *p, ekv_dtype dt, int64_t n, uint64_t seed, const float *dir, int D) {
    const int64_t row = D;
    switch (dt) {
    case EKV_DTYPE_F16: fill_kernel<__half><<<4096, 256>>>((__half *)p, n, seed, dir, D, row); break;
    case EKV_DTYPE_BF16: fill_kernel<__nv_bfloat16><<<4096, 256>>>((__nv_bfloat16 *)p, n, seed, dir, D, row); break;
    default: fill_kernel<float><<<4096, 256>>>((float *)p, n, seed, dir, D, row); break;
    }
    BC(cudaGetLastError());
    return 0;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
}

static double copy_bandwidth(void) {
    const size_t n = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    if (cudaMalloc(&a, n) != cudaSuccess || cudaMalloc(&b, n) != cudaSuccess) { cudaFree(a); return 0; }
    cudaMemset(a, 1, n);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0); cudaEventCreate(&e1);
    std::vector<double> ts;
    for (int i = 0; i < 13; i++) {
        cudaEventRecord(e0);
        cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        if (i >= 3) ts.push_back(ms);
    }
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    cudaFree(a); cudaFree(b);
    return 2.0 * (double)n / (median(ts) * 1e-3) / 1e9; /* GB/s, read + write */
}

extern "C" int cli_bench_cuda(const cuda_bench_opts *o) {
    ekv_context_params cpar = ekv_context_default_params();
    cpar.n_threads = 1;
    ekv_context *ctx = NULL;
    if (ekv_context_create(&cpar, &ctx)) { fprintf(stderr, "entmaxkv bench: cannot create a context\n"); return 1; }
    int32_t ndev = 0;
    ekv_cuda_device_count(ctx, &ndev);
    if (!ndev) { fprintf(stderr, "entmaxkv bench: --backend cuda: no CUDA device found\n"); ekv_context_free(ctx); return 1; }
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    const double bw = copy_bandwidth();
    const int planted = !strcmp(o->workload, "planted");
    const int certified = !strcmp(o->method, "certified"), gauss = !strcmp(o->method, "gaussian");
    const int topk = !strcmp(o->method, "topk") || gauss; /* a page list, one round */
    const int64_t B = o->batch, H = o->heads, Hk = o->kv_heads, D = o->dim, ps = o->page;
    const int64_t es = ekv_dtype_size(o->dtype);
    printf("# backend=cuda device=\"%s\" copy_bw=%.0f GB/s (read+write) method=%s alpha=%g dtype=%s B=%lld H=%lld Hk=%lld D=%lld page=%lld workload=%s%s\n",
           prop.name, bw, o->method, o->alpha, ekv_dtype_name(o->dtype), (long long)B, (long long)H, (long long)Hk,
           (long long)D, (long long)ps, o->workload, o->ragged_min ? " ragged" : "");
    printf("%9s %9s %9s %9s %13s %8s %9s %9s %8s %9s\n", "len", "ms_median", "ms_min", "ms_graph", "bytes_read", "GB/s",
           "roofline", "kv_frac", "launches", "support");
    FILE *jf = NULL;
    if (o->json) {
        jf = fopen(o->json, "w");
        if (!jf) { fprintf(stderr, "entmaxkv bench: cannot write %s\n", o->json); ekv_context_free(ctx); return 1; }
        fprintf(jf, "[\n");
    }
    int rc = 0;
    for (int li = 0; li < o->nlens && !rc; li++) {
        const int64_t len = o->lens[li];
        std::vector<int64_t> lens(B), indptr(B + 1);
        std::vector<int32_t> lpl(B);
        int64_t total_pages = 0, maxP = 0, total_tokens = 0;
        for (int64_t b = 0; b < B; b++) {
            lens[b] = o->ragged_min && B > 1 ? o->ragged_min + (len - o->ragged_min) * b / (B - 1) : len;
            const int64_t P = (lens[b] + ps - 1) / ps;
            indptr[b] = total_pages;
            total_pages += P;
            maxP = std::max(maxP, P);
            total_tokens += lens[b];
            lpl[b] = (int32_t)(lens[b] - (P - 1) * ps);
        }
        indptr[B] = total_pages;
        if (total_pages > INT32_MAX) { fprintf(stderr, "entmaxkv bench: too many pages\n"); rc = 1; break; }
        std::vector<int32_t> indices(total_pages);
        for (int64_t i = 0; i < total_pages; i++) indices[i] = (int32_t)i;
        const int64_t stride_page = Hk * ps * D, pool = total_pages * stride_page;
        void *dk = NULL, *dv = NULL, *dq = NULL, *dout = NULL, *ddir = NULL;
        float *st_buf = NULL;
        int32_t *dcount = NULL;
        int64_t *dindptr = NULL;
        int32_t *dindices = NULL, *dlpl = NULL;
        ekv_cuda_append_item *ditems = NULL;
        fprintf(stderr, "entmaxkv bench: len %lld: filling %.2f GB of K/V on the device\n", (long long)len,
                2.0 * pool * es / 1e9);
        BC(cudaMalloc(&dk, pool * es));
        BC(cudaMalloc(&dv, pool * es));
        const int64_t stat_n = total_pages * Hk * D;
        BC(cudaMalloc((void **)&st_buf, (4 * stat_n + total_pages * Hk) * sizeof(float)));
        BC(cudaMalloc((void **)&dcount, total_pages * sizeof(int32_t)));
        BC(cudaMalloc((void **)&dindptr, (B + 1) * sizeof(int64_t)));
        BC(cudaMalloc((void **)&dindices, total_pages * sizeof(int32_t)));
        BC(cudaMalloc((void **)&dlpl, B * sizeof(int32_t)));
        BC(cudaMalloc(&dq, B * H * D * sizeof(float)));
        BC(cudaMalloc(&dout, B * H * D * sizeof(float)));
        BC(cudaMalloc(&ddir, D * sizeof(float)));
        BC(cudaMalloc((void **)&ditems, total_pages * sizeof(ekv_cuda_append_item)));
        /* planted: a direction shared by the query and 1 in 500 keys */
        std::vector<float> dir(D);
        cli_rng rng;
        cli_rng_seed(&rng, (uint64_t)o->seed);
        double nrm = 0;
        for (int64_t d = 0; d < D; d++) { dir[d] = (float)cli_rng_normal(&rng); nrm += dir[d] * dir[d]; }
        for (int64_t d = 0; d < D; d++) dir[d] = (float)(dir[d] / sqrt(nrm) * sqrt((double)D) * 0.5);
        BC(cudaMemcpy(ddir, dir.data(), D * sizeof(float), cudaMemcpyHostToDevice));
        if (fill(dk, o->dtype, pool, (uint64_t)o->seed * 3 + 1, planted ? (const float *)ddir : NULL, (int)D)) { rc = 1; break; }
        if (fill(dv, o->dtype, pool, (uint64_t)o->seed * 3 + 2, NULL, (int)D)) { rc = 1; break; }
        fill_f32<<<256, 256>>>((float *)dq, B * H * D, (uint64_t)o->seed * 3 + 3);
        if (planted) { /* every head's query leans towards the planted keys: q += dir */
            std::vector<float> hq(B * H * D);
            BC(cudaMemcpy(hq.data(), dq, hq.size() * sizeof(float), cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < hq.size(); i++) hq[i] += dir[i % D];
            BC(cudaMemcpy(dq, hq.data(), hq.size() * sizeof(float), cudaMemcpyHostToDevice));
        }
        BC(cudaMemcpy(dindptr, indptr.data(), (B + 1) * sizeof(int64_t), cudaMemcpyHostToDevice));
        BC(cudaMemcpy(dindices, indices.data(), total_pages * sizeof(int32_t), cudaMemcpyHostToDevice));
        BC(cudaMemcpy(dlpl, lpl.data(), B * sizeof(int32_t), cudaMemcpyHostToDevice));
        ekv_paged_kv kv = {dk, dv, o->dtype, (int32_t)ps, (int32_t)Hk, (int32_t)D, total_pages, stride_page, ps * D, D};
        ekv_page_stats st;
        memset(&st, 0, sizeof st);
        st.kmin = st_buf; st.kmax = st_buf + stat_n; st.kmean = st_buf + 2 * stat_n; st.km2 = st_buf + 3 * stat_n;
        st.radius = st_buf + 4 * stat_n; st.count = dcount;
        ekv_page_table tab = {(int32_t)B, dindptr, dindices, dlpl};
        ekv_cuda_plan_params pp = ekv_cuda_plan_default_params();
        pp.max_batch = (int32_t)B; pp.num_heads = (int32_t)H; pp.num_kv_heads = (int32_t)Hk; pp.head_dim = (int32_t)D;
        pp.page_size = (int32_t)ps; pp.max_pages_per_seq = maxP;
        ekv_cuda_plan *plan = NULL;
        if (ekv_cuda_plan_create(ctx, &pp, &plan)) { fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx)); rc = 1; goto next; }
        {
            /* summaries of the filled pages: the prefill build (append with no new tokens) */
            std::vector<ekv_cuda_append_item> items(total_pages);
            for (int64_t b = 0; b < B; b++)
                for (int64_t p = indptr[b]; p < indptr[b + 1]; p++)
                    items[p] = ekv_cuda_append_item{(int32_t)p, p + 1 == indptr[b + 1] ? lpl[b] : (int32_t)ps, 0, 0, 0};
            BC(cudaMemcpy(ditems, items.data(), total_pages * sizeof(ekv_cuda_append_item), cudaMemcpyHostToDevice));
            cudaEvent_t a0, a1;
            cudaEventCreate(&a0); cudaEventCreate(&a1);
            cudaEventRecord(a0, 0);
            if (ekv_cuda_append(plan, &kv, &st, ditems, (int32_t)total_pages, (const float *)dq, (const float *)dq)) {
                fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx)); rc = 1; goto next;
            }
            BC(cudaDeviceSynchronize());
            cudaEventRecord(a1, 0);
            cudaEventSynchronize(a1);
            float build_ms = 0;
            cudaEventElapsedTime(&build_ms, a0, a1);
            cudaEventDestroy(a0); cudaEventDestroy(a1);
            ekv_decode_params prm = ekv_decode_default_params();
            prm.num_heads = (int32_t)H;
            prm.alpha = o->alpha;
            ekv_select_params sp = ekv_select_default_params();
            sp.method = gauss ? EKV_SELECT_GAUSSIAN : topk || certified ? EKV_SELECT_TOPK : EKV_SELECT_DENSE;
            const int64_t budget = o->budget_tokens ? o->budget_tokens : (int64_t)floor(o->budget * (double)len);
            sp.budget_tokens = budget;
            auto step = [&]() -> ekv_status {
                return certified ? ekv_cuda_decode_certified(plan, &prm, &sp, &kv, &st, &tab, (const float *)dq, (float *)dout)
                                 : ekv_cuda_decode(plan, &prm, &sp, &kv, &st, &tab, (const float *)dq, (float *)dout);
            };
            cudaEvent_t e0, e1;
            cudaEventCreate(&e0); cudaEventCreate(&e1);
            for (int64_t i = 0; i < o->warmup; i++)
                if (step()) { fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx)); rc = 1; goto next; }
            std::vector<double> ts, tg;
            ekv_cuda_report rep;
            memset(&rep, 0, sizeof rep);
            if (ekv_cuda_read_report(plan, (int32_t)B, &rep)) { rc = 1; goto next; }
            /* eager: wall clock from a drained device to the step's end, launches included */
            for (int64_t i = 0; i < o->iters; i++) {
                BC(cudaDeviceSynchronize());
                const double t0 = cli_now_seconds();
                if (step()) { rc = 1; goto next; }
                BC(cudaDeviceSynchronize());
                ts.push_back((cli_now_seconds() - t0) * 1e3);
            }
            /* graph: capture the step on a stream of our own (a second plan shares nothing) */
            double g_ms = 0;
            {
                cudaStream_t gs;
                BC(cudaStreamCreateWithFlags(&gs, cudaStreamNonBlocking));
                ekv_cuda_plan_params gp = pp;
                gp.stream = gs;
                ekv_cuda_plan *gplan = NULL;
                if (ekv_cuda_plan_create(ctx, &gp, &gplan) == EKV_OK) {
                    cudaGraph_t g;
                    cudaGraphExec_t ge;
                    BC(cudaStreamBeginCapture(gs, cudaStreamCaptureModeThreadLocal));
                    ekv_status ss = certified ? ekv_cuda_decode_certified(gplan, &prm, &sp, &kv, &st, &tab, (const float *)dq, (float *)dout)
                                              : ekv_cuda_decode(gplan, &prm, &sp, &kv, &st, &tab, (const float *)dq, (float *)dout);
                    BC(cudaStreamEndCapture(gs, &g));
                    if (!ss && cudaGraphInstantiate(&ge, g, 0) == cudaSuccess) {
                        for (int i = 0; i < 5; i++) cudaGraphLaunch(ge, gs);
                        BC(cudaStreamSynchronize(gs));
                        for (int64_t i = 0; i < o->iters; i++) {
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
                cudaStreamDestroy(gs);
                g_ms = median(tg);
            }
            cudaEventDestroy(e0); cudaEventDestroy(e1);
            std::vector<double> tau(B * H);
            std::vector<int64_t> sup(B * H), vrows(B * Hk);
            std::vector<int32_t> r1(B * Hk), r2(B * Hk);
            rep.tau = tau.data(); rep.support = sup.data(); rep.v_rows = vrows.data();
            rep.pages_round1 = r1.data(); rep.pages_round2 = r2.data();
            if (step() || ekv_cuda_read_report(plan, (int32_t)B, &rep)) { fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx)); rc = 1; goto next; }
            /* bytes: K of the listed tokens, V rows read, summaries read by the bound, and the
             * score traffic (written once; entmax reads it once for the candidates, softmax twice:
             * log-sum-exp and values) */
            int64_t ktok = 0, vrow = 0, round2 = 0;
            double sup_mean = 0;
            for (int64_t l = 0; l < B * Hk; l++) {
                const int64_t b = l / Hk, P = indptr[b + 1] - indptr[b];
                const int64_t pages = (topk || certified) ? r1[l] + r2[l] : P;
                ktok += std::min(pages * ps, lens[b]);
                vrow += vrows[l];
                round2 += r2[l];
            }
            for (int64_t i = 0; i < B * H; i++) sup_mean += (double)sup[i] / (double)(B * H);
            int64_t summary = 0;
            if (topk || certified)
                for (int64_t b = 0; b < B; b++)
                    summary += (indptr[b + 1] - indptr[b] - 1) * Hk * (D * 4 * (certified ? 3 : 2) + (certified ? 4 : gauss ? 4 : 0));
            const int64_t kbytes = ktok * D * es, vbytes = vrow * D * es;
            const int64_t scores = (o->alpha == 1.0 ? 3 : 2) * (ktok * (H / Hk)) * 4;
            if (rep.slow_rows)
                fprintf(stderr, "entmaxkv bench: %lld query heads overflowed the tau candidate lists (whole-row path)\n",
                        (long long)rep.slow_rows);
            const int64_t bytes = kbytes + vbytes + summary + scores;
            const double ms = median(ts), msmin = *std::min_element(ts.begin(), ts.end());
            const double best = g_ms > 0 ? std::min(ms, g_ms) : ms;
            const double gbps = bytes / (best * 1e-3) / 1e9;
            const double roof = best / (bytes / (bw * 1e9) * 1e3);
            const double kvfrac = (double)bytes / (double)(2 * total_tokens * Hk * D * es);
            printf("%9lld %9.4f %9.4f %9.4f %13lld %8.0f %9.2f %9.4f %8d %9.1f\n", (long long)len, ms, msmin, g_ms,
                   (long long)bytes, gbps, roof, kvfrac, rep.launches, sup_mean);
            if (jf)
                fprintf(jf,
                        "%s  {\"backend\":\"cuda\",\"device\":\"%s\",\"method\":\"%s\",\"alpha\":%g,\"len\":%lld,\"batch\":%lld,"
                        "\"ragged_min\":%lld,\"total_tokens\":%lld,\"heads\":%lld,\"kv_heads\":%lld,\"dim\":%lld,\"page\":%lld,"
                        "\"dtype\":\"%s\",\"workload\":\"%s\",\"budget_tokens\":%lld,\"ms_median\":%.5f,\"ms_min\":%.5f,"
                        "\"ms_graph_median\":%.5f,\"bytes_read\":%lld,\"bytes_k\":%lld,\"bytes_v\":%lld,"
                        "\"bytes_summary\":%lld,\"bytes_scores\":%lld,\"gbps\":%.1f,\"copy_bw_gbps\":%.1f,"
                        "\"roofline_ratio\":%.3f,\"kv_fraction\":%.5f,\"launches\":%d,\"support_mean\":%.2f,"
                        "\"pages_round2\":%lld,\"lists_round2\":%lld,\"slow_rows\":%lld,\"summary_build_ms\":%.3f,\"iters\":%lld}",
                        li ? ",\n" : "", prop.name, o->method, o->alpha, (long long)len, (long long)B, (long long)o->ragged_min,
                        (long long)total_tokens, (long long)H, (long long)Hk, (long long)D, (long long)ps,
                        ekv_dtype_name(o->dtype), o->workload, (long long)((topk || certified) ? budget : 0), ms, msmin,
                        g_ms, (long long)bytes, (long long)kbytes, (long long)vbytes, (long long)summary,
                        (long long)scores, gbps, bw, roof, kvfrac, rep.launches, sup_mean, (long long)round2,
                        (long long)rep.lists_round2, (long long)rep.slow_rows, build_ms, (long long)o->iters);
            fflush(stdout);
        }
    next:
        ekv_cuda_plan_free(plan);
        cudaFree(dk); cudaFree(dv); cudaFree(st_buf); cudaFree(dcount); cudaFree(dindptr); cudaFree(dindices);
        cudaFree(dlpl); cudaFree(dq); cudaFree(dout); cudaFree(ddir); cudaFree(ditems);
    }
    if (jf) { fprintf(jf, "\n]\n"); fclose(jf); }
    ekv_context_free(ctx);
    return rc;
}
