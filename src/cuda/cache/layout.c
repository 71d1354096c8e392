/*
 * The device cache's layout (layout.h; docs/architecture.md, "The device cache"): host
 * arithmetic, compiled in every build, so that ekv_cuda_cache_sizes answers without CUDA too
 * and the CPU tests check the layout. The pool geometry is the host cache's rule
 * (ekv_check_pool_geometry); the head dim the CUDA backend's.
 */
#include "layout.h"
#include "../../core/codes.h"
#include "../../core/internal.h"
#include "../common/sizes.cuh" /* EKV_CUDA_MAX_DIM (an enum: plain C) */
#include <string.h>

ekv_cuda_cache_params ekv_cuda_cache_default_params(void) {
    ekv_cuda_cache_params p;
    memset(&p, 0, sizeof p);
    p.device = 0;
    p.num_pages = 0; /* required */
    p.page_size = 16;
    p.num_kv_heads = 8;
    p.head_dim = 128;
    p.dtype = EKV_DTYPE_F16;
    p.layout = EKV_LAYOUT_HND;
    p.range_dtype = EKV_DTYPE_F32;
    p.compact_ball = 1;
    p.superpage_pages = 0;
    p.code_bits = 0;
    return p;
}

ekv_status ekv_cuda_check_head_dim(ekv_context *ctx, int64_t head_dim) {
    if (head_dim < 8 || head_dim % 8 || head_dim > EKV_CUDA_MAX_DIM)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "head_dim=%lld must be a multiple of 8 in [8, %d] on the CUDA backend",
                        (long long)head_dim, (int)EKV_CUDA_MAX_DIM);
    return EKV_OK;
}

static ekv_status check_params(ekv_context *ctx, const ekv_cuda_cache_params *p) {
    ekv_cache_params g;
    memset(&g, 0, sizeof g);
    g.num_pages = p->num_pages;
    g.page_size = p->page_size;
    g.num_kv_heads = p->num_kv_heads;
    g.head_dim = p->head_dim;
    g.dtype = p->dtype;
    g.superpage_pages = p->superpage_pages;
    g.code_bits = p->code_bits;
    g.range_dtype = p->range_dtype;
    g.layout = p->layout;
    ekv_status st = ekv_check_pool_geometry(ctx, &g);
    if (!st) st = ekv_cuda_check_head_dim(ctx, p->head_dim);
    if (st) return st;
    if (p->compact_ball != 0 && p->compact_ball != 1)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "compact_ball=%d must be 0 or 1",
                        p->compact_ball);
    if (p->device < 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "device=%d must be >= 0", p->device);
    return EKV_OK;
}

/* Places an array of `bytes` bytes at the next aligned offset from *end. */
static int64_t place(int64_t *end, int64_t bytes) {
    const int64_t at = (*end + EKV_CC_ALIGN - 1) / EKV_CC_ALIGN * EKV_CC_ALIGN;
    *end = at + bytes;
    return at;
}

ekv_status ekv_cuda_cache_layout_of(ekv_context *ctx, const ekv_cuda_cache_params *p,
                                    ekv_cuda_cache_layout *out) {
    if (!p || !out) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "params must not be NULL");
    const ekv_status st = check_params(ctx, p);
    if (st) return st;
    ekv_cuda_cache_layout L;
    for (int i = 0; i < EKV_CC_PARTS; i++) L.off[i] = -1;
    const int64_t P = p->num_pages, Hk = p->num_kv_heads, D = p->head_dim, ps = p->page_size;
    const int64_t S = p->superpage_pages;
    L.num_superpages = S > 0 ? (P + S - 1) / S : 0;
    const int compact = p->range_dtype != EKV_DTYPE_F32;
    /* per array: elements, bytes each (none: absent) */
    const int64_t parts[EKV_CC_PARTS][2] = {
            [EKV_CC_KMIN] = {P * Hk * D, 4},
            [EKV_CC_KMAX] = {P * Hk * D, 4},
            [EKV_CC_KMEAN] = {P * Hk * D, 4},
            [EKV_CC_KM2] = {P * Hk * D, 4},
            [EKV_CC_RADIUS] = {P * Hk, 4},
            [EKV_CC_COUNT] = {P, 4},
            [EKV_CC_KMIN16] = {compact ? P * Hk * D : 0, 2},
            [EKV_CC_KMAX16] = {compact ? P * Hk * D : 0, 2},
            [EKV_CC_KMEAN16] = {compact && p->compact_ball ? P * Hk * D : 0, 2},
            [EKV_CC_RADIUS16] = {compact && p->compact_ball ? P * Hk : 0, 4},
            [EKV_CC_SMIN] = {L.num_superpages * Hk * D, 4},
            [EKV_CC_SMAX] = {L.num_superpages * Hk * D, 4},
            [EKV_CC_CODES] = {P * Hk * ps, ekv_code_row_bytes(D, p->code_bits)},
    };
    /* no overflow: the geometry check bounds P <= 2^31, Hk <= 2^12, ps <= 2^8, D <= 2^9, so a
     * pool holds at most 2^62 bytes and the block less */
    L.pool_bytes = P * Hk * ps * D * ekv_dtype_size(p->dtype);
    int64_t end = 0;
    for (int i = 0; i < EKV_CC_PARTS; i++)
        if (parts[i][0] * parts[i][1] > 0) L.off[i] = place(&end, parts[i][0] * parts[i][1]);
    L.stats_bytes = end;
    *out = L;
    return EKV_OK;
}

