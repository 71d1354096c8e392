/*
 * The device cache (include/entmaxkv/cuda.h, docs/architecture.md, "The device cache"): K/V
 * pools and one statistics block laid out once (layout.c), in memory it allocates (create) or
 * the caller's (adopt); appends through the append kernel (append.cu), and truncation as the
 * host cache's (src/cache/truncate.c) by the same kernel: items that add no tokens rebuild a
 * page's statistics from the keys it keeps, or empty it.
 */
#include "layout.h"
#include "../common/launch.cuh"
#include "../common/plan.cuh"
extern "C" {
#include "../../core/internal.h"
}
#include <stdlib.h>
#include <string.h>

struct ekv_cuda_cache {
    ekv_context *ctx;
    ekv_cuda_cache_params p;
    ekv_cuda_cache_layout lay;
    void *k, *v, *stats;
    int owned; /* create's memory, freed with the cache; else the caller's */
    ekv_paged_kv kv;
    ekv_page_stats st;
    ekv_cuda_append_item *items; /* truncate's items on the device, grown as needed */
    int64_t items_cap;
};

extern "C" ekv_status ekv_cuda_check_device(ekv_context *ctx, int32_t device) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        cudaGetLastError();
        return ekv_fail(ctx, EKV_ERR_UNSUPPORTED, "no CUDA device is available");
    }
    if (device < 0 || device >= n)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "device=%d: only %d CUDA device(s)", device,
                        n);
    return EKV_OK;
}

/* A cache header for checked params on a device that is there (no memory yet). */
static ekv_status cache_new(ekv_context *ctx, const ekv_cuda_cache_params *p, ekv_cuda_cache **out,
                            ekv_cuda_cache **c) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!p || !out) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "params and out must not be NULL");
    *out = NULL;
    ekv_cuda_cache_layout lay;
    ekv_status st = ekv_cuda_cache_layout_of(ctx, p, &lay);
    if (!st) st = ekv_cuda_check_device(ctx, p->device);
    if (st) return st;
    *c = (ekv_cuda_cache *)calloc(1, sizeof **c);
    if (!*c) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    (*c)->ctx = ctx;
    (*c)->p = *p;
    (*c)->lay = lay;
    return EKV_OK;
}

/* The views over the cache's memory, taken once. */
static void cache_views(ekv_cuda_cache *c) {
    ekv_cuda_cache_views(&c->p, &c->lay, c->k, c->v, c->stats, &c->kv, &c->st);
}

static ekv_status dev_alloc(ekv_cuda_cache *c, void **p, int64_t bytes, const char *what) {
    const cudaError_t e = cudaMalloc(p, (size_t)bytes);
    if (e == cudaSuccess) return EKV_OK;
    *p = NULL;
    cudaGetLastError();
    size_t fr = 0, total = 0;
    cudaMemGetInfo(&fr, &total);
    return ekv_fail(c->ctx, EKV_ERR_OUT_OF_MEMORY,
                    "device cache: cannot allocate %.3f GiB of device memory for %s on device %d "
                    "(%.3f GiB free): %s",
                    (double)bytes / (1 << 30), what, c->p.device, (double)fr / (1 << 30),
                    cudaGetErrorString(e));
}

extern "C" ekv_status ekv_cuda_cache_create(ekv_context *ctx, const ekv_cuda_cache_params *p,
                                            ekv_cuda_cache **out) {
    ekv_cuda_cache *c = NULL;
    ekv_status st = cache_new(ctx, p, out, &c);
    if (st) return st;
    c->owned = 1;
    cudaError_t e = cudaSetDevice(p->device);
    if (e != cudaSuccess)
        st = ekv_fail(ctx, EKV_ERR_DEVICE, "cudaSetDevice: %s", cudaGetErrorString(e));
    if (!st) st = dev_alloc(c, &c->k, c->lay.pool_bytes, "the K pool");
    if (!st) st = dev_alloc(c, &c->v, c->lay.pool_bytes, "the V pool");
    if (!st) st = dev_alloc(c, &c->stats, c->lay.stats_bytes, "the page statistics");
    /* zeroed (every page counts 0 tokens), and done before any stream of the caller reads it */
    if (!st && ((e = cudaMemset(c->stats, 0, (size_t)c->lay.stats_bytes)) != cudaSuccess ||
                (e = cudaDeviceSynchronize()) != cudaSuccess))
        st = ekv_fail(ctx, EKV_ERR_DEVICE, "device cache: zeroing the statistics: %s",
                      cudaGetErrorString(e));
    if (st) {
        ekv_cuda_cache_free(c);
        return st;
    }
    cache_views(c);
    *out = c;
    ekv_clear_error(ctx);
    return EKV_OK;
}

/* The caller's memory for adopt: device memory of the cache's device, aligned, the three
 * ranges apart. */
