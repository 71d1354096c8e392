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
 * issue 16), filled with the values the whole pool holds there (fill_kernel).
 */
extern "C" {
#include "../cli.h"
#include "../src/core/stats_rules.h" /* the ball bytes the bound reads (one rule) */
}
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include <algorithm>

/* Rows each KV head's list read in the plan's last screened step (src/cuda/screen.cu; not part
 * of the public API): screened reads K of those rows only. */
extern "C" ekv_status ekv_cuda_screen_rows(ekv_cuda_plan *pl, int32_t batch, int64_t *rows);
/* Query heads of that step whose screen list overflowed (the retry pass ran), and whose retry
 * list overflowed too (every token kept). */
extern "C" ekv_status ekv_cuda_screen_overflow(ekv_cuda_plan *pl, int32_t batch, int64_t *out);
/* The screen kernel of that step: 0 generic, 1 fast (CUDA cores), 2 tensor cores. */
extern "C" ekv_status ekv_cuda_screen_kernel(const ekv_cuda_plan *pl, int32_t *kind);

#define BC(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "entmaxkv bench: %s: %s\n", #x, cudaGetErrorString(e_));               \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

static __device__ __forceinline__ float hash_normal(uint64_t i, uint64_t seed) {
    uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    const float u1 = ((x >> 40) + 1) * (1.0f / 16777217.0f),
                u2 = ((x >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
    return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

template <typename T> __device__ T from_f(float x);
template <> __device__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ float from_f<float>(float x) { return x; }

/* x[i] = N(0,1) (+ 3 dir[d] on planted tokens: 1 in 500, K only), a function of the element's
 * index in the whole pool, base + i: a shard's pool (--shard-pools) holds exactly the values
 * the whole pool holds at the same global pages. */
template <typename T>
__global__ void fill_kernel(T *x, int64_t n, int64_t base, uint64_t seed, const float *dir, int D,
                            int64_t row_elems) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t g = base + i;
        float v = hash_normal((uint64_t)g, seed);
        if (dir) {
            const int64_t row = g / row_elems; /* one token of one KV head */
            if (((uint64_t)row * 0x9E3779B97F4A7C15ull >> 33) % 500 == 0) v += 3.f * dir[g % D];
        }
        x[i] = from_f<T>(v);
    }
}
__global__ void fill_f32(float *x, int64_t n, uint64_t seed) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = hash_normal((uint64_t)i, seed);
}

