/*
 * append + summarize on the GPU (mirrors src/cache/append.c and summaries.c): one block per
 * (touched page, KV head) writes the new tokens in the storage dtype, then recomputes that
 * page's key statistics from the stored (rounded) keys, so the summaries describe exactly
 * what the attend kernels will read: min, max, mean (fp64 sums), M2 and the ball radius
 * max_j ||k_j - mean|| around the *stored* fp32 mean, rounded up (docs/math.md §1.2, 9.5). A page
 * holds at most 256 tokens, so recomputing it costs O(page_size * D) per touched page; a
 * prefill build passes every page as an item. With key codes (stats->codes, code_bits 4 or 8)
 * the block also re-derives the codes of the page from the stored keys and the new range,
 * byte for byte the CPU cache's (ekv_codes_update_page, docs/math.md §10.1, §10.4). With compact
 * ranges (stats->range_dtype f16/bf16) it also writes kmin/kmax rounded outward, which the
 * codes then follow (docs/math.md §1.2). With superpage boxes (stats->smin/smax) a second
 * launch rebuilds the box of every touched page's superpage.
 */
#include "../common/launch.cuh"
#include "../common/loads.cuh"
#include "../common/plan.cuh"
#include "../common/ranges.cuh"
#include "../common/reduce.cuh"
#include "../common/sizes.cuh"
#include "../../core/codes.h"
#include "../../core/stats_rules.h"
#include <math_constants.h>
extern "C" {
#include "../../core/method.h" /* ekv_check_stats_shape, ekv_check_superpages: the decode's rules */
}