ekv_status ekv_cuda_cache_sizes(ekv_context *ctx, const ekv_cuda_cache_params *params,
                                int64_t *pool_bytes, int64_t *stats_bytes) {
    ekv_cuda_cache_layout L;
    const ekv_status st = ekv_cuda_cache_layout_of(ctx, params, &L);
    if (st) return st;
    if (pool_bytes) *pool_bytes = L.pool_bytes;
    if (stats_bytes) *stats_bytes = L.stats_bytes;
    ekv_clear_error(ctx);
    return EKV_OK;
}

/* The array `part` of the block, or NULL when the layout has none. */
static void *part(void *stats, const ekv_cuda_cache_layout *L, int i) {
    return L->off[i] < 0 ? NULL : (char *)stats + L->off[i];
}

void ekv_cuda_cache_views(const ekv_cuda_cache_params *p, const ekv_cuda_cache_layout *L, void *k,
                          void *v, void *stats, ekv_paged_kv *kv, ekv_page_stats *st) {
    if (kv) {
        memset(kv, 0, sizeof *kv);
        kv->k = k;
        kv->v = v;
        kv->dtype = p->dtype;
        kv->page_size = p->page_size;
        kv->num_kv_heads = p->num_kv_heads;
        kv->head_dim = p->head_dim;
        kv->num_pages = p->num_pages;
        kv->stride_page = (int64_t)p->num_kv_heads * p->page_size * p->head_dim;
        ekv_layout_strides(p->layout, p->num_kv_heads, p->page_size, p->head_dim, &kv->stride_head,
                           &kv->stride_token);
    }
    if (!st) return;
    memset(st, 0, sizeof *st);
    st->kmin = part(stats, L, EKV_CC_KMIN);
    st->kmax = part(stats, L, EKV_CC_KMAX);
    st->kmean = part(stats, L, EKV_CC_KMEAN);
    st->km2 = part(stats, L, EKV_CC_KM2);
    st->radius = part(stats, L, EKV_CC_RADIUS);
    st->count = part(stats, L, EKV_CC_COUNT);
    st->range_dtype = p->range_dtype;
    st->kmin16 = part(stats, L, EKV_CC_KMIN16);
    st->kmax16 = part(stats, L, EKV_CC_KMAX16);
    st->kmean16 = part(stats, L, EKV_CC_KMEAN16);
    st->radius16 = part(stats, L, EKV_CC_RADIUS16);
    st->smin = part(stats, L, EKV_CC_SMIN);
    st->smax = part(stats, L, EKV_CC_SMAX);
    st->superpage_pages = st->smin ? p->superpage_pages : 0;
    st->num_superpages = st->smin ? L->num_superpages : 0;
    st->codes = part(stats, L, EKV_CC_CODES);
    st->code_bits = st->codes ? p->code_bits : 0;
    st->num_pages = p->num_pages;
    st->num_kv_heads = p->num_kv_heads;
    st->head_dim = p->head_dim;
    st->page_size = p->page_size;
}
