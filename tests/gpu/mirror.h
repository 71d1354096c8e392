/*
 * The GPU tests' device copies of CPU caches (test_cuda.c, test_cuda_sharded.c): cudaMalloc'd
 * copies of a cache's pool, statistics, key codes and superpage boxes and of a batch's page
 * table, on the current device. CU() exits on a CUDA error (a test's setup, not the library).
 */
#ifndef EKV_TEST_GPU_MIRROR_H
#define EKV_TEST_GPU_MIRROR_H
#include "entmaxkv.h"
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CU(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static void *dev_copy(const void *h, size_t n) {
    void *d = NULL;
    CU(cudaMalloc(&d, n ? n : 16));
    if (n && h) CU(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
    /* a pageable copy may still be in flight when cudaMemcpy returns: a caller's non-blocking
     * stream (the graph tests') is not ordered after it */
    CU(cudaDeviceSynchronize());
    return d;
}

/* a device mirror of a CPU cache: pool, statistics and the batch's page table */
typedef struct {
    ekv_paged_kv kv, dkv;
    ekv_page_stats st, dst;
    ekv_page_table tab, dtab;
    int64_t *indptr;
    int32_t *indices, *lpl;
    int64_t pool_bytes, stat_n, codes_bytes, sp_n; /* sp_n: superpage box values */
} mirror;

static void mirror_build(mirror *m, ekv_cache *cache, const int32_t *seqs, int B, int64_t idx_cap,
                         int reuse) {
    ekv_cache_kv_view(cache, &m->kv, &m->st);
    if (!reuse) {
        m->indptr = malloc(sizeof(int64_t) * (B + 1));
        m->indices = malloc(sizeof(int32_t) * idx_cap);
        m->lpl = malloc(sizeof(int32_t) * B);
    }
    ekv_cache_page_table(cache, seqs, B, m->indptr, m->indices, idx_cap, m->lpl, NULL);
    m->tab = (ekv_page_table){B, m->indptr, m->indices, m->lpl};
    const int64_t es = ekv_dtype_size(m->kv.dtype);
    m->pool_bytes = m->kv.num_pages * m->kv.stride_page * es;
    m->stat_n = m->kv.num_pages * m->kv.num_kv_heads * m->kv.head_dim;
    if (!reuse) {
        m->dkv = m->kv;
        m->dkv.k = dev_copy(NULL, m->pool_bytes);
        m->dkv.v = dev_copy(NULL, m->pool_bytes);
        memset(&m->dst, 0, sizeof m->dst);
        m->dst.kmin = dev_copy(NULL, m->stat_n * 4);
        m->dst.kmax = dev_copy(NULL, m->stat_n * 4);
        m->dst.kmean = dev_copy(NULL, m->stat_n * 4);
        m->dst.km2 = dev_copy(NULL, m->stat_n * 4);
        m->dst.radius = dev_copy(NULL, m->kv.num_pages * m->kv.num_kv_heads * 4);
        m->dst.count = dev_copy(NULL, m->kv.num_pages * 4);
        m->codes_bytes = m->st.codes ? m->kv.num_pages * m->kv.num_kv_heads * m->kv.page_size *
                                               ((m->kv.head_dim * m->st.code_bits + 7) / 8)
                                     : 0;
        m->dst.codes = m->st.codes ? dev_copy(NULL, m->codes_bytes) : NULL;
        m->dst.code_bits = m->st.code_bits;
        m->dst.range_dtype = m->st.range_dtype;
        m->dst.kmin16 = m->st.kmin16 ? dev_copy(NULL, m->stat_n * 2) : NULL;
        m->dst.kmax16 = m->st.kmax16 ? dev_copy(NULL, m->stat_n * 2) : NULL;
        m->dst.kmean16 = m->st.kmean16 ? dev_copy(NULL, m->stat_n * 2) : NULL;
        m->dst.radius16 =
                m->st.radius16 ? dev_copy(NULL, m->kv.num_pages * m->kv.num_kv_heads * 4) : NULL;
        m->sp_n = m->st.smin ? m->st.num_superpages * m->kv.num_kv_heads * m->kv.head_dim : 0;
        m->dst.smin = m->sp_n ? dev_copy(NULL, m->sp_n * 4) : NULL;
        m->dst.smax = m->sp_n ? dev_copy(NULL, m->sp_n * 4) : NULL;
        m->dst.superpage_pages = m->sp_n ? m->st.superpage_pages : 0;
        m->dst.num_superpages = m->sp_n ? m->st.num_superpages : 0;
        m->dst.num_pages = m->st.num_pages; /* the pool the statistics cover */
        m->dst.num_kv_heads = m->st.num_kv_heads;
        m->dst.head_dim = m->st.head_dim;
        m->dst.page_size = m->st.page_size;
        m->dtab.batch = B;
        m->dtab.indptr = dev_copy(NULL, sizeof(int64_t) * (B + 1));
        m->dtab.indices = dev_copy(NULL, sizeof(int32_t) * idx_cap);
        m->dtab.last_page_len = dev_copy(NULL, sizeof(int32_t) * B);
    }
    CU(cudaMemcpy((void *)m->dkv.k, m->kv.k, m->pool_bytes, cudaMemcpyHostToDevice));
    CU(cudaMemcpy((void *)m->dkv.v, m->kv.v, m->pool_bytes, cudaMemcpyHostToDevice));
    CU(cudaMemcpy((void *)m->dst.kmin, m->st.kmin, m->stat_n * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy((void *)m->dst.kmax, m->st.kmax, m->stat_n * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy((void *)m->dst.kmean, m->st.kmean, m->stat_n * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy((void *)m->dst.km2, m->st.km2, m->stat_n * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy((void *)m->dst.radius, m->st.radius, m->kv.num_pages * m->kv.num_kv_heads * 4,
                  cudaMemcpyHostToDevice));
    CU(cudaMemcpy((void *)m->dst.count, m->st.count, m->kv.num_pages * 4, cudaMemcpyHostToDevice));
    if (m->codes_bytes)
        CU(cudaMemcpy((void *)m->dst.codes, m->st.codes, m->codes_bytes, cudaMemcpyHostToDevice));
    if (m->sp_n) {
        CU(cudaMemcpy((void *)m->dst.smin, m->st.smin, m->sp_n * 4, cudaMemcpyHostToDevice));
        CU(cudaMemcpy((void *)m->dst.smax, m->st.smax, m->sp_n * 4, cudaMemcpyHostToDevice));
    }
    if (m->st.kmin16) {
        CU(cudaMemcpy((void *)m->dst.kmin16, m->st.kmin16, m->stat_n * 2, cudaMemcpyHostToDevice));
        CU(cudaMemcpy((void *)m->dst.kmax16, m->st.kmax16, m->stat_n * 2, cudaMemcpyHostToDevice));
        CU(cudaMemcpy((void *)m->dst.kmean16, m->st.kmean16, m->stat_n * 2,
                      cudaMemcpyHostToDevice));
        CU(cudaMemcpy((void *)m->dst.radius16, m->st.radius16,
                      m->kv.num_pages * m->kv.num_kv_heads * 4, cudaMemcpyHostToDevice));
    }
    CU(cudaMemcpy((void *)m->dtab.indptr, m->indptr, sizeof(int64_t) * (B + 1),
                  cudaMemcpyHostToDevice));
    CU(cudaMemcpy((void *)m->dtab.indices, m->indices, sizeof(int32_t) * m->indptr[B],
                  cudaMemcpyHostToDevice));
    CU(cudaMemcpy((void *)m->dtab.last_page_len, m->lpl, sizeof(int32_t) * B,
                  cudaMemcpyHostToDevice));
    CU(cudaDeviceSynchronize()); /* the copies landed (see dev_copy) */
}

static void mirror_free(mirror *m) {
    cudaFree((void *)m->dkv.k);
    cudaFree((void *)m->dkv.v);
    cudaFree((void *)m->dst.kmin);
    cudaFree((void *)m->dst.kmax);
    cudaFree((void *)m->dst.kmean);
    cudaFree((void *)m->dst.km2);
    cudaFree((void *)m->dst.radius);
    cudaFree((void *)m->dst.count);
    cudaFree((void *)m->dst.codes);
    cudaFree((void *)m->dst.smin);
    cudaFree((void *)m->dst.smax);
    cudaFree((void *)m->dst.kmean16);
    cudaFree((void *)m->dst.radius16);
    cudaFree((void *)m->dst.kmin16);
    cudaFree((void *)m->dst.kmax16);
    cudaFree((void *)m->dtab.indptr);
    cudaFree((void *)m->dtab.indices);
    cudaFree((void *)m->dtab.last_page_len);
    free(m->indptr);
    free(m->indices);
    free(m->lpl);
}

#endif