namespace {

struct append_args {
    ekv_paged_kv kv;
    float *kmin, *kmax, *kmean, *km2, *radius;
    uint16_t *kmin16, *kmax16; /* the compact copies (range_dtype f16/bf16), or NULL */
    uint16_t *kmean16;         /* the compact ball's centre, or NULL (docs/math.md §9.5) */
    float *radius16;           /* and the radius around it */
    int range_dtype;
    int32_t *count;
    uint8_t *codes; /* NULL: the cache keeps no key codes */
    int code_bits;
    const ekv_cuda_append_item *items;
    const float *k_new, *v_new;
    int Hk, D, ps;
};

/* The code block of (page, kvh) from its n stored keys and the range just written (read back
 * after a barrier): byte j * ps + t holds channel j (8 bits) or channels 2j, 2j + 1 (low, high
 * nibble) of slot t, 0 for slots past n, as src/core/codes.h lays it out. */
template <typename T>
__device__ void page_codes(const append_args &A, const T *K, int64_t pbase, int64_t so, int n,
                           int page, int kvh) {
    const int bits = A.code_bits, per_byte = bits == 8 ? 1 : 2;
    const int64_t R = ekv_code_row_bytes(A.D, bits);
    uint8_t *block = A.codes + ((int64_t)page * A.Hk + kvh) * A.ps * R;
    for (int64_t i = threadIdx.x; i < A.ps * R; i += blockDim.x) {
        const int64_t j = i / A.ps;
        const int t = (int)(i % A.ps);
        uint32_t v = 0;
        for (int u = 0; t < n && u < per_byte; u++) {
            const int64_t c = j * per_byte + u;
            const float mn =
                    A.kmin16 ? ekv_range16_f32(A.kmin16[so + c], A.range_dtype) : A.kmin[so + c];
            const float mx =
                    A.kmin16 ? ekv_range16_f32(A.kmax16[so + c], A.range_dtype) : A.kmax[so + c];
            const float step = ekv_code_step(mn, mx, bits);
            const float k = ekv_elem<T>::to(K[pbase + t * A.kv.stride_token + c]);
            v |= ekv_code_of(k, mn, step, bits) << (4 * u);
        }
        block[i] = (uint8_t)v;
    }
}

/* sqrt(s) rounded up to a float: a radius must not shrink. */
__device__ __forceinline__ float radius_up(double s) {
    const double r = sqrt(s) * (1 + 1e-12);
    float rf = (float)r;
    if ((double)rf < r) rf = nextafterf(rf, INFINITY);
    return rf;
}

/* x rounded to the nearest finite f16/bf16 (beyond the range: the largest finite value), as the
 * CPU cache's ekv_round16_nearest_finite: a compact ball's centre. */
__device__ __forceinline__ uint16_t nearest_finite16(float x, int dtype) {
    const uint16_t h = dtype == EKV_DTYPE_F16 ? __half_as_ushort(__float2half_rn(x))
                                             : __bfloat16_as_ushort(__float2bfloat16_rn(x));
    const uint16_t expo = dtype == EKV_DTYPE_F16 ? 0x7c00u : 0x7f80u;
    return (h & expo) != expo ? h : (uint16_t)((h & 0x8000u) | (expo - 1u));
}

/* Items are validated on the host when built there; a bad device item is skipped. */
__device__ __forceinline__ bool item_ok(const ekv_cuda_append_item &it, int64_t num_pages, int ps) {
    return it.page >= 0 && it.page < num_pages && it.first_slot >= 0 && it.n_new >= 0 &&
           it.first_slot + it.n_new <= ps;
}

template <typename T>
__global__ void __launch_bounds__(EKV_CUDA_THREADS) append_kernel(append_args A) {
    ekv_grid_begin();
    __shared__ double scratch[32];
    const ekv_cuda_append_item it = A.items[blockIdx.x];
    const int kvh = blockIdx.y, D = A.D;
    if (!item_ok(it, A.kv.num_pages, A.ps)) return;
    T *K = static_cast<T *>(const_cast<void *>(A.kv.k));
    T *V = static_cast<T *>(const_cast<void *>(A.kv.v));
    const int64_t pbase = (int64_t)it.page * A.kv.stride_page + (int64_t)kvh * A.kv.stride_head;
    for (int64_t i = threadIdx.x; i < (int64_t)it.n_new * D; i += blockDim.x) {
        const int64_t t = i / D, d = i % D;
        const int64_t src = ((it.src_token + t) * A.Hk + kvh) * D + d;
        const int64_t dst = pbase + (it.first_slot + t) * A.kv.stride_token + d;
        K[dst] = ekv_elem<T>::from(A.k_new[src]);
        V[dst] = ekv_elem<T>::from(A.v_new[src]);
    }
    __syncthreads();
    const int n = it.first_slot + it.n_new;
    const int64_t so = ((int64_t)it.page * A.Hk + kvh) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float mn = INFINITY, mx = -INFINITY;
        double s = 0;
        for (int t = 0; t < n; t++) {
            const float x = ekv_elem<T>::to(K[pbase + t * A.kv.stride_token + d]);
            mn = fminf(mn, x);
            mx = fmaxf(mx, x);
            s += x;
        }
        const double mean = n ? s / n : 0.0;
        double m2 = 0;
        for (int t = 0; t < n; t++) {
            const double x = (double)ekv_elem<T>::to(K[pbase + t * A.kv.stride_token + d]) - mean;
            m2 += x * x;
        }
        A.kmin[so + d] = mn;
        A.kmax[so + d] = mx;
        if (A.kmin16) { /* rounded outward, as the CPU cache's ekv_round16_outward */
            A.kmin16[so + d] = A.range_dtype == EKV_DTYPE_F16
                                       ? __half_as_ushort(__float2half_rd(mn))
                                       : __bfloat16_as_ushort(__float2bfloat16_rd(mn));
            A.kmax16[so + d] = A.range_dtype == EKV_DTYPE_F16
                                       ? __half_as_ushort(__float2half_ru(mx))
                                       : __bfloat16_as_ushort(__float2bfloat16_ru(mx));
        }
        A.kmean[so + d] = (float)mean;
        A.km2[so + d] = (float)m2;
        if (A.kmean16) A.kmean16[so + d] = nearest_finite16((float)mean, A.range_dtype);
    }
    __syncthreads();
    /* radius around the stored fp32 mean: one warp per token, max over tokens */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    double best = 0, best16 = 0;
    for (int t = warp; t < n; t += nw) {
        double s = 0, s16 = 0;
        for (int d = lane; d < D; d += 32) {
            const double k = (double)ekv_elem<T>::to(K[pbase + t * A.kv.stride_token + d]),
                         x = k - (double)A.kmean[so + d];
            s += x * x;
            if (A.kmean16) {
                const double y = k - (double)ekv_range16_f32(A.kmean16[so + d], A.range_dtype);
                s16 += y * y;
            }
        }
        s = ekv_warp_sum(s);
        best = s > best ? s : best;
        if (A.kmean16) {
            s16 = ekv_warp_sum(s16);
            best16 = s16 > best16 ? s16 : best16;
        }
    }
    best = ekv_block_max(best, scratch, 0.0);
    if (A.kmean16) best16 = ekv_block_max(best16, scratch, 0.0);
    if (threadIdx.x == 0) {
        A.radius[(int64_t)it.page * A.Hk + kvh] = radius_up(best);
        if (A.kmean16) A.radius16[(int64_t)it.page * A.Hk + kvh] = radius_up(best16);
        if (kvh == 0) A.count[it.page] = n;
    }
    /* the range was written before the barrier above the radius: every thread sees it */
    if (A.codes) page_codes<T>(A, K, pbase, so, n, it.page, kvh);
}

