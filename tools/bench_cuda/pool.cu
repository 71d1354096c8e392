/*
 * bench --backend cuda, pool building (bench_cuda.cu): the device holds the pages itself (no
 * ekv_cache, which is host memory), so a length's page table is built here, not by
 * wl_setup_create, and its pool, page statistics and their views are a device cache
 * (ekv_cuda_cache); then the append kernel builds the summaries of the filled pages.
 */
#include "bench_cuda.cuh"

void cuda_len_free(cuda_len *c) {
    ekv_cuda_cache_free(c->cache);
    c->cache = NULL;
    cudaFree(c->dindptr);
    cudaFree(c->dindices);
    cudaFree(c->dlpl);
    cudaFree(c->dq);
    cudaFree(c->dout);
    cudaFree(c->ddir);
    cudaFree(c->ditems);
    cudaFree(c->dknew);
    cudaFree(c->dvnew);
    cudaFree(c->dslopes);
}

/* The host CSR page table: sequence b gets len tokens, or (ragged) a length spread evenly
 * from --ragged to len; physical pages in order. */
int cuda_len_geometry(cuda_len *c, const bench_opts *o, int64_t len) {
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
int shard_geometry(const cuda_len &w, const bench_opts *o, int S, int j, cuda_len *c) {
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

/* The device cache of c (ekv_cuda_cache): the options' pool, ranges (with the compact ball),
 * superpage boxes and key codes (methods that read them), on c's device. */
static ekv_cuda_cache_params cuda_cache_params(const cuda_len *c, const bench_opts *o) {
    ekv_cuda_cache_params p = ekv_cuda_cache_default_params();
    p.device = c->device;
    p.num_pages = c->total_pages;
    p.page_size = (int32_t)o->w.page;
    p.num_kv_heads = (int32_t)o->w.kv_heads;
    p.head_dim = (int32_t)o->w.dim;
    p.dtype = o->w.dtype;
    p.layout = EKV_LAYOUT_HND;
    p.range_dtype = wl_range_dtype(&o->w);
    p.compact_ball = 1;
    p.superpage_pages = o->superpage > 0 ? (int32_t)o->superpage : 0;
    p.code_bits = cli_method_codes(o->method) ? (int32_t)o->code_bits : 0;
    return p;
}

/* Every other buffer cuda_len_alloc allocates for c (its sizes, written once for the allocation
 * and the memory check). */
static std::vector<dev_buf> cuda_len_buffers(cuda_len *c, const bench_opts *o) {
    const int64_t B = o->w.batch, H = o->w.heads, D = o->w.dim, P = c->total_pages;
    return {{(void **)&c->dindptr, (B + 1) * (int64_t)sizeof(int64_t)},
            {(void **)&c->dindices, P * (int64_t)sizeof(int32_t)},
            {(void **)&c->dlpl, B * (int64_t)sizeof(int32_t)},
            {&c->dq, B * H * D * (int64_t)sizeof(float)},
            {&c->dout, B * H * D * (int64_t)sizeof(float)},
            {&c->ddir, D * (int64_t)sizeof(float)},
            {(void **)&c->ditems, P * (int64_t)sizeof(ekv_cuda_append_item)}};
}

/* The device bytes of c: its cache (K, V and the statistics) and the other buffers; -1 when
 * the options make no valid cache (cuda_len_alloc says why). */
int64_t cuda_len_bytes(cuda_len *c, const bench_opts *o) {
    const ekv_cuda_cache_params cp = cuda_cache_params(c, o);
    int64_t pool = 0, stats = 0, n = 0;
    if (ekv_cuda_cache_sizes(NULL, &cp, &pool, &stats)) return -1;
    n = 2 * pool + stats;
    for (const dev_buf &b : cuda_len_buffers(c, o)) n += b.bytes;
    return n;
}

/* Free memory of the current device, in bytes (0 if it cannot be read). */
int64_t device_free_bytes(void) {
    size_t fr = 0, total = 0;
    if (cudaMemGetInfo(&fr, &total) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return (int64_t)fr;
}

/* "len L" or "len L shard j/S": who a message is about. */
void cuda_len_name(const cuda_len *c, char *buf, size_t n) {
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

/* c's device cache and buffers on the current device (c->device), the views the library
 * reads, the page table (indices local to this pool: page i of the pool is indices[i] = i). */
int cuda_len_alloc(ekv_context *ctx, cuda_len *c, const bench_opts *o) {
    const int64_t B = o->w.batch,
                  kv_elems = 2 * c->total_pages * o->w.kv_heads * o->w.page * o->w.dim;
    const std::vector<dev_buf> bufs = cuda_len_buffers(c, o);
    const int64_t need = cuda_len_bytes(c, o);
    char who[64];
    cuda_len_name(c, who, sizeof who);
    fprintf(stderr,
            "entmaxkv bench: %s: filling %.2f GB of K/V on GPU %d (%.2f GB with the statistics)\n",
            who, kv_elems * ekv_dtype_size(o->w.dtype) / 1e9, c->device, need / 1e9);
    if (device_room(c, need)) return 1;
    const ekv_cuda_cache_params cp = cuda_cache_params(c, o);
    if (ekv_cuda_cache_create(ctx, &cp, &c->cache) ||
        ekv_cuda_cache_view(c->cache, &c->kv, &c->st)) {
        fprintf(stderr, "entmaxkv bench: %s: %s\n", who, ekv_last_error(ctx));
        return 1;
    }
    for (const dev_buf &b : bufs) BC(cudaMalloc(b.p, (size_t)b.bytes));
    std::vector<int32_t> indices(c->total_pages);
    for (int64_t i = 0; i < c->total_pages; i++) indices[i] = (int32_t)i;
    BC(cudaMemcpy(c->dindptr, c->indptr.data(), (B + 1) * sizeof(int64_t), cudaMemcpyHostToDevice));
    BC(cudaMemcpy(c->dindices, indices.data(), c->total_pages * sizeof(int32_t),
                  cudaMemcpyHostToDevice));
    BC(cudaMemcpy(c->dlpl, c->lpl.data(), B * sizeof(int32_t), cudaMemcpyHostToDevice));
    c->tab = ekv_page_table{(int32_t)B, c->dindptr, c->dindices, c->dlpl};
    return 0;
}

/* Summaries of the filled pages: the prefill build (append with no new tokens); its time. */
int cuda_summaries(ekv_context *ctx, ekv_cuda_plan *plan, cuda_len *c, const bench_opts *o,
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
    ekv_status st = ekv_cuda_cache_append(plan, c->cache, c->ditems, (int32_t)c->total_pages,
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