static ekv_status check_memory(const ekv_cuda_cache *c, void *const mem[3]) {
    static const char *names[3] = {"k_pool", "v_pool", "stats"};
    const int64_t bytes[3] = {c->lay.pool_bytes, c->lay.pool_bytes, c->lay.stats_bytes};
    const uintptr_t align[3] = {16, 16, EKV_CC_ALIGN};
    for (int i = 0; i < 3; i++) {
        if (!mem[i])
            return ekv_fail(c->ctx, EKV_ERR_NULL_POINTER, "ekv_cuda_cache_adopt: %s is NULL",
                            names[i]);
        if ((uintptr_t)mem[i] % align[i])
            return ekv_fail(c->ctx, EKV_ERR_INVALID_ARGUMENT,
                            "ekv_cuda_cache_adopt: %s must be %d-byte aligned", names[i],
                            (int)align[i]);
        cudaPointerAttributes a;
        if (cudaPointerGetAttributes(&a, mem[i]) != cudaSuccess ||
            (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) ||
            a.device != c->p.device) {
            cudaGetLastError();
            return ekv_fail(c->ctx, EKV_ERR_INVALID_ARGUMENT,
                            "ekv_cuda_cache_adopt: %s is not device memory of device %d", names[i],
                            c->p.device);
        }
        for (int j = 0; j < i; j++) /* an append writes K, V and statistics side by side */
            if ((uintptr_t)mem[i] < (uintptr_t)mem[j] + (uint64_t)bytes[j] &&
                (uintptr_t)mem[j] < (uintptr_t)mem[i] + (uint64_t)bytes[i])
                return ekv_fail(c->ctx, EKV_ERR_INVALID_ARGUMENT,
                                "ekv_cuda_cache_adopt: %s (%lld bytes) and %s (%lld bytes) "
                                "overlap: each needs its own memory",
                                names[j], (long long)bytes[j], names[i], (long long)bytes[i]);
    }
    return EKV_OK;
}

extern "C" ekv_status ekv_cuda_cache_adopt(ekv_context *ctx, const ekv_cuda_cache_params *p,
                                           void *k_pool, void *v_pool, void *stats,
                                           ekv_cuda_cache **out) {
    ekv_cuda_cache *c = NULL;
    ekv_status st = cache_new(ctx, p, out, &c);
    if (st) return st;
    void *const mem[3] = {k_pool, v_pool, stats};
    st = check_memory(c, mem);
    if (st) {
        free(c);
        return st;
    }
    c->k = k_pool;
    c->v = v_pool;
    c->stats = stats;
    cache_views(c);
    *out = c;
    ekv_clear_error(ctx);
    return EKV_OK;
}

extern "C" void ekv_cuda_cache_free(ekv_cuda_cache *c) {
    if (!c) return;
    int cur = 0;
    const int back = cudaGetDevice(&cur) == cudaSuccess && cur != c->p.device;
    if (back) cudaSetDevice(c->p.device); /* the memory's device (its context) */
    if (c->owned) {
        cudaFree(c->k);
        cudaFree(c->v);
        cudaFree(c->stats);
    }
    cudaFree(c->items);
    if (back) cudaSetDevice(cur);
    free(c);
}

extern "C" ekv_status ekv_cuda_cache_view(const ekv_cuda_cache *c, ekv_paged_kv *kv,
                                          ekv_page_stats *stats) {
    if (!c) return EKV_ERR_NULL_POINTER;
    if (!kv && !stats)
        return ekv_fail(c->ctx, EKV_ERR_NULL_POINTER, "ekv_cuda_cache_view: kv and stats are NULL");
    if (kv) *kv = c->kv;
    if (stats) *stats = c->st;
    return EKV_OK;
}

/* The plan a call on the cache launches with runs on the cache's device (ekv_cuda_append
 * checks its shapes against the views). */
static ekv_status check_plan(const ekv_cuda_plan *pl, const ekv_cuda_cache *c, const char *who) {
    if (!c) return ekv_fail(pl->ctx, EKV_ERR_NULL_POINTER, "%s: cache is NULL", who);
    if (pl->p.device != c->p.device)
        return ekv_fail(pl->ctx, EKV_ERR_INVALID_ARGUMENT,
                        "%s: the plan is on device %d, the cache on device %d", who, pl->p.device,
                        c->p.device);
    return EKV_OK;
}

extern "C" ekv_status ekv_cuda_cache_append(ekv_cuda_plan *pl, ekv_cuda_cache *c,
                                            const ekv_cuda_append_item *items, int32_t n_items,
                                            const float *k_new, const float *v_new) {
    if (!pl) return EKV_ERR_NULL_POINTER;
    const ekv_status st = check_plan(pl, c, "ekv_cuda_cache_append");
    return st ? st : ekv_cuda_append(pl, &c->kv, &c->st, items, n_items, k_new, v_new);
}

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* A truncation's arguments, as ekv_cache_truncate's: the sequence's pages (in range, each
 * once) hold `length` tokens, and n_tokens is at most that. */
