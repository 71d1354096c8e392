/*
 * What the files of bench --backend cuda share (tools/bench_cuda/; the harness is described in
 * bench_cuda.cu): the device pool of one length, a timed step, its result, the sharded step's
 * inputs, and each file's entry points. Host C++ for nvcc, over the public API.
 *   bench_cuda.cu   cli_bench_cuda: the options, the header lines, a row per length
 *   fill.cu         the fill kernels: K, V and q of a pool (or a trace's rows)
 *   probe.cu        the device-to-device copy bandwidth and the byte roofline
 *   pool.cu         a length's geometry and device buffers, its summaries (the append kernel)
 *   timing.cu       the plan, eager and graph-replayed steps
 *   report.cu       the bytes a step read, the table row and the JSON
 *   sharded.cu      --shards N / --gpus N over copies of the whole pool
 *   shard_pools.cu  --shard-pools: each shard's GPU holds only its pages
 */
#pragma once
extern "C" {
#include "../cli.h"
}
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include <algorithm>

#define BC(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "entmaxkv bench: %s: %s\n", #x, cudaGetErrorString(e_));               \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* The median of v (0 when empty). */
static inline double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
}

/* Device memory of one length: its device cache (K/V pages, their statistics), the page table,
 * q and out. */
struct cuda_len {
    int64_t len = 0, total_pages = 0, maxP = 0, total_tokens = 0;
    std::vector<int64_t> lens, indptr;
    std::vector<int64_t> gpage;     /* the whole pool's page holding each sequence's first page */
    int shard = -1, num_shards = 0; /* --shard-pools: this pool is shard `shard`'s, else -1  */
    int device = 0;
    std::vector<int32_t> lpl;
    std::vector<float> dir; /* planted: the direction shared by the query and 1 in 500 keys */
    void *dq = NULL, *dout = NULL, *ddir = NULL;
    wl_state *wl = NULL;                                 /* trace:FILE, else NULL */
    float *dknew = NULL, *dvnew = NULL, *dslopes = NULL; /* trace: fp32 rows; its slopes */
    ekv_cuda_cache *cache = NULL; /* pool, statistics (--ranges, --superpage), key codes */
    int32_t *dindices = NULL, *dlpl = NULL;
    int64_t *dindptr = NULL;
    ekv_cuda_append_item *ditems = NULL;
    ekv_paged_kv kv; /* the cache's views */
    ekv_page_stats st;
    ekv_page_table tab;
};

/* The step of every method: ekv_cuda_decode picks its stages (certified included). */
struct cuda_step {
    ekv_decode_params prm;
    ekv_select_params sp;
    const cuda_len *c;
    ekv_status run(ekv_cuda_plan *plan) const {
        return ekv_cuda_decode(plan, &prm, &sp, &c->kv, &c->st, &c->tab, (const float *)c->dq,
                               (float *)c->dout);
    }
};

/* What one length measured, for the table and the JSON. */
struct cuda_result {
    double ms, msmin, g_ms, sup_mean;
    float build_ms;
    int64_t kbytes, vbytes, summary, scores, round2, budget, iters;
    int64_t screen_over[2]; /* heads that retried, and that kept every token */
    int64_t screen_dropped; /* pages the screen's page box dropped unread (their codes) */
    int32_t screen_kind;    /* the screen kernel (ekv_cuda_screen_kernel) */
    ekv_cuda_report rep;
};

/* What the sharded step takes, one entry per shard, and the GPUs it runs on. */
struct shard_args {
    int S = 0, ngpu = 0;
    std::vector<ekv_page_table> tv;
    std::vector<ekv_paged_kv> kv;
    std::vector<ekv_page_stats> st;
    std::vector<const float *> q;
    std::vector<float *> out;
    std::vector<int32_t> dev;
};

/* fill.cu: K, V and q of c (N(0, 1), planted, or the trace's rows), as cuda_len_fill says. */
int cuda_len_fill(cuda_len *c, const bench_opts *o);

/* probe.cu: the device-to-device copy bandwidth (GB/s, read + write), and the ms of reading
 * `bytes` at bandwidth bw. */
double copy_bandwidth(void);
double roofline_ms(int64_t bytes, double bw);

/* pool.cu: a length's host geometry (the whole pool, or shard j of S of it), its device bytes,
 * buffers and views, the summaries of its filled pages, and who a message is about. */
int cuda_len_geometry(cuda_len *c, const bench_opts *o, int64_t len);
int shard_geometry(const cuda_len &w, const bench_opts *o, int S, int j, cuda_len *c);
int64_t cuda_len_bytes(cuda_len *c, const bench_opts *o);
int64_t device_free_bytes(void);
int cuda_len_alloc(ekv_context *ctx, cuda_len *c, const bench_opts *o);
void cuda_len_free(cuda_len *c);
int cuda_summaries(ekv_context *ctx, ekv_cuda_plan *plan, cuda_len *c, const bench_opts *o,
                   float *build_ms);
void cuda_len_name(const cuda_len *c, char *buf, size_t n);

/* timing.cu: the decode and plan parameters of a run, and the timed steps of one length. */
void cuda_params(const bench_opts *o, ekv_decode_params *prm, ekv_select_params *sp);
ekv_cuda_plan_params cuda_plan_params(const bench_opts *o, const cuda_len *c);
int cuda_time(ekv_context *ctx, const bench_opts *o, cuda_len *c, cuda_result *r);

/* report.cu: the plan's report of its last step and the bytes it read, a step's bytes_read,
 * the K + V bytes of c, and the table row (with its JSON object) of one length. */
int cuda_read_bytes(ekv_context *ctx, ekv_cuda_plan *plan, const bench_opts *o, const cuda_len *c,
                    cuda_result *r);
int64_t cuda_result_bytes(const cuda_result *r);
int64_t kv_bytes(const bench_opts *o, const cuda_len *c);
void cuda_report_row(const bench_opts *o, const cudaDeviceProp &prop, double bw, int json_rows,
                     const cuda_len *c, const cuda_result *r, const cli_out *out);

/* sharded.cu: the shards and GPUs of the options, the sharded plan, its timed steps, the
 * "# sharded" line, and the whole-pool sharded bench of one length. */
void shard_args_init(const bench_opts *o, shard_args *a);
int sharded_plan_create(ekv_context *ctx, const bench_opts *o, const ekv_cuda_plan_params &pp,
                        const shard_args &a, ekv_cuda_sharded_plan **sp);
int sharded_steps(ekv_context *ctx, ekv_cuda_sharded_plan *sp, const bench_opts *o,
                  const shard_args &a, int64_t len, double *ms, ekv_cuda_sharded_report *sr,
                  std::vector<float> *got);
void sharded_line(const cli_out *out, const bench_opts *o, int S, int64_t len, double ms,
                  double ms1, const ekv_cuda_sharded_report &sr, const std::vector<float> &got,
                  const std::vector<float> &ref, const char *extra);
int cuda_sharded(ekv_context *ctx, const bench_opts *o, cuda_len *c, const cuda_result *one,
                 const cli_out *out);

/* shard_pools.cu: one length with --shard-pools. */
int cuda_shard_pools(ekv_context *ctx, const bench_opts *o, const cudaDeviceProp &prop, double bw,
                     int64_t len, int *json_rows, const cli_out *out);