/* The superpage box of each touched page (docs/math.md §9.6): min/max over the live pages
 * (count > 0) of its superpage, rebuilt from their fp32 ranges after the append kernel, as the
 * CPU cache rebuilds it (ekv_summary_rebuild_superpage). Items of one superpage write the same
 * values. */
struct superpage_args {
    const float *kmin, *kmax;
    const int32_t *count;
    float *smin, *smax;
    const ekv_cuda_append_item *items;
    int64_t num_pages;
    int HD, S, ps; /* Hk * D, pages per superpage, page size */
};

__global__ void __launch_bounds__(EKV_CUDA_THREADS) superpage_kernel(superpage_args A) {
    ekv_grid_begin();
    const ekv_cuda_append_item it = A.items[blockIdx.x];
    if (!item_ok(it, A.num_pages, A.ps)) return;
    const int64_t sid = it.page / A.S, p0 = sid * A.S,
                  p1 = p0 + A.S < A.num_pages ? p0 + A.S : A.num_pages;
    for (int i = threadIdx.x; i < A.HD; i += blockDim.x) {
        float mn = CUDART_INF_F, mx = -CUDART_INF_F;
        for (int64_t pg = p0; pg < p1; pg++)
            if (A.count[pg] > 0) {
                mn = fminf(mn, A.kmin[pg * A.HD + i]);
                mx = fmaxf(mx, A.kmax[pg * A.HD + i]);
            }
        A.smin[sid * A.HD + i] = mn;
        A.smax[sid * A.HD + i] = mx;
    }
}

ekv_status launch_superpages(ekv_cuda_plan *pl, const ekv_paged_kv *kv, const ekv_page_stats *st,
                             const ekv_cuda_append_item *items, int32_t n_items) {
    superpage_args S;
    S.kmin = st->kmin;
    S.kmax = st->kmax;
    S.count = st->count;
    S.smin = const_cast<float *>(st->smin);
    S.smax = const_cast<float *>(st->smax);
    S.items = items;
    S.num_pages = kv->num_pages;
    S.HD = kv->num_kv_heads * kv->head_dim;
    S.S = st->superpage_pages;
    S.ps = kv->page_size;
    ekv_launch(ekv_plan_stream(pl), superpage_kernel, n_items, EKV_CUDA_THREADS, 0, S);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "superpage kernel: %s", cudaGetErrorString(e));
    return EKV_OK;
}

} // namespace

