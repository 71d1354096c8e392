/*
 * bench --backend cuda, the fill kernels (bench_cuda.cu): a pool's K and V as N(0, 1) values that
 * are a function of each element's place in the whole pool (planted: plus a direction on 1 in
 * 500 keys), the queries, or a trace's rows for the append kernel.
 */
#include "bench_cuda.cuh"
#include <cuda_fp16.h>
#include <cuda_bf16.h>

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
int cuda_len_fill(cuda_len *c, const bench_opts *o) {
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
    /* the cache's pools (the views are const: the library only reads them) */
    if (fill_pages(c, o, const_cast<void *>(c->kv.k), (uint64_t)o->w.seed * 3 + 1,
                   planted ? (const float *)c->ddir : NULL, &pg) ||
        fill_pages(c, o, const_cast<void *>(c->kv.v), (uint64_t)o->w.seed * 3 + 2, NULL, &pg))
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