static ekv_status check_truncate(const ekv_cuda_plan *pl, const ekv_cuda_cache *c,
                                 const int32_t *pages, int64_t n_pages, int64_t length,
                                 int64_t n_tokens) {
    const char *who = "ekv_cuda_cache_truncate";
    ekv_status st = check_plan(pl, c, who);
    if (st) return st;
    const int64_t ps = c->p.page_size;
    if (n_pages < 0 || n_pages > c->p.num_pages || (n_pages && !pages))
        return ekv_fail(pl->ctx, n_pages > 0 ? EKV_ERR_NULL_POINTER : EKV_ERR_INVALID_SIZE,
                        "%s: n_pages=%lld must be in [0, %lld] with pages not NULL", who,
                        (long long)n_pages, (long long)c->p.num_pages);
    if (length < (n_pages ? (n_pages - 1) * ps + 1 : 0) || length > n_pages * ps)
        return ekv_fail(pl->ctx, EKV_ERR_INVALID_SIZE,
                        "%s: length=%lld does not fill %lld pages of %lld tokens (the last one "
                        "in part)",
                        who, (long long)length, (long long)n_pages, (long long)ps);
    if (n_tokens < 0 || n_tokens > length)
        return ekv_fail(pl->ctx, EKV_ERR_INVALID_SIZE,
                        "%s: n_tokens=%lld must be in [0, %lld] (the sequence's length)", who,
                        (long long)n_tokens, (long long)length);
    int32_t *sorted = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n_pages ? n_pages : 1));
    if (!sorted) return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    if (n_pages) memcpy(sorted, pages, sizeof(int32_t) * (size_t)n_pages);
    qsort(sorted, (size_t)n_pages, sizeof(int32_t), cmp_i32);
    for (int64_t i = 0; i < n_pages && !st; i++)
        if (sorted[i] < 0 || sorted[i] >= c->p.num_pages || (i && sorted[i] == sorted[i - 1]))
            st = ekv_fail(pl->ctx, EKV_ERR_INVALID_ARGUMENT, "%s: page %d is %s", who, sorted[i],
                          sorted[i] < 0 || sorted[i] >= c->p.num_pages ? "out of range"
                                                                       : "listed twice");
    free(sorted);
    return st;
}

/* Room for n truncate items on the cache's device. */
static ekv_status grow_items(const ekv_cuda_plan *pl, ekv_cuda_cache *c, int64_t n) {
    if (n <= c->items_cap) return EKV_OK;
    cudaStreamSynchronize(pl->stream); /* the old items may still be read by an earlier launch */
    int cur = 0;
    cudaGetDevice(&cur);
    cudaSetDevice(c->p.device);
    cudaFree(c->items);
    c->items_cap = 0;
    const cudaError_t e = cudaMalloc((void **)&c->items, sizeof(ekv_cuda_append_item) * (size_t)n);
    cudaSetDevice(cur);
    if (e != cudaSuccess) {
        c->items = NULL;
        cudaGetLastError();
        return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY,
                        "ekv_cuda_cache_truncate: no device memory for %lld items: %s",
                        (long long)n, cudaGetErrorString(e));
    }
    c->items_cap = n;
    return EKV_OK;
}

extern "C" ekv_status ekv_cuda_cache_truncate(ekv_cuda_plan *pl, ekv_cuda_cache *c,
                                              const int32_t *pages, int64_t n_pages, int64_t length,
                                              int64_t n_tokens) {
    if (!pl) return EKV_ERR_NULL_POINTER;
    ekv_status st = check_truncate(pl, c, pages, n_pages, length, n_tokens);
    if (st) return st;
    const int64_t ps = c->p.page_size, tail = n_tokens % ps, keep = n_tokens / ps + (tail != 0);
    const int rebuild = tail && n_tokens < length; /* the last kept page loses tokens */
    const int64_t n = n_pages - keep + rebuild;
    if (n == 0) return EKV_OK;
    ekv_cuda_append_item *items = (ekv_cuda_append_item *)malloc(sizeof *items * (size_t)n);
    if (!items) return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    /* no new tokens: the kernel rebuilds each page over its first first_slot keys (none: the
     * page is empty again, count 0, and leaves its superpage's box) */
    int64_t i = 0;
    if (rebuild) items[i++] = ekv_cuda_append_item{pages[keep - 1], (int32_t)tail, 0, 0, 0};
    for (int64_t j = keep; j < n_pages; j++)
        items[i++] = ekv_cuda_append_item{pages[j], 0, 0, 0, 0};
    st = grow_items(pl, c, n);
    if (st) {
        free(items);
        return st;
    }
    /* a copy from pageable memory: the items are staged before the call returns */
    const cudaError_t e = cudaMemcpyAsync(c->items, items, sizeof *items * (size_t)n,
                                          cudaMemcpyHostToDevice, pl->stream);
    free(items);
    if (e != cudaSuccess)
        return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "ekv_cuda_cache_truncate: %s",
                        cudaGetErrorString(e));
    /* k_new/v_new are never read (no item adds a token); any device pointer stands for them */
    const float *none = (const float *)c->items;
    return ekv_cuda_append(pl, &c->kv, &c->st, c->items, (int32_t)n, none, none);
}