static int fill(void *p, ekv_dtype dt, int64_t n, int64_t base, uint64_t seed, const float *dir,
                int D) {
    const int64_t row = D;
    switch (dt) {
    case EKV_DTYPE_F16:
        fill_kernel<__half><<<4096, 256>>>((__half *)p, n, base, seed, dir, D, row);
        break;
    case EKV_DTYPE_BF16:
        fill_kernel<__nv_bfloat16><<<4096, 256>>>((__nv_bfloat16 *)p, n, base, seed, dir, D, row);
        break;
    default: fill_kernel<float><<<4096, 256>>>((float *)p, n, base, seed, dir, D, row); break;
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
    if (cudaMalloc(&a, n) != cudaSuccess || cudaMalloc(&b, n) != cudaSuccess) {
        cudaFree(a);
        return 0;
    }
    cudaMemset(a, 1, n);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
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
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return 2.0 * (double)n / (median(ts) * 1e-3) / 1e9; /* GB/s, read + write */
}

/* The byte roofline: the ms of reading `bytes` at the copy bandwidth bw (GB/s). */
static double roofline_ms(int64_t bytes, double bw) { return (double)bytes / (bw * 1e9) * 1e3; }

/* Device memory of one length: K/V pages, their statistics, the page table, q and out. */
struct cuda_len {
    int64_t len = 0, total_pages = 0, maxP = 0, total_tokens = 0;
    std::vector<int64_t> lens, indptr;
    std::vector<int64_t> gpage;     /* the whole pool's page holding each sequence's first page */
    int shard = -1, num_shards = 0; /* --shard-pools: this pool is shard `shard`'s, else -1  */
    int device = 0;
    std::vector<int32_t> lpl;
    std::vector<float> dir; /* planted: the direction shared by the query and 1 in 500 keys */
    void *dk = NULL, *dv = NULL, *dq = NULL, *dout = NULL, *ddir = NULL;
    uint8_t *dcodes = NULL; /* key codes (methods that read them)                  */
    wl_state *wl = NULL;    /* trace:FILE, else NULL                               */
    float *dknew = NULL, *dvnew = NULL, *dslopes = NULL; /* trace: fp32 rows; its slopes */
    float *st_buf = NULL;
    uint16_t *range16 = NULL; /* compact kmin/kmax (--ranges f16/bf16), then kmean16 */
    float *radius16 = NULL;   /* the compact ball's radii                              */
    float *sp_box = NULL;     /* superpage boxes (--superpage S > 0): smin, then smax  */
    int32_t *dcount = NULL, *dindices = NULL, *dlpl = NULL;
    int64_t *dindptr = NULL;
    ekv_cuda_append_item *ditems = NULL;
    ekv_paged_kv kv;
    ekv_page_stats st;
    ekv_page_table tab;
};

static void cuda_len_free(cuda_len *c) {
    cudaFree(c->dk);
    cudaFree(c->dv);
    cudaFree(c->st_buf);
    cudaFree(c->dcount);
    cudaFree(c->dindptr);
    cudaFree(c->dindices);
    cudaFree(c->dlpl);
    cudaFree(c->dq);
    cudaFree(c->dout);
    cudaFree(c->ddir);
    cudaFree(c->ditems);
    cudaFree(c->dcodes);
    cudaFree(c->range16);
    cudaFree(c->radius16);
    cudaFree(c->sp_box);
    cudaFree(c->dknew);
    cudaFree(c->dvnew);
    cudaFree(c->dslopes);
}

/* The host CSR page table: sequence b gets len tokens, or (ragged) a length spread evenly
 * from --ragged to len; physical pages in order. */
static int cuda_len_geometry(cuda_len *c, const bench_opts *o, int64_t len) {
    const int64_t B = o->w.batch, ps = o->w.page;
    c->len = len;
    c->lens.resize(B);
    c->indptr.resize(B + 1);
    c->lpl.resize(B);
    for (int64_t b = 0; b < B; b++) {
        c->lens[b] =
                o->ragged_min && B > 1 ? o->ragged_min + (len - o->ragged_min) * b / (B - 1) : len;
        const int64_t P = (c->lens[b] + ps - 1) / ps;
        c->indptr[b] = c->total_pages;
        c->total_pages += P;
        c->maxP = std::max(c->maxP, P);
        c->total_tokens += c->lens[b];
        c->lpl[b] = (int32_t)(c->lens[b] - (P - 1) * ps);
    }
    c->indptr[B] = c->total_pages;
    c->gpage.assign(c->indptr.begin(), c->indptr.end() - 1);
    if (c->total_pages > INT32_MAX) {
        fprintf(stderr, "entmaxkv bench: too many pages\n");
        return 1;
    }
    return 0;
}

/* Shard j of S of the whole geometry w: each sequence's pages [j P / S, (j + 1) P / S)
 * (ekv_shard_pages; docs/architecture.md, "The sharded CUDA plan"), laid out in order in a
 * compact pool of their own; only the last shard holds a partial last page. */
static int shard_geometry(const cuda_len &w, const bench_opts *o, int S, int j, cuda_len *c) {
    const int64_t B = (int64_t)w.lens.size(), page = o->w.page;
    c->len = w.len;
    c->shard = j;
    c->num_shards = S;
    c->lens.resize(B);
    c->indptr.resize(B + 1);
    c->lpl.resize(B);
    c->gpage.resize(B);
    for (int64_t b = 0; b < B; b++) {
        const int64_t P = w.indptr[b + 1] - w.indptr[b];
        int64_t first = 0, count = 0;
        ekv_shard_pages(P, S, j, &first, &count);
        if (count < 1) {
            fprintf(stderr,
                    "entmaxkv bench: len %lld: sequence %lld has %lld pages, fewer than the %d "
                    "shards (each must hold a page of every sequence)\n",
                    (long long)w.len, (long long)b, (long long)P, S);
            return 1;
        }
        const int last = first + count == P;
        c->indptr[b] = c->total_pages;
        c->gpage[b] = w.gpage[b] + first;
        c->lpl[b] = last ? w.lpl[b] : (int32_t)page;
        c->lens[b] = (count - 1) * page + c->lpl[b];
        c->total_pages += count;
        c->maxP = std::max(c->maxP, count);
        c->total_tokens += c->lens[b];
    }
    c->indptr[B] = c->total_pages;
    return 0;
}
/* One device buffer of a length: where its pointer goes, its bytes. */
struct dev_buf {
    void **p;
    int64_t bytes;
};

/* Every buffer cuda_len_alloc allocates for c (its sizes, written once for the allocation and
 * the memory check). */
static std::vector<dev_buf> cuda_len_buffers(cuda_len *c, const bench_opts *o) {
    const int64_t B = o->w.batch, H = o->w.heads, Hk = o->w.kv_heads, D = o->w.dim, ps = o->w.page;
    const int64_t es = ekv_dtype_size(o->w.dtype), pool = c->total_pages * Hk * ps * D;
    const int64_t stat_n = c->total_pages * Hk * D, P = c->total_pages;
    std::vector<dev_buf> v = {{&c->dk, pool * es},
                              {&c->dv, pool * es},
                              {(void **)&c->st_buf, (4 * stat_n + P * Hk) * (int64_t)sizeof(float)},
                              {(void **)&c->dcount, P * (int64_t)sizeof(int32_t)},
                              {(void **)&c->dindptr, (B + 1) * (int64_t)sizeof(int64_t)},
                              {(void **)&c->dindices, P * (int64_t)sizeof(int32_t)},
                              {(void **)&c->dlpl, B * (int64_t)sizeof(int32_t)},
                              {&c->dq, B * H * D * (int64_t)sizeof(float)},
                              {&c->dout, B * H * D * (int64_t)sizeof(float)},
                              {&c->ddir, D * (int64_t)sizeof(float)},
                              {(void **)&c->ditems, P * (int64_t)sizeof(ekv_cuda_append_item)}};
    if (wl_range_dtype(&o->w) != EKV_DTYPE_F32) { /* compact copies, written by the append kernel */
        v.push_back({(void **)&c->range16, 3 * stat_n * (int64_t)sizeof(uint16_t)});
        v.push_back({(void **)&c->radius16, P * Hk * (int64_t)sizeof(float)});
    }
    if (o->superpage > 0) { /* superpage boxes: smin, then smax */
        const int64_t nsp = (P + o->superpage - 1) / o->superpage;
        v.push_back({(void **)&c->sp_box, 2 * nsp * Hk * D * (int64_t)sizeof(float)});
    }
    if (cli_method_codes(o->method)) /* key codes, written by the append kernel */
        v.push_back({(void **)&c->dcodes, P * Hk * ps * ((D * o->code_bits + 7) / 8)});
    return v;
}

static int64_t cuda_len_bytes(cuda_len *c, const bench_opts *o) {
    int64_t n = 0;
    for (const dev_buf &b : cuda_len_buffers(c, o)) n += b.bytes;
    return n;
}

/* Free memory of the current device, in bytes (0 if it cannot be read). */
static int64_t device_free_bytes(void) {
    size_t fr = 0, total = 0;
    if (cudaMemGetInfo(&fr, &total) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return (int64_t)fr;
}

/* "len L" or "len L shard j/S": who a message is about. */
static void cuda_len_name(const cuda_len *c, char *buf, size_t n) {
    if (c->shard < 0)
        snprintf(buf, n, "len %lld", (long long)c->len);
    else
        snprintf(buf, n, "len %lld shard %d/%d", (long long)c->len, c->shard, c->num_shards);
}

/* Whether the current device has `bytes` free; else a message naming both (not a bare CUDA
 * out-of-memory error half-way through the allocations). */
static int device_room(const cuda_len *c, int64_t bytes) {
    const int64_t fr = device_free_bytes();
    if (bytes <= fr) return 0;
    char who[64];
    cuda_len_name(c, who, sizeof who);
    fprintf(stderr,
            "entmaxkv bench: %s: the pool and its statistics need %.2f GB on GPU %d, "
            "which has %.2f GB free\n",
            who, bytes / 1e9, c->device, fr / 1e9);
    return 1;
}

/* c's buffers on the current device (c->device), the views the library reads, the page
 * table (indices local to this pool: page i of the pool is indices[i] = i). */
static int cuda_len_alloc(cuda_len *c, const bench_opts *o) {
    const int64_t B = o->w.batch, Hk = o->w.kv_heads, D = o->w.dim, ps = o->w.page;
    const int64_t es = ekv_dtype_size(o->w.dtype), stride_page = Hk * ps * D;
    const int64_t stat_n = c->total_pages * Hk * D;
    const std::vector<dev_buf> bufs = cuda_len_buffers(c, o);
    const int64_t need = cuda_len_bytes(c, o);
    char who[64];
    cuda_len_name(c, who, sizeof who);
    fprintf(stderr,
            "entmaxkv bench: %s: filling %.2f GB of K/V on GPU %d (%.2f GB with the statistics)\n",
            who, 2.0 * c->total_pages * stride_page * es / 1e9, c->device, need / 1e9);
    if (device_room(c, need)) return 1;
    for (const dev_buf &b : bufs) BC(cudaMalloc(b.p, (size_t)b.bytes));
    std::vector<int32_t> indices(c->total_pages);
    for (int64_t i = 0; i < c->total_pages; i++) indices[i] = (int32_t)i;
    BC(cudaMemcpy(c->dindptr, c->indptr.data(), (B + 1) * sizeof(int64_t), cudaMemcpyHostToDevice));
    BC(cudaMemcpy(c->dindices, indices.data(), c->total_pages * sizeof(int32_t),
                  cudaMemcpyHostToDevice));
    BC(cudaMemcpy(c->dlpl, c->lpl.data(), B * sizeof(int32_t), cudaMemcpyHostToDevice));
    c->kv = ekv_paged_kv{c->dk,      c->dv,          o->w.dtype,  (int32_t)ps, (int32_t)Hk,
                         (int32_t)D, c->total_pages, stride_page, ps * D,      D};
    memset(&c->st, 0, sizeof c->st);
    c->st.kmin = c->st_buf;
    c->st.kmax = c->st_buf + stat_n;
    c->st.kmean = c->st_buf + 2 * stat_n;
    c->st.km2 = c->st_buf + 3 * stat_n;
    c->st.radius = c->st_buf + 4 * stat_n;
    c->st.range_dtype = wl_range_dtype(&o->w);
    if (c->range16) {
        c->st.kmin16 = c->range16;
        c->st.kmax16 = c->range16 + stat_n;
        c->st.kmean16 = c->range16 + 2 * stat_n; /* the compact ball (docs/math.md §9.5) */
        c->st.radius16 = c->radius16;
    }
    c->st.count = c->dcount;
    c->st.num_pages = c->total_pages; /* the pool the statistics cover, checked against kv */
    c->st.num_kv_heads = (int32_t)Hk;
    c->st.head_dim = (int32_t)D;
    c->st.page_size = (int32_t)ps;
    if (c->sp_box) { /* written by the append kernel; certified skips against them */
        const int64_t S = o->superpage, nsp = (c->total_pages + S - 1) / S, n = nsp * Hk * D;
        c->st.smin = c->sp_box;
        c->st.smax = c->sp_box + n;
        c->st.superpage_pages = (int32_t)S;
        c->st.num_superpages = nsp;
    }
    if (c->dcodes) {
        c->st.codes = c->dcodes;
        c->st.code_bits = o->code_bits;
    }
    c->tab = ekv_page_table{(int32_t)B, c->dindptr, c->dindices, c->dlpl};
    return 0;
}

/* A trace tensor [N][Hk][D] (F32/F16/BF16) as fp32 on the device. */
static int trace_upload(const ekv_tensor_info *t, int64_t n, float **dst) {
    std::vector<float> h(n);
    const unsigned char *src = (const unsigned char *)t->data;
    for (int64_t i = 0; i < n; i++) {
        uint16_t bits = 0;
        if (t->dtype != EKV_DTYPE_F32) memcpy(&bits, src + 2 * i, 2);
        if (t->dtype == EKV_DTYPE_F16) {
            __half_raw r;
            r.x = bits;
            h[i] = __half2float(__half(r));
        } else if (t->dtype == EKV_DTYPE_BF16) {
            const uint32_t u = (uint32_t)bits << 16;
            memcpy(&h[i], &u, 4);
        } else
            memcpy(&h[i], src + 4 * i, 4);
    }
    BC(cudaMalloc((void **)dst, n * sizeof(float)));
    BC(cudaMemcpy(*dst, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    return 0;
}

/* trace:FILE: the rows the append kernel writes into the pages, the first query step, the
 * slopes. */
static int cuda_trace_fill(cuda_len *c, const bench_opts *o) {
    const int64_t rows = c->len * o->w.kv_heads * o->w.dim, qn = o->w.heads * o->w.dim;
    if (trace_upload(&c->wl->tk, rows, &c->dknew) || trace_upload(&c->wl->tv, rows, &c->dvnew))
        return 1;
    std::vector<float> q(qn);
    cli_rng rng;
    cli_rng_seed(&rng, (uint64_t)o->w.seed);
    wl_queries(c->wl, &rng, q.data(), 1);
    BC(cudaMemcpy(c->dq, q.data(), qn * sizeof(float), cudaMemcpyHostToDevice));
    if (wl_slopes(c->wl)) {
        BC(cudaMalloc((void **)&c->dslopes, o->w.heads * sizeof(float)));
        BC(cudaMemcpy(c->dslopes, wl_slopes(c->wl), o->w.heads * sizeof(float),
                      cudaMemcpyHostToDevice));
    }
    return 0;
}

/* Progress of a fill: lines on stderr every tenth of a pool over 8 GB (a 10M-token context's
 * shard is ~80 GB). */
struct fill_progress {
    const cuda_len *c;
    int64_t done = 0, total = 0;
    int tenths = 0;
    void advance(int64_t bytes) {
        done += bytes;
        if (total < ((int64_t)8 << 30) || done * 10 < (tenths + 1) * total) return;
        cudaDeviceSynchronize(); /* the line says what the device has written */
        tenths = (int)(done * 10 / total);
        char who[64];
        cuda_len_name(c, who, sizeof who);
        fprintf(stderr, "entmaxkv bench: %s: K/V filled %.2f of %.2f GB\n", who, done / 1e9,
                total / 1e9);
    }
};

/* K or V of c's pages, each page holding what page gpage of the whole pool holds: runs of
 * pages consecutive in both pools are one launch, in chunks of at most 2^30 elements. */
static int fill_pages(const cuda_len *c, const bench_opts *o, void *x, uint64_t seed,
                      const float *dir, fill_progress *pg) {
    const int64_t page_elems = o->w.kv_heads * o->w.page * o->w.dim, B = (int64_t)c->lens.size();
    const int64_t es = ekv_dtype_size(o->w.dtype), chunk = (int64_t)1 << 30;
    for (int64_t b = 0; b < B;) {
        int64_t e = b + 1; /* sequences b .. e - 1 are consecutive in the whole pool too */
        while (e < B && c->gpage[e] == c->gpage[b] + (c->indptr[e] - c->indptr[b])) e++;
        const int64_t n = (c->indptr[e] - c->indptr[b]) * page_elems;
        for (int64_t i = 0; i < n; i += chunk) {
            const int64_t m = std::min(chunk, n - i), at = c->indptr[b] * page_elems + i;
            if (fill((char *)x + at * es, o->w.dtype, m, c->gpage[b] * page_elems + i, seed, dir,
                     (int)o->w.dim))
                return 1;
            pg->advance(m * es);
        }
        b = e;
    }
    return 0;
}

/* K, V and q: N(0, 1); planted adds the shared direction to 1 in 500 keys and to every query.
 * The values are those of the whole pool at the pages' global positions (fill_kernel). */
static int cuda_len_fill(cuda_len *c, const bench_opts *o) {
    if (c->wl) return cuda_trace_fill(c, o);
    const int64_t D = o->w.dim, qn = o->w.batch * o->w.heads * D;
    const int planted = !strcmp(o->w.workload, "planted");
    cli_rng rng;
    cli_rng_seed(&rng, (uint64_t)o->w.seed);
    double nrm = 0;
    c->dir.resize(D);
    for (int64_t d = 0; d < D; d++) {
        c->dir[d] = (float)cli_rng_normal(&rng);
        nrm += c->dir[d] * c->dir[d];
    }
    for (int64_t d = 0; d < D; d++)
        c->dir[d] = (float)(c->dir[d] / sqrt(nrm) * sqrt((double)D) * 0.5);
    BC(cudaMemcpy(c->ddir, c->dir.data(), D * sizeof(float), cudaMemcpyHostToDevice));
    fill_progress pg;
    pg.c = c;
    pg.total = 2 * c->total_pages * o->w.kv_heads * o->w.page * D * ekv_dtype_size(o->w.dtype);
    if (fill_pages(c, o, c->dk, (uint64_t)o->w.seed * 3 + 1,
                   planted ? (const float *)c->ddir : NULL, &pg) ||
        fill_pages(c, o, c->dv, (uint64_t)o->w.seed * 3 + 2, NULL, &pg))
        return 1;
    fill_f32<<<256, 256>>>((float *)c->dq, qn, (uint64_t)o->w.seed * 3 + 3);
    if (planted) { /* every head's query leans towards the planted keys: q += dir */
        std::vector<float> hq(qn);
        BC(cudaMemcpy(hq.data(), c->dq, hq.size() * sizeof(float), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < hq.size(); i++) hq[i] += c->dir[i % D];
        BC(cudaMemcpy(c->dq, hq.data(), hq.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    /* before any plan's stream reads them (the local transport's is non-blocking) */
    BC(cudaDeviceSynchronize());
    return 0;
}

/* Summaries of the filled pages: the prefill build (append with no new tokens); its time. */
static int cuda_summaries(ekv_context *ctx, ekv_cuda_plan *plan, cuda_len *c, const bench_opts *o,
                          float *build_ms) {
    std::vector<ekv_cuda_append_item> items(c->total_pages);
    for (int64_t b = 0; b < o->w.batch; b++)
        for (int64_t p = c->indptr[b]; p < c->indptr[b + 1]; p++) {
            const int32_t n = p + 1 == c->indptr[b + 1] ? c->lpl[b] : (int32_t)o->w.page;
            /* a trace's tokens are new (rows of k_new/v_new); synthetic pages are filled */
            items[p] = c->wl ? ekv_cuda_append_item{(int32_t)p, 0, n, 0,
                                                    (p - c->indptr[b]) * o->w.page}
                             : ekv_cuda_append_item{(int32_t)p, n, 0, 0, 0};
        }
    BC(cudaMemcpy(c->ditems, items.data(), c->total_pages * sizeof(ekv_cuda_append_item),
                  cudaMemcpyHostToDevice));
    cudaEvent_t a0, a1;
    cudaEventCreate(&a0);
    cudaEventCreate(&a1);
    cudaEventRecord(a0, 0);
    ekv_status st = ekv_cuda_append(plan, &c->kv, &c->st, c->ditems, (int32_t)c->total_pages,
                                    c->wl ? c->dknew : (const float *)c->dq,
                                    c->wl ? c->dvnew : (const float *)c->dq);
    if (st) fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx));
    cudaDeviceSynchronize();
    cudaEventRecord(a1, 0);
    cudaEventSynchronize(a1);
    cudaEventElapsedTime(build_ms, a0, a1);
    cudaEventDestroy(a0);
    cudaEventDestroy(a1);
    BC(cudaGetLastError());
    return st ? 1 : 0;
}

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

/* What one length measured, for the table and the JSON. */
struct cuda_result {
    double ms, msmin, g_ms, sup_mean;
    float build_ms;
    int64_t kbytes, vbytes, summary, scores, round2, budget, iters;
    int64_t screen_over[2]; /* heads that retried, and that kept every token */
    int32_t screen_kind;    /* the screen kernel (ekv_cuda_screen_kernel) */
    ekv_cuda_report rep;
};

/* Bytes: K of the listed tokens, V rows read, summaries read by the bound, and the score
 * traffic (written once; entmax reads it once for the candidates, two-pass softmax twice:
 * log-sum-exp and values; one-pass softmax keeps no scores). The summary bytes per page follow the
 * kernels of each stage (src/cuda). */
static void cuda_bytes(const bench_opts *o, const cuda_len *c, const std::vector<int32_t> &r1,
                       const std::vector<int32_t> &r2, const std::vector<int64_t> &vrows,
                       const std::vector<int64_t> &srows, cuda_result *r) {
    const int64_t Hk = o->w.kv_heads, D = o->w.dim, es = ekv_dtype_size(o->w.dtype);
    const int listed = o->method != EKV_SELECT_DENSE, cert = o->method == EKV_SELECT_CERTIFIED;
    const int64_t rb = ekv_dtype_size(wl_range_dtype(&o->w)); /* the ranges as stored */
    const int64_t ball = ekv_ball_bytes(&c->st, D); /* centre and radius, as the bound reads them */
    const int64_t per_page = 2 * D * rb + (cert ? ball : o->method == EKV_SELECT_GAUSSIAN ? 4 : 0);
    int64_t ktok = 0, vrow = 0;
    r->round2 = 0;
    for (int64_t l = 0; l < o->w.batch * Hk; l++) {
        const int64_t b = l / Hk, P = c->indptr[b + 1] - c->indptr[b];
        const int64_t pages = listed ? r1[l] + r2[l] : P;
        /* screened reads K of its rows only (src/cuda/screen.cu) */
        ktok += o->method == EKV_SELECT_SCREENED ? srows[l]
                                                 : std::min(pages * o->w.page, c->lens[b]);
        vrow += vrows[l];
        r->round2 += r2[l];
    }
    r->summary = 0;
    const int screened = o->method == EKV_SELECT_SCREENED;
    /* screened: every page's range and codes (the candidates and row lists are small) */
    const int64_t screen_page = 2 * D * rb + o->w.page * ((D * o->code_bits + 7) / 8);
    if (listed)
        for (int64_t b = 0; b < o->w.batch; b++)
            r->summary += screened ? (c->indptr[b + 1] - c->indptr[b]) * Hk * screen_page
                                   : (c->indptr[b + 1] - c->indptr[b] - 1) * Hk * per_page;
    /* superpages: the summaries the bound skipped, the boxes it read instead, and certified's
     * round 0 (the last 4 pages' K, docs/math.md §9.6) */
    r->summary += r->rep.superpage_boxes * 2 * D * 4 - r->rep.superpage_skipped * per_page;
    if (cert && c->st.smin)
        for (int64_t b = 0; b < o->w.batch; b++)
            ktok += Hk * std::min<int64_t>(4 * o->w.page, c->lens[b]);
    r->kbytes = ktok * D * es;
    r->vbytes = vrow * D * es;
    r->scores = r->rep.softmax_one_pass
                        ? 0
                        : (o->alpha == 1.0 ? 3 : 2) * (ktok * (o->w.heads / Hk)) * 4;
}

/* The plan's report of its last step (support, V rows, the pages of each round) and the bytes
 * it read (cuda_bytes) over c's pages. */
static int cuda_read_bytes(ekv_context *ctx, ekv_cuda_plan *plan, const bench_opts *o,
                           const cuda_len *c, cuda_result *r) {
    const int64_t BH = o->w.batch * o->w.heads, BHk = o->w.batch * o->w.kv_heads;
    std::vector<double> tau(BH);
    std::vector<int64_t> sup(BH), vrows(BHk);
    std::vector<int32_t> r1(BHk), r2(BHk);
    std::vector<int64_t> srows(BHk);
    memset(&r->rep, 0, sizeof r->rep);
    r->rep.tau = tau.data();
    r->rep.support = sup.data();
    r->rep.v_rows = vrows.data();
    r->rep.pages_round1 = r1.data();
    r->rep.pages_round2 = r2.data();
    if (ekv_cuda_read_report(plan, (int32_t)o->w.batch, &r->rep) ||
        ekv_cuda_screen_rows(plan, (int32_t)o->w.batch, srows.data()) ||
        ekv_cuda_screen_overflow(plan, (int32_t)o->w.batch, r->screen_over) ||
        ekv_cuda_screen_kernel(plan, &r->screen_kind)) {
        fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx));
        return 1;
    }
    r->rep.tau = NULL;
    r->rep.support = NULL;
    r->rep.v_rows = NULL; /* the vectors die here */
    r->rep.pages_round1 = r->rep.pages_round2 = NULL;
    r->sup_mean = 0;
    for (int64_t i = 0; i < BH; i++) r->sup_mean += (double)sup[i] / (double)BH;
    cuda_bytes(o, c, r1, r2, vrows, srows, r);
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

/* bytes_read of a step: K, V, summaries and score traffic (cuda_bytes). */
static int64_t cuda_result_bytes(const cuda_result *r) {
    return r->kbytes + r->vbytes + r->summary + r->scores;
}

/* K + V bytes of c's sequences (kv_frac's denominator). */
static int64_t kv_bytes(const bench_opts *o, const cuda_len *c) {
    return 2 * c->total_tokens * o->w.kv_heads * o->w.dim * ekv_dtype_size(o->w.dtype);
}

/* The table row of one length, and its JSON object (after json_rows others). */
static void cuda_report_row(const bench_opts *o, const cudaDeviceProp &prop, double bw,
                            int json_rows, const cuda_len *c, const cuda_result *r,
                            const cli_out *out) {
    const int64_t Hk = o->w.kv_heads, D = o->w.dim;
    const int64_t bytes = cuda_result_bytes(r);
    const double best = r->g_ms > 0 ? std::min(r->ms, r->g_ms) : r->ms;
    const double gbps = bytes / (best * 1e-3) / 1e9;
    const double roof = best / roofline_ms(bytes, bw);
    const double kvfrac = (double)bytes / (double)kv_bytes(o, c);
    if (o->method == EKV_SELECT_SCREENED)
        fprintf(stderr,
                "entmaxkv bench: len %lld: screen survivors %.3f%% of (token, head) pairs\n",
                (long long)c->len,
                100.0 * (double)r->rep.survivors / (double)(c->total_tokens * o->w.heads));
    if (o->method == EKV_SELECT_SCREENED) {
        static const char *kinds[] = {"generic (CUDA cores)", "fast (CUDA cores)", "tensor cores"};
        fprintf(stderr, "entmaxkv bench: len %lld: screen kernel: %s\n", (long long)c->len,
                r->screen_kind >= 0 && r->screen_kind < 3 ? kinds[r->screen_kind] : "none");
    }
    if (o->method == EKV_SELECT_SCREENED && r->screen_over[0])
        fprintf(stderr,
                "entmaxkv bench: len %lld: %lld query heads overflowed the screen lists (retry pass), %lld of them kept every token\n",
                (long long)c->len, (long long)r->screen_over[0], (long long)r->screen_over[1]);
    if (r->rep.slow_rows || r->rep.compacted_rows)
        fprintf(stderr,
                "entmaxkv bench: query heads whose tau candidates overflowed the list: %lld "
                "compacted (rebuilt from the scores above a bound), %lld over the whole row\n",
                (long long)r->rep.compacted_rows, (long long)r->rep.slow_rows);
    fprintf(out->text, "%9lld %9.4f %9.4f %9.4f %13lld %8.0f %9.2f %9.4f %8d %9.1f\n",
            (long long)c->len, r->ms, r->msmin, r->g_ms, (long long)bytes, gbps, roof, kvfrac,
            r->rep.launches, r->sup_mean);
    fflush(out->text);
    if (!out->json) return;
    fprintf(out->json,
            "%s  {\"backend\":\"cuda\",\"device\":\"%s\",\"method\":\"%s\",\"alpha\":%g,\"len\":%lld,\"batch\":%lld,"
            "\"ragged_min\":%lld,\"total_tokens\":%lld,\"heads\":%lld,\"kv_heads\":%lld,\"dim\":%lld,\"page\":%lld,"
            "\"dtype\":\"%s\",\"workload\":\"%s\",\"budget_tokens\":%lld,\"ms_median\":%.5f,\"ms_min\":%.5f,"
            "\"ms_graph_median\":%.5f,\"bytes_read\":%lld,\"bytes_k\":%lld,\"bytes_v\":%lld,"
            "\"bytes_summary\":%lld,\"bytes_scores\":%lld,\"gbps\":%.1f,\"copy_bw_gbps\":%.1f,"
            "\"roofline_ratio\":%.3f,\"kv_fraction\":%.5f,\"launches\":%d,\"support_mean\":%.2f,"
            "\"pages_round2\":%lld,\"lists_round2\":%lld,\"slow_rows\":%lld,\"compacted_rows\":%lld,\"summary_build_ms\":%.3f,\"iters\":%lld,"
            "\"code_bits\":%d,\"survivors\":%lld,\"ranges\":\"%s\",\"tensor_cores\":%d,"
            "\"superpage\":%lld,\"superpage_skipped\":%lld}",
            json_rows ? ",\n" : "", prop.name, ekv_method_name(o->method), o->alpha,
            (long long)c->len, (long long)o->w.batch, (long long)o->ragged_min,
            (long long)c->total_tokens, (long long)o->w.heads, (long long)Hk, (long long)D,
            (long long)o->w.page, ekv_dtype_name(o->w.dtype), o->w.workload, (long long)r->budget,
            r->ms, r->msmin, r->g_ms, (long long)bytes, (long long)r->kbytes, (long long)r->vbytes,
            (long long)r->summary, (long long)r->scores, gbps, bw, roof, kvfrac, r->rep.launches,
            r->sup_mean, (long long)r->round2, (long long)r->rep.lists_round2,
            (long long)r->rep.slow_rows, (long long)r->rep.compacted_rows, r->build_ms, (long long)r->iters,
            cli_method_codes(o->method) ? o->code_bits : 0, (long long)r->rep.survivors,
            ekv_dtype_name(wl_range_dtype(&o->w)), o->tensor_cores, (long long)o->superpage,
            (long long)r->rep.superpage_skipped);
}

/* The decode parameters of a run (the budget is set per length). */
static void cuda_params(const bench_opts *o, ekv_decode_params *prm, ekv_select_params *sp) {
    *prm = ekv_decode_default_params();
    prm->num_heads = (int32_t)o->w.heads;
    prm->alpha = o->alpha;
    *sp = ekv_select_default_params();
    sp->method = o->method;
    sp->budget_tokens = 1;
}

/* The plan of a run: the options' shapes, c's longest sequence. */
static ekv_cuda_plan_params cuda_plan_params(const bench_opts *o, const cuda_len *c) {
    ekv_cuda_plan_params pp = ekv_cuda_plan_default_params();
    pp.max_batch = (int32_t)o->w.batch;
    pp.num_heads = (int32_t)o->w.heads;
    pp.num_kv_heads = (int32_t)o->w.kv_heads;
    pp.head_dim = (int32_t)o->w.dim;
    pp.page_size = (int32_t)o->w.page;
    pp.max_pages_per_seq = c->maxP;
    pp.tensor_cores = o->tensor_cores;
    return pp;
}

/* The timed steps of one length on a filled device cache. */
static int cuda_time(ekv_context *ctx, const bench_opts *o, cuda_len *c, cuda_result *r) {
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

/* ---- --shards N / --gpus N: the sharded plan (docs/architecture.md, "The sharded CUDA plan") */
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

/* The shards and GPUs of the options: --gpus N puts shard j on GPU j, --shards N all on 0. */
static void shard_args_init(const bench_opts *o, shard_args *a) {
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
    int rc = cuda_len_geometry(c, o, len) || cuda_len_alloc(c, o) || cuda_len_fill(c, o);
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
static int sharded_plan_create(ekv_context *ctx, const bench_opts *o,
                               const ekv_cuda_plan_params &pp, const shard_args &a,
                               ekv_cuda_sharded_plan **sp) {
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
static int sharded_steps(ekv_context *ctx, ekv_cuda_sharded_plan *sp, const bench_opts *o,
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
static void sharded_line(const cli_out *out, const bench_opts *o, int S, int64_t len, double ms,
                         double ms1, const ekv_cuda_sharded_report &sr,
                         const std::vector<float> &got, const std::vector<float> &ref,
                         const char *extra) {
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
static int cuda_sharded(ekv_context *ctx, const bench_opts *o, cuda_len *c, const cuda_result *one,
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

/* ---- --shard-pools: each shard's GPU holds only its pages (issue 16: a context that does not
 * fit one GPU; docs/architecture.md, "The sharded CUDA plan") */
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
    int rc = cuda_len_alloc(&c, o) || cuda_len_fill(&c, o) || cuda_time(ctx, o, &c, &r);
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
    if (cuda_len_alloc(c, o) || cuda_len_fill(c, o) ||
        cuda_summaries(ctx, ekv_cuda_sharded_shard(sp, j), c, o, &build_ms))
        return 1;
    char who[64];
    cuda_len_name(c, who, sizeof who);
    fprintf(stderr, "entmaxkv bench: %s: summaries built in %.1f ms\n", who, build_ms);
    return 0;
}

/* Each shard's bytes read in the last step: its plan's report, cuda_bytes over its pool. Its
 * V rows are the plan's count: without the group-union values, the tau kernel counts the
 * support at the shard's own tau (src/cuda/attend_tau.cu), a lower bound of the agreed tau
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
static int cuda_shard_pools(ekv_context *ctx, const bench_opts *o, const cudaDeviceProp &prop,
                            double bw, int64_t len, int *json_rows, const cli_out *out) {
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
        if (!rc) rc = cuda_len_alloc(&c, o);
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