extern "C" ekv_status ekv_cuda_append(ekv_cuda_plan *pl, const ekv_paged_kv *kv,
                                      const ekv_page_stats *st, const ekv_cuda_append_item *items,
                                      int32_t n_items, const float *k_new, const float *v_new) {
    if (!pl) return EKV_ERR_NULL_POINTER;
    if (!kv || !st || !items || !k_new || !v_new || !kv->k || !kv->v || !st->kmin || !st->kmax ||
        !st->kmean || !st->km2 || !st->radius || !st->count)
        return ekv_fail(
                pl->ctx, EKV_ERR_NULL_POINTER,
                "ekv_cuda_append: kv, stats (all arrays), items, k_new and v_new must not be NULL");
    if (n_items < 0)
        return ekv_fail(pl->ctx, EKV_ERR_INVALID_SIZE, "ekv_cuda_append: n_items=%d < 0", n_items);
    if (kv->num_kv_heads != pl->p.num_kv_heads || kv->head_dim != pl->p.head_dim ||
        kv->page_size != pl->p.page_size)
        return ekv_fail(
                pl->ctx, EKV_ERR_INVALID_ARGUMENT,
                "ekv_cuda_append: kv shape (heads %d, dim %d, page %d) differs from the plan's (%d, %d, %d)",
                kv->num_kv_heads, kv->head_dim, kv->page_size, pl->p.num_kv_heads, pl->p.head_dim,
                pl->p.page_size);
    ekv_status shape = ekv_check_kv_view(pl->ctx, kv);
    if (!shape) shape = ekv_check_stats_shape(pl->ctx, kv, st);
    if (shape) return shape;
    if (st->codes ? st->code_bits != 4 && st->code_bits != 8 : st->code_bits != 0)
        return ekv_fail(pl->ctx, EKV_ERR_INVALID_ARGUMENT,
                        "ekv_cuda_append: stats->code_bits=%d with codes %s (codes need code_bits "
                        "4 or 8, no codes code_bits 0)",
                        st->code_bits, st->codes ? "set" : "NULL");
    const int compact = st->range_dtype != EKV_DTYPE_F32;
    if (compact && ((st->range_dtype != EKV_DTYPE_F16 && st->range_dtype != EKV_DTYPE_BF16) ||
                    !st->kmin16 || !st->kmax16))
        return ekv_fail(pl->ctx, EKV_ERR_INVALID_ARGUMENT,
                        "ekv_cuda_append: stats->range_dtype=%d needs kmin16/kmax16 (f16 or bf16 "
                        "ranges)",
                        (int)st->range_dtype);
    if (st->smin) { /* the superpage boxes, as the bound stage reads them */
        const ekv_status ss = ekv_check_superpages(pl->ctx, kv, st);
        if (ss) return ss;
    }
    if (n_items == 0) return EKV_OK;
    append_args A;
    A.kv = *kv;
    A.kmin = const_cast<float *>(st->kmin);
    A.kmax = const_cast<float *>(st->kmax);
    A.kmean = const_cast<float *>(st->kmean);
    A.km2 = const_cast<float *>(st->km2);
    A.radius = const_cast<float *>(st->radius);
    A.kmin16 = compact ? const_cast<uint16_t *>(st->kmin16) : NULL;
    A.kmax16 = compact ? const_cast<uint16_t *>(st->kmax16) : NULL;
    A.range_dtype = (int)st->range_dtype;
    const int cball = ekv_compact_ball(st); /* the compact ball (docs/math.md §9.5) */
    A.kmean16 = cball ? const_cast<uint16_t *>(st->kmean16) : NULL;
    A.radius16 = cball ? const_cast<float *>(st->radius16) : NULL;
    A.count = const_cast<int32_t *>(st->count);
    A.codes = const_cast<uint8_t *>(st->codes);
    A.code_bits = st->code_bits;
    A.items = items;
    A.k_new = k_new;
    A.v_new = v_new;
    A.Hk = kv->num_kv_heads;
    A.D = kv->head_dim;
    A.ps = kv->page_size;
    dim3 grid(n_items, A.Hk);
    switch (kv->dtype) {
    case EKV_DTYPE_F16:
        ekv_launch(ekv_plan_stream(pl), append_kernel<__half>, grid, EKV_CUDA_THREADS, 0, A);
        break;
    case EKV_DTYPE_BF16:
        ekv_launch(ekv_plan_stream(pl), append_kernel<__nv_bfloat16>, grid, EKV_CUDA_THREADS, 0, A);
        break;
    case EKV_DTYPE_F32:
        ekv_launch(ekv_plan_stream(pl), append_kernel<float>, grid, EKV_CUDA_THREADS, 0, A);
        break;
    default:
        return ekv_fail(pl->ctx, EKV_ERR_INVALID_DTYPE, "ekv_cuda_append: unknown dtype %d",
                        (int)kv->dtype);
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "append kernel: %s", cudaGetErrorString(e));
    return st->smin && st->superpage_pages > 0 ? launch_superpages(pl, kv, st, items, n_items)
                                               : EKV_OK;
}
