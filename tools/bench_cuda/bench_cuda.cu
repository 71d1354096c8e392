/*
 * entmaxkv bench --backend cuda: times the CUDA decode step on device-resident K/V filled
 * with N(0,1) values (workload random; planted adds a few keys aligned with the query), and
 * reports bytes read, the achieved bandwidth, the device-to-device copy bandwidth measured in
 * the same process (read + write: 2 x bytes copied / time) and the byte-roofline ratio
 * ms / (bytes_read / copy bandwidth). Steps are timed eagerly with CUDA events and also as a
 * replayed CUDA graph. The device holds the pages itself (no ekv_cache, which is host
 * memory), so the K/V layout and page table are built here, not by wl_setup_create. A method
 * that reads key codes (screened) gets them from the append kernel (--code-bits). A
 * trace:FILE workload puts the trace's K and V (one sequence) through the append kernel and
 * takes its first query step and ALiBi slopes; the trace fixes the shapes and the length.
 * --shards N / --gpus N add the sharded plan's step over the same pool (every GPU a copy of
 * it); --shard-pools gives each shard's GPU only its pages (a context larger than one GPU,
 * issue 16), filled with the values the whole pool holds there (fill_kernel). This file
 * parses nothing (tools/bench.c does): it runs the lengths; the parts it calls, one concern a
 * file, are listed in bench_cuda.cuh.
 */
#include "bench_cuda.cuh"

/* Whether the CUDA backend runs this method: the library's own check (exit 2 if not). */
static int cuda_supported(ekv_context *ctx, const bench_opts *o) {
    ekv_decode_params prm;
    ekv_select_params sp;
    cuda_params(o, &prm, &sp);
    if (ekv_decode_supported(ctx, EKV_BACKEND_CUDA, &prm, &sp) == EKV_OK) return 0;
    fprintf(stderr, "entmaxkv bench: --backend cuda --method %s: %s\n", ekv_method_name(o->method),
            ekv_last_error(ctx));
    return CLI_USAGE;
}

/* trace:FILE opens the trace, whose shapes and length replace the options' (one sequence). */
static int cuda_workload(ekv_context *ctx, bench_opts *o, wl_state *wl, int *trace) {
    wl_kind k = WL_RANDOM;
    *trace = !wl_parse(o->w.workload, &k) && k == WL_TRACE;
    if (!*trace) return 0;
    if (wl_open(wl, ctx, o->w.workload, o->w.heads, o->w.kv_heads, o->w.dim, (uint64_t)o->w.seed,
                "bench"))
        return 1;
    o->w.heads = wl->heads;
    o->w.kv_heads = wl->kv_heads;
    o->w.dim = wl->dim;
    o->w.batch = 1;
    o->lens[0] = wl->trace_len;
    o->nlens = 1;
    return 0;
}

extern "C" int cli_bench_cuda(const bench_opts *opts) {
    ekv_context *ctx = NULL;
    int rc = cli_context("bench", 1, EKV_ISA_AUTO, &ctx);
    if (rc) return rc;
    bench_opts ow = *opts;
    const bench_opts *o = &ow;
    wl_state wl;
    memset(&wl, 0, sizeof wl);
    int trace = 0;
    if (cuda_workload(ctx, &ow, &wl, &trace)) {
        ekv_context_free(ctx);
        return 1;
    }
    int32_t ndev = 0;
    ekv_cuda_device_count(ctx, &ndev);
    if (!ndev) {
        fprintf(stderr, "entmaxkv bench: --backend cuda: no CUDA device found\n");
        wl_free(&wl);
        ekv_context_free(ctx);
        return 1;
    }
    rc = cuda_supported(ctx, o);
    cli_out out;
    if (!rc) rc = cli_out_open(&out, "bench", o->w.json);
    if (rc) {
        wl_free(&wl);
        ekv_context_free(ctx);
        return rc;
    }
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    const double bw = copy_bandwidth();
    fprintf(out.text,
            "# backend=cuda device=\"%s\" copy_bw=%.0f GB/s (read+write) method=%s alpha=%g dtype=%s B=%lld H=%lld Hk=%lld D=%lld page=%lld workload=%s%s\n",
            prop.name, bw, ekv_method_name(o->method), o->alpha, ekv_dtype_name(o->w.dtype),
            (long long)o->w.batch, (long long)o->w.heads, (long long)o->w.kv_heads,
            (long long)o->w.dim, (long long)o->w.page, o->w.workload,
            o->ragged_min ? " ragged" : "");
    fprintf(out.text, "%9s %9s %9s %9s %13s %8s %9s %9s %8s %9s\n", "len", "ms_median", "ms_min",
            "ms_graph", "bytes_read", "GB/s", "roofline", "kv_frac", "launches", "support");
    if (out.json) fprintf(out.json, "[\n");
    int json_rows = 0;
    for (int li = 0; li < o->nlens && !rc; li++) {
        if (o->shard_pools) {
            rc = cuda_shard_pools(ctx, o, prop, bw, o->lens[li], &json_rows, &out);
            continue;
        }
        cuda_len c;
        cuda_result r;
        memset(&r, 0, sizeof r);
        c.wl = trace ? &wl : NULL;
        rc = cuda_len_geometry(&c, o, o->lens[li]);
        if (!rc) rc = cuda_len_alloc(ctx, &c, o);
        if (!rc) rc = cuda_len_fill(&c, o);
        if (!rc) rc = cuda_time(ctx, o, &c, &r);
        if (!rc) cuda_report_row(o, prop, bw, json_rows++, &c, &r, &out);
        if (!rc && (o->shards || o->gpus)) rc = cuda_sharded(ctx, o, &c, &r, &out);
        cuda_len_free(&c);
    }
    if (out.json) fprintf(out.json, "\n]\n");
    if (cli_out_close(&out, "bench") && !rc) rc = 1;
    wl_free(&wl);
    ekv_context_free(ctx);
    return rc;
}
